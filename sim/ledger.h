#pragma once

// Internal to the simulator: the account of a simulated run's wall time, segment by segment,
// from which the totals and the timeline are read (sim/simulator.h). Every driver writes
// consecutive segments from time 0, so the segments' durations add up to the wall time.
//
// Thread safety: none; one per simulation.

#include <cstdint>
#include <string>
#include <vector>

#include "sinew/sim/simulator.h"

namespace sinew {
namespace sim {

class Ledger {
 public:
  // [start, start + seconds) spent on `cause`, committing nothing. seconds <= 0: nothing.
  void spend(double start, double seconds, Cause cause);
  // `count` consecutive committed steps of `seconds` each from `start`, `samples` each.
  void steps(double start, double seconds, int64_t count, double samples);
  // A step in flight at the end of the run: `fraction` of its samples count as committed
  // (the ideal job is integrated continuously, so a run is not charged for where it ends).
  void partialStep(double start, double seconds, double fraction, double samples);
  // The newest `count` committed steps are undone: their time becomes `as` and their samples
  // are no longer committed. REQUIRES: count <= committed().
  void undo(int64_t count, Cause as);
  int64_t committed() const { return committed_; }

  // The totals, and buckets of `bucket_s` over [0, wall_s) (one bucket if bucket_s <= 0);
  // a segment's seconds and samples are spread evenly over its length.
  SimResult result(const std::string& model, double wall_s, double bucket_s) const;

 private:
  struct Segment {
    double start = 0;
    double seconds = 0;  // of one unit
    int64_t count = 1;   // units (steps) of `seconds` each
    Cause cause = Cause::kTraining;
    double samples = 0;  // of one unit
    bool step = false;   // a committed step run (undo() may take it back)
  };
  std::vector<Segment> segments_;
  int64_t committed_ = 0;
};

}  // namespace sim
}  // namespace sinew
