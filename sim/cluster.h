#pragma once

// A cluster of jobs under an elastic scheduler (docs/scheduler.md, "At cluster scale"): the
// job list of sinew-sched on a pool of nodes, each job's step time from a curve, every resize
// charged a pause, and the slots reallocated by the policies of sim/allocation.h at each
// arrival and completion and every `realloc_s`. What it answers: the mean job completion time
// and makespan of a policy at a scale this machine cannot run, and how they change when a
// resize costs what Sinew measured instead of a restart (the 30-300 s that Pollux's and Blox's
// simulators charge per reallocation).
//
// The policy sees each job's true curve (what /v1/scaling converges to once the job has run
// at a few sizes) and the pause of each resize; it does not explore. Jobs do not fail here
// (sinew-sim's trace replay covers losses). Deterministic: the same inputs give the same
// result bit for bit.
//
// Thread safety: pure functions over plain values.

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "sinew/sim/allocation.h"

namespace sinew {
namespace sim {

struct ClusterJob {
  std::string name;
  double arrival_s = 0;
  int64_t steps = 1;
  int64_t global_batch = 1;  // samples per step
  int min_nodes = 1;
  int max_nodes = 1;  // the input's default: min_nodes
  // The step time at n nodes: from `samples_per_s` where it lists n (interpolated linearly in
  // 1/n between listed counts, the nearest listed count's rate per node beyond them), else
  // compute_s_per_sample * global_batch / n + fixed_s (a data-parallel job: its samples split
  // over the nodes, the gradient reduction and the rest of the step fixed).
  std::map<int, double> samples_per_s;
  double compute_s_per_sample = 0;
  double fixed_s = 0;

  double stepSeconds(int nodes) const;
};

struct ClusterCosts {
  double grow_pause_s = 0.02;    // a running job taking more nodes
  double shrink_pause_s = 0.02;  // a running job giving nodes back
  double start_s = 0;            // a job's launch until its first step
};

struct ClusterOptions {
  int nodes = 1;
  AllocationPolicy policy = AllocationPolicy::kMarginal;
  double realloc_s = 5;    // reallocate at least this often (sinew-sched's --realloc-s)
  double min_gain = 0.05;  // allocate()'s min_gain (sinew-sched's --min-gain)
};

struct ClusterJobResult {
  std::string name;
  double arrival_s = 0, started_s = -1, ended_s = -1;
  double jct_s = 0;     // ended - arrival
  int resizes = 0;      // size changes after the start
  double paused_s = 0;  // time spent paused: its start, then its resizes
  double node_seconds = 0;
};

struct ClusterResult {
  std::vector<ClusterJobResult> jobs;  // the job list's order
  double mean_jct_s = 0;
  double makespan_s = 0;
  double busy_share = 0;  // node-seconds used by jobs / (nodes x makespan)
};

// Validates the list and the options (InvalidArgument naming the job and field: a job whose
// minimum exceeds the pool, no way to compute a step time, non-positive steps or batch).
ClusterResult simulateCluster(const std::vector<ClusterJob>& jobs, const ClusterCosts& costs,
                              const ClusterOptions& options);

// {"jobs": [{"name", "arrival_s", "steps", "global_batch", "min_nodes", "max_nodes",
//   "samples_per_s": {"1": r1, ...} | "compute_s_per_sample" + "fixed_s"}],
//  "costs": {"grow_pause_s", "shrink_pause_s", "start_s"}}; unknown fields are errors.
struct ClusterInput {
  std::vector<ClusterJob> jobs;
  ClusterCosts costs;
};
ClusterInput parseClusterInput(const std::string& text, const std::string& source);

}  // namespace sim
}  // namespace sinew
