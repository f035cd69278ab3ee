#pragma once

// SnapshotArena: the lazy snapshot of DataStates-LLM, made correct (docs/architecture.md section
// 5).
//
// After the optimizer step of s the trainer calls snapshot(s, state); a background copy
// thread copies every tensor into a preallocated host slot (and computes each tensor's
// crc32c) while step s+1 runs forward and backward, which do not modify parameters or
// optimizer state. Before the optimizer step of s+1 the trainer calls waitBeforeUpdate(),
// which returns only when the copy of s is complete. snapshot() registers the whole copy
// before it returns, so a waitBeforeUpdate() that follows it always waits for it (the
// released DataStates code can wait before anything is queued).
//
// Memory: up to `slots` buffers of the shard's size. The constructor allocates and faults in
// two; nothing is allocated per snapshot. A slot is reused only when nobody else holds its
// HostShard (replication and flush hold it while they read) and it is neither the newest
// complete snapshot nor the protected one (the newest committed version). When no slot is
// free, snapshot() allocates another if fewer than `slots` exist (a version that never
// committed holds one: the newest complete), else skips the version and returns false. It
// never blocks the step on a reader. So resident memory is 2 slots while every version
// commits, and grows to `slots` only after one did not.
//
// CUDA tensors (built with SINEW_WITH_NCCL; docs/gpu.md): slots are pinned. snapshot()
// records an event on the legacy default stream (libtorch's default stream, where the
// optimizer step that made the version was issued) and queues one cudaMemcpyAsync per tensor
// on a side stream that waits for that event, so the copy overlaps the next forward and
// backward on the GPU. waitBeforeUpdate() does not block the host for them: it makes the
// legacy default stream wait for the side stream's copies (cudaStreamWaitEvent), so the next
// optimizer step's kernels, issued on that stream, start only once its tensors are in host
// memory, and nothing else waits. (Host tensors of the shard, e.g. Adam's step counts, are
// copied by the copy thread, and waitBeforeUpdate() does wait for those.) The copy thread
// checksums each tensor as soon as its copy lands (one event per tensor), so the snapshot is
// complete about when the last copy is. An optimizer step issued on another stream must make
// that stream wait for the default one first.
//
// Thread safety: snapshot(), waitBeforeUpdate() and waitComplete() are called by the
// training thread; the accessors may be called from any thread.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "sinew/checkpoint/shard.h"

namespace sinew {
namespace checkpoint {

constexpr std::chrono::milliseconds kDefaultSnapshotWaitTimeout{600000};

struct SnapshotOptions {
  int owner = 0;  // This worker's id, stamped on every HostShard.
  int slots = 2;  // At least 2; those beyond the first two are allocated when first needed.
  // Bytes copied between crc passes; keeps the freshly copied bytes in cache for the crc.
  size_t copyChunkBytes = 1 << 20;
  std::chrono::milliseconds waitTimeout = kDefaultSnapshotWaitTimeout;
  // CUDA: threads that checksum the copied tensors as they land (a GPU copies into pinned
  // memory several times faster than one core computes crc32c). >= 1.
  int checksumThreads = 4;
  // Test hook, run before each tensor is copied (an injected slow or failing copy): on the
  // copy thread; for CUDA tensors, whose copies are already queued, before each tensor is
  // checksummed, on any of the checksumThreads threads.
  std::function<void(const TensorRecord&)> beforeCopyTensor;
};

struct SnapshotStats {
  int64_t taken = 0;
  int64_t skipped = 0;
  uint64_t bytesCopied = 0;
  double copySeconds = 0;       // Time the copy thread spent copying (and checksumming).
  double waitSeconds = 0;       // Time waitBeforeUpdate() blocked the training thread.
  uint64_t bytesAllocated = 0;  // Host memory of the slots allocated so far.
};

class SnapshotArena {
 public:
  // Sizes the arena for shards laid out like `like` and starts the copy thread.
  SnapshotArena(const ShardState& like, SnapshotOptions options);
  ~SnapshotArena();
  SnapshotArena(const SnapshotArena&) = delete;
  SnapshotArena& operator=(const SnapshotArena&) = delete;

  // Starts copying version `step` of state in the background. Returns false (and copies
  // nothing) when no slot is free, or (CUDA) while the previous version, already waited for,
  // is still being checksummed. Rethrows the error of a copy that failed after its wait
  // returned (CUDA). REQUIRES: state has the arena's layout, its CUDA tensors on the arena's
  // GPU (InvalidArgument otherwise); steps increase; the previous snapshot was waited for.
  bool snapshot(int64_t step, const ShardState& state);

  // Returns when the state may be modified: blocks until the copy started by the last
  // snapshot() is complete and rethrows its error, if any; for the CUDA tensors of a shard it
  // only orders the legacy default stream after their copies (see above) and returns.
  // Returns at once when nothing is being copied. Throws Timeout naming the step after
  // `timeout` (default: options.waitTimeout).
  void waitBeforeUpdate(std::chrono::milliseconds timeout = std::chrono::milliseconds(-1));

  // Blocks until the last snapshot is complete (copied and checksummed, latest() returns it)
  // and rethrows its error, if any; the same as waitBeforeUpdate() for host tensors.
  void waitComplete(std::chrono::milliseconds timeout = std::chrono::milliseconds(-1));

  // The newest complete snapshot, or null.
  std::shared_ptr<const HostShard> latest() const;
  // Every complete snapshot.
  std::vector<std::shared_ptr<const HostShard>> all() const;
  // The complete snapshot of step, or null.
  std::shared_ptr<const HostShard> find(int64_t step) const;
  // Keeps the slot of `step` from being reused (the newest committed version). Monotonic:
  // a smaller step than the one protected is ignored.
  void protect(int64_t step);
  // Called on the copy thread with each completed snapshot (the engine replicates it).
  void setOnComplete(std::function<void(std::shared_ptr<const HostShard>)> fn);
  // Called on the copy thread with the step and error of each copy that failed (the error is
  // also rethrown by the next wait, or by the next snapshot() if every wait came before it).
  void setOnFailed(std::function<void(int64_t step, std::exception_ptr)> fn);

  const ShardLayout& layout() const { return layout_; }
  SnapshotStats stats() const;

 private:
  struct Job {
    int64_t step;
    std::shared_ptr<HostShard> slot;
    std::vector<at::Tensor> tensors;  // In layout order; hold the storage alive.
  };
  void copyLoop();
  void copyOne(Job& job);
  void copyHost(Job& job, size_t i);
  // CUDA: queues the device tensors' copies of `job` on the side stream (training thread).
  void enqueueDeviceCopies(Job& job);
  // CUDA: orders the legacy default stream after the copies queued last.
  void orderDefaultStream();
  // Waits (mu_ held) until done() or throws Timeout; then endWait() rethrows a copy's error
  // or marks the snapshot waited for, and orders the default stream after its device copies.
  void waitFor(std::unique_lock<std::mutex>& lock, std::chrono::milliseconds timeout,
               const std::function<bool()>& done);
  void endWait(std::unique_lock<std::mutex>& lock);

  const SnapshotOptions options_;
  const ShardLayout layout_;
  bool pinned_ = false;
  // When pinned_ (cudaStream_t, cudaEvent_t): the side stream; the event the copies wait for;
  // one event per tensor of the layout, after its copy (null for host tensors); the event
  // after the last copy.
  void* cudaStream_ = nullptr;
  void* readyEvent_ = nullptr;
  std::vector<void*> tensorEvents_;
  void* copiedEvent_ = nullptr;
  bool deviceCopiesQueued_ = false;  // Training thread only: orderDefaultStream() is due.
  int device_ = -1;                  // The GPU of the CUDA tensors when pinned_.

  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Guarded by mu_.
  static constexpr int kEagerSlots = 2;
  std::shared_ptr<HostShard> newSlot() const;
  std::vector<std::shared_ptr<HostShard>> slots_;
  std::unique_ptr<Job> job_;  // The queued or running copy.
  bool pending_ = false;      // A snapshot is registered and not yet complete.
  bool hostPending_ = false;  // Its host tensors are not all copied yet.
  bool waited_ = true;        // waitBeforeUpdate() was called since the last snapshot().
  int64_t pendingStep_ = -1;
  std::exception_ptr error_;
  int64_t protected_ = -1;
  bool stop_ = false;
  std::function<void(std::shared_ptr<const HostShard>)> onComplete_;
  std::function<void(int64_t, std::exception_ptr)> onFailed_;
  SnapshotStats stats_;

  std::thread thread_;
};

}  // namespace checkpoint
}  // namespace sinew
