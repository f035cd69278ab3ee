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
#include <set>
#include <sstream>

#include "sinew/collectives/detail/little_endian.h"
#include "sinew/collectives/hash_store.h"

namespace sinew {
namespace collectives {
namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using boost::system::error_code;

// Wire format (docs/store_protocol.md): a 12-byte header, then the payload.
//   u32 magic "SNST" | u8 version | u8 op (request) or status (response) | u16 zero |
//   u32 payload bytes
// Integers are little-endian. Payload fields: bytes = u32 length + data; i64.
constexpr uint32_t kMagic = 0x54534E53;  // "SNST" read as little-endian bytes
constexpr uint8_t kVersion = 1;
constexpr size_t kHeaderBytes = 12;

enum class Op : uint8_t {
  kSet = 1,
  kGet = 2,
  kAdd = 3,
  kCompareSet = 4,
  kWait = 5,
  kCheck = 6,
  kDelete = 7,
};

enum class Status : uint8_t { kOk = 0, kTimeout = 1, kInvalid = 2 };

const char* opName(uint8_t op) {
  switch (static_cast<Op>(op)) {
    case Op::kSet:
      return "set";
    case Op::kGet:
      return "get";
    case Op::kAdd:
      return "add";
    case Op::kCompareSet:
      return "compareSet";
    case Op::kWait:
      return "wait";
    case Op::kCheck:
      return "check";
    case Op::kDelete:
      return "delete";
  }
  return nullptr;
}

void putU32(Bytes& b, uint32_t v) { detail::appendLe(b, v, 4); }
uint32_t getU32(const uint8_t* p) { return static_cast<uint32_t>(detail::loadLe(p, 4)); }
void putI64(Bytes& b, int64_t v) { detail::appendLe(b, static_cast<uint64_t>(v), 8); }
void putBytes(Bytes& b, const uint8_t* data, size_t n) {
  putU32(b, static_cast<uint32_t>(n));
  b.insert(b.end(), data, data + n);
}
void putBytes(Bytes& b, const Bytes& v) { putBytes(b, v.data(), v.size()); }
void putString(Bytes& b, const std::string& s) {
  putBytes(b, reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

// Appends a header for a payload of payloadBytes to out.
void putHeader(Bytes& out, uint8_t code, size_t payloadBytes) {
  putU32(out, kMagic);
  out.push_back(kVersion);
  out.push_back(code);
  out.push_back(0);
  out.push_back(0);
  putU32(out, static_cast<uint32_t>(payloadBytes));
}

// Reads payload fields; any overrun throws Corruption naming the field.
class Reader {
 public:
  explicit Reader(const Bytes& b) : b_(b) {}
  Bytes bytes(const char* field) {
    uint32_t n = u32(field);
    need(n, field);
    Bytes out(b_.begin() + pos_, b_.begin() + pos_ + n);
    pos_ += n;
    return out;
  }
  std::string string(const char* field) { return toString(bytes(field)); }
  int64_t i64(const char* field) {
    need(8, field);
    uint64_t v = detail::loadLe(b_.data() + pos_, 8);
    pos_ += 8;
    return static_cast<int64_t>(v);
  }
  uint32_t u32(const char* field) {
    need(4, field);
    uint32_t v = getU32(b_.data() + pos_);
    pos_ += 4;
    return v;
  }
  void end() {
    if (pos_ != b_.size()) {
      SINEW_THROW(Corruption, b_.size() - pos_, " unexpected trailing bytes after the payload");
    }
  }

 private:
  void need(size_t n, const char* field) {
    if (b_.size() - pos_ < n) {
      SINEW_THROW(Corruption, "payload ends inside field '", field, "' (needs ", n, " bytes, ",
                  b_.size() - pos_, " left)");
    }
  }
  const Bytes& b_;
  size_t pos_ = 0;
};

std::string hex32(uint32_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << std::setw(8) << std::setfill('0') << v;
  return os.str();
}

std::string endpointName(const tcp::socket& s) {
  error_code ec;
  auto ep = s.remote_endpoint(ec);
  if (ec) return "an unknown peer";
  return ep.address().to_string() + ":" + std::to_string(ep.port());
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

  Impl(TcpStoreServer* owner, const TcpStoreServerOptions& options)
      : owner_(owner), options_(options), acceptor_(io_) {}

  void start() {
    error_code ec;
    auto address = asio::ip::make_address(options_.host, ec);
    if (ec) {
      tcp::resolver resolver(io_);
      auto results = resolver.resolve(options_.host, std::to_string(options_.port), ec);
      if (ec || results.empty()) {
        SINEW_THROW(IoError, "tcp store server: cannot resolve '", options_.host,
                    "': ", ec.message());
      }
      address = results.begin()->endpoint().address();
    }
    tcp::endpoint ep(address, options_.port);
    acceptor_.open(ep.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(ep, ec);
    if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      SINEW_THROW(IoError, "tcp store server: cannot listen on ", options_.host, ":", options_.port,
                  ": ", ec.message());
    }
    port_ = acceptor_.local_endpoint().port();
    accept();
    thread_ = std::thread([this] { io_.run(); });
  }

  void stop() {
    asio::post(io_, [this] {
      error_code ec;
      acceptor_.close(ec);
      auto sessions = sessions_;
      for (auto& s : sessions) closeSession(s);
    });
    if (thread_.joinable()) thread_.join();
  }

  // Called from any thread after a local mutation.
  void notifyMutation() {
    asio::post(io_, [this] { checkWaiters(); });
  }

  void log(const std::string& line) {
    std::string full =
        "sinew tcp store " + options_.host + ":" + std::to_string(port_) + ": " + line;
    if (options_.log) {
      options_.log(full);
    } else {
      std::fprintf(stderr, "%s\n", full.c_str());
    }
  }

  HashStore state_;
  uint16_t port_ = 0;

 private:
  void accept();
  void checkWaiters();
  void closeSession(const std::shared_ptr<Session>& s);

  TcpStoreServer* const owner_;  // Owns this Impl, so it outlives it.
  const TcpStoreServerOptions& options_;
  asio::io_context io_;
  tcp::acceptor acceptor_;
  std::thread thread_;
  // Owned by the io thread.
  std::set<std::shared_ptr<Session>> sessions_;
  std::set<std::shared_ptr<Session>> waiting_;

  friend class Session;
};

// One client connection. Reads continuously, so a client that dies while its request is
// parked is noticed at once; at most one request is in progress at a time.
class TcpStoreServer::Impl::Session : public std::enable_shared_from_this<Session> {
 public:
  Session(Impl* server, tcp::socket socket)
      : server_(server), socket_(std::move(socket)), timer_(socket_.get_executor()) {
    peer_ = endpointName(socket_);
  }

  void start() { readHeader(); }

  // Completes a parked request whose keys are now all set. Returns true when done.
  bool tryComplete() {
    if (!parked_ || !server_->state_.check(parkedKeys_)) return false;
    parked_ = false;
    timer_.cancel();
    if (parkedOp_ == Op::kGet) {
      Bytes value;
      try {
        value = server_->state_.get(parkedKeys_[0], std::chrono::milliseconds(0));
      } catch (const Timeout&) {
        parked_ = true;  // Deleted again in between: keep waiting.
        return false;
      }
      Bytes out;
      putBytes(out, value);
      respond(Status::kOk, out);
    } else {
      respond(Status::kOk, Bytes());
    }
    return true;
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    parked_ = false;
    timer_.cancel();
    error_code ec;
    socket_.shutdown(tcp::socket::shutdown_both, ec);
    socket_.close(ec);
  }

  bool closed() const { return closed_; }

 private:
  void readHeader() {
    auto self = shared_from_this();
    asio::async_read(socket_, asio::buffer(header_), [this, self](error_code ec, size_t) {
      if (closed_) return;
      if (ec) {
        if (ec != asio::error::eof && ec != asio::error::connection_reset) {
          server_->log("connection from " + peer_ + " failed: " + ec.message());
        }
        return server_->closeSession(self);
      }
      uint32_t magic = getU32(header_.data());
      if (magic != kMagic) {
        return drop("bad magic " + hex32(magic) + " (not a Sinew store request)");
      }
      if (header_[4] != kVersion) {
        return drop("protocol version " + std::to_string(header_[4]) + ", this server speaks " +
                    std::to_string(kVersion));
      }
      uint8_t op = header_[5];
      if (opName(op) == nullptr) return drop("unknown operation " + std::to_string(op));
      uint32_t length = getU32(header_.data() + 8);
      if (length > server_->options_.maxMessageBytes) {
        return drop("request of " + std::to_string(length) + " bytes exceeds the limit of " +
                    std::to_string(server_->options_.maxMessageBytes));
      }
      if (busy_) {
        return drop(std::string("a ") + opName(op) +
                    " request arrived before the previous one was answered");
      }
      payload_.assign(length, 0);
      readPayload(static_cast<Op>(op));
    });
  }

  void readPayload(Op op) {
    auto self = shared_from_this();
    asio::async_read(socket_, asio::buffer(payload_), [this, self, op](error_code ec, size_t) {
      if (closed_) return;
      if (ec) {
        server_->log("connection from " + peer_ + " closed in the middle of a " +
                     opName(static_cast<uint8_t>(op)) + " request: " + ec.message());
        return server_->closeSession(self);
      }
      busy_ = true;
      try {
        handle(op);
      } catch (const Corruption& e) {
        return drop(std::string("malformed ") + opName(static_cast<uint8_t>(op)) +
                    " request: " + e.what());
      } catch (const std::exception& e) {
        respond(Status::kInvalid, errorPayload(e.what()));
      }
      readHeader();
    });
  }

  static Bytes errorPayload(const std::string& message) {
    Bytes out;
    putString(out, message);
    return out;
  }

  void handle(Op op) {
    Reader r(payload_);
    HashStore& st = server_->state_;
    Bytes out;
    switch (op) {
      case Op::kSet: {
        std::string key = r.string("key");
        Bytes value = r.bytes("value");
        r.end();
        st.set(key, value);
        respond(Status::kOk, out);
        server_->checkWaiters();
        return;
      }
      case Op::kAdd: {
        std::string key = r.string("key");
        int64_t delta = r.i64("delta");
        r.end();
        putI64(out, st.add(key, delta));
        respond(Status::kOk, out);
        server_->checkWaiters();
        return;
      }
      case Op::kCompareSet: {
        std::string key = r.string("key");
        Bytes expected = r.bytes("expected");
        Bytes desired = r.bytes("desired");
        r.end();
        putBytes(out, st.compareSet(key, expected, desired));
        respond(Status::kOk, out);
        server_->checkWaiters();
        return;
      }
      case Op::kCheck: {
        std::vector<std::string> keys = readKeys(r);
        r.end();
        out.push_back(st.check(keys) ? 1 : 0);
        respond(Status::kOk, out);
        return;
      }
      case Op::kDelete: {
        std::string key = r.string("key");
        r.end();
        out.push_back(st.deleteKey(key) ? 1 : 0);
        respond(Status::kOk, out);
        return;
      }
      case Op::kGet:
      case Op::kWait: {
        int64_t timeoutMs = r.i64("timeout_ms");
        std::vector<std::string> keys;
        if (op == Op::kGet) {
          keys.push_back(r.string("key"));
        } else {
          keys = readKeys(r);
        }
        r.end();
        if (timeoutMs < 0) SINEW_THROW(InvalidArgument, "negative timeout ", timeoutMs, " ms");
        park(op, std::move(keys), std::chrono::milliseconds(timeoutMs));
        return;
      }
    }
  }

  static std::vector<std::string> readKeys(Reader& r) {
    uint32_t n = r.u32("key count");
    std::vector<std::string> keys;
    for (uint32_t i = 0; i < n; ++i) keys.push_back(r.string("key"));
    return keys;
  }

  void park(Op op, std::vector<std::string> keys, std::chrono::milliseconds timeout) {
    parked_ = true;
    parkedOp_ = op;
    parkedKeys_ = std::move(keys);
    const uint64_t id = ++parkId_;
    if (tryComplete()) return;
    server_->waiting_.insert(shared_from_this());
    timer_.expires_after(timeout);
    auto self = shared_from_this();
    // The id tells a stale expiry (of an earlier request) from this request's.
    timer_.async_wait([this, self, timeout, id](error_code ec) {
      if (ec || !parked_ || closed_ || id != parkId_) return;
      parked_ = false;
      server_->waiting_.erase(self);
      std::string missing;
      for (const auto& k : parkedKeys_) {
        if (!server_->state_.check({k})) missing += (missing.empty() ? "" : ", ") + k;
      }
      respond(Status::kTimeout, errorPayload("store " + std::string(opName(uint8_t(parkedOp_))) +
                                             " timed out after " + std::to_string(timeout.count()) +
                                             " ms; missing keys: " + missing));
    });
  }

  void respond(Status status, const Bytes& payload) {
    auto buf = std::make_shared<Bytes>();
    buf->reserve(kHeaderBytes + payload.size());
    putHeader(*buf, static_cast<uint8_t>(status), payload.size());
    buf->insert(buf->end(), payload.begin(), payload.end());
    auto self = shared_from_this();
    asio::async_write(socket_, asio::buffer(*buf), [this, self, buf](error_code ec, size_t) {
      if (closed_) return;
      if (ec) {
        server_->log("cannot answer " + peer_ + ": " + ec.message());
        return server_->closeSession(self);
      }
      busy_ = false;
    });
  }

  void drop(const std::string& reason) {
    server_->log("dropping connection from " + peer_ + ": " + reason);
    server_->owner_->dropped_++;
    server_->closeSession(shared_from_this());
  }

  Impl* const server_;  // The server outlives its sessions: stop() closes them first.
  tcp::socket socket_;
  asio::steady_timer timer_;
  std::string peer_;
  std::array<uint8_t, kHeaderBytes> header_{};
  Bytes payload_;
  bool busy_ = false;
  bool closed_ = false;
  bool parked_ = false;
  Op parkedOp_ = Op::kWait;
  uint64_t parkId_ = 0;
  std::vector<std::string> parkedKeys_;
};

void TcpStoreServer::Impl::accept() {
  acceptor_.async_accept([this](error_code ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
    if (!ec) {
      error_code ignored;
      socket.set_option(tcp::no_delay(true), ignored);
      auto session = std::make_shared<Session>(this, std::move(socket));
      sessions_.insert(session);
      owner_->open_++;
      session->start();
    } else {
      log("accept failed: " + ec.message());
    }
    accept();
  });
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

void TcpStoreServer::Impl::closeSession(const std::shared_ptr<Session>& s) {
  s->close();
  waiting_.erase(s);
  if (sessions_.erase(s) > 0) owner_->open_--;
}

TcpStoreServer::TcpStoreServer(TcpStoreServerOptions options)
    : options_(std::move(options)), impl_(std::make_unique<Impl>(this, options_)) {
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

// Synchronous requests over asynchronous Asio operations run against a deadline
// (io_context::run_until); an operation still pending at the deadline is cancelled by
// closing the socket, and the next request reconnects.
class TcpStore::Impl {
 public:
  Impl(std::string host, uint16_t port, TcpStoreOptions options)
      : host_(std::move(host)), port_(port), options_(options), socket_(io_) {}

  // Sends one request and returns the response payload; throws on any failure.
  Bytes request(Op op, const Bytes& payload, Clock::time_point deadline) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!socket_.is_open()) connect();
    Bytes header;
    putHeader(header, static_cast<uint8_t>(op), payload.size());
    std::array<asio::const_buffer, 2> out{asio::buffer(header), asio::buffer(payload)};
    const char* what = opName(static_cast<uint8_t>(op));
    error_code ec = runUntil(deadline, [&](error_code& result) {
      asio::async_write(socket_, out, [&result](error_code e, size_t) { result = e; });
    });
    if (ec) fail(what, "sending", ec);
    std::array<uint8_t, kHeaderBytes> rh{};
    ec = runUntil(deadline, [&](error_code& result) {
      asio::async_read(socket_, asio::buffer(rh), [&result](error_code e, size_t) { result = e; });
    });
    if (ec) fail(what, "awaiting the answer to", ec);
    uint32_t magic = getU32(rh.data());
    uint32_t length = getU32(rh.data() + 8);
    if (magic != kMagic || rh[4] != kVersion || rh[5] > 2 || length > (1u << 30)) {
      closeSocket();
      SINEW_THROW(Corruption, "tcp store at ", host_, ":", port_, " answered a ", what,
                  " request with a malformed header (magic ", hex32(magic), ", version ",
                  int(rh[4]), ", status ", int(rh[5]), ", length ", length, ")");
    }
    Bytes body(length);
    ec = runUntil(deadline, [&](error_code& result) {
      asio::async_read(socket_, asio::buffer(body),
                       [&result](error_code e, size_t) { result = e; });
    });
    if (ec) fail(what, "reading the answer to", ec);
    auto status = static_cast<Status>(rh[5]);
    if (status == Status::kOk) return body;
    Reader r(body);
    std::string message = r.string("message");
    if (status == Status::kTimeout) SINEW_THROW(Timeout, message);
    SINEW_THROW(InvalidArgument, "tcp store at ", host_, ":", port_, " rejected ", what, ": ",
                message);
  }

  const TcpStoreOptions& options() const { return options_; }

 private:
  template <typename Start>
  error_code runUntil(Clock::time_point deadline, Start start) {
    error_code result = asio::error::would_block;
    start(result);
    io_.restart();
    io_.run_until(deadline);
    if (!io_.stopped()) {
      // Deadline: cancel by closing, and let the handler run with operation_aborted.
      error_code ignored;
      socket_.close(ignored);
      io_.run();
      return asio::error::timed_out;
    }
    return result;
  }

  [[noreturn]] void fail(const char* what, const char* doing, error_code ec) {
    closeSocket();
    if (ec == asio::error::timed_out) {
      SINEW_THROW(Timeout, "tcp store at ", host_, ":", port_, ": deadline passed while ", doing,
                  " a ", what, " request");
    }
    SINEW_THROW(IoError, "tcp store at ", host_, ":", port_, ": connection failed while ", doing,
                " a ", what, " request: ", ec.message());
  }

  void closeSocket() {
    error_code ignored;
    socket_.close(ignored);
  }

  // Connects, retrying with backoff until connectTimeout (the server may start later).
  void connect() {
    auto deadline = Clock::now() + options_.connectTimeout;
    auto backoff = std::chrono::milliseconds(5);
    std::string lastError = "no attempt made";
    while (true) {
      error_code ec;
      tcp::resolver resolver(io_);
      auto endpoints = resolver.resolve(host_, std::to_string(port_), ec);
      if (!ec) {
        auto attemptDeadline = std::min(deadline, Clock::now() + std::chrono::seconds(2));
        ec = runUntil(attemptDeadline, [&](error_code& result) {
          asio::async_connect(socket_, endpoints,
                              [&result](error_code e, const tcp::endpoint&) { result = e; });
        });
        if (!ec) {
          error_code ignored;
          socket_.set_option(tcp::no_delay(true), ignored);
          return;
        }
        closeSocket();
      }
      lastError = ec.message();
      auto now = Clock::now();
      if (now >= deadline) break;
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
    }
    SINEW_THROW(Timeout, "tcp store at ", host_, ":", port_, ": could not connect within ",
                options_.connectTimeout.count(), " ms (last error: ", lastError, ")");
  }

  const std::string host_;
  const uint16_t port_;
  const TcpStoreOptions options_;
  std::mutex mu_;
  // Guarded by mu_.
  asio::io_context io_;
  tcp::socket socket_;
};

namespace {

// The server answers a timed-out wait itself at its deadline; the client allows this much
// longer before it gives up on the server.
constexpr std::chrono::milliseconds kServerAnswerGrace{2000};

}  // namespace

TcpStore::TcpStore(std::string host, uint16_t port, TcpStoreOptions options)
    : impl_(std::make_unique<Impl>(std::move(host), port, options)) {}

TcpStore::~TcpStore() = default;

void TcpStore::set(const std::string& key, const Bytes& value) {
  Bytes p;
  putString(p, key);
  putBytes(p, value);
  impl_->request(Op::kSet, p, Clock::now() + impl_->options().timeout);
}

Bytes TcpStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  Bytes p;
  putI64(p, timeout.count());
  putString(p, key);
  Bytes body = impl_->request(Op::kGet, p, Clock::now() + timeout + kServerAnswerGrace);
  Reader r(body);
  return r.bytes("value");
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  Bytes p;
  putString(p, key);
  putI64(p, delta);
  Bytes body = impl_->request(Op::kAdd, p, Clock::now() + impl_->options().timeout);
  Reader r(body);
  return r.i64("value");
}

Bytes TcpStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  Bytes p;
  putString(p, key);
  putBytes(p, expected);
  putBytes(p, desired);
  Bytes body = impl_->request(Op::kCompareSet, p, Clock::now() + impl_->options().timeout);
  Reader r(body);
  return r.bytes("value");
}

void TcpStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  Bytes p;
  putI64(p, timeout.count());
  putU32(p, static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) putString(p, k);
  impl_->request(Op::kWait, p, Clock::now() + timeout + kServerAnswerGrace);
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  Bytes p;
  putU32(p, static_cast<uint32_t>(keys.size()));
  for (const auto& k : keys) putString(p, k);
  Bytes body = impl_->request(Op::kCheck, p, Clock::now() + impl_->options().timeout);
  return !body.empty() && body[0] == 1;
}

bool TcpStore::deleteKey(const std::string& key) {
  Bytes p;
  putString(p, key);
  Bytes body = impl_->request(Op::kDelete, p, Clock::now() + impl_->options().timeout);
  return !body.empty() && body[0] == 1;
}

}  // namespace collectives
}  // namespace sinew
