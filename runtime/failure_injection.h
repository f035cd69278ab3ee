#pragma once

// Failure injection (docs/architecture.md section 8). A spec is a ';'-separated list of faults,
// each `kind:key=value:key=value...`:
//   kill:worker=2:step=30:phase=backward    SIGKILL this process
//   stop:worker=1:step=50:secs=3            SIGSTOP this process for secs (a helper
//                                           process sends SIGCONT)
//   mute:worker=1:step=20:secs=3            send the coordinator nothing (no heartbeats, no
//                                           votes) for secs
//   slow:worker=0:ms=20[:step=N]            sleep ms (at every step when step is absent)
//   failwrite:worker=0:step=19              the flush of version 19 fails with IoError (phase
//                                           flush, the only one it takes)
//   corrupt:worker=0:step=19                once version 19 is written, 8 bytes near the end
//                                           of each of its shard files are overwritten, as
//                                           bit rot would (phase flush, the default for
//                                           corrupt): a restore must notice and fall back
//   corrupt:worker=0:step=10:phase=copy     in the first layer copy this worker sends at or
//                                           after step 10, the first tensor goes with its first
//                                           8 bytes overwritten (its own state stays intact):
//                                           the receiver must notice and the copy be tried again
// worker is the launch rank (or `*` for every worker); phase is one of forward, backward,
// reduce, after-reduce, optimizer, snapshot, replication, recovery, reconfiguration, copy,
// release, flush, done (default forward). forward to optimizer fire at exactly `step`; the others
// fire at the first occasion at or after `step`, since a writer may skip a version (its previous
// flush still running) and a failure may come at any step: `snapshot` while a checkpoint writer
// copies a version to host memory; `replication` on a pipeline worker's replication thread before
// it sends a peer-RAM version; `recovery` in the first recovery after a failure; `reconfiguration`
// when an epoch after the first is announced (a failure, a join, a leave), before the worker
// builds its communicator; `copy` in a pipeline relayout between the layer manifests and the
// tensors; `release` once this worker has left the job at its word (released by a resize or
// a drain, or the job stopped), before it writes its last checkpoint and exits; `flush` on the
// checkpoint flush thread before it writes version `step` (exactly), or every version when a slow
// has no step; `done` once this worker has reported every step done, before it closes and exits.
// Each fault except an every-step slow fires once.
//
// With no faults, fire() is one inlined emptiness check: zero cost when unset.
//
// Thread safety: fire() for phase flush is called from the flush thread, for phase replication
// from the checkpoint engines' replication threads (one per kept generation), every other phase
// from the trainer's thread; a fault's `fired` is checked and set under a mutex.

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace sinew {
namespace runtime {

class CoordinatorClient;

// What a corrupt fault writes over the bytes it damages (a shard file's, a layer copy's).
inline constexpr char kDamageBytes[8] = {'\xde', '\xad', '\xbe', '\xef',
                                         '\xde', '\xad', '\xbe', '\xef'};

enum class Phase {
  kForward,
  kBackward,
  kReduce,
  kAfterReduce,
  kOptimizer,
  kSnapshot,
  kReplication,  // on the replication thread, before a peer-RAM version is sent (pipelines)
  kRecovery,
  kReconfiguration,
  kCopy,     // pipelines: between a layer copy's manifests and its tensors (sender and receiver)
  kRelease,  // left the job at its word, before its last checkpoint and its exit
  kFlush,
  kDone  // reported every step done to the coordinator, before closing and exiting
};

const char* phaseName(Phase p);

struct Fault {
  enum class Kind { kKill, kStop, kMute, kSlow, kFailWrite, kCorrupt };
  Kind kind = Kind::kKill;
  int worker = -1;    // -1: every worker
  int64_t step = -1;  // -1: every step (slow only)
  Phase phase = Phase::kForward;
  double seconds = 0;       // stop, mute
  double milliseconds = 0;  // slow
  // slow with us_per_sample: emulated accelerator time, this many microseconds for each sample
  // the worker computes in a data-parallel step (so a step's compute shrinks with the workers:
  // a scheduler's benchmark on a CPU-only machine, docs/control_api.md).
  double microsPerSample = 0;
  // slow with comm_ms: emulated communication, this many milliseconds of every data-parallel
  // step spent in the gradient reduction (a step's part that more workers do not shrink).
  double commMilliseconds = 0;
  bool fired = false;
};

class FailureInjector {
 public:
  FailureInjector() = default;
  // Parses a spec; throws InvalidArgument naming the offending fault and field.
  static FailureInjector parse(const std::string& spec);
  // Parses $SINEW_INJECT (empty injector when unset).
  static FailureInjector fromEnvironment();

  bool empty() const { return faults_.empty(); }
  const std::vector<Fault>& faults() const { return faults_; }

  // Runs the faults scheduled for (worker, step, phase). `client` may be null (mute then
  // does nothing).
  void fire(int worker, int64_t step, Phase phase, CoordinatorClient* client) {
    if (faults_.empty()) return;
    fireSlow(worker, step, phase, client);
  }
  // Sleeps for the emulated compute of `samples` (slow faults with us_per_sample) due for
  // (worker, step).
  void emulateCompute(int worker, int64_t step, int64_t samples);
  // Sleeps for the emulated communication (slow faults with comm_ms) due for (worker, step).
  void emulateCommunication(int worker, int64_t step);
  // On the flush thread, once version `step` is written to the checkpoint directory `dir`:
  // runs the corrupt faults due. Returns how many files it damaged.
  int afterFlush(int worker, int64_t step, const std::string& dir) {
    if (faults_.empty()) return 0;
    return corruptDue(worker, step, dir);
  }
  // In a layer copy this worker sends while the job resumes at `step`: whether a corrupt
  // fault of phase copy is due (once).
  bool damageCopy(int worker, int64_t step) {
    if (faults_.empty()) return false;
    return copyCorruptionDue(worker, step);
  }

 private:
  void fireSlow(int worker, int64_t step, Phase phase, CoordinatorClient* client);
  int corruptDue(int worker, int64_t step, const std::string& dir);
  bool copyCorruptionDue(int worker, int64_t step);
  std::vector<Fault> faults_;
  // Guards Fault::fired: several replication threads (one per kept peer-RAM generation) may
  // fire phase replication at once. Shared so that the injector stays copyable.
  std::shared_ptr<std::mutex> firedMu_ = std::make_shared<std::mutex>();
};

}  // namespace runtime
}  // namespace sinew
