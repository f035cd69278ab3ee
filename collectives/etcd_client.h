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

#include "sinew/base/cancellation.h"

namespace sinew {
namespace collectives {

struct EtcdEndpoint {
  std::string host;
  uint16_t port = 0;
  bool tls = false;  // "https://host:port"
};

// "[http://|https://]host:port[,...]" -> endpoints. Throws InvalidArgument naming `what`
// (e.g. "SINEW_ETCD") and the entry that is not host:port.
std::vector<EtcdEndpoint> parseEtcdEndpoints(const std::string& list, const std::string& what);

struct EtcdOptions {
  std::vector<EtcdEndpoint> endpoints;
  // One try on one member; a try that fails moves on to the next member...
  std::chrono::milliseconds attemptTimeout{1000};
  // ...until this has passed since the request began (then Timeout).
  std::chrono::milliseconds timeout{5000};
  // etcd's authentication: the client exchanges the user's password for a token
  // (/v3/auth/authenticate) and sends it with every request and watch, and authenticates
  // again when etcd says the token is invalid or expired. Empty user: no authentication. A
  // cluster whose authentication is not enabled (yet) is used without a token.
  std::string user;
  std::string password;
  // TLS, for "https://" endpoints: the members' certificates must chain to caFile's CAs
  // (empty: the system's) and name the endpoint's host (an IP address as an IP SAN); certFile
  // and keyFile (PEM) are the client's certificate for members that require one
  // (etcd --client-cert-auth). A TLS failure names the member and OpenSSL's reason.
  std::string caFile;
  std::string certFile;
  std::string keyFile;
};

// EtcdOptions from the environment, for every Sinew process that talks to etcd:
// SINEW_ETCD (endpoints, required unless given), SINEW_ETCD_USER and SINEW_ETCD_PASSWORD (or
// SINEW_ETCD_PASSWORD_FILE, whose first line is the password), SINEW_ETCD_CA, SINEW_ETCD_CERT,
// SINEW_ETCD_KEY. Throws InvalidArgument naming the variable that is wrong (a user without a
// password, a certificate without its key, a file that cannot be read).
// `endpoints`, when given, is used instead of SINEW_ETCD, and errors about it name it
// `endpointsName` (e.g. sinewctl's "--etcd").
EtcdOptions etcdOptionsFromEnvironment(const std::string& endpoints = "",
                                       const std::string& endpointsName = "SINEW_ETCD");

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

// Values in etcd that only a holder of the job token can have written (docs/ha.md): a JSON
// object with a "seal" field, HMAC-SHA256 keyed by the token over the etcd key and the object
// without its seal (keys sorted, so the same object always gives the same bytes). etcd's
// authentication keeps strangers from writing; the seal keeps a reader from acting on what a
// stranger wrote where etcd has no authentication (an etcd given by address), and binds a
// value to its key (a sealed state cannot pose as a leader).
// Returns objectJson with its seal. Throws InvalidArgument when objectJson is no object.
std::string sealEtcdValue(const std::string& key, const std::string& objectJson, uint64_t token);
// The object's text without its seal when the seal is right; otherwise nullopt, and *why (if
// given) says what was wrong (not JSON, no seal, a wrong seal).
std::optional<std::string> openEtcdValue(const std::string& key, const std::string& text,
                                         uint64_t token, std::string* why = nullptr);

// A high-availability job's leader key (runtime/ha_coordinator.h) as a reader may use it: its
// value (the text without the seal) when it is sealed with `token`, names the term it was
// written in (the key's create revision) and a port; otherwise nullopt, and *why.
std::optional<std::string> openServingLeader(const EtcdKeyValue& kv, uint64_t token,
                                             std::string* why = nullptr);

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
  // The key's value as it was at `revision` (etcd keeps the history until it is compacted):
  // nullopt when it was absent then. Throws IoError when that revision was compacted away.
  std::optional<EtcdKeyValue> getAt(const std::string& key, int64_t revision);
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

  // Turns on etcd's authentication with one user, "root" (etcd's administrator, who may read
  // and write every key), whose password is rootPassword; from then on etcd refuses requests
  // without a valid token. Throws IoError when the cluster has a root user already (someone
  // else set up its authentication: this client does not know the password) or refuses. The
  // client's own requests then authenticate as root when its options name no user.
  void enableAuth(const std::string& rootPassword);

  // Waits for the first changes to `key` (or, with prefix, to any key starting with it) at or
  // after revision fromRevision, for at most `timeout`; returns them (empty at the timeout).
  // Throws Timeout when no member can be reached, IoError when etcd refuses the watch (e.g.
  // fromRevision was compacted away: read again and watch from the new revision). `cancel`
  // (optional): its cancel() from another thread ends the watch at once, with no events.
  std::vector<EtcdWatchEvent> watch(const std::string& key, bool prefix, int64_t fromRevision,
                                    std::chrono::milliseconds timeout,
                                    Cancellation* cancel = nullptr);

  const EtcdOptions& options() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace collectives
}  // namespace sinew
