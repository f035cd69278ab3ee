#include "sinew/sim/ledger.h"

#include <algorithm>
#include <cmath>

#include "sinew/base/error.h"

namespace sinew {
namespace sim {

void Ledger::spend(double start, double seconds, Cause cause) {
  if (seconds <= 0) return;
  Segment s;
  s.start = start;
  s.seconds = seconds;
  s.cause = cause;
  segments_.push_back(s);
}

void Ledger::steps(double start, double seconds, int64_t count, double samples) {
  if (count <= 0) return;
  committed_ += count;
  if (!segments_.empty()) {
    Segment& last = segments_.back();
    // One run for consecutive steps of one length (a steady plan).
    if (last.step && last.cause == Cause::kTraining && last.seconds == seconds &&
        last.samples == samples &&
        std::fabs(last.start + last.seconds * static_cast<double>(last.count) - start) <
            1e-9 * std::max(1.0, start)) {
      last.count += count;
      return;
    }
  }
  Segment s;
  s.start = start;
  s.seconds = seconds;
  s.count = count;
  s.samples = samples;
  s.step = true;
  segments_.push_back(s);
}

void Ledger::partialStep(double start, double seconds, double fraction, double samples) {
  if (seconds <= 0) return;
  Segment s;
  s.start = start;
  s.seconds = seconds;
  s.samples = samples * std::clamp(fraction, 0.0, 1.0);
  segments_.push_back(s);
}

void Ledger::undo(int64_t count, Cause as) {
  if (count < 0 || count > committed_) {
    SINEW_THROW(InvalidArgument, "Ledger::undo: ", count, " steps of ", committed_, " committed");
  }
  committed_ -= count;
  for (size_t i = segments_.size(); i-- > 0 && count > 0;) {
    Segment& s = segments_[i];
    if (!s.step || s.cause != Cause::kTraining) continue;
    const int64_t k = std::min(count, s.count);
    count -= k;
    if (k == s.count) {
      s.cause = as;
      s.samples = 0;
      s.step = false;
      continue;
    }
    // The newest k steps of the run are undone: split it.
    Segment undone = s;
    s.count -= k;
    undone.start = s.start + s.seconds * static_cast<double>(s.count);
    undone.count = k;
    undone.cause = as;
    undone.samples = 0;
    undone.step = false;
    segments_.insert(segments_.begin() + static_cast<std::ptrdiff_t>(i) + 1, undone);
  }
}

SimResult Ledger::result(const std::string& model, double wall_s, double bucket_s) const {
  SimResult r;
  r.model = model;
  r.wall_s = wall_s;
  const double width = bucket_s > 0 ? bucket_s : std::max(wall_s, 1e-9);
  const int64_t buckets = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(wall_s / width)));
  r.timeline.resize(static_cast<size_t>(buckets));
  for (int64_t b = 0; b < buckets; ++b) {
    r.timeline[b].start_s = static_cast<double>(b) * width;
    r.timeline[b].end_s = std::min(wall_s, static_cast<double>(b + 1) * width);
  }
  for (const Segment& s : segments_) {
    const double length = s.seconds * static_cast<double>(s.count);
    const double samples = s.samples * static_cast<double>(s.count);
    const int c = static_cast<int>(s.cause);
    r.total.seconds[c] += length;
    r.total.samples += samples;
    if (length <= 0) continue;
    const double end = s.start + length;
    int64_t b = std::clamp<int64_t>(static_cast<int64_t>(s.start / width), 0, buckets - 1);
    for (; b < buckets; ++b) {
      Bucket& bucket = r.timeline[b];
      const double lo = std::max(s.start, bucket.start_s);
      const double hi = b == buckets - 1 ? end : std::min(end, bucket.end_s);
      if (hi <= lo) {
        if (bucket.start_s >= end) break;
        continue;
      }
      const double share = (hi - lo) / length;
      bucket.account.seconds[c] += hi - lo;
      bucket.account.samples += samples * share;
    }
  }
  return r;
}

const char* causeName(Cause cause) {
  switch (cause) {
    case Cause::kTraining:
      return "training";
    case Cause::kDetection:
      return "detection";
    case Cause::kReconfiguration:
      return "reconfiguration";
    case Cause::kRedone:
      return "redone";
    case Cause::kRollback:
      return "rollback";
    case Cause::kRestart:
      return "restart";
    case Cause::kIdle:
      return "idle";
    case Cause::kCheckpoint:
      return "checkpoint";
  }
  return "?";
}

}  // namespace sim
}  // namespace sinew
