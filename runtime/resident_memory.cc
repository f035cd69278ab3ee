#include "sinew/runtime/resident_memory.h"

#include <sys/resource.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>

namespace sinew {
namespace runtime {

namespace {

// VmHWM in bytes, or -1.
int64_t highWater() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::atoll(line.c_str() + 6) * 1024;
  }
  return -1;
}

// Makes VmHWM the current resident memory (clear_refs 5); false where it cannot.
bool resetHighWater() {
  std::ofstream f("/proc/self/clear_refs");
  f << "5";
  f.flush();
  return static_cast<bool>(f);
}

}  // namespace

int64_t ResidentMemory::processPeak() {
  struct rusage u {};
  getrusage(RUSAGE_SELF, &u);
  // Linux reports KiB; the kernel's own high-water mark may be a page or two ahead of it.
  return std::max(static_cast<int64_t>(u.ru_maxrss) * 1024, highWater());
}

void ResidentMemory::startTraining() {
  beforeTraining_ = processPeak();  // The reset below also resets getrusage's figure.
  reset_ = resetHighWater();
}

void ResidentMemory::phase(const char* name) {
  if (!byPhase_ || !reset_) return;
  const int64_t mark = highWater();
  if (current_ != nullptr) {
    int64_t& p = phases_[current_];
    p = std::max(p, mark);
  }
  phasesPeak_ = std::max(phasesPeak_, mark);
  current_ = name;
  resetHighWater();
}

int64_t ResidentMemory::trainingPeak() const {
  if (!reset_) return -1;
  return std::max(phasesPeak_, highWater());
}

std::map<std::string, int64_t> ResidentMemory::byPhase() const {
  std::map<std::string, int64_t> out = phases_;
  if (current_ != nullptr) {
    int64_t& p = out[current_];
    p = std::max(p, highWater());
  }
  return out;
}

int64_t ResidentMemory::lifetimePeak() const {
  return std::max({beforeTraining_, processPeak(), phasesPeak_});
}

}  // namespace runtime
}  // namespace sinew
