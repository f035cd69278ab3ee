#include "sinew/sim/allocation.h"

#include <algorithm>
#include <cmath>

#include "sinew/base/error.h"

namespace sinew {
namespace sim {

AllocationPolicy parseAllocationPolicy(const std::string& name) {
  if (name == "static") return AllocationPolicy::kStatic;
  if (name == "marginal") return AllocationPolicy::kMarginal;
  SINEW_THROW(InvalidArgument,
              "unknown allocation policy '" + name + "' (expected 'static' or 'marginal')");
}

const char* allocationPolicyName(AllocationPolicy policy) {
  return policy == AllocationPolicy::kStatic ? "static" : "marginal";
}

namespace {

double rateOfFinishing(const AllocationJob& j, int n) {
  const double t = j.time_to_finish ? j.time_to_finish(n) : HUGE_VAL;
  return std::isfinite(t) && t > 0 ? 1 / std::max(t, 1e-9) : 0;
}

// The policy's allocation from scratch (allocate() without min_gain).
std::vector<int> allocateOnce(const std::vector<AllocationJob>& jobs, int slots,
                              AllocationPolicy policy) {
  std::vector<int> want(jobs.size(), 0);
  std::vector<size_t> active;
  int left = slots;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (!jobs[i].running) continue;
    active.push_back(i);
    want[i] = jobs[i].min_workers;
    left -= jobs[i].min_workers;
  }
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (jobs[i].running) continue;
    if (jobs[i].min_workers > left) break;  // FIFO admission
    active.push_back(i);
    want[i] = jobs[i].min_workers;
    left -= jobs[i].min_workers;
  }
  if (left <= 0) return want;
  if (policy == AllocationPolicy::kStatic) {
    // Round robin in arrival order, one slot at a time, so the shares differ by at most one.
    std::vector<size_t> order = active;
    std::sort(order.begin(), order.end());
    bool gave = true;
    while (left > 0 && gave) {
      gave = false;
      for (size_t i : order) {
        if (left > 0 && want[i] < jobs[i].max_workers) {
          want[i]++;
          left--;
          gave = true;
        }
      }
    }
    return want;
  }
  // Each job's rate of finishing at every size it may take, computed once.
  std::vector<std::vector<double>> rate(jobs.size());
  for (size_t i : active) {
    const AllocationJob& j = jobs[i];
    // Up to the most it could get: its minimum plus every slot left.
    const int top = std::max(j.min_workers, std::min(j.max_workers, want[i] + left));
    rate[i].assign(static_cast<size_t>(top) + 1, 0);
    for (int n = j.min_workers; n <= top; ++n) rate[i][n] = rateOfFinishing(j, n);
  }
  // Slots go where they raise the rate of finishing most per slot. A job may take several at
  // once: a resize's pause can make one more slot a loss where two are a gain.
  for (const bool explore : {false, true}) {
    while (left > 0) {
      size_t best = jobs.size();
      int bestTo = 0;
      double bestGain = 0;
      for (size_t i : active) {
        const AllocationJob& j = jobs[i];
        int top = std::min(j.max_workers, want[i] + left);
        if (!explore && j.known_up_to > 0) top = std::min(top, j.known_up_to);
        for (int to = want[i] + 1; to <= top; ++to) {
          const double gain = (rate[i][to] - rate[i][want[i]]) / (to - want[i]);
          if (gain > bestGain * (1 + 1e-12)) {
            bestGain = gain;
            best = i;
            bestTo = to;
          }
        }
      }
      if (best == jobs.size()) break;  // No job finishes sooner with more slots.
      left -= bestTo - want[best];
      want[best] = bestTo;
    }
  }
  return want;
}

// The current sizes, where min_gain may keep them: every admitted job running within its
// limits, and the pool full or every job at its maximum. Empty otherwise.
std::vector<int> keepable(const std::vector<AllocationJob>& jobs, const std::vector<int>& want,
                          int slots) {
  std::vector<int> keep(jobs.size(), 0);
  int used = 0;
  bool allAtMax = true;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (want[i] <= 0) continue;
    const AllocationJob& j = jobs[i];
    if (!j.running || j.current < j.min_workers || j.current > j.max_workers) return {};
    keep[i] = j.current;
    used += j.current;
    allAtMax = allAtMax && j.current == j.max_workers;
  }
  if (used > slots || (used < slots && !allAtMax)) return {};
  return keep;
}

double summedRate(const std::vector<AllocationJob>& jobs, const std::vector<int>& sizes) {
  double sum = 0;
  for (size_t i = 0; i < jobs.size(); ++i) {
    if (sizes[i] > 0) sum += rateOfFinishing(jobs[i], sizes[i]);
  }
  return sum;
}

}  // namespace

std::vector<int> allocate(const std::vector<AllocationJob>& jobs, int slots,
                          AllocationPolicy policy, double min_gain) {
  std::vector<int> want = allocateOnce(jobs, slots, policy);
  if (policy != AllocationPolicy::kMarginal || !(min_gain > 0) || want.empty()) return want;
  const std::vector<int> keep = keepable(jobs, want, slots);
  if (keep.empty() || keep == want) return want;
  const double now = summedRate(jobs, keep);
  return summedRate(jobs, want) > now * (1 + min_gain) ? want : keep;
}

}  // namespace sim
}  // namespace sinew
