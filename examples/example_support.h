#pragma once

// What the examples share: their common command line (parsed strictly: whole-string numbers,
// no nan or inf, nothing that wraps), the options it sets, the single-process reference
// training every example compares with, and the RESULT line.

#include <ATen/ATen.h>
#include <torch/nn/modules/container/sequential.h>

#include <charconv>
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
  bool reference = true;
  bool float32 = false;
  int progress = 10;
  std::string checkpointDir;
  int checkpointEvery = 0;
  std::string device = "cpu";
  sinew::CommBackend backend = sinew::CommBackend::kAuto;
};

constexpr const char* kCommonUsage =
    "[--steps N] [--global-batch B] [--microbatch b] [--seed S] [--lr LR] "
    "[--optimizer adam|sgd] [--float32] [--progress N] [--checkpoint-dir DIR] "
    "[--checkpoint-every K] [--no-reference] [--device cpu|cuda|cuda:N] "
    "[--backend auto|gloo|nccl]";

// Walks argv flag by flag; `usage` prints the error and exits.
class ArgReader {
 public:
  ArgReader(int argc, char** argv, std::function<void(const std::string&)> usage)
      : argc_(argc), argv_(argv), usage_(std::move(usage)) {}

  bool next() {
    if (++i_ >= argc_) return false;
    flag_ = argv_[i_];
    return true;
  }
  const std::string& flag() const { return flag_; }
  [[noreturn]] void fail(const std::string& error) const {
    usage_(error);
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
  std::function<void(const std::string&)> usage_;
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
    if (a.optimizer != "adam" && a.optimizer != "sgd") r.fail("unknown optimizer " + a.optimizer);
  } else if (s == "--float32") {
    a.float32 = true;
  } else if (s == "--progress") {
    a.progress = static_cast<int>(r.integer(kMaxInt));
  } else if (s == "--checkpoint-dir") {
    a.checkpointDir = r.value();
  } else if (s == "--checkpoint-every") {
    a.checkpointEvery = static_cast<int>(r.integer(kMaxInt));
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

inline sinew::TrainerOptions trainerOptions(const CommonArgs& a) {
  sinew::TrainerOptions o;
  o.steps = a.steps;
  o.globalBatch = a.globalBatch;
  o.microbatch = a.microbatch;
  o.seed = a.seed;
  o.progressEvery = a.progress;
  o.dtype = a.float32 ? at::kFloat : at::kDouble;
  o.checkpointDir = a.checkpointDir;
  o.checkpointEvery = a.checkpointEvery;
  o.device = a.device;
  o.backend = a.backend;
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
// status when it must stop here, having said why: 3 when the job expelled this worker, 1 on
// another error, 0 when it was preempted (it left the job cleanly); nothing when it trained to
// the end, after saying so if it resumed from a durable checkpoint.
inline std::optional<int> train(const char* program, sinew::Context& ctx,
                                const sinew::ModelSpec& spec, const sinew::TrainerOptions& o,
                                std::unique_ptr<sinew::Trainer>* trainer,
                                sinew::TrainResult* result) {
  try {
    *trainer = std::make_unique<sinew::Trainer>(ctx, spec, o);
    *result = (*trainer)->run();
  } catch (const sinew::Expelled& e) {
    std::fprintf(stderr, "%s: worker %d left the job: %s\n", program, ctx.worker(), e.what());
    return 3;
  } catch (const sinew::Error& e) {
    std::fprintf(stderr, "%s: worker %d failed: %s\n", program, ctx.worker(), e.what());
    return 1;
  }
  if (result->preempted) {
    std::printf("%s: worker %d left the job (preempted) after step %lld\n", program, ctx.worker(),
                static_cast<long long>(result->steps - 1));
    return 0;
  }
  if (result->startStep > 0) {
    std::printf("%s: worker %d resumed from the durable checkpoint of step %lld\n", program,
                ctx.worker(), static_cast<long long>(result->startStep - 1));
  }
  return std::nullopt;
}

inline sinew::OptimizerFactory optimizer(const CommonArgs& a) {
  return a.optimizer == "adam" ? sinew::adam(a.lr) : sinew::sgd(a.lr, 0.9);
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

// The same training, single-process, in plain libtorch over the same global batches. Returns
// the last step's loss; *out gets the trained model. Each global batch goes through in chunks
// of `chunk` samples (the whole batch by default: the same gradient as the trainer's
// microbatches, in a few large operations instead of many small ones), each chunk's mean loss
// weighted by its share of the batch. A model whose microbatches differ in shape (train_pp
// --ragged) passes its microbatch. The reference runs after the job, when the other workers
// have left: it uses every core.
inline double trainReference(const CommonArgs& a, const sinew::ModelSpec& spec,
                             at::ScalarType dtype, torch::nn::Sequential* out, int64_t chunk = 0) {
  if (chunk <= 0) chunk = a.globalBatch;
  const int threads = at::get_num_threads();
  at::set_num_threads(std::max(1, static_cast<int>(std::thread::hardware_concurrency())));
  torch::nn::Sequential ref = sinew::buildModel(spec, a.seed, dtype);
  auto opt = spec.optimizer(ref->parameters());
  double loss = 0;
  for (int64_t s = 0; s < a.steps; ++s) {
    auto idx = sinew::globalBatchIndices(a.seed, s, a.globalBatch, spec.datasetSize);
    opt->zero_grad();
    double sum = 0;
    for (int64_t first = 0; first < a.globalBatch; first += chunk) {
      std::vector<at::Tensor> xs, ys;
      for (int64_t j = first; j < first + chunk; ++j) {
        auto smp = spec.dataset(idx[j]);
        xs.push_back(smp.input);
        ys.push_back(smp.target);
      }
      at::Tensor l = spec.loss(ref->forward(toTraining(at::stack(xs), dtype)),
                               toTraining(at::stack(ys), dtype));
      (l * (static_cast<double>(chunk) / a.globalBatch)).backward();
      sum += l.item<double>() * chunk;
    }
    loss = sum / a.globalBatch;
    opt->step();
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
