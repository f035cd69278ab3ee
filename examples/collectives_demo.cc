// collectives_demo: a small data-parallel-style job that survives an injected failure.
//
// The launcher process serves a TcpStore and forks N workers. Every step each worker
// allreduces (averages) a "gradient" and applies it to its copy of a parameter vector. At
// the injected step one worker SIGKILLs itself in the middle of the step; the survivors'
// allreduce fails with PeerLost naming it, they build the next epoch's communicator
// without it, redo the step and carry on. At the end every survivor checks that its
// parameters equal what a failure-free run over the survivors' data would give.
//
// Usage: collectives_demo [--workers N] [--steps S] [--kill-worker W] [--kill-step K]

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "sinew/collectives/tcp_store.h"
#include "sinew/communicator.h"

using namespace sinew::collectives;

namespace {

struct Args {
  int workers = 4;
  int steps = 20;
  int killWorker = 2;
  int killStep = 7;
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    if (k == "--help" || k == "-h") {
      std::printf(
          "usage: collectives_demo [--workers N] [--steps S] [--kill-worker W] [--kill-step K]\n");
      std::exit(0);
    }
    auto next = [&]() -> int {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "collectives_demo: %s needs a value\n", k.c_str());
        std::exit(2);
      }
      // Whole-string parse: "3x", "" or a number beyond int is an error, not 3 or 0.
      const std::string v = argv[++i];
      int x = 0;
      auto r = std::from_chars(v.data(), v.data() + v.size(), x);
      if (v.empty() || r.ec != std::errc() || r.ptr != v.data() + v.size() || x < 0) {
        std::fprintf(stderr, "collectives_demo: %s needs a non-negative integer, got '%s'\n",
                     k.c_str(), v.c_str());
        std::exit(2);
      }
      return x;
    };
    if (k == "--workers") {
      a.workers = next();
    } else if (k == "--steps") {
      a.steps = next();
    } else if (k == "--kill-worker") {
      a.killWorker = next();
    } else if (k == "--kill-step") {
      a.killStep = next();
    } else {
      std::fprintf(stderr,
                   "collectives_demo: unknown argument '%s'\nusage: collectives_demo [--workers "
                   "N] [--steps S] [--kill-worker W] [--kill-step K]\n",
                   k.c_str());
      std::exit(2);
    }
  }
  if (a.workers < 2 || a.steps < 1 || a.killWorker >= a.workers) {
    std::fprintf(stderr, "collectives_demo: need --workers >= 2 and --kill-worker < workers\n");
    std::exit(2);
  }
  return a;
}

// The gradient worker w contributes at step s: deterministic, so the result is checkable.
at::Tensor gradient(int worker, int step, int64_t n) {
  return at::arange(n, at::kDouble).remainder(7).add(worker + 0.25 * step);
}

int runWorker(const Args& a, int self, uint16_t port, uint64_t token) {
  at::set_num_threads(1);
  TcpStoreOptions so;
  so.token = token;  // The server's job token (inherited over fork).
  auto store = std::make_shared<TcpStore>("127.0.0.1", port, so);
  std::vector<int> members;
  for (int w = 0; w < a.workers; ++w) members.push_back(w);
  const int64_t n = 1 << 18;
  at::Tensor params = at::zeros({n}, at::kDouble);
  at::Tensor expected = at::zeros({n}, at::kDouble);
  int64_t epoch = 0;
  CommunicatorOptions o;
  o.members = members;
  o.self = self;
  o.epoch = epoch;
  o.timeout = std::chrono::seconds(10);
  auto comm = createGlooCommunicator(store, o);
  for (int step = 0; step < a.steps;) {
    at::Tensor g = gradient(self, step, n);
    if (step == a.killStep && self == a.killWorker) {
      std::printf("[worker %d] injected failure: SIGKILL at step %d\n", self, step);
      std::fflush(stdout);
      raise(SIGKILL);
    }
    auto start = std::chrono::steady_clock::now();
    try {
      comm->allreduce(g, ReduceOp::kAvg);
    } catch (const sinew::PeerLost& e) {
      double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count();
      members.erase(std::remove(members.begin(), members.end(), e.worker()), members.end());
      o.members = members;
      o.epoch = ++epoch;
      comm.reset();
      auto rebuildStart = std::chrono::steady_clock::now();
      comm = createGlooCommunicator(store, o);
      double rebuildMs =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - rebuildStart)
              .count();
      std::printf(
          "[worker %d] step %d: lost worker %d (noticed in %.1f ms); epoch %lld with %zu "
          "workers built in %.1f ms; redoing the step\n",
          self, step, e.worker(), ms, static_cast<long long>(epoch), members.size(), rebuildMs);
      std::fflush(stdout);
      continue;  // Redo this step with the survivors.
    }
    params -= g;
    // What the step should have computed: the mean over the current members.
    at::Tensor mean = at::zeros({n}, at::kDouble);
    for (int w : members) mean += gradient(w, step, n);
    expected -= mean / static_cast<double>(members.size());
    if (self == members.front() && (step % 5 == 0 || step == a.steps - 1)) {
      std::printf("[worker %d] step %d epoch %lld workers %zu param[1]=%.4f\n", self, step,
                  static_cast<long long>(epoch), members.size(), params[1].item<double>());
      std::fflush(stdout);
    }
    ++step;
  }
  double diff = (params - expected).abs().max().item<double>();
  if (self == members.front()) {
    std::printf("RESULT steps=%d workers_left=%zu epochs=%lld max_abs_diff=%.3g\n", a.steps,
                members.size(), static_cast<long long>(epoch + 1), diff);
  }
  return diff < 1e-9 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Args a = parse(argc, argv);
  TcpStoreServer server{TcpStoreServerOptions()};
  std::printf("collectives_demo: %d workers, %d steps, worker %d is killed at step %d\n", a.workers,
              a.steps, a.killWorker, a.killStep);
  std::fflush(stdout);
  std::vector<pid_t> pids;
  for (int w = 0; w < a.workers; ++w) {
    pid_t pid = fork();
    if (pid == 0) {
      int rc = 1;
      try {
        rc = runWorker(a, w, server.port(), server.token());
      } catch (const std::exception& e) {
        std::fprintf(stderr, "[worker %d] failed: %s\n", w, e.what());
      }
      std::fflush(nullptr);
      _exit(rc);
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (int w = 0; w < a.workers; ++w) {
    int status = 0;
    waitpid(pids[w], &status, 0);
    bool killedAsPlanned = w == a.killWorker && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
    bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok && !killedAsPlanned) {
      std::fprintf(stderr, "collectives_demo: worker %d ended badly (status %d)\n", w, status);
      failed++;
    }
  }
  std::printf("collectives_demo: %s\n", failed ? "FAILED" : "survived the injected failure");
  return failed ? 1 : 0;
}
