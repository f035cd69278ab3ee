#include "sinew/runtime/job_state.h"

#include "sinew/base/parse.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

namespace sinew {
namespace runtime {

// The job-state machine's control API (docs/control_api.md): the views and requests a scheduler
// makes, and the Prometheus metrics.

void JobState::onVoteStats(Worker& w, const json& body) {
  if (body.contains("compute_us")) w.computeSeconds = body.at("compute_us").get<int64_t>() * 1e-6;
  if (body.contains("stall_us")) {
    const double stall = body.at("stall_us").get<int64_t>() * 1e-6;
    w.stallSeconds += stall;
    measures_.onStall(stall);
  }
  if (body.contains("replicated_bytes"))
    measures_.onReplicated(body.at("replicated_bytes").get<int64_t>());
  // Votes of older epochs never get here (onMessage drops them).
  if (body.contains("state_bytes_in")) changes_.addStateBytes(body.at("state_bytes_in"));
}

void JobState::onDurable(int worker, const json& body) {
  const int64_t step = body.at("step").get<int64_t>();
  const double flush = body.at("flush_us").get<int64_t>() * 1e-6;
  measures_.onDurable(step, body.at("path").get<std::string>(), body.at("bytes").get<int64_t>(),
                      flush, now_);
  persistThrottled();
  event({{"event", "checkpoint"},
         {"step", step},
         {"worker", worker},
         {"bytes", body.at("bytes").get<int64_t>()},
         {"flush_s", flush},
         {"path", body.at("path").get<std::string>()}});
}

void JobState::updateDrains() {
  for (auto& [id, d] : drains_) {
    if (d.releaseStep >= 0) continue;
    bool all = true;
    for (int w : d.workers) all = all && !workers_.count(w);
    if (all) d.releaseStep = committed_;
  }
}

void JobState::sendCommit(const std::vector<int>& workers, int64_t step, bool nextEpoch) {
  json body = {{"step", step}};
  if (nextEpoch) body["next_epoch"] = true;
  if (checkpointStep_ == step) body["checkpoint"] = true;
  // Workers derive their operation and recovery deadlines from it (failure_semantics.md 12).
  if (options_.progressFloor.count() > 0) body["step_deadline_ms"] = stepDeadline().count();
  const auto shared = std::make_shared<const json>(std::move(body));
  for (int worker : workers) send(worker, wire::Type::kCommit, shared);
}

// Called once per commit, before the commit is sent.
void JobState::noteCommit(int64_t step) {
  const auto now = now_;
  if (const auto steady = measures_.onCommit(now, static_cast<int>(members_.size()))) {
    changes_.onSteadyStep(*steady);
  }
  goodput_.onCommit(now, globalBatch_ > 0 ? globalBatch_ : 0);
  if (epochCommits_ == 0) {
    if (auto c = changes_.end(now, epoch_, step, static_cast<int>(members_.size()))) {
      json e = EpochChanges::toJson(*c);
      e["event"] = "reconfigured";
      event(std::move(e));
    }
  }
  epochCommits_++;
  if (const auto took = measures_.endRecovery(now)) {
    event({{"event", "recovered"}, {"step", step}, {"epoch", epoch_}, {"seconds", *took}});
  }
  if (checkpointNext_) {
    checkpointNext_ = false;
    checkpointStep_ = step;
    event({{"event", "checkpoint_requested"}, {"step", step}});
  }
}

json JobState::goodputJson(Clock::time_point now) const {
  const GoodputMeter::Account g = goodput_.at(now);
  json seconds = json::object();
  for (int c = 0; c < GoodputMeter::kCauses; ++c)
    seconds[GoodputMeter::causeName(c)] = g.seconds[c];
  return {{"samples", g.samples},
          {"wall_s", g.wall_s},
          {"samples_per_s", g.wall_s > 0 ? g.samples / g.wall_s : 0.0},
          {"effective_share", g.wall_s > 0 ? g.seconds[GoodputMeter::kTraining] / g.wall_s : 0.0},
          {"seconds", seconds}};
}

std::string JobState::state() const {
  if (jobFailed_ || (epoch_ >= 0 && members_.empty() && !finished_)) return "failed";
  if (finished_) return "finished";
  if (epoch_ < 0) return "starting";
  if (stopRequested_ || !leaving_.empty()) return "draining";
  if (measures_.recovering() || (epoch_ > 0 && epochCommits_ == 0)) return "reconfiguring";
  if (checkpointNext_ || checkpointStep_ > measures_.durable().step) return "checkpointing";
  return "running";
}

json JobState::outcome() const {
  const bool failed = state() == "failed" || epoch_ < 0;
  const char* outcome = failed       ? "failed"
                        : !finished_ ? "running"
                        : stopped_   ? "stopped"
                                     : "finished";
  json o{{"outcome", outcome},    {"step", committed_},
         {"epoch", epoch_},       {"workers_lost", dead_},
         {"released", released_}, {"last_durable", measures_.durableJson(now_)}};
  o["exit_status"] = failed ? 1 : finished_ ? (stopped_ ? 75 : 0) : -1;
  if (!failed) return o;
  if (jobFailed_) {
    o["reason"] = failReason_;
  } else if (epoch_ < 0) {
    o["reason"] = "it never started: " + std::to_string(hellos_.size()) + " of " +
                  std::to_string(options_.expectedWorkers) + " workers said hello";
  } else {
    o["reason"] = "every member was lost before the last step; the last: " + lastLoss_;
  }
  return o;
}

std::vector<std::string> JobState::nodesOf(const std::vector<int>& workers) const {
  std::vector<const std::string*> nodes;
  for (int id : workers) {
    auto it = workers_.find(id);
    if (it != workers_.end()) nodes.push_back(&it->second.node);
  }
  return distinctNodes(nodes);
}

// Nodes the job trains on and keeps (members not on their way out).
int JobState::currentNodes() const { return nodesKept({}); }

int JobState::nodesKept(const std::set<int>& going) const {
  return ResizeCosts(costInputs()).nodesKept(going);
}

json JobState::drainJson(const Drain& d) const {
  bool safe = true;
  json workers = json::array();
  for (int id : d.workers) {
    std::string st;
    auto r = releasedWorkers_.find(id);
    if (r != releasedWorkers_.end()) {
      st = r->second.exited ? "exited" : "released";
      safe = safe && r->second.exited;
    } else if (workers_.count(id)) {
      st = "training";
      safe = false;
    } else {
      st = "dead";  // declared dead (or expelled at the deadline): the job no longer needs it
    }
    workers.push_back({{"worker", id}, {"state", st}});
  }
  const bool durable =
      !checkpointsOn_ || (d.releaseStep >= 0 && measures_.durable().step >= d.releaseStep);
  json out = {{"id", d.id},
              {"workers", workers},
              {"deadline_s", d.deadlineSeconds},
              {"requested_at", d.requestedAt},
              {"release_step", d.releaseStep >= 0 ? json(d.releaseStep) : json(nullptr)},
              {"checkpoint_durable", checkpointsOn_ ? json(durable) : json(nullptr)},
              {"deadline_missed", d.expelled},
              {"safe_to_kill", safe}};
  return out;
}

ControlReply JobState::status(Clock::time_point now) {
  now_ = now;
  ControlReply r;
  json& b = r.body;
  b["state"] = state();
  b["step"] = committed_ + 1;
  b["committed_step"] = committed_;
  b["steps"] = totalSteps_ > 0 ? json(totalSteps_) : json(nullptr);
  b["epoch"] = epoch_;
  const double step = measures_.medianStepSeconds();
  b["step_time_s"] = step > 0 ? json(step) : json(nullptr);
  json members = json::array();
  for (int id : members_) {
    auto it = workers_.find(id);
    if (it == workers_.end()) continue;
    const Worker& w = it->second;
    json m = {{"worker", id},
              {"node", w.node},
              {"pid", w.pid},
              {"heartbeat_age_s", secondsOf(now - w.lastHeard)},
              {"step", w.step},
              {"waiting", w.waiting},
              {"leaving", leaving_.count(id) > 0}};
    m["compute_s"] = w.computeSeconds >= 0 ? json(w.computeSeconds) : json(nullptr);
    // The share of the step this worker spent computing (the rest it waited on the others).
    m["step_time_share"] = w.computeSeconds >= 0 && step > 0
                               ? json(std::min(1.0, w.computeSeconds / step))
                               : json(nullptr);
    m["checkpoint_stall_s"] = w.stallSeconds;
    members.push_back(m);
  }
  b["members"] = members;
  b["pending_joiners"] = pendingJoin_;
  b["nodes"] = currentNodes();
  if (plans_.on() && !members_.empty()) {
    try {
      b["plan"] = json::parse(pipeline::planToJson(
          plans_.current() ? *plans_.current() : plans_.forMembers(members_, epoch_).plan));
    } catch (const std::exception& e) {
      b["plan"] = json{{"error", e.what()}};
    }
  } else {
    b["plan"] = json{{"mode", "data_parallel"}, {"workers", members_.size()}};
  }
  // Every version is committed when it is durable (peer-RAM versions come with issue 12).
  b["checkpoint"] = {{"enabled", checkpointsOn_},
                     {"last_committed", measures_.durableJson(now)},
                     {"last_durable", measures_.durableJson(now)},
                     {"requested_step", checkpointNext_ ? json("next") : json(checkpointStep_)}};
  measures_.addStatus(b, now, globalBatch_);
  b["goodput"] = goodputJson(now);
  b["wall_s"] = secondsOf(now - startTime_);
  b["dead"] = dead_;
  json released = json::array();
  for (const auto& [id, rw] : releasedWorkers_) {
    released.push_back(
        {{"worker", id}, {"node", rw.node}, {"step", rw.step}, {"exited", rw.exited}});
  }
  b["released"] = released;
  json drains = json::array();
  for (const auto& [id, d] : drains_) drains.push_back(drainJson(d));
  b["drains"] = drains;
  b["last_resize"] = lastResize_.is_null() ? json(nullptr) : lastResize_;
  b["limits"] = limits_.toJson();
  b["stop"] = stopRequested_ ? json{{"deadline_s", stopDeadline_}} : json(nullptr);
  return r;
}

ControlReply JobState::limits(const json& update, Clock::time_point at) {
  now_ = at;
  if (finished_ || jobFailed_) return refusal(409, "the job has ended (" + state() + ")");
  control::JobLimits next;
  try {
    next = control::parseLimits(update, limits_);
  } catch (const InvalidArgument& e) {
    return refusal(400, e.what());
  }
  const bool changed = next.toJson() != limits_.toJson();
  limits_ = std::move(next);
  ControlReply r;
  r.body = {{"limits", limits_.toJson()}, {"nodes_now", epoch_ >= 0 ? currentNodes() : 0}};
  if (epoch_ >= 0) {
    const std::string why = limits_.refuses(currentNodes());
    if (!why.empty()) r.body["warning"] = "the job's present size is " + why;
  }
  if (changed) {
    event({{"event", "limits"}, {"limits", limits_.toJson()}});
    // Stored with the job's state (HA): now, once the job has a state to take over; before the
    // first epoch, or while a takeover waits for its members, the next store carries them.
    if (epoch_ >= 0 && !takingOver_ && !persistState()) {
      return refusal(409, "this coordinator no longer leads the job");
    }
  }
  return r;
}

ControlReply JobState::resize(int64_t nodes, Clock::time_point at) {
  now_ = at;
  if (epoch_ < 0) return refusal(409, "the job has not started: no epoch has formed yet");
  if (finished_ || jobFailed_) return refusal(409, "the job has ended (" + state() + ")");
  if (stopRequested_) return refusal(409, "the job is stopping");
  if (const std::string why = limits_.refuses(nodes); !why.empty()) {
    return refusal(409, "resize to " + std::to_string(nodes) + " nodes: " + why +
                            " (POST /v1/limits changes them)");
  }
  const int now = currentNodes();
  ControlReply r;
  r.body = {{"from", now}, {"to", nodes}, {"at_step", committed_ + 1}};
  // The target holds for joiners too: one that connects while the job is at it (a retried
  // grow, a worker started by hand) is released at once (onHello).
  targetNodes_ = static_cast<int>(nodes);
  if (nodes <= now && !pendingJoin_.empty()) {
    std::vector<int> surplus = pendingJoin_;
    for (int id : surplus) {
      release(id, "the job was resized to " + std::to_string(nodes) + " nodes before it joined");
    }
    r.body["released_joiners"] = surplus;
  }
  if (plans_.on()) {
    const int G = plans_.devicesPerNode();
    try {
      std::vector<int> ids(nodes);
      for (int k = 0; k < nodes; ++k) ids[k] = k;
      pipeline::makePlan(plans_.templates(), ids, plans_.options());
    } catch (const Error& e) {
      return refusal(409, "no pipeline plan fits " + std::to_string(nodes) + " nodes: " + e.what());
    }
    if (nodes < now) {
      // The last nodes (node k is members [kG, kG + G)): every pipeline node costs the same.
      std::vector<int> staying;
      for (int id : members_) {
        if (!leaving_.count(id)) staying.push_back(id);
      }
      std::vector<int> release(staying.begin() + nodes * G, staying.end());
      for (int id : release) {
        leaving_.insert(id);
        leaveReason_[id] = "released by a resize to " + std::to_string(nodes) + " nodes";
      }
      r.body["action"] = "shrink";
      r.body["release_workers"] = release;
      lastResize_ = r.body;
      event({{"event", "resize"}, {"from", now}, {"to", nodes}, {"release", release}});
      return r;
    }
  } else if (nodes < now) {
    // The nodes whose loss costs least: the slowest (their workers' compute time, highest
    // first), then the newest (highest id).
    std::map<std::string, std::pair<double, int>> cost;  // node -> (compute, highest id)
    for (int id : members_) {
      if (leaving_.count(id)) continue;
      const Worker& w = workers_.at(id);
      auto& c = cost[w.node];
      c.first = std::max(c.first, w.computeSeconds);
      c.second = std::max(c.second, id);
    }
    std::vector<std::pair<std::string, std::pair<double, int>>> order(cost.begin(), cost.end());
    std::sort(order.begin(), order.end(), [](const auto& x, const auto& y) {
      return x.second.first != y.second.first ? x.second.first > y.second.first
                                              : x.second.second > y.second.second;
    });
    json released = json::array();
    for (int k = 0; k < now - nodes; ++k) {
      std::vector<int> ws;
      for (int id : members_) {
        if (!leaving_.count(id) && workers_.at(id).node == order[k].first) ws.push_back(id);
      }
      for (int id : ws) {
        leaving_.insert(id);
        leaveReason_[id] = "released by a resize to " + std::to_string(nodes) + " nodes";
      }
      released.push_back({{"node", order[k].first}, {"workers", ws}});
    }
    r.body["action"] = "shrink";
    r.body["release"] = released;
    lastResize_ = r.body;
    event({{"event", "resize"}, {"from", now}, {"to", nodes}, {"release", released}});
    return r;
  }
  if (nodes == now) {
    r.body["action"] = "none";
    return r;
  }
  // Growth: joiners are admitted at the next step boundary after they say hello. Those
  // connected and those a launcher is still starting count towards the target.
  const int perNode = plans_.on() ? plans_.devicesPerNode() : 1;
  const int pending =
      (static_cast<int>(pendingJoin_.size()) + joinersStarting_ + perNode - 1) / perNode;
  const int need = static_cast<int>(nodes) - now - pending;
  int started = 0;
  if (need > 0 && options_.startWorkers) {
    const int workers = options_.startWorkers(need * perNode);
    joinersStarting_ += workers;
    started = workers / perNode;
    if (workers > 0 && started == 0) started = 1;  // A node's first workers are on their way.
  }
  if (need > 0 && options_.startWorkers && started == 0) {
    return refusal(409, "the launcher may start no more workers (sinew-run --max-workers)");
  }
  r.body["action"] = "grow";
  r.body["pending_joiners"] = pendingJoin_;
  r.body["started"] = started;
  r.body["joiners_needed"] = std::max(0, need - started);
  if (need - started > 0) {
    r.body["how"] =
        "start " + std::to_string(need - started) +
        " more worker(s) with SINEW_COORDINATOR and SINEW_TOKEN set (coordinator.json); each "
        "joins at the next step boundary after it connects";
  }
  lastResize_ = r.body;
  event({{"event", "resize"}, {"from", now}, {"to", nodes}, {"started", started}});
  return r;
}

ControlReply JobState::drain(const control::DrainRequest& request, Clock::time_point now) {
  now_ = now;
  ControlReply r;
  if (epoch_ < 0) return refusal(409, "the job has not started: no epoch has formed yet");
  if (finished_ || jobFailed_) return refusal(409, "the job has ended (" + state() + ")");
  std::set<int> chosen;
  for (int id : request.workers) {
    if (!workers_.count(id)) {
      return refusal(400, "drain: worker " + std::to_string(id) + " is not in the job");
    }
    chosen.insert(id);
  }
  for (const std::string& node : request.nodes) {
    bool any = false;
    for (const auto& [id, w] : workers_) {
      if (w.node == node && !done_.count(id)) {
        chosen.insert(id);
        any = true;
      }
    }
    if (!any) return refusal(400, "drain: no worker of the job is on node '" + node + "'");
  }
  // A drain below the job's minimum: a scheduler that must have those nodes stops the job
  // (POST /v1/stop), or lowers the minimum first.
  if (limits_.minNodes > 0) {
    const int64_t left = nodesKept(chosen);
    // A job already below its minimum (after failures) may still drain what does not
    // shrink it (a worker not yet training, part of a node).
    if (left < limits_.minNodes && left < currentNodes()) {
      return refusal(
          409, "drain: it would leave " + std::to_string(left) +
                   " nodes, below the job's min_nodes " + std::to_string(limits_.minNodes) +
                   (limits_.preemptible ? " (stop the job, or lower min_nodes with POST /v1/limits)"
                                        : " and the job is not preemptible"));
    }
  }
  if (request.dryRun) {
    r.body = {{"dry_run", true},
              {"workers", std::vector<int>(chosen.begin(), chosen.end())},
              {"nodes", nodesOf(std::vector<int>(chosen.begin(), chosen.end()))},
              {"cost", ResizeCosts(costInputs()).removalCost(chosen)}};
    return r;
  }
  // What it takes: the rest of this step, then the checkpoint of it.
  const double step = measures_.medianStepSeconds();
  const double flush = measures_.meanFlushSeconds();
  const double estimate = step + (checkpointsOn_ ? flush : 0);
  // Priced before its workers are on their way out, as the dry run prices it.
  const json cost = ResizeCosts(costInputs()).removalCost(chosen);
  Drain d;
  d.id = nextDrain_++;
  d.workers.assign(chosen.begin(), chosen.end());
  d.deadlineSeconds = request.deadlineSeconds;
  d.requestedAt = wallSeconds();
  std::vector<int> pendingNow;
  for (int id : d.workers) {
    if (std::find(members_.begin(), members_.end(), id) == members_.end()) {
      pendingNow.push_back(id);  // Not training yet: it goes at once.
      continue;
    }
    leaving_.insert(id);
    leaveReason_[id] = "drained (request " + std::to_string(d.id) + ")";
  }
  if (checkpointsOn_) checkpointNext_ = true;
  d.deadline = now_ + std::chrono::milliseconds(static_cast<int64_t>(d.deadlineSeconds * 1e3));
  const int id = d.id;
  auto [it, inserted] = drains_.emplace(d.id, std::move(d));
  for (int w : pendingNow)
    release(w, "drained (request " + std::to_string(id) + ") before it trained");
  const Drain& stored = it->second;
  r.body = drainJson(stored);
  r.body["estimate_s"] = estimate;
  r.body["meets_deadline"] = estimate <= stored.deadlineSeconds;
  if (estimate > stored.deadlineSeconds) {
    r.body["warning"] = "the deadline is shorter than a step plus a checkpoint flush (" +
                        std::to_string(estimate) +
                        " s measured): workers still training at the deadline are declared "
                        "dead then, and the job goes on from the last committed step";
  }
  r.body["nodes"] = nodesOf(stored.workers);
  r.body["cost"] = cost;
  event({{"event", "drain"},
         {"id", stored.id},
         {"workers", stored.workers},
         {"deadline_s", stored.deadlineSeconds},
         {"estimate_s", estimate}});
  return r;
}

ControlReply JobState::checkpoint(Clock::time_point now) {
  now_ = now;
  if (!checkpointsOn_) {
    return refusal(409,
                   "this job writes no checkpoints (start it with a checkpoint directory, e.g. "
                   "train_dp --checkpoint-dir DIR)");
  }
  if (epoch_ < 0 || finished_ || jobFailed_) {
    return refusal(409, "the job is " + state() + ": no step boundary to checkpoint at");
  }
  ControlReply r;
  checkpointNext_ = true;
  r.body = {{"at_step", committed_ + 1}, {"last_durable", measures_.durableJson(now_)}};
  return r;
}

ControlReply JobState::stop(double deadlineSeconds, Clock::time_point now) {
  now_ = now;
  if (epoch_ < 0 || finished_ || jobFailed_) {
    return refusal(409, "the job is " + state() + ": nothing to stop");
  }
  ControlReply r;
  stopRequested_ = true;
  stopDeadline_ = deadlineSeconds;
  for (int id : members_) {
    leaving_.insert(id);
    leaveReason_[id] = "stopped by the control API";
  }
  std::vector<int> waiting = pendingJoin_;
  for (int id : waiting) release(id, "the job is stopping");
  if (checkpointsOn_) checkpointNext_ = true;
  if (deadlineSeconds > 0) {
    stopAt_ = now_ + std::chrono::milliseconds(static_cast<int64_t>(deadlineSeconds * 1e3));
  }
  r.body = {{"at_step", committed_ + 1},
            {"checkpoint", checkpointsOn_},
            {"deadline_s", deadlineSeconds > 0 ? json(deadlineSeconds) : json(nullptr)}};
  if (!checkpointsOn_) {
    r.body["warning"] = "this job writes no checkpoints: its state ends with it";
  }
  event({{"event", "stop_requested"}, {"deadline_s", deadlineSeconds}});
  return r;
}

std::string JobState::metrics(Clock::time_point now) {
  now_ = now;
  std::string out;
  appendMetric(out, "sinew_step", "gauge", "The next step the job runs (last committed + 1).",
               committed_ + 1);
  appendMetric(out, "sinew_epoch", "gauge", "The current epoch (membership version).", epoch_);
  appendMetric(out, "sinew_members", "gauge", "Workers training in the current epoch.",
               members_.size());
  appendMetric(out, "sinew_nodes", "gauge", "Nodes the job trains on.", currentNodes());
  appendMetric(out, "sinew_samples_per_second", "gauge",
               "Samples per second over the last steps (0 while not training).",
               measures_.samplesPerSecondNow(now, globalBatch_));
  measures_.addMetrics(out);
  const GoodputMeter::Account g = goodput_.at(now);
  appendMetric(
      out, "sinew_goodput_samples_total", "counter",
      "Samples of the steps that stayed committed, since the first commit (docs/goodput.md).",
      g.samples);
  out +=
      "# HELP sinew_goodput_seconds_total Wall time since the first commit by cause: training "
      "that stayed committed, redone (steps in flight lost), reconfiguration, rollback.\n";
  out += "# TYPE sinew_goodput_seconds_total counter\n";
  for (int c = 0; c < GoodputMeter::kCauses; ++c) {
    char buf[128];
    std::snprintf(buf, sizeof(buf), "sinew_goodput_seconds_total{cause=\"%s\"} %.6f\n",
                  GoodputMeter::causeName(c), g.seconds[c]);
    out += buf;
  }
  out += "# HELP sinew_worker_heartbeat_age_seconds Seconds since each member was last heard.\n";
  out += "# TYPE sinew_worker_heartbeat_age_seconds gauge\n";
  for (int id : members_) {
    auto it = workers_.find(id);
    if (it == workers_.end()) continue;
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.6f", secondsOf(now - it->second.lastHeard));
    out += "sinew_worker_heartbeat_age_seconds{worker=\"" + std::to_string(id) + "\",node=\"" +
           labelValue(it->second.node) + "\"} " + buf + "\n";
  }
  out += "# HELP sinew_state The job's state (1 for the present one).\n";
  out += "# TYPE sinew_state gauge\n";
  const std::string st = state();
  for (const char* s : {"starting", "running", "reconfiguring", "draining", "checkpointing",
                        "finished", "failed"}) {
    out += std::string("sinew_state{state=\"") + s + "\"} " + (st == s ? "1" : "0") + "\n";
  }
  return out;
}

}  // namespace runtime
}  // namespace sinew
