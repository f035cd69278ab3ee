#pragma once

// Internal: Trainer::gatherModel(). Data parallel mode: the root copies its own model
// (copyModel). Pipeline mode: Every layer's parameters go from the
// lowest-id worker that holds the layer to the root, which builds the whole model and fills
// it; the transfers are point to point on the epoch's communicator, in chunks, one exchange.
//
// Thread safety: called by the training thread of every member of the epoch at once.

#include <torch/nn/modules/container/sequential.h>

#include <chrono>
#include <cstdint>

#include "sinew/communicator.h"
#include "sinew/model.h"
#include "sinew/pipeline/plan.h"

namespace sinew {
namespace runtime {

struct GatherInputs {
  const ModelSpec* spec = nullptr;
  uint64_t seed = 0;
  at::ScalarType dtype = at::kFloat;
  const pipeline::Plan* plan = nullptr;
  int self = 0;
  int root = 0;
  const torch::nn::Sequential* held = nullptr;  // this worker's layers [heldFirst, ...)
  int heldFirst = 0;
  collectives::Communicator* comm = nullptr;  // the epoch's: every member of the plan
  at::Device device{at::kCPU};                // the communicator's (this worker's layers')
  std::chrono::milliseconds timeout{60000};
};

// Tag of the gather's messages (apart from the executor's and the layer copies').
constexpr uint32_t kTagGather = 6;

// On the root: the whole model (every layer of the spec, built on the CPU, its parameters the
// job's); elsewhere: an empty Sequential. Throws the communicator's errors.
torch::nn::Sequential gatherLayers(const GatherInputs& in);

// A plain CPU copy of `trained` (every layer of `spec`, built with `seed` and `dtype`), for a
// worker that holds the whole model (data parallel mode).
torch::nn::Sequential copyModel(const ModelSpec& spec, uint64_t seed, at::ScalarType dtype,
                                const torch::nn::Sequential& trained);

}  // namespace runtime
}  // namespace sinew
