#pragma once

// The trainer (DESIGN.md sections 1 and 6): wraps a user's libtorch model, loss, optimizer
// and data, and drives training through failures and joins.
//
// The model is an ordered list of LayerSpecs (any worker can build any layer); a Plan says
// which worker holds which layers and runs which microbatches. This version runs data
// parallel (every worker holds every layer: one-stage pipelines); the plan and step APIs are
// the pipeline-shaped ones, so pipelines plug in without changing them.
//
// A step s, on every member of the current epoch:
//   1. Run forward and backward over this worker's microbatches of the global batch of s
//      (a pure function of (seed, s)), each loss scaled by microbatch/global batch.
//   2. Allreduce the gradients (sum) and the loss.
//   3. Vote through the coordinator; apply the optimizer step only when step s is committed
//      (every member voted). A step is applied everywhere or nowhere.
// On a failure (PeerLost, Timeout, Aborted, or a new epoch announced) the worker aborts its
// communicator, waits for the coordinator's next epoch, builds that epoch's communicator,
// and resumes at the epoch's resume step (the last committed step + 1); its parameters are
// already those of the last committed step, since it never applies an uncommitted one. When
// an epoch adds workers (joins), the epoch's source broadcasts parameters and optimizer state
// to every member before the first step.
//
// Thread safety: a Trainer is driven by one thread.

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "sinew/runtime/init.h"

namespace sinew {

// One layer: a name (the key of its state everywhere: checkpoints, copies) and a factory.
// Factories are called in layer order after seeding torch's generator with the trainer's
// seed, so every worker builds the same initial parameters.
struct LayerSpec {
  std::string name;
  std::function<torch::nn::AnyModule()> build;
};

// Loss of one microbatch: the mean over its samples.
using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor> parameters)>;
OptimizerFactory sgd(double lr, double momentum = 0.0);
OptimizerFactory adam(double lr);

struct Sample {
  at::Tensor input;
  at::Tensor target;
};
// Returns sample i, deterministically (the same tensors on every worker, every time).
using Dataset = std::function<Sample(int64_t index)>;

struct ModelSpec {
  std::vector<LayerSpec> layers;
  LossFn loss;
  OptimizerFactory optimizer;
  Dataset dataset;
  int64_t datasetSize = 0;
};

struct TrainerOptions {
  int64_t globalBatch = 64;  // samples per step, whatever the job's size
  int64_t microbatch = 8;    // samples per microbatch; divides globalBatch
  uint64_t seed = 0;
  int64_t steps = 100;
  // Progress line every this many steps (printed by the epoch's first member); 0: never.
  int progressEvery = 10;
  // JSON-lines event log; empty: $SINEW_LOG_DIR/worker-<id>-events.jsonl if set, else none.
  std::string eventLog;
  // Parameters and data are cast to this type.
  at::ScalarType dtype = at::kDouble;
  // Deadline of each collective and of the step vote.
  std::chrono::milliseconds opTimeout{10000};
  // How long a recovery may take before the worker gives up (throws).
  std::chrono::milliseconds recoveryTimeout{60000};
  // Deadline for connecting one epoch's communicator. Its store waits give up as soon as a
  // newer epoch is announced; this bounds the connect phase after them, e.g. towards a peer
  // stopped mid-recovery (then the worker asks for a rebuild).
  std::chrono::milliseconds buildTimeout{10000};
  // Durable checkpoints (checkpoint/, docs/checkpoint_format.md); empty: none. After the
  // optimizer step of every `checkpointEvery`-th step (and of the last step) the epoch's
  // first member snapshots parameters and optimizer state lazily into host RAM (the copy
  // overlaps the next forward and backward; the next optimizer step waits for it), and a
  // background thread writes it to checkpointDir (safetensors + manifest, then LATEST).
  // A job started on a checkpointDir that holds a durable version resumes after it, with
  // any number of workers. Supported optimizers: SGD and Adam.
  std::string checkpointDir;
  int checkpointEvery = 0;
  int checkpointKeep = 2;  // newest durable versions kept
};

struct TrainResult {
  int64_t steps = 0;     // steps completed by the job
  double finalLoss = 0;  // mean loss over the last step's global batch
  int recoveries = 0;    // failures this worker recovered from
  double recoveryMaxSeconds = 0;
  int64_t finalEpoch = 0;
  std::vector<int> finalMembers;
  int64_t startStep = 0;              // first step this job ran (after a restored checkpoint)
  bool preempted = false;             // this worker left early (SIGTERM, requestPreemption)
  int64_t checkpointsWritten = 0;     // durable versions this worker wrote
  int64_t checkpointsSkipped = 0;     // due but skipped because a flush was still running
  double checkpointStallSeconds = 0;  // optimizer steps waiting for a snapshot copy
};

// Which layers a worker holds and which microbatches of each step it runs.
struct WorkerAssignment {
  int worker = -1;
  int pipeline = 0;
  int stage = 0;
  int firstLayer = 0;  // layers [firstLayer, endLayer)
  int endLayer = 0;
  std::vector<int64_t> microbatches;  // indices into the step's global batch
};

struct Plan {
  int64_t epoch = -1;
  int numLayers = 0;
  int64_t microbatchesPerStep = 0;
  std::vector<WorkerAssignment> workers;

  // Every member holds every layer and runs a contiguous, near-equal share of the
  // microbatches (members in ascending id order).
  static Plan dataParallel(int64_t epoch, const std::vector<int>& members, int numLayers,
                           int64_t microbatchesPerStep);
  // REQUIRES: worker is in the plan.
  const WorkerAssignment& of(int worker) const;
};

// The dataset indices of step `step`'s global batch: a pure function of (seed, step).
std::vector<int64_t> globalBatchIndices(uint64_t seed, int64_t step, int64_t globalBatch,
                                        int64_t datasetSize);

// Builds the model of `spec` (seeded with `seed`, cast to dtype) as a Sequential.
torch::nn::Sequential buildModel(const ModelSpec& spec, uint64_t seed, at::ScalarType dtype);

class Trainer {
 public:
  // REQUIRES: ctx outlives the trainer.
  Trainer(Context& ctx, ModelSpec spec, TrainerOptions options);
  ~Trainer();

  // Trains until options.steps steps are committed, or until this worker is preempted
  // (Context::preemptionRequested(), e.g. SIGTERM): then it leaves at the next step boundary,
  // after that step is applied, with result.preempted set; if it held the job's durable
  // checkpoints, that step is written first.
  // Throws Expelled if this worker was
  // declared dead, Timeout if a recovery took longer than recoveryTimeout.
  TrainResult run();

  torch::nn::Sequential& model() { return model_; }
  std::vector<at::Tensor> parameters() const { return model_->parameters(); }

  class Impl;

 private:
  torch::nn::Sequential model_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace sinew
