#include "sinew/runtime/slurm_bootstrap.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "sinew/base/error.h"
#include "sinew/base/parse.h"
#include "sinew/base/private_file.h"

namespace sinew {
namespace runtime {
namespace {

using ::sinew::detail::env;

// $name, which a step must have.
std::string required(const char* name) {
  const char* v = env(name);
  if (v == nullptr) {
    SINEW_THROW(InvalidArgument, "SINEW_BOOTSTRAP=slurm, but ", name,
                " is not set (is this a task of an srun step?)");
  }
  return v;
}

int intVariable(const char* name, const std::string& v, int64_t min) {
  return static_cast<int>(::sinew::detail::parseInt(v, name, min, 1 << 24));
}

// Expands the first bracket group of `name` (and, recursively, the rest) into `out`.
void expandOne(const std::string& name, const std::string& list, std::vector<std::string>& out) {
  const size_t open = name.find('[');
  if (open == std::string::npos) {
    if (name.find(']') != std::string::npos) {
      SINEW_THROW(InvalidArgument, "the host list '", list, "' has a ']' without '['");
    }
    out.push_back(name);
    return;
  }
  const size_t close = name.find(']', open);
  if (close == std::string::npos) {
    SINEW_THROW(InvalidArgument, "the host list '", list, "' has a '[' without ']'");
  }
  const std::string prefix = name.substr(0, open), suffix = name.substr(close + 1);
  if (close == open + 1)
    SINEW_THROW(InvalidArgument, "the host list '", list, "' has an empty '[]'");
  std::stringstream ranges(name.substr(open + 1, close - open - 1));
  for (std::string r; std::getline(ranges, r, ',');) {
    const size_t dash = r.find('-');
    const std::string lo = r.substr(0, dash),
                      hi = dash == std::string::npos ? lo : r.substr(dash + 1);
    const bool digits =
        !lo.empty() && !hi.empty() && lo.find_first_not_of("0123456789") == std::string::npos &&
        hi.find_first_not_of("0123456789") == std::string::npos && lo.size() <= 9 && hi.size() <= 9;
    if (!digits || std::stol(lo) > std::stol(hi) || std::stol(hi) - std::stol(lo) > 100000) {
      SINEW_THROW(InvalidArgument, "the host list '", list, "' has the bad range '", r, "'");
    }
    for (long i = std::stol(lo); i <= std::stol(hi); ++i) {
      std::string n = std::to_string(i);
      if (n.size() < lo.size()) n.insert(0, lo.size() - n.size(), '0');  // Zero padding.
      expandOne(prefix + n + suffix, list, out);
    }
  }
}

}  // namespace

std::vector<std::string> expandHostlist(const std::string& list) {
  std::vector<std::string> out;
  std::string name;
  int depth = 0;
  for (size_t i = 0; i <= list.size(); ++i) {
    const char c = i < list.size() ? list[i] : ',';
    if (c == '[') depth++;
    if (c == ']') depth--;
    if (depth < 0 || depth > 1 || (i == list.size() && depth != 0)) {
      SINEW_THROW(InvalidArgument, "the host list '", list, "' has unbalanced brackets");
    }
    if (c == ',' && depth == 0) {
      if (name.empty())
        SINEW_THROW(InvalidArgument, "the host list '", list, "' has an empty name");
      expandOne(name, list, out);
      name.clear();
    } else {
      name.push_back(c);
    }
  }
  return out;
}

std::optional<SlurmStep> slurmStepFromEnvironment() {
  const char* mode = env("SINEW_BOOTSTRAP");
  const std::string bootstrap = mode ? mode : "";
  if (!bootstrap.empty() && bootstrap != "slurm" && bootstrap != "mpi") {
    SINEW_THROW(InvalidArgument, "SINEW_BOOTSTRAP='", bootstrap, "' is neither 'slurm' nor 'mpi'");
  }
  if (bootstrap == "mpi") return std::nullopt;
  if (bootstrap.empty()) {
    // MPI meets the ranks under mpirun and under srun --mpi=pmi2/pmix.
    for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"}) {
      if (env(name)) return std::nullopt;
    }
    // A batch script's own environment has SLURM_PROCID but no step of srun's.
    if (!env("SLURM_PROCID") || !env("SLURM_STEP_ID") || !env("SLURM_STEP_NUM_TASKS")) {
      return std::nullopt;
    }
  }
  SlurmStep s;
  s.size = intVariable("SLURM_STEP_NUM_TASKS", required("SLURM_STEP_NUM_TASKS"), 1);
  s.rank = intVariable("SLURM_PROCID", required("SLURM_PROCID"), 0);
  if (s.rank >= s.size) {
    SINEW_THROW(InvalidArgument, "SLURM_PROCID=", s.rank,
                " is not below SLURM_STEP_NUM_TASKS=", s.size);
  }
  s.localRank = env("SLURM_LOCALID") ? intVariable("SLURM_LOCALID", env("SLURM_LOCALID"), 0) : 0;
  s.jobId = required("SLURM_JOB_ID");
  s.stepId = required("SLURM_STEP_ID");
  s.nodes = expandHostlist(required("SLURM_STEP_NODELIST"));
  const char* node = env("SLURMD_NODENAME");
  s.nodeName = node ? node : "";
  return s;
}

uint16_t derivedCoordinatorPort(const std::string& jobId, const std::string& stepId) {
  uint64_t h = 1469598103934665603ULL;  // FNV-1a over "job.step"
  for (char c : jobId + "." + stepId) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ULL;
  }
  return static_cast<uint16_t>(30000 + h % 25000);
}

SlurmRendezvous slurmRendezvous(const SlurmStep& step) {
  SlurmRendezvous r;
  if (const char* h = env("SINEW_COORDINATOR_HOST")) {
    r.host = h;
  } else if (step.nodes.size() <= 1) {
    r.host = "127.0.0.1";
  }
  if (const char* t = env("SINEW_TOKEN")) r.token = ::sinew::detail::parseToken(t, "SINEW_TOKEN");
  if (const char* p = env("SINEW_COORDINATOR_PORT")) {
    r.port =
        static_cast<uint16_t>(::sinew::detail::parseInt(p, "SINEW_COORDINATOR_PORT", 1, 65535));
    r.portFrom = "SINEW_COORDINATOR_PORT";
  } else if (r.token != 0) {
    r.port = derivedCoordinatorPort(step.jobId, step.stepId);
    r.portFrom = "derived from job " + step.jobId + " step " + step.stepId;
  } else {
    r.portFrom = "free";
  }
  std::string dir;
  if (const char* d = env("SINEW_RENDEZVOUS_DIR")) {
    dir = d;
  } else if (const char* home = env("HOME")) {
    dir = std::string(home) + "/.sinew";
  } else {
    dir = "/tmp/sinew-" + std::to_string(::getuid());
  }
  // A requeued job keeps its id and numbers its steps from 0 again.
  const char* restarts = env("SLURM_RESTART_COUNT");
  r.file = dir + "/slurm-" + step.jobId + "." + step.stepId + "." + (restarts ? restarts : "0") +
           ".rendezvous";
  return r;
}

std::string addressOf(const std::string& name) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(name.c_str(), nullptr, &hints, &found);
  if (rc != 0 || found == nullptr) {
    SINEW_THROW(IoError, "the host name '", name, "' has no IPv4 address (", ::gai_strerror(rc),
                "): set SINEW_COORDINATOR_HOST to rank 0's address");
  }
  char text[INET_ADDRSTRLEN] = {0};
  ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr, text,
              sizeof(text));
  ::freeaddrinfo(found);
  return text;
}

std::string ownAddress() {
  char name[256] = {0};
  ::gethostname(name, sizeof(name) - 1);
  return addressOf(name);
}

void writeRendezvousFile(const std::string& path, const RendezvousRecord& record) {
  ::sinew::detail::makePrivateDirs(path.substr(0, path.rfind('/')));
  char token[17];
  std::snprintf(token, sizeof(token), "%016llx", static_cast<unsigned long long>(record.token));
  ::sinew::detail::writePrivateFile(
      path, record.host + " " + std::to_string(record.port) + " " + token + "\n");
}

RendezvousRecord readRendezvousFile(const std::string& path, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    std::ifstream in(path);
    if (in) {
      std::string line;
      std::getline(in, line);
      std::istringstream words(line);
      std::string host, port, token, extra;
      words >> host >> port >> token;
      RendezvousRecord r;
      r.host = host;
      auto t = ::sinew::detail::tryParseToken(token);
      int64_t p = 0;
      const bool portOk = ::sinew::detail::parseIntOrError(port, "port", 1, 65535, &p).empty();
      if (host.empty() || !portOk || !t || (words >> extra)) {
        SINEW_THROW(Corruption, "the rendezvous file ", path, " is not 'address port token': '",
                    line.substr(0, 200), "'");
      }
      r.port = static_cast<uint16_t>(p);
      r.token = *t;
      return r;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      SINEW_THROW(Timeout, "rank 0 of the srun step wrote no rendezvous file ", path, " within ",
                  timeout.count(),
                  " ms: every node must see that folder (SINEW_RENDEZVOUS_DIR), or set "
                  "SINEW_TOKEN for the step");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace runtime
}  // namespace sinew
