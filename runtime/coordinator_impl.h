#pragma once

// Internal: the coordinator's implementation class, shared by the files that implement it
// (docs/architecture.md section 3): runtime/coordinator.cc (sessions, membership, epochs, the
// step vote), runtime/coordinator_ha.cc (high availability: the leader's persisted state and
// takeover) and runtime/coordinator_control.cc (the control API's views and requests, the
// metrics and the event feed). Included by those files only; not installed.
//
// Thread safety: every member below the constructor is guarded by mu_ unless it says
// otherwise; handlers run on the io thread.

#include "sinew/runtime/coordinator.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <future>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>

#include "sinew/base/error.h"
#include "sinew/base/parse.h"
#include "sinew/collectives/tcp_store.h"
#include "sinew/collectives/transport/channel.h"
#include "sinew/pipeline/instantiation.h"
#include "sinew/pipeline/plan.h"
#include "sinew/pipeline/profile.h"
#include "sinew/pipeline/reconfiguration.h"
#include "sinew/pipeline/template_planner.h"
#include "sinew/runtime/control_server.h"
#include "sinew/runtime/detail/wire.h"
#include "sinew/runtime/event_log.h"

namespace sinew {
namespace runtime {

namespace asio = boost::asio;
using boost::system::error_code;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

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

inline double secondsOf(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

inline double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A control operation's refusal: the status and {"error": why}.
inline ControlReply refusal(int status, const std::string& why) {
  ControlReply r;
  r.status = status;
  r.body = json{{"error", why}};
  return r;
}

// Prometheus text format: one metric with its help and type.
inline void metric(std::string& out, const char* name, const char* type, const char* help,
                   double value) {
  out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.17g", value);
  out += std::string(name) + " " + buf + "\n";
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

class Coordinator::Impl : public control::Backend, public EventFeed {
 public:
  class Session;

  explicit Impl(CoordinatorOptions options)
      : options_(std::move(options)), checkTimer_(io_), startTimer_(io_) {
    if (options_.token == 0) {
      std::random_device rd;
      options_.token = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ 1;
    }
    if (options_.expectedWorkers < 1) {
      SINEW_THROW(InvalidArgument,
                  "CoordinatorOptions::expectedWorkers = ", options_.expectedWorkers,
                  " must be >= 1");
    }
    if (options_.heartbeatInterval.count() <= 0 ||
        options_.deadAfter <= options_.heartbeatInterval) {
      SINEW_THROW(InvalidArgument, "CoordinatorOptions::deadAfter = ", options_.deadAfter.count(),
                  " ms must exceed heartbeatInterval = ", options_.heartbeatInterval.count(),
                  " ms > 0");
    }
    if (!options_.eventLogPath.empty()) {
      events_.open(options_.eventLogPath, {{"source", "coordinator"}});
    }
    collectives::TcpStoreServerOptions so;
    so.host = options_.host;
    so.token = options_.token;
    so.log = options_.log;
    store_ = std::make_unique<collectives::TcpStoreServer>(so);

    collectives::transport::ListenerOptions lo;
    lo.host = options_.host;
    lo.port = options_.port;
    lo.maxConnections = options_.maxConnections;
    lo.channel.rules = wire::coordinatorRules(options_.token, options_.maxMessageBytes);
    // Workers heartbeat far more often; this only ends connections that never say anything.
    lo.channel.idleTimeout = std::max(options_.idleTimeout, 2 * options_.deadAfter);
    lo.channel.frameTimeout = options_.frameTimeout;
    lo.channel.name = "sinew coordinator";
    lo.channel.log = [this](const std::string& line) { logLine(line); };
    listener_ = std::make_unique<collectives::transport::Listener>(
        io_, lo, [this] { return std::make_shared<Session>(this); });
    port_ = listener_->port();
    startTime_ = Clock::now();
    if (options_.controlPort >= 0) {
      if (options_.controlPort > 65535) {
        SINEW_THROW(InvalidArgument, "CoordinatorOptions::controlPort = ", options_.controlPort,
                    " is not a port");
      }
      if (options_.controlToken.empty()) {
        char hex[32];
        std::snprintf(hex, sizeof(hex), "%llx", static_cast<unsigned long long>(options_.token));
        options_.controlToken = hex;
      }
      ControlServerOptions cs;
      // Loopback unless configured (docs/architecture.md section 7), whatever the coordinator binds
      // to.
      if (options_.controlHost.empty()) options_.controlHost = "127.0.0.1";
      cs.host = options_.controlHost;
      cs.port = static_cast<uint16_t>(options_.controlPort);
      cs.token = options_.controlToken;
      cs.requestTimeout = options_.controlTimeout;
      cs.maxConnections = options_.controlMaxConnections;
      cs.log = [this](const std::string& line) { logLine(line); };
      control_ = std::make_unique<ControlServer>(io_, cs, this, this);
      controlPort_ = control_->port();
    }
    scheduleCheck();
    // A new job waits startTimeout for its ranks; a takeover waits takeoverWait for the
    // members of the previous leader's epoch.
    const bool takeover = !options_.takeoverState.empty();
    if (takeover) restoreState(options_.takeoverState);  // InvalidArgument names a bad field.
    startTimer_.expires_after(takeover ? options_.takeoverWait : options_.startTimeout);
    startTimer_.async_wait([this](error_code e) {
      if (e) return;
      std::lock_guard<std::mutex> lock(mu_);
      if (takingOver_) {
        formTakeoverEpoch("takeover wait of " + std::to_string(options_.takeoverWait.count()) +
                          " ms ended");
      } else if (epoch_ < 0 && !ready_.empty()) {
        formFirstEpoch("start timeout");
      }
    });
    thread_ = std::thread([this] {
      collectives::transport::runIoThread(io_, [this](const std::string& what) {
        std::lock_guard<std::mutex> lock(mu_);
        log("internal error in the io thread (it goes on serving): " + what);
        event({{"event", "internal_error"}, {"what", what}});
      });
    });
  }

  ~Impl() {
    asio::post(io_, [this] {
      stopping_ = true;  // A check that already fired must not re-arm its timer.
      checkTimer_.cancel();
      startTimer_.cancel();
      listener_->close();
      if (control_) control_->close();
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& [id, d] : drains_) {
        if (d.timer) d.timer->cancel();
      }
      if (stopTimer_) stopTimer_->cancel();
      subscribers_.clear();
    });
    thread_.join();
  }

  CoordinatorStatus coordinatorStatus() const {
    std::lock_guard<std::mutex> lock(mu_);
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
    for (const auto& [id, r] : releasedWorkers_) {
      if (!r.exited) s.releasedRunning.push_back(id);
    }
    return s;
  }

  bool waitFinished(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, timeout, [&] { return finished_ || (epoch_ >= 0 && members_.empty()); });
    return finished_ && (!done_.empty() || stopped_);
  }

  void log(const std::string& line) { logLine("sinew coordinator: " + line); }
  void logLine(const std::string& full) {
    if (options_.log) {
      options_.log(full);
    } else {
      std::fprintf(stderr, "%s\n", full.c_str());
    }
  }

  // Runs f on the io thread (at once when called there) and returns its result: the control
  // operations write to workers' connections, which only the io thread may touch.
  template <typename F>
  auto onIo(F f) -> decltype(f()) {
    if (std::this_thread::get_id() == thread_.get_id()) return f();
    std::packaged_task<decltype(f())()> task(std::move(f));
    auto result = task.get_future();
    asio::post(io_, [&task] { task(); });
    return result.get();
  }

  // control::Backend (docs/control_api.md); on the io thread, mu_ not held.
  ControlReply status() override;
  ControlReply scaling() override;
  ControlReply resize(int64_t nodes) override;
  ControlReply drain(const control::DrainRequest& request) override;
  ControlReply checkpoint() override;
  ControlReply stop(double deadlineSeconds) override;
  std::string metrics() override;
  // EventFeed.
  int subscribe(Sink sink, int64_t after) override;
  void unsubscribe(int id) override;

  CoordinatorOptions options_;
  uint16_t port_ = 0;
  uint16_t controlPort_ = 0;
  std::unique_ptr<collectives::TcpStoreServer> store_;

 private:
  friend class Session;
  struct Worker {
    int id = -1;
    std::string node;
    int64_t pid = 0;
    std::shared_ptr<Session> session;
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
    std::shared_ptr<Session> session;
    bool exited = false;
  };
  // A drain (POST /v1/drain): these workers must be free by the deadline.
  struct Drain {
    int id = 0;
    std::vector<int> workers;
    double deadlineSeconds = 0;
    double requestedAt = 0;  // wall-clock seconds
    int64_t releaseStep = -1;
    bool expelled = false;  // the deadline passed first: they were declared dead
    std::unique_ptr<asio::steady_timer> timer;
  };

  void scheduleCheck();

  // Everything below runs on the io thread with mu_ held.
  void onMessage(const std::shared_ptr<Session>& s, const collectives::transport::FrameHeader& h,
                 const json& body);
  void onHello(const std::shared_ptr<Session>& s, const json& body);
  void onVote(int worker, int64_t epoch, int64_t step);
  void onDone(int worker, int64_t step);
  void onReady(int worker, int64_t resumeStep, const json& body);
  void onLeave(int worker, int64_t step);
  void onDurable(int worker, const json& body);
  void onVoteStats(Worker& w, const json& body);
  void release(int worker, const std::string& why);
  void sendCommit(int worker, int64_t step, bool nextEpoch);
  // A drain is done with its workers once each was released or declared dead.
  void updateDrains();
  void noteCommit(int64_t step);
  std::string state() const;
  int currentNodes() const;
  std::vector<std::string> nodesOf(const std::vector<int>& workers) const;
  json drainJson(const Drain& d) const;
  json durableJson() const;
  double samplesPerSecondNow() const;
  // The median of the newest step times (seconds; 0 before any was measured).
  double medianStepSeconds(size_t newest = SIZE_MAX) const;
  // The step time at n workers from the measured ones (data parallel: t(n) = a + b / n).
  std::map<int, double> measuredStepSeconds() const;
  void onSessionClosed(const std::shared_ptr<Session>& s, const std::string& why);
  void declareDead(int worker, const std::string& why);
  // Whether the coordinator was paused since the last check (then discounted).
  bool discountOwnPause(Clock::time_point now);
  void noteProgress(Worker& w, int64_t step, bool waiting, Clock::time_point now);
  void checkProgress(Clock::time_point now);
  std::chrono::milliseconds stepDeadline() const;
  void formFirstEpoch(const std::string& why);
  void newEpoch(const std::string& why, std::vector<int> joiners);
  json epochBody(const std::vector<int>& joined, bool sync) const;
  void onPipeline(int worker, const json& body);
  void onRollback(int worker, int64_t step);
  // A plan for members_ and how it was made (pipelinePlan).
  struct EpochPlan {
    pipeline::Plan plan;
    std::string how;                 // "instantiated" or a pipeline::reconfigurationKindName
    std::vector<std::string> steps;  // a reconfiguration's steps, for the log
  };
  EpochPlan pipelinePlan() const;
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
  void event(json e);
  void checkFinished();

  asio::io_context io_;
  std::unique_ptr<collectives::transport::Listener> listener_;
  asio::steady_timer checkTimer_;
  Clock::time_point lastCheck_{};  // when the liveness check last ran
  Clock::time_point lastCommit_{};
  std::deque<Clock::duration> stepTimes_;  // between the last commits, at most 20
  asio::steady_timer startTimer_;
  std::thread thread_;
  bool stopping_ = false;  // io thread only

  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Guarded by mu_.
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
  // A pipeline job (docs/pipeline.md): the profile and options a worker sent, and the
  // templates planned once from them; every epoch after carries its plan.
  bool pipelineJob_ = false;
  json pipelineRequest_;  // the request the templates were planned from, and for how many nodes
  int pipelineNodes_ = 0;
  // High availability (docs/ha.md).
  bool deposed_ = false;
  Clock::time_point lastPersist_{};
  bool persistNextCommit_ = false;
  bool takingOver_ = false;          // waiting for the members of takeoverMembers_
  std::set<int> takeoverMembers_;    // the previous leader's last epoch's members
  std::map<int, int64_t> rejoined_;  // reconnected members -> the last commit they had
  pipeline::Profile profile_;
  pipeline::PlanOptions planOptions_;
  pipeline::TemplateSet templates_;
  // The plan of the current epoch (pipeline jobs; none before the first, nor on a new leader
  // until its first epoch): the next epoch's plan starts from it (pipelinePlan).
  std::optional<pipeline::Plan> plan_;
  EventLog events_;

  // The control API (docs/control_api.md). Guarded by mu_.
  std::unique_ptr<ControlServer> control_;  // Used on the io thread only.
  Clock::time_point startTime_{};
  std::map<int, int64_t> pids_;
  int64_t globalBatch_ = 0;
  int64_t microbatch_ = 0;
  int64_t totalSteps_ = 0;
  bool checkpointsOn_ = false;
  bool jobFailed_ = false;
  // Commits: how many, when the first was, time between commits of one epoch (per member
  // count, at most 50 each), their sum (effective training time).
  int64_t commits_ = 0;
  Clock::time_point firstCommit_{};
  std::map<int, std::deque<double>> stepSecondsBySize_;
  double effectiveSeconds_ = 0;
  int64_t epochCommits_ = 0;  // commits in the current epoch
  // Failures and recoveries (failure declared -> next commit).
  int64_t failures_ = 0;
  bool recovering_ = false;
  Clock::time_point recoveringSince_{};
  std::vector<double> recoverySeconds_;
  double stallSeconds_ = 0;
  int64_t replicatedBytes_ = 0;  // Peer-RAM replica bytes the workers reported with their votes.
  // Checkpoints: a request waits for the next commit; the durable version reported last.
  bool checkpointNext_ = false;
  int64_t checkpointStep_ = -1;  // the newest step whose commit asked for a checkpoint
  struct DurableVersion {
    int64_t step = -1;
    std::string path;
    int64_t bytes = 0;
    double flushSeconds = 0;
    Clock::time_point at{};
  } durable_;
  int64_t durableWrites_ = 0;
  int64_t rollbacks_ = 0;  // Rollbacks to an older version (pipelines).
  int64_t durableBytes_ = 0;
  double flushSecondsTotal_ = 0;
  // Releases, drains, resizes, stop.
  std::map<int, ReleasedWorker> releasedWorkers_;
  std::map<int, std::string> leaveReason_;  // coordinator-initiated leaves -> why
  std::map<int, Drain> drains_;
  int nextDrain_ = 1;
  json lastResize_;
  int targetNodes_ = -1;     // the last resize's target (-1: none)
  int joinersStarting_ = 0;  // workers a launcher started for a resize that have not said hello
  bool stopRequested_ = false;
  double stopDeadline_ = 0;
  std::unique_ptr<asio::steady_timer> stopTimer_;
  // Events for /v1/events: the newest ones, and who is listening.
  int64_t eventSeq_ = 0;
  std::deque<std::pair<int64_t, json>> recentEvents_;
  std::map<int, Sink> subscribers_;
  int nextSubscriber_ = 1;
};

// One worker's connection: the channel reads and checks frames; this dispatches them under
// mu_. Writes are queued on the channel.
class Coordinator::Impl::Session : public collectives::transport::ChannelHandler,
                                   public std::enable_shared_from_this<Session> {
 public:
  explicit Session(Impl* owner) : owner_(owner) {}

  void onFrame(collectives::transport::Channel& channel,
               const collectives::transport::FrameHeader& h,
               std::vector<uint8_t> payload) override {
    if (!channel_) channel_ = channel.shared_from_this();
    json body = wire::decodeBody(h.type, payload);  // Corruption drops the connection.
    std::lock_guard<std::mutex> lock(owner_->mu_);
    if (closed_) return;
    try {
      owner_->onMessage(shared_from_this(), h, body);
    } catch (const Error& e) {
      // ProtocolViolation, or a field a handler checks itself (InvalidArgument, Corruption).
      owner_->dropped_++;
      owner_->log("dropping connection from " + describe() + ": bad " + wire::typeName(h.type) +
                  " message: " + e.what());
      owner_->onSessionClosed(shared_from_this(), std::string("protocol violation: ") + e.what());
    } catch (const std::exception& e) {
      // A bug in a handler: reported as such; the connection goes, the coordinator stays.
      owner_->dropped_++;
      owner_->log("internal error handling a " + std::string(wire::typeName(h.type)) +
                  " message from " + describe() + ": " + e.what() + "; dropping the connection");
      owner_->event({{"event", "internal_error"}, {"error", e.what()}});
      owner_->onSessionClosed(shared_from_this(), std::string("internal error: ") + e.what());
    }
  }

  // Called later on the io thread (never from inside close()).
  void onClose(collectives::transport::Channel& channel, collectives::transport::CloseReason reason,
               const std::string& why) override {
    std::lock_guard<std::mutex> lock(owner_->mu_);
    channel_.reset();
    if (owner_->stopping_) return;  // Shutting down: no failure to declare.
    if (reason == collectives::transport::CloseReason::kViolation ||
        reason == collectives::transport::CloseReason::kTimeout) {
      owner_->dropped_++;
    }
    owner_->onSessionClosed(shared_from_this(),
                            reason == collectives::transport::CloseReason::kViolation
                                ? "protocol violation: " + why
                                : why);
  }

  void write(wire::Type type, int64_t epoch, const json& body, bool closeAfter = false) {
    if (closed_ || !channel_ || !owner_->mayWrite()) return;
    channel_->send(static_cast<uint8_t>(type), epoch, wire::encodeBody(body));
    if (closeAfter) channel_->closeAfterWrites();
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    if (channel_) channel_->close();
  }

  std::string describe() const {
    std::string peer = channel_ ? channel_->peer() : "an unknown peer";
    return worker_ >= 0 ? "worker " + std::to_string(worker_) + " (" + peer + ")" : peer;
  }

  int worker_ = -1;
  bool closed_ = false;

 private:
  Impl* const owner_;  // Outlives its sessions: ~Impl closes them and joins the io thread.
  std::shared_ptr<collectives::transport::Channel> channel_;  // Reset when it closes.
};

}  // namespace runtime
}  // namespace sinew
