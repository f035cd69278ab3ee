// sinew-bench-planner: wall time of the whole planning step (templates for every node count,
// instantiation and batch split) on synthetic profiles, for (layers L, nodes N, devices per
// node G) = (32, 32, 8), (96, 64, 8), (1000, 1024, 8). The last line is
//   RESULT plan_ms_32_32_8=<a> plan_ms_96_64_8=<b> plan_ms_1000_1024_8=<c>
//
// Synthetic profile (fixed seed): forward U(0.5, 1.5) ms, backward U(1, 3) ms, parameters
// U(0.9, 1.1) x 64 MiB per layer with Adam-like optimizer state (2 x parameters), activations
// U(0.5, 1.5) MiB and outputs 1 MiB per microbatch; each device holds the static bytes of one
// layer but not two (1.6 x the mean) plus L x 1.5 MiB of activations, so the model needs
// several nodes (n_min = 4, 8 and 20). Fault tolerance f = 1, B = 4 * N microbatches.
//
// As a baseline in the same run, the (32, 32, 8) case is also planned by the straightforward
// exact search (every bottleneck candidate, an O(S * L^2) least-fill DP each), and the two
// must agree on every template's cost.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "sinew/pipeline/cost_model.h"
#include "sinew/pipeline/instantiation.h"
#include "sinew/pipeline/profile.h"
#include "sinew/pipeline/template_planner.h"

namespace {

using sinew::pipeline::CostModel;
using sinew::pipeline::Instantiation;
using sinew::pipeline::LayerCost;
using sinew::pipeline::Profile;
using sinew::pipeline::TemplateSet;

constexpr int64_t kMiB = int64_t{1} << 20;

Profile syntheticProfile(int L, int G, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> fwd(0.5, 1.5), bwd(1.0, 3.0), pscale(0.9, 1.1),
      ascale(0.5, 1.5);
  Profile p;
  p.microbatch_size = 1;
  p.job.devices_per_node = G;
  p.job.inter_stage_gbps = 100.0;
  p.job.allreduce.bandwidth_gbps = 1600.0;
  p.job.allreduce.latency_us = 5.0;
  int64_t total = 0;
  for (int l = 0; l < L; ++l) {
    LayerCost c;
    c.name = "layer" + std::to_string(l);
    c.forward_ns = static_cast<int64_t>(fwd(rng) * 1e6);
    c.backward_ns = static_cast<int64_t>(bwd(rng) * 1e6);
    c.param_bytes = static_cast<int64_t>(pscale(rng) * 64 * kMiB);
    c.optimizer_bytes = 2 * c.param_bytes;
    c.activation_bytes = static_cast<int64_t>(ascale(rng) * kMiB);
    c.output_bytes = kMiB;
    total += c.param_bytes + c.optimizer_bytes;
    p.layers.push_back(c);
  }
  p.job.device_memory_bytes = static_cast<int64_t>(1.6 * static_cast<double>(total) / L) +
                              static_cast<int64_t>(L) * 3 * kMiB / 2;
  return p;
}

double msSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// The baseline: the same exact search, with a plain O(S * L^2) least-fill DP per bottleneck
// candidate instead of the banded windowed one, and no lower-bound pruning.
int64_t baselineTemplate(const CostModel& m, int n, int64_t M, int* stage_devices) {
  const int L = m.numLayers();
  const int G = m.devicesPerNode();
  const int64_t kInf = INT64_MAX / 4;
  int64_t best = kInf;
  for (size_t w = 0; w < m.widths().size(); ++w) {
    const int per_node = G / m.widths()[w];
    for (int S = (n - 1) * per_node + 1; S <= std::min(n * per_node, L); ++S) {
      // Candidate bottlenecks: every stage's compute time, in decreasing order.
      std::vector<int64_t> candidates;
      for (int i = 0; i < L; ++i) {
        for (int j = i + 1; j <= L; ++j) candidates.push_back(m.computeTicks(i, j, w));
      }
      std::sort(candidates.rbegin(), candidates.rend());
      candidates.erase(std::unique(candidates.begin(), candidates.end()), candidates.end());
      std::vector<int64_t> prev(L + 1), cur(L + 1);
      for (int64_t T : candidates) {
        std::fill(prev.begin(), prev.end(), kInf);
        prev[L] = 0;
        for (int k = 1; k <= S; ++k) {
          std::fill(cur.begin(), cur.end(), kInf);
          for (int i = 0; i < L; ++i) {
            for (int j = i + 1; j <= L; ++j) {
              if (prev[j] >= kInf || m.computeTicks(i, j, w) > T || !m.fits(i, j, w, k)) continue;
              cur[i] = std::min(cur[i], m.fillTicks(i, j, w) + prev[j]);
            }
          }
          std::swap(prev, cur);
        }
        if (prev[0] >= kInf) break;  // lower bounds only make it worse
        best = std::min(best, prev[0] + (M - 1) * T);
      }
    }
    (void)stage_devices;
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  struct Case {
    int L, N, G;
  };
  const Case cases[] = {{32, 32, 8}, {96, 64, 8}, {1000, 1024, 8}};
  const int f = 1;
  std::printf("%-18s %6s %6s %10s %12s %12s %12s\n", "case (L,N,G)", "n_min", "n_max", "templates",
              "templates_ms", "instance_ms", "plan_ms");
  std::string result = "RESULT";
  bool ok = true;
  for (const Case& c : cases) {
    Profile p = syntheticProfile(c.L, c.G, 42);
    const int64_t B = 4 * static_cast<int64_t>(c.N);
    auto t0 = std::chrono::steady_clock::now();
    TemplateSet set = sinew::pipeline::planTemplates(p, {c.N, f, B});
    double templates_ms = msSince(t0);
    auto t1 = std::chrono::steady_clock::now();
    Instantiation inst = sinew::pipeline::instantiate(set, c.N, {f, B});
    double instance_ms = msSince(t1);
    double total_ms = msSince(t0);
    char name[64];
    std::snprintf(name, sizeof(name), "(%d,%d,%d)", c.L, c.N, c.G);
    std::printf("%-18s %6d %6d %10zu %12.1f %12.1f %12.1f   %zu pipelines, makespan %.3f ms\n",
                name, set.min_nodes, set.max_nodes, set.templates.size(), templates_ms, instance_ms,
                total_ms, inst.pipelines.size(),
                static_cast<double>(inst.iteration_ticks) / c.G / 1e6);
    std::fflush(stdout);
    char kv[96];
    std::snprintf(kv, sizeof(kv), " plan_ms_%d_%d_%d=%.1f", c.L, c.N, c.G, total_ms);
    result += kv;
    if (c.L == 32) {
      CostModel model(p);
      auto tb = std::chrono::steady_clock::now();
      for (const auto& t : set.templates) {
        int64_t base = baselineTemplate(model, t.nodes, t.microbatches, nullptr);
        if (base != t.iterationTicks(t.microbatches)) {
          std::printf("MISMATCH n=%d: planner %lld, baseline %lld\n", t.nodes,
                      static_cast<long long>(t.iterationTicks(t.microbatches)),
                      static_cast<long long>(base));
          ok = false;
        }
      }
      std::printf("%-18s baseline (plain exact DP) templates_ms %.1f, same costs: %s\n", name,
                  msSince(tb), ok ? "yes" : "NO");
    }
  }
  std::printf("%s\n", result.c_str());
  return ok ? 0 : 1;
}
