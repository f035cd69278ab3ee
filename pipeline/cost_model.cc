#include "sinew/pipeline/cost_model.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "sinew/base/error.h"

namespace sinew {
namespace pipeline {
namespace {

constexpr int64_t kMaxFillTicks = int64_t{1} << 60;

int64_t ceilDiv128(__int128 a, __int128 b) { return static_cast<int64_t>((a + b - 1) / b); }

}  // namespace

int64_t gbpsToBitsPerSecond(double gbps) {
  double bps = std::round(gbps * 1e9);
  if (!(bps >= 1.0)) return 1;
  if (bps > 9.0e18) return int64_t{9000000000000000000};
  return static_cast<int64_t>(bps);
}

int64_t transferTimeNs(int64_t bytes, int64_t bits_per_s) {
  __int128 bits = static_cast<__int128>(bytes) * 8;
  __int128 ns = (bits * 1000000000 + bits_per_s - 1) / bits_per_s;
  if (ns > std::numeric_limits<int64_t>::max()) return std::numeric_limits<int64_t>::max();
  return static_cast<int64_t>(ns);
}

CostModel::CostModel(const Profile& profile) {
  validateProfile(profile);
  const JobSpec& job = profile.job;
  num_layers_ = static_cast<int>(profile.layers.size());
  devices_per_node_ = job.devices_per_node;
  device_memory_bytes_ = job.device_memory_bytes;
  for (int d = devices_per_node_; d >= 1; --d) {
    if (devices_per_node_ % d == 0) widths_.push_back(d);
  }
  allreduce_latency_ns_ = std::llround(job.allreduce.latency_us * 1000.0);
  allreduce_bits_per_s_ = gbpsToBitsPerSecond(job.allreduce.bandwidth_gbps);
  int64_t inter_bps = gbpsToBitsPerSecond(job.inter_stage_gbps);

  const int L = num_layers_;
  const int64_t G = devices_per_node_;
  transfer_ns_.resize(L);
  param_bytes_.resize(L);
  for (int l = 0; l < L; ++l) {
    transfer_ns_[l] = transferTimeNs(profile.layers[l].output_bytes, inter_bps);
    param_bytes_[l] = profile.layers[l].param_bytes;
  }

  // Sums are accumulated in 128 bits and checked against 2^60 ticks, so that every partial
  // sum below fits in int64 with room for the (M - 1) * bottleneck products the planner checks.
  boundary_.assign(L + 1, 0);
  __int128 boundary_total = 0;
  for (int end = 1; end < L; ++end) {
    __int128 b = static_cast<__int128>(2) * G * transfer_ns_[end - 1];
    boundary_total += b;
    if (boundary_total > kMaxFillTicks) {
      SINEW_THROW(InvalidArgument, "profile: stage-to-stage transfers would take more than 2^60 ",
                  "ticks (inter_stage_gbps=", job.inter_stage_gbps, ")");
    }
    boundary_[end] = static_cast<int64_t>(b);
  }
  compute_.assign(widths_.size(), std::vector<int64_t>(L + 1, 0));
  allreduce_.assign(widths_.size(), std::vector<int64_t>(L + 1, 0));
  for (size_t w = 0; w < widths_.size(); ++w) {
    const int64_t d = widths_[w];
    __int128 compute = 0;
    __int128 allreduce = 0;
    for (int l = 0; l < L; ++l) {
      const LayerCost& c = profile.layers[l];
      compute += static_cast<__int128>(c.forward_ns + c.backward_ns) * (G / d);
      __int128 ar_ns = 0;
      if (d > 1) {
        ar_ns = static_cast<__int128>(2 * (d - 1)) * allreduce_latency_ns_ +
                ceilDiv128(static_cast<__int128>(2 * (d - 1)) * c.param_bytes * 8 * 1000000000,
                           static_cast<__int128>(d) * allreduce_bits_per_s_);
      }
      allreduce += ar_ns * G;
      if (compute + allreduce + boundary_total > kMaxFillTicks) {
        SINEW_THROW(InvalidArgument, "profile: a pipeline's fill time would exceed 2^60 ticks ",
                    "(allreduce.bandwidth_gbps=", job.allreduce.bandwidth_gbps,
                    ", devices_per_node=", G, ")");
      }
      compute_[w][l + 1] = static_cast<int64_t>(compute);
      allreduce_[w][l + 1] = static_cast<int64_t>(allreduce);
    }
    max_fill_ticks_ =
        std::max(max_fill_ticks_, static_cast<int64_t>(compute + allreduce + boundary_total));
  }
  static_bytes_.assign(L + 1, 0);
  activation_bytes_.assign(L + 1, 0);
  for (int l = 0; l < L; ++l) {
    const LayerCost& c = profile.layers[l];
    static_bytes_[l + 1] = static_bytes_[l] + c.param_bytes + c.optimizer_bytes;
    activation_bytes_[l + 1] = activation_bytes_[l] + c.activation_bytes;
  }
  workspace_max_.assign(1, std::vector<int64_t>(L));
  for (int l = 0; l < L; ++l) workspace_max_[0][l] = profile.layers[l].workspace_bytes;
  for (int k = 1; (1 << k) <= L; ++k) {
    const std::vector<int64_t>& prev = workspace_max_[k - 1];
    std::vector<int64_t> level(L - (1 << k) + 1);
    for (size_t i = 0; i < level.size(); ++i) {
      level[i] = std::max(prev[i], prev[i + (size_t{1} << (k - 1))]);
    }
    workspace_max_.push_back(std::move(level));
  }
}

int64_t CostModel::workspaceBytes(int first, int end) const {
  if (end <= first) return 0;
  const int k = 63 - __builtin_clzll(static_cast<unsigned long long>(end - first));
  return std::max(workspace_max_[k][first], workspace_max_[k][end - (1 << k)]);
}

int CostModel::widthIndex(int width) const {
  for (size_t w = 0; w < widths_.size(); ++w) {
    if (widths_[w] == width) return static_cast<int>(w);
  }
  return -1;
}

int64_t CostModel::memoryBytes(int first, int end, int w, int64_t in_flight) const {
  __int128 m = static_cast<__int128>(staticBytes(first, end)) +
               static_cast<__int128>(in_flight) * activationBytesPerDevice(first, end, w) +
               workspaceBytes(first, end);
  if (m > std::numeric_limits<int64_t>::max()) return std::numeric_limits<int64_t>::max();
  return static_cast<int64_t>(m);
}

int64_t CostModel::allreduceNs(int layer, int width) const {
  if (width <= 1) return 0;
  const int64_t d = width;
  return static_cast<int64_t>(
      static_cast<__int128>(2 * (d - 1)) * allreduce_latency_ns_ +
      ceilDiv128(static_cast<__int128>(2 * (d - 1)) * param_bytes_[layer] * 8 * 1000000000,
                 static_cast<__int128>(d) * allreduce_bits_per_s_));
}

}  // namespace pipeline
}  // namespace sinew
