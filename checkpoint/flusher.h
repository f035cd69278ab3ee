#pragma once

// VersionFlusher: the one path by which a version's shards reach the checkpoint folder
// (docs/checkpoint_format.md), for the peer-RAM engine's flushes and the trainer's durable
// versions alike. A flush thread writes each submitted shard with its FlushRole:
//   kAlone   one writer holds the whole version: it writes its shard, the manifest, moves
//            LATEST and advances <prefix>/durable.
//   kPost    one of several writers: it writes its shard and posts the shard's record
//            (ShardFileRecord) at <prefix>/flush/<step>/<self>.
//   kCommit  the writer that completes the version: it writes its shard, waits for the records
//            of `others` (polled; a writer that `gone` says has left fails the version at once,
//            and so does the deadline), writes the manifest from all records, moves LATEST,
//            advances <prefix>/durable and deletes the records.
// A version is counted from reserve() (a copy is on its way) until it is written or failed,
// so finish() also waits for copies still in flight. A failed flush is reported through
// onFailed and the next version is written as usual. A version refused because LATEST already
// names a newer one (StaleVersion: a late writer's, correctly) is no failure: onSuperseded.
//
// Thread safety: every method may be called from any thread; the hooks run on the flush
// thread (onFailed also on the thread that calls fail()).

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "sinew/checkpoint/persist.h"
#include "sinew/checkpoint/snapshot.h"
#include "sinew/store.h"

namespace sinew {
namespace checkpoint {

// Waits on the store for other workers' keys poll it, first after kStorePollFirst, then twice
// as long each time up to kStorePollLast: a record usually follows within a millisecond or two,
// and many workers polling one store server every millisecond would starve its other clients.
constexpr std::chrono::milliseconds kStorePollFirst{1};
constexpr std::chrono::milliseconds kStorePollLast{16};

// A step number kept in the store (-1 for an empty value); Corruption for anything else than
// an integer >= -1.
int64_t parseStoredStep(const collectives::Bytes& value);
// Moves the step at `key` forward to `value` (never backwards), atomically.
void advanceStoredStep(collectives::Store& store, const std::string& key, int64_t value);

// Lowers the calling thread's scheduling priority (nice 10): replication and flushes yield the
// CPU to the training threads.
void lowerThisThreadsPriority();

struct FlushRole {
  enum class How { kAlone, kPost, kCommit };
  How how = How::kAlone;
  std::vector<int> others;  // kCommit: the other writers whose records it waits for
};

// A version this worker wrote: its step, role, the seconds the write took, its shard's bytes,
// and whether the shard was another component's copy (the peer-RAM engine's).
struct FlushedVersion {
  int64_t step = -1;
  FlushRole::How how = FlushRole::How::kAlone;
  double seconds = 0;
  int64_t bytes = 0;
  bool shared = false;
};

struct VersionFlusherOptions {
  int self = 0;
  PersistOptions persist;  // persist.dir is where versions go; required
  // For kPost and kCommit records and <prefix>/durable; required.
  std::shared_ptr<collectives::Store> store;
  std::string prefix = "sinew/ckpt";
  // How long kCommit waits for the other writers' records.
  std::chrono::milliseconds timeout{30000};
  // Asked while kCommit waits, for each writer whose record has not arrived: why it never will
  // (it left the job), or "" while it still may. Empty: every writer may.
  std::function<std::string(int worker)> gone;
  // The flush thread runs at a lower priority than the training threads.
  bool lowPriority = false;
  // Hooks (any may be empty): before a version is written (on the flush thread), after it
  // was, and when a version could not be made durable: `verb` and `where` say what failed
  // ("write", the folder; "copy", "host memory").
  std::function<void(int64_t step)> beforeWrite;
  std::function<void(const FlushedVersion&)> onFlushed;
  std::function<void(int64_t step, const std::string& verb, const std::string& where,
                     std::exception_ptr error)>
      onFailed;
  // A version written but not named durable because `newer` already is (StaleVersion).
  // Unset: one line on stderr.
  std::function<void(int64_t step, int64_t newer, const std::string& what)> onSuperseded;
};

class VersionFlusher {
 public:
  // Throws InvalidArgument if persist.dir is empty or store is null.
  explicit VersionFlusher(VersionFlusherOptions options);
  // Writes what was submitted, then joins the flush thread (reserved versions that never came
  // are not waited for).
  ~VersionFlusher();
  VersionFlusher(const VersionFlusher&) = delete;
  VersionFlusher& operator=(const VersionFlusher&) = delete;

  // A version is on its way (its copy to host memory is in flight). Every reserve() is
  // followed by exactly one of submit(), cancel() or fail().
  void reserve();
  // Queues a reserved version's shard for writing with `role`.
  void submit(std::shared_ptr<const HostShard> shard, FlushRole role, bool shared = false);
  // A reserved version that will not come, silently (its copy's error goes elsewhere).
  void cancel();
  // A reserved version that could not be made durable: reported through onFailed.
  void fail(int64_t step, std::exception_ptr error, const std::string& verb,
            const std::string& where);

  // Versions reserved and not yet written or failed.
  int64_t outstanding() const;
  // Waits until outstanding() is 0.
  void waitIdle();
  int64_t flushed() const;
  const std::string& dir() const { return options_.persist.dir; }
  CheckpointWriter& writer() { return *writer_; }

  // The key of a kPost record, and of the newest durable version (advanced, never moved back).
  std::string recordKey(int64_t step, int worker) const;
  std::string durableKey() const { return options_.prefix + "/durable"; }

 private:
  struct Job {
    std::shared_ptr<const HostShard> shard;
    FlushRole role;
    bool shared = false;
  };
  void loop();
  void write(const Job& job);

  const VersionFlusherOptions options_;
  std::unique_ptr<CheckpointWriter> writer_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Guarded by mu_.
  std::deque<Job> queue_;
  int64_t outstanding_ = 0;
  int64_t flushed_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace checkpoint
}  // namespace sinew
