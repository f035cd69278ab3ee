// sinew-bench-sched: one job list through sinew-sched twice, with the static equal-share policy
// (the baseline) and the marginal-gain policy, on the same pool of worker slots. Eight train_dp
// jobs arrive over 75 s: some scale (their steps are emulated accelerator time per sample,
// `slow:us_per_sample`, so a step's compute shrinks with its workers as on GPUs), some do not
// (emulated communication, `slow:comm_ms`: a fixed time of every step in the gradient
// reduction), of different lengths. Every job must finish
// equal to its single-process reference (max_param_rel_diff <= 1e-5 on its RESULT lines).
//
//   sinew-bench-sched [--slots N] [--scale F] [--dir DIR] [--min-gain M]
//
// --scale multiplies every job's steps (1 = the list below, about 85 s a policy here);
// --min-gain is sinew-sched's for the marginal run (default 0.05, as sinew-sched's).
// Prints each policy's jobs and
//   RESULT sched_mean_jct_vs_static=<marginal / static> sched_makespan_vs_static=<...>
// (issue 42's goal: <= 0.85 for the mean job completion time).

#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace {

using nlohmann::json;

struct Kind {
  const char* name;
  double arrival;
  int steps;
  std::string inject;
};

int runSched(const std::string& jobs, int slots, const std::string& policy, const std::string& dir,
             const std::string& minGain) {
  const std::string slotsText = std::to_string(slots), out = dir + ".out";
  const pid_t pid = ::fork();
  if (pid == 0) {
    std::FILE* f = std::fopen(out.c_str(), "w");
    if (f) {
      ::dup2(::fileno(f), 1);
      ::dup2(::fileno(f), 2);
    }
    ::execl(SINEW_SCHED_PATH, SINEW_SCHED_PATH, "--jobs", jobs.c_str(), "--slots",
            slotsText.c_str(), "--policy", policy.c_str(), "--log-dir", dir.c_str(), "--timeout-s",
            "1800", "--min-gain", minGain.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  int st = 0;
  ::waitpid(pid, &st, 0);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

}  // namespace

int main(int argc, char** argv) {
  int slots = 6;
  double scale = 1;
  std::string minGain = "0.05";
  std::string dir = "sinew-bench-sched-" + std::to_string(::getpid());
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--slots") {
      slots = std::atoi(argv[i + 1]);
    } else if (a == "--scale") {
      scale = std::atof(argv[i + 1]);
    } else if (a == "--dir") {
      dir = argv[i + 1];
    } else if (a == "--min-gain") {
      minGain = argv[i + 1];
    } else {
      std::fprintf(stderr,
                   "usage: sinew-bench-sched [--slots N] [--scale F] [--dir DIR] [--min-gain M]\n");
      return 2;
    }
  }
  if (slots < 1 || !(scale > 0)) {
    std::fprintf(stderr, "sinew-bench-sched: --slots >= 1 and --scale > 0\n");
    return 2;
  }
  const std::vector<Kind> kinds = {
      {"long-a", 0, 1200, "slow:worker=*:us_per_sample=800"},
      {"flat-b", 8, 500, "slow:worker=*:comm_ms=40;slow:worker=*:us_per_sample=100"},
      {"short-c", 16, 400, "slow:worker=*:us_per_sample=800"},
      {"long-d", 25, 1000, "slow:worker=*:us_per_sample=600"},
      {"flat-e", 35, 600, "slow:worker=*:comm_ms=30;slow:worker=*:us_per_sample=100"},
      {"short-f", 45, 300, "slow:worker=*:us_per_sample=1000"},
      {"mid-g", 60, 600, "slow:worker=*:us_per_sample=700"},
      {"short-h", 75, 250, "slow:worker=*:us_per_sample=900"},
  };
  std::filesystem::create_directories(dir);
  json list = {{"jobs", json::array()}};
  int seed = 1;
  for (const Kind& k : kinds) {
    const int steps = std::max(20, static_cast<int>(std::lround(k.steps * scale)));
    list["jobs"].push_back({{"name", k.name},
                            {"arrival_s", k.arrival},
                            {"command",
                             {TRAIN_DP_PATH, "--steps", std::to_string(steps), "--float32",
                              "--seed", std::to_string(seed++)}},
                            {"min_workers", 1},
                            {"max_workers", slots},
                            {"inject", k.inject}});
  }
  const std::string jobs = dir + "/jobs.json";
  std::ofstream(jobs) << list.dump(1) << "\n";
  std::printf("sinew-bench-sched: %zu jobs on %d slots, steps x %.2f, in %s\n", kinds.size(), slots,
              scale, dir.c_str());
  json reports;
  bool ok = true;
  for (const std::string policy : {"static", "marginal"}) {
    const std::string runDir = dir + "/" + policy;
    const int rc = runSched(jobs, slots, policy, runDir, minGain);
    std::ifstream in(runDir + "/report.json");
    json r = json::parse(in, nullptr, false);
    if (rc != 0 || r.is_discarded()) {
      std::printf("%s: sinew-sched exited %d (see %s.out)\n", policy.c_str(), rc, runDir.c_str());
      ok = false;
      continue;
    }
    std::printf("\n%s: mean JCT %.2f s, makespan %.2f s, %d of %zu exact\n", policy.c_str(),
                r["mean_jct_s"].get<double>(), r["makespan_s"].get<double>(), r["exact"].get<int>(),
                kinds.size());
    std::printf("  %-8s %8s %8s %8s %8s %8s %s\n", "JOB", "ARRIVAL", "START", "END", "JCT_S",
                "RESIZES", "MAX_REL_DIFF");
    for (const json& j : r["jobs"]) {
      std::printf("  %-8s %8.1f %8.1f %8.1f %8.1f %8zu %s\n", j["name"].get<std::string>().c_str(),
                  j["arrival_s"].get<double>(), j["started_s"].get<double>(),
                  j["ended_s"].get<double>(), j["jct_s"].get<double>(), j["resizes"].size(),
                  j["max_param_rel_diff"].dump().c_str());
    }
    ok = ok && r["exact"].get<int>() == static_cast<int>(kinds.size());
    reports[policy] = r;
  }
  if (!ok || !reports.contains("static") || !reports.contains("marginal")) {
    std::printf("sinew-bench-sched: a run failed or a job was not exact\n");
    std::printf("RESULT sched_mean_jct_vs_static=nan sched_makespan_vs_static=nan\n");
    return 1;
  }
  const double jct = reports["marginal"]["mean_jct_s"].get<double>() /
                     reports["static"]["mean_jct_s"].get<double>();
  const double makespan = reports["marginal"]["makespan_s"].get<double>() /
                          reports["static"]["makespan_s"].get<double>();
  std::printf("\nRESULT sched_mean_jct_vs_static=%.3f sched_makespan_vs_static=%.3f\n", jct,
              makespan);
  return 0;
}
