// sinew-bench-recovery: how long a pipeline job stands still after a SIGKILL, measured against
// stopping it and restarting it from disk, on this machine.
//
// Every job is examples/train_pp under sinew-run with a progress event per step
// (--progress 1). The bench watches worker 0's events; once the job has trained `killAt`
// steps it SIGKILLs the victims itself (by the PIDs the coordinator logged at their hello)
// and notes the time. "The next completed step" is the earliest progress event of any
// survivor in an epoch after the kill's (a progress event is written right after a step's
// optimizer step).
//
//  (a) recovery_s: 6 workers (three 2-stage pipelines), worker 2 killed: the survivors
//      reconfigure from the templates and copy the lost layers from live workers.
//  (b) ram_restore_s: 8 workers planned from a fixed profile (pipelines of 5 and 3 stages),
//      workers 0 and 5 killed at once, so no live copy of embed..block0 is left: the job rolls back
//      to the newest committed version and restores it from its own and peers' RAM.
//  (c) restart_s: the job of (a) with durable checkpoints every step; after the kill the whole
//      job is stopped (SIGKILL of its sinew-run process group) and started again on the same
//      checkpoint folder: the time from the kill to the restarted job's first completed step.
//  Throughput: samples/s of job (a) after the recovery (median of its progress reports)
//  against before the kill; and of (d), the job of (a) losing two workers at once, one in each
//  of two pipelines (workers 1 and 3), after its reconfiguration against before.
//
// Last line: RESULT recovery_s=<a> ram_restore_s=<b> restart_s=<c> recovery_speedup=<c/a>
//            throughput_after_1_loss=<after/before>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../job_watch.h"

namespace {

using json = nlohmann::json;
using sinew_bench::killAt;

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// examples/train_pp under sinew-run with a progress event per step.
struct Job : sinew_bench::Job {
  Job(const std::string& dir, int workers, const std::vector<std::string>& args)
      : sinew_bench::Job(dir, workers, program(args)) {}

  static std::vector<std::string> program(const std::vector<std::string>& args) {
    std::vector<std::string> p = {TRAIN_PP_PATH,    "--progress",         "1",
                                  "--no-reference", "--devices-per-node", "1"};
    p.insert(p.end(), args.begin(), args.end());
    return p;
  }
};

std::string tmpDir(const std::string& name);

// A fixed profile (a measured one varies from run to run): ten equal layers of 100 kB and
// 450 kB per worker plan 8 workers as pipelines of 5 (w0..w4) and 3 (w5..w7) stages, w0 and
// w5 both holding embed..block0.
std::string fourStageProfile() {
  const std::string path = tmpDir("profile") + ".json";
  std::ofstream out(path);
  out << R"({"version": 1, "microbatch_size": 4, "job": {"devices_per_node": 1,
    "device_memory_bytes": 450000, "inter_stage_gbps": 10.0,
    "allreduce": {"algorithm": "ring", "bandwidth_gbps": 1000.0, "latency_us": 1.0}},
    "layers": [)";
  for (int l = 0; l < 10; ++l) {
    std::string name = l == 0 ? "embed" : l == 9 ? "head" : "block" + std::to_string(l - 1);
    out << (l ? ", " : "") << R"({"name": ")" << name
        << R"(", "forward_ms": 1.0, "backward_ms": 2.0, "param_bytes": 100000,
      "optimizer_bytes": 0, "activation_bytes": 1000, "output_bytes": 16384})";
  }
  out << "]}\n";
  return path;
}

std::string tmpDir(const std::string& name) {
  return std::filesystem::temp_directory_path().string() + "/sinew-bench-recovery-" + name + "-" +
         std::to_string(::getpid());
}

struct Measured {
  double seconds = 0;
  double before = 0, after = 0;  // samples/s
};

// `expect`: what the job's output must say about its recovery (else the measurement is not of
// the path it names).
Measured killAndRecover(const std::string& name, int workers, std::vector<std::string> args,
                        const std::vector<int>& victims, int steps, int killStep,
                        const std::string& expect) {
  args.insert(args.end(), {"--steps", std::to_string(steps)});
  Job job(tmpDir(name), workers, args);
  const double t = killAt(job, killStep, victims);
  const double next = sinew_bench::recoveredAfter(job, t, name, expect);
  Measured m;
  m.seconds = next - t;
  int reporter = 0;
  while (std::find(victims.begin(), victims.end(), reporter) != victims.end()) ++reporter;
  m.before = median(job.rates(reporter, 0, t));
  m.after = median(job.rates(reporter, next, 1e18));
  std::filesystem::remove_all(job.dir);
  std::filesystem::remove(job.dir + ".out");
  return m;
}

double restartFromDisk(int steps, int killStep) {
  const std::string ckpt = tmpDir("restart-ckpt");
  std::vector<std::string> args = {"--steps", std::to_string(steps), "--checkpoint-dir",
                                   ckpt,      "--checkpoint-every",  "1"};
  Job first(tmpDir("restart-a"), 6, args);
  const double t = killAt(first, killStep, {2});
  first.killAll();  // Stop the job as a user would, then start it again on its folder.
  Job second(tmpDir("restart-b"), 6, args);
  const int status = second.wait();
  if (status != 0) {
    throw std::runtime_error("the restarted job failed (exit " + std::to_string(status) + "; see " +
                             second.dir + ".out)");
  }
  const double next = second.firstStepAfter(t);
  if (next == 0) throw std::runtime_error("the restarted job completed no step");
  for (const auto& d : {first.dir, second.dir, ckpt}) {
    std::filesystem::remove_all(d);
    std::filesystem::remove(d + ".out");
  }
  return next - t;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 40;
  if (argc == 3 && std::string(argv[1]) == "--steps") steps = std::max(30, std::atoi(argv[2]));
  const int killStep = steps / 3;
  try {
    Measured a = killAndRecover("reconfigure", 6, {}, {2}, steps, killStep, " copied from worker");
    Measured b = killAndRecover("rollback", 8, {"--profile", fourStageProfile()}, {0, 5}, steps,
                                killStep, " restored from ");
    Measured d =
        killAndRecover("reconfigure-2", 6, {}, {1, 3}, steps, killStep, " copied from worker");
    const double c = restartFromDisk(steps, killStep);
    std::printf("time from SIGKILL to the next completed step (train_pp, %d steps, kill at %d)\n",
                steps, killStep);
    std::printf("  (a) reconfiguration, 6 workers, 1 killed:          %8.3f s\n", a.seconds);
    std::printf("  (b) rollback from peer RAM, 8 workers, 2 killed:   %8.3f s\n", b.seconds);
    std::printf("  (c) stop and restart from disk, 6 workers:         %8.3f s\n", c);
    std::printf("  (d) reconfiguration, 6 workers, 2 killed (two pipelines): %8.3f s\n", d.seconds);
    std::printf("throughput of (a): %.1f samples/s before, %.1f after (5 of 6 workers)\n", a.before,
                a.after);
    std::printf("throughput of (d): %.1f samples/s before, %.1f after (4 of 6 workers)\n", d.before,
                d.after);
    std::printf(
        "throughput after losing k of 6 workers, relative to before: k=1 %.3f (goal >= %.3f), k=2 "
        "%.3f (goal >= %.3f)\n",
        a.before > 0 ? a.after / a.before : 0, 5.0 / 6, d.before > 0 ? d.after / d.before : 0,
        4.0 / 6);
    std::printf(
        "RESULT recovery_s=%.3f ram_restore_s=%.3f restart_s=%.3f recovery_speedup=%.1f "
        "throughput_after_1_loss=%.3f\n",
        a.seconds, b.seconds, c, a.seconds > 0 ? c / a.seconds : 0,
        a.before > 0 ? a.after / a.before : 0);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sinew-bench-recovery: %s\n", e.what());
    return 1;
  }
  return 0;
}
