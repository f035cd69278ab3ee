#include "sinew/runtime/coordinator.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
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
using asio::ip::tcp;
using boost::system::error_code;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

// A worker's message that breaks the protocol where it arrives (a second hello, a message
// before hello, a type a worker may not send, ...): the session drops that connection with
// the reason logged; the coordinator goes on.
class ProtocolViolation : public Corruption {
 public:
  using Corruption::Corruption;
};

[[noreturn]] void throwViolation(const std::string& why) { throw ProtocolViolation(why); }

}  // namespace

namespace {

double secondsOf(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A control operation's refusal: the status and {"error": why}.
ControlReply refusal(int status, const std::string& why) {
  ControlReply r;
  r.status = status;
  r.body = json{{"error", why}};
  return r;
}

// Prometheus text format: one metric with its help and type.
void metric(std::string& out, const char* name, const char* type, const char* help, double value) {
  out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.17g", value);
  out += std::string(name) + " " + buf + "\n";
}

// A label value, escaped as the text format requires.
std::string labelValue(const std::string& v) {
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

}  // namespace

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

void Coordinator::Impl::scheduleCheck() {
  checkTimer_.expires_after(options_.heartbeatInterval / 2);
  checkTimer_.async_wait([this](error_code ec) {
    if (ec || stopping_) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto now = Clock::now();
    const bool paused = discountOwnPause(now);
    std::vector<std::pair<int, int64_t>> silent;
    for (const auto& [id, w] : workers_) {
      if (done_.count(id)) continue;
      auto quiet = now - w.lastHeard;
      if (quiet > options_.deadAfter) {
        silent.emplace_back(id,
                            std::chrono::duration_cast<std::chrono::milliseconds>(quiet).count());
      }
    }
    for (const auto& [id, ms] : silent) {
      declareDead(id, "no heartbeat for " + std::to_string(ms) + " ms");
    }
    // Right after a pause the workers' messages of the pause are still unread: judge
    // progress at the next check.
    if (!paused) checkProgress(now);
    scheduleCheck();
  });
}

// The check runs every heartbeatInterval / 2. A run much later than that means this process
// (or its io thread) did not run: a SIGSTOP, a Slurm suspend, a VM pause. The workers' silence
// over that time is the coordinator's own doing (docs/failure_semantics.md, rule 2), so it is
// not counted against them: their last-heard times move forward by the pause.
bool Coordinator::Impl::discountOwnPause(Clock::time_point now) {
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

void Coordinator::Impl::noteProgress(Worker& w, int64_t step, bool waiting, Clock::time_point now) {
  if (waiting && (!w.waiting || w.step != step)) w.waitingSince = now;
  if (waiting) {
    w.lastWaited = now;
    w.lastWaitedStep = step;
  }
  w.step = step;
  w.waiting = waiting;
}

std::chrono::milliseconds Coordinator::Impl::stepDeadline() const {
  auto deadline = options_.progressFloor;
  if (!stepTimes_.empty()) {
    std::vector<Clock::duration> sorted(stepTimes_.begin(), stepTimes_.end());
    std::sort(sorted.begin(), sorted.end());
    auto median = std::chrono::duration_cast<std::chrono::milliseconds>(sorted[sorted.size() / 2]);
    deadline = std::max(deadline, options_.progressFactor * median);
  }
  return deadline;
}

// Rule 1 of docs/failure_semantics.md: a member that computes on while the others have waited
// for it past the step deadline is stuck (a hung training thread, a late vote), not they: it
// alone is declared dead, and the next epoch goes on without it.
void Coordinator::Impl::checkProgress(Clock::time_point now) {
  // Not before a step time has been measured: the first step (warm-up, first allocations)
  // may take long on every worker for reasons of its own.
  if (options_.progressFloor.count() <= 0 || epoch_ < 0 || members_.size() < 2 ||
      stepTimes_.empty()) {
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

void Coordinator::Impl::onSessionClosed(const std::shared_ptr<Session>& s, const std::string& why) {
  int worker = s->worker_;
  s->close();
  if (worker < 0) return;
  auto rit = releasedWorkers_.find(worker);
  if (rit != releasedWorkers_.end() && rit->second.session == s && !rit->second.exited) {
    // A released worker closes its connection when its process ends: its node is free.
    rit->second.exited = true;
    rit->second.session.reset();
    event({{"event", "worker_exited"}, {"worker", worker}, {"node", rit->second.node}});
    return;
  }
  auto it = workers_.find(worker);
  if (it == workers_.end() || it->second.session != s) return;
  if (done_.count(worker)) {
    workers_.erase(it);
    return;
  }
  declareDead(worker, why);
}

void Coordinator::Impl::onMessage(const std::shared_ptr<Session>& s,
                                  const collectives::transport::FrameHeader& h, const json& body) {
  auto type = static_cast<wire::Type>(h.type);
  if (type == wire::Type::kHello) {
    if (s->worker_ >= 0) throwViolation("second hello on one connection");
    return onHello(s, body);
  }
  if (s->worker_ < 0) {
    throwViolation(std::string(wire::typeName(h.type)) + " before hello");
  }
  int worker = s->worker_;
  auto it = workers_.find(worker);
  if (it == workers_.end()) {
    // A released worker still writes the checkpoint of its last step and says so; anything
    // else from it, or from a worker declared dead (its expulsion is on its way), is moot.
    if (type == wire::Type::kDurable && releasedWorkers_.count(worker)) onDurable(worker, body);
    return;
  }
  it->second.lastHeard = Clock::now();
  if (h.epoch > epoch_) {
    throwViolation("message of epoch " + std::to_string(h.epoch) +
                   " from the future (current epoch " + std::to_string(epoch_) + ")");
  }
  switch (type) {
    case wire::Type::kHeartbeat:
      // Liveness in any epoch; progress only in the current one.
      if (h.epoch == epoch_ && body.contains("waiting")) {
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
  if (h.epoch < epoch_) {
    // A message that crossed an epoch change is stale, not hostile: dropping the connection
    // would turn a benign race into a false failure (docs/coordinator_protocol.md).
    ignored_++;
    log(std::string("ignoring a ") + wire::typeName(h.type) + " of epoch " +
        std::to_string(h.epoch) + " from worker " + std::to_string(worker) + " (current epoch " +
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
      return onVote(worker, h.epoch, body.at("step").get<int64_t>());
    case wire::Type::kPipeline:
      return onPipeline(worker, body);
    case wire::Type::kRollback:
      return onRollback(worker, body.at("step").get<int64_t>());
    case wire::Type::kRebuild:
      log("worker " + std::to_string(worker) + " could not build epoch " + std::to_string(epoch_) +
          "'s communicator; rebuilding");
      return newEpoch("rebuild requested by worker " + std::to_string(worker), {});
    default:
      throwViolation(std::string("a worker may not send ") + wire::typeName(h.type));
  }
}

void Coordinator::Impl::onHello(const std::shared_ptr<Session>& s, const json& body) {
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
    s->write(wire::Type::kExpelled, epoch_, json{{"reason", why}}, /*closeAfter=*/true);
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
  s->worker_ = id;
  Worker w;
  w.id = id;
  w.node = node;
  w.pid = pid;
  w.session = s;
  w.lastHeard = Clock::now();
  workers_[id] = w;
  pids_[id] = pid;
  json welcome = {{"worker", id},
                  {"store_host", options_.host},
                  {"store_port", store_->port()},
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
                                  (pipelineJob_ ? profile_.job.devices_per_node : 1) >=
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

void Coordinator::Impl::onReady(int worker, int64_t resumeStep, const json& body) {
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

void Coordinator::Impl::formFirstEpoch(const std::string& why) {
  startTimer_.cancel();
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
  for (int id : notReady) {
    // Only this worker: its node's other workers may well be ready.
    log("worker " + std::to_string(id) + " left out: not ready when the first epoch formed");
    send(id, wire::Type::kExpelled, json{{"reason", "not ready when the first epoch formed"}});
    dead_.push_back(id);
    workers_.erase(id);
    hellos_.erase(std::remove(hellos_.begin(), hellos_.end(), id), hellos_.end());
  }
  for (int id : hellos_) workers_[id].hasState = true;
  std::vector<int> none;
  epoch_ = -1;
  newEpoch("first epoch (" + why + ")", none);
}

void Coordinator::Impl::newEpoch(const std::string& why, std::vector<int> joiners) {
  epoch_ = epoch_ < 0 ? 0 : epoch_ + 1;
  votes_.clear();
  for (auto& [id, w] : workers_) {
    w.waiting = false;  // Progress counts afresh in the new epoch.
    w.step = -1;
  }
  lastCommit_ = Clock::time_point{};  // A recovery is not a step.
  epochCommits_ = 0;
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
  if (pipelineJob_) {
    try {
      EpochPlan made = pipelinePlan();
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
      plan_ = plan;
    } catch (const Error& e) {
      return failJob("no pipeline plan for the " + std::to_string(members_.size()) +
                     " workers of epoch " + std::to_string(epoch_) + ": " + e.what());
    }
  }
  if (!persistState()) return;  // Another leader's job now: nothing is sent.
  persistNextCommit_ = true;    // The epoch's first commit is stored at once (recovered).
  for (int id : members_) send(id, wire::Type::kEpoch, body);
  for (int id : joined) workers_[id].hasState = true;
  log("epoch " + std::to_string(epoch_) + ": " + std::to_string(members_.size()) +
      " members, resume at step " + std::to_string(committed_ + 1) + " (" + why + ")");
  event({{"event", "epoch"},
         {"epoch", epoch_},
         {"members", members_},
         {"joined", joined},
         {"resume_step", committed_ + 1},
         {"reason", why}});
  cv_.notify_all();
}

json Coordinator::Impl::epochBody(const std::vector<int>& joined, bool sync) const {
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

// A worker of a pipeline job found a layer that no member holds live after this epoch's
// resume step (every worker that held it is gone): the job resumes after `step`, the newest
// version still held somewhere (peers' RAM or disk), which every member restores in the
// epoch this starts (docs/pipeline.md, "Rollback"). Only before the epoch's first commit.
void Coordinator::Impl::onRollback(int worker, int64_t step) {
  const std::string who = "worker " + std::to_string(worker) + "'s rollback to step ";
  if (!pipelineJob_ || epochCommits_ > 0 || step >= committed_) {
    log("ignoring " + who + std::to_string(step) + " (epoch " + std::to_string(epoch_) +
        " resumes at step " + std::to_string(committed_ + 1) +
        (epochCommits_ > 0 ? ", and has committed steps" : "") + ")");
    return;
  }
  const int64_t from = committed_;
  committed_ = step;
  rollbacks_++;
  event(
      {{"event", "rollback"}, {"epoch", epoch_}, {"from", from}, {"to", step}, {"worker", worker}});
  newEpoch("rollback from step " + std::to_string(from) + " to the version after step " +
               std::to_string(step) + ": a layer has no live copy",
           {});
}

// A worker sends the job's pipeline profile once (the first member of the first epoch, after
// every member profiled): the coordinator plans the templates once, for the nodes of this
// epoch up to the workers the job may grow to (max_workers), and starts an epoch that carries
// the plan; every later epoch re-instantiates them for its members. Later requests are
// ignored: the first one fixed the job's templates.
void Coordinator::Impl::onPipeline(int worker, const json& body) {
  if (pipelineJob_) return;
  const std::string who = "worker " + std::to_string(worker) + "'s pipeline request: ";
  std::string error = planPipelines(body, -1);
  if (!error.empty()) return failJob(who + error);
  newEpoch("pipeline plan", {});
}

// Plans the job's templates from a pipeline request, for `nodes` nodes (-1: this epoch's
// members' nodes) up to the workers the job may grow to (max_workers). A coordinator taking
// over plans them again from the request its predecessor persisted (the planner is
// deterministic, so they are the predecessor's templates) and reconfigures the predecessor's
// last plan, which it persisted too (pipelinePlan).
std::string Coordinator::Impl::planPipelines(const json& body, int nodes) {
  try {
    profile_ = pipeline::parseProfileJson(body.at("profile").get<std::string>());
  } catch (const Error& e) {
    return std::string("bad profile: ") + e.what();
  }
  const int G = profile_.job.devices_per_node;
  if (nodes < 0) nodes = static_cast<int>(members_.size()) / G;
  planOptions_.fault_tolerance = body.at("fault_tolerance").get<int>();
  planOptions_.global_microbatches = body.at("microbatches").get<int64_t>();
  // The most workers the job may grow to by joins (absent or 0: the workers it starts with).
  int64_t maxWorkers = 0;
  try {
    if (body.contains("max_workers")) {
      maxWorkers = sinew::detail::jsonInt(body["max_workers"], "max_workers", 0, 1 << 20);
    }
  } catch (const Error& e) {
    return e.what();
  }
  try {
    if (nodes < 1) {
      SINEW_THROW(InvalidArgument, members_.size(), " workers are fewer than one node of ",
                  "devices_per_node = ", G);
    }
    pipeline::TemplateOptions to;
    to.nodes = nodes;
    to.max_nodes = static_cast<int>(maxWorkers / G);
    to.fault_tolerance = planOptions_.fault_tolerance;
    to.global_microbatches = planOptions_.global_microbatches;
    templates_ = pipeline::planTemplates(profile_, to);
  } catch (const Error& e) {
    return e.what();
  }
  pipelineJob_ = true;
  pipelineRequest_ = body;
  pipelineNodes_ = nodes;
  log("planned pipeline templates for " + std::to_string(templates_.min_nodes) + ".." +
      std::to_string(templates_.max_nodes) + " nodes (" + std::to_string(nodes) + " nodes of " +
      std::to_string(G) + " workers, up to " +
      std::to_string(std::max<int64_t>(nodes, maxWorkers / G)) +
      " nodes by joins, fault tolerance " + std::to_string(planOptions_.fault_tolerance) + ")");
  return "";
}

// ---- High availability (docs/ha.md) ----------------------------------------------------------

bool Coordinator::Impl::mayWrite() {
  if (deposed_) return false;
  if (options_.mayWrite && !options_.mayWrite()) {
    // Not from inside a write: depose closes the sessions.
    asio::post(io_, [this] {
      std::lock_guard<std::mutex> lock(mu_);
      depose("its leader lease may have ended");
    });
    deposed_ = true;  // Nothing more goes out, from this moment.
    return false;
  }
  return true;
}

void Coordinator::Impl::depose(const std::string& why) {
  if (stopping_) return;
  deposed_ = true;
  stopping_ = true;  // Closing the connections below declares nobody dead.
  checkTimer_.cancel();
  startTimer_.cancel();
  log("this coordinator's term is over (" + why +
      "): it sends nothing more and closes every connection");
  event({{"event", "deposed"}, {"epoch", epoch_}, {"reason", why}});
  for (auto& [id, w] : workers_) {
    if (w.session) w.session->close();
  }
  for (auto& [id, r] : releasedWorkers_) {
    if (r.session) r.session->close();
  }
  cv_.notify_all();
}

std::string Coordinator::Impl::stateJson() const {
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
             {"durable_step", durable_.step},
             {"durable_path", durable_.path},
             {"shape",
              {{"global_batch", globalBatch_},
               {"microbatch", microbatch_},
               {"steps", totalSteps_},
               {"checkpoints", checkpointsOn_}}}};
  if (pipelineJob_) {
    st["pipeline"] = pipelineRequest_;
    st["pipeline_nodes"] = pipelineNodes_;
    // The epoch's plan, which the next one starts from (pipelinePlan): a new leader
    // reconfigures it for the members that rejoin it.
    if (plan_) st["plan"] = json::parse(pipeline::planToJson(*plan_));
  }
  return st.dump();
}

bool Coordinator::Impl::persistState() {
  if (deposed_) return false;
  if (!options_.persist) return true;
  try {
    options_.persist(stateJson());
    lastPersist_ = Clock::now();
    return true;
  } catch (const std::exception& e) {
    depose(std::string("its state could not be stored: ") + e.what());
    return false;
  }
}

bool Coordinator::Impl::persistThrottled() {
  if (options_.persist && !persistNextCommit_ &&
      Clock::now() - lastPersist_ < options_.persistCommitsEvery) {
    return !deposed_;
  }
  persistNextCommit_ = false;
  return persistState();
}

void Coordinator::Impl::restoreState(const std::string& text) {
  json st = json::parse(text, nullptr, /*allow_exceptions=*/false);
  const std::string what = "the job state to take over";
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
  finished_ = st.value("finished", false);
  stopped_ = st.value("stopped", false);
  durable_.step = st.value("durable_step", int64_t(-1));
  durable_.path = st.value("durable_path", std::string());
  if (st.contains("shape")) {
    const json& shape = st.at("shape");
    globalBatch_ = shape.value("global_batch", int64_t(0));
    microbatch_ = shape.value("microbatch", int64_t(0));
    totalSteps_ = shape.value("steps", int64_t(0));
    checkpointsOn_ = shape.value("checkpoints", false);
  }
  if (st.contains("pipeline")) {
    std::string error = planPipelines(
        st.at("pipeline"), static_cast<int>(jsonInt(jsonField(st, "pipeline_nodes", what),
                                                    "pipeline_nodes", 1, 1 << 20)));
    if (!error.empty()) SINEW_THROW(InvalidArgument, what, ": its pipeline request: ", error);
    if (st.contains("plan")) {
      try {
        plan_ = pipeline::planFromJson(st.at("plan").dump());
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

void Coordinator::Impl::formTakeoverEpoch(const std::string& why) {
  if (!takingOver_) return;
  takingOver_ = false;
  startTimer_.cancel();
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
    failures_++;
  }
  if (workers_.empty()) {
    // Every step committed: the members applied the last one and ended (their done may have
    // gone to the previous leader after it stored its last state).
    const bool allSteps = totalSteps_ > 0 && committed_ + 1 >= totalSteps_;
    if (!done_.empty() || allSteps) {
      finished_ = true;
      persistState();
      cv_.notify_all();
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
    if (had < committed_ && workers_.count(id)) sendCommit(id, committed_, false);
  }
  rejoined_.clear();
  recovering_ = true;
  recoveringSince_ = Clock::now();
  newEpoch("a new leader took over (" + why + ")", {});
}

// The plan for members_: with G devices per node, node k is members [kG, kG + G) in
// ascending id order (its id the first of them, device i the i-th); members beyond the last
// full node stay idle. Throws InvalidArgument if the templates cannot cover them.
// When the members are the nodes of the last epoch's plan less some lost ones (one device per
// node: with more, a loss renumbers the nodes after it), the plan is that plan reconfigured
// from the templates (pipeline::reconfigure, docs/pipeline.md section 5): pipelines that lost
// no node keep their nodes and layers; one that lost some shrinks to a smaller template,
// takes idle nodes, borrows from the largest pipeline or merges with another, and if none of
// that applies all survivors are re-planned ("replan"). Otherwise (the first epoch, joins,
// several devices per node) the templates are instantiated for all of them
// (pipeline::makePlan; after the first epoch with fewer than f + 1 pipelines if the nodes
// cannot hold them). The same nodes as the last epoch's keep its plan. A new leader starts
// from its predecessor's last plan (persisted with the job's state).
Coordinator::Impl::EpochPlan Coordinator::Impl::pipelinePlan() const {
  const int G = profile_.job.devices_per_node;
  const int nodes = static_cast<int>(members_.size()) / G;
  std::vector<int> nodeIds;
  for (int k = 0; k < nodes; ++k) nodeIds.push_back(members_[k * G]);
  EpochPlan out;
  if (G == 1 && plan_) {
    std::set<int> before(plan_->idleNodeIds.begin(), plan_->idleNodeIds.end());
    for (const auto& p : plan_->pipelines) before.insert(p.nodeIds.begin(), p.nodeIds.end());
    bool onlyLosses = true;
    for (int id : nodeIds) onlyLosses = onlyLosses && before.count(id) > 0;
    std::vector<int> lost;
    for (int id : before) {
      if (std::find(nodeIds.begin(), nodeIds.end(), id) == nodeIds.end()) lost.push_back(id);
    }
    if (onlyLosses && lost.empty()) {
      // The same nodes (a rollback, or a reconfiguration tried again): the same plan, so that
      // no layer moves for nothing.
      out.plan = *plan_;
      out.how = "unchanged";
    } else if (onlyLosses) {
      try {
        pipeline::Reconfiguration r = pipeline::reconfigure(templates_, *plan_, lost);
        out.plan = std::move(r.plan);
        out.how = pipeline::reconfigurationKindName(r.kind);
        out.steps = std::move(r.steps);
      } catch (const InvalidArgument&) {
        // Too few survivors for the templates: makePlan says so below, in its own words.
      }
    }
  }
  if (out.how.empty()) {
    // After the first epoch, with fewer pipelines than f + 1 if the nodes cannot hold that
    // many (as pipeline::reconfigure's re-plan and its borrows and merges may leave the job):
    // training goes on with every node it has.
    out.plan = plan_ ? pipeline::makePlanLoweringFaultTolerance(templates_, nodeIds, planOptions_)
                     : pipeline::makePlan(templates_, nodeIds, planOptions_);
    if (out.plan.faultTolerance < planOptions_.fault_tolerance) {
      out.steps.push_back("no plan of " + std::to_string(planOptions_.fault_tolerance + 1) +
                          " pipelines for these nodes: " +
                          std::to_string(out.plan.faultTolerance + 1) + " instead");
    }
    out.plan.faultTolerance = planOptions_.fault_tolerance;  // keep aiming for f + 1
    out.how = "instantiated";
  }
  out.plan.epoch = epoch_;
  for (auto& w : out.plan.workers) {
    const int k =
        static_cast<int>(std::find(nodeIds.begin(), nodeIds.end(), w.node) - nodeIds.begin());
    w.worker = members_[k * G + w.device];
  }
  return out;
}

// Ends the job: every worker is expelled with the reason (e.g. a plan no template fits).
void Coordinator::Impl::failJob(const std::string& why) {
  log("job failed: " + why);
  jobFailed_ = true;
  if (!persistState()) return;
  event({{"event", "job_failed"}, {"epoch", epoch_}, {"reason", why}});
  for (auto& [id, w] : workers_) {
    if (w.session && !w.session->closed_) {
      w.session->write(wire::Type::kExpelled, epoch_, json{{"reason", why}}, /*closeAfter=*/true);
    }
    dead_.push_back(id);
  }
  workers_.clear();
  members_.clear();
  hellos_.clear();
  ready_.clear();
  pendingJoin_.clear();
  cv_.notify_all();
}

void Coordinator::Impl::onVote(int worker, int64_t epoch, int64_t step) {
  if (step != committed_ + 1) {
    ignored_++;
    log("ignoring worker " + std::to_string(worker) + "'s vote for step " + std::to_string(step) +
        " (expected step " + std::to_string(committed_ + 1) + ")");
    return;
  }
  auto& voters = votes_[step];
  voters.insert(worker);
  noteProgress(workers_.at(worker), step, /*waiting=*/true, Clock::now());
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
    for (int id : members_) sendCommit(id, step, false);
    return;
  }
  if (!leaving_.empty()) {
    // Step boundary with preempted (or drained, or resized away) members: they apply this
    // step, then are released.
    std::vector<int> old = members_;
    for (int id : old) sendCommit(id, step, true);
    std::vector<int> leaving(leaving_.begin(), leaving_.end());
    leaving_.clear();
    for (int id : leaving) {
      auto why = leaveReason_.find(id);
      release(id, (why != leaveReason_.end() ? why->second : std::string("preempted")) +
                      "; left after step " + std::to_string(step));
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
      cv_.notify_all();
      return;
    }
    newEpoch("worker(s) preempted after step " + std::to_string(step), pendingJoin_);
    return;
  }
  // Step boundary with joiners: the commit carries the next epoch, so members switch to it
  // right after applying the step.
  std::vector<int> joiners = pendingJoin_;
  std::vector<int> old = members_;
  for (int id : old) sendCommit(id, step, true);
  newEpoch("worker(s) joining at step " + std::to_string(step + 1), joiners);
}

void Coordinator::Impl::onLeave(int worker, int64_t step) {
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

void Coordinator::Impl::release(int worker, const std::string& why) {
  auto it = workers_.find(worker);
  if (it == workers_.end()) return;
  if (it->second.session && !it->second.session->closed_) {
    // The connection stays open: the worker may still report its checkpoint, and its closing
    // says the process is gone (docs/control_api.md, drains).
    it->second.session->write(wire::Type::kReleased, epoch_,
                              json{{"reason", why}, {"step", committed_}});
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

void Coordinator::Impl::onDone(int worker, int64_t step) {
  done_.insert(worker);
  event({{"event", "done"}, {"worker", worker}, {"step", step}});
  const bool wasFinished = finished_;
  checkFinished();                               // Stores the state if this ends the job...
  if (finished_ == wasFinished) persistState();  // ...else the done is stored here.
}

void Coordinator::Impl::checkFinished() {
  if (epoch_ < 0 || members_.empty()) return;
  for (int id : members_) {
    if (!done_.count(id)) return;
  }
  if (!finished_) {
    finished_ = true;
    persistState();
    log("job finished at step " + std::to_string(committed_) + " in epoch " +
        std::to_string(epoch_));
    event({{"event", "finished"}, {"step", committed_}, {"epoch", epoch_}});
    for (int id : pendingJoin_) declareDead(id, "the job has finished");
    cv_.notify_all();
  }
}

void Coordinator::Impl::declareDead(int worker, const std::string& why) {
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
  for (int id : victims) {
    auto wit = workers_.find(id);
    if (wit == workers_.end()) continue;
    std::string reason =
        id == worker ? why : "node " + node + " of worker " + std::to_string(worker) + " failed";
    log("worker " + std::to_string(id) + " declared dead: " + reason);
    event({{"event", "failure"},
           {"worker", id},
           {"node", node},
           {"reason", reason},
           {"epoch", epoch_},
           {"committed_step", committed_}});
    if (wit->second.session && !wit->second.session->closed_) {
      wit->second.session->write(wire::Type::kExpelled, epoch_, json{{"reason", reason}},
                                 /*closeAfter=*/true);
    }
    wasMember = wasMember || std::find(members_.begin(), members_.end(), id) != members_.end();
    pendingJoin_.erase(std::remove(pendingJoin_.begin(), pendingJoin_.end(), id),
                       pendingJoin_.end());
    hellos_.erase(std::remove(hellos_.begin(), hellos_.end(), id), hellos_.end());
    ready_.erase(id);
    leaving_.erase(id);
    dead_.push_back(id);
    workers_.erase(wit);
  }
  failures_ += static_cast<int64_t>(victims.size());
  updateDrains();
  // A checkpoint asked for and not yet durable is lost with its writer (data parallel: the
  // epoch's first member; pipelines: any member): status stops saying "checkpointing".
  const bool writerLost =
      !members_.empty() &&
      (pipelineJob_ ? wasMember
                    : std::find(victims.begin(), victims.end(), members_.front()) != victims.end());
  if (writerLost && checkpointStep_ > durable_.step) {
    event({{"event", "checkpoint_abandoned"}, {"step", checkpointStep_}, {"reason", why}});
    checkpointStep_ = -1;
  }
  if (epoch_ >= 0 && wasMember && !finished_) {
    if (!recovering_) {
      recovering_ = true;
      recoveringSince_ = Clock::now();
    }
    newEpoch("worker " + std::to_string(worker) + " failed: " + why, {});
    checkFinished();
  }
  cv_.notify_all();
}

void Coordinator::Impl::send(int worker, wire::Type type, const json& body) {
  auto it = workers_.find(worker);
  if (it == workers_.end() || !it->second.session) return;
  it->second.session->write(type, epoch_, body);
}

void Coordinator::Impl::event(json e) {
  e["time"] = wallSeconds();
  events_.write(e);
  const int64_t seq = ++eventSeq_;
  recentEvents_.emplace_back(seq, e);
  if (recentEvents_.size() > 1000) recentEvents_.pop_front();
  for (const auto& [id, sink] : subscribers_) {
    asio::post(io_, [sink = sink, seq, e] { sink(seq, e); });
  }
}

// ---- Control API (docs/control_api.md) ------------------------------------------------------

void Coordinator::Impl::onVoteStats(Worker& w, const json& body) {
  if (body.contains("compute_us")) w.computeSeconds = body.at("compute_us").get<int64_t>() * 1e-6;
  if (body.contains("stall_us")) {
    const double stall = body.at("stall_us").get<int64_t>() * 1e-6;
    w.stallSeconds += stall;
    stallSeconds_ += stall;
  }
  if (body.contains("replicated_bytes"))
    replicatedBytes_ += body.at("replicated_bytes").get<int64_t>();
}

void Coordinator::Impl::onDurable(int worker, const json& body) {
  const int64_t step = body.at("step").get<int64_t>();
  const double flush = body.at("flush_us").get<int64_t>() * 1e-6;
  durableWrites_++;
  durableBytes_ += body.at("bytes").get<int64_t>();
  flushSecondsTotal_ += flush;
  if (step >= durable_.step) {
    durable_.step = step;
    durable_.path = body.at("path").get<std::string>();
    durable_.bytes = body.at("bytes").get<int64_t>();
    durable_.flushSeconds = flush;
    durable_.at = Clock::now();
  }
  persistThrottled();
  event({{"event", "checkpoint"},
         {"step", step},
         {"worker", worker},
         {"bytes", body.at("bytes").get<int64_t>()},
         {"flush_s", flush},
         {"path", body.at("path").get<std::string>()}});
}

void Coordinator::Impl::updateDrains() {
  for (auto& [id, d] : drains_) {
    if (d.releaseStep >= 0) continue;
    bool all = true;
    for (int w : d.workers) all = all && !workers_.count(w);
    if (all) d.releaseStep = committed_;
  }
}

void Coordinator::Impl::sendCommit(int worker, int64_t step, bool nextEpoch) {
  json body = {{"step", step}};
  if (nextEpoch) body["next_epoch"] = true;
  if (checkpointStep_ == step) body["checkpoint"] = true;
  // Workers derive their operation and recovery deadlines from it (failure_semantics.md 12).
  if (options_.progressFloor.count() > 0) body["step_deadline_ms"] = stepDeadline().count();
  send(worker, wire::Type::kCommit, body);
}

// Called once per commit, before the commit is sent.
void Coordinator::Impl::noteCommit(int64_t step) {
  const auto now = Clock::now();
  if (lastCommit_ != Clock::time_point{}) {
    stepTimes_.push_back(now - lastCommit_);
    if (stepTimes_.size() > 20) stepTimes_.pop_front();
    const double s = secondsOf(now - lastCommit_);
    effectiveSeconds_ += s;
    auto& bySize = stepSecondsBySize_[static_cast<int>(members_.size())];
    bySize.push_back(s);
    if (bySize.size() > 50) bySize.pop_front();
  }
  lastCommit_ = now;
  if (commits_++ == 0) firstCommit_ = now;
  epochCommits_++;
  if (recovering_) {
    recovering_ = false;
    const double took = secondsOf(now - recoveringSince_);
    recoverySeconds_.push_back(took);
    event({{"event", "recovered"}, {"step", step}, {"epoch", epoch_}, {"seconds", took}});
  }
  if (checkpointNext_) {
    checkpointNext_ = false;
    checkpointStep_ = step;
    event({{"event", "checkpoint_requested"}, {"step", step}});
  }
}

std::string Coordinator::Impl::state() const {
  if (jobFailed_ || (epoch_ >= 0 && members_.empty() && !finished_)) return "failed";
  if (finished_) return "finished";
  if (epoch_ < 0) return "starting";
  if (stopRequested_ || !leaving_.empty()) return "draining";
  if (recovering_ || (epoch_ > 0 && epochCommits_ == 0)) return "reconfiguring";
  if (checkpointNext_ || checkpointStep_ > durable_.step) return "checkpointing";
  return "running";
}

std::vector<std::string> Coordinator::Impl::nodesOf(const std::vector<int>& workers) const {
  std::vector<std::string> nodes;
  for (int id : workers) {
    auto it = workers_.find(id);
    if (it == workers_.end()) continue;
    if (std::find(nodes.begin(), nodes.end(), it->second.node) == nodes.end()) {
      nodes.push_back(it->second.node);
    }
  }
  return nodes;
}

// Nodes the job trains on and keeps (members not on their way out).
int Coordinator::Impl::currentNodes() const {
  std::vector<int> staying;
  for (int id : members_) {
    if (!leaving_.count(id)) staying.push_back(id);
  }
  if (pipelineJob_) return static_cast<int>(staying.size()) / profile_.job.devices_per_node;
  return static_cast<int>(nodesOf(staying).size());
}

json Coordinator::Impl::durableJson() const {
  if (durable_.step < 0) return nullptr;
  return json{{"step", durable_.step},
              {"path", durable_.path},
              {"bytes", durable_.bytes},
              {"flush_s", durable_.flushSeconds},
              {"age_s", secondsOf(Clock::now() - durable_.at)}};
}

json Coordinator::Impl::drainJson(const Drain& d) const {
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
  const bool durable = !checkpointsOn_ || (d.releaseStep >= 0 && durable_.step >= d.releaseStep);
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

double Coordinator::Impl::medianStepSeconds(size_t newest) const {
  std::vector<double> recent;
  for (auto it = stepTimes_.rbegin(); it != stepTimes_.rend() && recent.size() < newest; ++it) {
    recent.push_back(secondsOf(*it));
  }
  return median(recent);
}

double Coordinator::Impl::samplesPerSecondNow() const {
  if (globalBatch_ <= 0 || stepTimes_.empty() || lastCommit_ == Clock::time_point{}) return 0;
  const double step = medianStepSeconds(5);
  // No commit for three step times: the job is not training now (recovering, stuck).
  if (step <= 0 || secondsOf(Clock::now() - lastCommit_) > 3 * step + 1) return 0;
  return static_cast<double>(globalBatch_) / step;
}

std::map<int, double> Coordinator::Impl::measuredStepSeconds() const {
  std::map<int, double> out;
  for (const auto& [n, times] : stepSecondsBySize_) {
    if (times.size() >= 3) out[n] = median(std::vector<double>(times.begin(), times.end()));
  }
  return out;
}

ControlReply Coordinator::Impl::status() {
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = Clock::now();
  ControlReply r;
  json& b = r.body;
  b["state"] = state();
  b["step"] = committed_ + 1;
  b["committed_step"] = committed_;
  b["steps"] = totalSteps_ > 0 ? json(totalSteps_) : json(nullptr);
  b["epoch"] = epoch_;
  const double step = medianStepSeconds();
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
  if (pipelineJob_ && !members_.empty()) {
    try {
      b["plan"] = json::parse(pipeline::planToJson(plan_ ? *plan_ : pipelinePlan().plan));
    } catch (const std::exception& e) {
      b["plan"] = json{{"error", e.what()}};
    }
  } else {
    b["plan"] = json{{"mode", "data_parallel"}, {"workers", members_.size()}};
  }
  // Every version is committed when it is durable (peer-RAM versions come with issue 12).
  b["checkpoint"] = {{"enabled", checkpointsOn_},
                     {"last_committed", durableJson()},
                     {"last_durable", durableJson()},
                     {"requested_step", checkpointNext_ ? json("next") : json(checkpointStep_)}};
  const double wall = firstCommit_ == Clock::time_point{} ? 0 : secondsOf(now - firstCommit_);
  b["samples_per_s"] = {{"now", samplesPerSecondNow()},
                        {"average", wall > 0 && globalBatch_ > 0
                                        ? static_cast<double>((commits_ - 1) * globalBatch_) / wall
                                        : 0.0}};
  json recoveries = json::array();
  for (double s : recoverySeconds_) recoveries.push_back(s);
  b["failures"] = failures_;
  b["rollbacks"] = rollbacks_;
  b["recovery_s"] = recoveries;
  b["recovering"] = recovering_;
  b["effective_training_s"] = effectiveSeconds_;
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
  b["stop"] = stopRequested_ ? json{{"deadline_s", stopDeadline_}} : json(nullptr);
  return r;
}

ControlReply Coordinator::Impl::scaling() {
  std::lock_guard<std::mutex> lock(mu_);
  ControlReply r;
  const auto measured = measuredStepSeconds();
  const int workersNow = static_cast<int>(members_.size());
  const int nodesNow = currentNodes();
  json points = json::array();
  if (pipelineJob_) {
    // Pipelines: the templates' cost model, scaled to seconds by the step time measured at
    // the present size (docs/control_api.md).
    const int G = profile_.job.devices_per_node;
    double secondsPerTick = 0;
    auto mine = measured.find(workersNow);
    try {
      if (mine != measured.end()) {
        secondsPerTick = mine->second / (plan_ ? *plan_ : pipelinePlan().plan).iterationTicks;
      }
    } catch (const std::exception&) {
      secondsPerTick = 0;
    }
    // Beyond the node count planned for, only more copies of the planned templates fit.
    const int maxNodes = std::max(templates_.max_nodes, nodesNow);
    for (int n = std::max(1, templates_.min_nodes); n <= maxNodes + maxNodes / 2 + 1; ++n) {
      json p = {{"nodes", n}, {"workers", n * G}};
      try {
        std::vector<int> ids(n);
        for (int k = 0; k < n; ++k) ids[k] = k;
        pipeline::Plan plan = pipeline::makePlan(templates_, ids, planOptions_);
        p["feasible"] = true;
        p["pipelines"] = plan.pipelines.size();
        p["iteration_ticks"] = plan.iterationTicks;
        p["predicted_samples_per_s"] =
            secondsPerTick > 0 && globalBatch_ > 0
                ? json(globalBatch_ / (secondsPerTick * static_cast<double>(plan.iterationTicks)))
                : json(nullptr);
      } catch (const Error& e) {
        p["feasible"] = false;
        p["why"] = e.what();
      }
      auto m = measured.find(n * G);
      if (m != measured.end() && globalBatch_ > 0) {
        p["measured_samples_per_s"] = globalBatch_ / m->second;
      }
      points.push_back(p);
    }
    r.body["model"] = "pipeline templates (cost model), calibrated by the measured step time";
  } else {
    // Data parallel: the step time t(n) fitted by least squares to the sizes measured, as
    // t = a + b / n (the per-worker compute shrinks with n, the reduction does not) or, where
    // that fits worse (more workers made steps slower: shared cores, a slow network),
    // t = a + c n; both with non-negative coefficients. One size measured: t = b / n.
    double a = 0, b = 0, c = 0;
    std::string model = "nothing measured yet";
    if (measured.size() == 1) {
      b = measured.begin()->second * measured.begin()->first;
      model = "one size measured: step_s = b / workers";
    } else if (measured.size() >= 2) {
      // Fits t = p + q x over (x, t) with p, q >= 0; returns (p, q, squared error).
      auto fit = [&](auto xOf) {
        double sx = 0, sy = 0, sxx = 0, sxy = 0;
        const double k = static_cast<double>(measured.size());
        for (const auto& [n, t] : measured) {
          const double x = xOf(n);
          sx += x;
          sy += t;
          sxx += x * x;
          sxy += x * t;
        }
        double q = (k * sxy - sx * sy) / (k * sxx - sx * sx);
        double p = (sy - q * sx) / k;
        if (q < 0) {
          q = 0;
          p = sy / k;
        } else if (p < 0) {
          p = 0;
          q = sxy / sxx;
        }
        double err = 0;
        for (const auto& [n, t] : measured) err += std::pow(p + q * xOf(n) - t, 2);
        return std::array<double, 3>{p, q, err};
      };
      auto inverse = fit([](int n) { return 1.0 / n; });
      auto linear = fit([](int n) { return static_cast<double>(n); });
      if (inverse[2] <= linear[2]) {
        a = inverse[0];
        b = inverse[1];
        model = "fitted: step_s = a + b / workers";
      } else {
        a = linear[0];
        c = linear[1];
        model = "fitted: step_s = a + c * workers (more workers were slower per step)";
      }
    }
    const int64_t microbatches = microbatch_ > 0 ? globalBatch_ / microbatch_ : 0;
    int maxN = std::max({2 * workersNow, workersNow + 4, 8});
    if (!measured.empty()) maxN = std::max(maxN, measured.rbegin()->first);
    if (microbatches > 0) maxN = static_cast<int>(std::min<int64_t>(maxN, microbatches));
    for (int n = 1; n <= maxN; ++n) {
      json p = {{"nodes", n}, {"workers", n}, {"feasible", true}};
      auto m = measured.find(n);
      if (m != measured.end() && globalBatch_ > 0) {
        p["measured_samples_per_s"] = globalBatch_ / m->second;
        p["measured_steps"] = stepSecondsBySize_.at(n).size();
      }
      const double t = a + b / n + c * n;
      p["predicted_samples_per_s"] =
          t > 0 && globalBatch_ > 0 ? json(globalBatch_ / t) : json(nullptr);
      points.push_back(p);
    }
    r.body["model"] = model;
    r.body["fit"] = {{"a_s", a}, {"b_s", b}, {"c_s", c}};
    r.body["feasible_note"] = microbatches > 0
                                  ? "a data-parallel step has " + std::to_string(microbatches) +
                                        " microbatches: at most that many workers"
                                  : std::string("the job's batch shape is not known yet");
  }
  r.body["nodes_now"] = nodesNow;
  r.body["workers_now"] = workersNow;
  r.body["global_batch"] = globalBatch_;
  r.body["points"] = points;
  return r;
}

ControlReply Coordinator::Impl::resize(int64_t nodes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (epoch_ < 0) return refusal(409, "the job has not started: no epoch has formed yet");
  if (finished_ || jobFailed_) return refusal(409, "the job has ended (" + state() + ")");
  if (stopRequested_) return refusal(409, "the job is stopping");
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
  if (pipelineJob_) {
    const int G = profile_.job.devices_per_node;
    try {
      std::vector<int> ids(nodes);
      for (int k = 0; k < nodes; ++k) ids[k] = k;
      pipeline::makePlan(templates_, ids, planOptions_);
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
  const int perNode = pipelineJob_ ? profile_.job.devices_per_node : 1;
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

ControlReply Coordinator::Impl::drain(const control::DrainRequest& request) {
  std::lock_guard<std::mutex> lock(mu_);
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
  // What it takes: the rest of this step, then the checkpoint of it.
  const double step = medianStepSeconds();
  const double flush = durableWrites_ > 0 ? flushSecondsTotal_ / durableWrites_ : 0;
  const double estimate = step + (checkpointsOn_ ? flush : 0);
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
  d.timer = std::make_unique<asio::steady_timer>(io_);
  d.timer->expires_after(std::chrono::milliseconds(static_cast<int64_t>(d.deadlineSeconds * 1e3)));
  const int id = d.id;
  d.timer->async_wait([this, id](error_code ec) {
    if (ec) return;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = drains_.find(id);
    if (it == drains_.end() || stopping_ || finished_) return;
    std::vector<int> late;
    for (int w : it->second.workers) {
      if (workers_.count(w) && !done_.count(w)) late.push_back(w);
    }
    if (late.empty()) return;
    it->second.expelled = true;
    for (int w : late) {
      leaving_.erase(w);
      declareDead(w, "drain " + std::to_string(id) + " deadline of " +
                         std::to_string(it->second.deadlineSeconds) +
                         " s passed before a step boundary");
    }
  });
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
  event({{"event", "drain"},
         {"id", stored.id},
         {"workers", stored.workers},
         {"deadline_s", stored.deadlineSeconds},
         {"estimate_s", estimate}});
  return r;
}

ControlReply Coordinator::Impl::checkpoint() {
  std::lock_guard<std::mutex> lock(mu_);
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
  r.body = {{"at_step", committed_ + 1}, {"last_durable", durableJson()}};
  return r;
}

ControlReply Coordinator::Impl::stop(double deadlineSeconds) {
  std::lock_guard<std::mutex> lock(mu_);
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
    stopTimer_ = std::make_unique<asio::steady_timer>(io_);
    stopTimer_->expires_after(
        std::chrono::milliseconds(static_cast<int64_t>(deadlineSeconds * 1e3)));
    stopTimer_->async_wait([this, deadlineSeconds](error_code ec) {
      if (ec) return;
      std::lock_guard<std::mutex> lock(mu_);
      if (finished_ || jobFailed_ || stopping_) return;
      failJob("the stop deadline of " + std::to_string(deadlineSeconds) +
              " s passed before the job reached a step boundary");
    });
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

std::string Coordinator::Impl::metrics() {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  const auto now = Clock::now();
  metric(out, "sinew_step", "gauge", "The next step the job runs (last committed + 1).",
         committed_ + 1);
  metric(out, "sinew_epoch", "gauge", "The current epoch (membership version).", epoch_);
  metric(out, "sinew_members", "gauge", "Workers training in the current epoch.", members_.size());
  metric(out, "sinew_nodes", "gauge", "Nodes the job trains on.", currentNodes());
  metric(out, "sinew_samples_per_second", "gauge",
         "Samples per second over the last steps (0 while not training).", samplesPerSecondNow());
  metric(out, "sinew_committed_steps_total", "counter", "Steps committed by this coordinator.",
         commits_);
  metric(out, "sinew_failures_total", "counter", "Workers declared dead.", failures_);
  metric(out, "sinew_rollbacks_total", "counter",
         "Rollbacks to an older version because a layer had no live copy (pipelines).", rollbacks_);
  metric(out, "sinew_recoveries_total", "counter",
         "Recoveries finished (a failure, then the next committed step).", recoverySeconds_.size());
  double recoverySum = 0;
  for (double s : recoverySeconds_) recoverySum += s;
  metric(out, "sinew_recovery_seconds_sum", "counter",
         "Seconds from failures to the next committed step, summed.", recoverySum);
  metric(out, "sinew_effective_training_seconds_total", "counter",
         "Seconds between consecutive commits of one epoch, summed.", effectiveSeconds_);
  metric(out, "sinew_checkpoint_stall_seconds_total", "counter",
         "Seconds workers waited for a checkpoint snapshot before an optimizer step, summed.",
         stallSeconds_);
  metric(out, "sinew_checkpoint_flush_seconds_total", "counter",
         "Seconds spent writing durable checkpoints, summed.", flushSecondsTotal_);
  metric(out, "sinew_checkpoints_durable_total", "counter", "Durable checkpoint versions written.",
         durableWrites_);
  metric(out, "sinew_checkpoint_bytes_total", "counter", "Bytes of durable checkpoints written.",
         durableBytes_);
  metric(out, "sinew_checkpoint_durable_step", "gauge",
         "Step of the newest durable checkpoint (-1: none).", durable_.step);
  metric(out, "sinew_replicated_bytes_total", "counter",
         "Bytes of checkpoint replicas sent to peers' host memory.", replicatedBytes_);
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

int Coordinator::Impl::subscribe(Sink sink, int64_t after) {
  std::lock_guard<std::mutex> lock(mu_);
  const int id = nextSubscriber_++;
  for (const auto& [seq, e] : recentEvents_) {
    if (seq > after) asio::post(io_, [sink, seq = seq, e = e] { sink(seq, e); });
  }
  subscribers_[id] = std::move(sink);
  return id;
}

void Coordinator::Impl::unsubscribe(int id) {
  std::lock_guard<std::mutex> lock(mu_);
  subscribers_.erase(id);
}

Coordinator::Coordinator(CoordinatorOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
Coordinator::~Coordinator() = default;
uint16_t Coordinator::port() const { return impl_->port_; }
uint16_t Coordinator::storePort() const { return impl_->store_->port(); }
uint64_t Coordinator::token() const { return impl_->options_.token; }
const std::string& Coordinator::host() const { return impl_->options_.host; }
CoordinatorStatus Coordinator::status() const { return impl_->coordinatorStatus(); }
bool Coordinator::waitFinished(std::chrono::milliseconds timeout) {
  return impl_->waitFinished(timeout);
}
ControlReply Coordinator::controlStatus() {
  return impl_->onIo([this] { return impl_->status(); });
}
ControlReply Coordinator::scaling() {
  return impl_->onIo([this] { return impl_->scaling(); });
}
ControlReply Coordinator::resize(int64_t nodes) {
  return impl_->onIo([this, nodes] { return impl_->resize(nodes); });
}
ControlReply Coordinator::drain(const control::DrainRequest& request) {
  return impl_->onIo([this, &request] { return impl_->drain(request); });
}
ControlReply Coordinator::checkpoint() {
  return impl_->onIo([this] { return impl_->checkpoint(); });
}
ControlReply Coordinator::stop(double deadlineSeconds) {
  return impl_->onIo([this, deadlineSeconds] { return impl_->stop(deadlineSeconds); });
}
std::string Coordinator::metrics() {
  return impl_->onIo([this] { return impl_->metrics(); });
}
uint16_t Coordinator::controlPort() const { return impl_->controlPort_; }
const std::string& Coordinator::controlHost() const { return impl_->options_.controlHost; }

void writeCoordinatorJson(const Coordinator& coordinator, const std::string& path) {
  char token[32];
  std::snprintf(token, sizeof(token), "%llx", static_cast<unsigned long long>(coordinator.token()));
  json j = {{"host", coordinator.host()},
            {"port", coordinator.port()},
            {"token", token},
            {"store_port", coordinator.storePort()}};
  if (coordinator.controlPort() != 0) {
    j["control_host"] = coordinator.controlHost();
    j["control_port"] = coordinator.controlPort();
    j["control_token"] = coordinator.controlToken();
  }
  // Readable by this user only, from the moment it exists; replaced whole (rename).
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0 || ::fchmod(fd, 0600) != 0) {
    if (fd >= 0) ::close(fd);
    SINEW_THROW(IoError, "cannot create ", tmp, ": ", std::strerror(errno));
  }
  const std::string text = j.dump() + "\n";
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    SINEW_THROW(IoError, "cannot write ", path, ": ", std::strerror(errno));
  }
}
const std::string& Coordinator::controlToken() const { return impl_->options_.controlToken; }

}  // namespace runtime
}  // namespace sinew
