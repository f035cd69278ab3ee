// The takeover protocol of HA mode (docs/ha.md) in one process, without etcd: a coordinator
// whose persist hook stands for etcd, and a second one that takes the job over from what the
// first stored, with clients that find "the leader" through a switchable finder. A step stored
// but never sent is delivered once by the new leader; a step not stored is voted again; a
// leader whose writes are refused or whose lease may have ended sends nothing more; a bad
// state and a late rejoin are refused by name.

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <future>
#include <mutex>
#include <optional>
#include <thread>

#include "../support.h"
#include "sinew/pipeline/plan.h"
#include "sinew/pipeline/profile.h"
#include "sinew/runtime/coordinator.h"
#include "sinew/runtime/coordinator_client.h"

namespace sinew {
namespace runtime {
namespace {

using namespace std::chrono_literals;
using nlohmann::json;
using testing::eventually;
using testing::LogSink;
using Leader = CoordinatorClientOptions::Leader;

// What etcd would hold: the stored state and the current leader.
struct FakeEtcd {
  std::mutex mu;
  std::string state;
  std::optional<Leader> leader;
  // The next store of a state whose committed step is this fails: after storing it
  // (`storeThenFail`: the leader died between storing and sending) or without storing it (a
  // refused write).
  int64_t failAtCommitted = -2;
  bool storeThenFail = false;

  std::function<void(const std::string&)> persist() {
    return [this](const std::string& s) {
      std::lock_guard<std::mutex> lock(mu);
      const int64_t committed = json::parse(s).value("committed", int64_t(-1));
      if (committed == failAtCommitted) {
        failAtCommitted = -2;
        if (storeThenFail) state = s;
        throw Aborted("the term is over (test)");
      }
      state = s;
    };
  }
  void setLeader(const Coordinator& c, int64_t term) {
    std::lock_guard<std::mutex> lock(mu);
    leader = Leader{"127.0.0.1", c.port(), term};
  }
  std::string stored() {
    std::lock_guard<std::mutex> lock(mu);
    return state;
  }
  // The finder a client gets: the current leader if its term differs from `otherThan`.
  CoordinatorClientOptions::LeaderFinder finder(std::atomic<bool>* blocked = nullptr) {
    return [this, blocked](int64_t otherThan, std::chrono::milliseconds timeout,
                           Cancellation* cancel) {
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      while (true) {
        if (cancel && cancel->cancelled()) return std::optional<Leader>();
        if (!blocked || !blocked->load()) {
          std::lock_guard<std::mutex> lock(mu);
          if (leader && leader->term != otherThan) return leader;
        }
        if (std::chrono::steady_clock::now() >= deadline) return std::optional<Leader>();
        std::this_thread::sleep_for(10ms);
      }
    };
  }
};

CoordinatorOptions options(int expected, FakeEtcd& etcd, LogSink* sink, uint64_t token = 77) {
  CoordinatorOptions o;
  o.expectedWorkers = expected;
  o.heartbeatInterval = 50ms;
  o.deadAfter = 500ms;
  o.token = token;
  o.persist = etcd.persist();
  o.persistCommitsEvery = 0ms;  // Every commit stored: the tests fail chosen ones.
  o.takeoverWait = 3s;
  if (sink) o.log = sink->fn();
  return o;
}

std::unique_ptr<CoordinatorClient> client(FakeEtcd& etcd, int worker,
                                          std::atomic<bool>* blocked = nullptr,
                                          std::chrono::milliseconds reconnect = 10s) {
  CoordinatorClientOptions o;
  o.token = 77;
  o.worker = worker;
  o.node = "node" + std::to_string(worker);
  o.connectTimeout = 5s;
  o.reconnectTimeout = reconnect;
  o.awaitLeader = etcd.finder(blocked);
  auto c = std::make_unique<CoordinatorClient>(o);
  c->ready(0);
  return c;
}

// Both workers vote for `step`; returns both verdicts.
std::pair<CoordinatorClient::VoteResult, CoordinatorClient::VoteResult> voteBoth(
    CoordinatorClient& a, CoordinatorClient& b, int64_t epoch, int64_t step) {
  auto fa = std::async(std::launch::async, [&] { return a.vote(epoch, step, 10s); });
  auto fb = std::async(std::launch::async, [&] { return b.vote(epoch, step, 10s); });
  return {fa.get(), fb.get()};
}

TEST(HaCoordinatorTest, AStepStoredButNeverSentIsDeliveredOnceByTheNewLeader) {
  FakeEtcd etcd;
  LogSink sinkA, sinkB;
  auto first = std::make_unique<Coordinator>(options(2, etcd, &sinkA));
  etcd.setLeader(*first, 1);
  auto a = client(etcd, 0);
  auto b = client(etcd, 1);
  ASSERT_EQ(a->waitEpochAfter(-1, 5s).epoch, 0);
  ASSERT_EQ(b->waitEpochAfter(-1, 5s).epoch, 0);
  auto r = voteBoth(*a, *b, 0, 0);
  ASSERT_EQ(r.first, CoordinatorClient::VoteResult::kCommitted);
  EXPECT_EQ(json::parse(etcd.stored()).value("committed", -1), 0);

  // Step 1: the leader stores the commit, then its term ends before it sends anything.
  {
    std::lock_guard<std::mutex> lock(etcd.mu);
    etcd.failAtCommitted = 1;
    etcd.storeThenFail = true;
  }
  auto fa = std::async(std::launch::async, [&] { return a->vote(0, 1, 20s); });
  auto fb = std::async(std::launch::async, [&] { return b->vote(0, 1, 20s); });
  ASSERT_TRUE(eventually([&] { return first->status().deposed; }, 5s));
  EXPECT_TRUE(sinkA.contains("term is over"));
  EXPECT_EQ(first->status().committedStep, 1);  // It decided, stored, and sent nothing.

  // The new leader takes over from what was stored; both workers rejoin.
  CoordinatorOptions ob = options(2, etcd, &sinkB);
  ob.takeoverState = etcd.stored();
  Coordinator second(ob);
  etcd.setLeader(second, 2);
  EXPECT_EQ(fa.get(), CoordinatorClient::VoteResult::kCommitted);
  EXPECT_EQ(fb.get(), CoordinatorClient::VoteResult::kCommitted);
  EpochInfo e = a->waitEpochAfter(0, 10s);
  EXPECT_EQ(e.epoch, 1);
  EXPECT_EQ(e.members, (std::vector<int>{0, 1}));
  EXPECT_EQ(e.resumeStep, 2) << "step 1 is applied once, not redone";
  EXPECT_FALSE(e.sync);
  EXPECT_TRUE(sinkB.contains("worker 0 rejoined (last commit it had: step 0)"));
  EXPECT_TRUE(sinkB.contains("every member rejoined"));
  // The job goes on under the new leader.
  r = voteBoth(*a, *b, 1, 2);
  EXPECT_EQ(r.first, CoordinatorClient::VoteResult::kCommitted);
  EXPECT_EQ(r.second, CoordinatorClient::VoteResult::kCommitted);
  EXPECT_EQ(second.status().committedStep, 2);
  EXPECT_EQ(json::parse(etcd.stored()).value("epoch", -1), 1);
}

TEST(HaCoordinatorTest, AStepNotStoredIsVotedAgain) {
  FakeEtcd etcd;
  LogSink sinkA;
  auto first = std::make_unique<Coordinator>(options(2, etcd, &sinkA));
  etcd.setLeader(*first, 1);
  auto a = client(etcd, 0);
  auto b = client(etcd, 1);
  ASSERT_EQ(a->waitEpochAfter(-1, 5s).epoch, 0);
  b->waitEpochAfter(-1, 5s);
  ASSERT_EQ(voteBoth(*a, *b, 0, 0).first, CoordinatorClient::VoteResult::kCommitted);
  {
    std::lock_guard<std::mutex> lock(etcd.mu);
    etcd.failAtCommitted = 1;
    etcd.storeThenFail = false;  // The write of step 1 is refused: another leader's term.
  }
  auto fa = std::async(std::launch::async, [&] { return a->vote(0, 1, 20s); });
  auto fb = std::async(std::launch::async, [&] { return b->vote(0, 1, 20s); });
  ASSERT_TRUE(eventually([&] { return first->status().deposed; }, 5s));
  CoordinatorOptions ob = options(2, etcd, nullptr);
  ob.takeoverState = etcd.stored();
  Coordinator second(ob);
  etcd.setLeader(second, 2);
  EXPECT_EQ(fa.get(), CoordinatorClient::VoteResult::kSuperseded);
  EXPECT_EQ(fb.get(), CoordinatorClient::VoteResult::kSuperseded);
  EpochInfo e = a->waitEpochAfter(0, 10s);
  EXPECT_EQ(e.epoch, 1);
  EXPECT_EQ(e.resumeStep, 1) << "step 1 was never committed: it is voted again";
  EXPECT_EQ(voteBoth(*a, *b, 1, 1).first, CoordinatorClient::VoteResult::kCommitted);
}

// Commits are stored now and then (persistCommitsEvery), not before each is sent: a new leader
// learns the newer ones from the members that rejoin it, and none is applied twice.
TEST(HaCoordinatorTest, CommitsNotYetStoredAreLearnedFromTheMembers) {
  FakeEtcd etcd;
  LogSink sinkB;
  CoordinatorOptions oa = options(2, etcd, nullptr);
  oa.persistCommitsEvery = std::chrono::hours(1);
  auto first = std::make_unique<Coordinator>(oa);
  etcd.setLeader(*first, 1);
  auto a = client(etcd, 0);
  auto b = client(etcd, 1);
  ASSERT_EQ(a->waitEpochAfter(-1, 5s).epoch, 0);
  b->waitEpochAfter(-1, 5s);
  for (int64_t step = 0; step < 5; ++step) {
    ASSERT_EQ(voteBoth(*a, *b, 0, step).first, CoordinatorClient::VoteResult::kCommitted);
  }
  // The epoch's first commit was stored at once; the next four were not (within the hour).
  EXPECT_EQ(json::parse(etcd.stored()).value("committed", -1), 0);
  first.reset();  // The leader dies.
  CoordinatorOptions ob = options(2, etcd, &sinkB);
  ob.takeoverState = etcd.stored();
  Coordinator second(ob);
  etcd.setLeader(second, 2);
  EpochInfo e = a->waitEpochAfter(0, 10s);
  EXPECT_EQ(e.epoch, 1);
  EXPECT_EQ(e.resumeStep, 5) << "steps 1..4 were committed: the members had applied them";
  EXPECT_TRUE(sinkB.contains("worker 1 rejoined (last commit it had: step 4)"));
  EXPECT_EQ(voteBoth(*a, *b, 1, 5).first, CoordinatorClient::VoteResult::kCommitted);
  EXPECT_EQ(second.status().committedStep, 5);
}

TEST(HaCoordinatorTest, ALeaderWhoseLeaseMayHaveEndedSendsNothing) {
  FakeEtcd etcd;
  LogSink sink;
  std::atomic<bool> leaseOk{true};
  CoordinatorOptions o = options(1, etcd, &sink);
  o.mayWrite = [&] { return leaseOk.load(); };
  Coordinator coord(o);
  etcd.setLeader(coord, 1);
  auto a = client(etcd, 0, nullptr, 1s);
  ASSERT_EQ(a->waitEpochAfter(-1, 5s).epoch, 0);
  ASSERT_EQ(a->vote(0, 0, 5s), CoordinatorClient::VoteResult::kCommitted);
  leaseOk = false;
  // The vote is answered by nobody: the commit would be a message, and none goes out (the
  // worker, finding no other leader, gives up after its reconnect timeout).
  EXPECT_THROW(a->vote(0, 1, 500ms), Error);
  EXPECT_TRUE(eventually([&] { return coord.status().deposed; }, 5s));
  EXPECT_TRUE(sink.contains("lease may have ended"));
}

// Declaring a worker dead changes the job: it is stored under the leader's term before the
// worker hears "expelled". When the store is refused (another leader's term), the worker
// hears nothing of it and this coordinator steps down. Before, expelled went out first and
// the death was stored with the next epoch: in the review, a leader whose key was deleted
// expelled worker 0 while the new leader took over.
TEST(HaCoordinatorTest, AWorkerIsExpelledOnlyOnceItsDeathIsStored) {
  FakeEtcd etcd;
  LogSink sink;
  Coordinator coord(options(2, etcd, &sink));
  etcd.setLeader(coord, 1);
  auto a = client(etcd, 0, nullptr, 1s);
  auto b = client(etcd, 1, nullptr, 1s);
  ASSERT_EQ(a->waitEpochAfter(-1, 5s).epoch, 0);
  ASSERT_EQ(b->waitEpochAfter(-1, 5s).epoch, 0);
  ASSERT_EQ(voteBoth(*a, *b, 0, 0).first, CoordinatorClient::VoteResult::kCommitted);
  {
    std::lock_guard<std::mutex> lock(etcd.mu);
    etcd.failAtCommitted = 0;  // the next store (worker 1's death) is refused
  }
  b->muteHeartbeats(5s);
  EXPECT_TRUE(eventually([&] { return coord.status().deposed; }, 5s));
  EXPECT_TRUE(sink.contains("its state could not be stored"));
  try {
    b->waitEpochAfter(0, 2s);
    FAIL() << "worker 1 saw a new epoch";
  } catch (const Expelled& e) {
    FAIL() << "a leader whose term was over expelled worker 1: " << e.what();
  } catch (const Error&) {
    // The connection closed with the term, and no other leader is known: no verdict.
  }
  EXPECT_EQ(json::parse(etcd.stored()).at("dead"), json::array());
}

TEST(HaCoordinatorTest, ABadStateIsRefusedByName) {
  FakeEtcd etcd;
  CoordinatorOptions o = options(1, etcd, nullptr);
  o.takeoverState = "not json";
  try {
    Coordinator c(o);
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("not a JSON object"), std::string::npos) << e.what();
  }
  o.takeoverState = R"({"epoch": 3, "committed": 9, "next_id": 2})";
  try {
    Coordinator c(o);
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("members"), std::string::npos) << e.what();
  }
  o.takeoverState = R"({"epoch": 3, "committed": -7, "next_id": 2, "members": [0]})";
  try {
    Coordinator c(o);
    FAIL() << "no error";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("committed"), std::string::npos) << e.what();
  }
  // A pipeline job's persisted request is held to the bounds of a worker's pipeline message:
  // a field missing or of the wrong type is named (before, JSON's own exception escaped).
  pipeline::Profile profile;
  profile.job.device_memory_bytes = int64_t(1) << 30;
  profile.layers.resize(2);
  const json good = {
      {"profile", pipeline::profileToJson(profile)}, {"fault_tolerance", 0}, {"microbatches", 4}};
  json state = {
      {"epoch", 3}, {"committed", 9}, {"next_id", 2}, {"members", {0}}, {"pipeline_nodes", 1}};
  for (const auto& [field, value] : std::vector<std::pair<std::string, json>>{
           {"profile", nullptr}, {"fault_tolerance", "one"}, {"microbatches", 0}}) {
    json request = good;
    if (value.is_null()) {
      request.erase(field);
    } else {
      request[field] = value;
    }
    state["pipeline"] = request;
    o.takeoverState = state.dump();
    try {
      Coordinator c(o);
      FAIL() << "no error for " << request.dump();
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("pipeline request"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << field << ": not an InvalidArgument: " << e.what();
    }
  }
}

TEST(HaCoordinatorTest, AMemberThatRejoinsTooLateIsExpelledWithTheReason) {
  FakeEtcd etcd;
  LogSink sinkB;
  auto first = std::make_unique<Coordinator>(options(2, etcd, nullptr));
  etcd.setLeader(*first, 1);
  std::atomic<bool> bBlind{false};
  auto a = client(etcd, 0);
  auto b = client(etcd, 1, &bBlind);
  ASSERT_EQ(a->waitEpochAfter(-1, 5s).epoch, 0);
  b->waitEpochAfter(-1, 5s);
  ASSERT_EQ(voteBoth(*a, *b, 0, 0).first, CoordinatorClient::VoteResult::kCommitted);
  // The leader goes; worker 1 cannot see etcd for a while.
  bBlind = true;
  first.reset();
  CoordinatorOptions ob = options(2, etcd, &sinkB);
  ob.takeoverState = etcd.stored();
  ob.takeoverWait = 500ms;
  Coordinator second(ob);
  etcd.setLeader(second, 2);
  EpochInfo e = a->waitEpochAfter(0, 10s);
  EXPECT_EQ(e.members, std::vector<int>{0});
  EXPECT_TRUE(sinkB.contains("worker 1 declared dead: it did not reconnect"));
  bBlind = false;
  try {
    b->waitEpochAfter(0, 10s);
    FAIL() << "the late member was not refused";
  } catch (const Expelled& x) {
    EXPECT_NE(std::string(x.what()).find("reconnected too late"), std::string::npos) << x.what();
  }
  EXPECT_EQ(second.status().dead, std::vector<int>{1});
}

// A pipeline job's new leader starts from its predecessor's last plan (persisted with the
// job's state): when a member does not rejoin, the pipelines that did not hold it keep their
// nodes and layers, and the one that did is reconfigured (docs/pipeline.md section 5). Before,
// the new leader instantiated the templates anew for the members that rejoined.
TEST(HaCoordinatorTest, ANewLeaderReconfiguresThePipelinePlanItTookOver) {
  FakeEtcd etcd;
  LogSink sinkB;
  auto first = std::make_unique<Coordinator>(options(3, etcd, nullptr));
  etcd.setLeader(*first, 1);
  std::atomic<bool> cBlind{false};
  auto a = client(etcd, 0);
  auto b = client(etcd, 1);
  auto c = client(etcd, 2, &cBlind);
  for (auto* w : {a.get(), b.get(), c.get()}) ASSERT_EQ(w->waitEpochAfter(-1, 5s).epoch, 0);
  // Six equal layers, any of which fits one node: templates for 1 to 3 nodes, and f = 1
  // needs two pipelines.
  std::string profile = R"({"version": 1, "microbatch_size": 1, "job": {"devices_per_node": 1,
    "device_memory_bytes": 100000000, "inter_stage_gbps": 10.0,
    "allreduce": {"algorithm": "ring", "bandwidth_gbps": 100.0, "latency_us": 1.0}},
    "layers": [)";
  for (int l = 0; l < 6; ++l) {
    profile += (l ? ", " : "") + std::string(R"({"name": "layer)") + std::to_string(l) +
               R"(", "forward_ms": 1.0, "backward_ms": 2.0, "param_bytes": 1000,
      "optimizer_bytes": 0, "activation_bytes": 100, "output_bytes": 100})";
  }
  profile += "]}";
  a->requestPipelines(0, profile, 1, 6);
  EpochInfo e1 = a->waitEpochAfter(0, 5s);
  ASSERT_EQ(e1.epoch, 1);
  ASSERT_FALSE(e1.plan.empty());
  const pipeline::Plan before = pipeline::planFromJson(e1.plan);
  ASSERT_GE(before.pipelines.size(), 2u);
  b->waitEpochAfter(0, 5s);
  c->waitEpochAfter(0, 5s);
  ASSERT_NE(json::parse(etcd.stored()).value("plan", json()), json()) << "no plan stored";

  // The leader goes, and worker 2 never comes back.
  cBlind = true;
  first.reset();
  CoordinatorOptions ob = options(3, etcd, &sinkB);
  ob.takeoverState = etcd.stored();
  ob.takeoverWait = 500ms;
  Coordinator second(ob);
  etcd.setLeader(second, 2);
  EpochInfo e2 = a->waitEpochAfter(1, 10s);
  EXPECT_EQ(e2.members, (std::vector<int>{0, 1}));
  ASSERT_FALSE(e2.plan.empty());
  const pipeline::Plan after = pipeline::planFromJson(e2.plan);
  EXPECT_TRUE(sinkB.contains("lost node 2")) << "the new leader did not reconfigure the plan";
  // Every pipeline without node 2 is the same pipeline, on the same workers, with the same
  // layers.
  int kept = 0;
  for (const auto& p : before.pipelines) {
    if (std::find(p.nodeIds.begin(), p.nodeIds.end(), 2) != p.nodeIds.end()) continue;
    bool found = false;
    for (const auto& q : after.pipelines) found = found || q.nodeIds == p.nodeIds;
    EXPECT_TRUE(found) << "a pipeline that did not hold node 2 changed";
    ++kept;
  }
  EXPECT_GT(kept, 0);
  auto layersOf = [](const pipeline::Plan& plan, int worker) {
    for (const auto& w : plan.workers) {
      if (w.worker == worker) return std::make_pair(w.firstLayer, w.endLayer);
    }
    return std::make_pair(-1, -1);
  };
  for (const auto& p : before.pipelines) {
    if (std::find(p.nodeIds.begin(), p.nodeIds.end(), 2) != p.nodeIds.end()) continue;
    for (int node : p.nodeIds) {
      EXPECT_EQ(layersOf(after, node), layersOf(before, node)) << "worker " << node;
    }
  }
  cBlind = false;
}

}  // namespace
}  // namespace runtime
}  // namespace sinew
