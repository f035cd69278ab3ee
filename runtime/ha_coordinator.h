#pragma once

// High-availability mode (docs/ha.md, docs/architecture.md section 3): the job's state lives in
// etcd and several coordinator processes run, one of them the leader by an etcd lease and election.
//
// Keys, under /sinew/<job>/:
//   leader   the election key, bound to the leader's lease: {"candidate", "pid"} when it wins,
//            then {"term", "host", "port", ...} once it serves (workers connect there)
//   state    the coordinator's durable state (epoch, members, committed step, ...), written
//            only by the leader and only fenced by its term
// Both values are sealed with the job token (collectives::sealEtcdValue): readers skip a
// value without a valid seal.
//   store/   the job's rendezvous store (collectives::EtcdStore)
//
// Thread safety: runHaCoordinator runs on the calling thread; the leader finder may be called
// from any thread.

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "sinew/collectives/etcd_client.h"
#include "sinew/runtime/coordinator.h"
#include "sinew/runtime/coordinator_client.h"

namespace sinew {
namespace runtime {

// The etcd prefix of a job's keys: "/sinew/<job>/". Throws InvalidArgument for a job name
// that is empty, longer than 128 characters, or not [A-Za-z0-9._-].
std::string haPrefix(const std::string& job);

// The newest state a leader of the job stored at `key` (its text without the seal), nullopt
// when there is none. A version whose seal does not hold (not written with the job token) is
// skipped for the version before it in etcd's history, with a line to `log`. Throws
// InvalidArgument when the key has versions but none of them is sealed by the job.
std::optional<std::string> newestSealedState(collectives::EtcdClient& etcd, const std::string& key,
                                             uint64_t token,
                                             const std::function<void(const std::string&)>& log);

struct HaCoordinatorOptions {
  collectives::EtcdOptions etcd;
  std::string job;
  // The coordinator this candidate runs while it leads: host, token (required: every candidate
  // and worker of the job uses the same), expectedWorkers, deadlines, control API, ...
  CoordinatorOptions coordinator;
  // The leader's lease: a dead or paused leader is replaced this long after its last renewal.
  int64_t leaseTtlSeconds = 2;
  // This candidate's name in logs and in the leader key.
  std::string name;
  std::function<void(const std::string&)> log;
  // Where the leader that sees the job end writes its outcome (runtime/job_outcome.h); empty:
  // nowhere.
  std::string outcomePath;
};

// Runs one coordinator candidate of a job until the job ends: campaigns; while it leads,
// serves as the job's coordinator, taking over the state its predecessor stored; when its
// term ends (lease lost, write refused, etcd unreachable past the TTL) it stops serving and
// campaigns again. The leader that sees the job end serves until every worker has left it,
// writes the outcome and returns its status (0 finished, 75 stopped, 1 failed); another
// candidate returns 0 when the job finished or stopped, 1 when it failed. Throws
// InvalidArgument for bad options.
int runHaCoordinator(const HaCoordinatorOptions& options);

// For workers: the CoordinatorClientOptions::awaitLeader that reads and watches the job's
// leader key. It believes only a value sealed with the job's token (collectives::
// sealEtcdValue) that names the term of the key it is in; others are waited past.
CoordinatorClientOptions::LeaderFinder etcdLeaderFinder(
    std::shared_ptr<collectives::EtcdClient> etcd, const std::string& job, uint64_t token);

}  // namespace runtime
}  // namespace sinew
