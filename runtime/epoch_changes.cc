#include "sinew/runtime/epoch_changes.h"

#include <algorithm>
#include <vector>

namespace sinew {
namespace runtime {

namespace {

template <typename T>
T medianOf(std::vector<T> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : static_cast<T>((v[n / 2 - 1] + v[n / 2]) / 2);
}

}  // namespace

void EpochChanges::begin(Clock::time_point now, Clock::time_point lastCommit, int fromWorkers,
                         const std::string& cause) {
  if (!active_) {
    active_ = true;
    current_ = Change{};
    current_.fromWorkers = fromWorkers;
    since_ = lastCommit == Clock::time_point{} ? now : lastCommit;
  }
  current_.causes.insert(cause);
  // The bytes of an epoch that never committed were taken in for nothing: only the epoch that
  // commits counts (its members report again).
  current_.stateBytesIn = 0;
  current_.receivers = 0;
}

void EpochChanges::addStateBytes(int64_t bytes) {
  if (!active_ || bytes <= 0) return;
  current_.stateBytesIn += bytes;
  current_.receivers++;
}

std::optional<EpochChanges::Change> EpochChanges::end(Clock::time_point now, int64_t epoch,
                                                      int64_t step, int toWorkers) {
  if (!active_) return std::nullopt;
  active_ = false;
  Change c = std::move(current_);
  c.epoch = epoch;
  c.firstStep = step;
  c.toWorkers = toWorkers;
  c.intervalSeconds = std::chrono::duration<double>(now - since_).count();
  c.pauseSeconds = std::max(0.0, c.intervalSeconds - steadyStep_);
  if (c.causes.count("rollback")) {
    c.kind = "rollback";
  } else if (c.causes.count("failure")) {
    c.kind = "failure";
  } else if (c.toWorkers > c.fromWorkers) {
    c.kind = "grow";
  } else if (c.toWorkers < c.fromWorkers) {
    c.kind = "shrink";
  } else {
    c.kind = "other";
  }
  history_.push_back(c);
  if (history_.size() > 100) history_.pop_front();
  return c;
}

EpochChanges::Prediction EpochChanges::predictPause(const std::string& kind) const {
  std::vector<double> same, any;
  for (auto it = history_.rbegin(); it != history_.rend(); ++it) {
    if (it->kind == kind && same.size() < 20) same.push_back(it->pauseSeconds);
    if (any.size() < 20) any.push_back(it->pauseSeconds);
  }
  Prediction p;
  if (!same.empty()) {
    p.pauseSeconds = medianOf(same);
    p.basedOn = static_cast<int>(same.size());
    p.basis = "measured " + kind + " (" + std::to_string(same.size()) + ")";
  } else if (!any.empty()) {
    p.pauseSeconds = medianOf(any);
    p.basis = "measured: other kinds (" + std::to_string(any.size()) + ")";
  } else {
    p.basis = "nothing measured yet";
  }
  return p;
}

int64_t EpochChanges::bytesPerReceiver() const {
  std::vector<int64_t> per;
  for (const Change& c : history_) {
    if (c.receivers > 0) per.push_back(c.stateBytesIn / c.receivers);
  }
  return per.empty() ? 0 : medianOf(per);
}

nlohmann::json EpochChanges::toJson(const Change& c) {
  return {{"epoch", c.epoch},
          {"kind", c.kind},
          {"causes", c.causes},
          {"from_workers", c.fromWorkers},
          {"to_workers", c.toWorkers},
          {"pause_s", c.pauseSeconds},
          {"interval_s", c.intervalSeconds},
          {"state_bytes_in", c.stateBytesIn},
          {"receivers", c.receivers},
          {"first_step", c.firstStep}};
}

}  // namespace runtime
}  // namespace sinew
