#include "sinew/runtime/durable_checkpoints.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>

namespace sinew {
namespace runtime {

DurableCheckpoints::DurableCheckpoints(const TrainerServices& services, bool pipelineMode)
    : s_(services), pipelineMode_(pipelineMode), dir_(services.options.checkpointDir) {}

DurableCheckpoints::~DurableCheckpoints() {
  arena_.reset();  // Joins the copy thread, whose completion callback uses mu_.
  stopFlushThread();
}

std::string DurableCheckpoints::recordKey(int64_t step, int owner) {
  return "sinew/pipeline/checkpoint/" + std::to_string(step) + "/w" + std::to_string(owner);
}

void DurableCheckpoints::checkDir() {
  auto fail = [&](const std::string& why) {
    SINEW_THROW(InvalidArgument, "worker ", s_.worker(), " cannot write checkpoints to '", dir_,
                "' (TrainerOptions::checkpointDir): ", why);
  };
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) fail("creating it failed: " + ec.message());
  if (!std::filesystem::is_directory(dir_, ec)) fail("it is not a directory");
  const std::string probe = dir_ + "/.probe-w" + std::to_string(s_.worker()) + "-" +
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

void DurableCheckpoints::releaseKept() {
  validated_.clear();
  validatedStep_ = -1;
}

std::vector<int64_t> DurableCheckpoints::durableSteps() const {
  if (dir_.empty()) return {};
  return checkpoint::CheckpointReader(dir_, s_.state.checkpointEnv).durableSteps();
}

void DurableCheckpoints::maybeSnapshot(int64_t step, const Role& role, bool force,
                                       bool engineTakesIt,
                                       const std::function<checkpoint::ShardState()>& state,
                                       int64_t current, double* waited) {
  const TrainerOptions& o = s_.options;
  if (dir_.empty() || !role.writer) return;
  bool due = (o.checkpointEvery > 0 && (step + 1) % o.checkpointEvery == 0) ||
             step == o.steps - 1 || force;
  if (!due || step == lastSnapshot_) return;
  // Pipeline mode writes every due version on every writer (a version needs all of their
  // shards), so it waits for the previous one instead of skipping it. The job's last step
  // is never skipped either (docs/failure_semantics.md, rule 4).
  const bool wait = force || pipelineMode_ || step == o.steps - 1;
  // Waiting on the disk is not being stuck: the step deadline does not count it.
  std::optional<WaitingOnOthers> onDisk;
  if (wait) onDisk.emplace(s_.client, current, waited);
  if (wait && arena_) arena_->waitComplete();  // Its copy is in no step's way.
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (wait) cv_.wait(lock, [&] { return outstanding_ == 0; });
    if (outstanding_ > 0) {
      skipped_++;  // The previous version is still being written: never block a step.
      return;
    }
    role_ = role;
  }
  if (!writer_) {
    // Once per worker: a reconfiguration that changes its layers makes a new arena (of the
    // new layout) but keeps the writer and its flush thread.
    checkpoint::PersistOptions po;
    po.dir = dir_;
    po.keep = o.checkpointKeep;
    po.env = s_.state.checkpointEnv;
    writer_ = std::make_unique<checkpoint::CheckpointWriter>(po);
    flushThread_ = std::thread([this] { flushLoop(); });
  }
  if (engineTakesIt) {
    // One copy for both: the engine's completion hook queues its shard of `step` for the
    // flush (settleShared takes this worker's own snapshot if the engine does not).
    std::lock_guard<std::mutex> lock(mu_);
    outstanding_++;
    fromEngine_ = step;
    lastSnapshot_ = step;
    return;
  }
  snapshotToArena(step, state());
}

void DurableCheckpoints::settleShared(int64_t step, bool taken,
                                      const std::function<checkpoint::ShardState()>& state) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (fromEngine_ != step || taken) return;
    fromEngine_ = -1;
    outstanding_--;
  }
  snapshotToArena(step, state());
}

// The shard of a due durable version, copied into this worker's own arena (its completion
// queues the flush). REQUIRES: the writer exists and role_ is set for `step`.
void DurableCheckpoints::snapshotToArena(int64_t step, const checkpoint::ShardState& state) {
  if (!arena_) {
    checkpoint::SnapshotOptions so;
    so.owner = s_.worker();
    arena_ = std::make_unique<checkpoint::SnapshotArena>(state, so);
    arena_->setOnComplete([this](std::shared_ptr<const checkpoint::HostShard> shard) {
      std::lock_guard<std::mutex> lock(mu_);
      toFlush_.push_back({std::move(shard), role_.how, role_.others});
      cv_.notify_all();
    });
    // A copy that failed is never flushed: it no longer counts as outstanding (its error
    // reaches the training thread through the arena's next wait or snapshot).
    arena_->setOnFailed([this](int64_t, std::exception_ptr) {
      std::lock_guard<std::mutex> lock(mu_);
      outstanding_--;
      cv_.notify_all();
    });
  }
  {
    // Counted before the copy starts, so the flush of a fast copy never finds it at 0.
    std::lock_guard<std::mutex> lock(mu_);
    outstanding_++;
  }
  bool taken = false;
  try {
    taken = arena_->snapshot(step, state);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    outstanding_--;
    cv_.notify_all();
    throw;
  }
  if (taken) {
    lastSnapshot_ = step;
  } else {
    std::lock_guard<std::mutex> lock(mu_);
    outstanding_--;
    skipped_++;
    cv_.notify_all();
  }
  // While the copy is in flight (on a GPU: queued on the side stream).
  s_.state.injector.fire(s_.worker(), step, Phase::kSnapshot, &s_.client);
}

void DurableCheckpoints::onEngineSnapshot(
    const std::shared_ptr<const checkpoint::HostShard>& shard) {
  std::lock_guard<std::mutex> lock(mu_);
  if (shard->step != fromEngine_) return;
  fromEngine_ = -1;
  toFlush_.push_back({shard, role_.how, role_.others, /*shared=*/true});
  cv_.notify_all();
}

// As a failed flush (rule 10 of docs/failure_semantics.md): reported, training goes on, and
// error() returns it if no newer version is written (the engine's own rethrow comes only with
// its next wait, which the job's last step never reaches).
void DurableCheckpoints::onEngineSnapshotFailed(int64_t step, std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (step != fromEngine_) return;
  fromEngine_ = -1;
  outstanding_--;
  recordFailureLocked(step, error, "copy", "host memory");
  cv_.notify_all();
}

// A version that could not be made durable: kept for error() unless a newer version is
// written (rule 10), printed, and reported as a checkpoint_failed event:
// "could not <verb> checkpoint <step> to <where>: <error>".
void DurableCheckpoints::recordFailureLocked(int64_t step, std::exception_ptr error,
                                             const char* verb, const std::string& where) {
  error_ = error;
  errorStep_ = step;
  const std::string why = describe(error);
  std::fprintf(stderr, "sinew: worker %d could not %s checkpoint %lld to %s: %s\n", s_.worker(),
               verb, static_cast<long long>(step), where.c_str(), why.c_str());
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
  if (!writer_) return;
  if (arena_) arena_->waitComplete();
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return outstanding_ == 0; });
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

void DurableCheckpoints::stopFlushThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    cv_.notify_all();
  }
  if (flushThread_.joinable()) flushThread_.join();
}

void DurableCheckpoints::flushLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !toFlush_.empty(); });
    if (toFlush_.empty()) return;  // Stopping with nothing left to write.
    FlushJob job = std::move(toFlush_.front());
    toFlush_.pop_front();
    lock.unlock();
    auto t0 = TrainerClock::now();
    std::exception_ptr error;
    const auto& shard = job.shard;
    try {
      s_.state.injector.fire(s_.worker(), shard->step, Phase::kFlush, nullptr);
      flushOne(job);
    } catch (...) {
      error = std::current_exception();
    }
    double took = seconds(TrainerClock::now() - t0);
    lock.lock();
    outstanding_--;
    if (!error) {
      written_++;
      if (shard->step >= errorStep_) error_ = nullptr;  // A newer one is durable.
      s_.event({{"event", "checkpoint"},
                {"step", shard->step},
                {"duration_s", took},
                {"shared_snapshot", job.shared}});
      s_.state.injector.afterFlush(s_.worker(), shard->step, dir_);
      // The writer that moved LATEST tells the coordinator (its status and /metrics).
      if (job.how != FlushHow::kPost) {
        s_.client.durable(shard->step, shard->capacity(), took, dir_);
      }
    } else {
      // Reported, and training goes on: a later version may be written. error() returns it
      // only if no newer version was written after it (docs/failure_semantics.md, rule 10).
      recordFailureLocked(shard->step, error, "write", "'" + dir_ + "'");
    }
    cv_.notify_all();
  }
}

// Writes one version's shard: alone (data parallel), or as one of pipeline 0's writers,
// posting its manifest entries to the store (kPost) or collecting everyone's and committing
// the version (kCommit). Runs on the flush thread.
void DurableCheckpoints::flushOne(const FlushJob& job) {
  const checkpoint::HostShard& shard = *job.shard;
  if (job.how == FlushHow::kAlone) {
    writer_->flush({job.shard});
    return;
  }
  checkpoint::ShardFileRecord mine = writer_->writeShard(shard);
  const auto& store = s_.ctx.store();
  if (job.how == FlushHow::kPost) {
    store->set(recordKey(shard.step, s_.worker()), collectives::toBytes(mine.toJson()));
    return;
  }
  std::vector<std::string> keys;
  for (int w : job.others) keys.push_back(recordKey(shard.step, w));
  // Polled, not one blocking wait: a writer that left the job before posting its shard
  // never will, so the version cannot be completed. The flush then fails at once, reported,
  // and training goes on (docs/failure_semantics.md, rule 10) instead of this thread
  // waiting out the recovery deadline with the version's successors queued behind it.
  const auto deadline = TrainerClock::now() + s_.recoveryTimeout();
  auto pause = checkpoint::CheckpointEngine::kFirstPoll;
  while (!store->check(keys)) {
    const EpochInfo latest = s_.client.latestEpoch();
    for (size_t i = 0; i < keys.size(); ++i) {
      const int w = job.others[i];
      if (std::find(latest.members.begin(), latest.members.end(), w) == latest.members.end() &&
          !store->check({keys[i]})) {
        SINEW_THROW(Aborted, "checkpoint ", shard.step, " is not durable: worker ", w,
                    ", one of pipeline 0's writers, left the job (epoch ", latest.epoch,
                    ") before its shard of it arrived");
      }
    }
    if (TrainerClock::now() > deadline) {
      SINEW_THROW(Timeout, "checkpoint ", shard.step, ": the shards of pipeline 0's other ",
                  "writers did not all arrive within ", s_.recoveryTimeout().count(), " ms");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, checkpoint::CheckpointEngine::kLastPoll);
  }
  std::vector<checkpoint::ShardFileRecord> records = {mine};
  for (const std::string& k : keys) {
    records.push_back(checkpoint::ShardFileRecord::fromJson(
        collectives::toString(store->get(k, s_.recoveryTimeout()))));
  }
  writer_->commitVersion(shard.step, records);
  for (const std::string& k : keys) store->deleteKey(k);
}

}  // namespace runtime
}  // namespace sinew
