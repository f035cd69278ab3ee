#include "sinew/trainer.h"

#include <ATen/ATen.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "sinew/checkpoint/persist.h"
#include "sinew/checkpoint/snapshot.h"
#include "sinew/collectives/error.h"
#include "sinew/communicator.h"
#include "sinew/pipeline/plan.h"
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

torch::nn::Sequential buildModel(const ModelSpec& spec, uint64_t seed, at::ScalarType dtype) {
  if (spec.layers.empty()) SINEW_THROW(InvalidArgument, "ModelSpec::layers is empty");
  at::manual_seed(seed);
  torch::nn::Sequential seq;
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    const auto& l = spec.layers[i];
    if (!l.build) {
      SINEW_THROW(InvalidArgument, "ModelSpec::layers[", i, "] ('", l.name,
                  "') has no build factory");
    }
    seq->push_back(l.name, l.build());
  }
  seq->to(dtype);
  return seq;
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
    params_ = model_->parameters();
    opt_ = spec_.optimizer(params_);
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

  ~Impl() {
    client_.setEpochListener(nullptr);
    arena_.reset();  // Joins the copy thread, whose completion callback uses ckMu_.
    stopFlushThread();
  }

  TrainResult run() {
    client_.setEpochListener([this](int64_t epoch) {
      std::lock_guard<std::mutex> lock(commMu_);
      if (comm_ && (epoch < 0 || epoch > comm_->epoch())) comm_->abort();
    });
    int64_t resume = 0;
    if (!o_.checkpointDir.empty()) {
      int64_t latest =
          checkpoint::CheckpointReader(o_.checkpointDir, state_.checkpointEnv).latestStep();
      if (latest >= 0) resume = latest + 1;
    }
    client_.ready(resume);
    recoverInto(-1, /*failure=*/false, "start");
    startStep_ = step_;
    bool preempted = false;
    while (step_ < o_.steps) {
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
      if (applied_ >= 0 && !members_.empty() && members_.front() == ctx_.worker()) {
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
    {
      std::lock_guard<std::mutex> lock(commMu_);
      comm_.reset();  // Healthy: its peers are told it closed, not that it aborted.
    }
    std::exception_ptr flushError;
    {
      std::lock_guard<std::mutex> lock(ckMu_);
      flushError = flushError_;
    }
    if (flushError) std::rethrow_exception(flushError);  // A durable checkpoint failed.
    return r;
  }

 private:
  // One step; returns false when the coordinator reshapes the job right after it.
  bool runStep() {
    if (client_.latestEpoch().epoch != epoch_) {
      SINEW_THROW(EpochChanged, "epoch ", epoch_, " was superseded");
    }
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
      std::vector<at::Tensor> xs, ys;
      for (int64_t j = m * o_.microbatch; j < (m + 1) * o_.microbatch; ++j) {
        Sample s = spec_.dataset(indices[j]);
        xs.push_back(s.input);
        ys.push_back(s.target);
      }
      at::Tensor x = at::stack(xs).to(o_.dtype);
      at::Tensor y = at::stack(ys).to(o_.dtype);
      at::Tensor loss = spec_.loss(model_->forward(x), y);
      if (first) inj.fire(self, step_, Phase::kBackward, &client_);
      first = false;
      (loss * scale).backward();
      lossSum += loss.item<double>() * static_cast<double>(o_.microbatch);
    }
    // One flat buffer: every gradient, then the loss sum.
    std::vector<at::Tensor> parts;
    for (auto& p : params_) {
      parts.push_back(p.grad().defined() ? p.grad().reshape(-1)
                                         : at::zeros({p.numel()}, p.options()));
    }
    parts.push_back(at::full({1}, lossSum, at::TensorOptions().dtype(o_.dtype)));
    at::Tensor flat = at::cat(parts);
    inj.fire(self, step_, Phase::kReduce, &client_);
    comm_->allreduce(flat, collectives::ReduceOp::kSum, o_.opTimeout);
    inj.fire(self, step_, Phase::kAfterReduce, &client_);
    int64_t offset = 0;
    for (auto& p : params_) {
      at::Tensor g = flat.narrow(0, offset, p.numel()).view(p.sizes());
      if (p.grad().defined()) {
        p.mutable_grad().copy_(g);
      } else {
        p.mutable_grad() = g.clone();
      }
      offset += p.numel();
    }
    double loss = flat[offset].item<double>() / static_cast<double>(o_.globalBatch);
    client_.setStep(step_);
    auto verdict = client_.vote(epoch_, step_, o_.opTimeout);
    if (verdict == CoordinatorClient::VoteResult::kSuperseded) {
      SINEW_THROW(EpochChanged, "step ", step_, " was not committed in epoch ", epoch_);
    }
    inj.fire(self, step_, Phase::kOptimizer, &client_);
    if (arena_) {
      auto t0 = Clock::now();
      arena_->waitBeforeUpdate();
      ckStall_ += seconds(Clock::now() - t0);
    }
    opt_->step();
    applied_ = step_;
    maybeCheckpoint(step_);
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
    lastReport_ = now;
    stepsSinceReport_ = 0;
    event({{"event", "progress"},
           {"step", step_},
           {"loss", loss},
           {"samples_per_s", rate},
           {"epoch", epoch_},
           {"workers", members_.size()}});
    if (!members_.empty() && members_.front() == ctx_.worker()) {
      std::printf("sinew: step %lld loss %.6g samples/s %.0f epoch %lld workers %zu\n",
                  static_cast<long long>(step_), loss, rate, static_cast<long long>(epoch_),
                  members_.size());
      std::fflush(stdout);
    }
  }

  // Aborts and destroys the communicator of an epoch being left.
  void dropCommunicator() {
    std::lock_guard<std::mutex> lock(commMu_);
    if (comm_) comm_->abort();
    comm_.reset();
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
    auto deadline = t0 + o_.recoveryTimeout;
    int64_t waitFrom = from;
    while (true) {
      if (failure) state_.injector.fire(ctx_.worker(), step_, Phase::kRecovery, &client_);
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) {
        SINEW_THROW(Timeout, "worker ", ctx_.worker(), " could not recover within ",
                    o_.recoveryTimeout.count(), " ms (", why, ")");
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
    co.timeout = o_.opTimeout;
    co.initTimeout = std::min(o_.buildTimeout, o_.recoveryTimeout);
    co.hostname = ctx_.host();
    const int64_t e = info.epoch;
    auto store = std::make_shared<AbortableStore>(
        ctx_.store(), [this, e] { return client_.latestEpoch().epoch > e; });
    auto comm = collectives::createGlooCommunicator(store, co);
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
      comm_->broadcast(d, root, o_.opTimeout);
    }
    std::string bytes;
    if (comm_->rank() == root) {
      torch::serialize::OutputArchive archive;
      opt_->save(archive);
      std::ostringstream os;
      archive.save_to(os);
      bytes = os.str();
    }
    at::Tensor len = at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong);
    comm_->broadcast(len, root, o_.opTimeout);
    int64_t n = len.item<int64_t>();
    at::Tensor buf = at::zeros({(n + 7) / 8}, at::kLong);
    if (comm_->rank() == root) std::memcpy(buf.data_ptr(), bytes.data(), bytes.size());
    comm_->broadcast(buf, root, o_.opTimeout);
    if (comm_->rank() != root) {
      std::string received(static_cast<const char*>(buf.data_ptr()), static_cast<size_t>(n));
      std::istringstream is(received);
      torch::serialize::InputArchive archive;
      archive.load_from(is);
      opt_->load(archive);
    }
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

  // After the optimizer step of `step`: the epoch's first member snapshots a due version.
  void maybeCheckpoint(int64_t step, bool force = false) {
    if (o_.checkpointDir.empty() || members_.empty() || members_.front() != ctx_.worker()) {
      return;
    }
    bool due = (o_.checkpointEvery > 0 && (step + 1) % o_.checkpointEvery == 0) ||
               step == o_.steps - 1 || force;
    if (!due || step == lastSnapshot_) return;
    if (force && arena_) arena_->waitBeforeUpdate();  // Its copy is in no step's way.
    {
      std::unique_lock<std::mutex> lock(ckMu_);
      if (force) ckCv_.wait(lock, [&] { return toFlush_.empty() && !flushBusy_; });
      if (flushBusy_ || !toFlush_.empty()) {
        ckSkipped_++;  // The previous version is still being written: never block a step.
        return;
      }
    }
    checkpoint::ShardState state = shardState();
    if (!arena_) {
      checkpoint::SnapshotOptions so;
      so.owner = ctx_.worker();
      arena_ = std::make_unique<checkpoint::SnapshotArena>(state, so);
      arena_->setOnComplete([this](std::shared_ptr<const checkpoint::HostShard> shard) {
        std::lock_guard<std::mutex> lock(ckMu_);
        toFlush_.push_back(std::move(shard));
        ckCv_.notify_all();
      });
      checkpoint::PersistOptions po;
      po.dir = o_.checkpointDir;
      po.keep = o_.checkpointKeep;
      po.env = state_.checkpointEnv;
      writer_ = std::make_unique<checkpoint::CheckpointWriter>(po);
      flushThread_ = std::thread([this] { flushLoop(); });
    }
    if (arena_->snapshot(step, state)) {
      lastSnapshot_ = step;
    } else {
      std::lock_guard<std::mutex> lock(ckMu_);
      ckSkipped_++;
    }
  }

  void flushLoop() {
    std::unique_lock<std::mutex> lock(ckMu_);
    while (true) {
      ckCv_.wait(lock, [&] { return ckStop_ || !toFlush_.empty(); });
      if (toFlush_.empty()) return;  // Stopping with nothing left to write.
      auto shard = toFlush_.front();
      toFlush_.pop_front();
      flushBusy_ = true;
      lock.unlock();
      auto t0 = Clock::now();
      std::exception_ptr error;
      try {
        writer_->flush({shard});
      } catch (...) {
        error = std::current_exception();
      }
      double took = seconds(Clock::now() - t0);
      lock.lock();
      flushBusy_ = false;
      if (!error) {
        ckWritten_++;
        event({{"event", "checkpoint"}, {"step", shard->step}, {"duration_s", took}});
      } else {
        // Training goes on (a later version may be written); run() rethrows the first failure
        // when it returns (see Trainer::run()).
        if (!flushError_) flushError_ = error;
        const std::string what = describe(error);
        std::fprintf(stderr, "sinew: worker %d could not write checkpoint %lld: %s\n",
                     ctx_.worker(), static_cast<long long>(shard->step), what.c_str());
        event({{"event", "checkpoint_failed"}, {"step", shard->step}, {"error", what}});
      }
      ckCv_.notify_all();
    }
  }

  // Waits until the last snapshot is copied and every queued version is durable.
  void finishCheckpoints() {
    if (!arena_) return;
    arena_->waitBeforeUpdate();
    std::unique_lock<std::mutex> lock(ckMu_);
    ckCv_.wait(lock, [&] { return toFlush_.empty() && !flushBusy_; });
  }

  void stopFlushThread() {
    {
      std::lock_guard<std::mutex> lock(ckMu_);
      ckStop_ = true;
      ckCv_.notify_all();
    }
    if (flushThread_.joinable()) flushThread_.join();
  }

  // Loads version `step` from checkpointDir into the parameters and optimizer state.
  void restoreFromDisk(int64_t step) {
    if (o_.checkpointDir.empty()) {
      SINEW_THROW(InvalidArgument, "TrainerOptions::checkpointDir is empty on worker ",
                  ctx_.worker(), ", but the job resumes at step ", step + 1,
                  " from a checkpoint it must restore");
    }
    auto t0 = Clock::now();
    auto layers = checkpoint::CheckpointReader(o_.checkpointDir, state_.checkpointEnv).load(step);
    at::NoGradGuard noGrad;
    auto& st = opt_->state();
    for (const auto& child : model_->named_children()) {
      auto params = child.value()->named_parameters(/*recurse=*/true);
      if (params.size() == 0) continue;
      auto lit = layers.find(child.key());
      if (lit == layers.end()) {
        SINEW_THROW(InvalidArgument, "TrainerOptions::checkpointDir = '", o_.checkpointDir,
                    "': its checkpoint ", step, " has no layer '", child.key(),
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
          SINEW_THROW(InvalidArgument, "TrainerOptions::checkpointDir = '", o_.checkpointDir,
                      "': in its checkpoint ", step, ", layer '", child.key(), "' tensor '", n,
                      "' is missing or has another shape (a checkpoint of another model?)");
        }
        p.detach().copy_(*v);
        if (const at::Tensor* m = get(n + ".exp_avg")) {
          auto a = std::make_unique<torch::optim::AdamParamState>();
          a->exp_avg(m->to(p.dtype()).clone());
          a->exp_avg_sq(get(n + ".exp_avg_sq")->to(p.dtype()).clone());
          if (const at::Tensor* mx = get(n + ".max_exp_avg_sq")) {
            a->max_exp_avg_sq(mx->to(p.dtype()).clone());
          }
          a->step(get(n + ".step")->item<int64_t>());
          st[stateKey(st, p)] = std::move(a);
        } else if (const at::Tensor* b = get(n + ".momentum_buffer")) {
          auto s = std::make_unique<torch::optim::SGDParamState>();
          s->momentum_buffer(b->to(p.dtype()).clone());
          st[stateKey(st, p)] = std::move(s);
        }
      }
    }
    applied_ = step;
    event({{"event", "restored"},
           {"step", step},
           {"dir", o_.checkpointDir},
           {"duration_s", seconds(Clock::now() - t0)}});
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
  // Durable checkpoints (the epoch's first member only).
  std::unique_ptr<checkpoint::SnapshotArena> arena_;
  std::unique_ptr<checkpoint::CheckpointWriter> writer_;
  std::thread flushThread_;
  double ckStall_ = 0;
  std::mutex ckMu_;
  std::condition_variable ckCv_;
  // Guarded by ckMu_.
  std::deque<std::shared_ptr<const checkpoint::HostShard>> toFlush_;
  bool flushBusy_ = false;
  bool ckStop_ = false;
  int64_t ckWritten_ = 0;
  int64_t ckSkipped_ = 0;
  std::exception_ptr flushError_;  // The first failed flush, rethrown by run().
};

Trainer::Trainer(Context& ctx, ModelSpec spec, TrainerOptions options)
    : model_(buildModel(spec, options.seed, options.dtype)),
      impl_(std::make_unique<Impl>(ctx, std::move(spec), std::move(options), model_)) {}

Trainer::~Trainer() = default;

TrainResult Trainer::run() { return impl_->run(); }

}  // namespace sinew
