#pragma once

// Lanes: a Gloo communicator's direct data connections (docs/collectives.md, "Lanes"). One
// plain TCP socket per peer, non-blocking, read and written only by the thread running the
// operation, so that a transfer costs no hand-over to Gloo's loop thread. The Gloo pairs stay
// for everything else (the control slot and its watchers, the ring collectives, point to
// point); a lane carries only the bulk bytes of the operations that use it.
//
// Set-up: every member listens on an ephemeral port of its host and publishes
// "lane/<rank>" = "<address> <port> <nonce>" (the numeric address it bound) in the
// communicator's store namespace; the nonce is
// 64 random bits, so only a process that can read the store (which takes the job token) can
// open a lane. The higher rank of each pair connects and sends a hello frame (Sinew's frame
// header, service "collective lane", the listener's nonce as token, the epoch, its rank and
// the direction as payload), once for each direction; the listener checks the header before it
// allocates anything, answers with a welcome frame carrying the connector's nonce, and the
// connector checks that. A connection that fails the check is closed and the listener keeps
// accepting until its deadline. The listener reads hellos side by side, each within 2 s, at
// most 64 waiting at once (a newer connection evicts the oldest): a silent stranger delays no
// member.
//
// The same set-up also makes the connections of Gloo's pairs (Purpose::kGlooPairs: keys
// "pair/<rank>", one connection per pair, direction 2 in the hello), which the pairs adopt
// (gloo/pair_mesh.h) instead of listening for whoever connects first.
//
// Thread safety: fd() and the set-up are for the owner; wake() may be called from any thread.

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "sinew/store.h"

namespace sinew {
namespace collectives {

class Lanes {
 public:
  using Clock = std::chrono::steady_clock;
  // kData: the lanes, two connections per pair (sendFd, recvFd). kGlooPairs: one connection
  // per pair for Gloo's pair to adopt (takePairFd).
  enum class Purpose { kData, kGlooPairs };

  // Connects rank `rank` of `size` to every other rank; `store` is the communicator's own
  // namespace (keys "lane/<rank>"). `describe` prefixes error messages; `workerOf` names a
  // rank's worker in them. Every wait goes in slices of 50 ms; between them `cancelled` (may be
  // empty) is asked whether to give up (Aborted), and `store` gets a 1 ms wait on this rank's
  // own key, so a store that gives up when its epoch is over can do so. Throws Timeout (a
  // member did not appear or connect in time), IoError (a socket call failed) naming the peer,
  // Aborted (cancelled), or what the store throws.
  //
  // `kept`, indexed by rank: connections this rank already has (kept from the communicator
  // before: docs/collectives.md, "Repair"), as (sendFd, recvFd), or for Purpose::kGlooPairs
  // (pair connection, -1); -1 where there is none. The lanes own them from the start, and
  // only the pairs without one are connected (none at all: nothing listens or is published).
  //
  // `socketBufferBytes` > 0 gives every lane socket kernel buffers of that size each way
  // (SO_SNDBUF, SO_RCVBUF) where the system allows it (usableSocketBufferBytes), so that a new
  // connection carries bulk bytes at full speed at once instead of after the kernel's
  // autotuning has grown its buffers; 0 leaves the autotuning.
  Lanes(Store& store, int rank, int size, const std::string& host, int64_t epoch,
        Clock::time_point deadline, const std::string& describe,
        const std::function<int(int)>& workerOf, const std::function<bool()>& cancelled = {},
        int socketBufferBytes = 0, Purpose purpose = Purpose::kData,
        const std::vector<std::pair<int, int>>& kept = {});
  ~Lanes();
  Lanes(const Lanes&) = delete;
  Lanes& operator=(const Lanes&) = delete;

  // The buffer size the lanes set for a request of `requested` bytes: the request where the
  // kernel grants it whole each way (net.core.rmem_max and wmem_max are at least that much;
  // asked of the kernel on a scratch socket), else 0, and the kernel's autotuning stays:
  // where those limits are below the request, it would be cut down to them, capping the
  // window below what autotuning reaches. 0 also for a request above
  // kMaxLaneSocketBufferBytes.
  static int usableSocketBufferBytes(int requested);

  // The connected, non-blocking sockets (close-on-exec, TCP_NODELAY) this rank sends to
  // `peer` on and receives from it on. One connection per direction: a socket that both ends
  // write at once makes each end's writes wait for the socket's lock while the other's
  // segments are processed (measured: 1 MiB exchanges took 1.5-2x longer on one connection).
  int sendFd(int peer) const { return send_.at(peer); }
  int recvFd(int peer) const { return recv_.at(peer); }
  // Purpose::kGlooPairs: the connection to `peer`, which the caller now owns (-1 once taken).
  int takePairFd(int peer) {
    const int fd = send_.at(peer);
    send_.at(peer) = -1;
    return fd;
  }
  // This rank's nonce of the set-up, and `peer`'s (as published); 0 where no connection to
  // `peer` was made here (it was kept, or nothing was set up).
  uint64_t nonce() const { return nonce_; }
  uint64_t peerNonce(int peer) const { return peerNonce_.at(peer); }
  // Takes this rank's connections to `peer` (sendFd, recvFd), which the caller now owns; the
  // lanes no longer use them.
  std::pair<int, int> release(int peer) {
    std::pair<int, int> fds{send_.at(peer), recv_.at(peer)};
    send_.at(peer) = recv_.at(peer) = -1;
    return fds;
  }
  // Readable once wake() was called; never drained (a woken communicator is dead).
  int wakeFd() const { return wake_; }
  void wake();

 private:
  struct SetUp;  // what the steps of the set-up share (lanes.cc)
  // Step 2: connects to every lower rank, both directions.
  void connectLower(const SetUp& setUp);
  // Step 3: accepts both directions of every higher rank on `listener`.
  void acceptHigher(const SetUp& setUp, int listener);
  // Whether every connection to `peer` is made.
  bool connected(int peer) const;
  void closeAll();

  Purpose purpose_;
  std::vector<int> send_;
  std::vector<int> recv_;
  std::vector<uint64_t> peerNonce_;
  uint64_t nonce_ = 0;
  int wake_ = -1;
};

// The names of the lane frames' types (service "collective lane").
// Types: 1 hello (16-byte payload: the connector's rank, and 0 if the connector sends on the
// connection, 1 if it receives, 2 for a Gloo pair's connection), 2 welcome (no payload).
const char* laneFrameTypeName(uint8_t type);

}  // namespace collectives
}  // namespace sinew
