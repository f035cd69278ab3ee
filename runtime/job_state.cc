#include "sinew/runtime/job_state.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>

#include "sinew/base/parse.h"
#include "sinew/pipeline/instantiation.h"
#include "sinew/pipeline/reconfiguration.h"

namespace sinew {
namespace runtime {

JobState::JobState(const CoordinatorOptions& options, uint16_t storePort, Clock::time_point now)
    : options_(options), storePort_(storePort), now_(now) {
  startTime_ = now;
  limits_ = options_.limits;
  nextCheck_ = now + options_.heartbeatInterval / 2;
  // A new job waits startTimeout for its ranks; a takeover waits takeoverWait for the
  // members of the previous leader's epoch.
  const bool takeover = !options_.takeoverState.empty();
  if (takeover) restoreState(options_.takeoverState);  // InvalidArgument names a bad field.
  startDeadline_ = now + (takeover ? options_.takeoverWait : options_.startTimeout);
}

CoordinatorStatus JobState::coordinatorStatus() const {
  CoordinatorStatus s;
  s.epoch = epoch_;
  s.committedStep = committed_;
  s.members = members_;
  s.dead = dead_;
  s.released = released_;
  s.stopped = stopped_;
  s.done = std::vector<int>(done_.begin(), done_.end());
  s.finished = finished_;
  s.droppedConnections = dropped_;
  s.ignoredMessages = ignored_;
  s.pids = pids_;
  s.failed = jobFailed_;
  s.deposed = deposed_;
  s.connected = static_cast<int>(sessionWorker_.size());
  for (const auto& [id, r] : releasedWorkers_) {
    if (!r.exited) s.releasedRunning.push_back(id);
  }
  return s;
}

int JobState::workerOf(SessionId s) const {
  auto it = sessionWorker_.find(s);
  return it == sessionWorker_.end() ? -1 : it->second;
}

void JobState::onFrame(SessionId s, uint8_t type, int64_t epoch, const json& body,
                       Clock::time_point now) {
  now_ = now;
  if (deposed_) return;
  try {
    onMessage(s, type, epoch, body);
  } catch (...) {
    settle();
    throw;
  }
  settle();
}

void JobState::tick(Clock::time_point now) {
  now_ = now;
  if (deposed_) return;
  if (now >= nextCheck_) {
    check(now);
    nextCheck_ = now + options_.heartbeatInterval / 2;
  }
  if (now >= startDeadline_) {
    startDeadline_ = Clock::time_point::max();
    if (takingOver_) {
      formTakeoverEpoch("takeover wait of " + std::to_string(options_.takeoverWait.count()) +
                        " ms ended");
    } else if (epoch_ < 0 && !ready_.empty()) {
      formFirstEpoch("start timeout");
    }
  }
  for (auto& [id, d] : drains_) {
    if (d.deadlinePassed || now < d.deadline || finished_) continue;
    d.deadlinePassed = true;
    std::vector<int> late;
    for (int w : d.workers) {
      if (workers_.count(w) && !done_.count(w)) late.push_back(w);
    }
    if (late.empty()) continue;
    d.expelled = true;
    for (int w : late) {
      leaving_.erase(w);
      declareDead(w, "drain " + std::to_string(id) + " deadline of " +
                         std::to_string(d.deadlineSeconds) + " s passed before a step boundary");
    }
  }
  if (now >= stopAt_) {
    stopAt_ = Clock::time_point::max();
    if (!finished_ && !jobFailed_) {
      failJob("the stop deadline of " + std::to_string(stopDeadline_) +
              " s passed before the job reached a step boundary");
    }
  }
  settle();
}

Clock::time_point JobState::nextTick() const {
  Clock::time_point next = std::min({nextCheck_, startDeadline_, stopAt_});
  for (const auto& [id, d] : drains_) {
    if (!d.deadlinePassed) next = std::min(next, d.deadline);
  }
  return next;
}

JobState::Effects JobState::take() {
  Effects out = std::move(effects_);
  effects_ = Effects{};
  return out;
}

void JobState::write(SessionId s, wire::Type type, const json& body, bool closeAfter) {
  write(s, type, std::make_shared<const json>(body), closeAfter);
}

void JobState::write(SessionId s, wire::Type type, std::shared_ptr<const json> body,
                     bool closeAfter) {
  if (s == 0 || !mayWrite()) return;
  effects_.frames.push_back({s, type, epoch_, std::move(body), closeAfter});
}

void JobState::close(SessionId s) {
  if (s != 0) effects_.closes.push_back(s);
}

void JobState::settle() {
  if (!deposePending_) return;
  deposePending_ = false;
  depose(deposeWhy_);
}

void JobState::internalError(const std::string& what) {
  log("internal error in the io thread (it goes on serving): " + what);
  event({{"event", "internal_error"}, {"what", what}});
}

void JobState::log(const std::string& line) {
  const std::string full = "sinew coordinator: " + line;
  if (options_.log) {
    options_.log(full);
  } else {
    std::fprintf(stderr, "%s\n", full.c_str());
  }
}

void JobState::check(Clock::time_point now) {
  const bool paused = discountOwnPause(now);
  std::vector<std::pair<int, int64_t>> silent;
  for (const auto& [id, w] : workers_) {
    if (done_.count(id)) continue;
    auto quiet = now - w.lastHeard;
    if (quiet > options_.deadAfter) {
      silent.emplace_back(id, std::chrono::duration_cast<std::chrono::milliseconds>(quiet).count());
    }
  }
  for (const auto& [id, ms] : silent) {
    declareDead(id, "no heartbeat for " + std::to_string(ms) + " ms");
  }
  // Right after a pause the workers' messages of the pause are still unread: judge
  // progress at the next check.
  if (!paused) checkProgress(now);
}

// The check runs every heartbeatInterval / 2. A run much later than that means this process
// (or its io thread) did not run: a SIGSTOP, a Slurm suspend, a VM pause. The workers' silence
// over that time is the coordinator's own doing (docs/failure_semantics.md, rule 2), so it is
// not counted against them: their last-heard times move forward by the pause.
bool JobState::discountOwnPause(Clock::time_point now) {
  const auto expected = options_.heartbeatInterval / 2;
  bool paused = false;
  if (lastCheck_ != Clock::time_point{} &&
      now - lastCheck_ > expected + options_.heartbeatInterval) {
    paused = true;
    const auto pause = now - lastCheck_ - expected;
    for (auto& [id, w] : workers_) {
      w.lastHeard = std::min(now, w.lastHeard + pause);
      if (w.waiting) w.waitingSince = std::min(now, w.waitingSince + pause);
    }
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(pause).count();
    log("the coordinator did not run for " + std::to_string(ms) +
        " ms (paused?); the workers' silence over that time is not counted against them");
    event({{"event", "coordinator_paused"}, {"ms", ms}});
  }
  lastCheck_ = now;
  return paused;
}

void JobState::noteProgress(Worker& w, int64_t step, bool waiting, Clock::time_point now) {
  if (waiting && (!w.waiting || w.step != step)) w.waitingSince = now;
  if (waiting) {
    w.lastWaited = now;
    w.lastWaitedStep = step;
  }
  w.step = step;
  w.waiting = waiting;
}

std::chrono::milliseconds JobState::stepDeadline() const {
  auto deadline = options_.progressFloor;
  if (const auto step = measures_.medianStep()) {
    auto median = std::chrono::duration_cast<std::chrono::milliseconds>(*step);
    deadline = std::max(deadline, options_.progressFactor * median);
  }
  return deadline;
}

// Rule 1 of docs/failure_semantics.md: a member that computes on while the others have waited
// for it past the step deadline is stuck (a hung training thread, a late vote), not they: it
// alone is declared dead, and the next epoch goes on without it.
void JobState::checkProgress(Clock::time_point now) {
  // Not before a step time has been measured: the first step (warm-up, first allocations)
  // may take long on every worker for reasons of its own.
  if (options_.progressFloor.count() <= 0 || epoch_ < 0 || members_.size() < 2 ||
      !measures_.anyStep()) {
    return;
  }
  const int64_t step = committed_ + 1;
  Clock::time_point firstWait = Clock::time_point::max();
  for (int id : members_) {
    auto it = workers_.find(id);
    if (it == workers_.end()) continue;
    const Worker& w = it->second;
    if (w.waiting && w.step == step) firstWait = std::min(firstWait, w.waitingSince);
  }
  const auto deadline = stepDeadline();
  if (firstWait == Clock::time_point::max() || now - firstWait <= deadline) return;
  // A member seen waiting on this step within the last half step deadline (three heartbeats
  // at least) is not stuck: the member it waited on has just answered and it computes again
  // (the neighbours of a stalled pipeline stage, the moment the stall ends; blaming them
  // expelled healthy workers: scripts/chaos, seed 1125, run 21). A stuck member that waited
  // before it stalled is blamed at a later check, once that wait is older.
  const auto recently = std::max<Clock::duration>(3 * options_.heartbeatInterval, deadline / 2);
  std::vector<int> stuck;
  for (int id : members_) {
    auto it = workers_.find(id);
    if (it == workers_.end() || done_.count(id)) continue;
    const Worker& w = it->second;
    if (w.waiting && w.step >= step) continue;
    if (w.lastWaitedStep >= step && now - w.lastWaited <= recently) continue;
    stuck.push_back(id);
  }
  if (stuck.empty() || stuck.size() == members_.size()) return;
  const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(now - firstWait);
  for (int id : stuck) {
    declareDead(id, "no progress on step " + std::to_string(step) + " while the others waited " +
                        std::to_string(waited.count()) + " ms for it (step deadline " +
                        std::to_string(deadline.count()) + " ms)");
  }
}

void JobState::onClosed(SessionId s, const std::string& why, Clock::time_point now) {
  now_ = now;
  auto sw = sessionWorker_.find(s);
  if (sw == sessionWorker_.end() || deposed_) return settle();
  const int worker = sw->second;
  sessionWorker_.erase(sw);
  auto rit = releasedWorkers_.find(worker);
  if (rit != releasedWorkers_.end() && rit->second.session == s && !rit->second.exited) {
    // A released worker closes its connection when its process ends: its node is free.
    rit->second.exited = true;
    rit->second.session = 0;
    event({{"event", "worker_exited"}, {"worker", worker}, {"node", rit->second.node}});
    return settle();
  }
  auto it = workers_.find(worker);
  if (it == workers_.end() || it->second.session != s) return settle();
  it->second.session = 0;
  if (done_.count(worker)) {
    workers_.erase(it);
    return settle();
  }
  declareDead(worker, why);
  settle();
}

void JobState::onMessage(SessionId s, uint8_t rawType, int64_t epoch, const json& body) {
  auto type = static_cast<wire::Type>(rawType);
  if (type == wire::Type::kHello) {
    if (workerOf(s) >= 0) throwViolation("second hello on one connection");
    return onHello(s, body);
  }
  if (workerOf(s) < 0) {
    throwViolation(std::string(wire::typeName(rawType)) + " before hello");
  }
  int worker = workerOf(s);
  auto it = workers_.find(worker);
  if (it == workers_.end()) {
    // A released worker still writes the checkpoint of its last step and says so; anything
    // else from it, or from a worker declared dead (its expulsion is on its way), is moot.
    if (type == wire::Type::kDurable && releasedWorkers_.count(worker)) onDurable(worker, body);
    return;
  }
  it->second.lastHeard = now_;
  if (epoch > epoch_) {
    throwViolation("message of epoch " + std::to_string(epoch) +
                   " from the future (current epoch " + std::to_string(epoch_) + ")");
  }
  switch (type) {
    case wire::Type::kHeartbeat:
      // Liveness in any epoch; progress only in the current one.
      if (epoch == epoch_ && body.contains("waiting")) {
        noteProgress(it->second, body.at("step").get<int64_t>(), body.at("waiting").get<bool>(),
                     it->second.lastHeard);
      }
      return;
    case wire::Type::kDone:
      return onDone(worker, body.at("step").get<int64_t>());
    case wire::Type::kReady:
      return onReady(worker, body.at("resume_step").get<int64_t>(), body);
    case wire::Type::kLeave:
      return onLeave(worker, body.at("step").get<int64_t>());
    case wire::Type::kDurable:
      return onDurable(worker, body);  // A version written in an older epoch is still durable.
    default:
      break;
  }
  if (takingOver_) {
    // Votes, losses and requests of the previous leader's epoch: the takeover starts a new
    // epoch, which every member enters at the last committed step (docs/ha.md, rule 5).
    ignored_++;
    return;
  }
  if (epoch < epoch_) {
    // A message that crossed an epoch change is stale, not hostile: dropping the connection
    // would turn a benign race into a false failure (docs/coordinator_protocol.md).
    ignored_++;
    log(std::string("ignoring a ") + wire::typeName(rawType) + " of epoch " +
        std::to_string(epoch) + " from worker " + std::to_string(worker) + " (current epoch " +
        std::to_string(epoch_) + ")");
    return;
  }
  switch (type) {
    case wire::Type::kLost: {
      int lost = body.at("worker").get<int>();
      if (workers_.count(lost)) {
        declareDead(lost, "worker " + std::to_string(worker) + " lost it in the data plane");
      }
      return;
    }
    case wire::Type::kVote:
      onVoteStats(it->second, body);
      return onVote(worker, epoch, body.at("step").get<int64_t>());
    case wire::Type::kPipeline:
      return onPipeline(worker, body);
    case wire::Type::kRollback:
      return onRollback(worker, body.at("step").get<int64_t>());
    case wire::Type::kRebuild:
      log("worker " + std::to_string(worker) + " could not build epoch " + std::to_string(epoch_) +
          "'s communicator; rebuilding");
      return newEpoch("rebuild requested by worker " + std::to_string(worker), {}, {"rebuild"});
    case wire::Type::kWithdraw:
      return onWithdraw(worker, body.at("step").get<int64_t>());
    default:
      throwViolation(std::string("a worker may not send ") + wire::typeName(rawType));
  }
}

void JobState::onHello(SessionId s, const json& body) {
  if (deposed_) throwViolation("this coordinator no longer leads the job");
  int requested = body.at("worker").get<int>();
  std::string node = body.at("node").get<std::string>();
  int64_t pid = body.value("pid", int64_t(0));
  // A worker of this job reconnecting after a change of leader (docs/ha.md): during a
  // takeover, a member of the previous leader's epoch is taken back; afterwards it is too late.
  const bool rejoin = body.contains("rejoin");
  if (rejoin && (requested < 0 || !takingOver_ || !takeoverMembers_.count(requested))) {
    // Answered, not dropped: a dropped worker in HA mode would only try again.
    const std::string why =
        "worker " + std::to_string(requested) + " rejoins, but " +
        (takingOver_ ? "it was no member of epoch " + std::to_string(epoch_)
                     : std::string("the takeover is over (it reconnected too late)"));
    log(why);
    write(s, wire::Type::kExpelled, json{{"reason", why}}, /*closeAfter=*/true);
    return;
  }
  if (!rejoin && takingOver_ && requested >= 0) {
    throwViolation("worker " + std::to_string(requested) +
                   " says hello as a launch rank while the job is being taken over");
  }
  if (requested >= 0 && (workers_.count(requested) ||
                         std::find(dead_.begin(), dead_.end(), requested) != dead_.end())) {
    throwViolation("worker id " + std::to_string(requested) + " is already taken");
  }
  // Joiners get ids after every launch rank, so an early joiner never takes a rank's id.
  int id = requested >= 0 ? requested : std::max(nextId_, options_.expectedWorkers);
  if (id >= wire::kMaxWorkerId) {
    throwViolation("no worker id left for a join (ids are never reused; the last is " +
                   std::to_string(wire::kMaxWorkerId - 1) + ")");
  }
  nextId_ = std::max(nextId_, id + 1);
  sessionWorker_[s] = id;
  Worker w;
  w.id = id;
  w.node = node;
  w.pid = pid;
  w.session = s;
  w.lastHeard = now_;
  workers_[id] = w;
  pids_[id] = pid;
  json welcome = {{"worker", id},
                  {"store_host", options_.host},
                  {"store_port", storePort_},
                  {"heartbeat_ms", options_.heartbeatInterval.count()},
                  {"dead_after_ms", options_.deadAfter.count()}};
  send(id, wire::Type::kWelcome, welcome);
  event({{"event", "hello"}, {"worker", id}, {"node", node}, {"pid", pid}});
  if (rejoin) {
    workers_[id].hasState = true;
    rejoined_[id] = sinew::detail::jsonInt(body.at("rejoin").at("committed"), "rejoin.committed",
                                           -1, int64_t(1) << 53);
    log("worker " + std::to_string(id) + " rejoined (last commit it had: step " +
        std::to_string(rejoined_[id]) + ")");
    bool all = true;
    for (int m : takeoverMembers_) all = all && (rejoined_.count(m) || done_.count(m));
    if (all) formTakeoverEpoch("every member rejoined");
  } else if (epoch_ < 0 && requested < 0) {
    pendingJoin_.push_back(id);  // Joins the first epoch, but does not count as a rank.
  } else if (epoch_ < 0) {
    hellos_.push_back(id);  // Counts towards the first epoch once it is ready.
  } else if (finished_) {
    declareDead(id, "the job has already finished");
  } else if (requested < 0 && targetNodes_ >= 0 &&
             currentNodes() + static_cast<int>(pendingJoin_.size()) /
                                  (plans_.on() ? plans_.devicesPerNode() : 1) >=
                 targetNodes_) {
    joinersStarting_ = std::max(0, joinersStarting_ - 1);
    release(id, "the job is at its resize target of " + std::to_string(targetNodes_) + " nodes");
  } else {
    if (requested < 0) joinersStarting_ = std::max(0, joinersStarting_ - 1);
    pendingJoin_.push_back(id);
    log("worker " + std::to_string(id) + " (node " + node +
        ") asks to join; it joins at the next step boundary");
  }
}

void JobState::onReady(int worker, int64_t resumeStep, const json& body) {
  // Every worker of a job trains the same shape; the first to say it is believed.
  if (globalBatch_ == 0 && body.contains("global_batch")) {
    globalBatch_ = body.at("global_batch").get<int64_t>();
    microbatch_ = body.value("microbatch", int64_t(0));
    totalSteps_ = body.value("steps", int64_t(0));
    checkpointsOn_ = body.value("checkpoints", false);
  }
  if (epoch_ >= 0 || std::find(hellos_.begin(), hellos_.end(), worker) == hellos_.end()) {
    return;  // A joiner, or late: it takes the state of the epoch's source anyway.
  }
  if (resumeStep < 0) throwViolation("negative resume_step");
  ready_[worker] = resumeStep;
  if (static_cast<int>(ready_.size()) >= options_.expectedWorkers) formFirstEpoch("all ready");
}

void JobState::formFirstEpoch(const std::string& why) {
  startDeadline_ = Clock::time_point::max();
  // The job resumes after the oldest durable checkpoint any rank found (all normally agree);
  // the first epoch's source restores it and broadcasts it.
  int64_t resume = -1;
  for (const auto& [id, step] : ready_) resume = resume < 0 ? step : std::min(resume, step);
  committed_ = std::max<int64_t>(resume, 0) - 1;
  // Ranks that said hello but never became ready stay out of the first epoch.
  std::vector<int> notReady;
  for (int id : hellos_) {
    if (!ready_.count(id)) notReady.push_back(id);
  }
  std::vector<SessionId> leftOut;  // told once the first epoch is stored (fenced)
  for (int id : notReady) {
    // Only this worker: its node's other workers may well be ready.
    log("worker " + std::to_string(id) + " left out: not ready when the first epoch formed");
    if (workers_[id].session != 0) leftOut.push_back(workers_[id].session);
    dead_.push_back(id);
    workers_.erase(id);
    hellos_.erase(std::remove(hellos_.begin(), hellos_.end(), id), hellos_.end());
  }
  for (int id : hellos_) workers_[id].hasState = true;
  std::vector<int> none;
  epoch_ = -1;
  newEpoch("first epoch (" + why + ")", none, {"start"});
  if (deposed_) return;
  for (SessionId s : leftOut) {
    write(s, wire::Type::kExpelled, json{{"reason", "not ready when the first epoch formed"}});
  }
}

void JobState::newEpoch(const std::string& why, std::vector<int> joiners,
                        const std::set<std::string>& causes) {
  if (epoch_ >= 0) {
    for (const std::string& c : causes) {
      changes_.begin(now_, measures_.lastCommit(), static_cast<int>(members_.size()), c);
    }
  }
  epoch_ = epoch_ < 0 ? 0 : epoch_ + 1;
  votes_.clear();
  for (auto& [id, w] : workers_) {
    w.waiting = false;  // Progress counts afresh in the new epoch.
    w.step = -1;
  }
  measures_.onEpoch();
  epochCommits_ = 0;
  goodput_.onEpoch(now_);
  bool first = epoch_ == 0;
  std::vector<int> members;
  for (const auto& [id, w] : workers_) {
    if (!done_.count(id)) members.push_back(id);
  }
  members_ = members;
  for (int j : joiners) {
    pendingJoin_.erase(std::remove(pendingJoin_.begin(), pendingJoin_.end(), j),
                       pendingJoin_.end());
  }
  // Joiners still pending become members now too (they receive the state like the others).
  std::vector<int> joined = joiners;
  for (int j : pendingJoin_) joined.push_back(j);
  pendingJoin_.clear();
  std::sort(joined.begin(), joined.end());
  json body = epochBody(joined, first || !joined.empty());
  if (plans_.on()) {
    try {
      PipelinePlans::EpochPlan made = plans_.forMembers(members_, epoch_);
      const pipeline::Plan& plan = made.plan;
      body["plan"] = pipeline::planToJson(plan);
      std::vector<std::vector<int>> pipelines;
      for (const auto& p : plan.pipelines) pipelines.push_back(p.nodeIds);
      std::vector<std::array<int, 3>> holds;  // [worker, first layer, end layer]
      for (const auto& w : plan.workers) holds.push_back({w.worker, w.firstLayer, w.endLayer});
      for (const auto& step : made.steps) {
        log("epoch " + std::to_string(epoch_) + " plan: " + step);
      }
      event({{"event", "plan"},
             {"epoch", epoch_},
             {"how", made.how},
             {"steps", made.steps},
             {"pipeline_nodes", pipelines},
             {"idle_nodes", plan.idleNodeIds},
             {"workers", holds},
             {"pipelines", plan.pipelines.size()},
             {"iteration_ticks", plan.iterationTicks}});
      plans_.setCurrent(plan);
    } catch (const Error& e) {
      return failJob("no pipeline plan for the " + std::to_string(members_.size()) +
                     " workers of epoch " + std::to_string(epoch_) + ": " + e.what());
    }
  }
  if (!persistState()) return;  // Another leader's job now: nothing is sent.
  persistNextCommit_ = true;    // The epoch's first commit is stored at once (recovered).
  // One body for every member: N copies of an N-member list would be O(N^2).
  const auto shared = std::make_shared<const json>(std::move(body));
  for (int id : members_) send(id, wire::Type::kEpoch, shared);
  for (int id : joined) workers_[id].hasState = true;
  log("epoch " + std::to_string(epoch_) + ": " + std::to_string(members_.size()) +
      " members, resume at step " + std::to_string(committed_ + 1) + " (" + why + ")");
  event({{"event", "epoch"},
         {"epoch", epoch_},
         {"members", members_},
         {"joined", joined},
         {"resume_step", committed_ + 1},
         {"reason", why}});
  effects_.changed = true;
}

json JobState::epochBody(const std::vector<int>& joined, bool sync) const {
  int source = -1;
  for (int id : members_) {
    if (std::find(joined.begin(), joined.end(), id) != joined.end()) continue;
    if (workers_.at(id).hasState) {
      source = id;
      break;
    }
  }
  json body = {{"epoch", epoch_},  {"members", members_}, {"resume_step", committed_ + 1},
               {"source", source}, {"joined", joined},    {"sync", sync}};
  if (options_.progressFloor.count() > 0) body["step_deadline_ms"] = stepDeadline().count();
  return body;
}

// A member waited longer than its deadline for the verdict on its vote for `step` (e.g. this
// coordinator was paused with the votes in its socket) and withdraws it, then waits on. Messages
// of one connection arrive in order, so if `step` is committed the commit was sent before this
// was read and the member applies it; otherwise the vote is dropped and the next epoch, which
// every member enters holding the state after committed_, resumes at `step`
// (docs/failure_semantics.md, rule 14).
void JobState::onWithdraw(int worker, int64_t step) {
  if (step != committed_ + 1) {
    log("worker " + std::to_string(worker) + " withdrew its vote for step " + std::to_string(step) +
        ", already " + (step <= committed_ ? "committed" : "not the next step") +
        "; nothing to do");
    return;
  }
  auto v = votes_.find(step);
  if (v == votes_.end() || v->second.erase(worker) == 0) {
    log("worker " + std::to_string(worker) + " withdrew a vote for step " + std::to_string(step) +
        " it did not give; ignored");
    return;
  }
  event({{"event", "vote_withdrawn"}, {"epoch", epoch_}, {"step", step}, {"worker", worker}});
  newEpoch("worker " + std::to_string(worker) + " had no verdict on step " + std::to_string(step) +
               " in time and withdrew its vote",
           {}, {"vote_withdrawn"});
}

// A worker of a pipeline job found a layer that no member holds live after this epoch's
// resume step (every worker that held it is gone): the job resumes after `step`, the newest
// version still held somewhere (peers' RAM or disk), which every member restores in the
// epoch this starts (docs/pipeline.md, "Rollback"). Only before the epoch's first commit.
void JobState::onRollback(int worker, int64_t step) {
  const std::string who = "worker " + std::to_string(worker) + "'s rollback to step ";
  if (!plans_.on() || epochCommits_ > 0 || step >= committed_) {
    log("ignoring " + who + std::to_string(step) + " (epoch " + std::to_string(epoch_) +
        " resumes at step " + std::to_string(committed_ + 1) +
        (epochCommits_ > 0 ? ", and has committed steps" : "") + ")");
    return;
  }
  const int64_t from = committed_;
  committed_ = step;
  measures_.onRollback();
  goodput_.onRollback(from - step);
  event(
      {{"event", "rollback"}, {"epoch", epoch_}, {"from", from}, {"to", step}, {"worker", worker}});
  newEpoch("rollback from step " + std::to_string(from) + " to the version after step " +
               std::to_string(step) + ": a layer has no live copy",
           {}, {"rollback"});
}

// A worker sends the job's pipeline profile once (the first member of the first epoch, after
// every member profiled): the coordinator plans the templates once, for the nodes of this
// epoch up to the workers the job may grow to (max_workers), and starts an epoch that carries
// the plan; every later epoch re-instantiates them for its members. Later requests are
// ignored: the first one fixed the job's templates.
void JobState::onPipeline(int worker, const json& body) {
  if (plans_.on()) return;
  const std::string who = "worker " + std::to_string(worker) + "'s pipeline request: ";
  std::string error = planPipelines(body, -1);
  if (!error.empty()) return failJob(who + error);
  newEpoch("pipeline plan", {}, {"plan"});
}

// Plans the job's templates from a pipeline request, for `nodes` nodes (-1: this epoch's
// members' nodes) up to the workers the job may grow to (max_workers). A coordinator taking
// over plans them again from the request its predecessor persisted (the planner is
// deterministic, so they are the predecessor's templates) and reconfigures the predecessor's
// last plan, which it persisted too (PipelinePlans::forMembers).
std::string JobState::planPipelines(const json& body, int nodes) {
  std::string summary;
  const std::string error = plans_.plan(body, nodes, members_.size(), &summary);
  if (error.empty()) log(summary);
  return error;
}

// Ends the job: every worker is expelled with the reason (e.g. a plan no template fits).
void JobState::failJob(const std::string& why) {
  log("job failed: " + why);
  jobFailed_ = true;
  failReason_ = why;
  if (!persistState()) return;
  event({{"event", "job_failed"}, {"epoch", epoch_}, {"reason", why}});
  for (auto& [id, w] : workers_) {
    if (w.session != 0) write(w.session, wire::Type::kExpelled, json{{"reason", why}}, true);
    dead_.push_back(id);
  }
  workers_.clear();
  members_.clear();
  hellos_.clear();
  ready_.clear();
  pendingJoin_.clear();
  effects_.changed = true;
}

void JobState::onVote(int worker, int64_t epoch, int64_t step) {
  if (step != committed_ + 1) {
    ignored_++;
    log("ignoring worker " + std::to_string(worker) + "'s vote for step " + std::to_string(step) +
        " (expected step " + std::to_string(committed_ + 1) + ")");
    return;
  }
  auto& voters = votes_[step];
  voters.insert(worker);
  noteProgress(workers_.at(worker), step, /*waiting=*/true, now_);
  // Only a vote that may complete the round scans the members: a scan per vote made a step
  // O(N^2) at N members.
  if (voters.size() < members_.size()) return;
  for (int id : members_) {
    if (!voters.count(id)) return;
  }
  committed_ = step;
  votes_.erase(step);
  // Stored now and then, not before every commit: a new leader learns the newest commit from
  // the members that rejoin it (docs/ha.md, rule 5).
  if (!persistThrottled()) return;
  noteCommit(step);
  if (pendingJoin_.empty() && leaving_.empty()) {
    sendCommit(members_, step, false);
    return;
  }
  if (!leaving_.empty()) {
    // Step boundary with preempted (or drained, or resized away) members: they apply this
    // step, then are released.
    std::vector<int> old = members_;
    sendCommit(old, step, true);
    std::vector<int> leaving(leaving_.begin(), leaving_.end());
    leaving_.clear();
    bool jobStops = true;  // No member stays: the job stops here (resumable).
    for (int id : old) {
      jobStops = jobStops && (workers_.count(id) == 0 ||
                              std::find(leaving.begin(), leaving.end(), id) != leaving.end());
    }
    std::set<std::string> causes;  // for the epoch change's account
    if (!pendingJoin_.empty()) causes.insert("join");
    for (int id : leaving) {
      auto why = leaveReason_.find(id);
      const std::string reason = why != leaveReason_.end() ? why->second : "";
      causes.insert(reason.rfind("released by a resize", 0) == 0 ? "resize"
                    : reason.rfind("drained", 0) == 0            ? "drain"
                                                                 : "leave");
      release(id,
              (why != leaveReason_.end() ? why->second : std::string("preempted")) +
                  "; left after step " + std::to_string(step),
              jobStops);
    }
    bool anyLeft = false;
    for (int id : old) anyLeft = anyLeft || workers_.count(id) > 0;
    if (!anyLeft) {
      stopped_ = true;
      finished_ = true;
      std::vector<int> waiting = pendingJoin_;
      for (int id : waiting) declareDead(id, "the job stopped");
      log("job stopped after step " + std::to_string(step) + ": every member was preempted");
      event({{"event", "stopped"}, {"step", step}, {"epoch", epoch_}});
      effects_.changed = true;
      return;
    }
    newEpoch("worker(s) preempted after step " + std::to_string(step), pendingJoin_, causes);
    return;
  }
  // Step boundary with joiners: the commit carries the next epoch, so members switch to it
  // right after applying the step.
  std::vector<int> joiners = pendingJoin_;
  std::vector<int> old = members_;
  sendCommit(old, step, true);
  newEpoch("worker(s) joining at step " + std::to_string(step + 1), joiners, {"join"});
}

void JobState::onLeave(int worker, int64_t step) {
  if (finished_) return;
  bool member = std::find(members_.begin(), members_.end(), worker) != members_.end();
  if (!member) {
    // Not training yet (a pending joiner, or before the first epoch): it goes at once.
    return release(worker, "preempted before it trained");
  }
  leaving_.insert(worker);
  log("worker " + std::to_string(worker) + " is preempted at step " + std::to_string(step) +
      "; it leaves at the next step boundary");
  event({{"event", "leave"}, {"worker", worker}, {"step", step}});
}

void JobState::release(int worker, const std::string& why, bool jobStops) {
  auto it = workers_.find(worker);
  if (it == workers_.end()) return;
  if (it->second.session != 0) {
    // The connection stays open: the worker may still report its checkpoint, and its closing
    // says the process is gone (docs/control_api.md, drains).
    write(it->second.session, wire::Type::kReleased,
          json{{"reason", why}, {"step", committed_}, {"job_stopped", jobStops}});
    ReleasedWorker r;
    r.step = committed_;
    r.node = it->second.node;
    r.session = it->second.session;
    releasedWorkers_[worker] = r;
  } else {
    ReleasedWorker r;
    r.step = committed_;
    r.node = it->second.node;
    r.exited = true;
    releasedWorkers_[worker] = r;
  }
  leaveReason_.erase(worker);
  // Erased from workers_: its closing connection and any late message are no failure.
  pendingJoin_.erase(std::remove(pendingJoin_.begin(), pendingJoin_.end(), worker),
                     pendingJoin_.end());
  hellos_.erase(std::remove(hellos_.begin(), hellos_.end(), worker), hellos_.end());
  ready_.erase(worker);
  leaving_.erase(worker);
  released_.push_back(worker);
  workers_.erase(it);
  updateDrains();
  log("worker " + std::to_string(worker) + " released: " + why);
  event({{"event", "released"}, {"worker", worker}, {"reason", why}});
}

void JobState::onDone(int worker, int64_t step) {
  done_.insert(worker);
  event({{"event", "done"}, {"worker", worker}, {"step", step}});
  const bool wasFinished = finished_;
  checkFinished();                               // Stores the state if this ends the job...
  if (finished_ == wasFinished) persistState();  // ...else the done is stored here.
}

void JobState::checkFinished() {
  if (epoch_ < 0 || members_.empty()) return;
  for (int id : members_) {
    if (!done_.count(id)) return;
  }
  if (!finished_) {
    finished_ = true;
    persistState();
    log("job finished at step " + std::to_string(committed_) + " in epoch " +
        std::to_string(epoch_));
    event({{"event", "finished"},
           {"step", committed_},
           {"epoch", epoch_},
           {"goodput", goodputJson(now_)}});
    // A copy: declareDead erases from pendingJoin_.
    const std::vector<int> joiners = pendingJoin_;
    for (int id : joiners) declareDead(id, "the job has finished");
    effects_.changed = true;
  }
}

void JobState::declareDead(int worker, const std::string& why) {
  auto it = workers_.find(worker);
  if (it == workers_.end()) return;
  // Workers of a node fail together (docs/architecture.md section 1).
  std::string node = it->second.node;
  std::vector<int> victims;
  for (const auto& [id, w] : workers_) {
    if (w.node == node && !done_.count(id)) victims.push_back(id);
  }
  if (std::find(victims.begin(), victims.end(), worker) == victims.end()) victims.push_back(worker);
  bool wasMember = false;
  std::vector<std::pair<SessionId, std::string>> expelled;  // told once the deaths are stored
  for (int id : victims) {
    auto wit = workers_.find(id);
    if (wit == workers_.end()) continue;
    std::string reason =
        id == worker ? why : "node " + node + " of worker " + std::to_string(worker) + " failed";
    log("worker " + std::to_string(id) + " declared dead: " + reason);
    lastLoss_ = "worker " + std::to_string(id) + " (node " + node + "): " + reason;
    event({{"event", "failure"},
           {"worker", id},
           {"node", node},
           {"reason", reason},
           {"epoch", epoch_},
           {"committed_step", committed_}});
    if (wit->second.session != 0) expelled.emplace_back(wit->second.session, reason);
    wasMember = wasMember || std::find(members_.begin(), members_.end(), id) != members_.end();
    pendingJoin_.erase(std::remove(pendingJoin_.begin(), pendingJoin_.end(), id),
                       pendingJoin_.end());
    hellos_.erase(std::remove(hellos_.begin(), hellos_.end(), id), hellos_.end());
    ready_.erase(id);
    leaving_.erase(id);
    dead_.push_back(id);
    workers_.erase(wit);
  }
  measures_.onFailures(static_cast<int64_t>(victims.size()));
  // Fenced (docs/ha.md): the deaths are stored under this leader's term before anyone hears
  // of them; a leader whose term is over stores nothing, expels nobody and steps down. (Before
  // the first epoch nothing is stored: a successor starts such a job afresh.)
  if (deposed_ || (epoch_ >= 0 && !persistState())) return;
  for (const auto& [session, reason] : expelled) {
    write(session, wire::Type::kExpelled, json{{"reason", reason}}, /*closeAfter=*/true);
  }
  updateDrains();
  // A checkpoint asked for and not yet durable is lost with its writer (data parallel: the
  // epoch's first member; pipelines: any member): status stops saying "checkpointing".
  const bool writerLost =
      !members_.empty() &&
      (plans_.on() ? wasMember
                   : std::find(victims.begin(), victims.end(), members_.front()) != victims.end());
  if (writerLost && checkpointStep_ > measures_.durable().step) {
    event({{"event", "checkpoint_abandoned"}, {"step", checkpointStep_}, {"reason", why}});
    checkpointStep_ = -1;
  }
  // A writer of the last durable version among the dead (data parallel: the epoch's first
  // member; pipelines: every member) needs the next epoch's writer to write it.
  const bool writerDied =
      checkpointsOn_ && !members_.empty() &&
      (plans_.on() || std::find(victims.begin(), victims.end(), members_.front()) != victims.end());
  if (epoch_ >= 0 && wasMember && !finished_ && totalSteps_ > 0 && committed_ + 1 >= totalSteps_ &&
      !writerDied) {
    // Every step is committed: the members that live have applied the last one (or will: a
    // commit is only sent once every member voted) and need no new epoch. The dead leave the
    // member list; the job finishes once the others are done (some may be gone already).
    std::vector<int> staying;
    for (int id : members_) {
      if (std::find(victims.begin(), victims.end(), id) == victims.end()) staying.push_back(id);
    }
    if (!staying.empty()) {
      log("worker " + std::to_string(worker) + " died after the last step was committed; the " +
          "job does not need it");
      members_ = staying;
      checkFinished();
      effects_.changed = true;
      return;
    }
  }
  if (epoch_ >= 0 && wasMember && !finished_) {
    goodput_.onLoss(now_);
    measures_.startRecovery(now_);
    newEpoch("worker " + std::to_string(worker) + " failed: " + why, {}, {"failure"});
    checkFinished();
  }
  effects_.changed = true;
}

void JobState::send(int worker, wire::Type type, const json& body) {
  send(worker, type, std::make_shared<const json>(body));
}

void JobState::send(int worker, wire::Type type, std::shared_ptr<const json> body) {
  auto it = workers_.find(worker);
  if (it == workers_.end() || it->second.session == 0) return;
  write(it->second.session, type, std::move(body));
}

void JobState::event(json e) {
  e["time"] = wallSeconds();
  effects_.events.push_back(std::move(e));
}

}  // namespace runtime
}  // namespace sinew
