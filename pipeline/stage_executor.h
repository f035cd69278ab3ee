#pragma once

// The stage executor (docs/architecture.md section 4, "Execution"): one worker's part of one step
// of a pipeline, forward and backward of its stage's layers over its pipeline's microbatches in
// 1F1B order, with activations sent forward and their gradients sent back through a
// communicator's point-to-point exchange.
//
// The order (docs/pipeline.md, "A step"): a stage s of S with M microbatches runs
// W = min(S - s - 1, M) warm-up forwards, then M - W steady-state rounds of one forward and
// one backward, then the W remaining backwards. Each backward is of the oldest microbatch in
// flight. Every stage sends in microbatch order, so messages with one tag between two
// workers match in order.
//
// Wide stages: a stage of width d splits every microbatch of b samples among its workers
// (worker j runs samples [j b / d, (j + 1) b / d)). Neighbouring stages may have other
// widths: a worker exchanges with each worker of the neighbouring stage whose samples
// overlap its own, the overlap's rows (dimension 0) of the activation forward and of its
// gradient back.
//
// Activations (pipeline/activation.h): one tensor or several; each tensor's first dimension is
// the samples. A gradient comes back for each floating-point tensor of an activation.
//
// Activation shapes: every activation is preceded by a header (the number of tensors, whether
// they are a list, and each tensor's dtype, number of dimensions and dimensions). From the second
// microbatch of a step on, a receiver posts the activation's receive together with the header's,
// sized as the last one, and the sender sends one of exactly that size: the activation itself when
// its shape is unchanged, else zeros followed by the activation in an exchange of its own, which
// the receiver, seeing the new header, matches (for an activation of several tensors, all of them
// are sent again when one changed). Waiting for the header before posting the receive would cost
// every microbatch a second rendezvous between the stages.
//
// Gradients: parameter gradients accumulate in the layers (the caller zeroes them before the
// step); the last stage scales each microbatch's loss by its samples / the global batch, so
// that after every stage of every pipeline ran, the gradients are those of the mean loss over
// the global batch. A gradient is sent back for an activation iff it is floating point.
//
// Thread safety: an executor is used by one thread. Blocking: each exchange waits at most the
// step's timeout; errors are the communicator's (PeerLost, Timeout, Aborted) or Corruption
// for a malformed header from the previous stage, InvalidArgument for a layer output that
// cannot be sent (no batch dimension of the samples given, more than kMaxDims dimensions, more
// than kMaxTensors tensors) or a last stage whose output is not one tensor.

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "sinew/communicator.h"
#include "sinew/pipeline/activation.h"
#include "sinew/pipeline/plan.h"

namespace sinew {
namespace pipeline {

struct StageExecutorOptions {
  int64_t microbatch = 0;   // samples per microbatch (b)
  int64_t globalBatch = 0;  // samples per step, for the loss scale
  at::Device device{at::kCPU};
  // The name of the stage's last layer, for errors about what it outputs.
  std::string lastLayerName;
};

// What a step needs from the caller.
struct StageStep {
  // The stage's layers: the input of the stage's first layer to the output of its last.
  std::function<Activation(const Activation&)> forward;
  // The loss of one microbatch slice (the mean over its samples); used by the last stage.
  std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)> loss;
  // Inputs and targets of samples [begin, end) of global microbatch m of this step, on the
  // options' device (the first stage uses inputs, the last targets).
  std::function<std::pair<Activation, at::Tensor>(int64_t m, int64_t begin, int64_t end)> data;
  // Runs one exchange (the argument); a caller may wrap it (e.g. to mark the worker as
  // waiting on others). Empty: run it as is.
  std::function<void(const std::function<void()>& transfer)> aroundExchange;
  // Called once, just before the step's first backward (failure injection).
  std::function<void()> beforeFirstBackward;
  // The deadline of each exchange.
  std::chrono::milliseconds timeout{10000};
  // Dynamic loss scaling: the last stage's backward starts from loss x this (1: none).
  double lossScale = 1.0;
  // Evaluation: forwards only, in microbatch order, without autograd and without gradients
  // sent back; the last stage still sums the loss.
  bool forwardOnly = false;
};

struct StageStepResult {
  double lossSum = 0;      // sum over this worker's samples of the loss (last stage), else 0
  double waitSeconds = 0;  // time spent in exchanges
};

class StageExecutor {
 public:
  // Tags of the point-to-point messages between neighbouring stages.
  static constexpr uint32_t kTagHeader = 1;  // shape and dtype of the next activation
  static constexpr uint32_t kTagActivation = 2;
  static constexpr uint32_t kTagGradient = 3;  // gradient of that activation, sent back
  static constexpr int kMaxDims = 8;
  static constexpr int kMaxTensors = 8;  // tensors of one activation
  // int64 words of a header: count, list, then per tensor dtype, dims and kMaxDims sizes.
  static constexpr int kHeaderWords = 2 + kMaxTensors * (2 + kMaxDims);

  // The executor of `worker`'s stage in `plan` over `comm`, whose members are the plan's
  // workers (ranks are looked up by worker id in comm.members()).
  // REQUIRES: worker has an assignment in plan; comm outlives the executor.
  // Throws InvalidArgument if the options' microbatch or global batch is not positive or a
  // neighbouring stage's worker is not a member of comm.
  StageExecutor(const Plan& plan, int worker, collectives::Communicator& comm,
                StageExecutorOptions options);

  // Runs this stage's part of step `step`'s 1F1B schedule.
  StageStepResult run(const StageStep& step);

  int stage() const { return stage_; }
  int stages() const { return stages_; }
  // This worker's samples of every microbatch: [sliceBegin, sliceEnd).
  int64_t sliceBegin() const { return sliceBegin_; }
  int64_t sliceEnd() const { return sliceEnd_; }

  // The workers of (pipeline, stage) of `plan`, in device order.
  static std::vector<int> stageWorkers(const Plan& plan, int pipeline, int stage);

 private:
  // Rows [begin, end) of the microbatch, within this worker's slice, exchanged with `rank`.
  struct Piece {
    int rank;
    int64_t begin, end;
  };
  std::vector<Piece> overlaps(const Plan& plan, int pipeline, int stage) const;
  class StepRun;  // One call of run() (stage_executor.cc).
  struct Layout;  // An activation's tensors as its header announces them.

  collectives::Communicator& comm_;  // Outlives the executor (the caller's epoch's).
  const StageExecutorOptions options_;
  WorkerAssignment mine_;
  int stage_ = 0;
  int stages_ = 0;
  int64_t sliceBegin_ = 0;
  int64_t sliceEnd_ = 0;
  std::vector<Piece> prevPieces_;  // empty on the first stage
  std::vector<Piece> nextPieces_;  // empty on the last stage
};

}  // namespace pipeline
}  // namespace sinew
