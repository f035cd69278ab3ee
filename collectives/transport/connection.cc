#include "sinew/collectives/transport/connection.h"

#include <poll.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>

#include <array>
#include <thread>

#include "sinew/base/error.h"
#include "sinew/collectives/transport/channel.h"

namespace sinew {
namespace collectives {
namespace transport {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

Connection::Connection(FrameRules rules, std::string name)
    : rules_(rules), name_(std::move(name)), socket_(io_) {}

Connection::~Connection() = default;

bool Connection::isOpen() const { return socket_.is_open(); }

void Connection::close() {
  error_code ignored;
  socket_.close(ignored);
}

bool Connection::peerClosedWhileIdle() {
  if (!socket_.is_open()) return false;
  pollfd p{socket_.native_handle(), POLLIN | POLLRDHUP, 0};
  return ::poll(&p, 1, 0) > 0;
}

void Connection::fail(const char* doing, const error_code& ec) {
  close();
  if (ec == asio::error::timed_out) {
    SINEW_THROW(Timeout, name_, ": deadline passed while ", doing);
  }
  SINEW_THROW(IoError, name_, ": connection failed while ", doing, ": ", ec.message());
}

namespace {

// Runs io until `result` is set or the deadline passes; at the deadline closes the socket
// (cancelling the operation) and returns timed_out.
template <typename Start>
error_code runSocketUntil(asio::io_context& io, tcp::socket& socket,
                          Connection::Clock::time_point deadline, Start start) {
  error_code result = asio::error::would_block;
  start(result);
  io.restart();
  io.run_until(deadline);
  if (!io.stopped()) {
    error_code ignored;
    socket.close(ignored);
    io.run();
    return asio::error::timed_out;
  }
  return result;
}

}  // namespace

void connectSocket(asio::io_context& io, tcp::socket& socket, const std::string& host,
                   uint16_t port, Connection::Clock::time_point deadline,
                   const std::string& peerName) {
  using Clock = Connection::Clock;
  auto backoff = std::chrono::milliseconds(5);
  std::string lastError = "no attempt made";
  while (true) {
    error_code ec;
    tcp::resolver resolver(io);
    auto endpoints = resolver.resolve(host, std::to_string(port), ec);
    if (!ec) {
      auto attemptDeadline = std::min(deadline, Clock::now() + std::chrono::seconds(2));
      ec = runSocketUntil(io, socket, attemptDeadline, [&](error_code& result) {
        asio::async_connect(socket, endpoints,
                            [&result](error_code e, const tcp::endpoint&) { result = e; });
      });
      if (!ec) {
        error_code ignored;
        socket.set_option(tcp::no_delay(true), ignored);
        setCloseOnExec(socket.native_handle());
        io.restart();  // Ran out of work; the caller may run it again.
        return;
      }
      error_code ignored;
      socket.close(ignored);
    }
    lastError = ec.message();
    auto now = Clock::now();
    if (now >= deadline) break;
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(200));
  }
  SINEW_THROW(Timeout, "cannot reach ", peerName, " (", host, ":", port,
              ") by the deadline: ", lastError);
}

template <typename Start>
error_code Connection::runUntil(Clock::time_point deadline, Start start) {
  return runSocketUntil(io_, socket_, deadline, start);
}

void Connection::connect(const std::string& host, uint16_t port, Clock::time_point deadline) {
  close();
  connectSocket(io_, socket_, host, port, deadline, name_);
}

void Connection::send(uint8_t type, int64_t epoch, const std::vector<Part>& parts,
                      Clock::time_point deadline) {
  if (!socket_.is_open()) SINEW_THROW(IoError, name_, ": not connected");
  uint64_t total = 0;
  for (const auto& p : parts) total += p.size;
  SINEW_ENFORCE(total <= UINT32_MAX, "frame payload of ", total, " bytes");
  FrameHeader h;
  h.service = rules_.service;
  h.type = type;
  h.length = static_cast<uint32_t>(total);
  h.token = rules_.token;
  h.epoch = epoch;
  std::array<uint8_t, kFrameHeaderBytes> header{};
  encodeFrameHeader(h, header.data());
  std::vector<asio::const_buffer> bufs;
  bufs.reserve(parts.size() + 1);
  bufs.push_back(asio::buffer(header));
  for (const auto& p : parts) bufs.push_back(asio::buffer(p.data, p.size));
  error_code ec = runUntil(deadline, [&](error_code& result) {
    asio::async_write(socket_, bufs, [&result](error_code e, size_t) { result = e; });
  });
  if (ec) fail(("sending a " + frameName(rules_, type) + " message").c_str(), ec);
}

FrameHeader Connection::readHeader(Clock::time_point deadline) {
  if (!socket_.is_open()) SINEW_THROW(IoError, name_, ": not connected");
  std::array<uint8_t, kFrameHeaderBytes> header{};
  error_code ec = runUntil(deadline, [&](error_code& result) {
    asio::async_read(socket_, asio::buffer(header),
                     [&result](error_code e, size_t) { result = e; });
  });
  if (ec) fail("awaiting an answer", ec);
  try {
    return parseFrameHeader(header.data(), rules_);
  } catch (const Corruption& e) {
    close();
    SINEW_THROW(Corruption, name_, " answered with a bad frame: ", e.what());
  }
}

void Connection::readInto(uint8_t* dst, size_t n, Clock::time_point deadline) {
  if (n == 0) return;
  error_code ec = runUntil(deadline, [&](error_code& result) {
    asio::async_read(socket_, asio::buffer(dst, n),
                     [&result](error_code e, size_t) { result = e; });
  });
  if (ec) fail("reading an answer", ec);
}

std::vector<uint8_t> Connection::readPayload(const FrameHeader& h, Clock::time_point deadline) {
  std::vector<uint8_t> out(h.length);
  readInto(out.data(), out.size(), deadline);
  return out;
}

}  // namespace transport
}  // namespace collectives
}  // namespace sinew
