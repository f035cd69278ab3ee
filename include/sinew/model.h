#pragma once

// The model types (docs/architecture.md section 1): a model is an ordered list of layers, each with
// a name and a factory, so any worker can build any layer; plus the loss, the optimizer factory and
// the dataset the trainer drives. The runtime and the pipeline executor both see them.
//
// Thread safety: plain values; the functions they hold are called by the training thread.

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace sinew {

// One layer: a name (the key of its state everywhere: checkpoints, copies) and a factory.
// Before layer i's factory runs, torch's generator is seeded from (the trainer's seed, i), so
// every worker builds the same initial parameters for a layer whichever other layers it
// builds (a pipeline stage builds only its own).
//
// What flows between layers may be one tensor or several (hidden states and a mask): a layer's
// module takes at::Tensor when one tensor reaches it and std::vector<at::Tensor> when several
// do, and returns either; every tensor has the microbatch's samples as its first dimension.
// The model's last layer returns one tensor, the loss's input.
struct LayerSpec {
  std::string name;
  std::function<torch::nn::AnyModule()> build;
  // Bytes the layer keeps for backward per microbatch (its input, its output and what autograd
  // saves), when the program knows better than the profiler, which measures them on the CPU
  // (TrainerOptions::measureActivationMemory, the default) or estimates them as input + output
  // bytes (docs/pipeline.md, "Profiles"); -1: the profiler's figure.
  int64_t activationBytes = -1;
  // The most memory the layer needs for a moment beyond what it keeps (temporaries of its
  // forward, backward and optimizer step), when the program knows better than the profiler;
  // -1: the profiler's figure.
  int64_t workspaceBytes = -1;
};

// Loss of one microbatch: the mean over its samples.
using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> parameters)>;
// Ready-made factories. Any factory works whose optimizer Sinew can capture the state of:
// torch::optim::SGD, Adam, AdamW, RMSprop and Adagrad with any options (the Trainer refuses
// another, e.g. LBFGS, naming it).
OptimizerFactory sgd(double lr, double momentum = 0.0);
OptimizerFactory adam(double lr);
OptimizerFactory adamw(double lr, double weightDecay = 0.01);
OptimizerFactory rmsprop(double lr);
OptimizerFactory adagrad(double lr);

// One sample. The model's first layer gets `input` as an at::Tensor, or, when the sample has
// extra inputs (a padding mask, positions), std::vector<at::Tensor>{input, extraInputs...}.
// Every sample of a dataset has the same number of inputs, and each input the same shape and
// dtype as the first sample's (they are stacked into microbatches along a new first dimension).
struct Sample {
  Sample() = default;
  Sample(at::Tensor input, at::Tensor target, std::vector<at::Tensor> extraInputs = {})
      : input(std::move(input)), target(std::move(target)), extraInputs(std::move(extraInputs)) {}

  at::Tensor input;
  at::Tensor target;
  std::vector<at::Tensor> extraInputs;
};
// Returns sample i, deterministically (the same tensors on every worker, every time).
using Dataset = std::function<Sample(int64_t index)>;

// Two parameters that are one tensor of the model, each named "<layer>.<parameter>" (the
// layer's name, then the parameter's name within it, e.g. "embed.tok.weight" and
// "head.lm.weight": a GPT's token embedding and its output head). The follower starts as a copy
// of the owner, and at every step both get the sum of their gradients (summed between the
// workers that hold them when they sit on different pipeline stages), so the optimizer keeps
// them equal and the model trains as one whose two layers use one tensor. Gradient clipping
// counts the tensor once. Checkpoints, peer-RAM versions and layer copies hold both (equal)
// tensors, so each layer loads on its own. Both must have one shape and dtype and both be
// trainable or both frozen.
struct TiedParameters {
  std::string owner;
  std::string follower;
};

struct ModelSpec {
  std::vector<LayerSpec> layers;
  // Parameters shared between layers (see TiedParameters). A parameter is a follower at most
  // once, and an owner is no follower.
  std::vector<TiedParameters> tied;
  LossFn loss;
  OptimizerFactory optimizer;
  Dataset dataset;
  int64_t datasetSize = 0;
};

// Builds the model of `spec` (seeded with `seed`, cast to dtype) as a Sequential, each tied
// follower a copy of its owner (ModelSpec::tied).
// Throws InvalidArgument if spec has no layers, a layer has no factory, or a tie names a
// parameter that does not exist or differs from its owner in shape, dtype or requires_grad.
torch::nn::Sequential buildModel(const ModelSpec& spec, uint64_t seed, at::ScalarType dtype);

// Builds layers [first, end) of `spec` only, each exactly as buildModel() builds it (a follower
// whose owner's layer is outside the range still starts as the owner's copy).
// Throws InvalidArgument as buildModel() or unless 0 <= first < end <= spec.layers.size().
torch::nn::Sequential buildLayers(const ModelSpec& spec, uint64_t seed, at::ScalarType dtype,
                                  int first, int end);

}  // namespace sinew
