#pragma once

// Internal: the one place that turns a worker's layers' parameters and optimizer state into
// named tensors and back. Checkpoints, peer-RAM versions, layer copies and restores all use
// these names (docs/checkpoint_format.md, "Tensor names"):
//   "<param>"                  the parameter, e.g. "weight" or "blocks.0.attn.weight"
//   "<param>.exp_avg"          Adam: first moment
//   "<param>.exp_avg_sq"       Adam: second moment
//   "<param>.max_exp_avg_sq"   Adam with AMSGrad: the running maximum of exp_avg_sq
//   "<param>.step"             Adam: the parameter's step count, one int64
//   "<param>.momentum_buffer"  SGD with momentum
// A parameter the optimizer has no state for yet (before its first step) has only its own
// tensor. Layers are the children of a torch::nn::Sequential, keyed by their names.
//
// Thread safety: none; the caller owns the layers and the optimizer.

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "sinew/checkpoint/shard.h"
#include "sinew/communicator.h"

namespace sinew {
namespace runtime {

// Whether captureState() and loadState() know this optimizer's state: SGD and Adam.
bool optimizerStateSupported(const torch::optim::Optimizer& optimizer);

// The parameters and optimizer state of every child of `layers` that has parameters, one
// LayerState per child in order. The tensors alias the live ones (no copy), except ".step",
// which is made. REQUIRES: optimizer was made over (a superset of) layers' parameters.
checkpoint::ShardState captureState(const torch::nn::Sequential& layers,
                                    torch::optim::Optimizer& optimizer);

// The named tensors of one parameter `name` of `param` (its own, then its state's in the order
// of the table above), appended to `out`.
void captureParameterState(const std::string& name, const at::Tensor& param,
                           torch::optim::Optimizer& optimizer,
                           std::vector<checkpoint::NamedTensor>* out);

// Copies `saved` (layer name -> tensor name -> tensor) into the parameters of every child of
// `layers` that has parameters and replaces their optimizer state with the saved one, on each
// parameter's device and dtype. `source` names where the state came from, for errors.
// Throws InvalidArgument if a layer or a parameter is missing or has another shape (a
// checkpoint of another model), Corruption if a parameter's optimizer state is incomplete
// (exp_avg without exp_avg_sq or step, a step that is not one integer).
void loadState(const torch::nn::Sequential& layers, torch::optim::Optimizer& optimizer,
               const std::map<std::string, checkpoint::RestoredLayer>& saved,
               const std::string& source);

// Broadcasts rank `root`'s parameters and optimizer state (serialized by the optimizer's own
// save/load) to every member of `comm`, landing on `device` (the joining members of a data-
// parallel epoch take the state of a member that holds it). Collective: every member calls it.
// Throws the communicator's errors.
void broadcastState(collectives::Communicator& comm, int root, std::vector<at::Tensor>& params,
                    torch::optim::Optimizer& optimizer, at::Device device,
                    std::chrono::milliseconds timeout);

}  // namespace runtime
}  // namespace sinew
