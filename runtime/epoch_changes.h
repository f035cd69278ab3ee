#pragma once

// What each change of a job's epoch cost, measured, and what the next one is predicted to cost
// (docs/control_api.md, "The scheduler contract"). A change starts when the coordinator forms
// a new epoch (a failure, a join, a resize or drain's release, a rollback) and ends at the new
// epoch's first commit. Its pause is the time from the last commit before it to that first
// commit, less one step at the step time measured just before (the step the epoch would have
// taken anyway); its bytes are the model and optimizer state the new epoch's members took in (a
// joiner's copy, a pipeline's layer copies), as they report with their first votes. Changes
// that follow each other before any commit (a failure during a grow) are one change.
//
// Internal to sinew_runtime; the coordinator's state machine owns it. Thread safety: none.

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <deque>
#include <optional>
#include <set>
#include <string>

namespace sinew {
namespace runtime {

class EpochChanges {
 public:
  using Clock = std::chrono::steady_clock;

  struct Change {
    int64_t epoch = 0;
    // "grow", "shrink", "failure" (a member was lost), "rollback", or "other" (the same
    // members: a rebuild, a withdrawn vote, a takeover).
    std::string kind;
    std::set<std::string> causes;  // "failure", "join", "resize", "drain", "leave", ...
    int fromWorkers = 0;
    int toWorkers = 0;
    double pauseSeconds = 0;     // interval less one steady step, >= 0
    double intervalSeconds = 0;  // last commit before the change -> the epoch's first commit
    int64_t stateBytesIn = 0;    // summed over the new epoch's members
    int receivers = 0;           // members that took in state
    int64_t firstStep = 0;       // the step the new epoch committed first
  };

  // A prediction from the changes measured so far.
  struct Prediction {
    double pauseSeconds = 0;
    int basedOn = 0;    // changes of that kind it is the median of (0: none of the kind)
    std::string basis;  // "measured grow (3)", "measured: any kind (2)", "nothing measured yet"
  };

  // The steady step time, as measured between two commits of one epoch.
  void onSteadyStep(double seconds) { steadyStep_ = seconds; }
  // A new epoch formed at `now` for `cause`, leaving the last epoch's `fromWorkers` members;
  // `lastCommit` is the last commit before it (Clock::time_point{} if none: then `now`).
  void begin(Clock::time_point now, Clock::time_point lastCommit, int fromWorkers,
             const std::string& cause);
  // A member of the new epoch took in `bytes` of state.
  void addStateBytes(int64_t bytes);
  // The epoch `epoch` committed `step`, its first, at `now` with `toWorkers` members: the
  // change ends (nullopt if none was in progress).
  std::optional<Change> end(Clock::time_point now, int64_t epoch, int64_t step, int toWorkers);
  bool inProgress() const { return active_; }

  // The median pause of the measured changes of `kind` (the newest 20 of each), else of any
  // kind, else 0 with basedOn 0.
  Prediction predictPause(const std::string& kind) const;
  // The median state bytes one member took in when it took any (0 when none measured). A
  // data-parallel epoch with joiners broadcasts the state to every member but its source.
  int64_t bytesPerReceiver() const;
  const std::deque<Change>& history() const { return history_; }

  static nlohmann::json toJson(const Change& c);

 private:
  bool active_ = false;
  Change current_;
  Clock::time_point since_{};
  double steadyStep_ = 0;
  std::deque<Change> history_;  // the newest 100
};

}  // namespace runtime
}  // namespace sinew
