// Gloo backend of Communicator: ring collectives built on Gloo's TCP transport
// (gloo::transport::UnboundBuffer), so that every wait can be cut short by abort(), by
// the operation's deadline or by a peer's failure.
//
// Failure protocol (see also docs/collectives.md):
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
//     delivers before the error (same socket, in order), says whether it died or left.
//  5. Failing interrupts the operation in flight with abortWaitRecv/abortWaitSend, so it
//     returns within milliseconds; the operation then sends the Goodbyes and closes.

#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/tcp/loop.h>
#include <gloo/transport/unbound_buffer.h>

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <dlfcn.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "sinew/base/error.h"
#include "sinew/base/little_endian.h"
#include "sinew/collectives/gloo/lanes.h"
#include "sinew/collectives/prefix_store.h"
#include "sinew/communicator.h"

namespace sinew {
namespace collectives {
namespace {

using Clock = std::chrono::steady_clock;
using gloo::transport::UnboundBuffer;

// Waits are bounded by our own deadline timer, never by Gloo's timeout: a Gloo timeout
// closes every pair of the context, which peers would misread as our death.
constexpr std::chrono::milliseconds kForever{std::chrono::hours(24 * 365)};
// How long a failing member tries to deliver its Goodbyes before closing its sockets.
constexpr std::chrono::milliseconds kGoodbyeBudget{50};
// How long a data-path connection error waits for the peer's watcher verdict.
constexpr std::chrono::milliseconds kVerdictWait{1000};
// Ring collectives move data in segments of at most this many bytes so that sending,
// receiving and reducing overlap.
constexpr size_t kSegmentBytes = 512 * 1024;

constexpr uint64_t kControlSlot = uint64_t(1) << 62;
constexpr uint64_t kP2PSlotBase = uint64_t(1) << 61;
constexpr uint64_t kCollectiveSlotBase = uint64_t(1) << 40;
// allreduceTwo's lane (docs/collectives.md, "Lanes"): the header's magic ("SNWL"); the receive
// ring, small enough to stay in the L2 cache between the recv and the add (a 2 MiB ring made every
// size about half as fast); the most one send call moves (each receive call asks for the ring's
// free space, up to its end and the message's); the most one add covers; how long an operation with
// nothing to do spins before it sleeps in poll(). Send calls of 512 KiB against 32 KiB, taking
// turns in the same hour with receive calls for the ring's free space (sinew-bench-allreduce
// --ranks 2, same launch, MPI over TCP / Sinew): at or above 1.0 at every size from 1 to 64 MiB in
// eight of ten runs (0.95 and 0.77 at 2 MiB in the others), against none of eight with 32 KiB calls
// both ways (0.69-1.17 at 1-4 MiB; bench/RESULTS.md, "Call sizes, again").
constexpr uint32_t kLaneMagic = 0x4C574E53;
constexpr size_t kLaneScratchBytes = 128 << 10;
constexpr size_t kLaneSendCallBytes = 512 << 10;
constexpr size_t kLaneReduceBytes = 128 << 10;
constexpr std::chrono::microseconds kLaneSpin{200};
// Point-to-point messages on the lanes (CommunicatorOptions::p2pLanes): each message's 16-byte
// header (magic "SNWP" 4, tag 4, bytes 8, little-endian; LaneMessageHeader), and the most one send
// call moves is kLaneSendCallBytes (receive calls ask for the rest of the message): 32 KiB until
// 2026-11-27; 512 KiB since, as allreduceTwo's: the same hour, sinew-bench-pipeline's 16 MiB
// activation transfer took 4.4-6.0 ms with 512 KiB calls against 5.8-7.2 with 32 KiB and 6.3-11.4
// with 128 KiB (four launches each), and the largest layer copy of the width-256 copy job moved at
// 1.45-3.39 GB/s (median 1.64, 13 jobs) against 0.83-1.50 (median 1.30, 13 jobs) with 32 KiB.
constexpr uint32_t kLaneP2PMagic = 0x50574E53;
// A barrier on the lanes is a message of 8 bytes to every other member, with this magic
// ("SNWB") and the barrier's number as its tag.
constexpr uint32_t kLaneBarrierMagic = 0x42574E53;

// What a lane message with this magic is, for errors; null for an unknown magic.
const char* laneMessageKind(uint32_t magic) {
  switch (magic) {
    case kLaneMagic:
      return "an allreduce's header";
    case kLaneP2PMagic:
      return "a point-to-point message";
    case kLaneBarrierMagic:
      return "a barrier message";
  }
  return nullptr;
}

// The header of a point-to-point or barrier message on the lanes: 16 bytes, little-endian like
// LaneHeader (magic 4, tag 4, bytes 8).
struct LaneMessageHeader {
  uint32_t magic;  // kLaneP2PMagic or kLaneBarrierMagic
  uint32_t tag;
  uint64_t bytes;

  static constexpr size_t kWireBytes = 16;
  void encode(uint8_t* p) const {
    ::sinew::detail::storeLe(p, magic, 4);
    ::sinew::detail::storeLe(p + 4, tag, 4);
    ::sinew::detail::storeLe(p + 8, bytes, 8);
  }
  static LaneMessageHeader decode(const uint8_t* p) {
    return {static_cast<uint32_t>(::sinew::detail::loadLe(p, 4)),
            static_cast<uint32_t>(::sinew::detail::loadLe(p + 4, 4)),
            ::sinew::detail::loadLe(p + 8, 8)};
  }
};

// What each member sends ahead of an allreduce's bytes on the lane: 24 bytes, little-endian
// like the store's, the frames' and the lane handshake's fields (magic 4, dtype 4, seq 8,
// bytes 8).
struct LaneHeader {
  uint32_t magic;
  uint32_t dtype;  // at::ScalarType
  uint64_t seq;    // lane operations so far
  uint64_t bytes;

  static constexpr size_t kWireBytes = 24;
  void encode(uint8_t* p) const {
    ::sinew::detail::storeLe(p, magic, 4);
    ::sinew::detail::storeLe(p + 4, dtype, 4);
    ::sinew::detail::storeLe(p + 8, seq, 8);
    ::sinew::detail::storeLe(p + 16, bytes, 8);
  }
  static LaneHeader decode(const uint8_t* p) {
    return {static_cast<uint32_t>(::sinew::detail::loadLe(p, 4)),
            static_cast<uint32_t>(::sinew::detail::loadLe(p + 4, 4)),
            ::sinew::detail::loadLe(p + 8, 8), ::sinew::detail::loadLe(p + 16, 8)};
  }
};

constexpr uint32_t kGoodbyeMagic = 0x53475942;  // "BYGS"

enum class GoodbyeKind : uint32_t { kClosed = 1, kPeerLost = 2, kTimeout = 3, kAborted = 4 };

// A control record on the wire: 16 bytes, little-endian like the lane header (magic 4, kind 4,
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

// Keeps Gloo's TCP loop ticking while this thread connects or closes pairs. The loop
// (gloo/transport/tcp/loop.cc) makes a thread that unregisters a descriptor wait for its next
// tick, and an idle loop ticks once every 10 ms (its epoll_wait timeout). Pair::connect
// unregisters its listening socket on the connecting side of every pair, and closing a pair
// unregisters its socket, so connecting a mesh took about 10 ms per peer (docs/collectives.md,
// "Gloo's loop tick", has the measurements). While a kicker lives, an eventfd
// registered with the loop is written every kKickInterval, so every such wait ends within
// that. The eventfd itself is unregistered by the loop thread (from its handler, which does not
// wait for a tick): unregistered from this thread, the wait would be the idle 10 ms again,
// the eventfd no longer being there to wake the loop.
class LoopKicker {
 public:
  static constexpr std::chrono::microseconds kKickInterval{200};
  static constexpr std::chrono::seconds kUnregisterWait{1};

  // Does nothing (the loop then keeps its own pace) if `device` is not Gloo's TCP device or
  // the eventfd, its registration or the kick thread cannot be made. Never throws.
  explicit LoopKicker(const std::shared_ptr<gloo::transport::Device>& device) noexcept {
    auto tcp = std::dynamic_pointer_cast<gloo::transport::tcp::Device>(device);
    if (!tcp) return;
    auto drain = std::make_unique<Drain>();
    drain->device = tcp.get();
    drain->fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (drain->fd < 0) return;
    try {
      kicker_ = std::thread([d = drain.get()] {
        std::unique_lock<std::mutex> lock(d->mu);
        while (!d->stop) {
          lock.unlock();  // The loop thread's handler takes mu: never make it wait on a write.
          kick(d->fd);
          lock.lock();
          if (d->stop) break;
          d->cv.wait_for(lock, kKickInterval);
        }
      });
    } catch (const std::exception&) {
      ::close(drain->fd);
      return;
    }
    try {
      tcp->registerDescriptor(drain->fd, EPOLLIN, drain.get());
    } catch (const std::exception&) {
      stopKicking(*drain);
      ::close(drain->fd);
      return;
    }
    device_ = std::move(tcp);
    drain_ = std::move(drain);
  }
  ~LoopKicker() {
    if (!drain_) {
      if (kicker_.joinable()) kicker_.join();
      return;
    }
    bool unregistered;
    {
      std::unique_lock<std::mutex> lock(drain_->mu);
      drain_->stop = true;  // The kick thread ends; the loop thread unregisters the eventfd.
      drain_->cv.notify_all();
      kick(drain_->fd);
      unregistered =
          drain_->cv.wait_for(lock, kUnregisterWait, [&] { return drain_->unregistered; });
      // A loop this slow may still call the handler: it and the eventfd are left registered
      // and never freed (Gloo's own wait for a tick has no deadline either).
      if (!unregistered) drain_->abandoned = true;
    }
    kicker_.join();
    if (unregistered) {
      ::close(drain_->fd);
    } else {
      drain_.release();
    }
  }
  LoopKicker(const LoopKicker&) = delete;
  LoopKicker& operator=(const LoopKicker&) = delete;

 private:
  static void kick(int fd) {
    const uint64_t one = 1;
    if (::write(fd, &one, sizeof(one)) < 0) {
      // The counter is full: the loop has a wake-up pending anyway.
    }
  }

  // Runs on the loop thread: empties the eventfd (the loop is level-triggered), and once the
  // kicker stops, unregisters it.
  struct Drain : gloo::transport::tcp::Handler {
    gloo::transport::tcp::Device* device = nullptr;
    int fd = -1;
    std::mutex mu;
    std::condition_variable cv;
    bool stop = false;          // Guarded by mu.
    bool unregistered = false;  // Guarded by mu.
    bool abandoned = false;     // Guarded by mu: the kicker gave up waiting.
    void handleEvents(int) override {
      uint64_t v;
      while (::read(fd, &v, sizeof(v)) == static_cast<ssize_t>(sizeof(v))) {
      }
      std::lock_guard<std::mutex> lock(mu);
      if (stop && !unregistered && !abandoned) {
        device->unregisterDescriptor(fd, this);  // On the loop thread: no wait.
        unregistered = true;
        cv.notify_all();
      }
    }
  };

  void stopKicking(Drain& d) {
    {
      std::lock_guard<std::mutex> lock(d.mu);
      d.stop = true;
    }
    d.cv.notify_all();
    if (kicker_.joinable()) kicker_.join();
  }

  std::shared_ptr<gloo::transport::tcp::Device> device_;
  std::unique_ptr<Drain> drain_;
  std::thread kicker_;
};

// Adapts a sinew Store to Gloo's rendezvous Store interface.
class GlooStoreAdapter : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(std::shared_ptr<collectives::Store> store, Clock::time_point deadline)
      : store_(std::move(store)), deadline_(deadline) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, Bytes(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    Bytes b = store_->get(key, remaining());
    return std::vector<char>(b.begin(), b.end());
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys, remaining()); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds&) override {
    store_->wait(keys, remaining());
  }

 private:
  std::chrono::milliseconds remaining() const {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now());
    return std::max(left, std::chrono::milliseconds(1));
  }
  std::shared_ptr<collectives::Store> store_;
  Clock::time_point deadline_;
};

// Splits `numel` elements into `parts` blocks and each block into `segments` segments.
// Both ends of a transfer compute the same boundaries, so message sizes always match.
struct Segmenter {
  size_t numel;
  size_t parts;
  size_t segments;

  size_t blockBegin(size_t b) const { return numel * b / parts; }
  // Elements of the largest segment of any block.
  size_t maxSegment() const {
    size_t most = 0;
    for (size_t b = 0; b < parts; ++b) {
      for (size_t s = 0; s < segments; ++s) {
        auto [x, y] = segment(b, s);
        most = std::max(most, y - x);
      }
    }
    return most;
  }
  std::pair<size_t, size_t> segment(size_t block, size_t s) const {
    size_t begin = blockBegin(block);
    size_t len = blockBegin(block + 1) - begin;
    return {begin + len * s / segments, begin + len * (s + 1) / segments};
  }
};

size_t segmentsFor(size_t maxBlockBytes) {
  return std::max<size_t>(1, (maxBlockBytes + kSegmentBytes - 1) / kSegmentBytes);
}

// A spin-wait hint to the CPU (x86 PAUSE): lets a hyperthread sibling run.
inline void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Blocks of a fixed 64 bytes' worth of elements, which the compiler turns into vector adds even
// at -O2 (its cheap cost model vectorises only loops with a known trip count and no aliasing),
// then the tail. Twice as fast as the plain loop on the allreduce bench's 16 MiB.
template <typename T>
void addInto(T* __restrict dst, const T* __restrict src, size_t n) {
  constexpr size_t kBlock = 64 / sizeof(T);
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t k = 0; k < kBlock; ++k) dst[i + k] += src[i + k];
  }
  for (; i < n; ++i) dst[i] += src[i];
}

template <typename T>
void addIntoViaFloat(T* dst, const T* src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    dst[i] = static_cast<T>(static_cast<float>(dst[i]) + static_cast<float>(src[i]));
  }
}

void reduceSum(at::ScalarType type, void* dst, const void* src, size_t n) {
  switch (type) {
    case at::kFloat:
      return addInto(static_cast<float*>(dst), static_cast<const float*>(src), n);
    case at::kDouble:
      return addInto(static_cast<double*>(dst), static_cast<const double*>(src), n);
    case at::kLong:
      return addInto(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), n);
    case at::kHalf:
      return addIntoViaFloat(static_cast<c10::Half*>(dst), static_cast<const c10::Half*>(src), n);
    case at::kBFloat16:
      return addIntoViaFloat(static_cast<c10::BFloat16*>(dst),
                             static_cast<const c10::BFloat16*>(src), n);
    default:
      SINEW_THROW(InvalidArgument, "allreduce: unsupported dtype ", c10::toString(type));
  }
}

bool reducible(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kLong || t == at::kHalf ||
         t == at::kBFloat16;
}

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(const std::shared_ptr<Store>& store, const CommunicatorOptions& options);
  ~GlooCommunicator() override;

  const char* backend() const override { return "gloo"; }
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

  void connect(const std::shared_ptr<Store>& store);
  // Closes the pairs (each close waits for a tick of Gloo's loop, kept ticking meanwhile).
  void closeContext();
  void watch(int peer);
  void timerLoop();

  // Runs body as one operation; any exception it throws kills the communicator.
  template <typename F>
  void runOp(const char* name, std::chrono::milliseconds timeout,
             std::vector<UnboundBuffer*> buffers, F&& body);

  std::unique_ptr<UnboundBuffer> buffer(void* ptr, size_t bytes) {
    return context_->createUnboundBuffer(ptr, bytes);
  }
  void allreduceTwo(at::Tensor& t, std::chrono::milliseconds timeout);
  // send, recv and exchange with CommunicatorOptions::p2pLanes. REQUIRES: validated ops.
  // `kind`: kLaneP2PMagic, or kLaneBarrierMagic for barrier()'s messages.
  void exchangeOnLanes(const std::vector<P2POp>& ops, const char* name,
                       std::chrono::milliseconds timeout, uint32_t kind = kLaneP2PMagic);
  bool p2pOnLanes() const { return options_.p2pLanes && lanes_ != nullptr; }
  void checkLaneHeader(const LaneHeader& in, const LaneHeader& out, int peer);
  void waitRecv(UnboundBuffer* buf, int peer);
  void waitSend(UnboundBuffer* buf, int peer);
  [[noreturn]] void onPairError(int peer, const std::string& what);
  [[noreturn]] void throwFailure();

  // Records the first failure and interrupts the operation in flight. REQUIRES: mu_ held.
  void failLocked(std::exception_ptr error, GoodbyeKind kind, int worker);
  void fail(std::exception_ptr error, GoodbyeKind kind, int worker);
  // Sends Goodbyes, stops the threads and closes every connection. Idempotent.
  void shutdown();

  std::string describe() const;
  void validate(const at::Tensor& t, const char* op, bool needReduce) const;

  void ringReduceScatter(UnboundBuffer* sendBuf, UnboundBuffer* scratchBuf, char* data,
                         char* scratch, const Segmenter& seg, size_t esize, at::ScalarType type,
                         uint64_t slot);
  void ringAllgather(UnboundBuffer* sendBuf, UnboundBuffer* recvBuf, const Segmenter& seg,
                     size_t esize, int shift, uint64_t slot);
  // Throws the recorded failure, if any; every operation starts with it.
  void checkAlive() {
    if (error()) {
      shutdown();  // Tells the peers, if that has not happened yet.
      throwFailure();
    }
  }
  uint64_t nextCollectiveSlot() { return kCollectiveSlotBase + 4 * collectiveSeq_++; }

  int left() const { return (rank_ + size() - 1) % size(); }
  int right() const { return (rank_ + 1) % size(); }

  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::vector<uint8_t> controlIn_;  // One wire record per peer, written by Gloo.
  std::vector<std::unique_ptr<UnboundBuffer>> controlBufs_;
  std::vector<std::thread> watchers_;
  std::thread timer_;
  uint64_t collectiveSeq_ = 0;      // Operation thread only.
  std::atomic<int> waitingOn_{-1};  // Rank the operation thread waits for, or -1.

  // Direct connections to every member: two members' (allreduceTwo), or any size's with
  // p2pLanes (exchangeOnLanes); null otherwise.
  std::unique_ptr<Lanes> lanes_;
  uint64_t laneSeq_ = 0;     // Operation thread only.
  uint64_t barrierSeq_ = 0;  // Operation thread only: barriers on the lanes so far.
  // The receive ring of allreduceTwo, kept between operations (one runs at a time).
  std::vector<char> scratch_;
  std::atomic<bool> failed_{false};  // failure_ is set; read without mu_ by the lane loop.
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

// Gloo's TCP pairs write with writev, which raises SIGPIPE when the peer's socket is gone.
// A dead peer must surface as PeerLost, not kill this process, so SIGPIPE is ignored when it
// still has its default action (a handler the program installed is left alone), as c10d does.
void ignoreSigpipe() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      ::signal(SIGPIPE, SIG_IGN);
    }
  });
}

// This process's Gloo TCP device for `hostname`, shared by all its communicators. A device
// owns an epoll loop thread, which its destructor joins, and an idle loop notices only at its
// next 10 ms timeout: with a device per communicator, every communicator destroyed cost about
// 10 ms (measured: 9.6-14 ms in its shutdown), and a reconfiguration drops several. The devices
// live as long as the process (never destroyed: no join at exit). A forked child starts a map of
// its own: the parent's devices have no loop thread in it (they are left alone, not destroyed).
std::shared_ptr<gloo::transport::Device> sharedDevice(const std::string& hostname) {
  struct Devices {
    pid_t pid;
    std::map<std::string, std::shared_ptr<gloo::transport::Device>> byHost;
  };
  static std::mutex mu;
  static Devices* devices = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (devices == nullptr || devices->pid != ::getpid()) devices = new Devices{::getpid(), {}};
  auto& device = devices->byHost[hostname];
  if (!device) {
    gloo::transport::tcp::attr attr;
    attr.hostname = hostname;
    device = gloo::transport::tcp::CreateDevice(attr);
  }
  return device;
}

GlooCommunicator::GlooCommunicator(const std::shared_ptr<Store>& store,
                                   const CommunicatorOptions& options)
    : Communicator(options), verdicts_(options.members.size()) {
  if (store == nullptr) SINEW_THROW(InvalidArgument, "createGlooCommunicator: store is null");
  ignoreSigpipe();
  if (size() > 1) connect(store);
  timer_ = std::thread([this] { timerLoop(); });
}

std::string GlooCommunicator::describe() const {
  std::ostringstream os;
  os << "communicator '" << options_.name << "' (gloo, epoch " << epoch() << ", worker " << self()
     << ", rank " << rank_ << "/" << size() << ")";
  return os.str();
}

void GlooCommunicator::connect(const std::shared_ptr<Store>& store) {
  auto deadline = Clock::now() + options_.initTimeout;
  auto prefixed = std::make_shared<PrefixStore>(
      "sinew/comm/" + options_.name + "/epoch/" + std::to_string(epoch()), store);

  // 1. Announce ourselves and wait for every member, so a missing member is named.
  prefixed->set("joined/" + std::to_string(rank_), toBytes(std::to_string(self())));
  std::vector<std::string> keys;
  for (int r = 0; r < size(); ++r) keys.push_back("joined/" + std::to_string(r));
  try {
    prefixed->wait(keys, options_.initTimeout);
  } catch (const Timeout&) {
    std::ostringstream missing;
    for (int r = 0; r < size(); ++r) {
      if (!prefixed->check({keys[r]})) missing << " " << workerOf(r);
    }
    SINEW_THROW(Timeout, describe(), ": members did not join within ", options_.initTimeout.count(),
                " ms: workers", missing.str());
  }

  // 2. Full mesh of TCP pairs through Gloo's rendezvous.
  try {
    device_ = sharedDevice(options_.hostname);
    context_ = std::make_shared<gloo::rendezvous::Context>(rank_, size());
    // Gloo waits up to five times the context's timeout for a pair to connect (the
    // "initial connect" case of tcp/pair.h's waitUntil): a member whose peer gave up before
    // connecting to it was held for 5x the init timeout, far past the deadline (a flaky hang
    // of MemberThatLeavesAsTheMeshConnectsGivesIoError, 1 to 2 plays in 6 runs). With a fifth
    // of what is left, one such wait ends by the deadline (a second absent peer could add as
    // much again); the rendezvous' own waits use the deadline (GlooStoreAdapter), and no later
    // wait uses this timeout (they pass their own).
    context_->setTimeout(std::max(
        std::chrono::milliseconds(1),
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()) / 5));
    auto gstore = std::make_shared<PrefixStore>("gloo", prefixed);
    GlooStoreAdapter adapter(gstore, deadline);
    LoopKicker kicker(device_);
    context_->connectFullMesh(adapter, device_);
  } catch (const gloo::Exception& e) {
    closeContext();
    SINEW_THROW(IoError, describe(), ": connecting to the members failed: ", e.what());
  }

  // 3. Post the control receives and start their watchers. A peer that left right after the
  //    mesh connected (it crashed, or gave up on this epoch) has a closed pair, on which
  //    posting throws Gloo's IoException: that is this constructor's error like any other
  //    broken connection, never a Gloo exception in the caller (which handles Sinew's only).
  controlIn_.assign(size() * Goodbye::kWireBytes, 0);
  controlBufs_.resize(size());
  for (int r = 0; r < size(); ++r) {
    if (r == rank_) continue;
    controlBufs_[r] = buffer(controlIn_.data() + r * Goodbye::kWireBytes, Goodbye::kWireBytes);
    try {
      controlBufs_[r]->recv(r, kControlSlot, 0, Goodbye::kWireBytes);
    } catch (const gloo::Exception& e) {
      controlBufs_.clear();  // No watcher runs yet.
      closeContext();
      SINEW_THROW(IoError, describe(), ": the connection to worker ", workerOf(r), " (rank ", r,
                  ") broke as it was set up: ", e.what());
    }
  }
  for (int r = 0; r < size(); ++r) {
    if (r == rank_) continue;
    watchers_.emplace_back([this, r] { watch(r); });
  }

  // 4. Two members reduce over connections of their own (allreduceTwo), and with p2pLanes
  //    every member carries point to point on them (exchangeOnLanes). Set up once the
  //    watchers run, so that a peer that dies meanwhile ends the set-up within a slice (its
  //    watcher fails this communicator) instead of at the deadline.
  if (size() == 2 || (options_.p2pLanes && size() > 1)) {
    try {
      auto lanes = std::make_unique<Lanes>(
          *prefixed, rank_, size(), options_.hostname, epoch(), deadline, describe(),
          [this](int r) { return workerOf(r); },
          [this] { return failed_.load(std::memory_order_acquire); },
          options_.laneSocketBufferBytes);
      std::lock_guard<std::mutex> lock(mu_);
      lanes_ = std::move(lanes);
    } catch (...) {
      {
        // A lane that broke because the peer died or left: its watcher's verdict names the
        // cause (PeerLost, or the peer's reason), as onPairError does.
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait_for(lock, kVerdictWait, [&] { return failure_ != nullptr; });
        failLocked(std::current_exception(), GoodbyeKind::kAborted, self());
      }
      shutdown();
      throwFailure();
    }
  }
}

GlooCommunicator::~GlooCommunicator() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_) {
      failure_ = std::make_exception_ptr(Aborted(describe() + " was destroyed"));
      failureKind_ = GoodbyeKind::kClosed;
      failureWorker_ = self();
    }
  }
  shutdown();
}

void GlooCommunicator::watch(int peer) {
  Verdict v;
  try {
    if (!controlBufs_[peer]->waitRecv(nullptr, kForever)) return;  // Shutting down.
    const Goodbye g = Goodbye::decode(controlIn_.data() + peer * Goodbye::kWireBytes);
    if (g.magic != kGoodbyeMagic || g.kind < 1 || g.kind > 4) {
      v.kind = VerdictKind::kLost;
      v.detail = "malformed control message";
    } else {
      v.kind = VerdictKind::kGoodbye;
      v.goodbye = g;
    }
  } catch (const std::exception& e) {
    v.kind = VerdictKind::kLost;
    v.detail = e.what();
  }
  std::lock_guard<std::mutex> lock(mu_);
  verdicts_[peer] = v;
  cv_.notify_all();
  if (stopping_) return;
  int worker = workerOf(peer);
  if (v.kind == VerdictKind::kLost) {
    std::ostringstream os;
    os << describe() << ": lost worker " << worker << " (rank " << peer
       << "): its connection broke without a goodbye (" << v.detail << ")";
    failLocked(std::make_exception_ptr(PeerLost(worker, os.str())), GoodbyeKind::kPeerLost, worker);
    return;
  }
  auto kind = static_cast<GoodbyeKind>(v.goodbye.kind);
  int culprit = static_cast<int>(v.goodbye.worker);
  std::ostringstream os;
  os << describe() << ": ";
  switch (kind) {
    case GoodbyeKind::kClosed:
      return;  // Orderly exit; only an operation that still needs this peer fails.
    case GoodbyeKind::kPeerLost:
      os << "worker " << worker << " reports worker " << culprit << " lost";
      failLocked(std::make_exception_ptr(PeerLost(culprit, os.str())), kind, culprit);
      return;
    case GoodbyeKind::kTimeout:
      os << "worker " << culprit << " timed out";
      failLocked(std::make_exception_ptr(Timeout(os.str())), kind, culprit);
      return;
    case GoodbyeKind::kAborted:
      os << "worker " << culprit << " aborted the communicator";
      failLocked(std::make_exception_ptr(Aborted(os.str())), kind, culprit);
      return;
  }
}

// Operations do not wake this thread: it sleeps until the deadline it last saw and then
// looks at the operation in flight, if any (an operation only notifies it when its deadline
// is earlier than that, or when it sleeps without one). Two wake-ups per operation cost the
// two-member allreduce a context switch on the other member's core each time.
void GlooCommunicator::timerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    if (!deadline_) {
      timerWake_.reset();
      cv_.wait(lock);
      continue;
    }
    uint64_t generation = opGeneration_;
    auto deadline = *deadline_;
    timerWake_ = deadline;
    bool changed = cv_.wait_until(
        lock, deadline, [&] { return stopping_ || opGeneration_ != generation || !deadline_; });
    if (changed) continue;
    std::ostringstream os;
    int waiting = waitingOn_.load();
    os << describe() << ": " << (activeOp_ ? activeOp_ : "operation") << " timed out after "
       << activeTimeout_.count() << " ms";
    if (waiting >= 0)
      os << " waiting for worker " << workerOf(waiting) << " (rank " << waiting << ")";
    failLocked(std::make_exception_ptr(Timeout(os.str())), GoodbyeKind::kTimeout, self());
    deadline_.reset();
  }
}

void GlooCommunicator::failLocked(std::exception_ptr error, GoodbyeKind kind, int worker) {
  if (failure_) return;
  failure_ = std::move(error);
  failureKind_ = kind;
  failureWorker_ = worker;
  failed_.store(true, std::memory_order_release);
  if (lanes_) lanes_->wake();
  for (auto* b : active_) {
    b->abortWaitRecv();
    b->abortWaitSend();
  }
  cv_.notify_all();
}

void GlooCommunicator::fail(std::exception_ptr error, GoodbyeKind kind, int worker) {
  std::lock_guard<std::mutex> lock(mu_);
  failLocked(std::move(error), kind, worker);
}

void GlooCommunicator::abort() {
  fail(std::make_exception_ptr(Aborted(describe() + ": abort() was called")), GoodbyeKind::kAborted,
       self());
}

std::exception_ptr GlooCommunicator::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void GlooCommunicator::throwFailure() {
  std::exception_ptr e;
  {
    std::lock_guard<std::mutex> lock(mu_);
    e = failure_;
  }
  SINEW_ENFORCE(e != nullptr, describe(), ": interrupted without a recorded failure");
  std::rethrow_exception(e);
}

void GlooCommunicator::onPairError(int peer, const std::string& what) {
  std::unique_lock<std::mutex> lock(mu_);
  // The peer's watcher sees the same broken connection, after any Goodbye it delivered.
  cv_.wait_for(lock, kVerdictWait, [&] { return verdicts_[peer].kind != VerdictKind::kNone; });
  const Verdict& v = verdicts_[peer];
  int worker = workerOf(peer);
  std::ostringstream os;
  os << describe() << ": ";
  if (v.kind == VerdictKind::kGoodbye &&
      static_cast<GoodbyeKind>(v.goodbye.kind) == GoodbyeKind::kClosed) {
    os << "worker " << worker << " closed the communicator while "
       << (activeOp_ ? activeOp_ : "an operation") << " still needed it";
    failLocked(std::make_exception_ptr(Aborted(os.str())), GoodbyeKind::kAborted, worker);
  } else if (v.kind != VerdictKind::kGoodbye) {
    os << "lost worker " << worker << " (rank " << peer << "): " << what;
    failLocked(std::make_exception_ptr(PeerLost(worker, os.str())), GoodbyeKind::kPeerLost, worker);
  }
  // Otherwise the watcher already failed us with the Goodbye's cause.
  std::exception_ptr e = failure_;
  lock.unlock();
  std::rethrow_exception(e);
}

void GlooCommunicator::waitRecv(UnboundBuffer* buf, int peer) {
  waitingOn_.store(peer);
  bool ok;
  try {
    ok = buf->waitRecv(nullptr, kForever);
  } catch (const gloo::IoException& e) {
    onPairError(peer, e.what());
  }
  waitingOn_.store(-1);
  if (!ok) throwFailure();
}

void GlooCommunicator::waitSend(UnboundBuffer* buf, int peer) {
  waitingOn_.store(peer);
  bool ok;
  try {
    ok = buf->waitSend(nullptr, kForever);
  } catch (const gloo::IoException& e) {
    onPairError(peer, e.what());
  }
  waitingOn_.store(-1);
  if (!ok) throwFailure();
}

GlooCommunicator::OpScope::OpScope(GlooCommunicator* comm, const char* name,
                                   std::chrono::milliseconds timeout,
                                   std::vector<UnboundBuffer*> buffers)
    : comm_(comm) {
  std::lock_guard<std::mutex> lock(comm_->mu_);
  comm_->active_ = std::move(buffers);
  comm_->activeOp_ = name;
  comm_->activeTimeout_ = timeout;
  comm_->deadline_ = Clock::now() + timeout;
  comm_->opGeneration_++;
  // The timer thread wakes by itself in time unless it sleeps past this deadline.
  if (!comm_->timerWake_ || *comm_->deadline_ < *comm_->timerWake_) comm_->cv_.notify_all();
}

GlooCommunicator::OpScope::~OpScope() {
  std::lock_guard<std::mutex> lock(comm_->mu_);
  comm_->active_.clear();
  comm_->deadline_.reset();
  comm_->activeOp_ = nullptr;
  comm_->opGeneration_++;  // The timer thread sees it when it wakes; it need not wake now.
}

template <typename F>
void GlooCommunicator::runOp(const char* name, std::chrono::milliseconds timeout,
                             std::vector<UnboundBuffer*> buffers, F&& body) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_) std::rethrow_exception(failure_);
  }
  try {
    OpScope scope(this, name, timeout, std::move(buffers));
    // A failure recorded before the scope registered its buffers interrupted nothing.
    if (error()) throwFailure();
    body();
  } catch (const gloo::Exception& e) {
    // Posting a send or receive on a pair whose peer just aborted fails here, possibly before
    // that peer's watcher has delivered its Goodbye (the peer closes right after sending it):
    // give the watchers the grace onPairError gives them, so the failure names its cause.
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, kVerdictWait, [&] { return failure_ != nullptr; });
    failLocked(std::make_exception_ptr(
                   Aborted(describe() + ": " + name + ": transport error: " + e.what())),
               GoodbyeKind::kAborted, self());
  } catch (...) {
    // Usually the recorded failure rethrown; otherwise this exception becomes it.
    fail(std::current_exception(), GoodbyeKind::kAborted, self());
  }
  if (error()) {
    shutdown();
    throwFailure();
  }
}

void GlooCommunicator::shutdown() {
  GoodbyeKind kind;
  int worker;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
    kind = failureKind_;
    worker = failureWorker_;
  }
  if (context_) {
    // Tell every peer whose connection still works, and that has not left, why we leave
    // (protocol step 2). A peer whose goodbye arrived reads no more: a send to it could only
    // wait out the budget on its closed connection.
    std::vector<uint8_t> out(size() * Goodbye::kWireBytes);
    const Goodbye g{kGoodbyeMagic, static_cast<uint32_t>(kind), static_cast<int64_t>(worker)};
    for (int r = 0; r < size(); ++r) g.encode(out.data() + r * Goodbye::kWireBytes);
    auto buf = buffer(out.data(), out.size());
    int posted = 0;
    for (int r = 0; r < size(); ++r) {
      if (r == rank_) continue;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (verdicts_[r].kind != VerdictKind::kNone) continue;
      }
      try {
        buf->send(r, kControlSlot, r * Goodbye::kWireBytes, Goodbye::kWireBytes);
        posted++;
      } catch (const std::exception&) {
        // That peer's connection is already broken; it needs no goodbye.
      }
    }
    auto deadline = Clock::now() + kGoodbyeBudget;
    try {
      for (int i = 0; i < posted; ++i) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        // A Gloo timeout here closes every pair, which is what we do next anyway.
        buf->waitSend(nullptr, std::max(left, std::chrono::milliseconds(1)));
      }
    } catch (const std::exception&) {
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    cv_.notify_all();
  }
  for (auto& b : controlBufs_) {
    if (b) b->abortWaitRecv();
  }
  for (auto& t : watchers_) t.join();
  watchers_.clear();
  if (timer_.joinable()) timer_.join();
  controlBufs_.clear();
  closeContext();
  // After the goodbyes, so a peer in a lane operation learns why we left. Under mu_, as
  // failLocked reads lanes_ (it cannot run here anyway: a failure is recorded before any
  // shutdown, and failLocked returns early then).
  std::unique_ptr<Lanes> lanes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    lanes.swap(lanes_);
  }
  lanes.reset();
  device_.reset();
}

void GlooCommunicator::closeContext() {
  if (!context_) return;
  LoopKicker kicker(device_);
  context_.reset();
}

void GlooCommunicator::validate(const at::Tensor& t, const char* op, bool needReduce) const {
  if (!t.defined()) SINEW_THROW(InvalidArgument, describe(), ": ", op, ": undefined tensor");
  if (!t.device().is_cpu()) {
    SINEW_THROW(InvalidArgument, describe(), ": ", op, ": the gloo backend takes CPU tensors, got ",
                t.device().str());
  }
  if (!t.is_contiguous()) {
    SINEW_THROW(InvalidArgument, describe(), ": ", op, ": tensor must be contiguous");
  }
  if (needReduce && !reducible(t.scalar_type())) {
    SINEW_THROW(InvalidArgument, describe(), ": ", op, ": unsupported dtype ", dtypeName(t),
                " (float32, float64, float16, bfloat16 and int64 can be reduced)");
  }
}

// Ring reduce-scatter: after size()-1 steps rank r holds the sum of block (r+1) % size().
// Step t sends block (r-t) (reduced in step t-1) to the right and receives block (r-t-1)
// from the left into a double-buffered scratch, segment by segment, so a segment's
// reduction overlaps the next segment's transfer.
void GlooCommunicator::ringReduceScatter(UnboundBuffer* sendBuf, UnboundBuffer* scratchBuf,
                                         char* data, char* scratch, const Segmenter& seg,
                                         size_t esize, at::ScalarType type, uint64_t slot) {
  const int P = size();
  const size_t S = seg.segments;
  struct Unit {
    size_t begin, end;
  };
  auto sendUnit = [&](size_t t, size_t s) {
    auto [b, e] = seg.segment((rank_ - t + P * 2) % P, s);
    return Unit{b, e};
  };
  auto recvUnit = [&](size_t t, size_t s) {
    auto [b, e] = seg.segment((rank_ - t - 1 + P * 2) % P, s);
    return Unit{b, e};
  };
  const size_t scratchHalf = scratchBuf->size / 2;
  size_t sendsPosted = 0;
  auto postSend = [&](size_t t, size_t s) {
    Unit u = sendUnit(t, s);
    if (u.end == u.begin) return;
    sendBuf->send(right(), slot, u.begin * esize, (u.end - u.begin) * esize);
    sendsPosted++;
  };
  // Receives in order, skipping empty segments (the sender skips the same ones).
  std::vector<std::pair<size_t, size_t>> recvOrder;  // (t, s)
  for (size_t t = 0; t + 1 < size_t(P); ++t) {
    for (size_t s = 0; s < S; ++s) {
      Unit u = recvUnit(t, s);
      if (u.end > u.begin) recvOrder.emplace_back(t, s);
    }
  }
  auto postRecv = [&](size_t k) {
    if (k >= recvOrder.size()) return;
    Unit u = recvUnit(recvOrder[k].first, recvOrder[k].second);
    scratchBuf->recv(left(), slot, (k % 2) * scratchHalf, (u.end - u.begin) * esize);
  };
  for (size_t s = 0; s < S; ++s) postSend(0, s);
  postRecv(0);
  postRecv(1);
  for (size_t k = 0; k < recvOrder.size(); ++k) {
    waitRecv(scratchBuf, left());
    auto [t, s] = recvOrder[k];
    Unit u = recvUnit(t, s);
    reduceSum(type, data + u.begin * esize, scratch + (k % 2) * scratchHalf, u.end - u.begin);
    postRecv(k + 2);
    if (t + 2 < size_t(P)) postSend(t + 1, s);
  }
  for (size_t i = 0; i < sendsPosted; ++i) waitSend(sendBuf, right());
}

// Ring allgather: rank r starts with block (r + shift) complete; step t sends block
// (r + shift - t) to the right and receives block (r + shift - t - 1) from the left,
// forwarding each segment as soon as it has arrived.
void GlooCommunicator::ringAllgather(UnboundBuffer* sendBuf, UnboundBuffer* recvBuf,
                                     const Segmenter& seg, size_t esize, int shift, uint64_t slot) {
  const int P = size();
  const size_t S = seg.segments;
  auto block = [&](size_t t, int extra) { return (rank_ + shift - int(t) - extra + 2 * P) % P; };
  size_t sendsPosted = 0;
  auto postSend = [&](size_t t, size_t s) {
    auto [b, e] = seg.segment(block(t, 0), s);
    if (e == b) return;
    sendBuf->send(right(), slot, b * esize, (e - b) * esize);
    sendsPosted++;
  };
  std::vector<std::pair<size_t, size_t>> recvOrder;
  for (size_t t = 0; t + 1 < size_t(P); ++t) {
    for (size_t s = 0; s < S; ++s) {
      auto [b, e] = seg.segment(block(t, 1), s);
      if (e == b) continue;
      recvOrder.emplace_back(t, s);
      recvBuf->recv(left(), slot, b * esize, (e - b) * esize);
    }
  }
  for (size_t s = 0; s < S; ++s) postSend(0, s);
  for (auto [t, s] : recvOrder) {
    waitRecv(recvBuf, left());
    if (t + 2 < size_t(P)) postSend(t + 1, s);
  }
  for (size_t i = 0; i < sendsPosted; ++i) waitSend(sendBuf, right());
}

void GlooCommunicator::allreduce(at::Tensor& t, ReduceOp op, std::chrono::milliseconds timeout) {
  validate(t, "allreduce", true);
  checkAlive();
  timeout = resolveTimeout(timeout);
  const int P = size();
  if (P == 2 && t.numel() > 0) {
    allreduceTwo(t, timeout);
  } else if (P > 1 && t.numel() > 0) {
    const size_t esize = t.element_size();
    const size_t numel = t.numel();
    Segmenter seg{numel, size_t(P), segmentsFor(((numel + P - 1) / P) * esize)};
    std::vector<char> scratch(std::max<size_t>(1, 2 * seg.maxSegment() * esize));
    char* data = static_cast<char*>(t.data_ptr());
    // One buffer per direction, so a broken connection names its peer.
    auto sendBuf = buffer(data, numel * esize);
    auto recvBuf = buffer(data, numel * esize);
    auto scratchBuf = buffer(scratch.data(), scratch.size());
    uint64_t slot = nextCollectiveSlot();
    runOp("allreduce", timeout, {sendBuf.get(), recvBuf.get(), scratchBuf.get()}, [&] {
      ringReduceScatter(sendBuf.get(), scratchBuf.get(), data, scratch.data(), seg, esize,
                        t.scalar_type(), slot);
      ringAllgather(sendBuf.get(), recvBuf.get(), seg, esize, 1, slot + 1);
    });
  }
  if (op == ReduceOp::kAvg && P > 1) {
    if (t.scalar_type() == at::kLong) {
      t.div_(P, "trunc");
    } else {
      t.div_(P);
    }
  }
}

// Two members: one exchange over the lane (docs/collectives.md, "Lanes") instead of the
// ring's two phases. Each member sends a 24-byte header (magic, dtype, operation number,
// bytes) and its whole tensor, and receives the other's into a ring of scratch bytes, all from
// this thread with non-blocking socket calls and poll(); every received byte is added into the
// tensor once the same byte of the tensor has been sent, so the reduction overlaps the rest of
// the transfer and scratch stays at kLaneScratchBytes whatever the tensor. a + b and b + a are
// the same float, so both members end with identical bytes. A member blocks only while it can
// neither send (the peer's receive buffer is full) nor receive (its scratch is full of bytes it
// has not sent yet); both cannot hold at once on both members, so the exchange never
// deadlocks. Failures: a deadline or abort() wakes the poll through the lanes' eventfd; a
// broken connection goes to onPairError like a Gloo pair's, which waits for the watcher's
// verdict to name the cause.
void GlooCommunicator::allreduceTwo(at::Tensor& t, std::chrono::milliseconds timeout) {
  const size_t esize = t.element_size();
  const size_t bytes = t.numel() * esize;
  char* data = static_cast<char*>(t.data_ptr());
  const int peer = 1 - rank_;
  const int sfd = lanes_->sendFd(peer);
  const int rfd = lanes_->recvFd(peer);
  if (scratch_.size() < kLaneScratchBytes) scratch_.resize(kLaneScratchBytes);
  char* scratch = scratch_.data();
  const size_t cap = kLaneScratchBytes;  // a multiple of every element size
  const LaneHeader out{kLaneMagic, static_cast<uint32_t>(t.scalar_type()), laneSeq_++, bytes};
  uint8_t outWire[LaneHeader::kWireBytes], inWire[LaneHeader::kWireBytes];
  out.encode(outWire);
  runOp("allreduce", timeout, {}, [&] {
    size_t headerSent = 0, sent = 0, headerRecv = 0, recvd = 0, reduced = 0;
    Clock::time_point idleSince{};  // since when nothing moved, or zero
    waitingOn_.store(peer);
    while (reduced < bytes) {
      if (failed_.load(std::memory_order_acquire)) throwFailure();
      bool progress = false;
      short sendEvents = 0, recvEvents = 0;
      // Send: what is left of the header and up to kLaneSendCallBytes of the tensor, in one call.
      if (sent < bytes) {
        iovec iov[2];
        int n = 0;
        if (headerSent < sizeof(outWire)) {
          iov[n++] = {outWire + headerSent, sizeof(outWire) - headerSent};
        }
        iov[n++] = {data + sent, std::min(bytes - sent, kLaneSendCallBytes)};
        msghdr msg{};
        msg.msg_iov = iov;
        msg.msg_iovlen = n;
        ssize_t rv = ::sendmsg(sfd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (rv > 0) {
          size_t k = static_cast<size_t>(rv);
          size_t h = std::min(k, sizeof(outWire) - headerSent);
          headerSent += h;
          sent += k - h;
          progress = true;
        } else if (rv < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          onPairError(peer, std::string("lane send: ") + std::strerror(errno));
        } else {
          sendEvents = POLLOUT;
        }
      }
      // Receive: the header first, then as much of the payload as scratch has room for.
      char* dst = nullptr;
      size_t want = 0;
      if (headerRecv < sizeof(inWire)) {
        dst = reinterpret_cast<char*>(inWire) + headerRecv;
        want = sizeof(inWire) - headerRecv;
      } else if (recvd < bytes && recvd - reduced < cap) {
        const size_t pos = recvd % cap;
        dst = scratch + pos;
        want = std::min({cap - (recvd - reduced), cap - pos, bytes - recvd});
      }
      if (want > 0) {
        ssize_t rv = ::recv(rfd, dst, want, MSG_DONTWAIT);
        if (rv > 0) {
          progress = true;
          if (headerRecv < sizeof(inWire)) {
            headerRecv += static_cast<size_t>(rv);
            if (headerRecv == sizeof(inWire))
              checkLaneHeader(LaneHeader::decode(inWire), out, peer);
          } else {
            recvd += static_cast<size_t>(rv);
          }
        } else if (rv == 0) {
          onPairError(peer, "lane: connection closed");
        } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          onPairError(peer, std::string("lane recv: ") + std::strerror(errno));
        } else {
          recvEvents = POLLIN;
        }
      }
      // Reduce: whole elements that have arrived and whose own bytes have gone.
      const size_t ready = std::min(recvd, sent) / esize * esize;
      while (reduced < ready) {
        const size_t pos = reduced % cap;
        const size_t n = std::min({ready - reduced, cap - pos, kLaneReduceBytes});
        reduceSum(t.scalar_type(), data + reduced, scratch + pos, n / esize);
        reduced += n;
        progress = true;
      }
      if (progress || (sendEvents | recvEvents) == 0) {
        idleSince = Clock::time_point{};
        continue;
      }
      if (idleSince == Clock::time_point{}) idleSince = Clock::now();
      // Nothing moved: wait until a socket (or the wake fd) is ready. Spin on a zero-timeout
      // poll() for a while first: the peer's bytes are usually microseconds away, and a sleep
      // costs a wake-up. poll() checks readiness without taking the socket's lock, which a
      // spinning recv() would take over and over while the peer's segments arrive.
      pollfd fds[3] = {{sendEvents ? sfd : -1, sendEvents, 0},
                       {recvEvents ? rfd : -1, recvEvents, 0},
                       {lanes_->wakeFd(), POLLIN, 0}};
      for (;;) {
        const bool spin = Clock::now() - idleSince < kLaneSpin;
        int rv = ::poll(fds, 3, spin ? 0 : -1);
        if (rv > 0) break;
        if (rv < 0 && errno != EINTR) {
          SINEW_THROW(IoError, describe(), ": allreduce: poll: ", std::strerror(errno));
        }
        if (!spin) break;
        cpuRelax();
      }
    }
    waitingOn_.store(-1);
  });
}

// Point-to-point on the lanes (CommunicatorOptions::p2pLanes; docs/collectives.md, "Lanes").
// Every message is a 16-byte header (magic, tag, bytes) and its bytes, written on the lane to
// its receiver in the order of `ops`; the receiver reads straight into the tensor of the first
// of its receives from that member with the header's tag. It reads from a member only while
// it still expects a message from it, so a message for a later call stays in the socket. All
// from this thread with non-blocking calls and poll(): sends to different members and
// receives from every member move together, and a member waits only while no socket can move.
// Failures as in allreduceTwo (a deadline or abort() wakes the poll; a broken lane goes to
// onPairError).
void GlooCommunicator::exchangeOnLanes(const std::vector<P2POp>& ops, const char* name,
                                       std::chrono::milliseconds timeout, uint32_t kind) {
  constexpr size_t kHeader = LaneMessageHeader::kWireBytes;
  struct Send {
    const char* data;
    size_t bytes;
    size_t done = 0;  // header and payload bytes written
    uint8_t header[kHeader];
  };
  struct Recv {
    char* data;
    size_t bytes;
    uint32_t tag;
    bool matched = false;
  };
  struct Incoming {
    uint8_t header[kHeader];
    size_t headerDone = 0;
    int recv = -1;  // the receive the current message fills, or -1 before its header
    size_t done = 0;
  };
  const int P = size();
  std::vector<std::vector<Send>> sends(P);
  std::vector<std::vector<Recv>> recvs(P);
  std::vector<size_t> nextSend(P, 0);
  std::vector<int> expected(P, 0);  // receives from each member not complete yet
  size_t left = 0;
  for (const P2POp& op : ops) {
    const size_t bytes = op.tensor.numel() * op.tensor.element_size();
    if (bytes == 0) continue;  // Skipped on both sides, as on Gloo's pairs.
    if (op.kind == P2POp::Kind::kSend) {
      Send snd{static_cast<const char*>(op.tensor.data_ptr()), bytes, 0, {}};
      LaneMessageHeader{kind, op.tag, bytes}.encode(snd.header);
      sends[op.peer].push_back(snd);
    } else {
      recvs[op.peer].push_back({static_cast<char*>(op.tensor.data_ptr()), bytes, op.tag});
      expected[op.peer]++;
    }
    left++;
  }
  if (left == 0) return;
  std::vector<Incoming> in(P);
  std::vector<pollfd> fds;
  const auto checkFailed = [&] {
    if (failed_.load(std::memory_order_acquire)) throwFailure();
  };
  runOp(name, timeout, {}, [&] {
    while (left > 0) {
      checkFailed();
      bool progress = false;
      fds.clear();
      // Whom a timeout names: a member this one waits to receive from, else one it waits to
      // send to.
      int blockedRecv = -1, blockedSend = -1;
      for (int peer = 0; peer < P; ++peer) {
        // Send: the rest of the current message's header and a call's worth of its bytes.
        while (nextSend[peer] < sends[peer].size()) {
          checkFailed();
          Send& m = sends[peer][nextSend[peer]];
          iovec iov[2];
          int n = 0;
          if (m.done < kHeader) {
            iov[n++] = {m.header + m.done, kHeader - m.done};
          }
          const size_t sent = m.done > kHeader ? m.done - kHeader : 0;
          iov[n++] = {const_cast<char*>(m.data) + sent,
                      std::min(m.bytes - sent, kLaneSendCallBytes)};
          msghdr msg{};
          msg.msg_iov = iov;
          msg.msg_iovlen = n;
          ssize_t rv = ::sendmsg(lanes_->sendFd(peer), &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
          if (rv > 0) {
            m.done += static_cast<size_t>(rv);
            progress = true;
            if (m.done == kHeader + m.bytes) {
              nextSend[peer]++;
              left--;
            }
            continue;
          }
          if (rv < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
            onPairError(peer, std::string("lane send: ") + std::strerror(errno));
          }
          if (rv < 0 && errno == EINTR) continue;
          fds.push_back({lanes_->sendFd(peer), POLLOUT, 0});
          if (blockedSend < 0) blockedSend = peer;
          break;
        }
        // Receive: a header, then its bytes straight into the matching receive's tensor.
        while (expected[peer] > 0) {
          checkFailed();
          Incoming& c = in[peer];
          char* dst;
          size_t want;
          if (c.recv < 0) {
            dst = reinterpret_cast<char*>(c.header) + c.headerDone;
            want = kHeader - c.headerDone;
          } else {
            Recv& r = recvs[peer][c.recv];
            dst = r.data + c.done;
            want = r.bytes - c.done;  // The kernel returns what has arrived.
          }
          ssize_t rv = ::recv(lanes_->recvFd(peer), dst, want, MSG_DONTWAIT);
          if (rv == 0) onPairError(peer, "lane: connection closed");
          if (rv < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
              onPairError(peer, std::string("lane recv: ") + std::strerror(errno));
            }
            fds.push_back({lanes_->recvFd(peer), POLLIN, 0});
            if (blockedRecv < 0) blockedRecv = peer;
            break;
          }
          progress = true;
          if (c.recv < 0) {
            c.headerDone += static_cast<size_t>(rv);
            if (c.headerDone < kHeader) continue;
            const auto [magic, tag, bytes] = LaneMessageHeader::decode(c.header);
            if (magic != kind && laneMessageKind(magic) != nullptr) {
              SINEW_THROW(InvalidArgument, describe(), ": ", name, ": worker ", workerOf(peer),
                          " sent ", laneMessageKind(magic), " where this member expects ",
                          laneMessageKind(kind), " (the members' calls do not match)");
            }
            if (magic != kind) {
              SINEW_THROW(Corruption, describe(), ": ", name, ": worker ", workerOf(peer),
                          " sent a lane message with magic ", magic, " (expected ", kind, ")");
            }
            int match = -1;
            for (size_t i = 0; i < recvs[peer].size(); ++i) {
              if (!recvs[peer][i].matched && recvs[peer][i].tag == tag) {
                match = static_cast<int>(i);
                break;
              }
            }
            if (match < 0) {
              SINEW_THROW(InvalidArgument, describe(), ": ", name, ": worker ", workerOf(peer),
                          " sent a message with tag ", tag, " (", bytes,
                          " bytes) ahead of those this call receives from it, and this call "
                          "receives none with that tag (on lanes, a member's messages are "
                          "received in the order it sent them)");
            }
            if (bytes != recvs[peer][match].bytes) {
              SINEW_THROW(InvalidArgument, describe(), ": ", name, ": worker ", workerOf(peer),
                          " sent ", bytes, " bytes with tag ", tag, "; this member receives ",
                          recvs[peer][match].bytes, " (the members' calls do not match)");
            }
            recvs[peer][match].matched = true;
            c.recv = match;
            c.headerDone = 0;
            c.done = 0;
          } else {
            c.done += static_cast<size_t>(rv);
          }
          if (c.recv >= 0 && c.done == recvs[peer][c.recv].bytes) {
            c.recv = -1;
            c.done = 0;
            expected[peer]--;
            left--;
          }
        }
      }
      if (left == 0 || progress) continue;
      // Nothing moved: sleep until a socket (or the wake fd) is ready.
      waitingOn_.store(blockedRecv >= 0 ? blockedRecv : blockedSend);
      fds.push_back({lanes_->wakeFd(), POLLIN, 0});
      int rv = ::poll(fds.data(), fds.size(), -1);
      if (rv < 0 && errno != EINTR) {
        SINEW_THROW(IoError, describe(), ": ", name, ": poll: ", std::strerror(errno));
      }
      waitingOn_.store(-1);
    }
  });
}

void GlooCommunicator::checkLaneHeader(const LaneHeader& in, const LaneHeader& out, int peer) {
  if (in.magic != kLaneMagic && laneMessageKind(in.magic) != nullptr) {
    SINEW_THROW(InvalidArgument, describe(), ": allreduce: worker ", workerOf(peer), " sent ",
                laneMessageKind(in.magic), " where this member expects ",
                laneMessageKind(kLaneMagic), " (the members' calls do not match)");
  }
  if (in.magic != kLaneMagic) {
    SINEW_THROW(Corruption, describe(), ": allreduce: worker ", workerOf(peer),
                " sent a lane header with magic ", in.magic, " (expected ", kLaneMagic, ")");
  }
  if (in.seq != out.seq || in.bytes != out.bytes || in.dtype != out.dtype) {
    SINEW_THROW(InvalidArgument, describe(), ": allreduce: worker ", workerOf(peer), " reduces ",
                in.bytes, " bytes of dtype ", c10::toString(static_cast<at::ScalarType>(in.dtype)),
                " as lane operation ", in.seq, "; this member ", out.bytes, " bytes of dtype ",
                c10::toString(static_cast<at::ScalarType>(out.dtype)), " as operation ", out.seq,
                " (the members' calls do not match)");
  }
}

void GlooCommunicator::broadcast(at::Tensor& t, int root, std::chrono::milliseconds timeout) {
  validate(t, "broadcast", false);
  checkAlive();
  if (root < 0 || root >= size()) {
    SINEW_THROW(InvalidArgument, describe(), ": broadcast root = ", root, " is not a rank in [0, ",
                size(), ")");
  }
  timeout = resolveTimeout(timeout);
  const int P = size();
  if (P == 1 || t.numel() == 0) return;
  const size_t bytes = t.numel() * t.element_size();
  Segmenter seg{bytes, 1, segmentsFor(bytes)};
  char* data = static_cast<char*>(t.data_ptr());
  auto sendBuf = buffer(data, bytes);
  auto recvBuf = buffer(data, bytes);
  uint64_t slot = nextCollectiveSlot();
  // A pipelined chain root -> root+1 -> ... : each member forwards a segment as soon as
  // it has it.
  const int pos = (rank_ - root + P) % P;
  const int prev = (rank_ - 1 + P) % P;
  const int next = (rank_ + 1) % P;
  runOp("broadcast", timeout, {sendBuf.get(), recvBuf.get()}, [&] {
    if (pos > 0) {
      for (size_t s = 0; s < seg.segments; ++s) {
        auto [b, e] = seg.segment(0, s);
        if (e > b) recvBuf->recv(prev, slot, b, e - b);
      }
    }
    size_t sends = 0;
    for (size_t s = 0; s < seg.segments; ++s) {
      auto [b, e] = seg.segment(0, s);
      if (e == b) continue;
      if (pos > 0) waitRecv(recvBuf.get(), prev);
      if (pos < P - 1) {
        sendBuf->send(next, slot, b, e - b);
        sends++;
      }
    }
    for (size_t i = 0; i < sends; ++i) waitSend(sendBuf.get(), next);
  });
}

void GlooCommunicator::allgather(at::Tensor& output, const at::Tensor& input,
                                 std::chrono::milliseconds timeout) {
  validate(input, "allgather", false);
  validate(output, "allgather", false);
  checkAlive();
  if (output.scalar_type() != input.scalar_type()) {
    SINEW_THROW(InvalidArgument, describe(), ": allgather output dtype ", dtypeName(output),
                " != input dtype ", dtypeName(input));
  }
  if (output.numel() != input.numel() * size()) {
    SINEW_THROW(InvalidArgument, describe(), ": allgather output has ", output.numel(),
                " elements, expected ", input.numel() * size());
  }
  timeout = resolveTimeout(timeout);
  const size_t esize = input.element_size();
  const size_t n = input.numel();
  char* out = static_cast<char*>(output.data_ptr());
  if (n > 0) std::memcpy(out + rank_ * n * esize, input.data_ptr(), n * esize);
  const int P = size();
  if (P == 1 || n == 0) return;
  Segmenter seg{n * P, size_t(P), segmentsFor(n * esize)};
  auto sendBuf = buffer(out, n * P * esize);
  auto recvBuf = buffer(out, n * P * esize);
  uint64_t slot = nextCollectiveSlot();
  runOp("allgather", timeout, {sendBuf.get(), recvBuf.get()},
        [&] { ringAllgather(sendBuf.get(), recvBuf.get(), seg, esize, 0, slot); });
}

void GlooCommunicator::send(const at::Tensor& t, int dst, uint32_t tag,
                            std::chrono::milliseconds timeout) {
  validate(t, "send", false);
  checkAlive();
  if (dst < 0 || dst >= size() || dst == rank_) {
    SINEW_THROW(InvalidArgument, describe(), ": send to rank dst = ", dst,
                " is not another member");
  }
  timeout = resolveTimeout(timeout);
  const size_t bytes = t.numel() * t.element_size();
  if (bytes == 0) return;  // Nothing travels; the receiver skips it too.
  if (p2pOnLanes()) return exchangeOnLanes({P2POp::send(t, dst, tag)}, "send", timeout);
  auto buf = buffer(t.data_ptr(), bytes);
  runOp("send", timeout, {buf.get()}, [&] {
    buf->send(dst, kP2PSlotBase + tag, 0, bytes);
    waitSend(buf.get(), dst);
  });
}

void GlooCommunicator::recv(at::Tensor& t, int src, uint32_t tag,
                            std::chrono::milliseconds timeout) {
  validate(t, "recv", false);
  checkAlive();
  if (src < 0 || src >= size() || src == rank_) {
    SINEW_THROW(InvalidArgument, describe(), ": recv from rank src = ", src,
                " is not another member");
  }
  timeout = resolveTimeout(timeout);
  const size_t bytes = t.numel() * t.element_size();
  if (bytes == 0) return;
  if (p2pOnLanes()) return exchangeOnLanes({P2POp::recv(t, src, tag)}, "recv", timeout);
  auto buf = buffer(t.data_ptr(), bytes);
  runOp("recv", timeout, {buf.get()}, [&] {
    buf->recv(src, kP2PSlotBase + tag, 0, bytes);
    waitRecv(buf.get(), src);
  });
}

void GlooCommunicator::exchange(const std::vector<P2POp>& ops, std::chrono::milliseconds timeout) {
  for (const P2POp& op : ops) {
    const bool isSend = op.kind == P2POp::Kind::kSend;
    validate(op.tensor, isSend ? "exchange (send)" : "exchange (recv)", false);
    if (op.peer < 0 || op.peer >= size() || op.peer == rank_) {
      SINEW_THROW(InvalidArgument, describe(), ": exchange with rank ", op.peer,
                  " is not another member");
    }
  }
  checkAlive();
  timeout = resolveTimeout(timeout);
  if (p2pOnLanes()) return exchangeOnLanes(ops, "exchange", timeout);
  // Empty transfers are skipped on both sides, as in send() and recv().
  std::vector<std::unique_ptr<UnboundBuffer>> bufs(ops.size());
  std::vector<UnboundBuffer*> raw;
  for (size_t i = 0; i < ops.size(); ++i) {
    const size_t bytes = ops[i].tensor.numel() * ops[i].tensor.element_size();
    if (bytes == 0) continue;
    bufs[i] = buffer(ops[i].tensor.data_ptr(), bytes);
    raw.push_back(bufs[i].get());
  }
  if (raw.empty()) return;
  runOp("exchange", timeout, raw, [&] {
    // Receives first, so that a peer's data never waits for a buffer.
    for (size_t i = 0; i < ops.size(); ++i) {
      if (!bufs[i] || ops[i].kind != P2POp::Kind::kRecv) continue;
      bufs[i]->recv(ops[i].peer, kP2PSlotBase + ops[i].tag, 0, bufs[i]->size);
    }
    for (size_t i = 0; i < ops.size(); ++i) {
      if (!bufs[i] || ops[i].kind != P2POp::Kind::kSend) continue;
      bufs[i]->send(ops[i].peer, kP2PSlotBase + ops[i].tag, 0, bufs[i]->size);
    }
    for (size_t i = 0; i < ops.size(); ++i) {
      if (!bufs[i]) continue;
      if (ops[i].kind == P2POp::Kind::kRecv) {
        waitRecv(bufs[i].get(), ops[i].peer);
      } else {
        waitSend(bufs[i].get(), ops[i].peer);
      }
    }
  });
}

void GlooCommunicator::barrier(std::chrono::milliseconds timeout) {
  if (p2pOnLanes()) {
    // One round: 8 bytes to every other member and from every other member, so the last
    // member to arrive releases all the others at once (a ring allreduce on Gloo's pairs
    // takes 2(P - 1) hand-overs in turn, and released five members up to 8 ms apart in a
    // reconfiguration's copies).
    checkAlive();
    timeout = resolveTimeout(timeout);
    const auto seq = static_cast<uint32_t>(barrierSeq_++);
    at::Tensor out = at::full({1}, static_cast<int64_t>(seq), at::kLong);
    at::Tensor in = at::empty({size()}, at::kLong);
    std::vector<P2POp> ops;
    for (int r = 0; r < size(); ++r) {
      if (r == rank_) continue;
      ops.push_back(P2POp::send(out, r, seq));
      ops.push_back(P2POp::recv(in.narrow(0, r, 1), r, seq));
    }
    exchangeOnLanes(ops, "barrier", timeout, kLaneBarrierMagic);
    return;
  }
  at::Tensor one = at::ones({1}, at::kLong);
  allreduce(one, ReduceOp::kSum, timeout);
  SINEW_ENFORCE(one.item<int64_t>() == size(), describe(), ": barrier counted ",
                one.item<int64_t>(), " members, expected ", size());
}

}  // namespace

namespace {

// Empty if the process's gloo:: functions are those of the libgloo Sinew was built against;
// else why not. libtorch 2.x exports a bundled Gloo of another version: if it precedes
// libgloo in the executable's DT_NEEDED list, the dynamic linker binds Sinew's calls to it,
// whose classes have other layouts, and the first operation crashes.
std::string glooBindingProblem() {
  // Where Sinew's own reference to a Gloo function went, whatever the libraries are called.
  Dl_info mine{};
  auto* fn = reinterpret_cast<void*>(&gloo::transport::tcp::CreateDevice);
  if (::dladdr(fn, &mine) != 0 && mine.dli_fname != nullptr &&
      std::strstr(mine.dli_fname, "libtorch") != nullptr) {
    return std::string("gloo::transport::tcp::CreateDevice resolves to ") + mine.dli_fname +
           ": libtorch 2.x bundles its own Gloo, and it comes before libgloo in this "
           "program's link order. Link Sinew::sinew (or gloo) before ${TORCH_LIBRARIES}, or "
           "run with LD_PRELOAD=libgloo.so.0";
  }
  void* ours = ::dlopen("libgloo.so.0", RTLD_NOW | RTLD_NOLOAD);
  if (ours == nullptr) return {};  // Gloo linked in statically: nothing can interpose.
  const char* symbol = "_ZN4gloo9transport3tcp12CreateDeviceERKNS1_4attrE";
  void* bound = ::dlsym(RTLD_DEFAULT, symbol);
  void* expected = ::dlsym(ours, symbol);
  ::dlclose(ours);
  if (bound == nullptr || expected == nullptr || bound == expected) return {};
  Dl_info info{};
  std::string from = ::dladdr(bound, &info) != 0 && info.dli_fname ? info.dli_fname : "?";
  return "gloo::transport::tcp::CreateDevice resolves to " + from +
         " instead of libgloo.so.0: libtorch 2.x bundles its own Gloo, and it comes before "
         "libgloo in this program's link order. Link Sinew::sinew (or gloo) before "
         "${TORCH_LIBRARIES}, or run with LD_PRELOAD=libgloo.so.0";
}

}  // namespace

std::unique_ptr<Communicator> createGlooCommunicator(const std::shared_ptr<Store>& store,
                                                     const CommunicatorOptions& options) {
  static const std::string problem = glooBindingProblem();
  if (!problem.empty()) SINEW_THROW(InvalidArgument, "createGlooCommunicator: ", problem);
  return std::make_unique<GlooCommunicator>(store, options);
}

}  // namespace collectives
}  // namespace sinew
