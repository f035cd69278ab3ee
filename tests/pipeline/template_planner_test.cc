#include "sinew/pipeline/template_planner.h"

#include <gtest/gtest.h>

#include <random>
#include <set>

#include "brute_force.h"
#include "sinew/base/error.h"
#include "sinew/pipeline/cost_model.h"
#include "sinew/pipeline/instantiation.h"
#include "sinew/pipeline/reconfiguration.h"
#include "synthetic_profile.h"

namespace sinew {
namespace pipeline {
namespace {

using testing::bruteSplitCost;
using testing::bruteTemplateCost;
using testing::kNone;
using testing::randomProfile;

// The template's stages are a valid split placed on exactly its n nodes (every node holds a
// stage, no device holds two), its reported costs are what the brute-force model says, and
// the objective equals the brute-force optimum.
void checkTemplate(const Profile& p, const PipelineTemplate& t, int64_t brute_best) {
  const int G = p.job.devices_per_node;
  const int L = static_cast<int>(p.layers.size());
  std::vector<int> ends, widths;
  std::vector<std::vector<int>> owner(t.nodes, std::vector<int>(G, -1));
  int first = 0;
  bool uniform = true;
  for (size_t s = 0; s < t.stages.size(); ++s) {
    const StageAssignment& a = t.stages[s];
    EXPECT_EQ(a.first_layer, first);
    EXPECT_GT(a.end_layer, a.first_layer);
    ASSERT_GE(a.devices, 1);
    ASSERT_EQ(G % a.devices, 0);
    ASSERT_GE(a.node, 0);
    ASSERT_LT(a.node, t.nodes);
    ASSERT_GE(a.first_device, 0);
    ASSERT_LE(a.first_device + a.devices, G);
    for (int d = a.first_device; d < a.first_device + a.devices; ++d) {
      EXPECT_EQ(owner[a.node][d], -1) << "device " << d << " of node " << a.node << " twice";
      owner[a.node][d] = static_cast<int>(s);
    }
    EXPECT_LE(a.memory_bytes, p.job.device_memory_bytes);
    uniform = uniform && a.devices == t.stages[0].devices;
    ends.push_back(a.end_layer);
    widths.push_back(a.devices);
    first = a.end_layer;
  }
  ASSERT_EQ(first, L);
  for (int node = 0; node < t.nodes; ++node) {
    bool holds = false;
    for (int owner_stage : owner[node]) holds = holds || owner_stage >= 0;
    EXPECT_TRUE(holds) << "node " << node << " of the " << t.nodes << "-node template is idle";
  }
  EXPECT_EQ(t.stage_devices, uniform ? t.stages[0].devices : 0);
  testing::BruteCost c = bruteSplitCost(p, widths, ends, t.microbatches);
  ASSERT_NE(c.objective, kNone) << "the template does not fit in memory";
  EXPECT_EQ(c.fill, t.fill_ticks);
  EXPECT_EQ(c.bottleneck, t.bottleneck_ticks);
  EXPECT_EQ(t.iterationTicks(t.microbatches), brute_best);
}

TEST(TemplatePlannerTest, EqualsBruteForceOnRandomSmallInstances) {
  std::mt19937_64 rng(20240501);
  int checked = 0, infeasible_counts = 0, mixed = 0;
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
      mixed += t->stage_devices == 0;
    }
    EXPECT_EQ(next, set.templates.size());
  }
  EXPECT_GT(checked, 1000);
  EXPECT_GT(mixed, 50);             // templates with stages of different widths are really compared
  EXPECT_GT(infeasible_counts, 0);  // memory really constrains some instances
}

TEST(TemplatePlannerTest, EqualsBruteForceWithFourDevicesPerNode) {
  std::mt19937_64 rng(7);
  int checked = 0, mixed = 0;
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
      mixed += t.stage_devices == 0;
    }
  }
  EXPECT_GT(checked, 100);
  EXPECT_GT(mixed, 20);
}

// The planner bench's (32 layers, 8 devices per node) profile, on which a device holds one
// layer: a uniform-width template needs 32 stages and exists only for 4, 8, 16 and 32 nodes.
// With mixed widths every node count from n_min to n_max has one.
TEST(TemplatePlannerTest, MixedWidthsGiveEveryNodeCountATemplate) {
  const Profile p = syntheticProfile(32, 8, 42);
  TemplateSet set = planTemplates(p, {32, 1, 4 * 32});
  EXPECT_TRUE(set.mixed_widths);
  EXPECT_EQ(set.min_nodes, 4);
  EXPECT_EQ(set.max_nodes, 28);
  int mixed = 0;
  for (int n = set.min_nodes; n <= set.max_nodes; ++n) {
    const PipelineTemplate* t = set.find(n);
    ASSERT_NE(t, nullptr) << "no template on " << n << " nodes";
    EXPECT_EQ(t->stages.size(), 32u) << "n=" << n;  // one layer per device
    mixed += t->stage_devices == 0;
    for (const StageAssignment& a : t->stages) EXPECT_LE(a.memory_bytes, p.job.device_memory_bytes);
  }
  // Every count but 4, 8 and 16 (and some of those) needs stages of different widths.
  EXPECT_GE(mixed, 25 - 3);
  // Memory, not the search, limits the fewest nodes: 3 nodes of 8 devices cannot hold 32
  // layers one per device.
  EXPECT_EQ(set.find(3), nullptr);
}

// With 16 such nodes and f = 1, losing any 1, 2 or 3 nodes leaves no survivor idle: every
// survivor runs in a pipeline, at least f + 1 pipelines run, and each pipeline's template is
// one of the planned ones. (With uniform-width templates only, every such loss set left 3, 2 or
// 1 survivors idle.) All 696 loss sets are enumerated.
TEST(TemplatePlannerTest, NoSurvivorIsIdleAfterAnyLossOfUpToThreeNodes) {
  const Profile p = syntheticProfile(32, 8, 42);
  const int N = 16;
  const PlanOptions po{1, 4 * N};
  TemplateSet set = planTemplates(p, {N, po.fault_tolerance, po.global_microbatches});
  std::vector<int> nodes(N);
  for (int i = 0; i < N; ++i) nodes[i] = 100 + i;
  const Plan start = makePlan(set, nodes, po);
  ASSERT_TRUE(start.idleNodeIds.empty());
  int sets = 0;
  auto check = [&](const std::vector<int>& lost) {
    ++sets;
    Reconfiguration r = reconfigure(set, start, lost);
    std::set<int> used;
    for (const PipelinePlan& pp : r.plan.pipelines) {
      ASSERT_NE(set.find(pp.nodes), nullptr);
      for (int id : pp.nodeIds) EXPECT_TRUE(used.insert(id).second) << "node " << id << " twice";
    }
    EXPECT_TRUE(r.plan.idleNodeIds.empty())
        << r.plan.idleNodeIds.size() << " idle after losing " << lost.size() << " nodes";
    EXPECT_EQ(used.size(), static_cast<size_t>(N) - lost.size());
    for (int id : lost) EXPECT_EQ(used.count(id), 0u);
    EXPECT_GE(r.plan.pipelines.size(), 2u);
    int64_t total = 0;
    for (const PipelinePlan& pp : r.plan.pipelines) total += pp.microbatches;
    EXPECT_EQ(total, po.global_microbatches);
  };
  for (int a = 0; a < N; ++a) {
    check({nodes[a]});
    for (int b = a + 1; b < N; ++b) {
      check({nodes[a], nodes[b]});
      for (int c = b + 1; c < N; ++c) check({nodes[a], nodes[b], nodes[c]});
    }
  }
  EXPECT_EQ(sets, 16 + 120 + 560);
}

// G = 6 has divisors 1, 2, 3, 6 but the chain 1, 2, 6: width-3 stages appear only in uniform
// templates, and the planner equals the brute force over both families.
TEST(TemplatePlannerTest, EqualsBruteForceWithSixDevicesPerNode) {
  std::mt19937_64 rng(11);
  int checked = 0, mixed = 0;
  for (int iter = 0; iter < 120; ++iter) {
    const int L = 2 + static_cast<int>(rng() % 5);
    const int N = 1 + static_cast<int>(rng() % 2);
    const int64_t B = 1 + static_cast<int64_t>(rng() % 8);
    Profile p = randomProfile(rng, L, 6);
    TemplateSet set;
    try {
      set = planTemplates(p, {N, 0, B});
    } catch (const InvalidArgument&) {
      continue;
    }
    for (const PipelineTemplate& t : set.templates) {
      checkTemplate(p, t, bruteTemplateCost(p, t.nodes, t.microbatches));
      ++checked;
      mixed += t.stage_devices == 0;
    }
  }
  EXPECT_GT(checked, 50);
  EXPECT_GT(mixed, 5);
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

// Four identical layers of 100 static bytes, 10 activation bytes and `workspace` workspace
// bytes, 250 bytes per device, one device per node.
Profile fourSmallLayers(int64_t workspace) {
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
    c.workspace_bytes = workspace;
    p.layers.push_back(c);
  }
  return p;
}

TEST(TemplatePlannerTest, MemoryDecidesTheFewestNodes) {
  // A stage holds at most two of the layers, so the model needs two nodes.
  Profile p = fourSmallLayers(0);
  TemplateSet set = planTemplates(p, {5, 1, 8});
  EXPECT_EQ(set.min_nodes, 2);
  EXPECT_EQ(set.max_nodes, 3);  // N - f * n_min
  ASSERT_NE(set.find(2), nullptr);
  EXPECT_EQ(set.find(2)->stages[0].end_layer, 2);
  EXPECT_EQ(set.find(1), nullptr);
}

// A stage needs the largest workspace of its layers once (one layer runs at a time), on top of
// its static bytes and its activations in flight: the layers of MemoryDecidesTheFewestNodes
// with 5 workspace bytes each still fit two to a stage (200 + 2 x 20 + 5 <= 250; their sum,
// 10, would not), and one layer of 40 keeps the two-node split from fitting.
TEST(TemplatePlannerTest, AStageNeedsItsLargestWorkspaceOnce) {
  Profile p = fourSmallLayers(5);
  const CostModel model(p);
  EXPECT_EQ(model.workspaceBytes(0, 4), 5);
  EXPECT_EQ(model.memoryBytes(0, 2, 0, 2), 200 + 2 * 20 + 5);
  TemplateSet set = planTemplates(p, {5, 1, 8});
  EXPECT_EQ(set.min_nodes, 2);
  p.layers[1].workspace_bytes = 40;
  const CostModel wide(p);
  EXPECT_EQ(wide.workspaceBytes(0, 4), 40);
  EXPECT_EQ(wide.workspaceBytes(2, 4), 5);
  EXPECT_EQ(wide.workspaceBytes(1, 2), 40);
  EXPECT_FALSE(wide.fits(0, 2, 0, 2));  // 200 + 40 + 40 > 250
  EXPECT_TRUE(wide.fits(2, 4, 0, 1));
  set = planTemplates(p, {6, 1, 8});
  EXPECT_EQ(set.min_nodes, 3);
  ASSERT_NE(set.find(3), nullptr);
  for (const auto& s : set.find(3)->stages) {
    EXPECT_LE(s.memory_bytes, 250);
  }
}

// max_nodes (joins) extends the templates up to max_nodes - f * n_min and changes none of
// those the starting nodes have: the same splits and costs for every count up to N - f * n_min.
TEST(TemplatePlannerTest, MaxNodesAddsTemplatesForJoinsAndKeepsTheOthers) {
  for (int G : {1, 4}) {
    std::mt19937_64 rng(7 + G);
    Profile p = randomProfile(rng, 24, G);
    p.job.device_memory_bytes = 1 << 30;
    const TemplateSet start = planTemplates(p, {6, 1, 48});
    TemplateOptions grown{6, 1, 48};
    grown.max_nodes = 12;
    const TemplateSet more = planTemplates(p, grown);
    EXPECT_EQ(more.min_nodes, start.min_nodes);
    EXPECT_EQ(start.max_nodes, 6 - start.min_nodes);
    EXPECT_EQ(more.max_nodes, 12 - start.min_nodes);
    for (int n = start.min_nodes; n <= more.max_nodes; ++n) {
      const PipelineTemplate* a = start.find(n);
      const PipelineTemplate* b = more.find(n);
      ASSERT_NE(b, nullptr) << "G=" << G << ": no template for " << n << " nodes";
      if (n > start.max_nodes) {
        EXPECT_EQ(a, nullptr);
        continue;
      }
      ASSERT_NE(a, nullptr);
      EXPECT_EQ(a->fill_ticks, b->fill_ticks) << n;
      EXPECT_EQ(a->bottleneck_ticks, b->bottleneck_ticks) << n;
      ASSERT_EQ(a->stages.size(), b->stages.size()) << n;
      for (size_t s = 0; s < a->stages.size(); ++s) {
        EXPECT_EQ(a->stages[s].end_layer, b->stages[s].end_layer);
        EXPECT_EQ(a->stages[s].devices, b->stages[s].devices);
      }
    }
    // The grown templates instantiate on 12 nodes (e.g. after six joins) with none idle.
    std::vector<int> nodes(12);
    for (int i = 0; i < 12; ++i) nodes[i] = i;
    PlanOptions po;
    po.fault_tolerance = 1;
    po.global_microbatches = 48;
    EXPECT_TRUE(makePlan(more, nodes, po).idleNodeIds.empty()) << "G=" << G;
  }
  std::mt19937_64 rng(1);
  Profile p = randomProfile(rng, 4, 1);
  p.job.device_memory_bytes = 1 << 30;
  TemplateOptions bad{6, 1, 48};
  bad.max_nodes = -1;
  EXPECT_THROW(planTemplates(p, bad), InvalidArgument);
}

// Growth must not cost the starting nodes their mixed-width templates: on 128 layers of the
// bench profile (a device holds two layers at this L) with 40 nodes, a
// max_nodes of 200 would need a mixed-width table over 1024 devices, above the planner's limit.
// The growth is cut to what the table allows, and every starting count keeps its template.
TEST(TemplatePlannerTest, GrowthBeyondTheMixedTableKeepsTheStartingTemplates) {
  const Profile p = syntheticProfile(128, 8, 42);
  const TemplateSet start = planTemplates(p, {40, 1, 128});
  TemplateOptions grown{40, 1, 128};
  grown.max_nodes = 200;
  const TemplateSet more = planTemplates(p, grown);
  ASSERT_TRUE(start.mixed_widths);
  EXPECT_TRUE(more.mixed_widths);
  EXPECT_EQ(more.min_nodes, start.min_nodes);
  EXPECT_EQ(start.max_nodes, 40 - start.min_nodes);
  EXPECT_GT(more.max_nodes, start.max_nodes);
  for (int n = start.min_nodes; n <= start.max_nodes; ++n) {
    const PipelineTemplate* a = start.find(n);
    const PipelineTemplate* b = more.find(n);
    ASSERT_NE(a, nullptr) << "no starting template on " << n << " nodes";
    ASSERT_NE(b, nullptr) << "growth lost the template on " << n << " nodes";
    EXPECT_EQ(a->bottleneck_ticks, b->bottleneck_ticks) << n;
    EXPECT_EQ(a->fill_ticks, b->fill_ticks) << n;
    EXPECT_EQ(a->stages.size(), b->stages.size()) << n;
  }
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
