// sinew-run: the local launcher (like torchrun --standalone). Starts a coordinator in this
// process and N worker processes of `program`, echoes their output prefixed with the worker
// id (and writes it to <log-dir>/worker-<i>.log), forwards SIGINT/SIGTERM to them, and exits
// with the job's status: 0 when the job finished and every worker that was not declared
// dead exited 0; 75 when every worker was preempted (SIGTERM is forwarded to the workers,
// which leave at the next step boundary) and the job stopped cleanly, resumable from its
// checkpoint directory; 1 otherwise.
//
//   sinew-run -n N [--inject SPEC] [--log-dir DIR] [--heartbeat-ms MS] [--dead-after-ms MS]
//             [--quiet] [--] program [args...]
//
// <log-dir>/coordinator.json holds the coordinator's endpoint and token, so another worker
// can join the running job: SINEW_COORDINATOR=host:port SINEW_TOKEN=token program args...

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "sinew/collectives/detail/parse.h"
#include "sinew/runtime/coordinator.h"
#include "sinew/runtime/failure_injection.h"

namespace {

struct Args {
  int workers = 0;
  std::string inject;
  std::string logDir;
  int heartbeatMs = 100;
  int deadAfterMs = 1000;
  int stepDeadlineMs = 3000;
  int stepDeadlineFactor = 20;
  bool quiet = false;
  std::vector<std::string> program;
};

constexpr const char* kUsage =
    "usage: sinew-run -n N [--inject SPEC] [--log-dir DIR] [--heartbeat-ms MS]\n"
    "                 [--dead-after-ms MS] [--quiet] [--] program [args...]\n";

[[noreturn]] void usage(const std::string& error) {
  std::fprintf(stderr, "sinew-run: %s\n%s", error.c_str(), kUsage);
  std::exit(2);
}

// Command-line numbers go through the same strict parser as the rest of Sinew.
int parseCount(const std::string& flag, const std::string& v, int64_t max) {
  int64_t x = 0;
  const std::string error = sinew::detail::parseIntOrError(v, flag, 1, max, &x);
  if (!error.empty()) usage(error);
  return static_cast<int>(x);
}

Args parse(int argc, char** argv) {
  Args a;
  CLI::App app("Starts a coordinator and N worker processes of program (the local launcher).",
               "sinew-run");
  app.footer(
      "Everything from the first non-option argument (or after --) is the program and its\n"
      "arguments. Exit status: 0 when the job finished, 75 when every worker was preempted,\n"
      "2 for bad arguments, 1 otherwise.");
  std::string workers, heartbeat = "100", deadAfter = "1000", stepDeadline = "3000",
                       stepFactor = "20";
  app.add_option("-n,--nproc", workers, "worker processes to start, in [1, 1000000]")
      ->type_name("N");
  app.add_option("--inject", a.inject, "faults to inject (SINEW_INJECT syntax, docs/runtime.md)")
      ->type_name("SPEC");
  app.add_option("--log-dir", a.logDir,
                 "worker logs and coordinator.json (default sinew-logs/run-PID)")
      ->type_name("DIR");
  app.add_option("--heartbeat-ms", heartbeat, "heartbeat interval in ms (default 100)")
      ->type_name("MS");
  app.add_option("--dead-after-ms", deadAfter,
                 "silence in ms after which a worker is declared dead (default 1000)")
      ->type_name("MS");
  app.add_option("--step-deadline-ms", stepDeadline,
                 "a worker computing while the others have waited for it this long (ms; at least "
                 "--step-deadline-factor x the median step time) is declared dead; 0 turns the "
                 "check off (default 3000)")
      ->type_name("MS");
  app.add_option("--step-deadline-factor", stepFactor,
                 "multiple of the median step time the step deadline is at least (default 20)")
      ->type_name("K");
  app.add_flag("--quiet", a.quiet, "do not echo the workers' output (still logged)");
  app.prefix_command();  // The first positional and everything after it: the program.
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) std::exit(app.exit(e));  // --help
    usage(e.what());
  }
  // An unknown option before the program lands in remaining() too, in front of it.
  a.program = app.remaining();
  if (!a.program.empty() && a.program.front() == "--") {
    a.program.erase(a.program.begin());
  } else if (!a.program.empty() && a.program.front().size() > 1 && a.program.front()[0] == '-') {
    usage("unknown option '" + a.program.front() + "'");
  }
  if (workers.empty()) usage("-n N is required");
  a.workers = parseCount("-n", workers, 1000000);
  a.heartbeatMs = parseCount("--heartbeat-ms", heartbeat, 1000000);
  a.deadAfterMs = parseCount("--dead-after-ms", deadAfter, 1000000);
  a.stepDeadlineMs = parseCount("--step-deadline-ms", stepDeadline, 100000000);
  a.stepDeadlineFactor = parseCount("--step-deadline-factor", stepFactor, 1000000);
  if (a.program.empty()) usage("no program to run");
  if (a.deadAfterMs <= a.heartbeatMs) usage("--dead-after-ms must exceed --heartbeat-ms");
  return a;
}

// The launcher's children, for the signal handler (a launcher's main is the one place where
// a process-wide table is the natural owner).
std::vector<pid_t> gChildren;

// SIGTERM and SIGINT: the first is forwarded, and the workers drain (leave at the next step
// boundary, the last step durable); a second one ends the job at once: every worker is
// SIGKILLed (docs/failure_semantics.md). Only async-signal-safe calls.
volatile sig_atomic_t gSignals = 0;

void forward(int sig) {
  gSignals = gSignals + 1;
  const int send = gSignals >= 2 ? SIGKILL : sig;
  for (pid_t p : gChildren) ::kill(p, send);
}

struct Stream {
  int fd;
  int worker;
  std::string pending;
  std::FILE* log;
};

}  // namespace

int main(int argc, char** argv) {
  Args a = parse(argc, argv);
  if (!a.inject.empty()) {
    try {
      sinew::runtime::FailureInjector::parse(a.inject);
    } catch (const std::exception& e) {
      usage(std::string("--inject: ") + e.what());
    }
  }
  if (a.logDir.empty()) a.logDir = "sinew-logs/run-" + std::to_string(::getpid());
  std::error_code ec;
  std::filesystem::create_directories(a.logDir, ec);
  if (ec) usage("cannot create --log-dir " + a.logDir + ": " + ec.message());

  sinew::runtime::CoordinatorOptions co;
  co.expectedWorkers = a.workers;
  co.heartbeatInterval = std::chrono::milliseconds(a.heartbeatMs);
  co.deadAfter = std::chrono::milliseconds(a.deadAfterMs);
  co.progressFloor = std::chrono::milliseconds(a.stepDeadlineMs);
  co.progressFactor = a.stepDeadlineFactor;
  co.eventLogPath = a.logDir + "/coordinator-events.jsonl";
  co.log = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  sinew::runtime::Coordinator coordinator(co);
  char token[32];
  std::snprintf(token, sizeof(token), "%llx", static_cast<unsigned long long>(coordinator.token()));
  std::string endpoint = coordinator.host() + ":" + std::to_string(coordinator.port());
  {
    // It holds the job token: readable by this user only, from the moment it exists.
    const std::string path = a.logDir + "/coordinator.json";
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0 || ::fchmod(fd, 0600) != 0) {
      std::fprintf(stderr, "sinew-run: cannot create %s: %s\n", path.c_str(), std::strerror(errno));
      return 1;
    }
    std::string text = nlohmann::json{{"host", coordinator.host()},
                                      {"port", coordinator.port()},
                                      {"token", token},
                                      {"store_port", coordinator.storePort()}}
                           .dump() +
                       "\n";
    bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
    ::close(fd);
    if (!ok) {
      std::fprintf(stderr, "sinew-run: cannot write %s\n", path.c_str());
      return 1;
    }
  }
  std::printf("sinew-run: coordinator at %s, %d workers, logs in %s\n", endpoint.c_str(), a.workers,
              a.logDir.c_str());

  std::vector<Stream> streams;
  for (int w = 0; w < a.workers; ++w) {
    int fds[2];
    if (::pipe(fds) != 0) {
      std::perror("sinew-run: pipe");
      forward(SIGKILL);
      return 1;
    }
    std::fflush(nullptr);
    pid_t pid = ::fork();
    if (pid == 0) {
      ::dup2(fds[1], 1);
      ::dup2(fds[1], 2);
      ::close(fds[0]);
      ::close(fds[1]);
      ::setenv("SINEW_COORDINATOR", endpoint.c_str(), 1);
      ::setenv("SINEW_TOKEN", token, 1);
      ::setenv("SINEW_WORKER_ID", std::to_string(w).c_str(), 1);
      ::setenv("SINEW_LOG_DIR", a.logDir.c_str(), 1);
      if (!std::getenv("SINEW_NODE")) {
        ::setenv("SINEW_NODE", ("local-" + std::to_string(w)).c_str(), 1);
      }
      if (!a.inject.empty()) ::setenv("SINEW_INJECT", a.inject.c_str(), 1);
      std::vector<char*> args;
      for (auto& s : a.program) args.push_back(const_cast<char*>(s.c_str()));
      args.push_back(nullptr);
      ::execvp(args[0], args.data());
      std::fprintf(stderr, "sinew-run: cannot run %s: %s\n", args[0], std::strerror(errno));
      _exit(127);
    }
    ::close(fds[1]);
    gChildren.push_back(pid);
    std::string logPath = a.logDir + "/worker-" + std::to_string(w) + ".log";
    streams.push_back({fds[0], w, "", std::fopen(logPath.c_str(), "w")});
    std::printf("sinew-run: worker %d pid %d log %s\n", w, pid, logPath.c_str());
  }
  std::fflush(stdout);
  struct sigaction sa {};
  sa.sa_handler = forward;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);

  // Echo and log every worker's output until all pipes close.
  std::thread reader([&] {
    size_t open = streams.size();
    while (open > 0) {
      std::vector<pollfd> pfds;
      for (auto& s : streams) pfds.push_back({s.fd, POLLIN, 0});  // fd -1: ignored
      if (::poll(pfds.data(), pfds.size(), 200) < 0 && errno != EINTR) break;
      for (size_t i = 0; i < streams.size(); ++i) {
        Stream& s = streams[i];
        if (s.fd < 0 || !(pfds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        char buf[8192];
        ssize_t n = ::read(s.fd, buf, sizeof(buf));
        if (n <= 0) {
          if (n < 0 && errno == EINTR) continue;
          if (!s.pending.empty() && !a.quiet) {
            std::printf("[worker %d] %s\n", s.worker, s.pending.c_str());
          }
          ::close(s.fd);
          s.fd = -1;
          open--;
          continue;
        }
        if (s.log) {
          std::fwrite(buf, 1, n, s.log);
          std::fflush(s.log);
        }
        s.pending.append(buf, n);
        size_t nl;
        while ((nl = s.pending.find('\n')) != std::string::npos) {
          if (!a.quiet) std::printf("[worker %d] %s\n", s.worker, s.pending.substr(0, nl).c_str());
          s.pending.erase(0, nl + 1);
        }
        std::fflush(stdout);
      }
    }
  });

  // Reaps the workers. A worker declared dead that is still running once the job has ended
  // (its training thread stalled, docs/failure_semantics.md rule 1) gets a 2 s grace to learn
  // it was expelled and exit, then is killed by its PID: the launcher never waits out a hang.
  std::map<pid_t, int> status;
  bool graceRunning = false;
  std::chrono::steady_clock::time_point graceSince{};
  bool killedStragglers = false;
  while (status.size() < gChildren.size()) {
    int st = 0;
    pid_t p = ::waitpid(-1, &st, WNOHANG);
    if (p < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (p > 0) {
      status[p] = st;
      continue;
    }
    auto cs = coordinator.status();
    const bool ended = cs.finished || (cs.epoch >= 0 && cs.members.empty());
    bool onlyDeadLeft = true;
    for (size_t w = 0; w < gChildren.size(); ++w) {
      if (status.count(gChildren[w])) continue;
      onlyDeadLeft = onlyDeadLeft && std::find(cs.dead.begin(), cs.dead.end(),
                                               static_cast<int>(w)) != cs.dead.end();
    }
    if (!(ended && onlyDeadLeft)) graceRunning = false;
    if (ended && onlyDeadLeft && !killedStragglers) {
      auto now = std::chrono::steady_clock::now();
      if (!graceRunning) {
        graceRunning = true;
        graceSince = now;
      }
      if (now - graceSince > std::chrono::seconds(2)) {
        for (size_t w = 0; w < gChildren.size(); ++w) {
          if (status.count(gChildren[w])) continue;
          std::printf(
              "sinew-run: worker %zu was declared dead and still runs after the job "
              "ended; killing pid %d\n",
              w, static_cast<int>(gChildren[w]));
          ::kill(gChildren[w], SIGKILL);  // Our own child, by PID.
        }
        std::fflush(stdout);
        killedStragglers = true;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  reader.join();
  for (auto& s : streams) {
    if (s.log) std::fclose(s.log);
  }

  auto st = coordinator.status();
  std::vector<int> dead = st.dead;
  bool ok = st.finished;
  for (size_t w = 0; w < gChildren.size(); ++w) {
    int s = status[gChildren[w]];
    bool declaredDead = std::find(dead.begin(), dead.end(), static_cast<int>(w)) != dead.end();
    std::string how = WIFEXITED(s) ? "exited " + std::to_string(WEXITSTATUS(s))
                                   : "killed by signal " + std::to_string(WTERMSIG(s));
    bool clean = WIFEXITED(s) && WEXITSTATUS(s) == 0;
    if (!clean && !declaredDead) ok = false;
    if (!clean) {
      std::printf("sinew-run: worker %zu %s%s\n", w, how.c_str(),
                  declaredDead ? " (declared dead; the job went on without it)" : "");
    }
  }
  std::string deadList;
  for (int d : dead) deadList += (deadList.empty() ? "" : ",") + std::to_string(d);
  std::string releasedList;
  for (int r : st.released) releasedList += (releasedList.empty() ? "" : ",") + std::to_string(r);
  const char* verdict = !ok          ? "FAILED"
                        : st.stopped ? "stopped (every worker preempted)"
                                     : "finished";
  std::printf(
      "sinew-run: job %s at step %lld, epoch %lld; workers lost: [%s]; released: [%s]; "
      "logs in %s\n",
      verdict, static_cast<long long>(st.committedStep + 1), static_cast<long long>(st.epoch),
      deadList.c_str(), releasedList.c_str(), a.logDir.c_str());
  std::fflush(stdout);
  // 75 (EX_TEMPFAIL): stopped cleanly before the last step; rerun to resume.
  return !ok ? 1 : st.stopped ? 75 : 0;
}
