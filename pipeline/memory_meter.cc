#include "sinew/pipeline/memory_meter.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

// libtorch 2.3 made Allocator::allocate non-const and added copy_data().
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define SINEW_ALLOCATE_CONST
#define SINEW_ALLOCATOR_HAS_COPY_DATA 1
#else
#define SINEW_ALLOCATE_CONST const
#define SINEW_ALLOCATOR_HAS_COPY_DATA 0
#endif

namespace sinew {
namespace pipeline {

namespace {

// The counting allocator: one per process, never destroyed (tensors it allocated may outlive
// every meter). Each allocation's context is its data pointer, as libtorch's raw_allocate()
// requires (it asserts get() == get_context(): large CPU matmuls allocate that way); the
// allocator it forwarded to is found by that pointer.
class CountingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) SINEW_ALLOCATE_CONST override {
    c10::DataPtr inner = base_->allocate(n);
    void* data = inner.get();
    if (data == nullptr) return inner;  // Zero bytes: nothing to count.
    const c10::Device device = inner.device();
    {
      std::lock_guard<std::mutex> lock(mu_);
      live_.emplace(data, Entry{std::move(inner), n});
    }
    add(static_cast<int64_t>(n));
    return {data, data, &CountingAllocator::release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }
#if SINEW_ALLOCATOR_HAS_COPY_DATA
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
#endif

  // The allocator the counts forward to; set before the first install.
  void setBase(c10::Allocator* base) { base_ = base; }
  c10::Allocator* base() const { return base_; }

  int64_t live() const { return liveBytes_.load(); }
  int64_t peak() const { return peak_.load(); }
  void resetPeak() { peak_.store(liveBytes_.load()); }

  static CountingAllocator& instance() {
    static CountingAllocator* a = new CountingAllocator();  // Never destroyed.
    return *a;
  }

 private:
  struct Entry {
    c10::DataPtr inner;  // Frees the memory through the allocator that made it.
    size_t bytes = 0;
  };

  static void release(void* data) {
    CountingAllocator& self = instance();
    Entry entry;
    {
      std::lock_guard<std::mutex> lock(self.mu_);
      auto it = self.live_.find(data);
      if (it == self.live_.end()) return;  // Not ours (cannot happen: only ours use this).
      entry = std::move(it->second);
      self.live_.erase(it);
    }
    self.add(-static_cast<int64_t>(entry.bytes));
    // entry.inner frees the memory here, outside the lock.
  }

  void add(int64_t delta) const {
    const int64_t now = liveBytes_.fetch_add(delta) + delta;
    int64_t seen = peak_.load();
    while (now > seen && !peak_.compare_exchange_weak(seen, now)) {
    }
  }

  c10::Allocator* base_ = nullptr;
  mutable std::mutex mu_;
  mutable std::unordered_map<void*, Entry> live_;  // Guarded by mu_.
  mutable std::atomic<int64_t> liveBytes_{0};
  mutable std::atomic<int64_t> peak_{0};
};

std::mutex& meterMutex() {
  static std::mutex m;
  return m;
}
bool meterAlive = false;  // Guarded by meterMutex().

}  // namespace

CpuMemoryMeter::CpuMemoryMeter() {
  std::lock_guard<std::mutex> lock(meterMutex());
  if (meterAlive) return;
  CountingAllocator& counting = CountingAllocator::instance();
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current == &counting) return;
  counting.setBase(current);
  c10::SetCPUAllocator(&counting, /*priority=*/0);
  installed_ = c10::GetCPUAllocator() == &counting;
  meterAlive = installed_;
  if (installed_) counting.resetPeak();
}

CpuMemoryMeter::~CpuMemoryMeter() {
  if (!installed_) return;
  std::lock_guard<std::mutex> lock(meterMutex());
  c10::SetCPUAllocator(CountingAllocator::instance().base(), /*priority=*/0);
  meterAlive = false;
}

int64_t CpuMemoryMeter::live() const {
  return installed_ ? CountingAllocator::instance().live() : 0;
}

int64_t CpuMemoryMeter::peak() const {
  return installed_ ? CountingAllocator::instance().peak() : 0;
}

void CpuMemoryMeter::resetPeak() {
  if (installed_) CountingAllocator::instance().resetPeak();
}

}  // namespace pipeline
}  // namespace sinew
