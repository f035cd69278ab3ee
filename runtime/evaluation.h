#pragma once

// Internal: the forward-only pass of Trainer::evaluate() on one worker. Each global batch of
// the samples runs as a training step's forward does: in data parallel mode this worker's
// microbatches of the plan; in pipeline mode its stage's part of its pipeline's microbatches
// through the stage executor (forwards only, activations sent on, no gradients back).
//
// Thread safety: called by the training thread, which owns the layers and the executor.

#include <torch/nn/modules/container/sequential.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "sinew/model.h"
#include "sinew/pipeline/stage_executor.h"

namespace sinew {
namespace runtime {

struct EvaluationPass {
  torch::nn::Sequential* layers = nullptr;      // this worker's layers
  pipeline::StageExecutor* executor = nullptr;  // pipeline mode: its stage; null: idle
  bool pipelineMode = false;
  std::vector<int64_t> microbatches;  // data parallel: this worker's
  int64_t globalBatch = 0;
  int64_t microbatch = 0;
  LossFn loss;
  // The forwards and the loss run under autocast in computeDtype on device (if defined).
  at::Device device{at::kCPU};
  at::ScalarType computeDtype = at::ScalarType::Undefined;
  // Inputs and targets of samples [begin, end) (end < 0: all) of microbatch m of the global
  // batch `indices`, on this worker's device.
  std::function<std::pair<pipeline::Activation, at::Tensor>(const std::vector<int64_t>& indices,
                                                            int64_t m, int64_t begin, int64_t end)>
      data;
  std::function<void(const std::function<void()>& transfer)> aroundExchange;
  std::chrono::milliseconds timeout{10000};
  // Where to keep this worker's outputs of the model (those of its last layer, detached), as
  // (the index of the first sample of the rows, the rows); null: keep none.
  std::vector<std::pair<int64_t, at::Tensor>>* outputs = nullptr;
};

// This worker's part of the sum over samples [0, count) of the loss (the caller sums it over
// the epoch's members), with the layers in eval() mode and no autograd; the layers are back
// in train() mode afterwards, also when it throws (the executor's errors).
// REQUIRES: count is a positive multiple of pass.globalBatch.
double localEvaluationLossSum(const EvaluationPass& pass, int64_t count);

// The model's outputs for samples [0, count), stacked along dimension 0 in sample order, on
// every member of `comm` (on the CPU), from the `pieces` every member kept in
// localEvaluationLossSum(): the member holding sample 0's row announces the dtype and the
// shape of one sample's output, then each member puts its rows into zeros of the whole and one
// allreduce sums them (exact: every element comes from one member). Each transfer runs through
// `around`. Throws InvalidArgument if an output has no batch dimension or more than
// pipeline::StageExecutor::kMaxDims dimensions, Corruption if the announced shape is malformed,
// and the communicator's errors.
at::Tensor combineEvaluationOutputs(
    const std::vector<std::pair<int64_t, at::Tensor>>& pieces, int64_t count,
    collectives::Communicator& comm, at::Device device, std::chrono::milliseconds timeout,
    const std::function<void(const std::function<void()>&)>& around);

}  // namespace runtime
}  // namespace sinew
