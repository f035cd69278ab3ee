// sinew-bench-ha: what high-availability mode (docs/ha.md) costs and buys, in one run, on a
// three-member etcd cluster on loopback:
//   - the step time of a 4-worker train_dp job in etcd mode (3 sinew-coordinator candidates,
//     every commit stored in etcd before it is sent) against the same job under sinew-run's
//     built-in coordinator (runs alternate, medians of the per-interval samples/s);
//   - the failover time: the leader coordinator SIGKILLed, to the next committed step, for
//     lease TTLs of 1 and 2 s.
// Last line: RESULT etcd_step_ratio_vs_builtin=<etcd step time / built-in step time>
//            failover_s_ttl1=<s> failover_s_ttl2=<s>
//
//   sinew-bench-ha [--steps N] [--rounds R]

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "etcd_support.h"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using nlohmann::json;
using sinew::testing::EtcdCluster;

struct Proc {
  pid_t pid = -1;
  std::string log;
};

Proc spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
           const std::string& log) {
  return Proc{sinew::testing::spawnLogged(argv, env, log), log};
}

int waitExit(const Proc& p, std::chrono::seconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    int st = 0;
    if (::waitpid(p.pid, &st, WNOHANG) == p.pid) return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    std::this_thread::sleep_for(20ms);
  }
  ::kill(p.pid, SIGKILL);
  ::waitpid(p.pid, nullptr, 0);
  return -2;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The per-interval samples/s the first worker printed, past the first two reports (warm-up).
std::vector<double> rates(const std::string& out) {
  std::vector<double> r;
  std::regex re("sinew: step \\d+ loss \\S+ samples/s (\\d+)");
  int seen = 0;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator();
       ++it) {
    if (++seen > 2) r.push_back(std::stod((*it)[1]));
  }
  return r;
}

double wallSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Bench {
  std::string dir;
  std::string token = "5eed5eed";
  EtcdCluster* cluster = nullptr;
  int steps = 400;
  int jobs = 0;

  std::vector<double> builtin() {
    const std::string log = dir + "/builtin-" + std::to_string(jobs++) + ".log";
    Proc p =
        spawn({SINEW_RUN_PATH, "-n", "4", "--log-dir", dir + "/run-" + std::to_string(jobs),
               "--no-control", TRAIN_DP_PATH, "--steps", std::to_string(steps), "--no-reference"},
              {}, log);
    if (waitExit(p, 300s) != 0) {
      std::fprintf(stderr, "sinew-bench-ha: the built-in job failed (%s)\n", log.c_str());
      std::exit(1);
    }
    return rates(slurp(log));
  }

  // An etcd-mode job; with killAt >= 0, the leader is killed once that step is committed and
  // *failover gets the seconds to the next commit.
  std::vector<double> etcdMode(int ttl, int64_t killAt = -1, double* failover = nullptr) {
    const std::string job = "bench-" + std::to_string(jobs++);
    ::mkdir((dir + "/" + job).c_str(), 0755);
    std::vector<Proc> coordinators, workers;
    for (int i = 0; i < 3; ++i) {
      coordinators.push_back(
          spawn({SINEW_COORDINATOR_PATH, "--etcd", cluster->endpoints(), "--job", job, "--workers",
                 "4", "--name", "c" + std::to_string(i), "--lease-ttl-s", std::to_string(ttl),
                 "--log-dir", dir + "/" + job},
                {{"SINEW_TOKEN", token}}, dir + "/" + job + "-c" + std::to_string(i) + ".log"));
    }
    for (int w = 0; w < 4; ++w) {
      workers.push_back(spawn({TRAIN_DP_PATH, "--steps", std::to_string(steps), "--no-reference"},
                              {{"SINEW_ETCD", cluster->endpoints()},
                               {"SINEW_JOB", job},
                               {"SINEW_TOKEN", token},
                               {"SINEW_WORKER_ID", std::to_string(w)},
                               {"SINEW_NODE", "node" + std::to_string(w)}},
                              dir + "/" + job + "-w" + std::to_string(w) + ".log"));
    }
    if (killAt >= 0) {
      sinew::collectives::EtcdClient etcd(cluster->options());
      auto committed = [&]() -> int64_t {
        auto kv = etcd.get("/sinew/" + job + "/state");
        if (!kv) return -1;
        return json::parse(kv->value).value("committed", int64_t(-1));
      };
      const auto start = Clock::now();
      while (committed() < killAt && Clock::now() - start < 120s) std::this_thread::sleep_for(2ms);
      auto leader = json::parse(etcd.get("/sinew/" + job + "/leader")->value);
      const double killedAt = wallSeconds();
      ::kill(static_cast<pid_t>(leader.value("pid", 0)), SIGKILL);
      // The new leader logs "recovered" at the first commit after the failure (wall clock).
      const auto killedClock = Clock::now();
      while (*failover <= 0 && Clock::now() - killedClock < 60s) {
        std::this_thread::sleep_for(20ms);
        for (int i = 0; i < 3; ++i) {
          std::istringstream events(
              slurp(dir + "/" + job + "/coordinator-c" + std::to_string(i) + ".jsonl"));
          for (std::string line; std::getline(events, line);) {
            json e = json::parse(line, nullptr, false);
            if (e.is_object() && e.value("event", "") == "recovered" &&
                e.value("time", 0.0) > killedAt) {
              *failover = e.value("time", 0.0) - killedAt;
            }
          }
        }
      }
    }
    for (auto& w : workers) {
      if (waitExit(w, 300s) != 0) {
        std::fprintf(stderr, "sinew-bench-ha: an etcd-mode worker failed (%s)\n", w.log.c_str());
        std::exit(1);
      }
    }
    for (auto& c : coordinators) waitExit(c, 30s);
    return rates(slurp(workers[0].log));
  }
};

}  // namespace

int main(int argc, char** argv) {
  Bench b;
  int rounds = 2;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--steps" && i + 1 < argc) {
      b.steps = std::atoi(argv[++i]);
    } else if (a == "--rounds" && i + 1 < argc) {
      rounds = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: sinew-bench-ha [--steps N] [--rounds R]\n");
      return 2;
    }
  }
  if (sinew::testing::etcdPath().empty()) {
    std::fprintf(stderr, "sinew-bench-ha: etcd is not installed (apt-get install etcd-server)\n");
    return 1;
  }
  char tmpl[] = "/tmp/sinew-bench-ha-XXXXXX";
  b.dir = ::mkdtemp(tmpl);
  EtcdCluster cluster(3);
  b.cluster = &cluster;
  std::vector<double> builtinRates, etcdRates;
  for (int r = 0; r < rounds; ++r) {
    auto x = b.builtin();
    builtinRates.insert(builtinRates.end(), x.begin(), x.end());
    auto y = b.etcdMode(2);
    etcdRates.insert(etcdRates.end(), y.begin(), y.end());
  }
  const double builtin = median(builtinRates), etcd = median(etcdRates);
  std::printf(
      "4 workers of train_dp, %d steps, %d rounds (samples/s, median of %zu and %zu "
      "intervals of 10 steps)\n",
      b.steps, rounds, builtinRates.size(), etcdRates.size());
  std::printf("  built-in coordinator (sinew-run)     %8.0f samples/s\n", builtin);
  std::printf("  etcd mode (3 candidates, 3 members)  %8.0f samples/s\n", etcd);
  double f1 = 0, f2 = 0;
  b.etcdMode(1, 100, &f1);
  b.etcdMode(2, 100, &f2);
  std::printf(
      "failover (leader SIGKILLed -> next step committed): %.2f s with a 1 s lease, "
      "%.2f s with a 2 s lease\n",
      f1, f2);
  sinew::testing::removeTree(b.dir);
  std::printf("RESULT etcd_step_ratio_vs_builtin=%.3f failover_s_ttl1=%.2f failover_s_ttl2=%.2f\n",
              etcd > 0 ? builtin / etcd : 0, f1, f2);
  return 0;
}
