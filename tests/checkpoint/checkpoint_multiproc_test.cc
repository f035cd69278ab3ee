// Checkpoint tests with forked worker processes (tests/collectives/multiproc.h): nodes are
// SIGKILLed after replication (recovery from peers' RAM exactly when the placement says),
// during replication (the previous version stays committed) and during a flush (LATEST
// stays on the previous version); the engine's periodic flush across two workers.

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <iostream>

#include "../support.h"
#include "multiproc.h"
#include "sinew/checkpoint/engine.h"
#include "sinew/checkpoint/persist.h"
#include "sinew/checkpoint/placement.h"
#include "sinew/checkpoint/restore.h"
#include "sinew/collectives/tcp_store.h"

namespace sinew {
namespace checkpoint {
namespace {

using collectives::TcpStore;
using collectives::TcpStoreOptions;
using collectives::TcpStoreServer;
using collectives::TcpStoreServerOptions;
using collectives::toBytes;
using collectives::toString;
using sinew::testing::ProcessGroup;
using namespace std::chrono_literals;

std::shared_ptr<collectives::Store> connect(uint16_t port) {
  return std::make_shared<TcpStore>("127.0.0.1", port, sinew::testing::storeOptions());
}

// Worker w's shard at step s: two layers named by the worker, values a function of (w, s).
ShardState workerState(int w, int64_t s) {
  ShardState state;
  for (int l = 0; l < 2; ++l) {
    LayerState ls;
    ls.name = "w" + std::to_string(w) + ".l" + std::to_string(l);
    auto base = at::arange(256, at::kFloat).reshape({16, 16});
    ls.tensors.push_back({"weight", base * (w + 1) + s * 0.5 + l});
    ls.tensors.push_back({"exp_avg", (base - s) * 0.25 + w});
    ls.tensors.push_back({"step", at::full({}, s, at::kLong)});
    ls.tensors.push_back({"half", (base + w * 3 + s).to(at::kHalf)});
    state.push_back(std::move(ls));
  }
  return state;
}

// Returns "" if every tensor of want's layers is in got with the same bytes.
std::string compare(const ShardState& want, const std::map<std::string, RestoredLayer>& got) {
  for (const auto& l : want) {
    auto it = got.find(l.name);
    if (it == got.end()) return "missing layer " + l.name;
    for (const auto& t : l.tensors) {
      auto jt = it->second.find(t.name);
      if (jt == it->second.end()) return "missing " + l.name + "/" + t.name;
      if (!at::equal(jt->second, t.tensor)) return "bytes differ in " + l.name + "/" + t.name;
    }
  }
  return "";
}

std::vector<std::string> layersOf(const std::vector<int>& workers) {
  std::vector<std::string> out;
  for (int w : workers) {
    for (const auto& l : workerState(w, 0)) out.push_back(l.name);
  }
  return out;
}

CheckpointEngineOptions engineOptions(int self, int n, std::shared_ptr<collectives::Store> store) {
  CheckpointEngineOptions o;
  o.self = self;
  for (int i = 0; i < n; ++i) o.workers.push_back(i);
  o.replication = 2;
  o.store = std::move(store);
  o.token = sinew::testing::kTestToken;
  o.timeout = 20s;
  o.client.timeout = 10s;
  return o;
}

// Runs versions 0..last of worker self's training, with a snapshot after each step. These
// steps have no compute, so each waits for the previous version to commit, as a step
// longer than replication would.
void train(CheckpointEngine& engine, int self, int64_t last) {
  for (int64_t s = 0; s <= last; ++s) {
    engine.waitBeforeUpdate();  // Before the optimizer step of s.
    if (!engine.snapshot(s, workerState(self, s))) throw std::runtime_error("snapshot skipped");
    engine.waitCommitted(s, 20s);
  }
  engine.waitBeforeUpdate();
}

struct KillCase {
  int n;
  std::set<int> killed;
};

class KillTest : public ::testing::TestWithParam<KillCase> {};

TEST_P(KillTest, RecoveryFromPeersRamExactlyWhenThePlacementSaysSo) {
  const KillCase kc = GetParam();
  const int64_t kStep = 2;
  TcpStoreServer server{sinew::testing::serverOptions()};
  ProcessGroup group;
  for (int w = 0; w < kc.n; ++w) {
    group.spawn([&, w] {
      at::set_num_threads(1);
      auto store = connect(server.port());
      CheckpointEngine engine(workerState(w, 0), engineOptions(w, kc.n, store));
      train(engine, w, kStep);
      engine.waitCommitted(kStep, 20s);
      store->set("ready/" + std::to_string(w), toBytes("1"));
      store->wait({"done"}, 60s);  // Serve replicas until the test is over.
      return 0;
    });
  }
  std::vector<std::string> ready;
  for (int w = 0; w < kc.n; ++w) ready.push_back("ready/" + std::to_string(w));
  server.wait(ready, 60s);
  for (int w : kc.killed) group.signal(w, SIGKILL);
  // A new worker (not in the job) restores every layer, found by name, from RAM.
  ProcessGroup restorer;
  restorer.spawn([&] {
    at::set_num_threads(1);
    auto store = connect(server.port());
    RestoreSources src;
    src.client.token = sinew::testing::kTestToken;
    for (int w = 0; w < kc.n; ++w) {
      src.peers.emplace_back(w, toString(store->get("sinew/ckpt/replica/" + std::to_string(w))));
    }
    src.client.connectTimeout = 300ms;
    std::vector<int> all;
    for (int w = 0; w < kc.n; ++w) all.push_back(w);
    try {
      auto r = restoreLayers(src, kStep, layersOf(all));
      for (int w = 0; w < kc.n; ++w) {
        std::string diff = compare(workerState(w, kStep), r.layers);
        if (!diff.empty()) {
          std::cerr << "restored bytes wrong: " << diff << std::endl;
          return 3;
        }
        for (const auto& l : workerState(w, 0)) {
          const std::string& src = r.source.at(l.name);
          int from = std::stoi(src.substr(5));
          if (kc.killed.count(from) != 0) return 4;
        }
      }
      return 0;
    } catch (const IoError& e) {
      std::cerr << "restore failed: " << e.what() << std::endl;
      return 1;
    }
  });
  auto r = restorer.waitAll(60s);
  server.set("done", toBytes("1"));
  auto exits = group.waitAll(30s);
  std::vector<int> nodes;
  for (int w = 0; w < kc.n; ++w) nodes.push_back(w);
  const bool expected = ReplicaPlacement(nodes, 2).recoverable(kc.killed);
  ASSERT_TRUE(r[0].exited) << r[0].str();
  EXPECT_EQ(r[0].code, expected ? 0 : 1) << "restorer " << r[0].str();
  for (int w = 0; w < kc.n; ++w) {
    if (kc.killed.count(w) != 0) {
      EXPECT_TRUE(exits[w].signaled && exits[w].signal == SIGKILL) << exits[w].str();
    } else {
      EXPECT_TRUE(exits[w].exited && exits[w].code == 0) << "worker " << w << " " << exits[w].str();
    }
  }
}

std::string killName(const ::testing::TestParamInfo<KillCase>& info) {
  std::string s = "n" + std::to_string(info.param.n) + "_killed";
  for (int k : info.param.killed) s += "_" + std::to_string(k);
  return s;
}

// N=4: groups {0,1} {2,3}. N=5: group {0,1} and the ring 2→3→4→2.
INSTANTIATE_TEST_SUITE_P(Placements, KillTest,
                         ::testing::Values(KillCase{4, {1}}, KillCase{4, {0, 2}},
                                           KillCase{4, {1, 3}}, KillCase{4, {2, 3}},
                                           KillCase{5, {3}}, KillCase{5, {0, 3}},
                                           KillCase{5, {1, 4}}, KillCase{5, {2, 4}},
                                           KillCase{5, {0, 1}}),
                         killName);

TEST(ReplicationFailureTest, AWorkerKilledMidTransferLeavesThePreviousVersionCommitted) {
  TcpStoreServer server{sinew::testing::serverOptions()};
  ProcessGroup group;
  // Worker 0 pauses after the first chunk of version 2 until the parent has killed
  // worker 1, its only peer.
  group.spawn([&] {
    at::set_num_threads(1);
    auto store = connect(server.port());
    auto o = engineOptions(0, 2, store);
    o.client.chunkBytes = 1024;
    o.client.afterChunk = [store](int64_t chunk) {
      if (chunk == 0 && store->check({"go-kill"}) == false && store->check({"sending-2"})) {
        store->set("go-kill", toBytes("1"));
        store->wait({"killed"}, 30s);
      }
    };
    o.beforeReplicate = [store](int64_t step) {
      if (step == 2) store->set("sending-2", toBytes("1"));
    };
    CheckpointEngine engine(workerState(0, 0), o);
    train(engine, 0, 1);
    engine.waitCommitted(1, 20s);
    store->set("committed-1", toBytes("1"));
    store->wait({"proceed"}, 30s);
    engine.snapshot(2, workerState(0, 2));
    engine.waitBeforeUpdate();
    // Wait (with a deadline) for the replication thread to give up on version 2.
    auto deadline = std::chrono::steady_clock::now() + 30s;
    while (engine.stats().replicationFailures == 0) {
      if (std::chrono::steady_clock::now() > deadline) return 5;
      std::this_thread::sleep_for(2ms);
    }
    if (engine.committedStep() != 1) return 2;
    if (store->check({"sinew/ckpt/commit/2"})) return 3;
    // Version 1 restores completely from this process's RAM: its own snapshot and the
    // replica of worker 1's shard.
    auto r = engine.restore(1, layersOf({0, 1}));
    for (const auto& kv : r.source) {
      if (kv.second != "local") return 6;
    }
    std::string diff = compare(workerState(0, 1), r.layers) + compare(workerState(1, 1), r.layers);
    if (!diff.empty()) {
      std::cerr << diff << std::endl;
      return 4;
    }
    std::string lost = engine.stats().lastError;
    return lost.find("worker 1") != std::string::npos ? 0 : 7;
  });
  group.spawn([&] {
    at::set_num_threads(1);
    auto store = connect(server.port());
    CheckpointEngine engine(workerState(1, 0), engineOptions(1, 2, store));
    train(engine, 1, 1);
    store->wait({"never"}, 60s);
    return 0;
  });
  server.wait({"committed-1"}, 60s);
  server.set("proceed", toBytes("1"));
  server.wait({"go-kill"}, 60s);
  group.signal(1, SIGKILL);
  server.set("killed", toBytes("1"));
  auto exits = group.waitAll(60s);
  EXPECT_TRUE(exits[0].exited && exits[0].code == 0) << exits[0].str();
  EXPECT_TRUE(exits[1].signaled) << exits[1].str();
}

std::string tempDir() {
  char tmpl[] = "/tmp/sinew-ckpt-mp-XXXXXX";
  const char* d = mkdtemp(tmpl);
  if (d == nullptr) throw std::runtime_error("mkdtemp");
  return d;
}

TEST(FlushCrashTest, WriterKilledBetweenShardFileAndManifestLeavesThePreviousVersion) {
  const std::string dir = tempDir();
  ProcessGroup writer;
  writer.spawn([&] {
    at::set_num_threads(1);
    PersistOptions o;
    o.dir = dir;
    o.onPoint = [](const std::string& point) {
      static int shards = 0;
      if (point == "shard-durable" && ++shards == 3) raise(SIGKILL);  // Version 2's first.
    };
    CheckpointWriter w(o);
    for (int64_t step = 1; step <= 2; ++step) {
      std::vector<std::shared_ptr<const HostShard>> shards;
      for (int owner = 0; owner < 2; ++owner) {
        SnapshotOptions so;
        so.owner = owner;
        SnapshotArena arena(workerState(owner, step), so);
        arena.snapshot(step, workerState(owner, step));
        arena.waitBeforeUpdate();
        shards.push_back(arena.latest());
      }
      w.flush(shards);
    }
    return 0;
  });
  auto w = writer.waitAll(60s);
  ASSERT_TRUE(w[0].signaled && w[0].signal == SIGKILL) << w[0].str();
  ProcessGroup reader;
  reader.spawn([&] {
    at::set_num_threads(1);
    CheckpointReader r(dir);
    if (r.latestStep() != 1) return 1;
    // Version 2's first shard file is there, but no manifest: it is not a version.
    if (!posixEnv()->fileExists(dir + "/step-00000002/shard-w0.safetensors")) return 2;
    if (r.durableSteps() != std::vector<int64_t>{1}) return 3;
    auto got = r.load(1);
    std::string diff = compare(workerState(0, 1), got) + compare(workerState(1, 1), got);
    if (!diff.empty()) {
      std::cerr << diff << std::endl;
      return 4;
    }
    return 0;
  });
  auto r = reader.waitAll(60s);
  EXPECT_TRUE(r[0].exited && r[0].code == 0) << r[0].str();
  std::string cmd = "rm -rf '" + dir + "'";
  EXPECT_EQ(std::system(cmd.c_str()), 0);
}

TEST(EngineFlushTest, TwoWorkersFlushEveryKCommittedVersionsAndOnPreemption) {
  const std::string dir = tempDir();
  TcpStoreServer server{sinew::testing::serverOptions()};
  ProcessGroup group;
  for (int w = 0; w < 2; ++w) {
    group.spawn([&, w] {
      at::set_num_threads(1);
      auto store = connect(server.port());
      auto o = engineOptions(w, 2, store);
      o.persist.dir = dir;
      o.persist.keep = 2;
      o.flushEvery = 2;
      o.snapshot.slots = 3;
      CheckpointEngine engine(workerState(w, 0), o);
      for (int64_t s = 0; s <= 4; ++s) {
        engine.waitBeforeUpdate();
        engine.snapshot(s, workerState(w, s));
        try {
          engine.waitCommitted(s, 20s);  // Every version commits, so 0, 2, 4 flush.
        } catch (const Timeout&) {
          auto st = engine.stats();
          std::cerr << "worker " << w << " step " << s << ": taken " << st.snapshot.taken
                    << ", skipped " << st.snapshot.skipped << ", last error: " << st.lastError
                    << std::endl;
          throw;
        }
        // A flush pins its version's slot until the manifest is written; a trainer whose
        // step is shorter than a flush has snapshots skipped meanwhile, so this one waits.
        if (s % 2 == 0) engine.waitDurable(s, 20s);
      }
      engine.waitDurable(4, 20s);
      engine.preemptionNotice();  // The next committed version (5) is flushed too.
      engine.waitBeforeUpdate();
      engine.snapshot(5, workerState(w, 5));
      engine.waitBeforeUpdate();
      engine.waitDurable(5, 20s);
      store->add("finished", 1);
      // Worker 0 writes the manifest; both stay until both are done.
      auto deadline = std::chrono::steady_clock::now() + 20s;
      while (store->add("finished", 0) < 2 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(2ms);
      }
      return 0;
    });
  }
  auto exits = group.waitAll(90s);
  for (auto& e : exits) EXPECT_TRUE(e.exited && e.code == 0) << e.str();
  ProcessGroup reader;
  reader.spawn([&] {
    at::set_num_threads(1);
    CheckpointReader r(dir);
    if (r.latestStep() != 5) return 1;
    if (r.durableSteps() != std::vector<int64_t>{5, 4}) return 2;
    auto got = r.load(5);
    std::string diff = compare(workerState(0, 5), got) + compare(workerState(1, 5), got);
    if (!diff.empty()) {
      std::cerr << diff << std::endl;
      return 3;
    }
    return 0;
  });
  auto r = reader.waitAll(60s);
  EXPECT_TRUE(r[0].exited && r[0].code == 0) << r[0].str();
  std::string cmd = "rm -rf '" + dir + "'";
  EXPECT_EQ(std::system(cmd.c_str()), 0);
}

}  // namespace
}  // namespace checkpoint
}  // namespace sinew
