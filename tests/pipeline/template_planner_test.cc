#include "sinew/pipeline/template_planner.h"

#include <gtest/gtest.h>

#include <random>

#include "brute_force.h"
#include "sinew/collectives/error.h"
#include "sinew/pipeline/cost_model.h"

namespace sinew {
namespace pipeline {
namespace {

using testing::bruteSplitCost;
using testing::bruteTemplateCost;
using testing::kNone;
using testing::randomProfile;

// The template's stages are a valid uniform-width split, its reported costs are what the
// brute-force model says, and the objective equals the brute-force optimum.
void checkTemplate(const Profile& p, const PipelineTemplate& t, int64_t brute_best) {
  const int G = p.job.devices_per_node;
  const int L = static_cast<int>(p.layers.size());
  ASSERT_EQ(G % t.stage_devices, 0);
  const int per_node = G / t.stage_devices;
  ASSERT_GT(static_cast<int>(t.stages.size()), (t.nodes - 1) * per_node);  // needs n nodes
  ASSERT_LE(static_cast<int>(t.stages.size()), t.nodes * per_node);
  std::vector<int> ends;
  int first = 0;
  for (size_t s = 0; s < t.stages.size(); ++s) {
    const StageAssignment& a = t.stages[s];
    EXPECT_EQ(a.first_layer, first);
    EXPECT_GT(a.end_layer, a.first_layer);
    EXPECT_EQ(a.devices, t.stage_devices);
    EXPECT_EQ(a.node, static_cast<int>(s) / (G / t.stage_devices));
    EXPECT_EQ(a.first_device, static_cast<int>(s) % (G / t.stage_devices) * t.stage_devices);
    EXPECT_LE(a.memory_bytes, p.job.device_memory_bytes);
    ends.push_back(a.end_layer);
    first = a.end_layer;
  }
  ASSERT_EQ(first, L);
  testing::BruteCost c = bruteSplitCost(p, t.stage_devices, ends, t.microbatches);
  ASSERT_NE(c.objective, kNone) << "the template does not fit in memory";
  EXPECT_EQ(c.fill, t.fill_ticks);
  EXPECT_EQ(c.bottleneck, t.bottleneck_ticks);
  EXPECT_EQ(t.iterationTicks(t.microbatches), brute_best);
}

TEST(TemplatePlannerTest, EqualsBruteForceOnRandomSmallInstances) {
  std::mt19937_64 rng(20240501);
  int checked = 0, infeasible_counts = 0;
  for (int iter = 0; iter < 2500; ++iter) {
    const int L = 1 + static_cast<int>(rng() % 10);
    const int G = 1 + static_cast<int>(rng() % 2);
    const int N = 1 + static_cast<int>(rng() % 4);
    const int f = static_cast<int>(rng() % N);
    const int64_t B = 1 + static_cast<int64_t>(rng() % 12);
    Profile p = randomProfile(rng, L, G);
    TemplateOptions o;
    o.nodes = N;
    o.fault_tolerance = f;
    o.global_microbatches = B;
    // n_min by brute force: the fewest nodes (up to N - f and L) with a feasible template.
    int n_min = 0;
    for (int n = 1; n <= std::min(N - f, L) && n_min == 0; ++n) {
      if (bruteTemplateCost(p, n, templateMicrobatches(B, n, N)) != kNone) n_min = n;
    }
    if (n_min == 0 || (f + 1) * n_min > N) {
      EXPECT_THROW(planTemplates(p, o), InvalidArgument);
      continue;
    }
    TemplateSet set = planTemplates(p, o);
    ASSERT_EQ(set.min_nodes, n_min);
    ASSERT_EQ(set.max_nodes, std::min(N - f * n_min, L));
    size_t next = 0;
    for (int n = n_min; n <= set.max_nodes; ++n) {
      const int64_t M = templateMicrobatches(B, n, N);
      const int64_t brute = bruteTemplateCost(p, n, M);
      const PipelineTemplate* t = set.find(n);
      if (brute == kNone) {
        EXPECT_EQ(t, nullptr) << "n=" << n;
        ++infeasible_counts;
        continue;
      }
      ASSERT_NE(t, nullptr) << "n=" << n;
      ASSERT_EQ(t, &set.templates[next++]);
      EXPECT_EQ(t->microbatches, M);
      checkTemplate(p, *t, brute);
      ++checked;
    }
    EXPECT_EQ(next, set.templates.size());
  }
  EXPECT_GT(checked, 1000);
  EXPECT_GT(infeasible_counts, 0);  // memory really constrains some instances
}

TEST(TemplatePlannerTest, EqualsBruteForceWithFourDevicesPerNode) {
  std::mt19937_64 rng(7);
  int checked = 0;
  for (int iter = 0; iter < 300; ++iter) {
    const int L = 2 + static_cast<int>(rng() % 8);
    const int N = 1 + static_cast<int>(rng() % 2);
    const int64_t B = 1 + static_cast<int64_t>(rng() % 8);
    Profile p = randomProfile(rng, L, 4);
    TemplateSet set;
    try {
      set = planTemplates(p, {N, 0, B});
    } catch (const InvalidArgument&) {
      for (int n = 1; n <= std::min(N, L); ++n) {
        EXPECT_EQ(bruteTemplateCost(p, n, templateMicrobatches(B, n, N)), kNone);
      }
      continue;
    }
    for (const PipelineTemplate& t : set.templates) {
      checkTemplate(p, t, bruteTemplateCost(p, t.nodes, t.microbatches));
      ++checked;
    }
  }
  EXPECT_GT(checked, 100);
}

TEST(TemplatePlannerTest, DeterministicAcrossRuns) {
  std::mt19937_64 rng(99);
  Profile p = randomProfile(rng, 60, 8);
  p.job.device_memory_bytes = 1 << 30;
  TemplateSet a = planTemplates(p, {16, 1, 64});
  TemplateSet b = planTemplates(p, {16, 1, 64});
  ASSERT_EQ(a.templates.size(), b.templates.size());
  for (size_t i = 0; i < a.templates.size(); ++i) {
    const PipelineTemplate& x = a.templates[i];
    const PipelineTemplate& y = b.templates[i];
    EXPECT_EQ(x.nodes, y.nodes);
    EXPECT_EQ(x.stage_devices, y.stage_devices);
    EXPECT_EQ(x.fill_ticks, y.fill_ticks);
    EXPECT_EQ(x.bottleneck_ticks, y.bottleneck_ticks);
    ASSERT_EQ(x.stages.size(), y.stages.size());
    for (size_t s = 0; s < x.stages.size(); ++s) {
      EXPECT_EQ(x.stages[s].end_layer, y.stages[s].end_layer);
    }
  }
}

TEST(TemplatePlannerTest, MemoryDecidesTheFewestNodes) {
  // Four identical layers of 100 static bytes and 10 activation bytes, 250 bytes per device,
  // one device per node: a stage holds at most two layers, so the model needs two nodes.
  Profile p;
  p.job.devices_per_node = 1;
  p.job.device_memory_bytes = 250;
  for (int l = 0; l < 4; ++l) {
    LayerCost c;
    c.forward_ns = 1000;
    c.backward_ns = 2000;
    c.param_bytes = 50;
    c.optimizer_bytes = 50;
    c.activation_bytes = 10;
    p.layers.push_back(c);
  }
  TemplateSet set = planTemplates(p, {5, 1, 8});
  EXPECT_EQ(set.min_nodes, 2);
  EXPECT_EQ(set.max_nodes, 3);  // N - f * n_min
  ASSERT_NE(set.find(2), nullptr);
  EXPECT_EQ(set.find(2)->stages[0].end_layer, 2);
  EXPECT_EQ(set.find(1), nullptr);
}

TEST(TemplatePlannerTest, RejectsBadOptionsAndTooMuchFaultTolerance) {
  std::mt19937_64 rng(3);
  Profile p = randomProfile(rng, 4, 1);
  p.job.device_memory_bytes = int64_t{1} << 40;
  EXPECT_THROW(planTemplates(p, {0, 0, 1}), InvalidArgument);
  EXPECT_THROW(planTemplates(p, {2, -1, 1}), InvalidArgument);
  EXPECT_THROW(planTemplates(p, {2, 2, 1}), InvalidArgument);
  EXPECT_THROW(planTemplates(p, {2, 0, 0}), InvalidArgument);
  p.job.device_memory_bytes = 1;  // nothing fits
  try {
    planTemplates(p, {2, 0, 4});
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("device_memory_bytes=1"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace pipeline
}  // namespace sinew
