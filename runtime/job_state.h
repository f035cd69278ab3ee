#pragma once

// Internal: the coordinator's job-state machine (docs/architecture.md section 3). Everything the
// coordinator decides — membership, epochs, the step vote and its commits, liveness and
// progress, joins, leaves and releases, pipeline plans, the control API's views and requests,
// the metrics and what high availability persists — with no sockets, threads, timers or locks:
// events go in (a worker's message on a connection, a connection closed, a control request,
// tick(now)) each with the time it happens at, and what the coordinator does comes out
// (take(): frames to send on connections, connections to close, events for the log and the
// feed). runtime/coordinator.cc runs it on its io thread under one mutex; tests drive it with
// exact event sequences and times (tests/runtime/job_state_test.cc).
//
// Files: job_state.cc (sessions, membership, epochs, the vote), job_state_control.cc (the
// control API and metrics), job_state_scaling.cc (what the scaling curve and the costs of a
// resize or drain read of the job; they are a ResizeCosts, resize_costs.h), job_state_ha.cc (the
// persisted state and takeover); what is measured of the job (commits, step times, recoveries,
// checkpoints) is a JobMeasures (job_measures.h), and a pipeline job's templates and plans a
// PipelinePlans (pipeline_plans.h).
//
// Thread safety: none; the caller serializes every call.

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "sinew/base/error.h"
#include "sinew/pipeline/instantiation.h"
#include "sinew/pipeline/plan.h"
#include "sinew/pipeline/profile.h"
#include "sinew/pipeline/template_planner.h"
#include "sinew/runtime/control_api.h"
#include "sinew/runtime/coordinator.h"
#include "sinew/runtime/detail/wire.h"
#include "sinew/runtime/epoch_changes.h"
#include "sinew/runtime/event_log.h"
#include "sinew/runtime/goodput_meter.h"
#include "sinew/runtime/job_measures.h"
#include "sinew/runtime/pipeline_plans.h"
#include "sinew/runtime/resize_costs.h"

namespace sinew {
namespace runtime {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace coordinator_detail {

// A worker's message that breaks the protocol where it arrives (a second hello, a message
// before hello, a type a worker may not send, ...): the session drops that connection with
// the reason logged; the coordinator goes on.
class ProtocolViolation : public Corruption {
 public:
  using Corruption::Corruption;
};

[[noreturn]] inline void throwViolation(const std::string& why) { throw ProtocolViolation(why); }

}  // namespace coordinator_detail

namespace coordinator_detail {

// secondsOf and median are job_measures.h's.

// A control operation's refusal: the status and {"error": why}.
inline ControlReply refusal(int status, const std::string& why) {
  ControlReply r;
  r.status = status;
  r.body = json{{"error", why}};
  return r;
}

// A label value, escaped as the text format requires.
inline std::string labelValue(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

}  // namespace coordinator_detail

using namespace coordinator_detail;

class JobState {
 public:
  // A worker's connection, numbered by the caller (never 0).
  using SessionId = uint64_t;

  // A frame to send on a connection, then maybe close it once written.
  struct Frame {
    SessionId session = 0;
    wire::Type type = wire::Type::kHeartbeat;
    int64_t epoch = 0;
    // Shared by every frame of one broadcast (an epoch to N members is one body, encoded
    // once by the coordinator, not N copies).
    std::shared_ptr<const json> body;
    bool closeAfter = false;
  };
  // What the machine did since the last take().
  struct Effects {
    std::vector<Frame> frames;
    std::vector<SessionId> closes;  // close now (pending frames may be dropped)
    std::vector<json> events;       // for the event log and the feed, in order
    bool changed = false;           // the job's state changed (waitFinished may wake)
    bool deposed = false;           // this coordinator's term ended: stop serving
  };

  // `options` as the coordinator resolved them (token, control token); `storePort`: where the
  // rendezvous store listens (told to workers in their welcome). A takeover
  // (options.takeoverState) restores the state (InvalidArgument naming a bad field).
  JobState(const CoordinatorOptions& options, uint16_t storePort, Clock::time_point now);

  // A frame from connection `s` (its header's type and epoch, its decoded body). Throws
  // coordinator_detail::ProtocolViolation (or InvalidArgument, Corruption for a bad field):
  // the caller drops the connection and reports onClosed.
  void onFrame(SessionId s, uint8_t type, int64_t epoch, const json& body, Clock::time_point now);
  // Connection `s` closed (`why`); also after onFrame threw for it.
  void onClosed(SessionId s, const std::string& why, Clock::time_point now);
  // Time passes: the liveness and progress check every heartbeatInterval / 2, the start or
  // takeover wait, drain and stop deadlines.
  void tick(Clock::time_point now);
  // When tick() has something to do next.
  Clock::time_point nextTick() const;
  // What happened since the last call.
  Effects take();

  // The control API (docs/control_api.md).
  ControlReply status(Clock::time_point now);
  ControlReply scaling(Clock::time_point now);
  ControlReply resize(int64_t nodes, Clock::time_point now);
  ControlReply limits(const json& update, Clock::time_point now);
  ControlReply drain(const control::DrainRequest& request, Clock::time_point now);
  ControlReply checkpoint(Clock::time_point now);
  ControlReply stop(double deadlineSeconds, Clock::time_point now);
  std::string metrics(Clock::time_point now);

  CoordinatorStatus coordinatorStatus() const;
  // How the job ended (runtime/job_outcome.h); "running" while it has not.
  json outcome() const;
  // Whether the job finished (or every member left), for waitFinished.
  bool over() const { return finished_ || (epoch_ >= 0 && members_.empty()); }
  bool finishedWithWork() const { return finished_ && (!done_.empty() || stopped_); }
  bool deposed() const { return deposed_; }
  int64_t epoch() const { return epoch_; }
  int64_t committed() const { return committed_; }
  // The coordinator's time for the newest step committed on a frame: from reading that frame
  // (the last vote) to the commit written to every member's connection (/metrics'
  // sinew_commit_seconds).
  void noteCommitWritten(Clock::duration took) { measures_.setCommitSeconds(secondsOf(took)); }
  const std::vector<int>& members() const { return members_; }
  // The worker connection `s` said hello as, or -1.
  int workerOf(SessionId s) const;

  // Applies a deposition mayWrite() decided on, once the input that found it is handled
  // (every input does; a control request's caller calls it after the request).
  void settle();
  // A connection dropped for breaking the protocol (counted in the status).
  void noteDropped() { dropped_++; }
  // An internal error of the caller's (reported as an event and logged).
  void internalError(const std::string& what);
  void log(const std::string& line);

 private:
  struct Worker {
    int id = -1;
    std::string node;
    int64_t pid = 0;
    SessionId session = 0;  // Its connection (0: none).
    Clock::time_point lastHeard;
    bool hasState = false;  // held the model in an epoch (not a joiner awaiting state)
    // Progress, from heartbeats and votes: the step it is on, and since when it has been
    // waiting on the others for that step (epoch start: not waiting).
    int64_t step = -1;
    bool waiting = false;
    Clock::time_point waitingSince;
    // The last time it reported waiting, and on which step (rule 1's exemption of a member
    // that has just stopped waiting).
    Clock::time_point lastWaited;
    int64_t lastWaitedStep = -1;
    // From its votes: its last step's compute time (forward and backward, not the waits).
    double computeSeconds = -1;
    double stallSeconds = 0;  // snapshot stalls, summed
  };
  // A worker released (drained, resized away, preempted): it applies its last step, writes
  // its checkpoint if it is the writer, then exits; its connection closing says it is gone.
  struct ReleasedWorker {
    int64_t step = -1;
    std::string node;
    SessionId session = 0;  // Its connection (0: none).
    bool exited = false;
  };
  // A drain (POST /v1/drain): these workers must be free by the deadline.
  struct Drain {
    int id = 0;
    std::vector<int> workers;
    double deadlineSeconds = 0;
    double requestedAt = 0;  // wall-clock seconds
    int64_t releaseStep = -1;
    bool expelled = false;         // the deadline passed first: they were declared dead
    Clock::time_point deadline{};  // When its workers still training are declared dead.
    bool deadlinePassed = false;
  };

  void onMessage(SessionId s, uint8_t type, int64_t epoch, const json& body);
  void onHello(SessionId s, const json& body);
  void onVote(int worker, int64_t epoch, int64_t step);
  void onDone(int worker, int64_t step);
  void onReady(int worker, int64_t resumeStep, const json& body);
  void onLeave(int worker, int64_t step);
  void onDurable(int worker, const json& body);
  void onVoteStats(Worker& w, const json& body);
  // Sends `worker` its release; `jobStops`: every member leaves at this boundary.
  void release(int worker, const std::string& why, bool jobStops = false);
  // The commit of `step` to each of `workers` (one body for all).
  void sendCommit(const std::vector<int>& workers, int64_t step, bool nextEpoch);
  // A drain is done with its workers once each was released or declared dead.
  void updateDrains();
  void noteCommit(int64_t step);
  std::string state() const;
  // Nodes the job trains on and keeps, and those it keeps when `going` leave too
  // (ResizeCosts::nodesKept).
  int currentNodes() const;
  int nodesKept(const std::set<int>& going) const;
  std::vector<std::string> nodesOf(const std::vector<int>& workers) const;
  json drainJson(const Drain& d) const;
  // The goodput meter's account as the status shows it (docs/control_api.md, "goodput").
  nlohmann::json goodputJson(Clock::time_point now) const;
  // What the scaling curve and the costs of a resize or drain (ResizeCosts) read of the job.
  CostInputs costInputs() const;
  // The liveness check (every heartbeatInterval / 2).
  void check(Clock::time_point now);
  void declareDead(int worker, const std::string& why);
  // Whether the coordinator was paused since the last check (then discounted).
  bool discountOwnPause(Clock::time_point now);
  void noteProgress(Worker& w, int64_t step, bool waiting, Clock::time_point now);
  void checkProgress(Clock::time_point now);
  std::chrono::milliseconds stepDeadline() const;
  void formFirstEpoch(const std::string& why);
  // `causes`: what made it, for its cost's account (EpochChanges): "failure", "join",
  // "resize", "drain", "leave", "rollback", "rebuild", "vote_withdrawn", "plan", "takeover".
  void newEpoch(const std::string& why, std::vector<int> joiners,
                const std::set<std::string>& causes);
  json epochBody(const std::vector<int>& joined, bool sync) const;
  void onPipeline(int worker, const json& body);
  void onRollback(int worker, int64_t step);
  void onWithdraw(int worker, int64_t step);
  void failJob(const std::string& why);
  // High availability (docs/ha.md). Whether this coordinator may still send (its term has
  // not ended); a false answer ends the term.
  bool mayWrite();
  // Ends this coordinator's term: nothing more is sent, every connection is closed.
  void depose(const std::string& why);
  // Stores the durable state through options_.persist (if set) before a change of it is sent;
  // returns false, having ended the term, when the write was refused or failed.
  bool persistState();
  // persistState, unless the last store was less than persistCommitsEvery ago.
  bool persistThrottled();
  std::string stateJson() const;
  void restoreState(const std::string& text);
  // Takeover: the next epoch, with the members that reconnected.
  void formTakeoverEpoch(const std::string& why);
  // Plans the templates of a pipeline request for `nodes` nodes; returns the error, or "".
  std::string planPipelines(const json& body, int nodes);
  void send(int worker, wire::Type type, const json& body);
  void send(int worker, wire::Type type, std::shared_ptr<const json> body);
  void event(json e);
  void checkFinished();

  Clock::time_point lastCheck_{};  // when the liveness check last ran
  std::map<int, Worker> workers_;  // every worker that said hello and is not dead
  std::vector<int> hellos_;        // ids before the first epoch formed
  std::map<int, int64_t> ready_;   // launch ranks ready before the first epoch -> resume step
  std::vector<int> pendingJoin_;   // joined after the first epoch; added at a step boundary
  std::vector<int> members_;
  std::vector<int> dead_;
  std::vector<int> released_;
  std::set<int> leaving_;
  std::set<int> done_;
  std::map<int64_t, std::set<int>> votes_;  // step -> voters, for the current epoch
  int64_t epoch_ = -1;
  int64_t committed_ = -1;
  int nextId_ = 0;
  bool finished_ = false;
  bool stopped_ = false;
  int64_t dropped_ = 0;
  int64_t ignored_ = 0;
  // A pipeline job (docs/pipeline.md): the templates planned once from the profile and options
  // a worker sent, and the current epoch's plan; every epoch after carries its plan.
  PipelinePlans plans_;
  // High availability (docs/ha.md).
  bool deposed_ = false;
  Clock::time_point lastPersist_{};
  bool persistNextCommit_ = false;
  bool takingOver_ = false;          // waiting for the members of takeoverMembers_
  std::set<int> takeoverMembers_;    // the previous leader's last epoch's members
  std::map<int, int64_t> rejoined_;  // reconnected members -> the last commit they had

  // The control API (docs/control_api.md).
  Clock::time_point startTime_{};
  std::map<int, int64_t> pids_;
  int64_t globalBatch_ = 0;
  int64_t microbatch_ = 0;
  int64_t totalSteps_ = 0;
  bool checkpointsOn_ = false;
  bool jobFailed_ = false;
  std::string failReason_;  // failJob's
  std::string lastLoss_;    // the last worker declared dead and why ("worker 3: ...")
  // Commits and step times, failures and recoveries, rollbacks, checkpoint stalls, replicas
  // and durable versions, as measured.
  JobMeasures measures_;
  GoodputMeter goodput_;      // the wall time by cause (docs/goodput.md), this term's
  EpochChanges changes_;      // each epoch change's measured pause and bytes, this term's
  int64_t epochCommits_ = 0;  // commits in the current epoch
  // Checkpoints: a request waits for the next commit.
  bool checkpointNext_ = false;
  int64_t checkpointStep_ = -1;  // the newest step whose commit asked for a checkpoint
  // Releases, drains, resizes, stop.
  std::map<int, ReleasedWorker> releasedWorkers_;
  std::map<int, std::string> leaveReason_;  // coordinator-initiated leaves -> why
  std::map<int, Drain> drains_;
  int nextDrain_ = 1;
  json lastResize_;
  int targetNodes_ = -1;       // the last resize's target (-1: none)
  control::JobLimits limits_;  // from options_.limits, then POST /v1/limits
  int joinersStarting_ = 0;    // workers a launcher started for a resize that have not said hello
  bool stopRequested_ = false;
  double stopDeadline_ = 0;
  Clock::time_point stopAt_ = Clock::time_point::max();  // A stop's deadline.

  void write(SessionId s, wire::Type type, const json& body, bool closeAfter = false);
  void write(SessionId s, wire::Type type, std::shared_ptr<const json> body,
             bool closeAfter = false);
  void close(SessionId s);

  CoordinatorOptions options_;
  const uint16_t storePort_;
  Clock::time_point now_;  // Of the input being handled.
  Effects effects_;
  std::map<SessionId, int> sessionWorker_;  // Connections that said hello -> their worker.
  Clock::time_point nextCheck_;
  Clock::time_point startDeadline_ = Clock::time_point::max();  // The first or takeover epoch's.
  bool deposePending_ = false;
  std::string deposeWhy_;
  bool termEnded_ = false;  // depose() ran
};

}  // namespace runtime
}  // namespace sinew
