#pragma once

// Internal: what the trainer's parts (runtime/trainer.cc and the units it delegates to: epoch
// entry, durable checkpoints, peer-RAM versions, layer relayout, profile agreement, device
// choice) share: the worker's context, its coordinator client, its event log and options, the
// deadline hierarchy, and a few scopes and helpers. Not installed.
//
// Thread safety: TrainerServices is read-only after construction; its client and event log are
// thread-safe. The scopes are used by the training thread.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "sinew/base/error.h"
#include "sinew/checkpoint/engine.h"
#include "sinew/runtime/context_state.h"
#include "sinew/runtime/event_log.h"
#include "sinew/store.h"
#include "sinew/trainer.h"

namespace sinew {
namespace runtime {

using TrainerClock = std::chrono::steady_clock;

inline double seconds(TrainerClock::duration d) { return std::chrono::duration<double>(d).count(); }

using ::sinew::detail::describe;

// Seconds spent in the named parts of a piece of work, in order: {"name": s, ...} for an event.
class Laps {
 public:
  // The time since the previous lap (or since construction) goes to `name`.
  void lap(const char* name) {
    const auto now = TrainerClock::now();
    laps_[name] = seconds(now - last_);
    last_ = now;
  }
  const nlohmann::json& json() const { return laps_; }

 private:
  TrainerClock::time_point last_ = TrainerClock::now();
  nlohmann::json laps_ = nlohmann::json::object();
};

// The services of one worker's trainer. All references outlive the trainer.
struct TrainerServices {
  Context& ctx;
  ContextState& state;  // ctx's
  CoordinatorClient& client;
  EventLog& events;
  const TrainerOptions& options;

  // The step time the current pipeline plan predicts (its cost model's 1F1B time of the
  // slowest pipeline), in milliseconds; 0 in data parallel mode and before the first plan.
  mutable std::atomic<int64_t> plannedStepMs{0};

  int worker() const { return ctx.worker(); }
  void event(nlohmann::json e) const { events.write(std::move(e)); }

  // The deadline hierarchy (docs/failure_semantics.md, rule 12): the coordinator's step
  // deadline, derived from the measured step time, is the first to expire, so that it, not a
  // timeout in some collective, decides who is stuck; an operation's deadline is at least
  // twice it and a recovery's four times (each at least its TrainerOptions value); the job's
  // is the launcher's (--deadline-s). Before a step was measured, the plan's predicted step
  // time stands in for it: a stage of a large model may compute one microbatch for longer
  // than opTimeout, and its neighbour waits that long.
  std::chrono::milliseconds stepScale() const {
    return std::max(client.stepDeadline(), std::chrono::milliseconds(plannedStepMs.load()));
  }
  std::chrono::milliseconds opTimeout() const {
    return std::max(options.opTimeout, 2 * stepScale());
  }
  std::chrono::milliseconds recoveryTimeout() const {
    return std::max(options.recoveryTimeout, 4 * stepScale());
  }
};

// The current epoch was superseded: this worker must recover into the next one.
class EpochChanged : public Aborted {
 public:
  using Aborted::Aborted;
};

// While alive, this worker's heartbeats say it waits on the others for `step` (in a collective,
// or for its vote's verdict) rather than computing (docs/failure_semantics.md, rule 1). The
// time waited is added to *waited, so that a step's compute time excludes it.
class WaitingOnOthers {
 public:
  WaitingOnOthers(CoordinatorClient& client, int64_t step, double* waited)
      : client_(client), step_(step), waited_(waited), since_(TrainerClock::now()) {
    client_.setProgress(step_, true);
  }
  ~WaitingOnOthers() {
    client_.setProgress(step_, false);
    *waited_ += seconds(TrainerClock::now() - since_);
  }
  WaitingOnOthers(const WaitingOnOthers&) = delete;
  WaitingOnOthers& operator=(const WaitingOnOthers&) = delete;

 private:
  CoordinatorClient& client_;
  const int64_t step_;
  double* const waited_;
  const TrainerClock::time_point since_;
};

// While alive, a training transfer is in flight: peer-RAM replication yields to it between
// chunks (checkpoint::TrafficGate). A null gate does nothing.
class TrainingTraffic {
 public:
  explicit TrainingTraffic(checkpoint::TrafficGate* gate) : gate_(gate) {
    if (gate_) gate_->enter();
  }
  ~TrainingTraffic() {
    if (gate_) gate_->exit();
  }
  TrainingTraffic(const TrainingTraffic&) = delete;
  TrainingTraffic& operator=(const TrainingTraffic&) = delete;

 private:
  checkpoint::TrafficGate* const gate_;
};

// A Store whose blocking calls give up (EpochChanged) as soon as `superseded` says the epoch
// they rendezvous for is over, so a communicator build waiting for a member that died
// returns within a slice instead of at its deadline.
class AbortableStore : public collectives::Store {
 public:
  AbortableStore(std::shared_ptr<collectives::Store> store, std::function<bool()> superseded)
      : store_(std::move(store)), superseded_(std::move(superseded)) {}

  void set(const std::string& key, const collectives::Bytes& value) override {
    store_->set(key, value);
  }
  collectives::Bytes get(const std::string& key, std::chrono::milliseconds timeout) override {
    wait({key}, timeout);
    return store_->get(key, std::chrono::milliseconds(1000));
  }
  int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }
  collectives::Bytes compareSet(const std::string& key, const collectives::Bytes& expected,
                                const collectives::Bytes& desired) override {
    return store_->compareSet(key, expected, desired);
  }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    auto deadline = TrainerClock::now() + timeout;
    while (true) {
      if (superseded_()) SINEW_THROW(EpochChanged, "epoch superseded during rendezvous");
      auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - TrainerClock::now());
      try {
        store_->wait(keys, std::max(std::chrono::milliseconds(1), std::min(left, kSlice)));
        return;
      } catch (const Timeout&) {
        if (TrainerClock::now() >= deadline) throw;
      }
    }
  }
  bool check(const std::vector<std::string>& keys) override { return store_->check(keys); }
  bool deleteKey(const std::string& key) override { return store_->deleteKey(key); }
  using collectives::Store::get;
  using collectives::Store::wait;

 private:
  static constexpr std::chrono::milliseconds kSlice{50};
  std::shared_ptr<collectives::Store> store_;
  std::function<bool()> superseded_;
};

}  // namespace runtime
}  // namespace sinew
