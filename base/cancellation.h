#pragma once

// Ends a blocking wait from another thread: the waiter registers how to wake itself (e.g. post
// a socket's close to its io_context) for as long as it waits, and cancel() calls that once.
// A wait begun after cancel() sees cancelled() and does not start.
//
// Thread safety: every method may be called from any thread. The hook runs under this object's
// lock, in the thread that calls cancel(): it must not block or call back into this object.

#include <functional>
#include <mutex>
#include <utility>

namespace sinew {

class Cancellation {
 public:
  Cancellation() = default;
  Cancellation(const Cancellation&) = delete;
  Cancellation& operator=(const Cancellation&) = delete;

  void cancel() {
    std::lock_guard<std::mutex> lock(mu_);
    if (cancelled_) return;
    cancelled_ = true;
    if (hook_) hook_();
  }

  bool cancelled() const {
    std::lock_guard<std::mutex> lock(mu_);
    return cancelled_;
  }

  // While it lives, cancel() calls the hook it was made with (not if cancel() came first:
  // check cancelled() after making it). One at a time.
  class Registration {
   public:
    Registration() = default;
    Registration(Cancellation* c, std::function<void()> hook) : c_(c) {
      if (!c_) return;
      std::lock_guard<std::mutex> lock(c_->mu_);
      c_->hook_ = std::move(hook);
    }
    ~Registration() {
      if (!c_) return;
      std::lock_guard<std::mutex> lock(c_->mu_);
      c_->hook_ = nullptr;
    }
    Registration(const Registration&) = delete;
    Registration& operator=(const Registration&) = delete;

   private:
    Cancellation* c_ = nullptr;
  };

 private:
  mutable std::mutex mu_;
  bool cancelled_ = false;
  std::function<void()> hook_;
};

}  // namespace sinew
