// sinew-bench-dp-vs-ddp: the price of resilience when nothing fails. examples/train_gpt (the
// tiny preset: a GPT-2-style decoder with its head tied to its token embedding, AdamW, warm-up
// + cosine, clipping at 1.0, float32) trained data parallel by Sinew on 2 workers under
// sinew-run, against the same model and recipe written again in Python and trained by
// PyTorch's DistributedDataParallel on the Gloo backend, 2 processes started by torchrun
// (bench/dp_vs_ddp/ddp_gpt.py). Same global batch (16 windows of 64 tokens of the licence
// texts), each worker's share in one forward and backward (Sinew: --microbatch 8), one thread
// per process, no evaluation, no reference, no checkpoints.
//
// The times are what each prints for its training ("trained steps 0..S-1 in <s> s": from the
// trainer's construction, resp. the DDP wrapper's, to the last optimizer step; the process
// start and the group's rendezvous are outside both). The two alternate, `pairs` times
// (default 3), so that the machine's drift falls on both alike; the ratio is of the medians,
// as samples/s: DDP's time / Sinew's.
//
// usage: sinew-bench-dp-vs-ddp [pairs] [steps]
// Last line: RESULT sinew_s=<median> ddp_s=<median> dp_vs_ddp=<ratio>

#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

double seconds(const std::string& text, const std::string& who, int steps, const std::string& out) {
  std::smatch m;
  const std::regex re(who + " trained steps 0\\.\\." + std::to_string(steps - 1) +
                      " in ([0-9.]+) s");
  if (!std::regex_search(text, m, re)) throw std::runtime_error("no time in " + out);
  return std::stod(m[1]);
}

}  // namespace

int main(int argc, char** argv) {
  const int pairs = argc > 1 ? std::atoi(argv[1]) : 3;
  const int steps = argc > 2 ? std::atoi(argv[2]) : 40;
  if (pairs < 1 || steps < 2) {
    std::fprintf(stderr, "usage: sinew-bench-dp-vs-ddp [pairs >= 1] [steps >= 2]\n");
    return 2;
  }
  if (access(TORCHRUN_PATH, X_OK) != 0) {
    std::fprintf(stderr,
                 "sinew-bench-dp-vs-ddp: %s is missing: install Debian's python3-torch "
                 "(scripts/install-deps.sh --bench)\n",
                 TORCHRUN_PATH);
    return 2;
  }
  const std::string base = (std::filesystem::temp_directory_path() /
                            ("sinew-bench-dp-vs-ddp-" + std::to_string(getpid())))
                               .string();
  const std::string tokens = base + ".tokens";
  const std::string n = std::to_string(steps);
  std::vector<double> sinew, ddp;
  try {
    // The token file both read, made by train_gpt from the licence texts (one step).
    sinew_bench::runCapturing({TRAIN_GPT_PATH, "--tokens", tokens, "--steps", "1", "--no-reference",
                               "--eval-every", "0", "--progress", "0"},
                              base + "-tokens.out");
    for (int i = 0; i < pairs; ++i) {
      std::filesystem::remove_all(base + "-sinew");
      std::string out = base + "-sinew.out";
      sinew.push_back(seconds(sinew_bench::runCapturing({SINEW_RUN_PATH,
                                                         "-n",
                                                         "2",
                                                         "--log-dir",
                                                         base + "-sinew",
                                                         TRAIN_GPT_PATH,
                                                         "--data-parallel",
                                                         "--microbatch",
                                                         "8",
                                                         "--global-batch",
                                                         "16",
                                                         "--steps",
                                                         n,
                                                         "--no-reference",
                                                         "--eval-every",
                                                         "0",
                                                         "--progress",
                                                         "0",
                                                         "--tokens",
                                                         tokens},
                                                        out),
                              "worker 0", steps, out));
      out = base + "-ddp.out";
      std::filesystem::remove_all(base + "-ddp");
      // torchrun 1.13 on Python 3.11 accepts only 1 or 2 for --redirects and --tee.
      ddp.push_back(
          seconds(sinew_bench::runCapturing(
                      {TORCHRUN_PATH, "--standalone", "--nproc_per_node", "2", "--redirects", "1",
                       "--tee", "1", "--log_dir", base + "-ddp", DDP_SCRIPT_PATH, "--tokens",
                       tokens, "--steps", n, "--global-batch", "16"},
                      out),
                  "ddp:", steps, out));
      std::printf("pair %d: sinew %.3f s, ddp %.3f s\n", i + 1, sinew.back(), ddp.back());
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sinew-bench-dp-vs-ddp: %s\n", e.what());
    return 1;
  }
  for (const char* d : {"-sinew", "-ddp"}) std::filesystem::remove_all(base + d);
  std::filesystem::remove(tokens);
  const double s = median(sinew), d = median(ddp);
  std::printf("RESULT sinew_s=%.3f ddp_s=%.3f dp_vs_ddp=%.4f\n", s, d, d / s);
  return 0;
}
