#pragma once

// CheckpointEngine: one worker's part of docs/architecture.md section 5, assembled from the pieces.
//
//   snapshot(s) ─copy thread─> SnapshotArena slot ─replication thread─> peers' ReplicaService
//        │                                              │ all m-1 peers acknowledged
//   waitBeforeUpdate() before the optimizer step of s+1  └─> commit record in the Store
//                                                              └─flush thread─> disk
//
// Commit protocol (per version s; the Store is the coordinator's, or any shared Store):
//   1. Each worker's replication thread sends its shard of s to every peer that
//      ReplicaPlacement names and waits for each acknowledgement (bytes and checksums
//      verified by the peer).
//   2. It then sets <prefix>/held/<s>/<worker> and adds 1 to <prefix>/held/<s>.
//   3. The worker whose add returns N (every shard of s is in m places) writes the commit
//      record <prefix>/commit/<s> and advances <prefix>/committed (compare-and-set, never
//      backwards). It then deletes s's held keys and the record of the version committed two
//      before s, so the store holds O(workers) keys however long the job runs.
//   4. A worker that sees s committed protects its snapshot of s from reuse. A failure in
//      step 1 (a lost peer, a timeout, a rejected checksum) skips 2: s never commits and
//      s-1 stays the committed version.
// Flush protocol (every flushEvery committed versions, on requestFlush() or
// preemptionNotice()): VersionFlusher's (checkpoint/flusher.h), the first worker of `workers`
// completing the version (kCommit) and every other posting its shard's record (kPost).
// A caller may also hand a snapshot's copy to a VersionFlusher of its own (snapshot() with
// `durable`): the trainer writes its durable versions from the engine's copy that way instead
// of copying the state twice.
// Replication runs at low priority: its thread is niced, sends in chunks and waits (up to
// maxYield) between chunks while the trainer has a collective in flight (trafficGate()).
// It never blocks a step: versions are sent in order, and when replication falls behind
// the arena runs out of free slots and skips snapshots (SnapshotStats::skipped). Versions
// commit only if every worker snapshotted them, so a trainer whose replication is slower
// than its step should snapshot on a common schedule (e.g. every k-th step) rather than
// rely on skips, which differ between workers.
//
// Thread safety: snapshot() and waitBeforeUpdate() from the training thread; everything
// else from any thread.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "sinew/checkpoint/flusher.h"
#include "sinew/checkpoint/persist.h"
#include "sinew/checkpoint/placement.h"
#include "sinew/checkpoint/replica.h"
#include "sinew/checkpoint/restore.h"
#include "sinew/checkpoint/snapshot.h"
#include "sinew/store.h"

namespace sinew {
namespace checkpoint {

constexpr std::chrono::milliseconds kDefaultCheckpointTimeout{30000};

struct CheckpointEngineOptions {
  int self = 0;
  std::vector<int> workers;  // Every worker, in placement order (one worker per node).
  int replication = 2;       // m.
  std::shared_ptr<collectives::Store> store;
  std::string prefix = "sinew/ckpt";
  SnapshotOptions snapshot;  // owner is set to self.
  // The job token of the replica service and of its clients (their own token fields are
  // set from it). Required.
  uint64_t token = 0;
  ReplicaServiceOptions service;
  ReplicaClientOptions client;
  std::chrono::milliseconds maxYield{50};
  PersistOptions persist;  // persist.dir empty: no flushes.
  int flushEvery = 0;      // Flush committed versions with s % flushEvery == 0; 0: on request.
  std::chrono::milliseconds timeout = kDefaultCheckpointTimeout;  // Store waits.
  // Test hook: called on the replication thread before a version is sent.
  std::function<void(int64_t step)> beforeReplicate;
};

// A commit record (<prefix>/commit/<s>): the workers whose shards version `step` holds, in
// placement order, and the replication they were placed with.
struct CommitRecord {
  int64_t step = -1;
  std::vector<int> workers;
  int replication = 0;
  int64_t previous = -1;  // The version committed before it (-1: none).
};

struct EngineStats {
  SnapshotStats snapshot;
  int64_t replicated = 0;  // Versions acknowledged by every peer.
  int64_t replicationFailures = 0;
  uint64_t bytesReplicated = 0;   // Shard bytes sent to peers (a delta: its changed bytes).
  double replicationSeconds = 0;  // Time spent sending (to all peers).
  int64_t flushed = 0;
  std::string lastError;
};

class CheckpointEngine {
 public:
  // Waits for a commit poll the store, first after kFirstPoll, then twice as long each time up
  // to kLastPoll: a commit usually follows within a millisecond or two, and many workers polling
  // one store server every millisecond would starve its other clients.
  static constexpr std::chrono::milliseconds kFirstPoll = kStorePollFirst;
  static constexpr std::chrono::milliseconds kLastPoll = kStorePollLast;

  // Starts the replica service, publishes its address under <prefix>/replica/<self>, and
  // sizes the arena for shards like `like`.
  CheckpointEngine(const ShardState& like, CheckpointEngineOptions options);
  ~CheckpointEngine();
  CheckpointEngine(const CheckpointEngine&) = delete;
  CheckpointEngine& operator=(const CheckpointEngine&) = delete;

  // After the optimizer step of step: SnapshotArena::snapshot; the copy is then replicated.
  // With `durable` (REQUIRES: it has a reservation for this version and outlives the copy),
  // the copy is also submitted to it with `role` once complete, or failed there ("copy", "host
  // memory") if the copy fails. Returns whether the snapshot was taken; if not, `durable` is
  // left alone (its reservation is the caller's).
  bool snapshot(int64_t step, const ShardState& state, VersionFlusher* durable = nullptr,
                FlushRole role = {});
  // Before the next optimizer step.
  void waitBeforeUpdate(std::chrono::milliseconds timeout = std::chrono::milliseconds(-1));
  TrafficGate& trafficGate() { return gate_; }

  // The newest committed version (-1 if none), read from the Store; also protects this
  // worker's snapshot of it from reuse.
  int64_t committedStep() const;
  // Waits until version >= step is committed; returns it. Throws Timeout naming the step.
  int64_t waitCommitted(int64_t step, std::chrono::milliseconds timeout) const;
  // The newest durable version (-1 if none), read from the Store.
  int64_t durableStep() const;
  // Waits until version >= step is durable; returns it. Throws Timeout naming the step, or,
  // c10d Work style, the error of this worker's flush that failed while it waited (IoError
  // from a failing disk, ...) instead of waiting out the deadline; each failure is thrown
  // once.
  int64_t waitDurable(int64_t step, std::chrono::milliseconds timeout) const;
  // Flush the next committed version (also what a preemption notice does).
  void requestFlush();
  void preemptionNotice() { requestFlush(); }

  // Restores `layers` of version step: own RAM, then every other worker's replica
  // service, then the checkpoint folder (restoreLayers).
  RestoreResult restore(int64_t step, const std::vector<std::string>& layers) const;
  // The sources restore() uses for version step (a caller may merge those of several engines,
  // or drop peers it knows are gone).
  RestoreSources restoreSources(int64_t step) const;

  // What engines under `prefix` committed, read from `store` by any process: the newest
  // committed version (-1 if none), and the record of version step (nothing if that version
  // did not commit, or its record was dropped: the store keeps the records of the two newest
  // committed versions). Throws Corruption for a malformed value.
  static int64_t committedIn(collectives::Store& store, const std::string& prefix);
  static std::optional<CommitRecord> commitRecordIn(collectives::Store& store,
                                                    const std::string& prefix, int64_t step);

  SnapshotArena& arena() { return *arena_; }
  ReplicaService& service() { return *service_; }
  const ReplicaService& service() const { return *service_; }
  const ReplicaPlacement& placement() const { return placement_; }
  EngineStats stats() const;

 private:
  void onSnapshot(std::shared_ptr<const HostShard> shard);
  void onSnapshotFailed(int64_t step, std::exception_ptr error);
  void replicationLoop();
  // Sends the shard to every peer of the placement; returns the bytes sent.
  uint64_t replicate(const HostShard& shard);
  void reportHeld(int64_t step);
  // This worker's part in flushing the engine's own versions.
  FlushRole flushRole() const;
  std::string key(const std::string& suffix) const { return options_.prefix + "/" + suffix; }
  std::string peerAddress(int worker, std::chrono::milliseconds timeout) const;

  const CheckpointEngineOptions options_;
  const ReplicaPlacement placement_;
  TrafficGate gate_;
  std::unique_ptr<ReplicaService> service_;
  std::unique_ptr<SnapshotArena> arena_;
  std::unique_ptr<VersionFlusher> flusher_;  // With persist.dir: the engine's own flushes.
  // One client per peer, used only by the replication thread.
  std::map<int, std::unique_ptr<ReplicaClient>> clients_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Guarded by mu_.
  std::deque<std::shared_ptr<const HostShard>> toReplicate_;
  bool flushRequested_ = false;
  // Versions whose copy goes to a caller's flusher too, and with which role.
  struct DurableCopy {
    VersionFlusher* flusher = nullptr;
    FlushRole role;
  };
  std::map<int64_t, DurableCopy> durableCopies_;
  bool stop_ = false;
  EngineStats stats_;
  // A failed flush not yet rethrown by waitDurable() (its message is also stats_.lastError).
  mutable std::exception_ptr flushError_;

  std::thread replicationThread_;
};

}  // namespace checkpoint
}  // namespace sinew
