#include "sinew/runtime/mixed_precision.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <torch/version.h>

#include <cmath>
#include <string>

#include "sinew/base/error.h"
#include "sinew/runtime/step_update.h"

// libtorch 2.4 made autocast's state per device type; 1.x has one switch per backend.
#if defined(TORCH_VERSION_MAJOR) && \
    (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4))
#define SINEW_AUTOCAST_PER_DEVICE 1
#else
#define SINEW_AUTOCAST_PER_DEVICE 0
#endif

namespace sinew {
namespace runtime {

namespace {

bool autocastEnabled(bool cuda) {
#if SINEW_AUTOCAST_PER_DEVICE
  return at::autocast::is_autocast_enabled(cuda ? at::kCUDA : at::kCPU);
#else
  return cuda ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
#endif
}

at::ScalarType autocastDtype(bool cuda) {
#if SINEW_AUTOCAST_PER_DEVICE
  return at::autocast::get_autocast_dtype(cuda ? at::kCUDA : at::kCPU);
#else
  return cuda ? at::autocast::get_autocast_gpu_dtype() : at::autocast::get_autocast_cpu_dtype();
#endif
}

void setAutocast(bool cuda, bool enabled, at::ScalarType dtype) {
#if SINEW_AUTOCAST_PER_DEVICE
  const at::DeviceType type = cuda ? at::kCUDA : at::kCPU;
  at::autocast::set_autocast_dtype(type, dtype);
  at::autocast::set_autocast_enabled(type, enabled);
#else
  if (cuda) {
    at::autocast::set_autocast_gpu_dtype(dtype);
    at::autocast::set_enabled(enabled);
  } else {
    at::autocast::set_autocast_cpu_dtype(dtype);
    at::autocast::set_cpu_enabled(enabled);
  }
#endif
}

}  // namespace

void checkMixedPrecisionOptions(const TrainerOptions& o, at::Device device) {
  const at::ScalarType c = o.computeDtype;
  if (c != at::ScalarType::Undefined) {
    if (c != at::kBFloat16 && c != at::kHalf) {
      SINEW_THROW(InvalidArgument, "TrainerOptions::computeDtype is ", c,
                  "; mixed precision computes in BFloat16 or Half");
    }
    if (c == at::kHalf && !device.is_cuda()) {
      SINEW_THROW(InvalidArgument,
                  "TrainerOptions::computeDtype Half needs a CUDA device (libtorch's CPU "
                  "autocast computes in BFloat16 only); this worker's device is ",
                  device);
    }
    if (o.dtype != at::kFloat) {
      SINEW_THROW(InvalidArgument, "TrainerOptions::computeDtype ", c,
                  " keeps float32 master weights: TrainerOptions::dtype must be Float, not ",
                  o.dtype);
    }
  }
  if (o.lossScaling) {
    const double s = o.lossScaling->initialScale;
    if (!(std::isfinite(s) && s > 0)) {
      SINEW_THROW(InvalidArgument, "TrainerOptions::lossScaling.initialScale = ", s,
                  " must be finite and > 0");
    }
    if (o.lossScaling->growthInterval < 1) {
      SINEW_THROW(InvalidArgument,
                  "TrainerOptions::lossScaling.growthInterval = ", o.lossScaling->growthInterval,
                  " must be at least 1");
    }
  }
}

AutocastScope::AutocastScope(at::Device device, at::ScalarType computeDtype) {
  if (computeDtype == at::ScalarType::Undefined) return;
  active_ = true;
  cuda_ = device.is_cuda();
  wasEnabled_ = autocastEnabled(cuda_);
  wasDtype_ = autocastDtype(cuda_);
  setAutocast(cuda_, true, computeDtype);
  at::autocast::increment_nesting();
}

AutocastScope::~AutocastScope() {
  if (!active_) return;
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  setAutocast(cuda_, wasEnabled_, wasDtype_);
}

LossScaler::LossScaler(const TrainerOptions& o) {
  enabled_ = o.lossScaling.has_value() || o.computeDtype == at::kHalf;
  const TrainerOptions::LossScaling settings =
      o.lossScaling.value_or(TrainerOptions::LossScaling{});
  scale_ = settings.initialScale;
  growthInterval_ = settings.growthInterval;
}

bool LossScaler::update(double scaledSquaredNorm) {
  if (!enabled_) return true;
  if (!std::isfinite(scaledSquaredNorm)) {
    scale_ *= 0.5;
    finiteSteps_ = 0;
    return false;
  }
  if (++finiteSteps_ >= growthInterval_) {
    scale_ *= 2.0;
    finiteSteps_ = 0;
  }
  return true;
}

at::Tensor LossScaler::state() const {
  if (!enabled_) return at::Tensor();
  return at::tensor({scale_, static_cast<double>(finiteSteps_)}, at::kDouble);
}

void LossScaler::load(const at::Tensor& state, const std::string& source) {
  if (!enabled_) return;
  const bool shaped = state.defined() && state.numel() == 2 && state.scalar_type() == at::kDouble;
  const double scale = shaped ? state[0].item<double>() : 0;
  const double steps = shaped ? state[1].item<double>() : -1;
  if (!shaped || !(std::isfinite(scale) && scale > 0) || !(steps >= 0 && steps < 1e15) ||
      steps != std::floor(steps)) {
    SINEW_THROW(Corruption, source, ": the loss scale '", kStateName,
                "' is not a positive scale and a step count");
  }
  scale_ = scale;
  finiteSteps_ = static_cast<int64_t>(steps);
}

GradientScaling::GradientScaling(const TrainerOptions& o, JobTensors& jobs)
    : clip_(o.clipGradNorm), scaler_(o) {
  if (!scaler_.enabled()) return;
  jobs.add({LossScaler::kStateName, scaler_.state(), [this](int64_t) { return scaler_.state(); },
            [this](int64_t step, const at::Tensor& t) {
              scaler_.load(t, "the loss scale after step " + std::to_string(step));
            }});
}

double GradientScaling::begin() {
  stepScale_ = scaler_.scale();
  return stepScale_;
}

void GradientScaling::unscaleAndClip(const std::vector<at::Tensor>& params,
                                     double scaledSquaredNorm) {
  squaredNorm_ = scaledSquaredNorm;
  gradNorm_ = std::sqrt(scaledSquaredNorm) / stepScale_;
  if (!std::isfinite(scaledSquaredNorm)) return;
  const double clip = clip_ ? clipFactor(gradNorm_, *clip_) : 1.0;
  scaleGradients(params, clip / stepScale_);
}

bool GradientScaling::commit() {
  beforeCommit_ = scaler_;
  return scaler_.update(squaredNorm_);
}

}  // namespace runtime
}  // namespace sinew
