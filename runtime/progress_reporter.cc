#include "sinew/runtime/progress_reporter.h"

#include <cstdio>

namespace sinew {
namespace runtime {

std::string formatEta(double seconds) {
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  char buf[32];
  if (s < 60) {
    std::snprintf(buf, sizeof(buf), "%llds", static_cast<long long>(s));
  } else if (s < 3600) {
    std::snprintf(buf, sizeof(buf), "%lldm%02llds", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60));
  }
  return buf;
}

ProgressReporter::ProgressReporter(const TrainerServices& services, bool pipelineMode)
    : s_(services), pipelineMode_(pipelineMode) {}

void ProgressReporter::restart() {
  lastReport_ = TrainerClock::now();
  stepsSinceReport_ = 0;
  scheduleSeconds_ = 0;
  scheduleWaitSeconds_ = 0;
}

void ProgressReporter::addSchedule(double seconds, double waitSeconds) {
  scheduleSeconds_ += seconds;
  scheduleWaitSeconds_ += waitSeconds;
}

void ProgressReporter::stepDone(int64_t next, double loss, int64_t epoch,
                                const std::vector<int>& members) {
  const TrainerOptions& o = s_.options;
  stepsSinceReport_++;
  if (o.progressEvery <= 0 || next % o.progressEvery != 0) return;
  auto now = TrainerClock::now();
  double elapsed = seconds(now - lastReport_);
  double rate = elapsed > 0 ? stepsSinceReport_ * o.globalBatch / elapsed : 0;
  // The time left at this rate (ETA), in seconds.
  const double eta =
      rate > 0 ? static_cast<double>(o.steps - next) * static_cast<double>(o.globalBatch) / rate
               : 0;
  nlohmann::json e = {{"event", "progress"},   {"step", next},   {"loss", loss},
                      {"samples_per_s", rate}, {"epoch", epoch}, {"workers", members.size()},
                      {"eta_s", eta}};
  if (pipelineMode_) {
    // This stage's mean 1F1B time per step since the last report (forward, backward and
    // the transfers, without the gradient sums and the vote).
    e["schedule_s"] = scheduleSeconds_ / static_cast<double>(stepsSinceReport_);
    // Of which this stage waited in its sends and receives (the neighbours' compute, the
    // transfers and their rendezvous).
    e["schedule_wait_s"] = scheduleWaitSeconds_ / static_cast<double>(stepsSinceReport_);
    scheduleSeconds_ = 0;
    scheduleWaitSeconds_ = 0;
  }
  lastReport_ = now;
  stepsSinceReport_ = 0;
  s_.event(std::move(e));
  if (!members.empty() && members.front() == s_.worker()) {
    std::printf("sinew: step %lld loss %.6g samples/s %.0f epoch %lld workers %zu eta %s\n",
                static_cast<long long>(next), loss, rate, static_cast<long long>(epoch),
                members.size(), formatEta(eta).c_str());
    std::fflush(stdout);
  }
}

}  // namespace runtime
}  // namespace sinew
