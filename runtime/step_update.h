#pragma once

// Internal: what the trainer does to a step's gradients and optimizer between the gradient
// reduction and the optimizer step: global-norm clipping (TrainerOptions::clipGradNorm) and
// the scheduled learning rate (TrainerOptions::lrSchedule, sinew/schedule.h).
//
// Thread safety: pure functions, except that the setters change the tensors and optimizer the
// caller owns.

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <vector>

#include "sinew/schedule.h"
#include "sinew/trainer.h"

namespace sinew {
namespace runtime {

// Checks clipGradNorm (> 0 and finite when set) and the schedule's rates for the first steps
// of the job (at most 2^20 of them), so that a bad schedule is refused before training.
// Throws InvalidArgument naming the option, the step and the value.
void checkStepUpdateOptions(const TrainerOptions& options);

// schedule(step). Throws InvalidArgument naming the step and the rate unless it is finite and
// >= 0 (every worker computes the same rate, so every worker stops at the same step).
double scheduledRate(const LrSchedule& schedule, int64_t step);

// Sets `lr` on every parameter group of `optimizer`.
void setLearningRate(torch::optim::Optimizer& optimizer, double lr);

// The rate `optimizer` steps with: its first parameter group's (its defaults' without groups).
double learningRate(const torch::optim::Optimizer& optimizer);

// Sums the gradients of the trainable parameters of `params` with `reduce` (an in-place
// reduction of one contiguous tensor, e.g. an allreduce) in buckets of at most `bucketBytes`,
// as PyTorch DDP's bucket_cap_mb does: consecutive gradients smaller than that are packed into
// one flat tensor, reduced and copied back; a contiguous gradient of at least that size is
// reduced where it is. A parameter without a gradient gets a zero one first;
// a frozen one (requires_grad false) is neither reduced nor given a gradient, so no optimizer
// steps it (AdamW's weight decay included). The memory this needs beside the gradients is one
// bucket, not a copy of them all. Every member must pass the same parameters (shapes and order) and
// bucket size. `tail` (if defined: a contiguous tensor of the gradients' dtype and device, such as
// a loss sum) is packed into the last bucket and reduced in place with it, at no extra reduction.
void reduceInBuckets(const std::vector<at::Tensor>& params, int64_t bucketBytes,
                     const std::function<void(at::Tensor&)>& reduce, const at::Tensor& tail = {});

// PyTorch DDP's default bucket_cap_mb, the trainer's bucket for every gradient sum: the memory
// a sum needs beside the gradients, which the planner's cost model does not charge.
constexpr int64_t kGradientBucketBytes = int64_t{25} << 20;

// The sum of the squares of the defined gradients of `params`, in double precision.
double squaredGradientNorm(const std::vector<at::Tensor>& params);

// torch::nn::utils::clip_grad_norm_'s factor for a gradient of 2-norm `norm`:
// maxNorm / (norm + 1e-6), at most 1 (1: nothing to clip). A NaN or infinite norm gives 1:
// the gradients stay as they are (libtorch 1.x's clip_grad_norm_ does the same).
double clipFactor(double norm, double maxNorm);

// Multiplies the defined gradients of `params` by `factor` (nothing when it is 1).
void scaleGradients(const std::vector<at::Tensor>& params, double factor);

}  // namespace runtime
}  // namespace sinew
