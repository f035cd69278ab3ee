#pragma once

// The asynchronous half of Sinew's one transport (docs/transport.md): a Channel is one
// framed connection on an Asio io_context; a Listener accepts connections on a port and
// makes each a Channel. Servers (the store, the coordinator, the replica service) and the
// coordinator client use them; blocking clients use Connection (connection.h).
//
// A Channel reads frames forever and hands each to its ChannelHandler. It checks every
// header against its FrameRules (token first) before anything is allocated for the payload,
// and it closes the connection, with a logged reason, on a bad header, a payload that does
// not arrive within frameTimeout of its header, or (when no request is in progress) no frame
// within idleTimeout. A bulk payload can be read straight into its destination
// (ChannelHandler::payloadSink) and sent straight from its source (sendRef): no copies.
//
// Thread safety: a Channel and a Listener are used on their io_context's thread only (other
// threads post() to it). Handlers are called on that thread.

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "sinew/collectives/transport/frame.h"

namespace sinew {
namespace collectives {
namespace transport {

using Bytes = std::vector<uint8_t>;

// At most one log line per key (a peer's address) per interval: a flood of bad connections
// from one host costs a line every interval, and the next line it admits says how many were
// withheld. Thread-safe; remembers at most 4,096 keys (then starts over).
class LogThrottle {
 public:
  explicit LogThrottle(std::chrono::milliseconds interval = std::chrono::seconds(10))
      : interval_(interval) {}
  // Whether to log a line about `key` now; if so, *withheld is how many lines about it were
  // not logged since its last logged one.
  bool admit(const std::string& key, int64_t* withheld);

 private:
  struct Entry {
    std::chrono::steady_clock::time_point last{};
    int64_t withheld = 0;
  };
  const std::chrono::milliseconds interval_;
  std::mutex mu_;
  std::map<std::string, Entry> entries_;
};

struct ChannelOptions {
  FrameRules rules;  // what incoming frames must be
  // Close the connection when no frame starts within this while no request is in progress
  // (Channel::setBusy); 0: never. A header that arrives byte by byte counts as no frame.
  std::chrono::milliseconds idleTimeout{0};
  // A frame's payload must arrive within this of its header.
  std::chrono::milliseconds frameTimeout{30000};
  // Where reasons for dropped connections go (stderr if empty).
  std::function<void(const std::string&)> log;
  // Prefix of log lines, e.g. "sinew tcp store 127.0.0.1:4000".
  std::string name = "sinew";
  // Lines about dropped connections go through it, keyed by the peer's address (a Listener
  // gives its channels one, of 10 s, unless set); null: every one is logged.
  std::shared_ptr<LogThrottle> dropLog;
  // The first frame's header (which carries the job token) must arrive within this of the
  // connection's start; 0: only idleTimeout applies (a Listener sets its own).
  std::chrono::milliseconds authTimeout{0};
};

enum class CloseReason {
  kPeerClosed,  // EOF or a reset: the peer went away
  kViolation,   // a bad header or payload, or a handler threw Corruption
  kTimeout,     // idle or frame timeout
  kLocal,       // close() by the owner
};

class Channel;

class ChannelHandler {
 public:
  virtual ~ChannelHandler() = default;
  // Where to read the payload of h: a buffer of h.length bytes that stays valid until
  // onFrame, or null to read into a Bytes handed to onFrame. Throw Corruption to refuse.
  virtual uint8_t* payloadSink(Channel& channel, const FrameHeader& h) { return nullptr; }
  // One frame. `payload` is empty when it went to payloadSink. Throwing Corruption or
  // InvalidArgument closes the channel as a violation (logged with the message).
  virtual void onFrame(Channel& channel, const FrameHeader& h, Bytes payload) = 0;
  // Called once when the channel closes, for any reason; posted to the io thread, so never
  // from inside Channel::close().
  virtual void onClose(Channel& channel, CloseReason reason, const std::string& why) {}
};

class Channel : public std::enable_shared_from_this<Channel> {
 public:
  Channel(boost::asio::ip::tcp::socket socket, ChannelOptions options,
          std::shared_ptr<ChannelHandler> handler);
  ~Channel();

  // Starts reading. REQUIRES: called once, on the io thread.
  void start();

  // Queues a frame with a copy-free payload owned by the channel.
  void send(uint8_t type, int64_t epoch, Bytes payload);
  // Queues a frame whose payload is `n` bytes at `data`, sent without a copy; `keepAlive`
  // is held until the bytes are written.
  void sendRef(uint8_t type, int64_t epoch, const uint8_t* data, size_t n,
               std::shared_ptr<const void> keepAlive);
  // Closes after every queued frame is written.
  void closeAfterWrites();

  // While busy (a request is being served, e.g. a parked wait), the idle timeout is off.
  void setBusy(bool busy) { busy_ = busy; }

  // Closes now (idempotent); the handler's onClose runs later with kLocal, and the channel
  // lets go of the handler (which breaks handler -> channel reference cycles).
  void close(const std::string& why = "closed locally");
  // close(), with a line "dropping connection from <peer>: <why>" through the drop log.
  void drop(const std::string& why);

  bool closed() const { return closed_; }
  const std::string& peer() const { return peer_; }
  uint64_t token() const { return options_.rules.token; }

  // A number the owner hangs on the connection (e.g. the worker id); -1 until set.
  int64_t tag() const { return tag_; }
  void setTag(int64_t tag) { tag_ = tag; }

  // Whether a frame header carrying the token has arrived (the peer holds the job token).
  bool authenticated() const { return authenticated_; }
  // The peer's address without its port.
  const std::string& peerHost() const { return peerHost_; }
  // When the channel was made.
  std::chrono::steady_clock::time_point since() const { return since_; }
  // Called at the first frame header that carries the token: "" admits the connection, a
  // reason closes it (logged, throttled per address). REQUIRES: before start().
  void setAdmission(std::function<std::string(Channel&)> admit) { admit_ = std::move(admit); }

 private:
  struct Out {
    std::array<uint8_t, kFrameHeaderBytes> header;
    Bytes owned;
    const uint8_t* data = nullptr;
    size_t size = 0;
    std::shared_ptr<const void> keepAlive;
  };
  void readHeader();
  void readPayload();
  void armIdle();
  void writeNext();
  void finish(CloseReason reason, const std::string& why);
  void log(const std::string& line);
  // A line about a dropped connection, through options_.dropLog when set.
  void logDrop(const std::string& line);

  boost::asio::ip::tcp::socket socket_;
  const ChannelOptions options_;
  std::shared_ptr<ChannelHandler> handler_;
  boost::asio::steady_timer timer_;
  std::string peer_;
  std::string peerHost_;
  std::chrono::steady_clock::time_point since_;
  std::function<std::string(Channel&)> admit_;
  bool authenticated_ = false;
  std::array<uint8_t, kFrameHeaderBytes> header_{};
  FrameHeader h_;
  Bytes payload_;
  uint8_t* sink_ = nullptr;
  std::deque<Out> out_;
  uint64_t readSerial_ = 0;  // which read a timer belongs to
  bool busy_ = false;
  bool closed_ = false;
  bool closeAfterWrites_ = false;
  int64_t tag_ = -1;
};

struct ListenerOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;  // 0 picks a free port
  // Authenticated connections (whose first frame header carried the job token) beyond this
  // many open ones are closed when they authenticate (logged).
  size_t maxConnections = 256;
  // Connections that have not authenticated yet live in a pool of their own and never count
  // against maxConnections: at most maxPending of them, and maxPendingPerPeer from one
  // address. A new connection beyond either evicts the oldest unauthenticated connection of
  // its own address (over the per-address limit) or of the address with the most of them
  // (over the pool's), so a flood of strangers costs at most those sockets and never keeps a
  // member out: a member authenticates within a millisecond of connecting, a stranger's
  // connection is gone after authTimeout or when newer ones arrive.
  size_t maxPending = 1024;
  size_t maxPendingPerPeer = 64;
  // A connection's first frame header must arrive within this (the channel's authTimeout).
  std::chrono::milliseconds authTimeout{2000};
  ChannelOptions channel;
};

// Accepts connections and makes each a started Channel with a handler from makeHandler.
// The listening socket and every accepted socket are close-on-exec, so a child process
// does not keep the port.
class Listener {
 public:
  using MakeHandler = std::function<std::shared_ptr<ChannelHandler>()>;
  // Binds and listens now (throws IoError naming host:port); accepts once io runs.
  Listener(boost::asio::io_context& io, ListenerOptions options, MakeHandler makeHandler);
  ~Listener();
  uint16_t port() const { return port_; }
  // Stops accepting and closes every open channel. Io thread only.
  void close();
  // Open channels (io thread only), and connections refused for the cap or evicted from the
  // unauthenticated pool so far.
  size_t open();
  int64_t refused() const { return pool_->refused; }
  int64_t evicted() const { return pool_->evicted; }
  // Calls fn for every open channel (io thread only).
  void forEach(const std::function<void(Channel&)>& fn);

 private:
  void accept();
  // The unauthenticated connections of one address evict their oldest one; over the pool's
  // limit, the address with the most of them does. Io thread only.
  void evictPending(const std::string& host);

  // The channels and what the admission of a newly authenticated one needs; shared with the
  // channels' admission callbacks, which may outlive the Listener.
  struct Pool {
    std::set<std::weak_ptr<Channel>, std::owner_less<std::weak_ptr<Channel>>> channels;
    int64_t refused = 0;
    int64_t evicted = 0;
  };

  boost::asio::io_context& io_;
  const ListenerOptions options_;
  MakeHandler makeHandler_;
  boost::asio::ip::tcp::acceptor acceptor_;
  uint16_t port_ = 0;
  std::shared_ptr<Pool> pool_ = std::make_shared<Pool>();
};

// A connection that has not authenticated yet: its peer's address and when it was made.
struct PendingConnection {
  std::string host;
  std::chrono::steady_clock::time_point since;
};

// The rule of ListenerOptions::maxPending (shared with the control API): which of `pending`
// goes to make room for one more connection from `host`: over `maxPerPeer` from `host`, its
// oldest; else, over `maxPending` in all, the oldest of the address with the most (among
// equals, the one whose oldest connection is oldest). Its index, or -1 when there is room.
// Limits below 1 count as 1.
int64_t pendingToEvict(const std::vector<PendingConnection>& pending, const std::string& host,
                       size_t maxPending, size_t maxPerPeer);

// Sets FD_CLOEXEC on a descriptor (Asio does not for accepted sockets).
void setCloseOnExec(int fd);

// The body of a server's or client's io thread: io.run() until it runs out of work. An
// exception that escapes a completion handler is a bug (handlers answer bad input by closing
// the connection), but it must neither end the thread, leaving the port dead, nor reach
// std::terminate: onError gets its message (to log it, or to fail the waiting caller), then
// io.run() goes on.
void runIoThread(boost::asio::io_context& io,
                 const std::function<void(const std::string&)>& onError);

}  // namespace transport
}  // namespace collectives
}  // namespace sinew
