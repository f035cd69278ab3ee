#pragma once

// A key-value store for rendezvous (c10d's Store): communicators publish addresses and
// unique ids under keys, and processes wait for each other's keys.
//
// Implementations, made by the factories at the bottom: an in-process hash map
// (makeHashStore), a shared directory (makeFileStore), a client of a TCP store server such as
// the one the coordinator serves (connectTcpStore), and a namespace wrapper for per-epoch key
// prefixes (makePrefixStore).
//
// Thread safety: every Store method may be called concurrently from several threads.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "sinew/error.h"

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

// An in-process store backed by a hash map: for threads of one process and for tests.
std::shared_ptr<Store> makeHashStore();

// A store in a directory every process can reach (a local or shared filesystem): the
// rendezvous of last resort when no TCP server runs, e.g. under srun with a shared scratch
// directory. Creates the directory if missing; throws IoError naming the path on failure.
std::shared_ptr<Store> makeFileStore(const std::string& dir);

// Every key of `base` prefixed with "<prefix>/": one namespace per epoch or communicator, so
// keys of an older epoch never satisfy a newer wait. Throws InvalidArgument for a null base.
std::shared_ptr<Store> makePrefixStore(const std::string& prefix, std::shared_ptr<Store> base);

struct TcpStoreOptions {
  // The server's job token (SINEW_TOKEN; a TcpStoreServer's token()). Required: a request
  // under any other token is refused.
  uint64_t token = 0;
  // How long to keep retrying the first connection (and a reconnection) before Timeout.
  std::chrono::milliseconds connectTimeout{60000};
  // Deadline of requests that do not wait for keys (set, add, compareSet, check, delete).
  std::chrono::milliseconds timeout{30000};
};

// A client of the TCP store served at host:port (docs/store_protocol.md), e.g. the
// coordinator's, under options.token (InvalidArgument when 0). Does not connect yet: the first
// request does, retrying until connectTimeout. Every method throws Timeout when the server does not
// answer by the deadline and IoError when the connection breaks; the next call reconnects.
std::shared_ptr<Store> connectTcpStore(const std::string& host, uint16_t port,
                                       const TcpStoreOptions& options = TcpStoreOptions());

}  // namespace collectives
}  // namespace sinew
