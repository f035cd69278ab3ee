// sinew-bench-step-loop: what a loop of the program's own over Trainer::step() costs against
// Trainer::run() on the same job, on this machine.
//
// Each job is examples/train_dp under sinew-run (2 workers, float32, 400 steps, no reference):
// with run(), or with --step-loop (the same training through `for (;;) trainer.step()`). The
// time is what worker 0 prints for its training ("trained steps 0..399 in <s> s", the loop or
// run() alone, without the process start). The two kinds alternate, `pairs` times (default 5),
// so that the machine's drift falls on both alike; the ratio is of the medians.
//
// Last line: RESULT step_loop_s=<median> run_s=<median> step_loop_vs_run=<ratio>

#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <stdexcept>
#include <string>
#include <vector>

#include "../run_capture.h"

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Runs one job; returns worker 0's training seconds.
double runJob(const std::string& dir, bool stepLoop) {
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::vector<std::string> argv = {SINEW_RUN_PATH, "-n",      "2",   "--log-dir", dir,
                                   TRAIN_DP_PATH,  "--steps", "400", "--float32", "--no-reference",
                                   "--progress",   "0"};
  if (stepLoop) argv.push_back("--step-loop");
  const std::string out = dir + ".out";
  const std::string text = sinew_bench::runCapturing(argv, out);
  std::smatch m;
  if (!std::regex_search(text, m, std::regex("worker 0 trained steps 0\\.\\.399 in ([0-9.]+) s"))) {
    throw std::runtime_error("job in " + dir + " failed; see " + out);
  }
  return std::stod(m[1]);
}

}  // namespace

int main(int argc, char** argv) {
  const int pairs = argc > 1 ? std::atoi(argv[1]) : 5;
  if (pairs < 1) {
    std::fprintf(stderr, "usage: sinew-bench-step-loop [pairs >= 1]\n");
    return 2;
  }
  const std::string base = (std::filesystem::temp_directory_path() /
                            ("sinew-bench-step-loop-" + std::to_string(getpid())))
                               .string();
  std::vector<double> loop, run;
  try {
    for (int i = 0; i < pairs; ++i) {
      run.push_back(runJob(base + "-run", false));
      loop.push_back(runJob(base + "-loop", true));
      std::printf("pair %d: run() %.3f s, step loop %.3f s\n", i + 1, run.back(), loop.back());
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sinew-bench-step-loop: %s\n", e.what());
    return 1;
  }
  std::filesystem::remove_all(base + "-run");
  std::filesystem::remove_all(base + "-loop");
  const double l = median(loop), r = median(run);
  std::printf("RESULT step_loop_s=%.3f run_s=%.3f step_loop_vs_run=%.4f\n", l, r, l / r);
  return 0;
}
