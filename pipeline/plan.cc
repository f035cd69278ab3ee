#include "sinew/pipeline/plan.h"

#include <algorithm>
#include <limits>
#include <map>

#include <nlohmann/json.hpp>

#include "sinew/base/error.h"
#include "sinew/base/parse.h"

namespace sinew {
namespace pipeline {

Plan Plan::dataParallel(int64_t epoch, const std::vector<int>& members, int numLayers,
                        int64_t microbatchesPerStep) {
  SINEW_ENFORCE(!members.empty(), "a plan needs at least one member");
  std::vector<int> sorted = members;
  std::sort(sorted.begin(), sorted.end());
  Plan p;
  p.epoch = epoch;
  p.numLayers = numLayers;
  p.microbatchesPerStep = microbatchesPerStep;
  const int64_t w = static_cast<int64_t>(sorted.size());
  for (int64_t r = 0; r < w; ++r) {
    PipelinePlan pp;
    pp.nodes = 1;
    pp.nodeIds = {sorted[r]};
    WorkerAssignment a;
    a.worker = sorted[r];
    a.node = sorted[r];
    a.pipeline = static_cast<int>(r);
    a.stage = 0;
    a.firstLayer = 0;
    a.endLayer = numLayers;
    for (int64_t m = microbatchesPerStep * r / w; m < microbatchesPerStep * (r + 1) / w; ++m) {
      a.microbatches.push_back(m);
    }
    pp.microbatches = static_cast<int64_t>(a.microbatches.size());
    p.pipelines.push_back(std::move(pp));
    p.workers.push_back(std::move(a));
  }
  return p;
}

const WorkerAssignment* Plan::find(int worker) const {
  for (const auto& a : workers) {
    if (a.worker == worker) return &a;
  }
  return nullptr;
}

const WorkerAssignment& Plan::of(int worker) const {
  if (const WorkerAssignment* a = find(worker)) return *a;
  SINEW_THROW(InvalidArgument, "worker ", worker, " is not in the plan of epoch ", epoch);
}

namespace {

using nlohmann::json;

constexpr int64_t kMaxId = int64_t{1} << 24;     // worker and node ids (wire::kMaxWorkerId)
constexpr int64_t kMaxCount = int64_t{1} << 40;  // microbatches, ticks bound below

[[noreturn]] void bad(const std::string& field, const std::string& why) {
  SINEW_THROW(Corruption, "plan: ", field, " ", why);
}

int64_t intField(const json& obj, const char* key, int64_t lo, int64_t hi,
                 const std::string& where) {
  const std::string field = where + key;
  if (!obj.is_object() || !obj.contains(key)) bad(field, "is missing");
  const json& v = obj.at(key);
  if (!v.is_number_integer()) bad(field, "is not an integer: " + v.dump());
  if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(hi)) {
    bad(field, "is out of range: " + v.dump());
  }
  int64_t x = v.get<int64_t>();
  if (x < lo || x > hi) {
    bad(field, "= " + std::to_string(x) + " is outside [" + std::to_string(lo) + ", " +
                   std::to_string(hi) + "]");
  }
  return x;
}

const json& arrayField(const json& obj, const char* key, size_t maxSize, const std::string& where) {
  if (!obj.contains(key) || !obj.at(key).is_array()) bad(where + key, "is not an array");
  const json& a = obj.at(key);
  if (a.size() > maxSize) bad(where + key, "has more than " + std::to_string(maxSize) + " entries");
  return a;
}

int64_t intAt(const json& a, size_t i, int64_t lo, int64_t hi, const std::string& field) {
  const json& v = a.at(i);
  if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(hi)) ||
      v.get<int64_t>() < lo || v.get<int64_t>() > hi) {
    bad(field + "[" + std::to_string(i) + "]",
        "= " + v.dump() + " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  return v.get<int64_t>();
}

}  // namespace

std::string planToJson(const Plan& plan) {
  json pipes = json::array();
  for (const PipelinePlan& p : plan.pipelines) {
    pipes.push_back({{"nodes", p.nodes},
                     {"node_ids", p.nodeIds},
                     {"microbatches", p.microbatches},
                     {"iteration_ticks", p.iterationTicks}});
  }
  json workers = json::array();
  for (const WorkerAssignment& w : plan.workers) {
    workers.push_back({w.worker, w.node, w.device, w.pipeline, w.stage, w.firstLayer, w.endLayer});
  }
  json j = {{"epoch", plan.epoch},
            {"num_layers", plan.numLayers},
            {"microbatches", plan.microbatchesPerStep},
            {"fault_tolerance", plan.faultTolerance},
            {"iteration_ticks", plan.iterationTicks},
            {"idle", plan.idleNodeIds},
            {"pipelines", pipes},
            {"workers", workers}};
  return j.dump();
}

Plan planFromJson(const std::string& text) {
  if (detail::jsonTooDeep(text)) {
    bad("text", "nests JSON deeper than " + std::to_string(detail::kMaxJsonDepth) + " levels");
  }
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) bad("text", "is not a JSON object");
  Plan plan;
  const int64_t maxTicks = std::numeric_limits<int64_t>::max() / 4;
  plan.epoch = intField(j, "epoch", -1, kMaxCount, "");
  plan.numLayers = static_cast<int>(intField(j, "num_layers", 1, 1 << 24, ""));
  plan.microbatchesPerStep = intField(j, "microbatches", 1, INT32_MAX, "");
  plan.faultTolerance = static_cast<int>(intField(j, "fault_tolerance", 0, kMaxId, ""));
  plan.iterationTicks = intField(j, "iteration_ticks", 0, maxTicks, "");
  // A named (empty) prefix, not a temporary string: the arrays are references into j, which
  // GCC 13's -Wdangling-reference cannot tell when an argument is a temporary.
  const std::string top;
  const json& idle = arrayField(j, "idle", kMaxId, top);
  for (size_t i = 0; i < idle.size(); ++i) {
    plan.idleNodeIds.push_back(static_cast<int>(intAt(idle, i, 0, kMaxId - 1, "idle")));
  }
  const json& pipes = arrayField(j, "pipelines", kMaxId, top);
  if (pipes.empty()) bad("pipelines", "is empty");
  int64_t total = 0;
  std::vector<int64_t> firstMicrobatch;
  for (size_t p = 0; p < pipes.size(); ++p) {
    const std::string where = "pipelines[" + std::to_string(p) + "].";
    PipelinePlan pp;
    pp.nodes = static_cast<int>(intField(pipes[p], "nodes", 1, kMaxId, where));
    const json& ids = arrayField(pipes[p], "node_ids", kMaxId, where);
    if (static_cast<int64_t>(ids.size()) != pp.nodes) {
      bad(where + "node_ids",
          "has " + std::to_string(ids.size()) + " ids for " + std::to_string(pp.nodes) + " nodes");
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      pp.nodeIds.push_back(static_cast<int>(intAt(ids, i, 0, kMaxId - 1, where + "node_ids")));
    }
    pp.microbatches = intField(pipes[p], "microbatches", 0, plan.microbatchesPerStep, where);
    pp.iterationTicks = intField(pipes[p], "iteration_ticks", 0, maxTicks, where);
    firstMicrobatch.push_back(total);
    total += pp.microbatches;
    plan.pipelines.push_back(std::move(pp));
  }
  if (total != plan.microbatchesPerStep) {
    bad("pipelines", "run " + std::to_string(total) + " microbatches, not the global batch's " +
                         std::to_string(plan.microbatchesPerStep));
  }
  const json& workers = arrayField(j, "workers", kMaxId, top);
  std::vector<int> stagesSeen(plan.pipelines.size(), 0);
  std::map<int, size_t> listedAt;  // worker id -> its index in workers
  for (size_t i = 0; i < workers.size(); ++i) {
    const std::string field = "workers[" + std::to_string(i) + "]";
    const json& w = workers[i];
    if (!w.is_array() || w.size() != 7)
      bad(field,
          "is not [worker, node, device, pipeline, "
          "stage, first_layer, end_layer]");
    WorkerAssignment a;
    a.worker = static_cast<int>(intAt(w, 0, 0, kMaxId - 1, field));
    a.node = static_cast<int>(intAt(w, 1, 0, kMaxId - 1, field));
    a.device = static_cast<int>(intAt(w, 2, 0, 4095, field));
    a.pipeline = static_cast<int>(intAt(w, 3, 0, static_cast<int64_t>(pipes.size()) - 1, field));
    a.stage = static_cast<int>(intAt(w, 4, 0, plan.numLayers - 1, field));
    a.firstLayer = static_cast<int>(intAt(w, 5, 0, plan.numLayers - 1, field));
    a.endLayer = static_cast<int>(intAt(w, 6, a.firstLayer + 1, plan.numLayers, field));
    if (const auto [at, fresh] = listedAt.emplace(a.worker, i); !fresh) {
      bad(field, "lists worker " + std::to_string(a.worker) + " again (workers[" +
                     std::to_string(at->second) + "] has it)");
    }
    if (a.stage > stagesSeen[a.pipeline]) {
      bad(field, "skips a stage of pipeline " + std::to_string(a.pipeline));
    }
    stagesSeen[a.pipeline] = std::max(stagesSeen[a.pipeline], a.stage + 1);
    const int64_t first = firstMicrobatch[a.pipeline];
    for (int64_t m = first; m < first + plan.pipelines[a.pipeline].microbatches; ++m) {
      a.microbatches.push_back(m);
    }
    plan.workers.push_back(std::move(a));
  }
  return plan;
}

}  // namespace pipeline
}  // namespace sinew
