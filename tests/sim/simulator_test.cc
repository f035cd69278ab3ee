// The failure-trace simulator (sinew/sim/simulator.h, docs/goodput.md): each rule on a small
// trace whose outcome is computed by hand here, the reference models against hand
// computations, the Poisson traces, and the sinew-sim tool.

#include <sys/wait.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "../tool_support.h"
#include "sinew/error.h"
#include "sinew/pipeline/instantiation.h"
#include "sinew/pipeline/template_planner.h"
#include "sinew/sim/simulator.h"

namespace sinew {
namespace sim {
namespace {

constexpr double kEps = 1e-9;

double secondsOf(const SimResult& r, Cause c) { return r.total.seconds_of(c); }

// Every second of the run is accounted for once.
void expectAccountsForTheWallTime(const SimResult& r) {
  double sum = 0;
  for (double s : r.total.seconds) sum += s;
  EXPECT_NEAR(sum, r.wall_s, 1e-6) << r.model;
  double buckets = 0, samples = 0;
  for (const Bucket& b : r.timeline) {
    for (double s : b.account.seconds) buckets += s;
    samples += b.account.samples;
  }
  EXPECT_NEAR(buckets, r.wall_s, 1e-6) << r.model;
  EXPECT_NEAR(samples, r.total.samples, 1e-6) << r.model;
}

std::vector<TraceEvent> trace(const std::string& text) { return parseTrace(text, "test"); }

ThroughputTable table(std::map<int, double> t) {
  ThroughputTable x;
  x.samples_per_s = std::move(t);
  return x;
}

TEST(TraceTest, BadLinesAreRefusedNamingTheLine) {
  auto refusal = [](const std::string& text) {
    try {
      parseTrace(text, "t.csv");
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(refusal("0,add,n1\n5,add\n").find("t.csv line 2: expected time_ms,add|remove,node"),
            std::string::npos);
  EXPECT_NE(refusal("0,add,n1\n5,lose,n1\n").find("line 2: the event must be add or remove"),
            std::string::npos);
  EXPECT_NE(refusal("10,add,n1\n5,add,n2\n").find("line 2: time 5 ms is before the previous 10"),
            std::string::npos);
  EXPECT_NE(refusal("0,add,n1\n0,add,n1\n").find("line 2: node n1 is added but is already there"),
            std::string::npos);
  EXPECT_NE(refusal("0,add,n1\n3,remove,n2\n").find("line 2: node n2 is removed but is not there"),
            std::string::npos);
  EXPECT_NE(refusal("-1,add,n1\n").find("line 1"), std::string::npos);
  EXPECT_NE(refusal("x,add,n1\n").find("line 1"), std::string::npos);
  EXPECT_NE(refusal("# only a comment\n").find("no events"), std::string::npos);
  const auto t = trace("# comment\n0,add,a\r\n\n1500,remove,a\n");
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(t[1].time_ms, 1500);
  EXPECT_FALSE(t[1].add);
  EXPECT_EQ(t[0].node, "a");
}

TEST(TraceTest, PoissonTracesAreSeededAndHaveTheirRate) {
  PoissonTraceOptions o;
  o.nodes = 200;
  o.mtbf_s = 10 * 3600;
  o.duration_s = 10 * 3600;
  const auto a = poissonTrace(o);
  EXPECT_EQ(a.size(), poissonTrace(o).size());
  int removes = 0;
  for (const auto& e : a) removes += e.add ? 0 : 1;
  // Each node fails before the end with probability 1 - e^-1: 126 of 200 expected (sd 6.8).
  EXPECT_GT(removes, 100);
  EXPECT_LT(removes, 152);
  o.seed = 2;
  const auto b = poissonTrace(o);
  bool differs = a.size() != b.size();
  for (size_t i = 0; !differs && i < a.size(); ++i) differs = a[i].time_ms != b[i].time_ms;
  EXPECT_TRUE(differs) << "another seed gave the same trace";
  // Nodes that come back: each remove is followed by its node's add return_after_s later.
  o.return_after_s = 600;
  const auto c = poissonTrace(o);
  std::map<std::string, int64_t> downAt;
  int returns = 0;
  for (const auto& e : c) {
    if (!e.add) {
      downAt[e.node] = e.time_ms;
    } else if (downAt.count(e.node)) {
      EXPECT_NEAR(static_cast<double>(e.time_ms - downAt[e.node]), 600e3, 2.0) << e.node;
      ++returns;
    }
  }
  EXPECT_GT(returns, 100);
  EXPECT_NO_THROW(parseTrace(
      [&] {
        std::string text;
        for (const auto& e : c) {
          text += std::to_string(e.time_ms) + (e.add ? ",add," : ",remove,") + e.node + "\n";
        }
        return text;
      }(),
      "poisson"));
}

// Two nodes at 20 samples/s (steps of 0.5 s), one at 10 (1 s); 1 s per lost node.
//   0-2.25   4 steps (40 samples), the step in flight (0.25 s) lost at n2's loss
//   2.25-3.25 reconfiguration; n3's add at 3 waits for the next loss
//   3.25-5.5 2 steps on n1 (20 samples), 0.25 s lost at n1's loss
//   5.5-6.5  reconfiguration, n3 taken in
//   6.5-8    1 step (10 samples) and half of one (5 samples) at the end
TEST(FixedCostModelTest, MatchesAHandComputation) {
  FixedCostModel m;
  m.table = table({{1, 10.0}, {2, 20.0}});
  m.reconfiguration_s = 1.0;
  m.global_batch = 10;
  SimOptions o;
  o.duration_s = 8;
  o.bucket_s = 2;
  const SimResult r = simulateFixedCost(
      trace("0,add,n1\n0,add,n2\n2250,remove,n2\n3000,add,n3\n5500,remove,n1\n"), m, o);
  expectAccountsForTheWallTime(r);
  EXPECT_NEAR(r.total.samples, 75, kEps);
  EXPECT_NEAR(secondsOf(r, Cause::kTraining), 5.5, kEps);
  EXPECT_NEAR(secondsOf(r, Cause::kRedone), 0.5, kEps);
  EXPECT_NEAR(secondsOf(r, Cause::kReconfiguration), 2.0, kEps);
  EXPECT_EQ(r.losses, 2);
  EXPECT_EQ(r.joins, 1);
  // Ideal: 2 nodes for 2.25 + 2.5 s, 1 node for 0.75 + 2.5 s.
  EXPECT_NEAR(r.ideal_samples, 20 * 4.75 + 10 * 3.25, kEps);
  EXPECT_NEAR(r.goodput(), 75.0 / 8, kEps);
  ASSERT_EQ(r.timeline.size(), 4u);
  EXPECT_NEAR(r.timeline[0].account.samples, 40, kEps);  // 4 steps in [0, 2)
  EXPECT_NEAR(r.timeline[1].account.seconds_of(Cause::kReconfiguration), 1.0, kEps);  // 2.25-3.25
}

// One node in use at 10 samples/s (1 s steps; the second node idles), a checkpoint every 3
// steps for 0.5 s, 2 s per restart:
//   0-3 3 steps; 3-3.5 checkpoint; 3.5-4.5 step 4; 4.5-5.2 in flight when n1 is lost
//   5.2: step 4 (1 s) is lost back to the checkpoint; 5.2-7.2 restart on n2
//   7.2-9.2 2 steps; 9.2-10 0.8 of a step
TEST(RestartModelTest, MatchesAHandComputation) {
  RestartModel m;
  m.table = table({{1, 10.0}});
  m.checkpoint_every = 3;
  m.checkpoint_s = 0.5;
  m.restart_s = 2;
  m.global_batch = 10;
  SimOptions o;
  o.duration_s = 10;
  const SimResult r = simulateRestart(trace("0,add,n1\n0,add,n2\n5200,remove,n1\n"), m, o);
  expectAccountsForTheWallTime(r);
  EXPECT_NEAR(r.total.samples, 58, 1e-6);
  EXPECT_NEAR(secondsOf(r, Cause::kTraining), 5.8, 1e-9);
  EXPECT_NEAR(secondsOf(r, Cause::kCheckpoint), 0.5, 1e-9);
  EXPECT_NEAR(secondsOf(r, Cause::kRedone), 0.7, 1e-9);
  EXPECT_NEAR(secondsOf(r, Cause::kRestart), 3.0, 1e-9);
  EXPECT_EQ(r.restarts, 1);
  // A loss during the restart restarts it again: at 6 s, 0.8 s into it.
  const SimResult again = simulateRestart(
      trace("0,add,n1\n0,add,n2\n0,add,n3\n5200,remove,n1\n6000,remove,n2\n"), m, o);
  expectAccountsForTheWallTime(again);
  EXPECT_EQ(again.restarts, 2);
  EXPECT_NEAR(secondsOf(again, Cause::kRestart), 1.0 + 0.8 + 2.0, 1e-9);
}

// Four layers of 300 MB (parameters and optimizer state) on nodes of one device that hold two:
// the smallest template has 2 nodes, and 4 nodes run 2 pipelines of 2 (f = 1). 12 samples per
// step; the measured table gives 0.5 s steps on 4 nodes and 1 s on 2 or 3.
SinewJobModel smallJob() {
  SinewJobModel job;
  job.profile.microbatch_size = 1;
  job.profile.job.devices_per_node = 1;
  job.profile.job.device_memory_bytes = 700'000'000;
  job.profile.job.inter_stage_gbps = 100;
  for (int l = 0; l < 4; ++l) {
    pipeline::LayerCost c;
    c.name = "layer" + std::to_string(l);
    c.forward_ns = 1'000'000;
    c.backward_ns = 2'000'000;
    c.param_bytes = 100'000'000;
    c.optimizer_bytes = 200'000'000;
    c.activation_bytes = 1'000'000;
    c.output_bytes = 1'000'000;
    job.profile.layers.push_back(c);
  }
  job.fault_tolerance = 1;
  job.global_microbatches = 12;
  job.table = table({{2, 12.0}, {4, 24.0}});
  job.costs.detection_s = 0.05;
  job.costs.epoch_s = 0.25;
  // 1 GB/s: 0.2 s per layer sent or received (a copy moves its 100 MB of parameters and 100 MB
  // of momentum; optimizer_bytes also counts the gradient, which a copy does not move).
  job.costs.copy_gbps = 8;
  job.costs.ram_restore_s = 0.3;
  job.costs.disk_restore_s = 5;
  job.costs.restart_s = 2;
  job.costs.peer_every = 1;
  job.costs.durable_every = 5;
  job.costs.replication = 2;
  return job;
}

// The plan of 4 nodes, as the simulator makes it when node1..node4 start (it numbers them 0..3
// and plans them as the planner does).
pipeline::Plan fourNodePlan(const SinewJobModel& job) {
  pipeline::TemplateOptions to;
  to.nodes = 4;
  to.fault_tolerance = 1;
  to.global_microbatches = 12;
  const auto templates = pipeline::planTemplates(job.profile, to);
  pipeline::PlanOptions po;
  po.fault_tolerance = 1;
  po.global_microbatches = 12;
  return pipeline::makePlan(templates, {0, 1, 2, 3}, po);
}

// The trace names of the nodes holding layer 0 when 4 nodes start.
std::vector<std::string> layerZeroHolders(const SinewJobModel& job) {
  const pipeline::Plan plan = fourNodePlan(job);
  EXPECT_EQ(plan.pipelines.size(), 2u);
  std::vector<std::string> names;
  for (const auto& w : plan.workers) {
    if (w.firstLayer == 0) names.push_back("node" + std::to_string(w.node + 1));
  }
  return names;
}

const char* kFourNodes = "0,add,node1\n0,add,node2\n0,add,node3\n0,add,node4\n";

// Both holders of layer 0 are lost at 10.25 s, after 20 steps of 0.5 s. The peer-RAM version
// after step 18 (19 steps; that of step 19 was still replicating) has each shard on two nodes
// of a group, one of which lives: the job rolls back one step (0.5 s) and restores from RAM
// (0.3 s), besides detection (0.05) and the epoch (0.25); the two survivors run one pipeline,
// at 1 s per step, from 10.85 s: 9 steps and 0.15 of one by 20 s.
TEST(SinewModelTest, LosingEveryHolderOfALayerRollsBackToPeerRam) {
  SinewJobModel job = smallJob();
  const auto holders = layerZeroHolders(job);
  ASSERT_EQ(holders.size(), 2u);
  const std::string losses = "10250,remove," + holders[0] + "\n10250,remove," + holders[1] + "\n";
  SimOptions o;
  o.duration_s = 20;
  const SimResult r = simulateSinew(trace(kFourNodes + losses), job, o);
  expectAccountsForTheWallTime(r);
  EXPECT_EQ(r.losses, 2);
  EXPECT_EQ(r.rollbacks, 1);
  EXPECT_EQ(r.restarts, 0);
  EXPECT_NEAR(secondsOf(r, Cause::kRedone), 0.25, 1e-9);
  EXPECT_NEAR(secondsOf(r, Cause::kDetection), 0.05, 1e-9);
  EXPECT_NEAR(secondsOf(r, Cause::kReconfiguration), 0.25, 1e-9);
  EXPECT_NEAR(secondsOf(r, Cause::kRollback), 0.5 + 0.3, 1e-9);
  EXPECT_NEAR(r.total.samples, (19 + 9 + 0.15) * 12, 1e-6);
  EXPECT_NEAR(r.ideal_samples, 24 * 10.25 + 12 * 9.75, 1e-6);

  // With each shard in its own node's RAM only (m = 1), both lost shards are gone: the job
  // restores the durable version of 15 steps (5 steps undone) from disk (5 s).
  job.costs.replication = 1;
  const SimResult disk = simulateSinew(trace(kFourNodes + losses), job, o);
  expectAccountsForTheWallTime(disk);
  EXPECT_EQ(disk.rollbacks, 0);
  EXPECT_EQ(disk.restarts, 1);
  EXPECT_NEAR(secondsOf(disk, Cause::kRestart), 5 * 0.5 + 5.0, 1e-9);
  EXPECT_NEAR(secondsOf(disk, Cause::kRollback), 0, 1e-9);
}

// The trace names of the nodes of the 4-node plan, by pipeline then stage.
std::vector<std::vector<std::string>> nodesByPipeline(const SinewJobModel& job) {
  const pipeline::Plan plan = fourNodePlan(job);
  std::vector<std::vector<std::string>> names;
  for (const auto& p : plan.pipelines) {
    names.emplace_back();
    for (int n : p.nodeIds) names.back().push_back("node" + std::to_string(n + 1));
  }
  return names;
}

// At 10.25 s the job loses the whole of one pipeline (both nodes of a placement group, so
// both replicas of each of their shards) and the first stage of the other; node5, added at
// 10.2 s, makes up the two nodes the model needs. The first stage's layers have no live copy,
// but the peer-RAM version still has them: the lost first stage of the other pipeline held
// the same layers, and its shard's replica lives on in its group's survivor. The job rolls
// back to that version (as the runtime does: a version is restorable when every layer is in
// some live replica, runtime/peer_versions.cc), it does not restore from disk. Before, the
// model asked that every node's shard survive, and counted restores from disk where the real
// job rolled back (scripts/churn on the P3 trace: 50 restores from disk, against 4 rollbacks).
TEST(SinewModelTest, ARollbackNeedsEveryLayerNotEveryShard) {
  SinewJobModel job = smallJob();
  const auto pipes = nodesByPipeline(job);
  ASSERT_EQ(pipes.size(), 2u);
  ASSERT_EQ(pipes[0].size(), 2u);
  ASSERT_EQ(pipes[1].size(), 2u);
  const std::string events = "10200,add,node5\n10250,remove," + pipes[0][0] + "\n10250,remove," +
                             pipes[0][1] + "\n10250,remove," + pipes[1][0] + "\n";
  SimOptions o;
  o.duration_s = 20;
  const SimResult r = simulateSinew(trace(kFourNodes + events), job, o);
  expectAccountsForTheWallTime(r);
  EXPECT_EQ(r.losses, 3);
  EXPECT_EQ(r.rollbacks, 1);
  EXPECT_EQ(r.restarts, 0);
  // One step undone (the version after step 18 holds 19 steps of the 20), restored from RAM.
  EXPECT_NEAR(secondsOf(r, Cause::kRollback), 0.5 + 0.3, 1e-9);
  EXPECT_NEAR(secondsOf(r, Cause::kRestart), 0, 1e-9);
  // The survivor and node5 run one pipeline, 1 s a step, from 10.85 s: 9.15 steps by 20 s.
  EXPECT_NEAR(r.total.samples, (19 + 9.15) * 12, 1e-6);
}

// Three of four nodes lost at once: one node cannot hold the model, so the job ends, losing
// the 5 steps committed since the newest durable version (15 of its 20 steps), and waits,
// idle, until a node is added at 15 s; then it restarts from disk (2 s) on two nodes.
TEST(SinewModelTest, ALossBelowTheSmallestTemplateIdlesThenRestartsFromDisk) {
  SinewJobModel job = smallJob();
  SimOptions o;
  o.duration_s = 25;
  const SimResult r =
      simulateSinew(trace(std::string(kFourNodes) + "10250,remove,node1\n10250,remove,node2\n"
                                                    "10250,remove,node3\n15000,add,node5\n"),
                    job, o);
  expectAccountsForTheWallTime(r);
  EXPECT_EQ(r.restarts, 1);
  EXPECT_NEAR(secondsOf(r, Cause::kIdle), 15 - 10.25, 1e-9);
  EXPECT_NEAR(secondsOf(r, Cause::kRestart), 5 * 0.5 + 2.0, 1e-9);
  EXPECT_NEAR(secondsOf(r, Cause::kRedone), 0.25, 1e-9);
  // 15 steps kept, then 8 steps of 1 s from 17 s.
  EXPECT_NEAR(r.total.samples, (15 + 8) * 12, 1e-6);
}

// Two nodes join at 10.2 s; three of the four that train are lost at 10.25 s, and the
// recovery plans the survivor with the two joiners; the survivor is lost at 10.4 s, during
// that recovery. The joiners are still there: the job recovers on them (its layers from disk:
// every node that trained is gone), it does not end and restart. Before, the joiners the
// interrupted recovery had taken were counted nowhere, and the job ended (a restart, here
// made to cost 100 s).
TEST(SinewModelTest, ALossDuringARecoveryKeepsTheJoinersItHadTaken) {
  SinewJobModel job = smallJob();
  job.costs.restart_s = 100;
  SimOptions o;
  o.duration_s = 40;
  o.bucket_s = 5;
  const SimResult r = simulateSinew(
      trace(std::string(kFourNodes) +
            "10200,add,node5\n10200,add,node6\n10250,remove,node1\n10250,remove,node2\n"
            "10250,remove,node3\n10400,remove,node4\n"),
      job, o);
  expectAccountsForTheWallTime(r);
  EXPECT_EQ(r.losses, 4);
  EXPECT_LT(secondsOf(r, Cause::kRestart), 50) << "the job ended and restarted";
  EXPECT_NEAR(secondsOf(r, Cause::kIdle), 0, 1e-9);
  const Bucket& last = r.timeline.back();
  EXPECT_NEAR(last.account.samples / (last.end_s - last.start_s), 12, 1e-6)
      << "not training on the two joiners at the end";
}

// One node lost at 10.25 s (its pipeline's layers live on in the other): the survivors
// reconfigure with layer copies; a node added at 10.3 s, during that reconfiguration, is
// taken in at its end, with a second epoch and its copies, and the job trains on four nodes
// (0.5 s steps) again.
TEST(SinewModelTest, AJoinDuringAReconfigurationIsTakenAtItsEnd) {
  SinewJobModel job = smallJob();
  SimOptions o;
  o.duration_s = 30;
  o.bucket_s = 5;
  const SimResult r = simulateSinew(
      trace(std::string(kFourNodes) + "10250,remove,node2\n10300,add,node5\n"), job, o);
  expectAccountsForTheWallTime(r);
  EXPECT_EQ(r.losses, 1);
  EXPECT_EQ(r.joins, 1);
  EXPECT_EQ(r.rollbacks, 0);
  EXPECT_EQ(r.restarts, 0);
  // Two epochs, each with copies of at least one layer (200 MB, 0.2 s each way).
  EXPECT_GT(secondsOf(r, Cause::kReconfiguration), 2 * (0.25 + 0.2) - 1e-9);
  EXPECT_LT(secondsOf(r, Cause::kReconfiguration), 5);
  const Bucket& last = r.timeline.back();
  EXPECT_NEAR(last.account.samples / (last.end_s - last.start_s), 24, 1e-6)
      << "not back at four nodes' throughput";
  // A join while training waits for the step in flight: added at 20.1 s, taken at 20.5 s.
  const SimResult late = simulateSinew(
      trace(std::string(kFourNodes) + "10250,remove,node2\n20100,add,node5\n"), job, o);
  expectAccountsForTheWallTime(late);
  EXPECT_EQ(late.joins, 1);
  EXPECT_NEAR(secondsOf(late, Cause::kRedone), 0.25, 1e-9) << "the join lost work";
}

// The same trace with no losses gives the ideal, in all three models.
TEST(SinewModelTest, WithoutLossesEveryModelIsIdeal) {
  SinewJobModel job = smallJob();
  SimOptions o;
  o.duration_s = 100;
  const auto t = trace(kFourNodes);
  const SimResult s = simulateSinew(t, job, o);
  EXPECT_NEAR(s.goodputVsIdeal(), 1.0, 1e-9);
  EXPECT_NEAR(s.effectiveShare(), 1.0, 1e-9);
  const ThroughputTable tab = sinewThroughputTable(job, trace(kFourNodes));
  EXPECT_NEAR(tab.at(4), 24, 1e-9);
  EXPECT_NEAR(tab.at(3), 12, 1e-9);
  EXPECT_NEAR(simulateFixedCost(t, {tab, 1.0, 12}, o).goodputVsIdeal(), 1.0, 1e-9);
  // The restart model pays its checkpoints even then: 100 steps of 0.5 s, then 10 s.
  const SimResult rs = simulateRestart(t, {tab, 100, 10.0, 60.0, 12}, o);
  EXPECT_NEAR(secondsOf(rs, Cause::kCheckpoint), 10, 1e-9);
}

TEST(SinewModelTest, TheCostModelGivesTheStepTimeWithoutATable) {
  SinewJobModel job = smallJob();
  job.table.reset();
  const ThroughputTable tab = sinewThroughputTable(job, trace(kFourNodes));
  // 2 pipelines of 2 stages of 2 layers (6 ms per microbatch per stage), 6 microbatches each:
  // at least (6 + 1) * 6 ms per step, so at most 12 / 0.042 samples/s.
  ASSERT_GT(tab.at(4), 0);
  EXPECT_LE(tab.at(4), 12 / 0.042 + 1e-6);
  EXPECT_GT(tab.at(4), tab.at(2));
  SimOptions o;
  o.duration_s = 10;
  EXPECT_NEAR(simulateSinew(trace(kFourNodes), job, o).goodput(), tab.at(4), 1e-6 * tab.at(4));
}

TEST(SinewInputsTest, BadTablesAndCostsAreRefusedNamingTheField) {
  auto refusal = [](auto f) {
    try {
      f();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(refusal([] {
              parseThroughputTable(R"({"samples_per_s": {"8": -1}})", "t.json");
            }).find("t.json samples_per_s[\"8\"] must be > 0"),
            std::string::npos);
  EXPECT_NE(refusal([] {
              parseThroughputTable(R"({"samples_per_s": {"x": 1}})", "t.json");
            }).find("node count"),
            std::string::npos);
  EXPECT_NE(
      refusal([] { parseThroughputTable(R"({"rates": {}})", "t.json"); }).find("samples_per_s"),
      std::string::npos);
  EXPECT_NE(refusal([] {
              parseSinewCosts(R"({"epoch_s": "fast"})", "c.json");
            }).find("c.json epoch_s must be a number"),
            std::string::npos);
  EXPECT_NE(
      refusal([] { parseSinewCosts(R"({"epoc_s": 1})", "c.json"); }).find("unknown field 'epoc_s'"),
      std::string::npos);
  EXPECT_NE(refusal([] {
              parseSinewCosts(std::string(100, '[') + std::string(100, ']'), "c.json");
            }).find("deeper than"),
            std::string::npos);
  const SinewCosts c =
      parseSinewCosts(R"({"epoch_s": 0.5, "replication": 3, "_source": "x"})", "c");
  EXPECT_EQ(c.epoch_s, 0.5);
  EXPECT_EQ(c.replication, 3);
}

std::string writeFile(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path) << text;
  return path;
}

TEST(SinewSimToolTest, PrintsEveryModelAndAResultLine) {
  const std::string tracePath =
      writeFile("sim-trace.csv", std::string(kFourNodes) + "10250,remove,node2\n20000,add,node5\n");
  const std::string tablePath =
      writeFile("sim-table.json", R"({"samples_per_s": {"2": 12, "4": 24}})");
  // smallJob()'s profile as JSON; the table gives the step times.
  const std::string profile = writeFile("sim-profile.json", R"({"version": 1,
    "microbatch_size": 1, "job": {"devices_per_node": 1, "device_memory_bytes": 700000000,
    "inter_stage_gbps": 100, "allreduce": {"bandwidth_gbps": 100, "latency_us": 1}},
    "layers": [{"forward_ms": 1, "backward_ms": 2, "param_bytes": 100000000,
      "optimizer_bytes": 200000000, "activation_bytes": 1000000, "output_bytes": 1000000},
     {"forward_ms": 1, "backward_ms": 2, "param_bytes": 100000000,
      "optimizer_bytes": 200000000, "activation_bytes": 1000000, "output_bytes": 1000000},
     {"forward_ms": 1, "backward_ms": 2, "param_bytes": 100000000,
      "optimizer_bytes": 200000000, "activation_bytes": 1000000, "output_bytes": 1000000},
     {"forward_ms": 1, "backward_ms": 2, "param_bytes": 100000000,
      "optimizer_bytes": 200000000, "activation_bytes": 1000000, "output_bytes": 1000000}]})");
  const std::string timeline = ::testing::TempDir() + "sim-timeline.csv";
  testing::ToolRun r = testing::runTool(
      SINEW_SIM_PATH, "--trace " + tracePath + " --profile " + profile + " --microbatches 12 " +
                          "--throughput " + tablePath + " --measured-step --duration-s 40 " +
                          "--bucket-s 10 --timeline " + timeline);
  ASSERT_EQ(r.status, 0) << r.out;
  for (const char* model : {"\nsinew ", "\nfixed-cost ", "\nrestart "}) {
    EXPECT_NE(r.out.find(model), std::string::npos) << r.out;
  }
  const size_t result = r.out.rfind("RESULT sim_goodput_vs_fixed_cost=");
  ASSERT_NE(result, std::string::npos) << r.out;
  EXPECT_NE(r.out.find("sim_goodput_vs_restart=", result), std::string::npos);
  EXPECT_EQ(r.out.find('\n', result), r.out.size() - 1) << "RESULT is not the last line";
  std::ifstream csv(timeline);
  std::string header, line;
  std::getline(csv, header);
  EXPECT_EQ(header.rfind("trace,model,start_s,end_s,samples_per_s,training_s", 0), 0u) << header;
  int rows = 0;
  while (std::getline(csv, line)) ++rows;
  EXPECT_EQ(rows, 3 * 4);  // three models, four buckets of 10 s

  testing::ToolRun json = testing::runTool(
      SINEW_SIM_PATH, "--nodes 64 --mtbf-hours 2 --hours 4 --return-after-min 30 --profile " +
                          profile + " --microbatches 12 --json --models sinew,restart");
  ASSERT_EQ(json.status, 0) << json.out;
  EXPECT_NE(json.out.find("\"ettr\""), std::string::npos) << json.out;

  testing::ToolRun bad = testing::runTool(
      SINEW_SIM_PATH, "--trace " + writeFile("sim-bad.csv", "0,add,a\n5,remove,b\n") +
                          " --throughput " + tablePath + " --models fixed-cost");
  EXPECT_EQ(bad.status, 1) << bad.out;
  EXPECT_NE(bad.out.find("line 2: node b is removed but is not there"), std::string::npos)
      << bad.out;
  EXPECT_EQ(testing::runTool(SINEW_SIM_PATH, "--trace x.csv").status, 2);
  EXPECT_EQ(testing::runTool(SINEW_SIM_PATH, "--bogus").status, 2);
  testing::ToolRun help = testing::runTool(SINEW_SIM_PATH, "--help");
  EXPECT_EQ(help.status, 0);
  EXPECT_NE(help.out.find("--mtbf-hours"), std::string::npos);
}

}  // namespace
}  // namespace sim
}  // namespace sinew
