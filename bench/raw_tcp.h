#pragma once

// The benches' raw loopback TCP baseline: the same bytes a Sinew transfer moves, moved over one
// plain socket between this process and a forked child, with nothing of Sinew in the way.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <vector>

namespace sinew_bench {

inline void writeAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w <= 0) throw std::runtime_error("write failed");
    p += w;
    n -= static_cast<size_t>(w);
  }
}

inline void readAll(int fd, char* p, size_t n) {
  while (n > 0) {
    ssize_t r = ::read(fd, p, n);
    if (r <= 0) throw std::runtime_error("read failed");
    p += r;
    n -= static_cast<size_t>(r);
  }
}

// A listening socket on an ephemeral loopback port, whose address goes to `addr`.
inline int listenOnLoopback(sockaddr_in* addr) {
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  addr->sin_family = AF_INET;
  addr->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr->sin_port = 0;
  socklen_t len = sizeof *addr;
  if (listener < 0 || ::bind(listener, reinterpret_cast<sockaddr*>(addr), sizeof *addr) != 0 ||
      ::listen(listener, 1) != 0 ||
      ::getsockname(listener, reinterpret_cast<sockaddr*>(addr), &len) != 0) {
    throw std::runtime_error("cannot listen on loopback");
  }
  return listener;
}

// A connection to `addr` with Nagle off, for a forked child; exits the child if it fails.
inline int connectOrExit(const sockaddr_in& addr) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0 || ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) _exit(1);
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

// The next connection on `listener`, with Nagle off.
inline int acceptNoDelay(int listener) {
  int fd = ::accept(listener, nullptr, nullptr);
  if (fd < 0) throw std::runtime_error("accept failed");
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return fd;
}

inline double medianOf(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median seconds of one transfer (half a round trip) of `bytes` between this process and a
// forked child over a loopback TCP socket, over `rounds` rounds after two untimed ones.
// `beforeRounds`, if given, runs once the two are connected, before the first round.
inline double rawTcpSeconds(int64_t bytes, int rounds,
                            const std::function<void()>& beforeRounds = {}) {
  sockaddr_in addr{};
  int listener = listenOnLoopback(&addr);
  std::vector<char> buf(static_cast<size_t>(bytes));
  pid_t pid = ::fork();
  if (pid == 0) {
    int fd = connectOrExit(addr);
    try {
      for (int i = 0; i < rounds + 2; ++i) {
        readAll(fd, buf.data(), buf.size());
        writeAll(fd, buf.data(), buf.size());
      }
    } catch (const std::exception&) {
      _exit(1);
    }
    _exit(0);
  }
  int fd = acceptNoDelay(listener);
  if (beforeRounds) beforeRounds();
  std::vector<double> s;
  for (int i = 0; i < rounds + 2; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    writeAll(fd, buf.data(), buf.size());
    readAll(fd, buf.data(), buf.size());
    if (i >= 2) {
      s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 2);
    }
  }
  ::close(fd);
  ::close(listener);
  int st = 0;
  ::waitpid(pid, &st, 0);
  return medianOf(s);
}

// Median seconds, over `connections` connections, of the first transfer of `bytes` on a
// freshly made loopback TCP connection: this process writes them, a forked child reads them
// into a buffer it has already written (as a layer copy's receiver zero-fills its tensors) and
// answers one byte, which ends the time. A reconfiguration's copies are the first bulk transfer
// on the new epoch's connections, whose kernel buffers have not grown yet (on this machine such
// a first transfer took 18-42% longer than the same bytes on a connection that has carried
// them before, which is what rawTcpSeconds measures).
inline double rawTcpFreshSeconds(int64_t bytes, int connections) {
  std::vector<char> buf(static_cast<size_t>(bytes), 1);
  std::vector<double> s;
  for (int i = 0; i < connections; ++i) {
    sockaddr_in addr{};
    int listener = listenOnLoopback(&addr);
    pid_t pid = ::fork();
    if (pid == 0) {
      // Its own buffer, written before it connects: reading into the parent's would copy each
      // page on write inside the timed transfer.
      std::vector<char> in(static_cast<size_t>(bytes), 0);
      int fd = connectOrExit(addr);
      try {
        readAll(fd, in.data(), in.size());
        writeAll(fd, in.data(), 1);
      } catch (const std::exception&) {
        _exit(1);
      }
      _exit(0);
    }
    int fd = acceptNoDelay(listener);
    char ack = 0;
    auto t0 = std::chrono::steady_clock::now();
    writeAll(fd, buf.data(), buf.size());
    readAll(fd, &ack, 1);
    s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    ::close(fd);
    ::close(listener);
    int st = 0;
    ::waitpid(pid, &st, 0);
  }
  return medianOf(s);
}

}  // namespace sinew_bench
