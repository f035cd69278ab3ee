#include "sinew/runtime/control_server.h"

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <algorithm>
#include <array>
#include <deque>
#include <optional>
#include <vector>

#include "sinew/base/error.h"
#include "sinew/collectives/transport/channel.h"

namespace sinew {
namespace runtime {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
using asio::ip::tcp;
using boost::system::error_code;

// What close() and the unauthenticated pool need of a session.
class SessionBase {
 public:
  virtual ~SessionBase() = default;
  virtual void close() = 0;
  virtual bool closing() const = 0;
  bool authenticated = false;  // a request of it carried a valid token
  std::string host;            // the peer's address
  std::chrono::steady_clock::time_point since = std::chrono::steady_clock::now();
};

// What the sessions share with the server: it outlives the server while a session or a
// handler holds it, and `closed` tells them that backend and feed may be gone.
struct ControlServer::Shared {
  ControlServerOptions options;
  control::Backend* backend;  // Valid while !closed (the coordinator closes before it dies).
  EventFeed* feed;            // Same.
  std::optional<tcp::acceptor> acceptor;
  std::optional<asio::steady_timer> retry;  // backs off after a failed accept
  // Every session, so that close() can end them (an event stream never ends by itself).
  std::vector<std::weak_ptr<SessionBase>> sessions;
  bool closed = false;
  size_t streams = 0;
  // Evictions from the unauthenticated pool, logged once per address per 10 s.
  collectives::transport::LogThrottle evictionLog;

  void log(const std::string& line) const {
    if (options.log) options.log("sinew control API: " + line);
  }
};

namespace {

// Events a slow reader may have queued before its stream is dropped.
constexpr size_t kMaxQueuedEvents = 4096;

class Session : public SessionBase, public std::enable_shared_from_this<Session> {
 public:
  Session(tcp::socket socket, std::shared_ptr<ControlServer::Shared> shared)
      : stream_(std::move(socket)),
        deadline_(stream_.get_executor()),
        shared_(std::move(shared)),
        pollTimer_(stream_.get_executor()) {
    error_code ec;
    auto ep = stream_.socket().remote_endpoint(ec);
    host = ec ? std::string("an unknown peer") : ep.address().to_string();
    peer_ = ec ? host : host + ":" + std::to_string(ep.port());
  }

  ~Session() {
    if (subscription_ >= 0) {
      shared_->streams--;
      if (!shared_->closed) shared_->feed->unsubscribe(subscription_);
    }
  }

  void start() {
    shared_->sessions.push_back(weak_from_this());
    readHeader();
  }

  bool closing() const override { return closing_; }

 private:
  void readHeader() {
    if (shared_->closed) return;
    parser_.emplace();
    parser_->header_limit(control::kMaxHeaderBytes);
    parser_->body_limit(shared_->options.maxBodyBytes);
    // The request deadline is a timer of ours, not the stream's (which would close the
    // socket): a late request still hears 408.
    stream_.expires_never();
    timedOut_ = false;
    // Until a request shows the token, what is left of the authentication deadline.
    armDeadline(authenticated
                    ? asio::steady_timer::clock_type::now() + shared_->options.requestTimeout
                    : since + firstRequestLimit());
    http::async_read_header(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](error_code ec, size_t) { self->onHeader(ec); });
  }

  // The first request's headers must arrive within this of the connection (authTimeout 0:
  // only the request timeout).
  std::chrono::milliseconds firstRequestLimit() const {
    const auto& o = shared_->options;
    return o.authTimeout.count() > 0 ? std::min(o.requestTimeout, o.authTimeout) : o.requestTimeout;
  }

  // The request deadline is a timer of ours, not the stream's (which would close the socket):
  // a late request still hears 408.
  void armDeadline(asio::steady_timer::time_point at) {
    deadline_.expires_at(at);
    deadline_.async_wait([self = shared_from_this()](error_code ec) {
      // A completion queued just before a cancel() still runs: believe the clock.
      if (ec || self->closing_ ||
          self->deadline_.expiry() > asio::steady_timer::clock_type::now()) {
        return;
      }
      self->timedOut_ = true;
      error_code ignored;
      self->stream_.socket().cancel(ignored);
    });
  }

  // A failed read: answer what was wrong when the client can still hear it, then close.
  void onReadError(error_code ec) {
    deadline_.cancel();
    if (timedOut_ && ec == asio::error::operation_aborted && !shared_->closed) {
      if (!parser_->got_some()) return close();  // An idle keep-alive connection.
      const auto limit = authenticated ? shared_->options.requestTimeout : firstRequestLimit();
      shared_->log("request from " + peer_ + " did not arrive within " +
                   std::to_string(limit.count()) + " ms; closing");
      return respond(control::errorAnswer(408, "the request did not arrive within " +
                                                   std::to_string(limit.count()) + " ms"),
                     false, 11);
    }
    if (ec == http::error::end_of_stream || ec == asio::error::connection_reset ||
        ec == asio::error::operation_aborted || shared_->closed) {
      return close();
    }
    if (ec == http::error::body_limit) {
      return respond(
          control::errorAnswer(413, "the request body is over the limit of " +
                                        std::to_string(shared_->options.maxBodyBytes) + " bytes"),
          false, 11);
    }
    if (ec == http::error::header_limit) {
      return respond(
          control::errorAnswer(431, "the request headers are over the limit of " +
                                        std::to_string(control::kMaxHeaderBytes) + " bytes"),
          false, 11);
    }
    shared_->log("malformed request from " + peer_ + ": " + ec.message());
    respond(control::errorAnswer(400, "malformed HTTP request: " + ec.message()), false, 11);
  }

  void onHeader(error_code ec) {
    if (ec) return onReadError(ec);
    auto& req = parser_->get();
    version_ = req.version();
    // The token before anything else: no body is read for a stranger.
    auto auth = req[http::field::authorization];
    const control::Role role = control::roleOf(std::string_view(auth.data(), auth.size()),
                                               shared_->options.token, shared_->options.readToken);
    if (role == control::Role::kNone) {
      refuseUnauthorized();
      return;
    }
    if (!authenticated) {
      // A member's slot is taken only by a connection that showed a token.
      size_t members = 0;
      for (const auto& w : shared_->sessions) {
        auto s = w.lock();
        if (s && s.get() != this && !s->closing() && s->authenticated) ++members;
      }
      if (members >= shared_->options.maxConnections) {
        shared_->log("refusing a connection from " + peer_ + ": " +
                     std::to_string(shared_->options.maxConnections) +
                     " authenticated connections are open");
        return respond(
            control::errorAnswer(503, "too many connections (at most " +
                                          std::to_string(shared_->options.maxConnections) + ")"),
            false, version_);
      }
      authenticated = true;
      // The body (if any) gets the whole request timeout from here, not what is left of the
      // authentication deadline.
      armDeadline(asio::steady_timer::clock_type::now() + shared_->options.requestTimeout);
    }
    const auto method = req.method_string();
    if (!control::allows(role, std::string_view(method.data(), method.size()))) {
      respond(control::errorAnswer(403,
                                   "the read token may only GET (status, scaling, metrics, "
                                   "events); this needs the control token"),
              false, version_);
      return;
    }
    if (parser_->is_done()) return onRequest();
    http::async_read(stream_, buffer_, *parser_,
                     [self = shared_from_this()](error_code ec, size_t) {
                       if (ec) return self->onReadError(ec);
                       self->onRequest();
                     });
  }

  void refuseUnauthorized() {
    control::Answer a = control::errorAnswer(
        401,
        "missing or wrong bearer token (send 'Authorization: Bearer <token>'; the token is in "
        "the job's coordinator.json)");
    respond(a, false, version_);
  }

  void onRequest() {
    deadline_.cancel();
    if (shared_->closed) return close();
    auto& req = parser_->get();
    const bool keepAlive = req.keep_alive();
    auto target = req.target();
    auto method = req.method_string();
    control::Answer a =
        control::route(*shared_->backend, std::string_view(method.data(), method.size()),
                       std::string_view(target.data(), target.size()), req.body());
    if (a.eventStream) return startStream(req);
    if (a.longPoll) return startPoll(a, keepAlive);
    respond(a, keepAlive, version_);
  }

  // GET /v1/events?after=...: the events after `after` (up to the limit) as one JSON answer,
  // once there is at least one or the wait is over. Counted with the streams while it waits.
  void startPoll(const control::Answer& a, bool keepAlive) {
    if (shared_->streams >= shared_->options.maxEventStreams) {
      return respond(
          control::errorAnswer(503, "too many event streams and waits open (at most " +
                                        std::to_string(shared_->options.maxEventStreams) + ")"),
          false, version_);
    }
    shared_->streams++;
    poll_ = Poll{};
    poll_.after = a.after;
    poll_.limit = a.limit;
    poll_.keepAlive = keepAlive;
    std::weak_ptr<Session> weak = weak_from_this();
    subscription_ = shared_->feed->subscribe(
        [weak](int64_t seq, const nlohmann::json& e) {
          if (auto self = weak.lock()) self->onPolled(seq, e);
        },
        a.after);
    pollTimer_.expires_after(std::chrono::milliseconds(static_cast<int64_t>(a.waitSeconds * 1e3)));
    // The wait holds the session (nothing else does while it waits); a closed session's wait
    // is cancelled.
    pollTimer_.async_wait([self = shared_from_this()](error_code ec) {
      if (!ec) self->finishPoll();
    });
  }

  void onPolled(int64_t seq, const nlohmann::json& e) {
    if (poll_.done || seq <= poll_.after) return;
    if (poll_.events.size() < poll_.limit) {
      nlohmann::json x = e;
      x["seq"] = seq;
      poll_.events.push_back(std::move(x));
      poll_.next = seq;
    }
    // The retained events were posted together: answer after the rest of them.
    if (!poll_.flushPosted) {
      poll_.flushPosted = true;
      asio::post(stream_.get_executor(), [self = shared_from_this()] { self->finishPoll(); });
    }
  }

  void finishPoll() {
    if (poll_.done || closing_) return;
    poll_.done = true;
    pollTimer_.cancel();
    if (subscription_ >= 0) {
      shared_->streams--;
      if (!shared_->closed) shared_->feed->unsubscribe(subscription_);
      subscription_ = -1;
    }
    control::Answer a;
    a.body = nlohmann::json{{"events", std::move(poll_.events)},
                            {"next", std::max(poll_.next, poll_.after)}}
                 .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    respond(a, poll_.keepAlive, version_);
  }

  void respond(const control::Answer& a, bool keepAlive, unsigned version) {
    auto res = std::make_shared<http::response<http::string_body>>(
        static_cast<http::status>(a.status), version);
    res->set(http::field::server, "sinew");
    res->set(http::field::content_type, a.contentType);
    res->set(http::field::cache_control, "no-store");
    if (a.status == 401) res->set(http::field::www_authenticate, "Bearer");
    if (!a.allow.empty()) res->set(http::field::allow, a.allow);
    res->keep_alive(keepAlive);
    res->body() = a.body;
    res->prepare_payload();
    stream_.expires_after(shared_->options.requestTimeout);
    http::async_write(stream_, *res,
                      [self = shared_from_this(), res, keepAlive](error_code ec, size_t) {
                        if (ec || !keepAlive) return self->close();
                        self->readHeader();
                      });
  }

  // GET /v1/events: a server-sent event stream until the client goes or the server closes.
  void startStream(const http::request<http::string_body>& req) {
    if (shared_->streams >= shared_->options.maxEventStreams) {
      return respond(
          control::errorAnswer(503, "too many event streams open (at most " +
                                        std::to_string(shared_->options.maxEventStreams) + ")"),
          false, version_);
    }
    int64_t after = -1;
    auto last = req["Last-Event-ID"];
    if (!last.empty() && last.size() < 20) {
      try {
        after = std::stoll(std::string(last.data(), last.size()));
      } catch (const std::exception&) {
        after = -1;
      }
    }
    shared_->streams++;
    queue_.push_back(
        "HTTP/1.1 200 OK\r\nServer: sinew\r\nContent-Type: text/event-stream\r\n"
        "Cache-Control: no-store\r\nConnection: close\r\n\r\n");
    std::weak_ptr<Session> weak = weak_from_this();
    subscription_ = shared_->feed->subscribe(
        [weak](int64_t seq, const nlohmann::json& e) {
          if (auto self = weak.lock()) self->push(control::sseEvent(seq, e));
        },
        after);
    writeQueued();
    // Reading on tells when the client goes away (anything it sends is ignored).
    watchClient();
  }

  void push(std::string text) {
    if (closing_) return;
    if (queue_.size() >= kMaxQueuedEvents) {
      shared_->log("event stream to " + peer_ + " is not read; dropping it");
      return close();
    }
    queue_.push_back(std::move(text));
    if (!writing_) writeQueued();
  }

  void writeQueued() {
    if (queue_.empty() || closing_) return;
    writing_ = true;
    stream_.expires_after(shared_->options.requestTimeout);
    asio::async_write(stream_, asio::buffer(queue_.front()),
                      [self = shared_from_this()](error_code ec, size_t) {
                        self->writing_ = false;
                        if (ec) return self->close();
                        self->queue_.pop_front();
                        if (self->queue_.empty()) {
                          self->stream_.expires_never();
                        } else {
                          self->writeQueued();
                        }
                      });
  }

  void watchClient() {
    stream_.socket().async_read_some(asio::buffer(sink_),
                                     [self = shared_from_this()](error_code ec, size_t) {
                                       if (ec) return self->close();
                                       self->watchClient();
                                     });
  }

  void close() override {
    if (closing_) return;
    closing_ = true;
    deadline_.cancel();
    pollTimer_.cancel();
    error_code ignored;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ignored);
    stream_.socket().close(ignored);
  }

  beast::tcp_stream stream_;
  asio::steady_timer deadline_;  // the request deadline (see readHeader)
  bool timedOut_ = false;
  std::shared_ptr<ControlServer::Shared> shared_;
  beast::flat_buffer buffer_{control::kMaxHeaderBytes + 1024};
  std::optional<http::request_parser<http::string_body>> parser_;
  unsigned version_ = 11;
  std::string peer_;
  int subscription_ = -1;
  struct Poll {
    int64_t after = -1;
    int64_t next = -1;
    size_t limit = 100;
    bool keepAlive = false;
    bool flushPosted = false;
    bool done = false;
    nlohmann::json events = nlohmann::json::array();
  } poll_;
  asio::steady_timer pollTimer_;
  std::deque<std::string> queue_;
  bool writing_ = false;
  bool closing_ = false;
  std::array<char, 512> sink_{};
};

// Makes room for one more connection from `host` among those that have not shown a token:
// over the per-address limit its own oldest one goes, over the pool's limit the oldest one of
// the address with the most (logged once per address per 10 s, with a count).
void evictPending(ControlServer::Shared& shared, const std::string& host) {
  std::vector<std::shared_ptr<SessionBase>> sessions;
  std::vector<collectives::transport::PendingConnection> pending;
  for (const auto& w : shared.sessions) {
    auto s = w.lock();
    if (s && !s->closing() && !s->authenticated) {
      sessions.push_back(s);
      pending.push_back({s->host, s->since});
    }
  }
  const int64_t v = collectives::transport::pendingToEvict(pending, host, shared.options.maxPending,
                                                           shared.options.maxPendingPerPeer);
  if (v < 0) return;
  const std::string& from = pending[v].host;
  int64_t withheld = 0;
  if (shared.evictionLog.admit(from, &withheld)) {
    const auto fromCount = std::count_if(pending.begin(), pending.end(),
                                         [&](const auto& p) { return p.host == from; });
    shared.log("evicting the oldest of " + std::to_string(fromCount) + " connections from " + from +
               " that sent no request with a token (" + std::to_string(pending.size()) +
               " such in all)" +
               (withheld > 0 ? " (and " + std::to_string(withheld) + " more evictions since)"
                             : std::string()));
  }
  sessions[v]->close();
}

void accept(const std::shared_ptr<ControlServer::Shared>& shared) {
  shared->acceptor->async_accept([shared](error_code ec, tcp::socket socket) {
    if (shared->closed) return;
    if (ec) {
      // Out of descriptors, say: the connection stays queued, so retrying at once would spin.
      shared->log("accept failed (" + ec.message() + "); retrying in 50 ms");
      shared->retry->expires_after(std::chrono::milliseconds(50));
      shared->retry->async_wait([shared](error_code e) {
        if (!e && !shared->closed) accept(shared);
      });
      return;
    }
    {
      // Forget sessions that ended.
      auto& v = shared->sessions;
      v.erase(std::remove_if(v.begin(), v.end(), [](const auto& w) { return w.expired(); }),
              v.end());
    }
    collectives::transport::setCloseOnExec(socket.native_handle());
    auto session = std::make_shared<Session>(std::move(socket), shared);
    evictPending(*shared, session->host);
    session->start();
    accept(shared);
  });
}

}  // namespace

ControlServer::ControlServer(asio::io_context& io, ControlServerOptions options,
                             control::Backend* backend, EventFeed* feed)
    : shared_(std::make_shared<Shared>()) {
  shared_->options = std::move(options);
  shared_->backend = backend;
  shared_->feed = feed;
  if (shared_->options.token.empty()) {
    SINEW_THROW(InvalidArgument, "ControlServerOptions::token is empty");
  }
  try {
    tcp::endpoint ep(asio::ip::make_address(shared_->options.host), shared_->options.port);
    shared_->acceptor.emplace(io);
    shared_->retry.emplace(io);
    shared_->acceptor->open(ep.protocol());
    shared_->acceptor->set_option(tcp::acceptor::reuse_address(true));
    shared_->acceptor->bind(ep);
    shared_->acceptor->listen();
    // Workers and launchers fork: the listening socket stays with this process.
    collectives::transport::setCloseOnExec(shared_->acceptor->native_handle());
  } catch (const boost::system::system_error& e) {
    SINEW_THROW(IoError, "the control API cannot listen on ", shared_->options.host, ":",
                shared_->options.port, ": ", e.what());
  }
  accept(shared_);
}

ControlServer::~ControlServer() = default;

uint16_t ControlServer::port() const { return shared_->acceptor->local_endpoint().port(); }

void ControlServer::close() {
  shared_->closed = true;
  error_code ignored;
  if (shared_->acceptor) shared_->acceptor->close(ignored);
  if (shared_->retry) shared_->retry->cancel();
  for (auto& weak : shared_->sessions) {
    if (auto session = weak.lock()) session->close();
  }
  shared_->sessions.clear();
}

}  // namespace runtime
}  // namespace sinew
