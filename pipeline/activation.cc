#include "sinew/pipeline/activation.h"

#include <ATen/ATen.h>

#include <utility>

#include "sinew/base/error.h"

namespace sinew {
namespace pipeline {

Activation::Activation(at::Tensor t) : tensors{std::move(t)} {}

Activation Activation::ofList(std::vector<at::Tensor> ts) {
  Activation a;
  a.tensors = std::move(ts);
  a.list = true;
  return a;
}

const at::Tensor& Activation::single(const char* who) const {
  if (list || tensors.size() != 1) {
    SINEW_THROW(InvalidArgument, who, " is a list of ", tensors.size(),
                " tensors where one tensor is needed");
  }
  return tensors.front();
}

int64_t Activation::bytes() const {
  int64_t n = 0;
  for (const at::Tensor& t : tensors) {
    if (t.defined()) n += static_cast<int64_t>(t.numel() * t.element_size());
  }
  return n;
}

Activation Activation::detached() const {
  Activation a = *this;
  for (at::Tensor& t : a.tensors) {
    if (t.defined()) t = t.detach();
  }
  return a;
}

}  // namespace pipeline
}  // namespace sinew
