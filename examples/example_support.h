#pragma once

// What the examples share: their common command line (parsed strictly: whole-string numbers,
// no nan or inf, nothing that wraps), the options it sets, the single-process reference
// training every example compares with, and the RESULT line.

#include <ATen/ATen.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/utils/clip_grad.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "sinew/init.h"
#include "sinew/trainer.h"

namespace sinew_example {

constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();

// The options every example takes.
struct CommonArgs {
  int64_t steps = 80;
  int64_t globalBatch = 64;
  int64_t microbatch = 8;
  uint64_t seed = 1;
  double lr = 0.01;
  std::string optimizer = "adam";
  std::string schedule = "none";  // none (the optimizer's rate), cosine, step
  int64_t warmup = 0;             // warm-up steps of the cosine schedule
  double clip = 0;                // global-norm clipping; 0: none
  sinew::Sampling sampling = sinew::Sampling::kWithReplacement;
  int64_t datasetSize = 0;  // 0: the example's own
  bool stepLoop = false;    // a loop over Trainer::step() even without --eval-every
  std::string sampleLog;    // with a step loop: each committed step's samples, to PATH.<worker>
  // The reference skips a step whose gradient is not finite, as a job with dynamic loss
  // scaling does (set by programs that offer it).
  bool skipNonFinite = false;
  int64_t evalEvery = 0;    // evaluate after every N-th step; 0: never
  int64_t evalSamples = 0;  // held-out samples per evaluation; 0: one global batch
  bool reference = true;
  bool float32 = false;
  int progress = 10;
  std::string checkpointDir;
  int checkpointEvery = 0;
  bool incremental = false;    // TrainerOptions::incrementalCheckpoints
  bool memoryByPhase = false;  // TrainerOptions::memoryByPhase
  std::string device = "cpu";
  sinew::CommBackend backend = sinew::CommBackend::kAuto;
};

constexpr const char* kCommonUsage =
    "[--steps N] [--global-batch B] [--microbatch b] [--seed S] [--lr LR] "
    "[--optimizer adam|adamw|sgd|rmsprop|adagrad] [--schedule none|cosine|step] [--warmup N] "
    "[--clip C] [--sampling replacement|epochs] [--dataset-size N] [--eval-every N] "
    "[--eval-samples K] [--step-loop] [--sample-log PATH] [--float32] [--progress N] "
    "[--checkpoint-dir "
    "DIR] "
    "[--checkpoint-every K] [--incremental-checkpoints] [--memory-by-phase] [--no-reference] "
    "[--device cpu|cuda|cuda:N] "
    "[--backend auto|gloo|nccl]";

// Walks argv flag by flag. `usage` is the program's usage after its name: fail() prints the
// error and it on stderr and exits with 2; --help (or -h) prints it on stdout and exits with 0.
class ArgReader {
 public:
  ArgReader(int argc, char** argv, std::string program, std::string usage)
      : argc_(argc), argv_(argv), program_(std::move(program)), usage_(std::move(usage)) {}

  bool next() {
    if (++i_ >= argc_) return false;
    flag_ = argv_[i_];
    if (flag_ == "--help" || flag_ == "-h") {
      std::printf("usage: %s %s\n", program_.c_str(), usage_.c_str());
      std::exit(0);
    }
    return true;
  }
  const std::string& flag() const { return flag_; }
  [[noreturn]] void fail(const std::string& error) const {
    std::fprintf(stderr, "%s: %s\nusage: %s %s\n", program_.c_str(), error.c_str(),
                 program_.c_str(), usage_.c_str());
    std::exit(2);
  }
  std::string value() {
    if (i_ + 1 >= argc_) fail(flag_ + " needs a value");
    return argv_[++i_];
  }
  int64_t integer(int64_t max) {
    std::string v = value();
    int64_t x = 0;
    auto r = std::from_chars(v.data(), v.data() + v.size(), x);
    if (v.empty() || r.ec != std::errc() || r.ptr != v.data() + v.size() || x < 0 || x > max) {
      fail(flag_ + ": '" + v + "' is not an integer in [0, " + std::to_string(max) + "]");
    }
    return x;
  }
  double number() {
    std::string v = value();
    double d = 0;
    auto r = std::from_chars(v.data(), v.data() + v.size(), d);
    if (v.empty() || r.ec != std::errc() || r.ptr != v.data() + v.size() || !std::isfinite(d) ||
        d < 0) {
      fail(flag_ + ": '" + v + "' is not a finite non-negative number");
    }
    return d;
  }

 private:
  int argc_;
  char** argv_;
  std::string program_;
  std::string usage_;
  int i_ = 0;
  std::string flag_;
};

// Handles r.flag() if it is a common option; returns whether it was.
inline bool parseCommon(ArgReader& r, CommonArgs& a) {
  const std::string& s = r.flag();
  if (s == "--steps") {
    a.steps = r.integer(int64_t{1} << 40);
  } else if (s == "--global-batch") {
    a.globalBatch = r.integer(kMaxInt);
  } else if (s == "--microbatch") {
    a.microbatch = r.integer(kMaxInt);
  } else if (s == "--seed") {
    a.seed = static_cast<uint64_t>(r.integer(std::numeric_limits<int64_t>::max()));
  } else if (s == "--lr") {
    a.lr = r.number();
  } else if (s == "--optimizer") {
    a.optimizer = r.value();
    if (a.optimizer != "adam" && a.optimizer != "adamw" && a.optimizer != "sgd" &&
        a.optimizer != "rmsprop" && a.optimizer != "adagrad") {
      r.fail("unknown optimizer " + a.optimizer);
    }
  } else if (s == "--schedule") {
    a.schedule = r.value();
    if (a.schedule != "none" && a.schedule != "cosine" && a.schedule != "step") {
      r.fail("unknown schedule " + a.schedule);
    }
  } else if (s == "--warmup") {
    a.warmup = r.integer(int64_t{1} << 40);
  } else if (s == "--clip") {
    a.clip = r.number();
  } else if (s == "--sampling") {
    const std::string v = r.value();
    if (v != "replacement" && v != "epochs") r.fail("unknown sampling " + v);
    a.sampling = v == "epochs" ? sinew::Sampling::kEpochs : sinew::Sampling::kWithReplacement;
  } else if (s == "--dataset-size") {
    a.datasetSize = r.integer(int64_t{1} << 40);
    if (a.datasetSize == 0) r.fail("--dataset-size must be positive");
  } else if (s == "--step-loop") {
    a.stepLoop = true;
  } else if (s == "--sample-log") {
    a.sampleLog = r.value();
    a.stepLoop = true;
  } else if (s == "--eval-every") {
    a.evalEvery = r.integer(int64_t{1} << 40);
  } else if (s == "--eval-samples") {
    a.evalSamples = r.integer(int64_t{1} << 30);
  } else if (s == "--float32") {
    a.float32 = true;
  } else if (s == "--progress") {
    a.progress = static_cast<int>(r.integer(kMaxInt));
  } else if (s == "--checkpoint-dir") {
    a.checkpointDir = r.value();
  } else if (s == "--checkpoint-every") {
    a.checkpointEvery = static_cast<int>(r.integer(kMaxInt));
  } else if (s == "--incremental-checkpoints") {
    a.incremental = true;
  } else if (s == "--memory-by-phase") {
    a.memoryByPhase = true;
  } else if (s == "--no-reference") {
    a.reference = false;
  } else if (s == "--device") {
    a.device = r.value();  // Checked by the trainer (TrainerOptions::device).
  } else if (s == "--backend") {
    const std::string b = r.value();
    if (b == "auto") {
      a.backend = sinew::CommBackend::kAuto;
    } else if (b == "gloo") {
      a.backend = sinew::CommBackend::kGloo;
    } else if (b == "nccl") {
      a.backend = sinew::CommBackend::kNccl;
    } else {
      r.fail("--backend: '" + b + "' is not auto, gloo or nccl");
    }
  } else {
    return false;
  }
  return true;
}

// Checks what parseCommon() cannot check flag by flag.
inline void checkCommon(const ArgReader& r, const CommonArgs& a) {
  if (a.microbatch <= 0 || a.globalBatch % a.microbatch != 0) {
    r.fail("--global-batch must be a positive multiple of --microbatch");
  }
}

// The learning-rate schedule of --schedule: none; cosine, a warm-up of --warmup steps to --lr,
// then down to a tenth of it at the last step; step, halving every quarter of the steps.
inline sinew::LrSchedule lrSchedule(const CommonArgs& a) {
  if (a.schedule == "cosine") {
    return sinew::warmupCosine(a.lr, std::min(a.warmup, a.steps), a.steps, a.lr / 10);
  }
  if (a.schedule == "step") return sinew::stepDecay(a.lr, std::max<int64_t>(1, a.steps / 4), 0.5);
  return {};
}

inline sinew::TrainerOptions trainerOptions(const CommonArgs& a) {
  sinew::TrainerOptions o;
  o.steps = a.steps;
  o.globalBatch = a.globalBatch;
  o.microbatch = a.microbatch;
  o.seed = a.seed;
  o.sampling = a.sampling;
  o.progressEvery = a.progress;
  o.dtype = a.float32 ? at::kFloat : at::kDouble;
  o.checkpointDir = a.checkpointDir;
  o.checkpointEvery = a.checkpointEvery;
  o.incrementalCheckpoints = a.incremental;
  o.memoryByPhase = a.memoryByPhase;
  o.device = a.device;
  o.backend = a.backend;
  o.lrSchedule = lrSchedule(a);
  if (a.clip > 0) o.clipGradNorm = a.clip;
  return o;
}

// sinew::init() for `program`: the job's handle, or null after saying why this worker could
// not join (the program then exits with status 1).
inline std::unique_ptr<sinew::Context> join(const char* program, int* argc, char*** argv) {
  try {
    return sinew::init(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: cannot join the job: %s\n", program, e.what());
    return nullptr;
  }
}

// Trains `spec` with `o` on this worker into *trainer and *result. Returns the program's exit
// status when it must stop here, having said why and left the job (Context::finishJob()): 3
// when the job expelled this worker, 1 on another error (e.g. its last checkpoint could not be
// written; at least the job's status if that is worse), 0 when it was preempted and the job
// goes on, 75 when the whole job stopped; nothing when it trained to the end, after saying so
// if it resumed from a durable checkpoint.
// With --eval-every N it runs its own loop over Trainer::step() and evaluates `heldOut`
// (--eval-samples of it) after every N-th step, printing each result; `beforeFinish` (which
// also makes it run its own loop) is called after the last step, before Trainer::finish().
inline std::optional<int> train(const char* program, sinew::Context& ctx,
                                const sinew::ModelSpec& spec, const sinew::TrainerOptions& o,
                                std::unique_ptr<sinew::Trainer>* trainer,
                                sinew::TrainResult* result, const CommonArgs& a,
                                const sinew::Dataset& heldOut,
                                const std::function<void(sinew::Trainer&)>& beforeFinish = {}) {
  try {
    *trainer = std::make_unique<sinew::Trainer>(ctx, spec, o);
    const auto t0 = std::chrono::steady_clock::now();
    if (a.evalEvery <= 0 && !a.stepLoop && !beforeFinish) {
      *result = (*trainer)->run();
    } else {
      sinew::Trainer& t = **trainer;
      const int64_t count = a.evalSamples > 0 ? a.evalSamples : a.globalBatch;
      std::unique_ptr<std::FILE, int (*)(std::FILE*)> sampleLog(nullptr, &std::fclose);
      if (!a.sampleLog.empty()) {
        const std::string path = a.sampleLog + "." + std::to_string(ctx.worker());
        sampleLog.reset(std::fopen(path.c_str(), "a"));
        if (!sampleLog) throw sinew::IoError("cannot open the sample log " + path);
      }
      for (sinew::StepResult s; !(s = t.step()).done;) {
        if (s.skipped) {
          std::printf("%s: worker %d skipped step %lld (loss scale %g)\n", program, ctx.worker(),
                      static_cast<long long>(s.step), s.lossScale);
        }
        if (s.rolledBackTo >= 0) {
          std::printf("%s: worker %d's loop moved back to step %lld and committed step %lld\n",
                      program, ctx.worker(), static_cast<long long>(s.rolledBackTo),
                      static_cast<long long>(s.step));
        }
        if (sampleLog) {
          // "step S: position:index ...", flushed at once: a worker killed later keeps it.
          std::fprintf(sampleLog.get(), "step %lld:", static_cast<long long>(s.step));
          for (size_t i = 0; i < s.samples.size(); ++i) {
            std::fprintf(sampleLog.get(), " %lld:%lld",
                         static_cast<long long>(s.samplePositions[i]),
                         static_cast<long long>(s.samples[i]));
          }
          std::fprintf(sampleLog.get(), "\n");
          std::fflush(sampleLog.get());
        }
        if (a.evalEvery <= 0 || (s.step + 1) % a.evalEvery != 0) continue;
        sinew::EvalResult e = t.evaluate(heldOut, count);
        if (e.done) break;
        if (e.abandoned) {
          std::printf(
              "%s: worker %d abandoned the eval after step %lld: the job's members "
              "changed or it rolled back\n",
              program, ctx.worker(), static_cast<long long>(s.step));
          continue;
        }
        std::printf("%s: worker %d eval after step %lld: loss %.12g (lr %.6g, grad norm %.6g)\n",
                    program, ctx.worker(), static_cast<long long>(e.afterStep), e.loss,
                    s.learningRate, s.gradNorm);
      }
      sampleLog.reset();
      if (beforeFinish) beforeFinish(t);
      *result = t.finish();
    }
    std::printf("%s: worker %d trained steps %lld..%lld in %.3f s\n", program, ctx.worker(),
                static_cast<long long>(result->startStep),
                static_cast<long long>(result->steps - 1),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  } catch (const sinew::Expelled& e) {
    std::fprintf(stderr, "%s: worker %d left the job: %s\n", program, ctx.worker(), e.what());
    const int job = ctx.finishJob();  // Rank 0 under mpirun/srun waits for the job's end.
    return job == 0 || job == 75 ? 3 : job;
  } catch (const sinew::Error& e) {
    std::fprintf(stderr, "%s: worker %d failed: %s\n", program, ctx.worker(), e.what());
    const int job = ctx.finishJob();  // Rank 0 under mpirun/srun waits for the job's end.
    return job == 0 || job == 75 ? 1 : job;
  }
  if (result->preempted) {
    std::printf("%s: worker %d left the job (preempted) after step %lld\n", program, ctx.worker(),
                static_cast<long long>(result->steps - 1));
    std::fflush(stdout);
    return ctx.finishJob();  // 0, or 75 when the whole job stopped there
  }
  if (result->startStep > 0) {
    std::printf("%s: worker %d resumed from the durable checkpoint of step %lld\n", program,
                ctx.worker(), static_cast<long long>(result->startStep - 1));
  }
  return std::nullopt;
}

inline sinew::OptimizerFactory optimizer(const CommonArgs& a) {
  if (a.optimizer == "adamw") return sinew::adamw(a.lr, 0.1);
  if (a.optimizer == "sgd") return sinew::sgd(a.lr, 0.9);
  if (a.optimizer == "rmsprop") return sinew::rmsprop(a.lr);
  if (a.optimizer == "adagrad") return sinew::adagrad(a.lr);
  return sinew::adam(a.lr);
}

// The held-out split: the samples after the training set's (datasetSize + i).
inline sinew::Dataset heldOut(const sinew::ModelSpec& spec) {
  sinew::Dataset data = spec.dataset;
  const int64_t offset = spec.datasetSize;
  return [data, offset](int64_t i) { return data(offset + i); };
}

// SplitMix64: the examples' deterministic data.
inline uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// As the trainer does: floating-point data in the training dtype, integer data unchanged.
inline at::Tensor toTraining(const at::Tensor& t, at::ScalarType dtype) {
  return at::isFloatingType(t.scalar_type()) ? t.to(dtype) : t;
}

// The output of `m` on `samples` stacked as the trainer stacks a microbatch: the first layer
// gets the inputs as one tensor, or as {input, extra inputs...} when the samples have extra
// inputs (sinew::Sample); *targets (if given) gets the stacked targets.
inline at::Tensor forwardSamples(torch::nn::Sequential& m,
                                 const std::vector<sinew::Sample>& samples, at::ScalarType dtype,
                                 at::Tensor* targets = nullptr) {
  std::vector<std::vector<at::Tensor>> inputs(1 + samples.at(0).extraInputs.size());
  std::vector<at::Tensor> ys;
  for (const sinew::Sample& s : samples) {
    for (size_t k = 0; k < inputs.size(); ++k) {
      inputs[k].push_back(k == 0 ? s.input : s.extraInputs.at(k - 1));
    }
    ys.push_back(s.target);
  }
  if (targets != nullptr) *targets = toTraining(at::stack(ys), dtype);
  if (inputs.size() == 1) return m->forward(toTraining(at::stack(inputs[0]), dtype));
  std::vector<at::Tensor> stacked;
  for (const auto& x : inputs) stacked.push_back(toTraining(at::stack(x), dtype));
  return m->forward(stacked);
}

// The same training, single-process, in plain libtorch over the same global batches. Returns
// the last step's loss; *out gets the trained model. Each global batch goes through in chunks
// of `chunk` samples (the whole batch by default: the same gradient as the trainer's
// microbatches, in a few large operations instead of many small ones), each chunk's mean loss
// weighted by its share of the batch. A model whose microbatches differ in shape (train_pp
// --ragged) passes its microbatch. The reference runs after the job, when the other workers
// have left: it uses every core.
// With --eval-every it prints the evaluation of `heldOut` after the same steps as the job,
// whole global batches at a time. `share`, when given, makes the tensors ModelSpec::tied ties
// one (the model uses one of them in both places) and returns the parameters to optimize.
inline double trainReference(
    const CommonArgs& a, const sinew::ModelSpec& spec, at::ScalarType dtype,
    torch::nn::Sequential* out, int64_t chunk = 0, const sinew::Dataset& heldOut = {},
    const std::function<std::vector<at::Tensor>(torch::nn::Sequential&)>& share = {}) {
  if (chunk <= 0) chunk = a.globalBatch;
  const int threads = at::get_num_threads();
  at::set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency())));
  torch::nn::Sequential ref = sinew::buildModel(spec, a.seed, dtype);
  const std::vector<at::Tensor> params = share ? share(ref) : ref->parameters();
  auto opt = spec.optimizer(params);
  const sinew::LrSchedule schedule = lrSchedule(a);
  double loss = 0;
  for (int64_t s = 0; s < a.steps; ++s) {
    auto idx = sinew::batchIndices(a.sampling, a.seed, s, a.globalBatch, spec.datasetSize);
    if (schedule) {
      for (auto& g : opt->param_groups()) g.options().set_lr(schedule(s));
    }
    opt->zero_grad();
    double sum = 0;
    for (int64_t first = 0; first < a.globalBatch; first += chunk) {
      std::vector<sinew::Sample> samples;
      for (int64_t j = first; j < first + chunk; ++j) samples.push_back(spec.dataset(idx[j]));
      at::Tensor y;
      at::Tensor l = spec.loss(forwardSamples(ref, samples, dtype, &y), y);
      (l * (static_cast<double>(chunk) / a.globalBatch)).backward();
      sum += l.item<double>() * chunk;
    }
    loss = sum / a.globalBatch;
    bool finite = true;
    for (size_t i = 0; a.skipNonFinite && finite && i < params.size(); ++i) {
      finite = !params[i].grad().defined() || params[i].grad().isfinite().all().item<bool>();
    }
    if (!finite) {
      std::printf("reference skipped step %lld\n", static_cast<long long>(s));
    } else {
      if (a.clip > 0) torch::nn::utils::clip_grad_norm_(params, a.clip);
      opt->step();
    }
    if (a.evalEvery > 0 && heldOut && (s + 1) % a.evalEvery == 0) {
      at::NoGradGuard noGrad;
      ref->eval();
      const int64_t count = a.evalSamples > 0 ? a.evalSamples : a.globalBatch;
      double evalSum = 0;
      for (int64_t first = 0; first < count; first += a.globalBatch) {
        std::vector<sinew::Sample> samples;
        for (int64_t j = first; j < first + a.globalBatch; ++j) samples.push_back(heldOut(j));
        at::Tensor y;
        evalSum += spec.loss(forwardSamples(ref, samples, dtype, &y), y).item<double>() *
                   static_cast<double>(a.globalBatch);
      }
      ref->train();
      std::printf("reference eval after step %lld: loss %.12g\n", static_cast<long long>(s),
                  evalSum / static_cast<double>(count));
    }
  }
  at::set_num_threads(threads);
  *out = ref;
  return loss;
}

// max |mine - theirs| / max |theirs| of one tensor (mine may be on a GPU).
inline double relDiff(const at::Tensor& mine, const at::Tensor& theirs) {
  double diff = (mine.detach().cpu() - theirs).abs().max().item<double>();
  return diff / std::max(theirs.abs().max().item<double>(), 1e-30);
}

inline void printResult(const sinew::TrainResult& r, double refLoss, double maxRel) {
  std::printf(
      "RESULT final_loss=%.9g reference_loss=%.9g max_param_rel_diff=%.3g recoveries=%d "
      "recovery_s_max=%.3f\n",
      r.finalLoss, refLoss, maxRel, r.recoveries, r.recoveryMaxSeconds);
}

}  // namespace sinew_example
