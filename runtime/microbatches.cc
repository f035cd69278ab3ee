#include "sinew/runtime/microbatches.h"

#include <ATen/ATen.h>

#include "sinew/base/error.h"

namespace sinew {
namespace runtime {

namespace {

// Throws InvalidArgument unless `t` (sample `index`'s `what`) is defined and has the shape and
// dtype of `first` (sample `firstIndex`'s).
void checkLike(const at::Tensor& t, const at::Tensor& first, const char* what, int64_t index,
               int64_t firstIndex) {
  if (!t.defined()) {
    SINEW_THROW(InvalidArgument, "the dataset's sample ", index, " has no ", what);
  }
  if (!first.defined() || (t.sizes() == first.sizes() && t.scalar_type() == first.scalar_type())) {
    return;
  }
  SINEW_THROW(InvalidArgument, "the dataset's sample ", index, " has ",
              what == std::string("input") ? "an " : "a ", what, " of shape ", t.sizes(),
              " and dtype ", t.scalar_type(), ", but sample ", firstIndex,
              " of the same microbatch has shape ", first.sizes(), " and dtype ",
              first.scalar_type(), ": every sample's tensors must agree");
}

}  // namespace

std::pair<at::Tensor, at::Tensor> MicrobatchReader::operator()(const std::vector<int64_t>& indices,
                                                               int64_t m, int64_t begin,
                                                               int64_t end,
                                                               const Dataset* data) const {
  if (end < 0) end = microbatch;
  const Dataset& from = data != nullptr ? *data : *dataset;
  std::vector<at::Tensor> xs, ys;
  const int64_t firstIndex = indices[m * microbatch + begin];
  for (int64_t j = m * microbatch + begin; j < m * microbatch + end; ++j) {
    Sample s = from(indices[j]);
    checkLike(s.input, xs.empty() ? at::Tensor() : xs.front(), "input", indices[j], firstIndex);
    checkLike(s.target, ys.empty() ? at::Tensor() : ys.front(), "target", indices[j], firstIndex);
    xs.push_back(s.input);
    ys.push_back(s.target);
  }
  auto training = [this](const at::Tensor& t) {
    return (at::isFloatingType(t.scalar_type()) ? t.to(dtype) : t).to(device);
  };
  return {training(at::stack(xs)), training(at::stack(ys))};
}

}  // namespace runtime
}  // namespace sinew
