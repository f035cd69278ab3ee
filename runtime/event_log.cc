#include "sinew/runtime/event_log.h"

#include <cerrno>
#include <chrono>
#include <cstring>

#include "sinew/base/error.h"

namespace sinew {
namespace runtime {

double wallSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void EventLog::open(const std::string& path, nlohmann::json stamp) {
  // "e": close-on-exec, so a launcher's children do not inherit the log.
  std::FILE* f = std::fopen(path.c_str(), "ae");
  if (f == nullptr) {
    SINEW_THROW(IoError, "cannot open the event log ", path, ": ", std::strerror(errno));
  }
  std::lock_guard<std::mutex> lock(mu_);
  file_.reset(f);
  stamp_ = std::move(stamp);
}

void EventLog::write(nlohmann::json e) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!file_) return;
  e["time"] = wallSeconds();
  for (auto it = stamp_.begin(); it != stamp_.end(); ++it) e[it.key()] = it.value();
  // Invalid UTF-8 (say, in an error message) is replaced, never thrown.
  const std::string line = e.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::fwrite(line.data(), 1, line.size(), file_.get());
  std::fflush(file_.get());
}

}  // namespace runtime
}  // namespace sinew
