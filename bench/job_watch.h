#pragma once

// What the recovery benches share: a sinew-run job started in its own process group, watched
// through its event logs (docs/runtime.md, "Events"), its workers SIGKILLed by the PIDs the
// coordinator logged at their hello, and the times of the steps completed around a kill.

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

namespace sinew_bench {

inline double wallNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The events of one JSON-lines log; a line being written (not yet whole) is skipped.
inline std::vector<nlohmann::json> readEvents(const std::string& file) {
  std::vector<nlohmann::json> out;
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    auto e = nlohmann::json::parse(line, nullptr, false);
    if (!e.is_discarded() && e.contains("event")) out.push_back(std::move(e));
  }
  return out;
}

inline std::string slurp(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// `sinew-run -n <workers> --log-dir <dir> <program...>` in its own process group, its output
// in <dir>.out.
struct Job {
  pid_t pid = -1;
  std::string dir;
  int status = -1;  // its exit status once reaped

  Job(const std::string& dir_, int workers, const std::vector<std::string>& program) : dir(dir_) {
    std::filesystem::create_directories(dir);
    std::vector<std::string> argv = {SINEW_RUN_PATH, "-n", std::to_string(workers), "--log-dir",
                                     dir};
    argv.insert(argv.end(), program.begin(), program.end());
    const std::string out = dir + ".out";
    pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      ::setpgid(0, 0);
      FILE* f = std::freopen(out.c_str(), "w", stdout);
      if (f == nullptr || ::dup2(::fileno(stdout), 2) < 0) ::_exit(127);
      std::vector<char*> cargv;
      for (auto& a : argv) cargv.push_back(a.data());
      cargv.push_back(nullptr);
      ::execv(cargv[0], cargv.data());
      ::_exit(127);
    }
    ::setpgid(pid, pid);
  }

  // Waits for the job to end; returns its exit status.
  int wait() {
    if (status < 0) {
      int raw = 0;
      ::waitpid(pid, &raw, 0);
      reaped(raw);
    }
    return status;
  }

  // Whether the job has ended, without waiting.
  bool ended() {
    int raw = 0;
    if (status < 0 && ::waitpid(pid, &raw, WNOHANG) == pid) reaped(raw);
    return status >= 0;
  }

  void killAll() {
    if (status < 0) ::kill(-pid, SIGKILL);
    wait();
  }

  std::vector<nlohmann::json> eventsOf(int worker) const {
    return readEvents(dir + "/worker-" + std::to_string(worker) + "-events.jsonl");
  }

  // The step worker 0 last reported done (-1 before its first progress event).
  int64_t step() const {
    int64_t s = -1;
    for (const auto& e : eventsOf(0)) {
      if (e["event"] == "progress") s = std::max(s, e["step"].get<int64_t>());
    }
    return s;
  }

  // The PID of `worker`, from the coordinator's hello event.
  pid_t pidOf(int worker) const {
    for (const auto& e : readEvents(dir + "/coordinator-events.jsonl")) {
      if (e["event"] == "hello" && e["worker"] == worker) return e["pid"].get<pid_t>();
    }
    throw std::runtime_error("no hello of worker " + std::to_string(worker) + " in " + dir);
  }

  // Every worker's events named `name`.
  std::vector<nlohmann::json> all(const std::string& name) const {
    std::vector<nlohmann::json> out;
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
      const std::string f = entry.path().filename().string();
      if (f.rfind("worker-", 0) != 0 || f.find("-events.jsonl") == std::string::npos) continue;
      for (auto& e : readEvents(entry.path().string())) {
        if (e["event"] == name) out.push_back(std::move(e));
      }
    }
    return out;
  }

  // The time of the first step completed after `t` in an epoch newer than those of the steps
  // completed by then (a step of the epoch the kill interrupted may still be reported after
  // it by a slower worker; a rollback completes steps again); 0 if none.
  double firstStepAfter(double t) const {
    std::vector<nlohmann::json> ps = all("progress");
    int64_t epochAtKill = -1;
    for (const auto& e : ps) {
      if (e["time"].get<double>() <= t)
        epochAtKill = std::max(epochAtKill, e["epoch"].get<int64_t>());
    }
    double first = 0;
    for (const auto& e : ps) {
      const double at = e["time"].get<double>();
      if (at > t && e["epoch"].get<int64_t>() > epochAtKill && (first == 0 || at < first)) {
        first = at;
      }
    }
    return first;
  }

  // `worker`'s samples/s reports between `from` and `to`, the first one left out (it includes
  // a start or a recovery).
  std::vector<double> rates(int worker, double from, double to) const {
    std::vector<double> r;
    bool skippedFirst = false;
    for (const auto& e : eventsOf(worker)) {
      if (e["event"] != "progress") continue;
      const double at = e["time"].get<double>();
      if (at <= from || at >= to) continue;
      if (!skippedFirst) {
        skippedFirst = true;
        continue;
      }
      r.push_back(e["samples_per_s"].get<double>());
    }
    return r;
  }

  void reaped(int raw) { status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw); }

  // Removes the job's logs and output.
  void remove() const {
    std::filesystem::remove_all(dir);
    std::filesystem::remove(dir + ".out");
  }
};

// Waits for a job whose workers were killed at `t` to end; returns the time of its first step
// completed after the kill (Job::firstStepAfter). Throws, naming `name` and the job's output,
// unless it ended with 0, its output says `expect` (the recovery path it was to take) and it
// completed such a step.
inline double recoveredAfter(Job& job, double t, const std::string& name,
                             const std::string& expect) {
  const int status = job.wait();
  if (status != 0) {
    throw std::runtime_error(name + ": the job failed after the kill (exit " +
                             std::to_string(status) + "; see " + job.dir + ".out)");
  }
  if (slurp(job.dir + ".out").find(expect) == std::string::npos) {
    throw std::runtime_error(name + ": the job's output does not say '" + expect + "' (see " +
                             job.dir + ".out)");
  }
  const double next = job.firstStepAfter(t);
  if (next == 0) throw std::runtime_error(name + ": no step completed after the kill");
  return next;
}

// Waits until worker 0 of `job` reported step `steps` done (giving up after `patience`), then
// SIGKILLs `victims`; returns the kill time.
inline double killAt(Job& job, int64_t steps, const std::vector<int>& victims,
                     std::chrono::seconds patience = std::chrono::minutes(5)) {
  const auto deadline = std::chrono::steady_clock::now() + patience;
  while (job.step() < steps) {
    if (std::chrono::steady_clock::now() > deadline) {
      throw std::runtime_error("job in " + job.dir + " did not reach step " +
                               std::to_string(steps));
    }
    if (job.ended()) {
      throw std::runtime_error("job in " + job.dir + " ended before step " + std::to_string(steps) +
                               " (see " + job.dir + ".out)");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::vector<pid_t> pids;
  for (int v : victims) pids.push_back(job.pidOf(v));
  const double t = wallNow();
  for (pid_t p : pids) ::kill(p, SIGKILL);
  return t;
}

}  // namespace sinew_bench
