#pragma once

// Internal: the Gloo backend's communicator (docs/collectives.md), in three files:
//   gloo/communicator.cc  its lifecycle: connecting the mesh and the lanes, the control slot's
//                         watchers and goodbyes, deadlines, failing and closing
//   gloo/ring.cc          the ring algorithms on Gloo's pairs: allreduce of three or more
//                         members, broadcast, allgather
//   gloo/lane_ops.cc      everything on the lanes: the two-member allreduce, and point to point,
//                         exchange and barrier (one implementation, exchangeOnLanes)
//
// Failure protocol:
//  1. After connecting, every member posts one 16-byte control receive from each peer
//     (slot kControlSlot) and a watcher thread waits on it.
//  2. A member whose communicator fails (deadline, abort(), lost peer, closed peer) sends
//     each live peer a Goodbye {kind, worker} on that slot before closing its sockets.
//  3. A watcher that receives a Goodbye records it; unless the kind is kClosed (an orderly
//     destruction) it fails the local communicator with the same cause. A watcher whose
//     receive fails because the peer's connection broke without a Goodbye declares that
//     peer lost (PeerLost naming its worker id).
//  4. Data buffers are created per direction and peer, so a broken connection surfacing in
//     a data wait names the peer; the verdict of that peer's watcher, which Gloo's pair
//     delivers before the error (same socket, in order), says whether it died or left. A lane
//     that breaks goes the same way (onPairError).
//  5. Failing interrupts the operation in flight (abortWaitRecv/abortWaitSend on Gloo's
//     buffers, the lanes' wake descriptor for a lane operation), so it returns within
//     milliseconds; the operation then sends the Goodbyes and closes.

#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/transport/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "sinew/base/little_endian.h"
#include "sinew/collectives/gloo/gloo_options.h"
#include "sinew/collectives/gloo/kept_links.h"
#include "sinew/collectives/gloo/lane_frame.h"
#include "sinew/collectives/gloo/lanes.h"
#include "sinew/collectives/gloo/parked_threads.h"
#include "sinew/communicator.h"

namespace sinew {
namespace collectives {
namespace gloo_backend {

using Clock = std::chrono::steady_clock;
using gloo::transport::UnboundBuffer;

// Waits are bounded by our own deadline timer, never by Gloo's timeout: a Gloo timeout
// closes every pair of the context, which peers would misread as our death.
constexpr std::chrono::milliseconds kForever{std::chrono::hours(24 * 365)};
// How long a failing member tries to deliver its Goodbyes before closing its sockets.
constexpr std::chrono::milliseconds kGoodbyeBudget{50};
// How long a data-path connection error waits for the peer's watcher verdict.
constexpr std::chrono::milliseconds kVerdictWait{1000};

constexpr uint64_t kControlSlot = uint64_t(1) << 62;
constexpr uint64_t kCollectiveSlotBase = uint64_t(1) << 40;

constexpr uint32_t kGoodbyeMagic = 0x53475942;  // "BYGS"

enum class GoodbyeKind : uint32_t { kClosed = 1, kPeerLost = 2, kTimeout = 3, kAborted = 4 };

// A control record on the wire: 16 bytes, little-endian like the lane frame (magic 4, kind 4,
// worker 8).
struct Goodbye {
  uint32_t magic;
  uint32_t kind;
  int64_t worker;

  static constexpr size_t kWireBytes = 16;
  void encode(uint8_t* p) const {
    ::sinew::detail::storeLe(p, magic, 4);
    ::sinew::detail::storeLe(p + 4, kind, 4);
    ::sinew::detail::storeLe(p + 8, static_cast<uint64_t>(worker), 8);
  }
  static Goodbye decode(const uint8_t* p) {
    return {static_cast<uint32_t>(::sinew::detail::loadLe(p, 4)),
            static_cast<uint32_t>(::sinew::detail::loadLe(p + 4, 4)),
            static_cast<int64_t>(::sinew::detail::loadLe(p + 8, 8))};
  }
};

// This process's Gloo TCP device for `hostname`, shared by all its communicators (and so is its
// loop thread, which serves every pair on it).
std::shared_ptr<gloo::transport::Device> sharedDevice(const std::string& hostname);

// Splits `numel` elements into `parts` blocks and each block into `segments` segments.
// Both ends of a transfer compute the same boundaries, so message sizes always match.
struct Segmenter;

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(const std::shared_ptr<Store>& store, const CommunicatorOptions& options,
                   const GlooOptions& gloo);
  ~GlooCommunicator() override;

  const char* backend() const override { return "gloo"; }
  std::string setUp() const override {
    return "kept " + std::to_string(linksKept_) + " links, made " +
           std::to_string(connectionsMade_) + " connections";
  }
  void allreduce(at::Tensor& t, ReduceOp op, std::chrono::milliseconds timeout) override;
  void broadcast(at::Tensor& t, int root, std::chrono::milliseconds timeout) override;
  void allgather(at::Tensor& output, const at::Tensor& input,
                 std::chrono::milliseconds timeout) override;
  void send(const at::Tensor& t, int dst, uint32_t tag, std::chrono::milliseconds timeout) override;
  void recv(at::Tensor& t, int src, uint32_t tag, std::chrono::milliseconds timeout) override;
  void exchange(const std::vector<P2POp>& ops, std::chrono::milliseconds timeout) override;
  void barrier(std::chrono::milliseconds timeout) override;
  void abort() override;
  std::exception_ptr error() const override;

 private:
  enum class VerdictKind { kNone, kGoodbye, kLost };
  struct Verdict {
    VerdictKind kind = VerdictKind::kNone;
    Goodbye goodbye{};
    std::string detail;
  };

  // Registers the buffers of the operation in flight and its deadline, so that a failure
  // or the timer can interrupt it; unregisters on destruction.
  class OpScope {
   public:
    OpScope(GlooCommunicator* comm, const char* name, std::chrono::milliseconds timeout,
            std::vector<UnboundBuffer*> buffers);
    ~OpScope();

   private:
    GlooCommunicator* const comm_;  // Outlives the scope: scopes live inside its methods.
  };

  // Lifecycle (gloo/communicator.cc).
  void connect(const std::shared_ptr<Store>& store);
  // Step 1 of connect: announces this member (with the links it kept for the members) and
  // waits for every member; then keeps the links whose other end kept them too, resynchronised
  // for this epoch (returned by rank; the others are closed). On failure the links go back to
  // the pool untouched and this throws.
  std::vector<Link> join(Store& store, std::map<int, Link> kept, Clock::time_point deadline);
  // Which members this one keeps its link to (by rank). Rank 0 reads every member's
  // announcement (keys; `own` is its own) and publishes "kept", the pairs of ranks whose two
  // ends announced the same link; the others read that if they are `holding` links.
  std::vector<bool> agreeOnLinks(Store& store, const std::vector<std::string>& keys,
                                 const std::string& own, bool holding);
  // Leaves the intact connections to the next communicator of this name (kept_links.h), and
  // closes the rest of pairFds_. REQUIRES: the pairs are closed (context_ gone).
  void leaveLinks();
  // Closes the pairs (each close waits for a tick of Gloo's loop, kept ticking meanwhile).
  void closeContext();
  void watch(int peer);
  void timerLoop();
  // Runs body as one operation; any exception it throws kills the communicator.
  void runOp(const char* name, std::chrono::milliseconds timeout,
             std::vector<UnboundBuffer*> buffers, const std::function<void()>& body);
  void waitRecv(UnboundBuffer* buf, int peer);
  void waitSend(UnboundBuffer* buf, int peer);
  [[noreturn]] void onPairError(int peer, const std::string& what);
  [[noreturn]] void throwFailure();
  // throwFailure() once a failure is recorded; the lane loops' check, without mu_.
  void throwIfFailed() {
    if (failed_.load(std::memory_order_acquire)) throwFailure();
  }
  // Interrupts the waits of the operation in flight on Gloo's buffers. REQUIRES: mu_ held.
  void interruptActiveLocked();
  // Records the first failure and interrupts the operation in flight. REQUIRES: mu_ held.
  void failLocked(std::exception_ptr error, GoodbyeKind kind, int worker);
  void fail(std::exception_ptr error, GoodbyeKind kind, int worker);
  // Tells every member whose connection works, and whose goodbye has not arrived, why this
  // one leaves (kind, naming worker), within kGoodbyeBudget (the timer's deadline; no
  // operation may be in flight). REQUIRES: context_, the timer running.
  void sayGoodbye(GoodbyeKind kind, int worker);
  // Sends Goodbyes, stops the threads and closes every connection. Idempotent.
  void shutdown();
  std::string describe() const;
  void validate(const at::Tensor& t, const char* op, bool needReduce) const;
  // Throws the recorded failure, if any; every operation starts with it.
  void checkAlive() {
    if (error()) {
      shutdown();  // Tells the peers, if that has not happened yet.
      throwFailure();
    }
  }
  std::unique_ptr<UnboundBuffer> buffer(void* ptr, size_t bytes) {
    return context_->createUnboundBuffer(ptr, bytes);
  }

  // Ring algorithms on Gloo's pairs (gloo/ring.cc).
  void ringReduceScatter(UnboundBuffer* sendBuf, UnboundBuffer* scratchBuf, char* data,
                         char* scratch, const Segmenter& seg, size_t esize, at::ScalarType type,
                         uint64_t slot);
  void ringAllgather(UnboundBuffer* sendBuf, UnboundBuffer* recvBuf, const Segmenter& seg,
                     size_t esize, int shift, uint64_t slot);
  uint64_t nextCollectiveSlot() { return kCollectiveSlotBase + 4 * collectiveSeq_++; }
  int left() const { return (rank_ + size() - 1) % size(); }
  int right() const { return (rank_ + 1) % size(); }

  // Operations on the lanes (gloo/lane_ops.cc).
  void allreduceTwo(at::Tensor& t, std::chrono::milliseconds timeout);
  // send, recv, exchange and barrier. REQUIRES: validated ops. `kind`: kPointToPoint, or
  // kBarrier for barrier()'s messages.
  void exchangeOnLanes(const std::vector<P2POp>& ops, const char* name,
                       std::chrono::milliseconds timeout, LaneKind kind);
  // The state of one exchangeOnLanes() call (gloo/lane_ops.cc).
  struct LaneExchange;
  // What can move now without blocking of x's sends to `peer` (x's sockets to poll otherwise);
  // returns whether any byte moved.
  bool pumpLaneSends(LaneExchange& x, int peer);
  // The same for x's receives from `peer`.
  bool pumpLaneReceives(LaneExchange& x, int peer);
  // The receive of x that a message from `peer` with header `f` fills: the first one from
  // that member with its tag not yet matched, or InvalidArgument naming the member.
  int matchLaneReceive(LaneExchange& x, int peer, const LaneFrame& f);
  // A received frame against what this member's call expects (kind, and for an allreduce
  // dtype, operation number and length): InvalidArgument or Corruption naming the peer.
  void checkFrame(const LaneFrame& in, const LaneFrame& expected, const char* op, int peer);

  const GlooOptions gloo_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;
  std::vector<uint8_t> controlIn_;  // One wire record per peer, written by Gloo.
  std::vector<std::unique_ptr<UnboundBuffer>> controlBufs_;
  std::vector<std::shared_ptr<ParkedThreads::Job>> watchers_;
  std::thread timer_;
  uint64_t collectiveSeq_ = 0;      // Operation thread only.
  std::atomic<int> waitingOn_{-1};  // Rank the operation thread waits for, or -1.

  // Direct connections to every member (docs/collectives.md, "Lanes"); null for one member.
  std::unique_ptr<Lanes> lanes_;
  // Repair (kept_links.h): whether connections outlive this communicator; by rank, a
  // descriptor of each Gloo pair's connection of our own (-1: none) and each link's id.
  const bool keep_;
  std::vector<int> pairFds_;
  std::vector<uint64_t> linkIds_;
  int64_t linksKept_ = 0;        // Set by connect().
  int64_t connectionsMade_ = 0;  // Set by connect().
  uint64_t laneSeq_ = 0;         // Operation thread only: two-member allreduces so far.
  uint64_t barrierSeq_ = 0;      // Operation thread only: barriers so far.
  // The receive ring of allreduceTwo, kept between operations (one runs at a time).
  std::vector<char> scratch_;
  std::atomic<bool> failed_{false};  // failure_ is set; read without mu_ by the lane loops.
  mutable std::mutex mu_;
  std::condition_variable cv_;
  // Guarded by mu_.
  std::exception_ptr failure_;
  GoodbyeKind failureKind_ = GoodbyeKind::kClosed;
  int failureWorker_ = -1;
  std::vector<Verdict> verdicts_;
  std::vector<UnboundBuffer*> active_;
  std::optional<Clock::time_point> deadline_;
  std::chrono::milliseconds activeTimeout_{0};
  const char* activeOp_ = nullptr;
  uint64_t opGeneration_ = 0;
  // When the timer thread will look at deadline_ next, or nothing while it waits for a
  // notification (no operation had a deadline when it last looked).
  std::optional<Clock::time_point> timerWake_;
  bool stopping_ = false;
  bool closed_ = false;
};

}  // namespace gloo_backend
}  // namespace collectives
}  // namespace sinew
