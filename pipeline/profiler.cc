#include "sinew/pipeline/profiler.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <optional>
#include <string>
#include <vector>

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

void checkArguments(const std::vector<ProfiledLayer>& layers, const Activation& input,
                    const ProfilerOptions& options) {
  if (layers.empty()) {
    SINEW_THROW(InvalidArgument, "profileLayers: no layers");
  }
  if (options.warmup < 0 || options.repeats < 1) {
    SINEW_THROW(InvalidArgument,
                "profileLayers: need warmup >= 0 and repeats >= 1, got warmup=", options.warmup,
                " repeats=", options.repeats);
  }
  if (!(std::isfinite(options.time_budget_s) && options.time_budget_s >= 0)) {
    SINEW_THROW(InvalidArgument, "profileLayers: time_budget_s must be >= 0, got ",
                options.time_budget_s);
  }
  if (!(std::isfinite(options.optimizer_state_factor) && options.optimizer_state_factor >= 0)) {
    SINEW_THROW(InvalidArgument, "profileLayers: optimizer_state_factor must be >= 0, got ",
                options.optimizer_state_factor);
  }
  if (!(std::isfinite(options.update_workspace_factor) && options.update_workspace_factor >= 0)) {
    SINEW_THROW(InvalidArgument, "profileLayers: update_workspace_factor must be >= 0, got ",
                options.update_workspace_factor);
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
}

// The runs of one profile. Each run is one whole microbatch, as in training: the forward of
// every layer in order, then the backward of every layer in reverse, each layer timed on its
// own. Profiling a layer alone, over and over on the same tensors, measured it with a
// cache-hot working set and underestimated training by a third (docs/pipeline.md, "Cost model
// check").
class ProfileRuns {
 public:
  ProfileRuns(const std::vector<ProfiledLayer>& layers, const Activation& input,
              const ProfilerOptions& options)
      : layers_(layers),
        input_(input),
        options_(options),
        L_(layers.size()),
        fwd_(L_),
        bwd_(L_),
        ins_(L_),
        outs_(L_),
        retained_(L_, -1),
        transient_(L_, -1) {
    if (options.measure_memory && input.tensors[0].device().is_cpu()) meter_.emplace();
    metered_ = meter_ && meter_->installed();
  }

  // Warm-up runs, then timed ones; with a time budget, once the runs so far took it, the
  // warm-up stops and the timed runs stop after the third (or `repeats`, if fewer).
  Profile run() {
    const auto start = Clock::now();
    auto overBudget = [&] {
      return options_.time_budget_s > 0 &&
             std::chrono::duration<double>(Clock::now() - start).count() >= options_.time_budget_s;
    };
    for (int w = 0; w < options_.warmup && !(w > 0 && overBudget()); ++w) {
      backward(false, false, forward(false, false));
    }
    const int least = std::min(options_.repeats, 3);
    for (int r = 0; r < options_.repeats && !(r >= least && overBudget()); ++r) {
      backward(true, r == 0, forward(true, r == 0));
    }
    resetGradients();
    return result();
  }

 private:
  void resetGradients() {
    for (const ProfiledLayer& layer : layers_) {
      for (const at::Tensor& p : layer.parameters) {
        if (p.grad().defined()) p.mutable_grad().reset();
      }
    }
  }

  [[noreturn]] void failed(size_t l, const std::exception& e) {
    resetGradients();
    SINEW_THROW(InvalidArgument, "profileLayers: layers[", l, "] ('", layers_[l].name,
                "') failed: ", e.what());
  }

  // The options' loss on the last layer's output `y` (checked: one element that requires grad
  // when y does).
  at::Tensor lossOf(size_t l, const Activation& y) {
    auto lossFailed = [&](const std::string& why) {
      resetGradients();
      SINEW_THROW(InvalidArgument, "profileLayers: the loss on the output of layers[", l, "] ('",
                  layers_[l].name, "') ", why);
    };
    at::Tensor loss;
    try {
      loss = options_.loss(y.single("the last layer's output"), options_.target);
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
    return loss;
  }

  // Every layer's forward in order (timed when `timed`; its memory measured when `metered`);
  // returns the last layer's loss if the options give one.
  at::Tensor forward(bool timed, bool metered) {
    Activation x = input_.detached();
    at::Tensor loss;
    for (size_t l = 0; l < L_; ++l) {
      Activation in = x.detached();
      for (at::Tensor& t : in.tensors) {
        if (at::isFloatingType(t.scalar_type())) t.requires_grad_(true);
      }
      const int64_t liveBefore = metered_ ? meter_->live() : 0;
      if (metered_ && metered) meter_->resetPeak();
      auto t0 = Clock::now();
      const bool withLoss = l + 1 == L_ && static_cast<bool>(options_.loss);
      Activation y;
      try {
        y = layers_[l].forward(in);
        // A device error can surface only at the synchronisation.
        if (!withLoss) synchronize(y);
      } catch (const std::exception& e) {
        failed(l, e);
      }
      if (withLoss) loss = lossOf(l, y);
      if (timed) fwd_[l].push_back(nsSince(t0));
      if (metered_ && metered) {
        const int64_t live = meter_->live();
        retained_[l] = std::max<int64_t>(0, live - liveBefore);
        transient_[l] = std::max<int64_t>(0, meter_->peak() - live);
      }
      ins_[l] = in;
      outs_[l] = y;
      x = y;
    }
    return loss;
  }

  // Every layer's backward in reverse, each from the next layer's input gradients (ones where
  // it has none of the output's shape), or from `loss` for the last layer.
  void backward(bool timed, bool metered, const at::Tensor& loss) {
    std::vector<at::Tensor> g;  // gradients of the next layer's input tensors
    for (size_t i = L_; i-- > 0;) {
      const Activation& y = outs_[i];
      const bool fromLoss = i + 1 == L_ && loss.defined() && loss.requires_grad();
      std::vector<at::Tensor> ys, gs;  // the outputs that take part, with their gradients
      for (size_t j = 0; !fromLoss && j < y.tensors.size(); ++j) {
        const at::Tensor& t = y.tensors[j];
        if (!t.requires_grad()) continue;
        ys.push_back(t);
        const bool fits = j < g.size() && g[j].defined() && g[j].sizes() == t.sizes();
        gs.push_back(fits ? g[j] : at::ones_like(t));
      }
      int64_t ns = 0;
      const int64_t liveBefore = metered_ ? meter_->live() : 0;
      if (metered_ && metered) meter_->resetPeak();
      if (fromLoss || !ys.empty()) {
        try {
          auto t1 = Clock::now();
          if (fromLoss) {
            loss.backward();
          } else {
            torch::autograd::backward(ys, gs);
          }
          for (const at::Tensor& t : ins_[i].tensors) {
            if (t.requires_grad()) synchronize(t.grad());
          }
          synchronize(y);
          ns = nsSince(t1);
        } catch (const std::exception& e) {
          failed(i, e);
        }
      }
      if (timed) bwd_[i].push_back(ns);
      if (metered_ && metered) {
        transient_[i] = std::max(transient_[i], meter_->peak() - liveBefore);
      }
      g.clear();
      for (const at::Tensor& t : ins_[i].tensors) {
        g.push_back(t.requires_grad() && t.grad().defined() ? t.grad() : at::Tensor());
      }
    }
  }

  Profile result() const {
    Profile profile;
    profile.job = options_.job;
    profile.microbatch_size = options_.microbatch_size;
    for (size_t l = 0; l < L_; ++l) {
      const ProfiledLayer& layer = layers_[l];
      LayerCost c;
      c.name = layer.name.empty() ? "layer" + std::to_string(l) : layer.name;
      c.forward_ns = median(fwd_[l]);
      c.backward_ns = median(bwd_[l]);
      int64_t trained = 0;  // A frozen parameter has no gradient and no optimizer state.
      int64_t largest = 0;  // the largest trained parameter
      for (const at::Tensor& p : layer.parameters) {
        c.param_bytes += tensorBytes(p);
        if (p.requires_grad()) {
          trained += tensorBytes(p);
          largest = std::max(largest, tensorBytes(p));
        }
      }
      c.optimizer_bytes =
          std::llround(static_cast<double>(trained) * options_.optimizer_state_factor);
      c.output_bytes = outs_[l].bytes();
      c.activation_bytes = layer.activation_bytes >= 0 ? layer.activation_bytes
                           : retained_[l] >= 0         ? ins_[l].bytes() + retained_[l]
                                                       : ins_[l].bytes() + outs_[l].bytes();
      const int64_t step =
          std::llround(static_cast<double>(largest) * options_.update_workspace_factor);
      c.workspace_bytes = layer.workspace_bytes >= 0
                              ? layer.workspace_bytes
                              : std::max<int64_t>(step, std::max<int64_t>(0, transient_[l]));
      profile.layers.push_back(std::move(c));
    }
    validateProfile(profile);
    return profile;
  }

  const std::vector<ProfiledLayer>& layers_;
  const Activation& input_;
  const ProfilerOptions& options_;
  const size_t L_;
  std::vector<std::vector<int64_t>> fwd_, bwd_;  // per layer, the timed runs' nanoseconds
  std::vector<Activation> ins_, outs_;           // per layer, the last run's
  // Bytes each layer's forward left allocated (its output, what autograd saved for backward,
  // and for the last layer the loss's), in the last run; -1 where not measured.
  std::vector<int64_t> retained_;
  // The most a layer's forward or backward allocated beyond what it left allocated (its
  // temporaries, and in the backward its new gradients before they are added to the kept
  // ones), in the last run; -1 where not measured.
  std::vector<int64_t> transient_;
  std::optional<CpuMemoryMeter> meter_;
  bool metered_ = false;
};

}  // namespace

Profile profileLayers(const std::vector<ProfiledLayer>& layers, const Activation& input,
                      const ProfilerOptions& options) {
  checkArguments(layers, input, options);
  return ProfileRuns(layers, input, options).run();
}

}  // namespace pipeline
}  // namespace sinew
