// The coordinator's process side (docs/architecture.md section 3): the workers' listener, the
// rendezvous store, the control API's server and the io thread, around the job-state machine
// (runtime/job_state.h), which decides everything. Every input — a frame, a closed connection,
// a control request, the timer — is handed to the machine under one mutex with the time it
// happens at, and what it did comes back (frames to send, connections to close, events).

#include "sinew/runtime/coordinator.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "sinew/base/error.h"
#include "sinew/base/open_files.h"
#include "sinew/base/private_file.h"
#include "sinew/collectives/tcp_store.h"
#include "sinew/collectives/transport/channel.h"
#include "sinew/runtime/control_server.h"
#include "sinew/runtime/detail/wire.h"
#include "sinew/runtime/event_log.h"
#include "sinew/runtime/job_state.h"

namespace sinew {
namespace runtime {

namespace asio = boost::asio;
using boost::system::error_code;

class Coordinator::Impl : public control::Backend, public EventFeed {
 public:
  class Session;

  explicit Impl(CoordinatorOptions options) : options_(std::move(options)), checkTimer_(io_) {
    if (options_.token == 0) {
      std::random_device rd;
      options_.token = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ 1;
    }
    if (options_.expectedWorkers < 1) {
      SINEW_THROW(InvalidArgument,
                  "CoordinatorOptions::expectedWorkers = ", options_.expectedWorkers,
                  " must be >= 1");
    }
    control::validateLimits(options_.limits);  // InvalidArgument names the field.
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
    collectives::transport::ListenerOptions lo;
    ControlServerOptions cs;
    // One process serves three ports: every connection cap (members' and strangers') must fit
    // its open-file limit, raised for them where the hard limit allows, else lowered to it.
    {
      const int64_t control = options_.controlPort >= 0 ? 1 : 0;
      const std::vector<int64_t> caps = {
          static_cast<int64_t>(options_.maxConnections),
          static_cast<int64_t>(lo.maxPending),
          static_cast<int64_t>(so.maxConnections),
          static_cast<int64_t>(so.maxPending),
          control * static_cast<int64_t>(options_.controlMaxConnections),
          control * static_cast<int64_t>(cs.maxPending)};
      constexpr int64_t kReserve = 256;  // event logs, etcd, the launcher's pipes
      int64_t needed = kReserve;
      for (int64_t c : caps) needed += c;
      const int64_t limit = raiseOpenFileLimit(needed);
      const std::vector<int64_t> fit = capsWithin(caps, limit, kReserve);
      if (fit != caps) {
        logLine("sinew coordinator: the open-file limit is " + std::to_string(limit) +
                " and cannot be raised to the " + std::to_string(needed) +
                " its connection caps need; caps lowered to coordinator " + std::to_string(fit[0]) +
                " + " + std::to_string(fit[1]) + ", store " + std::to_string(fit[2]) + " + " +
                std::to_string(fit[3]) + ", control API " + std::to_string(fit[4]) + " + " +
                std::to_string(fit[5]) + " (members + unauthenticated)");
      }
      lo.maxConnections = static_cast<size_t>(fit[0]);
      lo.maxPending = static_cast<size_t>(fit[1]);
      so.maxConnections = static_cast<size_t>(fit[2]);
      so.maxPending = static_cast<size_t>(fit[3]);
      if (control) {
        options_.controlMaxConnections = static_cast<size_t>(fit[4]);
        cs.maxPending = static_cast<size_t>(fit[5]);
      }
    }
    so.host = options_.host;
    so.token = options_.token;
    so.log = options_.log;
    store_ = std::make_unique<collectives::TcpStoreServer>(so);

    lo.host = options_.host;
    lo.port = options_.port;
    lo.channel.rules = wire::coordinatorRules(options_.token, options_.maxMessageBytes);
    // Workers heartbeat far more often; this only ends connections that never say anything.
    lo.channel.idleTimeout = std::max(options_.idleTimeout, 2 * options_.deadAfter);
    lo.channel.frameTimeout = options_.frameTimeout;
    lo.channel.name = "sinew coordinator";
    lo.channel.log = [this](const std::string& line) { logLine(line); };
    listener_ = std::make_unique<collectives::transport::Listener>(io_, lo, [this] {
      std::lock_guard<std::mutex> lock(mu_);
      const JobState::SessionId id = nextSession_++;
      auto s = std::make_shared<Session>(this, id);
      sessions_[id] = s;
      return s;
    });
    port_ = listener_->port();
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
      // Loopback unless configured (docs/architecture.md section 7), whatever the coordinator binds
      // to.
      if (options_.controlHost.empty()) options_.controlHost = "127.0.0.1";
      cs.host = options_.controlHost;
      cs.port = static_cast<uint16_t>(options_.controlPort);
      if (options_.controlReadToken.empty()) {
        std::random_device rd;
        char hex[32];
        std::snprintf(hex, sizeof(hex), "%08x%08x", rd(), rd());
        options_.controlReadToken = hex;
      }
      cs.token = options_.controlToken;
      cs.readToken = options_.controlReadToken;
      cs.requestTimeout = options_.controlTimeout;
      cs.maxConnections = options_.controlMaxConnections;
      cs.log = [this](const std::string& line) { logLine(line); };
      control_ = std::make_unique<ControlServer>(io_, cs, this, this);
      controlPort_ = control_->port();
    }
    state_ = std::make_unique<JobState>(options_, store_->port(), Clock::now());
    scheduleTick();
    thread_ = std::thread([this] {
      collectives::transport::runIoThread(io_, [this](const std::string& what) {
        std::lock_guard<std::mutex> lock(mu_);
        state_->internalError(what);
        apply();
      });
    });
  }

  ~Impl() {
    asio::post(io_, [this] {
      stopping_ = true;  // A tick that already fired must not re-arm its timer.
      checkTimer_.cancel();
      listener_->close();
      if (control_) control_->close();
      std::lock_guard<std::mutex> lock(mu_);
      subscribers_.clear();
    });
    thread_.join();
  }

  CoordinatorStatus coordinatorStatus() const {
    std::lock_guard<std::mutex> lock(mu_);
    return state_->coordinatorStatus();
  }

  json outcome() const {
    std::lock_guard<std::mutex> lock(mu_);
    return state_->outcome();
  }

  bool waitFinished(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, timeout, [&] { return state_->over(); });
    return state_->finishedWithWork();
  }

  void logLine(const std::string& full) {
    if (options_.log) {
      options_.log(full);
    } else {
      std::fprintf(stderr, "%s\n", full.c_str());
    }
  }

  // Runs f on the io thread (at once when called there) and returns its result: what the
  // machine sends goes on workers' connections, which only the io thread may touch.
  template <typename F>
  auto onIo(F f) -> decltype(f()) {
    if (std::this_thread::get_id() == thread_.get_id()) return f();
    std::packaged_task<decltype(f())()> task(std::move(f));
    auto result = task.get_future();
    asio::post(io_, [&task] { task(); });
    return result.get();
  }

  // Runs a control request on the machine (io thread, mu_ not held) and applies its effects.
  template <typename F>
  auto request(F f) -> decltype(f(Clock::now())) {
    std::lock_guard<std::mutex> lock(mu_);
    auto r = f(Clock::now());
    state_->settle();
    apply();
    rearm();
    return r;
  }

  // control::Backend (docs/control_api.md); on the io thread.
  ControlReply status() override {
    return request([&](Clock::time_point now) { return state_->status(now); });
  }
  ControlReply scaling() override {
    return request([&](Clock::time_point now) { return state_->scaling(now); });
  }
  ControlReply resize(int64_t nodes) override {
    return request([&](Clock::time_point now) { return state_->resize(nodes, now); });
  }
  ControlReply limits(const nlohmann::json& update) override {
    return request([&](Clock::time_point now) { return state_->limits(update, now); });
  }
  ControlReply drain(const control::DrainRequest& r) override {
    return request([&](Clock::time_point now) { return state_->drain(r, now); });
  }
  ControlReply checkpoint() override {
    return request([&](Clock::time_point now) { return state_->checkpoint(now); });
  }
  ControlReply stop(double deadlineSeconds) override {
    return request([&](Clock::time_point now) { return state_->stop(deadlineSeconds, now); });
  }
  std::string metrics() override {
    return request([&](Clock::time_point now) { return state_->metrics(now); });
  }

  // EventFeed.
  int subscribe(Sink sink, int64_t after) override {
    std::lock_guard<std::mutex> lock(mu_);
    const int id = nextSubscriber_++;
    for (const auto& [seq, e] : recentEvents_) {
      if (seq > after) asio::post(io_, [sink, seq = seq, e = e] { sink(seq, e); });
    }
    subscribers_[id] = std::move(sink);
    return id;
  }
  void unsubscribe(int id) override {
    std::lock_guard<std::mutex> lock(mu_);
    subscribers_.erase(id);
  }

  CoordinatorOptions options_;
  uint16_t port_ = 0;
  uint16_t controlPort_ = 0;
  std::unique_ptr<collectives::TcpStoreServer> store_;

 private:
  friend class Session;

  // The timer: the machine's next tick, at most heartbeatInterval / 2 away.
  void scheduleTick() {
    const auto now = Clock::now();
    Clock::time_point next;
    {
      std::lock_guard<std::mutex> lock(mu_);
      next = std::min(state_->nextTick(), now + options_.heartbeatInterval / 2);
    }
    armed_ = next;
    checkTimer_.expires_at(next);
    checkTimer_.async_wait([this](error_code ec) {
      if (ec || stopping_) return;
      {
        std::lock_guard<std::mutex> lock(mu_);
        state_->tick(Clock::now());
        apply();
      }
      if (!stopping_) scheduleTick();
    });
  }
  // After an input: a deadline the machine set earlier than the timer's is armed for.
  // REQUIRES: mu_ held; on the io thread.
  void rearm() {
    if (stopping_ || state_->nextTick() >= armed_) return;
    checkTimer_.cancel();  // Its handler sees operation_aborted and does not re-arm.
    asio::post(io_, [this] {
      if (!stopping_) scheduleTick();
    });
  }

  // Carries out what the machine did. REQUIRES: mu_ held; on the io thread.
  void apply();

  asio::io_context io_;
  std::unique_ptr<collectives::transport::Listener> listener_;
  asio::steady_timer checkTimer_;
  Clock::time_point armed_{};
  std::thread thread_;
  bool stopping_ = false;                   // io thread only
  std::unique_ptr<ControlServer> control_;  // io thread only

  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Guarded by mu_.
  std::unique_ptr<JobState> state_;
  JobState::SessionId nextSession_ = 1;
  std::map<JobState::SessionId, std::weak_ptr<Session>> sessions_;
  EventLog events_;
  // Events for /v1/events: the newest ones, and who is listening.
  int64_t eventSeq_ = 0;
  std::deque<std::pair<int64_t, json>> recentEvents_;
  std::map<int, Sink> subscribers_;
  int nextSubscriber_ = 1;
};

// One worker's connection: the channel reads and checks frames; the machine decides, under mu_.
// Writes are queued on the channel.
class Coordinator::Impl::Session : public collectives::transport::ChannelHandler,
                                   public std::enable_shared_from_this<Session> {
 public:
  Session(Impl* owner, JobState::SessionId id) : owner_(owner), id_(id) {}

  void onFrame(collectives::transport::Channel& channel,
               const collectives::transport::FrameHeader& h,
               std::vector<uint8_t> payload) override {
    if (!channel_) channel_ = channel.shared_from_this();
    const auto read = Clock::now();
    json body = wire::decodeBody(h.type, payload);  // Corruption drops the connection.
    std::lock_guard<std::mutex> lock(owner_->mu_);
    if (closed_) return;
    JobState& state = *owner_->state_;
    const int64_t committedBefore = state.committed();
    try {
      state.onFrame(id_, h.type, h.epoch, body, Clock::now());
    } catch (const Error& e) {
      // ProtocolViolation, or a field a handler checks itself (InvalidArgument, Corruption).
      state.noteDropped();
      state.log("dropping connection from " + describe() + ": bad " + wire::typeName(h.type) +
                " message: " + e.what());
      close();
      state.onClosed(id_, std::string("protocol violation: ") + e.what(), Clock::now());
    } catch (const std::exception& e) {
      // A bug in a handler: reported as such; the connection goes, the coordinator stays.
      state.noteDropped();
      state.log("internal error handling a " + std::string(wire::typeName(h.type)) +
                " message from " + describe() + ": " + e.what() + "; dropping the connection");
      state.internalError(e.what());
      close();
      state.onClosed(id_, std::string("internal error: ") + e.what(), Clock::now());
    }
    owner_->apply();
    // This frame completed a step: its commit is now written to every member's socket (a
    // channel with nothing queued writes at once).
    if (state.committed() > committedBefore) state.noteCommitWritten(Clock::now() - read);
    owner_->rearm();
  }

  // Called later on the io thread (never from inside close()).
  void onClose(collectives::transport::Channel& channel, collectives::transport::CloseReason reason,
               const std::string& why) override {
    std::lock_guard<std::mutex> lock(owner_->mu_);
    channel_.reset();
    owner_->sessions_.erase(id_);
    if (owner_->stopping_) return;  // Shutting down: no failure to declare.
    if (reason == collectives::transport::CloseReason::kViolation ||
        reason == collectives::transport::CloseReason::kTimeout) {
      owner_->state_->noteDropped();
    }
    closed_ = true;
    owner_->state_->onClosed(id_,
                             reason == collectives::transport::CloseReason::kViolation
                                 ? "protocol violation: " + why
                                 : why,
                             Clock::now());
    owner_->apply();
    owner_->rearm();
  }

  // `payload` (an encoded body) may be shared by many sessions: it is sent without a copy.
  void write(wire::Type type, int64_t epoch,
             const std::shared_ptr<const std::vector<uint8_t>>& payload, bool closeAfter) {
    if (closed_ || !channel_) return;
    channel_->sendRef(static_cast<uint8_t>(type), epoch, payload->data(), payload->size(), payload);
    if (closeAfter) channel_->closeAfterWrites();
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    if (channel_) channel_->close();
  }

  std::string describe() const {
    const int worker = owner_->state_->workerOf(id_);
    std::string peer = channel_ ? channel_->peer() : "an unknown peer";
    return worker >= 0 ? "worker " + std::to_string(worker) + " (" + peer + ")" : peer;
  }

 private:
  Impl* const owner_;  // Outlives its sessions: ~Impl closes them and joins the io thread.
  const JobState::SessionId id_;
  bool closed_ = false;
  std::shared_ptr<collectives::transport::Channel> channel_;  // Reset when it closes.
};

void Coordinator::Impl::apply() {
  JobState::Effects fx = state_->take();
  // A broadcast's frames share one body (consecutive): it is encoded once.
  const json* encodedBody = nullptr;
  std::shared_ptr<const std::vector<uint8_t>> encoded;
  for (const auto& f : fx.frames) {
    auto it = sessions_.find(f.session);
    if (it == sessions_.end()) continue;
    auto s = it->second.lock();
    if (!s) continue;
    if (f.body.get() != encodedBody) {
      encoded = std::make_shared<const std::vector<uint8_t>>(wire::encodeBody(*f.body));
      encodedBody = f.body.get();
    }
    s->write(f.type, f.epoch, encoded, f.closeAfter);
  }
  for (JobState::SessionId id : fx.closes) {
    auto it = sessions_.find(id);
    if (it == sessions_.end()) continue;
    if (auto s = it->second.lock()) s->close();
  }
  for (auto& e : fx.events) {
    events_.write(e);
    const int64_t seq = ++eventSeq_;
    recentEvents_.emplace_back(seq, e);
    if (recentEvents_.size() > 1000) recentEvents_.pop_front();
    for (const auto& [id, sink] : subscribers_) {
      asio::post(io_, [sink = sink, seq, e] { sink(seq, e); });
    }
  }
  if (fx.deposed) {
    stopping_ = true;  // Closing the connections declares nobody dead.
    checkTimer_.cancel();
  }
  if (fx.changed || fx.deposed) cv_.notify_all();
}

Coordinator::Coordinator(CoordinatorOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {}
Coordinator::~Coordinator() = default;
uint16_t Coordinator::port() const { return impl_->port_; }
uint16_t Coordinator::storePort() const { return impl_->store_->port(); }
uint64_t Coordinator::token() const { return impl_->options_.token; }
const std::string& Coordinator::host() const { return impl_->options_.host; }
CoordinatorStatus Coordinator::status() const { return impl_->coordinatorStatus(); }
nlohmann::json Coordinator::outcome() const { return impl_->outcome(); }
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
    j["control_read_token"] = coordinator.controlReadToken();
  }
  // Readable by this user only, from the moment it exists; replaced whole (rename).
  ::sinew::detail::writePrivateFile(path, j.dump() + "\n");
}
const std::string& Coordinator::controlToken() const { return impl_->options_.controlToken; }
const std::string& Coordinator::controlReadToken() const {
  return impl_->options_.controlReadToken;
}

}  // namespace runtime
}  // namespace sinew
