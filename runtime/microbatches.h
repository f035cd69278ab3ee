#pragma once

// Internal: the tensors of a microbatch, read from a Dataset (sinew/model.h): the samples a
// step's batch indices name, stacked along a new first dimension, on the worker's device.
// Floating-point inputs and targets train in TrainerOptions::dtype; integer ones (token ids,
// labels) stay as they are.
//
// Thread safety: const; the dataset must be callable from the calling thread.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "sinew/model.h"
#include "sinew/pipeline/activation.h"

namespace sinew {
namespace runtime {

struct MicrobatchReader {
  const Dataset* dataset = nullptr;  // the model's (ModelSpec::dataset)
  int64_t microbatch = 0;            // samples per microbatch
  at::ScalarType dtype = at::kFloat;
  at::Device device{at::kCPU};

  // The inputs and targets of samples [begin, end) of global microbatch m of a step whose
  // batch is `indices` (end < 0: the whole microbatch), from `data` instead of the model's
  // dataset when given (evaluation). Throws InvalidArgument naming the sample index when a
  // sample's input or target is undefined or differs in shape or dtype from the microbatch's
  // first sample's, or has another number of extra inputs. The input is one tensor, or a list
  // of the input and the extra inputs when the samples have extra inputs.
  std::pair<pipeline::Activation, at::Tensor> operator()(const std::vector<int64_t>& indices,
                                                         int64_t m, int64_t begin = 0,
                                                         int64_t end = -1,
                                                         const Dataset* data = nullptr) const;
};

// The samples one attempt of a step read (StepResult::samples and samplePositions): each
// position of the step's global batch once, in the order read (a one-stage pipeline reads a
// microbatch's inputs and then its targets).
class SamplesRead {
 public:
  // A new attempt: nothing read yet.
  void clear();
  // Positions [begin, end) of the step's global batch `indices` were read.
  void note(const std::vector<int64_t>& indices, int64_t begin, int64_t end);
  // Moves what the attempt read into `samples` and `positions`.
  void take(std::vector<int64_t>* samples, std::vector<int64_t>* positions);

 private:
  std::vector<int64_t> samples_;
  std::vector<int64_t> positions_;
  std::vector<bool> seen_;  // by position
};

}  // namespace runtime
}  // namespace sinew
