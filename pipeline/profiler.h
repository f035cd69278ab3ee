#pragma once

// The layer profiler (docs/architecture.md section 4, "Profiles"): runs each layer's forward and
// backward on one microbatch and measures what the planner needs (sinew/pipeline/profile.h).
//
// Layers are given generically, as a forward callable over activations (one tensor or
// several: pipeline/activation.h) plus the parameters it
// trains, so the profiler does not depend on how the runtime builds models (LayerSpec). The
// layers run in order: layer l + 1 is profiled on the (detached) output of layer l.
//
// Each run is one whole microbatch as in training: the forward of every layer in order, then
// the backward of every layer in reverse order (so each layer runs with the working set of a
// real step, not cache-hot on its own). Per layer, over `repeats` timed runs after `warmup`
// untimed ones, the median of:
//   forward_ns:  y = forward(x), with x requiring grad (if floating point) as in training;
//                for the last layer, with `loss(y, target)` if the options give a loss (the
//                last stage computes it after its layers);
//   backward_ns: y.backward(g), g the gradient of the next layer's input (for the last layer
//                the loss's backward, or ones without a loss), i.e. the gradients of x and of
//                every parameter.
// Parameter gradients accumulate over the runs, as over a step's microbatches (every
// microbatch after a step's first adds to them), and are reset (made undefined) when profiling
// ends or fails: gradients the parameters had before the call are discarded.
// On a CUDA tensor each timed section ends by reading one element back (a synchronisation).
// Bytes: param_bytes = sum of the parameters' bytes, optimizer_bytes = optimizer_state_factor
// x the trained (requires_grad) parameters' bytes, output_bytes = bytes of y, activation_bytes =
// the layer's own figure if it gives one (>= 0), else, on the CPU, bytes of x + the bytes the
// layer's forward left allocated in the first timed run (measured by counting libtorch's CPU
// allocations, pipeline/memory_meter.h: y, everything autograd saved for backward such as attention
// scores, and for the last layer what the loss saved), else (a CUDA input, or
// measure_memory false) bytes of x + bytes of y, a lower bound for layers that save larger
// intermediates. workspace_bytes = the layer's own figure if it gives one (>= 0), else the
// largest of: update_workspace_factor x its largest trained parameter's bytes (the optimizer
// step's temporaries), and on the CPU what its forward allocated beyond what it left allocated
// and what its backward allocated beyond what was allocated when it began (temporaries such
// as attention scores and softmax gradients, and gradients before they are added to the kept
// ones), in the first timed run.
//
// Thread safety: profileLayers() runs the layers on the calling thread; callers must not run
// the same layers concurrently. Blocking: it takes (warmup + repeats) x the layers' time.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "sinew/pipeline/activation.h"
#include "sinew/pipeline/profile.h"

namespace sinew {
namespace pipeline {

struct ProfiledLayer {
  std::string name;
  // The layer's forward for one microbatch. Must be differentiable in its input and in
  // `parameters`.
  std::function<Activation(const Activation&)> forward;
  // The tensors the layer trains (requires_grad). Their gradients are made undefined when
  // profiling ends or fails.
  std::vector<at::Tensor> parameters;
  // Bytes kept for backward per microbatch, if the layer knows better than the profiler's
  // measurement (or its estimate); -1: measure (estimate).
  int64_t activation_bytes = -1;
  // LayerCost::workspace_bytes, if the layer knows better; -1: measure (see above).
  int64_t workspace_bytes = -1;
};

struct ProfilerOptions {
  // Untimed runs per layer before measuring. >= 0.
  int warmup = 2;
  // Timed runs per layer; the median is kept. >= 1.
  int repeats = 5;
  // Seconds the runs may take (0: no limit): once the runs so far took this long, the
  // warm-up ends (after its first run) and the timed runs end after their third, so that a
  // large model is profiled in a few of its microbatches instead of warmup + repeats. >= 0.
  double time_budget_s = 0;
  // Optimizer state bytes per byte of a trained parameter (requires_grad; a frozen one has
  // none): 2 for Adam's two moments in the parameters' dtype, 3 with its gradient (the
  // trainer's measured profiles count the gradient). >= 0.
  double optimizer_state_factor = 2.0;
  // Temporary bytes of the optimizer's step per byte of a parameter, for the largest trained
  // parameter of each layer (AdamW: 2, its square root and its quotient; the trainer measures
  // it: runtime/optimizer_state.h). >= 0.
  double update_workspace_factor = 0;
  // Copied into the profile (machines are not measured here).
  JobSpec job;
  // Measure each layer's activation bytes on the CPU (see above) instead of estimating them.
  bool measure_memory = true;
  // Samples per microbatch of `input`, recorded in the profile (0: unknown).
  int64_t microbatch_size = 0;
  // The training loss of the last layer's output and `target`, a scalar; timed as part of the
  // last layer. Unset: the last layer's backward starts from ones.
  std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)> loss;
  // The microbatch's targets, for `loss`.
  at::Tensor target;
};

// Profiles `layers` on the microbatch `input`. Throws sinew::InvalidArgument for no layers, a
// layer without forward, bad options, or a layer whose forward or backward throws (the message
// names the layer and its index; a loss given without a target, or one that throws, does not
// return a one-element tensor or does not require grad while the model's output does, is
// named as the loss), and as validateProfile() for the result.
Profile profileLayers(const std::vector<ProfiledLayer>& layers, const Activation& input,
                      const ProfilerOptions& options);

}  // namespace pipeline
}  // namespace sinew
