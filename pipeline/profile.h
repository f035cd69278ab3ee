#pragma once

// Layer profiles: what the planner knows about a model and the machines it runs on
// (docs/architecture.md section 4). A profile is measured by pipeline/profiler.h or loaded from the
// JSON format of docs/profile_format.md.
//
// Times are kept as integer nanoseconds and sizes as integer bytes, so that the planner's cost
// model is exact integer arithmetic and its output is the same, byte for byte, for the same
// profile. The JSON format writes times in milliseconds; loading rounds them to the nearest
// nanosecond.
//
// Thread safety: plain values; the functions are pure and may be called from any thread.

#include <cstdint>
#include <string>
#include <vector>

namespace sinew {
namespace pipeline {

// Costs of one layer for one microbatch.
struct LayerCost {
  std::string name;
  int64_t forward_ns = 0;
  int64_t backward_ns = 0;
  // Parameter bytes; each device of a stage holds all of its stage's parameters.
  int64_t param_bytes = 0;
  // Gradient and optimizer state bytes of the trained parameters (a measured profile: 3 x
  // param_bytes for Adam and AdamW, the gradient and two moments; SGD without momentum 1 x).
  int64_t optimizer_bytes = 0;
  // Bytes kept from the forward until the backward of one microbatch (per in-flight
  // microbatch). A stage on d devices splits each microbatch, so each device keeps 1/d.
  int64_t activation_bytes = 0;
  // Bytes of the layer's output; sent to the next stage when the layer ends a stage (and the
  // same number of gradient bytes comes back in the backward).
  int64_t output_bytes = 0;
  // The most memory the layer needs for a moment beyond what it keeps: temporaries of its
  // forward and backward (attention scores freed within the layer, an embedding's dense
  // gradient before it is added to the kept one) and of its optimizer step (e.g. AdamW's
  // square root and quotient, twice its largest parameter). Only one layer runs at a time, so a
  // stage needs the largest of its layers' workspaces once, not their sum.
  int64_t workspace_bytes = 0;
};

// The bytes a copy of layer c moves to a worker that takes it over: its parameters and their
// optimizer state, not the gradient optimizer_bytes also counts (a step makes it anew). The
// gradient is taken to be param_bytes where optimizer_bytes holds that much (every parameter
// trained); a layer with less (frozen parameters) is taken to have no optimizer state. A layer
// with some parameters frozen comes out low (Adam, half frozen: 1.5 x param_bytes against 2 x):
// the profile does not say which bytes are trained.
inline int64_t copyBytes(const LayerCost& c) {
  return c.param_bytes +
         (c.optimizer_bytes > c.param_bytes ? c.optimizer_bytes - c.param_bytes : 0);
}

// In-node gradient allreduce among the d devices of a stage: a ring allreduce of each layer's
// gradient (param_bytes), taking 2(d-1) latency_ns + ceil(2(d-1)/d * param_bytes * 8 /
// bandwidth) (see docs/planner.md).
struct AllreduceModel {
  // Per-device ring bandwidth inside a node, in gigabits per second (10^9 bit/s). > 0.
  double bandwidth_gbps = 100.0;
  // Latency of one ring step, in microseconds. >= 0.
  double latency_us = 0.0;
};

// The machines a job runs on.
struct JobSpec {
  // Devices (GPUs) per node, G. >= 1. Stages run on d devices of one node, d dividing G.
  int devices_per_node = 1;
  // Memory of one device available to parameters, optimizer state and activations. > 0.
  int64_t device_memory_bytes = 0;
  // Bandwidth between consecutive stages, in gigabits per second. > 0.
  double inter_stage_gbps = 100.0;
  AllreduceModel allreduce;
};

struct Profile {
  JobSpec job;
  // Samples per microbatch the layer costs were measured with; informational (0: unknown).
  int64_t microbatch_size = 0;
  // The model's layers in order; at least one.
  std::vector<LayerCost> layers;
};

// Throws sinew::InvalidArgument naming the first wrong field and its value: no layers,
// a negative time or size, devices_per_node < 1 or > 4096, device_memory_bytes <= 0, a
// bandwidth that is not a positive finite number, a negative latency, or totals so large that
// the planner's integer arithmetic could overflow (sum of layer times > 2^46 ns, about 19
// hours, or sum of bytes > 2^56).
void validateProfile(const Profile& profile);

// Parses the JSON format of docs/profile_format.md and validates the result.
// Throws sinew::InvalidArgument for malformed JSON, a missing or mistyped field or a value
// that validateProfile() rejects; the message names the field (e.g. "layers[3].forward_ms").
Profile parseProfileJson(const std::string& text);

// Reads and parses a profile file. Throws sinew::IoError if the file cannot be read and
// sinew::InvalidArgument as parseProfileJson().
Profile loadProfile(const std::string& path);

// Writes the JSON format (pretty-printed, keys sorted; deterministic). Round-trips through
// parseProfileJson().
std::string profileToJson(const Profile& profile);

}  // namespace pipeline
}  // namespace sinew
