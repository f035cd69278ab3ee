#pragma once

// Peer replicas in host RAM (Gemini): a ReplicaService on every worker receives the shards
// of the workers it holds replicas for and serves them back for restores; a ReplicaClient
// sends a shard to one peer, lists a peer's replicas or fetches one. The messages are in
// docs/checkpoint_format.md ("Replication protocol"); they travel in frames of Sinew's one
// transport (collectives/transport/, docs/transport.md: job token checked first, read
// deadlines, idle timeout, connection cap), over connections of their own, not the
// training communicator, so replication never occupies the communicator's ordered
// operation stream. Shard bytes are streamed in chunks straight between the shard's memory
// and the socket, without copies.
//
// The service keeps, per owner, the `versionsKept` newest complete versions (default 2) in
// slots sized on the first version and reused afterwards; an incoming version is written
// into the slot of the oldest one, so the newest complete version survives a transfer
// that fails half way. A version becomes visible only when all its bytes arrived and every
// tensor's crc32c matched; only then is it acknowledged.
//
// Thread safety: every method of both classes may be called from any thread; one
// ReplicaClient runs one request at a time (it serializes callers).

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "sinew/checkpoint/shard.h"

namespace sinew {
namespace checkpoint {

constexpr std::chrono::milliseconds kDefaultReplicaIoTimeout{30000};

// Lets replication yield to training traffic: the trainer brackets its collectives with
// enter()/exit(); the replication thread calls waitIdle() between chunks.
// Thread safety: all methods from any thread.
class TrafficGate {
 public:
  void enter();
  void exit();
  // Returns when no collective is in flight, or after maxWait (so replication cannot
  // starve forever behind back-to-back collectives).
  void waitIdle(std::chrono::milliseconds maxWait);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int inFlight_ = 0;  // Guarded by mu_.
};

struct ReplicaServiceOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;  // 0 picks a free port.
  // The job token every request must carry. Required (non-zero).
  uint64_t token = 0;
  // Authenticated connections; those that have not shown the token yet are at most
  // maxPending (docs/transport.md, "Connection slots"). Both are lowered, and said so on
  // stderr, where the process's open-file limit cannot be raised to hold them.
  size_t maxConnections = 256;
  size_t maxPending = 256;
  // A connection with no request for this long is closed (clients reconnect).
  std::chrono::milliseconds idleTimeout{120000};
  // A frame's payload (a chunk of at most maxChunkBytes) must arrive within this.
  std::chrono::milliseconds frameTimeout{30000};
  uint32_t maxChunkBytes = 64u << 20;
  int versionsKept = 2;
  // Reject shards larger than this (a corrupt header must not allocate terabytes).
  uint64_t maxShardBytes = uint64_t{1} << 40;
};

class ReplicaService {
 public:
  // Binds and starts serving (one io thread). Throws InvalidArgument for a zero token,
  // IoError if it cannot listen.
  ReplicaService(int self, ReplicaServiceOptions options);
  ~ReplicaService();
  ReplicaService(const ReplicaService&) = delete;
  ReplicaService& operator=(const ReplicaService&) = delete;

  uint16_t port() const { return port_; }
  std::string address() const;  // "host:port"

  // The complete replica of owner's shard at step, or null.
  std::shared_ptr<const HostShard> find(int owner, int64_t step) const;
  // Every complete replica held.
  std::vector<std::shared_ptr<const HostShard>> all() const;
  // Also serve (list and get) the shards this returns: the worker's own snapshots, so a
  // restoring worker can fetch a live worker's shard from it. Set once, before peers
  // connect.
  void setOwnShards(std::function<std::vector<std::shared_ptr<const HostShard>>()> fn);
  uint64_t bytesReceived() const { return bytesReceived_.load(); }
  // Bytes of replica memory allocated (flat once every owner's slots exist).
  uint64_t bytesAllocated() const;
  // Connections open now, and connections dropped for a protocol violation or a timeout.
  size_t openConnections() const;
  int64_t droppedConnections() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
  uint16_t port_ = 0;
  std::atomic<uint64_t> bytesReceived_{0};
};

struct ReplicaClientOptions {
  // The job token (the service's). Required (non-zero).
  uint64_t token = 0;
  std::chrono::milliseconds timeout = kDefaultReplicaIoTimeout;  // Each request's I/O.
  // Connecting retries (the peer may still be starting) until this passes.
  std::chrono::milliseconds connectTimeout{5000};
  size_t chunkBytes = 4 << 20;
  // Called before each chunk (TrafficGate::waitIdle); may be empty.
  std::function<void()> beforeChunk;
  // Test hook: called after each chunk is sent with its index (a kill mid-transfer).
  std::function<void(int64_t chunk)> afterChunk;
  // Incremental versions (Check-N-Run): after the peer acknowledged a version of a shard, the
  // next version of the same layout is sent as a delta, only the tensors whose checksum
  // changed (ShardLayout::changedSince), and the peer copies the rest from its replica of the
  // acknowledged one; whole when the peer no longer holds it. A changed tensor whose crc32c
  // happens to equal the old one's (odds 2^-32 per changed tensor) is not sent.
  bool incremental = false;
};

struct ReplicaInfo {
  int owner = -1;
  int64_t step = -1;
  ShardLayout layout;
};

class ReplicaClient {
 public:
  // peer: the worker id served at address ("host:port"); named in PeerLost errors.
  ReplicaClient(int peer, std::string address, ReplicaClientOptions options);
  ~ReplicaClient();

  // Sends shard (with options.incremental, perhaps as a delta) and waits for the peer's
  // acknowledgement; returns the shard bytes sent. Throws PeerLost naming the peer if the
  // connection fails, Timeout, or Corruption if the peer's checksums disagreed.
  uint64_t put(const HostShard& shard);
  std::vector<ReplicaInfo> list();
  // Fetches owner's shard at step into new host memory: all of it, or with `layers` only
  // those of them it has (a shard laid out by ShardLayout::onlyLayers). Throws IoError if the
  // peer does not hold it; the caller verifies checksums (HostShard::verify).
  std::shared_ptr<HostShard> get(int owner, int64_t step,
                                 const std::vector<std::string>& layers = {});
  int peer() const { return peer_; }

 private:
  class Conn;
  const int peer_;
  const std::string address_;
  const ReplicaClientOptions options_;
  std::mutex mu_;
  std::unique_ptr<Conn> conn_;  // Guarded by mu_; reconnected after an error.
  // The last version the peer acknowledged (guarded by mu_): an incremental put's base.
  struct Acked {
    int owner = -1;
    int64_t step = -1;
    ShardLayout layout;
  };
  std::optional<Acked> acked_;
  // Deltas this peer refused in a row for want of their base (guarded by mu_): after two (a
  // service that keeps one version has no slot for a delta) versions go to it whole.
  int noBase_ = 0;
  Conn& connection();
  // One put: begin (a delta from `base` when `ranges` is given: only those bytes follow),
  // chunks, end; returns the ack's text (empty: accepted). *sent: the bytes sent.
  std::string send(const HostShard& shard, const std::vector<std::pair<uint64_t, uint64_t>>* ranges,
                   int64_t base, uint64_t* sent);
};

}  // namespace checkpoint
}  // namespace sinew
