// sinew-bench-gpt-small: GPT-2 small (examples/train_gpt --preset small: 12 blocks of width 768,
// 12 heads, vocabulary 50257, 124 M parameters, the head tied to the token embedding; AdamW,
// warm-up + cosine, clipping, float32) trained by Sinew on 2 workers under sinew-run, as
//   pipeline: --memory-bytes M (by default 1.8 GB, less than the model's parameters, gradients
//             and AdamW state, 2 GB, with the optimizer step's 0.3 GB of temporaries, so that
//             no worker can hold it) and --fault-tolerance 0:
//             one pipeline of two stages, the global batch in microbatches of 1 (1F1B);
//   data parallel: the same global batch, each worker's half in one microbatch;
// with the same token windows (a token file made from the licence texts), context T (default
// 128, not GPT-2's 1024, so that a step takes seconds, not minutes, on two cores), no
// evaluation, no reference, no peer-RAM versions and no checkpoints (their host copies are
// outside the planner's device memory; docs/pipeline.md).
//
// Throughput: tokens/s between the first and the last step's progress events (step 0, with the
// profile and the first allocations, left out). Memory: each pipeline worker's peak resident
// memory while it trained (the largest of its `done` event's peak_rss_by_phase_bytes over the
// phases of a step: schedule, reduce, clip, optimizer, checkpoint; --memory-by-phase; the
// profile before them, which builds every layer of the model in every worker, and the gather
// of the trained model onto worker 0 after them are left out) against its `plan` event's
// memory_bytes (the cost model's parameters, gradients, optimizer state, activations in flight
// and the largest workspace) plus the resident memory of a train_gpt process that has built
// nothing (`base_rss`: libtorch, the program, the token file's pages; the peak RSS of
// `train_gpt --help`, measured here).
//
// usage: sinew-bench-gpt-small [steps] [context] [memory-bytes]
// Last line: RESULT pp_tokens_per_s=<t> dp_tokens_per_s=<t> pp_vs_dp=<r>
//   w0_rss_mb=<m> w0_predicted_mb=<m> w0_rss_vs_predicted=<r> w1_... base_rss_mb=<m>

#include <sys/resource.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../run_capture.h"

namespace {

using nlohmann::json;

constexpr int kGlobalBatch = 4;

std::vector<json> events(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("no event log " + path);
  std::vector<json> out;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(json::parse(line));
  }
  return out;
}

// Tokens per second between worker 0's first and last progress events after step 0.
double tokensPerSecond(const std::string& logDir, int context) {
  double t0 = 0, t1 = 0;
  int64_t s0 = -1, s1 = -1;
  for (const json& e : events(logDir + "/worker-0-events.jsonl")) {
    if (e.value("event", "") != "progress") continue;
    const int64_t step = e.at("step").get<int64_t>();
    if (step < 1) continue;
    if (s0 < 0) {
      s0 = step;
      t0 = e.at("time").get<double>();
    }
    s1 = step;
    t1 = e.at("time").get<double>();
  }
  if (s1 <= s0)
    throw std::runtime_error("fewer than two progress events after step 0 in " + logDir);
  return static_cast<double>((s1 - s0) * kGlobalBatch * context) / (t1 - t0);
}

struct WorkerMemory {
  int64_t predicted = -1;  // the plan's memory_bytes for its stage
  int64_t peak = -1;       // the largest peak of a step's phases
  int64_t lifePeak = -1;   // its done event's peak_rss_bytes (the profile's included)
  std::map<std::string, int64_t> phases;  // its done event's peak_rss_by_phase_bytes
};

// The phases of a training step (runtime/resident_memory.h).
bool stepPhase(const std::string& phase) {
  return phase == "schedule" || phase == "reduce" || phase == "clip" || phase == "optimizer" ||
         phase == "checkpoint";
}

WorkerMemory memoryOf(const std::string& logDir, int worker) {
  WorkerMemory m;
  for (const json& e : events(logDir + "/worker-" + std::to_string(worker) + "-events.jsonl")) {
    const std::string name = e.value("event", "");
    if (name == "plan") {
      for (const json& p : e.at("pipelines")) {
        for (const json& s : p.at("stages")) {
          if (s.at("worker") == worker) m.predicted = s.value("memory_bytes", int64_t{-1});
        }
      }
    } else if (name == "done") {
      m.lifePeak = e.value("peak_rss_bytes", int64_t{-1});
      if (e.contains("peak_rss_by_phase_bytes")) {
        m.phases = e.at("peak_rss_by_phase_bytes").get<std::map<std::string, int64_t>>();
      }
      for (const auto& [phase, bytes] : m.phases) {
        if (stepPhase(phase)) m.peak = std::max(m.peak, bytes);
      }
    }
  }
  if (m.predicted < 0 || m.peak < 0) {
    throw std::runtime_error("worker " + std::to_string(worker) + " of " + logDir +
                             " logged no plan memory or no peak RSS of a step's phases");
  }
  return m;
}

// The peak RSS of a train_gpt process that parses --help and exits: what the program costs
// before it builds anything.
int64_t baseRss(const std::string& out) {
  pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    if (std::freopen(out.c_str(), "w", stdout) == nullptr) _exit(127);
    execl(TRAIN_GPT_PATH, TRAIN_GPT_PATH, "--help", static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  struct rusage u {};
  if (wait4(pid, &status, 0, &u) != pid) throw std::runtime_error("wait4 failed");
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

double mb(int64_t bytes) { return static_cast<double>(bytes) / 1e6; }

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 4;
  const int context = argc > 2 ? std::atoi(argv[2]) : 128;
  const std::string memory = argc > 3 ? argv[3] : "1800000000";
  if (steps < 3 || context < 8 || context > 1024) {
    std::fprintf(stderr,
                 "usage: sinew-bench-gpt-small [steps >= 3] [context in [8, 1024]] "
                 "[memory-bytes]\n");
    return 2;
  }
  const std::string base = (std::filesystem::temp_directory_path() /
                            ("sinew-bench-gpt-small-" + std::to_string(getpid())))
                               .string();
  const std::string tokens = base + ".tokens";
  const std::vector<std::string> recipe = {"--preset",
                                           "small",
                                           "--context",
                                           std::to_string(context),
                                           "--global-batch",
                                           std::to_string(kGlobalBatch),
                                           "--steps",
                                           std::to_string(steps),
                                           "--no-reference",
                                           "--eval-every",
                                           "0",
                                           "--progress",
                                           "1",
                                           "--peer-checkpoint-every",
                                           "0",
                                           "--memory-by-phase",
                                           "--tokens",
                                           tokens};
  auto job = [&](const std::string& name, std::vector<std::string> extra) {
    const std::string dir = base + "-" + name;
    std::filesystem::remove_all(dir);
    std::vector<std::string> argv = {SINEW_RUN_PATH, "-n", "2", "--log-dir", dir, TRAIN_GPT_PATH};
    argv.insert(argv.end(), recipe.begin(), recipe.end());
    argv.insert(argv.end(), extra.begin(), extra.end());
    sinew_bench::runCapturing(argv, dir + ".out");
    return dir;
  };
  try {
    sinew_bench::runCapturing({TRAIN_GPT_PATH, "--tokens", tokens, "--steps", "1", "--no-reference",
                               "--eval-every", "0", "--progress", "0"},
                              base + "-tokens.out");
    const int64_t baseline = baseRss(base + "-help.out");
    const std::string pp =
        job("pp", {"--memory-bytes", memory, "--fault-tolerance", "0", "--microbatch", "1"});
    const double ppTps = tokensPerSecond(pp, context);
    std::printf("pipeline (2 stages, microbatches of 1): %.1f tokens/s\n", ppTps);
    std::fflush(stdout);
    const std::string dp = job("dp", {"--data-parallel", "--microbatch", "2"});
    const double dpTps = tokensPerSecond(dp, context);
    std::printf("data parallel (2 workers, 2 windows each): %.1f tokens/s\n", dpTps);
    std::string memoryFields;
    for (int w = 0; w < 2; ++w) {
      const WorkerMemory m = memoryOf(pp, w);
      const int64_t predicted = m.predicted + baseline;
      std::string phases;
      for (const auto& [phase, bytes] : m.phases) {
        phases += " " + phase + " " + std::to_string(std::llround(mb(bytes)));
      }
      std::printf(
          "worker %d: peak RSS while training %.0f MB (%.0f MB with the profile before it and "
          "the gather after it; by phase, MB:%s); planner %.0f MB + base %.0f MB = %.0f MB\n",
          w, mb(m.peak), mb(m.lifePeak), phases.c_str(), mb(m.predicted), mb(baseline),
          mb(predicted));
      char buf[160];
      std::snprintf(buf, sizeof(buf),
                    " w%d_rss_mb=%.0f w%d_predicted_mb=%.0f w%d_rss_vs_predicted=%.3f", w,
                    mb(m.peak), w, mb(predicted), w,
                    static_cast<double>(m.peak) / static_cast<double>(predicted));
      memoryFields += buf;
    }
    for (const char* d : {"-pp", "-dp"}) std::filesystem::remove_all(base + d);
    std::filesystem::remove(tokens);
    std::printf(
        "RESULT pp_tokens_per_s=%.1f dp_tokens_per_s=%.1f pp_vs_dp=%.3f%s base_rss_mb=%.0f\n",
        ppTps, dpTps, ppTps / dpTps, memoryFields.c_str(), mb(baseline));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sinew-bench-gpt-small: %s\n", e.what());
    return 1;
  }
  return 0;
}
