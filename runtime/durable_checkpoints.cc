#include "sinew/runtime/durable_checkpoints.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>

#include "sinew/base/private_file.h"
#include "sinew/pipeline/stage_executor.h"
#include "sinew/runtime/optimizer_state.h"

namespace sinew {
namespace runtime {

DurableCheckpoints::DurableCheckpoints(const TrainerServices& services, bool pipelineMode,
                                       std::map<std::string, std::string> storedOnce)
    : s_(services),
      pipelineMode_(pipelineMode),
      dir_(services.options.checkpointDir),
      storedOnce_(std::move(storedOnce)) {}

DurableCheckpoints::~DurableCheckpoints() {
  arena_.reset();    // Joins the copy thread, whose completion submits to the flusher.
  flusher_.reset();  // Writes what was submitted, then joins its thread.
}

void DurableCheckpoints::checkDir() {
  auto fail = [&](const std::string& why) {
    SINEW_THROW(InvalidArgument, "worker ", s_.worker(), " cannot write checkpoints to '", dir_,
                "' (TrainerOptions::checkpointDir): ", why);
  };
  // Weights and optimizer state are this user's only: folders 0700, files 0600.
  try {
    detail::makePrivateDirs(dir_);
  } catch (const Error& e) {
    fail(std::string("creating it failed: ") + e.what());
  }
  std::error_code ec;
  if (!std::filesystem::is_directory(dir_, ec)) fail("it is not a directory");
  const std::string probe = dir_ + "/.probe-w" + std::to_string(s_.worker()) + "-" +
                            std::to_string(static_cast<long long>(::getpid()));
  int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) fail(std::string("creating a file in it failed: ") + std::strerror(errno));
  const char byte = 0;
  const bool wrote = ::write(fd, &byte, 1) == 1;
  const int writeErrno = errno;
  ::close(fd);
  ::unlink(probe.c_str());
  if (!wrote) fail(std::string("writing a file in it failed: ") + std::strerror(writeErrno));
}

int64_t DurableCheckpoints::newestRestorable(bool keep) {
  checkpoint::CheckpointReader reader(dir_, s_.state.checkpointEnv);
  int64_t latest = -1;
  bool latestDamaged = false;
  try {
    latest = reader.latestStep();
  } catch (const Error& e) {
    latestDamaged = true;
    std::fprintf(stderr, "sinew: worker %d: %s; looking for the newest intact version\n",
                 s_.worker(), e.what());
    s_.event({{"event", "checkpoint_unreadable"}, {"what", "LATEST"}, {"error", e.what()}});
  }
  std::vector<int64_t> steps = reader.durableSteps();
  std::string lastError;
  for (int64_t step : steps) {
    if (!latestDamaged && step > latest) continue;  // Never committed.
    try {
      auto layers = reader.load(step);
      if (keep) {
        validated_ = std::move(layers);  // Restored from without reading it again.
        validatedStep_ = step;
      }
      if (latestDamaged || step < latest) {
        // LATEST names a damaged version: name this one instead, so that the versions this
        // run writes (newer than `step`, maybe older than the damaged one) are not refused
        // as a stale writer's (rule 8). Every worker does the same, under the lock.
        checkpoint::repointLatest(dir_, s_.state.checkpointEnv, step);
      }
      return step;
    } catch (const Error& e) {
      lastError = e.what();
      std::fprintf(stderr,
                   "sinew: worker %d: the checkpoint of step %lld cannot be restored (%s); "
                   "trying the one before\n",
                   s_.worker(), static_cast<long long>(step), e.what());
      s_.event({{"event", "checkpoint_unreadable"}, {"step", step}, {"error", e.what()}});
    }
  }
  if (!lastError.empty() || latestDamaged) {
    SINEW_THROW(Corruption, "no checkpoint in '", dir_, "' can be restored; the last error: ",
                lastError.empty() ? std::string("LATEST is damaged and no version has a manifest")
                                  : lastError);
  }
  return -1;
}

std::map<std::string, checkpoint::RestoredLayer> DurableCheckpoints::load(
    int64_t step, const std::vector<std::string>& names) {
  auto layers = validatedStep_ == step
                    ? std::move(validated_)
                    : checkpoint::CheckpointReader(dir_, s_.state.checkpointEnv).load(step, names);
  validated_.clear();
  validatedStep_ = -1;
  return layers;
}

DurableCheckpoints::Role DurableCheckpoints::roleOf(int worker, bool pipelineMode,
                                                    const std::vector<int>& members,
                                                    const pipeline::Plan& plan) {
  using How = checkpoint::FlushRole::How;
  Role role;
  if (!pipelineMode) {
    role.writer = !members.empty() && members.front() == worker;
    return role;
  }
  const pipeline::WorkerAssignment* mine = plan.find(worker);
  if (mine == nullptr || mine->pipeline != 0) return role;
  if (pipeline::StageExecutor::stageWorkers(plan, 0, mine->stage).front() != worker) return role;
  role.writer = true;
  role.flush.how = mine->stage == 0 ? How::kCommit : How::kPost;
  for (int stage = 1;; ++stage) {
    std::vector<int> ws = pipeline::StageExecutor::stageWorkers(plan, 0, stage);
    if (ws.empty()) break;
    role.flush.others.push_back(ws.front());
  }
  return role;
}

std::map<std::string, at::Tensor> DurableCheckpoints::restoreInto(
    int64_t step, const torch::nn::Sequential& layers, torch::optim::Optimizer& optimizer) {
  if (!enabled()) {
    SINEW_THROW(InvalidArgument, "TrainerOptions::checkpointDir is empty on worker ", s_.worker(),
                ", but the job resumes at step ", step + 1, " from a checkpoint it must restore");
  }
  auto t0 = TrainerClock::now();
  std::vector<std::string> names;  // The layers this worker holds that have state.
  for (const auto& child : layers->named_children()) {
    if (child.value()->parameters().size() > 0) names.push_back(child.key());
  }
  if (names.empty()) return {};
  const std::map<std::string, checkpoint::RestoredLayer> loaded = load(step, names);
  loadState(
      layers, optimizer, loaded,
      "TrainerOptions::checkpointDir = '" + dir_ + "': its checkpoint " + std::to_string(step));
  s_.event({{"event", "restored"},
            {"step", step},
            {"dir", dir_},
            {"duration_s", seconds(TrainerClock::now() - t0)}});
  return jobTensors(loaded);
}

void DurableCheckpoints::releaseKept() {
  validated_.clear();
  validatedStep_ = -1;
}

std::vector<int64_t> DurableCheckpoints::durableSteps() const {
  if (dir_.empty()) return {};
  return checkpoint::CheckpointReader(dir_, s_.state.checkpointEnv).durableSteps();
}

void DurableCheckpoints::makeFlusher() {
  const TrainerOptions& o = s_.options;
  checkpoint::VersionFlusherOptions fo;
  fo.self = s_.worker();
  fo.persist.dir = dir_;
  fo.persist.keep = o.checkpointKeep;
  fo.persist.incremental = o.incrementalCheckpoints;
  fo.persist.sameAs = storedOnce_;
  fo.persist.env = s_.state.checkpointEnv;
  fo.store = s_.ctx.store();
  fo.prefix = "sinew/durable";
  fo.timeout = s_.recoveryTimeout();
  // A writer that left the job before posting its shard never will.
  fo.gone = [this](int worker) -> std::string {
    const EpochInfo latest = s_.client.latestEpoch();
    if (std::find(latest.members.begin(), latest.members.end(), worker) != latest.members.end()) {
      return "";
    }
    return "left the job (epoch " + std::to_string(latest.epoch) + ")";
  };
  fo.beforeWrite = [this](int64_t step) {
    s_.state.injector.fire(s_.worker(), step, Phase::kFlush, nullptr);
  };
  fo.onFlushed = [this](const checkpoint::FlushedVersion& v) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      written_++;
      if (v.step >= errorStep_) error_ = nullptr;  // A newer one is durable.
    }
    s_.event({{"event", "checkpoint"},
              {"step", v.step},
              {"duration_s", v.seconds},
              {"shared_snapshot", v.shared}});
    s_.state.injector.afterFlush(s_.worker(), v.step, dir_);
    // The writer that moved LATEST tells the coordinator (its status and /metrics).
    if (v.how != checkpoint::FlushRole::How::kPost) {
      s_.client.durable(v.step, v.bytes, v.seconds, dir_);
    }
  };
  // Reported, and training goes on: a later version may be written. error() returns it only
  // if no newer version was written after it (docs/failure_semantics.md, rule 10).
  fo.onFailed = [this](int64_t step, const std::string& verb, const std::string& where,
                       std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mu_);
    recordFailureLocked(step, error, verb, where);
  };
  // A late writer's version refused because a newer one is durable: correct, and no error
  // (the job's newest durable state is the newer one).
  fo.onSuperseded = [this](int64_t step, int64_t newer, const std::string& what) {
    std::fprintf(stderr,
                 "sinew: worker %d: checkpoint %lld was written but not made the latest: "
                 "version %lld is already durable (a late writer's version; nothing is lost)\n",
                 s_.worker(), static_cast<long long>(step), static_cast<long long>(newer));
    s_.event({{"event", "checkpoint_superseded"},
              {"step", step},
              {"newer", newer},
              {"dir", dir_},
              {"what", what}});
  };
  flusher_ = std::make_unique<checkpoint::VersionFlusher>(std::move(fo));
}

checkpoint::VersionFlusher* DurableCheckpoints::reserve(int64_t step, const Role& role, bool force,
                                                        int64_t current, double* waited) {
  const TrainerOptions& o = s_.options;
  if (dir_.empty() || !role.writer) return nullptr;
  bool due = (o.checkpointEvery > 0 && (step + 1) % o.checkpointEvery == 0) ||
             step == o.steps - 1 || force;
  if (!due || step == lastSnapshot_) return nullptr;
  // Pipeline mode writes every due version on every writer (a version needs all of their
  // shards), so it waits for the previous one instead of skipping it. The job's last step
  // is never skipped either (docs/failure_semantics.md, rule 4).
  const bool wait = force || pipelineMode_ || step == o.steps - 1;
  // Once per worker: a reconfiguration that changes its layers makes a new arena (of the new
  // layout) but keeps the flusher.
  if (!flusher_) makeFlusher();
  if (wait) {
    // Waiting on the disk is not being stuck: the step deadline does not count it.
    WaitingOnOthers onDisk(s_.client, current, waited);
    if (arena_) arena_->waitComplete();  // Its copy is in no step's way.
    flusher_->waitIdle();
  } else if (flusher_->outstanding() > 0) {
    std::lock_guard<std::mutex> lock(mu_);
    skipped_++;  // The previous version is still being written: never block a step.
    return nullptr;
  }
  flusher_->reserve();
  lastSnapshot_ = step;
  return flusher_.get();
}

// The shard of a reserved version, copied into this worker's own arena (its completion
// submits it to the flusher).
void DurableCheckpoints::snapshotOwn(int64_t step, const Role& role,
                                     const std::function<checkpoint::ShardState()>& state) {
  const checkpoint::ShardState st = state();
  if (!arena_) {
    checkpoint::SnapshotOptions so;
    so.owner = s_.worker();
    arena_ = std::make_unique<checkpoint::SnapshotArena>(st, so);
    arena_->setOnComplete([this](std::shared_ptr<const checkpoint::HostShard> shard) {
      checkpoint::FlushRole r;
      {
        std::lock_guard<std::mutex> lock(mu_);
        r = arenaRole_;
      }
      flusher_->submit(std::move(shard), std::move(r));
    });
    // A copy that failed is never flushed: its reservation ends (its error reaches the training
    // thread through the arena's next wait or snapshot).
    arena_->setOnFailed([this](int64_t, std::exception_ptr) { flusher_->cancel(); });
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    arenaRole_ = role.flush;
  }
  bool taken = false;
  try {
    taken = arena_->snapshot(step, st);
  } catch (...) {
    flusher_->cancel();
    throw;
  }
  if (!taken) {
    flusher_->cancel();
    std::lock_guard<std::mutex> lock(mu_);
    skipped_++;
    lastSnapshot_ = -1;
  }
  // While the copy is in flight (on a GPU: queued on the side stream).
  s_.state.injector.fire(s_.worker(), step, Phase::kSnapshot, &s_.client);
}

// A version that could not be made durable: kept for error() unless a newer version is
// written (rule 10), printed, and reported as a checkpoint_failed event:
// "could not <verb> checkpoint <step> to <where>: <error>".
void DurableCheckpoints::recordFailureLocked(int64_t step, std::exception_ptr error,
                                             const std::string& verb, const std::string& where) {
  error_ = error;
  errorStep_ = step;
  const std::string why = describe(error);
  std::fprintf(stderr, "sinew: worker %d could not %s checkpoint %lld to %s: %s\n", s_.worker(),
               verb.c_str(), static_cast<long long>(step), where.c_str(), why.c_str());
  s_.event({{"event", "checkpoint_failed"}, {"step", step}, {"dir", dir_}, {"error", why}});
}

void DurableCheckpoints::waitBeforeUpdate() {
  if (arena_) arena_->waitBeforeUpdate();
}

void DurableCheckpoints::dropArena() {
  if (!arena_) return;
  try {
    arena_->waitComplete();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "sinew: worker %d: a snapshot failed before a reconfiguration: %s\n",
                 s_.worker(), e.what());
  }
  arena_.reset();
}

void DurableCheckpoints::rolledBackTo(int64_t step) {
  if (lastSnapshot_ > step) lastSnapshot_ = -1;
}

void DurableCheckpoints::finish() {
  if (!flusher_) return;
  if (arena_) arena_->waitComplete();
  flusher_->waitIdle();
}

int64_t DurableCheckpoints::written() const {
  std::lock_guard<std::mutex> lock(mu_);
  return written_;
}

int64_t DurableCheckpoints::skipped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return skipped_;
}

std::exception_ptr DurableCheckpoints::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

}  // namespace runtime
}  // namespace sinew
