#include "sinew/collectives/gloo/pair_mesh.h"

#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/transport/tcp/device.h>

// A Gloo of one listener per device (2023 on) has this header; its pairs are not adopted.
#if __has_include(<gloo/transport/tcp/listener.h>)
#define SINEW_GLOO_PAIRS_ADOPT 0
#else
#define SINEW_GLOO_PAIRS_ADOPT 1
#include <gloo/transport/tcp/context.h>
#include <gloo/transport/tcp/pair.h>
#endif

#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>

#include <mutex>
#include <utility>

#include "sinew/base/error.h"
#include "sinew/collectives/gloo/kept_links.h"
#include "sinew/collectives/gloo/lanes.h"
#include "sinew/collectives/gloo/loop_kicker.h"
#include "sinew/collectives/prefix_store.h"

namespace sinew {
namespace collectives {
namespace gloo_backend {
namespace {

#if SINEW_GLOO_PAIRS_ADOPT
namespace tcp = gloo::transport::tcp;

// Runs `work` once on Gloo's loop thread and returns after the loop's next iteration, so that
// every event the loop had fetched together with the wake-up has been handled too (or, after
// `wait`, false: the handler then stays registered and is never freed, as the loop may still
// call it). Unregistering a descriptor on the loop thread does not wait for a tick, so a batch
// of unregistrations costs two wake-ups of the loop instead of a tick each: with 31 pairs,
// 31 ticks of a loop that 31 busy processes share 2 cores with.
class OnLoop final : public tcp::Handler {
 public:
  static bool run(tcp::Device& device, std::function<void()> work, std::chrono::milliseconds wait) {
    auto h = std::make_unique<OnLoop>();
    h->device_ = &device;
    h->work_ = std::move(work);
    h->fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (h->fd_ < 0) return false;
    device.registerDescriptor(h->fd_, EPOLLIN, h.get());
    kick(h->fd_);
    std::unique_lock<std::mutex> lock(h->mu_);
    if (!h->cv_.wait_for(lock, wait, [&] { return h->phase_ == 2; })) {
      if (h->phase_ == 0) {
        h->work_ = nullptr;  // Too late to run it now; the caller takes the slow path.
        lock.unlock();
        h.release();
        return false;
      }
      // The work ran, and events fetched with it may still be handled: the caller may free
      // what they refer to only after the next iteration, which a running loop reaches.
      h->cv_.wait(lock, [&] { return h->phase_ == 2; });
    }
    lock.unlock();
    ::close(h->fd_);
    return true;
  }

  void handleEvents(int) override {
    uint64_t v;
    while (::read(fd_, &v, sizeof(v)) == static_cast<ssize_t>(sizeof(v))) {
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (phase_ == 0) {
      if (work_) work_();
      phase_ = 1;
      kick(fd_);  // Seen by the loop's next epoll_wait, after this batch's events.
    } else if (phase_ == 1) {
      device_->unregisterDescriptor(fd_, this);  // On the loop thread: no wait.
      phase_ = 2;
      cv_.notify_all();
    }
  }

 private:
  static void kick(int fd) {
    const uint64_t one = 1;
    if (::write(fd, &one, sizeof(one)) < 0) {
      // The counter is full: a wake-up is pending anyway.
    }
  }
  tcp::Device* device_ = nullptr;
  std::function<void()> work_;
  int fd_ = -1;
  std::mutex mu_;
  std::condition_variable cv_;
  int phase_ = 0;  // Guarded by mu_: 0 before the work, 1 after it, 2 after one more iteration.
};

// A Gloo TCP pair that runs on a connection it is given. tcp::Pair's constructor listens on
// an ephemeral port of its own (published nowhere here) and registers it with the device's
// loop; that socket is closed (dropOwnSocketOnLoop, for all pairs of a mesh in one pass of
// the loop thread), and adopt() makes a given connection the pair's, as Gloo's own accept or
// connect does at its end (handleConnected: non-blocking, TCP_NODELAY, the timeouts,
// registered with the loop, CONNECTED). Events for a socket the pair no longer has (the loop
// may have fetched them with the pass that dropped it) are ignored: Gloo's handler would
// stop the process on a pair that is not listening, connecting or connected.
class AdoptingPair final : public tcp::Pair {
 public:
  AdoptingPair(tcp::Context* context, tcp::Device* device, int rank,
               std::chrono::milliseconds timeout)
      : tcp::Pair(context, device, rank, timeout) {}

  void handleEvents(int events) override {
    if (stale_.load(std::memory_order_acquire)) return;
    tcp::Pair::handleEvents(events);
  }

  // Loop thread only: closes the socket Gloo's constructor made (its listener, or a
  // connection it accepted there meanwhile) and returns to the state before listening.
  void dropOwnSocketOnLoop() {
    std::lock_guard<std::mutex> lock(m_);
    stale_.store(true, std::memory_order_release);
    if (fd_ >= 0 && (state_ == LISTENING || state_ == CONNECTED)) {
      device_->unregisterDescriptor(fd_, this);
      ::close(fd_);
    }
    fd_ = -1;
    ex_ = nullptr;
    state_ = INITIALIZING;
  }

  // Loop thread only: closes the pair as its destructor would, without the destructor's wait
  // for a tick of the loop.
  void closeOnLoop() {
    std::lock_guard<std::mutex> lock(m_);
    stale_.store(true, std::memory_order_release);
    if (state_ != CLOSED) changeState(CLOSED);
  }

  // After dropOwnSocketOnLoop, from the thread connecting the mesh.
  void adopt(int fd) {
    std::lock_guard<std::mutex> lock(m_);
    fd_ = fd;
    try {
      handleConnected();  // Throws only before it registers the connection with the loop.
    } catch (...) {
      ::close(fd_);
      fd_ = -1;
      throw;
    }
    stale_.store(false, std::memory_order_release);
  }

  // Never called: the mesh below connects no pair through addresses.
  void connect(const std::vector<char>& /*address*/) override {
    GLOO_THROW_INVALID_OPERATION_EXCEPTION("a pair of Sinew's mesh adopts its connection");
  }

 private:
  std::atomic<bool> stale_{false};
};

class AdoptingContext final : public tcp::Context {
 public:
  using tcp::Context::Context;

  std::unique_ptr<gloo::transport::Pair>& createPair(int rank) override {
    pairs_[rank] = std::unique_ptr<gloo::transport::Pair>(
        new AdoptingPair(this, device_.get(), rank, getTimeout()));
    return pairs_[rank];
  }

  // Runs f on every pair, on the loop thread, in one pass; false if the loop did not get to
  // it within `wait`.
  bool onLoop(void (AdoptingPair::*f)(), std::chrono::milliseconds wait) {
    return OnLoop::run(
        *device_,
        [this, f] {
          for (auto& p : pairs_) {
            if (p) (static_cast<AdoptingPair&>(*p).*f)();
          }
        },
        wait);
  }
};

// gloo::Context with the transport context above; connectFullMesh's last two assignments,
// without its address exchange.
class MeshContext final : public gloo::Context {
 public:
  MeshContext(int rank, int size) : gloo::Context(rank, size) {}

  void adopt(std::shared_ptr<gloo::transport::Device> device,
             std::shared_ptr<gloo::transport::Context> pairs) {
    device_ = std::move(device);
    transportContext_ = std::move(pairs);
  }
  AdoptingContext* pairs() const { return dynamic_cast<AdoptingContext*>(transportContext_.get()); }
};

// How long a pass on the loop thread may take before the slow path (a tick per pair) is used.
constexpr std::chrono::milliseconds kLoopPassWait{2000};

// The pairs of rank `rank` over the connections `connections` made (taken from it).
std::shared_ptr<gloo::Context> adoptConnections(
    int rank, int size, const std::shared_ptr<gloo::transport::Device>& device,
    std::chrono::milliseconds timeout, Lanes& connections, PairLinks* links) {
  auto tcpDevice = std::dynamic_pointer_cast<tcp::Device>(device);
  if (!tcpDevice) SINEW_THROW(InvalidArgument, "connectPairs: not Gloo's TCP device");
  auto pairs = std::make_shared<AdoptingContext>(tcpDevice, rank, size);
  pairs->setTimeout(timeout);
  for (int peer = 0; peer < size; ++peer) {
    if (peer != rank) pairs->createPair(peer);
  }
  if (!pairs->onLoop(&AdoptingPair::dropOwnSocketOnLoop, kLoopPassWait)) {
    SINEW_THROW(IoError, "connectPairs: Gloo's loop did not run within ", kLoopPassWait.count(),
                " ms");
  }
  // A pair adopted before a failure closes on the loop thread too, without a tick's wait.
  struct CloseOnFailure {
    AdoptingContext* pairs;
    bool armed = true;
    ~CloseOnFailure() {
      if (armed) pairs->onLoop(&AdoptingPair::closeOnLoop, kLoopPassWait);
    }
  } closeOnFailure{pairs.get()};
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    auto& pair = pairs->getPair(peer);
    const int fd = connections.takePairFd(peer);
    if (fd < 0) SINEW_THROW(InternalError, "connectPairs: no connection to rank ", peer);
    const int own = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
    try {
      static_cast<AdoptingPair&>(*pair).adopt(fd);
    } catch (...) {
      if (own >= 0) ::close(own);
      throw;
    }
    if (own < 0) SINEW_THROW(IoError, "connectPairs: cannot keep a descriptor of rank ", peer);
    links->fds[peer] = own;
  }
  closeOnFailure.armed = false;
  auto context = std::make_shared<MeshContext>(rank, size);
  context->setTimeout(timeout);
  context->adopt(device, std::move(pairs));
  return context;
}
#endif  // SINEW_GLOO_PAIRS_ADOPT

std::chrono::milliseconds leftUntil(std::chrono::steady_clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(1),
                  std::chrono::duration_cast<std::chrono::milliseconds>(
                      deadline - std::chrono::steady_clock::now()));
}

}  // namespace

bool pairsAdoptConnections() { return SINEW_GLOO_PAIRS_ADOPT != 0; }

bool closePairsOnLoop(gloo::Context& context) {
#if SINEW_GLOO_PAIRS_ADOPT
  auto* mesh = dynamic_cast<MeshContext*>(&context);
  AdoptingContext* pairs = mesh ? mesh->pairs() : nullptr;
  return pairs != nullptr && pairs->onLoop(&AdoptingPair::closeOnLoop, kLoopPassWait);
#else
  (void)context;
  return false;
#endif
}

std::shared_ptr<gloo::Context> connectPairs(const std::shared_ptr<Store>& store, int rank, int size,
                                            const std::string& host, int64_t epoch,
                                            std::chrono::steady_clock::time_point deadline,
                                            const std::string& describe,
                                            const std::function<int(int)>& workerOf,
                                            const std::shared_ptr<gloo::transport::Device>& device,
                                            const std::vector<int>& kept, PairLinks* links) {
  links->fds.assign(size, -1);
  links->ids.assign(size, 0);
  try {
#if SINEW_GLOO_PAIRS_ADOPT
    std::vector<std::pair<int, int>> keptPairs(size, {-1, -1});
    for (size_t r = 0; r < kept.size() && r < keptPairs.size(); ++r) keptPairs[r].first = kept[r];
    Lanes connections(*store, rank, size, host, epoch, deadline, describe, workerOf, {}, 0,
                      Lanes::Purpose::kGlooPairs, keptPairs);
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank || connections.peerNonce(peer) == 0) continue;
      links->ids[peer] = peer > rank ? linkId(connections.nonce(), connections.peerNonce(peer))
                                     : linkId(connections.peerNonce(peer), connections.nonce());
    }
    // The pairs' sockets get the time left as their send and receive timeouts; nothing waits
    // on it (every later wait passes its own). Nothing here waits for a tick of Gloo's loop
    // (the pairs' own sockets are dropped in one pass of the loop thread), so no LoopKicker.
    try {
      return adoptConnections(rank, size, device, leftUntil(deadline), connections, links);
    } catch (...) {
      for (int& fd : links->fds) {
        if (fd >= 0) ::close(fd);
        fd = -1;
      }
      throw;
    }
#else
    for (int fd : kept) {
      if (fd >= 0) ::close(fd);
    }
    (void)host;
    (void)epoch;
    (void)workerOf;
    auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
    // Gloo waits up to five times the context's timeout for a pair to connect (the "initial
    // connect" case of tcp/pair.h's waitUntil): with a fifth of what is left, one such wait
    // ends by the deadline; the rendezvous' own waits use the deadline (GlooStoreAdapter).
    context->setTimeout(leftUntil(deadline) / 5);
    auto gstore = std::make_shared<PrefixStore>("gloo", store);
    GlooStoreAdapter adapter(gstore, deadline);
    LoopKicker kicker(device);
    auto mutableDevice = device;
    context->connectFullMesh(adapter, mutableDevice);
    return context;
#endif
  } catch (const gloo::Exception& e) {
    SINEW_THROW(IoError, describe, ": connecting to the members failed: ", e.what());
  } catch (const Error& e) {
    // A member that did not connect in time, a connection that broke or a malformed entry
    // (Timeout, IoError, Corruption from Lanes) is an IoError, as when Gloo's own mesh failed;
    // the message begins with `describe` (Lanes prefix it). What else the store throws (its
    // epoch is over, say) goes on as it is.
    if (dynamic_cast<const Timeout*>(&e) == nullptr &&
        dynamic_cast<const IoError*>(&e) == nullptr &&
        dynamic_cast<const Corruption*>(&e) == nullptr) {
      throw;
    }
    SINEW_THROW(IoError, e.what(), " (connecting to the members failed)");
  }
}

}  // namespace gloo_backend
}  // namespace collectives
}  // namespace sinew
