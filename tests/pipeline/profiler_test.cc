#include "sinew/pipeline/profiler.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <thread>

#include "sinew/base/error.h"
#include "sinew/pipeline/memory_meter.h"
#include "sinew/pipeline/template_planner.h"

namespace sinew {
namespace pipeline {
namespace {

// A linear layer (+ ReLU) built from at::linear, with its weight and bias.
ProfiledLayer linearLayer(const std::string& name, int64_t in, int64_t out, bool relu) {
  at::Tensor w = at::randn({out, in}).mul_(0.1).requires_grad_(true);
  at::Tensor b = at::zeros({out}).requires_grad_(true);
  ProfiledLayer l;
  l.name = name;
  l.parameters = {w, b};
  l.forward = [w, b, relu](const Activation& a) {
    const at::Tensor& x = a.tensors[0];
    at::Tensor y = at::linear(x, w, b);
    return relu ? at::relu(y) : y;
  };
  return l;
}

TEST(ProfilerTest, MeasuresTimesAndBytesOfLinearLayers) {
  at::set_num_threads(1);
  at::manual_seed(0);
  std::vector<ProfiledLayer> layers = {linearLayer("fc1", 64, 256, true),
                                       linearLayer("fc2", 256, 32, false)};
  ProfilerOptions o;
  o.repeats = 3;
  o.microbatch_size = 16;
  o.job.devices_per_node = 2;
  o.job.device_memory_bytes = 1 << 30;
  Profile p = profileLayers(layers, at::randn({16, 64}), o);
  ASSERT_EQ(p.layers.size(), 2u);
  EXPECT_EQ(p.microbatch_size, 16);
  EXPECT_EQ(p.job.devices_per_node, 2);
  const LayerCost& a = p.layers[0];
  EXPECT_EQ(a.name, "fc1");
  EXPECT_EQ(a.param_bytes, (64 * 256 + 256) * 4);
  EXPECT_EQ(a.optimizer_bytes, 2 * a.param_bytes);
  EXPECT_EQ(a.output_bytes, 16 * 256 * 4);
  EXPECT_EQ(a.activation_bytes, 16 * 64 * 4 + 16 * 256 * 4);
  EXPECT_GT(a.forward_ns, 0);
  EXPECT_GT(a.backward_ns, 0);
  const LayerCost& b = p.layers[1];
  EXPECT_EQ(b.param_bytes, (256 * 32 + 32) * 4);
  EXPECT_EQ(b.output_bytes, 16 * 32 * 4);
  EXPECT_GT(b.forward_ns, 0);
  // Gradients were reset after profiling, and the result plans.
  EXPECT_FALSE(layers[0].parameters[0].grad().defined());
  TemplateSet set = planTemplates(p, {2, 0, 4});
  EXPECT_FALSE(set.templates.empty());
}

// Self-attention without projections: softmax(x x^T / sqrt(E)) x. Autograd keeps the
// [b, T, T] attention weights for backward: at T = 128 and E = 8 eight times the input and
// output together.
ProfiledLayer attentionLayer() {
  ProfiledLayer l;
  l.name = "attention";
  l.forward = [](const Activation& a) {
    const at::Tensor& x = a.tensors[0];
    at::Tensor scores = at::matmul(x, x.transpose(1, 2)) / std::sqrt(8.0);
    return at::matmul(at::softmax(scores, -1), x);
  };
  return l;
}

// The profiler measures what a layer keeps for backward (the attention weights included),
// where the input + output estimate is 8x too low; measure_memory = false gives the estimate,
// and a layer's own figure wins over both.
// A model whose microbatch takes long is profiled within the time budget: the first warm-up
// run, then the timed runs until the budget is spent, at least three; without a budget every
// warm-up and timed run happens. (A 124 M-parameter GPT took over eight minutes per worker for
// its 24 runs on this machine.)
TEST(ProfilerTest, ATimeBudgetEndsTheRunsOfASlowModelAfterThreeTimedOnes) {
  auto runsWith = [](double budget) {
    auto runs = std::make_shared<int>(0);
    ProfiledLayer slow = linearLayer("slow", 8, 8, false);
    auto inner = slow.forward;
    slow.forward = [inner, runs](const Activation& x) {
      ++*runs;
      std::this_thread::sleep_for(std::chrono::milliseconds(40));
      return inner(x);
    };
    ProfilerOptions o;
    o.warmup = 3;
    o.repeats = 21;
    o.time_budget_s = budget;
    o.job.device_memory_bytes = 1 << 30;
    Profile p = profileLayers({slow}, at::randn({4, 8}), o);
    EXPECT_GE(p.layers.at(0).forward_ns, 40 * 1000 * 1000);
    return *runs;
  };
  EXPECT_EQ(runsWith(0), 24);
  // 40 ms a run, a budget of 0.1 s: three warm-up runs would take 0.12 s, so the warm-up ends
  // after two or three, then exactly three timed runs (the budget is spent by then).
  const int budgeted = runsWith(0.1);
  EXPECT_GE(budgeted, 2 + 3);
  EXPECT_LE(budgeted, 3 + 3);
  ProfilerOptions bad;
  bad.time_budget_s = -1;
  bad.job.device_memory_bytes = 1 << 30;
  EXPECT_THROW(profileLayers({linearLayer("a", 2, 2, false)}, at::randn({1, 2}), bad),
               InvalidArgument);
}

// libtorch's raw_allocate() (used by large CPU matmuls, e.g. a GPT-2 small block) asserts that
// an allocation's context is its data pointer: the meter's allocations keep that, are counted
// and freed through raw_deallocate. (The first meter failed it: "dptr.get() ==
// dptr.get_context() INTERNAL ASSERT FAILED" profiling GPT-2 small.)
TEST(ProfilerTest, TheMeterCountsRawAllocations) {
  CpuMemoryMeter meter;
  ASSERT_TRUE(meter.installed());
  const int64_t before = meter.live();
  c10::Allocator* cpu = c10::GetCPUAllocator();
  void* p = cpu->raw_allocate(1 << 20);
  ASSERT_NE(p, nullptr);
  std::memset(p, 1, 1 << 20);
  EXPECT_EQ(meter.live() - before, 1 << 20);
  EXPECT_GE(meter.peak() - before, 1 << 20);
  cpu->raw_deallocate(p);
  EXPECT_EQ(meter.live(), before);
  at::Tensor t = at::ones({256, 256});
  EXPECT_EQ(meter.live() - before, 256 * 256 * 4);
  t.reset();
  EXPECT_EQ(meter.live(), before);
}

TEST(ProfilerTest, MeasuresTheActivationsALayerKeepsForBackward) {
  at::set_num_threads(1);
  const int64_t b = 4, T = 128, E = 8;
  const int64_t io = 2 * b * T * E * 4;   // input and output, float32
  const int64_t weights = b * T * T * 4;  // the softmax's output, saved for backward
  ProfilerOptions o;
  o.repeats = 2;
  o.warmup = 1;
  o.job.device_memory_bytes = 1 << 30;
  Profile measured = profileLayers({attentionLayer()}, at::randn({b, T, E}), o);
  EXPECT_GE(measured.layers[0].activation_bytes, io + weights);
  EXPECT_LE(measured.layers[0].activation_bytes, io + 3 * weights);
  o.measure_memory = false;
  Profile estimated = profileLayers({attentionLayer()}, at::randn({b, T, E}), o);
  EXPECT_EQ(estimated.layers[0].activation_bytes, io);
  ProfiledLayer given = attentionLayer();
  given.activation_bytes = 12345;
  o.measure_memory = true;
  EXPECT_EQ(profileLayers({given}, at::randn({b, T, E}), o).layers[0].activation_bytes, 12345);
}

// A layer whose forward makes a [b, k, W] product and sums it away: nothing keeps the product
// (mul saves its inputs, a view of x and the weight), so its bytes are workspace, not
// activations; the backward makes two products of that size (the gradients of x's view and of
// the weight before their reductions). The optimizer step's share is update_workspace_factor x
// the layer's largest trained parameter, and a layer's own figure overrides both.
TEST(ProfilerTest, MeasuresTheTemporariesOfALayerAsItsWorkspace) {
  at::set_num_threads(1);
  const int64_t b = 4, k = 64, W = 1024;
  const int64_t product = b * k * W * 4;
  at::Tensor w = at::randn({k, W}).requires_grad_(true);
  ProfiledLayer wide;
  wide.name = "wide";
  wide.parameters = {w};
  wide.forward = [w](const Activation& a) { return a.tensors[0].unsqueeze(-1).mul(w).sum(-1); };
  ProfilerOptions o;
  o.repeats = 2;
  o.warmup = 1;
  o.job.device_memory_bytes = 1 << 30;
  const LayerCost measured = profileLayers({wide}, at::randn({b, k}), o).layers[0];
  EXPECT_GE(measured.workspace_bytes, product);
  EXPECT_LE(measured.workspace_bytes, 4 * product);
  EXPECT_LT(measured.activation_bytes, product / 8);
  o.update_workspace_factor = 64;  // 64 x the weight's 256 KiB dominates the temporaries
  EXPECT_EQ(profileLayers({wide}, at::randn({b, k}), o).layers[0].workspace_bytes, 64 * k * W * 4);
  o.update_workspace_factor = 0;
  o.measure_memory = false;
  EXPECT_EQ(profileLayers({wide}, at::randn({b, k}), o).layers[0].workspace_bytes, 0);
  wide.workspace_bytes = 777;
  o.measure_memory = true;
  EXPECT_EQ(profileLayers({wide}, at::randn({b, k}), o).layers[0].workspace_bytes, 777);
  o.update_workspace_factor = -1;
  EXPECT_THROW(profileLayers({wide}, at::randn({b, k}), o), InvalidArgument);
}

TEST(ProfilerTest, ReportsTheFailingLayerAndBadOptions) {
  at::set_num_threads(1);
  std::vector<ProfiledLayer> layers = {linearLayer("fc1", 8, 8, true)};
  ProfiledLayer bad;
  bad.name = "broken";
  bad.forward = [](const Activation&) -> Activation { throw std::runtime_error("boom"); };
  layers.push_back(bad);
  ProfilerOptions o;
  o.job.device_memory_bytes = 1 << 20;
  try {
    profileLayers(layers, at::randn({2, 8}), o);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("layers[1] ('broken') failed: boom"), std::string::npos)
        << e.what();
  }
  o.repeats = 0;
  EXPECT_THROW(profileLayers({linearLayer("x", 2, 2, false)}, at::randn({1, 2}), o),
               InvalidArgument);
  o.repeats = 1;
  EXPECT_THROW(profileLayers({}, at::randn({1, 2}), o), InvalidArgument);
}

// The last stage computes the loss after its layers, so the loss's forward and backward are
// the last layer's: a loss that takes 20 ms makes the last layer's forward at least that, and
// the backward starts from it (its gradient reaches the parameters).
TEST(ProfilerTest, TimesTheLossAsPartOfTheLastLayer) {
  at::set_num_threads(1);
  at::manual_seed(0);
  std::vector<ProfiledLayer> layers = {linearLayer("fc1", 16, 16, true),
                                       linearLayer("fc2", 16, 4, false)};
  ProfilerOptions o;
  o.warmup = 0;
  o.repeats = 3;
  o.job.device_memory_bytes = 1 << 20;
  const Profile without = profileLayers(layers, at::randn({8, 16}), o);
  EXPECT_LT(without.layers[1].forward_ns, 20'000'000);
  int calls = 0;
  at::Tensor seen;
  std::vector<bool> hadGradient;  // fc1's weight, at each run's loss
  o.target = at::randint(0, 4, {8}, at::kLong);
  o.loss = [&](const at::Tensor& y, const at::Tensor& t) {
    ++calls;
    seen = t;
    hadGradient.push_back(layers[0].parameters[0].grad().defined());
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    return at::cross_entropy_loss(y, t);
  };
  // The loss's gradient, not ones, flows back: record what reaches fc2's output.
  at::Tensor fromLoss;
  ProfiledLayer& fc2 = layers[1];
  auto inner = fc2.forward;
  fc2.forward = [inner, &fromLoss](const Activation& x) {
    at::Tensor y = inner(x).tensors[0];
    y.register_hook([&fromLoss](const at::Tensor& g) { fromLoss = g.clone(); });
    return y;
  };
  const Profile with = profileLayers(layers, at::randn({8, 16}), o);
  EXPECT_EQ(calls, 3);
  EXPECT_TRUE(seen.equal(o.target));
  EXPECT_GE(with.layers[1].forward_ns, 20'000'000);
  EXPECT_LT(with.layers[0].forward_ns, 20'000'000);
  EXPECT_GT(with.layers[1].backward_ns, 0);
  ASSERT_TRUE(fromLoss.defined());
  // Cross-entropy's gradient of a mean over 8 samples: each row sums to 0, entries within 1/8.
  EXPECT_LT(fromLoss.sum(1).abs().max().item<float>(), 1e-6);
  EXPECT_LE(fromLoss.abs().max().item<float>(), 1.0f / 8 + 1e-6);
  // Gradients accumulated over the runs (kept from one run to the next, as over a step's
  // microbatches) and were reset at the end.
  EXPECT_EQ(hadGradient, (std::vector<bool>{false, true, true}));
  EXPECT_FALSE(layers[0].parameters[0].grad().defined());
  EXPECT_FALSE(layers[1].parameters[0].grad().defined());
}

TEST(ProfilerTest, ReportsABadLoss) {
  at::set_num_threads(1);
  std::vector<ProfiledLayer> layers = {linearLayer("fc1", 4, 4, false)};
  ProfilerOptions o;
  o.job.device_memory_bytes = 1 << 20;
  o.loss = [](const at::Tensor& y, const at::Tensor&) { return y; };           // Not a scalar.
  EXPECT_THROW(profileLayers(layers, at::randn({2, 4}), o), InvalidArgument);  // No target.
  o.target = at::zeros({2});
  try {
    profileLayers(layers, at::randn({2, 4}), o);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("('fc1') returned 8 elements, not one"), std::string::npos)
        << e.what();
  }
  // A loss that fails on its third call, after two runs built gradients: the error names the
  // loss, and the gradients are gone.
  o.warmup = 1;
  o.repeats = 3;
  int calls = 0;
  o.loss = [&calls](const at::Tensor& y, const at::Tensor&) -> at::Tensor {
    if (++calls == 3) throw std::runtime_error("bad target");
    return y.sum();
  };
  try {
    profileLayers(layers, at::randn({2, 4}), o);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("the loss on the output of layers[0] ('fc1') failed: "
                                         "bad target"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(calls, 3);
  EXPECT_FALSE(layers[0].parameters[0].grad().defined());
  EXPECT_FALSE(layers[0].parameters[1].grad().defined());
  // A loss cut off from the graph would time no backward of the model's.
  o.loss = [](const at::Tensor& y, const at::Tensor&) { return y.detach().sum(); };
  try {
    profileLayers(layers, at::randn({2, 4}), o);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("does not require grad"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace pipeline
}  // namespace sinew
