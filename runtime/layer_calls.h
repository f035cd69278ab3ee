#pragma once

// Internal: runs a worker's layers on an activation (pipeline/activation.h). A layer gets one
// at::Tensor when one tensor reaches it and a std::vector<at::Tensor> when several do (or the
// previous layer returned a list); what it returns, an at::Tensor or a std::vector<at::Tensor>,
// goes to the next layer as it is. This is how torch::nn::Sequential chains modules, so a
// model gathered from a job (Trainer::gatherModel()) runs the same way.
//
// Thread safety: as the layers' forward.

#include <torch/nn/modules/container/sequential.h>

#include "sinew/pipeline/activation.h"

namespace sinew {
namespace runtime {

// The output of `layers` on x. Throws InvalidArgument naming the layer when one cannot take
// what reaches it or returns something other than a tensor or a list of tensors, and when
// `layers` is empty.
pipeline::Activation runLayers(torch::nn::Sequential layers, const pipeline::Activation& x);

}  // namespace runtime
}  // namespace sinew
