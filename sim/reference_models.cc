// The two reference models (sim/simulator.h, docs/goodput.md "Reference models"): a fixed
// pause per lost node (Oobleck's published simulator) and a restart from the last checkpoint
// (a Varuna- or torchrun-style job). Both train at the throughput table's rate for the nodes
// in use and take added nodes in only at the next loss.

#include <algorithm>
#include <cmath>
#include <set>

#include "sinew/base/error.h"
#include "sinew/sim/ledger.h"
#include "sinew/sim/simulator.h"
#include "sinew/sim/trace_replay.h"

namespace sinew {
namespace sim {

namespace {

struct Rules {
  const char* model = "";
  const ThroughputTable* table = nullptr;
  double samples_per_step = 1;
  bool restart = false;          // a loss restarts from the last checkpoint
  double pause_s = 0;            // fixed cost: per lost node; restart: per restart
  int64_t checkpoint_every = 0;  // 0: none
  double checkpoint_s = 0;
};

class ReferenceRun {
 public:
  explicit ReferenceRun(const Rules& rules) : rules_(rules) {
    if (rules.table == nullptr || rules.table->samples_per_s.empty()) {
      SINEW_THROW(InvalidArgument, rules.model, " model: the throughput table is empty");
    }
    if (!(rules.samples_per_step > 0)) {
      SINEW_THROW(InvalidArgument, rules.model, " model: global_batch must be >= 1");
    }
    if (rules.checkpoint_every < 0 || !(rules.pause_s >= 0) || !(rules.checkpoint_s >= 0)) {
      SINEW_THROW(InvalidArgument, rules.model,
                  " model: the checkpoint interval and the pauses must be >= 0");
    }
  }

  SimResult run(const std::vector<TraceEvent>& trace, const SimOptions& options) {
    TraceReplay replay(trace, options);
    const double end = replay.end();
    std::vector<int> added, removed;
    while (true) {
      const double te = replay.peek();
      if (te >= end) break;
      advance(te);
      replay.next(&added, &removed);
      onEvents(added, removed, te);
    }
    advance(end);
    if (mode_ == Mode::kTraining && t_ < end) {
      ledger_.partialStep(t_, end - t_, (end - t_) / stepS_, rules_.samples_per_step);
    }
    SimResult r = ledger_.result(rules_.model, end, options.bucket_s);
    r.losses = losses_;
    r.joins = joins_;
    r.restarts = restarts_;
    r.ideal_samples = replay.idealSamples([this](int n) { return rules_.table->at(n); });
    return r;
  }

 private:
  enum class Mode { kTraining, kPaused, kDown };

  // Trains (or waits) from t_ to T; a checkpoint falls due after every K-th step.
  void advance(double T) {
    while (t_ < T) {
      if (mode_ == Mode::kDown) {
        ledger_.spend(t_, T - t_, Cause::kIdle);
        t_ = T;
        return;
      }
      if (mode_ == Mode::kPaused) {
        const double d = std::min(pauseEnd_, T) - t_;
        ledger_.spend(t_, d, pauseCause_);
        t_ += d;
        if (t_ < pauseEnd_) return;
        endPause();
        continue;
      }
      int64_t n = static_cast<int64_t>(std::floor((T - t_) / stepS_ + 1e-9));
      const int64_t K = rules_.checkpoint_every;
      if (K > 0) n = std::min(n, K - (ledger_.committed() - checkpointed_));
      if (n <= 0) return;
      ledger_.steps(t_, stepS_, n, rules_.samples_per_step);
      t_ += static_cast<double>(n) * stepS_;
      if (K > 0 && ledger_.committed() - checkpointed_ >= K) {
        pause(rules_.checkpoint_s, Cause::kCheckpoint);
      }
    }
  }

  void pause(double seconds, Cause cause) {
    mode_ = Mode::kPaused;
    pauseEnd_ = t_ + seconds;
    pauseCause_ = cause;
  }

  void endPause() {
    if (pauseCause_ == Cause::kCheckpoint) checkpointed_ = ledger_.committed();
    train();
  }

  // Trains on the nodes in use at the table's rate, or waits if it has none for them.
  void train() {
    const double x = rules_.table->at(static_cast<int>(inUse_.size()));
    if (x <= 0) {
      mode_ = Mode::kDown;
      return;
    }
    stepS_ = rules_.samples_per_step / x;
    mode_ = Mode::kTraining;
  }

  // The nodes that were added since the last loss join the nodes in use.
  void takeInPending() {
    joins_ += static_cast<int>(pending_.size());
    inUse_.insert(pending_.begin(), pending_.end());
    pending_.clear();
  }

  void onEvents(const std::vector<int>& added, const std::vector<int>& removed, double te) {
    int lost = 0;
    for (int n : removed) {
      pending_.erase(n);
      lost += static_cast<int>(inUse_.erase(n));
    }
    pending_.insert(added.begin(), added.end());
    if (!started_) {
      // The first nodes start the job at no cost, as the ideal job.
      started_ = true;
      takeInPending();
      joins_ = 0;
      train();
      return;
    }
    if (mode_ == Mode::kDown) {
      if (lost > 0) return;
      takeInPending();
      if (rules_.table->at(static_cast<int>(inUse_.size())) <= 0) return;
      // Enough nodes again: a restart, or one reconfiguration.
      if (rules_.restart) ++restarts_;
      pause(rules_.pause_s, rules_.restart ? Cause::kRestart : Cause::kReconfiguration);
      return;
    }
    if (lost == 0) return;
    losses_ += lost;
    if (mode_ == Mode::kTraining) {
      ledger_.spend(t_, te - t_, Cause::kRedone);  // the step in flight
      t_ = te;
    }
    takeInPending();
    if (rules_.table->at(static_cast<int>(inUse_.size())) <= 0) {
      if (rules_.restart) lostSinceCheckpoint();
      mode_ = Mode::kDown;
      return;
    }
    if (rules_.restart) {
      // Every loss restarts the job from its last checkpoint, a restart in progress too.
      lostSinceCheckpoint();
      ++restarts_;
      pause(rules_.pause_s, Cause::kRestart);
      return;
    }
    // Fixed cost: each lost node adds its pause (to one in progress, if any).
    const double from = mode_ == Mode::kPaused ? pauseEnd_ : t_;
    mode_ = Mode::kPaused;
    pauseEnd_ = from + static_cast<double>(lost) * rules_.pause_s;
    pauseCause_ = Cause::kReconfiguration;
  }

  void lostSinceCheckpoint() { ledger_.undo(ledger_.committed() - checkpointed_, Cause::kRestart); }

  const Rules rules_;
  Ledger ledger_;
  Mode mode_ = Mode::kDown;
  bool started_ = false;
  double t_ = 0;
  double stepS_ = 1;
  double pauseEnd_ = 0;
  Cause pauseCause_ = Cause::kReconfiguration;
  int64_t checkpointed_ = 0;  // committed steps at the last completed checkpoint
  std::set<int> inUse_;
  std::set<int> pending_;
  int losses_ = 0;
  int joins_ = 0;
  int restarts_ = 0;
};

}  // namespace

SimResult simulateFixedCost(const std::vector<TraceEvent>& trace, const FixedCostModel& model,
                            const SimOptions& options) {
  Rules rules;
  rules.model = "fixed-cost";
  rules.table = &model.table;
  rules.samples_per_step = static_cast<double>(model.global_batch);
  rules.pause_s = model.reconfiguration_s;
  return ReferenceRun(rules).run(trace, options);
}

SimResult simulateRestart(const std::vector<TraceEvent>& trace, const RestartModel& model,
                          const SimOptions& options) {
  if (model.checkpoint_every < 1) {
    SINEW_THROW(InvalidArgument, "restart model: checkpoint_every = ", model.checkpoint_every,
                " must be >= 1");
  }
  Rules rules;
  rules.model = "restart";
  rules.table = &model.table;
  rules.samples_per_step = static_cast<double>(model.global_batch);
  rules.restart = true;
  rules.pause_s = model.restart_s;
  rules.checkpoint_every = model.checkpoint_every;
  rules.checkpoint_s = model.checkpoint_s;
  return ReferenceRun(rules).run(trace, options);
}

}  // namespace sim
}  // namespace sinew
