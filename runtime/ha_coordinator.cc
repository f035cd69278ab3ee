#include "sinew/runtime/ha_coordinator.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cstdio>
#include <functional>
#include <optional>
#include <thread>

#include "sinew/base/error.h"
#include "sinew/base/parse.h"
#include "sinew/runtime/job_outcome.h"
#include "sinew/runtime/leader_election.h"

namespace sinew {
namespace runtime {

using Clock = std::chrono::steady_clock;
using collectives::EtcdClient;
using collectives::EtcdOp;
using nlohmann::json;

std::string haPrefix(const std::string& job) {
  if (job.empty() || job.size() > 128) {
    SINEW_THROW(InvalidArgument, "job name '", job, "' must have 1 to 128 characters");
  }
  for (char c : job) {
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      SINEW_THROW(InvalidArgument, "job name '", job,
                  "' may hold only letters, digits, '.', '_' and '-'");
    }
  }
  return "/sinew/" + job + "/";
}

std::optional<std::string> newestSealedState(EtcdClient& etcd, const std::string& key,
                                             uint64_t token,
                                             const std::function<void(const std::string&)>& log) {
  auto kv = etcd.get(key);
  bool skipped = false;
  for (int i = 0; kv && i < 1000; ++i) {
    std::string why;
    if (auto opened = collectives::openEtcdValue(key, kv->value, token, &why)) return opened;
    if (log) {
      log("the job's state at etcd revision " + std::to_string(kv->modRevision) +
          " is not one its leaders wrote (" + why + "); reading the version before it");
    }
    skipped = true;
    kv = etcd.getAt(key, kv->modRevision - 1);
  }
  if (skipped) {
    SINEW_THROW(InvalidArgument, "the job's state in etcd (", key,
                ") has no version sealed with the job token: it was written by someone else");
  }
  return std::nullopt;
}

namespace {

// The job's end as a stored state says it: 0 finished, 1 failed, -1 still running.
int jobEndOf(const std::string& state) {
  json st = ::sinew::detail::tryParseJson(state);
  if (!st.is_object()) return -1;
  if (st.value("failed", false)) return 1;
  if (st.value("finished", false)) return 0;
  return -1;
}

}  // namespace

namespace {

void resignQuietly(LeaderElection& election) {
  try {
    election.resign();
  } catch (const Error&) {
  }
}

// The coordinator a leader serves in its term: it takes over `state` (the newest sealed one),
// stores each state sealed and fenced by the term (docs/ha.md, rule 3), and the leader key
// then names it, sealed and bound to the term: a reader connects (and sends the job token)
// only to an address a leader of this job named in the term the key was created in.
std::unique_ptr<Coordinator> serveTerm(const HaCoordinatorOptions& options,
                                       LeaderElection& election, const std::string& leaderKey,
                                       const std::string& stateKey,
                                       const std::optional<std::string>& state) {
  const uint64_t token = options.coordinator.token;
  CoordinatorOptions co = options.coordinator;
  if (state) co.takeoverState = *state;
  co.persist = [&election, &options, stateKey, token](const std::string& stateJson) {
    json st = json::parse(stateJson);
    st["leader"] = options.name;
    st["term"] = election.term();
    election.fencedWrite(
        {EtcdOp::put(stateKey, collectives::sealEtcdValue(stateKey, st.dump(), token))});
  };
  co.mayWrite = [&election] { return election.leads(); };
  auto coordinator = std::make_unique<Coordinator>(co);
  election.setValue(collectives::sealEtcdValue(leaderKey,
                                               json{{"candidate", options.name},
                                                    {"pid", static_cast<int64_t>(::getpid())},
                                                    {"term", election.term()},
                                                    {"host", coordinator->host()},
                                                    {"port", coordinator->port()},
                                                    {"control_host", coordinator->controlHost()},
                                                    {"control_port", coordinator->controlPort()}}
                                                   .dump(),
                                               token));
  return coordinator;
}

// Serves until the term ends (nullopt; the coordinator is gone and the term resigned) or the
// job ends: then serves until every worker has left, writes the outcome, resigns and returns
// the exit status.
std::optional<int> serveUntilEnd(const HaCoordinatorOptions& options,
                                 std::unique_ptr<Coordinator>& coordinator,
                                 LeaderElection& election,
                                 const std::function<void(const std::string&)>& log) {
  while (true) {
    coordinator->waitFinished(std::chrono::milliseconds(100));
    auto st = coordinator->status();
    if (st.deposed || !election.leads()) {
      log("its term is over; it stops serving");
      coordinator.reset();
      resignQuietly(election);
      return std::nullopt;
    }
    if (st.failed || st.finished) {
      // Workers may still use the job's store, released ones report their last checkpoint:
      // serve until every worker has left (or the term ends, or 300 s passed).
      const auto endedAt = Clock::now();
      while (coordinator->status().connected > 0 && election.leads() &&
             Clock::now() - endedAt < std::chrono::seconds(300)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
      const json outcome = coordinator->outcome();
      if (!options.outcomePath.empty()) {
        try {
          writeOutcomeFile(outcome, options.outcomePath);
        } catch (const Error& e) {
          log(e.what());
        }
      }
      coordinator.reset();
      resignQuietly(election);
      log(outcomeLine(outcome));
      return outcomeExitStatus(outcome);
    }
  }
}

}  // namespace

int runHaCoordinator(const HaCoordinatorOptions& options) {
  const std::string prefix = haPrefix(options.job);
  const std::string leaderKey = prefix + "leader";
  const std::string stateKey = prefix + "state";
  if (options.coordinator.token == 0) {
    SINEW_THROW(InvalidArgument, "HA coordinator without the job token (every candidate and ",
                "worker must share it)");
  }
  auto log = [&](const std::string& line) {
    const std::string full = "sinew coordinator " + options.name + ": " + line;
    if (options.log) {
      options.log(full);
    } else {
      std::fprintf(stderr, "%s\n", full.c_str());
    }
  };
  auto etcd = std::make_shared<EtcdClient>(options.etcd);
  LeaderElectionOptions eo;
  eo.etcd = etcd;
  eo.key = leaderKey;
  eo.ttlSeconds = options.leaseTtlSeconds;
  LeaderElection election(eo);
  const uint64_t token = options.coordinator.token;
  const std::string candidate = collectives::sealEtcdValue(
      leaderKey,
      json{{"candidate", options.name}, {"pid", static_cast<int64_t>(::getpid())}}.dump(), token);
  int ended = -1;
  auto jobEnded = [&] {
    try {
      // Only a state sealed with the job token ends it (a forged "finished" does not).
      auto state = etcd->get(stateKey);
      auto opened = state ? collectives::openEtcdValue(stateKey, state->value, token)
                          : std::optional<std::string>();
      ended = opened ? jobEndOf(*opened) : -1;
    } catch (const Error&) {
      // etcd unreachable: the job is not known to have ended.
    }
    return ended >= 0;
  };
  while (true) {
    if (jobEnded()) {
      log(std::string("the job ") + (ended == 0 ? "finished" : "failed") + "; exiting");
      return ended;
    }
    if (!election.campaign(candidate, std::chrono::seconds(5), jobEnded)) continue;
    const auto wonAt = Clock::now();
    log("leads the job (term " + std::to_string(election.term()) + ")");
    std::unique_ptr<Coordinator> coordinator;
    try {
      // Read after winning: every state a previous leader stored is visible (linearizable).
      auto state = newestSealedState(*etcd, stateKey, token, log);
      if (state && jobEndOf(*state) >= 0) {
        election.resign();
        continue;  // The loop's check exits.
      }
      coordinator = serveTerm(options, election, leaderKey, stateKey, state);
      log("serves at " + coordinator->host() + ":" + std::to_string(coordinator->port()) + " " +
          std::to_string(
              std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - wonAt).count()) +
          " ms after winning" + (state ? " (taking the job over)" : " (a new job)"));
    } catch (const InvalidArgument& e) {
      log(std::string("cannot serve the job: ") + e.what());
      election.resign();
      return 1;
    } catch (const Error& e) {
      log(std::string("lost the term before serving: ") + e.what());
      coordinator.reset();
      resignQuietly(election);
      continue;
    }
    if (auto status = serveUntilEnd(options, coordinator, election, log)) return *status;
  }
}

CoordinatorClientOptions::LeaderFinder etcdLeaderFinder(std::shared_ptr<EtcdClient> etcd,
                                                        const std::string& job, uint64_t token) {
  const std::string key = haPrefix(job) + "leader";
  return
      [etcd, key, token](int64_t otherThan, std::chrono::milliseconds timeout,
                         Cancellation* cancel) -> std::optional<CoordinatorClientOptions::Leader> {
        const auto deadline = Clock::now() + timeout;
        while (true) {
          if (cancel && cancel->cancelled()) return std::nullopt;
          int64_t revision = 0;
          auto kv = etcd->get(key, &revision);
          if (kv && kv->createRevision != otherThan) {
            // A leader serves once its value names its port; only a value sealed with the job
            // token for this term is believed (the job token goes to the address it names).
            auto opened = collectives::openServingLeader(*kv, token, nullptr);
            if (opened) {
              const json v = json::parse(*opened);
              CoordinatorClientOptions::Leader leader;
              leader.host = v.value("host", std::string("127.0.0.1"));
              leader.port = static_cast<uint16_t>(v.at("port").get<int>());
              leader.term = kv->createRevision;
              return leader;
            }
          }
          const auto left =
              std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
          if (left.count() <= 0) return std::nullopt;
          etcd->watch(key, false, revision + 1, left, cancel);
        }
      };
}

}  // namespace runtime
}  // namespace sinew
