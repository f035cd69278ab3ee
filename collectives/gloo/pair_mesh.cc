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
#include <unistd.h>

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

// A Gloo TCP pair that runs on a connection it is given. tcp::Pair's constructor listens on
// an ephemeral port of its own (published nowhere here) and registers it with the device's
// loop; that socket is closed at once, and adopt() makes a given connection the pair's, as
// Gloo's own accept or connect does at its end (handleConnected: non-blocking, TCP_NODELAY,
// the timeouts, registered with the loop, CONNECTED).
class AdoptingPair final : public tcp::Pair {
 public:
  AdoptingPair(tcp::Context* context, tcp::Device* device, int rank,
               std::chrono::milliseconds timeout)
      : tcp::Pair(context, device, rank, timeout) {
    std::lock_guard<std::mutex> lock(m_);
    dropOwnSocket();
  }

  void adopt(int fd) {
    std::lock_guard<std::mutex> lock(m_);
    dropOwnSocket();
    fd_ = fd;
    try {
      handleConnected();  // Throws only before it registers the connection with the loop.
    } catch (...) {
      ::close(fd_);
      fd_ = -1;
      throw;
    }
  }

  // Never called: the mesh below connects no pair through addresses.
  void connect(const std::vector<char>& /*address*/) override {
    GLOO_THROW_INVALID_OPERATION_EXCEPTION("a pair of Sinew's mesh adopts its connection");
  }

 private:
  // Closes the socket Gloo's constructor made (its listener, or in the microseconds before
  // this ran, a connection it accepted on it) and returns to the state before listening.
  // REQUIRES: m_ held.
  void dropOwnSocket() {
    if (fd_ >= 0 && (state_ == LISTENING || state_ == CONNECTED)) {
      device_->unregisterDescriptor(fd_, this);
      ::close(fd_);
    }
    fd_ = -1;
    ex_ = nullptr;
    state_ = INITIALIZING;
  }
};

class AdoptingContext final : public tcp::Context {
 public:
  using tcp::Context::Context;

  std::unique_ptr<gloo::transport::Pair>& createPair(int rank) override {
    pairs_[rank] = std::unique_ptr<gloo::transport::Pair>(
        new AdoptingPair(this, device_.get(), rank, getTimeout()));
    return pairs_[rank];
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
};

// The pairs of rank `rank` over the connections `connections` made (taken from it).
std::shared_ptr<gloo::Context> adoptConnections(
    int rank, int size, const std::shared_ptr<gloo::transport::Device>& device,
    std::chrono::milliseconds timeout, Lanes& connections, PairLinks* links) {
  auto tcpDevice = std::dynamic_pointer_cast<tcp::Device>(device);
  if (!tcpDevice) SINEW_THROW(InvalidArgument, "connectPairs: not Gloo's TCP device");
  auto pairs = std::make_shared<AdoptingContext>(tcpDevice, rank, size);
  pairs->setTimeout(timeout);
  for (int peer = 0; peer < size; ++peer) {
    if (peer == rank) continue;
    auto& pair = pairs->createPair(peer);
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
    LoopKicker kicker(device);
    // The pairs' sockets get the time left as their send and receive timeouts; nothing waits
    // on it (every later wait passes its own).
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
