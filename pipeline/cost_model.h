#pragma once

// The planner's cost model (docs/planner.md states it in full). Everything is integer:
// times in ticks, sizes in bytes, so that comparing two plans is exact and planning is
// deterministic.
//
// A tick is 1/G nanosecond, G = devices_per_node: a stage on d devices (d divides G) takes
// (sum of its layers' times) / d, which is a whole number of ticks.
//
// For a stage holding layers [first, end) on d devices, at position k from the end of an
// S-stage pipeline (the last stage has k = 1):
//   compute(first, end, d)  = sum over its layers of (forward_ns + backward_ns) * G / d
//   allreduce(first, end, d) = sum over its layers of G * ringAllreduceNs(param_bytes, d)
//   transfer(end)           = end < L ? 2 * G * transferNs(output_bytes of layer end-1) : 0
//   fill(first, end, d)     = compute + allreduce + transfer
//   memory(first, end, d, k) = params + optimizer + k * ceil(activations / d)
//                              + max over its layers of workspace
// and a pipeline of stages s = 1..S running M microbatches under 1F1B takes
//   iteration(M) = sum_s fill_s + (M - 1) * max_s compute_s      (M >= 1; 0 for M = 0).
// It is feasible when every stage's memory, at its position, fits device_memory_bytes.
//
// Thread safety: immutable after construction; const methods may be called concurrently.

#include <cstdint>
#include <vector>

#include "sinew/pipeline/profile.h"

namespace sinew {
namespace pipeline {

class CostModel {
 public:
  // Validates the profile (validateProfile) and precomputes prefix sums: O(L * |widths|).
  // Throws sinew::InvalidArgument if the profile is invalid or a pipeline's fill time could
  // exceed 2^60 ticks (e.g. a tiny inter_stage_gbps making transfers take years).
  explicit CostModel(const Profile& profile);

  int numLayers() const { return num_layers_; }
  int devicesPerNode() const { return devices_per_node_; }
  int64_t deviceMemoryBytes() const { return device_memory_bytes_; }

  // The stage widths d: the divisors of devices_per_node, largest first.
  const std::vector<int>& widths() const { return widths_; }
  // Index of `width` in widths(), or -1 if it does not divide devices_per_node.
  int widthIndex(int width) const;

  // Stage quantities for layers [first, end) on widths()[w] devices.
  // REQUIRES: 0 <= first < end <= numLayers(), 0 <= w < widths().size().
  int64_t computeTicks(int first, int end, int w) const {
    return compute_[w][end] - compute_[w][first];
  }
  int64_t allreduceTicks(int first, int end, int w) const {
    return allreduce_[w][end] - allreduce_[w][first];
  }
  // 2 * G * transferNs(end - 1) if end < L (the output of layer end-1 goes to the next stage and
  // its gradient comes back), 0 for the last stage. REQUIRES: 1 <= end <= numLayers().
  int64_t boundaryTicks(int end) const { return boundary_[end]; }
  int64_t fillTicks(int first, int end, int w) const {
    return computeTicks(first, end, w) + allreduceTicks(first, end, w) + boundaryTicks(end);
  }
  int64_t staticBytes(int first, int end) const {
    return static_bytes_[end] - static_bytes_[first];
  }
  int64_t activationBytesPerDevice(int first, int end, int w) const {
    int64_t a = activation_bytes_[end] - activation_bytes_[first];
    int64_t d = widths_[w];
    return (a + d - 1) / d;
  }
  // The largest workspace_bytes of layers [first, end) (0 for an empty range): O(1).
  int64_t workspaceBytes(int first, int end) const;
  // Whether the stage fits a device when `in_flight` (>= 1) microbatches are in flight.
  bool fits(int first, int end, int w, int64_t in_flight) const {
    int64_t free_bytes =
        device_memory_bytes_ - staticBytes(first, end) - workspaceBytes(first, end);
    return free_bytes >= 0 && activationBytesPerDevice(first, end, w) <= free_bytes / in_flight;
  }
  // params + optimizer + in_flight * activations/d + workspace, saturating at INT64_MAX.
  int64_t memoryBytes(int first, int end, int w, int64_t in_flight) const;

  // Per layer: time to send its output to the next stage, and one ring allreduce of its
  // gradient among `width` devices, in nanoseconds (docs/planner.md).
  int64_t transferNs(int layer) const { return transfer_ns_[layer]; }
  int64_t allreduceNs(int layer, int width) const;

  // Largest sum of fill ticks over all layers and boundaries for any width: an upper bound on
  // any pipeline's fill time and on any stage's compute time.
  int64_t maxPipelineFillTicks() const { return max_fill_ticks_; }

 private:
  int num_layers_;
  int devices_per_node_;
  int64_t device_memory_bytes_;
  std::vector<int> widths_;
  std::vector<int64_t> transfer_ns_;
  std::vector<int64_t> param_bytes_;
  int64_t allreduce_latency_ns_;
  int64_t allreduce_bits_per_s_;
  // Prefix sums indexed [width index][layer boundary 0..L].
  std::vector<std::vector<int64_t>> compute_;
  std::vector<std::vector<int64_t>> allreduce_;
  std::vector<int64_t> boundary_;
  std::vector<int64_t> static_bytes_;
  std::vector<int64_t> activation_bytes_;
  // workspace_max_[k][i]: the largest workspace_bytes of layers [i, i + 2^k) (a sparse table).
  std::vector<std::vector<int64_t>> workspace_max_;
  int64_t max_fill_ticks_ = 0;
};

// Ceil(bits * 10^9 / bits_per_s) nanoseconds for `bytes` bytes at `bits_per_s`, exact.
int64_t transferTimeNs(int64_t bytes, int64_t bits_per_s);

// Gigabits per second as integer bits per second (rounded, at least 1).
int64_t gbpsToBitsPerSecond(double gbps);

}  // namespace pipeline
}  // namespace sinew
