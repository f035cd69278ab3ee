#include "sinew/runtime/coordinator_client.h"

#include <fcntl.h>
#include <unistd.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <thread>

#include "sinew/collectives/transport/channel.h"
#include "sinew/collectives/transport/connection.h"
#include "sinew/runtime/detail/wire.h"

namespace sinew {
namespace runtime {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;
using Clock = std::chrono::steady_clock;
using nlohmann::json;
namespace transport = collectives::transport;

// K io_contexts of one thread each: a client is bound to one, so that its channel and timers
// are used on one thread, as a Channel requires.
class ClientIoThreads::Impl {
 public:
  explicit Impl(int threads) {
    SINEW_ENFORCE(threads >= 1, "ClientIoThreads needs at least one thread, got ", threads);
    for (int i = 0; i < threads; ++i) {
      ios_.push_back(std::make_unique<asio::io_context>());
      guards_.emplace_back(asio::make_work_guard(*ios_.back()));
    }
    for (int i = 0; i < threads; ++i) {
      threads_.emplace_back([io = ios_[i].get()] {
        // A client's own io thread fails that client on an exception out of a handler; here
        // the thread is shared, so the line names no client and the thread goes on.
        transport::runIoThread(*io, [](const std::string& what) {
          std::fprintf(stderr,
                       "sinew: internal error in a shared coordinator client io thread: %s\n",
                       what.c_str());
        });
      });
    }
  }
  ~Impl() {
    for (auto& g : guards_) g.reset();
    for (auto& t : threads_) t.join();
  }
  asio::io_context& next() { return *ios_[next_++ % ios_.size()]; }
  int size() const { return static_cast<int>(ios_.size()); }

 private:
  std::vector<std::unique_ptr<asio::io_context>> ios_;
  std::vector<asio::executor_work_guard<asio::io_context::executor_type>> guards_;
  std::vector<std::thread> threads_;
  std::atomic<size_t> next_{0};
};

ClientIoThreads::ClientIoThreads(int threads) : impl_(std::make_unique<Impl>(threads)) {}
ClientIoThreads::~ClientIoThreads() = default;
int ClientIoThreads::size() const { return impl_->size(); }

class CoordinatorClient::Impl : public transport::ChannelHandler {
 public:
  explicit Impl(CoordinatorClientOptions options)
      : options_(std::move(options)),
        ownIo_(options_.ioThreads ? nullptr : std::make_unique<asio::io_context>()),
        io_(options_.ioThreads ? options_.ioThreads->impl().next() : *ownIo_),
        heartbeat_(io_) {}

  // Flushes queued messages (e.g. done), for at most a second, then closes.
  ~Impl() override { shutdown(); }

  // Closes the connection (after what is queued is written, at most 1 s) and joins the
  // threads; later waits fail at once. Idempotent. On shared io threads it returns once none
  // of this client's handlers is pending (its channels' onClose delivered, its timer's last
  // wait over), since the threads outlive it.
  void shutdown() {
    if (shutDown_.exchange(true)) return;
    // The HA watcher first: it posts reconnections to the io thread.
    {
      std::lock_guard<std::mutex> lock(haMu_);
      haStop_ = true;
      if (watchCancel_) watchCancel_->cancel();
    }
    haCv_.notify_all();
    if (watcher_.joinable()) watcher_.join();
    asio::post(io_, [this] {
      stopping_ = true;
      heartbeat_.cancel();
      if (!channel_ || channel_->closed()) {
        closeNow();
        return checkQuiet();
      }
      channel_->closeAfterWrites();
      heartbeat_.expires_after(std::chrono::seconds(1));
      waitTimer([this](error_code) { closeNow(); });
    });
    if (thread_.joinable()) thread_.join();
    if (options_.ioThreads) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return quiet_; });
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (gone_.empty()) gone_ = "it left the job (its connection is closed)";
    }
    cv_.notify_all();
  }

  void closeNow() {
    closed_ = true;
    heartbeat_.cancel();
    if (channel_) channel_->close();
  }

  // io thread only: heartbeat_.async_wait, counted, so that shutdown on shared io threads
  // knows when the timer's last handler has run.
  template <typename F>
  void waitTimer(F f) {
    ++timerWaits_;
    heartbeat_.async_wait([this, f = std::move(f)](error_code ec) mutable {
      --timerWaits_;
      f(ec);
      checkQuiet();
    });
  }

  // io thread only: once stopping, with no channel open and no timer wait pending, nothing of
  // this client is left on the io thread.
  void checkQuiet() {
    if (!stopping_ || !closed_ || timerWaits_ > 0 || openChannels_ > 0) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      quiet_ = true;
    }
    cv_.notify_all();
  }

  // The channel holds its handler by shared_ptr; this Impl outlives the channel (its
  // destructor closes it and joins the io thread), so the handler it gets is a non-owning
  // alias.
  void start(std::shared_ptr<transport::ChannelHandler> self) {
    self_ = std::move(self);
    if (options_.awaitLeader) {
      // High availability: the leader etcd names (docs/ha.md).
      std::optional<CoordinatorClientOptions::Leader> leader;
      const auto deadline = Clock::now() + options_.connectTimeout;
      while (!leader && Clock::now() < deadline) {
        try {
          leader = options_.awaitLeader(
              0, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
              nullptr);
        } catch (const std::exception&) {
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
      }
      if (!leader) {
        SINEW_THROW(Timeout, "no coordinator leads the job within ",
                    options_.connectTimeout.count(), " ms (etcd names none)");
      }
      leader_ = *leader;
      term_.store(leader->term);
      options_.host = leader->host;
      options_.port = leader->port;
    }
    const std::string peer =
        "the coordinator at " + options_.host + ":" + std::to_string(options_.port);
    auto open = [this](tcp::socket socket) {
      channel_ = makeChannel(std::move(socket));
      json hello = {{"worker", options_.worker}, {"node", options_.node}, {"pid", ::getpid()}};
      queue(wire::Type::kHello, -1, hello);
      scheduleHeartbeat();
    };
    if (!options_.ioThreads) {
      tcp::socket socket(io_);
      transport::connectSocket(io_, socket, options_.host, options_.port,
                               Clock::now() + options_.connectTimeout, peer);
      open(std::move(socket));  // Before the io thread starts.
    } else {
      // Shared io threads run already: connect here, then hand the connection to this
      // client's io thread.
      const Detached d = connectDetached(options_.host, options_.port,
                                         Clock::now() + options_.connectTimeout, peer);
      asio::post(io_, [this, open, d] {
        std::string why;
        if (auto s = adopt(d, &why)) return open(std::move(*s));
        fail("cannot keep the connection to the coordinator: " + why);
      });
    }
    if (options_.awaitLeader) {
      connected_.store(true);
      watcher_ = std::thread([this] { watchLeader(); });
    }
    if (!options_.ioThreads) {
      thread_ = std::thread([this] {
        // An exception out of a handler fails the client: the training thread, which waits
        // on it, gets the message as the reason the coordinator connection is gone.
        transport::runIoThread(io_, [this](const std::string& what) {
          fail("internal error in the coordinator client's io thread: " + what);
        });
      });
    }
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, options_.connectTimeout, [&] { return welcomed_ || !gone_.empty(); })) {
      SINEW_THROW(Timeout, "coordinator at ", options_.host, ":", options_.port,
                  " did not answer the hello within ", options_.connectTimeout.count(), " ms");
    }
    if (!welcomed_) {
      SINEW_THROW(InvalidArgument, "coordinator at ", options_.host, ":", options_.port,
                  " rejected worker ", options_.worker, ": ", gone_);
    }
  }

  EpochInfo latestEpoch() const {
    std::lock_guard<std::mutex> lock(mu_);
    return epoch_;
  }

  EpochInfo waitEpochAfter(int64_t epoch, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    bool ok = waitFor(lock, timeout, [&] { return epoch_.epoch > epoch || !gone_.empty(); });
    if (!gone_.empty()) throwGone();
    if (!ok) {
      SINEW_THROW(Timeout, "worker ", worker_, ": no epoch after ", epoch, " was announced within ",
                  timeout.count(), " ms");
    }
    return epoch_;
  }

  VoteResult vote(int64_t epoch, int64_t step, std::chrono::milliseconds timeout, StepStats stats,
                  std::chrono::milliseconds withdrawalTimeout) {
    castVote(epoch, step, stats);
    return awaitVerdict(epoch, step, timeout, withdrawalTimeout);
  }

  void castVote(int64_t epoch, int64_t step, StepStats stats) {
    auto us = [](double s) { return static_cast<int64_t>(std::max(0.0, s) * 1e6); };
    json body{{"step", step},
              {"compute_us", us(stats.computeSeconds)},
              {"stall_us", us(stats.stallSeconds)}};
    if (stats.replicatedBytes > 0) body["replicated_bytes"] = stats.replicatedBytes;
    if (stats.stateBytesIn > 0) body["state_bytes_in"] = stats.stateBytesIn;
    post(wire::Type::kVote, epoch, body);
  }

  VoteResult awaitVerdict(int64_t epoch, int64_t step, std::chrono::milliseconds timeout,
                          std::chrono::milliseconds withdrawalTimeout) {
    if (withdrawalTimeout.count() <= 0) withdrawalTimeout = timeout;
    std::unique_lock<std::mutex> lock(mu_);
    auto decided = [&] { return committed_ >= step || epoch_.epoch > epoch || !gone_.empty(); };
    // Waits up to `wait` for the verdict: true with *result set when there is one. A commit
    // precedes any later epoch on the connection, so it is checked first.
    VoteResult result = VoteResult::kSuperseded;
    auto verdict = [&](std::chrono::milliseconds wait) {
      const bool ok = waitFor(lock, wait, decided);
      if (committed_ >= step) {
        result = reshapeAfter_ == step ? VoteResult::kCommittedThenReshape : VoteResult::kCommitted;
        return true;
      }
      if (!gone_.empty()) throwGone();
      return ok;
    };
    if (verdict(timeout)) return result;
    // No verdict in time. The vote may still be in the coordinator's socket (a paused
    // coordinator): withdraw it and wait for what the coordinator decides, so that this worker
    // applies `step` exactly when the coordinator committed it (the commit, if any, precedes
    // the answer to the withdrawal on the connection).
    post(wire::Type::kWithdraw, epoch, json{{"step", step}});
    if (!verdict(withdrawalTimeout)) {
      SINEW_THROW(Timeout, "worker ", worker_, ": no verdict on step ", step, " of epoch ", epoch,
                  " within ", timeout.count(), " ms, nor on its withdrawal within ",
                  withdrawalTimeout.count(), " ms more");
    }
    return result;
  }

  // cv_.wait_for, except in HA mode when the leader was lost during the wait: then the
  // silence is the leader's, not the peers', and the wait lasts until reconnectTimeout after
  // the loss (a new leader's takeover answers it with a commit or a new epoch; docs/ha.md).
  template <typename Pred>
  bool waitFor(std::unique_lock<std::mutex>& lock, std::chrono::milliseconds timeout, Pred pred) {
    const int64_t start = nowNs();
    auto deadline = Clock::now() + timeout;
    while (true) {
      if (cv_.wait_until(lock, deadline, pred)) return true;
      if (!options_.awaitLeader) return false;
      const int64_t lost = leaderLostNs_.load();
      if (lost < start) return false;
      const auto extended = Clock::time_point(std::chrono::nanoseconds(lost)) +
                            std::chrono::duration_cast<Clock::duration>(options_.reconnectTimeout);
      if (extended <= deadline) return false;
      deadline = extended;
    }
  }

  static int64_t nowNs() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
        .count();
  }

  // After close() nothing is sent ("later calls do nothing"); on shared io threads a handler
  // posted then could outlive the client.
  void post(wire::Type type, int64_t epoch, json body) {
    if (shutDown_.load()) return;
    asio::post(io_, [this, type, epoch, body = std::move(body)] { queue(type, epoch, body); });
  }

  std::chrono::milliseconds stepDeadline() const {
    return std::chrono::milliseconds(stepDeadlineMs_.load());
  }

  bool checkpointRequested(int64_t step) const {
    std::lock_guard<std::mutex> lock(mu_);
    return checkpointAt_ == step;
  }

  void setProgress(int64_t step, bool waiting) { progress_.store(step * 2 + (waiting ? 1 : 0)); }
  void mute(std::chrono::milliseconds d) {
    std::lock_guard<std::mutex> lock(mu_);
    mutedUntil_ = Clock::now() + d;
  }
  // Once this returns, the previous listener is not running and is never called again (a
  // trainer clears its listener before it is destroyed). The io thread may call it, e.g.
  // from inside the listener, without waiting for itself.
  void setListener(std::function<void(int64_t)> l) {
    std::unique_lock<std::mutex> calling(listenerMu_, std::defer_lock);
    if (!io_.get_executor().running_in_this_thread()) calling.lock();
    std::lock_guard<std::mutex> lock(mu_);
    listener_ = std::move(l);
  }

  // On the io thread: calls the current listener, holding listenerMu_ so that setListener
  // waits for the call to end.
  void callListener(int64_t epoch) {
    std::lock_guard<std::mutex> calling(listenerMu_);
    std::function<void(int64_t)> listener;
    {
      std::lock_guard<std::mutex> lock(mu_);
      listener = listener_;
    }
    if (listener) listener(epoch);
  }

  // transport::ChannelHandler, on the io thread.
  void onFrame(transport::Channel& channel, const transport::FrameHeader& h,
               std::vector<uint8_t> payload) override {
    if (&channel != channel_.get()) return;         // A previous leader's connection.
    json body = wire::decodeBody(h.type, payload);  // Corruption closes the channel.
    handle(static_cast<wire::Type>(h.type), body);
  }
  void onClose(transport::Channel& channel, transport::CloseReason reason,
               const std::string& why) override {
    --openChannels_;
    onChannelClosed(channel, reason, why);
    checkQuiet();
  }
  void onChannelClosed(transport::Channel& channel, transport::CloseReason reason,
                       const std::string& why) {
    if (&channel != channel_.get()) return;  // A previous leader's connection.
    // Stopping, and the final flush is over: end the timer that bounds it now, or the io
    // thread (and the process's exit) would wait out its second.
    if (stopping_) return closeNow();
    if (options_.awaitLeader && reason != transport::CloseReason::kViolation && !stopping_ &&
        !closed_) {
      // High availability: the leader is gone (or cut off); the watcher finds the next one.
      channel_.reset();
      {
        std::lock_guard<std::mutex> lock(haMu_);
        connected_.store(false);
        leaderLostNs_.store(nowNs());
        lostWhy_ = why;
        // A wait for a new leader made while connected ends: the same leader may be back.
        if (watchCancel_) watchCancel_->cancel();
      }
      haCv_.notify_all();
      return;
    }
    if (reason == transport::CloseReason::kViolation) {
      return fail("malformed message from the coordinator: " + why);
    }
    fail("the coordinator closed the connection (" + why + ")");
  }

  CoordinatorClientOptions options_;
  int worker_ = -1;
  std::string storeHost_;
  uint16_t storePort_ = 0;

  void markDone() {
    std::lock_guard<std::mutex> lock(mu_);
    doneSent_ = true;
  }

  Standing standing() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (released_) return jobStopped_ ? Standing::kJobStopped : Standing::kReleased;
    if (doneSent_) return Standing::kDone;
    return gone_.empty() ? Standing::kIn : Standing::kExpelled;
  }

 private:
  [[noreturn]] void throwGone() const {
    if (released_) SINEW_THROW(Released, "worker ", worker_, " left the job: ", gone_);
    SINEW_THROW(Expelled, "worker ", worker_, " must leave the job: ", gone_);
  }

  std::shared_ptr<transport::Channel> makeChannel(tcp::socket socket) {
    transport::ChannelOptions co;
    co.rules = wire::clientRules(options_.token);
    co.frameTimeout = std::chrono::milliseconds(10000);
    co.name = "sinew coordinator client";
    auto channel = std::make_shared<transport::Channel>(std::move(socket), co, self_);
    ++openChannels_;  // until its onClose
    channel->start();
    return channel;
  }

  // A connection made on a thread other than the io thread, as a descriptor of its own
  // (close-on-exec) for the io thread to adopt.
  struct Detached {
    int fd = -1;
    tcp::socket::protocol_type protocol = tcp::v4();
  };
  // Connects on an io_context of the calling thread's. Throws what connectSocket throws, or
  // IoError.
  static Detached connectDetached(const std::string& host, uint16_t port,
                                  Clock::time_point deadline, const std::string& peer) {
    asio::io_context io;
    tcp::socket socket(io);
    transport::connectSocket(io, socket, host, port, deadline, peer);
    Detached d;
    d.protocol = socket.local_endpoint().protocol();
    d.fd = ::fcntl(socket.native_handle(), F_DUPFD_CLOEXEC, 0);
    if (d.fd < 0) SINEW_THROW(IoError, "cannot keep the connection to ", peer, ": dup failed");
    return d;
  }
  // io thread only: `d` as a socket of io_, or nullopt (its descriptor closed, the reason in
  // *why when given).
  std::optional<tcp::socket> adopt(const Detached& d, std::string* why) {
    tcp::socket s(io_);
    error_code ec;
    s.assign(d.protocol, d.fd, ec);
    if (!ec) return s;
    ::close(d.fd);
    if (why) *why = ec.message();
    return std::nullopt;
  }

  // High availability (docs/ha.md): the watcher thread. While connected, it waits for etcd to
  // name a leader of another term and moves to it; while disconnected, it waits for a leader
  // (a new one, or the same one again) and connects. It gives up after reconnectTimeout
  // without a leader.
  void watchLeader() {
    while (true) {
      const int64_t term = term_.load();
      // Read under haMu_ with the wait's cancellation registered: a connection that closes
      // from here on cancels the wait.
      bool connected;
      auto cancel = std::make_shared<Cancellation>();
      {
        std::lock_guard<std::mutex> lock(haMu_);
        if (haStop_) return;
        connected = connected_.load();
        watchCancel_ = cancel;
      }
      std::optional<CoordinatorClientOptions::Leader> leader;
      try {
        leader = options_.awaitLeader(
            term, connected ? options_.leaderWatch : std::chrono::milliseconds(300), cancel.get());
      } catch (const std::exception&) {
        // etcd unreachable (it may have lost its majority): the job waits for it. Not at
        // once again: a member that refuses at once would make this loop spin.
        std::unique_lock<std::mutex> lock(haMu_);
        haCv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return haStop_; });
      }
      {
        std::lock_guard<std::mutex> lock(haMu_);
        watchCancel_.reset();
        if (haStop_) return;
      }
      if (leader && leader->term != term) {
        reconnect(*leader);
        continue;
      }
      if (connected_.load()) continue;
      // Disconnected and no new term: the same leader may still lead (a broken connection).
      CoordinatorClientOptions::Leader same;
      {
        std::lock_guard<std::mutex> lock(haMu_);
        same = leader_;
      }
      if (reconnect(same)) continue;
      {
        std::unique_lock<std::mutex> lock(haMu_);
        const std::string why = lostWhy_;
        if (nowNs() - leaderLostNs_.load() >
            std::chrono::nanoseconds(options_.reconnectTimeout).count()) {
          lock.unlock();
          asio::post(io_, [this, why] {
            fail("no coordinator led the job for " +
                 std::to_string(options_.reconnectTimeout.count()) +
                 " ms after the connection to the last one closed (" + why + ")");
          });
          return;
        }
        haCv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return haStop_; });
      }
    }
  }

  // Connects to `leader` (on this thread, at most 2 s), then hands the connection to the io
  // thread, which replaces the old one and says hello again. Returns whether it connected.
  bool reconnect(const CoordinatorClientOptions::Leader& leader) {
    if (leader.port == 0) return false;
    // A new leader may still be opening its port: retry for 2 s. The same leader again (its
    // connection closed) is tried once, briefly: it is most likely dead, and the watcher must
    // go back to waiting for etcd to name the next one.
    const bool sameTerm = leader.term == term_.load();
    Detached d;
    try {
      d = connectDetached(leader.host, leader.port,
                          Clock::now() + (sameTerm ? std::chrono::milliseconds(100)
                                                   : std::chrono::milliseconds(2000)),
                          "the leader at " + leader.host + ":" + std::to_string(leader.port));
    } catch (const std::exception&) {
      return false;
    }
    {
      std::lock_guard<std::mutex> lock(haMu_);
      if (leader.term != leader_.term) leaderLostNs_.store(nowNs());  // A change of leader.
      leader_ = leader;
      term_.store(leader.term);
      connected_.store(true);
    }
    asio::post(io_, [this, d, leader] {
      if (stopping_ || closed_) {
        ::close(d.fd);
        return;
      }
      std::optional<tcp::socket> s = adopt(d, nullptr);
      if (!s) return;
      if (channel_) channel_->close();  // Its onClose is ignored: no longer the current one.
      channel_ = makeChannel(std::move(*s));
      json hello = {{"worker", worker_}, {"node", options_.node}, {"pid", ::getpid()}};
      int64_t epoch;
      int64_t committed;
      {
        std::lock_guard<std::mutex> lock(mu_);
        epoch = epoch_.epoch;
        committed = committed_;
      }
      if (epoch >= 0) {
        hello["rejoin"] = {{"epoch", epoch}, {"committed", committed}};
      } else if (options_.worker < 0) {
        hello["worker"] = -1;  // A joiner not yet in the job asks again.
      }
      queue(wire::Type::kHello, -1, hello);
      // Before the first epoch, the new leader needs this worker's ready again.
      if (epoch < 0 && !lastReady_.is_null()) queue(wire::Type::kReady, -1, lastReady_);
      std::fprintf(stderr, "sinew: worker %d connected to the leader at %s:%u (term %lld)\n",
                   worker_, leader.host.c_str(), static_cast<unsigned>(leader.port),
                   static_cast<long long>(leader.term));
    });
    return true;
  }

  // io thread only.
  void queue(wire::Type type, int64_t epoch, const json& body) {
    if (type == wire::Type::kReady) lastReady_ = body;
    if (closed_ || !channel_) return;
    {
      // A muted worker (failure injection) says nothing at all, votes included: every message
      // counts as a heartbeat, so muting heartbeats alone would never make it look dead.
      std::lock_guard<std::mutex> lock(mu_);
      if (Clock::now() < mutedUntil_) return;
    }
    channel_->send(static_cast<uint8_t>(type), epoch, wire::encodeBody(body));
  }

  void scheduleHeartbeat() {
    heartbeat_.expires_after(heartbeatInterval_);
    waitTimer([this](error_code ec) {
      // Stopping: the destructor reuses this timer to bound the final flush.
      if (ec || closed_ || stopping_) return;
      bool muted;
      int64_t epoch;
      {
        std::lock_guard<std::mutex> lock(mu_);
        muted = Clock::now() < mutedUntil_;
        epoch = epoch_.epoch;
      }
      if (!muted) {
        const int64_t progress = progress_.load();  // step and waiting, read together
        queue(wire::Type::kHeartbeat, epoch,
              json{{"step", progress >> 1}, {"waiting", (progress & 1) != 0}});
      }
      scheduleHeartbeat();
    });
  }

  void handle(wire::Type type, const json& body) {
    int64_t announce = -2;
    {
      std::lock_guard<std::mutex> lock(mu_);
      switch (type) {
        case wire::Type::kWelcome:
          worker_ = body.at("worker").get<int>();
          storeHost_ = body.at("store_host").get<std::string>();
          storePort_ = body.at("store_port").get<uint16_t>();
          heartbeatInterval_ = std::chrono::milliseconds(body.at("heartbeat_ms").get<int64_t>());
          welcomed_ = true;
          break;
        case wire::Type::kEpoch: {
          EpochInfo e;
          e.epoch = body.at("epoch").get<int64_t>();
          e.members = body.at("members").get<std::vector<int>>();
          e.resumeStep = body.at("resume_step").get<int64_t>();
          e.source = body.at("source").get<int>();
          e.joined = body.at("joined").get<std::vector<int>>();
          e.sync = body.at("sync").get<bool>();
          e.plan = body.value("plan", std::string());
          if (body.contains("step_deadline_ms")) {
            stepDeadlineMs_.store(body.at("step_deadline_ms").get<int64_t>());
          }
          if (e.epoch > epoch_.epoch) {
            epoch_ = e;
            announce = e.epoch;
          }
          break;
        }
        case wire::Type::kCommit: {
          int64_t step = body.at("step").get<int64_t>();
          committed_ = std::max(committed_, step);
          if (body.value("next_epoch", false)) reshapeAfter_ = step;
          if (body.value("checkpoint", false)) checkpointAt_ = std::max(checkpointAt_, step);
          if (body.contains("step_deadline_ms")) {
            stepDeadlineMs_.store(body.at("step_deadline_ms").get<int64_t>());
          }
          break;
        }
        case wire::Type::kReleased:
          gone_ = "released by the coordinator: " + body.value("reason", std::string("?"));
          released_ = true;
          jobStopped_ = body.value("job_stopped", false);
          announce = -1;
          // The connection stays open until this worker ends: it may still report the
          // checkpoint of its last step (durable), and heartbeats keep it from timing out.
          break;
        case wire::Type::kExpelled:
          gone_ = "the coordinator expelled it: " + body.value("reason", std::string("?"));
          announce = -1;
          closed_ = true;
          break;
        default:
          SINEW_THROW(Corruption, "unexpected ", wire::typeName(static_cast<uint8_t>(type)),
                      " message from the coordinator");
      }
    }
    cv_.notify_all();
    if (announce != -2) callListener(announce);
  }

  void fail(const std::string& why) {
    if (stopping_) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (gone_.empty()) gone_ = why;
      closed_ = true;
    }
    heartbeat_.cancel();
    if (channel_) channel_->close();
    cv_.notify_all();
    callListener(-1);
  }

  std::unique_ptr<asio::io_context> ownIo_;  // without options_.ioThreads
  asio::io_context& io_;                     // ownIo_ or one of options_.ioThreads
  asio::steady_timer heartbeat_;
  std::thread thread_;
  std::shared_ptr<transport::ChannelHandler> self_;  // this, non-owning (see start())
  json lastReady_;  // io thread only: the last ready message, re-sent to a new leader
  // High availability (docs/ha.md).
  std::thread watcher_;
  std::atomic<bool> connected_{false};
  std::atomic<int64_t> term_{0};
  std::atomic<int64_t> leaderLostNs_{-1};  // when the last leader was lost (steady clock)
  std::mutex haMu_;
  std::condition_variable haCv_;
  // Guarded by haMu_.
  bool haStop_ = false;
  CoordinatorClientOptions::Leader leader_;
  std::string lostWhy_;
  std::shared_ptr<Cancellation> watchCancel_;  // the watcher's wait for a leader, while it waits
  // The step (times 2) and whether the worker waits on the others (the low bit), in one word
  // so that a heartbeat never pairs one step with another step's flag. -2: step -1.
  std::atomic<int64_t> progress_{-2};
  // The coordinator's step deadline in ms (0: not given).
  std::atomic<int64_t> stepDeadlineMs_{0};
  // io thread only (set before the io thread starts).
  std::shared_ptr<transport::Channel> channel_;
  bool closed_ = false;
  bool stopping_ = false;
  int timerWaits_ = 0;    // heartbeat_ waits whose handler has not run
  int openChannels_ = 0;  // channels made whose onClose has not run

  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Guarded by mu_.
  bool welcomed_ = false;
  bool quiet_ = false;  // shutdown on shared io threads: nothing of this client is pending
  std::atomic<bool> shutDown_{false};
  bool released_ = false;
  bool jobStopped_ = false;  // released because every member left (the job stopped)
  bool doneSent_ = false;
  std::string gone_;  // why this worker left the job; empty while it is in
  EpochInfo epoch_;
  int64_t committed_ = -1;
  int64_t reshapeAfter_ = -1;
  int64_t checkpointAt_ = -1;  // the newest commit that asked for a durable checkpoint
  std::chrono::milliseconds heartbeatInterval_{100};
  Clock::time_point mutedUntil_{};
  std::function<void(int64_t)> listener_;  // Guarded by mu_; called under listenerMu_.
  std::mutex listenerMu_;                  // Held while the listener runs.
};

CoordinatorClient::CoordinatorClient(CoordinatorClientOptions options)
    : impl_(std::make_unique<Impl>(std::move(options))) {
  // Non-owning alias: the channel never outlives impl_ (see Impl::start).
  impl_->start(std::shared_ptr<transport::ChannelHandler>(std::shared_ptr<void>(), impl_.get()));
}
CoordinatorClient::~CoordinatorClient() = default;
int CoordinatorClient::worker() const { return impl_->worker_; }
const std::string& CoordinatorClient::node() const { return impl_->options_.node; }
const std::string& CoordinatorClient::storeHost() const { return impl_->storeHost_; }
uint16_t CoordinatorClient::storePort() const { return impl_->storePort_; }
EpochInfo CoordinatorClient::latestEpoch() const { return impl_->latestEpoch(); }
EpochInfo CoordinatorClient::waitEpochAfter(int64_t epoch, std::chrono::milliseconds timeout) {
  return impl_->waitEpochAfter(epoch, timeout);
}
CoordinatorClient::VoteResult CoordinatorClient::vote(int64_t epoch, int64_t step,
                                                      std::chrono::milliseconds timeout,
                                                      StepStats stats,
                                                      std::chrono::milliseconds withdrawalTimeout) {
  return impl_->vote(epoch, step, timeout, stats, withdrawalTimeout);
}
void CoordinatorClient::castVote(int64_t epoch, int64_t step, StepStats stats) {
  impl_->castVote(epoch, step, stats);
}
CoordinatorClient::VoteResult CoordinatorClient::awaitVerdict(
    int64_t epoch, int64_t step, std::chrono::milliseconds timeout,
    std::chrono::milliseconds withdrawalTimeout) {
  return impl_->awaitVerdict(epoch, step, timeout, withdrawalTimeout);
}
std::chrono::milliseconds CoordinatorClient::stepDeadline() const { return impl_->stepDeadline(); }
bool CoordinatorClient::checkpointRequested(int64_t step) const {
  return impl_->checkpointRequested(step);
}
void CoordinatorClient::durable(int64_t step, uint64_t bytes, double flushSeconds,
                                const std::string& path) {
  impl_->post(wire::Type::kDurable, impl_->latestEpoch().epoch,
              json{{"step", step},
                   {"bytes", static_cast<int64_t>(bytes)},
                   {"flush_us", static_cast<int64_t>(std::max(0.0, flushSeconds) * 1e6)},
                   {"path", path.empty() ? std::string(".") : path}});
}
void CoordinatorClient::reportLost(int64_t epoch, int worker) {
  impl_->post(wire::Type::kLost, epoch, json{{"worker", worker}});
}
void CoordinatorClient::requestRebuild(int64_t epoch) {
  impl_->post(wire::Type::kRebuild, epoch, json::object());
}
void CoordinatorClient::ready(int64_t resumeStep, JobShape shape) {
  json body = {{"resume_step", resumeStep}};
  if (shape.globalBatch > 0) body["global_batch"] = shape.globalBatch;
  if (shape.microbatch > 0) body["microbatch"] = shape.microbatch;
  if (shape.steps > 0) body["steps"] = shape.steps;
  if (shape.checkpoints) body["checkpoints"] = true;
  impl_->post(wire::Type::kReady, impl_->latestEpoch().epoch, body);
}
void CoordinatorClient::requestPipelines(int64_t epoch, const std::string& profileJson,
                                         int faultTolerance, int64_t microbatches,
                                         int64_t maxWorkers) {
  impl_->post(wire::Type::kPipeline, epoch,
              json{{"profile", profileJson},
                   {"fault_tolerance", faultTolerance},
                   {"microbatches", microbatches},
                   {"max_workers", maxWorkers}});
}
void CoordinatorClient::requestRollback(int64_t epoch, int64_t step) {
  impl_->post(wire::Type::kRollback, epoch, json{{"step", step}});
}
void CoordinatorClient::leave(int64_t step) {
  impl_->post(wire::Type::kLeave, impl_->latestEpoch().epoch, json{{"step", step}});
}
void CoordinatorClient::done(int64_t step) {
  impl_->markDone();
  impl_->post(wire::Type::kDone, impl_->latestEpoch().epoch, json{{"step", step}});
}
CoordinatorClient::Standing CoordinatorClient::standing() const { return impl_->standing(); }
void CoordinatorClient::close() { impl_->shutdown(); }
void CoordinatorClient::setProgress(int64_t step, bool waiting) {
  impl_->setProgress(step, waiting);
}
void CoordinatorClient::muteHeartbeats(std::chrono::milliseconds d) { impl_->mute(d); }
void CoordinatorClient::setEpochListener(std::function<void(int64_t)> l) {
  impl_->setListener(std::move(l));
}

}  // namespace runtime
}  // namespace sinew
