#pragma once

// A key-value store for rendezvous (c10d's Store): communicators publish addresses and
// unique ids under keys, and processes wait for each other's keys.
//
// Implementations: HashStore (in one process), FileStore (processes sharing a
// filesystem), TcpStore (a Boost.Asio server and clients), PrefixStore (a namespace
// wrapper, used for per-epoch key prefixes).
//
// Thread safety: every Store method may be called concurrently from several threads.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sinew/collectives/error.h"

namespace sinew {
namespace collectives {

using Bytes = std::vector<uint8_t>;

inline Bytes toBytes(const std::string& s) { return Bytes(s.begin(), s.end()); }
inline std::string toString(const Bytes& b) { return std::string(b.begin(), b.end()); }

class Store {
 public:
  static constexpr std::chrono::milliseconds kDefaultTimeout{30000};

  virtual ~Store() = default;

  // Sets key to value, replacing any previous value, and wakes its waiters.
  virtual void set(const std::string& key, const Bytes& value) = 0;

  // Returns the value of key, waiting for it to be set.
  // Throws Timeout naming the key if it is not set within timeout.
  virtual Bytes get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  Bytes get(const std::string& key) { return get(key, kDefaultTimeout); }

  // Atomically adds delta to the integer stored at key (absent counts as 0; the value is
  // stored as its decimal text) and returns the new value.
  // Throws InvalidArgument if the key holds something that is not an integer.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;

  // Atomically: if key's value equals expected (an absent key equals an empty
  // `expected`), sets it to desired. Returns the value the key holds afterwards (desired
  // on success, the current value otherwise; empty if absent and not set).
  virtual Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) = 0;

  // Waits until every key is set. Throws Timeout naming the missing keys.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  void wait(const std::vector<std::string>& keys) { wait(keys, kDefaultTimeout); }

  // Returns whether every key is set, without waiting.
  virtual bool check(const std::vector<std::string>& keys) = 0;

  // Deletes key; returns whether it existed.
  virtual bool deleteKey(const std::string& key) = 0;
};

}  // namespace collectives
}  // namespace sinew
