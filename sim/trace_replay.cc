#include "sinew/sim/trace_replay.h"

#include <algorithm>

#include "sinew/base/error.h"

namespace sinew {
namespace sim {

ReplayStart replayStart(const std::vector<TraceEvent>& trace) {
  if (trace.empty()) SINEW_THROW(InvalidArgument, "the trace has no events");
  ReplayStart s;
  int present = 0;
  for (size_t i = 0; i < trace.size(); ++i) {
    present += trace[i].add ? 1 : -1;
    s.peak_nodes = std::max(s.peak_nodes, present);
    const bool lastOfFirstTime = i + 1 == trace.size() || trace[i + 1].time_ms != trace[0].time_ms;
    if (lastOfFirstTime && s.initial_nodes == 0) {
      s.initial_nodes = present;
      if (present <= 0) {
        SINEW_THROW(InvalidArgument, "the trace's first events (at ", trace[0].time_ms,
                    " ms) leave no node");
      }
    }
  }
  return s;
}

TraceReplay::TraceReplay(const std::vector<TraceEvent>& trace, const SimOptions& options)
    : trace_(trace) {
  if (trace.empty()) SINEW_THROW(InvalidArgument, "the trace has no events");
  end_ =
      options.duration_s > 0 ? options.duration_s : static_cast<double>(trace.back().time_ms) / 1e3;
  if (!(end_ > 0)) {
    SINEW_THROW(InvalidArgument,
                "the run has no length: the trace ends at time 0; give a "
                "duration");
  }
}

double TraceReplay::peek() const {
  if (at_ >= trace_.size()) return std::numeric_limits<double>::infinity();
  return static_cast<double>(trace_[at_].time_ms) / 1e3;
}

double TraceReplay::next(std::vector<int>* added, std::vector<int>* removed) {
  added->clear();
  removed->clear();
  const int64_t ms = trace_.at(at_).time_ms;
  for (; at_ < trace_.size() && trace_[at_].time_ms == ms; ++at_) {
    const TraceEvent& e = trace_[at_];
    auto it = ids_.emplace(e.node, static_cast<int>(ids_.size())).first;
    (e.add ? added : removed)->push_back(it->second);
  }
  return static_cast<double>(ms) / 1e3;
}

double TraceReplay::idealSamples(const std::function<double(int)>& throughput) const {
  double samples = 0;
  int present = 0;
  double from = 0;
  for (size_t i = 0; i < trace_.size(); ++i) {
    const double t = std::min(end_, static_cast<double>(trace_[i].time_ms) / 1e3);
    if (t > from && present > 0) samples += throughput(present) * (t - from);
    from = std::max(from, t);
    present += trace_[i].add ? 1 : -1;
  }
  if (end_ > from && present > 0) samples += throughput(present) * (end_ - from);
  return samples;
}

}  // namespace sim
}  // namespace sinew
