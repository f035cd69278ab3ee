#include "sinew/collectives/etcd_store.h"

#include <algorithm>

#include "sinew/base/error.h"
#include "sinew/collectives/hash_store.h"

namespace sinew {
namespace collectives {

using Clock = std::chrono::steady_clock;

EtcdStore::EtcdStore(std::shared_ptr<EtcdClient> client, std::string prefix)
    : client_(std::move(client)), prefix_(std::move(prefix)) {
  if (!client_) SINEW_THROW(InvalidArgument, "EtcdStore without an etcd client");
}

void EtcdStore::set(const std::string& key, const Bytes& value) {
  client_->put(prefix_ + key, toString(value));
}

std::optional<EtcdKeyValue> EtcdStore::waitFor(const std::string& key, Clock::time_point deadline) {
  while (true) {
    int64_t revision = 0;
    auto kv = client_->get(key, &revision);
    if (kv) return kv;
    const auto now = Clock::now();
    if (now >= deadline) return std::nullopt;
    // Watch from the revision after the read: a set in between is among the events. A watch
    // that ends without events (its deadline, a member lost) is followed by a fresh read.
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now);
    client_->watch(
        key, /*prefix=*/false, revision + 1,
        std::max(std::chrono::milliseconds(1), std::min(left, std::chrono::milliseconds(2000))));
  }
}

Bytes EtcdStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  auto kv = waitFor(prefix_ + key, Clock::now() + timeout);
  if (!kv) {
    SINEW_THROW(Timeout, "store key '", key, "' was not set within ", timeout.count(),
                " ms (etcd store ", prefix_, ")");
  }
  return toBytes(kv->value);
}

int64_t EtcdStore::add(const std::string& key, int64_t delta) {
  const std::string full = prefix_ + key;
  while (true) {
    auto kv = client_->get(full);
    const int64_t current = kv ? parseStoreInteger(key, toBytes(kv->value)) : 0;
    const int64_t next = current + delta;
    // Put only if nobody changed the key since the read (its mod revision, or its absence).
    EtcdCompare unchanged;
    unchanged.key = full;
    if (kv) {
      unchanged.target = EtcdCompare::Target::kModRevision;
      unchanged.number = kv->modRevision;
    } else {
      unchanged.target = EtcdCompare::Target::kVersion;
      unchanged.number = 0;
    }
    if (client_->txn({unchanged}, {EtcdOp::put(full, std::to_string(next))}).succeeded) {
      return next;
    }
  }
}

Bytes EtcdStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  const std::string full = prefix_ + key;
  // An absent key equals an empty `expected`; so does a present empty value. etcd's compares
  // are all-of, so these are two transactions: absent, then equal to `expected`.
  if (expected.empty()) {
    EtcdCompare absent;
    absent.key = full;
    absent.target = EtcdCompare::Target::kVersion;
    absent.number = 0;
    if (client_->txn({absent}, {EtcdOp::put(full, toString(desired))}).succeeded) return desired;
  }
  EtcdCompare equal;
  equal.key = full;
  equal.target = EtcdCompare::Target::kValue;
  equal.value = toString(expected);
  EtcdCompare present;
  present.key = full;
  present.target = EtcdCompare::Target::kVersion;
  present.op = EtcdCompare::Op::kGreater;
  present.number = 0;
  auto r =
      client_->txn({present, equal}, {EtcdOp::put(full, toString(desired))}, {EtcdOp::get(full)});
  if (r.succeeded) return desired;
  if (r.gets.empty() || !r.gets[0]) return Bytes();
  return toBytes(r.gets[0]->value);
}

void EtcdStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (const auto& key : keys) {
    if (!waitFor(prefix_ + key, deadline)) {
      std::string missing;
      for (const auto& k : keys) {
        if (!client_->get(prefix_ + k)) missing += (missing.empty() ? "'" : ", '") + k + "'";
      }
      SINEW_THROW(Timeout, "store keys ", missing.empty() ? "'" + key + "'" : missing,
                  " were not set within ", timeout.count(), " ms (etcd store ", prefix_, ")");
    }
  }
}

bool EtcdStore::check(const std::vector<std::string>& keys) {
  for (const auto& key : keys) {
    if (!client_->get(prefix_ + key)) return false;
  }
  return true;
}

bool EtcdStore::deleteKey(const std::string& key) { return client_->deleteKey(prefix_ + key) > 0; }

}  // namespace collectives
}  // namespace sinew
