#include "sinew/runtime/step_update.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "sinew/base/error.h"

namespace sinew {

namespace {

void checkRate(const char* what, double lr) {
  if (!std::isfinite(lr) || lr < 0) {
    SINEW_THROW(InvalidArgument, what, " = ", lr, " must be finite and >= 0");
  }
}

}  // namespace

LrSchedule constantLr(double lr) {
  checkRate("constantLr: lr", lr);
  return [lr](int64_t) { return lr; };
}

LrSchedule warmupCosine(double peakLr, int64_t warmupSteps, int64_t totalSteps, double minLr) {
  checkRate("warmupCosine: peakLr", peakLr);
  checkRate("warmupCosine: minLr", minLr);
  if (minLr > peakLr) {
    SINEW_THROW(InvalidArgument, "warmupCosine: minLr = ", minLr, " is above peakLr = ", peakLr);
  }
  if (warmupSteps < 0 || totalSteps < warmupSteps) {
    SINEW_THROW(InvalidArgument, "warmupCosine: warmupSteps = ", warmupSteps,
                " must be >= 0 and at most totalSteps = ", totalSteps);
  }
  return [=](int64_t step) {
    if (step < warmupSteps) {
      return peakLr * static_cast<double>(step + 1) / static_cast<double>(warmupSteps);
    }
    if (step >= totalSteps) return minLr;
    const double progress =
        static_cast<double>(step - warmupSteps) / static_cast<double>(totalSteps - warmupSteps);
    return minLr + 0.5 * (1.0 + std::cos(M_PI * progress)) * (peakLr - minLr);
  };
}

LrSchedule stepDecay(double lr, int64_t every, double gamma) {
  checkRate("stepDecay: lr", lr);
  if (!std::isfinite(gamma) || gamma <= 0 || every < 1) {
    SINEW_THROW(InvalidArgument, "stepDecay: gamma = ", gamma,
                " must be finite and > 0 and every = ", every, " >= 1");
  }
  return [=](int64_t step) { return lr * std::pow(gamma, static_cast<double>(step / every)); };
}

namespace runtime {

void checkStepUpdateOptions(const TrainerOptions& o) {
  if (o.clipGradNorm && (!std::isfinite(*o.clipGradNorm) || *o.clipGradNorm <= 0)) {
    SINEW_THROW(InvalidArgument, "TrainerOptions::clipGradNorm = ", *o.clipGradNorm,
                " must be finite and > 0 (unset: no clipping)");
  }
  if (!o.lrSchedule) return;
  const int64_t checked = std::min<int64_t>(o.steps, int64_t{1} << 20);
  for (int64_t s = 0; s < checked; ++s) scheduledRate(o.lrSchedule, s);
}

double scheduledRate(const LrSchedule& schedule, int64_t step) {
  const double lr = schedule(step);
  if (!std::isfinite(lr) || lr < 0) {
    SINEW_THROW(InvalidArgument, "TrainerOptions::lrSchedule gave learning rate ", lr, " for step ",
                step, "; a rate must be finite and >= 0");
  }
  return lr;
}

void setLearningRate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

double learningRate(const torch::optim::Optimizer& optimizer) {
  return optimizer.param_groups().empty() ? optimizer.defaults().get_lr()
                                          : optimizer.param_groups().front().options().get_lr();
}

void reduceInBuckets(const std::vector<at::Tensor>& params, int64_t bucketBytes,
                     const std::function<void(at::Tensor&)>& reduce, const at::Tensor& tail) {
  std::vector<at::Tensor> bucket;  // the gradients packed into the next flat tensor
  int64_t bucketed = 0;
  auto flush = [&] {
    if (bucket.empty()) return;
    std::vector<at::Tensor> parts;
    for (const auto& g : bucket) parts.push_back(g.reshape(-1));
    at::Tensor flat = at::cat(parts);
    reduce(flat);
    int64_t offset = 0;
    for (auto& g : bucket) {
      g.copy_(flat.narrow(0, offset, g.numel()).view(g.sizes()));
      offset += g.numel();
    }
    bucket.clear();
    bucketed = 0;
  };
  for (const auto& p : params) {
    if (!p.requires_grad()) continue;
    if (!p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    at::Tensor g = p.grad();
    const int64_t bytes = static_cast<int64_t>(g.nbytes());
    if (bytes >= bucketBytes && g.is_contiguous()) {
      flush();  // The order of the reductions is the parameters' on every member.
      reduce(g);
      continue;
    }
    if (bucketed + bytes > bucketBytes) flush();
    bucket.push_back(g);
    bucketed += bytes;
  }
  if (tail.defined()) bucket.push_back(tail);
  flush();
}

double squaredGradientNorm(const std::vector<at::Tensor>& params) {
  at::Tensor sum;  // On the gradients' device: one synchronization, at the end.
  for (const auto& p : params) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    at::Tensor sq = g.detach().norm().to(at::kDouble).square();
    sum = sum.defined() ? sum + sq : sq;
  }
  return sum.defined() ? sum.item<double>() : 0.0;
}

double clipFactor(double norm, double maxNorm) {
  if (!std::isfinite(norm)) return 1.0;
  return std::min(maxNorm / (norm + 1e-6), 1.0);
}

void scaleGradients(const std::vector<at::Tensor>& params, double factor) {
  if (factor == 1.0) return;
  at::NoGradGuard noGrad;
  for (const auto& p : params) {
    if (p.grad().defined()) p.grad().mul_(factor);
  }
}

}  // namespace runtime
}  // namespace sinew
