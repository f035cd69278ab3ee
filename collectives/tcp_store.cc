#include "sinew/collectives/tcp_store.h"

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>

#include <array>
#include <cstdio>
#include <iomanip>
#include <random>
#include <set>
#include <sstream>
#include <vector>

#include "sinew/base/little_endian.h"
#include "sinew/collectives/detail/store_wire.h"
#include "sinew/collectives/hash_store.h"
#include "sinew/collectives/transport/channel.h"
#include "sinew/collectives/transport/connection.h"

namespace sinew {
namespace collectives {

namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using boost::system::error_code;
using store_wire::Answer;
using store_wire::Op;
using transport::Channel;
using transport::FrameHeader;

uint64_t randomToken() {
  std::random_device rd;
  return ((static_cast<uint64_t>(rd()) << 32) ^ rd()) | 1;
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Server

// The server's state is a HashStore (thread-safe, used directly by local calls). Remote
// get/wait requests whose keys are missing park as waiters owned by the io thread; every
// mutation, local or remote, makes the io thread re-check them.
class TcpStoreServer::Impl {
 public:
  class Session;

  Impl(TcpStoreServer* owner, const TcpStoreServerOptions& options, uint64_t token)
      : owner_(owner), options_(options), token_(token) {}

  void start() {
    transport::ListenerOptions lo;
    lo.host = options_.host;
    lo.port = options_.port;
    lo.maxConnections = options_.maxConnections;
    lo.maxPending = options_.maxPending;
    lo.channel.rules = store_wire::requestRules(token_, options_.maxMessageBytes);
    lo.channel.idleTimeout = options_.idleTimeout;
    lo.channel.frameTimeout = options_.frameTimeout;
    lo.channel.name = "sinew tcp store " + options_.host;
    lo.channel.log = [this](const std::string& line) { log(line); };
    listener_ = std::make_unique<transport::Listener>(io_, lo, [this] { return makeSession(); });
    port_ = listener_->port();
    thread_ = std::thread([this] {
      transport::runIoThread(io_, [this](const std::string& what) {
        log("internal error in the io thread (it goes on serving): " + what);
      });
    });
  }

  void stop() {
    asio::post(io_, [this] {
      listener_->close();
      waiting_.clear();
    });
    if (thread_.joinable()) thread_.join();
  }

  // Called from any thread after a local mutation.
  void notifyMutation() {
    asio::post(io_, [this] { checkWaiters(); });
  }

  void log(const std::string& line) {
    std::string full = line + " (port " + std::to_string(port_) + ")";
    if (options_.log) {
      options_.log(full);
    } else {
      std::fprintf(stderr, "%s\n", full.c_str());
    }
  }

  HashStore state_;
  uint16_t port_ = 0;

 private:
  std::shared_ptr<transport::ChannelHandler> makeSession();
  void checkWaiters();

  TcpStoreServer* const owner_;  // Owns this Impl, so it outlives it.
  const TcpStoreServerOptions& options_;
  const uint64_t token_;
  asio::io_context io_;
  std::unique_ptr<transport::Listener> listener_;
  std::thread thread_;
  // Owned by the io thread.
  std::set<std::shared_ptr<Session>> waiting_;

  friend class Session;
};

// One client connection's requests. The channel reads continuously, so a client that dies
// while its request is parked is noticed at once; at most one request is in progress.
class TcpStoreServer::Impl::Session : public transport::ChannelHandler,
                                      public std::enable_shared_from_this<Session> {
 public:
  explicit Session(Impl* server) : server_(server) { server_->owner_->open_++; }

  void onFrame(Channel& channel, const FrameHeader& h, Bytes payload) override {
    if (!channel_) channel_ = channel.shared_from_this();
    if (busy_) {
      SINEW_THROW(Corruption, "a ", store_wire::requestName(h.type),
                  " request arrived before the previous one was answered");
    }
    store_wire::Request q = store_wire::decodeRequest(h.type, payload);
    busy_ = true;
    channel.setBusy(true);
    try {
      handle(std::move(q));
    } catch (const Corruption&) {
      throw;
    } catch (const std::exception& e) {
      respond(Answer::kInvalid, store_wire::encodeString(e.what()));
    }
  }

  void onClose(Channel& channel, transport::CloseReason reason, const std::string& why) override {
    if (reason == transport::CloseReason::kViolation) server_->owner_->dropped_++;
    server_->owner_->open_--;
    parked_ = false;
    if (timer_) timer_->cancel();
    server_->waiting_.erase(shared_from_this());
    channel_.reset();  // Breaks the channel -> session -> channel cycle.
  }

  // Completes a parked request whose keys are now all set. Returns true when done.
  bool tryComplete() {
    if (!parked_ || !server_->state_.check(parkedKeys_)) return false;
    parked_ = false;
    if (timer_) timer_->cancel();
    if (parkedOp_ == Op::kGet) {
      Bytes value;
      try {
        value = server_->state_.get(parkedKeys_[0], std::chrono::milliseconds(0));
      } catch (const Timeout&) {
        parked_ = true;  // Deleted again in between: keep waiting.
        return false;
      }
      respond(Answer::kOk, store_wire::encodeBytes(value));
    } else {
      respond(Answer::kOk, Bytes());
    }
    return true;
  }

  bool closed() const { return !channel_; }

 private:
  void handle(store_wire::Request q) {
    HashStore& st = server_->state_;
    switch (q.op) {
      case Op::kSet:
        st.set(q.key, q.value);
        respond(Answer::kOk, Bytes());
        server_->checkWaiters();
        return;
      case Op::kAdd:
        respond(Answer::kOk, store_wire::encodeI64(st.add(q.key, q.delta)));
        server_->checkWaiters();
        return;
      case Op::kCompareSet:
        respond(Answer::kOk, store_wire::encodeBytes(st.compareSet(q.key, q.expected, q.desired)));
        server_->checkWaiters();
        return;
      case Op::kCheck:
        respond(Answer::kOk, Bytes{static_cast<uint8_t>(st.check(q.keys) ? 1 : 0)});
        return;
      case Op::kDelete:
        respond(Answer::kOk, Bytes{static_cast<uint8_t>(st.deleteKey(q.key) ? 1 : 0)});
        return;
      case Op::kGet:
        park(Op::kGet, {q.key}, std::chrono::milliseconds(q.timeoutMs));
        return;
      case Op::kWait:
        park(Op::kWait, std::move(q.keys), std::chrono::milliseconds(q.timeoutMs));
        return;
    }
  }

  void park(Op op, std::vector<std::string> keys, std::chrono::milliseconds timeout) {
    parked_ = true;
    parkedOp_ = op;
    parkedKeys_ = std::move(keys);
    const uint64_t id = ++parkId_;
    if (tryComplete()) return;
    server_->waiting_.insert(shared_from_this());
    if (!timer_) timer_ = std::make_unique<asio::steady_timer>(server_->io_);
    timer_->expires_after(timeout);
    auto self = shared_from_this();
    // The id tells a stale expiry (of an earlier request) from this request's.
    timer_->async_wait([this, self, timeout, id](error_code ec) {
      if (ec || !parked_ || closed() || id != parkId_) return;
      parked_ = false;
      server_->waiting_.erase(self);
      std::string missing;
      for (const auto& k : parkedKeys_) {
        if (!server_->state_.check({k})) missing += (missing.empty() ? "" : ", ") + k;
      }
      respond(Answer::kTimeout,
              store_wire::encodeString("store " +
                                       std::string(store_wire::requestName(uint8_t(parkedOp_))) +
                                       " timed out after " + std::to_string(timeout.count()) +
                                       " ms; missing keys: " + missing));
    });
  }

  void respond(Answer answer, Bytes payload) {
    busy_ = false;
    if (!channel_) return;
    channel_->setBusy(false);
    channel_->send(static_cast<uint8_t>(answer), 0, std::move(payload));
  }

  Impl* const server_;                // The server outlives its sessions: stop() closes them first.
  std::shared_ptr<Channel> channel_;  // Set at the first frame; reset on close.
  std::unique_ptr<asio::steady_timer> timer_;
  bool busy_ = false;
  bool parked_ = false;
  Op parkedOp_ = Op::kWait;
  uint64_t parkId_ = 0;
  std::vector<std::string> parkedKeys_;
};

std::shared_ptr<transport::ChannelHandler> TcpStoreServer::Impl::makeSession() {
  return std::make_shared<Session>(this);
}

void TcpStoreServer::Impl::checkWaiters() {
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    auto s = *it;
    if (s->closed() || s->tryComplete()) {
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
}

TcpStoreServer::TcpStoreServer(TcpStoreServerOptions options)
    : options_(std::move(options)), token_(options_.token != 0 ? options_.token : randomToken()) {
  impl_ = std::make_unique<Impl>(this, options_, token_);
  impl_->start();
  port_ = impl_->port_;
}

TcpStoreServer::~TcpStoreServer() { impl_->stop(); }

void TcpStoreServer::set(const std::string& key, const Bytes& value) {
  impl_->state_.set(key, value);
  impl_->notifyMutation();
}
Bytes TcpStoreServer::get(const std::string& key, std::chrono::milliseconds timeout) {
  return impl_->state_.get(key, timeout);
}
int64_t TcpStoreServer::add(const std::string& key, int64_t delta) {
  int64_t v = impl_->state_.add(key, delta);
  impl_->notifyMutation();
  return v;
}
Bytes TcpStoreServer::compareSet(const std::string& key, const Bytes& expected,
                                 const Bytes& desired) {
  Bytes v = impl_->state_.compareSet(key, expected, desired);
  impl_->notifyMutation();
  return v;
}
void TcpStoreServer::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  impl_->state_.wait(keys, timeout);
}
bool TcpStoreServer::check(const std::vector<std::string>& keys) {
  return impl_->state_.check(keys);
}
bool TcpStoreServer::deleteKey(const std::string& key) { return impl_->state_.deleteKey(key); }

// ---------------------------------------------------------------------------------------
// Client

// Each request runs alone on a connection, against a deadline. Threads that request at once
// get a connection each: a blocking get or wait (a rendezvous, a checkpoint's shards) must not
// hold up another thread's short requests, which used to queue behind it for the whole
// timeout (a worker's flush thread waiting for a dead peer's shard kept its own recovery from
// reaching the store). Connections are opened lazily and kept for reuse, at most
// kMaxIdleConnections of them; one whose request failed is dropped.
class TcpStore::Impl {
 public:
  Impl(std::string host, uint16_t port, TcpStoreOptions options)
      : host_(std::move(host)),
        port_(port),
        options_(options),
        name_("tcp store at " + host_ + ":" + std::to_string(port)) {
    if (options_.token == 0) {
      SINEW_THROW(InvalidArgument,
                  "TcpStoreOptions::token is 0: pass the server's job token "
                  "(TcpStoreServer::token(), SINEW_TOKEN)");
    }
  }

  // Sends one request and returns the answer's payload; throws on any failure.
  Bytes request(const store_wire::Request& q, Clock::time_point deadline) {
    std::unique_ptr<transport::Connection> conn = acquire();
    // A server closes idle connections; reconnect rather than fail on one.
    if (conn->isOpen() && conn->peerClosedWhileIdle()) conn->close();
    if (!conn->isOpen()) conn->connect(host_, port_, Clock::now() + options_.connectTimeout);
    const char* what = store_wire::requestName(static_cast<uint8_t>(q.op));
    conn->send(static_cast<uint8_t>(q.op), 0, store_wire::encodeRequest(q), deadline);
    FrameHeader h = conn->readHeader(deadline);
    Bytes body = conn->readPayload(h, deadline);
    release(std::move(conn));  // A whole answer was read: the connection is idle again.
    auto answer = static_cast<Answer>(h.type);
    if (answer == Answer::kOk) return body;
    std::string message = store_wire::decodeString(body, "store error answer");
    if (answer == Answer::kTimeout) SINEW_THROW(Timeout, message);
    SINEW_THROW(InvalidArgument, "tcp store at ", host_, ":", port_, " rejected ", what, ": ",
                message);
  }

  const TcpStoreOptions& options() const { return options_; }

 private:
  static constexpr size_t kMaxIdleConnections = 4;

  std::unique_ptr<transport::Connection> acquire() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!idle_.empty()) {
        auto conn = std::move(idle_.back());
        idle_.pop_back();
        return conn;
      }
    }
    return std::make_unique<transport::Connection>(store_wire::answerRules(options_.token), name_);
  }

  void release(std::unique_ptr<transport::Connection> conn) {
    std::lock_guard<std::mutex> lock(mu_);
    if (idle_.size() < kMaxIdleConnections) idle_.push_back(std::move(conn));
  }

  const std::string host_;
  const uint16_t port_;
  const TcpStoreOptions options_;
  const std::string name_;
  std::mutex mu_;
  std::vector<std::unique_ptr<transport::Connection>> idle_;  // Guarded by mu_.
};

namespace {

// The server answers a timed-out wait itself at its deadline; the client allows this much
// longer before it gives up on the server.
constexpr std::chrono::milliseconds kServerAnswerGrace{2000};

store_wire::Request makeRequest(Op op) {
  store_wire::Request q;
  q.op = op;
  return q;
}

}  // namespace

TcpStore::TcpStore(std::string host, uint16_t port, TcpStoreOptions options)
    : impl_(std::make_unique<Impl>(std::move(host), port, options)) {}

TcpStore::~TcpStore() = default;

void TcpStore::set(const std::string& key, const Bytes& value) {
  auto q = makeRequest(Op::kSet);
  q.key = key;
  q.value = value;
  impl_->request(q, Clock::now() + impl_->options().timeout);
}

Bytes TcpStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  auto q = makeRequest(Op::kGet);
  q.key = key;
  q.timeoutMs = timeout.count();
  Bytes body = impl_->request(q, Clock::now() + timeout + kServerAnswerGrace);
  return store_wire::decodeBytes(body, "store get answer");
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  auto q = makeRequest(Op::kAdd);
  q.key = key;
  q.delta = delta;
  Bytes body = impl_->request(q, Clock::now() + impl_->options().timeout);
  return store_wire::decodeI64(body, "store add answer");
}

Bytes TcpStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  auto q = makeRequest(Op::kCompareSet);
  q.key = key;
  q.expected = expected;
  q.desired = desired;
  Bytes body = impl_->request(q, Clock::now() + impl_->options().timeout);
  return store_wire::decodeBytes(body, "store compareSet answer");
}

void TcpStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  auto q = makeRequest(Op::kWait);
  q.keys = keys;
  q.timeoutMs = timeout.count();
  impl_->request(q, Clock::now() + timeout + kServerAnswerGrace);
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  auto q = makeRequest(Op::kCheck);
  q.keys = keys;
  Bytes body = impl_->request(q, Clock::now() + impl_->options().timeout);
  return !body.empty() && body[0] == 1;
}

bool TcpStore::deleteKey(const std::string& key) {
  auto q = makeRequest(Op::kDelete);
  q.key = key;
  Bytes body = impl_->request(q, Clock::now() + impl_->options().timeout);
  return !body.empty() && body[0] == 1;
}

}  // namespace collectives
}  // namespace sinew
