#include "sinew/runtime/job_state.h"

#include "sinew/base/parse.h"

namespace sinew {
namespace runtime {

// High availability (docs/ha.md): what a leader persists of the job's state, with its lease
// fencing every write, and how a new leader restores it and forms the takeover epoch.

bool JobState::mayWrite() {
  if (deposed_) return false;
  if (options_.mayWrite && !options_.mayWrite()) {
    // Not from inside a write: the term ends once the input at hand is handled (settle()).
    deposePending_ = true;
    deposeWhy_ = "its leader lease may have ended";
    deposed_ = true;  // Nothing more goes out, from this moment.
    return false;
  }
  return true;
}

void JobState::depose(const std::string& why) {
  if (termEnded_) return;
  termEnded_ = true;
  deposed_ = true;
  effects_.deposed = true;  // The caller stops serving; closing the connections declares
                            // nobody dead.
  startDeadline_ = Clock::time_point::max();
  log("this coordinator's term is over (" + why +
      "): it sends nothing more and closes every connection");
  event({{"event", "deposed"}, {"epoch", epoch_}, {"reason", why}});
  for (auto& [id, w] : workers_) close(w.session);
  for (auto& [id, r] : releasedWorkers_) close(r.session);
  effects_.changed = true;
}

std::string JobState::stateJson() const {
  json st = {{"version", 1},
             {"epoch", epoch_},
             {"members", members_},
             {"committed", committed_},
             {"next_id", nextId_},
             {"expected", options_.expectedWorkers},
             {"done", std::vector<int>(done_.begin(), done_.end())},
             {"dead", dead_},
             {"finished", finished_},
             {"stopped", stopped_},
             {"failed", jobFailed_},
             {"fail_reason", failReason_},
             {"durable_step", measures_.durable().step},
             {"durable_path", measures_.durable().path},
             {"shape",
              {{"global_batch", globalBatch_},
               {"microbatch", microbatch_},
               {"steps", totalSteps_},
               {"checkpoints", checkpointsOn_}}},
             {"limits", limits_.toJson()}};
  if (plans_.on()) {
    st["pipeline"] = plans_.request();
    st["pipeline_nodes"] = plans_.requestNodes();
    // The epoch's plan, which the next one starts from (PipelinePlans::forMembers): a new leader
    // reconfigures it for the members that rejoin it.
    if (plans_.current()) st["plan"] = json::parse(pipeline::planToJson(*plans_.current()));
  }
  return st.dump();
}

bool JobState::persistState() {
  if (deposed_) return false;
  if (!options_.persist) return true;
  try {
    options_.persist(stateJson());
    lastPersist_ = now_;
    return true;
  } catch (const std::exception& e) {
    depose(std::string("its state could not be stored: ") + e.what());
    return false;
  }
}

bool JobState::persistThrottled() {
  if (options_.persist && !persistNextCommit_ &&
      now_ - lastPersist_ < options_.persistCommitsEvery) {
    return !deposed_;
  }
  persistNextCommit_ = false;
  return persistState();
}

void JobState::restoreState(const std::string& text) {
  const std::string what = "the job state to take over";
  if (detail::jsonTooDeep(text)) {
    SINEW_THROW(InvalidArgument, what, " nests JSON deeper than ", detail::kMaxJsonDepth,
                " levels");
  }
  json st = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!st.is_object()) SINEW_THROW(InvalidArgument, what, " is not a JSON object");
  using sinew::detail::jsonField;
  using sinew::detail::jsonInt;
  const int64_t kMax = int64_t(1) << 53;
  epoch_ = jsonInt(jsonField(st, "epoch", what), "epoch", -1, kMax);
  committed_ = jsonInt(jsonField(st, "committed", what), "committed", -1, kMax);
  nextId_ = static_cast<int>(jsonInt(jsonField(st, "next_id", what), "next_id", 0, 1 << 24));
  for (const json& id : jsonField(st, "members", what)) {
    takeoverMembers_.insert(static_cast<int>(jsonInt(id, "members[]", 0, 1 << 24)));
  }
  for (const json& id : st.value("done", json::array())) {
    done_.insert(static_cast<int>(jsonInt(id, "done[]", 0, 1 << 24)));
  }
  for (const json& id : st.value("dead", json::array())) {
    dead_.push_back(static_cast<int>(jsonInt(id, "dead[]", 0, 1 << 24)));
  }
  jobFailed_ = st.value("failed", false);
  failReason_ = st.value("fail_reason", std::string());
  finished_ = st.value("finished", false);
  stopped_ = st.value("stopped", false);
  measures_.restoreDurable(st.value("durable_step", int64_t(-1)),
                           st.value("durable_path", std::string()));
  if (st.contains("shape")) {
    const json& shape = st.at("shape");
    globalBatch_ = shape.value("global_batch", int64_t(0));
    microbatch_ = shape.value("microbatch", int64_t(0));
    totalSteps_ = shape.value("steps", int64_t(0));
    checkpointsOn_ = shape.value("checkpoints", false);
  }
  if (st.contains("limits")) {
    try {
      limits_ = control::parseLimits(st.at("limits"), control::JobLimits());
    } catch (const InvalidArgument& e) {
      SINEW_THROW(InvalidArgument, what, ": ", e.what());
    }
  }
  if (st.contains("pipeline")) {
    std::string error = planPipelines(
        st.at("pipeline"), static_cast<int>(jsonInt(jsonField(st, "pipeline_nodes", what),
                                                    "pipeline_nodes", 1, 1 << 20)));
    if (!error.empty()) SINEW_THROW(InvalidArgument, what, ": its pipeline request: ", error);
    if (st.contains("plan")) {
      try {
        plans_.setCurrent(pipeline::planFromJson(st.at("plan").dump()));
      } catch (const Error& e) {
        SINEW_THROW(InvalidArgument, what, ": its plan: ", e.what());
      }
    }
  }
  if (epoch_ < 0) {
    // The predecessor had not formed the first epoch: start the job afresh (its workers
    // restart with it; nothing was committed).
    SINEW_THROW(InvalidArgument, what, " has no epoch yet: nothing to take over");
  }
  takingOver_ = !finished_ && !jobFailed_;
  log("taking over the job at epoch " + std::to_string(epoch_) + ", last committed step " +
      std::to_string(committed_) + "; waiting for " + std::to_string(takeoverMembers_.size()) +
      " members to reconnect");
  event({{"event", "takeover"},
         {"epoch", epoch_},
         {"committed_step", committed_},
         {"members", std::vector<int>(takeoverMembers_.begin(), takeoverMembers_.end())}});
}

void JobState::formTakeoverEpoch(const std::string& why) {
  if (!takingOver_) return;
  takingOver_ = false;
  startDeadline_ = Clock::time_point::max();
  for (int id : takeoverMembers_) {
    if (rejoined_.count(id) || done_.count(id)) continue;
    log("worker " + std::to_string(id) + " declared dead: it did not reconnect after the " +
        "change of leader (" + why + ")");
    event({{"event", "failure"},
           {"worker", id},
           {"reason", "did not reconnect after the change of leader"},
           {"epoch", epoch_},
           {"committed_step", committed_}});
    dead_.push_back(id);
    measures_.onFailures(1);
  }
  if (workers_.empty()) {
    // Every step committed: the members applied the last one and ended (their done may have
    // gone to the previous leader after it stored its last state).
    const bool allSteps = totalSteps_ > 0 && committed_ + 1 >= totalSteps_;
    if (!done_.empty() || allSteps) {
      finished_ = true;
      persistState();
      effects_.changed = true;
      return;
    }
    return failJob("no member of epoch " + std::to_string(epoch_) +
                   " reconnected to the new leader (" + why + ")");
  }
  // The newest commit any member that rejoined has applied is committed (the previous leader
  // sends a commit only once every member voted, and may have stored it later or not at all).
  // A member that voted for it but never heard the verdict applies it now, before it learns of
  // the new epoch; a step nobody heard of is voted again.
  for (const auto& [id, had] : rejoined_) committed_ = std::max(committed_, had);
  for (const auto& [id, had] : rejoined_) {
    if (had < committed_ && workers_.count(id)) sendCommit({id}, committed_, false);
  }
  rejoined_.clear();
  measures_.startRecovery(now_);
  newEpoch("a new leader took over (" + why + ")", {}, {"takeover"});
}

}  // namespace runtime
}  // namespace sinew
