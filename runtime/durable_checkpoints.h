#pragma once

// Internal: a worker's durable checkpoints (TrainerOptions::checkpointDir;
// docs/checkpoint_format.md, docs/failure_semantics.md rules 4-10).
//
// After the optimizer step of a due version, a writer reserves it on its VersionFlusher
// (checkpoint/flusher.h, the one path by which versions reach the folder) and the shard comes
// from one of two copies: the peer-RAM engine's snapshot of the same version, which the engine
// submits to this flusher itself (CheckpointEngine::snapshot with `durable`), or, where the
// engine does not take the version, this worker's own host arena (snapshotOwn: the next
// optimizer step waits for the copy). The flusher writes it alone (data parallel: the epoch's
// first member holds every layer), or as one of pipeline 0's writers (the first worker of each
// of its stages), posting its shard's record or completing the version.
// A flush that fails is reported (stderr and a checkpoint_failed event) and training goes on;
// error() returns it until a newer version is durable.
//
// Thread safety: every method is called by the training thread; the flusher's hooks run on its
// thread (and on the engine's copy thread for a failed copy).

#include <torch/nn/modules/container/sequential.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "sinew/checkpoint/flusher.h"
#include "sinew/checkpoint/persist.h"
#include "sinew/checkpoint/snapshot.h"
#include "sinew/pipeline/plan.h"
#include "sinew/runtime/trainer_services.h"

namespace sinew {
namespace runtime {

class DurableCheckpoints {
 public:
  // What this worker does for the current epoch's versions.
  struct Role {
    bool writer = false;
    checkpoint::FlushRole flush;
  };

  // `worker`'s role in an epoch of `members` and `plan`: in data parallel mode the epoch's
  // first member writes the versions alone (it holds every layer); in pipeline mode the first
  // worker of every stage of pipeline 0 (together they hold every layer once), its first stage
  // committing the version.
  static Role roleOf(int worker, bool pipelineMode, const std::vector<int>& members,
                     const pipeline::Plan& plan);

  // REQUIRES: services outlive this object. `pipelineMode`: several writers per version.
  // `storedOnce`: the tied parameters, "follower layer/param" -> "owner layer/param", whose
  // follower (and its optimizer state) the versions store once, as the owner's
  // (checkpoint::PersistOptions::sameAs).
  DurableCheckpoints(const TrainerServices& services, bool pipelineMode,
                     std::map<std::string, std::string> storedOnce = {});
  // Waits for the copy in flight, then joins the flusher after the versions queued are written.
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
  // Loads durable version `step` into the parameters and optimizer state of `layers` (those
  // with parameters; `layers` is this worker's whole model or its stage). Throws
  // InvalidArgument naming this worker and the step when no checkpoint folder is set (the job
  // resumes from one), Corruption when the version cannot be read.
  // Returns the layers' tensors that are not parameters or optimizer state but the job's
  // (names starting with '@', e.g. the loss scale), by name, from the first layer that has them.
  std::map<std::string, at::Tensor> restoreInto(int64_t step, const torch::nn::Sequential& layers,
                                                torch::optim::Optimizer& optimizer);
  // Drops the version newestRestorable() kept (only the first epoch's source restores it).
  void releaseKept();
  // The durable versions in the folder, newest first.
  std::vector<int64_t> durableSteps() const;

  // After the optimizer step of `step` (`current`: the step being run, for the heartbeats;
  // `waited`: its time waiting on others): whether version `step` is to be written by this
  // worker (`role`), and if so the flusher that has reserved it. `force`: due whatever
  // checkpointEvery says. The version's shard must then reach the flusher: handed to the
  // peer-RAM engine's snapshot, or, where the engine does not take it, snapshotOwn(step, ...).
  // Null when it is not due, this worker does not write it, or it is skipped (the previous
  // version is still being written, in data parallel mode).
  checkpoint::VersionFlusher* reserve(int64_t step, const Role& role, bool force, int64_t current,
                                      double* waited);
  // Copies the shard of a version reserve() returned the flusher for into this worker's own
  // arena; its completion submits it.
  void snapshotOwn(int64_t step, const Role& role,
                   const std::function<checkpoint::ShardState()>& state);

  // Waits until the last own snapshot's copy no longer needs the state (before an optimizer
  // step).
  void waitBeforeUpdate();
  // Waits for the last own snapshot and drops the arena (its layout is the old layers', before
  // a reconfiguration changes them); a failed copy is reported, not thrown.
  void dropArena();
  // A rollback to `step`: versions after it run again and are snapshotted again.
  void rolledBackTo(int64_t step);

  // Waits until the last snapshot is copied and every version reserved is written or failed.
  void finish();

  int64_t written() const;
  int64_t skipped() const;
  // The newest failed flush if no newer version was written after it, else null.
  std::exception_ptr error() const;

 private:
  // REQUIRES: mu_ held.
  void recordFailureLocked(int64_t step, std::exception_ptr error, const std::string& verb,
                           const std::string& where);
  void makeFlusher();

  const TrainerServices& s_;  // The trainer's; outlives this object.
  const bool pipelineMode_;
  const std::string dir_;
  const std::map<std::string, std::string> storedOnce_;
  int64_t lastSnapshot_ = -1;
  // The version newestRestorable() read back whole, kept for load().
  std::map<std::string, checkpoint::RestoredLayer> validated_;
  int64_t validatedStep_ = -1;
  std::unique_ptr<checkpoint::VersionFlusher> flusher_;  // Made at the first due version.
  std::unique_ptr<checkpoint::SnapshotArena> arena_;
  checkpoint::FlushRole arenaRole_;  // Of the own snapshot being copied (training thread).

  mutable std::mutex mu_;
  // Guarded by mu_.
  int64_t skipped_ = 0;
  int64_t written_ = 0;
  std::exception_ptr error_;  // The newest failed flush, cleared when a newer one is written.
  int64_t errorStep_ = -1;
};

}  // namespace runtime
}  // namespace sinew
