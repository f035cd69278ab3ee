#include "sinew/trainer.h"

#include <ATen/ATen.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "sinew/checkpoint/detail/crc32c.h"
#include "sinew/checkpoint/engine.h"
#include "sinew/checkpoint/persist.h"
#include "sinew/checkpoint/snapshot.h"
#include "sinew/collectives/cuda_device.h"
#include "sinew/collectives/detail/parse.h"
#include "sinew/collectives/error.h"
#include "sinew/communicator.h"
#include "sinew/config.h"
#include "sinew/pipeline/plan.h"
#include "sinew/pipeline/profile.h"
#include "sinew/pipeline/profiler.h"
#include "sinew/pipeline/reconfiguration.h"
#include "sinew/runtime/context_state.h"
#include "sinew/runtime/event_log.h"

namespace sinew {

using Clock = std::chrono::steady_clock;
using collectives::Bytes;
using collectives::Store;
using pipeline::Plan;
using runtime::CoordinatorClient;
using runtime::EpochInfo;
using runtime::Phase;

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// The message of a caught exception, for logs (the exception itself is carried on).
std::string describe(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "unknown exception";
  }
}

// The current epoch was superseded: this worker must recover into the next one.
class EpochChanged : public Aborted {
 public:
  using Aborted::Aborted;
};

// A Store whose blocking calls give up (Aborted) as soon as `superseded` says the epoch
// they rendezvous for is over, so a communicator build waiting for a member that died
// returns within a slice instead of at its deadline.
class AbortableStore : public Store {
 public:
  AbortableStore(std::shared_ptr<Store> store, std::function<bool()> superseded)
      : store_(std::move(store)), superseded_(std::move(superseded)) {}

  void set(const std::string& key, const Bytes& value) override { store_->set(key, value); }
  Bytes get(const std::string& key, std::chrono::milliseconds timeout) override {
    wait({key}, timeout);
    return store_->get(key, std::chrono::milliseconds(1000));
  }
  int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) override {
    return store_->compareSet(key, expected, desired);
  }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    auto deadline = Clock::now() + timeout;
    while (true) {
      if (superseded_()) SINEW_THROW(EpochChanged, "epoch superseded during rendezvous");
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      try {
        store_->wait(keys, std::max(std::chrono::milliseconds(1), std::min(left, kSlice)));
        return;
      } catch (const Timeout&) {
        if (Clock::now() >= deadline) throw;
      }
    }
  }
  bool check(const std::vector<std::string>& keys) override { return store_->check(keys); }
  bool deleteKey(const std::string& key) override { return store_->deleteKey(key); }
  using Store::get;
  using Store::wait;

 private:
  static constexpr std::chrono::milliseconds kSlice{50};
  std::shared_ptr<Store> store_;
  std::function<bool()> superseded_;
};

// An optimizer's per-parameter state is keyed by the parameter's TensorImpl: its address as
// text in libtorch 1.x, the address itself (void*) in 2.x.
template <typename StateMap>
typename StateMap::key_type stateKey(const StateMap&, const at::Tensor& p) {
  using Key = typename StateMap::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream os;
    os << static_cast<const void*>(p.unsafeGetTensorImpl());
    return os.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

// Every parameter's gradient (zeros where it has none) in one flat tensor, then `tail`: one
// allreduce sums them all.
// Seconds as "42s", "3m05s" or "2h07m" for progress lines.
std::string formatEta(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (s < 60) {
    std::snprintf(buf, sizeof(buf), "%llds", static_cast<long long>(s));
  } else if (s < 3600) {
    std::snprintf(buf, sizeof(buf), "%lldm%02llds", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60));
  }
  return buf;
}

// While alive, this worker's heartbeats say it waits on the others for `step` (in a collective,
// or for its vote's verdict) rather than computing (docs/failure_semantics.md, rule 1). The
// time waited is added to *waited, so that a step's compute time excludes it.
class WaitingOnOthers {
 public:
  WaitingOnOthers(CoordinatorClient& client, int64_t step, double* waited)
      : client_(client), step_(step), waited_(waited), since_(std::chrono::steady_clock::now()) {
    client_.setProgress(step_, true);
  }
  ~WaitingOnOthers() {
    client_.setProgress(step_, false);
    *waited_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - since_).count();
  }
  WaitingOnOthers(const WaitingOnOthers&) = delete;
  WaitingOnOthers& operator=(const WaitingOnOthers&) = delete;

 private:
  CoordinatorClient& client_;
  const int64_t step_;
  double* const waited_;
  const std::chrono::steady_clock::time_point since_;
};

// While alive, a training transfer is in flight: peer-RAM replication yields to it between
// chunks (checkpoint::TrafficGate). A null gate does nothing.
class TrainingTraffic {
 public:
  explicit TrainingTraffic(checkpoint::TrafficGate* gate) : gate_(gate) {
    if (gate_) gate_->enter();
  }
  ~TrainingTraffic() {
    if (gate_) gate_->exit();
  }
  TrainingTraffic(const TrainingTraffic&) = delete;
  TrainingTraffic& operator=(const TrainingTraffic&) = delete;

 private:
  checkpoint::TrafficGate* const gate_;
};

// The local rank the launcher gives this process (its index among the workers of its
// machine), or -1 if none says.
int localRankFromEnv() {
  for (const char* name : {"SINEW_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID",
                           "MPI_LOCALRANKID", "LOCAL_RANK"}) {
    const char* v = std::getenv(name);
    if (v == nullptr || *v == 0) continue;
    char* end = nullptr;
    long r = std::strtol(v, &end, 10);
    if (*end == 0 && r >= 0 && r < (1 << 20)) return static_cast<int>(r);
  }
  return -1;
}

at::Tensor flatGradients(const std::vector<at::Tensor>& params, const at::Tensor& tail = {}) {
  std::vector<at::Tensor> parts;
  for (const auto& p : params) {
    parts.push_back(p.grad().defined() ? p.grad().reshape(-1)
                                       : at::zeros({p.numel()}, p.options()));
  }
  if (tail.defined()) parts.push_back(tail);
  return at::cat(parts);
}

// Copies flatGradients()'s layout back into the gradients; returns the elements it used.
int64_t setGradients(const std::vector<at::Tensor>& params, const at::Tensor& flat) {
  int64_t offset = 0;
  for (const auto& p : params) {
    at::Tensor g = flat.narrow(0, offset, p.numel()).view(p.sizes());
    if (p.grad().defined()) {
      p.mutable_grad().copy_(g);
    } else {
      p.mutable_grad() = g.clone();
    }
    offset += p.numel();
  }
  return offset;
}

}  // namespace

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

std::vector<int64_t> globalBatchIndices(uint64_t seed, int64_t step, int64_t globalBatch,
                                        int64_t datasetSize) {
  if (datasetSize <= 0 || globalBatch < 0) {
    SINEW_THROW(InvalidArgument, "globalBatchIndices: datasetSize = ", datasetSize,
                " must be positive and globalBatch = ", globalBatch, " not negative");
  }
  std::vector<int64_t> out(globalBatch);
  uint64_t base = splitmix64(seed ^ 0x5157A11ull) ^ splitmix64(static_cast<uint64_t>(step));
  for (int64_t j = 0; j < globalBatch; ++j) {
    out[j] = static_cast<int64_t>(splitmix64(base + static_cast<uint64_t>(j)) %
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
  torch::nn::Sequential seq;
  for (int i = first; i < end; ++i) {
    const auto& l = spec.layers[i];
    if (!l.build) {
      SINEW_THROW(InvalidArgument, "ModelSpec::layers[", i, "] ('", l.name,
                  "') has no build factory");
    }
    // Each layer from its own seed: the same parameters whichever layers a worker builds.
    at::manual_seed(splitmix64(seed ^ splitmix64(0x1A7E5u + static_cast<uint64_t>(i))));
    seq->push_back(l.name, l.build());
  }
  seq->to(dtype);
  return seq;
}

torch::nn::Sequential buildModel(const ModelSpec& spec, uint64_t seed, at::ScalarType dtype) {
  return buildLayers(spec, seed, dtype, 0, static_cast<int>(spec.layers.size()));
}

class Trainer::Impl {
 public:
  Impl(Context& ctx, ModelSpec spec, TrainerOptions o, torch::nn::Sequential model)
      : ctx_(ctx),
        state_(runtime::ContextAccess::state(ctx)),
        client_(*state_.client),
        spec_(std::move(spec)),
        o_(std::move(o)),
        model_(std::move(model)) {
    if (o_.globalBatch <= 0 || o_.microbatch <= 0 || o_.globalBatch % o_.microbatch != 0) {
      SINEW_THROW(InvalidArgument, "TrainerOptions::microbatch = ", o_.microbatch,
                  " must be positive and divide globalBatch = ", o_.globalBatch);
    }
    if (!spec_.loss || !spec_.optimizer || !spec_.dataset) {
      SINEW_THROW(InvalidArgument, "ModelSpec needs a loss, an optimizer and a dataset; missing:",
                  spec_.loss ? "" : " loss", spec_.optimizer ? "" : " optimizer",
                  spec_.dataset ? "" : " dataset");
    }
    if (spec_.datasetSize <= 0) {
      SINEW_THROW(InvalidArgument, "ModelSpec::datasetSize = ", spec_.datasetSize,
                  " must be positive");
    }
    pipelineMode_ = o_.parallelism == Parallelism::kPipeline;
    device_ = resolveDevice();
    if (pipelineMode_) {
      if (o_.faultTolerance < 0) {
        SINEW_THROW(InvalidArgument, "TrainerOptions::faultTolerance = ", o_.faultTolerance,
                    " must be >= 0");
      }
      if (o_.deviceMemoryBytes < 0) {
        SINEW_THROW(InvalidArgument, "TrainerOptions::deviceMemoryBytes = ", o_.deviceMemoryBytes,
                    " must be >= 0 (0: unlimited)");
      }
      if (o_.devicesPerNode < 1 || o_.devicesPerNode > 4096) {
        SINEW_THROW(InvalidArgument, "TrainerOptions::devicesPerNode = ", o_.devicesPerNode,
                    " must be in [1, 4096]");
      }
      if (o_.maxWorkers < 0 || o_.maxWorkers > (1 << 20)) {
        SINEW_THROW(InvalidArgument, "TrainerOptions::maxWorkers = ", o_.maxWorkers,
                    " must be in [0, 2^20] (0: SINEW_MAX_WORKERS, else twice the start)");
      }
      if (o_.laneSocketBufferBytes < 0 ||
          o_.laneSocketBufferBytes > collectives::kMaxLaneSocketBufferBytes) {
        SINEW_THROW(InvalidArgument,
                    "TrainerOptions::laneSocketBufferBytes = ", o_.laneSocketBufferBytes,
                    " must be in [0, 2^30] (0: the kernel's autotuning)");
      }
      if (o_.peerCheckpointEvery < 0 || o_.replicas < 1) {
        SINEW_THROW(InvalidArgument,
                    "TrainerOptions::peerCheckpointEvery = ", o_.peerCheckpointEvery,
                    " must be >= 0 and replicas = ", o_.replicas, " >= 1");
      }
      if (!o_.profilePath.empty()) {
        profile_ = pipeline::loadProfile(o_.profilePath);
        checkProfile("TrainerOptions::profilePath = '" + o_.profilePath + "'");
      } else if (o_.devicesPerNode > o_.microbatch) {
        SINEW_THROW(InvalidArgument, "TrainerOptions::devicesPerNode = ", o_.devicesPerNode,
                    " is more than microbatch = ", o_.microbatch,
                    ": a stage as wide as a node could not give every worker a sample");
      }
    } else {
      model_->to(device_);
      params_ = model_->parameters();
    }
    // In pipeline mode the optimizer is made once the stage's layers exist (makeOptimizer);
    // this one only checks what the factory makes.
    opt_ = spec_.optimizer(params_);
    if (peerCheckpoints() && dynamic_cast<torch::optim::Adam*>(opt_.get()) == nullptr &&
        dynamic_cast<torch::optim::SGD*>(opt_.get()) == nullptr) {
      // Versions hold SGD's and Adam's state only: without them a loss of every live copy of
      // a layer can only restart from the durable checkpoint or the start.
      std::fprintf(stderr,
                   "sinew: worker %d: peer-RAM versions are off (TrainerOptions::"
                   "peerCheckpointEvery): ModelSpec::optimizer made neither SGD nor Adam\n",
                   ctx_.worker());
      o_.peerCheckpointEvery = 0;
    }
    if (!o_.checkpointDir.empty()) {
      if (dynamic_cast<torch::optim::Adam*>(opt_.get()) == nullptr &&
          dynamic_cast<torch::optim::SGD*>(opt_.get()) == nullptr) {
        SINEW_THROW(InvalidArgument, "TrainerOptions::checkpointDir = '", o_.checkpointDir,
                    "' needs ModelSpec::optimizer to make SGD or Adam (whose state checkpoints "
                    "support); it made another optimizer");
      }
      if (o_.checkpointEvery < 0 || o_.checkpointKeep < 1) {
        SINEW_THROW(InvalidArgument, "TrainerOptions::checkpointEvery = ", o_.checkpointEvery,
                    " must be >= 0 and checkpointKeep = ", o_.checkpointKeep, " >= 1");
      }
    }
    std::string path = o_.eventLog;
    if (path.empty()) {
      if (const char* dir = std::getenv("SINEW_LOG_DIR")) {
        path = std::string(dir) + "/worker-" + std::to_string(ctx_.worker()) + "-events.jsonl";
      }
    }
    if (!path.empty()) events_.open(path, {{"worker", ctx_.worker()}});
  }

  torch::nn::Sequential& model() { return model_; }

  ~Impl() {
    client_.setEpochListener(nullptr);
    gens_.clear();   // Joins their threads (the replication hook uses the injector).
    stopRetiring();  // Likewise for the engines being destroyed in the background.
    arena_.reset();  // Joins the copy thread, whose completion callback uses ckMu_.
    stopFlushThread();
  }

  TrainResult run() {
    client_.setEpochListener([this](int64_t epoch) {
      std::lock_guard<std::mutex> lock(commMu_);
      if (comm_ && (epoch < 0 || epoch > comm_->epoch())) {
        comm_->abort();
        for (auto& g : groups_) {
          if (g.comm) g.comm->abort();
        }
      }
    });
    if (device_.is_cuda()) collectives::setCudaDevice(device_.index());
    // Which device this worker trains on and the backend it asks for, from which every
    // member of a communicator makes the same choice (makeCommunicator).
    const char* asks = o_.backend == CommBackend::kGloo   ? "gloo"
                       : o_.backend == CommBackend::kNccl ? "nccl"
                                                          : "auto";
    const std::string where =
        device_.is_cuda() ? collectives::cudaDeviceUuid(device_.index()) : std::string("cpu");
    ctx_.store()->set(deviceKey(ctx_.worker()), collectives::toBytes(where + " " + asks));
    int64_t resume = 0;
    if (!o_.checkpointDir.empty()) {
      checkCheckpointDir();
      resume = newestRestorable() + 1;
    }
    runtime::JobShape shape;
    shape.globalBatch = o_.globalBatch;
    shape.microbatch = o_.microbatch;
    shape.steps = o_.steps;
    shape.checkpoints = !o_.checkpointDir.empty();
    client_.ready(resume, shape);
    bool preempted = false;
    try {
      recoverInto(-1, /*failure=*/false, "start");
    } catch (const Released&) {
      // Released before it trained: a joiner the job no longer needs (a resize, a drain, a
      // stop), or preempted while it started.
      preempted = true;
    }
    validated_.clear();  // Only the first epoch's source restores from it.
    validatedStep_ = -1;
    startStep_ = step_;
    while (!preempted && step_ < o_.steps) {
      if (!leaveSent_ && ctx_.preemptionRequested()) {
        client_.leave(step_);
        leaveSent_ = true;
        event({{"event", "preempted"}, {"step", step_}});
      }
      try {
        if (!runStep()) recoverInto(epoch_, /*failure=*/false, "reshape at a step boundary");
      } catch (const Released&) {
        preempted = true;
        break;
      } catch (const PeerLost& e) {
        client_.reportLost(epoch_, e.worker());
        recoverInto(epoch_, true, e.what());
      } catch (const Timeout& e) {
        recoverInto(epoch_, true, e.what());
      } catch (const Aborted& e) {
        recoverInto(epoch_, true, e.what());
      } catch (const IoError& e) {
        recoverInto(epoch_, true, e.what());
      }
    }
    if (preempted) {
      // The last step this worker applied is the job's newest: make it durable if this
      // worker writes the checkpoints (when the whole job is preempted, it is the last word).
      // (Pipeline mode: a version needs every writer's shard, so one leaving worker cannot
      // write it alone.)
      if (!pipelineMode_ && applied_ >= 0 && !members_.empty() &&
          members_.front() == ctx_.worker()) {
        maybeCheckpoint(applied_, /*force=*/true);
      }
      finishCheckpoints();
      event({{"event", "released"}, {"step", step_}});
    } else {
      finishCheckpoints();
      client_.done(step_);
      event({{"event", "done"}, {"step", step_}, {"loss", lastLoss_}});
    }
    TrainResult r;
    r.steps = step_;
    r.finalLoss = lastLoss_;
    r.recoveries = recoveries_;
    r.recoveryMaxSeconds = recoveryMax_;
    r.finalEpoch = epoch_;
    r.finalMembers = members_;
    r.startStep = startStep_;
    r.preempted = preempted;
    {
      std::lock_guard<std::mutex> lock(ckMu_);
      r.checkpointsWritten = ckWritten_;
      r.checkpointsSkipped = ckSkipped_;
    }
    r.checkpointStallSeconds = ckStall_;
    r.pipelines = static_cast<int>(plan_.pipelines.size());
    for (const auto& w : plan_.workers) {
      if (w.worker != ctx_.worker()) continue;
      r.pipeline = w.pipeline;
      r.stage = w.stage;
    }
    for (const auto& child : model_->named_children()) r.layers.push_back(child.key());
    for (const auto& p : model_->parameters()) r.parameterCount += p.numel();
    r.device = device_.str();
    r.backend = backend_;
    {
      std::lock_guard<std::mutex> lock(commMu_);
      comm_.reset();  // Healthy: its peers are told it closed, not that it aborted.
      groups_.clear();
    }
    std::exception_ptr flushError;
    {
      std::lock_guard<std::mutex> lock(ckMu_);
      flushError = flushError_;
    }
    // The newest version this worker wrote failed, and none after it was written: the job's
    // last durable state is not what it trained to.
    if (flushError) std::rethrow_exception(flushError);
    return r;
  }

 private:
  // Floating-point inputs and targets train in o_.dtype; integer ones (token ids, labels)
  // stay as they are.
  at::Tensor toTraining(const at::Tensor& t) const {
    return at::isFloatingType(t.scalar_type()) ? t.to(o_.dtype) : t;
  }

  at::TensorOptions onDevice(at::ScalarType dtype) const {
    return at::TensorOptions().dtype(dtype).device(device_);
  }

  // TrainerOptions::device as a device this process can use (docs/gpu.md).
  at::Device resolveDevice() const {
    const std::string& d = o_.device;
    auto bad = [&](const std::string& why) {
      SINEW_THROW(InvalidArgument, "TrainerOptions::device = '", d, "' on worker ", ctx_.worker(),
                  ": ", why);
    };
    if (d == "cpu") return at::Device(at::kCPU);
    int index = -1;
    if (d != "cuda") {
      const std::string digits = d.rfind("cuda:", 0) == 0 ? d.substr(5) : std::string();
      if (digits.empty() || digits.size() > 6 ||
          digits.find_first_not_of("0123456789") != std::string::npos) {
        bad("expected cpu, cuda or cuda:N");
      }
      index = std::stoi(digits);
    }
    if (!SINEW_WITH_NCCL) {
      bad("this Sinew was built without the CUDA toolkit (SINEW_WITH_NCCL=OFF)");
    }
    if (!at::hasCUDA()) bad("this libtorch has no CUDA (at::hasCUDA() is false)");
    const int count = collectives::cudaDeviceCount();
    if (count == 0) {
      const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
      bad(std::string("this process sees no GPU (CUDA_VISIBLE_DEVICES=") +
          (visible ? visible : "unset") + ")");
    }
    if (index < 0) {
      const int local = localRankFromEnv();
      index = (local >= 0 ? local : std::max(ctx_.worker(), 0)) % count;
    }
    if (index >= count) bad("this process sees only " + std::to_string(count) + " GPUs");
    return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
  }

  static std::string deviceKey(int worker) { return "sinew/device/w" + std::to_string(worker); }

  // Whether the workers `members` use one NCCL communicator: each is on a GPU of its own
  // (NCCL refuses two ranks of one communicator on the same GPU) and none asks for Gloo
  // (TrainerOptions::backend). Decided from what every member published, so that all decide
  // alike. *why says why (not).
  bool ncclChosen(Store& store, const std::vector<int>& members, std::string* why) {
    if (!SINEW_WITH_NCCL) {
      *why = "Sinew was built without NCCL";
      return false;
    }
    std::map<std::string, int> owner;
    for (int w : members) {
      const std::string published = collectives::toString(store.get(deviceKey(w), opTimeout()));
      const size_t space = published.find(' ');
      const std::string id = published.substr(0, space);
      const std::string asks = space == std::string::npos ? "auto" : published.substr(space + 1);
      if (asks == "gloo") {
        *why = "worker " + std::to_string(w) + " asks for Gloo (TrainerOptions::backend)";
        return false;
      }
      if (id == "cpu") {
        *why = "worker " + std::to_string(w) + " trains on the CPU";
        return false;
      }
      auto [it, fresh] = owner.emplace(id, w);
      if (!fresh) {
        *why = "workers " + std::to_string(it->second) + " and " + std::to_string(w) +
               " share GPU " + id + ", and NCCL needs a GPU per worker";
        return false;
      }
    }
    *why = "every worker has a GPU of its own";
    return true;
  }

  // The communicator of `co.members` (TrainerOptions::backend): NCCL, or Gloo (through host
  // memory for CUDA tensors). Every member decides alike, from the same published devices.
  std::unique_ptr<collectives::Communicator> makeCommunicator(const std::shared_ptr<Store>& store,
                                                              collectives::CommunicatorOptions co) {
    std::string why = "this worker trains on the CPU";
    // A CPU worker needs no one else's word: NCCL needs every member on a GPU.
    const bool nccl = device_.is_cuda() && ncclChosen(*store, co.members, &why);
    if (o_.backend == CommBackend::kNccl && !nccl) {
      SINEW_THROW(InvalidArgument, "TrainerOptions::backend is kNccl, but communicator '", co.name,
                  "' of epoch ", co.epoch, " cannot use NCCL: ", why);
    }
    const std::string backend = nccl ? "nccl" : "gloo";
    // CPU jobs with the default backend say nothing new (their output is as before).
    const bool report = device_.is_cuda() || o_.backend != CommBackend::kAuto;
    if (co.name == "dp" || co.name == "pp") {
      if (report && (backend != backend_ || why != backendWhy_)) {
        event({{"event", "backend"}, {"epoch", co.epoch}, {"backend", backend}, {"reason", why}});
        if (co.members.front() == ctx_.worker()) {
          std::printf("sinew: epoch %lld transfers over %s%s (%s)\n",
                      static_cast<long long>(co.epoch), backend.c_str(),
                      !nccl && device_.is_cuda() ? " through host memory" : "", why.c_str());
          std::fflush(stdout);
        }
      }
      backend_ = backend;
      backendWhy_ = why;
    }
    if (nccl) {
      co.device = device_.index();
      return collectives::createNcclCommunicator(store, co);
    }
    return device_.is_cuda() ? collectives::createHostStagedCommunicator(store, co)
                             : collectives::createGlooCommunicator(store, co);
  }

  // The inputs and targets of global microbatch m of the step whose batch is `indices`, or of
  // its samples [begin, end) (a slice for one worker of a wide stage).
  std::pair<at::Tensor, at::Tensor> microbatchData(const std::vector<int64_t>& indices, int64_t m,
                                                   int64_t begin = 0, int64_t end = -1) const {
    if (end < 0) end = o_.microbatch;
    std::vector<at::Tensor> xs, ys;
    for (int64_t j = m * o_.microbatch + begin; j < m * o_.microbatch + end; ++j) {
      Sample s = spec_.dataset(indices[j]);
      xs.push_back(s.input);
      ys.push_back(s.target);
    }
    return {toTraining(at::stack(xs)).to(device_), toTraining(at::stack(ys)).to(device_)};
  }

  // One step; returns false when the coordinator reshapes the job right after it.
  bool runStep() {
    if (client_.latestEpoch().epoch != epoch_) {
      SINEW_THROW(EpochChanged, "epoch ", epoch_, " was superseded");
    }
    client_.setProgress(step_, /*waiting=*/false);
    stepStart_ = Clock::now();
    stepWaited_ = 0;
    if (pipelineMode_) return runPipelineStep();
    const int self = ctx_.worker();
    auto& inj = state_.injector;
    inj.fire(self, step_, Phase::kForward, &client_);
    for (auto& p : params_) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    const auto& mine = plan_.of(self);
    auto indices = globalBatchIndices(o_.seed, step_, o_.globalBatch, spec_.datasetSize);
    double lossSum = 0;
    bool first = true;
    const double scale = static_cast<double>(o_.microbatch) / static_cast<double>(o_.globalBatch);
    for (int64_t m : mine.microbatches) {
      auto [x, y] = microbatchData(indices, m);
      at::Tensor loss = spec_.loss(model_->forward(x), y);
      if (first) inj.fire(self, step_, Phase::kBackward, &client_);
      first = false;
      (loss * scale).backward();
      lossSum += loss.item<double>() * static_cast<double>(o_.microbatch);
    }
    // One flat buffer: every gradient, then the loss sum.
    at::Tensor flat = flatGradients(params_, at::full({1}, lossSum, onDevice(o_.dtype)));
    inj.fire(self, step_, Phase::kReduce, &client_);
    {
      WaitingOnOthers waiting(client_, step_, &stepWaited_);
      comm_->allreduce(flat, collectives::ReduceOp::kSum, opTimeout());
    }
    inj.fire(self, step_, Phase::kAfterReduce, &client_);
    const int64_t offset = setGradients(params_, flat);
    double loss = flat[offset].item<double>() / static_cast<double>(o_.globalBatch);
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
      WaitingOnOthers waiting(client_, step_, &stepWaited_);
      verdict = client_.vote(epoch_, step_, opTimeout(), stats);
    }
    if (verdict == CoordinatorClient::VoteResult::kSuperseded) {
      SINEW_THROW(EpochChanged, "step ", step_, " was not committed in epoch ", epoch_);
    }
    inj.fire(self, step_, Phase::kOptimizer, &client_);
    lastStall_ = 0;
    {
      auto t0 = Clock::now();
      if (arena_) waitForSnapshot();
      if (!gens_.empty() && gens_.back().epoch == epoch_) gens_.back().engine->waitBeforeUpdate();
      lastStall_ = seconds(Clock::now() - t0);
      ckStall_ += lastStall_;
    }
    opt_->step();
    applied_ = step_;
    // A scheduler's checkpoint, drain or stop asked for this step to be durable.
    maybeCheckpoint(step_, /*force=*/client_.checkpointRequested(step_), /*peerFollows=*/true);
    bool peerTook = false;
    try {
      peerTook = maybePeerSnapshot(step_);
    } catch (...) {
      // A store or engine error before (or after) the engine took the step: the durable
      // version is still written, from this worker's own copy unless the engine's has already
      // been handed to the flush.
      settleSharedSnapshot(step_, /*taken=*/false);
      throw;
    }
    settleSharedSnapshot(step_, peerTook);
    lastLoss_ = loss;
    ++step_;
    progress(loss);
    return verdict == CoordinatorClient::VoteResult::kCommitted;
  }

  void progress(double loss) {
    stepsSinceReport_++;
    if (o_.progressEvery <= 0 || step_ % o_.progressEvery != 0) return;
    auto now = Clock::now();
    double elapsed = seconds(now - lastReport_);
    double rate = elapsed > 0 ? stepsSinceReport_ * o_.globalBatch / elapsed : 0;
    // The time left at this rate (ETA), in seconds.
    const double eta = rate > 0 ? static_cast<double>(o_.steps - step_) *
                                      static_cast<double>(o_.globalBatch) / rate
                                : 0;
    nlohmann::json e = {{"event", "progress"},   {"step", step_},   {"loss", loss},
                        {"samples_per_s", rate}, {"epoch", epoch_}, {"workers", members_.size()},
                        {"eta_s", eta}};
    if (pipelineMode_) {
      // This stage's mean 1F1B time per step since the last report (forward, backward and
      // the transfers, without the gradient sums and the vote).
      e["schedule_s"] = scheduleSeconds_ / static_cast<double>(stepsSinceReport_);
      // Of which this stage waited in its sends and receives (the neighbours' compute, the
      // transfers and their rendezvous).
      e["schedule_wait_s"] = scheduleWaitSeconds_ / static_cast<double>(stepsSinceReport_);
      scheduleSeconds_ = 0;
      scheduleWaitSeconds_ = 0;
    }
    lastReport_ = now;
    stepsSinceReport_ = 0;
    event(std::move(e));
    if (!members_.empty() && members_.front() == ctx_.worker()) {
      std::printf("sinew: step %lld loss %.6g samples/s %.0f epoch %lld workers %zu eta %s\n",
                  static_cast<long long>(step_), loss, rate, static_cast<long long>(epoch_),
                  members_.size(), formatEta(eta).c_str());
      std::fflush(stdout);
    }
  }

  // The deadline hierarchy (docs/failure_semantics.md, rule 12): the coordinator's step
  // deadline, derived from the measured step time, is the first to expire, so that it, not a
  // timeout in some collective, decides who is stuck; an operation's deadline is at least
  // twice it and a recovery's four times (each at least its TrainerOptions value); the job's
  // is the launcher's (--deadline-s).
  std::chrono::milliseconds opTimeout() const {
    return std::max(o_.opTimeout, 2 * client_.stepDeadline());
  }
  std::chrono::milliseconds recoveryTimeout() const {
    return std::max(o_.recoveryTimeout, 4 * client_.stepDeadline());
  }

  // Aborts and destroys the communicator of an epoch being left.
  void dropCommunicator() {
    std::lock_guard<std::mutex> lock(commMu_);
    if (comm_) comm_->abort();
    comm_.reset();
    for (auto& g : groups_) {
      if (g.comm) g.comm->abort();
    }
    groups_.clear();
  }

  // Leaves epoch `from` (aborting its communicator) and enters the next one the coordinator
  // announces, retrying until one can be built (DESIGN.md section 6, steps 2-3).
  void recoverInto(int64_t from, bool failure, const std::string& why) {
    auto t0 = Clock::now();
    dropCommunicator();
    if (failure) {
      state_.memberLost = true;  // MPI_Finalize would wait for the lost member forever.
      event({{"event", "failure_noticed"}, {"epoch", from}, {"step", step_}, {"reason", why}});
    }
    auto deadline = t0 + recoveryTimeout();
    int64_t waitFrom = from;
    while (true) {
      if (failure) state_.injector.fire(ctx_.worker(), step_, Phase::kRecovery, &client_);
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) {
        SINEW_THROW(Timeout, "worker ", ctx_.worker(), " could not recover within ",
                    recoveryTimeout().count(), " ms (", why, ")");
      }
      EpochInfo info;
      try {
        info = client_.waitEpochAfter(waitFrom, std::min(left, kNudge));
      } catch (const Timeout&) {
        // Nothing died that the coordinator knows of (e.g. a timeout without a death):
        // ask for a fresh epoch with the same members.
        if (waitFrom >= 0) client_.requestRebuild(waitFrom);
        continue;
      }
      // A new epoch after the first: the worker is reconfiguring (DESIGN.md section 8).
      if (from >= 0) {
        state_.injector.fire(ctx_.worker(), step_, Phase::kReconfiguration, &client_);
      }
      try {
        enter(info);
        break;
      } catch (const PeerLost& e) {
        client_.reportLost(info.epoch, e.worker());
      } catch (const Timeout&) {
        client_.requestRebuild(info.epoch);
      } catch (const Aborted&) {
        // Superseded while building: the next epoch is already on its way.
      } catch (const IoError&) {
        client_.requestRebuild(info.epoch);
      } catch (const Corruption& e) {
        // A layer copy arrived damaged (its crc32c disagreed with the sender's, or its
        // manifest was malformed): nothing of it was adopted; the same members try the epoch
        // again and copy it anew. Other corruption (every restore source damaged) ends the
        // worker as before.
        if (!copyDamaged_) throw;
        copyDamaged_ = false;
        event({{"event", "copy_damaged"}, {"epoch", info.epoch}, {"reason", e.what()}});
        std::fprintf(stderr, "sinew: worker %d: %s; trying the epoch again\n", ctx_.worker(),
                     e.what());
        client_.requestRebuild(info.epoch);
      }
      dropCommunicator();
      waitFrom = info.epoch;
    }
    double took = seconds(Clock::now() - t0);
    if (failure) {
      recoveries_++;
      recoveryMax_ = std::max(recoveryMax_, took);
    }
    event({{"event", failure ? "recovered" : "epoch_entered"},
           {"epoch", epoch_},
           {"resume_step", step_},
           {"workers", members_},
           {"duration_s", took},
           {"reason", why}});
  }

  void enter(const EpochInfo& info) {
    const int self = ctx_.worker();
    if (std::find(info.members.begin(), info.members.end(), self) == info.members.end()) {
      SINEW_THROW(Expelled, "worker ", self, " is not a member of epoch ", info.epoch);
    }
    if (pipelineMode_) {
      enterPipeline(info);
      return;
    }
    if (!info.sync && applied_ != info.resumeStep - 1) {
      SINEW_THROW(InvalidArgument, "worker ", self, " holds the state after step ", applied_,
                  " but epoch ", info.epoch, " resumes at step ", info.resumeStep,
                  " without a state copy");
    }
    collectives::CommunicatorOptions co;
    co.members = info.members;
    co.self = self;
    co.epoch = info.epoch;
    co.name = "dp";
    co.timeout = opTimeout();
    co.initTimeout = std::min(o_.buildTimeout, recoveryTimeout());
    co.hostname = ctx_.host();
    const int64_t e = info.epoch;
    auto store = std::make_shared<AbortableStore>(
        ctx_.store(), [this, e] { return client_.latestEpoch().epoch > e; });
    auto comm = makeCommunicator(store, co);
    {
      std::lock_guard<std::mutex> lock(commMu_);
      comm_ = std::move(comm);
      // An announcement that raced with the build would have found no communicator to abort.
      if (client_.latestEpoch().epoch > e) comm_->abort();
    }
    epoch_ = info.epoch;
    members_ = info.members;
    plan_ = Plan::dataParallel(info.epoch, info.members, static_cast<int>(spec_.layers.size()),
                               o_.globalBatch / o_.microbatch);
    if (info.sync && info.source == self && applied_ < info.resumeStep - 1) {
      restoreFromDisk(info.resumeStep - 1);  // The first epoch of a resumed job.
    }
    if (info.sync) {
      SINEW_ENFORCE(info.source >= 0, "epoch ", info.epoch,
                    " has no surviving worker that holds the model state");
      syncState(info);
      applied_ = info.resumeStep - 1;
    }
    step_ = info.resumeStep;
    lastReport_ = Clock::now();
    stepsSinceReport_ = 0;
  }

  // The source's parameters and optimizer state, broadcast to every member.
  void syncState(const EpochInfo& info) {
    int root = static_cast<int>(std::find(info.members.begin(), info.members.end(), info.source) -
                                info.members.begin());
    at::NoGradGuard noGrad;
    for (auto& p : params_) {
      at::Tensor d = p.detach();
      comm_->broadcast(d, root, opTimeout());
    }
    std::string bytes;
    if (comm_->rank() == root) {
      torch::serialize::OutputArchive archive;
      opt_->save(archive);
      std::ostringstream os;
      archive.save_to(os);
      bytes = os.str();
    }
    // Through the communicator's device (NCCL moves CUDA tensors only).
    at::Tensor len = at::full({1}, static_cast<int64_t>(bytes.size()), onDevice(at::kLong));
    comm_->broadcast(len, root, opTimeout());
    int64_t n = len.item<int64_t>();
    at::Tensor host = at::zeros({(n + 7) / 8}, at::kLong);
    if (comm_->rank() == root) std::memcpy(host.data_ptr(), bytes.data(), bytes.size());
    at::Tensor buf = host.to(device_);
    comm_->broadcast(buf, root, opTimeout());
    if (comm_->rank() != root) {
      host = buf.cpu();
      std::string received(static_cast<const char*>(host.data_ptr()), static_cast<size_t>(n));
      std::istringstream is(received);
      torch::serialize::InputArchive archive;
      archive.load_from(is, device_);  // The state onto this worker's device.
      opt_->load(archive);
    }
  }

  // ---- Pipeline parallelism (docs/pipeline.md) --------------------------------------

  // Tags of the point-to-point messages between neighbouring stages; messages with one tag
  // between two workers match in order, and every stage sends in microbatch order.
  static constexpr uint32_t kTagHeader = 1;  // shape and dtype of the next activation
  static constexpr uint32_t kTagActivation = 2;
  static constexpr uint32_t kTagGradient = 3;  // gradient of that activation, sent back
  static constexpr int kMaxDims = 8;

  // A layer range whose layers are held by the same workers, and their communicator.
  struct GradGroup {
    int first = 0;
    int end = 0;
    std::vector<int> members;
    std::unique_ptr<collectives::Communicator> comm;  // null when this worker holds it alone
  };

  void checkProfile(const std::string& where) {
    if (profile_.layers.size() != spec_.layers.size()) {
      SINEW_THROW(InvalidArgument, where, ": the profile has ", profile_.layers.size(),
                  " layers but the model has ", spec_.layers.size());
    }
    if (profile_.job.devices_per_node > o_.microbatch) {
      SINEW_THROW(InvalidArgument, where, ": devices_per_node = ", profile_.job.devices_per_node,
                  " is more than TrainerOptions::microbatch = ", o_.microbatch,
                  ": a stage as wide as a node could not give every worker a sample");
    }
  }

  // The measured profile, agreed by the members of the first pipeline epoch (`store` is that
  // epoch's abortable store). Every member profiles at once, so the layers are timed under
  // the same load as training (on a shared machine running them one at a time measured
  // them a third faster than they then ran); the first member publishes, once for the job,
  // the per-layer median of everyone's times, and all members plan from that.
  void agreeOnProfile(const EpochInfo& info, const std::shared_ptr<Store>& store) {
    const std::string key = "sinew/pipeline/profile";
    if (!store->check({key})) {
      auto t0 = Clock::now();
      if (myProfile_.layers.empty()) myProfile_ = measureProfile();  // Once, even on retries.
      const pipeline::Profile& mine = myProfile_;
      const std::string prefix = key + "/e" + std::to_string(info.epoch) + "/w";
      store->set(prefix + std::to_string(ctx_.worker()),
                 collectives::toBytes(pipeline::profileToJson(mine)));
      if (info.members.front() == ctx_.worker()) {
        std::vector<pipeline::Profile> all;
        for (int w : info.members) {
          all.push_back(pipeline::parseProfileJson(
              collectives::toString(store->get(prefix + std::to_string(w), recoveryTimeout()))));
        }
        pipeline::Profile agreed = mine;
        for (size_t l = 0; l < agreed.layers.size(); ++l) {
          std::vector<int64_t> f, b;
          for (const auto& p : all) {
            f.push_back(p.layers.at(l).forward_ns);
            b.push_back(p.layers.at(l).backward_ns);
          }
          std::sort(f.begin(), f.end());
          std::sort(b.begin(), b.end());
          agreed.layers[l].forward_ns = f[f.size() / 2];
          agreed.layers[l].backward_ns = b[b.size() / 2];
        }
        // The first combined profile of the job wins, should two epochs race.
        store->compareSet(key, {}, collectives::toBytes(pipeline::profileToJson(agreed)));
      }
      event({{"event", "profiled"},
             {"layers", mine.layers.size()},
             {"duration_s", seconds(Clock::now() - t0)},
             {"profile", nlohmann::json::parse(pipeline::profileToJson(mine))}});
    }
    profile_ =
        pipeline::parseProfileJson(collectives::toString(store->get(key, recoveryTimeout())));
    checkProfile("the measured profile");
  }

  // This worker's profile of every layer on the first microbatch of step 0.
  pipeline::Profile measureProfile() {
    const int L = static_cast<int>(spec_.layers.size());
    std::vector<pipeline::ProfiledLayer> layers;
    for (int i = 0; i < L; ++i) {
      torch::nn::Sequential m = buildLayers(spec_, o_.seed, o_.dtype, i, i + 1);
      m->to(device_);
      layers.push_back({spec_.layers[i].name,
                        [m](const at::Tensor& x) mutable { return m->forward(x); },
                        m->parameters()});
    }
    auto indices = globalBatchIndices(o_.seed, 0, o_.globalBatch, spec_.datasetSize);
    pipeline::ProfilerOptions po;
    po.job.devices_per_node = o_.devicesPerNode;
    po.job.device_memory_bytes = o_.deviceMemoryBytes > 0 ? o_.deviceMemoryBytes : int64_t{1} << 50;
    po.job.inter_stage_gbps = 10;  // Loopback TCP between workers of one host.
    // A stage's in-node allreduce runs over the same loopback TCP (Gloo), with a ring step's
    // latency of a few tens of microseconds.
    po.job.allreduce.bandwidth_gbps = 10;
    po.job.allreduce.latency_us = 50;
    po.microbatch_size = o_.microbatch;
    // Medians over many whole-microbatch runs: a short profile on a busy machine can be off
    // by half, and the plan and its predicted iteration time rest on it.
    po.warmup = 3;
    po.repeats = 21;
    // The last stage computes the loss after its layers: its time is the last layer's.
    auto [input, target] = microbatchData(indices, 0);
    po.loss = [this](const at::Tensor& y, const at::Tensor& t) { return spec_.loss(y, t); };
    po.target = target;
    return pipeline::profileLayers(layers, input, po);
  }

  // The assignment of this worker in plan_, or null if the plan leaves it idle.
  const pipeline::WorkerAssignment* mineIn(const Plan& plan) const {
    for (const auto& w : plan.workers) {
      if (w.worker == ctx_.worker()) return &w;
    }
    return nullptr;
  }

  // ---- Reconfiguration: moving layers between workers (docs/pipeline.md) ----------------

  // What a member holds when an epoch starts: layers [first, end) (first < 0: none built
  // yet) with the state after step `applied`.
  struct Holding {
    int first = -1;
    int end = -1;
    int64_t applied = -1;
    bool holds(int layer) const { return first >= 0 && layer >= first && layer < end; }
  };

  static std::string heldKey(int64_t epoch, int worker) {
    return "sinew/pipeline/held/" + std::to_string(epoch) + "/w" + std::to_string(worker);
  }

  static Holding parseHolding(const std::string& text, int worker, int64_t epoch) {
    Holding h;
    std::istringstream is(text);
    if (!(is >> h.first >> h.end >> h.applied) || h.end < h.first || h.applied < -1) {
      SINEW_THROW(Corruption, "worker ", worker, " published a malformed holding for epoch ", epoch,
                  ": '", text, "'");
    }
    return h;
  }

  // The new layers of this worker, and their state, from a reconfiguration.
  struct Relayout {
    torch::nn::Sequential model;                             // [first, end), on device_
    std::map<std::string, checkpoint::RestoredLayer> state;  // by layer name, as checkpoints
    int copied = 0, fromDisk = 0, fromOwnRam = 0, fromPeerRam = 0, fresh = 0;
    std::vector<int> sources;     // workers copied from (live layers)
    std::vector<int> ramSources;  // workers whose RAM versions were restored
    int64_t bytesCopied = 0;      // tensor bytes received from live workers
    double copySeconds = 0;       // the wall time of receiving them (with this worker's sends)
  };

  // Per-parameter flags of a layer copy's manifest.
  static constexpr int64_t kHasAdam = 1;      // exp_avg, exp_avg_sq and step follow
  static constexpr int64_t kHasMaxSq = 2;     // max_exp_avg_sq follows (AMSGrad)
  static constexpr int64_t kHasMomentum = 4;  // SGD's momentum_buffer follows
  static constexpr uint32_t kTagLayerManifest = 4;
  static constexpr uint32_t kTagLayerState = 5;
  // Layer copies go as messages of at most this many bytes (collectives::exchangeInChunks).
  static constexpr size_t kLayerCopyChunkBytes = size_t{4} << 20;

  // crc32c of the tensors' bytes, one after the other (host copies of device tensors).
  static uint32_t checksum(const std::vector<at::Tensor>& tensors) {
    uint32_t crc = 0;
    for (const auto& t : tensors) {
      at::Tensor h = t.is_cpu() ? t.contiguous() : t.to(at::kCPU).contiguous();
      crc = checkpoint::detail::crc32cExtend(crc, h.data_ptr(),
                                             static_cast<size_t>(h.numel() * h.element_size()));
    }
    return crc;
  }

  // The manifest of held layer `layer` (per parameter: flags, then Adam's step count; last,
  // the crc32c of all its tensors) and its tensors in manifest order (a parameter, then its
  // optimizer state).
  at::Tensor layerManifest(int layer, std::vector<at::Tensor>* tensors) {
    auto params = (*model_)[layer - heldFirst_]->named_parameters(/*recurse=*/true);
    const int64_t n = static_cast<int64_t>(params.size());
    at::Tensor m = at::zeros({2 * n + 1}, at::kLong);
    const size_t before = tensors->size();
    auto a = m.accessor<int64_t, 1>();
    auto& st = opt_->state();
    int64_t i = 0;
    for (const auto& np : params) {
      const at::Tensor& p = np.value();
      tensors->push_back(p.detach().contiguous());
      auto it = st.find(stateKey(st, p));
      if (it != st.end()) {
        if (auto* ad = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
          a[i] |= kHasAdam;
          a[n + i] = ad->step();
          tensors->push_back(ad->exp_avg().contiguous());
          tensors->push_back(ad->exp_avg_sq().contiguous());
          if (ad->max_exp_avg_sq().defined()) {
            a[i] |= kHasMaxSq;
            tensors->push_back(ad->max_exp_avg_sq().contiguous());
          }
        } else if (auto* sg = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
          if (sg->momentum_buffer().defined()) {
            a[i] |= kHasMomentum;
            tensors->push_back(sg->momentum_buffer().contiguous());
          }
        }
      }
      ++i;
    }
    a[2 * n] = checksum(std::vector<at::Tensor>(tensors->begin() + before, tensors->end()));
    return m.to(device_);
  }

  // Runs this epoch's layer copies (docs/pipeline.md, "Reconfiguration"): every member
  // derives the same list from the published holdings (each layer goes to every worker of the
  // new plan that does not hold it live, from the live holder with the least traffic so far:
  // pipeline::liveLayerCopies), sends what it must from its current layers, and receives into
  // new ones. Returns this worker's new layers and their state, or nothing when it keeps
  // exactly what it holds. Nothing of this worker changes here: a failure leaves it holding
  // what it held.
  std::optional<Relayout> relayoutLayers(const Plan& plan, const std::map<int, Holding>& held,
                                         int first, int end, int64_t resumeApplied) {
    const int self = ctx_.worker();
    auto live = [&](int w, int l) {
      const Holding& h = held.at(w);
      return h.holds(l) && h.applied == resumeApplied;
    };
    // Who copies which layer to whom (pipeline::liveLayerCopies: by layer, then receiver; each
    // from the live holder with the least traffic so far). Traffic is counted in layers, which
    // every member knows alike: the measured profile is not on every member (a joiner has
    // none, and in that test neither had worker 1), and members that weighed
    // the copies differently would post unmatched messages and wait for them until the epoch's
    // deadline (seen in PipelineJoinTest.AJoinedWorkerGetsAStage).
    std::vector<std::vector<int>> holders(plan.numLayers);
    for (int l = 0; l < plan.numLayers; ++l) {
      for (const auto& [w, h] : held) {
        if (live(w, l)) holders[l].push_back(w);
      }
    }
    const std::vector<pipeline::LiveLayerCopy> copies = pipeline::liveLayerCopies(
        plan, holders, std::vector<int64_t>(static_cast<size_t>(plan.numLayers), 1));
    // Ranks in this epoch's communicator (members_ is still the last epoch's).
    const std::vector<int>& members = comm_->members();
    auto rankIn = [&](int w) {
      return static_cast<int>(std::find(members.begin(), members.end(), w) - members.begin());
    };
    const Holding& me = held.at(self);
    const bool keeps = me.first == first && me.end == end && me.applied == resumeApplied;
    Relayout r;
    if (!keeps && end > first) {
      r.model = buildLayers(spec_, o_.seed, o_.dtype, first, end);
      r.model->to(device_);
    }
    auto freshParams = [&](int l) { return (*r.model)[l - first]->named_parameters(true); };
    auto heldParams = [&](int l) {
      return (*model_)[l - heldFirst_]->named_parameters(/*recurse=*/true);
    };
    // Phase 1: manifests.
    std::vector<collectives::P2POp> ops;
    std::map<size_t, std::vector<at::Tensor>> outgoing;  // by copy index, where it sends
    std::map<size_t, at::Tensor> manifests;              // by copy index, where it receives
    for (size_t c = 0; c < copies.size(); ++c) {
      const pipeline::LiveLayerCopy& k = copies[c];
      if (k.from == self && heldParams(k.layer).size() > 0) {
        at::Tensor m = layerManifest(k.layer, &outgoing[c]);
        ops.push_back(collectives::P2POp::send(m, rankIn(k.to), kTagLayerManifest));
      } else if (k.to == self && freshParams(k.layer).size() > 0) {
        at::Tensor m = at::zeros({2 * static_cast<int64_t>(freshParams(k.layer).size()) + 1},
                                 onDevice(at::kLong));
        manifests[c] = m;
        ops.push_back(collectives::P2POp::recv(m, rankIn(k.from), kTagLayerManifest));
      }
    }
    if (!ops.empty()) {
      comm_->exchange(ops, recoveryTimeout());
      // Between the two exchanges of this worker's copies (a kill during a layer copy).
      state_.injector.fire(self, resumeApplied + 1, Phase::kCopy, &client_);
    }
    // Phase 2: the tensors, in manifest order.
    ops.clear();
    if (!outgoing.empty() && state_.injector.damageCopy(self, resumeApplied + 1)) {
      // Failure injection (corrupt, phase copy): the first tensor goes out with its first
      // bytes overwritten, from a copy (its own state stays intact).
      at::Tensor& t = outgoing.begin()->second.front();
      at::Tensor damaged = t.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true).contiguous();
      std::memcpy(damaged.data_ptr(), runtime::kDamageBytes,
                  std::min<size_t>(sizeof runtime::kDamageBytes, damaged.nbytes()));
      t = damaged.to(t.device());
    }
    for (const auto& [c, tensors] : outgoing) {
      for (const auto& t : tensors) {
        ops.push_back(collectives::P2POp::send(t, rankIn(copies[c].to), kTagLayerState));
      }
    }
    struct Incoming {
      std::string layer, name;
      at::Tensor tensor;
      size_t copy;  // its copy's index
    };
    std::vector<Incoming> incoming;
    std::map<size_t, uint32_t> expected;  // crc32c by copy index
    for (const auto& [c, received] : manifests) {
      const pipeline::LiveLayerCopy& k = copies[c];
      const std::string& layerName = spec_.layers[k.layer].name;
      at::Tensor m = received.cpu();
      auto a = m.accessor<int64_t, 1>();
      auto params = freshParams(k.layer);
      const int64_t n = static_cast<int64_t>(params.size());
      expected[c] = static_cast<uint32_t>(a[2 * n]);
      int64_t i = 0;
      for (const auto& np : params) {
        const int64_t flags = a[i];
        if (flags < 0 || flags > (kHasAdam | kHasMaxSq | kHasMomentum)) {
          copyDamaged_ = true;
          SINEW_THROW(Corruption, "worker ", self, " received a malformed manifest of layer '",
                      layerName, "' from worker ", k.from);
        }
        auto want = [&](const std::string& suffix) {
          // Zero-filled, not empty: the pages are faulted in here, while the sender's first
          // chunks are already on their way, instead of one by one inside Gloo's reads (which
          // halved the copy's receive time and cut 10% off the reconfiguration, docs/pipeline.md
          // section 6).
          incoming.push_back({layerName, np.key() + suffix, at::zeros_like(np.value()), c});
          ops.push_back(
              collectives::P2POp::recv(incoming.back().tensor, rankIn(k.from), kTagLayerState));
        };
        want("");
        if (flags & kHasAdam) {
          want(".exp_avg");
          want(".exp_avg_sq");
          r.state[layerName][np.key() + ".step"] = at::full({1}, a[n + i], at::kLong);
        }
        if (flags & kHasMaxSq) want(".max_exp_avg_sq");
        if (flags & kHasMomentum) want(".momentum_buffer");
        ++i;
      }
      r.copied++;
      r.sources.push_back(k.from);
    }
    // The copies run while nothing else of the job does (docs/pipeline.md, "Quiet copies"):
    // every member enters them once every receiver has built and zero-filled its buffers and
    // every sender has its manifests' checksums, and leaves them only once every copy has
    // arrived, so that no member's layer building or next forward shares the machine with
    // them. Every member derives the same copy list, so all of them take both barriers or
    // none; a member lost meanwhile fails them as it fails the copies (PeerLost).
    const bool anyCopies = !copies.empty();
    if (anyCopies) comm_->barrier(recoveryTimeout());
    if (!ops.empty()) {
      // Streamed in chunks (no message above kLayerCopyChunkBytes); timed on the receivers
      // for the copy's throughput (the layers_moved event).
      auto t0 = Clock::now();
      collectives::exchangeInChunks(*comm_, ops, kLayerCopyChunkBytes, recoveryTimeout());
      for (const auto& in : incoming) r.bytesCopied += in.tensor.nbytes();
      if (!incoming.empty()) r.copySeconds = seconds(Clock::now() - t0);
    }
    if (anyCopies) comm_->barrier(recoveryTimeout());
    if (keeps) return std::nullopt;
    // Every copy arrived whole, or the reconfiguration fails here (nothing adopted).
    for (const auto& [c, crc] : expected) {
      std::vector<at::Tensor> got;
      for (const auto& in : incoming) {
        if (in.copy == c) got.push_back(in.tensor);
      }
      const uint32_t actual = checksum(got);
      if (actual != crc) {
        copyDamaged_ = true;
        SINEW_THROW(Corruption, "layer '", spec_.layers[copies[c].layer].name,
                    "' copied from worker ", copies[c].from, " to worker ", self, " in epoch ",
                    comm_->epoch(), " arrived damaged: crc32c ", actual, ", the sender's ", crc);
      }
    }
    for (auto& in : incoming) r.state[in.layer][in.name] = in.tensor;
    // Layers this worker keeps: its own state. Layers nobody holds live: from their seeds if
    // no step was applied yet, else from the durable version of the resume step.
    std::map<std::string, checkpoint::RestoredLayer> own;
    for (auto& l : shardState()) {
      auto& m = own[l.name];
      for (auto& t : l.tensors) m[t.name] = t.tensor;
    }
    std::vector<std::string> fromDisk;
    for (int l = first; l < end; ++l) {
      const std::string& name = spec_.layers[l].name;
      if (freshParams(l).size() == 0 || r.state.count(name)) continue;
      if (live(self, l)) {
        r.state[name] = own.at(name);
      } else if (holders[l].empty() && resumeApplied >= 0) {
        fromDisk.push_back(name);
      } else {
        for (const auto& np : freshParams(l)) r.state[name][np.key()] = np.value().detach();
        r.fresh++;
      }
    }
    if (!fromDisk.empty()) {
      // The version of the resume step (after a rollback, every layer): own RAM, peers' RAM,
      // then disk (enterPipeline chose a step every layer can be restored from).
      std::vector<int> live;
      for (const auto& [w, h] : held) live.push_back(w);
      checkpoint::RestoreResult restored = restoreVersion(resumeApplied, fromDisk, live);
      for (auto& [name, layer] : restored.layers) {
        const std::string& from = restored.source.at(name);
        if (from == "local") {
          r.fromOwnRam++;
        } else if (from.rfind("peer ", 0) == 0) {
          r.fromPeerRam++;
          r.ramSources.push_back(std::stoi(from.substr(5)));
        } else {
          r.fromDisk++;
        }
        r.state[name] = std::move(layer);
      }
      for (const std::string& why : restored.fellThrough) {
        std::fprintf(stderr, "sinew: worker %d: restoring version %lld: %s\n", self,
                     static_cast<long long>(resumeApplied), why.c_str());
      }
    }
    return r;
  }

  // Rollback (docs/pipeline.md, "Rollback"): when some layer with parameters has no live
  // holder after the epoch's resume step, the epoch's first member picks the newest version
  // every layer can still be restored from (rollbackTarget) and publishes it; if it is older
  // than the resume step, it asks the coordinator for an epoch resuming after it, and every
  // member waits for that epoch (EpochChanged), in which nobody holds a layer live at the
  // resume step and every layer is restored from that version.
  void checkRollback(const EpochInfo& info, const std::map<int, Holding>& held,
                     collectives::Store& store) {
    const int64_t e = info.epoch;
    const int64_t resumeApplied = info.resumeStep - 1;
    int orphan = -1;
    for (int l = 0; l < static_cast<int>(spec_.layers.size()) && orphan < 0; ++l) {
      if (!hasParameters(l)) continue;
      bool live = false;
      for (const auto& [w, h] : held) live = live || (h.holds(l) && h.applied == resumeApplied);
      if (!live) orphan = l;
    }
    // The first member always publishes its decision (its own view of which layers have
    // parameters decides), so a member that sees an orphan never waits for nothing.
    const std::string key = "sinew/pipeline/rollback/" + std::to_string(e);
    const bool decides = info.members.front() == ctx_.worker();
    if (decides) {
      const int64_t t =
          orphan < 0 ? resumeApplied : rollbackTarget(resumeApplied, e, info.members, store);
      store.set(key, collectives::toBytes(std::to_string(t)));
    }
    if (orphan < 0) return;
    const int64_t target = std::stoll(collectives::toString(store.get(key, recoveryTimeout())));
    if (target >= resumeApplied) return;  // That very version is restorable.
    event({{"event", "rollback"},
           {"epoch", e},
           {"layer", spec_.layers[orphan].name},
           {"from", resumeApplied},
           {"to", target}});
    if (decides) {
      std::printf(
          "sinew: epoch %lld: layer %s has no live copy after step %lld; rolling back to %s\n",
          static_cast<long long>(e), spec_.layers[orphan].name.c_str(),
          static_cast<long long>(resumeApplied),
          target >= 0 ? ("version " + std::to_string(target)).c_str() : "the start");
      std::fflush(stdout);
      client_.requestRollback(e, target);
    }
    SINEW_THROW(EpochChanged, "epoch ", e, ": layer '", spec_.layers[orphan].name,
                "' has no live copy after step ", resumeApplied, "; the job rolls back to ",
                target >= 0 ? "version " + std::to_string(target) : std::string("the start"));
  }

  // Makes `r` this worker's layers (after every copy of the epoch succeeded).
  void adoptLayers(Relayout r, int first, int end, int64_t resumeApplied, int64_t epoch) {
    auto t0 = Clock::now();
    if (arena_) {
      // Its shard layout is the old layers': the next due version makes a new arena.
      try {
        arena_->waitComplete();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "sinew: worker %d: a snapshot failed before a reconfiguration: %s\n",
                     ctx_.worker(), e.what());
      }
      arena_.reset();
    }
    model_ = r.model ? r.model : torch::nn::Sequential();
    params_ = model_->parameters();
    opt_ = spec_.optimizer(params_);
    loadState(r.state, "the state of the layers moved in epoch " + std::to_string(epoch));
    const int oldFirst = heldFirst_, oldEnd = heldEnd_;
    heldFirst_ = first;
    heldEnd_ = end;
    applied_ = resumeApplied;
    for (auto* v : {&r.sources, &r.ramSources}) {
      std::sort(v->begin(), v->end());
      v->erase(std::unique(v->begin(), v->end()), v->end());
    }
    if (lastSnapshot_ > resumeApplied) lastSnapshot_ = -1;  // A rollback: those steps run again.
    event({{"event", "layers_moved"},
           {"epoch", epoch},
           {"held", {oldFirst, oldEnd}},
           {"holds", {first, end}},
           {"copied", r.copied},
           {"from", r.sources},
           {"from_disk", r.fromDisk},
           {"from_own_ram", r.fromOwnRam},
           {"from_peer_ram", r.fromPeerRam},
           {"ram_sources", r.ramSources},
           {"version", resumeApplied},
           {"fresh", r.fresh},
           {"copied_bytes", r.bytesCopied},
           {"copy_s", r.copySeconds},
           {"duration_s", seconds(Clock::now() - t0)}});
    std::ostringstream os;
    os << "sinew: worker " << ctx_.worker() << " now holds ";
    if (end > first) {
      os << "layers " << spec_.layers[first].name << ".." << spec_.layers[end - 1].name;
    } else {
      os << "no layers";
    }
    os << " (epoch " << epoch;
    if (r.copied > 0) {
      os << "; " << r.copied << " copied from worker" << (r.sources.size() > 1 ? "s" : "");
      for (int w : r.sources) os << " " << w;
    }
    if (r.fromOwnRam > 0) {
      os << "; " << r.fromOwnRam << " restored from its own RAM (version " << resumeApplied << ")";
    }
    if (r.fromPeerRam > 0) {
      os << "; " << r.fromPeerRam << " restored from the RAM of worker"
         << (r.ramSources.size() > 1 ? "s" : "");
      for (int w : r.ramSources) os << " " << w;
      os << " (version " << resumeApplied << ")";
    }
    if (r.fromDisk > 0) {
      os << "; " << r.fromDisk << " read from the durable checkpoint (version " << resumeApplied
         << ")";
    }
    if (r.fresh > 0) os << "; " << r.fresh << " built from their seeds";
    if (r.copied + r.fromDisk + r.fromOwnRam + r.fromPeerRam + r.fresh == 0) {
      os << (end > first ? "; all its own" : "; idle");
    }
    os << ")";
    std::printf("%s\n", os.str().c_str());
    std::fflush(stdout);
  }

  // The most workers the job may grow to (TrainerOptions::maxWorkers): the option, else
  // SINEW_MAX_WORKERS, else twice the `members` it starts with.
  int64_t grownWorkers(int64_t members) const {
    if (o_.maxWorkers > 0) return o_.maxWorkers;
    if (const char* env = std::getenv("SINEW_MAX_WORKERS")) {
      return sinew::detail::parseInt(env, "SINEW_MAX_WORKERS", 1, 1 << 20);
    }
    return 2 * members;
  }

  void enterPipeline(const EpochInfo& info) {
    const int self = ctx_.worker();
    const int64_t e = info.epoch;
    auto store = std::make_shared<AbortableStore>(
        ctx_.store(), [this, e] { return client_.latestEpoch().epoch > e; });
    if (info.plan.empty()) {
      // The job's first epoch: agree on the profile, have the first member ask the
      // coordinator to plan, and wait for the epoch that carries the plan.
      if (profile_.layers.empty()) agreeOnProfile(info, store);
      if (info.members.front() == self) {
        client_.requestPipelines(info.epoch, pipeline::profileToJson(profile_), o_.faultTolerance,
                                 o_.globalBatch / o_.microbatch,
                                 grownWorkers(static_cast<int64_t>(info.members.size())));
      }
      SINEW_THROW(EpochChanged, "epoch ", info.epoch,
                  " has no pipeline plan yet; waiting for the coordinator's");
    }
    Plan plan = pipeline::planFromJson(info.plan);
    if (plan.numLayers != static_cast<int>(spec_.layers.size())) {
      SINEW_THROW(InvalidArgument, "the coordinator's plan of epoch ", info.epoch, " has ",
                  plan.numLayers, " layers but the model has ", spec_.layers.size(),
                  " (workers of one job must train the same ModelSpec)");
    }
    for (const auto& w : plan.workers) {
      if (std::find(info.members.begin(), info.members.end(), w.worker) == info.members.end()) {
        SINEW_THROW(Corruption, "the coordinator's plan of epoch ", info.epoch,
                    " assigns layers to ", "worker ", w.worker, ", which is not a member");
      }
    }
    const pipeline::WorkerAssignment* mine = mineIn(plan);
    const int first = mine ? mine->firstLayer : 0;
    const int end = mine ? mine->endLayer : 0;
    const int64_t resumeApplied = info.resumeStep - 1;
    // What every member holds now, published for this epoch, so that all agree on who copies
    // which layers to whom (docs/pipeline.md, "Reconfiguration").
    store->set(heldKey(e, self),
               collectives::toBytes(std::to_string(heldFirst_) + " " + std::to_string(heldEnd_) +
                                    " " + std::to_string(applied_)));
    std::map<int, Holding> held;
    bool anyHeld = false, anyTrained = false;
    for (int w : info.members) {
      held[w] =
          parseHolding(collectives::toString(store->get(heldKey(e, w), recoveryTimeout())), w, e);
      anyHeld = anyHeld || held[w].first < held[w].end;
      anyTrained = anyTrained || held[w].applied >= 0;
    }
    // The job's first plan (or the first since it restarted from disk): every worker builds
    // its own layers from their seeds, or reads them from the durable checkpoint. (Members
    // that trained but hold no layers, because every worker that held some is gone, are not
    // a first plan: they roll back to a version they can restore.)
    const bool firstPlan = !anyHeld && !anyTrained;
    if (!firstPlan && resumeApplied >= 0) checkRollback(info, held, *store);
    auto options = [&](std::vector<int> members, std::string name) {
      collectives::CommunicatorOptions co;
      co.members = std::move(members);
      co.self = self;
      co.epoch = e;
      co.name = std::move(name);
      co.timeout = opTimeout();
      co.initTimeout = std::min(o_.buildTimeout, recoveryTimeout());
      co.hostname = ctx_.host();
      return co;
    };
    // Activations, gradients and layer copies go on lanes: each transfer is moved by the
    // thread that waits for it, not handed over by Gloo's loop thread (docs/collectives.md).
    collectives::CommunicatorOptions worldOptions = options(info.members, "pp");
    worldOptions.p2pLanes = true;
    worldOptions.laneSocketBufferBytes = o_.laneSocketBufferBytes;
    auto comm = makeCommunicator(store, std::move(worldOptions));
    {
      std::lock_guard<std::mutex> lock(commMu_);
      comm_ = std::move(comm);
      if (client_.latestEpoch().epoch > e) comm_->abort();
    }
    // Gradient groups: maximal ranges of this worker's layers held by the same workers, in
    // increasing layer order on every worker (so the builds and reductions never wait in a
    // cycle).
    std::vector<std::vector<int>> holders(plan.numLayers);
    for (const auto& w : plan.workers) {
      for (int l = w.firstLayer; l < w.endLayer; ++l) holders[l].push_back(w.worker);
    }
    for (auto& h : holders) std::sort(h.begin(), h.end());
    for (int l = first; l < end;) {
      int r = l + 1;
      while (r < end && holders[r] == holders[l]) ++r;
      GradGroup g;
      g.first = l;
      g.end = r;
      g.members = holders[l];
      if (g.members.size() > 1) {
        g.comm = makeCommunicator(
            store, options(g.members, "grad-" + std::to_string(l) + "-" + std::to_string(r)));
      }
      std::lock_guard<std::mutex> lock(commMu_);
      groups_.push_back(std::move(g));
      if (client_.latestEpoch().epoch > e && groups_.back().comm) groups_.back().comm->abort();
      l = r;
    }
    // The layers this worker now holds that it did not (a reconfiguration), copied from live
    // workers that hold them, before anything of this worker's changes.
    waitPeerSnapshots();  // Their copies read the tensors this epoch may replace or update.
    std::optional<Relayout> relayout;
    if (!firstPlan) relayout = relayoutLayers(plan, held, first, end, resumeApplied);
    if (relayout) adoptLayers(std::move(*relayout), first, end, resumeApplied, e);
    if (firstPlan) {
      // The first plan this worker enters (its communicators are up): build this stage's
      // layers and nothing else.
      model_ = torch::nn::Sequential();
      if (end > first) {
        torch::nn::Sequential built = buildLayers(spec_, o_.seed, o_.dtype, first, end);
        built->to(device_);
        auto it = built->begin();
        for (int i = first; i < end; ++i, ++it) model_->push_back(spec_.layers[i].name, *it);
      }
      params_ = model_->parameters();
      opt_ = spec_.optimizer(params_);
      heldFirst_ = first;
      heldEnd_ = end;
    }
    epoch_ = info.epoch;
    members_ = info.members;
    plan_ = std::move(plan);
    if (firstPlan && applied_ < info.resumeStep - 1) {
      // The first plan of a resumed job: every worker reads its own layers from disk.
      restoreFromDisk(info.resumeStep - 1);
    }
    applied_ = info.resumeStep - 1;
    step_ = info.resumeStep;
    lastReport_ = Clock::now();
    stepsSinceReport_ = 0;
    scheduleSeconds_ = 0;
    scheduleWaitSeconds_ = 0;
    describePlan();
  }

  // Logs the plan; the epoch's first member prints it.
  void describePlan() {
    nlohmann::json pipes = nlohmann::json::array();
    std::ostringstream os;
    os << "sinew: epoch " << epoch_ << " plan: " << plan_.pipelines.size() << " pipelines";
    for (size_t p = 0; p < plan_.pipelines.size(); ++p) {
      nlohmann::json stages = nlohmann::json::array();
      int nstages = 0;
      std::ostringstream ps;
      for (const auto& w : plan_.workers) {
        if (w.pipeline != static_cast<int>(p)) continue;
        nstages = std::max(nstages, w.stage + 1);
        stages.push_back({{"worker", w.worker},
                          {"stage", w.stage},
                          {"first_layer", w.firstLayer},
                          {"end_layer", w.endLayer}});
        ps << " w" << w.worker << "[" << spec_.layers[w.firstLayer].name << ".."
           << spec_.layers[w.endLayer - 1].name << "]";
      }
      pipes.push_back({{"nodes", plan_.pipelines[p].nodes},
                       {"stages", stages},
                       {"microbatches", plan_.pipelines[p].microbatches}});
      const int nodes = plan_.pipelines[p].nodes;
      os << "\n  pipeline " << p << ": " << nodes << (nodes == 1 ? " node, " : " nodes, ")
         << nstages << " stages, " << plan_.pipelines[p].microbatches
         << " microbatches:" << ps.str();
    }
    // The cost model's 1F1B time of the slowest pipeline (ticks are 1/G ns).
    const double predicted =
        static_cast<double>(plan_.iterationTicks) /
        (1e9 * static_cast<double>(std::max(1, profile_.job.devices_per_node)));
    event({{"event", "plan"},
           {"epoch", epoch_},
           {"pipelines", pipes},
           {"idle", plan_.idleNodeIds},
           {"predicted_iteration_s", predicted}});
    if (!members_.empty() && members_.front() == ctx_.worker()) {
      std::printf("%s\n", os.str().c_str());
      std::fflush(stdout);
    }
  }

  // The workers of (pipeline, stage) of plan_, in device order (one unless the stage is
  // wider than one device).
  std::vector<int> stageWorkers(int pipelineIndex, int stage) const {
    std::vector<int> out;
    for (const auto& w : plan_.workers) {
      if (w.pipeline == pipelineIndex && w.stage == stage) out.push_back(w.worker);
    }
    return out;
  }

  int rankOf(int worker) const {
    return static_cast<int>(std::find(members_.begin(), members_.end(), worker) - members_.begin());
  }

  // This worker's index among its stage's workers, or -1 if it holds no stage.
  int indexInStage() const {
    const pipeline::WorkerAssignment* mine = mineIn(plan_);
    if (mine == nullptr) return -1;
    auto ws = stageWorkers(mine->pipeline, mine->stage);
    return static_cast<int>(std::find(ws.begin(), ws.end(), ctx_.worker()) - ws.begin());
  }

  // One pipeline step: 1F1B over this pipeline's microbatches (docs/pipeline.md, "A step"),
  // then the per-layer-range gradient sums and the loss sum, then the vote.
  bool runPipelineStep() {
    const int self = ctx_.worker();
    auto& inj = state_.injector;
    inj.fire(self, step_, Phase::kForward, &client_);
    for (auto& p : params_) {
      if (p.grad().defined()) p.mutable_grad().zero_();
    }
    double lossSum = 0;
    if (const pipeline::WorkerAssignment* mine = mineIn(plan_)) {
      auto t0 = Clock::now();
      lossSum = runSchedule(*mine);
      scheduleSeconds_ += seconds(Clock::now() - t0);
    }
    inj.fire(self, step_, Phase::kReduce, &client_);
    for (auto& g : groups_) {
      if (!g.comm) continue;
      std::vector<at::Tensor> ps;
      for (int l = g.first; l < g.end; ++l) {
        for (auto& p : (*model_)[l - heldFirst_]->parameters()) ps.push_back(p);
      }
      if (ps.empty()) continue;
      at::Tensor flat = flatGradients(ps);
      WaitingOnOthers waiting(client_, step_, &stepWaited_);
      TrainingTraffic traffic(trafficGate());
      g.comm->allreduce(flat, collectives::ReduceOp::kSum, opTimeout());
      setGradients(ps, flat);
    }
    at::Tensor loss = at::full({1}, lossSum, onDevice(at::kDouble));
    {
      WaitingOnOthers waiting(client_, step_, &stepWaited_);
      comm_->allreduce(loss, collectives::ReduceOp::kSum, opTimeout());
    }
    inj.fire(self, step_, Phase::kAfterReduce, &client_);
    return commitAndApply(loss.item<double>() / static_cast<double>(o_.globalBatch));
  }

  // Forward and backward of this stage over its pipeline's microbatches in 1F1B order;
  // returns the sum over its samples of the loss (last stage) or 0.
  double runSchedule(const pipeline::WorkerAssignment& mine) {
    int S = 0;
    for (const auto& w : plan_.workers) {
      if (w.pipeline == mine.pipeline) S = std::max(S, w.stage + 1);
    }
    const int s = mine.stage;
    const bool firstStage = s == 0, lastStage = s == S - 1;
    // A stage of width d: worker j of it runs samples [j b / d, (j + 1) b / d) of every
    // microbatch (b samples). Neighbouring stages may have other widths (mixed-width
    // templates): a worker exchanges with each worker of the neighbouring stage whose samples
    // overlap its own, the overlap's rows of the activation (dimension 0, the batch) forward
    // and of its gradient back.
    const std::vector<int> peers = stageWorkers(mine.pipeline, s);
    const int d = static_cast<int>(peers.size());
    const int j =
        static_cast<int>(std::find(peers.begin(), peers.end(), ctx_.worker()) - peers.begin());
    const int64_t sliceBegin = j * o_.microbatch / d, sliceEnd = (j + 1) * o_.microbatch / d;
    struct Piece {
      int rank;
      int64_t begin, end;  // rows of the microbatch, within [sliceBegin, sliceEnd)
    };
    auto overlaps = [&](int stage) {
      std::vector<Piece> pieces;
      const std::vector<int> ws = stageWorkers(mine.pipeline, stage);
      const int64_t n = static_cast<int64_t>(ws.size());
      for (int64_t q = 0; q < n; ++q) {
        const int64_t lo = std::max(sliceBegin, q * o_.microbatch / n);
        const int64_t hi = std::min(sliceEnd, (q + 1) * o_.microbatch / n);
        if (lo < hi) pieces.push_back({rankOf(ws[q]), lo, hi});
      }
      return pieces;
    };
    const std::vector<Piece> prevPieces = firstStage ? std::vector<Piece>{} : overlaps(s - 1);
    const std::vector<Piece> nextPieces = lastStage ? std::vector<Piece>{} : overlaps(s + 1);
    auto rows = [&](const at::Tensor& t, const Piece& p) {
      return t.narrow(0, p.begin - sliceBegin, p.end - p.begin);
    };
    const int64_t W = std::min<int64_t>(S - s - 1, static_cast<int64_t>(mine.microbatches.size()));
    const int64_t M = static_cast<int64_t>(mine.microbatches.size());
    const double scale =
        static_cast<double>(sliceEnd - sliceBegin) / static_cast<double>(o_.globalBatch);
    auto indices = globalBatchIndices(o_.seed, step_, o_.globalBatch, spec_.datasetSize);
    struct InFlight {
      at::Tensor x, y, loss;
    };
    std::deque<InFlight> inFlight;
    double lossSum = 0;
    bool firstBackward = true;
    auto exchange = [&](std::vector<collectives::P2POp> ops) {
      if (ops.empty()) return;
      WaitingOnOthers waiting(client_, step_, &stepWaited_);
      TrainingTraffic traffic(trafficGate());
      auto t0 = Clock::now();
      comm_->exchange(ops, opTimeout());
      scheduleWaitSeconds_ += seconds(Clock::now() - t0);
    };
    // The header of an activation: dtype, number of dimensions, dimensions.
    auto header = [&](const at::Tensor& y) {
      if (y.dim() > kMaxDims) {
        SINEW_THROW(InvalidArgument, "layer '", spec_.layers[mine.endLayer - 1].name,
                    "' (the last of stage ", s, ") outputs a tensor of ", y.dim(),
                    " dimensions; at most ", kMaxDims, " can be sent between pipeline stages");
      }
      at::Tensor h = at::zeros({2 + kMaxDims}, at::kLong);
      auto a = h.accessor<int64_t, 1>();
      a[0] = static_cast<int64_t>(y.scalar_type());
      a[1] = y.dim();
      for (int64_t d = 0; d < y.dim(); ++d) a[2 + d] = y.size(d);
      return h.to(device_);
    };
    // The sizes a header announces; Corruption if malformed.
    auto fromHeader = [&](const at::Tensor& received, const Piece& p) {
      at::Tensor h = received.cpu();
      auto a = h.accessor<int64_t, 1>();
      const int64_t type = a[0], dims = a[1];
      const bool plain = type >= 0 && type < static_cast<int64_t>(at::ScalarType::NumOptions) &&
                         (at::isFloatingType(static_cast<at::ScalarType>(type)) ||
                          at::isIntegralType(static_cast<at::ScalarType>(type),
                                             /*includeBool=*/true));
      if (!plain || dims < 1 || dims > kMaxDims) {
        SINEW_THROW(Corruption, "stage ", s, " received a malformed activation header from stage ",
                    s - 1, " (dtype code ", type, ", ", dims, " dimensions)");
      }
      std::vector<int64_t> sizes{type};
      for (int64_t d = 0; d < dims; ++d) {
        if (a[2 + d] < 0 || a[2 + d] > (int64_t{1} << 40)) {
          SINEW_THROW(Corruption, "stage ", s, " received an activation size of ", a[2 + d],
                      " from stage ", s - 1);
        }
        sizes.push_back(a[2 + d]);
      }
      if (sizes[1] != p.end - p.begin) {
        SINEW_THROW(Corruption, "stage ", s, " expected ", p.end - p.begin,
                    " rows of activation from stage ", s - 1, ", the header says ", sizes[1]);
      }
      return sizes;  // dtype code, then the dimensions
    };
    // Activation shapes (dtype code, then the dimensions) of this step's last microbatch, per
    // piece: what this stage sent to each worker of the next stage, and what it received from
    // each worker of the previous one. From the second microbatch of a step on, a receiver
    // posts the activation's receive with the header's, sized as the last one, and the sender
    // sends one of exactly that size: the activation itself when its shape is unchanged (the
    // usual case), else zeros, followed by the activation in an exchange of its own that the
    // receiver, seeing the new header, matches. Waiting for the header before posting the
    // activation's receive cost every microbatch a second rendezvous between the stages
    // (docs/pipeline.md, "A step").
    std::vector<std::vector<int64_t>> sentShapes, receivedShapes;
    std::vector<collectives::P2POp> resend;  // activations whose shape changed, sent next
    auto shapeOf = [](const at::Tensor& t) {
      std::vector<int64_t> v{static_cast<int64_t>(t.scalar_type())};
      for (int64_t d = 0; d < t.dim(); ++d) v.push_back(t.size(d));
      return v;
    };
    // An uninitialised tensor of a shape as above.
    auto emptyOf = [&](const std::vector<int64_t>& shape) {
      return at::empty(std::vector<int64_t>(shape.begin() + 1, shape.end()),
                       onDevice(static_cast<at::ScalarType>(shape[0])));
    };
    auto sendForward = [&](const at::Tensor& y, std::vector<collectives::P2POp>& ops) {
      if (lastStage) return;
      at::Tensor data = y.detach().contiguous();
      if (data.dim() < 1 || data.size(0) != sliceEnd - sliceBegin) {
        SINEW_THROW(InvalidArgument, "layer '", spec_.layers[mine.endLayer - 1].name,
                    "' (the last of stage ", s, ") outputs a tensor whose first dimension is not ",
                    "the ", sliceEnd - sliceBegin, " samples it was given");
      }
      const bool guessed = !sentShapes.empty();
      sentShapes.resize(nextPieces.size());
      for (size_t i = 0; i < nextPieces.size(); ++i) {
        const Piece& p = nextPieces[i];
        at::Tensor part = rows(data, p);
        std::vector<int64_t> shape = shapeOf(part);
        ops.push_back(collectives::P2POp::send(header(part), p.rank, kTagHeader));
        if (!guessed || shape == sentShapes[i]) {
          ops.push_back(collectives::P2POp::send(part, p.rank, kTagActivation));
        } else {
          ops.push_back(
              collectives::P2POp::send(emptyOf(sentShapes[i]).zero_(), p.rank, kTagActivation));
          resend.push_back(collectives::P2POp::send(part, p.rank, kTagActivation));
        }
        sentShapes[i] = std::move(shape);
      }
    };
    // After an exchange with sendForward's operations: the activations that did not have the
    // shape their receivers expected.
    auto sendChanged = [&] {
      if (resend.empty()) return;
      std::vector<collectives::P2POp> ops;
      ops.swap(resend);
      exchange(std::move(ops));
    };
    // After `pre` (sends of the same exchange) completes with the headers' receives.
    auto inputFor = [&](int64_t k, std::vector<collectives::P2POp> pre) -> at::Tensor {
      if (firstStage) {
        exchange(std::move(pre));
        return microbatchData(indices, mine.microbatches[k], sliceBegin, sliceEnd).first;
      }
      std::vector<at::Tensor> headers;
      // The pieces' receives sized as the last microbatch's (see sentShapes).
      std::vector<at::Tensor> guesses;
      const bool guessed = !receivedShapes.empty();
      for (size_t i = 0; i < prevPieces.size(); ++i) {
        const Piece& p = prevPieces[i];
        headers.push_back(at::zeros({2 + kMaxDims}, onDevice(at::kLong)));
        pre.push_back(collectives::P2POp::recv(headers.back(), p.rank, kTagHeader));
        if (guessed) {
          guesses.push_back(emptyOf(receivedShapes[i]));
          pre.push_back(collectives::P2POp::recv(guesses.back(), p.rank, kTagActivation));
        }
      }
      exchange(std::move(pre));
      std::vector<int64_t> shape;
      std::vector<std::vector<int64_t>> received;
      for (size_t i = 0; i < prevPieces.size(); ++i) {
        std::vector<int64_t> sizes = fromHeader(headers[i], prevPieces[i]);
        if (i == 0) {
          shape = sizes;
          shape[1] = sliceEnd - sliceBegin;
        } else if (sizes[0] != shape[0] || sizes.size() != shape.size() ||
                   !std::equal(sizes.begin() + 2, sizes.end(), shape.begin() + 2)) {
          SINEW_THROW(Corruption, "stage ", s, " received activation parts of different types ",
                      "or shapes from the workers of stage ", s - 1);
        }
        received.push_back(std::move(sizes));
      }
      const bool allGuessed =
          guessed && std::equal(received.begin(), received.end(), receivedShapes.begin());
      if (allGuessed && prevPieces.size() == 1) {
        receivedShapes = std::move(received);
        at::Tensor x = guesses[0];  // One piece: the whole slice, already here.
        if (at::isFloatingType(x.scalar_type())) x.requires_grad_(true);
        return x;
      }
      at::Tensor x = emptyOf(shape);
      std::vector<collectives::P2POp> ops;
      for (size_t i = 0; i < prevPieces.size(); ++i) {
        const Piece& p = prevPieces[i];
        if (guessed && received[i] == receivedShapes[i]) {
          rows(x, p).copy_(guesses[i]);  // It came with the header.
        } else {
          ops.push_back(collectives::P2POp::recv(rows(x, p), p.rank, kTagActivation));
        }
      }
      receivedShapes = std::move(received);
      exchange(std::move(ops));
      if (at::isFloatingType(x.scalar_type())) x.requires_grad_(true);
      return x;
    };
    auto forward = [&](int64_t k, at::Tensor x) {
      InFlight f;
      f.x = x;
      f.y = model_->forward(x);
      if (lastStage) {
        at::Tensor target =
            microbatchData(indices, mine.microbatches[k], sliceBegin, sliceEnd).second;
        f.loss = spec_.loss(f.y, target);
        lossSum += f.loss.item<double>() * static_cast<double>(sliceEnd - sliceBegin);
      }
      inFlight.push_back(std::move(f));
    };
    // A gradient comes back for an activation iff it is floating point.
    auto gradientFor = [&](const InFlight& f, std::vector<collectives::P2POp>& ops) {
      at::Tensor g;
      if (!lastStage && at::isFloatingType(f.y.scalar_type())) {
        g = at::empty(f.y.sizes(), f.y.options().requires_grad(false));
        for (const Piece& p : nextPieces) {
          ops.push_back(collectives::P2POp::recv(rows(g, p), p.rank, kTagGradient));
        }
      }
      return g;
    };
    // Backward of the oldest microbatch in flight; adds the send of its input's gradient.
    auto backward = [&](const at::Tensor& g, std::vector<collectives::P2POp>& ops) {
      InFlight f = std::move(inFlight.front());
      inFlight.pop_front();
      if (firstBackward) state_.injector.fire(ctx_.worker(), step_, Phase::kBackward, &client_);
      firstBackward = false;
      if (lastStage) {
        (f.loss * scale).backward();
      } else if (g.defined() && f.y.requires_grad()) {
        f.y.backward(g);
      }
      if (!firstStage && at::isFloatingType(f.x.scalar_type())) {
        at::Tensor dx = f.x.grad().defined() ? f.x.grad().contiguous() : at::zeros_like(f.x);
        for (const Piece& p : prevPieces) {
          ops.push_back(collectives::P2POp::send(rows(dx.detach(), p), p.rank, kTagGradient));
        }
      }
    };
    // Warm-up: forwards only.
    for (int64_t k = 0; k < W; ++k) {
      forward(k, inputFor(k, {}));
      std::vector<collectives::P2POp> ops;
      sendForward(inFlight.back().y, ops);
      exchange(std::move(ops));
      sendChanged();
    }
    // Steady state: one forward, one backward.
    at::Tensor x;
    if (W < M) x = inputFor(W, {});
    for (int64_t k = W; k < M; ++k) {
      forward(k, x);
      std::vector<collectives::P2POp> ops;
      sendForward(inFlight.back().y, ops);
      at::Tensor g = gradientFor(inFlight.front(), ops);
      exchange(std::move(ops));
      sendChanged();
      std::vector<collectives::P2POp> back;
      backward(g, back);
      if (k + 1 < M) {
        x = inputFor(k + 1, std::move(back));
      } else {
        exchange(std::move(back));
      }
    }
    // Cool-down: backwards only.
    while (!inFlight.empty()) {
      std::vector<collectives::P2POp> ops;
      at::Tensor g = gradientFor(inFlight.front(), ops);
      exchange(std::move(ops));
      std::vector<collectives::P2POp> back;
      backward(g, back);
      exchange(std::move(back));
    }
    return lossSum;
  }

  // ---- Durable checkpoints ----------------------------------------------------------

  // Parameters and optimizer state, per layer (the Sequential's children, keyed by name).
  checkpoint::ShardState shardState() {
    checkpoint::ShardState out;
    auto& st = opt_->state();
    for (const auto& child : model_->named_children()) {
      checkpoint::LayerState layer;
      layer.name = child.key();
      for (const auto& np : child.value()->named_parameters(/*recurse=*/true)) {
        const at::Tensor& p = np.value();
        const std::string& n = np.key();
        layer.tensors.push_back({n, p.detach()});
        auto it = st.find(stateKey(st, p));
        if (it == st.end()) continue;
        if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(it->second.get())) {
          layer.tensors.push_back({n + ".exp_avg", a->exp_avg()});
          layer.tensors.push_back({n + ".exp_avg_sq", a->exp_avg_sq()});
          if (a->max_exp_avg_sq().defined()) {
            layer.tensors.push_back({n + ".max_exp_avg_sq", a->max_exp_avg_sq()});
          }
          layer.tensors.push_back({n + ".step", at::full({1}, a->step(), at::kLong)});
        } else if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
          if (s->momentum_buffer().defined()) {
            layer.tensors.push_back({n + ".momentum_buffer", s->momentum_buffer()});
          }
        }
      }
      if (!layer.tensors.empty()) out.push_back(std::move(layer));
    }
    return out;
  }

  // Whether this worker writes durable checkpoints: in data parallel mode the epoch's first
  // member (it holds every layer); in pipeline mode the first worker of every stage of
  // pipeline 0 (together they hold every layer once), its first stage committing the version.
  bool checkpointWriter() const {
    if (!pipelineMode_) return !members_.empty() && members_.front() == ctx_.worker();
    const pipeline::WorkerAssignment* mine = mineIn(plan_);
    return mine != nullptr && mine->pipeline == 0 && indexInStage() == 0;
  }

  enum class FlushHow { kAlone, kPost, kCommit };
  struct FlushJob {
    std::shared_ptr<const checkpoint::HostShard> shard;
    FlushHow how = FlushHow::kAlone;
    std::vector<int> others;  // kCommit: the other writers whose records it waits for
    bool shared = false;      // The shard is the peer-RAM engine's copy of the version.
  };

  static std::string recordKey(int64_t step, int owner) {
    return "sinew/pipeline/checkpoint/" + std::to_string(step) + "/w" + std::to_string(owner);
  }

  // After the optimizer step of `step`: a writer snapshots a due version. `peerFollows`: the
  // caller calls maybePeerSnapshot(step) next and then settleSharedSnapshot(step), so when the
  // peer-RAM version of `step` is due too, the engine's snapshot of it is flushed instead of a
  // second copy into this worker's own arena.
  void maybeCheckpoint(int64_t step, bool force = false, bool peerFollows = false) {
    if (o_.checkpointDir.empty() || !checkpointWriter()) return;
    bool due = (o_.checkpointEvery > 0 && (step + 1) % o_.checkpointEvery == 0) ||
               step == o_.steps - 1 || force;
    if (!due || step == lastSnapshot_) return;
    // Pipeline mode writes every due version on every writer (a version needs all of their
    // shards), so it waits for the previous one instead of skipping it. The job's last step
    // is never skipped either (docs/failure_semantics.md, rule 4).
    const bool wait = force || pipelineMode_ || step == o_.steps - 1;
    // Waiting on the disk is not being stuck: the step deadline does not count it.
    std::optional<WaitingOnOthers> onDisk;
    if (wait) onDisk.emplace(client_, step_, &stepWaited_);
    if (wait && arena_) waitForSnapshot(/*complete=*/true);  // Its copy is in no step's way.
    {
      std::unique_lock<std::mutex> lock(ckMu_);
      if (wait) ckCv_.wait(lock, [&] { return ckOutstanding_ == 0; });
      if (ckOutstanding_ > 0) {
        ckSkipped_++;  // The previous version is still being written: never block a step.
        return;
      }
      ckHow_ = FlushHow::kAlone;
      ckOthers_.clear();
      if (pipelineMode_) {
        const pipeline::WorkerAssignment* mine = mineIn(plan_);
        ckHow_ = mine->stage == 0 ? FlushHow::kCommit : FlushHow::kPost;
        for (int stage = 1;; ++stage) {
          std::vector<int> ws = stageWorkers(0, stage);
          if (ws.empty()) break;
          ckOthers_.push_back(ws.front());
        }
      }
    }
    if (!writer_) {
      // Once per worker: a reconfiguration that changes its layers makes a new arena (of the
      // new layout) but keeps the writer and its flush thread.
      checkpoint::PersistOptions po;
      po.dir = o_.checkpointDir;
      po.keep = o_.checkpointKeep;
      po.env = state_.checkpointEnv;
      writer_ = std::make_unique<checkpoint::CheckpointWriter>(po);
      flushThread_ = std::thread([this] { flushLoop(); });
    }
    if (peerFollows && peerVersionDue(step)) {
      // One copy for both: the engine's completion hook queues its shard of `step` for the
      // flush (settleSharedSnapshot takes this worker's own snapshot if the engine does not).
      std::lock_guard<std::mutex> lock(ckMu_);
      ckOutstanding_++;
      ckFromEngine_ = step;
      lastSnapshot_ = step;
      return;
    }
    snapshotForDisk(step);
  }

  // The shard of a due durable version, copied into this worker's own arena (its completion
  // queues the flush). REQUIRES: the writer exists and ckHow_/ckOthers_ are set for `step`.
  void snapshotForDisk(int64_t step) {
    checkpoint::ShardState state = shardState();
    if (!arena_) {
      checkpoint::SnapshotOptions so;
      so.owner = ctx_.worker();
      arena_ = std::make_unique<checkpoint::SnapshotArena>(state, so);
      arena_->setOnComplete([this](std::shared_ptr<const checkpoint::HostShard> shard) {
        std::lock_guard<std::mutex> lock(ckMu_);
        toFlush_.push_back({std::move(shard), ckHow_, ckOthers_});
        ckCv_.notify_all();
      });
      // A copy that failed is never flushed: it no longer counts as outstanding (its error
      // reaches the training thread through the arena's next wait or snapshot).
      arena_->setOnFailed([this](int64_t, std::exception_ptr) {
        std::lock_guard<std::mutex> lock(ckMu_);
        ckOutstanding_--;
        ckCv_.notify_all();
      });
    }
    {
      // Counted before the copy starts, so the flush of a fast copy never finds it at 0.
      std::lock_guard<std::mutex> lock(ckMu_);
      ckOutstanding_++;
    }
    bool taken = false;
    try {
      taken = arena_->snapshot(step, state);
    } catch (...) {
      std::lock_guard<std::mutex> lock(ckMu_);
      ckOutstanding_--;
      ckCv_.notify_all();
      throw;
    }
    if (taken) {
      lastSnapshot_ = step;
    } else {
      std::lock_guard<std::mutex> lock(ckMu_);
      ckOutstanding_--;
      ckSkipped_++;
      ckCv_.notify_all();
    }
    // While the copy is in flight (on a GPU: queued on the side stream).
    state_.injector.fire(ctx_.worker(), step, Phase::kSnapshot, &client_);
  }

  // ---- Peer-RAM versions (pipelines; docs/pipeline.md, "Peer-RAM versions") ----

  bool peerCheckpoints() const { return pipelineMode_ && o_.peerCheckpointEvery > 0; }

  // Whether maybePeerSnapshot(step) will try to take a version (it may still decline).
  bool peerVersionDue(int64_t step) const {
    return peerCheckpoints() && heldEnd_ > heldFirst_ &&
           ((step + 1) % o_.peerCheckpointEvery == 0 || step == o_.steps - 1);
  }

  // After maybePeerSnapshot(step) (`taken`: whether the engine took it): a durable version
  // of `step` left to the engine (maybeCheckpoint) that it did not take is copied into this
  // worker's own arena after all. With taken false while the engine's copy is in fact in
  // flight (maybePeerSnapshot threw after it), the hook finds the step no longer left to it
  // and ignores the copy, so the version is flushed exactly once either way.
  void settleSharedSnapshot(int64_t step, bool taken) {
    {
      std::lock_guard<std::mutex> lock(ckMu_);
      if (ckFromEngine_ != step || taken) return;
      ckFromEngine_ = -1;
      ckOutstanding_--;
    }
    snapshotForDisk(step);
  }

  // The engine's snapshot hooks (its copy thread): the shard of a durable version left to it
  // goes to the flush; a failed copy of one no longer counts as outstanding (its error reaches
  // the training thread through the engine's next wait).
  void onEngineSnapshot(const std::shared_ptr<const checkpoint::HostShard>& shard) {
    std::lock_guard<std::mutex> lock(ckMu_);
    if (shard->step != ckFromEngine_) return;
    ckFromEngine_ = -1;
    toFlush_.push_back({shard, ckHow_, ckOthers_, /*shared=*/true});
    ckCv_.notify_all();
  }
  // As a failed flush (rule 10 of docs/failure_semantics.md): reported, training goes on, and
  // run() rethrows it if no newer version is written (the engine's own rethrow comes only with
  // its next wait, which the job's last step never reaches).
  void onEngineSnapshotFailed(int64_t step, std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(ckMu_);
    if (step != ckFromEngine_) return;
    ckFromEngine_ = -1;
    ckOutstanding_--;
    recordCheckpointFailureLocked(step, error, "copy", "host memory");
    ckCv_.notify_all();
  }

  // A version that could not be made durable: kept for run() to rethrow unless a newer version
  // is written (rule 10 of docs/failure_semantics.md), printed, and reported as a
  // checkpoint_failed event: "could not <verb> checkpoint <step> to <where>: <error>".
  // REQUIRES: ckMu_ held.
  void recordCheckpointFailureLocked(int64_t step, std::exception_ptr error, const char* verb,
                                     const std::string& where) {
    flushError_ = error;
    flushErrorStep_ = step;
    const std::string why = describe(error);
    std::fprintf(stderr, "sinew: worker %d could not %s checkpoint %lld to %s: %s\n", ctx_.worker(),
                 verb, static_cast<long long>(step), where.c_str(), why.c_str());
    event({{"event", "checkpoint_failed"},
           {"step", step},
           {"dir", o_.checkpointDir},
           {"error", why}});
  }

  // The engine of one epoch that snapshotted (a generation): its workers and placement.
  struct Generation {
    int64_t epoch = -1;
    std::unique_ptr<checkpoint::CheckpointEngine> engine;
    int64_t lastTaken = -1;    // The newest version it snapshotted.
    int64_t failuresSeen = 0;  // Its replication failures when that version was taken.
  };

  // The gate the stages' transfers hold while in flight: this epoch's engine's, if any.
  checkpoint::TrafficGate* trafficGate() {
    if (gens_.empty() || gens_.back().epoch != epoch_) return nullptr;
    return &gens_.back().engine->trafficGate();
  }

  // The store prefix of the peer-RAM versions of epoch `epoch`'s generation.
  static std::string geminiPrefix(int64_t epoch) {
    return "sinew/gemini/e" + std::to_string(epoch);
  }
  static std::string geminiKey(int64_t epoch, const std::string& suffix) {
    return geminiPrefix(epoch) + "/" + suffix;
  }

  // The workers of `plan` that hold layers, in Gemini placement order: by pipeline, then
  // stage, so that a group (consecutive workers) holds different layers and the loss of every
  // live copy of a layer (its holders in all pipelines) leaves a replica of each of its shards.
  static std::vector<int> placementOrder(const Plan& plan) {
    std::vector<pipeline::WorkerAssignment> ws;
    for (const auto& w : plan.workers) {
      if (w.endLayer > w.firstLayer) ws.push_back(w);
    }
    std::sort(ws.begin(), ws.end(), [](const auto& a, const auto& b) {
      return std::tie(a.pipeline, a.stage, a.worker) < std::tie(b.pipeline, b.stage, b.worker);
    });
    std::vector<int> order;
    for (const auto& w : ws) order.push_back(w.worker);
    return order;
  }

  // After the optimizer step of `step`: every `peerCheckpointEvery`-th version (and the last
  // step's) is snapshotted into this epoch's engine, which replicates it to the peers of the
  // placement and commits it once every shard has `replicas` copies. A version is taken only
  // after the previous one of this epoch committed or was abandoned, so at most one version
  // per worker is in flight.
  // Returns whether the engine took the version of `step`.
  bool maybePeerSnapshot(int64_t step) {
    if (!peerVersionDue(step)) return false;
    const int self = ctx_.worker();
    if (gens_.empty() || gens_.back().epoch != epoch_) {
      std::vector<int> order = placementOrder(plan_);
      if (std::find(order.begin(), order.end(), self) == order.end()) return false;
      checkpoint::CheckpointEngineOptions eo;
      eo.self = self;
      eo.workers = std::move(order);
      eo.replication = o_.replicas;
      eo.store = ctx_.store();
      eo.prefix = geminiPrefix(epoch_);
      eo.token = state_.token;
      eo.service.host = ctx_.host();
      // The committed version, the newest complete one and one being taken: a version that
      // never commits (abandoned) does not keep the next one from being taken.
      eo.snapshot.slots = 3;
      // A peer that stopped answering fails the version within the operation deadline, so an
      // engine being dropped never waits long for its replication thread.
      eo.client.timeout = opTimeout();
      eo.client.connectTimeout = std::min(opTimeout(), std::chrono::milliseconds(5000));
      eo.timeout = recoveryTimeout();
      eo.beforeReplicate = [this](int64_t s) {
        state_.injector.fire(ctx_.worker(), s, Phase::kReplication, nullptr);
      };
      eo.onSnapshot = [this](std::shared_ptr<const checkpoint::HostShard> shard) {
        onEngineSnapshot(shard);
      };
      eo.onSnapshotFailed = [this](int64_t s, std::exception_ptr e) {
        onEngineSnapshotFailed(s, e);
      };
      Generation g;
      g.epoch = epoch_;
      g.engine = std::make_unique<checkpoint::CheckpointEngine>(shardState(), std::move(eo));
      // What this generation's shard holds, for a rollback's decision (rollbackTarget()).
      ctx_.store()->set(
          geminiKey(epoch_, "layers/" + std::to_string(self)),
          collectives::toBytes(std::to_string(heldFirst_) + " " + std::to_string(heldEnd_)));
      gens_.push_back(std::move(g));
    }
    Generation& g = gens_.back();
    if (g.lastTaken >= 0 && !waitPeerCommit(g)) return false;  // A newer epoch is announced.
    g.failuresSeen = g.engine->stats().replicationFailures;
    const bool taken = g.engine->snapshot(step, shardState());
    if (taken) g.lastTaken = step;
    state_.injector.fire(self, step, Phase::kSnapshot, &client_);
    // Generations older than the newest one with a committed version are never restored.
    for (size_t i = gens_.size(); i-- > 1;) {
      if (gens_[i].engine->committedStep() >= 0) {
        std::vector<std::unique_ptr<checkpoint::CheckpointEngine>> old;
        for (size_t k = 0; k < i; ++k) old.push_back(std::move(gens_[k].engine));
        gens_.erase(gens_.begin(), gens_.begin() + static_cast<std::ptrdiff_t>(i));
        for (auto& e : old) retire(std::move(e));
        break;
      }
    }
    return taken;
  }

  // Destroys an engine no longer needed off the training thread. Its destructor joins its
  // replication thread, which may be waiting up to opTimeout for the acknowledgement of a peer
  // that was stopped (SIGSTOP) rather than killed and has since been declared dead; on the
  // training thread that wait held up the step past the step deadline, and the coordinator
  // expelled this healthy worker too (PipelineRecoveryTest.StoppedReplicaPeerCostsOnlyItself).
  // The engine's snapshots completed before its generation was dropped.
  void retire(std::unique_ptr<checkpoint::CheckpointEngine> engine) {
    if (!engine) return;
    try {
      engine->arena().waitComplete();
    } catch (const std::exception&) {
      // Its failure was reported when it happened; the engine goes either way.
    }
    std::lock_guard<std::mutex> lock(retireMu_);
    retiring_.push_back(std::move(engine));
    if (!retireThread_.joinable()) retireThread_ = std::thread([this] { retireLoop(); });
    retireCv_.notify_all();
  }

  void retireLoop() {
    std::unique_lock<std::mutex> lock(retireMu_);
    for (;;) {
      retireCv_.wait(lock, [&] { return retireStop_ || !retiring_.empty(); });
      if (retiring_.empty()) return;  // Stopping, and nothing left.
      std::unique_ptr<checkpoint::CheckpointEngine> engine = std::move(retiring_.front());
      retiring_.pop_front();
      lock.unlock();
      engine.reset();  // Joins its threads.
      lock.lock();
    }
  }

  // Destroys every retired engine and joins the thread. Idempotent.
  void stopRetiring() {
    {
      std::lock_guard<std::mutex> lock(retireMu_);
      retireStop_ = true;
    }
    retireCv_.notify_all();
    if (retireThread_.joinable()) retireThread_.join();
  }

  // Waits until g's last version committed or was abandoned: this worker's replication of it
  // failed (then it abandons it for everyone, under <prefix>/abandoned/<s>), another worker
  // abandoned it, or recoveryTimeout passed. Returns false if a newer epoch was announced
  // meanwhile (the next step's operations see it). Counts as waiting on the others for the
  // next step (the step deadline's rule 1).
  bool waitPeerCommit(Generation& g) {
    const int64_t version = g.lastTaken;
    if (g.engine->committedStep() >= version) return true;
    const std::string abandoned = geminiKey(g.epoch, "abandoned/" + std::to_string(version));
    auto& store = *ctx_.store();
    WaitingOnOthers waiting(client_, step_ + 1, &stepWaited_);
    const auto deadline = Clock::now() + recoveryTimeout();
    std::string why;
    auto pause = checkpoint::CheckpointEngine::kFirstPoll;
    while (g.engine->committedStep() < version) {
      if (client_.latestEpoch().epoch > epoch_) return false;
      if (g.engine->stats().replicationFailures > g.failuresSeen) {
        why = "its replication failed: " + g.engine->stats().lastError;
        store.set(abandoned, collectives::toBytes(std::to_string(ctx_.worker())));
        break;
      }
      if (store.check({abandoned})) {
        why = "worker " + collectives::toString(store.get(abandoned)) + " abandoned it";
        break;
      }
      if (Clock::now() > deadline) {
        why = "it did not commit within " + std::to_string(recoveryTimeout().count()) + " ms";
        break;
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, checkpoint::CheckpointEngine::kLastPoll);
    }
    if (!why.empty()) {
      std::fprintf(stderr, "sinew: worker %d: peer-RAM version %lld abandoned: %s\n", ctx_.worker(),
                   static_cast<long long>(version), why.c_str());
      event({{"event", "peer_version_abandoned"}, {"step", version}, {"why", why}});
    }
    return true;
  }

  // The newest version at or before `upTo` from which every layer can be restored when the
  // workers in `live` are all that remain: a committed peer-RAM version (of a generation this
  // worker still keeps, or any if it keeps none) that, by its generation's placement and
  // published shard layers, some live worker holds every layer of; or a durable version in
  // checkpointDir. -1 if there is none (the job then starts over from the seeds).
  int64_t rollbackTarget(int64_t upTo, int64_t epoch, const std::vector<int>& live,
                         collectives::Store& store) {
    const int numLayers = static_cast<int>(spec_.layers.size());
    auto isLive = [&](int w) { return std::find(live.begin(), live.end(), w) != live.end(); };
    const int64_t oldest = gens_.empty() ? 0 : gens_.front().epoch;
    int64_t best = -1;
    for (int64_t e = epoch; e >= oldest; --e) {
      const std::string prefix = geminiPrefix(e);
      // upTo itself if it committed here (a version may commit after a first decision), else
      // the generation's newest.
      auto record = checkpoint::CheckpointEngine::commitRecordIn(store, prefix, upTo);
      if (!record) {
        const int64_t c = checkpoint::CheckpointEngine::committedIn(store, prefix);
        if (c < 0 || c > upTo) continue;
        record = checkpoint::CheckpointEngine::commitRecordIn(store, prefix, c);
      }
      if (!record || record->step <= best) continue;
      checkpoint::ReplicaPlacement placement(record->workers, record->replication);
      std::vector<bool> covered(numLayers, false);
      for (int w : record->workers) {
        const auto& holders = placement.holders(w);
        if (std::none_of(holders.begin(), holders.end(), isLive)) continue;
        std::istringstream is(collectives::toString(
            store.get(geminiKey(e, "layers/" + std::to_string(w)), recoveryTimeout())));
        int first = 0, end = 0;
        if (!(is >> first >> end)) continue;
        for (int l = std::max(first, 0); l < std::min(end, numLayers); ++l) covered[l] = true;
      }
      bool all = true;
      for (int l = 0; l < numLayers; ++l) all = all && (covered[l] || !hasParameters(l));
      if (all) best = record->step;
    }
    if (!o_.checkpointDir.empty()) {
      // The newest durable version at or before upTo (restoreLayers verifies its checksums).
      for (int64_t d :
           checkpoint::CheckpointReader(o_.checkpointDir, state_.checkpointEnv).durableSteps()) {
        if (d <= upTo) {
          best = std::max(best, d);
          break;
        }
      }
    }
    return best;
  }

  // Whether layer l has parameters (from the profile; without one, assume it has).
  bool hasParameters(int l) const {
    return profile_.layers.size() != spec_.layers.size() || profile_.layers[l].param_bytes > 0;
  }

  // Restores `layers` of version `step`: this worker's own RAM (its snapshots and the
  // replicas it holds, of every generation it keeps), then the RAM of the live workers of
  // those generations, then checkpointDir (checkpoint::restoreLayers; every tensor's crc32c is
  // checked, a damaged or missing copy moves on to the next source).
  checkpoint::RestoreResult restoreVersion(int64_t step, const std::vector<std::string>& layers,
                                           const std::vector<int>& live) {
    checkpoint::RestoreSources src;
    for (auto it = gens_.rbegin(); it != gens_.rend(); ++it) {
      checkpoint::RestoreSources g = it->engine->restoreSources(step);
      src.local.insert(src.local.end(), g.local.begin(), g.local.end());
      for (auto& peer : g.peers) {
        // Workers that left are gone (a stopped one would only cost its timeout).
        if (std::find(live.begin(), live.end(), peer.first) != live.end()) {
          src.peers.push_back(std::move(peer));
        }
      }
      src.client = g.client;
    }
    src.client.token = state_.token;
    src.client.connectTimeout = std::chrono::milliseconds(1000);
    src.client.timeout = recoveryTimeout();
    src.dir = o_.checkpointDir;
    src.env = state_.checkpointEnv;
    return checkpoint::restoreLayers(src, step, layers);
  }

  // Waits for every peer-RAM snapshot in flight (their copies read the layers' tensors).
  void waitPeerSnapshots() {
    for (auto& g : gens_) {
      try {
        g.engine->arena().waitComplete();
      } catch (const std::exception& e) {
        std::fprintf(stderr, "sinew: worker %d: a peer-RAM snapshot failed: %s\n", ctx_.worker(),
                     e.what());
      }
    }
  }

  void flushLoop() {
    std::unique_lock<std::mutex> lock(ckMu_);
    while (true) {
      ckCv_.wait(lock, [&] { return ckStop_ || !toFlush_.empty(); });
      if (toFlush_.empty()) return;  // Stopping with nothing left to write.
      FlushJob job = std::move(toFlush_.front());
      toFlush_.pop_front();
      lock.unlock();
      auto t0 = Clock::now();
      std::exception_ptr error;
      const auto& shard = job.shard;
      try {
        state_.injector.fire(ctx_.worker(), shard->step, Phase::kFlush, nullptr);
        flushOne(job);
      } catch (...) {
        error = std::current_exception();
      }
      double took = seconds(Clock::now() - t0);
      lock.lock();
      ckOutstanding_--;
      if (!error) {
        ckWritten_++;
        if (shard->step >= flushErrorStep_) flushError_ = nullptr;  // A newer one is durable.
        event({{"event", "checkpoint"},
               {"step", shard->step},
               {"duration_s", took},
               {"shared_snapshot", job.shared}});
        state_.injector.afterFlush(ctx_.worker(), shard->step, o_.checkpointDir);
        // The writer that moved LATEST tells the coordinator (its status and /metrics).
        if (job.how != FlushHow::kPost) {
          client_.durable(shard->step, shard->capacity(), took, o_.checkpointDir);
        }
      } else {
        // Reported, and training goes on: a later version may be written. run() rethrows it
        // only if no newer version was written after it (docs/failure_semantics.md, rule 10).
        recordCheckpointFailureLocked(shard->step, error, "write", "'" + o_.checkpointDir + "'");
      }
      ckCv_.notify_all();
    }
  }

  // Writes one version's shard: alone (data parallel), or as one of pipeline 0's writers,
  // posting its manifest entries to the store (kPost) or collecting everyone's and
  // committing the version (kCommit). Runs on the flush thread.
  void flushOne(const FlushJob& job) {
    const checkpoint::HostShard& shard = *job.shard;
    if (job.how == FlushHow::kAlone) {
      writer_->flush({job.shard});
      return;
    }
    checkpoint::ShardFileRecord mine = writer_->writeShard(shard);
    const auto& store = ctx_.store();
    if (job.how == FlushHow::kPost) {
      store->set(recordKey(shard.step, ctx_.worker()), collectives::toBytes(mine.toJson()));
      return;
    }
    std::vector<std::string> keys;
    for (int w : job.others) keys.push_back(recordKey(shard.step, w));
    // Polled, not one blocking wait: a writer that left the job before posting its shard
    // never will, so the version cannot be completed. The flush then fails at once, reported,
    // and training goes on (docs/failure_semantics.md, rule 10) instead of this thread
    // waiting out the recovery deadline with the version's successors queued behind it.
    const auto deadline = Clock::now() + recoveryTimeout();
    auto pause = checkpoint::CheckpointEngine::kFirstPoll;
    while (!store->check(keys)) {
      const EpochInfo latest = client_.latestEpoch();
      for (size_t i = 0; i < keys.size(); ++i) {
        const int w = job.others[i];
        if (std::find(latest.members.begin(), latest.members.end(), w) == latest.members.end() &&
            !store->check({keys[i]})) {
          SINEW_THROW(Aborted, "checkpoint ", shard.step, " is not durable: worker ", w,
                      ", one of pipeline 0's writers, left the job (epoch ", latest.epoch,
                      ") before its shard of it arrived");
        }
      }
      if (Clock::now() > deadline) {
        SINEW_THROW(Timeout, "checkpoint ", shard.step, ": the shards of pipeline 0's other ",
                    "writers did not all arrive within ", recoveryTimeout().count(), " ms");
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, checkpoint::CheckpointEngine::kLastPoll);
    }
    std::vector<checkpoint::ShardFileRecord> records = {mine};
    for (const std::string& k : keys) {
      records.push_back(checkpoint::ShardFileRecord::fromJson(
          collectives::toString(store->get(k, recoveryTimeout()))));
    }
    writer_->commitVersion(shard.step, records);
    for (const std::string& k : keys) store->deleteKey(k);
  }

  // Waits for the copy of the last snapshot: until the state may be updated, or (complete)
  // until the snapshot is whole. The error of a copy that failed propagates (its outstanding
  // count was dropped by the arena's onFailed).
  void waitForSnapshot(bool complete = false) {
    if (complete) {
      arena_->waitComplete();
    } else {
      arena_->waitBeforeUpdate();
    }
  }

  // Waits until the last snapshot is copied and every version taken is flushed.
  void finishCheckpoints() {
    if (!writer_) return;
    if (arena_) waitForSnapshot(/*complete=*/true);
    std::unique_lock<std::mutex> lock(ckMu_);
    ckCv_.wait(lock, [&] { return ckOutstanding_ == 0; });
  }

  void stopFlushThread() {
    {
      std::lock_guard<std::mutex> lock(ckMu_);
      ckStop_ = true;
      ckCv_.notify_all();
    }
    if (flushThread_.joinable()) flushThread_.join();
  }

  // A checkpoint directory that cannot be written is an error at start, before any training
  // (docs/failure_semantics.md, rule 6): created if missing, then probed with a file.
  void checkCheckpointDir() {
    const std::string& dir = o_.checkpointDir;
    auto fail = [&](const std::string& why) {
      SINEW_THROW(InvalidArgument, "worker ", ctx_.worker(), " cannot write checkpoints to '", dir,
                  "' (TrainerOptions::checkpointDir): ", why);
    };
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) fail("creating it failed: " + ec.message());
    if (!std::filesystem::is_directory(dir, ec)) fail("it is not a directory");
    const std::string probe = dir + "/.probe-w" + std::to_string(ctx_.worker()) + "-" +
                              std::to_string(static_cast<long long>(::getpid()));
    int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) fail(std::string("creating a file in it failed: ") + std::strerror(errno));
    const char byte = 0;
    const bool wrote = ::write(fd, &byte, 1) == 1;
    const int writeErrno = errno;
    ::close(fd);
    ::unlink(probe.c_str());
    if (!wrote) fail(std::string("writing a file in it failed: ") + std::strerror(writeErrno));
  }

  // The newest durable version this worker can read back whole, or -1 if there is none
  // (docs/failure_semantics.md, rule 5): versions up to the one LATEST names (every manifest
  // if LATEST itself is damaged), newest first; a version with a corrupt or missing file is
  // reported and the one before is tried. Every worker reads the same files, so all agree.
  // Throws Corruption if versions exist but none can be read (starting over would lose them).
  int64_t newestRestorable() {
    checkpoint::CheckpointReader reader(o_.checkpointDir, state_.checkpointEnv);
    int64_t latest = -1;
    bool latestDamaged = false;
    try {
      latest = reader.latestStep();
    } catch (const Error& e) {
      latestDamaged = true;
      std::fprintf(stderr, "sinew: worker %d: %s; looking for the newest intact version\n",
                   ctx_.worker(), e.what());
      event({{"event", "checkpoint_unreadable"}, {"what", "LATEST"}, {"error", e.what()}});
    }
    std::vector<int64_t> steps = reader.durableSteps();
    std::string lastError;
    for (int64_t step : steps) {
      if (!latestDamaged && step > latest) continue;  // Never committed.
      try {
        auto layers = reader.load(step);
        if (!pipelineMode_ && o_.parallelism != Parallelism::kPipeline) {
          validated_ = std::move(layers);  // The source restores from it without reading again.
          validatedStep_ = step;
        }
        if (latestDamaged || step < latest) {
          // LATEST names a damaged version: name this one instead, so that the versions this
          // run writes (newer than `step`, maybe older than the damaged one) are not refused
          // as a stale writer's (rule 8). Every worker does the same, under the lock.
          checkpoint::repointLatest(o_.checkpointDir, state_.checkpointEnv, step);
        }
        return step;
      } catch (const Error& e) {
        lastError = e.what();
        std::fprintf(stderr,
                     "sinew: worker %d: the checkpoint of step %lld cannot be restored (%s); "
                     "trying the one before\n",
                     ctx_.worker(), static_cast<long long>(step), e.what());
        event({{"event", "checkpoint_unreadable"}, {"step", step}, {"error", e.what()}});
      }
    }
    if (!lastError.empty() || latestDamaged) {
      SINEW_THROW(Corruption, "no checkpoint in '", o_.checkpointDir,
                  "' can be restored; the last error: ",
                  lastError.empty() ? std::string("LATEST is damaged and no version has a manifest")
                                    : lastError);
    }
    return -1;
  }

  // Loads version `step` from checkpointDir into the parameters and optimizer state.
  void restoreFromDisk(int64_t step) {
    if (o_.checkpointDir.empty()) {
      SINEW_THROW(InvalidArgument, "TrainerOptions::checkpointDir is empty on worker ",
                  ctx_.worker(), ", but the job resumes at step ", step + 1,
                  " from a checkpoint it must restore");
    }
    auto t0 = Clock::now();
    std::vector<std::string> names;  // The layers this worker holds that have state.
    for (const auto& child : model_->named_children()) {
      if (child.value()->parameters().size() > 0) names.push_back(child.key());
    }
    if (names.empty()) {
      applied_ = step;
      return;
    }
    auto layers = validatedStep_ == step
                      ? std::move(validated_)
                      : checkpoint::CheckpointReader(o_.checkpointDir, state_.checkpointEnv)
                            .load(step, names);
    validated_.clear();
    validatedStep_ = -1;
    loadState(layers, "TrainerOptions::checkpointDir = '" + o_.checkpointDir +
                          "': its checkpoint " + std::to_string(step));
    applied_ = step;
    event({{"event", "restored"},
           {"step", step},
           {"dir", o_.checkpointDir},
           {"duration_s", seconds(Clock::now() - t0)}});
  }

  // Loads the parameters and optimizer state (SGD, Adam) of every layer of model_ that has
  // parameters from `layers` (layer name -> tensor name -> tensor, named as in checkpoints:
  // "<param>", "<param>.exp_avg", ...), onto this worker's device. `source` names where they
  // came from, for errors.
  void loadState(const std::map<std::string, checkpoint::RestoredLayer>& layers,
                 const std::string& source) {
    at::NoGradGuard noGrad;
    auto& st = opt_->state();
    for (const auto& child : model_->named_children()) {
      auto params = child.value()->named_parameters(/*recurse=*/true);
      if (params.size() == 0) continue;
      auto lit = layers.find(child.key());
      if (lit == layers.end()) {
        SINEW_THROW(InvalidArgument, source, " has no layer '", child.key(),
                    "' (a checkpoint of another model?)");
      }
      const auto& saved = lit->second;
      auto get = [&](const std::string& n) -> const at::Tensor* {
        auto it = saved.find(n);
        return it == saved.end() ? nullptr : &it->second;
      };
      for (const auto& np : params) {
        at::Tensor p = np.value();
        const std::string& n = np.key();
        const at::Tensor* v = get(n);
        if (v == nullptr || v->sizes() != p.sizes()) {
          SINEW_THROW(InvalidArgument, source, ", layer '", child.key(), "' tensor '", n,
                      "' is missing or has another shape (a checkpoint of another model?)");
        }
        p.detach().copy_(*v);
        if (const at::Tensor* m = get(n + ".exp_avg")) {
          auto a = std::make_unique<torch::optim::AdamParamState>();
          a->exp_avg(m->to(p.device(), p.scalar_type()).clone());
          a->exp_avg_sq(get(n + ".exp_avg_sq")->to(p.device(), p.scalar_type()).clone());
          if (const at::Tensor* mx = get(n + ".max_exp_avg_sq")) {
            a->max_exp_avg_sq(mx->to(p.device(), p.scalar_type()).clone());
          }
          a->step(get(n + ".step")->item<int64_t>());
          st[stateKey(st, p)] = std::move(a);
        } else if (const at::Tensor* b = get(n + ".momentum_buffer")) {
          auto s = std::make_unique<torch::optim::SGDParamState>();
          s->momentum_buffer(b->to(p.device(), p.scalar_type()).clone());
          st[stateKey(st, p)] = std::move(s);
        }
      }
    }
  }

  // Called by the training and the flush thread.
  void event(nlohmann::json e) { events_.write(std::move(e)); }

  static constexpr std::chrono::milliseconds kNudge{3000};

  Context& ctx_;
  runtime::ContextState& state_;  // ctx_'s; the Context outlives the trainer.
  CoordinatorClient& client_;
  ModelSpec spec_;
  TrainerOptions o_;
  torch::nn::Sequential model_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<torch::optim::Optimizer> opt_;
  std::mutex commMu_;
  // Guarded by commMu_ (the client's io thread aborts it on a new epoch).
  std::unique_ptr<collectives::Communicator> comm_;
  std::vector<GradGroup> groups_;  // Pipeline mode; guarded by commMu_ like comm_.
  bool pipelineMode_ = false;
  // Set by relayoutLayers just before it throws Corruption for a damaged copy (recoverInto
  // tries the epoch again for those, and no other corruption).
  bool copyDamaged_ = false;
  at::Device device_{at::kCPU};  // Where this worker's layers live (TrainerOptions::device).
  std::string backend_;          // The current epoch's transfers: "gloo" or "nccl".
  std::string backendWhy_;       // Why, as last reported.
  pipeline::Profile profile_;    // The job's, as agreed.
  pipeline::Profile myProfile_;  // This worker's measurement.
  // The version newestRestorable() read back whole (data parallel), kept for restoreFromDisk.
  std::map<std::string, checkpoint::RestoredLayer> validated_;
  int64_t validatedStep_ = -1;
  int heldFirst_ = -1;  // The layers this worker holds in pipeline mode, [heldFirst_, heldEnd_).
  int heldEnd_ = -1;
  double scheduleSeconds_ = 0;      // runSchedule() time since the last progress report.
  double scheduleWaitSeconds_ = 0;  // Of which in its exchanges.
  int64_t epoch_ = -1;
  std::vector<int> members_;
  Plan plan_;
  int64_t step_ = 0;
  int64_t applied_ = -1;
  double lastLoss_ = 0;
  int recoveries_ = 0;
  double recoveryMax_ = 0;
  Clock::time_point lastReport_;
  int64_t stepsSinceReport_ = 0;
  runtime::EventLog events_;
  int64_t startStep_ = 0;
  bool leaveSent_ = false;
  int64_t lastSnapshot_ = -1;
  // Peer-RAM versions (pipelines): one engine per epoch that snapshotted, oldest first.
  std::deque<Generation> gens_;
  // Engines of dropped generations, destroyed on retireThread_ (retire()).
  std::mutex retireMu_;
  std::condition_variable retireCv_;
  std::deque<std::unique_ptr<checkpoint::CheckpointEngine>> retiring_;  // Guarded by retireMu_.
  bool retireStop_ = false;                                             // Guarded by retireMu_.
  std::thread retireThread_;
  // Durable checkpoints (the writers only: checkpointWriter()).
  std::unique_ptr<checkpoint::SnapshotArena> arena_;
  std::unique_ptr<checkpoint::CheckpointWriter> writer_;
  std::thread flushThread_;
  double ckStall_ = 0;
  // The step being run: when it started, how long it waited on the others, and the snapshot
  // stall before the previous step's optimizer step (reported with the vote).
  Clock::time_point stepStart_{};
  double stepWaited_ = 0;
  double lastStall_ = 0;
  std::mutex ckMu_;
  std::condition_variable ckCv_;
  // Guarded by ckMu_.
  std::deque<FlushJob> toFlush_;
  int64_t ckOutstanding_ = 0;  // Snapshots taken and not yet flushed (or failed).
  int64_t ckFromEngine_ = -1;  // The durable version whose shard the engine's copy provides.
  FlushHow ckHow_ = FlushHow::kAlone;  // How the snapshot being copied is to be flushed.
  std::vector<int> ckOthers_;
  bool ckStop_ = false;
  int64_t ckWritten_ = 0;
  int64_t ckSkipped_ = 0;
  // The newest failed flush, cleared when a newer version is written; rethrown by run().
  std::exception_ptr flushError_;
  int64_t flushErrorStep_ = -1;
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

}  // namespace sinew
