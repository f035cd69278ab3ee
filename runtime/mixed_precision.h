#pragma once

// Internal: mixed precision (TrainerOptions::computeDtype, lossScaling). An AutocastScope runs
// a forward under libtorch's autocast for the device; a LossScaler keeps the dynamic loss
// scale, decides from a step's global gradient norm whether the optimizer may step, and turns
// its state into a tensor that travels with every layer's state ("@loss_scale") and back.
//
// Thread safety: autocast is thread-local, so a scope affects only its thread; a LossScaler is
// used by the training thread.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "sinew/runtime/job_tensors.h"
#include "sinew/trainer.h"

namespace sinew {
namespace runtime {

// Throws InvalidArgument naming the option unless computeDtype is Undefined, kBFloat16, or
// kHalf on CUDA, with dtype float32, and the loss scaling's values are valid.
void checkMixedPrecisionOptions(const TrainerOptions& options, at::Device device);

// Autocast on `device`'s type in `computeDtype` for the scope's lifetime (nothing when it is
// Undefined); the previous state comes back at the end, and the cache of cast weights is
// cleared when the outermost scope ends.
class AutocastScope {
 public:
  AutocastScope(at::Device device, at::ScalarType computeDtype);
  ~AutocastScope();
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  bool active_ = false;
  bool cuda_ = false;
  bool wasEnabled_ = false;
  at::ScalarType wasDtype_ = at::kFloat;
};

class LossScaler {
 public:
  // The tensor name of the state in a layer's state.
  static constexpr const char* kStateName = "@loss_scale";

  // Off unless options.lossScaling is set or options.computeDtype is kHalf.
  explicit LossScaler(const TrainerOptions& options);

  bool enabled() const { return enabled_; }
  // What the loss is multiplied by (1 when off).
  double scale() const { return enabled_ ? scale_ : 1.0; }
  // After a step's reduction: whether its gradient is finite, given its squared global norm as
  // scaled (the same on every worker); updates the scale for the next step. Always true when
  // off.
  bool update(double scaledSquaredNorm);

  // The state (scale, steps in a row without an infinite gradient) as float64 [2]; undefined
  // when off.
  at::Tensor state() const;
  // Takes a state made by state(). Throws Corruption naming `source` unless it is two finite
  // values with a positive scale and a whole, non-negative count.
  void load(const at::Tensor& state, const std::string& source);

 private:
  bool enabled_ = false;
  double scale_ = 1.0;
  int64_t growthInterval_ = 2000;
  int64_t finiteSteps_ = 0;
};

// One step's gradient handling between backward and the optimizer: the loss scale the step
// uses, the global norm, unscaling and clipping (TrainerOptions::clipGradNorm), and at the
// commit whether the optimizer steps. Registers "@loss_scale" with `jobs` when scaling is on.
class GradientScaling {
 public:
  // REQUIRES: jobs outlives this object.
  GradientScaling(const TrainerOptions& options, JobTensors& jobs);

  // The loss scale of the step that starts now (1 without scaling).
  double begin();
  // After the reduction, with the squared global norm of the scaled gradient (the same on
  // every worker): divides this worker's gradients `params` by the step's scale and clips them;
  // a gradient that is not finite is left as it is (its step will be skipped).
  void unscaleAndClip(const std::vector<at::Tensor>& params, double scaledSquaredNorm);
  // At the step's commit: whether the optimizer may step; updates the scale.
  bool commit();
  // Takes back the last commit()'s update (the step did not commit after all).
  void undoCommit() { scaler_ = beforeCommit_; }

  double stepScale() const { return stepScale_; }
  double gradNorm() const { return gradNorm_; }  // the step's, unscaled, before clipping
  double nextScale() const { return scaler_.scale(); }

 private:
  const std::optional<double> clip_;
  LossScaler scaler_;
  LossScaler beforeCommit_ = scaler_;
  double stepScale_ = 1.0;
  double squaredNorm_ = 0;  // scaled
  double gradNorm_ = 0;
};

}  // namespace runtime
}  // namespace sinew
