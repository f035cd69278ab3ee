#include "sinew/runtime/goodput_meter.h"

#include <algorithm>

namespace sinew {
namespace runtime {

namespace {
// Steps a rollback can undo: far more than the peer-RAM versions a job keeps.
constexpr size_t kRecentSteps = 4096;
}  // namespace

const char* GoodputMeter::causeName(int cause) {
  switch (cause) {
    case kTraining:
      return "training";
    case kRedone:
      return "redone";
    case kReconfiguration:
      return "reconfiguration";
    case kRollback:
      return "rollback";
  }
  return "?";
}

void GoodputMeter::onCommit(Clock::time_point now, int64_t samples) {
  double step = 0;
  switch (state_) {
    case State::kBeforeFirstCommit:
      start_ = now;  // The clock starts here; the first step is start-up.
      break;
    case State::kTraining:
      step = secondsOf(now - mark_);
      steadyStep_ = step;
      break;
    case State::kEpochStart:
    case State::kRecovering: {
      const double interval = secondsOf(now - mark_);
      step = steadyStep_ > 0 ? std::min(interval, steadyStep_) : interval;
      charge(pause_, interval - step);
      break;
    }
  }
  if (state_ != State::kBeforeFirstCommit) {
    charge(kTraining, step);
    account_.samples += static_cast<double>(samples);
    steps_.emplace_back(step, samples);
    if (steps_.size() > kRecentSteps) steps_.pop_front();
  }
  state_ = State::kTraining;
  mark_ = now;
}

void GoodputMeter::onLoss(Clock::time_point now) {
  if (state_ == State::kBeforeFirstCommit) return;
  const double since = secondsOf(now - mark_);
  if (state_ == State::kTraining) {
    charge(kRedone, since);
  } else {
    charge(pause_, since);  // a loss during a recovery: its time so far
  }
  state_ = State::kRecovering;
  pause_ = kReconfiguration;
  mark_ = now;
}

void GoodputMeter::onEpoch(Clock::time_point now) {
  const bool rollback = rollbackNext_;
  rollbackNext_ = false;
  if (state_ == State::kBeforeFirstCommit) return;
  const double since = secondsOf(now - mark_);
  // From a commit (a join or a reshape at a step boundary) the epoch's set-up starts here.
  charge(state_ == State::kTraining ? kReconfiguration : pause_, since);
  state_ = State::kEpochStart;
  pause_ = rollback ? kRollback : kReconfiguration;
  mark_ = now;
}

void GoodputMeter::onRollback(int64_t steps) {
  rollbackNext_ = true;
  for (; steps > 0 && !steps_.empty(); --steps) {
    const auto [seconds, samples] = steps_.back();
    steps_.pop_back();
    account_.seconds[kTraining] -= seconds;
    account_.seconds[kRollback] += seconds;
    account_.samples -= static_cast<double>(samples);
  }
}

GoodputMeter::Account GoodputMeter::at(Clock::time_point now) const {
  Account a = account_;
  if (state_ == State::kBeforeFirstCommit) return a;
  const double open = std::max(0.0, secondsOf(now - mark_));
  a.seconds[state_ == State::kTraining ? kTraining : pause_] += open;
  a.wall_s = std::max(0.0, secondsOf(now - start_));
  return a;
}

}  // namespace runtime
}  // namespace sinew
