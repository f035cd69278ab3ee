#include "sinew/init.h"

#include <ftw.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "sinew/base/error.h"
#include "sinew/base/parse.h"
#include "sinew/base/private_file.h"
#include "sinew/collectives/etcd_pki.h"
#include "sinew/collectives/etcd_store.h"
#include "sinew/collectives/tcp_store.h"
#include "sinew/config.h"
#include "sinew/runtime/context_state.h"
#include "sinew/runtime/coordinator.h"
#include "sinew/runtime/coordinator_process.h"
#include "sinew/runtime/ha_coordinator.h"
#include "sinew/runtime/job_outcome.h"
#include "sinew/runtime/slurm_bootstrap.h"

#if SINEW_WITH_MPI
#include <mpi.h>
#endif

namespace sinew {
namespace {

// Set by the SIGTERM handler. A signal handler can reach no object, so this one flag is
// process-wide (SIGTERM asks the process to leave); Context::preemptionRequested() reads it
// and the Context's own flag, which requestPreemption() sets.
volatile std::sig_atomic_t gSigtermReceived = 0;

void onSigterm(int) { gSigtermReceived = 1; }

using runtime::controlApiFromEnv;
using runtime::Coordinator;
using runtime::CoordinatorClientOptions;
using runtime::CoordinatorOptions;

using ::sinew::detail::env;

// SINEW_HA=1: the launch starts the job's etcd members and coordinator candidates itself.
bool haRequested() {
  const char* ha = env("SINEW_HA");
  return ha != nullptr && std::string(ha) == "1";
}

// $name=v as an integer in [min, max]; InvalidArgument naming the variable and value.
int64_t parseInt(const char* name, const std::string& v, int64_t min = 0,
                 int64_t max = std::numeric_limits<int32_t>::max()) {
  return ::sinew::detail::parseInt(v, name, min, max);
}

uint64_t parseToken(const std::string& v) { return ::sinew::detail::parseToken(v, "SINEW_TOKEN"); }

// "host:port" -> (host, port).
std::pair<std::string, uint16_t> parseEndpoint(const char* name, const std::string& v) {
  auto colon = v.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    SINEW_THROW(InvalidArgument, name, "='", v, "' is not host:port");
  }
  int64_t port = parseInt((std::string(name) + " port").c_str(), v.substr(colon + 1), 1, 65535);
  return {v.substr(0, colon), static_cast<uint16_t>(port)};
}

std::string hostName() {
  char buf[256] = {0};
  ::gethostname(buf, sizeof(buf) - 1);
  return buf;
}

// The launch rank under mpirun/srun, or -1.
int mpiRank() {
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    if (const char* v = env(name)) return static_cast<int>(parseInt(name, v));
  }
  return -1;
}

#if SINEW_WITH_MPI
int mpiSize() {
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS"}) {
    if (const char* v = env(name)) return static_cast<int>(parseInt(name, v, 1));
  }
  return 1;
}

// ---- SINEW_HA=1 under mpirun/srun (docs/ha.md, "Under mpirun") ------------------------------
//
// 1. Before MPI_Init every rank forks a helper (no MPI, no libtorch threads yet) that waits on
//    a pipe for what to do.
// 2. After MPI_Init, rank 0 takes SINEW_TOKEN or draws the job token, draws the job's id and
//    etcd's root password, makes the launch's certificate authority, and broadcasts them; every
//    rank picks two free ports on its host and all ranks exchange
//    (node, host, ports) with one allgather: the last MPI calls.
// 3. The lowest rank of each of the first three nodes (fewer if the job has fewer) hosts an
//    etcd member and a coordinator candidate: its helper starts etcd (a new directory on local
//    disk, under SINEW_ETCD_DIR or /tmp, with the member's certificate; TLS to clients and
//    peers) and then runs the candidate until the job ends; the other helpers exit at once.
// 4. Every worker then runs as with SINEW_ETCD (the members' client endpoints) and
//    SINEW_JOB (mpi-<a 40-bit id rank 0 draws with the token>).
// A node's loss takes its worker, candidate and etcd member: the job keeps its leader and its
// state while two of the three nodes live.

struct HaPeer {
  char node[200];
  char host[48];
  uint16_t client;
  uint16_t peer;
};

// A port no other socket of this machine has: bound here and held until the destructor.
// Every rank holds its two ports until the address exchange has completed everywhere, so no
// two of them (nor two ranks on one host) can be handed the same one; closing and re-binding
// each at once let two nodes' etcd members be given the same client port, and the third
// member then had no majority when one node died (HaMpirunTest.EveryProcessOfNodeZeroKilled,
// seen once under ASan).
class HeldPort {
 public:
  explicit HeldPort(const std::string& host) : fd_(::socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    socklen_t len = sizeof(a);
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      const int err = errno;
      if (fd_ >= 0) ::close(fd_);
      SINEW_THROW(IoError, "no free port on ", host, ": ", std::strerror(err));
    }
    port_ = ntohs(a.sin_port);
  }
  ~HeldPort() { ::close(fd_); }
  HeldPort(const HeldPort&) = delete;
  HeldPort& operator=(const HeldPort&) = delete;
  uint16_t port() const { return port_; }

 private:
  int fd_;
  uint16_t port_ = 0;
};

// The first member's helper turns on the job's etcd authentication as soon as the cluster
// answers (within 60 s): until then, every client of the job (they all have the password)
// works without a token; after, etcd refuses anyone without the password. An etcd that has a
// root user already was set up by someone else: the helper refuses it (throws IoError).
void enableJobEtcdAuth(collectives::EtcdOptions o) {
  o.timeout = std::chrono::milliseconds(2000);
  collectives::EtcdClient etcd(o);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (true) {
    try {
      etcd.enableAuth(o.password);
      return;
    } catch (const Timeout&) {
      // The members are still forming their cluster.
      if (std::chrono::steady_clock::now() > deadline) throw;
    }
  }
}

// The helper: reads one JSON line of instructions; {"run": false} ends it, else it starts etcd
// and runs a coordinator candidate until the job ends, then stops etcd.
[[noreturn]] void haHelperMain(int fd, const InitOptions& o) {
  std::string line;
  char c;
  while (::read(fd, &c, 1) == 1 && c != '\n') line.push_back(c);
  ::close(fd);
  nlohmann::json in = nlohmann::json::parse(line, nullptr, false);
  if (!in.is_object() || !in.value("run", false)) _exit(0);
  int rc = 1;
  pid_t etcdPid = -1;
  const std::string dataDir = in.at("data_dir").get<std::string>();
  try {
    std::vector<std::string> args = in.at("etcd_args").get<std::vector<std::string>>();
    const char* logDir = env("SINEW_LOG_DIR");
    const std::string log =
        logDir ? std::string(logDir) + "/etcd-" + in.at("name").get<std::string>() + ".log"
               : "/dev/null";
    etcdPid = ::fork();
    if (etcdPid == 0) {
      FILE* f = std::fopen(log.c_str(), "a");
      if (f) {
        ::dup2(fileno(f), 1);
        ::dup2(fileno(f), 2);
      }
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execvp(argv[0], argv.data());
      std::fprintf(stderr, "sinew: cannot run %s: %s\n", argv[0], std::strerror(errno));
      _exit(127);
    }
    if (const char* dir = env("SINEW_LOG_DIR")) {
      std::ofstream f(std::string(dir) + "/ha-" + in.at("name").get<std::string>() + ".json");
      f << nlohmann::json{{"helper_pid", ::getpid()},
                          {"etcd_pid", etcdPid},
                          {"data_dir", dataDir},
                          {"etcd", in.at("endpoints")},
                          {"job", in.at("job")}}
               .dump()
        << "\n";
    }
    runtime::HaCoordinatorOptions h;
    h.etcd.endpoints = collectives::parseEtcdEndpoints(in.at("endpoints").get<std::string>(),
                                                       "the job's etcd members");
    // The job's etcd requires its root password, drawn per job, and speaks TLS with the job's
    // own certificates (docs/ha.md, "Security").
    h.etcd.user = "root";
    h.etcd.password = in.at("etcd_password").get<std::string>();
    h.etcd.caFile = in.at("etcd_ca").get<std::string>();
    if (in.value("enable_auth", false)) enableJobEtcdAuth(h.etcd);
    h.job = in.at("job").get<std::string>();
    h.name = in.at("name").get<std::string>();
    h.coordinator.host = in.at("host").get<std::string>();
    h.coordinator.token = in.at("token").get<uint64_t>();
    h.coordinator.expectedWorkers = in.at("workers").get<int>();
    h.coordinator.heartbeatInterval = o.heartbeatInterval;
    h.coordinator.deadAfter = o.deadAfter;
    h.coordinator.progressFloor = o.stepDeadlineFloor;
    h.coordinator.progressFactor = o.stepDeadlineFactor;
    controlApiFromEnv(h.coordinator);  // The control API moves with the leader (docs/ha.md).
    if (const char* dir = env("SINEW_LOG_DIR")) {
      h.outcomePath = std::string(dir) + "/" + runtime::kOutcomeFile;  // Whoever leads at the end.
    }
    if (const char* ttl = env("SINEW_HA_LEASE_TTL_S")) {
      h.leaseTtlSeconds = parseInt("SINEW_HA_LEASE_TTL_S", ttl, 1, 3600);
    }
    rc = runtime::runHaCoordinator(h);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sinew HA helper: %s\n", e.what());
  }
  if (etcdPid > 0) {
    // Other candidates may still be reading the job's end: give them a moment.
    std::this_thread::sleep_for(std::chrono::seconds(2));
    ::kill(etcdPid, SIGTERM);
    for (int i = 0; i < 50 && ::waitpid(etcdPid, nullptr, WNOHANG) != etcdPid; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ::kill(etcdPid, SIGKILL);
    ::waitpid(etcdPid, nullptr, 0);
    ::nftw(
        dataDir.c_str(),
        [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
        FTW_DEPTH | FTW_PHYS);
  }
  std::fflush(nullptr);
  _exit(rc);
}

// Forks the helper (before MPI_Init); returns its pid and the pipe to instruct it.
std::pair<pid_t, int> forkHaHelper(const InitOptions& o) {
  int fds[2];
  if (::pipe(fds) != 0) SINEW_THROW(IoError, "pipe: ", std::strerror(errno));
  pid_t pid = ::fork();
  if (pid < 0) SINEW_THROW(IoError, "fork: ", std::strerror(errno));
  if (pid == 0) {
    ::close(fds[1]);
    ::signal(SIGINT, SIG_IGN);
    ::signal(SIGTERM, SIG_DFL);
    haHelperMain(fds[0], o);
  }
  ::close(fds[0]);
  return {pid, fds[1]};
}

// Rank 0 makes the launch's certificate authority (collectives/etcd_pki.h) and broadcasts
// it, certificate and key; every rank returns it.
collectives::PemCertificate broadcastCertificateAuthority(int rank) {
  std::array<char, 8192> buf{};
  if (rank == 0) {
    const collectives::PemCertificate ca =
        collectives::makeCertificateAuthority("sinew etcd of one launch");
    if (ca.cert.size() + ca.key.size() + 2 > buf.size()) {
      SINEW_THROW(IoError, "the launch's certificate authority does not fit ", buf.size(),
                  " bytes");
    }
    std::memcpy(buf.data(), ca.cert.data(), ca.cert.size());
    std::memcpy(buf.data() + ca.cert.size() + 1, ca.key.data(), ca.key.size());
  }
  MPI_Bcast(buf.data(), static_cast<int>(buf.size()), MPI_CHAR, 0, MPI_COMM_WORLD);
  collectives::PemCertificate ca;
  ca.cert = std::string(buf.data());
  ca.key = std::string(buf.data() + ca.cert.size() + 1);
  return ca;
}

// What the helper of a rank that hosts an etcd member does: a new directory for the member
// (its data, and its TLS files, mode 0600: the launch's authority and a certificate issued
// for this host, for clients and peers alike), the etcd command line, and the candidate's
// settings. `first`: this member's helper turns etcd's authentication on.
nlohmann::json memberInstructions(int rank, bool first, int size, const std::string& host,
                                  const HaPeer& mine, const std::string& job,
                                  const std::string& cluster, const std::string& endpoints,
                                  uint64_t token, const std::string& password,
                                  const collectives::PemCertificate& ca) {
  const char* base = env("SINEW_ETCD_DIR");
  const std::string name = "m" + std::to_string(rank);
  // A new directory for each launch: a member killed with its node leaves its directory
  // behind, and a later job with the same token (so the same name) must not start from it.
  std::string pattern =
      std::string(base ? base : "/tmp") + "/sinew-etcd-" + job + "-" + name + "-XXXXXX";
  if (::mkdtemp(pattern.data()) == nullptr) {
    SINEW_THROW(IoError, "cannot create the etcd member's data directory ", pattern, ": ",
                std::strerror(errno));
  }
  const std::string dir = pattern;
  const collectives::PemCertificate member = collectives::issueCertificate(ca, host);
  ::sinew::detail::writePrivateFile(dir + "/ca.pem", ca.cert);
  ::sinew::detail::writePrivateFile(dir + "/member.pem", member.cert);
  ::sinew::detail::writePrivateFile(dir + "/member.key", member.key);
  const std::string clientUrl = "https://" + host + ":" + std::to_string(mine.client);
  const std::string peerUrl = "https://" + host + ":" + std::to_string(mine.peer);
  return {{"run", true},
          {"etcd_password", password},
          {"etcd_ca", dir + "/ca.pem"},
          {"enable_auth", first},
          {"name", name},
          {"job", job},
          {"token", token},
          {"host", host},
          {"workers", size},
          {"endpoints", endpoints},
          {"data_dir", dir},
          {"etcd_args",
           {"etcd",
            "--name=" + name,
            "--data-dir=" + dir + "/data",
            "--listen-client-urls=" + clientUrl,
            "--advertise-client-urls=" + clientUrl,
            "--listen-peer-urls=" + peerUrl,
            "--initial-advertise-peer-urls=" + peerUrl,
            "--initial-cluster=" + cluster,
            "--initial-cluster-state=new",
            "--initial-cluster-token=" + job,
            "--cert-file=" + dir + "/member.pem",
            "--key-file=" + dir + "/member.key",
            "--peer-cert-file=" + dir + "/member.pem",
            "--peer-key-file=" + dir + "/member.key",
            "--peer-trusted-ca-file=" + dir + "/ca.pem",
            "--peer-client-cert-auth",
            "--heartbeat-interval=50",
            "--election-timeout=500",
            "--logger=zap",
            "--log-level=error"}}};
}

// Steps 2-4 above, after MPI_Init. Returns the etcd endpoints and the job name, and tells the
// helper what to do.
std::pair<std::string, std::string> haBootstrap(int rank, int size, const std::string& node,
                                                const std::string& host, int helperFd,
                                                uint64_t* token, std::string* etcdPassword,
                                                collectives::PemCertificate* ca) {
  // {token, job id}. SINEW_TOKEN, when given, is the job's token (a scheduler that set it can
  // then use the control API, which takes the token as its bearer token); otherwise rank 0
  // draws one. The job id, which names the job in etcd, is drawn apart from the token: the
  // name is no secret (it is in etcd's keys, logs and files), the token is.
  // drawn[2..3]: the password of etcd's root user, a secret of this launch alone.
  unsigned long long drawn[4] = {0, 0, 0, 0};
  if (rank == 0) {
    std::random_device rd;
    auto draw = [&rd] { return (static_cast<unsigned long long>(rd()) << 32) ^ rd(); };
    const char* given = env("SINEW_TOKEN");
    drawn[0] = given ? parseToken(given) : (draw() | 1);
    drawn[1] = draw() & 0xffffffffffULL;
    drawn[2] = draw();
    drawn[3] = draw();
  }
  MPI_Bcast(drawn, 4, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
  const unsigned long long t = drawn[0];
  *token = t;
  char password[40];
  std::snprintf(password, sizeof(password), "%016llx%016llx", drawn[2], drawn[3]);
  *etcdPassword = password;
  *ca = broadcastCertificateAuthority(rank);
  HaPeer mine{};
  std::snprintf(mine.node, sizeof(mine.node), "%s", node.c_str());
  std::snprintf(mine.host, sizeof(mine.host), "%s", host.c_str());
  std::vector<HaPeer> all(size);
  {
    // Held by every rank at once: bound before its Allgather, released after it.
    HeldPort client(host), peer(host);
    mine.client = client.port();
    mine.peer = peer.port();
    MPI_Allgather(&mine, sizeof(HaPeer), MPI_BYTE, all.data(), sizeof(HaPeer), MPI_BYTE,
                  MPI_COMM_WORLD);  // The last MPI call.
  }
  std::vector<int> hosts;  // the lowest rank of each of the first three nodes
  std::vector<std::string> seen;
  for (int r = 0; r < size && hosts.size() < 3; ++r) {
    if (std::find(seen.begin(), seen.end(), all[r].node) != seen.end()) continue;
    seen.push_back(all[r].node);
    hosts.push_back(r);
  }
  char jobHex[32];
  std::snprintf(jobHex, sizeof(jobHex), "mpi-%llx", drawn[1]);
  const std::string job = jobHex;
  std::string endpoints, cluster;
  for (int r : hosts) {
    const std::string h = all[r].host;
    endpoints += (endpoints.empty() ? "" : ",") + std::string("https://") + h + ":" +
                 std::to_string(all[r].client);
    cluster += (cluster.empty() ? "" : ",") + std::string("m") + std::to_string(r) + "=https://" +
               h + ":" + std::to_string(all[r].peer);
  }
  nlohmann::json out = {{"run", false}};
  if (std::find(hosts.begin(), hosts.end(), rank) != hosts.end()) {
    out = memberInstructions(rank, rank == hosts.front(), size, host, all[rank], job, cluster,
                             endpoints, t, *etcdPassword, *ca);
  }
  const std::string line = out.dump() + "\n";
  if (::write(helperFd, line.data(), line.size()) < 0) {
    SINEW_THROW(IoError, "cannot instruct the HA helper: ", std::strerror(errno));
  }
  ::close(helperFd);
  return {endpoints, job};
}
#endif

#if SINEW_WITH_MPI
// Under mpirun (or srun --mpi=...): rank 0 forks the coordinator before MPI_Init and
// broadcasts its endpoint, the only MPI call after MPI_Init.
void joinMpi(int* argc, char*** argv, const InitOptions& options, runtime::ContextState* ctx,
             CoordinatorClientOptions& co) {
  int rank = mpiRank();
  std::string announced;
  if (rank == 0) {
    ctx->coordinatorProcess = runtime::forkCoordinator(mpiSize(), options);
    announced = ctx->coordinatorProcess.announced;
  }
  int provided = 0;
  MPI_Init_thread(argc, argv, MPI_THREAD_SINGLE, &provided);
  ctx->mpi = true;
  char buf[256] = {0};
  if (rank == 0) {
    const char* h = env("SINEW_COORDINATOR_HOST");
    std::snprintf(buf, sizeof(buf), "%s %s", h ? h : "127.0.0.1", announced.c_str());
  }
  MPI_Bcast(buf, sizeof(buf), MPI_CHAR, 0, MPI_COMM_WORLD);  // The last MPI call.
  char host[200] = {0};
  unsigned port = 0;
  unsigned long long token = 0;
  if (std::sscanf(buf, "%199s %u %llu", host, &port, &token) != 3) {
    SINEW_THROW(IoError, "bad coordinator endpoint from rank 0: '", buf, "'");
  }
  co.host = host;
  co.port = static_cast<uint16_t>(port);
  co.token = token;
  co.worker = rank;
  ctx->mode = "mpi";
}

// SINEW_HA=1 under mpirun (docs/ha.md): the ranks start the job's etcd members and coordinator
// candidates; returns the etcd client the worker uses, and the job's name in *job.
std::shared_ptr<collectives::EtcdClient> joinMpiHa(int* argc, char*** argv,
                                                   const InitOptions& options,
                                                   runtime::ContextState* ctx,
                                                   CoordinatorClientOptions& co, std::string* job) {
  const int rank = mpiRank();
  auto [helperPid, helperFd] = forkHaHelper(options);
  ctx->haHelper = helperPid;
  int provided = 0;
  MPI_Init_thread(argc, argv, MPI_THREAD_SINGLE, &provided);
  ctx->mpi = true;
  uint64_t token = 0;
  std::string password;
  collectives::PemCertificate ca;
  auto [endpoints, jobName] =
      haBootstrap(rank, mpiSize(), ctx->node, ctx->host, helperFd, &token, &password, &ca);
  collectives::EtcdOptions eo;
  eo.endpoints = collectives::parseEtcdEndpoints(endpoints, "the job's etcd members");
  eo.user = "root";
  eo.password = password;
  // The client reads the authority's certificate when it is made; the file goes right after.
  const char* base = env("SINEW_ETCD_DIR");
  std::string caDir = std::string(base ? base : "/tmp") + "/sinew-etcd-ca-XXXXXX";
  if (::mkdtemp(caDir.data()) == nullptr) {
    SINEW_THROW(IoError, "cannot create ", caDir, ": ", std::strerror(errno));
  }
  eo.caFile = caDir + "/ca.pem";
  ::sinew::detail::writePrivateFile(eo.caFile, ca.cert);
  std::shared_ptr<collectives::EtcdClient> etcd;
  try {
    etcd = std::make_shared<collectives::EtcdClient>(eo);
  } catch (...) {
    ::unlink(eo.caFile.c_str());
    ::rmdir(caDir.c_str());
    throw;
  }
  ::unlink(eo.caFile.c_str());
  ::rmdir(caDir.c_str());
  *job = jobName;
  co.token = token;
  co.awaitLeader = runtime::etcdLeaderFinder(etcd, *job, token);
  co.worker = rank;
  ctx->mode = "mpi-ha";
  if (const char* dir = env("SINEW_LOG_DIR")) {
    // Which processes are this node's, for tests and operators (docs/ha.md).
    // The etcd password and the authority's certificate go to files only this user can read,
    // named in the record.
    const std::string passwordFile = std::string(dir) + "/etcd-password-" + std::to_string(rank);
    ::sinew::detail::writePrivateFile(passwordFile, password + "\n");
    const std::string caFile = std::string(dir) + "/etcd-ca-" + std::to_string(rank) + ".pem";
    ::sinew::detail::writePrivateFile(caFile, ca.cert);
    std::ofstream f(std::string(dir) + "/ha-rank-" + std::to_string(rank) + ".json");
    f << nlohmann::json{{"rank", rank},
                        {"node", ctx->node},
                        {"pid", ::getpid()},
                        {"helper_pid", helperPid},
                        {"etcd", endpoints},
                        {"etcd_user", "root"},
                        {"etcd_password_file", passwordFile},
                        {"etcd_ca_file", caFile},
                        {"job", *job}}
             .dump()
      << "\n";
  }
  return etcd;
}
#endif

// Under srun without MPI (runtime/slurm_bootstrap.h): rank 0 starts the coordinator where
// the others will look for it; every task then connects to it like a worker of sinew-run.
void joinSlurmStep(const runtime::SlurmStep& step, const InitOptions& options,
                   runtime::ContextState* ctx, CoordinatorClientOptions& co) {
  const runtime::SlurmRendezvous rv = runtime::slurmRendezvous(step);
  runtime::RendezvousRecord where{rv.host, rv.port, rv.token};
  if (step.rank == 0) {
    if (where.host.empty()) {
      where.host = rv.token != 0 ? runtime::addressOf(step.nodes.front()) : runtime::ownAddress();
    }
    std::string announced;  // "port token": the token SINEW_TOKEN's, or one it drew
    try {
      ctx->coordinatorProcess =
          runtime::forkCoordinator(step.size, options, where.host, where.port, where.token);
      announced = ctx->coordinatorProcess.announced;
    } catch (const IoError& e) {
      SINEW_THROW(IoError, "rank 0 of srun step ", step.jobId, ".", step.stepId,
                  " could not start the coordinator on ", where.host, ":", where.port, " (",
                  rv.portFrom, "): ", e.what(), "; set SINEW_COORDINATOR_PORT to a free port");
    }
    unsigned port = 0;
    unsigned long long token = 0;
    if (std::sscanf(announced.c_str(), "%u %llu", &port, &token) != 2) {
      SINEW_THROW(IoError, "bad coordinator endpoint from its process: '", announced, "'");
    }
    where.port = static_cast<uint16_t>(port);
    where.token = token;
    if (rv.token == 0) {
      runtime::writeRendezvousFile(rv.file, where);
      ctx->rendezvousFile = rv.file;
    }
  } else if (rv.token == 0) {
    where = runtime::readRendezvousFile(rv.file, options.connectTimeout);
  } else if (where.host.empty()) {
    where.host = step.nodes.front();
  }
  co.host = where.host;
  co.port = where.port;
  co.token = where.token;
  co.worker = step.rank;
  ctx->mode = "srun";
}

}  // namespace

void Context::requestPreemption() { state_->preemptionRequested = true; }

bool Context::preemptionRequested() const {
  return state_->preemptionRequested || gSigtermReceived != 0;
}

Context::Context() : state_(std::make_unique<runtime::ContextState>()) {}

int Context::worker() const { return state_->client->worker(); }
const std::string& Context::node() const { return state_->node; }
const std::string& Context::host() const { return state_->host; }
const std::string& Context::launchMode() const { return state_->mode; }
bool Context::joined() const { return state_->joined; }
const std::shared_ptr<collectives::Store>& Context::store() const { return state_->store; }

namespace {

// Context::finishJob(); from the destructor (`explicitCall` false) a job of one worker is not
// waited for and says nothing: only a launch's host of the coordinator process does.
int endJob(runtime::ContextState& st, bool explicitCall) {
  if (st.exitStatus) return *st.exitStatus;
  using Standing = runtime::CoordinatorClient::Standing;
  const Standing standing = st.client ? st.client->standing() : Standing::kExpelled;
  // This worker leaves: its connection closes (the client object stays for a Trainer that
  // outlives this call).
  if (st.client) st.client->close();
  int status = 1;
  nlohmann::json outcome;
  if (st.coordinatorProcess.pid > 0 && !st.client) {
    // init() failed after it forked the coordinator: nobody will use it (it ignores SIGTERM).
    ::kill(st.coordinatorProcess.pid, SIGKILL);  // Our own child, by PID.
  }
  if (st.coordinatorProcess.pid > 0) {
    outcome = runtime::awaitOutcome(st.coordinatorProcess);
  } else if (st.localCoordinator && explicitCall) {
    // A job of one worker: its coordinator is in this process and hears the connection close.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (st.localCoordinator->status().connected > 0 &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    outcome = st.localCoordinator->outcome();
  }
  if (outcome.is_object()) {
    status = runtime::outcomeExitStatus(outcome);
    std::fflush(stderr);
    std::printf("%s\n", runtime::outcomeLine(outcome).c_str());
    std::fflush(stdout);
  } else {
    status = standing == Standing::kDone || standing == Standing::kReleased ? 0
             : standing == Standing::kJobStopped                            ? 75
             : standing == Standing::kExpelled                              ? 3
                                                                            : 1;
  }
  st.exitStatus = status;
  return status;
}

}  // namespace

int Context::finishJob() { return endJob(*state_, true); }

Context::~Context() {
  try {
    endJob(*state_, false);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sinew: ending the job's part of this worker failed: %s\n", e.what());
  }
  state_->client.reset();
  if (!state_->rendezvousFile.empty()) ::unlink(state_->rendezvousFile.c_str());
  state_->localCoordinator.reset();
  if (state_->haHelper > 0) {
    // SINEW_HA=1: the helper's candidate ends once the job has (it reads so in etcd); the
    // others' candidates may still need this node's etcd member meanwhile.
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (::waitpid(state_->haHelper, nullptr, WNOHANG) != state_->haHelper) {
      if (std::chrono::steady_clock::now() > until) {
        ::kill(state_->haHelper, SIGTERM);
        ::waitpid(state_->haHelper, nullptr, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
#if SINEW_WITH_MPI
  if (state_->mpi) {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && !state_->memberLost) MPI_Finalize();
  }
#endif
}

std::unique_ptr<Context> init(int* argc, char*** argv, const InitOptions& options) {
  std::unique_ptr<Context> handle(new Context());
  runtime::ContextState* ctx = handle->state_.get();
  ctx->injector = runtime::FailureInjector::fromEnvironment();
  if (options.preemptOnSigterm) {
    struct sigaction sa {};
    sa.sa_handler = onSigterm;
    ::sigemptyset(&sa.sa_mask);
    ::sigaction(SIGTERM, &sa, nullptr);
    // A scheduler's advance warning (Slurm's --signal=USR1@120) drains this worker too.
    if (const char* name = env("SINEW_DRAIN_SIGNAL")) {
      ::sigaction(runtime::signalNumber("SINEW_DRAIN_SIGNAL", name), &sa, nullptr);
    }
  }
  if (const char* h = env("SINEW_HOST")) ctx->host = h;
  const char* node = env("SINEW_NODE");
  // Under srun, the node Slurm runs the task on (several slurmd may share a host).
  const char* slurmNode = env("SLURM_STEP_ID") ? env("SLURMD_NODENAME") : nullptr;
  ctx->node = node ? node : slurmNode ? slurmNode : hostName();
  // "{rank}" in SINEW_NODE becomes the launch rank: one failure domain per worker on one
  // machine under mpirun (-x SINEW_NODE=node{rank}), for tests and demos.
  auto brace = ctx->node.find("{rank}");
  if (brace != std::string::npos) {
    int rank = mpiRank();
    if (const char* id = env("SINEW_WORKER_ID"))
      rank = static_cast<int>(parseInt("SINEW_WORKER_ID", id, -1));
    ctx->node.replace(brace, 6,
                      rank >= 0 ? std::to_string(rank) : "joiner-" + std::to_string(::getpid()));
  }

  CoordinatorClientOptions co;
  co.node = ctx->node;
  co.connectTimeout = options.connectTimeout;
  std::shared_ptr<collectives::EtcdClient> etcd;
  std::string job;
  if (const char* list = env("SINEW_ETCD")) {
    // High availability (docs/ha.md): the leader, the job's state and the store are in etcd;
    // coordinators run elsewhere (sinew-coordinator), so neither mode below starts one.
    // Credentials and TLS: SINEW_ETCD_USER, SINEW_ETCD_PASSWORD(_FILE), SINEW_ETCD_CA, ...
    etcd = std::make_shared<collectives::EtcdClient>(collectives::etcdOptionsFromEnvironment(list));
    const char* token = env("SINEW_TOKEN");
    if (!token) SINEW_THROW(InvalidArgument, "SINEW_ETCD is set but SINEW_TOKEN is not");
    co.token = parseToken(token);
    const char* jobName = env("SINEW_JOB");
    if (!jobName) SINEW_THROW(InvalidArgument, "SINEW_ETCD is set but SINEW_JOB is not");
    job = jobName;
    co.awaitLeader = runtime::etcdLeaderFinder(etcd, job, co.token);
    int rank = mpiRank();
    if (const char* id = env("SINEW_WORKER_ID")) {
      rank = static_cast<int>(parseInt("SINEW_WORKER_ID", id, -1));
    }
    co.worker = rank;
    ctx->joined = rank < 0;
    ctx->mode = "etcd";
  } else if (const char* ep = env("SINEW_COORDINATOR")) {
    std::tie(co.host, co.port) = parseEndpoint("SINEW_COORDINATOR", ep);
    const char* token = env("SINEW_TOKEN");
    if (!token) SINEW_THROW(InvalidArgument, "SINEW_COORDINATOR is set but SINEW_TOKEN is not");
    co.token = parseToken(token);
    const char* id = env("SINEW_WORKER_ID");
    co.worker = id ? static_cast<int>(parseInt("SINEW_WORKER_ID", id, -1)) : -1;
    ctx->joined = co.worker < 0;
    ctx->mode = ctx->joined ? "join" : "sinew-run";
  } else if (std::optional<runtime::SlurmStep> step = runtime::slurmStepFromEnvironment()) {
    if (haRequested()) {
      SINEW_THROW(InvalidArgument,
                  "SINEW_HA=1 needs MPI to start its etcd members: under srun, run with "
                  "--mpi=pmix, or give the job's etcd with SINEW_ETCD (docs/ha.md)");
    }
    joinSlurmStep(*step, options, ctx, co);
  } else if (mpiRank() >= 0 && haRequested()) {
#if SINEW_WITH_MPI
    etcd = joinMpiHa(argc, argv, options, ctx, co, &job);
#else
    SINEW_THROW(InvalidArgument,
                "SINEW_HA=1 under mpirun/srun, but this Sinew was built without MPI");
#endif
  } else if (mpiRank() >= 0) {
#if SINEW_WITH_MPI
    joinMpi(argc, argv, options, ctx, co);
#else
    SINEW_THROW(InvalidArgument,
                "launched under mpirun/srun, but this Sinew was built without MPI; use sinew-run");
#endif
  } else {
    CoordinatorOptions c;
    c.heartbeatInterval = options.heartbeatInterval;
    c.deadAfter = options.deadAfter;
    c.progressFloor = options.stepDeadlineFloor;
    c.progressFactor = options.stepDeadlineFactor;
    ctx->localCoordinator = std::make_unique<Coordinator>(c);
    co.host = c.host;
    co.port = ctx->localCoordinator->port();
    co.token = ctx->localCoordinator->token();
    co.worker = 0;
    ctx->mode = "single";
  }
  ctx->client = std::make_unique<runtime::CoordinatorClient>(co);
  ctx->token = co.token;
  if (etcd) {
    ctx->store = std::make_shared<collectives::EtcdStore>(etcd, runtime::haPrefix(job) + "store/");
    return handle;
  }
  collectives::TcpStoreOptions so;
  so.token = co.token;  // The coordinator serves the store under the job's token.
  so.connectTimeout = options.connectTimeout;
  ctx->store = std::make_shared<collectives::TcpStore>(ctx->client->storeHost(),
                                                       ctx->client->storePort(), so);
  return handle;
}

}  // namespace sinew
