#pragma once

// Internal: a pipeline worker's peer-RAM versions (Gemini; docs/pipeline.md, "Peer-RAM
// versions"). After the optimizer step of every `peerCheckpointEvery`-th step (and of the last
// step) the worker snapshots its layers into the current epoch's checkpoint engine, which
// replicates the shard to the peers of the placement (ownsShard, placementOrder: pipeline 0's
// stages own the shards, the other workers holding layers hold their replicas) and commits
// the version once every shard has `replicas` copies. One engine per
// epoch that snapshotted (a generation); generations older than the newest one with a
// committed version are destroyed off the training thread.
//
// When every live copy of some layer is lost, rollbackTarget() names the newest version every
// layer can still be restored from, and restore() brings layers of it back from own RAM, then
// peers' RAM, then the durable checkpoint folder.
//
// Thread safety: called by the training thread; a retire thread destroys old engines.

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "sinew/checkpoint/engine.h"
#include "sinew/checkpoint/restore.h"
#include "sinew/pipeline/plan.h"
#include "sinew/runtime/durable_checkpoints.h"
#include "sinew/runtime/trainer_services.h"

namespace sinew {
namespace runtime {

class PeerVersions {
 public:
  // REQUIRES: services and durable outlive this object. `enabled`: pipeline mode with
  // peerCheckpointEvery > 0; a disabled object takes no version and holds none.
  PeerVersions(const TrainerServices& services, DurableCheckpoints& durable, bool enabled);
  // Destroys every generation and joins the retire thread.
  ~PeerVersions();
  PeerVersions(const PeerVersions&) = delete;
  PeerVersions& operator=(const PeerVersions&) = delete;

  bool enabled() const { return enabled_; }

  // Whether maybeSnapshot(step, ...) will try to take a version (it may still decline), for a
  // worker that holds layers (`holdsLayers`).
  bool due(int64_t step, bool holdsLayers) const;

  // After the optimizer step of `step` in `epoch` of `plan`, where this worker holds layers
  // [first, end): takes version `step` if due, once the previous version of this epoch
  // committed or was abandoned (at most one version per worker is in flight). `current` and
  // `waited` are the step being run and its time waiting on others (the wait for a commit
  // counts as waiting for step current + 1). Returns whether the engine took the version,
  // which `*taken` also says as soon as it is known (an exception after that leaves it true).
  // With `durable` (a flusher that reserved the version; DurableCheckpoints::reserve), the
  // engine also hands its copy to it with `role`; where the engine does not take the version,
  // the reservation stays the caller's.
  bool maybeSnapshot(int64_t step, int64_t epoch, const pipeline::Plan& plan, int first, int end,
                     const std::function<checkpoint::ShardState()>& state, int64_t current,
                     double* waited, checkpoint::VersionFlusher* durable,
                     const checkpoint::FlushRole& role, bool* taken);

  // Before the optimizer step in `epoch`: waits until the engine's copy of the last version
  // no longer needs the state.
  void waitBeforeUpdate(int64_t epoch);
  // The gate the stages' transfers of `epoch` hold while in flight; null if none.
  checkpoint::TrafficGate* trafficGate(int64_t epoch);
  // Waits for every snapshot in flight (their copies read the tensors a reconfiguration may
  // replace); failures are reported, not thrown.
  void waitSnapshots();

  // The newest version at or before `upTo` from which every layer with parameters
  // (`hasParameters`) of `numLayers` can be restored when the workers in `live` are all that
  // remain: a committed peer-RAM version (of a generation this worker still keeps, or any if it
  // keeps none) that, by its generation's placement and published shard layers, some live
  // worker holds every layer of; or a durable version. -1 if there is none.
  int64_t rollbackTarget(int64_t upTo, int64_t epoch, const std::vector<int>& live,
                         collectives::Store& store, int numLayers,
                         const std::function<bool(int)>& hasParameters);

  // Restores `layers` of version `step`: own RAM (snapshots and replicas held, of every
  // generation kept), then the RAM of the live workers of those generations, then the durable
  // folder (every tensor's crc32c is checked; a damaged or missing copy moves on).
  checkpoint::RestoreResult restore(int64_t step, const std::vector<std::string>& layers,
                                    const std::vector<int>& live);

  // Whether `worker` owns a shard of `plan`'s versions: the first worker of its stage in
  // pipeline 0 (the same workers write the durable checkpoint). The other workers that hold
  // layers hold copies of those layers (the other pipelines, a wide stage's other devices), so
  // their shards are empty: they hold the owners' replicas.
  static bool ownsShard(const pipeline::Plan& plan, int worker);
  // The engine's workers in Gemini placement order, for groups of `replicas`: each owner, then
  // `replicas - 1` workers that hold none of its layers (their holders in other pipelines,
  // so a group never loses a layer's copies together with its replicas), then the workers left.
  static std::vector<int> placementOrder(const pipeline::Plan& plan, int replicas);

  // Host memory of the generations kept: their arenas' slots (this worker's own versions)
  // and their replica services' slots (the versions it holds for peers).
  struct HostBytes {
    int64_t own = 0;
    int64_t replicas = 0;
  };
  HostBytes hostBytes() const;

  // Bytes every engine of this worker has sent to peers so far (the sinew_replicated_bytes_total
  // metric, reported with the votes).
  int64_t replicatedBytes();

 private:
  // The engine of one epoch that snapshotted.
  struct Generation {
    int64_t epoch = -1;
    std::unique_ptr<checkpoint::CheckpointEngine> engine;
    bool owner = false;        // Whether its shard holds this worker's layers (ownsShard).
    int64_t lastTaken = -1;    // The newest version it snapshotted.
    int64_t failuresSeen = 0;  // Its replication failures when that version was taken.
  };

  static std::string prefix(int64_t epoch);
  static std::string key(int64_t epoch, const std::string& suffix);
  bool waitCommit(Generation& g, int64_t epoch, int64_t current, double* waited);
  void retire(std::unique_ptr<checkpoint::CheckpointEngine> engine);
  void retireLoop();
  void stopRetiring();

  const TrainerServices& s_;     // The trainer's; outlives this object.
  DurableCheckpoints& durable_;  // The trainer's; outlives this object (its durable steps).
  const bool enabled_;
  std::deque<Generation> gens_;  // Oldest first.
  // Engines of dropped generations, destroyed on retireThread_.
  std::mutex retireMu_;
  std::condition_variable retireCv_;
  // Guarded by retireMu_.
  std::deque<std::unique_ptr<checkpoint::CheckpointEngine>> retiring_;
  bool retireStop_ = false;
  int64_t retiredBytes_ = 0;  // Sent by the engines retired and destroyed.
  std::thread retireThread_;
};

}  // namespace runtime
}  // namespace sinew
