#include "sinew/runtime/job_measures.h"

#include <algorithm>
#include <cstdio>

namespace sinew {
namespace runtime {
namespace {

using coordinator_detail::median;
using coordinator_detail::secondsOf;
using nlohmann::json;

}  // namespace

void appendMetric(std::string& out, const char* name, const char* type, const char* help,
                  double value) {
  out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.17g", value);
  out += std::string(name) + " " + buf + "\n";
}

std::optional<double> JobMeasures::onCommit(Clock::time_point now, int members) {
  std::optional<double> steady;
  if (lastCommit_ != Clock::time_point{}) {
    stepTimes_.push_back(now - lastCommit_);
    if (stepTimes_.size() > 20) stepTimes_.pop_front();
    const double s = secondsOf(now - lastCommit_);
    effectiveSeconds_ += s;
    auto& series = bySize_[members];
    series.push_back(s);
    if (series.size() > 50) series.pop_front();
    steady = s;
  }
  lastCommit_ = now;
  if (commits_++ == 0) firstCommit_ = now;
  return steady;
}

void JobMeasures::startRecovery(Clock::time_point now) {
  if (recovering_) return;
  recovering_ = true;
  recoveringSince_ = now;
}

std::optional<double> JobMeasures::endRecovery(Clock::time_point now) {
  if (!recovering_) return std::nullopt;
  recovering_ = false;
  const double took = secondsOf(now - recoveringSince_);
  recoverySeconds_.push_back(took);
  return took;
}

void JobMeasures::onDurable(int64_t step, const std::string& path, int64_t bytes,
                            double flushSeconds, Clock::time_point now) {
  durableWrites_++;
  durableBytes_ += bytes;
  flushSecondsTotal_ += flushSeconds;
  if (step < durable_.step) return;
  durable_.step = step;
  durable_.path = path;
  durable_.bytes = bytes;
  durable_.flushSeconds = flushSeconds;
  durable_.at = now;
}

void JobMeasures::restoreDurable(int64_t step, const std::string& path) {
  durable_.step = step;
  durable_.path = path;
}

double JobMeasures::medianStepSeconds(size_t newest) const {
  std::vector<double> recent;
  for (auto it = stepTimes_.rbegin(); it != stepTimes_.rend() && recent.size() < newest; ++it) {
    recent.push_back(secondsOf(*it));
  }
  return median(recent);
}

std::optional<JobMeasures::Clock::duration> JobMeasures::medianStep() const {
  if (stepTimes_.empty()) return std::nullopt;
  std::vector<Clock::duration> sorted(stepTimes_.begin(), stepTimes_.end());
  std::sort(sorted.begin(), sorted.end());
  return sorted[sorted.size() / 2];
}

double JobMeasures::samplesPerSecondNow(Clock::time_point now, int64_t globalBatch) const {
  if (globalBatch <= 0 || stepTimes_.empty() || lastCommit_ == Clock::time_point{}) return 0;
  const double step = medianStepSeconds(5);
  // No commit for three step times: the job is not training now (recovering, stuck).
  if (step <= 0 || secondsOf(now - lastCommit_) > 3 * step + 1) return 0;
  return static_cast<double>(globalBatch) / step;
}

void JobMeasures::addStatus(json& b, Clock::time_point now, int64_t globalBatch) const {
  const double wall = firstCommit_ == Clock::time_point{} ? 0 : secondsOf(now - firstCommit_);
  b["samples_per_s"] = {{"now", samplesPerSecondNow(now, globalBatch)},
                        {"average", wall > 0 && globalBatch > 0
                                        ? static_cast<double>((commits_ - 1) * globalBatch) / wall
                                        : 0.0}};
  b["failures"] = failures_;
  b["rollbacks"] = rollbacks_;
  b["recovery_s"] = recoverySeconds_;
  b["recovering"] = recovering_;
  b["effective_training_s"] = effectiveSeconds_;
}

json JobMeasures::durableJson(Clock::time_point now) const {
  if (durable_.step < 0) return nullptr;
  return json{{"step", durable_.step},
              {"path", durable_.path},
              {"bytes", durable_.bytes},
              {"flush_s", durable_.flushSeconds},
              {"age_s", secondsOf(now - durable_.at)}};
}

void JobMeasures::addMetrics(std::string& out) const {
  appendMetric(out, "sinew_committed_steps_total", "counter",
               "Steps committed by this coordinator.", commits_);
  appendMetric(out, "sinew_commit_seconds", "gauge",
               "Seconds from reading the last vote of the newest committed step to its commit "
               "written to every member's connection (0: none yet).",
               commitSeconds_);
  appendMetric(out, "sinew_failures_total", "counter", "Workers declared dead.", failures_);
  appendMetric(out, "sinew_rollbacks_total", "counter",
               "Rollbacks to an older version because a layer had no live copy (pipelines).",
               rollbacks_);
  appendMetric(out, "sinew_recoveries_total", "counter",
               "Recoveries finished (a failure, then the next committed step).",
               recoverySeconds_.size());
  double recoverySum = 0;
  for (double s : recoverySeconds_) recoverySum += s;
  appendMetric(out, "sinew_recovery_seconds_total", "counter",
               "Seconds from failures to the next committed step, summed.", recoverySum);
  appendMetric(out, "sinew_effective_training_seconds_total", "counter",
               "Seconds between consecutive commits of one epoch, summed.", effectiveSeconds_);
  appendMetric(out, "sinew_checkpoint_stall_seconds_total", "counter",
               "Seconds workers waited for a checkpoint snapshot before an optimizer step, summed.",
               stallSeconds_);
  appendMetric(out, "sinew_checkpoint_flush_seconds_total", "counter",
               "Seconds spent writing durable checkpoints, summed.", flushSecondsTotal_);
  appendMetric(out, "sinew_checkpoints_durable_total", "counter",
               "Durable checkpoint versions written.", durableWrites_);
  appendMetric(out, "sinew_checkpoint_bytes_total", "counter",
               "Bytes of durable checkpoints written.", durableBytes_);
  appendMetric(out, "sinew_checkpoint_durable_step", "gauge",
               "Step of the newest durable checkpoint (-1: none).", durable_.step);
  appendMetric(out, "sinew_replicated_bytes_total", "counter",
               "Bytes of checkpoint replicas sent to peers' host memory.", replicatedBytes_);
}

}  // namespace runtime
}  // namespace sinew
