#pragma once

// Internal: the one place that turns a worker's layers' parameters and optimizer state into
// named tensors and back. Checkpoints, peer-RAM versions, layer copies and restores all use
// these names (docs/checkpoint_format.md, "Tensor names"): "<param>" for the parameter (e.g.
// "weight" or "blocks.0.attn.weight") and "<param>.<field>" for each field of its optimizer
// state, the fields of the optimizer's StateLayout in order:
//   torch::optim::SGD      momentum_buffer (with momentum only)
//   torch::optim::Adam     exp_avg, exp_avg_sq, max_exp_avg_sq (AMSGrad only), step
//   torch::optim::AdamW    exp_avg, exp_avg_sq, max_exp_avg_sq (AMSGrad only), step
//   torch::optim::RMSprop  square_avg, momentum_buffer (momentum > 0), grad_avg (centered), step
//   torch::optim::Adagrad  sum, step
// Tensor fields are shaped as their parameter; "step" is one int64. A parameter the optimizer
// has no state for yet (before its first step) has only its own tensor. Layers are the
// children of a torch::nn::Sequential, keyed by their names.
//
// One generic path serves every optimizer: an OptimizerStateCodec per optimizer type lists the
// fields of its per-parameter state and how to read and build one; nothing else knows an
// optimizer's type. An optimizer without a codec (LBFGS, whose state is not per parameter, or
// a custom one) is refused by optimizerStateCodec().
//
// Thread safety: the codecs are immutable; otherwise none (the caller owns the layers and the
// optimizer).

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "sinew/checkpoint/shard.h"
#include "sinew/communicator.h"
#include "sinew/runtime/layer_copy_manifest.h"

namespace sinew {
namespace runtime {

// How one optimizer type's per-parameter state becomes fields and back.
class OptimizerStateCodec {
 public:
  virtual ~OptimizerStateCodec() = default;

  // The optimizer's C++ type, e.g. "torch::optim::AdamW".
  virtual const std::string& name() const = 0;
  virtual const StateLayout& layout() const = 0;
  virtual bool matches(const torch::optim::Optimizer& optimizer) const = 0;
  // The fields (bit i: layout().fields[i]) that a parameter's state must have when it has
  // any, given the options of the parameter's group.
  virtual int64_t required(const torch::optim::OptimizerOptions& options) const = 0;
  // Field i of `state`: the live tensor (undefined when absent; no copy), or the count as one
  // int64. REQUIRES: state was made by an optimizer this codec matches.
  virtual at::Tensor field(const torch::optim::OptimizerParamState& state, size_t i) const = 0;
  // A state holding `values` (one per field, undefined where absent; counts as one integer).
  virtual std::unique_ptr<torch::optim::OptimizerParamState> make(
      const std::vector<at::Tensor>& values) const = 0;
};

// The codec of `optimizer`'s type, or null when Sinew cannot capture its state.
const OptimizerStateCodec* findOptimizerStateCodec(const torch::optim::Optimizer& optimizer);

// The codec of `optimizer`'s type. Throws InvalidArgument naming `what` (e.g.
// "ModelSpec::optimizer"), the optimizer's type and the supported ones when there is none.
const OptimizerStateCodec& optimizerStateCodec(const torch::optim::Optimizer& optimizer,
                                               const std::string& what);

// The memory a trained parameter costs besides itself, in its own bytes: its gradient and the
// state tensors `optimizer`'s first parameter group needs (Adam 1 + 2, Adam with AMSGrad
// 1 + 3, SGD without momentum 1), for the planner's memory model. REQUIRES: the optimizer has
// a codec and at least one parameter group.
double stateBytesPerParameterByte(const torch::optim::Optimizer& optimizer);

// The temporaries of one optimizer step in a parameter's own bytes, measured: an optimizer
// from `make` over one CPU tensor of `dtype` with a gradient steps twice, and what the second
// step allocated beyond what it kept is counted through libtorch's CPU allocator (AdamW 2:
// the square root of its second moment and the quotient; SGD without momentum 0). 0 where
// the counting allocator cannot be installed. For the planner's workspace
// (pipeline/profile.h).
double measureStepWorkspacePerParameterByte(
    const std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>& make,
    at::ScalarType dtype);

// Whether captureState() and loadState() know this optimizer's state.
bool optimizerStateSupported(const torch::optim::Optimizer& optimizer);

// The parameters and optimizer state of every child of `layers` that has parameters, one
// LayerState per child in order. The tensors alias the live ones (no copy), except ".step",
// which is made. REQUIRES: optimizer was made over (a superset of) layers' parameters, and
// optimizerStateSupported(optimizer).
checkpoint::ShardState captureState(const torch::nn::Sequential& layers,
                                    torch::optim::Optimizer& optimizer);

// The named tensors of one parameter `name` of `param` (its own, then its state's fields in
// the layout's order), appended to `out`. REQUIRES: optimizerStateSupported(optimizer).
void captureParameterState(const std::string& name, const at::Tensor& param,
                           torch::optim::Optimizer& optimizer,
                           std::vector<checkpoint::NamedTensor>* out);

// Copies `saved` (layer name -> tensor name -> tensor) into the parameters of every child of
// `layers` that has parameters and replaces their optimizer state with the saved one, on each
// parameter's device and dtype. `source` names where the state came from, for errors.
// Throws InvalidArgument if a layer or a parameter is missing or has another shape (a
// checkpoint of another model) or the optimizer has no codec, Corruption if a parameter's
// optimizer state is incomplete (a field its options need is missing, e.g. exp_avg without
// exp_avg_sq or step), has another shape, or a count that is not one integer.
// `adoptable(layer)`, when given and true, says the caller owns that layer's saved tensors
// and nothing else will use them: its optimizer state is taken as it is (where its device and
// dtype are already the parameter's) instead of cloned, and a saved parameter that is the
// parameter's own memory is not copied onto itself.
void loadState(const torch::nn::Sequential& layers, torch::optim::Optimizer& optimizer,
               const std::map<std::string, checkpoint::RestoredLayer>& saved,
               const std::string& source,
               const std::function<bool(const std::string&)>& adoptable = {});

// Tensors of a layer's state that belong to the job rather than to a parameter carry names
// starting with '@' (the dynamic loss scale, "@loss_scale": runtime/mixed_precision.h); every
// layer with parameters carries the same ones, so that each layer restores alone. loadState()
// leaves them alone. The job's tensors of the first layer of `saved` that has any, by name.
std::map<std::string, at::Tensor> jobTensors(
    const std::map<std::string, checkpoint::RestoredLayer>& saved);

// Broadcasts rank `root`'s parameters and optimizer state (serialized by the optimizer's own
// save/load) to every member of `comm`, landing on `device` (the joining members of a data-
// parallel epoch take the state of a member that holds it). Collective: every member calls it.
// Returns the bytes this member received (the parameters and the serialized optimizer state;
// 0 at the root), which the epoch's cost reports (docs/control_api.md, "reconfigured").
// Throws the communicator's errors.
int64_t broadcastState(collectives::Communicator& comm, int root, std::vector<at::Tensor>& params,
                       torch::optim::Optimizer& optimizer, at::Device device,
                       std::chrono::milliseconds timeout);

}  // namespace runtime
}  // namespace sinew
