#pragma once

// Internal: what the layer profiler measures of memory (sinew/pipeline/profiler.h). While a
// CpuMemoryMeter is alive, libtorch's CPU allocator is a counting one that forwards to the
// allocator it replaced: live() is the bytes allocated through it and not yet freed, peak()
// the most live() has been since the last resetPeak(). Tensors allocated while it was alive
// may outlive it: their memory is freed through the allocator that made it, and counted off.
//
// The count is process-wide: allocations of other threads (a communicator, a flush) while a
// meter is alive count too, so the profiler measures before training starts.
//
// Thread safety: live() and peak() may be read from any thread; one meter at a time (a second
// one, or another allocator installed at a higher priority, leaves installed() false).

#include <cstdint>

namespace sinew {
namespace pipeline {

class CpuMemoryMeter {
 public:
  CpuMemoryMeter();
  ~CpuMemoryMeter();  // Restores the allocator it replaced.
  CpuMemoryMeter(const CpuMemoryMeter&) = delete;
  CpuMemoryMeter& operator=(const CpuMemoryMeter&) = delete;

  // Whether the counting allocator is the CPU allocator (false: nothing is counted).
  bool installed() const { return installed_; }
  int64_t live() const;
  int64_t peak() const;
  // Makes peak() live() from now on.
  void resetPeak();

 private:
  bool installed_ = false;
};

}  // namespace pipeline
}  // namespace sinew
