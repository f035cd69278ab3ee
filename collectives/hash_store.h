#pragma once

// An in-process Store backed by a hash map: for threads of one process and for tests.
// Thread safety: all methods are thread-safe.

#include <condition_variable>
#include <mutex>
#include <unordered_map>

#include "sinew/base/error.h"
#include "sinew/store.h"

namespace sinew {
namespace collectives {

class HashStore : public Store {
 public:
  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool deleteKey(const std::string& key) override;
  using Store::get;
  using Store::wait;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  // Guarded by mu_.
  std::unordered_map<std::string, Bytes> map_;
};

// Parses the decimal integer stored by Store::add; throws InvalidArgument naming the key.
int64_t parseStoreInteger(const std::string& key, const Bytes& value);

}  // namespace collectives
}  // namespace sinew
