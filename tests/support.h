#pragma once

// Helpers shared by tests that talk to Sinew's servers: a log sink for the reasons a server
// gives, a deadline-bounded wait on a condition, and raw loopback sockets for sending bytes
// that no Sinew client would send.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "sinew/collectives/tcp_store.h"
#include "sinew/collectives/transport/frame.h"

namespace sinew {
namespace testing {

// The job token of test servers and clients.
constexpr uint64_t kTestToken = 0x5133d00dfeedf00dull;

inline collectives::TcpStoreServerOptions serverOptions() {
  collectives::TcpStoreServerOptions o;
  o.token = kTestToken;
  return o;
}

inline collectives::TcpStoreOptions storeOptions() {
  collectives::TcpStoreOptions o;
  o.token = kTestToken;
  return o;
}

// A raw frame of Sinew's transport: header (with any field overridden) and payload.
struct RawFrame {
  uint8_t service = 1;
  uint8_t type = 1;
  uint64_t token = kTestToken;
  int64_t epoch = 0;
  std::vector<uint8_t> payload;
  // Overrides of header fields (for malformed frames); -1: derived.
  int64_t length = -1;
  int64_t magic = -1;
  int version = -1;
  int flags = 0;
};

inline std::vector<uint8_t> rawFrame(const RawFrame& f) {
  collectives::transport::FrameHeader h;
  h.service = static_cast<collectives::transport::Service>(f.service);
  h.type = f.type;
  h.length = static_cast<uint32_t>(f.length >= 0 ? f.length : int64_t(f.payload.size()));
  h.token = f.token;
  h.epoch = f.epoch;
  std::vector<uint8_t> b(collectives::transport::kFrameHeaderBytes);
  collectives::transport::encodeFrameHeader(h, b.data());
  b[5] = f.service;  // encodeFrameHeader takes a known service; tests may send any byte.
  if (f.magic >= 0) {
    for (int i = 0; i < 4; ++i) b[i] = static_cast<uint8_t>(uint64_t(f.magic) >> (8 * i));
  }
  if (f.version >= 0) b[4] = static_cast<uint8_t>(f.version);
  b[7] = static_cast<uint8_t>(f.flags);
  b.insert(b.end(), f.payload.begin(), f.payload.end());
  return b;
}

// Collects log lines (a server's `log` option) so tests can check a logged reason.
struct LogSink {
  std::mutex mu;
  std::vector<std::string> lines;
  std::function<void(const std::string&)> fn() {
    return [this](const std::string& l) {
      std::lock_guard<std::mutex> lock(mu);
      lines.push_back(l);
    };
  }
  bool contains(const std::string& s) {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& l : lines) {
      if (l.find(s) != std::string::npos) return true;
    }
    return false;
  }
};

// Polls cond every millisecond until it holds or the timeout passes (no fixed sleeps).
inline bool eventually(const std::function<bool()>& cond,
                       std::chrono::milliseconds timeout = std::chrono::seconds(5)) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (cond()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return cond();
}

// A TCP connection to 127.0.0.1:port, or -1.
inline int connectLoopback(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Whether the peer closed fd within the timeout (a read returns 0 or an error).
inline bool closedByPeer(int fd, std::chrono::milliseconds timeout) {
  timeval tv{};
  tv.tv_sec = timeout.count() / 1000;
  tv.tv_usec = (timeout.count() % 1000) * 1000;
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  char buf[4096];
  while (true) {
    ssize_t r = ::read(fd, buf, sizeof(buf));
    if (r == 0) return true;
    if (r < 0) return errno != EAGAIN && errno != EWOULDBLOCK;
  }
}

}  // namespace testing
}  // namespace sinew
