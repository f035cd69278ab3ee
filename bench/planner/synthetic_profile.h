#pragma once

// The planner bench's synthetic profile, shared by sinew-bench-planner and the planner tests
// that prove coverage on it (tests/pipeline/template_planner_test.cc).
//
// Fixed seed: forward U(0.5, 1.5) ms, backward U(1, 3) ms, parameters U(0.9, 1.1) x 64 MiB per
// layer with Adam-like optimizer state (2 x parameters), activations U(0.5, 1.5) MiB and outputs
// 1 MiB per microbatch; each device holds the static bytes of one layer but not two (1.6 x the
// mean) plus L x 1.5 MiB of activations.

#include <cstdint>
#include <random>
#include <string>

#include "sinew/pipeline/profile.h"

namespace sinew {
namespace pipeline {

inline Profile syntheticProfile(int L, int G, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> fwd(0.5, 1.5), bwd(1.0, 3.0), pscale(0.9, 1.1),
      ascale(0.5, 1.5);
  constexpr int64_t kMiB = int64_t{1} << 20;
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

}  // namespace pipeline
}  // namespace sinew
