#include "sinew/trainer.h"

#include <ATen/ATen.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "sinew/base/error.h"
#include "sinew/base/mix.h"
#include "sinew/base/parse.h"
#include "sinew/collectives/cuda_device.h"
#include "sinew/collectives/gloo/kept_links.h"
#include "sinew/communicator.h"
#include "sinew/pipeline/plan.h"
#include "sinew/pipeline/profile.h"
#include "sinew/pipeline/stage_executor.h"
#include "sinew/runtime/context_state.h"
#include "sinew/runtime/device_choice.h"
#include "sinew/runtime/durable_checkpoints.h"
#include "sinew/runtime/epoch_communicators.h"
#include "sinew/runtime/epoch_entry.h"
#include "sinew/runtime/epoch_recovery.h"
#include "sinew/runtime/evaluation.h"
#include "sinew/runtime/event_log.h"
#include "sinew/runtime/job_tensors.h"
#include "sinew/runtime/layer_calls.h"
#include "sinew/runtime/layer_relayout.h"
#include "sinew/runtime/microbatches.h"
#include "sinew/runtime/mixed_precision.h"
#include "sinew/runtime/model_gather.h"
#include "sinew/runtime/optimizer_state.h"
#include "sinew/runtime/peer_versions.h"
#include "sinew/runtime/plan_report.h"
#include "sinew/runtime/profile_agreement.h"
#include "sinew/runtime/progress_reporter.h"
#include "sinew/runtime/resident_memory.h"
#include "sinew/runtime/step_update.h"
#include "sinew/runtime/tied_parameters.h"
#include "sinew/runtime/trainer_options.h"
#include "sinew/runtime/trainer_services.h"

namespace sinew {

using Clock = std::chrono::steady_clock;
using collectives::Store;
using runtime::CoordinatorClient;
using runtime::EpochChanged;
using runtime::EpochInfo;
using runtime::Phase;
using runtime::seconds;
using runtime::TrainingTraffic;
using runtime::WaitingOnOthers;

OptimizerFactory sgd(double lr, double momentum) {
  return [lr, momentum](std::vector<at::Tensor> params) {
    return std::make_unique<torch::optim::SGD>(std::move(params),
                                               torch::optim::SGDOptions(lr).momentum(momentum));
  };
}

OptimizerFactory adam(double lr) {
  return [lr](std::vector<at::Tensor> params) {
    return std::make_unique<torch::optim::Adam>(std::move(params), torch::optim::AdamOptions(lr));
  };
}

OptimizerFactory adamw(double lr, double weightDecay) {
  return [lr, weightDecay](std::vector<at::Tensor> params) {
    return std::make_unique<torch::optim::AdamW>(
        std::move(params), torch::optim::AdamWOptions(lr).weight_decay(weightDecay));
  };
}

OptimizerFactory rmsprop(double lr) {
  return [lr](std::vector<at::Tensor> params) {
    return std::make_unique<torch::optim::RMSprop>(std::move(params),
                                                   torch::optim::RMSpropOptions(lr));
  };
}

OptimizerFactory adagrad(double lr) {
  return [lr](std::vector<at::Tensor> params) {
    return std::make_unique<torch::optim::Adagrad>(std::move(params),
                                                   torch::optim::AdagradOptions(lr));
  };
}

std::vector<int64_t> globalBatchIndices(uint64_t seed, int64_t step, int64_t globalBatch,
                                        int64_t datasetSize) {
  if (datasetSize <= 0 || globalBatch < 0) {
    SINEW_THROW(InvalidArgument, "globalBatchIndices: datasetSize = ", datasetSize,
                " must be positive and globalBatch = ", globalBatch, " not negative");
  }
  std::vector<int64_t> out(globalBatch);
  uint64_t base =
      detail::splitmix64(seed ^ 0x5157A11ull) ^ detail::splitmix64(static_cast<uint64_t>(step));
  for (int64_t j = 0; j < globalBatch; ++j) {
    out[j] = static_cast<int64_t>(detail::splitmix64(base + static_cast<uint64_t>(j)) %
                                  static_cast<uint64_t>(datasetSize));
  }
  return out;
}

torch::nn::Sequential buildLayers(const ModelSpec& spec, uint64_t seed, at::ScalarType dtype,
                                  int first, int end) {
  if (spec.layers.empty()) SINEW_THROW(InvalidArgument, "ModelSpec::layers is empty");
  if (first < 0 || end <= first || end > static_cast<int>(spec.layers.size())) {
    SINEW_THROW(InvalidArgument, "buildLayers: layers [", first, ", ", end,
                ") are not a range of the model's ", spec.layers.size(), " layers");
  }
  for (int i = first; i < end; ++i) {
    if (!spec.layers[i].build) {
      SINEW_THROW(InvalidArgument, "ModelSpec::layers[", i, "] ('", spec.layers[i].name,
                  "') has no build factory");
    }
  }
  torch::nn::Sequential seq = runtime::buildUntiedLayers(spec, seed, dtype, first, end);
  runtime::copyOwnersIntoFollowers(spec, runtime::resolveTies(spec), seed, dtype, first, end, seq);
  return seq;
}

torch::nn::Sequential buildModel(const ModelSpec& spec, uint64_t seed, at::ScalarType dtype) {
  return buildLayers(spec, seed, dtype, 0, static_cast<int>(spec.layers.size()));
}

namespace {

// TrainerOptions::eventLog, else <SINEW_LOG_DIR>/worker-<id>-events.jsonl, else none ("").
std::string eventLogPath(const TrainerOptions& o, int worker) {
  if (!o.eventLog.empty()) return o.eventLog;
  const char* dir = std::getenv("SINEW_LOG_DIR");
  return dir ? std::string(dir) + "/worker-" + std::to_string(worker) + "-events.jsonl" : "";
}

}  // namespace

// The trainer of one worker: the epoch loop, the step and its vote, and recovery. What a step
// and an epoch change need besides is delegated: entering an epoch (runtime/epoch_entry.h),
// device and backend choice (runtime/device_choice.h), the 1F1B stage executor
// (pipeline/stage_executor.h), layer relayout (runtime/layer_relayout.h), optimizer state as named
// tensors (runtime/optimizer_state.h), peer-RAM versions (runtime/peer_versions.h), durable
// checkpoints (runtime/durable_checkpoints.h) and profile agreement
// (runtime/profile_agreement.h).
class Trainer::Impl {
 public:
  Impl(Context& ctx, ModelSpec spec, TrainerOptions o, torch::nn::Sequential model)
      : ctx_(ctx),
        state_(runtime::ContextAccess::state(ctx)),
        client_(*state_.client),
        spec_(std::move(spec)),
        o_(std::move(o)),
        services_{ctx_, state_, client_, events_, o_},
        scaling_(o_, jobTensors_) {
    ws_.model = std::move(model);
    runtime::checkTrainerOptions(o_, spec_);
    pipelineMode_ = o_.parallelism == Parallelism::kPipeline;
    device_ = runtime::resolveDevice(o_.device, ctx_.worker());
    if (pipelineMode_) {
      runtime::checkPipelineOptions(o_);
    } else {
      ws_.model->to(device_);
      ws_.params = ws_.model->parameters();
    }
    // In pipeline mode the optimizer is made once the stage's layers exist; this one only
    // checks what the factory makes.
    ws_.opt = spec_.optimizer(ws_.params);
    // Checkpoints, peer-RAM versions, layer copies and rollbacks all need its state as named
    // tensors: an optimizer whose state Sinew cannot capture is refused here, by name.
    runtime::optimizerStateCodec(*ws_.opt, "ModelSpec::optimizer");
    runtime::checkStepUpdateOptions(o_);
    runtime::checkMixedPrecisionOptions(o_, device_);
    for (const KeptState& k : o_.keptState) jobTensors_.add(runtime::keptStateEntry(k));
    ties_ = runtime::resolveTies(spec_);
    const std::string path = eventLogPath(o_, ctx_.worker());
    if (!path.empty()) events_.open(path, {{"worker", ctx_.worker()}});
    chooser_ = std::make_unique<runtime::BackendChooser>(services_, device_);
    comms_ = std::make_unique<runtime::EpochCommunicators>(services_, *chooser_);
    // The pipeline communicator's lanes carry a reconfiguration's layer copies, the first bulk
    // bytes on each epoch's new connections, which autotuned socket buffers carry at about 0.8
    // of a warm connection's speed (bench/RESULTS.md, "Sized lane buffers"): they ask for
    // 4 MiB unless SINEW_GLOO_LANE_SOCKET_BUFFER_BYTES says otherwise (a bad value is an
    // InvalidArgument here, before any training).
    if (pipelineMode_) pipelineGloo_ = collectives::GlooOptions::fromEnvironment(4 << 20);
    microbatches_ = {&spec_.dataset, o_.microbatch, o_.dtype, device_};
    progress_ = std::make_unique<runtime::ProgressReporter>(services_, pipelineMode_);
    durable_ = std::make_unique<runtime::DurableCheckpoints>(services_, pipelineMode_,
                                                             runtime::storedOnce(spec_, ties_));
    peers_ = std::make_unique<runtime::PeerVersions>(services_, *durable_,
                                                     pipelineMode_ && o_.peerCheckpointEvery > 0);
    relayout_ = std::make_unique<runtime::LayerRelayout>(services_, spec_, device_, *peers_);
    profiles_ = std::make_unique<runtime::ProfileAgreement>(services_, spec_, device_, [this] {
      return microbatches_(batchIndices(o_.sampling, o_.seed, 0, o_.globalBatch, spec_.datasetSize),
                           0);
    });
    entry_ = std::make_unique<runtime::EpochEntry>(runtime::EpochEntry::Units{
        services_, spec_, ties_, device_, pipelineMode_, pipelineGloo_, *comms_, *durable_, *peers_,
        *relayout_, *profiles_, *progress_, jobTensors_});
  }

  torch::nn::Sequential& model() { return ws_.model; }

  ~Impl() {
    client_.setEpochListener(nullptr);
    relayout_.reset();
    peers_.reset();    // Joins the engines' threads (their hooks use durable_).
    durable_.reset();  // Joins the snapshot copy and the flush threads.
  }

  TrainResult run() {
    while (!step().done) {
    }
    return finish();
  }

  // Runs `attempt` once and returns true, unless it throws a failure: then the worker recovers
  // into the job's next epoch and false is returned; also when this worker was released (then
  // preempted_ is set and nothing more runs).
  template <typename Attempt>
  bool recovering(Attempt&& attempt) {
    try {
      attempt();
      return true;
    } catch (const Released&) {
      preempted_ = true;
    } catch (const PeerLost& e) {
      client_.reportLost(ws_.epoch, e.worker());
      recoverInto(ws_.epoch, true, e.what());
    } catch (const Timeout& e) {
      recoverInto(ws_.epoch, true, e.what());
    } catch (const Aborted& e) {
      recoverInto(ws_.epoch, true, e.what());
    } catch (const IoError& e) {
      recoverInto(ws_.epoch, true, e.what());
    }
    return false;
  }

  // One committed step, with whatever recoveries it takes (see Trainer::step()).
  StepResult step() {
    if (finished_) SINEW_THROW(InvalidArgument, "Trainer::step() after finish()");
    if (!started_) start();
    StepResult r;
    const int64_t first = step_;
    const int recoveriesBefore = recoveries_;
    bool committed = false;
    while (!committed) {
      if (preempted_ || step_ >= o_.steps) {
        r.done = true;
        break;
      }
      if (!leaveSent_ && ctx_.preemptionRequested()) {
        client_.leave(step_);
        leaveSent_ = true;
        event({{"event", "preempted"}, {"step", step_}});
      }
      recovering([&] {
        const int64_t attempted = step_;
        const bool keepShape = runStep();
        committed = true;
        committedMembers_ = ws_.members;  // Before a reshape at this boundary changes them.
        r.step = attempted;
        r.loss = lastLoss_;
        r.learningRate = appliedLr_;
        r.gradNorm = scaling_.gradNorm();
        r.skipped = lastSkipped_;
        r.lossScale = scaling_.stepScale();
        samplesRead_.take(&r.samples, &r.samplePositions);
        if (!keepShape) recoverInto(ws_.epoch, /*failure=*/false, "reshape at a step boundary");
      });
      if (!committed && step_ < first) r.rolledBackTo = step_;
    }
    r.recoveries = recoveries_ - recoveriesBefore;
    r.nextStep = step_;
    return r;
  }

  // A forward-only pass over samples [0, count) of `data` (see Trainer::evaluate()).
  EvalResult evaluate(const Dataset& data, int64_t count, bool keepOutputs) {
    if (finished_) SINEW_THROW(InvalidArgument, "Trainer::evaluate() after finish()");
    if (!data || count <= 0 || count % o_.globalBatch != 0) {
      SINEW_THROW(InvalidArgument, "Trainer::evaluate: count = ", count,
                  " must be a positive multiple of TrainerOptions::globalBatch = ", o_.globalBatch,
                  data ? "" : ", and the dataset must be set");
    }
    if (!started_) start();
    EvalResult r;
    const int64_t first = step_;
    const int recoveriesBefore = recoveries_;
    // Those who trained the step before: each of them calls evaluate() here (the contract).
    const std::vector<int> evaluators = committedMembers_.empty() ? ws_.members : committedMembers_;
    while (!preempted_ && !r.abandoned && !recovering([&] {
      // A member that joined at this boundary trains the next step meanwhile, and after a
      // rollback the parameters are an older step's: every member sees the same epoch and
      // gives up alike, so the next collective is the next step's on every member.
      if (step_ != first || !std::includes(evaluators.begin(), evaluators.end(),
                                           ws_.members.begin(), ws_.members.end())) {
        r.abandoned = true;
        return;
      }
      rss_.phase("evaluation");
      std::vector<std::pair<int64_t, at::Tensor>> outputs;
      r.loss = evaluationLossSum(data, count, keepOutputs ? &outputs : nullptr) /
               static_cast<double>(count);
      if (keepOutputs) {
        r.outputs = runtime::combineEvaluationOutputs(outputs, count, comms_->world(), device_,
                                                      opTimeout(), waitingOnOthers());
      }
      r.samples = count;
      r.afterStep = step_ - 1;
    })) {
    }
    r.done = preempted_;
    r.recoveries = recoveries_ - recoveriesBefore;
    if (step_ < first) r.rolledBackTo = step_;
    return r;
  }

  // The whole model on the epoch's first member (see Trainer::gatherModel()).
  torch::nn::Sequential gatherModel() {
    if (finished_) SINEW_THROW(InvalidArgument, "Trainer::gatherModel() after finish()");
    if (!started_) start();
    torch::nn::Sequential whole;
    rss_.phase("gather");
    while (!preempted_ && !recovering([&] { whole = gatherOnce(); })) {
    }
    return whole;  // Without modules if this worker was released first.
  }

  // EpochChanged when the coordinator announced a newer epoch than this worker is in.
  void throwIfSuperseded() const {
    if (client_.latestEpoch().epoch != ws_.epoch) {
      SINEW_THROW(EpochChanged, "epoch ", ws_.epoch, " was superseded");
    }
  }

  // One attempt of gatherModel() in the current epoch.
  torch::nn::Sequential gatherOnce() {
    throwIfSuperseded();
    const int self = ctx_.worker();
    if (!pipelineMode_) {
      if (ws_.members.front() != self) return torch::nn::Sequential();
      return runtime::copyModel(spec_, o_.seed, o_.dtype, ws_.model);
    }
    runtime::GatherInputs in;
    in.spec = &spec_;
    in.seed = o_.seed;
    in.dtype = o_.dtype;
    in.plan = &ws_.plan;
    in.self = self;
    in.root = ws_.members.front();
    in.held = &ws_.model;
    in.heldFirst = ws_.heldFirst;
    in.comm = &comms_->world();
    in.device = device_;
    in.timeout = recoveryTimeout();
    WaitingOnOthers waiting(client_, step_, &stepWaited_);
    return runtime::gatherLayers(in);
  }

  // The sum over every sample of the loss, each global batch of `data` run as a training step
  // runs forward (the same microbatches on the same workers), summed over the epoch's members.
  double evaluationLossSum(const Dataset& data, int64_t count,
                           std::vector<std::pair<int64_t, at::Tensor>>* outputs) {
    throwIfSuperseded();
    runtime::EvaluationPass pass;
    pass.layers = &ws_.model;
    pass.executor = comms_->executor();
    pass.pipelineMode = pipelineMode_;
    if (!pipelineMode_) pass.microbatches = ws_.plan.of(ctx_.worker()).microbatches;
    pass.globalBatch = o_.globalBatch;
    pass.microbatch = o_.microbatch;
    pass.loss = spec_.loss;
    pass.device = device_;
    pass.computeDtype = o_.computeDtype;
    pass.data = [&](const std::vector<int64_t>& indices, int64_t m, int64_t begin, int64_t end) {
      return microbatches_(indices, m, begin, end, &data);
    };
    pass.aroundExchange = waitingOnOthers();
    pass.timeout = opTimeout();
    pass.outputs = outputs;
    at::Tensor sum =
        at::full({1}, runtime::localEvaluationLossSum(pass, count), onDevice(at::kDouble));
    {
      WaitingOnOthers waiting(client_, step_, &stepWaited_);
      comms_->world().allreduce(sum, collectives::ReduceOp::kSum, opTimeout());
    }
    return sum.item<double>();
  }

  // Ends training on this worker (see Trainer::finish()).
  TrainResult finish() {
    if (finished_) SINEW_THROW(InvalidArgument, "Trainer::finish() called twice");
    if (!started_) start();
    if (!preempted_ && step_ < o_.steps) {
      // The program stops before the last step: this worker leaves the job as a preempted one
      // does, at a step boundary the coordinator picks (it may run steps until then).
      ctx_.requestPreemption();
      while (!step().done) {
      }
    }
    finished_ = true;
    const bool preempted = preempted_;
    if (preempted) {
      state_.injector.fire(ctx_.worker(), step_, Phase::kRelease, &client_);
      // The last step this worker applied is the job's newest: make it durable if this
      // worker writes the checkpoints (when the whole job is preempted, it is the last word).
      // (Pipeline mode: a version needs every writer's shard, so one leaving worker cannot
      // write it alone.)
      if (!pipelineMode_ && ws_.applied >= 0) {
        const runtime::DurableCheckpoints::Role role = durableRole();
        if (durable_->reserve(ws_.applied, role, /*force=*/true, step_, &stepWaited_) != nullptr) {
          durable_->snapshotOwn(ws_.applied, role, shardState());
        }
      }
      durable_->finish();
      event({{"event", "released"}, {"step", step_}});
    } else {
      durable_->finish();
      client_.done(step_);
      // The training peak first: the lifetime peak read after it is at least as high.
      // Read in this order, each figure at least the one before (the high-water mark only
      // grows): the phases, the training peak, the lifetime peak.
      const std::map<std::string, int64_t> phases = rss_.byPhase();
      const int64_t trainingPeak = rss_.trainingPeak();
      nlohmann::json done = {{"event", "done"},
                             {"step", step_},
                             {"loss", lastLoss_},
                             {"peak_rss_bytes", std::max(rss_.lifetimePeak(), trainingPeak)},
                             {"training_peak_rss_bytes", trainingPeak}};
      if (o_.memoryByPhase) done["peak_rss_by_phase_bytes"] = phases;
      if (peers_->enabled()) {
        const runtime::PeerVersions::HostBytes held = peers_->hostBytes();
        done["peer_version_bytes"] = {{"own", held.own}, {"replicas", held.replicas}};
      }
      event(std::move(done));
      state_.injector.fire(ctx_.worker(), step_, Phase::kDone, &client_);
    }
    TrainResult r = result(preempted);
    comms_->close();
    // The newest version this worker wrote failed, and none after it was written: the job's
    // last durable state is not what it trained to.
    if (std::exception_ptr flushError = durable_->error()) std::rethrow_exception(flushError);
    return r;
  }

  int64_t nextStep() const { return step_; }

  // Joins the job: publishes this worker's device, restores the newest durable version if any,
  // and enters the first epoch.
  void start() {
    client_.setEpochListener([this](int64_t epoch) { comms_->abortBefore(epoch); });
    if (device_.is_cuda()) collectives::setCudaDevice(device_.index());
    // Which device this worker trains on and the backend it asks for, from which every
    // member of a communicator makes the same choice.
    chooser_->publish(*ctx_.store());
    int64_t resume = 0;
    if (durable_->enabled()) {
      durable_->checkDir();
      resume = durable_->newestRestorable(/*keep=*/!pipelineMode_) + 1;
    }
    runtime::JobShape shape;
    shape.globalBatch = o_.globalBatch;
    shape.microbatch = o_.microbatch;
    shape.steps = o_.steps;
    shape.checkpoints = durable_->enabled();
    client_.ready(resume, shape);
    started_ = true;
    try {
      recoverInto(-1, /*failure=*/false, "start");
    } catch (const Released&) {
      // Released before it trained: a joiner the job no longer needs (a resize, a drain, a
      // stop), or preempted while it started.
      preempted_ = true;
    }
    durable_->releaseKept();  // Only the first epoch's source restores from it.
    startStep_ = step_;
    // The memory of training, without the profile's (every layer of the model, built once).
    rss_.startTraining();
  }

 private:
  TrainResult result(bool preempted) const {
    TrainResult r;
    r.steps = step_;
    r.finalLoss = lastLoss_;
    r.recoveries = recoveries_;
    r.recoveryMaxSeconds = recoveryMax_;
    r.finalEpoch = ws_.epoch;
    r.finalMembers = ws_.members;
    r.startStep = startStep_;
    r.preempted = preempted;
    r.checkpointsWritten = durable_->written();
    r.checkpointsSkipped = durable_->skipped();
    r.checkpointStallSeconds = ckStall_;
    r.pipelines = static_cast<int>(ws_.plan.pipelines.size());
    if (const pipeline::WorkerAssignment* mine = ws_.plan.find(ctx_.worker())) {
      r.pipeline = mine->pipeline;
      r.stage = mine->stage;
    }
    for (const auto& child : ws_.model->named_children()) r.layers.push_back(child.key());
    for (const auto& p : ws_.model->parameters()) r.parameterCount += p.numel();
    r.device = device_.str();
    r.backend = chooser_->backend();
    r.lossScale = scaling_.nextScale();
    return r;
  }

  at::TensorOptions onDevice(at::ScalarType dtype) const {
    return at::TensorOptions().dtype(dtype).device(device_);
  }

  // This worker's parameters and optimizer state as named tensors, per layer.
  // Every layer also carries the job tensors (the loss scale, the kept state: JobTensors).
  std::function<checkpoint::ShardState()> shardState() {
    return [this] {
      checkpoint::ShardState state = runtime::captureState(ws_.model, *ws_.opt);
      jobTensors_.appendTo(state);
      return state;
    };
  }

  // One step; returns false when the coordinator reshapes the job right after it.
  bool runStep() {
    throwIfSuperseded();
    client_.setProgress(step_, /*waiting=*/false);
    stepStart_ = Clock::now();
    stepWaited_ = 0;
    stepLr_ = o_.lrSchedule ? runtime::scheduledRate(o_.lrSchedule, step_) : -1.0;
    samplesRead_.clear();
    rss_.phase("schedule");
    if (pipelineMode_) return runPipelineStep();
    const int self = ctx_.worker();
    auto& inj = state_.injector;
    inj.fire(self, step_, Phase::kForward, &client_);
    for (auto& p : ws_.params) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    const auto& mine = ws_.plan.of(self);
    auto indices = batchIndices(o_.sampling, o_.seed, step_, o_.globalBatch, spec_.datasetSize);
    double lossSum = 0;
    bool first = true;
    const double scale = static_cast<double>(o_.microbatch) / static_cast<double>(o_.globalBatch);
    const double lossScale = scaling_.begin();
    for (int64_t m : mine.microbatches) {
      samplesRead_.note(indices, m * o_.microbatch, (m + 1) * o_.microbatch);
      auto [x, y] = microbatches_(indices, m);
      at::Tensor loss;
      {
        runtime::AutocastScope autocast(device_, o_.computeDtype);
        loss = spec_.loss(
            runtime::runLayers(ws_.model, x).single("the model's output (its last layer's)"), y);
      }
      if (first) inj.fire(self, step_, Phase::kBackward, &client_);
      first = false;
      (loss * (scale * lossScale)).backward();
      lossSum += loss.item<double>() * static_cast<double>(o_.microbatch);
    }
    inj.emulateCompute(self, step_, static_cast<int64_t>(mine.microbatches.size()) * o_.microbatch);
    rss_.phase("reduce");
    // The gradients in buckets (one bucket's memory beside them), the loss sum in the last.
    at::Tensor lossTotal = at::full({1}, lossSum, onDevice(o_.dtype));
    inj.fire(self, step_, Phase::kReduce, &client_);
    {
      WaitingOnOthers waiting(client_, step_, &stepWaited_);
      inj.emulateCommunication(self, step_);
      runtime::reduceInBuckets(
          ws_.params, runtime::kGradientBucketBytes,
          [&](at::Tensor& t) {
            comms_->world().allreduce(t, collectives::ReduceOp::kSum, opTimeout());
          },
          lossTotal);
    }
    inj.fire(self, step_, Phase::kAfterReduce, &client_);
    double loss = lossTotal.item<double>() / static_cast<double>(o_.globalBatch);
    rss_.phase("clip");
    if (ties_.empty()) {
      scaling_.unscaleAndClip(ws_.params, runtime::squaredGradientNorm(ws_.params));
    } else {
      runtime::sumTiedGradients(ws_.model, ties_);
      scaling_.unscaleAndClip(ws_.params,
                              runtime::squaredNormCountingTiesOnce(ws_.model, 0, ties_));
    }
    return commitAndApply(loss);
  }

  // Votes for step_ and applies it once committed (everywhere or nowhere).
  bool commitAndApply(double loss) {
    const int self = ctx_.worker();
    auto& inj = state_.injector;
    CoordinatorClient::VoteResult verdict;
    {
      runtime::StepStats stats;
      stats.computeSeconds = seconds(Clock::now() - stepStart_) - stepWaited_;
      stats.stallSeconds = lastStall_;
      // Counted as reported once posted, even if the wait for the verdict then fails.
      stats.replicatedBytes = peers_->replicatedBytes() - replicatedReported_;
      replicatedReported_ += stats.replicatedBytes;
      stats.stateBytesIn = std::exchange(ws_.stateBytesIn, 0);
      WaitingOnOthers waiting(client_, step_, &stepWaited_);
      verdict = client_.vote(ws_.epoch, step_, opTimeout(), stats, recoveryTimeout());
    }
    if (verdict == CoordinatorClient::VoteResult::kSuperseded) {
      SINEW_THROW(EpochChanged, "step ", step_, " was not committed in epoch ", ws_.epoch);
    }
    inj.fire(self, step_, Phase::kOptimizer, &client_);
    rss_.phase("optimizer");
    lastStall_ = 0;
    {
      auto t0 = Clock::now();
      durable_->waitBeforeUpdate();
      peers_->waitBeforeUpdate(ws_.epoch);
      lastStall_ = seconds(Clock::now() - t0);
      ckStall_ += lastStall_;
    }
    if (stepLr_ >= 0) runtime::setLearningRate(*ws_.opt, stepLr_);
    appliedLr_ = runtime::learningRate(*ws_.opt);
    // After the verdict, so that a step redone in another epoch scales as its first attempt.
    lastSkipped_ = !scaling_.commit();
    try {
      jobTensors_.commit(step_);  // Before the optimizer steps: a save that throws changes nothing.
    } catch (...) {
      scaling_.undoCommit();
      throw;
    }
    if (lastSkipped_) {
      event({{"event", "step_skipped"},
             {"step", step_},
             {"loss_scale", scaling_.stepScale()},
             {"next_loss_scale", scaling_.nextScale()}});
    } else {
      ws_.opt->step();
    }
    ws_.applied = step_;
    rss_.phase("checkpoint");
    // A scheduler's checkpoint, drain or stop may ask for this step to be durable. When the
    // peer-RAM engine takes the step's version, its copy is flushed; otherwise this worker's
    // own.
    const auto state = shardState();
    const runtime::DurableCheckpoints::Role role = durableRole();
    checkpoint::VersionFlusher* durable = durable_->reserve(
        step_, role, /*force=*/client_.checkpointRequested(step_), step_, &stepWaited_);
    bool peerTook = false;
    try {
      peers_->maybeSnapshot(step_, ws_.epoch, ws_.plan, ws_.heldFirst, ws_.heldEnd, state, step_,
                            &stepWaited_, durable, role.flush, &peerTook);
    } catch (...) {
      // A store or engine error before the engine took the step: the durable version is still
      // written, from this worker's own copy.
      if (durable != nullptr && !peerTook) durable_->snapshotOwn(step_, role, state);
      throw;
    }
    if (durable != nullptr && !peerTook) durable_->snapshotOwn(step_, role, state);
    lastLoss_ = loss;
    ++step_;
    progress_->stepDone(step_, loss, ws_.epoch, ws_.members);
    return verdict == CoordinatorClient::VoteResult::kCommitted;
  }

  runtime::DurableCheckpoints::Role durableRole() const {
    return runtime::DurableCheckpoints::roleOf(ctx_.worker(), pipelineMode_, ws_.members, ws_.plan);
  }

  std::chrono::milliseconds opTimeout() const { return services_.opTimeout(); }

  std::chrono::milliseconds recoveryTimeout() const { return services_.recoveryTimeout(); }

  // Leaves epoch `from` (aborting its communicator) and enters the next one the coordinator
  // announces, retrying until one can be built (docs/architecture.md section 6, steps 2-3).
  void recoverInto(int64_t from, bool failure, const std::string& why) {
    rss_.phase("recovery");
    // What the Gloo communicators of the epoch entered took: links kept from the epoch
    // before (docs/collectives.md, "Repair") and connections made.
    collectives::gloo_backend::LinkCounters built;
    enterLaps_ = nlohmann::json::object();
    const double took = runtime::recoverIntoNextEpoch(
        services_, *comms_, from, failure, why, step_, [this, &built](const EpochInfo& info) {
          const auto before = collectives::gloo_backend::linkCounters();
          enterLaps_ = entry_->enter(info, ws_);
          step_ = info.resumeStep;
          const auto after = collectives::gloo_backend::linkCounters();
          built.linksKept = after.linksKept - before.linksKept;
          built.connectionsMade = after.connectionsMade - before.connectionsMade;
        });
    if (failure) {
      recoveries_++;
      recoveryMax_ = std::max(recoveryMax_, took);
    }
    event({{"event", failure ? "recovered" : "epoch_entered"},
           {"epoch", ws_.epoch},
           {"resume_step", step_},
           {"workers", ws_.members},
           {"duration_s", took},
           {"links_kept", built.linksKept},
           {"connections_made", built.connectionsMade},
           {"phases_s", enterLaps_},
           {"reason", why}});
  }

  // ---- Pipeline parallelism (docs/pipeline.md) --------------------------------------

  // Runs a transfer as waiting on the others.
  runtime::EpochCommunicators::Around waitingOnOthers() {
    return [this](const std::function<void()>& transfer) {
      WaitingOnOthers waiting(client_, step_, &stepWaited_);
      transfer();
    };
  }

  // Runs a transfer of the step as waiting on the others, with peer-RAM replication yielding.
  runtime::EpochCommunicators::Around trainingExchange() {
    return [this](const std::function<void()>& transfer) {
      WaitingOnOthers waiting(client_, step_, &stepWaited_);
      TrainingTraffic traffic(peers_->trafficGate(ws_.epoch));
      transfer();
    };
  }

  // One pipeline step: 1F1B over this pipeline's microbatches (pipeline/stage_executor.h),
  // then the per-layer-range gradient sums and the loss sum, then the vote.
  bool runPipelineStep() {
    const int self = ctx_.worker();
    auto& inj = state_.injector;
    inj.fire(self, step_, Phase::kForward, &client_);
    for (auto& p : ws_.params) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    double lossSum = 0;
    const double lossScale = scaling_.begin();  // Idle members too: they report the norm.
    if (pipeline::StageExecutor* executor = comms_->executor()) {
      auto t0 = Clock::now();
      const auto indices =
          batchIndices(o_.sampling, o_.seed, step_, o_.globalBatch, spec_.datasetSize);
      pipeline::StageStep step;
      step.forward = [this](const pipeline::Activation& x) {
        runtime::AutocastScope autocast(device_, o_.computeDtype);
        return runtime::runLayers(ws_.model, x);
      };
      step.loss = [this](const at::Tensor& y, const at::Tensor& t) {
        runtime::AutocastScope autocast(device_, o_.computeDtype);
        return spec_.loss(y, t);
      };
      step.lossScale = lossScale;
      step.data = [&](int64_t m, int64_t begin, int64_t end) {
        samplesRead_.note(indices, m * o_.microbatch + begin, m * o_.microbatch + end);
        return microbatches_(indices, m, begin, end);
      };
      step.aroundExchange = trainingExchange();
      step.beforeFirstBackward = [&] { inj.fire(self, step_, Phase::kBackward, &client_); };
      step.timeout = opTimeout();
      const pipeline::StageStepResult done = executor->run(step);
      lossSum = done.lossSum;
      progress_->addSchedule(seconds(Clock::now() - t0), done.waitSeconds);
    }
    inj.fire(self, step_, Phase::kReduce, &client_);
    rss_.phase("reduce");
    // The squares of the gradients of the layers this worker is the first holder of (so that
    // every layer counts once in the global norm, however many pipelines hold it).
    const double squares =
        comms_->reduceGradients(ws_.model, ws_.heldFirst, ties_, trainingExchange());
    // The loss and the squared gradient norm summed over every member in one allreduce.
    at::Tensor sums = at::tensor({lossSum, squares}, at::kDouble).to(device_);
    {
      WaitingOnOthers waiting(client_, step_, &stepWaited_);
      comms_->world().allreduce(sums, collectives::ReduceOp::kSum, opTimeout());
    }
    inj.fire(self, step_, Phase::kAfterReduce, &client_);
    const at::Tensor host = sums.cpu();
    rss_.phase("clip");
    scaling_.unscaleAndClip(ws_.params, host[1].item<double>());
    return commitAndApply(host[0].item<double>() / static_cast<double>(o_.globalBatch));
  }

  // Called by the training and the flush thread.
  void event(nlohmann::json e) { events_.write(std::move(e)); }

  Context& ctx_;
  runtime::ContextState& state_;  // ctx_'s; the Context outlives the trainer.
  CoordinatorClient& client_;
  ModelSpec spec_;
  TrainerOptions o_;
  runtime::EventLog events_;
  const runtime::TrainerServices services_;  // Refers to the members above.
  // Its layers and their optimizer, what they hold and the epoch it is in.
  runtime::WorkerState ws_;
  bool pipelineMode_ = false;
  std::vector<runtime::Tie> ties_;  // ModelSpec::tied, resolved
  runtime::ResidentMemory rss_{o_.memoryByPhase};
  runtime::MicrobatchReader microbatches_;
  at::Device device_{at::kCPU};  // Where this worker's layers live (TrainerOptions::device).
  // The units the trainer delegates to; destroyed in ~Impl in reverse dependency order.
  std::unique_ptr<runtime::BackendChooser> chooser_;
  collectives::GlooOptions pipelineGloo_;  // The pipeline communicator's (Gloo only).
  std::unique_ptr<runtime::DurableCheckpoints> durable_;
  std::unique_ptr<runtime::PeerVersions> peers_;
  std::unique_ptr<runtime::LayerRelayout> relayout_;
  std::unique_ptr<runtime::ProfileAgreement> profiles_;
  std::unique_ptr<runtime::ProgressReporter> progress_;
  // The epoch's communicators and this worker's stage executor (aborted by the client's io
  // thread when a newer epoch is announced).
  std::unique_ptr<runtime::EpochCommunicators> comms_;
  std::unique_ptr<runtime::EpochEntry> entry_;  // Uses the units above.
  // The members when the last step committed (before a reshape at its boundary), ascending.
  std::vector<int> committedMembers_;
  int64_t step_ = 0;
  double lastLoss_ = 0;
  // The loss scale and the program's kept state, carried in every version.
  runtime::JobTensors jobTensors_;
  runtime::GradientScaling scaling_;  // Registers with jobTensors_: declared after it.
  bool lastSkipped_ = false;          // the last committed step skipped its optimizer step
  runtime::SamplesRead samplesRead_;  // by the current attempt of step_
  double stepLr_ = -1;                // this step's scheduled rate; -1: no schedule
  double appliedLr_ = 0;  // the rate of the last step's optimizer step (its first group's)
  bool started_ = false;
  bool finished_ = false;
  bool preempted_ = false;  // released, or left: no more steps
  int recoveries_ = 0;
  double recoveryMax_ = 0;
  // Seconds of each part of the last pipeline epoch entered (the recovered and epoch_entered
  // events' phases_s; docs/pipeline.md, "Reconfiguration, step by step").
  nlohmann::json enterLaps_ = nlohmann::json::object();
  int64_t startStep_ = 0;
  bool leaveSent_ = false;
  double ckStall_ = 0;              // Optimizer steps waiting for snapshot copies.
  int64_t replicatedReported_ = 0;  // Peer-RAM replica bytes reported with the votes so far.
  // The step being run: when it started, how long it waited on the others, and the snapshot
  // stall before the previous step's optimizer step (reported with the vote).
  Clock::time_point stepStart_{};
  double stepWaited_ = 0;
  double lastStall_ = 0;
};

namespace {

// Pipeline mode builds a worker's layers once its stage is known; until then it holds none.
torch::nn::Sequential initialModel(const ModelSpec& spec, const TrainerOptions& o) {
  if (o.parallelism == Parallelism::kData) return buildModel(spec, o.seed, o.dtype);
  if (spec.layers.empty()) SINEW_THROW(InvalidArgument, "ModelSpec::layers is empty");
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    if (!spec.layers[i].build) {
      SINEW_THROW(InvalidArgument, "ModelSpec::layers[", i, "] ('", spec.layers[i].name,
                  "') has no build factory");
    }
  }
  return torch::nn::Sequential();
}

}  // namespace

Trainer::Trainer(Context& ctx, ModelSpec spec, TrainerOptions options) {
  torch::nn::Sequential model = initialModel(spec, options);
  impl_ = std::make_unique<Impl>(ctx, std::move(spec), std::move(options), std::move(model));
}

torch::nn::Sequential& Trainer::model() { return impl_->model(); }

std::vector<at::Tensor> Trainer::parameters() const { return impl_->model()->parameters(); }

Trainer::~Trainer() = default;

TrainResult Trainer::run() { return impl_->run(); }

StepResult Trainer::step() { return impl_->step(); }

TrainResult Trainer::finish() { return impl_->finish(); }

int64_t Trainer::nextStep() const { return impl_->nextStep(); }

torch::nn::Sequential Trainer::gatherModel() { return impl_->gatherModel(); }

EvalResult Trainer::evaluate(const Dataset& samples, int64_t count, bool keepOutputs) {
  return impl_->evaluate(samples, count, keepOutputs);
}

}  // namespace sinew
