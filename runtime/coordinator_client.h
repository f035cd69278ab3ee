#pragma once

// A worker's connection to the coordinator (docs/architecture.md section 3): hello, heartbeats,
// epoch announcements, failure reports and the step vote. It owns one io thread, which reads the
// coordinator's messages and sends heartbeats; the worker's threads call the methods below.
//
// Thread safety: every method may be called from any thread.

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "sinew/base/cancellation.h"
#include "sinew/base/error.h"

namespace sinew {
namespace runtime {

// Failures reach the worker as sinew::Expelled and sinew::Released (sinew/error.h).

// One configuration of the job, as the coordinator announced it.
struct EpochInfo {
  int64_t epoch = -1;
  std::vector<int> members;  // worker ids, ascending
  // The first step this epoch runs: the last committed step + 1.
  int64_t resumeStep = 0;
  // A member that holds the committed state, to copy it from when sync is set (-1: none).
  int source = -1;
  // Members that hold no state yet (joined at this epoch).
  std::vector<int> joined;
  // Every member must take the state from source before the first step (first epoch, joins).
  bool sync = false;
  // A pipeline job's plan for this epoch (pipeline::planToJson), made by the coordinator;
  // empty for data parallel jobs and before the job's pipeline request was planned.
  std::string plan;
};

// How the voter's step went, for the coordinator's status and scaling (docs/control_api.md):
// its forward and backward time, and how long it stalled for a checkpoint snapshot.
struct StepStats {
  double computeSeconds = 0;
  double stallSeconds = 0;
  // Bytes of peer-RAM replicas this worker sent since its previous vote.
  int64_t replicatedBytes = 0;
  // Bytes of model and optimizer state it took in to enter this epoch (a joiner's copy of the
  // state, a pipeline's layer copies); reported with its first vote of the epoch.
  int64_t stateBytesIn = 0;
};

// The job's shape, for the coordinator's throughput figures and scaling curve.
struct JobShape {
  int64_t globalBatch = 0;  // samples per step; 0: unknown
  int64_t microbatch = 0;
  int64_t steps = 0;
  bool checkpoints = false;  // writes durable checkpoints
};

// Io threads that several clients share, for a process that speaks for many workers (a
// harness of simulated workers, e.g. sinew-bench-control-plane): each client runs on one of
// them, taken in turn, so that all of one client's handlers run on one thread. A worker
// process has one client and needs none of this (a client without it has an io thread of its
// own).
//
// Thread safety: next() may be called from any thread. REQUIRES: destroyed after every client
// that uses it (each client holds it by shared_ptr, so dropping the other references is enough).
class ClientIoThreads {
 public:
  explicit ClientIoThreads(int threads);
  ~ClientIoThreads();
  ClientIoThreads(const ClientIoThreads&) = delete;
  ClientIoThreads& operator=(const ClientIoThreads&) = delete;
  int size() const;

  class Impl;
  Impl& impl() { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
};

struct CoordinatorClientOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  uint64_t token = 0;
  // The launch rank, or -1 to join a running job (the coordinator assigns an id).
  int worker = -1;
  // The failure domain (a host name); workers of one node fail together.
  std::string node;
  std::chrono::milliseconds connectTimeout{60000};
  // Run on one of these shared io threads instead of an io thread of the client's own.
  std::shared_ptr<ClientIoThreads> ioThreads;

  // High availability (docs/ha.md): the job's leader is found in etcd, and may change. When
  // awaitLeader is set, host and port are ignored: the client connects to the leader it
  // returns; a closed connection is not the end of the job (the client waits for a leader,
  // the same or a new one, and says hello again with `rejoin`: its last epoch and commit);
  // and the client moves to a new leader as soon as one is announced, since a paused leader
  // may hold its connections open without answering. awaitLeader blocks up to `timeout` for
  // a leader whose term is not `otherThan` (0: any leader) and returns nullopt when there is
  // none by then, or at once when `cancel` (may be null) is cancelled from another thread; it
  // may throw (etcd unreachable), which counts as none.
  struct Leader {
    std::string host;
    uint16_t port = 0;
    int64_t term = 0;
  };
  using LeaderFinder = std::function<std::optional<Leader>(
      int64_t otherThan, std::chrono::milliseconds timeout, Cancellation* cancel)>;
  LeaderFinder awaitLeader;
  // With awaitLeader, while connected: how long one wait for a new leader lasts before the
  // client waits again (a new leader is seen as soon as etcd names it either way; a closed
  // connection or close() ends the wait at once). Each wait is a read and a watch of the
  // leader key in etcd, so this sets the load a job puts on etcd (N workers: N / leaderWatch
  // requests a second) and how late a watch held by a silent etcd member sees a new leader.
  std::chrono::milliseconds leaderWatch{10000};
  // With awaitLeader: how long the worker may be without a leader before it gives up (the
  // job's state is safe in etcd; the worker ends with Expelled naming the wait).
  std::chrono::milliseconds reconnectTimeout{60000};
};

class CoordinatorClient {
 public:
  // Connects, says hello and waits for the welcome. Throws Timeout if the coordinator cannot
  // be reached within connectTimeout, InvalidArgument if it rejects the hello.
  explicit CoordinatorClient(CoordinatorClientOptions options);
  ~CoordinatorClient();
  CoordinatorClient(const CoordinatorClient&) = delete;
  CoordinatorClient& operator=(const CoordinatorClient&) = delete;

  int worker() const;
  const std::string& node() const;
  // The rendezvous store the coordinator serves.
  const std::string& storeHost() const;
  uint16_t storePort() const;

  // The newest epoch announced (epoch -1 before the first).
  EpochInfo latestEpoch() const;
  // Waits for an epoch newer than `epoch`. Throws Expelled, or Timeout.
  EpochInfo waitEpochAfter(int64_t epoch, std::chrono::milliseconds timeout);

  enum class VoteResult {
    kCommitted,             // every member voted: apply the step
    kCommittedThenReshape,  // apply it; a new epoch (joiners) follows at this boundary
    kSuperseded,            // a new epoch began first: do not apply; recover
  };
  // Votes that this worker finished the reduction of `step` in `epoch`, and waits for the
  // verdict. Without one within `timeout` (e.g. the coordinator is paused with the vote in its
  // socket) it withdraws the vote and waits up to `withdrawalTimeout` (0: `timeout`) more for
  // the coordinator's answer: the commit if it committed `step` before reading the withdrawal,
  // else the next epoch (docs/failure_semantics.md, rule 14). Throws Expelled, or Timeout.
  VoteResult vote(int64_t epoch, int64_t step, std::chrono::milliseconds timeout,
                  StepStats stats = StepStats(),
                  std::chrono::milliseconds withdrawalTimeout = std::chrono::milliseconds(0));
  // vote() in two halves, for a thread that speaks for several workers (it casts each one's
  // vote, then awaits each verdict) or does other work while the vote is out: castVote sends
  // the vote and returns at once; awaitVerdict then waits as vote() does after sending,
  // withdrawal included. REQUIRES: awaitVerdict(epoch, step) only after castVote(epoch, step).
  void castVote(int64_t epoch, int64_t step, StepStats stats = StepStats());
  VoteResult awaitVerdict(
      int64_t epoch, int64_t step, std::chrono::milliseconds timeout,
      std::chrono::milliseconds withdrawalTimeout = std::chrono::milliseconds(0));
  // Whether the commit of `step` asked for a durable checkpoint of it (a scheduler's
  // checkpoint, drain or stop request).
  bool checkpointRequested(int64_t step) const;
  // The coordinator's step deadline, as its last commit or epoch gave it (0 before any, or
  // when its progress check is off): the base of the worker's own deadlines.
  std::chrono::milliseconds stepDeadline() const;
  // Reports that the version of `step` is durable: `bytes` written to `path` in `flushSeconds`
  // (sent by the worker that moved LATEST to it).
  void durable(int64_t step, uint64_t bytes, double flushSeconds, const std::string& path);

  // Reports a peer the data plane lost (from PeerLost).
  void reportLost(int64_t epoch, int worker);
  // Reports that `epoch`'s communicator could not be built; the coordinator starts another.
  void requestRebuild(int64_t epoch);
  // Reports that this worker is ready to train, and the first step it could resume at from
  // a durable checkpoint (0 for none). The first epoch forms when every launched worker is
  // ready; it resumes at the smallest such step.
  void ready(int64_t resumeStep, JobShape shape = JobShape());
  // Asks the coordinator to run the job as pipelines planned from `profileJson`
  // (docs/profile_format.md) with this fault tolerance and global batch of `microbatches`,
  // with templates for up to `maxWorkers` workers (joins; 0: the workers it starts with);
  // it answers with a new epoch that carries the plan, or expels everyone naming why no plan
  // fits. Only the first request of a job counts.
  void requestPipelines(int64_t epoch, const std::string& profileJson, int faultTolerance,
                        int64_t microbatches, int64_t maxWorkers = 0);
  // Pipelines: some layer has no live copy after epoch's resume step (every worker that held
  // it is gone), so the job must resume after `step`, the newest version still held
  // somewhere (-1: from the start). The coordinator answers with a new epoch resuming at
  // step + 1; a request for a step at or after the resume step, or of an older epoch, is
  // ignored (docs/pipeline.md, "Rollback").
  void requestRollback(int64_t epoch, int64_t step);
  // Reports that this worker finished every step.
  void done(int64_t step);
  // Where this worker stands with the job, for its exit status (Context::finishJob): still in
  // it, done with every step, released while the job goes on, released because the whole job
  // stopped at a step boundary, or expelled (also: the coordinator is gone).
  enum class Standing { kIn, kDone, kReleased, kJobStopped, kExpelled };
  Standing standing() const;
  // Leaves: closes the connection once what is queued is written (the coordinator counts this
  // worker as gone) and joins the client's threads; later waits throw Expelled at once, other
  // calls do nothing. The destructor does the same.
  void close();
  // Asks to leave the job at the next step boundary (preemption); the coordinator answers
  // by releasing it right after the next committed step (waitEpochAfter then throws
  // Released).
  void leave(int64_t step);
  // The progress heartbeats carry (docs/failure_semantics.md, rule 1): the step, and whether
  // this worker is waiting on others (in a collective of that step, or for its vote's verdict)
  // rather than computing. The coordinator declares dead a member that computes on while the
  // others have waited for it past the step deadline.
  void setProgress(int64_t step, bool waiting);
  // Sends the coordinator nothing, heartbeats and votes alike, for this long (failure
  // injection): the worker looks dead.
  void muteHeartbeats(std::chrono::milliseconds duration);

  // Called on the io thread when an epoch newer than the previous one is announced, or when
  // this worker is expelled (with -1): the trainer aborts its communicator, so that a call
  // blocked on a dead or stopped peer returns at once. Must not block.
  void setEpochListener(std::function<void(int64_t)> listener);

  class Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace runtime
}  // namespace sinew
