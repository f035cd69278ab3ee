#pragma once

// What the coordinator measures of a job as it runs (docs/control_api.md, "Status" and
// "Metrics"): commits and the time between them (overall, and by member count for the scaling
// curve), failures and the recoveries after them, rollbacks, checkpoint stalls, the bytes of
// peer-RAM replicas, and the durable checkpoint versions. The job-state machine (job_state.h)
// tells it what happened; the status, the metrics, the scaling curve and the step deadline read
// it. Only the durable version outlives a change of leader (job_state_ha.cc stores it);
// everything else is this coordinator's term's.
//
// Internal to sinew_runtime. Thread safety: none; the job-state machine serializes every call.

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace sinew {
namespace runtime {
namespace coordinator_detail {

inline double secondsOf(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// The upper median (0 for none).
inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace coordinator_detail

class JobMeasures {
 public:
  using Clock = std::chrono::steady_clock;

  // The newest durable checkpoint version the workers reported.
  struct DurableVersion {
    int64_t step = -1;
    std::string path;
    int64_t bytes = 0;
    double flushSeconds = 0;
    Clock::time_point at{};
  };

  // A commit at `now` while the epoch has `members` members. Returns the seconds since the
  // commit before it in the same epoch (a steady step), or nothing for an epoch's first.
  std::optional<double> onCommit(Clock::time_point now, int members);
  // A new epoch: its first commit starts a new series (a recovery is not a step).
  void onEpoch() { lastCommit_ = Clock::time_point{}; }
  // The last commit of this epoch (epoch's start: the zero time point).
  Clock::time_point lastCommit() const { return lastCommit_; }

  // `n` workers declared dead.
  void onFailures(int64_t n) { failures_ += n; }
  // A recovery starts at `now` (a member's failure, a takeover), unless one is under way.
  void startRecovery(Clock::time_point now);
  // The commit at `now` ends the recovery under way, if one is: its seconds.
  std::optional<double> endRecovery(Clock::time_point now);
  bool recovering() const { return recovering_; }
  void onRollback() { rollbacks_++; }

  // From a vote: seconds a worker stalled for a snapshot; replica bytes it sent to peers.
  void onStall(double seconds) { stallSeconds_ += seconds; }
  void onReplicated(int64_t bytes) { replicatedBytes_ += bytes; }
  // A durable version written by a worker; the newest by step is kept.
  void onDurable(int64_t step, const std::string& path, int64_t bytes, double flushSeconds,
                 Clock::time_point now);
  // A takeover's restored state: the durable version the leader before stored.
  void restoreDurable(int64_t step, const std::string& path);
  const DurableVersion& durable() const { return durable_; }
  // The mean seconds a durable version took to write (0 before any).
  double meanFlushSeconds() const {
    return durableWrites_ > 0 ? flushSecondsTotal_ / static_cast<double>(durableWrites_) : 0;
  }
  // The coordinator's time for the newest commit (JobState::noteCommitWritten).
  void setCommitSeconds(double s) { commitSeconds_ = s; }

  // The median of the newest `newest` times between commits (seconds; 0 before any).
  double medianStepSeconds(size_t newest = SIZE_MAX) const;
  // The median time between commits, as a duration (nothing before any).
  std::optional<Clock::duration> medianStep() const;
  bool anyStep() const { return !stepTimes_.empty(); }
  // Seconds between commits by member count, the newest 50 of each.
  const std::map<int, std::deque<double>>& stepSecondsBySize() const { return bySize_; }
  // Samples per second over the newest steps, 0 while not training (no commit for three step
  // times), at `now` with `globalBatch` samples a step.
  double samplesPerSecondNow(Clock::time_point now, int64_t globalBatch) const;

  // The status's measured fields (samples_per_s, failures, rollbacks, recovery_s, recovering,
  // effective_training_s) into `status`.
  void addStatus(nlohmann::json& status, Clock::time_point now, int64_t globalBatch) const;
  // The durable version as the status shows it (null: none yet).
  nlohmann::json durableJson(Clock::time_point now) const;
  // The Prometheus metrics of what is measured here.
  void addMetrics(std::string& out) const;

 private:
  Clock::time_point lastCommit_{};
  std::deque<Clock::duration> stepTimes_;  // between the last commits, at most 20
  std::map<int, std::deque<double>> bySize_;
  int64_t commits_ = 0;
  Clock::time_point firstCommit_{};
  double effectiveSeconds_ = 0;  // the steady steps' seconds, summed
  double commitSeconds_ = 0;
  int64_t failures_ = 0;
  bool recovering_ = false;
  Clock::time_point recoveringSince_{};
  std::vector<double> recoverySeconds_;
  int64_t rollbacks_ = 0;
  double stallSeconds_ = 0;
  int64_t replicatedBytes_ = 0;
  DurableVersion durable_;
  int64_t durableWrites_ = 0;
  int64_t durableBytes_ = 0;
  double flushSecondsTotal_ = 0;
};

// Prometheus text format: one metric with its help and type.
void appendMetric(std::string& out, const char* name, const char* type, const char* help,
                  double value);

}  // namespace runtime
}  // namespace sinew
