#pragma once

// Internal to the simulator: a trace as the models consume it, batch by batch (all events of
// one time together, as simultaneous), with node names mapped to ids 0, 1, ... in order of
// first appearance.
//
// Thread safety: none; one per simulation.

#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "sinew/sim/simulator.h"

namespace sinew {
namespace sim {

struct ReplayStart {
  int initial_nodes = 0;  // present after the first time's events
  int peak_nodes = 0;     // the most present at once
};
// Throws InvalidArgument for an empty trace or one whose first events leave no node.
ReplayStart replayStart(const std::vector<TraceEvent>& trace);

class TraceReplay {
 public:
  // REQUIRES: trace is valid (parseTrace's rules). The run ends at options.duration_s, or at
  // the trace's last event if that is <= 0.
  TraceReplay(const std::vector<TraceEvent>& trace, const SimOptions& options);

  double end() const { return end_; }
  // The time of the next batch, or +infinity if none is left.
  double peek() const;
  // The next batch's node ids (added, removed) and its time. REQUIRES: peek() is finite.
  double next(std::vector<int>* added, std::vector<int>* removed);

  // The integral over [0, end) of throughput(n), n the nodes present at each moment.
  double idealSamples(const std::function<double(int)>& throughput) const;

 private:
  const std::vector<TraceEvent>& trace_;
  size_t at_ = 0;
  double end_ = 0;
  std::map<std::string, int> ids_;
};

}  // namespace sim
}  // namespace sinew
