// The cluster simulator (sim/cluster.h): event by event, from arrival to the last completion.

#include "sinew/sim/cluster.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>

#include "sinew/base/error.h"

namespace sinew {
namespace sim {

double ClusterJob::stepSeconds(int nodes) const {
  if (nodes < 1) return HUGE_VAL;
  if (!samples_per_s.empty()) {
    const double batch = static_cast<double>(global_batch);
    auto hi = samples_per_s.lower_bound(nodes);
    if (hi != samples_per_s.end() && hi->first == nodes) return batch / hi->second;
    if (hi == samples_per_s.begin()) {  // below every listed count: its rate per node
      return batch / (hi->second * nodes / hi->first);
    }
    auto lo = std::prev(hi);
    if (hi == samples_per_s.end()) return batch / lo->second;  // no faster than the largest
    // Linear in 1/n between the neighbours, as a data-parallel step's a / n + b is.
    const double tLo = batch / lo->second, tHi = batch / hi->second;
    const double x = (1.0 / nodes - 1.0 / hi->first) / (1.0 / lo->first - 1.0 / hi->first);
    return tHi + x * (tLo - tHi);
  }
  return compute_s_per_sample * static_cast<double>(global_batch) / nodes + fixed_s;
}

namespace {

struct Run {
  const ClusterJob* spec = nullptr;
  bool arrived = false, started = false, done = false;
  int size = 0;
  double left = 0;  // samples
  double pausedUntil = 0;
  ClusterJobResult result;

  double rate(int n) const {
    return static_cast<double>(spec->global_batch) / spec->stepSeconds(n);
  }
  double finishAt(double now) const { return std::max(now, pausedUntil) + left / rate(size); }
};

void validate(const std::vector<ClusterJob>& jobs, const ClusterCosts& costs,
              const ClusterOptions& options) {
  if (jobs.empty()) SINEW_THROW(InvalidArgument, "the cluster simulation needs jobs");
  if (options.nodes < 1) SINEW_THROW(InvalidArgument, "the pool needs at least one node");
  if (!(options.realloc_s > 0)) SINEW_THROW(InvalidArgument, "realloc_s must be > 0");
  for (double c : {costs.grow_pause_s, costs.shrink_pause_s, costs.start_s}) {
    if (!(c >= 0) || !std::isfinite(c)) {
      SINEW_THROW(InvalidArgument, "the cluster costs must be finite and >= 0");
    }
  }
  std::set<std::string> names;
  for (const ClusterJob& j : jobs) {
    const std::string what = "job '" + j.name + "'";
    if (!names.insert(j.name).second) SINEW_THROW(InvalidArgument, what, ": the name is taken");
    if (j.steps < 1 || j.global_batch < 1) {
      SINEW_THROW(InvalidArgument, what, ": steps and global_batch must be >= 1");
    }
    if (j.min_nodes < 1 || j.max_nodes < j.min_nodes) {
      SINEW_THROW(InvalidArgument, what, ": needs 1 <= min_nodes <= max_nodes");
    }
    if (j.min_nodes > options.nodes) {
      SINEW_THROW(InvalidArgument, what, ": needs ", j.min_nodes, " nodes; the pool has ",
                  options.nodes);
    }
    if (j.samples_per_s.empty() && !(j.compute_s_per_sample > 0 || j.fixed_s > 0)) {
      SINEW_THROW(InvalidArgument, what,
                  ": needs samples_per_s or compute_s_per_sample / fixed_s for its step time");
    }
    if (!(j.arrival_s >= 0) || !std::isfinite(j.arrival_s)) {
      SINEW_THROW(InvalidArgument, what, ": arrival_s must be finite and >= 0");
    }
  }
}

}  // namespace

ClusterResult simulateCluster(const std::vector<ClusterJob>& jobs, const ClusterCosts& costs,
                              const ClusterOptions& options) {
  validate(jobs, costs, options);
  // Arrival order (stable): the admission's FIFO order.
  std::vector<Run> runs(jobs.size());
  std::vector<size_t> order(jobs.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return jobs[a].arrival_s < jobs[b].arrival_s; });
  for (size_t i = 0; i < jobs.size(); ++i) {
    runs[i].spec = &jobs[i];
    runs[i].left = static_cast<double>(jobs[i].steps) * static_cast<double>(jobs[i].global_batch);
    runs[i].result.name = jobs[i].name;
    runs[i].result.arrival_s = jobs[i].arrival_s;
  }
  double now = 0, nextRealloc = 0;
  size_t finished = 0;
  bool changed = true;  // an arrival or a completion since the last allocation
  while (finished < runs.size()) {
    for (Run& r : runs) {
      if (!r.arrived && r.spec->arrival_s <= now) {
        r.arrived = true;
        changed = true;
      }
    }
    if (changed || now >= nextRealloc) {
      std::vector<size_t> active;
      std::vector<AllocationJob> view;
      for (size_t i : order) {
        Run& r = runs[i];
        if (!r.arrived || r.done) continue;
        AllocationJob a;
        a.min_workers = r.spec->min_nodes;
        a.max_workers = r.spec->max_nodes;
        a.running = r.started;
        a.current = r.started ? r.size : 0;
        const Run* rp = &r;
        const double t = now;
        a.time_to_finish = [rp, t, &costs](int n) {
          double pause = std::max(0.0, rp->pausedUntil - t);
          if (!rp->started) {
            pause += costs.start_s;
          } else if (n > rp->size) {
            pause += costs.grow_pause_s;
          } else if (n < rp->size) {
            pause += costs.shrink_pause_s;
          }
          return pause + rp->left / rp->rate(n);
        };
        active.push_back(i);
        view.push_back(std::move(a));
      }
      const std::vector<int> want = allocate(view, options.nodes, options.policy, options.min_gain);
      for (size_t k = 0; k < active.size(); ++k) {
        Run& r = runs[active[k]];
        if (want[k] <= 0 || want[k] == r.size) continue;
        if (!r.started) {
          r.started = true;
          r.result.started_s = now;
          r.pausedUntil = now + costs.start_s;
        } else {
          const double pause = want[k] > r.size ? costs.grow_pause_s : costs.shrink_pause_s;
          const double from = std::max(now, r.pausedUntil);
          r.pausedUntil = from + pause;
          r.result.resizes++;
        }
        r.size = want[k];
      }
      // At least the next representable time: the loop always moves on.
      nextRealloc = std::max(now + options.realloc_s, std::nextafter(now, HUGE_VAL));
      changed = false;
    }
    // The next moment something happens: an arrival, a completion, the next allocation.
    double next = HUGE_VAL;
    bool anyActive = false;
    for (const Run& r : runs) {
      if (!r.arrived) next = std::min(next, r.spec->arrival_s);
      if (r.arrived && !r.done) anyActive = true;
      if (r.started && !r.done) next = std::min(next, r.finishAt(now));
    }
    if (anyActive) next = std::min(next, nextRealloc);
    if (!std::isfinite(next)) break;  // Nothing runs and nothing will arrive.
    for (Run& r : runs) {
      if (!r.started || r.done) continue;
      const double end = r.finishAt(now);
      const double from = std::max(now, r.pausedUntil);
      r.result.paused_s += std::max(0.0, std::min(next, r.pausedUntil) - now);
      r.result.node_seconds += r.size * (next - now);
      if (end <= next * (1 + 1e-12) + 1e-12) {
        r.done = true;
        r.left = 0;
        r.result.ended_s = end;
        r.result.jct_s = end - r.spec->arrival_s;
        r.size = 0;
        finished++;
        changed = true;
      } else if (next > from) {
        r.left = std::max(0.0, r.left - r.rate(r.size) * (next - from));
      }
    }
    now = next;
  }
  ClusterResult out;
  double used = 0;
  for (const Run& r : runs) {
    out.jobs.push_back(r.result);
    out.mean_jct_s += r.result.jct_s / static_cast<double>(runs.size());
    out.makespan_s = std::max(out.makespan_s, r.result.ended_s);
    used += r.result.node_seconds;
  }
  out.busy_share = out.makespan_s > 0 ? used / (options.nodes * out.makespan_s) : 0;
  return out;
}

}  // namespace sim
}  // namespace sinew
