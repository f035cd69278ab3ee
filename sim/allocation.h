#pragma once

// The allocation policies of sinew-sched (docs/scheduler.md), as a pure function of what the
// scheduler knows about each job, so that the scheduler running real jobs and the cluster
// simulator (sim/cluster.h) decide the same way from the same numbers.
//
// Thread safety: pure functions over plain values.

#include <functional>
#include <string>
#include <vector>

namespace sinew {
namespace sim {

enum class AllocationPolicy {
  // Each admitted job gets an equal share of the slots above the minimums (dealt one at a time
  // in arrival order), within its limits; what a job cannot use goes to the others.
  kStatic,
  // After AFS (Hwang et al., NSDI '21): every admitted job starts at its minimum and each
  // further slot goes to the job whose rate of finishing, 1 / time to finish, it raises most.
  // With linear scaling this is shortest-remaining-time first; with sublinear curves it spreads
  // slots where they still buy time.
  kMarginal,
};
// "static" or "marginal"; InvalidArgument otherwise.
AllocationPolicy parseAllocationPolicy(const std::string& name);
const char* allocationPolicyName(AllocationPolicy policy);

struct AllocationJob {
  int min_workers = 1;
  int max_workers = 1;
  // Running jobs always keep at least their minimum; waiting ones are admitted in order while
  // their minimum fits, and the first that does not fit stops the admission (FIFO, no
  // backfilling, so that a large job is not starved by small ones behind it).
  bool running = false;
  // The marginal policy first hands out slots only up to this size (a curve measured at one
  // size cannot tell a job that scales from one that does not), then the rest on the
  // predictions alone. <= 0: no such bound.
  int known_up_to = 0;
  // The workers a running job has now (0: none, or not running).
  int current = 0;
  // Seconds to finish at n workers, including the pause of getting there; +inf where the job
  // cannot run at n. Called for n in [min_workers, max_workers]; used by the marginal policy.
  std::function<double(int)> time_to_finish;
};

// Workers for each job, in the jobs' order (0: not admitted). The sum stays within `slots`
// except where running jobs' minimums alone exceed it (after losses: they keep them).
//
// min_gain (marginal only): where every admitted job is running, within its limits, and their
// current sizes use every slot or each job's maximum, the current sizes are kept unless the
// new allocation raises the jobs' summed rate of finishing (sum of 1 / time to finish) by more
// than this share. Every resize is a pause, and curves measured on a busy machine move by a
// few percent between reallocations: without it, a job is moved back and forth on noise.
std::vector<int> allocate(const std::vector<AllocationJob>& jobs, int slots,
                          AllocationPolicy policy, double min_gain = 0);

}  // namespace sim
}  // namespace sinew
