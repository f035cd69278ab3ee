#pragma once

// Internal: parameters tied across layers (ModelSpec::tied, sinew/model.h). Each follower is a
// tensor of its own that starts as a copy of its owner; after every backward both get the sum
// of their two gradients, so that one optimizer keeps them equal and the model trains as if
// one tensor were used in both places. In data parallel mode every worker holds both and sums
// them locally (sumTiedGradients); in pipeline mode the holders of the two layers sum them
// over a communicator of their own (runtime/epoch_communicators.h). The gradient norm counts
// the tensor once: the follower is left out of it.
//
// Thread safety: pure functions over tensors the caller owns.

#include <ATen/core/Tensor.h>
#include <torch/nn/modules/container/sequential.h>

#include <map>
#include <string>
#include <unordered_set>
#include <vector>

#include "sinew/model.h"

namespace sinew {
namespace runtime {

// One tie, resolved against the model's layers.
struct Tie {
  int ownerLayer = 0;
  std::string ownerParam;  // within the owner layer's module
  int followerLayer = 0;
  std::string followerParam;
};

// ModelSpec::tied resolved: each name is "<layer>.<parameter>" of a layer of `spec` (the
// longest layer name that prefixes it). Throws InvalidArgument naming the tie when a name has
// no such layer or no parameter part, a parameter is tied to itself, is a follower twice, or
// an owner is also a follower. (Whether the parameters exist is checked when they are built.)
std::vector<Tie> resolveTies(const ModelSpec& spec);

// Parameter `name` of `layer` (layer `index` of the model, named `layerName`). Throws
// InvalidArgument naming both when the layer has no such parameter.
at::Tensor tiedParameter(const torch::nn::Module& layer, const std::string& name, int index,
                         const std::string& layerName);

// Layers [first, end) of `spec`, each built from its own seed (see LayerSpec), cast to dtype,
// before any tie is applied. REQUIRES: a valid range; every layer has a factory.
torch::nn::Sequential buildUntiedLayers(const ModelSpec& spec, uint64_t seed, at::ScalarType dtype,
                                        int first, int end);

// Copies each owner into its follower where `layers` (layers [first, end) of `spec`, built
// with `seed` and `dtype`) holds the follower; an owner outside the range is built from its
// seed for the copy. Throws InvalidArgument naming both parameters when their shapes, dtypes
// or requires_grad differ.
void copyOwnersIntoFollowers(const ModelSpec& spec, const std::vector<Tie>& ties, uint64_t seed,
                             at::ScalarType dtype, int first, int end,
                             torch::nn::Sequential& layers);

// Parameter `name` of layer `layer` where `held` holds layers [heldFirst, heldFirst +
// held->size()); undefined when the layer is not among them. Throws as tiedParameter().
at::Tensor heldParameter(const torch::nn::Sequential& held, int heldFirst, int layer,
                         const std::string& name);

// The ties as checkpoints store them once: "follower layer/param" -> "owner layer/param", by
// the layers' names in `spec` (checkpoint::PersistOptions::sameAs).
std::map<std::string, std::string> storedOnce(const ModelSpec& spec, const std::vector<Tie>& ties);

// Data parallel mode: sets the gradients of both parameters of every tie to their sum (an
// undefined gradient counts as zeros). `model` holds every layer.
void sumTiedGradients(const torch::nn::Sequential& model, const std::vector<Tie>& ties);

// The sum of the squares of the gradients of the trainable parameters of `held` (layers
// [heldFirst, heldFirst + held->size())), the followers left out: each tied tensor counts once.
double squaredNormCountingTiesOnce(const torch::nn::Sequential& held, int heldFirst,
                                   const std::vector<Tie>& ties);

// The followers among the layers [heldFirst, heldFirst + held->size()) that `held` holds, by
// their TensorImpl, for leaving them out of the gradient norm.
std::unordered_set<const void*> heldFollowers(const torch::nn::Sequential& held, int heldFirst,
                                              const std::vector<Tie>& ties);

}  // namespace runtime
}  // namespace sinew
