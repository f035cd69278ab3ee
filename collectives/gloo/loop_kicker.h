#pragma once

// Internal to the Gloo backend: LoopKicker, which keeps Gloo's TCP loop ticking while a thread
// connects or closes pairs, and GlooStoreAdapter, Gloo's rendezvous store on a Sinew Store with
// one deadline for all its waits. Used by gloo/communicator.cc only.

#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/tcp/loop.h>

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "sinew/store.h"

namespace sinew {
namespace collectives {
namespace gloo_backend {

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
  GlooStoreAdapter(std::shared_ptr<collectives::Store> store,
                   std::chrono::steady_clock::time_point deadline)
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
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline_ - std::chrono::steady_clock::now());
    return std::max(left, std::chrono::milliseconds(1));
  }
  std::shared_ptr<collectives::Store> store_;
  std::chrono::steady_clock::time_point deadline_;
};

}  // namespace gloo_backend
}  // namespace collectives
}  // namespace sinew
