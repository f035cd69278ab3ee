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

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "example_support.h"
#include "sinew/trainer.h"

namespace {

using sinew_example::CommonArgs;

// --loss-scaling N: dynamic loss scaling from 2^16, doubling after N finite steps in a row
// (TrainerOptions::lossScaling). --poison-sample K: sample K's input is NaN, so the steps
// that train on it have no finite gradient (with loss scaling every worker skips them).
int64_t gLossScaling = 0;
int64_t gPoisonSample = -1;

CommonArgs parse(int argc, char** argv) {
  CommonArgs a;
  sinew_example::ArgReader r(
      argc, argv, "train_dp",
      std::string(sinew_example::kCommonUsage) + " [--loss-scaling N] [--poison-sample K]");
  while (r.next()) {
    if (sinew_example::parseCommon(r, a)) continue;
    if (r.flag() == "--loss-scaling") {
      gLossScaling = r.integer(sinew_example::kMaxInt);
      if (gLossScaling < 1) r.fail("--loss-scaling needs a growth interval of at least 1");
      a.skipNonFinite = true;
    } else if (r.flag() == "--poison-sample") {
      gPoisonSample = r.integer(int64_t{1} << 40);
    } else {
      r.fail("unknown argument '" + r.flag() + "'");
    }
  }
  sinew_example::checkCommon(r, a);
  return a;
}

constexpr int64_t kFeatures = 16;

// Sample i: x uniform in [-1, 1]^16 from a hash of i; y = sin(w.x) + 0.5 cos(x0 x1).
sinew::Sample sample(int64_t i) {
  std::vector<double> x(kFeatures);
  double dot = 0;
  for (int64_t k = 0; k < kFeatures; ++k) {
    x[k] = static_cast<double>(sinew_example::mix(static_cast<uint64_t>(i) * kFeatures + k) >> 11) /
               static_cast<double>(1ull << 53) * 2.0 -
           1.0;
    dot += x[k] * (0.3 + 0.05 * static_cast<double>(k % 5));
  }
  double y = std::sin(dot) + 0.5 * std::cos(x[0] * x[1]);
  return {at::tensor(x, at::kDouble), at::tensor(std::vector<double>{y}, at::kDouble)};
}

sinew::ModelSpec model(const CommonArgs& a) {
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
  spec.optimizer = sinew_example::optimizer(a);
  spec.dataset = [](int64_t i) {
    sinew::Sample s = sample(i);
    if (i == gPoisonSample) s.input = at::full_like(s.input, std::nan(""));
    return s;
  };
  spec.datasetSize = a.datasetSize > 0 ? a.datasetSize : 1 << 20;
  return spec;
}

}  // namespace

int main(int argc, char** argv) {
  CommonArgs a = parse(argc, argv);
  at::set_num_threads(1);  // Several workers share a few cores.
  std::unique_ptr<sinew::Context> ctx = sinew_example::join("train_dp", &argc, &argv);
  if (!ctx) return 1;
  sinew::TrainerOptions o = sinew_example::trainerOptions(a);
  if (gLossScaling > 0) o.lossScaling = sinew::TrainerOptions::LossScaling{65536.0, gLossScaling};
  sinew::ModelSpec spec = model(a);
  std::unique_ptr<sinew::Trainer> trainer;
  sinew::TrainResult r;
  if (auto status = sinew_example::train("train_dp", *ctx, spec, o, &trainer, &r, a,
                                         sinew_example::heldOut(spec)))
    return *status;
  if (r.checkpointsWritten > 0 || r.checkpointsSkipped > 0) {
    std::printf(
        "train_dp: worker %d wrote %lld checkpoints (skipped %lld), optimizer steps "
        "waited %.3f ms for snapshots\n",
        ctx->worker(), static_cast<long long>(r.checkpointsWritten),
        static_cast<long long>(r.checkpointsSkipped), r.checkpointStallSeconds * 1e3);
  }
  double checksum = 0;
  for (const auto& p : trainer->parameters()) checksum += p.abs().sum().item<double>();
  std::printf(
      "train_dp: worker %d done: %lld steps, epoch %lld, %zu workers, loss %.9g, "
      "param_checksum %.12g, device %s, backend %s\n",
      ctx->worker(), static_cast<long long>(r.steps), static_cast<long long>(r.finalEpoch),
      r.finalMembers.size(), r.finalLoss, checksum, r.device.c_str(), r.backend.c_str());
  bool reporter = !r.finalMembers.empty() && r.finalMembers.front() == ctx->worker();
  if (reporter) {
    double refLoss = -1, maxRel = -1;
    if (a.reference) {
      torch::nn::Sequential ref;
      refLoss =
          sinew_example::trainReference(a, spec, o.dtype, &ref, 0, sinew_example::heldOut(spec));
      maxRel = 0;
      auto mine = trainer->parameters();
      auto theirs = ref->parameters();
      for (size_t i = 0; i < mine.size(); ++i) {
        maxRel = std::max(maxRel, sinew_example::relDiff(mine[i], theirs[i]));
      }
    }
    sinew_example::printResult(r, refLoss, maxRel);
  }
  std::fflush(stdout);
  return ctx->finishJob();  // Rank 0 under mpirun/srun: how the job ended, said last.
}
