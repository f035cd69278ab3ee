#include "sinew/pipeline/profiler.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <optional>

#include "sinew/base/error.h"
#include "sinew/pipeline/memory_meter.h"

#include <torch/csrc/autograd/autograd.h>

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
void synchronize(const Activation& a) {
  for (const at::Tensor& t : a.tensors) synchronize(t);
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

Profile profileLayers(const std::vector<ProfiledLayer>& layers, const Activation& input,
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
  if (input.tensors.empty()) {
    SINEW_THROW(InvalidArgument, "profileLayers: the input has no tensor");
  }
  for (const at::Tensor& t : input.tensors) {
    if (!t.defined()) SINEW_THROW(InvalidArgument, "profileLayers: an input tensor is undefined");
  }
  if (options.loss && !options.target.defined()) {
    SINEW_THROW(InvalidArgument, "profileLayers: a loss is given without a target tensor");
  }
  for (size_t l = 0; l < layers.size(); ++l) {
    if (!layers[l].forward) {
      SINEW_THROW(InvalidArgument, "profileLayers: layers[", l, "] ('", layers[l].name,
                  "') has no forward");
    }
  }
  Profile profile;
  profile.job = options.job;
  profile.microbatch_size = options.microbatch_size;
  const size_t L = layers.size();
  // Each run is one whole microbatch, as in training: the forward of every layer in order,
  // then the backward of every layer in reverse, each layer timed on its own. Profiling a
  // layer alone, over and over on the same tensors, measured it with a cache-hot working set
  // and underestimated training by a third (docs/pipeline.md, "Cost model check").
  std::vector<std::vector<int64_t>> fwd(L), bwd(L);
  std::vector<Activation> ins(L), outs(L);
  auto resetGradients = [&] {
    for (const ProfiledLayer& layer : layers) {
      for (const at::Tensor& p : layer.parameters) {
        if (p.grad().defined()) p.mutable_grad().reset();
      }
    }
  };
  auto failed = [&](size_t l, const std::exception& e) {
    resetGradients();
    SINEW_THROW(InvalidArgument, "profileLayers: layers[", l, "] ('", layers[l].name,
                "') failed: ", e.what());
  };
  // Bytes each layer's forward left allocated (its output, what autograd saved for backward,
  // and for the last layer the loss's), in the last run; -1 where not measured.
  std::vector<int64_t> retained(L, -1);
  std::optional<CpuMemoryMeter> meter;
  if (options.measure_memory && input.tensors[0].device().is_cpu()) meter.emplace();
  const bool metered = meter && meter->installed();
  for (int run = 0; run < options.warmup + options.repeats; ++run) {
    const bool lastRun = run + 1 == options.warmup + options.repeats;
    Activation x = input.detached();
    at::Tensor loss;  // The last layer's, if the options give a loss.
    for (size_t l = 0; l < L; ++l) {
      Activation in = x.detached();
      for (at::Tensor& t : in.tensors) {
        if (at::isFloatingType(t.scalar_type())) t.requires_grad_(true);
      }
      const int64_t liveBefore = metered ? meter->live() : 0;
      auto t0 = Clock::now();
      const bool withLoss = l + 1 == L && static_cast<bool>(options.loss);
      Activation y;
      try {
        y = layers[l].forward(in);
        // A device error can surface only at the synchronisation.
        if (!withLoss) synchronize(y);
      } catch (const std::exception& e) {
        failed(l, e);
      }
      if (withLoss) {
        auto lossFailed = [&](const std::string& why) {
          resetGradients();
          SINEW_THROW(InvalidArgument, "profileLayers: the loss on the output of layers[", l,
                      "] ('", layers[l].name, "') ", why);
        };
        try {
          loss = options.loss(y.single("the last layer's output"), options.target);
          if (loss.defined() && loss.numel() == 1) synchronize(loss);
        } catch (const std::exception& e) {
          lossFailed(std::string("failed: ") + e.what());
        }
        if (!loss.defined() || loss.numel() != 1) {
          lossFailed("returned " +
                     (loss.defined() ? std::to_string(loss.numel()) + " elements" : "no tensor") +
                     ", not one");
        }
        if (y.tensors[0].requires_grad() && !loss.requires_grad()) {
          lossFailed("does not require grad, so no gradient reaches the model");
        }
      }
      if (run >= options.warmup) fwd[l].push_back(nsSince(t0));
      if (metered && lastRun) retained[l] = std::max<int64_t>(0, meter->live() - liveBefore);
      ins[l] = in;
      outs[l] = y;
      x = y;
    }
    std::vector<at::Tensor> g;  // gradients of the next layer's input tensors
    for (size_t i = L; i-- > 0;) {
      const Activation& y = outs[i];
      const bool fromLoss = i + 1 == L && loss.defined() && loss.requires_grad();
      // The outputs that take part in backward, with the next layer's input gradients (ones
      // where it has none of the output's shape).
      std::vector<at::Tensor> ys, gs;
      for (size_t j = 0; !fromLoss && j < y.tensors.size(); ++j) {
        const at::Tensor& t = y.tensors[j];
        if (!t.requires_grad()) continue;
        ys.push_back(t);
        const bool fits = j < g.size() && g[j].defined() && g[j].sizes() == t.sizes();
        gs.push_back(fits ? g[j] : at::ones_like(t));
      }
      int64_t b_ns = 0;
      if (fromLoss || !ys.empty()) {
        try {
          auto t1 = Clock::now();
          if (fromLoss) {
            loss.backward();
          } else {
            torch::autograd::backward(ys, gs);
          }
          for (const at::Tensor& t : ins[i].tensors) {
            if (t.requires_grad()) synchronize(t.grad());
          }
          synchronize(y);
          b_ns = nsSince(t1);
        } catch (const std::exception& e) {
          failed(i, e);
        }
      }
      if (run >= options.warmup) bwd[i].push_back(b_ns);
      g.clear();
      for (const at::Tensor& t : ins[i].tensors) {
        g.push_back(t.requires_grad() && t.grad().defined() ? t.grad() : at::Tensor());
      }
    }
  }
  resetGradients();
  for (size_t l = 0; l < L; ++l) {
    const ProfiledLayer& layer = layers[l];
    LayerCost c;
    c.name = layer.name.empty() ? "layer" + std::to_string(l) : layer.name;
    c.forward_ns = median(fwd[l]);
    c.backward_ns = median(bwd[l]);
    for (const at::Tensor& p : layer.parameters) c.param_bytes += tensorBytes(p);
    c.optimizer_bytes =
        std::llround(static_cast<double>(c.param_bytes) * options.optimizer_state_factor);
    c.output_bytes = outs[l].bytes();
    c.activation_bytes = layer.activation_bytes >= 0 ? layer.activation_bytes
                         : retained[l] >= 0          ? ins[l].bytes() + retained[l]
                                                     : ins[l].bytes() + outs[l].bytes();
    profile.layers.push_back(std::move(c));
  }
  validateProfile(profile);
  return profile;
}

}  // namespace pipeline
}  // namespace sinew
