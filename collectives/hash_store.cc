#include "sinew/collectives/hash_store.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>

namespace sinew {
namespace collectives {

int64_t parseStoreInteger(const std::string& key, const Bytes& value) {
  std::string text = toString(value);
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(text.c_str(), &end, 10);
  if (text.empty() || errno != 0 || end != text.c_str() + text.size()) {
    SINEW_THROW(InvalidArgument, "store key '", key, "' holds '", text.substr(0, 32),
                "', not an integer counter");
  }
  return static_cast<int64_t>(v);
}

void HashStore::set(const std::string& key, const Bytes& value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    map_[key] = value;
  }
  cv_.notify_all();
}

Bytes HashStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  wait({key}, timeout);
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(key);
  if (it == map_.end()) {
    // Deleted between the wait and the lookup.
    SINEW_THROW(Timeout, "store key '", key, "' was deleted while waiting for it");
  }
  return it->second;
}

int64_t HashStore::add(const std::string& key, int64_t delta) {
  int64_t result;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(key);
    int64_t current = it == map_.end() ? 0 : parseStoreInteger(key, it->second);
    result = current + delta;
    map_[key] = toBytes(std::to_string(result));
  }
  cv_.notify_all();
  return result;
}

Bytes HashStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  Bytes result;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = map_.find(key);
    if (it == map_.end()) {
      if (!expected.empty()) return Bytes();
      map_[key] = desired;
      result = desired;
    } else if (it->second == expected) {
      it->second = desired;
      result = desired;
    } else {
      return it->second;
    }
  }
  cv_.notify_all();
  return result;
}

void HashStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  std::unique_lock<std::mutex> lock(mu_);
  auto allSet = [&] {
    return std::all_of(keys.begin(), keys.end(),
                       [&](const std::string& k) { return map_.count(k) > 0; });
  };
  if (!cv_.wait_until(lock, deadline, allSet)) {
    std::string missing;
    for (const auto& k : keys) {
      if (map_.count(k) == 0) missing += (missing.empty() ? "" : ", ") + k;
    }
    SINEW_THROW(Timeout, "store wait timed out after ", timeout.count(),
                " ms; missing keys: ", missing);
  }
}

bool HashStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mu_);
  return std::all_of(keys.begin(), keys.end(),
                     [&](const std::string& k) { return map_.count(k) > 0; });
}

bool HashStore::deleteKey(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  return map_.erase(key) > 0;
}

}  // namespace collectives
}  // namespace sinew
