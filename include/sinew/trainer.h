#pragma once

// The trainer (docs/architecture.md sections 1 and 6): wraps a user's libtorch model, loss,
// optimizer and data, and drives training through failures and joins.
//
// The model is an ordered list of LayerSpecs (sinew/model.h; any worker can build any layer);
// a plan says which worker holds which layers and runs which microbatches. Two modes
// (TrainerOptions::parallelism):
//   - data parallel: every worker holds every layer (one-stage pipelines);
//   - pipeline parallel (docs/pipeline.md): from the job's layer profile the coordinator
//     plans the pipeline templates once and sends each epoch's plan (at least
//     faultTolerance + 1 pipelines on its members); each worker builds only its stage's
//     layers, runs 1F1B over its
//     pipeline's share of the global batch (activations forward and gradients back through
//     Communicator::exchange), and each layer's gradient is summed over the workers that hold
//     that layer (one group per layer range).
//
// A step s, on every member of the current epoch:
//   1. Run forward and backward over this worker's microbatches of the global batch of s
//      (a pure function of (seed, s)), each loss scaled by microbatch/global batch.
//      Floating-point inputs and targets are cast to the training dtype; integer ones (token
//      ids, class labels) are passed unchanged.
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

#include <torch/nn/modules/container/sequential.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "sinew/data.h"
#include "sinew/error.h"
#include "sinew/init.h"
#include "sinew/model.h"
#include "sinew/schedule.h"

namespace sinew {

// How workers move tensors between them (docs/gpu.md).
enum class CommBackend {
  // NCCL when every member of an epoch trains on a GPU of its own; otherwise Gloo, through
  // host memory for CUDA tensors (several workers sharing one GPU, which NCCL refuses, or a
  // job that mixes GPU and CPU workers). Decided again for each epoch and gradient group.
  kAuto,
  kGloo,  // always Gloo (CUDA tensors through host memory)
  kNccl,  // always NCCL: InvalidArgument when a member is not on a GPU of its own
};

enum class Parallelism {
  kData,      // every worker holds every layer
  kPipeline,  // pipelines from templates; each worker holds one stage's layers
};

// A tensor of the program's own state (its data loader's position, a generator, a running
// statistic) that travels with the model: stored with every checkpoint, peer-RAM version and
// layer copy as "@user.<name>" (docs/checkpoint_format.md), and given back when the job
// resumes from one. `save(step)` is called once per committed step on every worker, in step
// order, inside Trainer::step() (or run()) once the step is committed, just before its
// optimizer step; it returns the state after that step, of `initial`'s shape and dtype (the
// program may advance its state in it). If it throws, step() throws InvalidArgument naming it
// and the step, and the optimizer has not stepped. `load(step, value)` is called inside step() or
// the constructor when this worker's state comes back to the one after `step`: after a restore from
// disk, a rollback to a peer-RAM version, or when it joins the job (the value of a member that
// holds it). A step redone after a rollback calls save again. The same names on every worker; a
// name is [A-Za-z0-9_.-]+.
struct KeptState {
  std::string name;
  at::Tensor initial;
  std::function<at::Tensor(int64_t step)> save;
  std::function<void(int64_t step, const at::Tensor& value)> load;
};

struct TrainerOptions {
  int64_t globalBatch = 64;  // samples per step, whatever the job's size
  int64_t microbatch = 8;    // samples per microbatch; divides globalBatch
  uint64_t seed = 0;
  // Which samples each step trains on (sinew/data.h): drawn with replacement, or in epochs,
  // every sample once per epoch whatever joins, losses and rollbacks happen.
  Sampling sampling = Sampling::kWithReplacement;
  int64_t steps = 100;
  // Progress line every this many steps (printed by the epoch's first member); 0: never.
  int progressEvery = 10;
  // JSON-lines event log; empty: $SINEW_LOG_DIR/worker-<id>-events.jsonl if set, else none.
  std::string eventLog;
  // Parameters, gradients, optimizer state and floating-point data are cast to this type
  // (float64 where a test asserts exactness).
  at::ScalarType dtype = at::kFloat;
  // Mixed precision: the dtype the layers compute in, at::kBFloat16 (CPU or CUDA) or
  // at::kHalf (CUDA only), while parameters, gradients, optimizer state and checkpoints stay
  // in `dtype`, which must then be float32 (the master weights). Every forward and the loss
  // run under libtorch's autocast for the device: matrix products and convolutions in the
  // compute dtype, reductions and the loss in float32, as PyTorch's AMP. Activations and
  // their gradients cross pipeline stages in the dtype the layers give them. Undefined (the
  // default): everything in `dtype`.
  at::ScalarType computeDtype = at::ScalarType::Undefined;
  // Dynamic loss scaling (PyTorch's GradScaler rules): the loss is multiplied by a scale
  // before backward and the gradients divided by it after the reduction. A step whose
  // gradient has an infinite or NaN element (its global norm, the same on every worker, is
  // not finite) is committed without an optimizer step by every worker alike, and the scale
  // halves; after `growthInterval` steps in a row without one, it doubles. The scale travels
  // with every checkpoint, peer-RAM version and layer copy ("@loss_scale",
  // docs/checkpoint_format.md), so a restored or rolled-back job resumes with the scale of
  // its step. Unset: on exactly when computeDtype is at::kHalf.
  struct LossScaling {
    double initialScale = 65536.0;  // 2^16; > 0 and finite
    int64_t growthInterval = 2000;  // >= 1
  };
  std::optional<LossScaling> lossScaling;
  // The program's own state that travels with the model (see KeptState).
  std::vector<KeptState> keptState;
  // The learning rate of each step (sinew/schedule.h: warmupCosine, stepDecay, constantLr, or
  // any function of the step), set on every parameter group of the optimizer before the
  // step's optimizer step, by every worker alike, also for a step redone after a recovery, a
  // rollback or a restore. Empty: the optimizer's own rates. The rates of the job's first
  // steps (up to 2^20) are checked when the Trainer is made; a rate that is NaN, infinite or
  // negative is an InvalidArgument naming the step.
  LrSchedule lrSchedule;
  // Global-norm gradient clipping: the gradient of the step's global batch over the whole
  // model (in pipeline mode: every stage's layers, each layer counted once however many
  // pipelines hold it) is scaled by min(1, clipGradNorm / (norm + 1e-6)), as
  // torch::nn::utils::clip_grad_norm_ does to the same gradient in one process. Unset: no
  // clipping; set, it must be finite and > 0.
  std::optional<double> clipGradNorm;
  // Where this worker's layers, activations and gradients live (docs/gpu.md): "cpu"; "cuda",
  // the GPU of this worker's local rank modulo the GPUs it sees (the local rank from
  // SINEW_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID, MPI_LOCALRANKID or
  // LOCAL_RANK, else the worker id); or "cuda:N". Layers are built on the CPU from their
  // seeds and then moved, so every device starts from the same parameters. CUDA needs a
  // libtorch with CUDA and Sinew built with the CUDA toolkit (SINEW_WITH_NCCL).
  std::string device = "cpu";
  CommBackend backend = CommBackend::kAuto;
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
  // any number of workers. Any optimizer of sinew/model.h's list (its state's tensor names:
  // docs/checkpoint_format.md, "Tensor names").
  std::string checkpointDir;
  int checkpointEvery = 0;
  int checkpointKeep = 2;  // newest durable versions kept
  // Incremental versions (Check-N-Run): a writer's shard file holds only the layers whose
  // digest (a crc32c of each tensor, its dtype and shape) changed since the previous durable
  // version, and the manifest points at older files for the rest, so a frozen base
  // (requires_grad false: no gradient, no optimizer state, no update) is written once.
  // Retention keeps every file a kept manifest reads. Peer-RAM versions (pipeline mode) are
  // incremental too: each replica holder gets only the tensors whose crc32c changed since the
  // version it acknowledged last and copies the rest from its replica of that one. A changed
  // layer or tensor whose checksum collides with its old one (about 1 in 2^32 each time)
  // would not be written: off by default.
  bool incrementalCheckpoints = false;
  // The `done` event gets `peak_rss_by_phase_bytes`: the peak resident memory of each phase
  // of a step (schedule: forward and backward; reduce: gradient sums; clip; optimizer; the
  // checkpoint after it; evaluation; recovery), measured by resetting Linux's high-water mark
  // at each phase (about a millisecond per GB resident each time). The whole training's peak
  // (`training_peak_rss_bytes`) is reported either way.
  bool memoryByPhase = false;

  // ---- Pipeline parallelism (parallelism = kPipeline; docs/pipeline.md) ----
  Parallelism parallelism = Parallelism::kData;
  // f: the job runs at least f + 1 pipelines, so every layer has f + 1 copies.
  int faultTolerance = 1;
  // Peer-RAM versions (Gemini; docs/pipeline.md, "Peer-RAM versions"): after the optimizer
  // step of every `peerCheckpointEvery`-th step (and of the last step) each worker snapshots
  // its layers' parameters and optimizer state lazily into host RAM and replicates them to
  // `replicas - 1` peers chosen by Gemini's group placement (consecutive stages of one
  // pipeline form a group); a version is committed once every worker's shard has `replicas`
  // copies. When every live copy of some layer is lost (f + 1 failures, or two workers of
  // different pipelines holding the same layers) the job rolls back to the newest committed
  // version, restored from the workers' own RAM, then peers' RAM, then checkpointDir.
  // 0: off (such a loss then rolls back to the newest durable version in checkpointDir, or
  // to the start when there is none).
  int peerCheckpointEvery = 1;
  int replicas = 2;
  // The most workers the job may grow to by joins: the coordinator plans templates up to
  // that many nodes, so a joined worker gets a stage (docs/pipeline.md, "Joins"). 0: the
  // environment's SINEW_MAX_WORKERS (sinew-run --max-workers sets it), else twice the
  // workers the job starts with.
  int64_t maxWorkers = 0;
  // The layer profile the planner uses: a JSON file (docs/profile_format.md) with one entry
  // per layer of the model, in order; empty: measured at start by every member of the first
  // epoch at once (pipeline/profiler.h, whole microbatches of step 0, medians of 21 runs, or of
  // 3 or more within 60 s for a large model; each
  // worker builds every layer for it, one at a time), the first member publishing the
  // per-layer median of everyone's times, which the coordinator plans from.
  std::string profilePath;
  // For a measured profile: the memory one worker may use for its layers' parameters,
  // optimizer state and activations (0: unlimited). A profile file sets its own.
  int64_t deviceMemoryBytes = 0;
  // For a measured profile: each layer's activation bytes (what it keeps for backward per
  // microbatch) measured by counting libtorch's CPU allocations during a forward, attention
  // scores and all (on by default), instead of estimated as its input + output bytes (which is
  // several times too low for attention blocks), and each layer's workspace (the temporaries
  // of its forward, backward and optimizer step; docs/pipeline.md, "Profiles"). A GPU worker
  // always estimates activations and counts only the optimizer step's workspace.
  // LayerSpec::activationBytes overrides the activations.
  bool measureActivationMemory = true;
  // For a measured profile: G, the workers (devices) of one node (a profile file sets its own
  // devices_per_node). In every epoch the planner's node k is the epoch's members [kG, kG + G)
  // in ascending id order (members beyond the last full node stay idle), and a stage may be up
  // to G workers wide. After a loss the survivors are grouped again in the same way, so a node
  // may then pair workers that were in different nodes before (docs/pipeline.md, section 1).
  // In [1, 4096] and at most `microbatch`. 1: every worker is a node of one device.
  int devicesPerNode = 1;
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
  // What this worker ran in the final epoch: its pipeline and stage (data parallel: its rank
  // and 0), of how many pipelines, the layers it held and their parameter count.
  int pipelines = 0;
  int pipeline = -1;
  int stage = -1;
  std::vector<std::string> layers;
  int64_t parameterCount = 0;
  std::string device;      // where its layers were: "cpu", "cuda:0", ...
  std::string backend;     // of its final epoch's transfers: "gloo" or "nccl"
  double lossScale = 1.0;  // the loss scale after the last step (1 without loss scaling)
};

// What one Trainer::step() did.
struct StepResult {
  // No step was run: the job trained its last step, or this worker was released (preempted,
  // or a joiner the job did not need). The other fields but nextStep are then unset.
  bool done = false;
  int64_t step = -1;        // the step this call committed (0-based)
  double loss = 0;          // its mean loss over the global batch
  double learningRate = 0;  // the rate its optimizer step used (the first parameter group's)
  double gradNorm = 0;      // the 2-norm of its whole gradient, before clipping
  // With loss scaling: the step's gradient was not finite and the optimizer did not step
  // (on every worker); lossScale is the scale the step's loss was multiplied by (1 without).
  bool skipped = false;
  double lossScale = 1.0;
  int recoveries = 0;  // failures and reshapes this call recovered from
  // The job moved back before this step: the step the job resumed at, below the step this
  // call started at (a rollback to a peer-RAM or durable version, docs/pipeline.md); -1: not.
  int64_t rolledBackTo = -1;
  int64_t nextStep = 0;  // the step the next call runs
  // The dataset indices this worker read samples of (inputs or targets) in the attempt of
  // `step` that committed, and each one's position in the step's global batch
  // (batchIndices(sampling, seed, step, ...)[position] == index), in the order read. A
  // data-parallel worker reads its share of the batch; in a pipeline the first stage reads the
  // inputs and the last the targets of the pipeline's microbatches (a stage several devices wide:
  // each device its part). Attempts that a failure ended are not included.
  std::vector<int64_t> samples;
  std::vector<int64_t> samplePositions;
};

// What one Trainer::evaluate() did.
struct EvalResult {
  bool done = false;  // nothing evaluated: this worker was released
  // Nothing evaluated: the job changed under the evaluation so that not every member could
  // evaluate the same parameters (a worker joined at its step boundary, and joiners train on;
  // or the job rolled back). Every member of the job abandons it alike; go on to the next step.
  bool abandoned = false;
  double loss = 0;  // the mean loss over the samples
  int64_t samples = 0;
  int64_t afterStep = -1;     // the parameters were those after this step (-1: initial ones)
  int recoveries = 0;         // failures it recovered from (and then evaluated again)
  int64_t rolledBackTo = -1;  // as StepResult::rolledBackTo
  // With keepOutputs: the model's outputs for samples [0, count), stacked along dimension 0 in
  // sample order, on the CPU, on every member; else undefined.
  at::Tensor outputs;
};

// The dataset indices of step `step`'s global batch: a pure function of (seed, step).
// Throws InvalidArgument unless datasetSize > 0 and globalBatch >= 0.
std::vector<int64_t> globalBatchIndices(uint64_t seed, int64_t step, int64_t globalBatch,
                                        int64_t datasetSize);

class Trainer {
 public:
  // REQUIRES: ctx outlives the trainer.
  Trainer(Context& ctx, ModelSpec spec, TrainerOptions options);
  ~Trainer();

  // Trains until options.steps steps are committed, or until this worker is preempted
  // (Context::preemptionRequested(), e.g. SIGTERM): then it leaves at the next step boundary,
  // after that step is applied, with result.preempted set; if it held the job's durable
  // checkpoints, that step is written first.
  // Throws Expelled if this worker was declared dead, Timeout if a recovery took longer than
  // recoveryTimeout. Durable checkpoints are written by a background thread while training
  // goes on: a write that fails (e.g. IoError from a failing disk) is logged on stderr and as a
  // "checkpoint_failed" event naming this worker, the step and the folder, and training
  // continues. Once training is over (the job was told this worker is done) run() rethrows the
  // newest such error if no newer version was written after it, so the caller learns that the
  // newest durable version is older than the last step; a failure that a later version made
  // good is only reported.
  TrainResult run();

  // The step API: the program owns the loop, Sinew owns the step. step() runs one step of the
  // global batch through the current plan, with whatever recoveries it takes, and returns the
  // step it committed; its first call joins the job (as run() does). finish() ends training
  // on this worker and returns what run() returns; run() is `while (!step().done) {}` and then
  // finish(). Errors are run()'s.
  //
  // After a failure the job resumes at its last committed step + 1, so the steps a loop sees
  // are increasing, except after a rollback or a restore (result.rolledBackTo >= 0), when
  // they start again from an earlier step: a loop that keys everything it does on
  // result.step (evaluation every N steps, logging, its own state) does exactly what its
  // first attempt did. A loop that stops before options.steps should call finish(): this
  // worker then leaves the job as a preempted one does, at a step boundary the coordinator
  // chooses, training until then.
  StepResult step();
  TrainResult finish();
  // The step the next step() runs (after a rollback, an earlier one).
  int64_t nextStep() const;
  // Evaluation: the mean loss over samples [0, count) of `samples` (a held-out split, the
  // same on every worker), forward only through the current plan: each global batch of
  // them runs as a training step's forward does (the same microbatches on the same workers
  // and pipelines; the layers in eval() mode, without autograd), and the loss is summed over
  // the job. Collective: every member calls it between the same two steps (key it on
  // StepResult::step). A failure during it is recovered from and the evaluation run again
  // with the members left; when the job has a member that did not train the step before it
  // (a worker that joined at that boundary) or rolled back, it is abandoned (EvalResult).
  // keepOutputs: also return the model's outputs (EvalResult::outputs; every sample's output
  // must have one shape). They are summed into place by one allreduce of count samples'
  // outputs, so every member receives them all.
  // Throws InvalidArgument unless count is a positive multiple of options.globalBatch.
  EvalResult evaluate(const Dataset& samples, int64_t count, bool keepOutputs = false);
  // The trained model out of the job: on the current epoch's first member (its lowest worker
  // id), a torch::nn::Sequential of every layer of the spec, built on the CPU as buildModel()
  // builds it, holding the job's parameters (each layer from one of its holders); on every
  // other member a Sequential without modules (size() == 0). Collective, like evaluate(): every
  // member calls it between the same two steps, before finish(). A failure during it is
  // recovered from and the gather run again (on the new epoch's first member).
  torch::nn::Sequential gatherModel();

  // The layers this worker holds: all of them in data parallel mode; in pipeline mode its
  // stage's, built when the first epoch's plan is known (empty before run()) and replaced
  // when a reconfiguration moves layers to or from this worker (docs/pipeline.md). Call
  // them before or after run(), not from another thread during it.
  torch::nn::Sequential& model();
  std::vector<at::Tensor> parameters() const;

 private:
  class Impl;

  std::unique_ptr<Impl> impl_;
};

}  // namespace sinew
