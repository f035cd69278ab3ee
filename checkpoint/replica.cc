#include "sinew/checkpoint/replica.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstring>
#include <list>

#include "sinew/checkpoint/detail/crc32c.h"
#include "sinew/collectives/detail/little_endian.h"
#include "sinew/collectives/error.h"

namespace sinew {
namespace checkpoint {

void TrafficGate::enter() {
  std::lock_guard<std::mutex> lock(mu_);
  inFlight_++;
}

void TrafficGate::exit() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    inFlight_--;
  }
  cv_.notify_all();
}

void TrafficGate::waitIdle(std::chrono::milliseconds maxWait) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, maxWait, [&] { return inFlight_ == 0; });
}

namespace {

namespace asio = boost::asio;
using asio::ip::tcp;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

// Frame header (docs/checkpoint_format.md, "Replication protocol"), little-endian:
//   u32 magic "SNRP" | u8 version | u8 type | u16 zero | i32 owner | i64 step | u64 length
constexpr uint32_t kMagic = 0x50524E53;
constexpr uint8_t kVersion = 1;
constexpr size_t kHeaderBytes = 28;

enum class Type : uint8_t {
  kBegin = 1,
  kChunk = 2,
  kEnd = 3,
  kAck = 4,
  kList = 5,
  kListReply = 6,
  kGet = 7,
  kGetReply = 8,
  kError = 9,
};

struct Header {
  Type type;
  int32_t owner = -1;
  int64_t step = -1;
  uint64_t length = 0;
};

// A socket failure: closed by the peer or past the deadline.
struct SocketError {
  bool timeout;
  std::string what;
};

void waitFd(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    int ms = -1;
    if (deadline != Clock::time_point::max()) {
      auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left <= 0) throw SocketError{true, "deadline passed"};
      ms = static_cast<int>(std::min<int64_t>(left, 1 << 30));
    }
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, ms);
    if (r > 0) return;
    if (r == 0) throw SocketError{true, "deadline passed"};
    if (errno != EINTR) throw SocketError{false, std::string("poll: ") + std::strerror(errno)};
  }
}

void writeAll(int fd, const void* data, size_t n, Clock::time_point deadline) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w > 0) {
      p += w;
      n -= static_cast<size_t>(w);
    } else if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      waitFd(fd, POLLOUT, deadline);
    } else if (w < 0 && errno == EINTR) {
      continue;
    } else {
      throw SocketError{false, std::string("send: ") + std::strerror(errno)};
    }
  }
}

void readAll(int fd, void* data, size_t n, Clock::time_point deadline) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    ssize_t r = ::recv(fd, p, n, MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      n -= static_cast<size_t>(r);
    } else if (r == 0) {
      throw SocketError{false, "connection closed by peer"};
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      waitFd(fd, POLLIN, deadline);
    } else if (errno != EINTR) {
      throw SocketError{false, std::string("recv: ") + std::strerror(errno)};
    }
  }
}

using sinew::detail::loadLe;
using sinew::detail::storeLe;

void writeHeader(int fd, const Header& h, Clock::time_point deadline) {
  uint8_t b[kHeaderBytes] = {};
  storeLe(b, kMagic, 4);
  b[4] = kVersion;
  b[5] = static_cast<uint8_t>(h.type);
  storeLe(b + 8, static_cast<uint32_t>(h.owner), 4);
  storeLe(b + 12, static_cast<uint64_t>(h.step), 8);
  storeLe(b + 20, h.length, 8);
  writeAll(fd, b, kHeaderBytes, deadline);
}

// Returns false on a malformed header (the caller drops the connection).
bool readHeader(int fd, Header* h, Clock::time_point deadline, std::string* why) {
  uint8_t b[kHeaderBytes];
  readAll(fd, b, kHeaderBytes, deadline);
  if (loadLe(b, 4) != kMagic || b[4] != kVersion) {
    *why = "bad magic or version";
    return false;
  }
  h->type = static_cast<Type>(b[5]);
  h->owner = static_cast<int32_t>(static_cast<uint32_t>(loadLe(b + 8, 4)));
  h->step = static_cast<int64_t>(loadLe(b + 12, 8));
  h->length = loadLe(b + 20, 8);
  return true;
}

void sendMessage(int fd, Type type, int owner, int64_t step, const std::string& payload,
                 Clock::time_point deadline) {
  writeHeader(fd, Header{type, owner, step, payload.size()}, deadline);
  writeAll(fd, payload.data(), payload.size(), deadline);
}

std::string readPayload(int fd, uint64_t n, Clock::time_point deadline) {
  if (n > (64u << 20))
    throw SocketError{
        false, "control payload of " + std::to_string(n) + " bytes is over the 64 MiB limit"};
  std::string s(n, '\0');
  if (n > 0) readAll(fd, &s[0], n, deadline);
  return s;
}

void tuneSocket(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Service.

class ReplicaService::Impl {
 public:
  Impl(ReplicaService* owner, int self, ReplicaServiceOptions options)
      : service_(owner), self_(self), options_(std::move(options)), acceptor_(io_) {
    tcp::endpoint ep(asio::ip::make_address(options_.host), options_.port);
    boost::system::error_code ec;
    acceptor_.open(ep.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(ep, ec);
    if (!ec) acceptor_.listen(64, ec);
    if (ec) {
      SINEW_THROW(IoError, "replica service of worker ", self, ": cannot listen on ", options_.host,
                  ":", options_.port, ": ", ec.message());
    }
    port_ = acceptor_.local_endpoint().port();
    acceptThread_ = std::thread([this] { acceptLoop(); });
  }

  ~Impl() {
    stop_ = true;
    ::shutdown(acceptor_.native_handle(), SHUT_RDWR);
    boost::system::error_code ec;
    acceptor_.close(ec);
    acceptThread_.join();
    std::list<Connection> conns;
    {
      std::lock_guard<std::mutex> lock(connMu_);
      for (auto& c : conns_) ::shutdown(c.fd, SHUT_RDWR);
      conns.swap(conns_);
    }
    for (auto& c : conns) c.thread.join();
    for (auto& c : conns) ::close(c.fd);
  }

  uint16_t port() const { return port_; }

  void setOwnShards(std::function<std::vector<std::shared_ptr<const HostShard>>()> fn) {
    std::lock_guard<std::mutex> lock(mu_);
    ownShards_ = std::move(fn);
  }

  // Replicas and own snapshots, for LIST and GET.
  std::vector<std::shared_ptr<const HostShard>> served() const {
    auto out = all();
    std::function<std::vector<std::shared_ptr<const HostShard>>()> own;
    {
      std::lock_guard<std::mutex> lock(mu_);
      own = ownShards_;
    }
    if (own) {
      for (auto& s : own()) out.push_back(std::move(s));
    }
    return out;
  }

  std::shared_ptr<const HostShard> findServed(int owner, int64_t step) const {
    for (auto& s : served()) {
      if (s->owner == owner && s->step == step) return s;
    }
    return nullptr;
  }

  std::shared_ptr<const HostShard> find(int owner, int64_t step) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = slots_.find(owner);
    if (it == slots_.end()) return nullptr;
    for (const auto& s : it->second) {
      if (s && s->complete && s->step == step) return s;
    }
    return nullptr;
  }

  std::vector<std::shared_ptr<const HostShard>> all() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::shared_ptr<const HostShard>> out;
    for (const auto& kv : slots_) {
      for (const auto& s : kv.second) {
        if (s && s->complete) out.push_back(s);
      }
    }
    return out;
  }

  uint64_t bytesAllocated() const {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t n = 0;
    for (const auto& kv : slots_) {
      for (const auto& s : kv.second) n += s ? s->capacity() : 0;
    }
    return n;
  }

 private:
  struct Connection {
    int fd;
    std::thread thread;
  };

  void acceptLoop() {
    while (!stop_) {
      int fd = ::accept4(acceptor_.native_handle(), nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return;  // Closed by the destructor.
      }
      tuneSocket(fd);
      std::lock_guard<std::mutex> lock(connMu_);
      if (stop_) {
        ::close(fd);
        return;
      }
      conns_.push_back(Connection{fd, std::thread()});
      conns_.back().thread = std::thread([this, fd] { serve(fd); });
    }
  }

  // Picks the slot an incoming version of owner is written into: not read by anyone and
  // not the newest complete version. Null if none is free.
  std::shared_ptr<HostShard> claimSlot(int owner, int64_t step, const ShardLayout& layout) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& slots = slots_[owner];
    if (slots.empty()) slots.resize(std::max(1, options_.versionsKept));
    int newest = -1;  // Index of the newest complete version: never overwritten.
    for (int i = 0; i < static_cast<int>(slots.size()); ++i) {
      const auto& s = slots[i];
      if (s && s->complete && (newest < 0 || s->step > slots[newest]->step)) newest = i;
    }
    int best = -1;
    for (int i = 0; i < static_cast<int>(slots.size()); ++i) {
      const auto& s = slots[i];
      if (!s) {
        best = i;
        break;
      }
      if (s.use_count() != 1) continue;
      if (i == newest && slots.size() > 1) continue;
      if (best < 0 || !s->complete || (slots[best]->complete && s->step < slots[best]->step)) {
        best = i;
      }
    }
    if (best < 0) return nullptr;
    auto& slot = slots[best];
    if (!slot || slot->capacity() < layout.totalBytes) {
      slot.reset();  // Sized once per owner; regrown only if the owner's shard grew.
      slot = std::make_shared<HostShard>(layout.totalBytes, false);
    }
    slot->complete = false;
    slot->owner = owner;
    slot->step = step;
    slot->layout = layout;
    return slot;
  }

  void serve(int fd) {
    const auto forever = Clock::time_point::max();
    std::shared_ptr<HostShard> incoming;
    std::string incomingError;
    try {
      for (;;) {
        Header h;
        std::string why;
        if (!readHeader(fd, &h, forever, &why)) {
          std::fprintf(stderr, "sinew replica service %d: dropping a connection: %s\n", self_,
                       why.c_str());
          break;
        }
        switch (h.type) {
          case Type::kBegin: {
            ShardLayout layout;
            incomingError.clear();
            try {
              layout = ShardLayout::fromJson(readPayload(fd, h.length, forever));
            } catch (const Corruption& e) {
              incomingError = e.what();
              break;
            }
            if (layout.totalBytes > options_.maxShardBytes) {
              incomingError = "shard of " + std::to_string(layout.totalBytes) + " bytes is over " +
                              std::to_string(options_.maxShardBytes);
              incoming.reset();
              break;
            }
            incoming = claimSlot(h.owner, h.step, layout);
            if (!incoming)
              incomingError = "no free replica slot for worker " + std::to_string(h.owner);
            break;
          }
          case Type::kChunk: {
            if (h.length < 8) throw SocketError{false, "short chunk"};
            uint8_t o[8];
            readAll(fd, o, 8, forever);
            const uint64_t offset = loadLe(o, 8);
            const uint64_t n = h.length - 8;
            if (incoming && incoming->step == h.step && incoming->owner == h.owner &&
                offset <= incoming->layout.totalBytes &&
                n <= incoming->layout.totalBytes - offset) {
              readAll(fd, incoming->data() + offset, n, forever);
              service_->bytesReceived_.fetch_add(n);
            } else {
              // Drain it: the sender learns of the failure at kEnd.
              std::vector<uint8_t> sink(std::min<uint64_t>(n, 1 << 20));
              for (uint64_t left = n; left > 0;) {
                size_t k = static_cast<size_t>(std::min<uint64_t>(left, sink.size()));
                readAll(fd, sink.data(), k, forever);
                left -= k;
              }
              if (incomingError.empty()) incomingError = "chunk outside the announced shard";
            }
            break;
          }
          case Type::kEnd: {
            std::string result;
            if (!incoming || incoming->step != h.step || incoming->owner != h.owner) {
              result = incomingError.empty() ? "end of a shard that was not begun" : incomingError;
            } else {
              result = incoming->verify();
              if (result.empty()) {
                std::lock_guard<std::mutex> lock(mu_);
                incoming->complete = true;
              }
            }
            incoming.reset();
            sendMessage(fd, Type::kAck, h.owner, h.step, result, forever);
            break;
          }
          case Type::kList: {
            json j = json::array();
            for (const auto& s : served()) {
              j.push_back({{"owner", s->owner}, {"step", s->step}, {"layout", s->layout.toJson()}});
            }
            sendMessage(fd, Type::kListReply, self_, -1, j.dump(), forever);
            break;
          }
          case Type::kGet: {
            auto s = findServed(h.owner, h.step);
            if (!s) {
              sendMessage(fd, Type::kError, h.owner, h.step,
                          "worker " + std::to_string(self_) + " holds no replica of worker " +
                              std::to_string(h.owner) + " at version " + std::to_string(h.step),
                          forever);
              break;
            }
            std::string layout = s->layout.toJson();
            uint8_t len[8];
            storeLe(len, layout.size(), 8);
            writeHeader(
                fd,
                Header{Type::kGetReply, h.owner, h.step, 8 + layout.size() + s->layout.totalBytes},
                forever);
            writeAll(fd, len, 8, forever);
            writeAll(fd, layout.data(), layout.size(), forever);
            writeAll(fd, s->data(), s->layout.totalBytes, forever);
            break;
          }
          default:
            std::fprintf(stderr, "sinew replica service %d: dropping a connection: type %d\n",
                         self_, static_cast<int>(h.type));
            throw SocketError{false, "unknown type"};
        }
      }
    } catch (const SocketError& e) {
      // The peer went away, or sent garbage: only this connection ends (garbage is logged).
      if (e.what != "connection closed by peer") {
        std::fprintf(stderr, "sinew replica service %d: dropping a connection: %s\n", self_,
                     e.what.c_str());
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "sinew replica service %d: connection error: %s\n", self_, e.what());
    }
    if (incoming) {
      std::lock_guard<std::mutex> lock(mu_);
      incoming->step = -1;  // A half-received version never becomes visible.
    }
    ::shutdown(fd, SHUT_RDWR);
  }

  ReplicaService* const service_;  // Owns this Impl, so it outlives it.
  const int self_;
  const ReplicaServiceOptions options_;
  asio::io_context io_;
  tcp::acceptor acceptor_;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread acceptThread_;

  mutable std::mutex mu_;
  // Guarded by mu_: owner → its version slots.
  std::map<int, std::vector<std::shared_ptr<HostShard>>> slots_;
  std::function<std::vector<std::shared_ptr<const HostShard>>()> ownShards_;

  std::mutex connMu_;
  std::list<Connection> conns_;  // Guarded by connMu_.
};

ReplicaService::ReplicaService(int self, ReplicaServiceOptions options)
    : impl_(std::make_unique<Impl>(this, self, std::move(options))) {
  port_ = impl_->port();
}

ReplicaService::~ReplicaService() = default;

std::string ReplicaService::address() const { return "127.0.0.1:" + std::to_string(port_); }

std::shared_ptr<const HostShard> ReplicaService::find(int owner, int64_t step) const {
  return impl_->find(owner, step);
}

std::vector<std::shared_ptr<const HostShard>> ReplicaService::all() const { return impl_->all(); }

uint64_t ReplicaService::bytesAllocated() const { return impl_->bytesAllocated(); }

void ReplicaService::setOwnShards(
    std::function<std::vector<std::shared_ptr<const HostShard>>()> fn) {
  impl_->setOwnShards(std::move(fn));
}

// ---------------------------------------------------------------------------------------
// Client.

class ReplicaClient::Conn {
 public:
  Conn(const std::string& address, std::chrono::milliseconds timeout) : socket_(io_) {
    auto colon = address.rfind(':');
    SINEW_ENFORCE(colon != std::string::npos, "replica address '", address, "' is not host:port");
    tcp::resolver resolver(io_);
    auto deadline = Clock::now() + timeout;
    boost::system::error_code ec;
    for (;;) {
      auto eps = resolver.resolve(address.substr(0, colon), address.substr(colon + 1), ec);
      if (!ec) asio::connect(socket_, eps, ec);
      if (!ec) break;
      if (Clock::now() > deadline) throw SocketError{true, "connect: " + ec.message()};
      std::this_thread::sleep_for(std::chrono::milliseconds(20));  // Retry with backoff.
    }
    fd_ = socket_.native_handle();
    tuneSocket(fd_);
  }
  int fd() const { return fd_; }

 private:
  asio::io_context io_;
  tcp::socket socket_;
  int fd_ = -1;
};

ReplicaClient::ReplicaClient(int peer, std::string address, ReplicaClientOptions options)
    : peer_(peer), address_(std::move(address)), options_(std::move(options)) {}

ReplicaClient::~ReplicaClient() = default;

ReplicaClient::Conn& ReplicaClient::connection() {
  if (!conn_) conn_ = std::make_unique<Conn>(address_, options_.connectTimeout);
  return *conn_;
}

namespace {
[[noreturn]] void rethrowSocket(const SocketError& e, int peer, const std::string& address,
                                const std::string& what) {
  if (e.timeout) {
    SINEW_THROW(Timeout, what, " with worker ", peer, " at ", address, ": ", e.what);
  }
  throw PeerLost(peer,
                 what + " with worker " + std::to_string(peer) + " at " + address + ": " + e.what);
}
}  // namespace

void ReplicaClient::put(const HostShard& shard) {
  std::lock_guard<std::mutex> lock(mu_);
  std::string ack;
  try {
    int fd = connection().fd();
    auto deadline = [&] { return Clock::now() + options_.timeout; };
    sendMessage(fd, Type::kBegin, shard.owner, shard.step, shard.layout.toJson(), deadline());
    const uint64_t total = shard.layout.totalBytes;
    int64_t index = 0;
    for (uint64_t off = 0; off < total; off += options_.chunkBytes, ++index) {
      if (options_.beforeChunk) options_.beforeChunk();
      const uint64_t n = std::min<uint64_t>(options_.chunkBytes, total - off);
      writeHeader(fd, Header{Type::kChunk, shard.owner, shard.step, 8 + n}, deadline());
      uint8_t o[8];
      storeLe(o, off, 8);
      writeAll(fd, o, 8, deadline());
      writeAll(fd, shard.data() + off, n, deadline());
      if (options_.afterChunk) options_.afterChunk(index);
    }
    sendMessage(fd, Type::kEnd, shard.owner, shard.step, "", deadline());
    Header h;
    std::string why;
    if (!readHeader(fd, &h, deadline(), &why) || h.type != Type::kAck) {
      throw SocketError{false, "unexpected reply to a shard: " + why};
    }
    ack = readPayload(fd, h.length, deadline());
  } catch (const SocketError& e) {
    conn_.reset();
    rethrowSocket(e, peer_, address_,
                  "replicating worker " + std::to_string(shard.owner) + "'s shard of version " +
                      std::to_string(shard.step));
  }
  if (!ack.empty()) {
    SINEW_THROW(Corruption, "worker ", peer_, " rejected the replica of worker ", shard.owner,
                "'s shard of version ", shard.step, ": ", ack);
  }
}

std::vector<ReplicaInfo> ReplicaClient::list() {
  std::lock_guard<std::mutex> lock(mu_);
  std::string payload;
  try {
    int fd = connection().fd();
    auto deadline = Clock::now() + options_.timeout;
    sendMessage(fd, Type::kList, -1, -1, "", deadline);
    Header h;
    std::string why;
    if (!readHeader(fd, &h, deadline, &why) || h.type != Type::kListReply) {
      throw SocketError{false, "unexpected reply to list: " + why};
    }
    payload = readPayload(fd, h.length, deadline);
  } catch (const SocketError& e) {
    conn_.reset();
    rethrowSocket(e, peer_, address_, "listing replicas");
  }
  std::vector<ReplicaInfo> out;
  try {
    for (const auto& j : json::parse(payload)) {
      ReplicaInfo r;
      r.owner = j.at("owner").get<int>();
      r.step = j.at("step").get<int64_t>();
      r.layout = ShardLayout::fromJson(j.at("layout").get<std::string>());
      out.push_back(std::move(r));
    }
  } catch (const json::exception& e) {
    SINEW_THROW(Corruption, "replica list from worker ", peer_, " does not parse: ", e.what());
  }
  return out;
}

std::shared_ptr<HostShard> ReplicaClient::get(int owner, int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  try {
    int fd = connection().fd();
    auto deadline = [&] { return Clock::now() + options_.timeout; };
    sendMessage(fd, Type::kGet, owner, step, "", deadline());
    Header h;
    std::string why;
    if (!readHeader(fd, &h, deadline(), &why)) throw SocketError{false, why};
    if (h.type == Type::kError) {
      SINEW_THROW(IoError, readPayload(fd, h.length, deadline()));
    }
    if (h.type != Type::kGetReply || h.length < 8) throw SocketError{false, "unexpected reply"};
    uint8_t lenBytes[8];
    readAll(fd, lenBytes, 8, deadline());
    const uint64_t layoutLen = loadLe(lenBytes, 8);
    ShardLayout layout = ShardLayout::fromJson(readPayload(fd, layoutLen, deadline()));
    if (h.length != 8 + layoutLen + layout.totalBytes) {
      throw SocketError{false, "reply length disagrees with its layout"};
    }
    auto shard = std::make_shared<HostShard>(layout.totalBytes, false);
    shard->owner = owner;
    shard->step = step;
    shard->layout = std::move(layout);
    readAll(fd, shard->data(), shard->layout.totalBytes, deadline());
    shard->complete = true;
    return shard;
  } catch (const SocketError& e) {
    conn_.reset();
    rethrowSocket(
        e, peer_, address_,
        "fetching worker " + std::to_string(owner) + "'s shard of version " + std::to_string(step));
  }
}

}  // namespace checkpoint
}  // namespace sinew
