#pragma once

// Leader election on etcd (docs/ha.md): candidates race to create one key bound to a lease of
// their own; the one that created it leads until its lease ends. Its term is the key's create
// revision, which no later leader can have, so every write a leader makes is fenced: a
// transaction that runs only while the leader key still has this create revision (etcd's
// own election recipe). A leader that was paused or cut off past its lease's TTL therefore
// cannot change anything: its writes fail with NotLeader, and leads() turns false as soon as
// its own clock says the lease may have ended, before it hears from etcd, and at the next
// renewal (every quarter TTL) after the key was deleted or made anew by another candidate,
// though its lease lives on.
//
// Thread safety: every method may be called from any thread. One background thread renews
// the lease while this candidate leads.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "sinew/base/error.h"
#include "sinew/collectives/etcd_client.h"

namespace sinew {
namespace runtime {

// A write of a leader that no longer leads (its term is over).
class NotLeader : public Aborted {
 public:
  using Aborted::Aborted;
};

struct LeaderElectionOptions {
  std::shared_ptr<collectives::EtcdClient> etcd;
  // The election's key (e.g. "/sinew/<job>/leader"); the leader's value is stored there.
  std::string key;
  // The lease's TTL: how long a dead or paused leader keeps its term. etcd may grant more
  // (its floor is 1.5 x its election timeout); leads() uses what etcd granted.
  int64_t ttlSeconds = 2;
};

class LeaderElection {
 public:
  explicit LeaderElection(LeaderElectionOptions options);
  // Resigns if leading (revokes the lease, so the next candidate need not wait for the TTL).
  ~LeaderElection();
  LeaderElection(const LeaderElection&) = delete;
  LeaderElection& operator=(const LeaderElection&) = delete;

  // Blocks until this candidate leads, with `value` at the key, or until `giveUp` returns
  // true (checked at least every 500 ms) or `timeout` passes; returns whether it leads.
  // etcd being unreachable is waited out, not thrown.
  bool campaign(const std::string& value, std::chrono::milliseconds timeout,
                const std::function<bool()>& giveUp = nullptr);

  // Whether this candidate still leads as far as it knows: it won, has not resigned, etcd
  // has not said the lease ended, and the last renewal etcd confirmed started less than the
  // granted TTL (minus a margin) ago. A leader must check this before each message it sends.
  bool leads() const;
  // The leader key's create revision while leading (0 otherwise).
  int64_t term() const;
  int64_t lease() const;

  // Runs `ops` only if this candidate still leads (the leader key's create revision is its
  // term). Throws NotLeader when it does not (and from then on leads() is false), and
  // Timeout/IoError when etcd cannot be reached (the caller does not know whether it still
  // leads: it must not act as if the write happened).
  void fencedWrite(const std::vector<collectives::EtcdOp>& ops);
  // Replaces the leader key's value (keeping the lease), fenced.
  void setValue(const std::string& value);

  // Ends this term: revokes the lease (its keys go at once). No-op when not leading.
  void resign();

  // Called once, on the renewal thread, when a term ends without resign(): the lease
  // expired, etcd deleted the key, or renewals failed for longer than the TTL.
  void setOnLost(std::function<void(const std::string& why)> onLost);

 private:
  void renewLoop();
  void lose(const std::string& why);

  LeaderElectionOptions options_;
  std::atomic<int64_t> term_{0};
  std::atomic<int64_t> lease_{0};
  std::atomic<int64_t> grantedTtlMs_{0};
  // When the newest renewal that etcd confirmed was sent (steady clock, ns since epoch).
  std::atomic<int64_t> renewedAtNs_{0};
  std::thread renewer_;
  std::mutex mu_;
  std::condition_variable cv_;
  // Guarded by mu_.
  bool stop_ = false;
  std::function<void(const std::string&)> onLost_;
};

}  // namespace runtime
}  // namespace sinew
