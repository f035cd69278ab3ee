#pragma once

// The HTTP server of the control API (docs/control_api.md), on Boost.Beast, run by the
// coordinator on its io_context. It checks each request's bearer token from the headers
// before reading a body, bounds the headers (8 KiB) and the body (64 KiB by default), gives
// each request a deadline (a slow-drip client is cut off) and closes keep-alive connections
// idle that long, and refuses connections beyond a cap with 503. GET /v1/events streams the
// coordinator's events as server-sent events.
//
// Internal to sinew_runtime. Thread safety: constructed and closed on the io thread, or
// before the io thread runs; everything else runs on the io thread.

#include <boost/asio/io_context.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "sinew/runtime/control_api.h"

namespace sinew {
namespace runtime {

// The coordinator's event stream, for /v1/events.
class EventFeed {
 public:
  virtual ~EventFeed() = default;
  using Sink = std::function<void(int64_t seq, const nlohmann::json& event)>;
  // Calls sink, on the io thread, with every retained event whose sequence number is above
  // `after`, then with each new one; returns an id for unsubscribe.
  virtual int subscribe(Sink sink, int64_t after) = 0;
  virtual void unsubscribe(int id) = 0;
};

struct ControlServerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  // The bearer token every request must carry: `token` for anything, `readToken` (if set)
  // for GET only; another method with the read token is 403, before any body is read.
  std::string token;
  std::string readToken;
  // A request's headers and body must arrive within this; a keep-alive connection idle this
  // long is closed; an event stream whose client reads nothing for this long is dropped.
  std::chrono::milliseconds requestTimeout{10000};
  // Connections whose requests showed a token (either): more are answered 503.
  size_t maxConnections = 128;
  // Connections that have not yet sent a request with a token: at most maxPending, and
  // maxPendingPerPeer from one address; a new one beyond either evicts the oldest of its own
  // address (per address) or of the address with the most (the pool's). The first request
  // must arrive within authTimeout (or requestTimeout if shorter), else 408. So a flood of
  // idle or slow connections never takes a slot from sinewctl or a scheduler.
  size_t maxPending = 256;
  size_t maxPendingPerPeer = 32;
  std::chrono::milliseconds authTimeout{2000};
  size_t maxBodyBytes = control::kDefaultMaxBodyBytes;
  size_t maxEventStreams = 16;
  std::function<void(const std::string&)> log;
};

class ControlServer {
 public:
  // Listens at once; throws IoError naming the address if it cannot. backend and feed must
  // outlive every call the io thread makes before close().
  ControlServer(boost::asio::io_context& io, ControlServerOptions options,
                control::Backend* backend, EventFeed* feed);
  ~ControlServer();
  ControlServer(const ControlServer&) = delete;
  ControlServer& operator=(const ControlServer&) = delete;

  uint16_t port() const;
  // Stops accepting and closes every connection; no call reaches backend or feed after it.
  void close();

  struct Shared;

 private:
  std::shared_ptr<Shared> shared_;
};

}  // namespace runtime
}  // namespace sinew
