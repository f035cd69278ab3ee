// train_dp: a data-parallel Sinew trainer of a small MLP on a synthetic learnable regression
// task (no downloads). Run it under sinew-run (or mpirun --enable-recovery):
//
//   sinew-run -n 4 --inject kill:worker=2:step=30:phase=backward build/examples/train_dp
//
// After training, the lowest surviving worker trains the same model single-process in plain
// libtorch over the same global batches (skip with --no-reference) and prints
//   RESULT final_loss=<l> reference_loss=<r> max_param_rel_diff=<d> recoveries=<k>
//          recovery_s_max=<t>
// Training runs in float64 by default: the job's float32 summation order changes with its
// size, which alone would move parameters past 1e-5 of the reference over many steps.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "sinew/trainer.h"

namespace {

struct Args {
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
};

[[noreturn]] void usage(const std::string& error) {
  std::fprintf(stderr,
               "train_dp: %s\nusage: train_dp [--steps N] [--global-batch B] [--microbatch b] "
               "[--seed S] [--lr LR] [--optimizer adam|sgd] [--float32] [--progress N] "
               "[--checkpoint-dir DIR] [--checkpoint-every K] [--no-reference]\n",
               error.c_str());
  std::exit(2);
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    std::string s = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage(s + " needs a value");
      return argv[++i];
    };
    // Whole-string parses: no trailing junk, no nan or inf, nothing that wraps.
    auto integer = [&](int64_t max) -> int64_t {
      std::string v = value();
      int64_t x = 0;
      auto r = std::from_chars(v.data(), v.data() + v.size(), x);
      if (v.empty() || r.ec != std::errc() || r.ptr != v.data() + v.size() || x < 0 || x > max) {
        usage(s + ": '" + v + "' is not an integer in [0, " + std::to_string(max) + "]");
      }
      return x;
    };
    auto number = [&]() -> double {
      std::string v = value();
      double d = 0;
      auto r = std::from_chars(v.data(), v.data() + v.size(), d);
      if (v.empty() || r.ec != std::errc() || r.ptr != v.data() + v.size() || !std::isfinite(d) ||
          d < 0) {
        usage(s + ": '" + v + "' is not a finite non-negative number");
      }
      return d;
    };
    constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();
    if (s == "--steps") {
      a.steps = integer(int64_t{1} << 40);
    } else if (s == "--global-batch") {
      a.globalBatch = integer(kMaxInt);
    } else if (s == "--microbatch") {
      a.microbatch = integer(kMaxInt);
    } else if (s == "--seed") {
      a.seed = static_cast<uint64_t>(integer(std::numeric_limits<int64_t>::max()));
    } else if (s == "--lr") {
      a.lr = number();
    } else if (s == "--optimizer") {
      a.optimizer = value();
      if (a.optimizer != "adam" && a.optimizer != "sgd") usage("unknown optimizer " + a.optimizer);
    } else if (s == "--float32") {
      a.float32 = true;
    } else if (s == "--progress") {
      a.progress = static_cast<int>(integer(kMaxInt));
    } else if (s == "--checkpoint-dir") {
      a.checkpointDir = value();
    } else if (s == "--checkpoint-every") {
      a.checkpointEvery = static_cast<int>(integer(kMaxInt));
    } else if (s == "--no-reference") {
      a.reference = false;
    } else {
      usage("unknown argument '" + s + "'");
    }
  }
  if (a.microbatch <= 0 || a.globalBatch % a.microbatch != 0) {
    usage("--global-batch must be a positive multiple of --microbatch");
  }
  return a;
}

constexpr int64_t kFeatures = 16;

uint64_t mix(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Sample i: x uniform in [-1, 1]^16 from a hash of i; y = sin(w.x) + 0.5 cos(x0 x1).
sinew::Sample sample(int64_t i) {
  std::vector<double> x(kFeatures);
  double dot = 0;
  for (int64_t k = 0; k < kFeatures; ++k) {
    x[k] = static_cast<double>(mix(static_cast<uint64_t>(i) * kFeatures + k) >> 11) /
               static_cast<double>(1ull << 53) * 2.0 -
           1.0;
    dot += x[k] * (0.3 + 0.05 * static_cast<double>(k % 5));
  }
  double y = std::sin(dot) + 0.5 * std::cos(x[0] * x[1]);
  return {at::tensor(x, at::kDouble), at::tensor(std::vector<double>{y}, at::kDouble)};
}

sinew::ModelSpec model(const Args& a) {
  sinew::ModelSpec spec;
  spec.layers = {
      {"fc1", [] { return torch::nn::AnyModule(torch::nn::Linear(kFeatures, 64)); }},
      {"act1", [] { return torch::nn::AnyModule(torch::nn::Tanh()); }},
      {"fc2", [] { return torch::nn::AnyModule(torch::nn::Linear(64, 64)); }},
      {"act2", [] { return torch::nn::AnyModule(torch::nn::Tanh()); }},
      {"fc3", [] { return torch::nn::AnyModule(torch::nn::Linear(64, 1)); }},
  };
  spec.loss = [](const at::Tensor& out, const at::Tensor& target) {
    return (out - target).pow(2).mean();
  };
  spec.optimizer = a.optimizer == "adam" ? sinew::adam(a.lr) : sinew::sgd(a.lr, 0.9);
  spec.dataset = sample;
  spec.datasetSize = 1 << 20;
  return spec;
}

// The same training, single-process, in plain libtorch. Returns the last step's loss.
double trainReference(const Args& a, const sinew::ModelSpec& spec, at::ScalarType dtype,
                      torch::nn::Sequential* out) {
  torch::nn::Sequential ref = sinew::buildModel(spec, a.seed, dtype);
  auto opt = spec.optimizer(ref->parameters());
  double loss = 0;
  const int64_t micro = a.globalBatch / a.microbatch;
  for (int64_t s = 0; s < a.steps; ++s) {
    auto idx = sinew::globalBatchIndices(a.seed, s, a.globalBatch, spec.datasetSize);
    opt->zero_grad();
    double sum = 0;
    for (int64_t m = 0; m < micro; ++m) {
      std::vector<at::Tensor> xs, ys;
      for (int64_t j = m * a.microbatch; j < (m + 1) * a.microbatch; ++j) {
        auto smp = spec.dataset(idx[j]);
        xs.push_back(smp.input);
        ys.push_back(smp.target);
      }
      at::Tensor l = spec.loss(ref->forward(at::stack(xs).to(dtype)), at::stack(ys).to(dtype));
      (l * (static_cast<double>(a.microbatch) / a.globalBatch)).backward();
      sum += l.item<double>() * a.microbatch;
    }
    loss = sum / a.globalBatch;
    opt->step();
  }
  *out = ref;
  return loss;
}

}  // namespace

int main(int argc, char** argv) {
  Args a = parse(argc, argv);
  at::set_num_threads(1);  // Several workers share a few cores.
  std::unique_ptr<sinew::Context> ctx;
  try {
    ctx = sinew::init(&argc, &argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "train_dp: cannot join the job: %s\n", e.what());
    return 1;
  }
  sinew::TrainerOptions o;
  o.steps = a.steps;
  o.globalBatch = a.globalBatch;
  o.microbatch = a.microbatch;
  o.seed = a.seed;
  o.progressEvery = a.progress;
  o.dtype = a.float32 ? at::kFloat : at::kDouble;
  o.checkpointDir = a.checkpointDir;
  o.checkpointEvery = a.checkpointEvery;
  sinew::ModelSpec spec = model(a);
  sinew::Trainer trainer(*ctx, spec, o);
  sinew::TrainResult r;
  try {
    r = trainer.run();
  } catch (const sinew::Expelled& e) {
    std::fprintf(stderr, "train_dp: worker %d left the job: %s\n", ctx->worker(), e.what());
    return 3;
  }
  if (r.preempted) {
    std::printf("train_dp: worker %d left the job (preempted) after step %lld\n", ctx->worker(),
                static_cast<long long>(r.steps - 1));
    return 0;
  }
  if (r.startStep > 0) {
    std::printf("train_dp: worker %d resumed from the durable checkpoint of step %lld\n",
                ctx->worker(), static_cast<long long>(r.startStep - 1));
  }
  if (r.checkpointsWritten > 0 || r.checkpointsSkipped > 0) {
    std::printf(
        "train_dp: worker %d wrote %lld checkpoints (skipped %lld), optimizer steps "
        "waited %.3f ms for snapshots\n",
        ctx->worker(), static_cast<long long>(r.checkpointsWritten),
        static_cast<long long>(r.checkpointsSkipped), r.checkpointStallSeconds * 1e3);
  }
  double checksum = 0;
  for (const auto& p : trainer.parameters()) checksum += p.abs().sum().item<double>();
  std::printf(
      "train_dp: worker %d done: %lld steps, epoch %lld, %zu workers, loss %.9g, "
      "param_checksum %.12g\n",
      ctx->worker(), static_cast<long long>(r.steps), static_cast<long long>(r.finalEpoch),
      r.finalMembers.size(), r.finalLoss, checksum);
  bool reporter = !r.finalMembers.empty() && r.finalMembers.front() == ctx->worker();
  if (reporter) {
    double refLoss = -1, maxRel = -1;
    if (a.reference) {
      torch::nn::Sequential ref;
      refLoss = trainReference(a, spec, o.dtype, &ref);
      maxRel = 0;
      auto mine = trainer.parameters();
      auto theirs = ref->parameters();
      for (size_t i = 0; i < mine.size(); ++i) {
        double diff = (mine[i] - theirs[i]).abs().max().item<double>();
        double scale = std::max(theirs[i].abs().max().item<double>(), 1e-30);
        maxRel = std::max(maxRel, diff / scale);
      }
    }
    std::printf(
        "RESULT final_loss=%.9g reference_loss=%.9g max_param_rel_diff=%.3g recoveries=%d "
        "recovery_s_max=%.3f\n",
        r.finalLoss, refLoss, maxRel, r.recoveries, r.recoveryMaxSeconds);
  }
  std::fflush(stdout);
  return 0;
}
