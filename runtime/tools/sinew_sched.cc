// sinew-sched: a reference elastic scheduler over several Sinew jobs (docs/scheduler.md). It
// runs the jobs of a job list on a pool of worker slots, each job under its own sinew-run (local
// processes here; on Slurm, the same loop would start each job's workers in the allocation), and
// reallocates the slots among the running jobs at every arrival, completion and loss of a
// worker, through the control API alone (GET /v1/status and /v1/scaling, POST /v1/resize).
//
//   sinew-sched --jobs LIST.json --slots N [--policy marginal|static] --log-dir DIR
//               [--sinew-run PATH] [--tick-ms T] [--realloc-s R] [--timeout-s S]
//               [--stop-grace-s G] [--min-gain M]
//
// Policies: `static` gives each running job an equal share of the slots (within its limits);
// `marginal` (after AFS, Hwang et al., NSDI '21) starts every job at its minimum and hands out
// each further slot to the job whose rate of finishing, 1 / time to finish, it raises most, from
// the job's own /v1/scaling (throughput per size as measured and predicted, the pause of going
// there, the work left). Jobs are admitted in arrival order while their minimum fits.
//
// The job list: {"jobs": [{"name": "a", "arrival_s": 0, "command": ["train_dp", "--steps",
// "300"], "min_workers": 1, "max_workers": 4, "inject": "slow:worker=*:us_per_sample=500"}]}.
// Each job's output goes to DIR/<name>.log; DIR/report.json says, per job, when it arrived,
// started and ended, its exit status, its resizes and the max_param_rel_diff of its RESULT lines
// (the programs' comparison with their single-process reference). The last line printed is
//   SCHED policy=<p> jobs=<n> finished=<k> exact=<e> mean_jct_s=<x> makespan_s=<y>
// Exit status: 0 when every job finished, 1 otherwise, 2 for bad arguments or a bad job list,
// 75 when stopped by SIGINT or SIGTERM (1 if a job then ended otherwise than finished or
// stopped). The first such signal is forwarded to every running
// job's sinew-run as SIGTERM (its workers leave at the next step boundary, the last step
// durable where the job checkpoints; sinew-run exits 75), no job starts after it, and
// sinew-sched writes the report once they have ended; a second one (or --stop-grace-s without
// the jobs stopping) is forwarded too, and sinew-run then kills its workers at once. Each job
// runs in a process group of its own: a terminal's Ctrl-C reaches sinew-sched alone.

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "control_http.h"
#include "sinew/sim/allocation.h"

namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
namespace http = boost::beast::http;

struct JobSpec {
  std::string name;
  double arrival = 0;
  std::vector<std::string> command;
  int minWorkers = 1;
  int maxWorkers = 1;
  std::string inject;
};

struct Job {
  JobSpec spec;
  enum class State { kWaiting, kRunning, kDone } state = State::kWaiting;
  pid_t pid = -1;
  std::string logDir, logFile;
  std::optional<sinew::tools::ControlTarget> api;
  bool admitted = false;  // arrived: counts in the allocation
  int want = 0;           // the allocation's workers for it
  int target = 0;         // workers asked for (the launch's -n, then each resize)
  int64_t lostSeen = 0;   // failures it has asked to replace
  json status, scaling;
  int64_t failures = 0;
  double started = -1, ended = -1;
  int exitStatus = -1;
  json resizes = json::array();
};

// SIGINT and SIGTERM: counted here, acted on by the main loop (only async-signal-safe code).
volatile std::sig_atomic_t gStopSignals = 0;
volatile std::sig_atomic_t gStopSignal = 0;
void onStopSignal(int sig) {
  gStopSignal = sig;
  gStopSignals = gStopSignals + 1;
}

[[noreturn]] void fail(int code, const std::string& why) {
  std::fprintf(stderr, "sinew-sched: %s\n", why.c_str());
  std::exit(code);
}

std::vector<JobSpec> readJobs(const std::string& path) {
  std::ifstream in(path);
  if (!in) fail(2, "cannot read the job list " + path);
  const json j = json::parse(in, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("jobs") || !j["jobs"].is_array() ||
      j["jobs"].empty()) {
    fail(2, path + ": expected {\"jobs\": [...]} with at least one job");
  }
  std::vector<JobSpec> out;
  for (const json& e : j["jobs"]) {
    const std::string where = path + ": job " + std::to_string(out.size());
    try {
      JobSpec s;
      s.name = e.at("name").get<std::string>();
      if (s.name.empty() ||
          s.name.find_first_not_of("abcdefghijklmnopqrstuvwxyz"
                                   "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_") != std::string::npos) {
        fail(2, where + ": 'name' must be letters, digits, '-' or '_'");
      }
      s.arrival = e.value("arrival_s", 0.0);
      s.command = e.at("command").get<std::vector<std::string>>();
      s.minWorkers = e.value("min_workers", 1);
      s.maxWorkers = e.value("max_workers", s.minWorkers);
      s.inject = e.value("inject", std::string());
      if (s.command.empty()) fail(2, where + ": 'command' is empty");
      if (s.arrival < 0 || s.minWorkers < 1 || s.maxWorkers < s.minWorkers) {
        fail(2, where + ": needs arrival_s >= 0 and 1 <= min_workers <= max_workers");
      }
      for (const JobSpec& o : out) {
        if (o.name == s.name) fail(2, where + ": the name '" + s.name + "' is taken");
      }
      out.push_back(std::move(s));
    } catch (const json::exception& x) {
      fail(2, where + ": " + x.what());
    }
  }
  return out;
}

class Scheduler {
 public:
  Scheduler(std::vector<JobSpec> specs, int slots, sinew::sim::AllocationPolicy policy,
            std::string dir, std::string sinewRun)
      : slots_(slots), policy_(policy), dir_(std::move(dir)), sinewRun_(std::move(sinewRun)) {
    for (auto& s : specs) {
      Job j;
      j.spec = std::move(s);
      j.logDir = dir_ + "/" + j.spec.name;
      j.logFile = dir_ + "/" + j.spec.name + ".log";
      jobs_.push_back(std::move(j));
    }
    std::stable_sort(jobs_.begin(), jobs_.end(),
                     [](const Job& a, const Job& b) { return a.spec.arrival < b.spec.arrival; });
  }

  void setStopGrace(double seconds) { stopGraceS_ = seconds; }
  void setMinGain(double share) { minGain_ = share; }

  int run(std::chrono::milliseconds tick, double timeoutS, double reallocS) {
    start_ = Clock::now();
    bool changed = true;
    double lastAllocation = 0;
    while (true) {
      const double now = elapsed();
      if (now > timeoutS && !timedOut_) {
        timedOut_ = true;
        log("timed out after " + std::to_string(timeoutS) + " s; ending the jobs left");
      }
      changed = reap() || changed;
      if (stopping()) {
        bool running = false;
        for (const Job& j : jobs_) running = running || j.state == Job::State::kRunning;
        if (!running) break;
        std::this_thread::sleep_for(tick);
        continue;
      }
      for (Job& j : jobs_) {
        if (j.state == Job::State::kWaiting && j.spec.arrival <= now && !j.admitted) {
          j.admitted = true;
          log("job " + j.spec.name + " arrives");
          changed = true;
        }
      }
      for (Job& j : jobs_) {
        if (j.state == Job::State::kRunning) changed = poll(j) || changed;
      }
      // Also every reallocS: the running jobs' curves have new measurements.
      if (changed || now - lastAllocation >= reallocS) {
        reallocate();
        changed = false;
        lastAllocation = now;
      }
      apply();
      bool left = false;
      for (const Job& j : jobs_) left = left || j.state != Job::State::kDone;
      if (!left) break;
      std::this_thread::sleep_for(tick);
    }
    const int status = report();
    if (stopSignals_ == 0) return status;
    // Stopped: 75, unless a job ended otherwise than finished (0) or stopped (75).
    for (const Job& j : jobs_) {
      if (j.exitStatus >= 0 && j.exitStatus != 0 && j.exitStatus != 75) return 1;
    }
    return 75;
  }

 private:
  double elapsed() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }
  void log(const std::string& s) const {
    std::printf("[%7.2f] %s\n", elapsed(), s.c_str());
    std::fflush(stdout);
  }

  // Ending the jobs, one step per call (every tick) and never a SIGKILL of a sinew-run alone,
  // which would leave its workers training: a first SIGTERM to each running job's sinew-run
  // (the job stops at its next step boundary, sinew-run exits 75); a second one, at a second
  // SIGINT or SIGTERM, after --stop-grace-s, or at once after --timeout-s (sinew-run kills its
  // workers); 30 s later, SIGKILL to what is left of each job's process group. True once the
  // jobs are being ended: nothing starts or moves after that.
  bool stopping() {
    const double now = elapsed();
    const int signals = gStopSignals;
    std::string why;
    if (stopLevel_ < 3 && stopSignals_ < signals) {
      ++stopSignals_;
      why = std::string("got ") + (gStopSignal == SIGINT ? "SIGINT" : "SIGTERM") +
            (stopLevel_ == 0   ? ": stopping every running job at its next step boundary "
                                 "(SIGTERM to its sinew-run); no job starts now"
             : stopLevel_ == 1 ? " again: each sinew-run kills its workers"
                               : " a third time: SIGKILL to the jobs' process groups");
    } else if (stopLevel_ == 0 && timedOut_) {
      why = "SIGTERM to every running job's sinew-run";
    } else if (stopLevel_ == 1 && now - stopAt_ > (timedOut_ ? 0.2 : stopGraceS_)) {
      why = timedOut_ ? "a second SIGTERM: each sinew-run kills its workers"
                      : "the jobs did not stop within --stop-grace-s: a second SIGTERM, each "
                        "sinew-run kills its workers";
    } else if (stopLevel_ == 2 && now - stopAt_ > 30) {
      why = "jobs left 30 s after the second SIGTERM: SIGKILL to their process groups";
    }
    if (!why.empty()) {
      log(why);
      ++stopLevel_;
      stopAt_ = now;
      for (const Job& j : jobs_) {
        if (j.state != Job::State::kRunning) continue;
        // Our children, by PID; each leads a process group of its own (launch()).
        if (stopLevel_ <= 2) ::kill(j.pid, SIGTERM);
        if (stopLevel_ == 3) ::kill(-j.pid, SIGKILL);
      }
    }
    return stopLevel_ > 0;
  }

  // Workers the job holds slots for: its target, or more while released workers still run.
  static int held(const Job& j) {
    if (j.state != Job::State::kRunning) return 0;
    int members = 0, releasedRunning = 0;
    if (j.status.is_object()) {
      members = static_cast<int>(j.status.value("members", json::array()).size() +
                                 j.status.value("pending_joiners", json::array()).size());
      for (const json& r : j.status.value("released", json::array())) {
        releasedRunning += r.value("exited", true) ? 0 : 1;
      }
    }
    return std::max(j.target, members) + releasedRunning;
  }
  int freeSlots() const {
    int used = 0;
    for (const Job& j : jobs_) used += held(j);
    return slots_ - used;
  }

  bool reap() {
    bool any = false;
    while (true) {
      // Looks first (WNOWAIT): while the exited sinew-run is a zombie its pid, and so its
      // process group's id, is no one else's; what it left in that group (its workers, had it
      // died before them) is killed before it is reaped. A sinew-run that ended normally
      // waited for its workers, so the group is empty then.
      siginfo_t info{};
      if (::waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid == 0) break;
      const pid_t p = info.si_pid;
      ::kill(-p, SIGKILL);  // Our child's own group (launch()); the zombie itself ignores it.
      int st = 0;
      if (::waitpid(p, &st, 0) != p) break;
      for (Job& j : jobs_) {
        if (j.pid != p) continue;
        j.state = Job::State::kDone;
        j.ended = elapsed();
        j.exitStatus = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        j.target = 0;
        log("job " + j.spec.name + " ended (exit " + std::to_string(j.exitStatus) + ") after " +
            std::to_string(j.ended - j.spec.arrival) + " s");
        any = true;
      }
    }
    return any;
  }
  std::optional<json> get(Job& j, const std::string& path) {
    if (!j.api) {
      std::ifstream in(j.logDir + "/coordinator.json");
      const json c = json::parse(in, nullptr, false);
      if (c.is_discarded() || !c.is_object() || !c.contains("control_port")) return std::nullopt;
      j.api = sinew::tools::ControlTarget{c.value("control_host", std::string("127.0.0.1")),
                                          std::to_string(c["control_port"].get<int>()),
                                          c.value("control_token", std::string())};
    }
    try {
      auto [code, text] = sinew::tools::controlRequest(*j.api, http::verb::get, path, "",
                                                       std::chrono::seconds(5), "sinew-sched");
      if (code != 200) return std::nullopt;
      json b = json::parse(text, nullptr, false);
      if (b.is_discarded()) return std::nullopt;
      return b;
    } catch (const std::exception&) {
      return std::nullopt;  // The job is starting or ending.
    }
  }

  // Reads the job's status; true when a worker was lost (a reallocation is due).
  bool poll(Job& j) {
    auto s = get(j, "/v1/status");
    if (!s) return false;
    j.status = *s;
    const int64_t failures = s->value("failures", int64_t{0});
    const bool lost = failures > j.failures;
    if (lost)
      log("job " + j.spec.name + " lost " + std::to_string(failures - j.failures) + " worker(s)");
    j.failures = failures;
    return lost;
  }

  // The job's time to finish at n workers: from its scaling curve where it has one, else
  // linear in n from what any job measured per worker (a prior for a job not yet measured).
  double timeToFinish(Job& j, int n) {
    if (j.state == Job::State::kRunning && j.scaling.is_object()) {
      for (const json& p : j.scaling.value("points", json::array())) {
        if (p.value("workers", 0) != n) continue;
        if (!p.value("feasible", false)) return HUGE_VAL;
        const json& t = p["time_to_finish_s"];
        if (t.is_number()) return std::max(1e-3, t.get<double>());
      }
    }
    // No prediction: the job's work left at the pool's median per-worker rate, in samples.
    std::vector<double> perWorker;
    for (const Job& o : jobs_) {
      if (!o.status.is_object()) continue;
      const json& now = o.status["samples_per_s"]["now"];
      const size_t members = o.status.value("members", json::array()).size();
      if (now.is_number() && now.get<double>() > 0 && members > 0) {
        perWorker.push_back(now.get<double>() / members);
      }
    }
    std::sort(perWorker.begin(), perWorker.end());
    const double rate = perWorker.empty() ? 100.0 : perWorker[perWorker.size() / 2];
    double stepsLeft = 0, batch = 64;
    if (j.status.is_object() && j.status["steps"].is_number()) {
      stepsLeft = j.status["steps"].get<double>() - j.status.value("step", 0.0);
      if (j.scaling.is_object() && j.scaling["global_batch"].is_number()) {
        batch = j.scaling["global_batch"].get<double>();
      }
    } else {
      stepsLeft = stepsOf(j.spec);
    }
    return std::max(1e-3, stepsLeft * batch / (rate * n));
  }
  // Twice the largest size the job's curve has a measurement at (twice its minimum before any).
  static int knownUpTo(const Job& j) {
    int largest = j.spec.minWorkers;
    if (j.scaling.is_object()) {
      for (const json& p : j.scaling.value("points", json::array())) {
        if (p.contains("measured_samples_per_s"))
          largest = std::max(largest, p.value("workers", 0));
      }
    }
    return 2 * largest;
  }
  static double stepsOf(const JobSpec& s) {
    for (size_t k = 0; k + 1 < s.command.size(); ++k) {
      if (s.command[k] == "--steps") return std::atof(s.command[k + 1].c_str());
    }
    return 80;  // the examples' default
  }

  // The allocation (sim/allocation.h, the same function the cluster simulator runs): the
  // running jobs keep their minimum, waiting ones are admitted in arrival order while theirs
  // fits, then the policy hands out the rest.
  void reallocate() {
    std::vector<Job*> active;
    std::vector<sinew::sim::AllocationJob> view;
    for (Job& j : jobs_) {
      if (j.state == Job::State::kDone || !j.admitted) continue;
      if (j.state == Job::State::kRunning) {
        if (auto s = get(j, "/v1/scaling")) j.scaling = *s;
      }
      sinew::sim::AllocationJob a;
      a.min_workers = j.spec.minWorkers;
      a.max_workers = j.spec.maxWorkers;
      a.running = j.state == Job::State::kRunning;
      a.current = a.running ? j.target : 0;
      a.known_up_to = knownUpTo(j);
      Job* jp = &j;
      a.time_to_finish = [this, jp](int n) { return timeToFinish(*jp, n); };
      active.push_back(&j);
      view.push_back(std::move(a));
    }
    const std::vector<int> counts = sinew::sim::allocate(view, slots_, policy_, minGain_);
    std::map<Job*, int> want;
    for (size_t k = 0; k < active.size(); ++k) want[active[k]] = counts[k];
    std::string line;
    bool moved = false;
    for (Job* j : active) {
      moved = moved || j->want != want[j];
      j->want = want[j];
      line += " " + j->spec.name + "=" + std::to_string(want[j]);
    }
    if (moved)
      log(std::string("allocation (") + sinew::sim::allocationPolicyName(policy_) + "):" + line);
  }

  // Moves each job towards its allocation: shrinks at once, grows and starts as slots free up.
  void apply() {
    if (gStopSignals != 0) return;  // stopping() acts on it at the next tick
    for (Job& j : jobs_) {
      if (j.state == Job::State::kRunning && j.want < j.target && j.want > 0) resize(j, j.want);
    }
    for (Job& j : jobs_) {
      if (j.state == Job::State::kRunning && j.want > j.target) {
        const int room = freeSlots();
        if (room > 0) resize(j, std::min(j.want, j.target + room));
      }
      if (j.state == Job::State::kWaiting && j.admitted && j.want > 0 && freeSlots() >= j.want) {
        launch(j);
      }
    }
    // A job that lost workers and keeps its allocation asks for them again.
    for (Job& j : jobs_) {
      if (j.state != Job::State::kRunning || !j.status.is_object()) continue;
      const int members = static_cast<int>(j.status.value("members", json::array()).size());
      if (j.lostSeen < j.failures && j.status.value("state", "") == "running" &&
          members < j.target) {
        j.lostSeen = j.failures;
        resize(j, j.target, /*again=*/true);
      }
    }
  }

  void resize(Job& j, int workers, bool again = false) {
    if (!j.api || (!again && workers == j.target)) return;
    try {
      auto [code, text] = sinew::tools::controlRequest(*j.api, http::verb::post, "/v1/resize",
                                                       json{{"nodes", workers}}.dump(),
                                                       std::chrono::seconds(5), "sinew-sched");
      const json answer = json::parse(text, nullptr, false);
      log("job " + j.spec.name + ": resize " + std::to_string(j.target) + " -> " +
          std::to_string(workers) + ": " + std::to_string(code) + " " +
          (answer.is_discarded() ? text : answer.dump()).substr(0, 200));
      if (code == 200) {
        j.resizes.push_back({{"at_s", elapsed()}, {"from", j.target}, {"to", workers}});
        j.target = workers;
      } else {
        j.want = j.target;  // Refused (the job is ending, a limit): until the next allocation.
      }
    } catch (const std::exception& e) {
      log("job " + j.spec.name + ": resize failed: " + e.what());
    }
  }

  void launch(Job& j) {
    std::vector<std::string> args = {sinewRun_,
                                     "-n",
                                     std::to_string(j.want),
                                     "--max-workers",
                                     std::to_string(j.spec.maxWorkers),
                                     "--log-dir",
                                     j.logDir,
                                     "--quiet"};
    if (!j.spec.inject.empty()) {
      args.push_back("--inject");
      args.push_back(j.spec.inject);
    }
    args.insert(args.end(), j.spec.command.begin(), j.spec.command.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::FILE* out = std::fopen(j.logFile.c_str(), "w");
    if (out == nullptr) fail(1, "cannot write " + j.logFile);
    // The child leads a process group of its own, so that a terminal's Ctrl-C reaches this
    // scheduler only (which stops the jobs at a step boundary) and a last SIGKILL reaches
    // sinew-run with its workers; our stop signals are held until it has the default ones.
    sigset_t stops, before;
    sigemptyset(&stops);
    sigaddset(&stops, SIGINT);
    sigaddset(&stops, SIGTERM);
    ::sigprocmask(SIG_BLOCK, &stops, &before);
    const pid_t pid = ::fork();
    if (pid < 0) fail(1, "fork failed");
    if (pid == 0) {
      ::setpgid(0, 0);
      ::signal(SIGINT, SIG_DFL);
      ::signal(SIGTERM, SIG_DFL);
      ::sigprocmask(SIG_SETMASK, &before, nullptr);
      // Not the terminal: a background process group reading it would be stopped.
      const int devNull = ::open("/dev/null", O_RDONLY);
      if (devNull >= 0) ::dup2(devNull, 0);
      ::dup2(::fileno(out), 1);
      ::dup2(::fileno(out), 2);
      ::execvp(argv[0], argv.data());
      std::perror("sinew-sched: exec");
      _exit(127);
    }
    ::setpgid(pid, pid);  // also here: whichever runs first
    ::sigprocmask(SIG_SETMASK, &before, nullptr);
    std::fclose(out);
    j.pid = pid;
    j.state = Job::State::kRunning;
    j.started = elapsed();
    j.target = j.want;
    log("job " + j.spec.name + " starts on " + std::to_string(j.want) + " workers (pid " +
        std::to_string(pid) + ")");
  }

  int report() {
    json jobs = json::array();
    double sumJct = 0, makespan = 0;
    int finished = 0, exact = 0;
    const std::regex result("max_param_rel_diff=([0-9.eE+-]+|nan|inf)");
    for (const Job& j : jobs_) {
      // The workers' logs (sinew-run writes one per worker it started in the job's log
      // directory: worker-<rank>.log, joiner-<k>.log).
      std::string out;
      std::error_code ec;
      for (const auto& f : std::filesystem::directory_iterator(j.logDir, ec)) {
        const std::string name = f.path().filename().string();
        if ((name.rfind("worker-", 0) != 0 && name.rfind("joiner-", 0) != 0) ||
            f.path().extension() != ".log") {
          continue;
        }
        std::ifstream in(f.path());
        std::stringstream text;
        text << in.rdbuf();
        out += text.str();
      }
      double worst = -1;
      int results = 0;
      for (std::sregex_iterator it(out.begin(), out.end(), result), end; it != end; ++it) {
        const double d = std::atof((*it)[1].str().c_str());
        worst = std::isnan(d) || std::isnan(worst) ? NAN : std::max(worst, d);
        results++;
      }
      const bool ok = j.exitStatus == 0;
      const bool isExact = results > 0 && worst >= 0 && worst <= 1e-5;
      finished += ok ? 1 : 0;
      exact += isExact ? 1 : 0;
      const double jct = j.ended >= 0 ? j.ended - j.spec.arrival : NAN;
      if (ok) sumJct += jct;
      makespan = std::max(makespan, j.ended);
      jobs.push_back({{"name", j.spec.name},
                      {"arrival_s", j.spec.arrival},
                      {"started_s", j.started},
                      {"ended_s", j.ended},
                      {"jct_s", jct},
                      {"exit", j.exitStatus},
                      {"failures", j.failures},
                      {"resizes", j.resizes},
                      {"results", results},
                      {"max_param_rel_diff", results > 0 ? json(worst) : json(nullptr)},
                      {"exact", isExact}});
    }
    const double mean = finished > 0 ? sumJct / finished : NAN;
    json r = {{"policy", sinew::sim::allocationPolicyName(policy_)},
              {"slots", slots_},
              {"jobs", jobs},
              {"mean_jct_s", mean},
              {"makespan_s", makespan},
              {"finished", finished},
              {"exact", exact}};
    std::ofstream(dir_ + "/report.json") << r.dump(2) << "\n";
    std::printf("SCHED policy=%s jobs=%zu finished=%d exact=%d mean_jct_s=%.2f makespan_s=%.2f\n",
                sinew::sim::allocationPolicyName(policy_), jobs_.size(), finished, exact, mean,
                makespan);
    return finished == static_cast<int>(jobs_.size()) ? 0 : 1;
  }

  int slots_;
  int stopSignals_ = 0;  // SIGINTs and SIGTERMs acted on
  int stopLevel_ = 0;    // stopping(): signals sent to the jobs (3: SIGKILL)
  double stopAt_ = 0;    // when the last of them was sent
  bool timedOut_ = false;
  double stopGraceS_ = 120;
  double minGain_ = 0.05;
  sinew::sim::AllocationPolicy policy_;
  std::string dir_, sinewRun_;
  std::vector<Job> jobs_;
  Clock::time_point start_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("A reference elastic scheduler over Sinew jobs (docs/scheduler.md).", "sinew-sched");
  std::string jobsPath, policy = "marginal", dir, sinewRun;
  int slots = 0, tickMs = 250;
  double timeoutS = 3600, reallocS = 5, stopGraceS = 120, minGain = 0.05;
  app.add_option("--jobs", jobsPath, "the job list (JSON)")->required();
  app.add_option("--slots", slots, "worker slots in the pool")
      ->required()
      ->check(CLI::Range(1, 100000));
  app.add_option("--policy", policy, "marginal (default) or static")
      ->check(CLI::IsMember({"marginal", "static"}));
  app.add_option("--log-dir", dir, "where each job's logs and the report go")->required();
  app.add_option("--sinew-run", sinewRun, "the launcher (default: sinew-run beside this program)");
  app.add_option("--tick-ms", tickMs, "how often the jobs are read (default 250)")
      ->check(CLI::Range(10, 60000));
  app.add_option("--realloc-s", reallocS,
                 "reallocate at least this often, with the jobs' newest curves (default 5)")
      ->check(CLI::Range(0.1, 1e6));
  app.add_option("--min-gain", minGain,
                 "marginal: keep the running jobs' sizes unless a new allocation raises their "
                 "summed rate of finishing by more than this share (default 0.05; 0: always move)")
      ->check(CLI::Range(0.0, 10.0));
  app.add_option("--stop-grace-s", stopGraceS,
                 "after a SIGINT or SIGTERM, how long the jobs have to stop at a step boundary "
                 "before their workers are killed (default 120)")
      ->check(CLI::Range(0.0, 1e6));
  app.add_option("--timeout-s", timeoutS, "kill what still runs after this long (default 3600)")
      ->check(CLI::Range(1.0, 1e6));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  if (sinewRun.empty()) {
    char self[4096];
    const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
    std::string me = n > 0 ? std::string(self, static_cast<size_t>(n)) : std::string(argv[0]);
    sinewRun = me.substr(0, me.rfind('/') + 1) + "sinew-run";
  }
  std::vector<JobSpec> specs = readJobs(jobsPath);
  for (const JobSpec& s : specs) {
    if (s.minWorkers > slots) {
      fail(2, "job " + s.name + " needs " + std::to_string(s.minWorkers) +
                  " workers; the pool has " + std::to_string(slots));
    }
  }
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) fail(2, "cannot create " + dir);
  Scheduler sched(std::move(specs), slots, sinew::sim::parseAllocationPolicy(policy), dir,
                  sinewRun);
  struct sigaction sa {};
  sa.sa_handler = onStopSignal;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaddset(&sa.sa_mask, SIGINT);
  sigaddset(&sa.sa_mask, SIGTERM);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  sched.setStopGrace(stopGraceS);
  sched.setMinGain(minGain);
  return sched.run(std::chrono::milliseconds(tickMs), timeoutS, reallocS);
}
