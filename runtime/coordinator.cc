#include "sinew/runtime/coordinator.h"

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "sinew/collectives/error.h"
#include "sinew/collectives/tcp_store.h"
#include "sinew/collectives/transport/channel.h"
#include "sinew/pipeline/instantiation.h"
#include "sinew/pipeline/plan.h"
#include "sinew/pipeline/profile.h"
#include "sinew/pipeline/template_planner.h"
#include "sinew/runtime/detail/wire.h"
#include "sinew/runtime/event_log.h"

namespace sinew {
namespace runtime {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {}  // namespace

class Coordinator::Impl {
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
    scheduleCheck();
    startTimer_.expires_after(options_.startTimeout);
    startTimer_.async_wait([this](error_code e) {
      if (e) return;
      std::lock_guard<std::mutex> lock(mu_);
      if (epoch_ < 0 && !ready_.empty()) formFirstEpoch("start timeout");
    });
    thread_ = std::thread([this] {
      collectives::transport::runIoThread(io_, [this](const std::string& what) {
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
    });
    thread_.join();
  }

  CoordinatorStatus status() const {
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

  CoordinatorOptions options_;
  uint16_t port_ = 0;
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
  };

  void scheduleCheck();

  // Everything below runs on the io thread with mu_ held.
  void onMessage(const std::shared_ptr<Session>& s, const collectives::transport::FrameHeader& h,
                 const json& body);
  void onHello(const std::shared_ptr<Session>& s, const json& body);
  void onVote(int worker, int64_t epoch, int64_t step);
  void onDone(int worker, int64_t step);
  void onReady(int worker, int64_t resumeStep);
  void onLeave(int worker, int64_t step);
  void release(int worker, const std::string& why);
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
  pipeline::Plan pipelinePlan() const;
  void failJob(const std::string& why);
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
  pipeline::Profile profile_;
  pipeline::PlanOptions planOptions_;
  pipeline::TemplateSet templates_;
  EventLog events_;
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
    } catch (const std::exception& e) {
      owner_->dropped_++;
      owner_->log("dropping connection from " + describe() + ": bad " + wire::typeName(h.type) +
                  " message: " + e.what());
      owner_->onSessionClosed(shared_from_this(), std::string("protocol violation: ") + e.what());
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
    if (closed_ || !channel_) return;
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
  std::vector<int> stuck;
  for (int id : members_) {
    auto it = workers_.find(id);
    if (it == workers_.end() || done_.count(id)) continue;
    const Worker& w = it->second;
    if (!(w.waiting && w.step >= step)) stuck.push_back(id);
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
    if (s->worker_ >= 0) throw std::runtime_error("second hello on one connection");
    return onHello(s, body);
  }
  if (s->worker_ < 0) {
    throw std::runtime_error(std::string(wire::typeName(h.type)) + " before hello");
  }
  int worker = s->worker_;
  auto it = workers_.find(worker);
  if (it == workers_.end()) return;  // Already declared dead; its expulsion is on its way.
  it->second.lastHeard = Clock::now();
  if (h.epoch > epoch_) {
    throw std::runtime_error("message of epoch " + std::to_string(h.epoch) +
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
      return onReady(worker, body.at("resume_step").get<int64_t>());
    case wire::Type::kLeave:
      return onLeave(worker, body.at("step").get<int64_t>());
    default:
      break;
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
      return onVote(worker, h.epoch, body.at("step").get<int64_t>());
    case wire::Type::kPipeline:
      return onPipeline(worker, body);
    case wire::Type::kRebuild:
      log("worker " + std::to_string(worker) + " could not build epoch " + std::to_string(epoch_) +
          "'s communicator; rebuilding");
      return newEpoch("rebuild requested by worker " + std::to_string(worker), {});
    default:
      throw std::runtime_error(std::string("a worker may not send ") + wire::typeName(h.type));
  }
}

void Coordinator::Impl::onHello(const std::shared_ptr<Session>& s, const json& body) {
  int requested = body.at("worker").get<int>();
  std::string node = body.at("node").get<std::string>();
  int64_t pid = body.value("pid", int64_t(0));
  if (requested >= 0 && (workers_.count(requested) ||
                         std::find(dead_.begin(), dead_.end(), requested) != dead_.end())) {
    throw std::runtime_error("worker id " + std::to_string(requested) + " is already taken");
  }
  // Joiners get ids after every launch rank, so an early joiner never takes a rank's id.
  int id = requested >= 0 ? requested : std::max(nextId_, options_.expectedWorkers);
  if (id >= wire::kMaxWorkerId) {
    throw std::runtime_error("no worker id left for a join (ids are never reused; the last is " +
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
  json welcome = {{"worker", id},
                  {"store_host", options_.host},
                  {"store_port", store_->port()},
                  {"heartbeat_ms", options_.heartbeatInterval.count()},
                  {"dead_after_ms", options_.deadAfter.count()}};
  send(id, wire::Type::kWelcome, welcome);
  event({{"event", "hello"}, {"worker", id}, {"node", node}, {"pid", pid}});
  if (epoch_ < 0 && requested < 0) {
    pendingJoin_.push_back(id);  // Joins the first epoch, but does not count as a rank.
  } else if (epoch_ < 0) {
    hellos_.push_back(id);  // Counts towards the first epoch once it is ready.
  } else if (finished_) {
    declareDead(id, "the job has already finished");
  } else {
    pendingJoin_.push_back(id);
    log("worker " + std::to_string(id) + " (node " + node +
        ") asks to join; it joins at the next step boundary");
  }
}

void Coordinator::Impl::onReady(int worker, int64_t resumeStep) {
  if (epoch_ >= 0 || std::find(hellos_.begin(), hellos_.end(), worker) == hellos_.end()) {
    return;  // A joiner, or late: it takes the state of the epoch's source anyway.
  }
  if (resumeStep < 0) throw std::runtime_error("negative resume_step");
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
      pipeline::Plan plan = pipelinePlan();
      body["plan"] = pipeline::planToJson(plan);
      event({{"event", "plan"},
             {"epoch", epoch_},
             {"pipelines", plan.pipelines.size()},
             {"iteration_ticks", plan.iterationTicks}});
    } catch (const Error& e) {
      return failJob("no pipeline plan for the " + std::to_string(members_.size()) +
                     " workers of epoch " + std::to_string(epoch_) + ": " + e.what());
    }
  }
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
  return json{{"epoch", epoch_},  {"members", members_}, {"resume_step", committed_ + 1},
              {"source", source}, {"joined", joined},    {"sync", sync}};
}

// A worker sends the job's pipeline profile once (the first member of the first epoch, after
// every member profiled): the coordinator plans the templates once, for the nodes of this
// epoch, and starts an epoch that carries the plan; every later epoch re-instantiates them
// for its members. Later requests are ignored: the first one fixed the job's templates.
void Coordinator::Impl::onPipeline(int worker, const json& body) {
  if (pipelineJob_) return;
  const std::string who = "worker " + std::to_string(worker) + "'s pipeline request: ";
  try {
    profile_ = pipeline::parseProfileJson(body.at("profile").get<std::string>());
  } catch (const Error& e) {
    return failJob(who + "bad profile: " + e.what());
  }
  const int G = profile_.job.devices_per_node;
  const int nodes = static_cast<int>(members_.size()) / G;
  planOptions_.fault_tolerance = body.at("fault_tolerance").get<int>();
  planOptions_.global_microbatches = body.at("microbatches").get<int64_t>();
  try {
    if (nodes < 1) {
      SINEW_THROW(InvalidArgument, members_.size(), " workers are fewer than one node of ",
                  "devices_per_node = ", G);
    }
    pipeline::TemplateOptions to;
    to.nodes = nodes;
    to.fault_tolerance = planOptions_.fault_tolerance;
    to.global_microbatches = planOptions_.global_microbatches;
    templates_ = pipeline::planTemplates(profile_, to);
  } catch (const Error& e) {
    return failJob(who + e.what());
  }
  pipelineJob_ = true;
  log("planned pipeline templates for " + std::to_string(templates_.min_nodes) + ".." +
      std::to_string(templates_.max_nodes) + " nodes (" + std::to_string(nodes) + " nodes of " +
      std::to_string(G) + " workers, fault tolerance " +
      std::to_string(planOptions_.fault_tolerance) + ")");
  newEpoch("pipeline plan", {});
}

// The plan for members_: with G devices per node, node k is members [kG, kG + G) in
// ascending id order (its id the first of them, device i the i-th); members beyond the last
// full node stay idle. Throws InvalidArgument if the templates cannot cover them.
pipeline::Plan Coordinator::Impl::pipelinePlan() const {
  const int G = profile_.job.devices_per_node;
  const int nodes = static_cast<int>(members_.size()) / G;
  std::vector<int> nodeIds;
  for (int k = 0; k < nodes; ++k) nodeIds.push_back(members_[k * G]);
  pipeline::Plan plan = pipeline::makePlan(templates_, nodeIds, planOptions_);
  plan.epoch = epoch_;
  for (auto& w : plan.workers) {
    const int k =
        static_cast<int>(std::find(nodeIds.begin(), nodeIds.end(), w.node) - nodeIds.begin());
    w.worker = members_[k * G + w.device];
  }
  return plan;
}

// Ends the job: every worker is expelled with the reason (e.g. a plan no template fits).
void Coordinator::Impl::failJob(const std::string& why) {
  log("job failed: " + why);
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
  {
    const auto now = Clock::now();
    if (lastCommit_ != Clock::time_point{}) {
      stepTimes_.push_back(now - lastCommit_);
      if (stepTimes_.size() > 20) stepTimes_.pop_front();
    }
    lastCommit_ = now;
  }
  if (pendingJoin_.empty() && leaving_.empty()) {
    for (int id : members_) send(id, wire::Type::kCommit, json{{"step", step}});
    return;
  }
  if (!leaving_.empty()) {
    // Step boundary with preempted members: they apply this step, then are released.
    std::vector<int> old = members_;
    for (int id : old) send(id, wire::Type::kCommit, json{{"step", step}, {"next_epoch", true}});
    std::vector<int> leaving(leaving_.begin(), leaving_.end());
    leaving_.clear();
    for (int id : leaving) release(id, "preempted; left after step " + std::to_string(step));
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
  for (int id : old) send(id, wire::Type::kCommit, json{{"step", step}, {"next_epoch", true}});
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
    it->second.session->write(wire::Type::kReleased, epoch_,
                              json{{"reason", why}, {"step", committed_}},
                              /*closeAfter=*/true);
  }
  // Erased from workers_: its closing connection and any late message are no failure.
  pendingJoin_.erase(std::remove(pendingJoin_.begin(), pendingJoin_.end(), worker),
                     pendingJoin_.end());
  hellos_.erase(std::remove(hellos_.begin(), hellos_.end(), worker), hellos_.end());
  ready_.erase(worker);
  leaving_.erase(worker);
  released_.push_back(worker);
  workers_.erase(it);
  log("worker " + std::to_string(worker) + " released: " + why);
  event({{"event", "released"}, {"worker", worker}, {"reason", why}});
}

void Coordinator::Impl::onDone(int worker, int64_t step) {
  done_.insert(worker);
  event({{"event", "done"}, {"worker", worker}, {"step", step}});
  checkFinished();
}

void Coordinator::Impl::checkFinished() {
  if (epoch_ < 0 || members_.empty()) return;
  for (int id : members_) {
    if (!done_.count(id)) return;
  }
  if (!finished_) {
    finished_ = true;
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
  // Workers of a node fail together (DESIGN.md section 1).
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
  if (epoch_ >= 0 && wasMember && !finished_) {
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

void Coordinator::Impl::event(json e) { events_.write(std::move(e)); }

Coordinator::Coordinator(CoordinatorOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
Coordinator::~Coordinator() = default;
uint16_t Coordinator::port() const { return impl_->port_; }
uint16_t Coordinator::storePort() const { return impl_->store_->port(); }
uint64_t Coordinator::token() const { return impl_->options_.token; }
const std::string& Coordinator::host() const { return impl_->options_.host; }
CoordinatorStatus Coordinator::status() const { return impl_->status(); }
bool Coordinator::waitFinished(std::chrono::milliseconds timeout) {
  return impl_->waitFinished(timeout);
}

}  // namespace runtime
}  // namespace sinew
