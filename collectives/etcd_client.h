#pragma once

// A client of etcd's v3 API through its documented JSON gateway (etcd 3.4: POST /v3/kv/range,
// /v3/kv/put, /v3/kv/txn, /v3/lease/*, /v3/watch), over Boost.Beast. Sinew's high-availability
// mode keeps the job's state, its leader and its rendezvous store in etcd (docs/ha.md).
//
// The client talks to one member at a time. A request that fails there (refused, reset, no
// answer within attemptTimeout, or etcd's "unavailable") goes on to the next member, until
// `timeout` has passed; so a job keeps its store and its leader through the loss of any
// minority of the members. When no member answers (the cluster lost its majority), requests
// throw Timeout: callers wait and retry, they never guess.
//
// Thread safety: every method may be called from any thread. Requests share one keep-alive
// connection, one request at a time; watch() opens a connection of its own per call.

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace sinew {
namespace collectives {

struct EtcdEndpoint {
  std::string host;
  uint16_t port = 0;
};

// "host:port[,host:port...]" -> endpoints. Throws InvalidArgument naming `what` (e.g.
// "SINEW_ETCD") and the entry that is not host:port.
std::vector<EtcdEndpoint> parseEtcdEndpoints(const std::string& list, const std::string& what);

struct EtcdOptions {
  std::vector<EtcdEndpoint> endpoints;
  // One try on one member; a try that fails moves on to the next member...
  std::chrono::milliseconds attemptTimeout{1000};
  // ...until this has passed since the request began (then Timeout).
  std::chrono::milliseconds timeout{5000};
};

struct EtcdKeyValue {
  std::string key;
  std::string value;
  int64_t createRevision = 0;
  int64_t modRevision = 0;
  int64_t version = 0;
  int64_t lease = 0;
};

// One condition of a transaction (etcd's Compare): the key's target compared with a number
// (versions, revisions, lease) or, for kValue, with `value`. An absent key has version 0 and
// create revision 0.
struct EtcdCompare {
  enum class Target { kVersion, kCreateRevision, kModRevision, kValue, kLease };
  enum class Op { kEqual, kNotEqual, kGreater, kLess };
  std::string key;
  Target target = Target::kVersion;
  Op op = Op::kEqual;
  int64_t number = 0;
  std::string value;
};

// One operation of a transaction branch.
struct EtcdOp {
  enum class Kind { kPut, kGet, kDelete };
  Kind kind = Kind::kPut;
  std::string key;
  std::string value;
  int64_t lease = 0;  // puts only; 0: none

  static EtcdOp put(std::string key, std::string value, int64_t lease = 0);
  static EtcdOp get(std::string key);
  static EtcdOp del(std::string key);
};

struct EtcdTxnResult {
  bool succeeded = false;  // the compares held, and the success branch ran
  int64_t revision = 0;    // the store's revision after the transaction
  // What the branch's get operations read, in order (nullopt: the key was absent).
  std::vector<std::optional<EtcdKeyValue>> gets;
};

struct EtcdWatchEvent {
  bool deleted = false;
  EtcdKeyValue kv;  // after a put: the new value; after a delete: the key and revision
};

class EtcdClient {
 public:
  // Throws InvalidArgument without endpoints. Connects lazily.
  explicit EtcdClient(EtcdOptions options);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  // The key's value (nullopt when absent). *revision, if given, gets the store's revision at
  // the read: a watch from revision + 1 sees every later change.
  std::optional<EtcdKeyValue> get(const std::string& key, int64_t* revision = nullptr);
  // Every key that starts with prefix, in key order.
  std::vector<EtcdKeyValue> getPrefix(const std::string& prefix, int64_t* revision = nullptr);
  // Returns the store's revision after the put.
  int64_t put(const std::string& key, const std::string& value, int64_t lease = 0);
  // Returns how many keys were deleted.
  int64_t deleteKey(const std::string& key);
  int64_t deletePrefix(const std::string& prefix);
  // If every compare holds, runs `success`, else `failure`; atomically.
  EtcdTxnResult txn(const std::vector<EtcdCompare>& compares, const std::vector<EtcdOp>& success,
                    const std::vector<EtcdOp>& failure = {});

  // A lease of ttlSeconds; returns its id. etcd may grant a longer TTL than asked (it has a
  // floor): *grantedTtl gets what it granted.
  int64_t grantLease(int64_t ttlSeconds, int64_t* grantedTtl = nullptr);
  // Renews the lease; returns its remaining TTL in seconds, 0 when the lease is gone.
  int64_t keepAlive(int64_t lease);
  // Ends the lease at once (its keys are deleted); a lease already gone is no error.
  void revokeLease(int64_t lease);

  // Waits for the first changes to `key` (or, with prefix, to any key starting with it) at or
  // after revision fromRevision, for at most `timeout`; returns them (empty at the timeout).
  // Throws Timeout when no member can be reached, IoError when etcd refuses the watch (e.g.
  // fromRevision was compacted away: read again and watch from the new revision).
  std::vector<EtcdWatchEvent> watch(const std::string& key, bool prefix, int64_t fromRevision,
                                    std::chrono::milliseconds timeout);

  const EtcdOptions& options() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace collectives
}  // namespace sinew
