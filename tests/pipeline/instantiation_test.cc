#include "sinew/pipeline/instantiation.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <tuple>

#include "brute_force.h"
#include "sinew/base/error.h"

namespace sinew {
namespace pipeline {
namespace {

using testing::bruteSplitMakespan;
using testing::kNone;

// A template set with random costs for random node counts in [n_min, n_max] (with gaps, as
// memory can leave). Larger pipelines tend to be faster but not always.
TemplateSet randomTemplates(std::mt19937_64& rng, int n_min, int n_max) {
  TemplateSet set;
  set.devices_per_node = 1;
  set.num_layers = n_max;
  set.min_nodes = n_min;
  set.max_nodes = n_max;
  for (int n = n_min; n <= n_max; ++n) {
    if (n != n_min && rng() % 4 == 0) continue;  // a gap
    PipelineTemplate t;
    t.nodes = n;
    t.stage_devices = 1;
    t.fill_ticks = 100 + static_cast<int64_t>(rng() % 200);
    t.bottleneck_ticks = static_cast<int64_t>(rng() % 60) / n;  // may be 0
    for (int s = 0; s < n; ++s) {
      StageAssignment a;
      a.first_layer = s;
      a.end_layer = s + 1;
      a.node = s;
      a.devices = 1;
      t.stages.push_back(a);
    }
    set.templates.push_back(t);
  }
  return set;
}

TEST(SplitBatchTest, EqualsBruteForceAndSumsExactly) {
  std::mt19937_64 rng(11);
  for (int iter = 0; iter < 3000; ++iter) {
    TemplateSet set = randomTemplates(rng, 1, 4);
    const int P = 1 + static_cast<int>(rng() % 4);
    const int64_t B = 1 + static_cast<int64_t>(rng() % 12);
    std::vector<int> sizes;
    std::vector<const PipelineTemplate*> pipes;
    for (int p = 0; p < P; ++p) {
      const PipelineTemplate& t = set.templates[rng() % set.templates.size()];
      sizes.push_back(t.nodes);
      pipes.push_back(&t);
    }
    BatchSplit split = splitBatch(set, sizes, B);
    ASSERT_EQ(split.microbatches.size(), sizes.size());
    EXPECT_EQ(std::accumulate(split.microbatches.begin(), split.microbatches.end(), int64_t{0}), B);
    int64_t z = 0;
    for (int p = 0; p < P; ++p) {
      EXPECT_GE(split.microbatches[p], 0);
      z = std::max(z, pipes[p]->iterationTicks(split.microbatches[p]));
    }
    EXPECT_EQ(split.iteration_ticks, z);
    EXPECT_EQ(split.iteration_ticks, bruteSplitMakespan(pipes, B));
  }
}

TEST(SplitBatchTest, LargeBatchIsExactAndFast) {
  std::mt19937_64 rng(5);
  TemplateSet set = randomTemplates(rng, 1, 64);
  std::vector<int> sizes;
  for (const PipelineTemplate& t : set.templates) sizes.push_back(t.nodes);
  const int64_t B = 1000003;
  BatchSplit split = splitBatch(set, sizes, B);
  EXPECT_EQ(std::accumulate(split.microbatches.begin(), split.microbatches.end(), int64_t{0}), B);
  // Optimality: no pipeline could take one more microbatch and finish strictly earlier than
  // the makespan, i.e. moving one microbatch off a slowest pipeline never helps.
  for (size_t p = 0; p < sizes.size(); ++p) {
    const PipelineTemplate& t = *set.find(sizes[p]);
    if (t.iterationTicks(split.microbatches[p]) != split.iteration_ticks) continue;
    if (split.microbatches[p] == 0) continue;
    for (size_t q = 0; q < sizes.size(); ++q) {
      if (q == p) continue;
      EXPECT_GE(set.find(sizes[q])->iterationTicks(split.microbatches[q] + 1),
                split.iteration_ticks);
    }
  }
}

TEST(SplitBatchTest, RejectsBadArguments) {
  std::mt19937_64 rng(1);
  TemplateSet set = randomTemplates(rng, 2, 2);
  EXPECT_THROW(splitBatch(set, {2}, 0), InvalidArgument);
  EXPECT_THROW(splitBatch(set, {}, 4), InvalidArgument);
  try {
    splitBatch(set, {2, 3}, 4);
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("no pipeline template for 3 nodes"), std::string::npos)
        << e.what();
  }
}

// Brute force: every multiset of template sizes covering the most nodes <= N with >= f + 1
// pipelines, every integer split of B.
int64_t bruteInstantiate(const TemplateSet& set, int N, int f, int64_t B, int* used_out) {
  std::vector<std::vector<const PipelineTemplate*>> choices[64];
  std::vector<const PipelineTemplate*> cur;
  std::function<void(size_t, int)> rec = [&](size_t from, int used) {
    if (static_cast<int>(cur.size()) >= f + 1) choices[used].push_back(cur);
    for (size_t i = from; i < set.templates.size(); ++i) {
      if (used + set.templates[i].nodes > N) continue;
      cur.push_back(&set.templates[i]);
      rec(i, used + set.templates[i].nodes);
      cur.pop_back();
    }
  };
  rec(0, 0);
  for (int used = N; used >= 1; --used) {
    if (choices[used].empty()) continue;
    int64_t best = kNone;
    for (const auto& c : choices[used]) best = std::min(best, bruteSplitMakespan(c, B));
    *used_out = used;
    return best;
  }
  *used_out = 0;
  return kNone;
}

TEST(InstantiateTest, EqualsBruteForce) {
  std::mt19937_64 rng(23);
  int with_idle = 0;
  for (int iter = 0; iter < 1500; ++iter) {
    const int n_min = 1 + static_cast<int>(rng() % 3);
    const int N = n_min + static_cast<int>(rng() % 7);
    const int f = static_cast<int>(rng() % 3);
    const int64_t B = 1 + static_cast<int64_t>(rng() % 9);
    TemplateSet set = randomTemplates(rng, n_min, std::max(n_min, N - f * n_min));
    if ((f + 1) * n_min > N) {
      EXPECT_THROW(instantiate(set, N, {f, B}), InvalidArgument);
      continue;
    }
    int used = 0;
    int64_t brute = bruteInstantiate(set, N, f, B, &used);
    ASSERT_NE(brute, kNone);
    Instantiation inst = instantiate(set, N, {f, B});
    EXPECT_EQ(inst.iteration_ticks, brute) << "iter " << iter;
    EXPECT_EQ(inst.idle_nodes, N - used);
    with_idle += inst.idle_nodes > 0;
    EXPECT_GE(static_cast<int>(inst.pipelines.size()), f + 1);
    int nodes = 0;
    int64_t mb = 0, z = 0;
    for (size_t p = 0; p < inst.pipelines.size(); ++p) {
      const PipelineInstance& pi = inst.pipelines[p];
      if (p > 0) {
        EXPECT_LE(pi.nodes, inst.pipelines[p - 1].nodes);  // largest first
      }
      ASSERT_NE(set.find(pi.nodes), nullptr);
      EXPECT_EQ(pi.iteration_ticks, set.find(pi.nodes)->iterationTicks(pi.microbatches));
      nodes += pi.nodes;
      mb += pi.microbatches;
      z = std::max(z, pi.iteration_ticks);
    }
    EXPECT_EQ(nodes, used);
    EXPECT_EQ(mb, B);
    EXPECT_EQ(z, inst.iteration_ticks);
  }
  EXPECT_GT(with_idle, 0);  // gaps in template sizes really leave nodes idle sometimes
}

TEST(InstantiateTest, MakePlanAssignsNodesAndWorkers) {
  std::mt19937_64 rng(8);
  TemplateSet set = randomTemplates(rng, 2, 6);
  Plan plan = makePlan(set, {10, 11, 12, 13, 14, 15, 16, 17}, {1, 16});
  std::set<int> seen;
  for (const PipelinePlan& p : plan.pipelines) {
    EXPECT_EQ(static_cast<int>(p.nodeIds.size()), p.nodes);
    for (int id : p.nodeIds) EXPECT_TRUE(seen.insert(id).second);
  }
  for (int id : plan.idleNodeIds) EXPECT_TRUE(seen.insert(id).second);
  EXPECT_EQ(seen.size(), 8u);
  std::vector<WorkerAssignment> workers = workerAssignments(set, plan);
  EXPECT_EQ(workers.size(), 8u - plan.idleNodeIds.size());
  // The plan carries the per-worker view too: every stage of pipeline p runs the same
  // microbatches, and the pipelines together run each of the B microbatches once.
  EXPECT_EQ(plan.numLayers, set.num_layers);
  EXPECT_EQ(plan.microbatchesPerStep, 16);
  ASSERT_EQ(plan.workers.size(), workers.size());
  std::vector<int> runs(16, 0);
  std::set<int> counted;
  for (const WorkerAssignment& w : plan.workers) {
    EXPECT_EQ(w.worker, -1);
    const PipelinePlan& p = plan.pipelines[w.pipeline];
    EXPECT_NE(std::find(p.nodeIds.begin(), p.nodeIds.end(), w.node), p.nodeIds.end());
    EXPECT_EQ(static_cast<int64_t>(w.microbatches.size()), p.microbatches);
    if (counted.insert(w.pipeline).second) {
      for (int64_t m : w.microbatches) runs[m]++;
    }
  }
  EXPECT_EQ(runs, std::vector<int>(16, 1));
  EXPECT_THROW(makePlan(set, {1, 2, 2, 3}, {0, 4}), InvalidArgument);
  EXPECT_THROW(makePlan(set, {1, -2, 3}, {0, 4}), InvalidArgument);
}

TEST(InstantiateTest, RejectsTooMuchFaultTolerance) {
  std::mt19937_64 rng(2);
  TemplateSet set = randomTemplates(rng, 3, 5);
  try {
    instantiate(set, 8, {2, 8});
    FAIL() << "expected InvalidArgument";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("fault_tolerance=2"), std::string::npos) << e.what();
  }
  EXPECT_THROW(instantiate(set, 8, {0, 0}), InvalidArgument);
  EXPECT_THROW(instantiate(set, 0, {0, 1}), InvalidArgument);
}

TEST(PlanTest, DataParallelGivesEveryMemberEveryLayerAndAShareOfTheBatch) {
  Plan plan = Plan::dataParallel(3, {9, 4, 2}, 5, 8);
  EXPECT_EQ(plan.epoch, 3);
  ASSERT_EQ(plan.workers.size(), 3u);
  ASSERT_EQ(plan.pipelines.size(), 3u);
  std::vector<int64_t> all;
  int pipeline = 0;
  for (int worker : {2, 4, 9}) {  // ascending ids
    const WorkerAssignment& w = plan.of(worker);
    EXPECT_EQ(w.worker, worker);
    EXPECT_EQ(w.node, worker);
    EXPECT_EQ(w.pipeline, pipeline);
    EXPECT_EQ(plan.pipelines[pipeline].nodeIds, std::vector<int>{worker});
    EXPECT_EQ(plan.pipelines[pipeline].microbatches, static_cast<int64_t>(w.microbatches.size()));
    EXPECT_EQ(w.firstLayer, 0);
    EXPECT_EQ(w.endLayer, 5);
    all.insert(all.end(), w.microbatches.begin(), w.microbatches.end());
    pipeline++;
  }
  EXPECT_EQ(all, (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(plan.of(9).microbatches.size(), 3u);
  EXPECT_THROW(plan.of(7), InvalidArgument);
}

TEST(PlanTest, JsonRoundTripsAndNamesTheBadField) {
  std::mt19937_64 rng(8);
  TemplateSet set = randomTemplates(rng, 2, 6);
  Plan plan = makePlan(set, {10, 11, 12, 13, 14, 15, 16, 17}, {1, 16});
  plan.epoch = 3;
  for (size_t i = 0; i < plan.workers.size(); ++i) plan.workers[i].worker = 100 + int(i);
  Plan back = planFromJson(planToJson(plan));
  EXPECT_EQ(back.epoch, 3);
  EXPECT_EQ(back.numLayers, plan.numLayers);
  EXPECT_EQ(back.microbatchesPerStep, 16);
  EXPECT_EQ(back.idleNodeIds, plan.idleNodeIds);
  ASSERT_EQ(back.pipelines.size(), plan.pipelines.size());
  for (size_t p = 0; p < plan.pipelines.size(); ++p) {
    EXPECT_EQ(back.pipelines[p].nodeIds, plan.pipelines[p].nodeIds);
    EXPECT_EQ(back.pipelines[p].microbatches, plan.pipelines[p].microbatches);
  }
  ASSERT_EQ(back.workers.size(), plan.workers.size());
  for (size_t i = 0; i < plan.workers.size(); ++i) {
    const WorkerAssignment& a = plan.workers[i];
    const WorkerAssignment& b = back.workers[i];
    EXPECT_EQ(std::make_tuple(a.worker, a.node, a.device, a.pipeline, a.stage, a.firstLayer,
                              a.endLayer, a.microbatches),
              std::make_tuple(b.worker, b.node, b.device, b.pipeline, b.stage, b.firstLayer,
                              b.endLayer, b.microbatches));
  }
  EXPECT_EQ(planToJson(back), planToJson(plan));
  auto expectCorrupt = [](const std::string& text, const std::string& field) {
    try {
      planFromJson(text);
      ADD_FAILURE() << "accepted " << text;
    } catch (const Corruption& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  std::string good = planToJson(plan);
  expectCorrupt("[1, 2]", "not a JSON object");
  expectCorrupt(good.substr(0, good.size() / 2), "not a JSON object");
  auto edit = [&](const std::string& from, const std::string& to) {
    std::string t = good;
    size_t at = t.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return t.replace(at, from.size(), to);
  };
  expectCorrupt(edit("\"microbatches\":16", "\"microbatches\":17"), "pipelines run 16");
  expectCorrupt(edit("\"num_layers\":", "\"num_layerz\":"), "num_layers is missing");
  expectCorrupt(edit("\"epoch\":3", "\"epoch\":\"3\""), "epoch is not an integer");
  expectCorrupt(edit("\"workers\":[[", "\"workers\":[[1,2],["), "workers[0] is not");
  // A worker listed twice would be given two assignments, and Plan::find one of them.
  expectCorrupt(edit("[101,", "[100,"), "workers[1] lists worker 100 again");
}

}  // namespace
}  // namespace pipeline
}  // namespace sinew
