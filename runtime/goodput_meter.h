#pragma once

// The coordinator's live account of the job's wall time in the failure-trace simulator's
// vocabulary (docs/goodput.md, docs/control_api.md "goodput"): committed samples, and the
// seconds that went to training that stayed committed, to the steps in flight that losses threw
// away, to reconfiguration (epochs after losses, joins and reshapes, until their first step
// commits), and to rollbacks (steps undone, and the restore epoch). The clock starts at the
// job's first commit (what comes before is start-up) and covers this coordinator's term.
//
// The coordinator cannot see when a worker died, only when it noticed: the time from the last
// commit to the notice counts as redone (the step in flight and the detection together). An
// epoch's first step is charged as one step at the last steady step time (the rest of its
// interval is the epoch's set-up); the steps of one epoch are charged at their measured
// intervals.
//
// Thread safety: none (the coordinator's state machine owns it).

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>

namespace sinew {
namespace runtime {

class GoodputMeter {
 public:
  using Clock = std::chrono::steady_clock;
  enum Cause : int { kTraining = 0, kRedone, kReconfiguration, kRollback, kCauses };
  static const char* causeName(int cause);  // "training", "redone", ...

  struct Account {
    double samples = 0;  // committed since the clock started
    double wall_s = 0;
    std::array<double, kCauses> seconds{};
  };

  // A step of `samples` committed at `now`.
  void onCommit(Clock::time_point now, int64_t samples);
  // A member's loss noticed at `now`.
  void onLoss(Clock::time_point now);
  // A new epoch formed at `now` (a rollback's epoch if onRollback came just before).
  void onEpoch(Clock::time_point now);
  // The newest `steps` committed steps were undone by a rollback; the next epoch restores
  // the version.
  void onRollback(int64_t steps);
  // The account up to `now` (an interval in progress counts as what it is so far).
  Account at(Clock::time_point now) const;

 private:
  enum class State { kBeforeFirstCommit, kTraining, kEpochStart, kRecovering };
  void charge(int cause, double seconds) { account_.seconds[cause] += seconds; }
  static double secondsOf(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

  State state_ = State::kBeforeFirstCommit;
  Clock::time_point start_{};
  Clock::time_point mark_{};
  int pause_ = kReconfiguration;  // the cause of the epoch set-up in progress
  bool rollbackNext_ = false;     // onRollback came: the next epoch is a rollback's
  double steadyStep_ = 0;         // the last step time measured within an epoch
  Account account_;
  std::deque<std::pair<double, int64_t>> steps_;  // recent steps' (seconds, samples)
};

}  // namespace runtime
}  // namespace sinew
