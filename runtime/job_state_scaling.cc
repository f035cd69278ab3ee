#include "sinew/runtime/job_state.h"

#include "sinew/runtime/scaling_curve.h"

#include <algorithm>
#include <cmath>

namespace sinew {
namespace runtime {

// The job-state machine's scaling view and costs (docs/control_api.md, "GET /v1/scaling" and
// "Costs"): what a scheduler reads before it resizes or drains the job.

namespace {

json orNull(double v) { return v > 0 && std::isfinite(v) ? json(v) : json(nullptr); }

}  // namespace

int JobState::workersPerNode() const {
  if (pipelineJob_) return profile_.job.devices_per_node;
  const int nodes = currentNodes();
  int staying = 0;
  for (int id : members_) staying += leaving_.count(id) ? 0 : 1;
  return nodes > 0 ? std::max(1, static_cast<int>(std::lround(1.0 * staying / nodes))) : 1;
}

std::pair<int64_t, bool> JobState::layerMoves(const pipeline::Plan& next) const {
  std::map<std::pair<int, int>, std::pair<int, int>> held;  // (node, device) -> layers
  if (plan_) {
    for (const auto& w : plan_->workers) held[{w.node, w.device}] = {w.firstLayer, w.endLayer};
  }
  std::set<int> staying;
  for (const auto& w : next.workers) staying.insert(w.node);
  std::vector<bool> live(profile_.layers.size(), false);
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
      bytes += pipeline::copyBytes(profile_.layers[l]);
    }
  }
  return {bytes, rollback};
}

json JobState::resizeCost(int nodes) const {
  const int now = currentNodes();
  json c = {{"pause_s", 0.0}, {"bytes", 0}, {"rollback", false}};
  if (nodes == now) {
    c["basis"] = "the present size";
    return c;
  }
  const EpochChanges::Prediction p = changes_.predictPause(nodes > now ? "grow" : "shrink");
  c["pause_s"] = p.basis == "nothing measured yet" ? json(nullptr) : json(p.pauseSeconds);
  c["basis"] = p.basis;
  if (pipelineJob_) {
    const int G = profile_.job.devices_per_node;
    std::vector<int> staying, nodeIds;  // a node's id is its first worker's (pipelinePlan)
    for (int id : members_) {
      if (!leaving_.count(id)) staying.push_back(id);
    }
    for (size_t k = 0; k + G <= staying.size(); k += G) nodeIds.push_back(staying[k]);
    // A shrink releases the last nodes; a grow adds nodes with new ids.
    if (nodes < static_cast<int>(nodeIds.size())) nodeIds.resize(nodes);
    int fresh = workers_.empty() ? 0 : workers_.rbegin()->first + 1;
    while (static_cast<int>(nodeIds.size()) < nodes) {
      nodeIds.push_back(fresh);
      fresh += G;
    }
    try {
      const auto [bytes, rollback] = layerMoves(planOnNodes(nodeIds).plan);
      c["bytes"] = bytes;
      c["rollback"] = rollback;
      c["bytes_basis"] = "the layers the new plan gives workers that do not hold them";
    } catch (const Error& e) {
      c["bytes"] = nullptr;
      c["why"] = e.what();
    }
  } else if (nodes > now) {
    // The epoch that takes joiners in broadcasts the state from one member to all the others.
    int64_t perMember = changes_.bytesPerReceiver();
    std::string basis =
        "the state each member took in at earlier grows, times the members "
        "but the source";
    if (perMember == 0 && measures_.durable().bytes > 0) {
      perMember = measures_.durable().bytes;
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

// The members' median compute time of their last step (forward and backward, no waits), and
// their count; 0 when not every member has reported one.
std::pair<int, double> JobState::medianCompute() const {
  std::vector<double> c;
  for (int id : members_) {
    auto it = workers_.find(id);
    if (it == workers_.end() || it->second.computeSeconds < 0) return {0, 0.0};
    c.push_back(it->second.computeSeconds);
  }
  if (c.empty()) return {0, 0.0};
  return {static_cast<int>(c.size()), median(c)};
}

json JobState::removalCost(const std::set<int>& going) const {
  std::vector<int> staying;
  double slowestNow = 0, slowestAfter = 0;
  for (int id : members_) {
    auto w = workers_.find(id);
    if (leaving_.count(id) || w == workers_.end()) continue;
    const double compute = w->second.computeSeconds;
    slowestNow = std::max(slowestNow, compute);
    if (going.count(id)) continue;
    staying.push_back(id);
    slowestAfter = std::max(slowestAfter, compute);
  }
  json c = resizeCost(nodesKept(going));
  c["workers_after"] = staying.size();
  c["nodes_after"] = nodesKept(going);
  const auto measured = summarizeStepTimes(measures_.stepSecondsBySize());
  const int workersNow = static_cast<int>(members_.size());
  auto here = measured.find(workersNow);
  c["samples_per_s_now"] = here != measured.end() && globalBatch_ > 0
                               ? json(globalBatch_ / here->second.medianSeconds)
                               : json(nullptr);
  if (staying.empty()) {
    c["feasible"] = false;
    c["why"] = "no member would stay: the job would stop (POST /v1/stop)";
    c["samples_per_s_after"] = 0;
    return c;
  }
  double after = 0;
  if (pipelineJob_) {
    const int G = profile_.job.devices_per_node;
    std::vector<int> nodeIds;
    for (size_t k = 0; k + G <= staying.size(); k += G) nodeIds.push_back(staying[k]);
    try {
      const pipeline::Plan next = planOnNodes(nodeIds).plan;
      const auto [bytes, rollback] = layerMoves(next);
      c["bytes"] = bytes;
      c["rollback"] = rollback;
      if (here != measured.end() && plan_ && plan_->iterationTicks > 0 && globalBatch_ > 0) {
        const double perTick = here->second.medianSeconds / plan_->iterationTicks;
        after = globalBatch_ / (perTick * static_cast<double>(next.iterationTicks));
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
        predictAt(static_cast<int>(staying.size()), static_cast<double>(globalBatch_), measured,
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

json JobState::nodeCosts() const {
  json costs = json::array();
  if (epoch_ >= 0 && !finished_) {
    std::map<std::string, std::set<int>> byNode;
    for (int id : members_) {
      auto w = workers_.find(id);
      if (!leaving_.count(id) && w != workers_.end()) byNode[w->second.node].insert(id);
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
  }
  return costs;
}

ControlReply JobState::scaling(Clock::time_point now) {
  now_ = now;
  ControlReply r;
  const auto measured = summarizeStepTimes(measures_.stepSecondsBySize());
  const int workersNow = static_cast<int>(members_.size());
  const int nodesNow = currentNodes();
  const int perNode = std::max(1, workersPerNode());
  const double batch = static_cast<double>(globalBatch_);
  const int64_t remainingSteps =
      totalSteps_ > 0 ? std::max<int64_t>(0, totalSteps_ - committed_ - 1) : -1;
  // The model's step time by worker count, and the node counts to list.
  std::function<double(int)> model;
  std::map<int, json> plans;  // pipelines: nodes -> the plan's facts, or why none fits
  int firstNodes = 1, lastNodes = 1;
  if (pipelineJob_) {
    // The templates' cost model (iteration ticks), in seconds by the step time measured at the
    // present size.
    double perTick = 0;
    auto mine = measured.find(workersNow);
    if (mine != measured.end() && plan_ && plan_->iterationTicks > 0) {
      perTick = mine->second.medianSeconds / plan_->iterationTicks;
    }
    // Beyond the node count planned for, only more copies of the planned templates fit.
    const int maxNodes = std::max(templates_.max_nodes, nodesNow);
    lastNodes = maxNodes + maxNodes / 2 + 1;
    std::map<int, int64_t> ticks;
    for (int n = 1; n <= lastNodes; ++n) {
      try {
        std::vector<int> ids(n);
        for (int k = 0; k < n; ++k) ids[k] = k;
        const pipeline::Plan plan = pipeline::makePlan(templates_, ids, planOptions_);
        ticks[n * perNode] = plan.iterationTicks;
        plans[n] = {{"feasible", true},
                    {"pipelines", plan.pipelines.size()},
                    {"iteration_ticks", plan.iterationTicks}};
      } catch (const Error& e) {
        plans[n] = {{"feasible", false}, {"why", e.what()}};
      }
    }
    model = [ticks, perTick](int workers) {
      auto t = ticks.find(workers);
      return t == ticks.end() ? 0.0 : perTick * static_cast<double>(t->second);
    };
    r.body["model"] = "pipeline templates (cost model), calibrated by the measured step times";
  } else {
    const auto [cw, cs] = medianCompute();
    const DataParallelFit fit = fitDataParallel(measured, cw, cs);
    model = [fit](int workers) { return fit.any() ? fit.stepSeconds(workers) : 0.0; };
    lastNodes = std::max({2 * nodesNow, nodesNow + 4, 8});
    if (!measured.empty()) lastNodes = std::max(lastNodes, measured.rbegin()->first / perNode);
    // Up to the most workers a step's microbatches can feed, and the first size past them (to
    // list as infeasible).
    const int64_t fed = microbatch_ > 0 ? globalBatch_ / microbatch_ / perNode : 0;
    if (fed > 0) lastNodes = static_cast<int>(std::min<int64_t>(lastNodes, fed) + 1);
    r.body["model"] = fit.model;
    r.body["fit"] = {{"a_s", fit.a}, {"b_s", fit.b}, {"c_s", fit.c}};
  }
  const std::optional<double> error = modelError(measured, model);
  const int64_t microbatches = microbatch_ > 0 ? globalBatch_ / microbatch_ : 0;
  json points = json::array();
  for (int n = firstNodes; n <= lastNodes; ++n) {
    const int workers = n * perNode;
    json p = {{"nodes", n}, {"workers", workers}};
    if (pipelineJob_) {
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
    p["within_limits"] = limits_.refuses(n).empty();
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
  const auto& history = changes_.history();
  for (size_t k = history.size() > 10 ? history.size() - 10 : 0; k < history.size(); ++k) {
    changes.push_back(EpochChanges::toJson(history[k]));
  }
  r.body["nodes_now"] = nodesNow;
  r.body["workers_now"] = workersNow;
  r.body["workers_per_node"] = perNode;
  r.body["global_batch"] = globalBatch_;
  r.body["remaining_steps"] = remainingSteps >= 0 ? json(remainingSteps) : json(nullptr);
  r.body["points"] = points;
  r.body["node_costs"] = nodeCosts();
  r.body["reconfigurations"] = changes;
  r.body["limits"] = limits_.toJson();
  return r;
}

}  // namespace runtime
}  // namespace sinew
