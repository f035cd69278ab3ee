// Whole pipeline-parallel jobs: sinew-run runs examples/train_pp (a GPT-style decoder on
// token ids) with a memory budget that no single worker can hold the model in, so the
// trainer plans pipelines from templates and runs 1F1B. Each job must end with parameters
// within 1e-5 (relative) of the single-process libtorch reference, every worker holding
// (and allocating) only its own layers.

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <numeric>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "../fs_support.h"
#include "../tool_support.h"
#include "job_support.h"

namespace {

using namespace std::chrono_literals;
using namespace sinew::testing;

// train_pp's layers with their parameter counts: embed (token 32 x 32 + position 16 x 32),
// 8 blocks (two layer norms, qkv, proj, a 4x MLP over 32 features), head (layer norm, 32 x 32
// projection with bias).
constexpr int64_t kEmbedParams = 32 * 32 + 16 * 32;
constexpr int64_t kBlockParams =
    2 * 64 + (32 * 96 + 96) + (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32);
constexpr int64_t kHeadParams = 64 + 32 * 32 + 32;
constexpr int64_t kModelParams = kEmbedParams + 8 * kBlockParams + kHeadParams;
// Parameters, gradients and Adam's two moments of the whole model in float64 are 3.4 MB and
// the measured activations about 0.3 MB per block per microbatch in flight; a worker may use
// 4.4 MB, so the model needs at least two workers per pipeline. (The budget gives the plans the
// 2 MB budget gave when the planner left gradients out and estimated activations as input +
// output bytes, 32 kB per block.)
const char* kBudget = "4400000";

int layerIndex(const std::string& name) {
  if (name == "embed") return 0;
  if (name == "head") return 9;
  return 1 + std::stoi(name.substr(5));  // "block<k>"
}

int64_t paramsOf(int first, int last) {
  int64_t n = 0;
  for (int l = first; l <= last; ++l) {
    n += l == 0 ? kEmbedParams : l == 9 ? kHeadParams : kBlockParams;
  }
  return n;
}

struct WorkerLine {
  int worker = -1, pipeline = -1, pipelines = 0, stage = -1, first = -1, last = -1;
  int64_t params = 0;
};

// The "train_pp: worker W done: ..." line of every worker.
std::vector<WorkerLine> workerLines(const std::string& out) {
  std::regex re(
      "train_pp: worker (\\d+) done: .* pipeline (-?\\d+) of (\\d+), stage (-?\\d+), layers "
      "(\\w+)\\.\\.(\\w+) \\(\\d+ layers, (\\d+) parameters\\)");
  std::vector<WorkerLine> lines;
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it) {
    WorkerLine w;
    w.worker = std::stoi((*it)[1]);
    w.pipeline = std::stoi((*it)[2]);
    w.pipelines = std::stoi((*it)[3]);
    w.stage = std::stoi((*it)[4]);
    w.first = layerIndex((*it)[5]);
    w.last = layerIndex((*it)[6]);
    w.params = std::stoll((*it)[7]);
    lines.push_back(w);
  }
  return lines;
}

// Column `column` (2: nodes, 3: stages, 4: microbatches) of every pipeline of the first plan
// the job printed ("  pipeline P: N nodes, S stages, M microbatches: ...").
std::vector<int> planColumn(const std::string& out, int column) {
  std::regex re("  pipeline (\\d+): (\\d+) nodes?, (\\d+) stages, (\\d+) microbatches:");
  std::vector<int> values;
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it) {
    if (std::stoi((*it)[1]) == 0 && !values.empty()) break;  // A later epoch's plan.
    values.push_back(std::stoi((*it)[column]));
  }
  return values;
}

std::vector<int> planStages(const std::string& out) { return planColumn(out, 3); }
std::vector<int> planNodes(const std::string& out) { return planColumn(out, 2); }

// These jobs test plans, layer movement and rollbacks, not rule 1 of
// docs/failure_semantics.md (fault_semantics_test and scripts/chaos do): a 10 s step-deadline
// floor instead of the default 3 s keeps a CI machine's multi-second stall of one of six
// processes on two cores from expelling a healthy worker and changing who holds what (seen
// once in CI: worker 3 expelled after 3.04 s at step 12, the job exact without it).
// Worker 0 trains the single-process reference after the job has ended; under the
// sanitizers on two cores that can outlast sinew-run's default 30 s exit grace (rule 11), and
// the launcher killed worker 0 after it printed RESULT and failed the job (seen in the
// sanitizer CI run). kExitGrace gives the reference room; rule 11 has its own test.
const char* kExitGrace = "240";
JobRun trainPpWith(const std::string& name, int workers, const std::vector<std::string>& args,
                   const std::string& inject = "") {
  return sinew::testing::runJob(name, workers, TRAIN_PP_PATH, args, inject,
                                std::chrono::seconds(300),
                                {"--step-deadline-ms", "10000", "--exit-grace-s", kExitGrace});
}

// These jobs are written for one worker per node (the trainer's default; train_pp's own is
// two, see SixWorkersWithNoArgumentsRunPipelinesOfDifferentLengths): unless a test names
// --devices-per-node, every worker is a node. A profile file sets its own and overrides it.
JobRun trainPp(const std::string& name, int workers, std::vector<std::string> args,
               const std::string& inject = "") {
  if (std::find(args.begin(), args.end(), "--devices-per-node") == args.end()) {
    args.insert(args.begin(), {"--devices-per-node", "1"});
  }
  return trainPpWith(name, workers, args, inject);
}

void expectMatchesReference(const JobRun& run) {
  EXPECT_FALSE(run.timedOut) << "the job hung";
  EXPECT_EQ(run.exitCode, 0);
  Result r = parseResult(run.output);
  ASSERT_TRUE(r.found) << "no RESULT line";
  EXPECT_LE(r.maxRel, 1e-5);
  EXPECT_NEAR(r.finalLoss, r.referenceLoss, 1e-6 * r.referenceLoss);
  EXPECT_LT(r.finalLoss, 2.0) << "the model did not learn (a uniform guess scores ln 32 = 3.47)";
}

// Every worker holds a contiguous range of layers, allocates exactly their parameters, and
// the stages of each pipeline cover the model once.
void expectStagesHoldOnlyTheirLayers(const std::vector<WorkerLine>& lines, int workers,
                                     int maxWidth = 1) {
  ASSERT_EQ(static_cast<int>(lines.size()), workers);
  std::map<int, std::vector<WorkerLine>> byPipeline;
  for (const auto& w : lines) {
    EXPECT_EQ(w.params, paramsOf(w.first, w.last)) << "worker " << w.worker;
    EXPECT_LT(w.params, kModelParams) << "worker " << w.worker << " holds the whole model";
    byPipeline[w.pipeline].push_back(w);
  }
  EXPECT_GE(byPipeline.size(), 2u) << "fault tolerance 1 needs two pipelines";
  for (auto& [p, stages] : byPipeline) {
    std::sort(stages.begin(), stages.end(),
              [](const WorkerLine& a, const WorkerLine& b) { return a.stage < b.stage; });
    int next = 0;
    int width = 0;  // workers of the current stage so far
    for (size_t i = 0; i < stages.size(); ++i) {
      const WorkerLine& w = stages[i];
      if (i > 0 && w.stage == stages[i - 1].stage) {
        // Another worker of a wider stage: the same layers.
        EXPECT_LE(++width, maxWidth) << "pipeline " << p << " stage " << w.stage << " too wide";
        EXPECT_EQ(w.first, stages[i - 1].first) << "worker " << w.worker;
        EXPECT_EQ(w.last, stages[i - 1].last) << "worker " << w.worker;
        continue;
      }
      width = 1;
      EXPECT_EQ(w.first, next) << "pipeline " << p << " stage " << w.stage;
      next = w.last + 1;
    }
    EXPECT_EQ(next, 10) << "pipeline " << p << " does not end with the head";
  }
}

TEST(PipelineJobTest, SixWorkersTrainPipelinesOfAModelNoWorkerCanHold) {
  JobRun run = trainPp("pp-six", 6, {"--memory-bytes", kBudget});
  SCOPED_TRACE(run.output);
  expectMatchesReference(run);
  expectStagesHoldOnlyTheirLayers(workerLines(run.output), 6);
  for (int stages : planStages(run.output)) EXPECT_GE(stages, 2);
}

// The example as the README runs it: `sinew-run -n 6 train_pp`, no arguments. train_pp's
// workers form nodes of two (--devices-per-node 2), so the six are three nodes; fault
// tolerance 1 needs two pipelines and every node is used, so they are a one-node and a
// two-node pipeline, each cut where no worker exceeds the 4.4 MB default budget.
TEST(PipelineJobTest, SixWorkersWithNoArgumentsRunPipelinesOfDifferentLengths) {
  JobRun run = trainPpWith("pp-defaults", 6, {});
  SCOPED_TRACE(run.output);
  expectMatchesReference(run);
  EXPECT_NE(run.output.find("(3 nodes of 2 workers"), std::string::npos);
  std::vector<int> nodes = planNodes(run.output);
  ASSERT_EQ(nodes.size(), 2u);
  EXPECT_EQ(std::multiset<int>(nodes.begin(), nodes.end()), (std::multiset<int>{1, 2}))
      << "three nodes, two pipelines: one of two nodes and one of one";
  for (int stages : planStages(run.output)) EXPECT_GE(stages, 2) << "no worker can hold it";
  // Every worker holds a stage, and every pipeline's stages cover the model once; a stage
  // at most a node (two workers) wide gives both the same layers.
  std::vector<WorkerLine> lines = workerLines(run.output);
  expectStagesHoldOnlyTheirLayers(lines, 6, /*maxWidth=*/2);
  std::set<int> pipelines;
  for (const auto& w : lines) pipelines.insert(w.pipeline);
  EXPECT_EQ(pipelines.size(), 2u);
}

// --ragged: every microbatch keeps kContext - (its first token mod 4) positions, so the
// activation between the stages changes shape from one microbatch to the next. From a step's
// second microbatch on, a receiver posts the activation's receive with its header, sized as
// the last one; when the shape changed the sender fills that receive with zeros and sends the
// activation again in an exchange the receiver matches once it has read the new header. A
// mismatch there would hang the job, fail it or train on zeros; it ends exact.
TEST(PipelineJobTest, ActivationsThatChangeShapeBetweenMicrobatches) {
  JobRun run = trainPp("pp-ragged", 4, {"--memory-bytes", kBudget, "--steps", "30", "--ragged"});
  SCOPED_TRACE(run.output);
  expectMatchesReference(run);
  EXPECT_EQ(planStages(run.output), (std::vector<int>{2, 2}));
  // With stages two workers wide each worker would cut its half of a microbatch to the length
  // of its own first sample: refused before the job starts, naming the flag to pass.
  JobRun wide = finish(start({TRAIN_PP_PATH, "--ragged"}, {}), 60s);
  EXPECT_EQ(wide.exitCode, 2);
  EXPECT_NE(wide.output.find("--ragged needs stages one worker wide: pass --devices-per-node 1"),
            std::string::npos)
      << wide.output;
}

TEST(PipelineJobTest, FiveWorkersRunPipelinesOfDifferentLengths) {
  JobRun run = trainPp("pp-five", 5, {"--memory-bytes", kBudget, "--steps", "30"});
  SCOPED_TRACE(run.output);
  expectMatchesReference(run);
  expectStagesHoldOnlyTheirLayers(workerLines(run.output), 5);
  std::vector<int> stages = planStages(run.output);
  ASSERT_EQ(stages.size(), 2u);
  EXPECT_EQ(std::set<int>(stages.begin(), stages.end()), (std::set<int>{2, 3}))
      << "five workers, two pipelines: one of 3 stages and one of 2";
}

TEST(PipelineJobTest, OneWorkerCannotHoldTheModelAndSaysWhy) {
  JobRun run = trainPp("pp-one", 1, {"--memory-bytes", kBudget, "--fault-tolerance", "0"});
  EXPECT_FALSE(run.timedOut);
  EXPECT_NE(run.exitCode, 0);
  EXPECT_NE(run.output.find("fits no pipeline"), std::string::npos) << run.output;
  EXPECT_NE(run.output.find("device_memory_bytes=4400000"), std::string::npos) << run.output;
}

TEST(PipelineJobTest, IntegerInputsTrainDataParallel) {
  // Token ids stay int64 on their way to the Embedding (they used to be cast to float64).
  JobRun run = trainPp("pp-dp", 3, {"--data-parallel", "--steps", "20"});
  SCOPED_TRACE(run.output);
  EXPECT_FALSE(run.timedOut);
  EXPECT_EQ(run.exitCode, 0);
  Result r = parseResult(run.output);
  ASSERT_TRUE(r.found) << "no RESULT line";
  EXPECT_LE(r.maxRel, 1e-5);
  for (const auto& w : workerLines(run.output)) EXPECT_EQ(w.params, kModelParams);
}

TEST(PipelineJobTest, RestartFromDiskOntoOtherPlansAndDataParallel) {
  std::string dir = logDir("pp-ckpt") + "-checkpoints";
  std::filesystem::remove_all(dir);
  // Pipelines of 3 and 2 stages write steps 0..15 (every writer of pipeline 0 its shard).
  JobRun a = trainPp("pp-ckpt-a", 5,
                     {"--memory-bytes", kBudget, "--steps", "16", "--checkpoint-dir", dir,
                      "--checkpoint-every", "4", "--no-reference"});
  ASSERT_EQ(a.exitCode, 0) << a.output;
  // Data parallel on 2 workers resumes from the pipelines' version and writes 16..27.
  JobRun b = trainPp("pp-ckpt-b", 2,
                     {"--data-parallel", "--steps", "28", "--checkpoint-dir", dir,
                      "--checkpoint-every", "4", "--no-reference"});
  ASSERT_EQ(b.exitCode, 0) << b.output;
  EXPECT_NE(b.output.find("resumed from the durable checkpoint of step 15"), std::string::npos)
      << b.output;
  // Pipelines on 6 workers resume from the data-parallel version and finish.
  JobRun c = trainPp("pp-ckpt-c", 6,
                     {"--memory-bytes", kBudget, "--steps", "40", "--checkpoint-dir", dir,
                      "--checkpoint-every", "4"});
  SCOPED_TRACE(c.output);
  EXPECT_NE(c.output.find("resumed from the durable checkpoint of step 27"), std::string::npos);
  expectMatchesReference(c);
  std::filesystem::remove_all(dir);
}

// A profile of train_pp's ten layers, each 100 kB of parameters, `forwardMs` (1 ms) forward
// and twice that backward, with `devicesPerNode` workers per node of `memoryBytes` each and
// layer l's activations.
std::string layerProfile(const std::string& path, int devicesPerNode, int64_t memoryBytes,
                         int64_t (*activationBytes)(int), double forwardMs = 1.0) {
  std::ofstream out(path);
  out << R"({"version": 1, "microbatch_size": 4, "job": {"devices_per_node": )" << devicesPerNode
      << R"(, "device_memory_bytes": )" << memoryBytes << R"(, "inter_stage_gbps": 10.0,
    "allreduce": {"algorithm": "ring", "bandwidth_gbps": 1000.0, "latency_us": 1.0}},
    "layers": [)";
  for (int l = 0; l < 10; ++l) {
    std::string name = l == 0 ? "embed" : l == 9 ? "head" : "block" + std::to_string(l - 1);
    out << (l ? ", " : "") << R"({"name": ")" << name << R"(", "forward_ms": )" << forwardMs
        << R"(, "backward_ms": )" << 2 * forwardMs
        << R"(, "param_bytes": 100000, "optimizer_bytes": 0, "activation_bytes": )"
        << activationBytes(l) << R"(, "output_bytes": 16384})";
  }
  out << "]}\n";
  return path;
}

// Before a step was measured, the plan's predicted step time scales the workers' deadlines: a
// first stage that computes its first step for 12 s (a large model on a slow machine: GPT-2
// small's first stage took over 10 s per microbatch here) is waited for, not timed out. The
// profile predicts about 15 s a step (100 ms forward, 200 ms backward per layer, 8
// microbatches, two stages), so the second stage's exchange waits up to twice that. Before,
// it gave up after opTimeout's 10 s and every epoch's step 0 failed the same way (the fault
// here fires once, so the job then recovered; with GPT-2 small it never did).
TEST(PipelineJobTest, AFirstStepLongerThanTheOperationTimeoutIsWaitedFor) {
  const std::string profile = layerProfile(
      logDir("pp-slow-first") + "-profile.json", 1, 700000, [](int) -> int64_t { return 1000; },
      100.0);
  // A step deadline floor of 2 s leaves opTimeout at its 10 s before a step was measured.
  JobRun run = sinew::testing::runJob(
      "pp-slow-first", 2, TRAIN_PP_PATH,
      {"--devices-per-node", "1", "--profile", profile, "--steps", "30", "--fault-tolerance", "0"},
      "slow:worker=0:step=0:phase=forward:ms=12000", std::chrono::seconds(300),
      {"--step-deadline-ms", "2000", "--exit-grace-s", kExitGrace});
  SCOPED_TRACE(run.output);
  expectMatchesReference(run);
  EXPECT_NE(run.output.find("recoveries=0"), std::string::npos) << "step 0 timed out";
  EXPECT_EQ(run.output.find("timed out"), std::string::npos);
  std::filesystem::remove(profile);
}

// A profile of train_pp's layers with 2 devices (workers) per node and 600 kB per device:
// every layer's parameters are 100 kB, so a pipeline needs two stages or more; layer l keeps
// activationBytes(l) of activations per microbatch.
std::string twoPerNodeProfile(const std::string& path, int64_t (*activationBytes)(int)) {
  return layerProfile(path, 2, 600000, activationBytes);
}

// 15 kB of activations per layer: a pipeline needs two stages; a stage of width 1 on one
// node would keep twice the activations of one of width 2 and does not fit, so the planner
// runs two-stage pipelines of width 2, each worker of a stage running half of every
// microbatch.
std::string wideProfile(const std::string& path) {
  return twoPerNodeProfile(path, [](int) -> int64_t { return 15000; });
}

// The workers' lines of a finished job by (pipeline, stage), each worker holding exactly the
// parameters of its layers.
std::map<std::pair<int, int>, std::vector<WorkerLine>> workersByStage(const std::string& out,
                                                                      size_t workers) {
  std::vector<WorkerLine> lines = workerLines(out);
  EXPECT_EQ(lines.size(), workers);
  std::map<std::pair<int, int>, std::vector<WorkerLine>> byStage;
  for (const auto& w : lines) {
    EXPECT_EQ(w.params, paramsOf(w.first, w.last)) << "worker " << w.worker;
    byStage[{w.pipeline, w.stage}].push_back(w);
  }
  return byStage;
}

// A step whose durable and peer-RAM versions are both due is copied once: the writers flush
// the peer-RAM engine's snapshot of it (checkpoint events with shared_snapshot true) and take
// their own snapshot only for durable versions the engine does not take. Durable every 2 steps
// and peer-RAM every 3: steps 5 and 11 (both due) and 12 (the last, always both) share, 1, 3, 7
// and 9 do not. The version on disk restores onto another plan (3 + 2) exactly.
TEST(PipelineJobTest, DurableAndPeerRamVersionsOfAStepShareOneSnapshot) {
  const std::string name = "pp-shared-snapshot";
  const std::string ckpt = logDir(name) + "-checkpoints";
  std::filesystem::remove_all(ckpt);
  std::filesystem::remove_all(logDir(name));
  JobRun run = trainPp(name, 4,
                       {"--memory-bytes", kBudget, "--steps", "13", "--checkpoint-dir", ckpt,
                        "--checkpoint-every", "2", "--peer-checkpoint-every", "3"});
  SCOPED_TRACE(run.output);
  ASSERT_EQ(run.exitCode, 0);
  Result r = parseResult(run.output);
  ASSERT_TRUE(r.found) << "no RESULT line";
  EXPECT_LE(r.maxRel, 1e-5);  // 13 steps: exact, though not yet learned (the resumed job is)
  std::map<int64_t, std::vector<bool>> shared;  // step -> each writer's flush
  std::set<std::string> writers;
  std::map<std::string, nlohmann::json> held;  // events file -> its peer_version_bytes
  for (const auto& entry : std::filesystem::directory_iterator(logDir(name))) {
    const std::string file = entry.path().filename().string();
    if (file.rfind("worker-", 0) != 0 || file.find("-events.jsonl") == std::string::npos) continue;
    std::ifstream in(entry.path());
    std::string line;
    while (std::getline(in, line)) {
      auto e = nlohmann::json::parse(line, nullptr, false);
      if (e.is_discarded()) continue;
      if (e.value("event", "") == "done") held[file] = e.at("peer_version_bytes");
      if (e.value("event", "") != "checkpoint") continue;
      writers.insert(file);
      shared[e.at("step").get<int64_t>()].push_back(e.at("shared_snapshot").get<bool>());
    }
  }
  // Two pipelines of two stages: the writers (pipeline 0's stages) own the versions' shards;
  // the other pipeline's workers hold the same layers, so they take none of their own and hold
  // the writers' replicas instead, each a writer's partner. The RAM is the model's state in
  // four copies (two slots, two kept replicas), not eight.
  ASSERT_EQ(held.size(), 4u);
  ASSERT_EQ(writers.size(), 2u);
  int64_t own = 0, replicas = 0;
  for (const auto& [file, bytes] : held) {
    const bool writer = writers.count(file) != 0;
    SCOPED_TRACE(file + ": " + bytes.dump());
    if (writer) {
      EXPECT_GT(bytes.at("own").get<int64_t>(), 0);
      EXPECT_EQ(bytes.at("replicas").get<int64_t>(), 0);
    } else {
      EXPECT_EQ(bytes.at("own").get<int64_t>(), 0);
      EXPECT_GT(bytes.at("replicas").get<int64_t>(), 0);
    }
    own += bytes.at("own").get<int64_t>();
    replicas += bytes.at("replicas").get<int64_t>();
  }
  EXPECT_LE(replicas, own);  // A third arena slot is allocated only for a version abandoned.
  const std::map<int64_t, bool> want = {{1, false}, {3, false}, {5, true}, {7, false},
                                        {9, false}, {11, true}, {12, true}};
  for (const auto& [step, isShared] : want) {
    ASSERT_EQ(shared[step].size(), 2u) << "step " << step << ": one flush per writer";
    for (bool b : shared[step]) EXPECT_EQ(b, isShared) << "step " << step;
  }
  EXPECT_EQ(shared.size(), want.size());
  JobRun again = trainPp(name + "-again", 5,
                         {"--memory-bytes", kBudget, "--steps", "40", "--checkpoint-dir", ckpt,
                          "--checkpoint-every", "8"});
  EXPECT_NE(again.output.find("resumed from the durable checkpoint of step 12"), std::string::npos)
      << again.output;
  expectMatchesReference(again);
  sinew::testing::removeTree(ckpt);
}

TEST(PipelineJobTest, StagesTwoWorkersWideSplitEachMicrobatch) {
  const std::string dir = logDir("pp-wide") + "-checkpoints";
  std::filesystem::remove_all(dir);
  const std::string profile = wideProfile(logDir("pp-wide") + "-profile.json");
  JobRun run = trainPp(
      "pp-wide", 8,
      {"--profile", profile, "--steps", "20", "--checkpoint-dir", dir, "--checkpoint-every", "5"});
  SCOPED_TRACE(run.output);
  expectMatchesReference(run);
  EXPECT_EQ(planStages(run.output), (std::vector<int>{2, 2}));
  // Two pipelines x two stages x two workers: the two workers of a stage hold the same
  // layers, the stages of a pipeline cover the model.
  auto byStage = workersByStage(run.output, 8);
  ASSERT_EQ(byStage.size(), 4u);
  for (const auto& [key, ws] : byStage) {
    ASSERT_EQ(ws.size(), 2u) << "pipeline " << key.first << " stage " << key.second;
    EXPECT_EQ(ws[0].first, ws[1].first);
    EXPECT_EQ(ws[0].last, ws[1].last);
    const int expectedFirst =
        key.second == 0 ? 0 : byStage[std::make_pair(key.first, 0)][0].last + 1;
    EXPECT_EQ(ws[0].first, expectedFirst);
  }
  // Only one worker of each stage writes its layers: the version restores onto data
  // parallelism and goes on equal to the reference.
  JobRun dp =
      trainPp("pp-wide-dp", 2, {"--data-parallel", "--steps", "30", "--checkpoint-dir", dir});
  SCOPED_TRACE(dp.output);
  EXPECT_NE(dp.output.find("resumed from the durable checkpoint of step 19"), std::string::npos);
  expectMatchesReference(dp);
  std::filesystem::remove_all(dir);
  std::filesystem::remove(profile);
}

// A profile of train_pp's layers, 2 devices per node, where block3 keeps 300 kB of activations
// per microbatch: on one device it does not fit with the two microbatches in flight of a middle
// stage, on two it does. The planner's template is mixed: layers 0-3 on one device, 4-5 on two
// (one node), 6-9 on one device (the two one-device stages share the other node). Activations
// are split from one worker to two and joined from two to one, and gradients the other way.
std::string mixedProfile(const std::string& path) {
  return twoPerNodeProfile(path, [](int l) -> int64_t { return l == 4 ? 300000 : 15000; });
}

TEST(PipelineJobTest, MixedWidthStagesSplitAndJoinActivations) {
  const std::string profile = mixedProfile(logDir("pp-mixed") + "-profile.json");
  JobRun run = trainPp("pp-mixed", 8, {"--profile", profile, "--steps", "20"});
  SCOPED_TRACE(run.output);
  expectMatchesReference(run);
  EXPECT_EQ(planStages(run.output), (std::vector<int>{3, 3}));
  auto byStage = workersByStage(run.output, 8);
  ASSERT_EQ(byStage.size(), 6u);
  for (int p = 0; p < 2; ++p) {
    const auto& s0 = byStage[{p, 0}];
    const auto& s1 = byStage[{p, 1}];
    const auto& s2 = byStage[{p, 2}];
    ASSERT_EQ(s0.size(), 1u) << "pipeline " << p;
    ASSERT_EQ(s1.size(), 2u) << "pipeline " << p;
    ASSERT_EQ(s2.size(), 1u) << "pipeline " << p;
    EXPECT_EQ(s0[0].first, 0);
    EXPECT_EQ(s0[0].last, 3);
    for (const auto& w : s1) {
      EXPECT_EQ(w.first, 4);
      EXPECT_EQ(w.last, 5);
    }
    EXPECT_EQ(s2[0].first, 6);
    EXPECT_EQ(s2[0].last, 9);
  }
  std::filesystem::remove(profile);
}

// ---- Reconfiguration after worker loss (issue 12, docs/pipeline.md "Reconfiguration") ----
// Six workers, a model none can hold alone (two-stage pipelines, three of them). After a loss
// the coordinator plans the survivors again from the templates; workers that now hold layers
// they did not copy them from live workers that hold them, and the job ends equal to the
// reference with every survivor holding layers.

// Who holds which layer after each reconfiguration. The coordinator logs each epoch's plan
// (its "plan" event: how it was made, and every worker's layers), and a worker logs a
// layers_moved event whenever its layers change and an epoch_entered or recovered event once
// it has entered an epoch (its layers copied and adopted). Every worker that entered an epoch
// held exactly that epoch's plan's layers: the range of its last layers_moved event of that
// epoch or before, else its range in the first plan. (An epoch whose reconfiguration failed, a
// member lost or a rollback needed, is entered by nobody.) No plan left a node idle (the
// templates here fit every survivor count), and some worker entered a plan after the first.
// Returns how each plan was made ("instantiated", "shrink", "merge", ...).
std::vector<std::string> expectEachPlanHeld(const std::string& dir) {
  struct PlanEvent {
    int64_t epoch = 0;
    std::string how;
    std::map<int, std::pair<int, int>> holds;  // worker -> [first, end)
    std::vector<int> idle;
  };
  auto readEvents = [](const std::filesystem::path& file, const std::string& kind) {
    std::vector<nlohmann::json> out;
    std::ifstream in(file);
    std::string line;
    while (std::getline(in, line)) {
      auto e = nlohmann::json::parse(line, nullptr, false);
      if (!e.is_discarded() && e.value("event", "") == kind) out.push_back(std::move(e));
    }
    return out;
  };
  std::vector<PlanEvent> plans;
  for (const auto& e : readEvents(dir + "/coordinator-events.jsonl", "plan")) {
    PlanEvent p;
    p.epoch = e.at("epoch").get<int64_t>();
    p.how = e.at("how").get<std::string>();
    for (const auto& w : e.at("workers")) {
      p.holds[w.at(0).get<int>()] = {w.at(1).get<int>(), w.at(2).get<int>()};
    }
    p.idle = e.at("idle_nodes").get<std::vector<int>>();
    plans.push_back(std::move(p));
  }
  std::vector<std::string> hows;
  if (plans.size() < 2) {
    ADD_FAILURE() << "fewer than two plans in " << dir;
    return hows;
  }
  std::map<int, std::vector<std::tuple<int64_t, int, int>>> moved;  // worker -> (epoch, range)
  std::map<int, std::set<int64_t>> entered;                         // worker -> epochs
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string file = entry.path().filename().string();
    if (file.rfind("worker-", 0) != 0 || file.find("-events.jsonl") == std::string::npos) continue;
    const int w = std::stoi(file.substr(7));
    for (const auto& e : readEvents(entry.path(), "layers_moved")) {
      moved[w].emplace_back(e.at("epoch").get<int64_t>(), e.at("holds").at(0).get<int>(),
                            e.at("holds").at(1).get<int>());
    }
    for (const char* kind : {"epoch_entered", "recovered"}) {
      for (const auto& e : readEvents(entry.path(), kind)) {
        entered[w].insert(e.at("epoch").get<int64_t>());
      }
    }
  }
  int checked = 0;
  for (const PlanEvent& p : plans) {
    hows.push_back(p.how);
    EXPECT_TRUE(p.idle.empty()) << "the plan of epoch " << p.epoch << " left nodes idle";
    for (const auto& [w, range] : p.holds) {
      if (!entered[w].count(p.epoch)) continue;
      std::pair<int, int> held{-1, -1};
      auto first = plans.front().holds.find(w);
      if (first != plans.front().holds.end()) held = first->second;
      for (const auto& [epoch, f, e] : moved[w]) {
        if (epoch <= p.epoch) held = {f, e};
      }
      EXPECT_EQ(held, range) << "worker " << w << " in epoch " << p.epoch << " (plan " << p.how
                             << ")";
      if (p.epoch > plans.front().epoch) ++checked;
    }
  }
  EXPECT_GT(checked, 0) << "no worker entered a plan after the first";
  return hows;
}

// True if any plan of `hows` borrowed a node or merged two pipelines.
bool borrowedOrMerged(const std::vector<std::string>& hows) {
  return std::find(hows.begin(), hows.end(), "borrow") != hows.end() ||
         std::find(hows.begin(), hows.end(), "merge") != hows.end();
}

// A job that lost exactly `lost` (sinew-run's "workers lost: [...]") and ended exact, with
// `survivors` workers that each hold layers, every pipeline covering the model once.
void expectReconfiguredExact(const JobRun& run, const std::string& lost, int survivors) {
  expectMatchesReference(run);
  EXPECT_NE(run.output.find("workers lost: [" + lost + "]"), std::string::npos)
      << "expected workers lost: [" << lost << "]";
  std::vector<WorkerLine> lines = workerLines(run.output);
  expectStagesHoldOnlyTheirLayers(lines, survivors);
  for (const auto& w : lines) EXPECT_GT(w.params, 0) << "worker " << w.worker << " is idle";
  EXPECT_NE(run.output.find(" copied from worker"), std::string::npos)
      << "no worker copied a layer from a live one";
  EXPECT_EQ(run.output.find("read from the durable checkpoint"), std::string::npos)
      << "a layer came from disk although live copies existed";
}

// With RMSprop: its square averages and step counts travel with the copied layers.
TEST(PipelineRecoveryTest, KillInForwardMovesLayersFromLiveWorkers) {
  JobRun run = trainPp(
      "pp-kill-forward", 6,
      {"--memory-bytes", kBudget, "--steps", "30", "--optimizer", "rmsprop", "--lr", "0.005"},
      "kill:worker=2:step=10:phase=forward");
  SCOPED_TRACE(run.output);
  expectReconfiguredExact(run, "2", 5);
  expectEachPlanHeld(logDir("pp-kill-forward"));
  // Who holds what after the reconfiguration is what each worker reports at the end; the
  // epoch-2 plan printed by the first worker names the same ranges.
  EXPECT_NE(run.output.find("epoch 2 plan: 2 pipelines"), std::string::npos);
}

// With durable checkpoints every step: the writers whose layers changed write the new
// layout's versions (a new snapshot arena, the same writer), and the last step is durable.
TEST(PipelineRecoveryTest, KillWithCheckpointsEveryStep) {
  const std::string ckpt = logDir("pp-kill-ckpt-dir");
  JobRun run = trainPp("pp-kill-ckpt", 5,
                       {"--memory-bytes", kBudget, "--steps", "24", "--checkpoint-dir", ckpt,
                        "--checkpoint-every", "1"},
                       "kill:worker=4:step=18:phase=backward");
  SCOPED_TRACE(run.output);
  expectReconfiguredExact(run, "4", 4);
  expectEachPlanHeld(logDir("pp-kill-ckpt"));
  std::smatch m;
  const std::string latest = slurp(ckpt + "/LATEST");
  ASSERT_TRUE(std::regex_search(latest, m, std::regex("\"step\":(\\d+)"))) << latest;
  EXPECT_EQ(std::stoi(m[1]), 23) << "the last step is not durable";
  sinew::testing::removeTree(ckpt);
}

// Worker 1 (pipeline 0's second stage, a writer whose shard of every durable version worker 0
// commits) dies in its flush of version 5, before posting its shard. Version 5 can never be
// complete: worker 0 reports it not durable as soon as the coordinator's next epoch lacks
// worker 1, and the job reconfigures, writes the later versions and ends exact with its last
// step durable. Before, worker 0's flush thread waited out the recovery deadline (60 s) for the
// shard on the store connection the recovery needed, and every worker failed (scripts/chaos,
// seed 9, runs 79 and 124).
TEST(PipelineRecoveryTest, KillOfACheckpointWriterBeforeItsShardArrived) {
  const std::string ckpt = logDir("pp-kill-writer-dir");
  JobRun run = trainPp("pp-kill-writer", 6,
                       {"--memory-bytes", kBudget, "--steps", "20", "--checkpoint-dir", ckpt,
                        "--checkpoint-every", "1"},
                       "kill:worker=1:step=5:phase=flush");
  SCOPED_TRACE(run.output);
  expectReconfiguredExact(run, "1", 5);
  EXPECT_NE(run.output.find("checkpoint 5 is not durable: worker 1"), std::string::npos);
  std::smatch m;
  const std::string latest = slurp(ckpt + "/LATEST");
  ASSERT_TRUE(std::regex_search(latest, m, std::regex("\"step\":(\\d+)"))) << latest;
  EXPECT_EQ(std::stoi(m[1]), 19) << "the last step is not durable";
  sinew::testing::removeTree(ckpt);
}

// With Adagrad: its sums and step counts travel with the copied layers.
TEST(PipelineRecoveryTest, KillInBackwardMidSchedule) {
  JobRun run = trainPp(
      "pp-kill-backward", 6,
      {"--memory-bytes", kBudget, "--steps", "30", "--optimizer", "adagrad", "--lr", "0.05"},
      "kill:worker=5:step=7:phase=backward");
  SCOPED_TRACE(run.output);
  expectReconfiguredExact(run, "5", 5);
  expectEachPlanHeld(logDir("pp-kill-backward"));
}

TEST(PipelineRecoveryTest, TwoKillsInTheSamePipeline) {
  // Workers 0 and 1 are pipeline 0's two stages: after both, its layers live on only in the
  // other pipelines.
  JobRun run = trainPp("pp-kill-same", 6, {"--memory-bytes", kBudget, "--steps", "30"},
                       "kill:worker=0:step=5:phase=forward;kill:worker=1:step=12:phase=reduce");
  SCOPED_TRACE(run.output);
  expectReconfiguredExact(run, "0,1", 4);
  // Pipeline 0 falls below the smallest template at one of the kills: it borrows a node from
  // the largest pipeline or merges with another (2+2+2 merges, 3+3 borrows).
  EXPECT_TRUE(borrowedOrMerged(expectEachPlanHeld(logDir("pp-kill-same"))));
}

// With SGD and momentum: the momentum buffers travel with the copied layers.
TEST(PipelineRecoveryTest, TwoKillsInDifferentPipelinesAtOnce) {
  JobRun run =
      trainPp("pp-kill-two", 6,
              {"--memory-bytes", kBudget, "--steps", "30", "--optimizer", "sgd", "--lr", "0.1"},
              "kill:worker=1:step=8:phase=forward;kill:worker=4:step=8:phase=forward");
  SCOPED_TRACE(run.output);
  // One or two reconfigurations, depending on when the second death is noticed.
  EXPECT_TRUE(run.output.find("workers lost: [1,4]") != std::string::npos ||
              run.output.find("workers lost: [4,1]") != std::string::npos);
  expectMatchesReference(run);
  expectStagesHoldOnlyTheirLayers(workerLines(run.output), 4);
  expectEachPlanHeld(logDir("pp-kill-two"));
}

TEST(PipelineRecoveryTest, KillDuringTheReconfiguration) {
  // Worker 3 dies as the epoch after worker 2's loss is announced, before it has copied or
  // sent anything: the survivors reconfigure again from what each still holds.
  JobRun run = trainPp("pp-kill-reconf", 6, {"--memory-bytes", kBudget, "--steps", "30"},
                       "kill:worker=2:step=10:phase=forward;"
                       "kill:worker=3:step=0:phase=reconfiguration");
  SCOPED_TRACE(run.output);
  EXPECT_TRUE(run.output.find("workers lost: [2,3]") != std::string::npos ||
              run.output.find("workers lost: [3,2]") != std::string::npos);
  expectMatchesReference(run);
  expectStagesHoldOnlyTheirLayers(workerLines(run.output), 4);
  expectEachPlanHeld(logDir("pp-kill-reconf"));
}

TEST(PipelineRecoveryTest, KillDuringALayerCopy) {
  // After worker 2's loss, worker 0 sends layers to worker 1 (as in KillInForward...); it dies
  // between the manifests and the tensors of that copy. Nothing was adopted, so the survivors
  // reconfigure again from what each still holds.
  JobRun run = trainPp("pp-kill-copy", 6, {"--memory-bytes", kBudget, "--steps", "30"},
                       "kill:worker=2:step=10:phase=forward;kill:worker=0:step=0:phase=copy");
  SCOPED_TRACE(run.output);
  EXPECT_NE(run.output.find("worker 0 SIGKILLs itself at step 10 phase copy"), std::string::npos);
  EXPECT_TRUE(run.output.find("workers lost: [2,0]") != std::string::npos ||
              run.output.find("workers lost: [0,2]") != std::string::npos);
  expectMatchesReference(run);
  std::vector<WorkerLine> lines = workerLines(run.output);
  expectStagesHoldOnlyTheirLayers(lines, 4);
  for (const auto& w : lines) EXPECT_GT(w.params, 0) << "worker " << w.worker << " is idle";
  expectEachPlanHeld(logDir("pp-kill-copy"));
}

// A layer copy that arrives damaged (failure injection: every worker that sends layers in
// the reconfiguration after worker 2's loss overwrites the first 8 bytes of its first tensor,
// in a copy of it) is caught by the receiver's crc32c check: nothing of it is adopted, the same
// members try the epoch again with the same plan and copy anew, no other worker is lost, and
// the job ends equal to the reference. Before, the receiver's Corruption ended it, and the
// job lost it too.
TEST(PipelineCopyTest, ADamagedLayerCopyIsCopiedAgain) {
  JobRun run = trainPp("pp-copy-damaged", 6, {"--memory-bytes", kBudget, "--steps", "30"},
                       "kill:worker=2:step=10:phase=forward;corrupt:worker=*:step=10:phase=copy");
  SCOPED_TRACE(run.output);
  EXPECT_NE(run.output.find("damages the layer copy it sends at step 10"), std::string::npos);
  EXPECT_NE(run.output.find("arrived damaged: crc32c"), std::string::npos);
  EXPECT_NE(run.output.find("trying the epoch again"), std::string::npos);
  expectReconfiguredExact(run, "2", 5);
  const std::vector<std::string> hows = expectEachPlanHeld(logDir("pp-copy-damaged"));
  EXPECT_NE(std::find(hows.begin(), hows.end(), "unchanged"), hows.end())
      << "no epoch tried the same plan again";
}

TEST(PipelineRecoveryTest, SigstopPastTheHeartbeatTimeout) {
  JobRun run = trainPp("pp-sigstop", 6, {"--memory-bytes", kBudget, "--steps", "30"},
                       "stop:worker=3:step=10:secs=3");
  SCOPED_TRACE(run.output);
  expectReconfiguredExact(run, "3", 5);
  EXPECT_NE(run.output.find("worker 3 declared dead"), std::string::npos);
  expectEachPlanHeld(logDir("pp-sigstop"));
}

// Worker 3 stops (SIGSTOP) right after its snapshot of step 9, so the peer that replicates
// its version 9 to worker 3 (its Gemini group partner) waits for an acknowledgement that
// cannot come until the operation deadline (20 s here). Worker 3 is declared dead, the job
// reconfigures, and the survivors' next peer-RAM version commits, which drops the old epoch's
// engine. Dropping it joined that stuck replication thread on the training thread, so the
// partner made no progress for the rest of the deadline and was expelled as well (seen as
// "workers lost: [3,2]"). Only the stopped worker may be lost.
TEST(PipelineRecoveryTest, StoppedReplicaPeerCostsOnlyItself) {
  JobRun run = trainPp("pp-stop-replica", 6, {"--memory-bytes", kBudget, "--steps", "30"},
                       "stop:worker=3:step=9:phase=snapshot:secs=30");
  SCOPED_TRACE(run.output);
  expectReconfiguredExact(run, "3", 5);
  EXPECT_EQ(run.output.find("no progress on step"), std::string::npos)
      << "a survivor was expelled for the stopped worker's stall";
}

// A worker started with SINEW_COORDINATOR joins a running pipeline job of 6 workers (two or
// three pipelines). The coordinator planned templates for up to twice the starting workers
// (TrainerOptions::maxWorkers), so at the next step boundary the 7 workers are instantiated
// from the templates anew: the joiner gets its layers, with their optimizer state, copied from
// live workers, no node is idle, and every worker ends equal to the reference.
TEST(PipelineJoinTest, AJoinedWorkerGetsAStage) {
  const std::string dir = logDir("pp-join");
  std::filesystem::remove_all(dir);  // A repeated run must not read the last coordinator.json.
  // Slowed steps keep the job running while the joiner starts.
  // The joiner trains to the same last step: one that stopped earlier would leave the job.
  // It joins before step 20 (the join's plan is epoch 2's); 60 steps leave it 40 to spare.
  const char* steps = "60";
  Child job = start({SINEW_RUN_PATH, "-n", "6", "--log-dir", dir, "--exit-grace-s", kExitGrace,
                     "--inject", "slow:worker=*:ms=50", TRAIN_PP_PATH, "--devices-per-node", "1",
                     "--memory-bytes", kBudget, "--steps", steps},
                    {});
  // sinew-run's output is read while the joiner runs, so that its pipe never fills.
  auto jobRun = std::async(std::launch::async, [&] { return finish(job, 300s); });
  const auto env = joinerEnv(dir, "joiner");
  ASSERT_FALSE(env.empty()) << "no coordinator.json";
  // (Generous: under ASan the start and the profile take most of a minute.)
  ASSERT_TRUE(waitForLog(dir, "sinew: step 10 ", 240s)) << "the job did not reach step 10";
  JobRun joined = finish(
      start({TRAIN_PP_PATH, "--devices-per-node", "1", "--memory-bytes", kBudget, "--steps", steps},
            env),
      300s);
  JobRun run = jobRun.get();
  SCOPED_TRACE(run.output + joined.output);
  EXPECT_EQ(joined.exitCode, 0);
  EXPECT_NE(run.output.find("worker 6 (node joiner) asks to join"), std::string::npos);
  expectMatchesReference(run);
  const std::vector<int> first = planNodes(run.output);
  EXPECT_GE(first.size(), 2u) << "the first plan";
  EXPECT_EQ(std::accumulate(first.begin(), first.end(), 0), 6) << "the first plan";
  // Who holds what after each plan (the join's among them: seven nodes, none idle), and at the
  // end: the six launched workers and the joiner, every one a stage.
  // The first plan and the join's are instantiated from the templates; an epoch built again
  // with the same members (a connection that timed out) keeps its plan.
  const std::vector<std::string> hows = expectEachPlanHeld(dir);
  EXPECT_EQ(std::count(hows.begin(), hows.end(), "instantiated"), 2);
  EXPECT_EQ(std::count(hows.begin(), hows.end(), "instantiated") +
                std::count(hows.begin(), hows.end(), "unchanged"),
            static_cast<std::ptrdiff_t>(hows.size()));
  ASSERT_FALSE(hows.empty());
  EXPECT_EQ(hows.front(), "instantiated");
  std::vector<WorkerLine> lines = workerLines(run.output + joined.output);
  expectStagesHoldOnlyTheirLayers(lines, 7);
  bool joinerHolds = false;
  for (const auto& w : lines) {
    EXPECT_GT(w.params, 0) << "worker " << w.worker << " is idle";
    joinerHolds = joinerHolds || (w.worker == 6 && w.params > 0);
  }
  EXPECT_TRUE(joinerHolds) << "the joiner holds no layers";
  EXPECT_TRUE(std::regex_search(
      joined.output, std::regex("sinew: worker 6 now holds layers \\S+ \\(epoch \\d+; \\d+ "
                                "copied from worker")))
      << "the joiner's layers were not copied from live workers";
  EXPECT_EQ(run.output.find("read from the durable checkpoint"), std::string::npos);
}

}  // namespace

// ---- Peer-RAM versions and rollback (issue 12; docs/pipeline.md "Peer-RAM versions" and
// "Rollback") ----
// Eight workers as two pipelines (below), so every layer has exactly f + 1 = 2 live copies
// and killing w0 and w5 loses every live copy of embed. Gemini's groups follow the stages of a
// pipeline, so their shards survive in the RAM of their group partners.
// The plan comes from a fixed profile (a measured one varies from run to run and can plan 5+3
// stages): ten equal layers of 100 kB and 450 kB per worker, so a pipeline needs three workers
// (at most four layers each); eight run pipelines of five (w0..w4) and three (w5..w7)
// stages, both starting with embed..block0, and six survivors run two of three.
std::string fourStageProfile(const std::string& path) {
  return layerProfile(path, 1, 450000, [](int) -> int64_t { return 1000; });
}

// w0 dies at step 10; w5 dies in the first reconfiguration at or after step 9, i.e. as the
// epoch after w0's death is announced, before it publishes what it holds or builds that
// epoch's communicator, so before it could copy embed to anyone, whenever it notices w0's
// death (a kill of both in forward could miss w5 if it noticed first: it would reconfigure,
// copy embed to others, and die only in the next epoch).
const char* kKillBothHoldersOfEmbed =
    "kill:worker=0:step=10:phase=forward;kill:worker=5:step=9:phase=reconfiguration";

// The version the job said it rolls back to, or -2 if it did not.
int64_t rollbackVersion(const std::string& out) {
  std::smatch m;
  if (!std::regex_search(out, m, std::regex("rolling back to version (\\d+)"))) return -2;
  return std::stoll(m[1]);
}

// Lines "worker W now holds ... (epoch E; ...)" of the epoch that restored the rollback's
// version, by worker.
std::map<int, std::string> restoreLines(const std::string& out) {
  std::map<int, std::string> lines;
  std::regex re("sinew: worker (\\d+) now holds [^\\n]*");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it) {
    const std::string line = (*it)[0];
    if (line.find("(version ") != std::string::npos ||
        line.find("read from the durable checkpoint") != std::string::npos) {
      lines[std::stoi((*it)[1])] = line;
    }
  }
  return lines;
}

// Every "eval after step S" line of the job's workers has the loss of the reference's
// evaluation after step S; returns how many lines there were.
int expectEvaluationsMatchTheReference(const std::string& out) {
  std::map<int64_t, double> ref;
  std::regex refRe("reference eval after step (\\d+): loss ([0-9.e+-]+)");
  for (std::sregex_iterator it(out.begin(), out.end(), refRe), end; it != end; ++it) {
    ref[std::stoll((*it)[1])] = std::stod((*it)[2]);
  }
  int lines = 0;
  std::regex re("worker (\\d+) eval after step (\\d+): loss ([0-9.e+-]+)");
  for (std::sregex_iterator it(out.begin(), out.end(), re), end; it != end; ++it, ++lines) {
    const int64_t step = std::stoll((*it)[2]);
    const double loss = std::stod((*it)[3]);
    auto r = ref.find(step);
    if (r == ref.end()) {
      ADD_FAILURE() << "the reference did not evaluate after step " << step;
      continue;
    }
    EXPECT_NEAR(loss, r->second, 1e-9 * r->second) << (*it)[0];
  }
  return lines;
}

// A recipe as users write it: RMSprop, warm-up + cosine, clipping at 0.5, and an evaluation on
// held-out samples every 5 steps, in a loop of the program's own over Trainer::step(). The
// optimizer's square averages and step counts are in every version, so the rollback restores
// them from RAM (AdamW's moments: PipelineGptTest.LosingEveryCopyOfTheTiedHeadRestoresItFromRam);
// the job ends equal to its reference, and every evaluation, those redone after the rollback
// included, equals the reference's after the same step.
TEST(PipelineRollbackTest, LosingEveryLiveCopyRestoresTheCommittedVersionFromRam) {
  const std::string profile = fourStageProfile(logDir("pp-rollback-ram") + "-profile.json");
  JobRun run = trainPp("pp-rollback-ram", 8,
                       {"--profile", profile, "--steps", "20", "--optimizer", "rmsprop",
                        "--schedule", "cosine", "--warmup", "4", "--lr", "0.003", "--clip", "0.5",
                        "--eval-every", "5", "--eval-samples", "128"},
                       kKillBothHoldersOfEmbed);
  SCOPED_TRACE(run.output);
  expectMatchesReference(run);
  // 4 evaluations on each of the 6 survivors, at least; those of steps 4 and 9 also on the
  // two that died, and again after a rollback.
  EXPECT_GE(expectEvaluationsMatchTheReference(run.output), 24);
  // The clipping acted: some step's whole gradient (summed over the stages) was above 0.5.
  double largestNorm = 0;
  std::regex normRe("eval after step \\d+: loss \\S+ \\(lr \\S+, grad norm ([0-9.e+-]+)\\)");
  for (std::sregex_iterator it(run.output.begin(), run.output.end(), normRe), end; it != end;
       ++it) {
    largestNorm = std::max(largestNorm, std::stod((*it)[1]));
  }
  EXPECT_GT(largestNorm, 0.5) << "no step was clipped";
  EXPECT_TRUE(run.output.find("workers lost: [0,5]") != std::string::npos ||
              run.output.find("workers lost: [5,0]") != std::string::npos);
  std::vector<WorkerLine> lines = workerLines(run.output);
  expectStagesHoldOnlyTheirLayers(lines, 6);
  for (const auto& w : lines) EXPECT_GT(w.params, 0) << "worker " << w.worker << " is idle";
  expectEachPlanHeld(logDir("pp-rollback-ram"));
  std::map<int, std::string> restored = restoreLines(run.output);
  const int64_t version = rollbackVersion(run.output);
  if (version == -2) {
    // Every replica of version 9 arrived before the kills: it is committed and restorable, so
    // nobody rolls back and the lost layers come from RAM at step 9.
    EXPECT_FALSE(restored.empty());
    for (const auto& [w, line] : restored) {
      EXPECT_NE(line.find("RAM"), std::string::npos) << line;
      EXPECT_NE(line.find("(version 9)"), std::string::npos) << line;
    }
    return;
  }
  // Otherwise version 8 is the newest committed one: a worker snapshots a version only after
  // the previous one committed, and worker 0 had snapshotted 9.
  EXPECT_NE(run.output.find("layer embed has no live copy after step 9"), std::string::npos);
  EXPECT_EQ(version, 8);
  // The program's own loop sees its step counter move back (StepResult::rolledBackTo).
  EXPECT_NE(run.output.find("'s loop moved back to step 9 and committed step 9"),
            std::string::npos);
  // Every survivor restored its layers of that version from RAM (its own or a peer's):
  // nothing from disk (there is none), nothing from the seeds.
  EXPECT_EQ(restored.size(), 6u);
  bool fromPeer = false;
  for (const auto& [w, line] : restored) {
    EXPECT_NE(line.find("(version 8)"), std::string::npos) << line;
    EXPECT_EQ(line.find("built from their seeds"), std::string::npos) << line;
    EXPECT_EQ(line.find("durable checkpoint"), std::string::npos) << line;
    fromPeer = fromPeer || line.find("from the RAM of worker") != std::string::npos;
  }
  EXPECT_TRUE(fromPeer) << "no worker restored a layer from a peer's RAM";
  // embed lived only in w0's shard (pipeline 0's stages own the shards; w5, its holder in
  // pipeline 1, owns none) and in w6's RAM: w0's partner, the first worker of the other
  // pipeline that holds none of its layers (PeerVersions::placementOrder).
  for (const auto& w : lines) {
    if (w.first != 0) continue;
    EXPECT_TRUE(w.worker == 6 ||
                restored[w.worker].find("from the RAM of worker 6") != std::string::npos)
        << restored[w.worker];
  }
}

TEST(PipelineRollbackTest, WithNoCommittedPeerVersionTheDurableOneIsRestored) {
  // Peer-RAM versions only every 100 steps: none exists when w0 and w5 die, so the job rolls
  // back to the newest durable version (every step is written). With AdamW: its moments and
  // step counts go to disk and come back.
  const std::string ckpt = logDir("pp-rollback-disk-dir");
  JobRun run = trainPp(
      "pp-rollback-disk", 8,
      {"--profile", fourStageProfile(ckpt + "-profile.json"), "--steps", "20", "--checkpoint-dir",
       ckpt, "--checkpoint-every", "1", "--peer-checkpoint-every", "100", "--optimizer", "adamw"},
      kKillBothHoldersOfEmbed);
  SCOPED_TRACE(run.output);
  expectMatchesReference(run);
  std::map<int, std::string> restored = restoreLines(run.output);
  const int64_t version = rollbackVersion(run.output);
  if (version == -2) {
    // Worker 0 wrote version 9 before it died: the lost layers come from it, no rollback.
    EXPECT_NE(run.output.find("read from the durable checkpoint (version 9)"), std::string::npos);
  } else {
    EXPECT_GE(version, 5) << "rolled back further than the flushes lag";
    EXPECT_LE(version, 8);
    EXPECT_EQ(restored.size(), 6u) << "after a rollback every survivor restores its layers";
  }
  EXPECT_FALSE(restored.empty());
  for (const auto& [w, line] : restored) {
    EXPECT_NE(line.find("read from the durable checkpoint"), std::string::npos) << line;
    EXPECT_EQ(line.find("RAM"), std::string::npos) << line;
  }
  expectStagesHoldOnlyTheirLayers(workerLines(run.output), 6);
  std::smatch m;
  const std::string latest = slurp(ckpt + "/LATEST");
  ASSERT_TRUE(std::regex_search(latest, m, std::regex("\"step\":(\\d+)"))) << latest;
  EXPECT_EQ(std::stoi(m[1]), 19) << "the last step is not durable";
  sinew::testing::removeTree(ckpt);
}

// ---- examples/train_gpt: a GPT-2-style decoder whose head is tied to its token embedding,
// trained as users train one (AdamW, warm-up + cosine, clipping at 1.0, epochs over a token
// file made from the licence texts, an evaluation every 5 steps in a loop of the program's
// own over Trainer::step()), in float64 so that exactness can be asserted.

namespace {

// train_gpt --blocks 2 --documents: every sample has two inputs (the tokens and each position's
// document id), and two tensors (the hidden states and the document ids) cross every stage
// boundary, forward and (the hidden states' gradient) back.
// Its four layers (embed, block0, block1, head), each 100 kB of parameters,
// 1 ms forward and 2 ms backward, on nodes of one worker with 250 kB each: a stage holds two
// layers at most. Five workers run a pipeline of three stages (w0..w2) and one of two (w3, w4):
// the tied tensor's two layers sit on different stages in both, and the head's holders are w2
// and w4.
std::string gptProfile(const std::string& path) {
  std::ofstream out(path);
  out << R"({"version": 1, "microbatch_size": 2, "job": {"devices_per_node": 1,
    "device_memory_bytes": 250000, "inter_stage_gbps": 10.0,
    "allreduce": {"algorithm": "ring", "bandwidth_gbps": 1000.0, "latency_us": 1.0}},
    "layers": [)";
  const char* names[] = {"embed", "block0", "block1", "head"};
  for (int l = 0; l < 4; ++l) {
    out << (l ? ", " : "") << R"({"name": ")" << names[l]
        << R"(", "forward_ms": 1.0, "backward_ms": 2.0, "param_bytes": 100000,
      "optimizer_bytes": 0, "activation_bytes": 1000, "output_bytes": 16384})";
  }
  out << "]}\n";
  return path;
}

JobRun trainGpt(const std::string& name, const std::string& inject,
                const std::vector<std::string>& more = {}) {
  const std::string profile = gptProfile(logDir(name) + "-profile.json");
  std::vector<std::string> args{"--float64", "--blocks",  "2",     "--context",
                                "32",        "--steps",   "20",    "--eval-every",
                                "5",         "--profile", profile, "--documents"};
  args.insert(args.end(), more.begin(), more.end());
  return runJob(name, 5, TRAIN_GPT_PATH, args, inject, std::chrono::seconds(300),
                {"--step-deadline-ms", "10000", "--exit-grace-s", kExitGrace});
}

// The job ends equal to the single-process reference, in which the head uses the embedding's
// tensor itself; so does its final evaluation, and every evaluation of every worker after the
// same step. Without the tied gradients summed between the stages the parameters differ by
// more than 100% (seen with the tie's reduction switched off).
void expectGptMatchesReference(const JobRun& run) {
  EXPECT_FALSE(run.timedOut) << "the job hung";
  EXPECT_EQ(run.exitCode, 0);
  Result r = parseResult(run.output);
  ASSERT_TRUE(r.found) << "no RESULT line";
  EXPECT_LE(r.maxRel, 1e-9);
  EXPECT_NEAR(r.finalLoss, r.referenceLoss, 1e-9 * r.referenceLoss);
  std::smatch m;
  ASSERT_TRUE(
      std::regex_search(run.output, m, std::regex("eval_loss=(\\S+) reference_eval_loss=(\\S+)")));
  EXPECT_NEAR(std::stod(m[1]), std::stod(m[2]), 1e-9 * std::stod(m[2]));
  EXPECT_LT(std::stod(m[1]), 4.0) << "the model did not learn (a uniform guess is ln 256 = 5.5)";
  ASSERT_TRUE(std::regex_search(run.output, m, std::regex("eval_outputs_rel_diff=(\\S+)")));
  EXPECT_GE(std::stod(m[1]), 0) << "no outputs were compared";
  EXPECT_LE(std::stod(m[1]), 1e-9) << "the evaluation's logits differ from the reference's";
  EXPECT_GE(expectEvaluationsMatchTheReference(run.output), 12);
  EXPECT_NE(run.output.find("epoch 1 plan: 2 pipelines\n"), std::string::npos);
  EXPECT_NE(run.output.find("pipeline 0: 3 nodes, 3 stages"), std::string::npos);
  EXPECT_NE(run.output.find("pipeline 1: 2 nodes, 2 stages"), std::string::npos);
}

}  // namespace

TEST(PipelineGptTest, ATiedHeadOnAnotherStageTrainsExactlyThroughAKill) {
  JobRun run = trainGpt("gpt-kill", "kill:worker=1:step=8:phase=backward");
  SCOPED_TRACE(run.output);
  expectGptMatchesReference(run);
  EXPECT_NE(run.output.find("workers lost: [1]"), std::string::npos);
  EXPECT_NE(run.output.find(" copied from worker"), std::string::npos);
}

// Incremental peer-RAM versions (--incremental-checkpoints), one every step: each version
// after a holder's first goes to it as a delta of the one it acknowledged, and the rollback
// that brings the head back from a peer's RAM ends as exact as with whole versions.
TEST(PipelineGptTest, IncrementalPeerVersionsRestoreTheTiedHeadExactly) {
  JobRun run =
      trainGpt("gpt-incremental",
               "kill:worker=2:step=10:phase=forward;kill:worker=4:step=9:phase=reconfiguration",
               {"--peer-checkpoint-every", "1", "--incremental-checkpoints"});
  SCOPED_TRACE(run.output);
  expectGptMatchesReference(run);
  EXPECT_TRUE(std::regex_search(run.output, std::regex("now holds layers [a-z0-9.]*head \\(epoch "
                                                       "\\d+; \\d+ restored from [^\\n]*RAM")))
      << "the head did not come back from RAM";
}

// Both holders of the head die (w2 in a forward, w4 as it reconfigures): the head, and with it
// the follower of the tied tensor, has no live copy and comes back from a peer-RAM version.
// Peer-RAM versions every 4 steps: the newest is that of step 7, so the job rolls back and
// redoes steps 8 and 9. With dynamic loss scaling that doubles every 3 steps, the scale comes
// back with the version: after 20 steps it is 2^16 x 2^6, as without a rollback (with the
// restore switched off it ended at 2^23: the redone steps scaled on from the current scale).
TEST(PipelineGptTest, LosingEveryCopyOfTheTiedHeadRestoresItFromRam) {
  JobRun run =
      trainGpt("gpt-rollback",
               "kill:worker=2:step=10:phase=forward;kill:worker=4:step=9:phase=reconfiguration",
               {"--loss-scaling", "3", "--peer-checkpoint-every", "4"});
  SCOPED_TRACE(run.output);
  expectGptMatchesReference(run);
  std::smatch scale;
  ASSERT_TRUE(std::regex_search(run.output, scale, std::regex("loss_scale=(\\S+)")));
  EXPECT_EQ(std::stod(scale[1]), 65536.0 * 64);
  // The program's kept state (its count of the tokens trained on) came back with the version:
  // 20 steps of 16 windows of 32 tokens, not counting the redone steps twice.
  ASSERT_TRUE(std::regex_search(run.output, scale, std::regex("tokens_seen=(\\d+)")));
  EXPECT_EQ(std::stoll(scale[1]), 20 * 16 * 32);
  EXPECT_NE(run.output.find("rolling back to version 7"), std::string::npos);
  // The program's own loop sees its step counter move back (StepResult::rolledBackTo).
  EXPECT_NE(run.output.find("'s loop moved back to step 8 and committed step 8"),
            std::string::npos);
  EXPECT_TRUE(run.output.find("workers lost: [2,4]") != std::string::npos ||
              run.output.find("workers lost: [4,2]") != std::string::npos);
  EXPECT_TRUE(std::regex_search(run.output, std::regex("now holds layers [a-z0-9.]*head \\(epoch "
                                                       "\\d+; \\d+ restored from [^\\n]*RAM")))
      << "the head did not come back from RAM";
}

// A worker that joins a pipeline job whose loop evaluates after every step: the join's epoch
// begins at a step boundary where the old members evaluate, while the joiner, which did not
// train the step before, trains the next one. Every old member abandons that evaluation alike
// (EvalResult::abandoned) and the job goes on exact. Before, the old members ran the
// evaluation's collectives against the joiner's pipeline sends ("the members' calls do not
// match") and failed, as scripts/churn on the P3 trace found.
TEST(PipelineGptTest, AJoinAtAnEvaluationsBoundaryAbandonsItAlike) {
  const std::string dir = logDir("gpt-join-eval");
  std::filesystem::remove_all(dir);  // A repeated run must not read the last coordinator.json.
  const std::string profile = gptProfile(dir + "-profile.json");
  const std::vector<std::string> gpt{"--float64", "--blocks",  "2",     "--context",
                                     "32",        "--steps",   "40",    "--eval-every",
                                     "1",         "--profile", profile, "--documents"};
  std::vector<std::string> argv{SINEW_RUN_PATH,
                                "-n",
                                "4",
                                "--log-dir",
                                dir,
                                "--exit-grace-s",
                                kExitGrace,
                                "--step-deadline-ms",
                                "10000",
                                "--inject",
                                "slow:worker=*:ms=50",
                                TRAIN_GPT_PATH};
  argv.insert(argv.end(), gpt.begin(), gpt.end());
  Child job = start(argv, {});
  // sinew-run's output is read while the joiner runs, so that its pipe never fills.
  auto jobRun = std::async(std::launch::async, [&] { return finish(job, 300s); });
  const auto env = joinerEnv(dir, "joiner");
  ASSERT_FALSE(env.empty()) << "no coordinator.json";
  ASSERT_TRUE(waitForLog(dir, "eval after step 3:", 240s)) << "the job did not reach step 3";
  std::vector<std::string> joinArgv{TRAIN_GPT_PATH};
  joinArgv.insert(joinArgv.end(), gpt.begin(), gpt.end());
  JobRun joined = finish(start(joinArgv, env), 300s);
  JobRun run = jobRun.get();
  SCOPED_TRACE(run.output + joined.output);
  EXPECT_EQ(joined.exitCode, 0);
  EXPECT_NE(run.output.find("worker 4 (node joiner) asks to join"), std::string::npos);
  EXPECT_NE(run.output.find("abandoned the eval after step"), std::string::npos)
      << "no member abandoned the evaluation at the join's boundary";
  expectGptMatchesReference(run);
  EXPECT_NE(run.output.find("workers lost: []"), std::string::npos);
}

// Every example answers --help (and -h) with its usage on stdout and exit status 0, and an
// unknown flag with the usage and exit status 2.
TEST(ExampleHelpTest, EveryExamplePrintsItsUsageAndExitsZero) {
  for (const char* program : {TRAIN_DP_PATH, TRAIN_PP_PATH, TRAIN_GPT_PATH}) {
    for (const char* flag : {"--help", "-h"}) {
      sinew::testing::ToolRun r = sinew::testing::runTool(program, flag);
      EXPECT_EQ(r.status, 0) << program << " " << flag << ": " << r.out;
      EXPECT_NE(r.out.find("usage: "), std::string::npos) << program << ": " << r.out;
      EXPECT_NE(r.out.find("--steps N"), std::string::npos) << program << ": " << r.out;
    }
    sinew::testing::ToolRun bad = sinew::testing::runTool(program, "--no-such-flag");
    EXPECT_EQ(bad.status, 2) << program << ": " << bad.out;
    EXPECT_NE(bad.out.find("--no-such-flag"), std::string::npos) << program << ": " << bad.out;
  }
}
