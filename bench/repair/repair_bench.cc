// sinew-bench-gloo-repair: the Gloo communicator's set-up after a member's loss, repaired
// (the survivors keep their connections to each other: GlooOptions::keepConnections) against
// rebuilt (every pair connected anew), at several member counts on this machine.
//
// For each size N it forks N members (one ATen thread each), which build epoch 0 and
// allreduce until the parent SIGKILLs the last of them. The N - 1 survivors then build
// epochs 1, 2, ... taking turns, repaired and rebuilt, --rounds of each; every epoch starts at
// a barrier of the store, each member times its own set-up (the constructor) and then checks
// one allreduce. An epoch's time is its slowest member's; each mode's figure is the median
// over its rounds. A rebuilt epoch leaves nothing to keep, so the next repaired epoch keeps
// the links of the repaired epoch before it (all of them: no member was lost since).
//
// Last line: RESULT gloo_repair_vs_rebuild_<N>=<rebuilt ms / repaired ms> ... for every size.

#include <CLI/CLI.hpp>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "sinew/collectives/gloo/gloo_options.h"
#include "sinew/collectives/gloo/kept_links.h"
#include "sinew/collectives/tcp_store.h"
#include "sinew/communicator.h"

namespace {

using namespace sinew::collectives;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

CommunicatorOptions optionsFor(const std::vector<int>& members, int self, int64_t epoch) {
  CommunicatorOptions o;
  o.members = members;
  o.self = self;
  o.epoch = epoch;
  o.name = "bench";
  o.timeout = 120s;
  o.initTimeout = 120s;
  return o;
}

std::string key(const std::string& what, int64_t epoch, int worker) {
  return what + "/" + std::to_string(epoch) + "/" + std::to_string(worker);
}

// This process's CPU time so far (user and system, every thread), ms.
double cpuMs() {
  struct rusage u {};
  ::getrusage(RUSAGE_SELF, &u);
  auto ms = [](const timeval& t) { return t.tv_sec * 1e3 + t.tv_usec / 1e3; };
  return ms(u.ru_utime) + ms(u.ru_stime);
}

// Whether epoch `e` (>= 1) is repaired: odd epochs are, even ones rebuilt.
bool repairedEpoch(int64_t e) { return e % 2 == 1; }

// One member: epoch 0 with all, then (if it survives) 2 * rounds epochs of the survivors.
int member(uint16_t port, uint64_t token, int n, int self, int rounds) {
  at::set_num_threads(1);
  TcpStoreOptions so;
  so.token = token;
  auto store = std::make_shared<TcpStore>("127.0.0.1", port, so);
  std::vector<int> all, survivors;
  for (int w = 0; w < n; ++w) all.push_back(w);
  survivors.assign(all.begin(), all.end() - 1);
  GlooOptions keep, rebuild;
  rebuild.keepConnections = false;
  auto comm = createGlooCommunicator(store, optionsFor(all, self, 0), keep);
  store->set(key("ready", 0, self), {'1'});
  at::Tensor t = at::ones({1024}, at::kFloat);
  try {
    for (;;) comm->allreduce(t);  // Until the last member is killed.
  } catch (const sinew::Error&) {
  }
  comm.reset();
  for (int64_t e = 1; e <= 2 * rounds; ++e) {
    std::vector<std::string> ready;
    for (int w : survivors) ready.push_back(key("start", e, w));
    store->set(key("start", e, self), {'1'});
    store->wait(ready, 120s);
    const auto t0 = Clock::now();
    const double cpu0 = cpuMs();
    comm = createGlooCommunicator(store, optionsFor(survivors, self, e),
                                  repairedEpoch(e) ? keep : rebuild);
    const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    const double cpu = cpuMs() - cpu0;
    at::Tensor u = at::full({1024}, static_cast<float>(self), at::kFloat);
    comm->allreduce(u);
    const float want = static_cast<float>((n - 1) * (n - 2) / 2);
    if (!at::equal(u, at::full({1024}, want, at::kFloat))) {
      std::fprintf(stderr, "member %d: epoch %lld's allreduce is wrong\n", self,
                   static_cast<long long>(e));
      return 3;
    }
    const std::string v = std::to_string(ms) + " " + std::to_string(cpu);
    store->set(key("ms", e, self), Bytes(v.begin(), v.end()));
    comm.reset();
  }
  return 0;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct SizeResult {
  int n;
  double repaired, rebuilt;        // median over rounds of the slowest member's set-up, ms
  double repairedCpu, rebuiltCpu;  // mean CPU time of a member's set-up, ms
};

SizeResult runSize(int n, int rounds) {
  TcpStoreServer server{TcpStoreServerOptions{}};
  std::vector<pid_t> pids;
  std::fflush(nullptr);
  for (int w = 0; w < n; ++w) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      int rc = 98;
      try {
        rc = member(server.port(), server.token(), n, w, rounds);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "member %d: %s\n", w, e.what());
        rc = 99;
      }
      std::fflush(nullptr);
      _exit(rc);
    }
    pids.push_back(pid);
  }
  TcpStoreOptions so;
  so.token = server.token();
  TcpStore store("127.0.0.1", server.port(), so);
  std::vector<std::string> ready;
  for (int w = 0; w < n; ++w) ready.push_back(key("ready", 0, w));
  store.wait(ready, 300s);
  ::kill(pids.back(), SIGKILL);
  std::vector<double> repaired, rebuilt;
  double cpu[2] = {0, 0};
  for (int64_t e = 1; e <= 2 * rounds; ++e) {
    double slowest = 0;
    for (int w = 0; w + 1 < n; ++w) {
      const Bytes b = store.get(key("ms", e, w), 300s);
      std::istringstream is(std::string(b.begin(), b.end()));
      double ms = 0, c = 0;
      is >> ms >> c;
      slowest = std::max(slowest, ms);
      cpu[repairedEpoch(e) ? 1 : 0] += c / (rounds * (n - 1));
    }
    (repairedEpoch(e) ? repaired : rebuilt).push_back(slowest);
  }
  for (size_t i = 0; i < pids.size(); ++i) {
    int status = 0;
    ::waitpid(pids[i], &status, 0);
    const bool victim = i + 1 == pids.size();
    if (!victim && !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
      throw std::runtime_error("member " + std::to_string(i) + " failed");
    }
  }
  return {n, median(repaired), median(rebuilt), cpu[1], cpu[0]};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app("The Gloo communicator's set-up after a loss: repaired against rebuilt.",
               "sinew-bench-gloo-repair");
  std::vector<int> sizes = {8, 16, 32};
  app.add_option("--sizes", sizes, "member counts before the loss")
      ->delimiter(',')
      ->check(CLI::Range(3, 256))
      ->capture_default_str();
  int rounds = 5;
  app.add_option("--rounds", rounds, "epochs of each mode per size")
      ->check(CLI::Range(1, 50))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  std::vector<SizeResult> results;
  for (int n : sizes) {
    results.push_back(runSize(n, rounds));
    std::fflush(stdout);
  }
  std::printf(
      "Gloo communicator set-up of the survivors of a SIGKILL (slowest member, median of %d "
      "epochs each)\n",
      rounds);
  std::printf("%8s %10s %12s %13s %7s %17s %18s\n", "members", "survivors", "rebuilt ms",
              "repaired ms", "ratio", "rebuilt cpu ms", "repaired cpu ms");
  std::ostringstream line;
  line << "RESULT";
  for (const SizeResult& r : results) {
    const double ratio = r.rebuilt / r.repaired;
    std::printf("%8d %10d %12.2f %13.2f %7.2f %17.2f %18.2f\n", r.n, r.n - 1, r.rebuilt, r.repaired,
                ratio, r.rebuiltCpu, r.repairedCpu);
    char v[32];
    std::snprintf(v, sizeof v, "%.2f", ratio);
    line << " gloo_repair_vs_rebuild_" << r.n << "=" << v;
  }
  std::printf("%s\n", line.str().c_str());
  return 0;
}
