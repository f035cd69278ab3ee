#include "sinew/pipeline/profiler.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>

#include "sinew/collectives/error.h"

namespace sinew {
namespace pipeline {
namespace {

using Clock = std::chrono::steady_clock;

int64_t tensorBytes(const at::Tensor& t) {
  return t.defined() ? static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size()) : 0;
}

// Waits for the device's queued work: reading one element back synchronises a CUDA stream
// and is free on the CPU, where work is already done.
void synchronize(const at::Tensor& t) {
  if (t.defined() && !t.is_cpu() && t.numel() > 0) {
    (void)t.reshape({-1})[0].item();
  }
}

int64_t median(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int64_t nsSince(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}

}  // namespace

Profile profileLayers(const std::vector<ProfiledLayer>& layers, const at::Tensor& input,
                      const ProfilerOptions& options) {
  if (layers.empty()) {
    SINEW_THROW(InvalidArgument, "profileLayers: no layers");
  }
  if (options.warmup < 0 || options.repeats < 1) {
    SINEW_THROW(InvalidArgument,
                "profileLayers: need warmup >= 0 and repeats >= 1, got warmup=", options.warmup,
                " repeats=", options.repeats);
  }
  if (!(std::isfinite(options.optimizer_state_factor) && options.optimizer_state_factor >= 0)) {
    SINEW_THROW(InvalidArgument, "profileLayers: optimizer_state_factor must be >= 0, got ",
                options.optimizer_state_factor);
  }
  if (!input.defined()) {
    SINEW_THROW(InvalidArgument, "profileLayers: input tensor is undefined");
  }
  Profile profile;
  profile.job = options.job;
  profile.microbatch_size = options.microbatch_size;
  at::Tensor x = input.detach();
  for (size_t l = 0; l < layers.size(); ++l) {
    const ProfiledLayer& layer = layers[l];
    if (!layer.forward) {
      SINEW_THROW(InvalidArgument, "profileLayers: layers[", l, "] ('", layer.name,
                  "') has no forward");
    }
    const bool floating = at::isFloatingType(x.scalar_type());
    std::vector<int64_t> fwd, bwd;
    at::Tensor y;
    for (int run = 0; run < options.warmup + options.repeats; ++run) {
      at::Tensor in = x.detach();
      if (floating) in.requires_grad_(true);
      try {
        auto t0 = Clock::now();
        y = layer.forward(in);
        synchronize(y);
        int64_t f_ns = nsSince(t0);
        int64_t b_ns = 0;
        if (y.requires_grad()) {
          auto t1 = Clock::now();
          y.backward(at::ones_like(y));
          synchronize(floating ? in.grad() : y);
          b_ns = nsSince(t1);
        }
        if (run >= options.warmup) {
          fwd.push_back(f_ns);
          bwd.push_back(b_ns);
        }
      } catch (const std::exception& e) {
        SINEW_THROW(InvalidArgument, "profileLayers: layers[", l, "] ('", layer.name,
                    "') failed: ", e.what());
      }
      for (const at::Tensor& p : layer.parameters) {
        if (p.grad().defined()) p.mutable_grad().reset();
      }
    }
    LayerCost c;
    c.name = layer.name.empty() ? "layer" + std::to_string(l) : layer.name;
    c.forward_ns = median(fwd);
    c.backward_ns = median(bwd);
    for (const at::Tensor& p : layer.parameters) c.param_bytes += tensorBytes(p);
    c.optimizer_bytes =
        std::llround(static_cast<double>(c.param_bytes) * options.optimizer_state_factor);
    c.output_bytes = tensorBytes(y);
    c.activation_bytes =
        layer.activation_bytes >= 0 ? layer.activation_bytes : tensorBytes(x) + tensorBytes(y);
    profile.layers.push_back(std::move(c));
    x = y.detach();
  }
  validateProfile(profile);
  return profile;
}

}  // namespace pipeline
}  // namespace sinew
