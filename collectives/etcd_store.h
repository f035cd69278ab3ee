#pragma once

// A Store kept in etcd (docs/ha.md): the rendezvous store of a job in high-availability mode,
// so that it outlives every coordinator. Every key is stored under `prefix` (e.g.
// "/sinew/<job>/store/"). Reads are linearizable; waits watch the keys they wait for, so a
// set wakes them at once; add and compareSet are etcd transactions (compare, then put).
//
// Errors: Timeout when no etcd member answers within the client's timeout (or a wait's keys
// are not set by its deadline); IoError when etcd refuses a request.
//
// Thread safety: every method may be called concurrently from several threads.

#include <memory>
#include <string>

#include "sinew/collectives/etcd_client.h"
#include "sinew/store.h"

namespace sinew {
namespace collectives {

class EtcdStore : public Store {
 public:
  // REQUIRES: client is not null.
  EtcdStore(std::shared_ptr<EtcdClient> client, std::string prefix);

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

 private:
  // Waits until `key` (full etcd key) exists, up to deadline; returns its value.
  std::optional<EtcdKeyValue> waitFor(const std::string& key,
                                      std::chrono::steady_clock::time_point deadline);

  const std::shared_ptr<EtcdClient> client_;
  const std::string prefix_;
};

}  // namespace collectives
}  // namespace sinew
