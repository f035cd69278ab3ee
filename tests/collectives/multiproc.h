#pragma once

// Forked-process test harness (after Gloo's test/multiproc_test.h). The parent never
// touches libtorch, so forking is safe; each child runs a function and _exit()s with its
// return value. Children find each other through a TcpStore served by the parent.
// Tests kill only the PIDs this harness forked.

#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace sinew {
namespace testing {

inline int64_t monotonicMicros() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Milliseconds since `start` on the steady clock.
inline int64_t elapsedMs(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                               start)
      .count();
}

struct ChildExit {
  bool exited = false;  // Exited normally; code holds the status.
  int code = -1;
  bool signaled = false;  // Killed by a signal; signal holds it.
  int signal = 0;
  bool timedOut = false;  // Still running at the deadline (then SIGKILLed).
  std::string str() const {
    if (timedOut) return "hung (killed at the deadline)";
    if (signaled) return "killed by signal " + std::to_string(signal);
    return "exited with " + std::to_string(code);
  }
};

class ProcessGroup {
 public:
  ~ProcessGroup() { killAll(); }

  // Forks a child that runs fn() and exits with its result (an exception exits 99).
  pid_t spawn(const std::function<int()>& fn) {
    std::fflush(nullptr);
    pid_t pid = fork();
    if (pid == 0) {
      int rc = 98;
      try {
        rc = fn();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "child %d: uncaught exception: %s\n", getpid(), e.what());
        rc = 99;
      } catch (...) {
        rc = 99;
      }
      std::fflush(nullptr);
      _exit(rc);
    }
    pids_.push_back(pid);
    return pid;
  }

  pid_t pid(size_t i) const { return pids_.at(i); }
  size_t size() const { return pids_.size(); }

  void signal(size_t i, int sig) { ::kill(pids_.at(i), sig); }

  // Waits for every child until the deadline; children still running are SIGKILLed.
  std::vector<ChildExit> waitAll(std::chrono::milliseconds timeout) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    std::vector<ChildExit> out(pids_.size());
    std::vector<bool> done(pids_.size(), false);
    size_t remaining = pids_.size();
    while (remaining > 0) {
      for (size_t i = 0; i < pids_.size(); ++i) {
        if (done[i]) continue;
        int status = 0;
        pid_t r = waitpid(pids_[i], &status, WNOHANG);
        if (r == pids_[i]) {
          done[i] = true;
          remaining--;
          if (WIFEXITED(status)) {
            out[i].exited = true;
            out[i].code = WEXITSTATUS(status);
          } else if (WIFSIGNALED(status)) {
            out[i].signaled = true;
            out[i].signal = WTERMSIG(status);
          }
        }
      }
      if (remaining == 0) break;
      if (std::chrono::steady_clock::now() > deadline) {
        for (size_t i = 0; i < pids_.size(); ++i) {
          if (done[i]) continue;
          out[i].timedOut = true;
          ::kill(pids_[i], SIGKILL);
          ::kill(pids_[i], SIGCONT);
          waitpid(pids_[i], nullptr, 0);
          done[i] = true;
        }
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    reaped_ = true;
    return out;
  }

 private:
  void killAll() {
    if (reaped_) return;
    for (pid_t p : pids_) {
      ::kill(p, SIGKILL);
      ::kill(p, SIGCONT);
      waitpid(p, nullptr, 0);
    }
  }

  std::vector<pid_t> pids_;
  bool reaped_ = false;
};

}  // namespace testing
}  // namespace sinew
