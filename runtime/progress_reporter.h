#pragma once

// Internal: the trainer's progress reports: every TrainerOptions::progressEvery steps a
// "progress" event (step, loss, samples/s since the last report, epoch, workers, ETA; in
// pipeline mode the stage's mean 1F1B time and its wait in exchanges) and, on the epoch's
// first member, a line on stdout.
//
// Thread safety: used by the training thread.

#include <cstdint>
#include <string>
#include <vector>

#include "sinew/runtime/trainer_services.h"

namespace sinew {
namespace runtime {

// Seconds as "42s", "3m05s" or "2h07m".
std::string formatEta(double seconds);

class ProgressReporter {
 public:
  // REQUIRES: services outlive the reporter.
  ProgressReporter(const TrainerServices& services, bool pipelineMode);

  // Rates count from now (a new epoch).
  void restart();
  // One step's 1F1B time (forward, backward and transfers) and, of it, the wait in exchanges.
  void addSchedule(double seconds, double waitSeconds);
  // After a step was applied: `next` is the step to run next, `loss` the applied step's.
  void stepDone(int64_t next, double loss, int64_t epoch, const std::vector<int>& members);

 private:
  const TrainerServices& s_;  // The trainer's; outlives the reporter.
  const bool pipelineMode_;
  TrainerClock::time_point lastReport_ = TrainerClock::now();
  int64_t stepsSinceReport_ = 0;
  double scheduleSeconds_ = 0;      // The executor's time since the last report.
  double scheduleWaitSeconds_ = 0;  // Of which in its exchanges.
};

}  // namespace runtime
}  // namespace sinew
