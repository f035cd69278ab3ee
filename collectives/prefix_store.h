#pragma once

// Wraps a Store so that every key is prefixed with "<prefix>/": one namespace per epoch
// or per communicator, so keys of an older epoch never satisfy a newer wait.
// Thread safety: as thread-safe as the wrapped store.

#include <memory>

#include "sinew/base/error.h"
#include "sinew/store.h"

namespace sinew {
namespace collectives {

class PrefixStore : public Store {
 public:
  // The wrapped store is shared: several PrefixStores over one TcpStore client is the
  // normal case.
  PrefixStore(std::string prefix, std::shared_ptr<Store> store);

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool deleteKey(const std::string& key) override;
  using Store::get;
  using Store::wait;

  const std::string& prefix() const { return prefix_; }
  const std::shared_ptr<Store>& underlying() const { return store_; }

 private:
  std::string join(const std::string& key) const { return prefix_ + "/" + key; }
  std::vector<std::string> join(const std::vector<std::string>& keys) const;

  const std::string prefix_;
  const std::shared_ptr<Store> store_;
};

}  // namespace collectives
}  // namespace sinew
