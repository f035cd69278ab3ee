#include "sinew/collectives/prefix_store.h"

namespace sinew {
namespace collectives {

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> store)
    : prefix_(std::move(prefix)), store_(std::move(store)) {
  if (store_ == nullptr) {
    SINEW_THROW(InvalidArgument, "PrefixStore '", prefix_, "': the wrapped store is null");
  }
}

std::vector<std::string> PrefixStore::join(const std::vector<std::string>& keys) const {
  std::vector<std::string> out;
  out.reserve(keys.size());
  for (const auto& k : keys) out.push_back(join(k));
  return out;
}

void PrefixStore::set(const std::string& key, const Bytes& value) { store_->set(join(key), value); }

Bytes PrefixStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  return store_->get(join(key), timeout);
}

int64_t PrefixStore::add(const std::string& key, int64_t delta) {
  return store_->add(join(key), delta);
}

Bytes PrefixStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  return store_->compareSet(join(key), expected, desired);
}

void PrefixStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  store_->wait(join(keys), timeout);
}

bool PrefixStore::check(const std::vector<std::string>& keys) { return store_->check(join(keys)); }

bool PrefixStore::deleteKey(const std::string& key) { return store_->deleteKey(join(key)); }

}  // namespace collectives
}  // namespace sinew
