#include "sinew/runtime/coordinator_process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <thread>

#include "sinew/base/error.h"
#include "sinew/base/parse.h"
#include "sinew/runtime/control_api.h"
#include "sinew/runtime/job_outcome.h"

namespace sinew {
namespace runtime {
namespace {

using ::sinew::detail::env;
using json = nlohmann::json;

bool writeAll(int fd, const std::string& text) {
  size_t off = 0;
  while (off < text.size()) {
    const ssize_t n = ::write(fd, text.data() + off, text.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    off += static_cast<size_t>(n);
  }
  return true;
}

// The child's life once it listens: serve until the job has ended (or never started within the
// connect timeout) and no worker is connected any more, or SINEW_END_GRACE_S (default 300)
// after the end while some still are (a worker hung after training keeps its heartbeats);
// returns the outcome.
json serveUntilEveryWorkerLeft(Coordinator& coord, const InitOptions& o) {
  const auto start = std::chrono::steady_clock::now();
  std::chrono::seconds grace(300);
  if (const char* g = env("SINEW_END_GRACE_S")) {
    grace = std::chrono::seconds(detail::parseInt(g, "SINEW_END_GRACE_S", 0, 86400));
  }
  std::optional<std::chrono::steady_clock::time_point> endedAt;
  for (;;) {
    coord.waitFinished(std::chrono::milliseconds(200));
    const CoordinatorStatus st = coord.status();
    const bool ended = st.finished || st.failed || (st.epoch >= 0 && st.members.empty());
    if (ended && st.connected == 0) break;
    if (ended && !endedAt) endedAt = std::chrono::steady_clock::now();
    if (endedAt && std::chrono::steady_clock::now() - *endedAt > grace) {
      std::fprintf(stderr,
                   "sinew coordinator: %d worker(s) still connected %lld s after the job ended; "
                   "ending (SINEW_END_GRACE_S)\n",
                   st.connected, static_cast<long long>(grace.count()));
      break;
    }
    if (st.epoch < 0 && std::chrono::steady_clock::now() - start > o.connectTimeout) break;
    if (ended) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return coord.outcome();
}

[[noreturn]] void runChild(int fd, int expected, const InitOptions& o, const std::string& host,
                           uint16_t port, uint64_t token) {
  // The workers decide. A ^C reaches them; so does SIGTERM (and the drain signal) when Slurm
  // signals every process of the step (scancel, the time limit, preemption) or mpirun rank 0's
  // process group: the coordinator outlives it, so that the workers can drain into a durable
  // checkpoint, and ends when the job does (SIGKILL still ends it).
  ::signal(SIGINT, SIG_IGN);
  ::signal(SIGTERM, SIG_IGN);
  ::signal(SIGPIPE, SIG_IGN);  // Rank 0 may be gone when the outcome is written.
  int rc = 0;
  bool reported = false;
  try {
    if (const char* name = env("SINEW_DRAIN_SIGNAL")) {
      ::signal(signalNumber("SINEW_DRAIN_SIGNAL", name), SIG_IGN);
    }
    CoordinatorOptions c;
    if (const char* h = env("SINEW_COORDINATOR_HOST")) c.host = h;
    if (!host.empty()) c.host = host;
    c.port = port;
    c.token = token;
    c.expectedWorkers = expected;
    c.heartbeatInterval = o.heartbeatInterval;
    c.deadAfter = o.deadAfter;
    c.progressFloor = o.stepDeadlineFloor;
    c.progressFactor = o.stepDeadlineFactor;
    c.startTimeout = o.connectTimeout;
    const char* dir = env("SINEW_LOG_DIR");
    if (dir) c.eventLogPath = std::string(dir) + "/coordinator-events.jsonl";
    controlApiFromEnv(c);
    Coordinator coord(c);
    if (dir) writeCoordinatorJson(coord, std::string(dir) + "/coordinator.json");
    if (!writeAll(fd, std::to_string(coord.port()) + " " + std::to_string(coord.token()) + "\n")) {
      _exit(1);
    }
    reported = true;
    const json outcome = serveUntilEveryWorkerLeft(coord, o);
    rc = outcomeExitStatus(outcome);
    if (dir) {
      try {
        writeOutcomeFile(outcome, std::string(dir) + "/" + kOutcomeFile);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "sinew coordinator: %s\n", e.what());
      }
    }
    // Rank 0 prints it; when rank 0 is gone (killed), the coordinator says it itself.
    if (!writeAll(fd, outcome.dump() + "\n")) {
      std::fprintf(stderr, "%s\n", outcomeLine(outcome).c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sinew coordinator: %s\n", e.what());
    // Before it reported its port, the reason goes to the process that forked it.
    if (!reported) writeAll(fd, std::string("! ") + e.what() + "\n");
    rc = 1;
  }
  std::fflush(nullptr);
  _exit(rc);
}

// One line from fd (without its newline); false at end of file before any byte.
bool readLine(int fd, std::string* line) {
  line->clear();
  char c;
  for (;;) {
    const ssize_t n = ::read(fd, &c, 1);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return !line->empty();
    if (c == '\n') return true;
    line->push_back(c);
  }
}

}  // namespace

void controlApiFromEnv(CoordinatorOptions& c) {
  if (const char* port = env("SINEW_CONTROL_PORT")) {
    c.controlPort = static_cast<int>(detail::parseInt(port, "SINEW_CONTROL_PORT", 0, 65535));
  }
  if (const char* host = env("SINEW_CONTROL_HOST")) c.controlHost = host;
  // A scheduler may give the tokens (otherwise: the job token, and a drawn read token).
  if (const char* token = env("SINEW_CONTROL_TOKEN")) c.controlToken = token;
  if (const char* token = env("SINEW_CONTROL_READ_TOKEN")) c.controlReadToken = token;
}

CoordinatorProcess forkCoordinator(int expected, const InitOptions& o, const std::string& host,
                                   uint16_t port, uint64_t token) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) SINEW_THROW(IoError, "pipe: ", std::strerror(errno));
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int e = errno;
    ::close(fds[0]);
    ::close(fds[1]);
    SINEW_THROW(IoError, "fork: ", std::strerror(e));
  }
  if (pid == 0) {
    ::close(fds[0]);
    runChild(fds[1], expected, o, host, port, token);
  }
  ::close(fds[1]);
  CoordinatorProcess p;
  p.pid = pid;
  std::string line;
  readLine(fds[0], &line);
  if (line.empty() || line[0] == '!') {
    ::close(fds[0]);
    ::waitpid(pid, nullptr, 0);
    SINEW_THROW(IoError, "the coordinator process (pid ", pid, ") failed to start",
                line.empty() ? std::string() : ": " + line.substr(2));
  }
  p.outcomeFd = fds[0];
  p.announced = line;
  return p;
}

json awaitOutcome(CoordinatorProcess& process) {
  std::string line;
  const bool got = process.outcomeFd >= 0 && readLine(process.outcomeFd, &line);
  if (process.outcomeFd >= 0) ::close(process.outcomeFd);
  process.outcomeFd = -1;
  int status = 0;
  while (process.pid > 0 && ::waitpid(process.pid, &status, 0) < 0 && errno == EINTR) {
  }
  const pid_t pid = process.pid;
  process.pid = -1;
  json outcome = got ? json::parse(line, nullptr, /*allow_exceptions=*/false) : json();
  if (outcome.is_object() && outcome.contains("outcome")) return outcome;
  const std::string how = WIFSIGNALED(status)
                              ? "was killed by signal " + std::to_string(WTERMSIG(status))
                              : "exited " + std::to_string(WEXITSTATUS(status));
  return json{{"outcome", "failed"},
              {"exit_status", 1},
              {"step", -1},
              {"reason", "the job's coordinator (pid " + std::to_string(pid) + ") " + how +
                             " without saying how the job ended"}};
}

}  // namespace runtime
}  // namespace sinew
