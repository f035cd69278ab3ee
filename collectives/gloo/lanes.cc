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

#include <cerrno>
#include <cstring>
#include <random>
#include <sstream>

#include "sinew/collectives/detail/little_endian.h"
#include "sinew/collectives/error.h"
#include "sinew/collectives/transport/frame.h"

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
// A connection must complete its hello within this (bounded by the overall deadline), so a
// stranger that connects and stays silent delays the set-up by at most this much.
constexpr std::chrono::milliseconds kHandshakeBound{2000};

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

// Waits until fd has one of `events`; false at the deadline.
bool waitFor(int fd, short events, Clock::time_point deadline) {
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, events, 0};
    int rv = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left.count() + 1, 1000)));
    if (rv > 0) return true;
    if (rv < 0 && errno != EINTR) SINEW_THROW(IoError, errnoText("poll"));
  }
}

// Reads or writes exactly n bytes of a non-blocking socket before the deadline. Returns an
// empty string on success, else why not ("timed out", "connection closed", an errno text).
std::string readAll(int fd, void* data, size_t n, Clock::time_point deadline) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    ssize_t rv = ::recv(fd, p, n, MSG_DONTWAIT);
    if (rv > 0) {
      p += rv;
      n -= static_cast<size_t>(rv);
    } else if (rv == 0) {
      return "connection closed";
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!waitFor(fd, POLLIN, deadline)) return "timed out";
    } else if (errno != EINTR) {
      return errnoText("recv");
    }
  }
  return {};
}

std::string writeAll(int fd, const void* data, size_t n, Clock::time_point deadline) {
  auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    ssize_t rv = ::send(fd, p, n, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (rv >= 0) {
      p += rv;
      n -= static_cast<size_t>(rv);
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!waitFor(fd, POLLOUT, deadline)) return "timed out";
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
               Clock::time_point deadline, const std::string& what) {
  uint8_t buf[kFrameHeaderBytes + kHelloBytes];
  FrameHeader h;
  h.service = Service::kLane;
  h.type = type;
  h.length = n;
  h.token = token;
  h.epoch = epoch;
  transport::encodeFrameHeader(h, buf);
  if (n > 0) std::memcpy(buf + kFrameHeaderBytes, payload, n);
  std::string err = writeAll(fd, buf, kFrameHeaderBytes + n, deadline);
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

Lanes::Lanes(Store& store, int rank, int size, const std::string& host, int64_t epoch,
             Clock::time_point deadline, const std::string& describe,
             const std::function<int(int)>& workerOf)
    : send_(size, -1), recv_(size, -1) {
  auto peerName = [&](int r) {
    std::ostringstream os;
    os << describe << ": lane to worker " << workerOf(r) << " (rank " << r << ")";
    return os.str();
  };
  auto left = [&] {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()));
  };
  try {
    wake_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (wake_ < 0) SINEW_THROW(IoError, describe, ": lanes: ", errnoText("eventfd"));

    // 1. Listen and publish.
    Resolved self = resolve(host, 0, describe + ": lanes");
    Fd listener(::socket(self.family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    if (listener.get() < 0) SINEW_THROW(IoError, describe, ": lanes: ", errnoText("socket"));
    if (::bind(listener.get(), reinterpret_cast<sockaddr*>(&self.addr), self.len) != 0 ||
        ::listen(listener.get(), size) != 0) {
      SINEW_THROW(IoError, describe, ": lanes: cannot listen on ", host, ": ",
                  errnoText("bind/listen"));
    }
    sockaddr_storage bound{};
    socklen_t boundLen = sizeof(bound);
    ::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&bound), &boundLen);
    const uint64_t nonce = drawNonce();
    std::string entry = host + " " + std::to_string(portOf(bound)) + " " + std::to_string(nonce);
    store.set("lane/" + std::to_string(rank), Bytes(entry.begin(), entry.end()));

    // 2. Connect to every lower rank (they accept in step 3 of their own set-up; the kernel
    //    completes the connection before that, and the welcome waits for it).
    for (int q = 0; q < rank; ++q) {
      const std::string what = peerName(q);
      Bytes raw;
      try {
        raw = store.get("lane/" + std::to_string(q), left());
      } catch (const Timeout&) {
        SINEW_THROW(Timeout, what, ": the member did not publish its lane in time");
      }
      Entry e = parseEntry(raw, what);
      Resolved addr = resolve(e.host, e.port, what);
      for (int dir = 0; dir < 2; ++dir) {  // 0: this rank sends on it, 1: it receives
        Fd s(::socket(addr.family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
        if (s.get() < 0) SINEW_THROW(IoError, what, ": ", errnoText("socket"));
        if (::connect(s.get(), reinterpret_cast<sockaddr*>(&addr.addr), addr.len) != 0 &&
            errno != EINPROGRESS) {
          SINEW_THROW(IoError, what, ": connecting to ", e.host, ":", e.port, ": ",
                      errnoText("connect"));
        }
        if (!waitFor(s.get(), POLLOUT, deadline)) {
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
        ::sinew::detail::storeLe(payload, static_cast<uint64_t>(rank), 8);
        ::sinew::detail::storeLe(payload + 8, static_cast<uint64_t>(dir), 8);
        sendFrame(s.get(), kHello, e.nonce, epoch, payload, kHelloBytes, deadline, what);
        uint8_t answer[kFrameHeaderBytes];
        std::string err = readAll(s.get(), answer, sizeof(answer), deadline);
        if (!err.empty()) SINEW_THROW(IoError, what, ": waiting for its welcome: ", err);
        FrameHeader h = transport::parseFrameHeader(answer, laneRules(nonce));
        if (h.type != kWelcome || h.epoch != epoch) {
          SINEW_THROW(Corruption, what, ": expected a welcome of epoch ", epoch, ", got ",
                      laneFrameTypeName(h.type), " of epoch ", h.epoch);
        }
        (dir == 0 ? send_ : recv_)[q] = s.release();
      }
    }

    // 3. Accept every higher rank. A connection that is not a valid hello is closed.
    int missing = 2 * (size - 1 - rank);
    std::string lastRefusal;
    while (missing > 0) {
      if (!waitFor(listener.get(), POLLIN, deadline)) {
        std::ostringstream os;
        os << describe << ": lanes: workers";
        for (int r = rank + 1; r < size; ++r) {
          if (send_[r] < 0 || recv_[r] < 0) os << " " << workerOf(r);
        }
        os << " did not connect in time";
        if (!lastRefusal.empty()) os << " (last refused connection: " << lastRefusal << ")";
        SINEW_THROW(Timeout, os.str());
      }
      Fd s(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (s.get() < 0) continue;  // EAGAIN, or a connection reset before we took it.
      auto bound = std::min(deadline, Clock::now() + kHandshakeBound);
      uint8_t hello[kFrameHeaderBytes + kHelloBytes];
      std::string err = readAll(s.get(), hello, kFrameHeaderBytes, bound);
      if (!err.empty()) {
        lastRefusal = "no hello: " + err;
        continue;
      }
      int from = -1;
      int dir = -1;
      try {
        FrameHeader h = transport::parseFrameHeader(hello, laneRules(nonce));
        if (h.type != kHello || h.length != kHelloBytes || h.epoch != epoch) {
          SINEW_THROW(Corruption, "expected a hello of epoch ", epoch, " with ", kHelloBytes,
                      " payload bytes, got ", laneFrameTypeName(h.type), " of epoch ", h.epoch,
                      " with ", h.length);
        }
        err = readAll(s.get(), hello + kFrameHeaderBytes, kHelloBytes, bound);
        if (!err.empty()) SINEW_THROW(Corruption, "hello payload: ", err);
        const uint64_t r = ::sinew::detail::loadLe(hello + kFrameHeaderBytes, 8);
        const uint64_t d = ::sinew::detail::loadLe(hello + kFrameHeaderBytes + 8, 8);
        if (r <= uint64_t(rank) || r >= uint64_t(size) || d > 1) {
          SINEW_THROW(Corruption, "hello from rank ", r, " for direction ", d,
                      ", which may not connect here");
        }
        from = static_cast<int>(r);
        dir = static_cast<int>(d);
        // The connector sends on its direction 0, so this rank receives on it.
        if ((dir == 0 ? recv_ : send_)[from] >= 0) {
          SINEW_THROW(Corruption, "a second hello from rank ", from, " for direction ", dir);
        }
      } catch (const Corruption& c) {
        lastRefusal = c.what();
        continue;
      }
      const std::string what = peerName(from);
      Entry e = parseEntry(store.get("lane/" + std::to_string(from), left()), what);
      sendFrame(s.get(), kWelcome, e.nonce, epoch, nullptr, 0, deadline, what);
      setNoDelay(s.get());
      (dir == 0 ? recv_ : send_)[from] = s.release();
      missing--;
    }
  } catch (...) {
    closeAll();
    throw;
  }
}

Lanes::~Lanes() { closeAll(); }

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
