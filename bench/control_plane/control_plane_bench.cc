// sinew-bench-control-plane: the coordinator's control plane at thousands of workers (issue
// 41; runs in bench/RESULTS.md). Simulated workers, no libtorch: each is a real CoordinatorClient
// (its own connection, heartbeats at the real interval of 100 ms) in this process,
// against a real Coordinator in a process of its own (this binary run again with --serve), so
// that the coordinator's CPU time and resident memory are its own. For each size N it
// measures:
//   - start: from the first connection to every worker holding the first epoch (N hellos,
//     N readies, one epoch to N workers);
//   - vote round trip: every worker votes the next step at once; as the issue defines it, the
//     last vote in to the last commit out, at the coordinator (its /metrics'
//     sinew_commit_seconds, read after each step), and end to end, the last vote out to the
//     last commit in at the workers (with the coordinator's backlog of votes and the harness's
//     reading of the commits); medians of --steps steps, while every worker heartbeats;
//   - epoch change: a worker is killed (SIGKILL of a process of its own holding that one
//     worker; then of one holding a whole node of 8, which fail together), and a worker falls
//     silent (heartbeats muted: dead after the 1 s timeout): from the death to every survivor
//     holding the next epoch;
//   - the coordinator's CPU share while N workers only heartbeat, and its resident memory
//     per worker (after the first epoch, less the coordinator's own before any worker);
//   - the control API's /v1/status and /metrics at that size (time and bytes).
// The smallest size is the baseline: each figure is also given as its growth from it.
//
// The simulated workers share --io-threads io threads (8 by default; ClientIoThreads: each
// client on one of them) and vote from --voter-threads threads (8; each casts the votes of its
// share of the workers, then awaits their verdicts: castVote and awaitVerdict), so that the
// harness has a few dozen threads, not two per worker. --io-threads 0 gives every client an io
// thread of its own, as in a worker process, and --voter-threads 0 a voter thread per worker:
// at 4,096 workers that is 8,192 threads, whose wake-ups take this 2-core machine's CPU (the
// figures then measure the harness, not the coordinator). These threads run at nice
// --worker-nice (10 by default), the coordinator's process and this process's measuring thread
// at the nice they were started with: on a cluster each worker has its own host. --worker-nice
// 0 measures them side by side.
//
// --ha runs the coordinator as in high-availability mode (docs/ha.md): a one-member etcd on
// loopback (data on tmpfs), the coordinator a leader candidate (runHaCoordinator: it wins the
// election, publishes its address under a lease, stores every epoch and commit in etcd before
// sending it), and every worker finds it through etcd (etcdLeaderFinder; the workers of this
// process share one etcd client, each client process has its own) and watches for a new
// leader, as real workers do.
//
//   sinew-bench-control-plane [--sizes 256,1024,4096] [--steps 10] [--worker-nice 10] [--ha]
//                             [--io-threads 8] [--voter-threads 8] [--check]
//
// --check makes it a test: it exits 1 unless every phase completed (every survivor saw each
// epoch, every vote committed) within its bound. The last line is
//   RESULT epoch_change_s_<N>=<s> vote_rtt_ms_<N>=<ms> coord_kib_per_worker=<k>
//   vote_e2e_ms_<N>=<ms>
// for the largest N.

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "etcd_support.h"
#include "sinew/base/open_files.h"
#include "sinew/collectives/etcd_client.h"
#include "sinew/runtime/coordinator.h"
#include "sinew/runtime/coordinator_client.h"
#include "sinew/runtime/ha_coordinator.h"

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;
using sinew::runtime::CoordinatorClient;
using sinew::runtime::CoordinatorClientOptions;

double secondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

// ---- The coordinator's process (--serve N) ----

// High availability, for the bench's processes: the etcd endpoints and the job's name (empty
// endpoints: the built-in coordinator), from SINEW_BENCH_ETCD and SINEW_BENCH_JOB.
struct HaSetting {
  std::string etcd;
  std::string job;
  bool on() const { return !etcd.empty(); }
  static HaSetting fromEnvironment() {
    HaSetting h;
    if (const char* e = std::getenv("SINEW_BENCH_ETCD")) h.etcd = e;
    if (const char* j = std::getenv("SINEW_BENCH_JOB")) h.job = j;
    return h;
  }
};

std::shared_ptr<sinew::collectives::EtcdClient> etcdClientFor(const HaSetting& ha) {
  sinew::collectives::EtcdOptions e;
  e.endpoints = sinew::collectives::parseEtcdEndpoints(ha.etcd, "SINEW_BENCH_ETCD");
  return std::make_shared<sinew::collectives::EtcdClient>(e);
}

// HA: one leader candidate for N workers with the given token and control port; prints the
// same JSON line as serve() (port 0: the workers find the leader in etcd), then serves until
// its stdin closes.
int serveHa(int n, const HaSetting& ha, uint64_t token, uint16_t controlPort) {
  sinew::raiseOpenFileLimit(static_cast<int64_t>(n) * 2 + 4096);
  sinew::runtime::HaCoordinatorOptions o;
  o.etcd.endpoints = sinew::collectives::parseEtcdEndpoints(ha.etcd, "SINEW_BENCH_ETCD");
  o.job = ha.job;
  o.name = "bench-leader";
  o.leaseTtlSeconds = 2;
  const bool verbose = std::getenv("SINEW_BENCH_VERBOSE") != nullptr;
  o.log = [verbose](const std::string& line) {
    if (verbose) std::fprintf(stderr, "%s\n", line.c_str());
  };
  auto& c = o.coordinator;
  c.token = token;
  c.expectedWorkers = n;
  c.maxConnections = static_cast<size_t>(n) + 256;
  c.startTimeout = std::chrono::seconds(600);
  c.progressFloor = std::chrono::milliseconds(0);  // As serve().
  c.controlPort = controlPort;
  c.log = o.log;
  char tok[32];
  std::snprintf(tok, sizeof(tok), "%llx", static_cast<unsigned long long>(token));
  c.controlToken = tok;
  json info = {{"port", 0}, {"token", tok}, {"control_port", controlPort}, {"control_token", tok}};
  std::printf("%s\n", info.dump().c_str());
  std::fflush(stdout);
  std::thread([o] {
    try {
      sinew::runtime::runHaCoordinator(o);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "control-plane: the HA coordinator failed: %s\n", e.what());
    }
  }).detach();
  char buf[64];
  while (::read(0, buf, sizeof(buf)) > 0) {
  }
  std::fflush(nullptr);
  _exit(0);  // The candidate serves until the job ends; this job never does.
}

// Serves a coordinator for N workers; prints its endpoint and tokens as one JSON line, then
// serves until its stdin closes.
int serve(int n) {
  const HaSetting ha = HaSetting::fromEnvironment();
  if (ha.on()) {
    const char* t = std::getenv("SINEW_BENCH_TOKEN");
    const char* cport = std::getenv("SINEW_BENCH_CONTROL_PORT");
    return serveHa(n, ha, std::stoull(t ? t : "1", nullptr, 16),
                   static_cast<uint16_t>(std::atoi(cport ? cport : "0")));
  }
  sinew::raiseOpenFileLimit(static_cast<int64_t>(n) * 2 + 4096);
  sinew::runtime::CoordinatorOptions o;
  o.expectedWorkers = n;
  o.maxConnections = static_cast<size_t>(n) + 256;
  o.startTimeout = std::chrono::seconds(600);
  // No step-progress check: the bench's voters are threads of a starved process, not stuck
  // workers; a death is what it measures.
  o.progressFloor = std::chrono::milliseconds(0);
  o.controlPort = 0;
  // SINEW_BENCH_VERBOSE=1: the coordinator's log on stderr.
  const bool verbose = std::getenv("SINEW_BENCH_VERBOSE") != nullptr;
  o.log = [verbose](const std::string& line) {
    if (verbose) std::fprintf(stderr, "%s\n", line.c_str());
  };
  sinew::runtime::Coordinator c(o);
  char token[32];
  std::snprintf(token, sizeof(token), "%llx", static_cast<unsigned long long>(c.token()));
  json info = {{"port", c.port()},
               {"token", token},
               {"control_port", c.controlPort()},
               {"control_token", c.controlToken()}};
  std::printf("%s\n", info.dump().c_str());
  std::fflush(stdout);
  char buf[64];
  while (::read(0, buf, sizeof(buf)) > 0) {
  }
  return 0;
}

// Lowers the calling thread's priority (Linux: a nice value is per thread, and threads it
// creates inherit it).
void niceThisThread(int nice) {
  if (nice != 0) (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), nice);
}

// ---- Workers in a process of their own (--clients), so that a death is a real SIGKILL ----

// --clients PORT TOKEN STEPS NICE NODE ID...: one CoordinatorClient per ID on NODE; each is
// ready at once, and it prints "hello"; when the first epoch is there it prints "ready" and votes
// steps [0, STEPS) of that epoch like every other worker, then waits to be killed (or for its stdin
// to close: the bench is gone).
int serveClients(int argc, char** argv, int first) {
  if (argc - first < 6) {
    std::fprintf(stderr, "control-plane: --clients PORT TOKEN STEPS NICE NODE ID...\n");
    return 2;
  }
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  const uint16_t port = static_cast<uint16_t>(std::atoi(argv[first]));
  const uint64_t token = std::stoull(argv[first + 1], nullptr, 16);
  const int steps = std::atoi(argv[first + 2]);
  niceThisThread(std::atoi(argv[first + 3]));
  const std::string node = argv[first + 4];
  const HaSetting ha = HaSetting::fromEnvironment();
  std::shared_ptr<sinew::collectives::EtcdClient> etcd = ha.on() ? etcdClientFor(ha) : nullptr;
  std::vector<std::unique_ptr<CoordinatorClient>> clients;
  for (int i = first + 5; i < argc; ++i) {
    CoordinatorClientOptions o;
    o.port = port;
    o.token = token;
    if (etcd) o.awaitLeader = sinew::runtime::etcdLeaderFinder(etcd, ha.job, token);
    o.worker = std::atoi(argv[i]);
    o.node = node;
    o.connectTimeout = std::chrono::seconds(120);
    clients.push_back(std::make_unique<CoordinatorClient>(o));
    clients.back()->ready(0);
  }
  std::printf("hello\n");
  std::fflush(stdout);
  const int64_t epoch = clients.front()->waitEpochAfter(-1, std::chrono::seconds(300)).epoch;
  std::printf("ready\n");
  std::fflush(stdout);
  std::vector<std::thread> voters;
  for (auto& c : clients) {
    voters.emplace_back([&c, epoch, steps] {
      try {
        for (int s = 0; s < steps; ++s) {
          if (c->vote(epoch, s, std::chrono::seconds(60)) !=
              CoordinatorClient::VoteResult::kCommitted) {
            return;
          }
        }
      } catch (const std::exception&) {
      }
    });
  }
  for (auto& t : voters) t.join();
  char buf[64];
  while (::read(0, buf, sizeof(buf)) > 0) {
  }
  return 0;
}

// This binary run again with `args` (after argv[0]), its stdin and stdout pipes to us.
struct Child {
  pid_t pid = -1;
  int stdinFd = -1;   // ours to write; closing it tells the child to end
  int stdoutFd = -1;  // ours to read
};

Child spawnSelf(const char* self, std::vector<std::string> args) {
  int in[2], out[2];
  if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0) {
    std::perror("pipe");
    std::exit(2);
  }
  args.insert(args.begin(), self);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(in[0], 0);
    ::dup2(out[1], 1);
    ::execv(self, argv.data());
    _exit(127);
  }
  ::close(in[0]);
  ::close(out[1]);
  return {pid, in[1], out[0]};
}

// Workers in a process of their own (--clients).
struct ClientProcess : Child {
  std::vector<int> ids;
};

ClientProcess startClients(const char* self, uint16_t port, uint64_t token, int steps, int nice,
                           const std::string& node, const std::vector<int>& ids) {
  char tok[32];
  std::snprintf(tok, sizeof(tok), "%llx", static_cast<unsigned long long>(token));
  std::vector<std::string> args = {"--clients",           std::to_string(port), tok,
                                   std::to_string(steps), std::to_string(nice), node};
  for (int id : ids) args.push_back(std::to_string(id));
  ClientProcess p;
  static_cast<Child&>(p) = spawnSelf(self, std::move(args));
  p.ids = ids;
  return p;
}

// Kills a client process (our own child, by its PID) and reaps it. Idempotent.
void killClients(ClientProcess& p) {
  if (p.pid < 0) return;
  ::kill(p.pid, SIGKILL);
  int st = 0;
  ::waitpid(p.pid, &st, 0);
  ::close(p.stdinFd);
  ::close(p.stdoutFd);
  p.pid = -1;
}

struct CoordinatorProcess {
  pid_t pid = -1;
  int stdinFd = -1;
  uint16_t port = 0;
  uint64_t token = 0;
  uint16_t controlPort = 0;
  std::string controlToken;
};

CoordinatorProcess startCoordinator(const char* self, int n) {
  const Child child = spawnSelf(self, {"--serve", std::to_string(n)});
  std::string line;
  char c;
  while (::read(child.stdoutFd, &c, 1) == 1 && c != '\n') line += c;
  ::close(child.stdoutFd);
  json info = json::parse(line, nullptr, false);
  if (!info.is_object()) {
    std::fprintf(stderr, "control-plane: the coordinator process did not start: %s\n",
                 line.c_str());
    std::exit(2);
  }
  CoordinatorProcess p;
  p.pid = child.pid;
  p.stdinFd = child.stdinFd;
  p.port = info["port"].get<uint16_t>();
  p.token = std::stoull(info["token"].get<std::string>(), nullptr, 16);
  p.controlPort = info["control_port"].get<uint16_t>();
  p.controlToken = info["control_token"].get<std::string>();
  return p;
}

void stopCoordinator(CoordinatorProcess& p) {
  ::close(p.stdinFd);
  int st = 0;
  ::waitpid(p.pid, &st, 0);  // Our own child, by PID.
}

// The process's CPU seconds (user + system) and resident bytes, from /proc.
double cpuSeconds(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');
  std::istringstream rest(text.substr(close + 2));
  std::string field;
  double ticks = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14 || i == 15) ticks += std::stod(field);  // utime, stime
  }
  return ticks / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

int64_t residentBytes(pid_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return 0;
}

// A GET of the control API (HTTP/1.1, Connection: close): the status code and body size (the
// body into *body when given).
std::pair<int, size_t> httpGet(uint16_t port, const std::string& path, const std::string& token,
                               std::string* body = nullptr) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    ::close(fd);
    return {0, 0};
  }
  const std::string req = "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " +
                          token + "\r\nConnection: close\r\n\r\n";
  (void)!::write(fd, req.data(), req.size());
  std::string resp;
  char buf[65536];
  ssize_t got;
  while ((got = ::read(fd, buf, sizeof(buf))) > 0) resp.append(buf, got);
  ::close(fd);
  const int code = resp.size() > 12 ? std::atoi(resp.c_str() + 9) : 0;
  const size_t start = resp.find("\r\n\r\n");
  if (start == std::string::npos) return {code, 0};
  if (body) *body = resp.substr(start + 4);
  return {code, resp.size() - start - 4};
}

// The coordinator's own round trip of its newest committed step (/metrics' sinew_commit_seconds:
// from reading the step's last vote to its commit written to every member), in ms; negative if
// the metric is missing.
double commitMs(uint16_t port, const std::string& token) {
  std::string body;
  if (httpGet(port, "/metrics", token, &body).first != 200) return -1;
  const std::string key = "\nsinew_commit_seconds ";
  const size_t at = body.find(key);
  return at == std::string::npos ? -1 : 1e3 * std::atof(body.c_str() + at + key.size());
}

// ---- The simulated workers ----

struct Worker {
  std::unique_ptr<CoordinatorClient> client;
  std::atomic<int64_t> epoch{-1};   // the newest epoch it was told of (-1: none, or expelled)
  std::atomic<int64_t> epochNs{0};  // when (nowNs)
  bool gone = false;  // killed, silenced, or held by a client process (not watched here)
};

// Runs f(i) for i in [0, n) on `threads` threads of nice `nice`.
template <class F>
void parallelFor(int n, int threads, int nice, F f) {
  std::atomic<int> next{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      niceThisThread(nice);
      for (int i; (i = next++) < n;) f(i);
    });
  }
  for (auto& t : pool) t.join();
}

// Waits up to `timeout` for every worker not gone to hold an epoch after `after`; returns the
// time from `since` to the last one's (seconds), or a negative number on timeout.
double waitAllPast(std::vector<std::unique_ptr<Worker>>& ws, int64_t after, int64_t sinceNs,
                   std::chrono::seconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    bool all = true;
    int64_t last = 0;
    for (auto& w : ws) {
      if (w->gone) continue;
      const int64_t e = w->epoch.load();
      if (e <= after) {
        all = false;
        break;
      }
      last = std::max(last, w->epochNs.load());
    }
    if (all) return static_cast<double>(last - sinceNs) / 1e9;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return -1;
}

// A reusable barrier for the voters.
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void arrive() {
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return gen_ != gen; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const int n_;
  int count_ = 0;
  int64_t gen_ = 0;
};

struct SizeResult {
  int n = 0;
  double startS = 0;
  double voteRttMs = 0;  // last vote out to last commit in, at the workers
  double commitMs = 0;   // last vote in to last commit out, at the coordinator
  double closeOneS = 0, closeNodeS = 0, silentS = 0;
  double cpuShare = 0;
  double kibPerWorker = 0;
  double statusMs = 0, metricsMs = 0;
  size_t statusBytes = 0, metricsBytes = 0;
  bool ok = true;
  std::string why;
};

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// a = max(a, v), atomically.
void raiseTo(std::atomic<int64_t>& a, int64_t v) {
  int64_t prev = a.load();
  while (v > prev && !a.compare_exchange_weak(prev, v)) {
  }
}

// Every worker of this process votes steps [first, first + count) together (the client
// processes' workers vote each step as soon as the one before it commits, so they are never
// the last); the median of (last commit in - last vote out) in ms, or negative when a vote did
// not commit. With `threads` > 0, each of that many threads casts the votes of its share of
// the workers, then awaits their verdicts in turn; with 0, a thread per worker votes.
// *coordinatorMs: the median of the coordinator's own figure (commitMs) over the steps.
double voteRounds(std::vector<std::unique_ptr<Worker>>& ws, int64_t epoch, int64_t first, int count,
                  int nice, int threads, const CoordinatorProcess& cp, double* coordinatorMs) {
  std::vector<Worker*> local;
  for (auto& w : ws) {
    if (w->client) local.push_back(w.get());
  }
  const int n = static_cast<int>(local.size());
  const int t = threads > 0 ? std::min(threads, n) : n;
  std::vector<std::atomic<int64_t>> lastOut(count), lastIn(count);
  for (int s = 0; s < count; ++s) lastOut[s] = lastIn[s] = 0;
  std::vector<double> coordinator(count, -1);
  std::atomic<bool> failed{false};
  Barrier barrier(t);
  std::vector<std::thread> voters;
  voters.reserve(t);
  for (int v = 0; v < t; ++v) {
    voters.emplace_back([&, v] {
      niceThisThread(nice);
      // Workers v, v + t, v + 2t, ...
      for (int s = 0; s < count; ++s) {
        barrier.arrive();
        for (int i = v; i < n; i += t) {
          local[i]->client->castVote(epoch, first + s);
          raiseTo(lastOut[s], nowNs());
        }
        for (int i = v; i < n; i += t) {
          CoordinatorClient::VoteResult r = CoordinatorClient::VoteResult::kSuperseded;
          try {
            r = local[i]->client->awaitVerdict(epoch, first + s, std::chrono::seconds(60));
          } catch (const std::exception&) {
          }
          if (r != CoordinatorClient::VoteResult::kCommitted) failed = true;
        }
        raiseTo(lastIn[s], nowNs());
        // Between steps (the others wait at the barrier): the coordinator's figure for step s,
        // the newest committed (the client processes' workers have voted s + 1, this
        // process's workers not yet).
        barrier.arrive();
        if (v == 0) coordinator[s] = commitMs(cp.controlPort, cp.controlToken);
      }
    });
  }
  for (auto& th : voters) th.join();
  *coordinatorMs = median(coordinator);
  if (failed) return -1;
  std::vector<double> rtt;
  for (int s = 0; s < count; ++s) rtt.push_back(static_cast<double>(lastIn[s] - lastOut[s]) / 1e6);
  return median(rtt);
}

// HA for the size-n run (empty endpoints: none): a job of its own in the shared etcd, and a
// token and control port of our choosing (the leader publishes only its worker address), given
// to the coordinator and client processes through the environment.
HaSetting haForSize(int n, const std::string& etcdEndpoints) {
  HaSetting ha;
  if (etcdEndpoints.empty()) return ha;
  ha.etcd = etcdEndpoints;
  ha.job = "bench-" + std::to_string(n) + "-" + std::to_string(::getpid());
  char tok[32];
  std::snprintf(tok, sizeof(tok), "%llx",
                static_cast<unsigned long long>(0x5eed0000u + static_cast<unsigned>(n)));
  ::setenv("SINEW_BENCH_ETCD", ha.etcd.c_str(), 1);
  ::setenv("SINEW_BENCH_JOB", ha.job.c_str(), 1);
  ::setenv("SINEW_BENCH_TOKEN", tok, 1);
  ::setenv("SINEW_BENCH_CONTROL_PORT", std::to_string(sinew::testing::freeLoopbackPort()).c_str(),
           1);
  return ha;
}

// /v1/status and /metrics, five times each: their median times and sizes into r; the first
// answer that is not 200, or empty.
std::string timeControlApi(const CoordinatorProcess& cp, SizeResult& r) {
  std::string why;
  std::vector<double> st, me;
  for (int k = 0; k < 5; ++k) {
    auto t = Clock::now();
    auto [code, bytes] = httpGet(cp.controlPort, "/v1/status", cp.controlToken);
    st.push_back(secondsSince(t) * 1e3);
    r.statusBytes = bytes;
    if (code != 200 && why.empty()) why = "/v1/status answered " + std::to_string(code);
    t = Clock::now();
    auto [mcode, mbytes] = httpGet(cp.controlPort, "/metrics", cp.controlToken);
    me.push_back(secondsSince(t) * 1e3);
    r.metricsBytes = mbytes;
    if (mcode != 200 && why.empty()) why = "/metrics answered " + std::to_string(mcode);
  }
  r.statusMs = median(st);
  r.metricsMs = median(me);
  return why;
}

// The harness's threads: shared io threads for the simulated workers' clients (0: one each)
// and voter threads (0: one per worker).
struct HarnessThreads {
  int io = 8;
  int voters = 8;
};

SizeResult runSize(const char* self, int n, int steps, int nice, const std::string& etcdEndpoints,
                   HarnessThreads threads) {
  SizeResult r;
  r.n = n;
  auto fail = [&](const std::string& why) {
    if (r.ok) r.why = why;
    r.ok = false;
  };
  // HA: a job of its own per size in the shared etcd.
  const HaSetting ha = haForSize(n, etcdEndpoints);
  std::shared_ptr<sinew::collectives::EtcdClient> etcd = ha.on() ? etcdClientFor(ha) : nullptr;
  CoordinatorProcess cp = startCoordinator(self, n);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const int64_t rssBefore = residentBytes(cp.pid);

  // Start: N hellos (at most 32 connecting at once: one address may hold 64 unauthenticated
  // connections), each ready at once; the first epoch forms when all are. The workers that
  // will be killed live in processes of their own: worker 3 alone, and workers 8..15, a node.
  std::vector<std::unique_ptr<Worker>> ws;
  for (int i = 0; i < n; ++i) ws.push_back(std::make_unique<Worker>());
  ClientProcess one, node;
  auto readLine = [](ClientProcess& p) {
    std::string line;
    char c;
    while (::read(p.stdoutFd, &c, 1) == 1 && c != '\n') line += c;
    return line;
  };
  if (n >= 16) {
    one = startClients(self, cp.port, cp.token, steps, nice, "node-3", {3});
    node = startClients(self, cp.port, cp.token, steps, nice, "node-shared",
                        {8, 9, 10, 11, 12, 13, 14, 15});
    for (int i : one.ids) ws[i]->gone = true;
    for (int i : node.ids) ws[i]->gone = true;
    // Their hellos come first, so the start below is the coordinator's, not their exec.
    if (readLine(one) != "hello" || readLine(node) != "hello") {
      fail("a client process could not say hello");
    }
  }
  // The shared io threads, made on a thread of the workers' nice (they inherit it).
  std::shared_ptr<sinew::runtime::ClientIoThreads> io;
  if (threads.io > 0) {
    std::thread([&] {
      niceThisThread(nice);
      io = std::make_shared<sinew::runtime::ClientIoThreads>(threads.io);
    }).join();
  }
  const int64_t startNs = nowNs();
  std::atomic<int> failedStarts{0};
  parallelFor(n, 32, nice, [&](int i) {
    if (ws[i]->gone) return;  // in a client process
    CoordinatorClientOptions o;
    o.port = cp.port;
    o.token = cp.token;
    if (etcd) o.awaitLeader = sinew::runtime::etcdLeaderFinder(etcd, ha.job, cp.token);
    o.worker = i;
    // Workers 8..15 share a node (they fail together); every other worker is a node of its
    // own, so that one closed connection is one worker's loss.
    o.node = i >= 8 && i < 16 ? "node-shared" : "node-" + std::to_string(i);
    o.connectTimeout = std::chrono::seconds(120);
    o.ioThreads = io;
    try {
      Worker* w = ws[i].get();
      w->client = std::make_unique<CoordinatorClient>(o);
      w->client->setEpochListener([w](int64_t e) {
        w->epochNs = nowNs();
        w->epoch = e;
      });
      w->client->ready(0);
    } catch (const std::exception& e) {
      if (failedStarts++ == 0) std::fprintf(stderr, "control-plane: worker %d: %s\n", i, e.what());
    }
  });
  if (failedStarts > 0) {
    fail(std::to_string(failedStarts.load()) + " workers could not say hello");
    for (auto& w : ws) w->gone = w->client == nullptr;
  }
  r.startS = waitAllPast(ws, -1, startNs, std::chrono::seconds(120));
  if (r.startS < 0) fail("not every worker got the first epoch");
  for (ClientProcess* p : {&one, &node}) {
    if (p->pid >= 0 && readLine(*p) != "ready") fail("a client process got no first epoch");
  }
  int64_t epoch = ws[0]->client ? ws[0]->client->latestEpoch().epoch : 0;

  // Steady state: heartbeats only.
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const double cpu0 = cpuSeconds(cp.pid);
  const auto t0 = Clock::now();
  std::this_thread::sleep_for(std::chrono::seconds(3));
  r.cpuShare = (cpuSeconds(cp.pid) - cpu0) / secondsSince(t0);
  r.kibPerWorker = static_cast<double>(residentBytes(cp.pid) - rssBefore) / 1024.0 / n;

  // The control API at this size.
  if (const std::string why = timeControlApi(cp, r); !why.empty()) fail(why);

  // Votes.
  if (r.ok) {
    r.voteRttMs = voteRounds(ws, epoch, 0, steps, nice, threads.voters, cp, &r.commitMs);
    if (r.commitMs <= 0) fail("/metrics has no sinew_commit_seconds");
    if (r.voteRttMs < 0) fail("a vote did not commit");
  }

  // Deaths: SIGKILL of worker 3's process, of the process of a node of 8 (workers 8..15),
  // and a silent worker (5: heartbeats muted).
  auto death = [&](const char* what, ClientProcess* killed, bool silent) {
    if (!r.ok || n < 16) return -1.0;
    const int64_t before = epoch;
    const int64_t t = nowNs();
    if (silent) {
      ws[5]->client->muteHeartbeats(std::chrono::seconds(30));
      ws[5]->gone = true;
    } else {
      killClients(*killed);
    }
    const double s = waitAllPast(ws, before, t, std::chrono::seconds(30));
    if (s < 0) fail(std::string("not every survivor got the epoch after ") + what);
    for (auto& w : ws) {
      if (!w->gone) epoch = std::max(epoch, w->epoch.load());
    }
    return s;
  };
  r.closeOneS = death("a killed worker", &one, false);
  r.closeNodeS = death("a node's loss", &node, false);
  r.silentS = death("a silent worker", nullptr, true);

  // Tear down: the coordinator first (each client closing before it would start an epoch
  // for the rest: N epochs of up to N members), then every client, in parallel.
  stopCoordinator(cp);
  killClients(one);
  killClients(node);
  parallelFor(n, 16, 0, [&](int i) { ws[i]->client.reset(); });
  io.reset();  // Its threads end with the last client.
  if (ha.on()) {
    for (const char* v :
         {"SINEW_BENCH_ETCD", "SINEW_BENCH_JOB", "SINEW_BENCH_TOKEN", "SINEW_BENCH_CONTROL_PORT"}) {
      ::unsetenv(v);
    }
  }
  return r;
}

std::vector<int> parseSizes(const std::string& s) {
  std::vector<int> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) {
    const int v = std::atoi(item.c_str());
    if (v < 1 || v > 100000) {
      std::fprintf(stderr, "control-plane: --sizes: %s is not a worker count in [1, 100000]\n",
                   item.c_str());
      std::exit(2);
    }
    out.push_back(v);
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  std::string sizes = "256,1024,4096";
  int steps = 10;
  int nice = 10;
  bool check = false;
  bool ha = false;
  HarnessThreads threads;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--serve" && i + 1 < argc) return serve(std::atoi(argv[i + 1]));
    if (a == "--clients") return serveClients(argc, argv, i + 1);
    if (a == "--sizes" && i + 1 < argc) {
      sizes = argv[++i];
    } else if (a == "--steps" && i + 1 < argc) {
      steps = std::max(1, std::atoi(argv[++i]));
    } else if (a == "--worker-nice" && i + 1 < argc) {
      nice = std::max(0, std::min(19, std::atoi(argv[++i])));
    } else if (a == "--io-threads" && i + 1 < argc) {
      threads.io = std::max(0, std::atoi(argv[++i]));
    } else if (a == "--voter-threads" && i + 1 < argc) {
      threads.voters = std::max(0, std::atoi(argv[++i]));
    } else if (a == "--ha") {
      ha = true;
    } else if (a == "--check") {
      check = true;
    } else {
      std::fprintf(stderr,
                   "usage: sinew-bench-control-plane [--sizes 256,1024,4096] [--steps 10] "
                   "[--worker-nice 10] [--ha] [--io-threads 8] [--voter-threads 8] "
                   "[--check]\n");
      return 2;
    }
  }
  ::signal(SIGPIPE, SIG_IGN);
  const std::vector<int> ns = parseSizes(sizes);
  // Every simulated worker holds one socket, and in HA mode also its watch of the leader key
  // in etcd (a socket, and the watch's io_context: an epoll, an eventfd and a timerfd); the
  // coordinator's process raises its own. Past the hard limit only where that is allowed (as
  // root): 4,096 HA workers need about 25,000 descriptors.
  const int64_t largest = *std::max_element(ns.begin(), ns.end());
  const int64_t needed = largest * (ha ? 6 : 2) + 1024;
  int64_t allowed = sinew::raiseOpenFileLimit(needed);
  if (allowed < needed) {
    struct rlimit r {};
    r.rlim_cur = r.rlim_max = static_cast<rlim_t>(needed);
    if (::setrlimit(RLIMIT_NOFILE, &r) == 0) allowed = needed;
  }
  if (allowed < needed) {
    std::printf("note: %lld open files allowed, %lld wanted: the largest size may run out\n",
                static_cast<long long>(allowed), static_cast<long long>(needed));
  }
  std::vector<SizeResult> results;
  std::unique_ptr<sinew::testing::EtcdCluster> etcdCluster;
  if (ha) {
    etcdCluster = std::make_unique<sinew::testing::EtcdCluster>(1);
    std::printf("high availability: the coordinator a leader candidate on etcd %s\n",
                etcdCluster->endpoints().c_str());
  }
  std::printf("harness: %s io threads, %s voter threads, nice %d\n",
              threads.io > 0 ? std::to_string(threads.io).c_str() : "one per worker's",
              threads.voters > 0 ? std::to_string(threads.voters).c_str() : "one per worker's",
              nice);
  std::printf("%7s %8s %10s %10s %10s %10s %10s %8s %9s %10s %11s\n", "workers", "start_s",
              "vote_rtt_ms", "vote_e2e_ms", "kill_1_ms", "kill_8_ms", "silent_ms", "coord_cpu",
              "kib/wkr", "status_ms", "metrics_ms");
  bool ok = true;
  for (int n : ns) {
    SizeResult r = runSize(argv[0], n, steps, nice, ha ? etcdCluster->endpoints() : "", threads);
    std::printf("%7d %8.3f %10.2f %10.2f %10.1f %10.1f %10.1f %8.1f%% %9.1f %10.1f %11.1f\n", r.n,
                r.startS, r.commitMs, r.voteRttMs, 1e3 * r.closeOneS, 1e3 * r.closeNodeS,
                1e3 * r.silentS, 100 * r.cpuShare, r.kibPerWorker, r.statusMs, r.metricsMs);
    if (!r.ok) {
      std::printf("  %d workers: FAILED: %s\n", r.n, r.why.c_str());
      ok = false;
    }
    std::printf("  /v1/status %zu bytes, /metrics %zu bytes\n", r.statusBytes, r.metricsBytes);
    std::fflush(stdout);
    results.push_back(r);
  }
  const SizeResult& base = results.front();
  const SizeResult& top = results.back();
  if (results.size() > 1) {
    std::printf(
        "growth from %d to %d workers (x%.0f): start x%.1f, vote x%.1f (end to end x%.1f), "
        "kill x%.1f, cpu x%.1f, status x%.1f\n",
        base.n, top.n, static_cast<double>(top.n) / base.n, top.startS / base.startS,
        top.commitMs / base.commitMs, top.voteRttMs / base.voteRttMs,
        top.closeOneS / base.closeOneS, top.cpuShare / base.cpuShare, top.statusMs / base.statusMs);
  }
  std::printf(
      "RESULT epoch_change_s_%d=%.3f vote_rtt_ms_%d=%.2f coord_kib_per_worker=%.1f "
      "vote_e2e_ms_%d=%.2f\n",
      top.n, top.closeOneS, top.n, top.commitMs, top.kibPerWorker, top.n, top.voteRttMs);
  return check && !ok ? 1 : 0;
}
