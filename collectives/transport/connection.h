#pragma once

// The blocking half of Sinew's one transport (docs/transport.md): a client Connection that
// sends and receives frames against deadlines. The store client and the replica client use
// it; the frame format and checks are those of frame.h, in both directions (a server's
// answer must carry the job token too).
//
// Every operation takes a deadline; an operation still pending at it is cancelled by closing
// the socket and throws Timeout. A broken connection throws IoError; a bad header from the
// peer throws Corruption. After any throw the connection is closed; connect() opens it again.
//
// Thread safety: not thread-safe; one owner (callers serialize).

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "sinew/collectives/transport/frame.h"

namespace sinew {
namespace collectives {
namespace transport {

// Connects `socket` (on `io`, which no other thread may be running) to host:port,
// retrying with backoff until the deadline; each attempt is bounded too. The socket ends
// up close-on-exec with TCP_NODELAY. Throws Timeout naming `peerName` and the last error.
void connectSocket(boost::asio::io_context& io, boost::asio::ip::tcp::socket& socket,
                   const std::string& host, uint16_t port,
                   std::chrono::steady_clock::time_point deadline, const std::string& peerName);

class Connection {
 public:
  using Clock = std::chrono::steady_clock;

  // rules: what the peer's frames must be (its service, the job token, its types).
  // name: how errors name the peer, e.g. "tcp store at 127.0.0.1:4000".
  Connection(FrameRules rules, std::string name);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  // Connects to host:port, retrying with backoff (the server may start later) until the
  // deadline; each attempt is bounded too. Throws Timeout with the last error.
  void connect(const std::string& host, uint16_t port, Clock::time_point deadline);
  bool isOpen() const;
  // True when an open connection was closed by the peer (or has unsolicited bytes) while
  // no request was in flight, e.g. a server's idle timeout: reconnect before using it.
  bool peerClosedWhileIdle();
  void close();

  // Sends one frame whose payload is the concatenation of `parts` (no copies).
  struct Part {
    const uint8_t* data;
    size_t size;
  };
  void send(uint8_t type, int64_t epoch, const std::vector<Part>& parts,
            Clock::time_point deadline);
  void send(uint8_t type, int64_t epoch, const std::vector<uint8_t>& payload,
            Clock::time_point deadline) {
    send(type, epoch, {Part{payload.data(), payload.size()}}, deadline);
  }

  // Reads and checks the next header.
  FrameHeader readHeader(Clock::time_point deadline);
  // Reads n payload bytes into dst.
  void readInto(uint8_t* dst, size_t n, Clock::time_point deadline);
  // Reads the payload of h into a new buffer.
  std::vector<uint8_t> readPayload(const FrameHeader& h, Clock::time_point deadline);

  const std::string& name() const { return name_; }
  const FrameRules& rules() const { return rules_; }

 private:
  template <typename Start>
  boost::system::error_code runUntil(Clock::time_point deadline, Start start);
  [[noreturn]] void fail(const char* doing, const boost::system::error_code& ec);

  const FrameRules rules_;
  const std::string name_;
  boost::asio::io_context io_;
  boost::asio::ip::tcp::socket socket_;
};

}  // namespace transport
}  // namespace collectives
}  // namespace sinew
