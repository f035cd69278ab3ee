#pragma once

// Internal: the resident memory a worker reports (its `done` event): the peak of the whole
// process, the peak while it trained (after the start's profile, which builds every layer of
// the model), and with TrainerOptions::memoryByPhase the peak of each phase of a step.
//
// Linux only: the training peak resets the kernel's high-water mark (VmHWM, through
// /proc/self/clear_refs) when training starts, and each phase resets it again when it begins;
// where that file cannot be written, the training figures are -1. A reset walks the process's
// page tables (about a millisecond per GB resident), so phases are measured only when asked.
//
// Thread safety: one thread (the training thread) calls everything.

#include <cstdint>
#include <map>
#include <string>

namespace sinew {
namespace runtime {

class ResidentMemory {
 public:
  explicit ResidentMemory(bool byPhase) : byPhase_(byPhase) {}

  // The most resident memory this process has used so far, in bytes.
  static int64_t processPeak();

  // Training begins: the peak so far is kept as the lifetime's and the high-water mark reset.
  void startTraining();
  // With phases on, the step enters `phase` (a string literal: "schedule", "reduce", ...):
  // the high-water mark since the last phase began is that phase's, and is reset. Without
  // phases, or before startTraining(), nothing.
  void phase(const char* name);

  // The peak since startTraining() (every phase's included), or -1 where it cannot be read.
  int64_t trainingPeak() const;
  // The process's peak over its whole life, at least trainingPeak().
  int64_t lifetimePeak() const;
  // Each phase's peak resident memory in bytes, the current one's so far included (empty
  // without phases).
  std::map<std::string, int64_t> byPhase() const;

 private:
  const bool byPhase_;
  bool reset_ = false;          // startTraining() reset the high-water mark
  int64_t beforeTraining_ = 0;  // the process's peak when training began
  int64_t phasesPeak_ = -1;     // the highest mark read at a phase change
  const char* current_ = nullptr;
  std::map<std::string, int64_t> phases_;
};

}  // namespace runtime
}  // namespace sinew
