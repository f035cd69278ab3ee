// sinew-run: the local launcher (like torchrun --standalone). Starts a coordinator in this
// process and N worker processes of `program`, echoes their output prefixed with the worker
// id (and writes it to <log-dir>/worker-<i>.log), forwards SIGINT/SIGTERM to them, and exits
// with the job's status: 0 when the job finished and every worker that was not declared
// dead exited 0; 75 when every worker was preempted (SIGTERM is forwarded to the workers,
// which leave at the next step boundary) and the job stopped cleanly, resumable from its
// checkpoint directory; 1 otherwise.
//
//   sinew-run -n N [--max-workers M] [--inject SPEC] [--log-dir DIR] [--control-port P]
//             [--drain-signal SIG --drain-deadline-s T] [--quiet] [--] program [args...]
//
// <log-dir>/coordinator.json holds the coordinator's endpoint and token, so another worker
// can join the running job (SINEW_COORDINATOR=host:port SINEW_TOKEN=token program args...),
// and the control API's address and token (docs/control_api.md), which sinewctl reads. A
// resize that grows the job makes sinew-run start joiners, up to --max-workers running at once. The
// coordinator lives in this process: sinew-run stays while the job goes on, also after every
// worker it started has exited, as long as workers that joined from outside are connected.

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "sinew/base/parse.h"
#include "sinew/runtime/coordinator.h"
#include "sinew/runtime/failure_injection.h"
#include "sinew/runtime/job_outcome.h"

namespace {

struct Args {
  int workers = 0;
  std::string inject;
  std::string logDir;
  int heartbeatMs = 100;
  int deadAfterMs = 1000;
  int stepDeadlineMs = 3000;
  int stepDeadlineFactor = 20;
  double deadline = 0;    // the whole job, seconds (0: none)
  double exitGrace = 30;  // after the job ended, for every worker to exit
  bool quiet = false;
  int maxWorkers = 0;            // 0: -n
  bool maxWorkersGiven = false;  // then workers get SINEW_MAX_WORKERS
  int controlPort = 0;
  bool noControl = false;
  std::string controlHost = "127.0.0.1";
  int controlTimeoutMs = 10000;
  int drainSignal = 0;
  double drainDeadline = 120;
  sinew::runtime::control::JobLimits limits;  // --limits
  std::vector<std::string> program;
};

constexpr const char* kUsage =
    "usage: sinew-run -n N [--max-workers M] [--inject SPEC] [--log-dir DIR]\n"
    "                 [--heartbeat-ms MS] [--dead-after-ms MS] [--control-port P]\n"
    "                 [--drain-signal SIG] [--quiet] [--] program [args...]\n";

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

// The options given as text, checked and converted by checkArgs().
struct OptionText {
  std::string workers, heartbeat = "100", deadAfter = "1000", stepDeadline = "3000",
                       stepFactor = "20";
  std::string maxWorkers, controlPort = "0", controlTimeout = "10000", drainSignal,
                          drainDeadline = "120";
  std::string jobDeadline = "0", exitGrace = "30";
  std::string limits;
};

// Declares the options of `app`: the flags into `a`, the values as text into `t`.
void declareOptions(CLI::App& app, Args& a, OptionText& t) {
  app.add_option("-n,--nproc", t.workers, "worker processes to start, in [1, 1000000]")
      ->type_name("N");
  app.add_option("--inject", a.inject, "faults to inject (SINEW_INJECT syntax, docs/runtime.md)")
      ->type_name("SPEC");
  app.add_option("--log-dir", a.logDir,
                 "worker logs and coordinator.json (default sinew-logs/run-PID)")
      ->type_name("DIR");
  app.add_option("--heartbeat-ms", t.heartbeat, "heartbeat interval in ms (default 100)")
      ->type_name("MS");
  app.add_option("--dead-after-ms", t.deadAfter,
                 "silence in ms after which a worker is declared dead (default 1000)")
      ->type_name("MS");
  app.add_option("--step-deadline-ms", t.stepDeadline,
                 "a worker computing while the others have waited for it this long (ms; at least "
                 "--step-deadline-factor x the median step time) is declared dead; 0 turns the "
                 "check off (default 3000)")
      ->type_name("MS");
  app.add_option("--step-deadline-factor", t.stepFactor,
                 "multiple of the median step time the step deadline is at least (default 20)")
      ->type_name("K");
  app.add_option("--max-workers", t.maxWorkers,
                 "workers a resize may grow the job to (joiners this launcher starts; default -n); "
                 "pipeline jobs plan templates up to it (SINEW_MAX_WORKERS)")
      ->type_name("M");
  app.add_option("--control-port", t.controlPort,
                 "port of the HTTP control API (docs/control_api.md; default 0: a free one)")
      ->type_name("P");
  app.add_flag("--no-control", a.noControl, "do not serve the control API");
  app.add_option("--control-host", a.controlHost,
                 "address of the control API (default 127.0.0.1; others need a firewall)")
      ->type_name("HOST");
  app.add_option("--control-timeout-ms", t.controlTimeout,
                 "a control request must arrive within this; idle connections close after it "
                 "(default 10000)")
      ->type_name("MS");
  app.add_option("--drain-signal", t.drainSignal,
                 "a signal (e.g. USR1, as Slurm's --signal=B:USR1@120 sends) that stops the job "
                 "with a durable checkpoint within --drain-deadline-s")
      ->type_name("SIG");
  app.add_option("--drain-deadline-s", t.drainDeadline,
                 "deadline of the stop --drain-signal asks for, in seconds (default 120)")
      ->type_name("T");
  app.add_option("--deadline-s", t.jobDeadline,
                 "the job's deadline in seconds: then it stops at a step boundary with that step "
                 "durable (exit 75), or is killed 60 s later (exit 1); default 0: none")
      ->type_name("T");
  app.add_option("--exit-grace-s", t.exitGrace,
                 "once the job has ended, workers still running after this many seconds are "
                 "killed (default 30)")
      ->type_name("T");
  app.add_flag("--quiet", a.quiet, "do not echo the workers' output (still logged)");
  app.add_option("--limits", t.limits,
                 "the job's limits and wishes for schedulers, as POST /v1/limits takes them: "
                 "JSON with min_nodes, max_nodes, sizes, deadline_unix_s, preemptible, priority "
                 "(docs/control_api.md)")
      ->type_name("JSON");
  app.prefix_command();  // The first positional and everything after it: the program.
}

// Converts the values of `t` into `a`, or exits with usage() naming the option that is wrong.
void checkArgs(const OptionText& t, Args& a) {
  if (t.workers.empty()) usage("-n N is required");
  a.workers = parseCount("-n", t.workers, 1000000);
  a.heartbeatMs = parseCount("--heartbeat-ms", t.heartbeat, 1000000);
  a.deadAfterMs = parseCount("--dead-after-ms", t.deadAfter, 1000000);
  a.stepDeadlineMs = parseCount("--step-deadline-ms", t.stepDeadline, 100000000);
  a.stepDeadlineFactor = parseCount("--step-deadline-factor", t.stepFactor, 1000000);
  a.maxWorkers =
      t.maxWorkers.empty() ? a.workers : parseCount("--max-workers", t.maxWorkers, 1000000);
  a.maxWorkersGiven = !t.maxWorkers.empty();
  if (a.maxWorkers < a.workers) usage("--max-workers must be at least -n");
  {
    int64_t x = 0;
    std::string error =
        sinew::detail::parseIntOrError(t.controlPort, "--control-port", 0, 65535, &x);
    if (!error.empty()) usage(error);
    a.controlPort = static_cast<int>(x);
  }
  a.controlTimeoutMs = parseCount("--control-timeout-ms", t.controlTimeout, 100000000);
  if (!t.drainSignal.empty()) {
    try {
      a.drainSignal = sinew::runtime::signalNumber("--drain-signal", t.drainSignal);
    } catch (const std::exception& e) {
      usage(e.what());
    }
    if (a.drainSignal == SIGINT || a.drainSignal == SIGTERM) {
      usage("--drain-signal must not be INT or TERM (they drain already)");
    }
  }
  auto seconds = [](const std::string& flag, const std::string& v, bool zeroOk) {
    char* end = nullptr;
    const double x = std::strtod(v.c_str(), &end);
    if (v.empty() || *end != '\0' || !(zeroOk ? x >= 0 : x > 0) || !(x <= 1e7)) {
      usage(flag + " = '" + v + "' must be a number of seconds in " + (zeroOk ? "[0" : "(0") +
            ", 1e7]");
    }
    return x;
  };
  a.drainDeadline = seconds("--drain-deadline-s", t.drainDeadline, false);
  a.deadline = seconds("--deadline-s", t.jobDeadline, true);
  a.exitGrace = seconds("--exit-grace-s", t.exitGrace, false);
  if (!t.limits.empty()) {
    try {
      a.limits = sinew::runtime::control::parseLimits(
          sinew::runtime::control::parseObject(t.limits), sinew::runtime::control::JobLimits());
    } catch (const std::exception& e) {
      usage(std::string("--limits: ") + e.what());
    }
  }
  if (a.program.empty()) usage("no program to run");
  if (a.deadAfterMs <= a.heartbeatMs) usage("--dead-after-ms must exceed --heartbeat-ms");
}

Args parse(int argc, char** argv) {
  Args a;
  OptionText t;
  CLI::App app("Starts a coordinator and N worker processes of program (the local launcher).",
               "sinew-run");
  app.footer(
      "Everything from the first non-option argument (or after --) is the program and its\n"
      "arguments. Exit status: 0 when the job finished, 75 when every worker was preempted,\n"
      "2 for bad arguments, 1 otherwise.");
  declareOptions(app, a, t);
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
  checkArgs(t, a);
  return a;
}

// The launcher's children, for the signal handler (a launcher's main is the one place where
// a process-wide table is the natural owner). Its capacity is reserved up front
// (kMaxStartsPerSlot per --max-workers slot: a scheduler may shrink and grow a job again and
// again), so that starting a joiner never moves it under a running handler.
std::vector<pid_t> gChildren;
constexpr size_t kMaxStartsPerSlot = 64;
size_t childCapacity(int maxWorkers) {
  return std::min<size_t>(kMaxStartsPerSlot * static_cast<size_t>(maxWorkers), size_t{1} << 20);
}
// Workers this launcher killed because they outlived the exit grace (their exit fails the job).
std::set<pid_t> gGraceKilled;
// Set by --drain-signal's handler; the main loop asks the coordinator to stop.
volatile sig_atomic_t gDrainSignal = 0;
void onDrainSignal(int) { gDrainSignal = 1; }

// SIGTERM and SIGINT: the first is forwarded, and the workers drain (leave at the next step
// boundary, the last step durable); a second one ends the job at once: every worker is
// SIGKILLed (docs/failure_semantics.md). Only async-signal-safe calls.
volatile sig_atomic_t gSignals = 0;
// SIGINT, SIGTERM and --drain-signal: blocked from the start in every thread, so that the
// threads made later (the coordinator's, the echo thread) inherit the block and only the main
// thread ever runs the handlers. It takes them once every worker is started (a signal that
// came meanwhile is then forwarded to all of them), and blocks them again around each start,
// between the fork and the new pid in gChildren. Each worker gets the default actions and
// gOriginalMask back before exec.
sigset_t gHandled;
sigset_t gOriginalMask;

void forward(int sig) {
  gSignals = gSignals + 1;
  const int send = gSignals >= 2 ? SIGKILL : sig;
  for (pid_t p : gChildren) ::kill(p, send);
}

struct Stream {
  int fd;
  std::string label;  // "worker 3", or "joiner 1" until the coordinator names it
  std::string pending;
  std::FILE* log;
};

// Echoes every worker's output, each line prefixed with its label unless `quiet`, and appends
// it to the worker's log, until every pipe has closed and no more workers will start.
void echoOutputs(std::vector<Stream>& streams, std::mutex& streamsMu,
                 const std::atomic<bool>& noMoreWorkers, bool quiet) {
  while (true) {
    std::vector<pollfd> pfds;
    {
      std::lock_guard<std::mutex> lock(streamsMu);
      size_t open = 0;
      for (auto& s : streams) {
        pfds.push_back({s.fd, POLLIN, 0});  // fd -1: ignored
        open += s.fd >= 0;
      }
      if (open == 0 && noMoreWorkers.load()) break;
    }
    if (::poll(pfds.data(), pfds.size(), 200) < 0 && errno != EINTR) break;
    std::lock_guard<std::mutex> lock(streamsMu);
    for (size_t i = 0; i < pfds.size(); ++i) {
      Stream& s = streams[i];
      if (s.fd < 0 || !(pfds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buf[8192];
      ssize_t n = ::read(s.fd, buf, sizeof(buf));
      if (n <= 0) {
        if (n < 0 && errno == EINTR) continue;
        if (!s.pending.empty() && !quiet) {
          std::printf("[%s] %s\n", s.label.c_str(), s.pending.c_str());
        }
        ::close(s.fd);
        s.fd = -1;
        continue;
      }
      if (s.log) {
        std::fwrite(buf, 1, n, s.log);
        std::fflush(s.log);
      }
      s.pending.append(buf, n);
      size_t nl;
      while ((nl = s.pending.find('\n')) != std::string::npos) {
        if (!quiet) std::printf("[%s] %s\n", s.label.c_str(), s.pending.substr(0, nl).c_str());
        s.pending.erase(0, nl + 1);
      }
      std::fflush(stdout);
    }
  }
}

// Says how the job ended, from the coordinator's view and each worker's exit status (`status`,
// by PID), in its last line and <log-dir>/outcome.json, and returns sinew-run's exit status: 0
// finished, 75 stopped (resumable), 1 failed (also when a worker the job neither declared dead
// nor released exited badly, or the launcher had to kill the job at its deadline).
int reportJob(const Args& a, sinew::runtime::Coordinator& coordinator,
              const std::map<pid_t, int>& statusByPid,
              const std::function<int(size_t, const sinew::runtime::CoordinatorStatus&)>& workerOf,
              bool deadlineKilled) {
  const auto st = coordinator.status();
  std::vector<int> dead = st.dead;
  bool ok = st.finished;
  nlohmann::json outcome = coordinator.outcome();
  // A worker killed (by a signal) after it reported every step done, in a job that finished
  // with nothing left to write (no durable version, or the last step's), took nothing the job
  // committed with it: it does not fail the job. An exit status of its own still does (the
  // examples exit 1 when their last checkpoint could not be written), and so does a worker
  // this launcher had to kill for outliving the exit grace.
  const auto lastDurable = outcome.find("last_durable");
  const bool nothingToWrite =
      lastDurable == outcome.end() || lastDurable->is_null() ||
      (lastDurable->is_object() && lastDurable->value("step", int64_t{-1}) == st.committedStep);
  for (size_t i = 0; i < gChildren.size(); ++i) {
    const auto found = statusByPid.find(gChildren[i]);
    const int s = found == statusByPid.end() ? 0 : found->second;
    const int w = workerOf(i, st);
    bool declaredDead = std::find(dead.begin(), dead.end(), w) != dead.end();
    // A worker the job released (a resize, a drain) had left it: how its process ended later
    // changes nothing the job committed.
    const bool released = std::find(st.released.begin(), st.released.end(), w) != st.released.end();
    std::string how = WIFEXITED(s) ? "exited " + std::to_string(WEXITSTATUS(s))
                                   : "killed by signal " + std::to_string(WTERMSIG(s));
    // A second SIGTERM or SIGINT killed every worker: say so, and not that the job went on.
    if (gSignals >= 2) declaredDead = false;
    // 75: the worker left a job that stopped at a step boundary (Context::finishJob()).
    bool clean = WIFEXITED(s) && (WEXITSTATUS(s) == 0 || (WEXITSTATUS(s) == 75 && st.stopped));
    const bool killedWhenDone = WIFSIGNALED(s) && gSignals < 2 &&
                                gGraceKilled.count(gChildren[i]) == 0 && st.finished &&
                                !st.stopped && !st.failed && nothingToWrite &&
                                std::find(st.done.begin(), st.done.end(), w) != st.done.end();
    if (!clean && !declaredDead && !released && !killedWhenDone) ok = false;
    if (!clean) {
      std::printf(
          "sinew-run: worker %d (pid %d) %s%s\n", w, static_cast<int>(gChildren[i]), how.c_str(),
          declaredDead     ? " (declared dead; the job went on without it)"
          : gSignals >= 2  ? " (sinew-run killed it: a second SIGTERM or SIGINT)"
          : released       ? " (released by the job before; the job went on without it)"
          : killedWhenDone ? " (after it had reported every step done; the job had finished)"
                           : "");
    }
  }
  // The job's outcome as its coordinator saw it, failed too when a worker it did not declare
  // dead exited badly or the launcher had to kill the job; in <log-dir>/outcome.json.
  if (deadlineKilled) ok = false;
  if (!ok && outcome.value("outcome", std::string()) != "failed") {
    outcome["outcome"] = "failed";
    outcome["reason"] = gSignals >= 2 ? "a second SIGTERM or SIGINT: sinew-run killed every worker"
                        : deadlineKilled
                            ? "it did not stop within 60 s of its deadline"
                            : "a worker it neither declared dead nor released exited badly";
  }
  outcome["exit_status"] = !ok ? 1 : st.stopped ? 75 : 0;
  try {
    sinew::runtime::writeOutcomeFile(outcome, a.logDir + "/" + sinew::runtime::kOutcomeFile);
  } catch (const std::exception& e) {
    std::printf("sinew-run: %s\n", e.what());
  }
  std::string deadList;
  for (int d : dead) deadList += (deadList.empty() ? "" : ",") + std::to_string(d);
  std::string releasedList;
  for (int r : st.released) releasedList += (releasedList.empty() ? "" : ",") + std::to_string(r);
  const char* verdict = !ok          ? "FAILED"
                        : st.stopped ? "stopped (every worker preempted or stopped)"
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

// Whether the job has ended: it finished (or stopped), or its epoch has no member left.
bool jobEnded(const sinew::runtime::CoordinatorStatus& cs) {
  return cs.finished || (cs.epoch >= 0 && cs.members.empty());
}

// Joiners a resize asked for: the coordinator counts them (under its lock, so it must not
// fork), the launcher's loop starts them.
struct JoinerRequests {
  std::atomic<int> wanted{0};
  std::atomic<int> granted{0};
  std::atomic<int> exited{0};  // workers of this launcher whose process ended
};

// The coordinator's options from the command line. With the control API, a resize that
// grows the job asks `joiners` for workers, up to --max-workers in all.
sinew::runtime::CoordinatorOptions coordinatorOptions(const Args& a, JoinerRequests& joiners) {
  sinew::runtime::CoordinatorOptions co;
  co.expectedWorkers = a.workers;
  co.limits = a.limits;
  co.heartbeatInterval = std::chrono::milliseconds(a.heartbeatMs);
  co.deadAfter = std::chrono::milliseconds(a.deadAfterMs);
  co.progressFloor = std::chrono::milliseconds(a.stepDeadlineMs);
  co.progressFactor = a.stepDeadlineFactor;
  co.eventLogPath = a.logDir + "/coordinator-events.jsonl";
  co.log = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  if (!a.noControl) {
    co.controlPort = a.controlPort;
    co.controlHost = a.controlHost;
    co.controlTimeout = std::chrono::milliseconds(a.controlTimeoutMs);
    // A scheduler may give the tokens (docs/control_api.md); its child processes never see them.
    if (const char* t = std::getenv("SINEW_CONTROL_TOKEN")) co.controlToken = t;
    if (const char* t = std::getenv("SINEW_CONTROL_READ_TOKEN")) co.controlReadToken = t;
    co.startWorkers = [&a, &joiners](int count) {
      // Room for workers up to --max-workers running at once (a released worker's slot is
      // free once its process exited), within the table's reserved capacity.
      const int running = a.workers + joiners.granted.load() - joiners.exited.load();
      const int starts = a.workers + joiners.granted.load();
      const int room =
          std::min(a.maxWorkers - running, static_cast<int>(childCapacity(a.maxWorkers)) - starts);
      const int n = std::max(0, std::min(count, room));
      joiners.granted += n;
      joiners.wanted += n;
      return n;
    };
  }
  return co;
}

// Starts the workers, echoes their output, reaps them, keeps every wait to its deadline and
// reports how the job ended.
class Launcher {
 public:
  Launcher(const Args& a, sinew::runtime::Coordinator& coordinator, JoinerRequests& joiners)
      : a_(a), coordinator_(coordinator), joiners_(joiners) {
    char token[32];
    std::snprintf(token, sizeof(token), "%llx",
                  static_cast<unsigned long long>(coordinator.token()));
    token_ = token;
    endpoint_ = coordinator.host() + ":" + std::to_string(coordinator.port());
  }

  const std::string& endpoint() const { return endpoint_; }

  // Starts one worker: launch rank `rank`, or a joiner (-1). False if it could not.
  bool start(int rank);

  // Echoes and logs every worker's output until all pipes close and no more workers start.
  void startEchoing() {
    reader_ = std::thread([this] { echoOutputs(streams_, streamsMu_, noMoreWorkers_, a_.quiet); });
  }

  // Reaps the workers until every one it started has exited and the job needs none of them
  // (see keepsRunning()), then says how the job ended; returns sinew-run's exit status.
  int supervise();

 private:
  // The worker id of child i: its launch rank, or the id the coordinator gave the joiner.
  int workerOf(size_t i, const sinew::runtime::CoordinatorStatus& cs) const {
    if (launchRank_[i] >= 0) return launchRank_[i];
    for (const auto& [id, pid] : cs.pids) {
      if (pid == gChildren[i]) return id;
    }
    return -1;
  }
  // Asks the coordinator to stop the job within `deadline` seconds. False while nothing can
  // stop yet (before the first epoch): the caller asks again at the next turn, until the stop
  // is taken or the job has ended.
  bool askStop(double deadline, sinew::runtime::ControlReply* reply) {
    *reply = coordinator_.stop(deadline);
    const auto cs = coordinator_.status();
    return reply->status == 200 || jobEnded(cs);
  }
  // The job's deadline (--deadline-s, then 60 s to stop) and the drain signal.
  void checkDeadlineAndDrain(std::chrono::steady_clock::time_point now);
  // Once the job has ended: --exit-grace-s for every worker to exit, and 2 s for workers it
  // declared dead that still run (their training thread stalled, docs/failure_semantics.md
  // rule 1) to learn they were expelled; then each is killed by its PID.
  void checkExits(std::chrono::steady_clock::time_point now,
                  const sinew::runtime::CoordinatorStatus& cs);
  // Whether to go on once every worker this launcher started has exited: while the job has
  // not ended and workers that joined from outside (SINEW_COORDINATOR, started by someone
  // else) are still connected, the job goes on with them and its coordinator must stay.
  bool keepsRunning(const sinew::runtime::CoordinatorStatus& cs) const {
    const bool ended = jobEnded(cs);
    return !ended && cs.connected > 0 && gSignals < 2 && !deadlineKilled_;
  }

  const Args& a_;
  sinew::runtime::Coordinator& coordinator_;
  JoinerRequests& joiners_;
  std::string token_;
  std::string endpoint_;
  std::mutex streamsMu_;
  std::vector<Stream> streams_;  // Guarded by streamsMu_.
  std::vector<int> launchRank_;  // per child: its launch rank, or -1 for a joiner
  int joinerCount_ = 0;
  std::atomic<bool> noMoreWorkers_{false};
  std::thread reader_;
  std::map<pid_t, int> status_;  // exit statuses of the children reaped, by PID
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  bool drainAsked_ = false;
  // Every wait has a deadline (docs/failure_semantics.md, rule 11).
  bool deadlineStop_ = false, deadlineKilled_ = false, graceKilled_ = false;
  bool graceRunning_ = false, killedStragglers_ = false;
  std::chrono::steady_clock::time_point graceSince_{}, endedAt_{}, quietAt_{};
};

bool Launcher::start(int rank) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    std::perror("sinew-run: pipe");
    return false;
  }
  const std::string label =
      rank >= 0 ? "worker " + std::to_string(rank) : "joiner " + std::to_string(++joinerCount_);
  const std::string logName = rank >= 0 ? "worker-" + std::to_string(rank) + ".log"
                                        : "joiner-" + std::to_string(joinerCount_) + ".log";
  // Everything the child needs is built before fork(): between fork and exec it only makes
  // async-signal-safe calls (other threads may hold locks that would never be released).
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    if (key == "SINEW_COORDINATOR" || key == "SINEW_TOKEN" || key == "SINEW_WORKER_ID" ||
        key == "SINEW_LOG_DIR" || key == "SINEW_CONTROL_TOKEN" ||
        key == "SINEW_CONTROL_READ_TOKEN" || (key == "SINEW_INJECT" && !a_.inject.empty()) ||
        (key == "SINEW_MAX_WORKERS" && a_.maxWorkersGiven)) {
      continue;
    }
    env.push_back(kv);
  }
  env.push_back("SINEW_COORDINATOR=" + endpoint_);
  env.push_back("SINEW_TOKEN=" + token_);
  if (rank >= 0) env.push_back("SINEW_WORKER_ID=" + std::to_string(rank));
  env.push_back("SINEW_LOG_DIR=" + a_.logDir);
  if (!std::getenv("SINEW_NODE")) {
    env.push_back("SINEW_NODE=" + (rank >= 0 ? "local-" + std::to_string(rank)
                                             : "local-joiner-" + std::to_string(joinerCount_)));
  }
  if (!a_.inject.empty()) env.push_back("SINEW_INJECT=" + a_.inject);
  // Pipeline jobs plan templates for the workers the job may grow to
  // (TrainerOptions::maxWorkers).
  if (a_.maxWorkersGiven) env.push_back("SINEW_MAX_WORKERS=" + std::to_string(a_.maxWorkers));
  std::vector<char*> envp;
  for (auto& kv : env) envp.push_back(const_cast<char*>(kv.c_str()));
  envp.push_back(nullptr);
  std::vector<char*> args;
  for (auto& arg : a_.program) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  const std::string cannot = "sinew-run: cannot run " + a_.program[0] + "\n";
  std::fflush(nullptr);
  sigset_t before;
  ::pthread_sigmask(SIG_BLOCK, &gHandled, &before);
  pid_t pid = ::fork();
  if (pid < 0) {
    ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
    std::perror("sinew-run: fork");
    ::close(fds[0]);
    ::close(fds[1]);
    return false;
  }
  if (pid == 0) {
    // The default actions before the signals are taken again: one sent to this worker before
    // its exec ends it rather than running sinew-run's handler in it.
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; ++sig) {
      if (::sigismember(&gHandled, sig) == 1) ::sigaction(sig, &dfl, nullptr);
    }
    ::pthread_sigmask(SIG_SETMASK, &gOriginalMask, nullptr);
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::execvpe(args[0], args.data(), envp.data());
    (void)!::write(2, cannot.data(), cannot.size());
    _exit(127);
  }
  ::close(fds[1]);
  gChildren.push_back(pid);
  ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
  launchRank_.push_back(rank);
  std::string logPath = a_.logDir + "/" + logName;
  {
    std::lock_guard<std::mutex> lock(streamsMu_);
    streams_.push_back({fds[0], label, "", std::fopen(logPath.c_str(), "we")});
  }
  std::printf("sinew-run: %s pid %d log %s\n", label.c_str(), pid, logPath.c_str());
  std::fflush(stdout);
  return true;
}

void Launcher::checkDeadlineAndDrain(std::chrono::steady_clock::time_point now) {
  if (a_.deadline > 0 && !deadlineStop_ &&
      now - started_ > std::chrono::duration<double>(a_.deadline)) {
    sinew::runtime::ControlReply reply;
    if (askStop(60, &reply)) {
      deadlineStop_ = true;
      std::printf(
          "sinew-run: the job's deadline of %g s passed: stopping it at the next step "
          "boundary (%s)\n",
          a_.deadline, reply.body.dump().c_str());
      std::fflush(stdout);
    }
  }
  if (a_.deadline > 0 && !deadlineKilled_ &&
      now - started_ > std::chrono::duration<double>(a_.deadline + 60)) {
    deadlineKilled_ = true;
    std::printf("sinew-run: the job did not stop within 60 s of its deadline; killing it\n");
    std::fflush(stdout);
    for (pid_t p : gChildren) {
      if (!status_.count(p)) ::kill(p, SIGKILL);  // Our own children, by PID.
    }
  }
  if (gDrainSignal && !drainAsked_) {
    sinew::runtime::ControlReply reply;
    if (askStop(a_.drainDeadline, &reply)) {
      drainAsked_ = true;
      std::printf("sinew-run: drain signal: stopping the job within %.0f s: %s\n", a_.drainDeadline,
                  reply.body.dump().c_str());
      std::fflush(stdout);
    }
  }
}

void Launcher::checkExits(std::chrono::steady_clock::time_point now,
                          const sinew::runtime::CoordinatorStatus& cs) {
  const bool ended = jobEnded(cs);
  bool onlyDeadLeft = true;
  for (size_t i = 0; i < gChildren.size(); ++i) {
    if (status_.count(gChildren[i])) continue;
    const int w = workerOf(i, cs);
    onlyDeadLeft = onlyDeadLeft && std::find(cs.dead.begin(), cs.dead.end(), w) != cs.dead.end();
  }
  // Released workers may still be writing their last checkpoint: the grace starts when they
  // are gone (and ten graces after the end in any case).
  const std::chrono::steady_clock::time_point never{};
  if (ended && endedAt_ == never) endedAt_ = now;
  if (ended && cs.releasedRunning.empty() && quietAt_ == never) quietAt_ = now;
  const auto grace = std::chrono::duration<double>(a_.exitGrace);
  if (ended && !graceKilled_ &&
      ((quietAt_ != never && now - quietAt_ > grace) || now - endedAt_ > 10 * grace)) {
    graceKilled_ = true;
    for (size_t i = 0; i < gChildren.size(); ++i) {
      if (status_.count(gChildren[i])) continue;
      std::printf(
          "sinew-run: worker %d (pid %d) still runs %.0f s after the job ended; "
          "killing it\n",
          workerOf(i, cs), static_cast<int>(gChildren[i]), a_.exitGrace);
      ::kill(gChildren[i], SIGKILL);  // Our own child, by PID.
      gGraceKilled.insert(gChildren[i]);
    }
    std::fflush(stdout);
  }
  if (!(ended && onlyDeadLeft)) graceRunning_ = false;
  if (ended && onlyDeadLeft && !killedStragglers_) {
    if (!graceRunning_) {
      graceRunning_ = true;
      graceSince_ = now;
    }
    if (now - graceSince_ > std::chrono::seconds(2)) {
      for (size_t i = 0; i < gChildren.size(); ++i) {
        if (status_.count(gChildren[i])) continue;
        std::printf(
            "sinew-run: worker %d was declared dead and still runs after the job "
            "ended; killing pid %d\n",
            workerOf(i, cs), static_cast<int>(gChildren[i]));
        ::kill(gChildren[i], SIGKILL);  // Our own child, by PID.
      }
      std::fflush(stdout);
      killedStragglers_ = true;
    }
  }
}

int Launcher::supervise() {
  while (true) {
    const auto now = std::chrono::steady_clock::now();
    checkDeadlineAndDrain(now);
    for (int want = joiners_.wanted.exchange(0); want > 0 && gSignals == 0; --want) {
      if (!start(-1)) break;
    }
    const bool ownRunning = status_.size() < gChildren.size();
    if (ownRunning) {
      int st = 0;
      const pid_t p = ::waitpid(-1, &st, WNOHANG);
      if (p < 0 && errno == EINTR) continue;
      if (p < 0) break;
      if (p > 0) {
        status_[p] = st;
        joiners_.exited++;
        continue;
      }
    }
    const auto cs = coordinator_.status();
    if (!ownRunning && joiners_.wanted.load() == 0 && !keepsRunning(cs)) break;
    checkExits(now, cs);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  noMoreWorkers_ = true;
  reader_.join();
  for (auto& s : streams_) {
    if (s.log) std::fclose(s.log);
  }
  return reportJob(
      a_, coordinator_, status_,
      [this](size_t i, const sinew::runtime::CoordinatorStatus& cs) { return workerOf(i, cs); },
      deadlineKilled_);
}

}  // namespace

int main(int argc, char** argv) {
  Args a = parse(argc, argv);
  ::sigemptyset(&gHandled);
  ::sigaddset(&gHandled, SIGINT);
  ::sigaddset(&gHandled, SIGTERM);
  if (a.drainSignal != 0) ::sigaddset(&gHandled, a.drainSignal);
  ::pthread_sigmask(SIG_BLOCK, &gHandled, &gOriginalMask);
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
  gChildren.reserve(childCapacity(a.maxWorkers));

  JoinerRequests joiners;
  std::unique_ptr<sinew::runtime::Coordinator> coordinator;
  try {
    coordinator = std::make_unique<sinew::runtime::Coordinator>(coordinatorOptions(a, joiners));
    sinew::runtime::writeCoordinatorJson(*coordinator, a.logDir + "/coordinator.json");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sinew-run: %s\n", e.what());
    return 1;
  }
  Launcher launcher(a, *coordinator, joiners);
  std::printf("sinew-run: coordinator at %s, %d workers, logs in %s\n", launcher.endpoint().c_str(),
              a.workers, a.logDir.c_str());
  if (coordinator->controlPort() != 0) {
    std::printf("sinew-run: control API at http://%s:%d (token in %s/coordinator.json)\n",
                coordinator->controlHost().c_str(), coordinator->controlPort(), a.logDir.c_str());
  }
  struct sigaction sa {};
  sa.sa_handler = forward;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  if (a.drainSignal != 0) {
    struct sigaction ds {};
    ds.sa_handler = onDrainSignal;
    ::sigaction(a.drainSignal, &ds, nullptr);
  }
  for (int w = 0; w < a.workers; ++w) {
    if (!launcher.start(w)) {
      forward(SIGKILL);
      return 1;
    }
  }
  launcher.startEchoing();
  // A SIGINT or SIGTERM that came while the workers started is forwarded to all of them now.
  ::pthread_sigmask(SIG_UNBLOCK, &gHandled, nullptr);
  return launcher.supervise();
}
