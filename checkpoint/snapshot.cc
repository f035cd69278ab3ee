#include "sinew/checkpoint/snapshot.h"

#include <ATen/ATen.h>

#include <atomic>
#include <cstring>
#include <system_error>

#include "sinew/base/crc32c.h"
#include "sinew/base/error.h"
#include "sinew/config.h"

#if SINEW_WITH_NCCL
#include <cuda_runtime_api.h>
#endif

namespace sinew {
namespace checkpoint {
namespace {

using Clock = std::chrono::steady_clock;

double secondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

bool anyCuda(const ShardState& state) {
  for (const auto& l : state) {
    for (const auto& t : l.tensors) {
      if (t.tensor.defined() && t.tensor.is_cuda()) return true;
    }
  }
  return false;
}

#if SINEW_WITH_NCCL
void checkCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) SINEW_THROW(IoError, "snapshot: ", what, ": ", cudaGetErrorString(e));
}
#endif

}  // namespace

SnapshotArena::SnapshotArena(const ShardState& like, SnapshotOptions options)
    : options_(std::move(options)), layout_(ShardLayout::of(like)) {
  if (options_.slots < 2 || options_.checksumThreads < 1) {
    SINEW_THROW(InvalidArgument, "SnapshotOptions::slots = ", options_.slots,
                " must be >= 2 and checksumThreads = ", options_.checksumThreads, " >= 1");
  }
  if (anyCuda(like)) {
#if SINEW_WITH_NCCL
    pinned_ = true;
    // One GPU per arena: its stream, events and legacy stream are that device's.
    for (const auto& l : like) {
      for (const auto& t : l.tensors) {
        if (!t.tensor.defined() || !t.tensor.is_cuda()) continue;
        if (device_ < 0) device_ = t.tensor.get_device();
        if (t.tensor.get_device() != device_) {
          SINEW_THROW(InvalidArgument, "snapshot arena: tensor '", l.name, ".", t.name, "' is on ",
                      t.tensor.device().str(), " but others on cuda:", device_,
                      "; one arena holds the tensors of one GPU");
        }
      }
    }
    checkCuda(cudaSetDevice(device_), "cudaSetDevice");
    cudaStream_t s = nullptr;
    checkCuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    cudaStream_ = s;
    // Events the copy thread waits on block it (no spinning on a core training needs).
    auto event = [](unsigned flags) {
      cudaEvent_t ev = nullptr;
      checkCuda(cudaEventCreateWithFlags(&ev, flags), "cudaEventCreate");
      return static_cast<void*>(ev);
    };
    readyEvent_ = event(cudaEventDisableTiming);
    copiedEvent_ = event(cudaEventDisableTiming);
    for (const auto& l : like) {
      for (const auto& t : l.tensors) {
        tensorEvents_.push_back(
            t.tensor.is_cuda() ? event(cudaEventDisableTiming | cudaEventBlockingSync) : nullptr);
      }
    }
#else
    SINEW_THROW(InvalidArgument,
                "snapshot of CUDA tensors needs Sinew built with CUDA (SINEW_WITH_NCCL=1)");
#endif
  }
  // Two slots from the start (the committed version and the next one); any further slot
  // only once snapshot() finds both held (a version that never committed, a slow reader).
  for (int i = 0; i < std::min(options_.slots, kEagerSlots); ++i) slots_.push_back(newSlot());
  thread_ = std::thread([this] { copyLoop(); });
}

std::shared_ptr<HostShard> SnapshotArena::newSlot() const {
  auto slot = std::make_shared<HostShard>(layout_.totalBytes, pinned_);
  slot->owner = options_.owner;
  return slot;
}

SnapshotArena::~SnapshotArena() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
#if SINEW_WITH_NCCL
  if (cudaStream_ != nullptr) {
    // Copies still queued write into slots freed below: let them land first.
    cudaSetDevice(device_);
    cudaStreamSynchronize(static_cast<cudaStream_t>(cudaStream_));
    for (void* ev : tensorEvents_) {
      if (ev != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(ev));
    }
    cudaEventDestroy(static_cast<cudaEvent_t>(readyEvent_));
    cudaEventDestroy(static_cast<cudaEvent_t>(copiedEvent_));
    cudaStreamDestroy(static_cast<cudaStream_t>(cudaStream_));
  }
#endif
}

bool SnapshotArena::snapshot(int64_t step, const ShardState& state) {
  // Validate on the caller's thread, so a wrong state is the caller's exception.
  ShardLayout layout = ShardLayout::of(state);
  if (!layout.sameShape(layout_)) {
    SINEW_THROW(InvalidArgument, "snapshot of step ", step,
                ": state's layers, tensors, dtypes or shapes differ from the arena's");
  }
  auto job = std::make_unique<Job>();
  job->step = step;
  for (const auto& l : state) {
    for (const auto& t : l.tensors) {
      // A non-contiguous tensor is made contiguous here, once (an allocation); trainers
      // pass contiguous parameters and optimizer state.
      job->tensors.push_back(t.tensor.is_contiguous() ? t.tensor : t.tensor.contiguous());
      const size_t i = job->tensors.size() - 1;
      const bool deviceCopy = pinned_ && tensorEvents_[i] != nullptr;
      if (t.tensor.is_cuda() != deviceCopy || (!t.tensor.is_cuda() && !t.tensor.is_cpu()) ||
          (deviceCopy && t.tensor.get_device() != device_)) {
        SINEW_THROW(InvalidArgument, "snapshot of step ", step, ": tensor '", l.name, ".", t.name,
                    "' is on ", t.tensor.device().str(), ", not where the arena's was");
      }
    }
  }
  std::unique_lock<std::mutex> lock(mu_);
  if (pending_ && !waited_) {
    SINEW_THROW(InvalidArgument, "snapshot of step ", step, " while step ", pendingStep_,
                " is still being copied: call waitBeforeUpdate() first");
  }
  if (error_) {
    // A copy that failed after waitBeforeUpdate() returned (CUDA): reported here, once.
    auto e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
  if (pending_) {
    // CUDA: the previous version's copies are ordered before the update but its checksums
    // are still being computed; this version is skipped rather than the step blocked.
    stats_.skipped++;
    return false;
  }
  // Pick the oldest slot nobody reads that is neither the newest complete nor protected.
  int64_t newest = -1;
  for (const auto& s : slots_) {
    if (s->complete) newest = std::max(newest, s->step);
  }
  std::shared_ptr<HostShard> chosen;
  for (const auto& s : slots_) {
    if (s.use_count() != 1) continue;  // Only we hold it; nobody can acquire it unlocked.
    if (s->complete && (s->step == newest || s->step == protected_)) continue;
    if (!chosen || !s->complete || (chosen->complete && s->step < chosen->step)) chosen = s;
  }
  if (!chosen && static_cast<int>(slots_.size()) < options_.slots) {
    // Allocated and faulted in off the lock (readers of the other slots go on); only this
    // thread takes snapshots, and nothing is pending, so the choice stands meanwhile.
    lock.unlock();
    chosen = newSlot();
    lock.lock();
    slots_.push_back(chosen);
  }
  if (!chosen) {
    stats_.skipped++;
    return false;
  }
  chosen->complete = false;
  chosen->step = step;
  chosen->layout = layout_;
  job->slot = chosen;
  if (pinned_) {
    try {
      enqueueDeviceCopies(*job);
    } catch (...) {
#if SINEW_WITH_NCCL
      // Copies queued before the failure still read the tensors and write the slot.
      cudaStreamSynchronize(static_cast<cudaStream_t>(cudaStream_));
#endif
      chosen->step = -1;
      throw;
    }
  }
  job_ = std::move(job);
  pending_ = true;
  hostPending_ = true;
  waited_ = false;
  pendingStep_ = step;
  lock.unlock();
  cv_.notify_all();
  return true;
}

void SnapshotArena::enqueueDeviceCopies(Job& job) {
#if SINEW_WITH_NCCL
  auto stream = static_cast<cudaStream_t>(cudaStream_);
  auto ready = static_cast<cudaEvent_t>(readyEvent_);
  checkCuda(cudaSetDevice(device_), "cudaSetDevice");  // The legacy stream of our GPU.
  // After everything queued so far on the legacy default stream: the optimizer step.
  checkCuda(cudaEventRecord(ready, cudaStreamLegacy), "cudaEventRecord");
  checkCuda(cudaStreamWaitEvent(stream, ready, 0), "cudaStreamWaitEvent");
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    if (tensorEvents_[i] == nullptr) continue;  // A host tensor: the copy thread's.
    const auto& rec = layout_.tensors[i];
    checkCuda(cudaMemcpyAsync(job.slot->data() + rec.offset, job.tensors[i].data_ptr(), rec.nbytes,
                              cudaMemcpyDeviceToHost, stream),
              "cudaMemcpyAsync");
    checkCuda(cudaEventRecord(static_cast<cudaEvent_t>(tensorEvents_[i]), stream),
              "cudaEventRecord");
  }
  checkCuda(cudaEventRecord(static_cast<cudaEvent_t>(copiedEvent_), stream), "cudaEventRecord");
  deviceCopiesQueued_ = true;
#else
  (void)job;
#endif
}

void SnapshotArena::orderDefaultStream() {
#if SINEW_WITH_NCCL
  if (!deviceCopiesQueued_) return;
  checkCuda(cudaSetDevice(device_), "cudaSetDevice");
  checkCuda(cudaStreamWaitEvent(cudaStreamLegacy, static_cast<cudaEvent_t>(copiedEvent_), 0),
            "cudaStreamWaitEvent");
  deviceCopiesQueued_ = false;
#endif
}

void SnapshotArena::waitFor(std::unique_lock<std::mutex>& lock, std::chrono::milliseconds timeout,
                            const std::function<bool()>& done) {
  if (timeout.count() < 0) timeout = options_.waitTimeout;
  auto start = Clock::now();
  if (!cv_.wait_for(lock, timeout, done)) {
    SINEW_THROW(Timeout, "snapshot of step ", pendingStep_, " not complete after ", timeout.count(),
                " ms");
  }
  stats_.waitSeconds += secondsSince(start);
}

void SnapshotArena::waitBeforeUpdate(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  waitFor(lock, timeout, [&] { return !hostPending_ || error_ != nullptr; });
  endWait(lock);
}

void SnapshotArena::waitComplete(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  waitFor(lock, timeout, [&] { return !pending_; });
  endWait(lock);
}

void SnapshotArena::endWait(std::unique_lock<std::mutex>& lock) {
  if (error_) {
    auto e = error_;
    error_ = nullptr;
    std::rethrow_exception(e);
  }
  waited_ = true;
  lock.unlock();
  orderDefaultStream();
}

std::shared_ptr<const HostShard> SnapshotArena::latest() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::shared_ptr<const HostShard> best;
  for (const auto& s : slots_) {
    if (s->complete && (!best || s->step > best->step)) best = s;
  }
  return best;
}

std::vector<std::shared_ptr<const HostShard>> SnapshotArena::all() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<const HostShard>> out;
  for (const auto& s : slots_) {
    if (s->complete) out.push_back(s);
  }
  return out;
}

std::shared_ptr<const HostShard> SnapshotArena::find(int64_t step) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& s : slots_) {
    if (s->complete && s->step == step) return s;
  }
  return nullptr;
}

void SnapshotArena::protect(int64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  protected_ = std::max(protected_, step);
}

void SnapshotArena::setOnFailed(std::function<void(int64_t, std::exception_ptr)> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  onFailed_ = std::move(fn);
}

void SnapshotArena::setOnComplete(std::function<void(std::shared_ptr<const HostShard>)> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  onComplete_ = std::move(fn);
}

SnapshotStats SnapshotArena::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  SnapshotStats s = stats_;
  s.bytesAllocated = slots_.size() * layout_.totalBytes;
  return s;
}

void SnapshotArena::copyLoop() {
  for (;;) {
    std::unique_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || job_ != nullptr; });
      if (stop_ && job_ == nullptr) return;
      job = std::move(job_);
    }
    auto start = Clock::now();
    std::exception_ptr err;
    try {
      copyOne(*job);
    } catch (...) {
      err = std::current_exception();  // Rethrown by waitBeforeUpdate().
    }
    if (err) {
      // Before any waiter can see the failure, so its owner's accounting is already done.
      std::function<void(int64_t, std::exception_ptr)> onFailed;
      {
        std::lock_guard<std::mutex> lock(mu_);
        onFailed = onFailed_;
      }
      if (onFailed) onFailed(job->step, err);
    }
    std::function<void(std::shared_ptr<const HostShard>)> onComplete;
    std::shared_ptr<const HostShard> done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.copySeconds += secondsSince(start);
      if (err) {
        job->slot->step = -1;
        error_ = err;
      } else {
        job->slot->complete = true;
        stats_.taken++;
        stats_.bytesCopied += layout_.totalBytes;
        done = job->slot;
        onComplete = onComplete_;
      }
      pending_ = false;
      hostPending_ = false;
    }
    job.reset();  // Drops the tensor references before waking the trainer.
    cv_.notify_all();
    if (onComplete && done) {
      try {
        onComplete(done);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "sinew checkpoint: onComplete of step %lld failed: %s\n",
                     static_cast<long long>(done->step), e.what());
      }
    }
  }
}

void SnapshotArena::copyHost(Job& job, size_t i) {
  auto& rec = job.slot->layout.tensors[i];
  if (options_.beforeCopyTensor) options_.beforeCopyTensor(rec);
  const auto* src = static_cast<const uint8_t*>(job.tensors[i].data_ptr());
  uint8_t* dst = job.slot->data() + rec.offset;
  uint32_t crc = 0;
  for (uint64_t done = 0; done < rec.nbytes;) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(options_.copyChunkBytes, rec.nbytes - done));
    std::memcpy(dst + done, src + done, n);
    crc = ::sinew::detail::crc32cExtend(crc, dst + done, n);
    done += n;
  }
  rec.crc32c = crc;
}

void SnapshotArena::copyOne(Job& job) {
  if (!pinned_) {
    for (size_t i = 0; i < layout_.tensors.size(); ++i) copyHost(job, i);
    return;
  }
#if SINEW_WITH_NCCL
  // The job's device copies were queued before it reached this thread; whatever fails here,
  // they must have landed before its tensors are released (to the caching allocator) and
  // its slot reused.
  struct DrainOnError {
    void* event;
    bool armed = true;
    ~DrainOnError() {
      if (armed) cudaEventSynchronize(static_cast<cudaEvent_t>(event));
    }
  } drain{copiedEvent_};
  checkCuda(cudaSetDevice(device_), "cudaSetDevice");
  // Host tensors first: the optimizer step waits for them (waitBeforeUpdate).
  for (size_t i = 0; i < layout_.tensors.size(); ++i) {
    if (tensorEvents_[i] == nullptr) copyHost(job, i);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    hostPending_ = false;
  }
  cv_.notify_all();
  // Each device tensor is checksummed as soon as its copy has landed, in copy order, by
  // checksumThreads threads (this one among them).
  std::atomic<size_t> next{0};
  std::mutex errorMu;
  std::exception_ptr error;
  auto work = [&] {
    try {
      checkCuda(cudaSetDevice(device_), "cudaSetDevice");
      for (size_t i = next++; i < layout_.tensors.size(); i = next++) {
        if (tensorEvents_[i] == nullptr) continue;
        auto& rec = job.slot->layout.tensors[i];
        if (options_.beforeCopyTensor) options_.beforeCopyTensor(rec);
        checkCuda(cudaEventSynchronize(static_cast<cudaEvent_t>(tensorEvents_[i])),
                  "cudaEventSynchronize (the copy of a CUDA tensor)");
        rec.crc32c = ::sinew::detail::crc32c(job.slot->data() + rec.offset, rec.nbytes);
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(errorMu);
      if (!error) error = std::current_exception();
      next = layout_.tensors.size();  // The others stop too.
    }
  };
  std::vector<std::thread> helpers;
  for (int t = 1; t < options_.checksumThreads; ++t) {
    try {
      helpers.emplace_back(work);
    } catch (const std::system_error&) {
      break;  // No more threads to be had: fewer checksum the rest.
    }
  }
  work();
  for (auto& h : helpers) h.join();
  if (error) std::rethrow_exception(error);
  drain.armed = false;  // Every copy's event was waited for.
#endif
}

}  // namespace checkpoint
}  // namespace sinew
