#include "sinew/runtime/resize_costs.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <unordered_set>

#include "sinew/base/error.h"
#include "sinew/runtime/scaling_curve.h"

namespace sinew {
namespace runtime {

using coordinator_detail::median;
using nlohmann::json;

namespace {

json orNull(double v) { return v > 0 && std::isfinite(v) ? json(v) : json(nullptr); }

}  // namespace

std::vector<std::string> distinctNodes(const std::vector<const std::string*>& nodes) {
  std::vector<std::string> out;
  std::unordered_set<std::string> seen;
  for (const std::string* node : nodes) {
    if (node && seen.insert(*node).second) out.push_back(*node);
  }
  return out;
}

int ResizeCosts::nodesKept(const std::set<int>& going) const {
  std::vector<const std::string*> staying;
  for (const auto& m : in_.members) {
    if (!m.leaving && !going.count(m.id)) staying.push_back(m.node);
  }
  if (in_.pipeline) return static_cast<int>(staying.size()) / in_.profile->job.devices_per_node;
  return static_cast<int>(distinctNodes(staying).size());
}

int ResizeCosts::workersPerNode() const {
  if (in_.pipeline) return in_.profile->job.devices_per_node;
  const int nodes = nodesKept({});
  int staying = 0;
  for (const auto& m : in_.members) staying += m.leaving ? 0 : 1;
  return nodes > 0 ? std::max(1, static_cast<int>(std::lround(1.0 * staying / nodes))) : 1;
}

std::pair<int64_t, bool> ResizeCosts::layerMoves(const pipeline::Plan& next) const {
  std::map<std::pair<int, int>, std::pair<int, int>> held;  // (node, device) -> layers
  if (in_.plan) {
    for (const auto& w : in_.plan->workers) held[{w.node, w.device}] = {w.firstLayer, w.endLayer};
  }
  std::set<int> staying;
  for (const auto& w : next.workers) staying.insert(w.node);
  std::vector<bool> live(in_.profile->layers.size(), false);
  for (const auto& [at, range] : held) {
    if (!staying.count(at.first)) continue;
    for (int l = range.first; l < range.second; ++l) live[l] = true;
  }
  int64_t bytes = 0;
  bool rollback = false;
  for (const auto& w : next.workers) {
    auto it = held.find({w.node, w.device});
    for (int l = w.firstLayer; l < w.endLayer; ++l) {
      if (it != held.end() && l >= it->second.first && l < it->second.second) continue;
      if (!live[l]) {
        rollback = true;  // No live copy: every member restores an older version.
        continue;
      }
      bytes += pipeline::copyBytes(in_.profile->layers[l]);
    }
  }
  return {bytes, rollback};
}

json ResizeCosts::resizeCost(int nodes) const {
  const int now = nodesKept({});
  json c = {{"pause_s", 0.0}, {"bytes", 0}, {"rollback", false}};
  if (nodes == now) {
    c["basis"] = "the present size";
    return c;
  }
  const EpochChanges::Prediction p = in_.changes->predictPause(nodes > now ? "grow" : "shrink");
  c["pause_s"] = p.basis == "nothing measured yet" ? json(nullptr) : json(p.pauseSeconds);
  c["basis"] = p.basis;
  if (in_.pipeline) {
    const int G = in_.profile->job.devices_per_node;
    std::vector<int> staying, nodeIds;  // a node's id is its first worker's (JobState's plans)
    for (const auto& m : in_.members) {
      if (!m.leaving) staying.push_back(m.id);
    }
    for (size_t k = 0; k + G <= staying.size(); k += G) nodeIds.push_back(staying[k]);
    // A shrink releases the last nodes; a grow adds nodes with new ids.
    if (nodes < static_cast<int>(nodeIds.size())) nodeIds.resize(nodes);
    int fresh = in_.nextWorkerId;
    while (static_cast<int>(nodeIds.size()) < nodes) {
      nodeIds.push_back(fresh);
      fresh += G;
    }
    try {
      const auto [bytes, rollback] = layerMoves(in_.planOnNodes(nodeIds));
      c["bytes"] = bytes;
      c["rollback"] = rollback;
      c["bytes_basis"] = "the layers the new plan gives workers that do not hold them";
    } catch (const Error& e) {
      c["bytes"] = nullptr;
      c["why"] = e.what();
    }
  } else if (nodes > now) {
    // The epoch that takes joiners in broadcasts the state from one member to all the others.
    int64_t perMember = in_.changes->bytesPerReceiver();
    std::string basis =
        "the state each member took in at earlier grows, times the members "
        "but the source";
    if (perMember == 0 && in_.measures->durable().bytes > 0) {
      perMember = in_.measures->durable().bytes;
      basis = "the last durable checkpoint's size, times the members but the source";
    }
    const int64_t receivers = static_cast<int64_t>(nodes) * workersPerNode() - 1;
    c["bytes"] = perMember > 0 ? json(receivers * perMember) : json(nullptr);
    c["bytes_basis"] = perMember > 0 ? basis : "not known until a grow or a checkpoint";
  } else {
    c["bytes_basis"] = "a data-parallel shrink moves no state: every member holds all of it";
  }
  return c;
}

std::pair<int, double> ResizeCosts::medianCompute() const {
  std::vector<double> c;
  for (const auto& m : in_.members) {
    if (!m.node || m.computeSeconds < 0) return {0, 0.0};
    c.push_back(m.computeSeconds);
  }
  if (c.empty()) return {0, 0.0};
  return {static_cast<int>(c.size()), median(c)};
}

json ResizeCosts::removalCost(const std::set<int>& going) const {
  std::vector<int> staying;
  double slowestNow = 0, slowestAfter = 0;
  for (const auto& m : in_.members) {
    if (m.leaving || !m.node) continue;
    slowestNow = std::max(slowestNow, m.computeSeconds);
    if (going.count(m.id)) continue;
    staying.push_back(m.id);
    slowestAfter = std::max(slowestAfter, m.computeSeconds);
  }
  json c = resizeCost(nodesKept(going));
  c["workers_after"] = staying.size();
  c["nodes_after"] = nodesKept(going);
  const auto measured = summarizeStepTimes(in_.measures->stepSecondsBySize());
  const int workersNow = static_cast<int>(in_.members.size());
  auto here = measured.find(workersNow);
  c["samples_per_s_now"] = here != measured.end() && in_.globalBatch > 0
                               ? json(in_.globalBatch / here->second.medianSeconds)
                               : json(nullptr);
  if (staying.empty()) {
    c["feasible"] = false;
    c["why"] = "no member would stay: the job would stop (POST /v1/stop)";
    c["samples_per_s_after"] = 0;
    return c;
  }
  double after = 0;
  if (in_.pipeline) {
    const int G = in_.profile->job.devices_per_node;
    std::vector<int> nodeIds;
    for (size_t k = 0; k + G <= staying.size(); k += G) nodeIds.push_back(staying[k]);
    try {
      const pipeline::Plan next = in_.planOnNodes(nodeIds);
      const auto [bytes, rollback] = layerMoves(next);
      c["bytes"] = bytes;
      c["rollback"] = rollback;
      if (here != measured.end() && in_.plan && in_.plan->iterationTicks > 0 &&
          in_.globalBatch > 0) {
        const double perTick = here->second.medianSeconds / in_.plan->iterationTicks;
        after = in_.globalBatch / (perTick * static_cast<double>(next.iterationTicks));
      }
      c["feasible"] = true;
    } catch (const Error& e) {
      c["feasible"] = false;
      c["why"] = e.what();
    }
  } else {
    const auto [cw, cs] = medianCompute();
    const DataParallelFit fit = fitDataParallel(measured, cw, cs);
    const CurvePoint p =
        predictAt(static_cast<int>(staying.size()), static_cast<double>(in_.globalBatch), measured,
                  [&](int n) { return fit.any() ? fit.stepSeconds(n) : 0.0; });
    after = p.predictedSamplesPerSecond;
    // A data-parallel step waits for its slowest member: taking a straggler away speeds up
    // the rest by the ratio of the slowest compute times (before / after).
    const double speedup =
        slowestNow > 0 && slowestAfter > 0 ? std::max(1.0, slowestNow / slowestAfter) : 1.0;
    after *= speedup;
    c["straggler_speedup"] = speedup;
    c["feasible"] = true;
  }
  c["samples_per_s_after"] = orNull(after);
  return c;
}

json ResizeCosts::nodeCosts() const {
  json costs = json::array();
  if (!in_.running) return costs;
  std::map<std::string, std::set<int>> byNode;
  for (const auto& m : in_.members) {
    if (!m.leaving && m.node) byNode[*m.node].insert(m.id);
  }
  for (const auto& [node, ids] : byNode) {
    json c = removalCost(ids);
    c["node"] = node;
    c["workers"] = ids;
    costs.push_back(c);
  }
  auto keeps = [](const json& c) {
    const json& a = c["samples_per_s_after"];
    return a.is_number() ? a.get<double>() : 0.0;
  };
  auto moves = [](const json& c) {
    const json& b = c["bytes"];
    return b.is_number() ? b.get<int64_t>() : INT64_MAX;
  };
  std::stable_sort(costs.begin(), costs.end(), [&](const json& x, const json& y) {
    if (x["rollback"] != y["rollback"]) return !x["rollback"].get<bool>();
    if (keeps(x) != keeps(y)) return keeps(x) > keeps(y);
    return moves(x) < moves(y);
  });
  return costs;
}

std::function<double(int)> ResizeCosts::stepModel(const std::map<int, MeasuredSize>& measured,
                                                  json& body, std::map<int, json>& plans,
                                                  int& lastNodes) const {
  const int workersNow = static_cast<int>(in_.members.size());
  const int nodesNow = nodesKept({});
  const int perNode = std::max(1, workersPerNode());
  if (in_.pipeline) {
    // The templates' cost model (iteration ticks), in seconds by the step time measured at the
    // present size.
    double perTick = 0;
    auto mine = measured.find(workersNow);
    if (mine != measured.end() && in_.plan && in_.plan->iterationTicks > 0) {
      perTick = mine->second.medianSeconds / in_.plan->iterationTicks;
    }
    // Beyond the node count planned for, only more copies of the planned templates fit.
    const int maxNodes = std::max(in_.templates->max_nodes, nodesNow);
    lastNodes = maxNodes + maxNodes / 2 + 1;
    std::map<int, int64_t> ticks;
    for (int n = 1; n <= lastNodes; ++n) {
      try {
        std::vector<int> ids(n);
        for (int k = 0; k < n; ++k) ids[k] = k;
        const pipeline::Plan plan = pipeline::makePlan(*in_.templates, ids, *in_.planOptions);
        ticks[n * perNode] = plan.iterationTicks;
        plans[n] = {{"feasible", true},
                    {"pipelines", plan.pipelines.size()},
                    {"iteration_ticks", plan.iterationTicks}};
      } catch (const Error& e) {
        plans[n] = {{"feasible", false}, {"why", e.what()}};
      }
    }
    body["model"] = "pipeline templates (cost model), calibrated by the measured step times";
    return [ticks, perTick](int workers) {
      auto t = ticks.find(workers);
      return t == ticks.end() ? 0.0 : perTick * static_cast<double>(t->second);
    };
  }
  const auto [cw, cs] = medianCompute();
  const DataParallelFit fit = fitDataParallel(measured, cw, cs);
  lastNodes = std::max({2 * nodesNow, nodesNow + 4, 8});
  if (!measured.empty()) lastNodes = std::max(lastNodes, measured.rbegin()->first / perNode);
  // Up to the most workers a step's microbatches can feed, and the first size past them (to
  // list as infeasible).
  const int64_t fed = in_.microbatch > 0 ? in_.globalBatch / in_.microbatch / perNode : 0;
  if (fed > 0) lastNodes = static_cast<int>(std::min<int64_t>(lastNodes, fed) + 1);
  body["model"] = fit.model;
  body["fit"] = {{"a_s", fit.a}, {"b_s", fit.b}, {"c_s", fit.c}};
  return [fit](int workers) { return fit.any() ? fit.stepSeconds(workers) : 0.0; };
}

json ResizeCosts::scaling() const {
  json body = json::object();
  const auto measured = summarizeStepTimes(in_.measures->stepSecondsBySize());
  const int perNode = std::max(1, workersPerNode());
  const double batch = static_cast<double>(in_.globalBatch);
  const int64_t remainingSteps =
      in_.totalSteps > 0 ? std::max<int64_t>(0, in_.totalSteps - in_.committed - 1) : -1;
  std::map<int, json> plans;  // pipelines: nodes -> the plan's facts, or why none fits
  int lastNodes = 1;
  const std::function<double(int)> model = stepModel(measured, body, plans, lastNodes);
  const std::optional<double> error = modelError(measured, model);
  const int64_t microbatches = in_.microbatch > 0 ? in_.globalBatch / in_.microbatch : 0;
  json points = json::array();
  for (int n = 1; n <= lastNodes; ++n) {
    const int workers = n * perNode;
    json p = {{"nodes", n}, {"workers", workers}};
    if (in_.pipeline) {
      p.update(plans.at(n));
    } else if (microbatches > 0 && workers > microbatches) {
      p["feasible"] = false;
      p["why"] = "a data-parallel step has " + std::to_string(microbatches) +
                 " microbatches: at most that many workers";
    } else {
      p["feasible"] = true;
    }
    auto m = measured.find(workers);
    if (m != measured.end() && batch > 0) {
      p["measured_samples_per_s"] = batch / m->second.medianSeconds;
      p["measured_steps"] = m->second.steps;
      // The steps' spread: the throughput of the slowest and fastest tenth's bounds.
      p["measured_p10_samples_per_s"] = batch / m->second.p90Seconds;
      p["measured_p90_samples_per_s"] = batch / m->second.p10Seconds;
    }
    if (!p.at("feasible").get<bool>()) {
      points.push_back(p);
      continue;
    }
    const CurvePoint c = predictAt(workers, batch, measured, model);
    p["predicted_samples_per_s"] = orNull(c.predictedSamplesPerSecond);
    p["basis"] = c.basis.empty() ? json(nullptr) : json(c.basis);
    if (c.basis != "measured") p["model_error"] = error ? json(*error) : json(nullptr);
    p["cost"] = resizeCost(n);
    p["within_limits"] = in_.limits->refuses(n).empty();
    if (remainingSteps >= 0) {
      p["remaining_steps"] = remainingSteps;
      const json& pause = p["cost"]["pause_s"];
      if (c.predictedSamplesPerSecond > 0) {
        p["time_to_finish_s"] = (pause.is_number() ? pause.get<double>() : 0.0) +
                                remainingSteps * batch / c.predictedSamplesPerSecond;
      } else {
        p["time_to_finish_s"] = nullptr;
      }
    }
    points.push_back(p);
  }
  json changes = json::array();
  const auto& history = in_.changes->history();
  for (size_t k = history.size() > 10 ? history.size() - 10 : 0; k < history.size(); ++k) {
    changes.push_back(EpochChanges::toJson(history[k]));
  }
  body["nodes_now"] = nodesKept({});
  body["workers_now"] = static_cast<int>(in_.members.size());
  body["workers_per_node"] = perNode;
  body["global_batch"] = in_.globalBatch;
  body["remaining_steps"] = remainingSteps >= 0 ? json(remainingSteps) : json(nullptr);
  body["points"] = points;
  body["node_costs"] = nodeCosts();
  body["reconfigurations"] = changes;
  body["limits"] = in_.limits->toJson();
  return body;
}

}  // namespace runtime
}  // namespace sinew
