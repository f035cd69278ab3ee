#include "sinew/runtime/microbatches.h"

#include <ATen/ATen.h>

#include <string>

#include "sinew/base/error.h"

namespace sinew {
namespace runtime {

namespace {

// Throws InvalidArgument unless `t` (sample `index`'s `what`) is defined and has the shape and
// dtype of `first` (sample `firstIndex`'s).
void checkLike(const at::Tensor& t, const at::Tensor& first, const std::string& what, int64_t index,
               int64_t firstIndex) {
  if (!t.defined()) {
    SINEW_THROW(InvalidArgument, "the dataset's sample ", index, " has no ", what);
  }
  if (!first.defined() || (t.sizes() == first.sizes() && t.scalar_type() == first.scalar_type())) {
    return;
  }
  SINEW_THROW(InvalidArgument, "the dataset's sample ", index, " has ",
              what == "target" ? "a " : "an ", what, " of shape ", t.sizes(), " and dtype ",
              t.scalar_type(), ", but sample ", firstIndex, " of the same microbatch has shape ",
              first.sizes(), " and dtype ", first.scalar_type(),
              ": every sample's tensors must agree");
}

}  // namespace

std::pair<pipeline::Activation, at::Tensor> MicrobatchReader::operator()(
    const std::vector<int64_t>& indices, int64_t m, int64_t begin, int64_t end,
    const Dataset* data) const {
  if (end < 0) end = microbatch;
  const Dataset& from = data != nullptr ? *data : *dataset;
  std::vector<std::vector<at::Tensor>> xs;  // per input, the samples' tensors
  std::vector<at::Tensor> ys;
  const int64_t firstIndex = indices[m * microbatch + begin];
  for (int64_t j = m * microbatch + begin; j < m * microbatch + end; ++j) {
    Sample s = from(indices[j]);
    if (xs.empty()) xs.resize(1 + s.extraInputs.size());
    if (s.extraInputs.size() + 1 != xs.size()) {
      SINEW_THROW(InvalidArgument, "the dataset's sample ", indices[j], " has ",
                  s.extraInputs.size(), " extra inputs, but sample ", firstIndex,
                  " of the same microbatch has ", xs.size() - 1,
                  ": every sample has the same inputs");
    }
    for (size_t k = 0; k < xs.size(); ++k) {
      const at::Tensor& x = k == 0 ? s.input : s.extraInputs[k - 1];
      const std::string what = k == 0 ? "input" : "extra input " + std::to_string(k - 1);
      checkLike(x, xs[k].empty() ? at::Tensor() : xs[k].front(), what, indices[j], firstIndex);
      xs[k].push_back(x);
    }
    checkLike(s.target, ys.empty() ? at::Tensor() : ys.front(), "target", indices[j], firstIndex);
    ys.push_back(s.target);
  }
  auto training = [this](const at::Tensor& t) {
    return (at::isFloatingType(t.scalar_type()) ? t.to(dtype) : t).to(device);
  };
  if (xs.size() == 1)
    return {pipeline::Activation(training(at::stack(xs[0]))), training(at::stack(ys))};
  std::vector<at::Tensor> inputs;
  for (const auto& x : xs) inputs.push_back(training(at::stack(x)));
  return {pipeline::Activation::ofList(std::move(inputs)), training(at::stack(ys))};
}

void SamplesRead::clear() {
  samples_.clear();
  positions_.clear();
  seen_.clear();
}

void SamplesRead::note(const std::vector<int64_t>& indices, int64_t begin, int64_t end) {
  seen_.resize(indices.size(), false);
  for (int64_t j = begin; j < end; ++j) {
    if (seen_[static_cast<size_t>(j)]) continue;
    seen_[static_cast<size_t>(j)] = true;
    samples_.push_back(indices[static_cast<size_t>(j)]);
    positions_.push_back(j);
  }
}

void SamplesRead::take(std::vector<int64_t>* samples, std::vector<int64_t>* positions) {
  *samples = std::move(samples_);
  *positions = std::move(positions_);
  clear();
}

}  // namespace runtime
}  // namespace sinew
