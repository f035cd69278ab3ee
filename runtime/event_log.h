#pragma once

// The event log of the coordinator and of each worker (docs/runtime.md, "Event logs"): one JSON
// object a line, appended, each stamped with the wall-clock time and who wrote it. Internal to
// sinew_runtime. Thread safety: write() may be called from any thread.

#include <nlohmann/json.hpp>

#include <cstdio>
#include <memory>
#include <mutex>
#include <string>

namespace sinew {
namespace runtime {

// Wall-clock seconds since the epoch, as the "time" of events.
double wallSeconds();

class EventLog {
 public:
  // Writes nothing until opened.
  EventLog() = default;
  EventLog(const EventLog&) = delete;
  EventLog& operator=(const EventLog&) = delete;

  // Appends to path from now on, creating it if needed (IoError naming the path and the
  // reason if it cannot). Every line gets "time" (wallSeconds()) and the fields of stamp
  // (e.g. {"source": "coordinator"} or {"worker": 3}). Call before any write().
  void open(const std::string& path, nlohmann::json stamp);

  // Appends e, stamped, as one line, and flushes it: a killed process loses no event.
  // Nothing if not opened.
  void write(nlohmann::json e);

  bool enabled() const { return file_ != nullptr; }

 private:
  std::mutex mu_;
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file_{nullptr, &std::fclose};
  nlohmann::json stamp_;
};

}  // namespace runtime
}  // namespace sinew
