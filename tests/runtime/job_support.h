#pragma once

// Whole jobs under sinew-run for the job tests: start a launcher with its output captured,
// read it until it exits or a deadline passes (then SIGTERM, then SIGKILL), and parse the
// examples' RESULT line. Every child is killed by its PID only.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace sinew {
namespace testing {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

struct JobRun {
  int exitCode = -1;
  bool timedOut = false;
  std::string output;
};

struct Child {
  pid_t pid = -1;
  int fd = -1;
};

// Starts argv with env added, its output to a pipe; with ownGroup in a process group of its own
// (its PID), as launchers start a rank, so that a test can signal it and what it forks.
inline Child start(const std::vector<std::string>& argv,
                   const std::map<std::string, std::string>& env, bool ownGroup = false) {
  int fds[2];
  if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
  pid_t pid = ::fork();
  if (pid == 0) {
    if (ownGroup) ::setpgid(0, 0);
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    ::close(fds[0]);
    ::close(fds[1]);
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> args;
    for (const auto& s : argv) args.push_back(const_cast<char*>(s.c_str()));
    args.push_back(nullptr);
    ::execvp(args[0], args.data());
    _exit(127);
  }
  ::close(fds[1]);
  return {pid, fds[0]};
}

// Reads the child's output until it exits or the deadline passes (then SIGTERM, which
// sinew-run forwards to its workers, and SIGKILL after 5 s).
inline JobRun finish(Child c, std::chrono::seconds timeout) {
  JobRun r;
  auto deadline = Clock::now() + timeout;
  bool terminated = false;
  while (true) {
    pollfd p{c.fd, POLLIN, 0};
    ::poll(&p, 1, 100);
    if (p.revents & (POLLIN | POLLHUP)) {
      char buf[8192];
      ssize_t n = ::read(c.fd, buf, sizeof(buf));
      if (n > 0) {
        r.output.append(buf, n);
        continue;
      }
      if (n == 0) break;
    }
    if (Clock::now() > deadline && !terminated) {
      r.timedOut = true;
      ::kill(c.pid, SIGTERM);
      terminated = true;
      deadline = Clock::now() + 5s;
    } else if (terminated && Clock::now() > deadline) {
      ::kill(c.pid, SIGKILL);
      break;
    }
  }
  ::close(c.fd);
  int st = 0;
  ::waitpid(c.pid, &st, 0);
  r.exitCode = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return r;
}

struct Result {
  bool found = false;
  double finalLoss = 0, referenceLoss = 0, maxRel = 1, recoveryMax = 99;
  int recoveries = -1;
};

inline Result parseResult(const std::string& out) {
  std::regex re(
      "RESULT final_loss=(\\S+) reference_loss=(\\S+) max_param_rel_diff=(\\S+) "
      "recoveries=(\\d+) recovery_s_max=(\\S+)");
  std::smatch m;
  Result r;
  if (std::regex_search(out, m, re)) {
    r.found = true;
    r.finalLoss = std::stod(m[1]);
    r.referenceLoss = std::stod(m[2]);
    r.maxRel = std::stod(m[3]);
    r.recoveries = std::stoi(m[4]);
    r.recoveryMax = std::stod(m[5]);
  }
  return r;
}

inline std::string logDir(const std::string& name) {
  return std::string(SINEW_TEST_TMP) + "/" + name + "-" + std::to_string(::getpid());
}

// Runs `program` with `args` under sinew-run with `workers` workers (and --inject `inject`
// unless empty), logs in logDir(name), until it ends or `timeout` passes.
// runArgs go to sinew-run itself, before the program.
inline JobRun runJob(const std::string& name, int workers, const std::string& program,
                     const std::vector<std::string>& args, const std::string& inject = "",
                     std::chrono::seconds timeout = 300s,
                     const std::vector<std::string>& runArgs = {}) {
  std::vector<std::string> argv = {SINEW_RUN_PATH, "-n", std::to_string(workers), "--log-dir",
                                   logDir(name)};
  argv.insert(argv.end(), runArgs.begin(), runArgs.end());
  if (!inject.empty()) {
    argv.push_back("--inject");
    argv.push_back(inject);
  }
  argv.push_back(program);
  argv.insert(argv.end(), args.begin(), args.end());
  return finish(start(argv, {}), timeout);
}

// A train_dp job that finished every step with parameters equal to the reference (within
// 1e-5), learned, and lost exactly the workers in lostList ("1,2"; "" for none).
inline void expectFinishedExact(const JobRun& run, const std::string& lostList) {
  EXPECT_FALSE(run.timedOut) << "the job hung";
  EXPECT_EQ(run.exitCode, 0);
  Result r = parseResult(run.output);
  ASSERT_TRUE(r.found) << "no RESULT line";
  EXPECT_LE(r.maxRel, 1e-5);
  EXPECT_LT(r.finalLoss, 0.05) << "the model did not learn";
  EXPECT_NE(run.output.find("workers lost: [" + lostList + "]"), std::string::npos)
      << "expected workers lost: [" << lostList << "]";
}

// Reads a file whole ("" if it does not exist yet).
inline std::string slurp(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// Waits (up to `timeout`) until worker 0 of the job in `dir` has logged `text`.
inline bool waitForLog(const std::string& dir, const std::string& text,
                       std::chrono::seconds timeout = 60s) {
  auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    if (slurp(dir + "/worker-0.log").find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

// The pid of a worker, from the coordinator's event log (-1 if not there yet).
inline pid_t workerPid(const std::string& dir, int worker) {
  std::smatch m;
  std::string events = slurp(dir + "/coordinator-events.jsonl");
  std::regex re("\"event\":\"hello\",\"node\":\"[^\"]*\",\"pid\":(\\d+),[^\\n]*\"worker\":" +
                std::to_string(worker) + "\\}");
  return std::regex_search(events, m, re) ? static_cast<pid_t>(std::stol(m[1])) : -1;
}

// The environment of a worker that joins the job sinew-run runs with logs in `dir`: the
// coordinator's endpoint and token from coordinator.json (waits up to 30 s for the launcher
// to write it), SINEW_NODE = node and the job's log folder. Empty if there is no
// coordinator.json.
inline std::map<std::string, std::string> joinerEnv(const std::string& dir,
                                                    const std::string& node) {
  auto deadline = Clock::now() + 30s;
  while (Clock::now() < deadline) {
    std::string text = slurp(dir + "/coordinator.json");
    std::smatch m;
    if (std::regex_search(text, m, std::regex("\"port\":(\\d+).*\"token\":\"([0-9a-f]+)\""))) {
      return {{"SINEW_COORDINATOR", "127.0.0.1:" + m[1].str()},
              {"SINEW_TOKEN", m[2].str()},
              {"SINEW_NODE", node},
              {"SINEW_LOG_DIR", dir}};
    }
    std::this_thread::sleep_for(20ms);
  }
  return {};
}

}  // namespace testing
}  // namespace sinew
