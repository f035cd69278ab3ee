#pragma once

// Brute-force references for the pipeline planner tests. They recompute the cost model of
// docs/planner.md from the profile's fields directly (not through CostModel) and enumerate every
// candidate, so that a test compares the planner with an independent statement of the model.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "sinew/pipeline/profile.h"
#include "sinew/pipeline/template_planner.h"

namespace sinew {
namespace pipeline {
namespace testing {

constexpr int64_t kNone = std::numeric_limits<int64_t>::max();

inline int64_t ceilDiv(__int128 a, __int128 b) { return static_cast<int64_t>((a + b - 1) / b); }

inline int64_t bitsPerSecond(double gbps) { return static_cast<int64_t>(gbps * 1e9 + 0.5); }

// A random profile: `layers` layers, G devices per node; memory such that some stage splits
// do not fit. Times are whole microseconds so that the ms in JSON round-trip exactly.
inline Profile randomProfile(std::mt19937_64& rng, int layers, int G) {
  std::uniform_int_distribution<int64_t> fwd(1, 60), bwd(1, 120), bytes(0, 400), out(0, 50);
  Profile p;
  p.job.devices_per_node = G;
  p.job.inter_stage_gbps = 0.008 * static_cast<double>(1 + rng() % 4);  // 1..4 MB/s
  p.job.allreduce.bandwidth_gbps = 0.016 * static_cast<double>(1 + rng() % 4);
  p.job.allreduce.latency_us = static_cast<double>(rng() % 3);
  int64_t total = 0;
  for (int l = 0; l < layers; ++l) {
    LayerCost c;
    c.name = "l" + std::to_string(l);
    c.forward_ns = fwd(rng) * 1000;
    c.backward_ns = bwd(rng) * 1000;
    c.param_bytes = bytes(rng);
    c.optimizer_bytes = 2 * c.param_bytes;
    c.activation_bytes = bytes(rng);
    c.output_bytes = out(rng);
    c.workspace_bytes = rng() % 3 == 0 ? bytes(rng) / 4 : 0;
    total += c.param_bytes + c.optimizer_bytes + c.activation_bytes;
    p.layers.push_back(c);
  }
  // Between a quarter and all of the model's static + one microbatch of activations.
  std::uniform_int_distribution<int64_t> mem(std::max<int64_t>(1, total / 4), total + 1);
  p.job.device_memory_bytes = mem(rng);
  return p;
}

// Cost of one split, recomputed from the profile; kNone if a stage does not fit.
struct BruteCost {
  int64_t objective = kNone;
  int64_t fill = 0;
  int64_t bottleneck = 0;
};

// One stage [first, end) on d devices at position in_flight from the end: its compute and fill
// ticks, or fits = false.
struct BruteStage {
  bool fits = false;
  int64_t compute = 0;
  int64_t fill = 0;
};

inline BruteStage bruteStage(const Profile& p, int first, int end, int d, int64_t in_flight) {
  const int64_t G = p.job.devices_per_node;
  const int64_t inter = bitsPerSecond(p.job.inter_stage_gbps);
  const int64_t ar_bps = bitsPerSecond(p.job.allreduce.bandwidth_gbps);
  const int64_t lat_ns = static_cast<int64_t>(p.job.allreduce.latency_us * 1000 + 0.5);
  const int L = static_cast<int>(p.layers.size());
  int64_t compute = 0, allreduce = 0, stat = 0, act = 0, workspace = 0;
  for (int l = first; l < end; ++l) {
    const LayerCost& x = p.layers[l];
    compute += (x.forward_ns + x.backward_ns) * G / d;
    if (d > 1) {
      allreduce += G * (2 * (d - 1) * lat_ns +
                        ceilDiv(static_cast<__int128>(2 * (d - 1)) * x.param_bytes * 8 * 1000000000,
                                static_cast<__int128>(d) * ar_bps));
    }
    stat += x.param_bytes + x.optimizer_bytes;
    act += x.activation_bytes;
    workspace = std::max(workspace, x.workspace_bytes);
  }
  int64_t transfer = 0;
  if (end < L) {
    transfer =
        2 * G *
        ceilDiv(static_cast<__int128>(p.layers[end - 1].output_bytes) * 8 * 1000000000, inter);
  }
  BruteStage st;
  if (stat + workspace + in_flight * ceilDiv(act, d) > p.job.device_memory_bytes) return st;
  st.fits = true;
  st.compute = compute;
  st.fill = compute + allreduce + transfer;
  return st;
}

// A split with a width per stage.
inline BruteCost bruteSplitCost(const Profile& p, const std::vector<int>& widths,
                                const std::vector<int>& ends, int64_t M) {
  const int S = static_cast<int>(ends.size());
  BruteCost c;
  int first = 0;
  for (int s = 0; s < S; ++s) {
    BruteStage st = bruteStage(p, first, ends[s], widths[s], S - s);
    if (!st.fits) return BruteCost{};
    c.fill += st.fill;
    c.bottleneck = std::max(c.bottleneck, st.compute);
    first = ends[s];
  }
  c.objective = c.fill + (M - 1) * c.bottleneck;
  return c;
}

// A split whose stages all have width d.
inline BruteCost bruteSplitCost(const Profile& p, int d, const std::vector<int>& ends, int64_t M) {
  return bruteSplitCost(p, std::vector<int>(ends.size(), d), ends, M);
}

// The chain of widths of mixed templates: 1, then each the smallest divisor of G that is a
// multiple of the one before.
inline std::vector<int> chainOf(int G) {
  std::vector<int> chain;
  for (int d = 1; d <= G;) {
    chain.push_back(d);
    int next = d + 1;
    while (next <= G && (G % next != 0 || next % d != 0)) ++next;
    d = next;
  }
  return chain;
}

// Every split of L layers into S non-empty contiguous stages.
inline void forEachSplit(int L, int S, const std::function<void(const std::vector<int>&)>& fn) {
  std::vector<int> ends(S);
  std::function<void(int, int)> rec = [&](int s, int first) {
    if (s == S - 1) {
      ends[s] = L;
      fn(ends);
      return;
    }
    for (int e = first + 1; e <= L - (S - 1 - s); ++e) {
      ends[s] = e;
      rec(s + 1, e);
    }
  };
  if (S >= 1 && S <= L) rec(0, 0);
}

// The least objective for n nodes over both families of docs/planner.md (kNone if none fits):
// uniform templates (one width d | G for every stage, (n - 1) G / d < S <= n G / d) and, if
// `mixed`, every assignment of chain widths to the stages of every split with S >= n stages
// and widths summing to at most n * G.
inline int64_t bruteTemplateCost(const Profile& p, int n, int64_t M, bool mixed = true) {
  const int G = p.job.devices_per_node;
  const int L = static_cast<int>(p.layers.size());
  int64_t best = kNone;
  for (int d = 1; d <= G; ++d) {
    if (G % d != 0) continue;
    for (int S = (n - 1) * G / d + 1; S <= std::min(n * G / d, L); ++S) {
      forEachSplit(L, S, [&](const std::vector<int>& ends) {
        best = std::min(best, bruteSplitCost(p, d, ends, M).objective);
      });
    }
  }
  if (!mixed) return best;
  const std::vector<int> chain = chainOf(G);
  for (int S = n; S <= L; ++S) {
    std::function<void(int, int, int64_t, int64_t, int64_t)> rec =
        [&](int s, int first, int64_t W, int64_t fill, int64_t bottleneck) {
          if (s == S) {
            if (first == L) best = std::min(best, fill + (M - 1) * bottleneck);
            return;
          }
          for (int end = first + 1; end <= L - (S - 1 - s); ++end) {
            for (int d : chain) {
              if (W + d > static_cast<int64_t>(n) * G) continue;
              BruteStage st = bruteStage(p, first, end, d, S - s);
              if (!st.fits) continue;
              rec(s + 1, end, W + d, fill + st.fill, std::max(bottleneck, st.compute));
            }
          }
        };
    rec(0, 0, 0, 0, 0);
  }
  return best;
}

// The least makespan over all integer splits of B among pipelines with the given
// (fill, bottleneck) costs.
inline int64_t bruteSplitMakespan(const std::vector<const PipelineTemplate*>& pipes, int64_t B) {
  int64_t best = kNone;
  std::vector<int64_t> b(pipes.size(), 0);
  std::function<void(size_t, int64_t)> rec = [&](size_t i, int64_t left) {
    if (i + 1 == pipes.size()) {
      b[i] = left;
      int64_t z = 0;
      for (size_t k = 0; k < pipes.size(); ++k) z = std::max(z, pipes[k]->iterationTicks(b[k]));
      best = std::min(best, z);
      return;
    }
    for (int64_t x = 0; x <= left; ++x) {
      b[i] = x;
      rec(i + 1, left - x);
    }
  };
  rec(0, B);
  return best;
}

}  // namespace testing
}  // namespace pipeline
}  // namespace sinew
