#pragma once

// Internal to the Gloo backend: threads that outlive the communicator they served, for the
// watchers (one per peer). A communicator of 31 peers made 31 threads and joined them at its
// end; when 31 processes on 2 cores built their communicators at once after a repair, making
// the threads took 20-35 ms of a 60 ms set-up (docs/collectives.md, "Repair"). A finished job's
// thread parks and takes the next job; a process keeps at most kMaxParked idle threads.
//
// Thread safety: every method may be called from any thread.

#include <unistd.h>

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace sinew {
namespace collectives {
namespace gloo_backend {

class ParkedThreads {
 public:
  static constexpr size_t kMaxParked = 256;

  // A job handed to a thread; wait() returns once it has run.
  class Job {
   public:
    void wait() {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return done_; });
    }

   private:
    friend class ParkedThreads;
    std::function<void()> fn_;
    std::mutex mu_;
    std::condition_variable cv_;
    bool done_ = false;
  };

  // This process's threads. A forked child starts with none (its parent's are not there).
  static ParkedThreads& instance() {
    static std::mutex mu;
    static ParkedThreads* threads = nullptr;
    std::lock_guard<std::mutex> lock(mu);
    // Never destroyed: parked threads wait on it until the process ends.
    if (threads == nullptr || threads->pid_ != ::getpid()) threads = new ParkedThreads;
    return *threads;
  }

  // Runs fn on a parked thread, or a new one. fn must not throw.
  std::shared_ptr<Job> run(std::function<void()> fn) {
    auto job = std::make_shared<Job>();
    job->fn_ = std::move(fn);
    std::shared_ptr<Slot> slot;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!idle_.empty()) {
        slot = std::move(idle_.back());
        idle_.pop_back();
      }
    }
    if (!slot) {
      slot = std::make_shared<Slot>();
      slot->job = job;
      std::thread([this, slot] { serve(slot); }).detach();
      return job;
    }
    {
      std::lock_guard<std::mutex> lock(slot->mu);
      slot->job = job;
    }
    slot->cv.notify_one();
    return job;
  }

 private:
  // One thread's mailbox.
  struct Slot {
    std::mutex mu;
    std::condition_variable cv;
    std::shared_ptr<Job> job;  // Guarded by mu: the next job, until the thread takes it.
  };

  ParkedThreads() : pid_(::getpid()) {}

  void serve(const std::shared_ptr<Slot>& slot) {
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(slot->mu);
        slot->cv.wait(lock, [&] { return slot->job != nullptr; });
        job = std::move(slot->job);
      }
      job->fn_();
      job->fn_ = nullptr;
      {
        std::lock_guard<std::mutex> lock(job->mu_);
        job->done_ = true;
      }
      job->cv_.notify_all();
      job.reset();
      std::lock_guard<std::mutex> lock(mu_);
      if (idle_.size() >= kMaxParked) return;
      idle_.push_back(slot);
    }
  }

  const pid_t pid_;
  std::mutex mu_;
  std::vector<std::shared_ptr<Slot>> idle_;  // Guarded by mu_: parked threads.
};

}  // namespace gloo_backend
}  // namespace collectives
}  // namespace sinew
