#include "sinew/collectives/transport/channel.h"

#include <fcntl.h>

#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>

#include <algorithm>
#include <cstdio>
#include <map>

#include "sinew/base/error.h"

namespace sinew {
namespace collectives {
namespace transport {

namespace asio = boost::asio;
using asio::ip::tcp;
using boost::system::error_code;

void setCloseOnExec(int fd) {
  int flags = ::fcntl(fd, F_GETFD);
  if (flags >= 0) ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC);
}

void runIoThread(asio::io_context& io, const std::function<void(const std::string&)>& onError) {
  for (;;) {
    try {
      io.run();
      return;
    } catch (const std::exception& e) {
      onError(e.what());
    } catch (...) {
      onError("an exception that is not a std::exception");
    }
  }
}

namespace {

std::string endpointName(const tcp::socket& s) {
  error_code ec;
  auto ep = s.remote_endpoint(ec);
  if (ec) return "an unknown peer";
  return ep.address().to_string() + ":" + std::to_string(ep.port());
}

// The address of "address:port" (IPv6 addresses keep their colons).
std::string hostOf(const std::string& peer) {
  const size_t colon = peer.rfind(':');
  return colon == std::string::npos ? peer : peer.substr(0, colon);
}

bool isPeerGone(const error_code& ec) {
  return ec == asio::error::eof || ec == asio::error::connection_reset ||
         ec == asio::error::broken_pipe;
}

}  // namespace

Channel::Channel(tcp::socket socket, ChannelOptions options,
                 std::shared_ptr<ChannelHandler> handler)
    : socket_(std::move(socket)),
      options_(std::move(options)),
      handler_(std::move(handler)),
      timer_(socket_.get_executor()) {
  peer_ = endpointName(socket_);
  peerHost_ = hostOf(peer_);
  since_ = std::chrono::steady_clock::now();
  error_code ignored;
  socket_.set_option(tcp::no_delay(true), ignored);
  setCloseOnExec(socket_.native_handle());
}

Channel::~Channel() = default;

bool LogThrottle::admit(const std::string& key, int64_t* withheld) {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  if (entries_.size() >= 4096 && entries_.count(key) == 0) entries_.clear();
  Entry& e = entries_[key];
  if (e.last != std::chrono::steady_clock::time_point{} && now - e.last < interval_) {
    ++e.withheld;
    return false;
  }
  *withheld = e.withheld;
  e.withheld = 0;
  e.last = now;
  return true;
}

void Channel::logDrop(const std::string& line) {
  int64_t withheld = 0;
  if (options_.dropLog && !options_.dropLog->admit(peerHost_, &withheld)) return;
  log(withheld == 0 ? line
                    : line + " (and " + std::to_string(withheld) + " more from " + peerHost_ +
                          " since its last logged one, not logged)");
}

void Channel::log(const std::string& line) {
  std::string full = options_.name + ": " + line;
  if (options_.log) {
    options_.log(full);
  } else {
    std::fprintf(stderr, "%s\n", full.c_str());
  }
}

void Channel::start() { readHeader(); }

void Channel::armIdle() {
  // Until its first header, a connection has what is left of its authentication deadline.
  const bool pending = !authenticated_ && options_.authTimeout.count() > 0;
  std::chrono::steady_clock::duration limit = options_.idleTimeout;
  if (pending) {
    const auto left = options_.authTimeout - (std::chrono::steady_clock::now() - since_);
    limit = options_.idleTimeout.count() > 0 ? std::min(limit, left) : left;
  } else if (options_.idleTimeout.count() <= 0) {
    return;
  }
  const uint64_t serial = readSerial_;
  auto self = shared_from_this();
  timer_.expires_after(std::max(limit, std::chrono::steady_clock::duration::zero()));
  timer_.async_wait([this, self, serial, pending](error_code ec) {
    if (ec || closed_ || serial != readSerial_) return;
    if (busy_) return armIdle();
    if (pending && (options_.idleTimeout.count() <= 0 ||
                    std::chrono::steady_clock::now() - since_ < options_.idleTimeout)) {
      return finish(CloseReason::kTimeout,
                    "no frame header carrying the job token within the authentication deadline "
                    "of " +
                        std::to_string(options_.authTimeout.count()) + " ms");
    }
    finish(CloseReason::kTimeout, "no complete frame within the idle timeout of " +
                                      std::to_string(options_.idleTimeout.count()) + " ms");
  });
}

void Channel::readHeader() {
  ++readSerial_;
  armIdle();
  auto self = shared_from_this();
  asio::async_read(socket_, asio::buffer(header_), [this, self](error_code ec, size_t) {
    if (closed_) return;
    if (ec) {
      return finish(isPeerGone(ec) ? CloseReason::kPeerClosed : CloseReason::kViolation,
                    isPeerGone(ec) ? "connection closed" : "read failed: " + ec.message());
    }
    try {
      h_ = parseFrameHeader(header_.data(), options_.rules);
      if (!authenticated_) {
        authenticated_ = true;
        const std::string refused = admit_ ? admit_(*this) : std::string();
        if (!refused.empty()) return drop(refused);
      }
      auto handler = handler_;  // Stays alive even if the handler closes the channel.
      sink_ = h_.length > 0 ? handler->payloadSink(*this, h_) : nullptr;
    } catch (const std::exception& e) {  // Corruption from the header; anything from a sink.
      return finish(CloseReason::kViolation, e.what());
    }
    if (!sink_) payload_.assign(h_.length, 0);  // The header, token included, was checked.
    readPayload();
  });
}

void Channel::readPayload() {
  const uint64_t serial = ++readSerial_;
  auto self = shared_from_this();
  if (h_.length > 0) {
    timer_.expires_after(options_.frameTimeout);
    timer_.async_wait([this, self, serial](error_code ec) {
      if (ec || closed_ || serial != readSerial_) return;
      finish(CloseReason::kTimeout, "the payload of a " + frameName(options_.rules, h_.type) +
                                        " message of " + std::to_string(h_.length) +
                                        " bytes did not arrive within " +
                                        std::to_string(options_.frameTimeout.count()) + " ms");
    });
  }
  auto buffer = sink_ ? asio::buffer(sink_, h_.length) : asio::buffer(payload_);
  asio::async_read(socket_, buffer, [this, self](error_code ec, size_t) {
    if (closed_) return;
    if (ec) {
      std::string why = "connection from " + peer_ + " closed in the middle of a " +
                        frameName(options_.rules, h_.type) + " message";
      logDrop(why);
      return finish(CloseReason::kPeerClosed, why);
    }
    ++readSerial_;            // Disarms the frame timer.
    auto handler = handler_;  // Stays alive even if the handler closes the channel.
    try {
      handler->onFrame(*this, h_, sink_ ? Bytes() : std::move(payload_));
    } catch (const std::exception& e) {
      return finish(CloseReason::kViolation,
                    "bad " + frameName(options_.rules, h_.type) + " message: " + e.what());
    }
    payload_ = Bytes();
    if (!closed_) readHeader();
  });
}

void Channel::send(uint8_t type, int64_t epoch, Bytes payload) {
  if (closed_) return;
  out_.emplace_back();
  Out& o = out_.back();
  o.owned = std::move(payload);
  o.data = o.owned.data();
  o.size = o.owned.size();
  FrameHeader h;
  h.service = options_.rules.service;
  h.type = type;
  h.length = static_cast<uint32_t>(o.size);
  h.token = options_.rules.token;
  h.epoch = epoch;
  encodeFrameHeader(h, o.header.data());
  if (out_.size() == 1) writeNext();
}

void Channel::sendRef(uint8_t type, int64_t epoch, const uint8_t* data, size_t n,
                      std::shared_ptr<const void> keepAlive) {
  if (closed_) return;
  SINEW_ENFORCE(n <= UINT32_MAX, "frame payload of ", n, " bytes");
  out_.emplace_back();
  Out& o = out_.back();
  o.data = data;
  o.size = n;
  o.keepAlive = std::move(keepAlive);
  FrameHeader h;
  h.service = options_.rules.service;
  h.type = type;
  h.length = static_cast<uint32_t>(n);
  h.token = options_.rules.token;
  h.epoch = epoch;
  encodeFrameHeader(h, o.header.data());
  if (out_.size() == 1) writeNext();
}

void Channel::closeAfterWrites() {
  closeAfterWrites_ = true;
  if (out_.empty()) close("closed after its last message");
}

void Channel::writeNext() {
  auto self = shared_from_this();
  Out& o = out_.front();
  std::array<asio::const_buffer, 2> bufs{asio::buffer(o.header), asio::buffer(o.data, o.size)};
  asio::async_write(socket_, bufs, [this, self](error_code ec, size_t) {
    if (closed_) return;
    if (ec) {
      return finish(CloseReason::kPeerClosed, "write failed: " + ec.message());
    }
    out_.pop_front();
    if (!out_.empty()) return writeNext();
    if (closeAfterWrites_) close("closed after its last message");
  });
}

void Channel::close(const std::string& why) { finish(CloseReason::kLocal, why); }

void Channel::drop(const std::string& why) {
  if (closed_) return;
  logDrop("dropping connection from " + peer_ + ": " + why);
  finish(CloseReason::kLocal, why);
}

void Channel::finish(CloseReason reason, const std::string& why) {
  if (closed_) return;
  closed_ = true;
  if (reason == CloseReason::kViolation || reason == CloseReason::kTimeout) {
    logDrop("dropping connection from " + peer_ + ": " + why);
  }
  error_code ec;
  timer_.cancel();
  socket_.shutdown(tcp::socket::shutdown_both, ec);
  socket_.close(ec);
  out_.clear();
  // onClose runs later on the io thread, never inside a caller's close() (which may hold
  // the owner's lock).
  auto handler = std::move(handler_);
  if (handler) {
    auto self = shared_from_this();
    asio::post(socket_.get_executor(),
               [self, handler, reason, why] { handler->onClose(*self, reason, why); });
  }
}

// ---------------------------------------------------------------------------------------

namespace {

ListenerOptions withDropLog(ListenerOptions o) {
  if (!o.channel.dropLog) o.channel.dropLog = std::make_shared<LogThrottle>();
  o.channel.authTimeout = o.authTimeout;
  o.maxPending = std::max<size_t>(o.maxPending, 1);
  o.maxPendingPerPeer = std::max<size_t>(std::min(o.maxPendingPerPeer, o.maxPending), 1);
  return o;
}

}  // namespace

Listener::Listener(asio::io_context& io, ListenerOptions options, MakeHandler makeHandler)
    : io_(io),
      options_(withDropLog(std::move(options))),
      makeHandler_(std::move(makeHandler)),
      acceptor_(io) {
  error_code ec;
  auto address = asio::ip::make_address(options_.host, ec);
  if (ec) {
    tcp::resolver resolver(io_);
    auto results = resolver.resolve(options_.host, std::to_string(options_.port), ec);
    if (ec || results.empty()) {
      SINEW_THROW(IoError, options_.channel.name, ": cannot resolve '", options_.host,
                  "': ", ec.message());
    }
    address = results.begin()->endpoint().address();
  }
  tcp::endpoint ep(address, options_.port);
  acceptor_.open(ep.protocol(), ec);
  if (!ec) setCloseOnExec(acceptor_.native_handle());
  if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor_.bind(ep, ec);
  if (!ec) acceptor_.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    SINEW_THROW(IoError, options_.channel.name, ": cannot listen on ", options_.host, ":",
                options_.port, ": ", ec.message());
  }
  port_ = acceptor_.local_endpoint().port();
  accept();
}

Listener::~Listener() {
  error_code ec;
  acceptor_.close(ec);
}

size_t Listener::open() {
  auto& channels = pool_->channels;
  for (auto it = channels.begin(); it != channels.end();) {
    auto c = it->lock();
    if (!c || c->closed()) {
      it = channels.erase(it);
    } else {
      ++it;
    }
  }
  return channels.size();
}

int64_t pendingToEvict(const std::vector<PendingConnection>& pending, const std::string& host,
                       size_t maxPending, size_t maxPerPeer) {
  struct Address {
    size_t count = 0;
    int64_t oldest = -1;  // index into pending
  };
  std::map<std::string, Address> byHost;
  for (size_t i = 0; i < pending.size(); ++i) {
    Address& a = byHost[pending[i].host];
    ++a.count;
    if (a.oldest < 0 || pending[i].since < pending[a.oldest].since) a.oldest = int64_t(i);
  }
  auto mine = byHost.find(host);
  if (mine != byHost.end() && mine->second.count >= std::max<size_t>(maxPerPeer, 1)) {
    return mine->second.oldest;
  }
  if (pending.empty() || pending.size() < std::max<size_t>(maxPending, 1)) return -1;
  const Address* most = nullptr;
  for (const auto& [h, a] : byHost) {
    if (!most || a.count > most->count ||
        (a.count == most->count && pending[a.oldest].since < pending[most->oldest].since)) {
      most = &a;
    }
  }
  return most->oldest;
}

void Listener::evictPending(const std::string& host) {
  open();
  std::vector<std::shared_ptr<Channel>> channels;
  std::vector<PendingConnection> pending;
  for (const auto& w : pool_->channels) {
    auto c = w.lock();
    if (c && !c->authenticated()) {
      channels.push_back(c);
      pending.push_back({c->peerHost(), c->since()});
    }
  }
  const int64_t v = pendingToEvict(pending, host, options_.maxPending, options_.maxPendingPerPeer);
  if (v < 0) return;
  const std::string& from = pending[v].host;
  const size_t fromCount = static_cast<size_t>(std::count_if(
      pending.begin(), pending.end(), [&](const PendingConnection& p) { return p.host == from; }));
  const std::string why = from == host && fromCount >= options_.maxPendingPerPeer
                              ? std::to_string(fromCount) + " connections from " + from +
                                    " have not authenticated (the limit per address)"
                              : std::to_string(pending.size()) +
                                    " connections have not authenticated (the limit), " +
                                    std::to_string(fromCount) + " of them from " + from;
  pool_->evicted++;
  channels[v]->drop("evicted by a newer connection: " + why);
}

void Listener::forEach(const std::function<void(Channel&)>& fn) {
  open();
  std::vector<std::shared_ptr<Channel>> live;
  for (const auto& w : pool_->channels) {
    if (auto c = w.lock()) live.push_back(c);
  }
  for (auto& c : live) fn(*c);
}

void Listener::close() {
  error_code ec;
  acceptor_.close(ec);
  forEach([](Channel& c) { c.close("server stopping"); });
  pool_->channels.clear();
}

void Listener::accept() {
  acceptor_.async_accept([this](error_code ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
    if (ec) {
      // EMFILE and friends: keep accepting (after a pause), never stop for good.
      std::fprintf(stderr, "%s: accept failed: %s\n", options_.channel.name.c_str(),
                   ec.message().c_str());
      auto timer = std::make_shared<asio::steady_timer>(io_, std::chrono::milliseconds(50));
      timer->async_wait([this, timer](error_code e) {
        if (!e && acceptor_.is_open()) accept();
      });
      return;
    }
    setCloseOnExec(socket.native_handle());
    auto channel = std::make_shared<Channel>(std::move(socket), options_.channel, makeHandler_());
    evictPending(channel->peerHost());  // Room in the unauthenticated pool for one more.
    // A connection takes a member's slot only once it shows the job token.
    const size_t cap = options_.maxConnections;
    channel->setAdmission([pool = pool_, cap](Channel& self) -> std::string {
      size_t members = 0;
      for (const auto& w : pool->channels) {
        auto c = w.lock();
        if (c && c.get() != &self && !c->closed() && c->authenticated()) ++members;
      }
      if (members < cap) return "";
      pool->refused++;
      return std::to_string(cap) + " authenticated connections are open (the cap)";
    });
    pool_->channels.insert(channel);
    channel->start();
    accept();
  });
}

}  // namespace transport
}  // namespace collectives
}  // namespace sinew
