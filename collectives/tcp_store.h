#pragma once

// A Store served over TCP (Boost.Asio): one TcpStoreServer, any number of TcpStore clients
// in other processes. The wire format is in docs/store_protocol.md.
//
// Both speak Sinew's one framed transport (collectives/transport/, docs/transport.md).
// The server runs its own io_context thread. It is itself a Store, so the process that
// serves it can use it without a connection. It never trusts its peers: a connection that
// sends bytes that are not a request (a bad frame header or a wrong job token, checked
// before anything is allocated; a length over maxMessageBytes; a payload that does not
// parse; a second request before the first was answered; no request within idleTimeout;
// a payload that does not arrive within frameTimeout) is closed with a logged reason, and a
// client that dies in the middle of a request only loses its own connection. At most
// maxConnections are open at once. Other clients are unaffected.
//
// A client runs each request alone on a connection, against a deadline; threads requesting
// at once use a connection each (so a blocking get or wait never holds up another thread's
// requests), and up to four idle connections are kept for reuse. It connects lazily,
// retrying until connectTimeout, drops a connection whose request failed, and reconnects
// before a request when the server closed an idle connection.
//
// Thread safety: every method of both classes may be called from any thread.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "sinew/base/error.h"
#include "sinew/store.h"

namespace sinew {
namespace collectives {

struct TcpStoreServerOptions {
  // Address to listen on. Loopback by default; a multi-host job passes its interface.
  std::string host = "127.0.0.1";
  // 0 picks a free port; port() tells which.
  uint16_t port = 0;
  // The job token every request must carry; 0 draws a random one (token() tells which).
  uint64_t token = 0;
  // Largest request accepted; a longer one drops the connection.
  uint32_t maxMessageBytes = 64u << 20;
  // Authenticated connections beyond this many are closed; connections that have not shown
  // the token yet are at most maxPending (docs/transport.md, "Connection slots").
  size_t maxConnections = 1024;
  size_t maxPending = 1024;
  // A connection with no request in progress that sends no complete request for this long
  // is closed (clients reconnect transparently).
  std::chrono::milliseconds idleTimeout{120000};
  // A request's payload must arrive within this of its header.
  std::chrono::milliseconds frameTimeout{30000};
  // Where dropped-connection reasons go; by default one line on stderr.
  std::function<void(const std::string&)> log;
};

class TcpStoreServer : public Store {
 public:
  // Binds and starts serving. Throws IoError naming host:port if it cannot bind.
  explicit TcpStoreServer(TcpStoreServerOptions options);
  // Stops serving and closes every connection; blocked clients fail.
  ~TcpStoreServer() override;
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  uint16_t port() const { return port_; }
  const std::string& host() const { return options_.host; }
  uint64_t token() const { return token_; }
  // Connections closed because of a protocol violation (garbage, oversize, ...).
  int64_t droppedConnections() const { return dropped_.load(); }
  // Connections currently open.
  int64_t openConnections() const { return open_.load(); }

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool deleteKey(const std::string& key) override;
  using Store::get;
  using Store::wait;

 private:
  class Impl;
  const TcpStoreServerOptions options_;
  std::unique_ptr<Impl> impl_;
  uint16_t port_ = 0;
  uint64_t token_ = 0;
  std::atomic<int64_t> dropped_{0};
  std::atomic<int64_t> open_{0};
};

// TcpStoreOptions is public (sinew/store.h).
class TcpStore : public Store {
 public:
  // Does not connect yet; the first request does.
  TcpStore(std::string host, uint16_t port, TcpStoreOptions options);
  ~TcpStore() override;
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  // Every method throws Timeout when the server does not answer by the deadline and
  // IoError when the connection breaks; the next call reconnects.
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool deleteKey(const std::string& key) override;
  using Store::get;
  using Store::wait;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace collectives
}  // namespace sinew
