#pragma once

// What flows from one layer to the next and between pipeline stages: one tensor, or several
// (hidden states and a padding mask, a residual stream beside them). A layer whose input is one
// tensor takes an at::Tensor; a layer whose input is several takes a std::vector<at::Tensor>, and
// a layer may return either. Every tensor of an activation has the microbatch's samples as its
// first dimension, since a wide stage splits the samples among its workers by rows.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace sinew {
namespace pipeline {

struct Activation {
  std::vector<at::Tensor> tensors;
  // The next layer takes std::vector<at::Tensor> (also for a list of one), else tensors[0].
  bool list = false;

  Activation() = default;
  // One tensor.
  Activation(at::Tensor t);  // NOLINT(google-explicit-constructor): a tensor is an activation.
  static Activation ofList(std::vector<at::Tensor> tensors);

  // The one tensor of a single-tensor activation; InvalidArgument naming `who` otherwise.
  const at::Tensor& single(const char* who) const;
  // Bytes of all tensors (undefined ones count 0).
  int64_t bytes() const;
  // The same tensors detached from autograd.
  Activation detached() const;
};

}  // namespace pipeline
}  // namespace sinew
