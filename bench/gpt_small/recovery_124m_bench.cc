// sinew-bench-recovery-124m: the recovery bench on a model of real size. examples/train_gpt
// --preset small (GPT-2 small's dimensions: 12 blocks of width 768, vocabulary 50257, 124 M
// parameters, the head tied to the token embedding; AdamW, warm-up + cosine, clipping, float32)
// as pipelines on 8 workers under sinew-run, context T (default 32, so that a step takes
// seconds on two cores), global batch 2 in microbatches of 1, no evaluation, no reference.
//
// The plan: a layer profile measured first by one worker (the job's own profile would build
// every layer in all 8 workers at once, 8 x 2.5 GB), with the device memory set to M bytes
// (default 1.3 GB: at least 3 stages hold the model's 2 GB of parameters, gradients and AdamW
// state plus the embedding's and the head's workspaces), so that 8 workers run two pipelines
// of 4 stages and 7 run pipelines of 4 and 3. Every job below plans from that file.
//
//   steady:        8 workers, no peer-RAM versions, no kill: each worker's peak resident memory
//                  while training (the largest of its step phases, --memory-by-phase) against
//                  its stage's memory_bytes in the plan plus the resident memory of a train_gpt
//                  that has built nothing; the median seconds of a step.
//   reconfigure:   8 workers, worker 2 (a middle stage of pipeline 0) SIGKILLed after step K:
//                  the survivors re-instantiate the templates and copy the lost layers from
//                  the other pipeline. recovery_s: the kill to the next completed step;
//                  reconfigure_s: the kill to the last survivor's `recovered` event (every
//                  survivor holds its layers; the step it then runs is the rest); the largest
//                  copy one receiver got (its layers_moved event's copied_bytes and copy_s)
//                  against the same bytes over raw loopback TCP, measured right after the job.
//   rollback:      8 workers with peer-RAM versions every step, workers 1 and 5 (stage 1 of both
//                  pipelines) SIGKILLed at once after step K: no live copy of their layers is
//                  left, so the six survivors roll back to the newest committed version as two
//                  pipelines of 3 stages, restored from their own RAM and their peers'. The
//                  versions' host copies are the model's parameters and AdamW state 4 times
//                  over (pipeline 0's stages own the shards, pipeline 1's workers hold their
//                  replicas), 6 GB beside the training.
//   restart:       the reconfigure job with durable checkpoints every step (--checkpoint-dir):
//                  after the kill the whole job is stopped (SIGKILL of its process group) and
//                  started again on the same folder; the kill to the restarted job's first
//                  completed step.
//
// usage: sinew-bench-recovery-124m [--context T] [--memory-bytes M] [--kill-after K]
//                                  [--peer-ram] (peer-RAM versions in reconfigure and restart
//                                  too: both generations are held across the change, about
//                                  22 GB)
// Last line: RESULT recovery_s_124m=<s> recovery_speedup_124m=<restart/recovery>
//   copy_ratio_124m=<copy throughput / raw TCP> rss_vs_plan_124m=<largest worker's ratio>
//   reconfigure_s_124m=<s> ram_restore_s_124m=<s> restart_s_124m=<s> step_s_124m=<s>

#include <sys/resource.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../job_watch.h"
#include "../raw_tcp.h"
#include "../run_capture.h"

namespace {

using nlohmann::json;
using sinew_bench::Job;

constexpr int kWorkers = 8;
constexpr int kGlobalBatch = 2;

struct Options {
  int context = 32;
  std::string memoryBytes = "1300000000";
  int killAfter = 2;
  bool peerRam = false;
};

std::string base() {
  static const std::string b = (std::filesystem::temp_directory_path() /
                                ("sinew-bench-recovery-124m-" + std::to_string(::getpid())))
                                   .string();
  return b;
}

std::vector<std::string> recipe(const Options& o, const std::string& profile) {
  std::vector<std::string> r = {TRAIN_GPT_PATH,
                                "--preset",
                                "small",
                                "--context",
                                std::to_string(o.context),
                                "--global-batch",
                                std::to_string(kGlobalBatch),
                                "--microbatch",
                                "1",
                                "--no-reference",
                                "--eval-every",
                                "0",
                                "--progress",
                                "1",
                                "--devices-per-node",
                                "1",
                                "--tokens",
                                base() + ".tokens"};
  if (!profile.empty()) r.insert(r.end(), {"--profile", profile, "--memory-bytes", o.memoryBytes});
  return r;
}

// One worker measures the profile (and trains a step on the whole model, unlimited memory);
// the file written holds it with device_memory_bytes = M.
std::string measureProfile(const Options& o) {
  const std::string dir = base() + "-profile";
  std::vector<std::string> argv = {SINEW_RUN_PATH, "-n", "1", "--log-dir", dir};
  for (const auto& a : recipe(o, "")) argv.push_back(a);
  argv.insert(argv.end(),
              {"--steps", "1", "--fault-tolerance", "0", "--peer-checkpoint-every", "0"});
  sinew_bench::runCapturing(argv, dir + ".out");
  for (const json& e : sinew_bench::readEvents(dir + "/worker-0-events.jsonl")) {
    if (e["event"] != "profiled") continue;
    json profile = e.at("profile");
    profile["job"]["device_memory_bytes"] = std::stoll(o.memoryBytes);
    const std::string path = base() + "-profile.json";
    std::ofstream(path) << profile.dump() << "\n";
    std::filesystem::remove_all(dir);
    std::filesystem::remove(dir + ".out");
    return path;
  }
  throw std::runtime_error("the profiling job logged no profiled event (see " + dir + ".out)");
}

// The peak RSS of a train_gpt process that parses --help and exits.
int64_t baseRss() {
  const std::string out = base() + "-help.out";
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    if (std::freopen(out.c_str(), "w", stdout) == nullptr) _exit(127);
    ::execl(TRAIN_GPT_PATH, TRAIN_GPT_PATH, "--help", static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  struct rusage u {};
  if (::wait4(pid, &status, 0, &u) != pid) throw std::runtime_error("wait4 failed");
  std::filesystem::remove(out);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

double mb(int64_t bytes) { return static_cast<double>(bytes) / 1e6; }

// The first plan's stage of each worker: {first_layer, end_layer, memory_bytes}; throws unless
// its pipelines have the stages `shape` says ("4+4": two of four; what the figures assume).
std::map<int, json> firstPlan(const Job& job, const std::string& expected = "4+4") {
  for (const json& e : job.eventsOf(0)) {
    if (e["event"] != "plan") continue;
    std::map<int, json> stages;
    std::string shape;
    for (const json& p : e.at("pipelines")) {
      shape += (shape.empty() ? "" : "+") + std::to_string(p.at("stages").size());
      for (const json& s : p.at("stages")) stages[s.at("worker").get<int>()] = s;
    }
    if (shape != expected) {
      throw std::runtime_error("the plan of " + job.dir + " is pipelines of " + shape +
                               " stages, not " + expected +
                               ": choose --memory-bytes so that 3 or 4 stages hold the model");
    }
    return stages;
  }
  throw std::runtime_error("worker 0 of " + job.dir + " logged no plan");
}

struct Steady {
  double stepS = 0;
  double worstRatio = 0;
};

Steady steady(const Options& o, const std::string& profile, int64_t baseline) {
  std::vector<std::string> program = recipe(o, profile);
  program.insert(program.end(),
                 {"--steps", "4", "--peer-checkpoint-every", "0", "--memory-by-phase"});
  Job job(base() + "-steady", kWorkers, program);
  if (job.wait() != 0) throw std::runtime_error("the steady job failed; see " + job.dir + ".out");
  const std::map<int, json> plan = firstPlan(job);
  Steady r;
  std::vector<double> gaps;
  double last = 0;
  for (const json& e : job.eventsOf(0)) {
    if (e["event"] != "progress") continue;
    const double t = e["time"].get<double>();
    if (e["step"].get<int64_t>() >= 2) gaps.push_back(t - last);
    last = t;
  }
  r.stepS = sinew_bench::medianOf(gaps);
  std::printf("steady (8 workers, no peer-RAM versions): %.2f s a step (median of %zu)\n", r.stepS,
              gaps.size());
  for (const auto& [w, stage] : plan) {
    int64_t peak = -1;
    for (const json& e : job.eventsOf(w)) {
      if (e["event"] != "done" || !e.contains("peak_rss_by_phase_bytes")) continue;
      for (const auto& [phase, bytes] : e["peak_rss_by_phase_bytes"].items()) {
        if (phase != "gather") peak = std::max(peak, bytes.get<int64_t>());
      }
    }
    if (peak < 0) throw std::runtime_error("worker " + std::to_string(w) + " logged no phases");
    const int64_t predicted = stage.at("memory_bytes").get<int64_t>() + baseline;
    const double ratio = static_cast<double>(peak) / static_cast<double>(predicted);
    r.worstRatio = std::max(r.worstRatio, ratio);
    std::printf(
        "  worker %d layers [%d, %d): peak RSS %.0f MB, planner %.0f MB + base %.0f MB: %.3f\n", w,
        stage.at("first_layer").get<int>(), stage.at("end_layer").get<int>(), mb(peak),
        mb(stage.at("memory_bytes").get<int64_t>()), mb(baseline), ratio);
  }
  job.remove();
  return r;
}

struct Recovery {
  double recoveryS = 0;     // the kill to the next completed step
  double reconfigureS = 0;  // the kill to the last survivor's recovered event
  double noticedS = 0;      // the kill to the last survivor's start of its recovery
  double reenterS = 0;      // the longest recovery (a recovered event's duration_s)
  int64_t copyBytes = 0;    // the largest copy one receiver got
  double copyS = 0;
};

Recovery killAndRecover(const Options& o, const std::string& name, const std::string& profile,
                        std::vector<std::string> extra, int workers, const std::string& shape,
                        const std::vector<int>& victims, const std::string& expect) {
  std::vector<std::string> program = recipe(o, profile);
  program.insert(program.end(), {"--steps", std::to_string(o.killAfter + 3)});
  program.insert(program.end(), extra.begin(), extra.end());
  Job job(base() + "-" + name, workers, program);
  const double t = sinew_bench::killAt(job, o.killAfter, victims, std::chrono::minutes(10));
  firstPlan(job, shape);  // The victims' stages are those the header says.
  Recovery r;
  r.recoveryS = sinew_bench::recoveredAfter(job, t, name, expect) - t;
  std::map<int, json> ready;  // each survivor's first recovered event after the kill
  for (json& e : job.all("recovered")) {
    const double at = e["time"].get<double>();
    const int w = e["worker"].get<int>();
    if (at > t && (ready.count(w) == 0 || at < ready[w]["time"].get<double>())) ready[w] = e;
  }
  if (ready.size() != workers - victims.size()) {
    throw std::runtime_error(name + ": " + std::to_string(ready.size()) +
                             " survivors logged a recovered event");
  }
  for (const auto& [w, e] : ready) {
    const double at = e["time"].get<double>(), took = e.value("duration_s", 0.0);
    r.reconfigureS = std::max(r.reconfigureS, at - t);
    r.noticedS = std::max(r.noticedS, at - took - t);
    r.reenterS = std::max(r.reenterS, took);
  }
  for (const json& e : job.all("layers_moved")) {
    if (e["time"].get<double>() <= t) continue;
    const int64_t bytes = e.value("copied_bytes", int64_t{0});
    if (bytes > r.copyBytes) {
      r.copyBytes = bytes;
      r.copyS = e.value("copy_s", 0.0);
    }
  }
  job.remove();
  return r;
}

double restartFromDisk(const Options& o, const std::string& profile, bool peerRam) {
  const std::string ckpt = base() + "-restart-ckpt";
  std::vector<std::string> program = recipe(o, profile);
  program.insert(program.end(), {"--steps", std::to_string(o.killAfter + 3), "--checkpoint-dir",
                                 ckpt, "--checkpoint-every", "1"});
  if (!peerRam) program.insert(program.end(), {"--peer-checkpoint-every", "0"});
  Job first(base() + "-restart-a", kWorkers, program);
  const double t = sinew_bench::killAt(first, o.killAfter, {2}, std::chrono::minutes(10));
  first.killAll();  // Stop the job as a user would, then start it again on its folder.
  Job second(base() + "-restart-b", kWorkers, program);
  if (second.wait() != 0) {
    throw std::runtime_error("the restarted job failed; see " + second.dir + ".out");
  }
  if (sinew_bench::slurp(second.dir + ".out").find(" resumed from the durable checkpoint") ==
      std::string::npos) {
    throw std::runtime_error(
        "the restarted job does not say it resumed from the durable checkpoint (see " + second.dir +
        ".out)");
  }
  const double next = second.firstStepAfter(t);
  if (next == 0) throw std::runtime_error("the restarted job completed no step");
  first.remove();
  second.remove();
  std::filesystem::remove_all(ckpt);
  return next - t;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const bool hasValue = i + 1 < argc;
    if (a == "--context" && hasValue) {
      o.context = std::atoi(argv[++i]);
    } else if (a == "--memory-bytes" && hasValue) {
      o.memoryBytes = argv[++i];
    } else if (a == "--kill-after" && hasValue) {
      o.killAfter = std::atoi(argv[++i]);
    } else if (a == "--peer-ram") {
      o.peerRam = true;
    } else {
      throw std::invalid_argument("unknown or incomplete argument '" + a + "'");
    }
  }
  if (o.context < 8 || o.context > 1024) throw std::invalid_argument("--context: in [8, 1024]");
  if (o.killAfter < 1) throw std::invalid_argument("--kill-after: at least 1");
  if (o.memoryBytes.empty() || o.memoryBytes.find_first_not_of("0123456789") != std::string::npos)
    throw std::invalid_argument("--memory-bytes: a number of bytes");
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr,
                 "sinew-bench-recovery-124m: %s\nusage: sinew-bench-recovery-124m [--context T] "
                 "[--memory-bytes M] [--kill-after K] [--peer-ram]\n",
                 e.what());
    return 2;
  }
  try {
    sinew_bench::runCapturing({TRAIN_GPT_PATH, "--tokens", base() + ".tokens", "--steps", "1",
                               "--no-reference", "--eval-every", "0", "--progress", "0"},
                              base() + "-tokens.out");
    std::filesystem::remove(base() + "-tokens.out");
    const int64_t baseline = baseRss();
    const std::string profile = measureProfile(o);
    const Recovery b =
        killAndRecover(o, "rollback", profile, {}, kWorkers, "4+4", {1, 5}, " restored from ");
    std::printf(
        "rollback (workers 1 and 5 killed after step %d, peer-RAM versions every step): next "
        "step %.2f s after the kill, every survivor ready %.2f s after it (the last to notice the "
        "loss %.2f s after it, the longest recovery %.2f s)\n",
        o.killAfter, b.recoveryS, b.reconfigureS, b.noticedS, b.reenterS);
    std::fflush(stdout);
    const Steady s = steady(o, profile, baseline);
    std::fflush(stdout);
    const std::vector<std::string> peer =
        o.peerRam ? std::vector<std::string>{}
                  : std::vector<std::string>{"--peer-checkpoint-every", "0"};
    const Recovery a = killAndRecover(o, "reconfigure", profile, peer, kWorkers, "4+4", {2},
                                      " copied from worker");
    const double tcpS = sinew_bench::rawTcpSeconds(a.copyBytes, 3);
    std::printf(
        "reconfigure (worker 2 killed after step %d): next step %.2f s after the kill, every "
        "survivor ready %.2f s after it (the last to notice the loss %.2f s after it, the longest "
        "recovery %.2f s); largest copy %.0f MB in %.3f s, raw TCP %.3f s\n",
        o.killAfter, a.recoveryS, a.reconfigureS, a.noticedS, a.reenterS, mb(a.copyBytes), a.copyS,
        tcpS);
    std::fflush(stdout);
    const double c = restartFromDisk(o, profile, o.peerRam);
    std::printf(
        "restart from disk (durable versions every step): first step %.2f s after the kill\n", c);
    std::filesystem::remove(base() + ".tokens");
    std::filesystem::remove(profile);
    std::printf(
        "RESULT recovery_s_124m=%.3f recovery_speedup_124m=%.2f copy_ratio_124m=%.3f "
        "rss_vs_plan_124m=%.3f reconfigure_s_124m=%.3f ram_restore_s_124m=%.3f "
        "restart_s_124m=%.3f step_s_124m=%.3f\n",
        a.recoveryS, c / a.recoveryS, a.copyS > 0 ? tcpS / a.copyS : 0, s.worstRatio,
        a.reconfigureS, b.recoveryS, c, s.stepS);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sinew-bench-recovery-124m: %s\n", e.what());
    return 1;
  }
  return 0;
}
