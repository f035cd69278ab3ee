#pragma once

// Internal: a worker's durable checkpoints (TrainerOptions::checkpointDir;
// docs/checkpoint_format.md, docs/failure_semantics.md rules 4-10).
//
// After the optimizer step of a due version, a writer snapshots its shard lazily into a host
// arena (the next optimizer step waits for the copy), or takes the peer-RAM engine's copy of
// the same version, and a flush thread writes it to the folder: alone (data parallel: the
// epoch's first member holds every layer), or as one of pipeline 0's writers (the first
// worker of each of its stages), posting its shard's records to the store (kPost) or
// collecting everyone's and committing the version (kCommit, the first stage).
// A flush that fails is reported (stderr and a checkpoint_failed event) and training goes on;
// error() returns it until a newer version is durable.
//
// Thread safety: every method is called by the training thread, except the engine hooks
// (onEngineSnapshot, onEngineSnapshotFailed), which the peer-RAM engine's copy thread calls.
// The flush thread is internal.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "sinew/checkpoint/persist.h"
#include "sinew/checkpoint/snapshot.h"
#include "sinew/runtime/trainer_services.h"

namespace sinew {
namespace runtime {

class DurableCheckpoints {
 public:
  enum class FlushHow { kAlone, kPost, kCommit };

  // What this worker does for the current epoch's versions.
  struct Role {
    bool writer = false;
    FlushHow how = FlushHow::kAlone;
    std::vector<int> others;  // kCommit: the other writers whose records it waits for
  };

  // REQUIRES: services outlive this object. `pipelineMode`: several writers per version.
  DurableCheckpoints(const TrainerServices& services, bool pipelineMode);
  // Joins the flush thread after the versions queued are written.
  ~DurableCheckpoints();
  DurableCheckpoints(const DurableCheckpoints&) = delete;
  DurableCheckpoints& operator=(const DurableCheckpoints&) = delete;

  bool enabled() const { return !dir_.empty(); }

  // A folder that cannot be written is an error at start, before any training
  // (docs/failure_semantics.md, rule 6): created if missing, then probed with a file.
  // Throws InvalidArgument naming the folder and the reason.
  void checkDir();

  // The newest durable version this worker can read back whole, or -1 if there is none
  // (rule 5): versions up to the one LATEST names (every manifest if LATEST itself is
  // damaged), newest first; a version with a corrupt or missing file is reported and the one
  // before is tried. Every worker reads the same files, so all agree. With `keep`, the version
  // read is kept for load(). Throws Corruption if versions exist but none can be read.
  int64_t newestRestorable(bool keep);

  // The layers `names` of durable version `step` (the one newestRestorable kept, else read).
  std::map<std::string, checkpoint::RestoredLayer> load(int64_t step,
                                                        const std::vector<std::string>& names);
  // Drops the version newestRestorable() kept (only the first epoch's source restores it).
  void releaseKept();
  // The durable versions in the folder, newest first.
  std::vector<int64_t> durableSteps() const;

  // After the optimizer step of `step` (`current`: the step being run, for the heartbeats;
  // `waited`: its time waiting on others): snapshots a due version if `role` writes.
  // `force`: due whatever checkpointEvery says. `engineTakesIt`: the peer-RAM engine is about
  // to snapshot `step` too, and settleShared(step, taken) follows, so its copy is flushed
  // instead of a second one into this worker's arena.
  void maybeSnapshot(int64_t step, const Role& role, bool force, bool engineTakesIt,
                     const std::function<checkpoint::ShardState()>& state, int64_t current,
                     double* waited);
  // After the engine was asked for `step` (`taken`: whether it took it): a durable version left
  // to the engine that it did not take is copied into this worker's own arena after all.
  void settleShared(int64_t step, bool taken, const std::function<checkpoint::ShardState()>& state);

  // The peer-RAM engine's snapshot hooks (its copy thread).
  void onEngineSnapshot(const std::shared_ptr<const checkpoint::HostShard>& shard);
  void onEngineSnapshotFailed(int64_t step, std::exception_ptr error);

  // Waits until the last snapshot's copy no longer needs the state (before an optimizer step).
  void waitBeforeUpdate();
  // Waits for the last snapshot and drops the arena (its layout is the old layers', before a
  // reconfiguration changes them); a failed copy is reported, not thrown.
  void dropArena();
  // A rollback to `step`: versions after it run again and are snapshotted again.
  void rolledBackTo(int64_t step);

  // Waits until the last snapshot is copied and every version taken is flushed.
  void finish();

  int64_t written() const;
  int64_t skipped() const;
  // The newest failed flush if no newer version was written after it, else null.
  std::exception_ptr error() const;

 private:
  struct FlushJob {
    std::shared_ptr<const checkpoint::HostShard> shard;
    FlushHow how = FlushHow::kAlone;
    std::vector<int> others;
    bool shared = false;  // The shard is the peer-RAM engine's copy of the version.
  };

  void snapshotToArena(int64_t step, const checkpoint::ShardState& state);
  void flushLoop();
  void flushOne(const FlushJob& job);
  void stopFlushThread();
  // REQUIRES: mu_ held.
  void recordFailureLocked(int64_t step, std::exception_ptr error, const char* verb,
                           const std::string& where);
  static std::string recordKey(int64_t step, int owner);

  const TrainerServices& s_;  // The trainer's; outlives this object.
  const bool pipelineMode_;
  const std::string dir_;
  int64_t lastSnapshot_ = -1;
  // The version newestRestorable() read back whole, kept for load().
  std::map<std::string, checkpoint::RestoredLayer> validated_;
  int64_t validatedStep_ = -1;
  std::unique_ptr<checkpoint::SnapshotArena> arena_;
  std::unique_ptr<checkpoint::CheckpointWriter> writer_;
  std::thread flushThread_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Guarded by mu_.
  std::deque<FlushJob> toFlush_;
  int64_t outstanding_ = 0;  // Snapshots taken and not yet flushed (or failed).
  int64_t fromEngine_ = -1;  // The durable version whose shard the engine's copy provides.
  Role role_;                // Of the snapshot being copied.
  bool stop_ = false;
  int64_t written_ = 0;
  int64_t skipped_ = 0;
  std::exception_ptr error_;  // The newest failed flush, cleared when a newer one is written.
  int64_t errorStep_ = -1;
};

}  // namespace runtime
}  // namespace sinew
