#include "sinew/checkpoint/replica.h"

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>

#include "sinew/base/crc32c.h"
#include "sinew/base/error.h"
#include "sinew/base/little_endian.h"
#include "sinew/base/open_files.h"
#include "sinew/checkpoint/detail/replica_wire.h"
#include "sinew/collectives/transport/channel.h"
#include "sinew/collectives/transport/connection.h"

namespace sinew {
namespace checkpoint {

void TrafficGate::enter() {
  std::lock_guard<std::mutex> lock(mu_);
  inFlight_++;
}

void TrafficGate::exit() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    inFlight_--;
  }
  cv_.notify_all();
}

void TrafficGate::waitIdle(std::chrono::milliseconds maxWait) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, maxWait, [&] { return inFlight_ == 0; });
}

namespace {

namespace asio = boost::asio;
namespace transport = collectives::transport;
using asio::ip::tcp;
using nlohmann::json;
using Clock = std::chrono::steady_clock;
using sinew::detail::appendLe;
using sinew::detail::loadLe;

}  // namespace

namespace {

using replica_wire::Type;

constexpr size_t kServeChunkBytes = 4 << 20;

}  // namespace

// ---------------------------------------------------------------------------------------
// Service.

class ReplicaService::Impl {
 public:
  class Session;

  Impl(ReplicaService* owner, int self, ReplicaServiceOptions options)
      : service_(owner), self_(self), options_(std::move(options)) {
    if (options_.token == 0) {
      SINEW_THROW(InvalidArgument, "ReplicaServiceOptions::token of worker ", self,
                  " is 0: pass the job token");
    }
    transport::ListenerOptions lo;
    lo.host = options_.host;
    lo.port = options_.port;
    // A worker's other files: its store and coordinator connections, a communicator's pairs,
    // checkpoint files.
    constexpr int64_t kReserve = 512;
    const std::vector<int64_t> caps = {static_cast<int64_t>(options_.maxConnections),
                                       static_cast<int64_t>(options_.maxPending)};
    const int64_t limit = raiseOpenFileLimit(caps[0] + caps[1] + kReserve);
    const std::vector<int64_t> fit = capsWithin(caps, limit, kReserve);
    if (fit != caps) {
      std::fprintf(stderr,
                   "sinew replica service %d: the open-file limit is %lld and cannot be raised; "
                   "connection caps lowered from %lld + %lld to %lld + %lld\n",
                   self, static_cast<long long>(limit), static_cast<long long>(caps[0]),
                   static_cast<long long>(caps[1]), static_cast<long long>(fit[0]),
                   static_cast<long long>(fit[1]));
    }
    lo.maxConnections = static_cast<size_t>(fit[0]);
    lo.maxPending = static_cast<size_t>(fit[1]);
    lo.channel.rules = replica_wire::serviceRules(options_.token, options_.maxChunkBytes);
    lo.channel.idleTimeout = options_.idleTimeout;
    lo.channel.frameTimeout = options_.frameTimeout;
    lo.channel.name = "sinew replica service " + std::to_string(self);
    listener_ = std::make_unique<transport::Listener>(io_, lo, [this] { return makeSession(); });
    port_ = listener_->port();
    thread_ = std::thread([this] {
      transport::runIoThread(io_, [this](const std::string& what) {
        std::fprintf(
            stderr,
            "sinew replica service %d: internal error in the io thread (it goes on serving): %s\n",
            self_, what.c_str());
      });
    });
  }

  ~Impl() {
    asio::post(io_, [this] { listener_->close(); });
    thread_.join();
  }

  uint16_t port() const { return port_; }

  void setOwnShards(std::function<std::vector<std::shared_ptr<const HostShard>>()> fn) {
    std::lock_guard<std::mutex> lock(mu_);
    ownShards_ = std::move(fn);
  }

  // Replicas and own snapshots, for LIST and GET.
  std::vector<std::shared_ptr<const HostShard>> served() const {
    auto out = all();
    std::function<std::vector<std::shared_ptr<const HostShard>>()> own;
    {
      std::lock_guard<std::mutex> lock(mu_);
      own = ownShards_;
    }
    if (own) {
      for (auto& s : own()) out.push_back(std::move(s));
    }
    return out;
  }

  std::shared_ptr<const HostShard> findServed(int owner, int64_t step) const {
    for (auto& s : served()) {
      if (s->owner == owner && s->step == step) return s;
    }
    return nullptr;
  }

  std::shared_ptr<const HostShard> find(int owner, int64_t step) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = slots_.find(owner);
    if (it == slots_.end()) return nullptr;
    for (const auto& s : it->second) {
      if (s && s->complete && s->step == step) return s;
    }
    return nullptr;
  }

  std::vector<std::shared_ptr<const HostShard>> all() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::shared_ptr<const HostShard>> out;
    for (const auto& kv : slots_) {
      for (const auto& s : kv.second) {
        if (s && s->complete) out.push_back(s);
      }
    }
    return out;
  }

  uint64_t bytesAllocated() const {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t n = 0;
    for (const auto& kv : slots_) {
      for (const auto& s : kv.second) n += s ? s->capacity() : 0;
    }
    return n;
  }

  size_t openConnections() {
    std::promise<size_t> p;
    auto f = p.get_future();
    asio::post(io_, [&] { p.set_value(listener_->open()); });
    return f.get();
  }

  std::atomic<int64_t> dropped_{0};

 private:
  std::shared_ptr<transport::ChannelHandler> makeSession();

  // Picks the slot an incoming version of owner is written into: not read by anyone and
  // not the newest complete version. Null if none is free.
  std::shared_ptr<HostShard> claimSlot(int owner, int64_t step, const ShardLayout& layout) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& slots = slots_[owner];
    if (slots.empty()) slots.resize(std::max(1, options_.versionsKept));
    int newest = -1;  // Index of the newest complete version: never overwritten.
    for (int i = 0; i < static_cast<int>(slots.size()); ++i) {
      const auto& s = slots[i];
      if (s && s->complete && (newest < 0 || s->step > slots[newest]->step)) newest = i;
    }
    int best = -1;
    for (int i = 0; i < static_cast<int>(slots.size()); ++i) {
      const auto& s = slots[i];
      if (!s) {
        best = i;
        break;
      }
      if (s.use_count() != 1) continue;
      if (i == newest && slots.size() > 1) continue;
      if (best < 0 || !s->complete || (slots[best]->complete && s->step < slots[best]->step)) {
        best = i;
      }
    }
    if (best < 0) return nullptr;
    auto& slot = slots[best];
    if (!slot || slot->capacity() < layout.totalBytes) {
      slot.reset();  // Sized once per owner; regrown only if the owner's shard grew.
      slot = std::make_shared<HostShard>(layout.totalBytes, false);
    }
    slot->complete = false;
    slot->owner = owner;
    slot->step = step;
    slot->layout = layout;
    return slot;
  }

  void markComplete(const std::shared_ptr<HostShard>& s) {
    std::lock_guard<std::mutex> lock(mu_);
    s->complete = true;
  }

  void abandon(const std::shared_ptr<HostShard>& s) {
    std::lock_guard<std::mutex> lock(mu_);
    s->step = -1;  // A half-received version never becomes visible.
  }

  ReplicaService* const service_;  // Owns this Impl, so it outlives it.
  const int self_;
  const ReplicaServiceOptions options_;
  asio::io_context io_;
  std::unique_ptr<transport::Listener> listener_;
  uint16_t port_ = 0;
  std::thread thread_;

  mutable std::mutex mu_;
  // Guarded by mu_: owner → its version slots.
  std::map<int, std::vector<std::shared_ptr<HostShard>>> slots_;
  std::function<std::vector<std::shared_ptr<const HostShard>>()> ownShards_;

  friend class Session;
};

// One peer's connection. A put is begin, chunks (read straight into the claimed slot, at
// consecutive offsets) and end, which is answered with an ack (empty: accepted; else why
// not). A bad message closes the connection; a shard that cannot be accepted (no free slot,
// a chunk outside it) is drained and refused at end.
class ReplicaService::Impl::Session : public transport::ChannelHandler {
 public:
  explicit Session(Impl* service) : service_(service) {}

  uint8_t* payloadSink(transport::Channel& channel, const transport::FrameHeader& h) override {
    if (static_cast<Type>(h.type) != Type::kChunk) return nullptr;
    if (delta_) {
      // The next bytes of the current changed range (a chunk never crosses one).
      if (incoming_ && range_ < ranges_.size() && h.length <= ranges_[range_].second - inRange_) {
        uint8_t* p = incoming_->data() + ranges_[range_].first + inRange_;
        inRange_ += h.length;
        if (inRange_ == ranges_[range_].second) {
          ++range_;
          inRange_ = 0;
        }
        return p;
      }
      if (incomingError_.empty()) incomingError_ = "chunk outside the changed ranges";
      dropIncoming();
      return nullptr;
    }
    if (incoming_ && h.length <= incoming_->layout.totalBytes - nextOffset_) {
      uint8_t* p = incoming_->data() + nextOffset_;
      nextOffset_ += h.length;
      return p;
    }
    if (incomingError_.empty()) incomingError_ = "chunk outside the announced shard";
    dropIncoming();
    return nullptr;  // Read into a scratch buffer and dropped; refused at end.
  }

  void onFrame(transport::Channel& channel, const transport::FrameHeader& h,
               std::vector<uint8_t> payload) override {
    switch (static_cast<Type>(h.type)) {
      case Type::kBeginDelta:
        return beginDelta(payload);
      case Type::kBegin: {
        if (incoming_) service_->abandon(incoming_);
        dropIncoming();
        incomingError_.clear();
        nextOffset_ = 0;
        auto r = replica_wire::decodeBegin(payload, service_->options_.maxShardBytes);
        incoming_ = service_->claimSlot(r.owner, r.step, r.layout);
        verify_.reset();
        if (!incoming_) {
          incomingError_ = "no free replica slot for worker " + std::to_string(r.owner);
        } else {
          verify_ = std::make_unique<IncrementalVerify>(*incoming_);
        }
        return;
      }
      case Type::kChunk:
        if (incoming_) {
          service_->service_->bytesReceived_.fetch_add(h.length);
          if (verify_) verify_->advance(nextOffset_);  // Checksums this chunk while in cache.
        }
        return;
      case Type::kEnd: {
        std::string result;
        if (!incoming_) {
          result = incomingError_.empty() ? "end of a shard that was not begun" : incomingError_;
        } else if (delta_ && range_ != ranges_.size()) {
          result = "delta ended after " + std::to_string(range_) + " of its " +
                   std::to_string(ranges_.size()) + " changed ranges";
          service_->abandon(incoming_);
        } else if (!delta_ && nextOffset_ != incoming_->layout.totalBytes) {
          result = "shard ended after " + std::to_string(nextOffset_) + " of " +
                   std::to_string(incoming_->layout.totalBytes) + " bytes";
          service_->abandon(incoming_);
        } else {
          // A delta's bytes did not arrive in order: its every tensor is checked now, the
          // ones copied from the base included.
          result = delta_ ? incoming_->verify() : verify_->result();
          if (result.empty()) {
            service_->markComplete(incoming_);
          } else {
            service_->abandon(incoming_);
          }
        }
        dropIncoming();
        channel.send(static_cast<uint8_t>(Type::kAck), 0,
                     std::vector<uint8_t>(result.begin(), result.end()));
        return;
      }
      case Type::kList: {
        std::vector<replica_wire::ShardEntry> shards;
        for (const auto& s : service_->served()) shards.push_back({s->owner, s->step, s->layout});
        channel.send(static_cast<uint8_t>(Type::kListReply), 0, replica_wire::encodeList(shards));
        return;
      }
      case Type::kGet:
      case Type::kGetLayers: {
        int owner = -1;
        int64_t step = -1;
        std::vector<std::string> layers;  // Empty: the whole shard.
        if (static_cast<Type>(h.type) == Type::kGet) {
          replica_wire::decodeShardId(payload, payload.size(), &owner, &step, "get");
        } else {
          layers = replica_wire::decodeGetLayers(payload, &owner, &step);
        }
        auto s = service_->findServed(owner, step);
        if (!s) {
          std::string why = "worker " + std::to_string(service_->self_) +
                            " holds no replica of worker " + std::to_string(owner) +
                            " at version " + std::to_string(step);
          channel.send(static_cast<uint8_t>(Type::kError), 0,
                       std::vector<uint8_t>(why.begin(), why.end()));
          return;
        }
        std::vector<std::pair<uint64_t, uint64_t>> ranges{{0, s->layout.totalBytes}};
        const std::string layout =
            layers.empty() ? s->layout.toJson() : s->layout.onlyLayers(layers, &ranges).toJson();
        channel.send(static_cast<uint8_t>(Type::kGetReply), 0,
                     std::vector<uint8_t>(layout.begin(), layout.end()));
        // The shard's bytes go straight from its memory; `s` keeps it alive until written.
        for (const auto& [begin, bytes] : ranges) {
          for (uint64_t off = 0; off < bytes; off += kServeChunkBytes) {
            const size_t n = static_cast<size_t>(std::min<uint64_t>(kServeChunkBytes, bytes - off));
            channel.sendRef(static_cast<uint8_t>(Type::kData), 0, s->data() + begin + off, n, s);
          }
        }
        return;
      }
      default:
        SINEW_THROW(Corruption, "unexpected replica message type ", int(h.type));
    }
  }

  void onClose(transport::Channel& channel, transport::CloseReason reason,
               const std::string& why) override {
    if (reason == transport::CloseReason::kViolation ||
        reason == transport::CloseReason::kTimeout) {
      service_->dropped_++;
    }
    if (incoming_) service_->abandon(incoming_);
    dropIncoming();
  }

 private:
  // Forgets the version being received (the caller abandons its slot where it must).
  void dropIncoming() {
    incoming_.reset();
    verify_.reset();
    base_.reset();
    delta_ = false;
    ranges_.clear();
    range_ = 0;
    inRange_ = 0;
  }

  // An incremental version: the bytes of the tensors unchanged since `base` are copied from
  // this service's replica of it, the changed ones arrive as chunks. Without that replica (or
  // with one of another layout) the version is refused at end with kNoBase, and the client
  // sends it whole.
  void beginDelta(const std::vector<uint8_t>& payload) {
    if (incoming_) service_->abandon(incoming_);
    dropIncoming();
    incomingError_.clear();
    nextOffset_ = 0;
    int64_t base = -1;
    auto r = replica_wire::decodeBeginDelta(payload, service_->options_.maxShardBytes, &base);
    delta_ = true;  // Chunks are drained against the ranges (none when refused).
    base_ = service_->find(r.owner, base);
    if (!base_ || !base_->layout.sameShape(r.layout)) {
      incomingError_ = std::string(replica_wire::kNoBase) + "worker " +
                       std::to_string(service_->self_) + " holds no replica of worker " +
                       std::to_string(r.owner) + " at version " + std::to_string(base) +
                       (base_ ? " of that layout" : "");
      base_.reset();
      return;
    }
    // base_ is held, so claimSlot does not pick its slot (with versionsKept 1 there is none
    // other, and the version comes whole).
    incoming_ = service_->claimSlot(r.owner, r.step, r.layout);
    if (!incoming_) {
      incomingError_ = std::string(replica_wire::kNoBase) + "no free replica slot for worker " +
                       std::to_string(r.owner) + " besides its version " + std::to_string(base);
      base_.reset();
      return;
    }
    ranges_ = r.layout.changedSince(base_->layout);
    uint64_t at = 0;
    auto copyUpTo = [&](uint64_t end) {
      if (end > at) std::memcpy(incoming_->data() + at, base_->data() + at, end - at);
    };
    for (const auto& [first, bytes] : ranges_) {
      copyUpTo(first);
      at = first + bytes;
    }
    copyUpTo(r.layout.totalBytes);
    base_.reset();
  }

  Impl* const service_;  // Outlives its sessions: ~Impl closes them and joins the io thread.
  std::shared_ptr<HostShard> incoming_;
  std::unique_ptr<IncrementalVerify> verify_;  // Of incoming_ (whole versions); reset with it.
  uint64_t nextOffset_ = 0;
  std::string incomingError_;
  // A delta version: its changed ranges (offset, bytes), the one being filled and how far.
  bool delta_ = false;
  std::shared_ptr<const HostShard> base_;
  std::vector<std::pair<uint64_t, uint64_t>> ranges_;
  size_t range_ = 0;
  uint64_t inRange_ = 0;
};

std::shared_ptr<transport::ChannelHandler> ReplicaService::Impl::makeSession() {
  return std::make_shared<Session>(this);
}

ReplicaService::ReplicaService(int self, ReplicaServiceOptions options)
    : impl_(std::make_unique<Impl>(this, self, std::move(options))) {
  port_ = impl_->port();
}

ReplicaService::~ReplicaService() = default;

std::string ReplicaService::address() const { return "127.0.0.1:" + std::to_string(port_); }

std::shared_ptr<const HostShard> ReplicaService::find(int owner, int64_t step) const {
  return impl_->find(owner, step);
}

std::vector<std::shared_ptr<const HostShard>> ReplicaService::all() const { return impl_->all(); }

uint64_t ReplicaService::bytesAllocated() const { return impl_->bytesAllocated(); }

size_t ReplicaService::openConnections() const { return impl_->openConnections(); }

int64_t ReplicaService::droppedConnections() const { return impl_->dropped_.load(); }

void ReplicaService::setOwnShards(
    std::function<std::vector<std::shared_ptr<const HostShard>>()> fn) {
  impl_->setOwnShards(std::move(fn));
}

// ---------------------------------------------------------------------------------------
// Client.

class ReplicaClient::Conn {
 public:
  Conn(int peer, const std::string& address, const ReplicaClientOptions& options)
      : conn_(replica_wire::clientRules(options.token),
              "replica service of worker " + std::to_string(peer) + " at " + address) {
    if (options.token == 0) {
      SINEW_THROW(InvalidArgument, "ReplicaClientOptions::token is 0: pass the job token");
    }
    auto colon = address.rfind(':');
    if (colon == std::string::npos) {
      SINEW_THROW(InvalidArgument, "replica address '", address, "' is not host:port");
    }
    host_ = address.substr(0, colon);
    const std::string portText = address.substr(colon + 1);
    char* end = nullptr;
    errno = 0;
    unsigned long port = std::strtoul(portText.c_str(), &end, 10);
    if (portText.empty() || *end != '\0' || errno != 0 || port == 0 || port > 65535) {
      SINEW_THROW(InvalidArgument, "replica address '", address, "': port '", portText,
                  "' is not in [1, 65535]");
    }
    port_ = static_cast<uint16_t>(port);
    timeout_ = options.connectTimeout;
  }

  transport::Connection& get() {
    if (conn_.peerClosedWhileIdle()) conn_.close();
    if (!conn_.isOpen()) conn_.connect(host_, port_, Clock::now() + timeout_);
    return conn_;
  }

 private:
  transport::Connection conn_;
  std::string host_;
  uint16_t port_ = 0;
  std::chrono::milliseconds timeout_{0};
};

ReplicaClient::ReplicaClient(int peer, std::string address, ReplicaClientOptions options)
    : peer_(peer), address_(std::move(address)), options_(std::move(options)) {}

ReplicaClient::~ReplicaClient() = default;

ReplicaClient::Conn& ReplicaClient::connection() {
  if (!conn_) conn_ = std::make_unique<Conn>(peer_, address_, options_);
  return *conn_;
}

namespace {

// Runs fn; a broken connection becomes PeerLost naming the peer, a deadline Timeout; the
// connection is dropped either way (the next request reconnects).
template <typename Drop, typename Fn>
auto talk(Drop dropConnection, int peer, const std::string& address, const std::string& what, Fn fn)
    -> decltype(fn()) {
  try {
    return fn();
  } catch (const Timeout& e) {
    dropConnection();
    SINEW_THROW(Timeout, what, " with worker ", peer, " at ", address, ": ", e.what());
  } catch (const IoError& e) {
    dropConnection();
    throw PeerLost(
        peer, what + " with worker " + std::to_string(peer) + " at " + address + ": " + e.what());
  } catch (const Corruption&) {
    dropConnection();
    throw;
  }
}

std::string text(const std::vector<uint8_t>& b) { return std::string(b.begin(), b.end()); }

}  // namespace

std::string ReplicaClient::send(const HostShard& shard,
                                const std::vector<std::pair<uint64_t, uint64_t>>* ranges,
                                int64_t base, uint64_t* sent) {
  const std::string what = "replicating worker " + std::to_string(shard.owner) +
                           "'s shard of version " + std::to_string(shard.step);
  *sent = 0;
  return talk(
      [this] { conn_.reset(); }, peer_, address_, what,
      [&] {
        transport::Connection& c = connection().get();
        auto deadline = [&] { return Clock::now() + options_.timeout; };
        if (ranges != nullptr) {
          c.send(static_cast<uint8_t>(Type::kBeginDelta), 0,
                 replica_wire::encodeBeginDelta(shard.owner, shard.step, base, shard.layout),
                 deadline());
        } else {
          std::vector<uint8_t> begin = replica_wire::encodeShardId(shard.owner, shard.step);
          std::string layout = shard.layout.toJson();
          begin.insert(begin.end(), layout.begin(), layout.end());
          c.send(static_cast<uint8_t>(Type::kBegin), 0, begin, deadline());
        }
        const std::vector<std::pair<uint64_t, uint64_t>> whole = {{0, shard.layout.totalBytes}};
        int64_t index = 0;
        // Each chunk lies within one range: the service maps them onto the ranges in order.
        for (const auto& [first, bytes] : ranges != nullptr ? *ranges : whole) {
          for (uint64_t off = 0; off < bytes; off += options_.chunkBytes, ++index) {
            if (options_.beforeChunk) options_.beforeChunk();
            const size_t n =
                static_cast<size_t>(std::min<uint64_t>(options_.chunkBytes, bytes - off));
            c.send(static_cast<uint8_t>(Type::kChunk), 0, {{shard.data() + first + off, n}},
                   deadline());
            *sent += n;
            if (options_.afterChunk) options_.afterChunk(index);
          }
        }
        c.send(static_cast<uint8_t>(Type::kEnd), 0, std::vector<uint8_t>(), deadline());
        transport::FrameHeader h = c.readHeader(deadline());
        if (static_cast<Type>(h.type) != Type::kAck) {
          c.close();
          SINEW_THROW(Corruption, c.name(), " answered a shard with a ",
                      replica_wire::answerName(h.type), " message");
        }
        return text(c.readPayload(h, deadline()));
      });
}

uint64_t ReplicaClient::put(const HostShard& shard) {
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<Acked> base = std::move(acked_);
  acked_.reset();  // Set again only once this version is acknowledged.
  const bool delta = options_.incremental && noBase_ < 2 && base && base->owner == shard.owner &&
                     base->step < shard.step && shard.layout.sameShape(base->layout);
  uint64_t sent = 0, total = 0;
  std::string ack;
  if (delta) {
    const auto ranges = shard.layout.changedSince(base->layout);
    ack = send(shard, &ranges, base->step, &sent);
    if (ack.rfind(replica_wire::kNoBase, 0) == 0) {  // The peer lost it: send it whole.
      ++noBase_;
      total += sent;
      ack = send(shard, nullptr, -1, &sent);
    } else {
      noBase_ = 0;
    }
  } else {
    ack = send(shard, nullptr, -1, &sent);
  }
  total += sent;
  if (!ack.empty()) {
    SINEW_THROW(Corruption, "worker ", peer_, " rejected the replica of worker ", shard.owner,
                "'s shard of version ", shard.step, ": ", ack);
  }
  acked_ = Acked{shard.owner, shard.step, shard.layout};
  return total;
}

std::vector<ReplicaInfo> ReplicaClient::list() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint8_t> payload =
      talk([this] { conn_.reset(); }, peer_, address_, "listing replicas",
           [&] {
             transport::Connection& c = connection().get();
             auto deadline = Clock::now() + options_.timeout;
             c.send(static_cast<uint8_t>(Type::kList), 0, std::vector<uint8_t>(), deadline);
             transport::FrameHeader h = c.readHeader(deadline);
             if (static_cast<Type>(h.type) != Type::kListReply) {
               c.close();
               SINEW_THROW(Corruption, c.name(), " answered list with a ",
                           replica_wire::answerName(h.type), " message");
             }
             return c.readPayload(h, deadline);
           });
  std::vector<ReplicaInfo> out;
  for (auto& e : replica_wire::decodeList(payload, "worker " + std::to_string(peer_))) {
    out.push_back({e.owner, e.step, std::move(e.layout)});
  }
  return out;
}

std::shared_ptr<HostShard> ReplicaClient::get(int owner, int64_t step,
                                              const std::vector<std::string>& layers) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string what =
      "fetching " +
      (layers.empty() ? std::string() : std::to_string(layers.size()) + " layers of ") + "worker " +
      std::to_string(owner) + "'s shard of version " + std::to_string(step);
  std::string notHeld;  // The peer's answer when it does not hold the shard.
  auto shard =
      talk([this] { conn_.reset(); }, peer_, address_, what,
           [&]() -> std::shared_ptr<HostShard> {
             transport::Connection& c = connection().get();
             auto deadline = [&] { return Clock::now() + options_.timeout; };
             if (layers.empty()) {
               c.send(static_cast<uint8_t>(Type::kGet), 0, replica_wire::encodeShardId(owner, step),
                      deadline());
             } else {
               c.send(static_cast<uint8_t>(Type::kGetLayers), 0,
                      replica_wire::encodeGetLayers(owner, step, layers), deadline());
             }
             transport::FrameHeader h = c.readHeader(deadline());
             if (static_cast<Type>(h.type) == Type::kError) {
               notHeld = text(c.readPayload(h, deadline()));
               return nullptr;
             }
             if (static_cast<Type>(h.type) != Type::kGetReply) {
               c.close();
               SINEW_THROW(Corruption, c.name(), " answered get with a ",
                           replica_wire::answerName(h.type), " message");
             }
             ShardLayout layout = ShardLayout::fromJson(text(c.readPayload(h, deadline())));
             auto shard = std::make_shared<HostShard>(layout.totalBytes, false);
             shard->owner = owner;
             shard->step = step;
             shard->layout = std::move(layout);
             for (uint64_t off = 0; off < shard->layout.totalBytes;) {
               transport::FrameHeader d = c.readHeader(deadline());
               if (static_cast<Type>(d.type) != Type::kData || d.length == 0 ||
                   d.length > shard->layout.totalBytes - off) {
                 c.close();
                 SINEW_THROW(Corruption, c.name(), " sent a ", replica_wire::answerName(d.type),
                             " message of ", d.length, " bytes at offset ", off, " of a ",
                             shard->layout.totalBytes, "-byte shard");
               }
               c.readInto(shard->data() + off, d.length, deadline());  // Straight into the shard.
               off += d.length;
             }
             shard->complete = true;
             return shard;
           });
  if (!shard) SINEW_THROW(IoError, notHeld);
  return shard;
}

}  // namespace checkpoint
}  // namespace sinew
