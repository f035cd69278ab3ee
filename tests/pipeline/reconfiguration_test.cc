#include "sinew/pipeline/reconfiguration.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <tuple>

#include "brute_force.h"
#include "sinew/base/error.h"

namespace sinew {
namespace pipeline {
namespace {

// Templates of the given node counts, 2 devices per node, 2 * n one-device stages over
// L = 2 * max(sizes) layers, with costs that make larger pipelines faster.
TemplateSet makeTemplates(const std::vector<int>& sizes) {
  TemplateSet set;
  set.devices_per_node = 2;
  set.num_layers = 2 * *std::max_element(sizes.begin(), sizes.end());
  set.min_nodes = sizes.front();
  set.max_nodes = sizes.back();
  for (int n : sizes) {
    PipelineTemplate t;
    t.nodes = n;
    t.stage_devices = 1;
    const int S = 2 * n;
    for (int s = 0; s < S; ++s) {
      StageAssignment a;
      a.first_layer = s * set.num_layers / S;
      a.end_layer = (s + 1) * set.num_layers / S;
      a.node = s / 2;
      a.first_device = s % 2;
      a.devices = 1;
      t.stages.push_back(a);
    }
    t.fill_ticks = 1000 + 10 * n;
    t.bottleneck_ticks = 600 / n;
    set.templates.push_back(t);
  }
  return set;
}

Plan handPlan(const TemplateSet& set, const std::vector<std::vector<int>>& pipelines,
              const std::vector<int>& idle, int f, int64_t B) {
  Plan plan;
  plan.faultTolerance = f;
  plan.microbatchesPerStep = B;
  std::vector<int> sizes;
  for (const auto& ids : pipelines) {
    PipelinePlan p;
    p.nodes = static_cast<int>(ids.size());
    p.nodeIds = ids;
    sizes.push_back(p.nodes);
    plan.pipelines.push_back(p);
  }
  BatchSplit split = splitBatch(set, sizes, B);
  for (size_t p = 0; p < sizes.size(); ++p) {
    plan.pipelines[p].microbatches = split.microbatches[p];
    plan.pipelines[p].iterationTicks = set.find(sizes[p])->iterationTicks(split.microbatches[p]);
  }
  plan.iterationTicks = split.iteration_ticks;
  plan.idleNodeIds = idle;
  return plan;
}

// Invariants of any plan reconfigure() returns, and of its layer copies.
void checkReconfiguration(const TemplateSet& set, const Plan& before, const std::set<int>& lost,
                          const Reconfiguration& r) {
  const Plan& plan = r.plan;
  std::set<int> seen;
  std::vector<const PipelineTemplate*> pipes;
  int64_t sum = 0, z = 0;
  for (const PipelinePlan& p : plan.pipelines) {
    ASSERT_EQ(static_cast<int>(p.nodeIds.size()), p.nodes);
    const PipelineTemplate* t = set.find(p.nodes);
    ASSERT_NE(t, nullptr) << "pipeline of " << p.nodes << " nodes has no template";
    pipes.push_back(t);
    for (int id : p.nodeIds) {
      EXPECT_TRUE(seen.insert(id).second) << "node " << id << " used twice";
      EXPECT_EQ(lost.count(id), 0u) << "lost node " << id << " still in the plan";
    }
    EXPECT_EQ(p.iterationTicks, t->iterationTicks(p.microbatches));
    sum += p.microbatches;
    z = std::max(z, p.iterationTicks);
  }
  for (int id : plan.idleNodeIds) EXPECT_TRUE(seen.insert(id).second);
  EXPECT_EQ(sum, before.microbatchesPerStep);  // the global batch never changes
  EXPECT_EQ(plan.iterationTicks, z);
  if (before.microbatchesPerStep <= 10 && pipes.size() <= 4) {
    EXPECT_EQ(z, testing::bruteSplitMakespan(pipes, before.microbatchesPerStep));
  }
  // Every surviving node of the old plan is somewhere in the new one.
  for (const PipelinePlan& p : before.pipelines) {
    for (int id : p.nodeIds) EXPECT_TRUE(lost.count(id) || seen.count(id)) << id;
  }
}

// Whether worker (node, device) of `next` holds layer l that it did not hold in `previous`, and
// some worker of `previous` not in `lost` held it (the runtime copies it from a live holder).
bool copiedFromASurvivor(const TemplateSet& set, const Plan& previous, const Plan& next,
                         const std::set<int>& lost, int node, int device) {
  bool any = false;
  for (const WorkerAssignment& w : workerAssignments(set, next)) {
    if (w.node != node || w.device != device) continue;
    for (int l = w.firstLayer; l < w.endLayer; ++l) {
      bool had = false, survives = false;
      for (const WorkerAssignment& o : workerAssignments(set, previous)) {
        const bool holds = o.firstLayer <= l && l < o.endLayer;
        had = had || (holds && o.node == node && o.device == device);
        survives = survives || (holds && !lost.count(o.node));
      }
      any = any || (!had && survives);
    }
  }
  return any;
}

TEST(ReconfigurationTest, ShrinksToTheTemplateWithOneNodeFewer) {
  TemplateSet set = makeTemplates({2, 3, 4});
  Plan plan = handPlan(set, {{0, 1, 2, 3}, {4, 5, 6, 7}}, {}, 1, 20);
  Reconfiguration r = reconfigure(set, plan, {1});
  EXPECT_EQ(r.kind, ReconfigurationKind::kShrink);
  ASSERT_EQ(r.plan.pipelines.size(), 2u);
  EXPECT_EQ(r.plan.pipelines[0].nodeIds, (std::vector<int>{0, 2, 3}));
  EXPECT_EQ(r.plan.pipelines[1].nodeIds, (std::vector<int>{4, 5, 6, 7}));
  checkReconfiguration(set, plan, {1}, r);
  // The faster 4-node pipeline takes more of the batch.
  EXPECT_GT(r.plan.pipelines[1].microbatches, r.plan.pipelines[0].microbatches);
}

TEST(ReconfigurationTest, TakesIdleNodesBeforeBorrowing) {
  TemplateSet set = makeTemplates({2, 4});
  Plan plan = handPlan(set, {{0, 1, 2, 3}, {4, 5, 6, 7}}, {8}, 1, 8);
  Reconfiguration r = reconfigure(set, plan, {0});
  EXPECT_EQ(r.kind, ReconfigurationKind::kUseIdle);
  EXPECT_EQ(r.plan.pipelines[0].nodeIds, (std::vector<int>{1, 2, 3, 8}));
  EXPECT_TRUE(r.plan.idleNodeIds.empty());
  checkReconfiguration(set, plan, {0}, r);
}

TEST(ReconfigurationTest, BorrowsFromTheLargestPipeline) {
  TemplateSet set = makeTemplates({2, 3, 4});
  Plan plan = handPlan(set, {{0, 1, 2}, {3, 4, 5, 6}}, {}, 1, 8);
  Reconfiguration r = reconfigure(set, plan, {0, 2});
  EXPECT_EQ(r.kind, ReconfigurationKind::kBorrow);
  EXPECT_EQ(r.plan.pipelines[0].nodeIds, (std::vector<int>{1, 6}));
  EXPECT_EQ(r.plan.pipelines[1].nodeIds, (std::vector<int>{3, 4, 5}));
  checkReconfiguration(set, plan, {0, 2}, r);
  // Node 6 now runs layers it did not hold, which a surviving replica holds.
  EXPECT_TRUE(copiedFromASurvivor(set, plan, r.plan, {0, 2}, 6, 0));
}

TEST(ReconfigurationTest, MergesWhenBorrowingCannotHelp) {
  TemplateSet set = makeTemplates({2, 3});
  Plan plan = handPlan(set, {{0, 1}, {2, 3}, {4, 5}}, {}, 1, 9);
  Reconfiguration r = reconfigure(set, plan, {0});
  EXPECT_EQ(r.kind, ReconfigurationKind::kMerge);
  ASSERT_EQ(r.plan.pipelines.size(), 2u);
  EXPECT_EQ(r.plan.pipelines[0].nodeIds, (std::vector<int>{2, 3, 1}));
  checkReconfiguration(set, plan, {0}, r);
}

TEST(ReconfigurationTest, ReplansWhenNothingElseWorks) {
  TemplateSet set = makeTemplates({2});
  Plan plan = handPlan(set, {{0, 1}, {2, 3}}, {}, 1, 4);
  Reconfiguration r = reconfigure(set, plan, {0});
  EXPECT_EQ(r.kind, ReconfigurationKind::kReplan);
  ASSERT_EQ(r.plan.pipelines.size(), 1u);  // 3 nodes hold only one 2-node pipeline
  EXPECT_EQ(r.plan.idleNodeIds.size(), 1u);
  EXPECT_EQ(r.plan.faultTolerance, 1);  // still aims for f + 1 when nodes come back
  checkReconfiguration(set, plan, {0}, r);
}

TEST(ReconfigurationTest, ErrorsAndUnchangedPlans) {
  TemplateSet set = makeTemplates({2, 3});
  Plan plan = handPlan(set, {{0, 1}, {2, 3}}, {4}, 1, 4);
  EXPECT_THROW(reconfigure(set, plan, {9}), InvalidArgument);
  try {
    reconfigure(set, plan, {0, 1, 2, 4});
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("n_min = 2"), std::string::npos) << e.what();
  }
  Reconfiguration r = reconfigure(set, plan, {4});  // an idle node
  EXPECT_EQ(r.kind, ReconfigurationKind::kUnchanged);
  EXPECT_TRUE(r.plan.idleNodeIds.empty());
}

TEST(ReconfigurationTest, RandomLossSequencesKeepInvariantsAndAreDeterministic) {
  std::mt19937_64 rng(31);
  int steps = 0;
  for (int iter = 0; iter < 200; ++iter) {
    const int n_min = 1 + static_cast<int>(rng() % 3);
    const int N = n_min * 2 + static_cast<int>(rng() % 8);
    const int f = static_cast<int>(rng() % 2);
    std::vector<int> sizes{n_min};
    for (int n = n_min + 1; n <= N - f * n_min; ++n) {
      if (rng() % 3 != 0) sizes.push_back(n);
    }
    TemplateSet set = makeTemplates(sizes);
    std::vector<int> ids(N);
    std::iota(ids.begin(), ids.end(), 100);
    const int64_t B = 1 + static_cast<int64_t>(rng() % 10);
    Plan plan = makePlan(set, ids, {f, B});
    std::set<int> alive(ids.begin(), ids.end());
    while (true) {
      std::vector<int> live(alive.begin(), alive.end());
      std::vector<int> lost{live[rng() % live.size()]};
      if (rng() % 3 == 0 && live.size() > 1) {
        int other = live[rng() % live.size()];
        if (other != lost[0]) lost.push_back(other);
      }
      for (int id : lost) alive.erase(id);
      if (static_cast<int>(alive.size()) < n_min) {
        EXPECT_THROW(reconfigure(set, plan, lost), InvalidArgument);
        break;
      }
      Reconfiguration r = reconfigure(set, plan, lost);
      Reconfiguration again = reconfigure(set, plan, lost);
      ASSERT_EQ(r.steps, again.steps);
      checkReconfiguration(set, plan, std::set<int>(lost.begin(), lost.end()), r);
      if (::testing::Test::HasFailure()) return;
      plan = r.plan;
      ++steps;
    }
  }
  EXPECT_GT(steps, 300);
}

// A plan of workers with the given layer ranges [first, end) over `layers` layers.
Plan planOf(int layers, const std::vector<std::tuple<int, int, int>>& ranges) {
  Plan p;
  p.numLayers = layers;
  for (const auto& [w, first, end] : ranges) {
    WorkerAssignment a;
    a.worker = w;
    a.firstLayer = first;
    a.endLayer = end;
    p.workers.push_back(a);
  }
  return p;
}

std::map<int, int64_t> sentBytes(const std::vector<LiveLayerCopy>& copies,
                                 const std::vector<int64_t>& bytes) {
  std::map<int, int64_t> sent;
  for (const auto& c : copies) sent[c.from] += bytes[c.layer];
  return sent;
}

TEST(LiveLayerCopiesTest, EveryLayerAWorkerLacksComesOnceInLayerThenReceiverOrder) {
  // Workers 3 and 1 (listed out of order) need layers the live workers 0 and 2 hold; worker 1
  // already holds layer 1 live.
  const Plan next = planOf(4, {{3, 0, 2}, {1, 1, 4}, {0, 0, 2}, {2, 2, 4}});
  const std::vector<std::vector<int>> live = {{0}, {0, 1}, {2}, {2}};
  const std::vector<int64_t> bytes = {10, 10, 10, 10};
  const auto copies = liveLayerCopies(next, live, bytes);
  std::vector<std::tuple<int, int, int>> got;
  for (const auto& c : copies) got.emplace_back(c.layer, c.to, c.from);
  // Layer 1 has two live holders, workers 0 and 1; worker 1 receives 20 bytes here and worker 0
  // has sent 10 by then, so worker 0 sends it. The rest come from their only live holders.
  const std::vector<std::tuple<int, int, int>> want = {{0, 3, 0}, {1, 3, 0}, {2, 1, 2}, {3, 1, 2}};
  EXPECT_EQ(got, want);
}

TEST(LiveLayerCopiesTest, SpreadsTheSendsOverTheLiveHolders) {
  // Workers 0 and 1 both hold all 4 layers live; workers 2 and 3 need all of them. With the
  // lowest live id as every copy's source, worker 0 sent all 8 copies and worker 1 none.
  const Plan next = planOf(4, {{0, 0, 4}, {1, 0, 4}, {2, 0, 4}, {3, 0, 4}});
  const std::vector<std::vector<int>> live(4, std::vector<int>{0, 1});
  const std::vector<int64_t> bytes = {100, 300, 300, 100};
  const auto copies = liveLayerCopies(next, live, bytes);
  ASSERT_EQ(copies.size(), 8u);
  auto sent = sentBytes(copies, bytes);
  EXPECT_EQ(sent[0], 800);
  EXPECT_EQ(sent[1], 800);
  for (const auto& c : copies) {
    EXPECT_TRUE(c.to == 2 || c.to == 3);
    EXPECT_TRUE(c.from == 0 || c.from == 1);
  }
}

TEST(LiveLayerCopiesTest, AHolderThatAlsoReceivesSendsLast) {
  // Worker 0 holds layers 0-1 live but now receives layers 2-3; worker 1 holds 0-1 live and
  // receives nothing: worker 4's layers 0-1 come from worker 1.
  const Plan next = planOf(4, {{0, 0, 4}, {1, 0, 2}, {4, 0, 2}, {5, 2, 4}});
  const std::vector<std::vector<int>> live = {{0, 1}, {0, 1}, {5}, {5}};
  const std::vector<int64_t> bytes = {10, 10, 10, 10};
  const auto copies = liveLayerCopies(next, live, bytes);
  ASSERT_EQ(copies.size(), 4u);
  for (const auto& c : copies) {
    if (c.to == 4) {
      EXPECT_EQ(c.from, 1) << "layer " << c.layer;
    } else {
      EXPECT_EQ(c.to, 0);
      EXPECT_EQ(c.from, 5) << "layer " << c.layer;
    }
  }
}

TEST(LiveLayerCopiesTest, LayersWithoutALiveHolderGetNoCopyAndSizesMustMatch) {
  const Plan next = planOf(3, {{0, 0, 3}});
  const auto copies = liveLayerCopies(next, {{}, {1}, {}}, {1, 1, 1});
  ASSERT_EQ(copies.size(), 1u);
  EXPECT_EQ(copies[0].layer, 1);
  EXPECT_EQ(copies[0].from, 1);
  EXPECT_EQ(copies[0].to, 0);
  EXPECT_THROW(liveLayerCopies(next, {{}, {1}}, {1, 1, 1}), InvalidArgument);
  EXPECT_THROW(liveLayerCopies(next, {{}, {1}, {}}, {1}), InvalidArgument);
}

}  // namespace
}  // namespace pipeline
}  // namespace sinew
