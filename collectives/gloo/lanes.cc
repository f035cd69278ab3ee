#include "sinew/collectives/gloo/lanes.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <optional>
#include <random>
#include <sstream>

#include "sinew/collectives/gloo/gloo_options.h"
#include "sinew/collectives/gloo/kept_links.h"

#include "sinew/base/error.h"
#include "sinew/base/little_endian.h"
#include "sinew/collectives/transport/frame.h"
#include "sinew/communicator.h"

namespace sinew {
namespace collectives {
namespace {

using Clock = Lanes::Clock;
using transport::FrameHeader;
using transport::FrameRules;
using transport::kFrameHeaderBytes;
using transport::Service;

constexpr uint8_t kHello = 1;
constexpr uint8_t kWelcome = 2;
constexpr uint32_t kHelloBytes = 16;  // the connector's rank, which direction (i64 each)
// The hello's direction of a Gloo pair's connection (Purpose::kGlooPairs); a lane's is 0 or 1.
constexpr uint64_t kPairDirection = 2;
// A connection must complete its hello within this (bounded by the overall deadline). Hellos
// are read side by side, so a stranger that connects and stays silent delays no one; at most
// kMaxPendingHellos connections wait for theirs at once.
constexpr std::chrono::milliseconds kHandshakeBound{2000};
constexpr size_t kMaxPendingHellos = 64;

uint32_t laneMaxPayload(uint8_t type) { return type == kHello ? kHelloBytes : 0; }

FrameRules laneRules(uint64_t token) {
  FrameRules rules;
  rules.service = Service::kLane;
  rules.token = token;
  rules.typeName = laneFrameTypeName;
  rules.maxPayloadBytes = kHelloBytes;
  rules.maxPayloadOf = laneMaxPayload;
  return rules;
}

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  int get() const { return fd_; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_;
};

std::string errnoText(const char* call) { return std::string(call) + ": " + std::strerror(errno); }

// Called between the slices of every wait; throws to give up (the owner failed, or its epoch
// is over).
using Tick = std::function<void()>;
constexpr std::chrono::milliseconds kSlice{50};

// Waits until fd has one of `events`; false at the deadline. Calls tick every slice.
bool waitFor(int fd, short events, Clock::time_point deadline, const Tick& tick) {
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, events, 0};
    int rv = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count() + 1, kSlice.count())));
    if (rv > 0) return true;
    if (rv < 0 && errno != EINTR) SINEW_THROW(IoError, errnoText("poll"));
    tick();
  }
}

// Reads or writes exactly n bytes of a non-blocking socket before the deadline. Returns an
// empty string on success, else why not ("timed out", "connection closed", an errno text).
std::string readAll(int fd, void* data, size_t n, Clock::time_point deadline, const Tick& tick) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    ssize_t rv = ::recv(fd, p, n, MSG_DONTWAIT);
    if (rv > 0) {
      p += rv;
      n -= static_cast<size_t>(rv);
    } else if (rv == 0) {
      return "connection closed";
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!waitFor(fd, POLLIN, deadline, tick)) return "timed out";
    } else if (errno != EINTR) {
      return errnoText("recv");
    }
  }
  return {};
}

std::string writeAll(int fd, const void* data, size_t n, Clock::time_point deadline,
                     const Tick& tick) {
  auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    ssize_t rv = ::send(fd, p, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (rv >= 0) {
      p += rv;
      n -= static_cast<size_t>(rv);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!waitFor(fd, POLLOUT, deadline, tick)) return "timed out";
    } else if (errno != EINTR) {
      return errnoText("send");
    }
  }
  return {};
}

void setNoDelay(int fd) {
  int on = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
}

// Gives a socket kernel buffers of `bytes` each way (Lanes::usableSocketBufferBytes), before
// it listens or connects: the window scale is agreed in the handshake, and accepted sockets
// take the listener's sizes.
void sizeBuffers(int fd, int bytes, const std::string& what) {
  if (bytes <= 0) return;
  for (int option : {SO_SNDBUF, SO_RCVBUF}) {
    if (::setsockopt(fd, SOL_SOCKET, option, &bytes, sizeof(bytes)) != 0) {
      SINEW_THROW(IoError, what, ": sizing a lane socket's ",
                  option == SO_SNDBUF ? "send" : "receive", " buffer to ", bytes,
                  " bytes: ", errnoText("setsockopt"));
    }
  }
}

struct Resolved {
  sockaddr_storage addr{};
  socklen_t len = 0;
  int family = AF_INET;
};

Resolved resolve(const std::string& host, uint16_t port, const std::string& what) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rv = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rv != 0 || res == nullptr) {
    SINEW_THROW(IoError, what, ": cannot resolve host '", host, "': ", ::gai_strerror(rv));
  }
  Resolved r;
  std::memcpy(&r.addr, res->ai_addr, res->ai_addrlen);
  r.len = res->ai_addrlen;
  r.family = res->ai_family;
  ::freeaddrinfo(res);
  return r;
}

uint16_t portOf(const sockaddr_storage& a) {
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<const sockaddr_in6&>(a).sin6_port);
  return ntohs(reinterpret_cast<const sockaddr_in&>(a).sin_port);
}

uint64_t drawNonce() {
  std::random_device rd;
  uint64_t v = 0;
  while (v == 0) v = (uint64_t(rd()) << 32) ^ rd();  // 0 is never a valid token
  return v;
}

// The store key of rank r's entry: "lane/<r>", or "pair/<r>" for Purpose::kGlooPairs.
std::string entryKey(bool pairs, int r) { return (pairs ? "pair/" : "lane/") + std::to_string(r); }

struct Entry {
  std::string host;
  uint16_t port = 0;
  uint64_t nonce = 0;
};

Entry parseEntry(const Bytes& b, const std::string& what) {
  std::istringstream is(std::string(b.begin(), b.end()));
  Entry e;
  unsigned port = 0;
  if (!(is >> e.host >> port >> e.nonce) || port == 0 || port > 65535 || e.nonce == 0) {
    SINEW_THROW(Corruption, what, ": malformed lane entry in the store: '",
                std::string(b.begin(), b.end()), "'");
  }
  e.port = static_cast<uint16_t>(port);
  return e;
}

void sendFrame(int fd, uint8_t type, uint64_t token, int64_t epoch, const void* payload, uint32_t n,
               Clock::time_point deadline, const std::string& what, const Tick& tick) {
  uint8_t buf[kFrameHeaderBytes + kHelloBytes];
  FrameHeader h;
  h.service = Service::kLane;
  h.type = type;
  h.length = n;
  h.token = token;
  h.epoch = epoch;
  transport::encodeFrameHeader(h, buf);
  if (n > 0) std::memcpy(buf + kFrameHeaderBytes, payload, n);
  std::string err = writeAll(fd, buf, kFrameHeaderBytes + n, deadline, tick);
  if (!err.empty()) SINEW_THROW(IoError, what, ": ", err);
}

}  // namespace

const char* laneFrameTypeName(uint8_t type) {
  switch (type) {
    case kHello:
      return "hello";
    case kWelcome:
      return "welcome";
  }
  return nullptr;
}

int Lanes::usableSocketBufferBytes(int requested) {
  if (requested <= 0 || requested > GlooOptions::kMaxLaneSocketBufferBytes) return 0;
  // Asks the kernel itself on a scratch socket, not /proc/sys/net/core/{r,w}mem_max: a
  // container's network namespace may not show those files (before Linux 6.11), while the
  // limits still apply. Linux reports twice the size set, or twice the limit it was cut to.
  Fd probe(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (probe.get() < 0) return 0;
  for (int option : {SO_SNDBUF, SO_RCVBUF}) {
    int got = 0;
    socklen_t len = sizeof(got);
    if (::setsockopt(probe.get(), SOL_SOCKET, option, &requested, sizeof(requested)) != 0 ||
        ::getsockopt(probe.get(), SOL_SOCKET, option, &got, &len) != 0 ||
        int64_t{got} < 2 * int64_t{requested}) {
      return 0;
    }
  }
  return requested;
}

namespace {

// A connection the listener accepted, reading its hello (at most until `bound`).
struct PendingHello {
  Fd fd;
  Clock::time_point bound;
  std::array<uint8_t, kFrameHeaderBytes + kHelloBytes> buf{};
  size_t got = 0;
};

// A whole, valid hello: its connection, who sent it and for which direction.
struct Hello {
  Fd fd;
  int from = -1;
  int dir = -1;
};

// Reads what `p` has sent without waiting: the hello once it is whole and valid, nullopt
// while more is to come. Throws Corruption saying why the connection is refused (the header
// is checked, token first, before its payload is read).
std::optional<Hello> readHello(PendingHello& p, uint64_t nonce, int64_t epoch, int rank, int size,
                               bool pairs, const std::vector<int>& send,
                               const std::vector<int>& recv) {
  auto fill = [&](size_t want) {
    while (p.got < want) {
      const ssize_t rv = ::recv(p.fd.get(), p.buf.data() + p.got, want - p.got, MSG_DONTWAIT);
      if (rv > 0) {
        p.got += static_cast<size_t>(rv);
      } else if (rv == 0) {
        SINEW_THROW(Corruption, "no hello: connection closed");
      } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
        return false;
      } else if (errno != EINTR) {
        SINEW_THROW(Corruption, "no hello: ", errnoText("recv"));
      }
    }
    return true;
  };
  if (!fill(kFrameHeaderBytes)) return std::nullopt;
  FrameHeader h = transport::parseFrameHeader(p.buf.data(), laneRules(nonce));
  if (h.type != kHello || h.length != kHelloBytes || h.epoch != epoch) {
    SINEW_THROW(Corruption, "expected a hello of epoch ", epoch, " with ", kHelloBytes,
                " payload bytes, got ", laneFrameTypeName(h.type), " of epoch ", h.epoch, " with ",
                h.length);
  }
  if (!fill(p.buf.size())) return std::nullopt;
  const uint64_t r = ::sinew::detail::loadLe(p.buf.data() + kFrameHeaderBytes, 8);
  const uint64_t d = ::sinew::detail::loadLe(p.buf.data() + kFrameHeaderBytes + 8, 8);
  if (r <= uint64_t(rank) || r >= uint64_t(size) || (pairs ? d != kPairDirection : d > 1)) {
    SINEW_THROW(Corruption, "hello from rank ", r, " for direction ", d,
                ", which may not connect here");
  }
  Hello hello;
  hello.from = static_cast<int>(r);
  hello.dir = static_cast<int>(d);
  // The connector sends on its direction 0, so this rank receives on it; a pair's connection
  // is kept in `send`.
  if ((hello.dir == 0 ? recv : send)[hello.from] >= 0) {
    SINEW_THROW(Corruption, "a second hello from rank ", hello.from, " for direction ", hello.dir);
  }
  hello.fd = std::move(p.fd);
  return hello;
}

}  // namespace

// What the steps of the set-up share.
struct Lanes::SetUp {
  Store& store;
  int rank;
  int size;
  int64_t epoch;
  Clock::time_point deadline;
  const std::string& describe;
  const std::function<int(int)>& workerOf;
  int buffers;     // socket buffer bytes (0: the kernel's autotuning)
  uint64_t nonce;  // this rank's, as published
  bool pairs;      // Purpose::kGlooPairs
  std::function<void()> tick;

  std::string key(int r) const { return entryKey(pairs, r); }
  std::string peerName(int r) const {
    std::ostringstream os;
    os << describe << ": " << (pairs ? "Gloo pair connection" : "lane") << " to worker "
       << workerOf(r) << " (rank " << r << ")";
    return os.str();
  }
  std::chrono::milliseconds left() const {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
  }
};

Lanes::Lanes(Store& store, int rank, int size, const std::string& host, int64_t epoch,
             Clock::time_point deadline, const std::string& describe,
             const std::function<int(int)>& workerOf, const std::function<bool()>& cancelled,
             int socketBufferBytes, Purpose purpose, const std::vector<std::pair<int, int>>& kept)
    : purpose_(purpose), send_(size, -1), recv_(size, -1), peerNonce_(size, 0) {
  const bool pairs = purpose == Purpose::kGlooPairs;
  const int buffers = usableSocketBufferBytes(socketBufferBytes);
  for (size_t r = 0; r < kept.size() && r < static_cast<size_t>(size); ++r) {
    send_[r] = kept[r].first;
    recv_[r] = pairs ? -1 : kept[r].second;
  }
  try {
    wake_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_ < 0) SINEW_THROW(IoError, describe, ": lanes: ", errnoText("eventfd"));
    bool needed = false;  // Whether any connection is to be made.
    for (int r = 0; r < size; ++r) needed = needed || (r != rank && !connected(r));
    if (!needed) return;

    // 1. Listen and publish.
    Resolved self = resolve(host, 0, describe + ": lanes");
    Fd listener(::socket(self.family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (listener.get() < 0) SINEW_THROW(IoError, describe, ": lanes: ", errnoText("socket"));
    sizeBuffers(listener.get(), buffers, describe + ": lanes");
    if (::bind(listener.get(), reinterpret_cast<sockaddr*>(&self.addr), self.len) != 0 ||
        ::listen(listener.get(), SOMAXCONN) != 0) {
      SINEW_THROW(IoError, describe, ": lanes: cannot listen on ", host, ": ",
                  errnoText("bind/listen"));
    }
    sockaddr_storage bound{};
    socklen_t boundLen = sizeof(bound);
    char numeric[NI_MAXHOST];
    if (::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&bound), &boundLen) != 0 ||
        ::getnameinfo(reinterpret_cast<sockaddr*>(&bound), boundLen, numeric, sizeof(numeric),
                      nullptr, 0, NI_NUMERICHOST) != 0) {
      SINEW_THROW(IoError, describe, ": lanes: cannot read the address bound on ", host);
    }
    // The bound address, not the name: a peer resolving the name on its own host could get
    // another address.
    const uint64_t nonce = drawNonce();
    nonce_ = nonce;
    const std::string ownKey = entryKey(pairs, rank);
    std::string entry =
        std::string(numeric) + " " + std::to_string(portOf(bound)) + " " + std::to_string(nonce);
    store.set(ownKey, Bytes(entry.begin(), entry.end()));
    // Between the slices of every wait: give up when the owner has failed (a watcher saw the
    // peer die), and let a store that gives up when its epoch is over do so (its wait checks).
    const SetUp setUp{
        store, rank, size, epoch, deadline, describe, workerOf, buffers, nonce, pairs, [&] {
          if (cancelled && cancelled()) {
            SINEW_THROW(Aborted, describe, ": lane set-up given up: the communicator failed");
          }
          store.wait({ownKey}, std::chrono::milliseconds(1));
        }};
    connectLower(setUp);
    acceptHigher(setUp, listener.get());
  } catch (...) {
    closeAll();
    throw;
  }
}

// 2. Connect to every lower rank (they accept in step 3 of their own set-up; the kernel
//    completes the connection before that, and the welcome waits for it).
void Lanes::connectLower(const SetUp& setUp) {
  for (int q = 0; q < setUp.rank; ++q) {
    if (connected(q)) continue;  // Kept from the communicator before.
    const std::string what = setUp.peerName(q);
    const std::string key = setUp.key(q);
    for (;;) {
      try {
        setUp.store.wait({key}, std::min<std::chrono::milliseconds>(setUp.left(), kSlice));
        break;
      } catch (const Timeout&) {
        if (Clock::now() >= setUp.deadline) {
          SINEW_THROW(Timeout, what, ": the member did not publish its lane in time");
        }
      }
      setUp.tick();
    }
    Bytes raw = setUp.store.get(key, setUp.left());
    Entry e = parseEntry(raw, what);
    peerNonce_[q] = e.nonce;
    Resolved addr = resolve(e.host, e.port, what);
    // 0: this rank sends on it, 1: it receives; a pair's one connection is kPairDirection.
    const int first = setUp.pairs ? int(kPairDirection) : 0;
    const int last = setUp.pairs ? int(kPairDirection) : 1;
    for (int dir = first; dir <= last; ++dir) {
      Fd s(::socket(addr.family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
      if (s.get() < 0) SINEW_THROW(IoError, what, ": ", errnoText("socket"));
      sizeBuffers(s.get(), setUp.buffers, what);
      if (::connect(s.get(), reinterpret_cast<sockaddr*>(&addr.addr), addr.len) != 0 &&
          errno != EINPROGRESS) {
        SINEW_THROW(IoError, what, ": connecting to ", e.host, ":", e.port, ": ",
                    errnoText("connect"));
      }
      if (!waitFor(s.get(), POLLOUT, setUp.deadline, setUp.tick)) {
        SINEW_THROW(Timeout, what, ": connecting to ", e.host, ":", e.port, " timed out");
      }
      int soerr = 0;
      socklen_t soerrLen = sizeof(soerr);
      ::getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &soerr, &soerrLen);
      if (soerr != 0) {
        SINEW_THROW(IoError, what, ": connecting to ", e.host, ":", e.port, ": ",
                    std::strerror(soerr));
      }
      setNoDelay(s.get());
      uint8_t payload[kHelloBytes];
      ::sinew::detail::storeLe(payload, static_cast<uint64_t>(setUp.rank), 8);
      ::sinew::detail::storeLe(payload + 8, static_cast<uint64_t>(dir), 8);
      sendFrame(s.get(), kHello, e.nonce, setUp.epoch, payload, kHelloBytes, setUp.deadline, what,
                setUp.tick);
      uint8_t answer[kFrameHeaderBytes];
      std::string err = readAll(s.get(), answer, sizeof(answer), setUp.deadline, setUp.tick);
      if (!err.empty()) SINEW_THROW(IoError, what, ": waiting for its welcome: ", err);
      FrameHeader h = transport::parseFrameHeader(answer, laneRules(setUp.nonce));
      if (h.type != kWelcome || h.epoch != setUp.epoch) {
        SINEW_THROW(Corruption, what, ": expected a welcome of epoch ", setUp.epoch, ", got ",
                    laneFrameTypeName(h.type), " of epoch ", h.epoch);
      }
      (dir == 1 ? recv_ : send_)[q] = s.release();
      ::sinew::collectives::gloo_backend::countConnectionsMade(1);
    }
  }
}

// 3. Accept every higher rank. The hellos are read side by side, each within
//    kHandshakeBound, so a stranger that connects and stays silent costs the others nothing;
//    at most kMaxPendingHellos wait at once (a new connection evicts the oldest). A connection
//    that is not a valid hello is closed.
void Lanes::acceptHigher(const SetUp& setUp, int listener) {
  std::vector<PendingHello> pending;
  int missing = 0;
  for (int r = setUp.rank + 1; r < setUp.size; ++r) {
    if (!connected(r)) missing += setUp.pairs ? 1 : 2;
  }
  std::string lastRefusal;
  // Reads what `p` sent (when `readable`) and welcomes a whole, valid hello. Returns whether
  // `p` still waits for its hello; false once it was welcomed or refused (and closed).
  auto progress = [&](PendingHello& p, bool readable) {
    try {
      std::optional<Hello> hello;
      if (readable) {
        hello = readHello(p, setUp.nonce, setUp.epoch, setUp.rank, setUp.size, setUp.pairs, send_,
                          recv_);
      }
      if (!hello) {
        if (Clock::now() < p.bound) return true;
        SINEW_THROW(Corruption, "no hello within ", kHandshakeBound.count(), " ms");
      }
      const std::string what = setUp.peerName(hello->from);
      Entry e = parseEntry(setUp.store.get(setUp.key(hello->from), setUp.left()), what);
      peerNonce_[hello->from] = e.nonce;
      sendFrame(hello->fd.get(), kWelcome, e.nonce, setUp.epoch, nullptr, 0, setUp.deadline, what,
                setUp.tick);
      setNoDelay(hello->fd.get());
      // The connector sends on its direction 0, so this rank receives on it.
      (hello->dir == 0 ? recv_ : send_)[hello->from] = hello->fd.release();
      ::sinew::collectives::gloo_backend::countConnectionsMade(1);
      missing--;
    } catch (const Corruption& c) {
      lastRefusal = c.what();
    }
    return false;
  };
  while (missing > 0) {
    if (Clock::now() >= setUp.deadline) {
      std::ostringstream os;
      os << setUp.describe << (setUp.pairs ? ": Gloo pairs" : ": lanes") << ": workers";
      for (int r = setUp.rank + 1; r < setUp.size; ++r) {
        if (!connected(r)) os << " " << setUp.workerOf(r);
      }
      os << " did not connect in time";
      if (!lastRefusal.empty()) os << " (last refused connection: " << lastRefusal << ")";
      SINEW_THROW(Timeout, os.str());
    }
    std::vector<pollfd> fds{{listener, POLLIN, 0}};
    Clock::time_point wake = std::min(setUp.deadline, Clock::now() + kSlice);
    for (const PendingHello& p : pending) {
      fds.push_back({p.fd.get(), POLLIN, 0});
      wake = std::min(wake, p.bound);
    }
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(wake - Clock::now());
    if (::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(0, ms.count() + 1))) <
            0 &&
        errno != EINTR) {
      SINEW_THROW(IoError, setUp.describe, ": lanes: ", errnoText("poll"));
    }
    setUp.tick();
    std::vector<PendingHello> kept;
    for (size_t i = 0; i < pending.size(); ++i) {
      if (progress(pending[i], fds[i + 1].revents != 0)) kept.push_back(std::move(pending[i]));
    }
    pending = std::move(kept);
    if ((fds[0].revents & POLLIN) == 0) continue;
    for (;;) {  // everything queued on the listener
      PendingHello p;
      p.fd = Fd(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (p.fd.get() < 0) {
        // Nothing (more) to take, or a connection reset before we took it; anything else
        // (out of descriptors) would come back at once and spin until the deadline.
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNABORTED ||
            errno == EPROTO) {
          break;
        }
        SINEW_THROW(IoError, setUp.describe, ": lanes: ", errnoText("accept"));
      }
      p.bound = std::min(setUp.deadline, Clock::now() + kHandshakeBound);
      // A member's hello is there with its connection: served at once, it waits behind no one.
      if (!progress(p, true)) continue;
      if (pending.size() >= kMaxPendingHellos) {
        lastRefusal = "evicted by a newer connection: " + std::to_string(pending.size()) +
                      " connections had not sent their hello";
        pending.erase(pending.begin());
      }
      pending.push_back(std::move(p));
    }
  }
}

Lanes::~Lanes() { closeAll(); }

bool Lanes::connected(int peer) const {
  return send_[peer] >= 0 && (purpose_ == Purpose::kGlooPairs || recv_[peer] >= 0);
}

void Lanes::closeAll() {
  for (auto* fds : {&send_, &recv_}) {
    for (int& fd : *fds) {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
  }
  if (wake_ >= 0) ::close(wake_);
  wake_ = -1;
}

void Lanes::wake() {
  uint64_t one = 1;
  ssize_t rv = ::write(wake_, &one, sizeof(one));
  (void)rv;  // EAGAIN: the counter is already non-zero, i.e. already woken.
}

}  // namespace collectives
}  // namespace sinew
