// Single-process tests of sinew_checkpoint: crc32c, snapshot (exact bytes for every dtype,
// the wait before the optimizer step, flat memory), placement against Gemini's formula,
// durable flushes (crash at every I/O operation, corruption, truncation, Python reading
// the files, incremental versions), replication over loopback and restore order.

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <future>
#include <mutex>
#include <set>
#include <thread>

#include "../support.h"
#include "../tool_support.h"
#include "fault_env.h"
#include "sinew/base/crc32c.h"
#include "sinew/checkpoint/engine.h"
#include "sinew/checkpoint/flusher.h"
#include "sinew/checkpoint/persist.h"
#include "sinew/checkpoint/placement.h"
#include "sinew/checkpoint/replica.h"
#include "sinew/checkpoint/restore.h"
#include "sinew/checkpoint/snapshot.h"
#include "sinew/collectives/hash_store.h"

namespace sinew {
namespace checkpoint {
namespace {

ReplicaServiceOptions replicaServiceOptions() {
  ReplicaServiceOptions o;
  o.token = sinew::testing::kTestToken;
  return o;
}

ReplicaClientOptions replicaClientOptions() {
  ReplicaClientOptions o;
  o.token = sinew::testing::kTestToken;
  return o;
}

}  // namespace

namespace {

using sinew::testing::removeTree;
using sinew::testing::tempDir;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// Values that use every bit pattern a dtype allows, so a copy that converts or truncates
// anything shows up.
at::Tensor randomBits(at::ScalarType type, std::vector<int64_t> shape, int64_t seed) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(type));
  auto* p = static_cast<uint8_t*>(t.data_ptr());
  uint64_t x = 0x9E3779B97F4A7C15ull * static_cast<uint64_t>(seed + 1);
  for (int64_t i = 0; i < n * static_cast<int64_t>(t.element_size()); ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    p[i] = static_cast<uint8_t>(x);
  }
  if (type == at::kBool) t = t.to(at::kByte).remainder(2).to(at::kBool);  // Only 0 and 1.
  return t;
}

bool sameBytes(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  if (a.numel() == 0) return true;  // data_ptr() may be null; memcmp must not see it (UBSan).
  at::Tensor ca = a.contiguous(), cb = b.contiguous();
  return std::memcmp(ca.data_ptr(), cb.data_ptr(), ca.numel() * ca.element_size()) == 0;
}

const std::vector<at::ScalarType> kAllTypes = {at::kFloat, at::kDouble, at::kHalf,  at::kBFloat16,
                                               at::kLong,  at::kInt,    at::kShort, at::kChar,
                                               at::kByte,  at::kBool};

// A model-like shard: per layer a weight, a bias and Adam's two moments; one layer per
// dtype in the all-dtype variant.
ShardState makeState(int layers, int64_t width, int64_t seed,
                     const std::string& prefix = "layers.") {
  ShardState s;
  for (int l = 0; l < layers; ++l) {
    LayerState ls;
    ls.name = prefix + std::to_string(l);
    ls.tensors.push_back({"weight", randomBits(at::kFloat, {width, width}, seed * 100 + l)});
    ls.tensors.push_back({"bias", randomBits(at::kFloat, {width}, seed * 100 + l + 50)});
    ls.tensors.push_back(
        {"weight.exp_avg", randomBits(at::kFloat, {width, width}, seed * 100 + l + 70)});
    ls.tensors.push_back({"step", at::full({}, seed, at::kLong)});
    s.push_back(std::move(ls));
  }
  return s;
}

ShardState allDtypeState(int64_t seed) {
  ShardState s;
  int i = 0;
  for (auto type : kAllTypes) {
    LayerState ls;
    ls.name = std::string("dtype.") + c10::toString(type);
    ls.tensors.push_back({"value", randomBits(type, {3, 5, 7}, seed * 31 + i)});
    ls.tensors.push_back({"scalar", randomBits(type, {}, seed * 31 + i + 13)});
    ls.tensors.push_back({"empty", at::empty({0, 4}, at::TensorOptions().dtype(type))});
    s.push_back(std::move(ls));
    ++i;
  }
  return s;
}

void expectLayersEqual(const ShardState& want, const std::map<std::string, RestoredLayer>& got) {
  for (const auto& l : want) {
    auto it = got.find(l.name);
    ASSERT_NE(it, got.end()) << "missing layer " << l.name;
    for (const auto& t : l.tensors) {
      auto jt = it->second.find(t.name);
      ASSERT_NE(jt, it->second.end()) << l.name << "/" << t.name;
      EXPECT_TRUE(sameBytes(t.tensor, jt->second)) << l.name << "/" << t.name;
    }
  }
}

// The options of engines 0 and 1 of a two-worker placement on `store` (the test token).
std::pair<CheckpointEngineOptions, CheckpointEngineOptions> twoEngines(
    const std::shared_ptr<collectives::HashStore>& store) {
  CheckpointEngineOptions a, b;
  a.self = 0;
  b.self = 1;
  a.workers = b.workers = {0, 1};
  a.store = b.store = store;
  a.token = b.token = sinew::testing::kTestToken;
  return {a, b};
}

std::map<std::string, RestoredLayer> extractAll(const HostShard& s) {
  std::map<std::string, RestoredLayer> out;
  for (const auto& l : s.layout.layers()) out[l] = s.extractLayer(l);
  return out;
}

// ---------------------------------------------------------------------------------------

TEST(Crc32cTest, StandardVectorsAndImplementationsAgree) {
  const std::string check = "123456789";
  EXPECT_EQ(::sinew::detail::crc32c(check.data(), check.size()), 0xE3069283u);
  EXPECT_EQ(::sinew::detail::crc32cPortable(0, check.data(), check.size()), 0xE3069283u);
  std::vector<uint8_t> zeros(32, 0);
  EXPECT_EQ(::sinew::detail::crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);  // RFC 3720 B.4
  std::vector<uint8_t> buf(100003);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 131 + (i >> 7));
  for (size_t off : {0, 1, 3, 7}) {
    // 12287..12289 and 24581 straddle the three 4096-byte streams of the SSE4.2 path.
    for (size_t n : {0, 1, 5, 8, 9, 64, 1000, 12287, 12288, 12289, 24581, 99990}) {
      uint32_t a = ::sinew::detail::crc32c(buf.data() + off, n);
      EXPECT_EQ(a, ::sinew::detail::crc32cPortable(0, buf.data() + off, n)) << off << " " << n;
      // Extending in two pieces equals one pass.
      uint32_t b = ::sinew::detail::crc32cExtend(::sinew::detail::crc32c(buf.data() + off, n / 3),
                                                 buf.data() + off + n / 3, n - n / 3);
      EXPECT_EQ(a, b);
    }
  }
}

TEST(SnapshotTest, RoundTripsExactBytesForEveryDtype) {
  ShardState state = allDtypeState(1);
  SnapshotOptions o;
  o.owner = 7;
  SnapshotArena arena(state, o);
  for (int64_t step = 0; step < 4; ++step) {
    ShardState s = allDtypeState(step + 10);
    ASSERT_TRUE(arena.snapshot(step, s));
    arena.waitBeforeUpdate();
    auto snap = arena.latest();
    ASSERT_NE(snap, nullptr);
    EXPECT_EQ(snap->step, step);
    EXPECT_EQ(snap->owner, 7);
    EXPECT_EQ(snap->verify(), "");
    expectLayersEqual(s, extractAll(*snap));
  }
  EXPECT_EQ(arena.stats().taken, 4);
}

TEST(SnapshotTest, OptimizerStepNeverRunsBeforeItsSnapshotCompletes) {
  // An injected slow copy: each tensor copy takes 2 ms. The trainer calls
  // waitBeforeUpdate() right away and then overwrites every tensor (the optimizer step);
  // the snapshot must hold the values from before the step, and the wait must not return
  // before the copy thread finished the last tensor.
  ShardState state = makeState(6, 32, 1);
  std::atomic<int> copied{0};
  std::atomic<bool> waitReturned{false};
  std::atomic<int> copiedAfterWait{0};
  SnapshotOptions o;
  o.beforeCopyTensor = [&](const TensorRecord&) {
    std::this_thread::sleep_for(2ms);
    if (waitReturned.load()) copiedAfterWait++;
    copied++;
  };
  SnapshotArena arena(state, o);
  const int total = static_cast<int>(arena.layout().tensors.size());
  for (int64_t step = 0; step < 5; ++step) {
    ShardState before;
    for (const auto& l : state) {
      LayerState c{l.name, {}};
      for (const auto& t : l.tensors) c.tensors.push_back({t.name, t.tensor.clone()});
      before.push_back(std::move(c));
    }
    copied = 0;
    ASSERT_TRUE(arena.snapshot(step, state));
    arena.waitBeforeUpdate();
    waitReturned = true;
    EXPECT_EQ(copied.load(), total) << "wait returned before the copy finished";
    for (auto& l : state) {
      for (auto& t : l.tensors) t.tensor.fill_(step + 1000);  // The optimizer step.
    }
    waitReturned = false;
    expectLayersEqual(before, extractAll(*arena.find(step)));
  }
  EXPECT_EQ(copiedAfterWait.load(), 0);
}

TEST(SnapshotTest, RejectsAStateOfAnotherLayoutAndASnapshotBeforeTheWait) {
  ShardState state = makeState(2, 8, 1);
  SnapshotArena arena(state, SnapshotOptions());
  ShardState other = makeState(3, 8, 1);
  EXPECT_THROW(arena.snapshot(0, other), InvalidArgument);
  std::promise<void> release;
  auto released = release.get_future().share();
  SnapshotOptions o;
  o.beforeCopyTensor = [released](const TensorRecord&) { released.wait(); };
  SnapshotArena slow(state, o);
  ASSERT_TRUE(slow.snapshot(0, state));
  try {
    slow.snapshot(1, state);
    ADD_FAILURE() << "a second snapshot before the wait was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("step 0 is still being copied"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(slow.waitBeforeUpdate(20ms), Timeout);
  release.set_value();
  slow.waitBeforeUpdate();
}

// A copy that fails: its owner hears of it once through onFailed (before any wait returns),
// the wait rethrows it, no version of that step appears, and the next snapshot works.
TEST(SnapshotTest, AFailedCopyIsReportedOnceAndTheNextOneWorks) {
  ShardState state = makeState(2, 8, 1);
  SnapshotOptions o;
  std::atomic<bool> fail{true};
  o.beforeCopyTensor = [&](const TensorRecord&) {
    if (fail.exchange(false)) throw IoError("injected copy failure");
  };
  SnapshotArena arena(state, o);
  std::atomic<int> failed{0};
  std::atomic<int64_t> failedStep{-1};
  arena.setOnFailed([&](int64_t step, std::exception_ptr e) {
    failed++;
    failedStep = step;
    EXPECT_NE(e, nullptr);
  });
  ASSERT_TRUE(arena.snapshot(5, state));
  EXPECT_THROW(arena.waitBeforeUpdate(), IoError);
  EXPECT_EQ(failed.load(), 1);
  EXPECT_EQ(failedStep.load(), 5);
  EXPECT_EQ(arena.find(5), nullptr);
  arena.waitBeforeUpdate();  // Reported once: nothing left to wait for.
  ASSERT_TRUE(arena.snapshot(6, state));
  arena.waitComplete();
  ASSERT_NE(arena.find(6), nullptr);
  EXPECT_EQ(arena.find(6)->verify(), "");
  EXPECT_EQ(failed.load(), 1);
}

int64_t residentBytes() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

// A third slot costs a shard's worth of host memory, and is needed only when the newest
// complete version never commits (it and the committed one both stay): so it is allocated
// then, not up front. With three slots allowed, versions that each commit before the next one
// keep two slots resident; an uncommitted one brings the third, and the next version is
// still taken (not skipped) with the committed and the uncommitted ones intact.
TEST(SnapshotTest, AThirdSlotIsAllocatedOnlyOnceAVersionStaysUncommitted) {
  ShardState state = makeState(2, 2048, 1);  // 2 × (2 × 16 MiB + 8 KiB + 8 B) ≈ 64 MiB
  SnapshotOptions o;
  o.slots = 3;
  const int64_t before = residentBytes();
  SnapshotArena arena(state, o);
  const auto shard = static_cast<int64_t>(arena.layout().totalBytes);
  for (int64_t step = 0; step < 10; ++step) {
    state[0].tensors[0].tensor.add_(1);
    ASSERT_TRUE(arena.snapshot(step, state)) << step;
    arena.waitComplete();
    arena.protect(step);  // Committed before the next one is taken.
  }
  const int64_t twoSlots = residentBytes() - before;
  EXPECT_GT(twoSlots, 2 * shard - shard / 8);
  EXPECT_LT(twoSlots, 2 * shard + shard / 2) << "more than two slots resident";
  ASSERT_TRUE(arena.snapshot(10, state));  // Never committed: 9 stays protected.
  arena.waitComplete();
  state[0].tensors[0].tensor.add_(1);
  ASSERT_TRUE(arena.snapshot(11, state));
  arena.waitComplete();
  EXPECT_GT(residentBytes() - before, 3 * shard - shard / 8) << "no third slot";
  for (int64_t step : {9, 10, 11}) {
    ASSERT_NE(arena.find(step), nullptr) << step;
    EXPECT_EQ(arena.find(step)->verify(), "") << step;
  }
  EXPECT_EQ(arena.stats().taken, 12);
  EXPECT_EQ(arena.stats().skipped, 0);
  // With all three held (9 committed, 11 the newest, 10 read by someone), the next is skipped.
  auto reader = arena.find(10);
  EXPECT_FALSE(arena.snapshot(12, state));
  EXPECT_EQ(arena.stats().skipped, 1);
}

TEST(SnapshotTest, MemoryStaysFlatOverAThousandCheckpointsWithReplication) {
  // 1,000 versions of a 1 MiB shard, each snapshotted and replicated to a peer service
  // over loopback: resident memory after the first 20 versions is where it stays.
  ShardState state = makeState(4, 256, 1);  // 4 × (2 × 256 KiB + 1 KiB + 8 B) ≈ 2 MiB
  auto store = std::make_shared<collectives::HashStore>();
  auto [a, b] = twoEngines(store);
  a.snapshot.slots = b.snapshot.slots = 3;
  CheckpointEngine e0(state, a);
  CheckpointEngine e1(state, b);
  int64_t rssAfterWarmup = 0;
  int64_t committed = -1;
  for (int64_t step = 0; step < 1000; ++step) {
    state[0].tensors[0].tensor.add_(1);
    e0.waitBeforeUpdate();
    e1.waitBeforeUpdate();
    e0.snapshot(step, state);
    e1.snapshot(step, state);
    // Training paces replication: each version commits before the next step ends, and each
    // worker sees it commit before it takes the next (so two of its three slots are used).
    committed = e0.waitCommitted(step, 10s);
    ASSERT_EQ(e1.waitCommitted(step, 10s), step);
    if (step == 20) rssAfterWarmup = residentBytes();
  }
  e0.waitBeforeUpdate();
  e1.waitBeforeUpdate();
  const int64_t growth = residentBytes() - rssAfterWarmup;
  const int64_t shard = static_cast<int64_t>(e0.arena().layout().totalBytes);
  EXPECT_LT(growth, shard) << "resident memory grew by " << growth << " bytes over 980 versions";
  EXPECT_EQ(committed, 999);
  EXPECT_EQ(e0.stats().snapshot.taken, 1000);
  EXPECT_EQ(e0.service().bytesAllocated(), 2 * static_cast<uint64_t>(shard));
  // Nor does the store: the committer drops each version's reports and the record of the
  // version committed two before it.
  EXPECT_TRUE(sinew::testing::eventually([&] { return !store->check({"sinew/ckpt/commit/997"}); }));
  for (const char* gone : {"sinew/ckpt/held/500", "sinew/ckpt/held/500/0", "sinew/ckpt/held/500/1",
                           "sinew/ckpt/commit/500", "sinew/ckpt/held/999"}) {
    EXPECT_FALSE(store->check({gone})) << gone;
  }
  auto last = CheckpointEngine::commitRecordIn(*store, "sinew/ckpt", 999);
  ASSERT_TRUE(last.has_value());
  EXPECT_EQ(last->previous, 998);
  EXPECT_EQ(last->workers, (std::vector<int>{0, 1}));
  EXPECT_TRUE(CheckpointEngine::commitRecordIn(*store, "sinew/ckpt", 998).has_value());
  EXPECT_EQ(CheckpointEngine::committedIn(*store, "sinew/ckpt"), 999);
}

// A worker whose layers another worker's shard already holds (a data-parallel copy of a stage)
// takes an empty shard: it holds its partner's replica, the version commits with both, and the
// empty worker restores the layers from its own RAM (the replica), the partner from its own.
TEST(EngineTest, AnEmptyShardHoldsItsPartnersReplicaAndTheVersionCommits) {
  ShardState state = makeState(3, 64, 5);
  auto store = std::make_shared<collectives::HashStore>();
  auto [a, b] = twoEngines(store);
  CheckpointEngine owner(state, a);
  CheckpointEngine holder(ShardState{}, b);
  for (int64_t step = 0; step < 3; ++step) {
    state[1].tensors[0].tensor.add_(1);
    owner.waitBeforeUpdate();
    holder.waitBeforeUpdate();
    ASSERT_TRUE(owner.snapshot(step, state));
    ASSERT_TRUE(holder.snapshot(step, ShardState{}));
    ASSERT_EQ(owner.waitCommitted(step, 10s), step);
    ASSERT_EQ(holder.waitCommitted(step, 10s), step);
  }
  EXPECT_EQ(holder.arena().layout().totalBytes, 0u);
  auto r = holder.restore(2, {"layers.0", "layers.1", "layers.2"});
  for (const auto& l : state) EXPECT_EQ(r.source.at(l.name), "local") << l.name;
  expectLayersEqual(state, r.layers);
  r = owner.restore(2, {"layers.1"});
  EXPECT_EQ(r.source.at("layers.1"), "local");
}

// Replication yields to training traffic (docs/architecture.md section 5; the trainer brackets its
// stages' transfers and collectives with the engine's TrafficGate): while worker 0 has a
// transfer in flight, no chunk of its replica goes out; the first goes once the transfer ends.
// And a gate that never opens delays each chunk by at most maxYield, so the version still
// commits.
TEST(EngineTest, ReplicationYieldsToTrainingTraffic) {
  ShardState state = makeState(4, 256, 1);  // about 2 MiB: 9 chunks of 256 KiB
  for (auto maxYield : {std::chrono::milliseconds(5000), std::chrono::milliseconds(60)}) {
    SCOPED_TRACE("maxYield " + std::to_string(maxYield.count()) + " ms");
    const bool opens = maxYield.count() > 1000;
    auto store = std::make_shared<collectives::HashStore>();
    std::mutex mu;
    std::vector<Clock::time_point> sent;  // worker 0's chunks, as each went out
    auto [a, b] = twoEngines(store);
    a.client.chunkBytes = b.client.chunkBytes = 256 << 10;
    a.maxYield = b.maxYield = maxYield;
    a.client.afterChunk = [&](int64_t) {
      std::lock_guard<std::mutex> lock(mu);
      sent.push_back(Clock::now());
    };
    CheckpointEngine e0(state, a);
    CheckpointEngine e1(state, b);
    e0.trafficGate().enter();  // a stage's send, say
    const auto entered = Clock::now();
    e0.waitBeforeUpdate();
    e1.waitBeforeUpdate();
    e0.snapshot(0, state);
    e1.snapshot(0, state);
    Clock::time_point opened = Clock::time_point::max();
    if (opens) {
      std::this_thread::sleep_for(400ms);
      {
        std::lock_guard<std::mutex> lock(mu);
        EXPECT_TRUE(sent.empty()) << sent.size() << " chunks went out during the transfer";
      }
      opened = Clock::now();
      e0.trafficGate().exit();
    }
    EXPECT_EQ(e0.waitCommitted(0, 20s), 0);
    std::lock_guard<std::mutex> lock(mu);
    const size_t total = e0.arena().layout().totalBytes;
    const size_t chunks = (total + (256 << 10) - 1) / (256 << 10);
    ASSERT_EQ(sent.size(), chunks);
    if (opens) {
      EXPECT_GE(sent.front(), opened);
    } else {
      // Each chunk waited out maxYield first (the gate never opened), and no longer.
      EXPECT_GE(sent.back() - entered, static_cast<int>(chunks) * maxYield);
      EXPECT_LT(sent.back() - entered, static_cast<int>(chunks) * maxYield + 5s);
      e0.trafficGate().exit();
    }
    e0.waitBeforeUpdate();
    e1.waitBeforeUpdate();
  }
}

TEST(EngineTest, AFailedFlushReachesTheWaiterAsIoError) {
  // Every write of the disk fails: the flush thread's IoError must reach waitDurable() (the
  // thread waiting for the flush) as that IoError, at once, not as a Timeout with a string
  // left behind in the stats.
  ShardState state = makeState(2, 8, 1);
  const std::string dir = tempDir("ckpt-flushfail");
  testing::FaultEnv env;
  auto store = std::make_shared<collectives::HashStore>();
  auto [a, b] = twoEngines(store);
  a.persist.dir = b.persist.dir = dir;
  a.persist.env = b.persist.env = &env;
  a.flushEvery = b.flushEvery = 1;
  CheckpointEngine e0(state, a);
  CheckpointEngine e1(state, b);
  env.failAfter(0);
  e0.snapshot(0, state);
  e1.snapshot(0, state);
  EXPECT_EQ(e0.waitCommitted(0, 10s), 0);
  auto t0 = std::chrono::steady_clock::now();
  try {
    e0.waitDurable(0, 20s);
    ADD_FAILURE() << "version 0 became durable on a disk that fails every write";
  } catch (const IoError& e) {
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 15s) << "the error waited for the deadline";
  }
  EXPECT_FALSE(e0.stats().lastError.empty());
  EXPECT_EQ(e0.durableStep(), -1);
  removeTree(dir);
}

// ---------------------------------------------------------------------------------------

double choose(int n, int k) {
  if (k < 0 || k > n) return 0;
  double r = 1;
  for (int i = 1; i <= k; ++i) r = r * (n - k + i) / i;
  return r;
}

TEST(PlacementTest, GroupsOfMAndARingForTheRemainder) {
  ReplicaPlacement p4({0, 1, 2, 3}, 2);
  EXPECT_EQ(p4.holders(0), (std::vector<int>{0, 1}));
  EXPECT_EQ(p4.holders(1), (std::vector<int>{1, 0}));
  EXPECT_EQ(p4.holders(3), (std::vector<int>{3, 2}));
  EXPECT_FALSE(p4.hasRing());
  ReplicaPlacement p5({0, 1, 2, 3, 4}, 2);
  EXPECT_TRUE(p5.hasRing());
  EXPECT_EQ(p5.holders(0), (std::vector<int>{0, 1}));
  EXPECT_EQ(p5.holders(2), (std::vector<int>{2, 3}));
  EXPECT_EQ(p5.holders(3), (std::vector<int>{3, 4}));
  EXPECT_EQ(p5.holders(4), (std::vector<int>{4, 2}));
  EXPECT_EQ(p5.sourcesOf(2), (std::vector<int>{4}));
  ReplicaPlacement p7({10, 11, 12, 13, 14, 15, 16}, 3);  // A group of 3 and a ring of 4.
  EXPECT_EQ(p7.holders(13), (std::vector<int>{13, 14, 15}));
  EXPECT_EQ(p7.holders(16), (std::vector<int>{16, 13, 14}));
  for (int n = 1; n <= 12; ++n) {
    for (int m = 1; m <= 4; ++m) {
      std::vector<int> nodes;
      for (int i = 0; i < n; ++i) nodes.push_back(i);
      ReplicaPlacement p(nodes, m);
      for (int i = 0; i < n; ++i) {
        EXPECT_EQ(static_cast<int>(p.holders(i).size()), std::min(n, m)) << n << " " << m;
        EXPECT_EQ(std::set<int>(p.holders(i).begin(), p.holders(i).end()).size(),
                  p.holders(i).size());
      }
    }
  }
}

TEST(PlacementTest, RecoveryForEveryKilledPairOfSixteenMatchesGeminisAnalysis) {
  const int n = 16, m = 2;
  std::vector<int> nodes;
  for (int i = 0; i < n; ++i) nodes.push_back(i);
  ReplicaPlacement group(nodes, m);
  int pairs = 0, recovered = 0;
  for (int a = 0; a < n; ++a) {
    for (int b = a + 1; b < n; ++b) {
      ++pairs;
      bool ok = group.recoverable({a, b});
      // Gemini: recovery fails exactly when all m members of a group fail.
      EXPECT_EQ(ok, a / m != b / m) << "killed " << a << " and " << b;
      recovered += ok;
    }
  }
  EXPECT_EQ(pairs, 120);
  EXPECT_EQ(recovered, 112);
  EXPECT_NEAR(1.0 - groupPlacementFailureProbability(n, m, 2), recovered / 120.0, 1e-12);
  EXPECT_NEAR(recovered / 120.0, 0.9333, 1e-4);  // docs/architecture.md's worked example.
  // The union bound is tight for k = 2 and a lower bound for every k.
  for (int k = 2; k <= 6; ++k) {
    std::vector<int> pick(k);
    int64_t total = 0, ok = 0;
    std::function<void(int, int)> rec = [&](int start, int depth) {
      if (depth == k) {
        total++;
        ok += group.recoverable(std::set<int>(pick.begin(), pick.end()));
        return;
      }
      for (int i = start; i < n; ++i) {
        pick[depth] = i;
        rec(i + 1, depth + 1);
      }
    };
    rec(0, 0);
    EXPECT_EQ(total, static_cast<int64_t>(choose(n, k)));
    EXPECT_NEAR(1.0 - groupPlacementFailureProbability(n, m, k), static_cast<double>(ok) / total,
                1e-12)
        << "k=" << k;
    EXPECT_GE(static_cast<double>(ok) / total + 1e-12,
              1.0 - (n / m) * choose(n - m, k - m) / choose(n, k));
  }
  // A ring (each shard on the next node) is worse: 86.7% for two failures.
  int ringOk = 0;
  for (int a = 0; a < n; ++a) {
    for (int b = a + 1; b < n; ++b) ringOk += !(b == a + 1 || (a == 0 && b == n - 1));
  }
  EXPECT_NEAR(ringOk / 120.0, 0.8667, 1e-4);
}

// ---------------------------------------------------------------------------------------

std::shared_ptr<const HostShard> snap(const ShardState& state, int owner, int64_t step) {
  SnapshotOptions o;
  o.owner = owner;
  SnapshotArena arena(state, o);
  arena.snapshot(step, state);
  arena.waitBeforeUpdate();
  return arena.latest();  // Outlives the arena (shared ownership).
}

TEST(PersistTest, FlushAndLoadExactBytesKeepTheNewestK) {
  const std::string dir = tempDir("ckpt-persist");
  PersistOptions o;
  o.dir = dir;
  o.keep = 2;
  CheckpointWriter writer(o);
  CheckpointReader reader(dir);
  EXPECT_EQ(reader.latestStep(), -1);
  std::map<int64_t, std::pair<ShardState, ShardState>> versions;
  for (int64_t step = 1; step <= 4; ++step) {
    ShardState a = allDtypeState(step), b = makeState(3, 16, step, "b.");
    writer.flush({snap(a, 0, step), snap(b, 1, step)});
    versions[step] = {a, b};
    EXPECT_EQ(reader.latestStep(), step);
  }
  EXPECT_EQ(reader.durableSteps(), (std::vector<int64_t>{4, 3}));
  for (int64_t step : {3, 4}) {
    auto got = reader.load(step);
    expectLayersEqual(versions[step].first, got);
    expectLayersEqual(versions[step].second, got);
  }
  // Only the needed layers are read.
  auto one = reader.load(4, {"b.2"});
  EXPECT_EQ(one.size(), 1u);
  EXPECT_THROW(reader.load(4, {"no.such.layer"}), InvalidArgument);
  auto entries = posixEnv()->listDir(dir);
  EXPECT_EQ(std::set<std::string>(entries.begin(), entries.end()),
            (std::set<std::string>{"LATEST", "LATEST.lock", "step-00000003", "step-00000004"}));
  removeTree(dir);
}

// What a VersionFlusher reported through its hooks.
struct FlushLog {
  std::mutex mu;
  std::vector<FlushedVersion> flushed;
  std::vector<std::pair<int64_t, std::string>> failed;  // step, "verb where: error"
  std::vector<std::pair<int64_t, int64_t>> superseded;  // step, the newer durable one

  VersionFlusherOptions options(int self, const std::string& dir,
                                std::shared_ptr<collectives::Store> store) {
    VersionFlusherOptions o;
    o.self = self;
    o.persist.dir = dir;
    o.store = std::move(store);
    o.prefix = "test";
    o.onFlushed = [this](const FlushedVersion& v) {
      std::lock_guard<std::mutex> lock(mu);
      flushed.push_back(v);
    };
    o.onFailed = [this](int64_t step, const std::string& verb, const std::string& where,
                        std::exception_ptr e) {
      std::string what;
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& x) {
        what = x.what();
      }
      std::lock_guard<std::mutex> lock(mu);
      failed.emplace_back(step, verb + " " + where + ": " + what);
    };
    o.onSuperseded = [this](int64_t step, int64_t newer, const std::string&) {
      std::lock_guard<std::mutex> lock(mu);
      superseded.emplace_back(step, newer);
    };
    return o;
  }
};

// Two writers of one version: the one that posts (kPost) and the one that completes it
// (kCommit, waiting for the other's record). The version reads back byte for byte with both
// shards, <prefix>/durable names it and the record is gone. A writer that `gone` says left
// fails the next version at once (not at the 30 s deadline), reported, and a version after it
// is written alone as usual.
TEST(FlusherTest, TwoWritersCompleteAVersionAndALeaverFailsTheNextAtOnce) {
  const std::string dir = tempDir("ckpt-flusher");
  auto store = std::make_shared<collectives::HashStore>();
  FlushLog log0, log1;
  std::atomic<bool> oneLeft{false};
  VersionFlusherOptions o0 = log0.options(0, dir, store);
  o0.gone = [&](int worker) -> std::string {
    return worker == 1 && oneLeft ? "left the job (test)" : "";
  };
  VersionFlusher f0(o0), f1(log1.options(1, dir, store));
  const ShardState a = makeState(2, 8, 1, "a."), b = makeState(3, 8, 2, "b.");
  f0.reserve();
  f1.reserve();
  EXPECT_EQ(f0.outstanding(), 1);
  FlushRole commit{FlushRole::How::kCommit, {1}}, post{FlushRole::How::kPost, {}};
  f0.submit(snap(a, 0, 5), commit);
  std::this_thread::sleep_for(50ms);  // The committer is waiting for worker 1's record.
  EXPECT_EQ(f0.outstanding(), 1);
  f1.submit(snap(b, 1, 5), post);
  f0.waitIdle();
  f1.waitIdle();
  CheckpointReader reader(dir);
  EXPECT_EQ(reader.latestStep(), 5);
  auto got = reader.load(5);
  expectLayersEqual(a, got);
  expectLayersEqual(b, got);
  EXPECT_EQ(collectives::toString(store->get(f0.durableKey())), "5");
  EXPECT_FALSE(store->check({f0.recordKey(5, 1)}));
  ASSERT_EQ(log0.flushed.size(), 1u);
  EXPECT_EQ(log0.flushed[0].step, 5);
  EXPECT_EQ(log0.flushed[0].how, FlushRole::How::kCommit);
  EXPECT_GT(log0.flushed[0].bytes, 0);
  ASSERT_EQ(log1.flushed.size(), 1u);
  EXPECT_EQ(log1.flushed[0].how, FlushRole::How::kPost);

  oneLeft = true;
  f0.reserve();
  const auto t0 = Clock::now();
  f0.submit(snap(a, 0, 6), commit);
  f0.waitIdle();
  EXPECT_LT(Clock::now() - t0, 5s) << "the version waited for a writer that had left";
  ASSERT_EQ(log0.failed.size(), 1u);
  EXPECT_EQ(log0.failed[0].first, 6);
  EXPECT_NE(log0.failed[0].second.find("write '" + dir + "'"), std::string::npos)
      << log0.failed[0].second;
  EXPECT_NE(log0.failed[0].second.find("worker 1, one of its writers, left the job (test)"),
            std::string::npos)
      << log0.failed[0].second;
  EXPECT_EQ(reader.latestStep(), 5);
  EXPECT_EQ(f0.flushed(), 1);

  f0.reserve();
  f0.submit(snap(a, 0, 7), FlushRole{});
  f0.waitIdle();
  EXPECT_EQ(reader.latestStep(), 7);
  expectLayersEqual(a, reader.load(7));
  EXPECT_EQ(collectives::toString(store->get(f0.durableKey())), "7");
  removeTree(dir);
}

// A late writer's version, older than the one LATEST names, is refused (LATEST never moves
// back) and reported as superseded, not as a failure: alone, and as the committer of two
// writers (whose records are then deleted). Before, each was an onFailed, which the trainer's
// finish() turned into an error exit.
TEST(FlusherTest, AVersionOlderThanLatestIsSupersededNotFailed) {
  const std::string dir = tempDir("ckpt-flusher-stale");
  auto store = std::make_shared<collectives::HashStore>();
  FlushLog log0, log1;
  VersionFlusher f0(log0.options(0, dir, store)), f1(log1.options(1, dir, store));
  const ShardState a = makeState(2, 8, 1, "a."), b = makeState(3, 8, 2, "b.");
  f0.reserve();
  f0.submit(snap(a, 0, 7), FlushRole{});
  f0.waitIdle();
  f0.reserve();
  f0.submit(snap(a, 0, 5), FlushRole{});
  f0.waitIdle();
  CheckpointReader reader(dir);
  EXPECT_EQ(reader.latestStep(), 7);
  EXPECT_TRUE(log0.failed.empty()) << log0.failed[0].second;
  ASSERT_EQ(log0.superseded.size(), 1u);
  EXPECT_EQ(log0.superseded[0], (std::pair<int64_t, int64_t>{5, 7}));
  EXPECT_EQ(f0.flushed(), 1);

  f0.reserve();
  f1.reserve();
  f1.submit(snap(b, 1, 6), FlushRole{FlushRole::How::kPost, {}});
  f0.submit(snap(a, 0, 6), FlushRole{FlushRole::How::kCommit, {1}});
  f0.waitIdle();
  f1.waitIdle();
  EXPECT_EQ(reader.latestStep(), 7);
  EXPECT_TRUE(log0.failed.empty()) << log0.failed[0].second;
  ASSERT_EQ(log0.superseded.size(), 2u);
  EXPECT_EQ(log0.superseded[1], (std::pair<int64_t, int64_t>{6, 7}));
  EXPECT_FALSE(store->check({f0.recordKey(6, 1)})) << "the refused version's record was kept";
  removeTree(dir);
}

// A reservation holds waitIdle() until its version comes or is given up: cancel() silently,
// fail() reported with its verb and place.
TEST(FlusherTest, AReservationHoldsTheWaitUntilCancelledOrFailed) {
  const std::string dir = tempDir("ckpt-flusher-reserve");
  FlushLog log;
  VersionFlusher f(log.options(0, dir, std::make_shared<collectives::HashStore>()));
  f.reserve();
  auto waited = std::async(std::launch::async, [&] { f.waitIdle(); });
  EXPECT_EQ(waited.wait_for(100ms), std::future_status::timeout);
  f.cancel();
  EXPECT_EQ(waited.wait_for(5s), std::future_status::ready);
  f.reserve();
  f.fail(3, std::make_exception_ptr(IoError("no memory for the copy")), "copy", "host memory");
  f.waitIdle();
  ASSERT_EQ(log.failed.size(), 1u);
  EXPECT_EQ(log.failed[0],
            (std::pair<int64_t, std::string>{3, "copy host memory: no memory for the copy"}));
  EXPECT_TRUE(log.flushed.empty());
  removeTree(dir);
}

// The engine hands its copy of a version to a caller's flusher (the trainer's durable
// versions): written from that one copy, marked shared.
TEST(EngineTest, ADurableVersionIsWrittenFromTheEnginesCopy) {
  const std::string dir = tempDir("ckpt-engine-durable");
  auto store = std::make_shared<collectives::HashStore>();
  const ShardState state = makeState(2, 8, 3);
  FlushLog log;
  VersionFlusher flusher(log.options(0, dir, store));
  CheckpointEngineOptions eo;
  eo.self = 0;
  eo.workers = {0};
  eo.replication = 1;
  eo.store = store;
  eo.token = sinew::testing::kTestToken;
  CheckpointEngine engine(state, eo);
  flusher.reserve();
  ASSERT_TRUE(engine.snapshot(4, state, &flusher, FlushRole{}));
  flusher.waitIdle();
  CheckpointReader reader(dir);
  EXPECT_EQ(reader.latestStep(), 4);
  expectLayersEqual(state, reader.load(4));
  ASSERT_EQ(log.flushed.size(), 1u);
  EXPECT_TRUE(log.flushed[0].shared);
  removeTree(dir);
}

TEST(PersistTest, FlippedByteAndTruncationAreCorruptionNamingFileLayerAndChecksums) {
  const std::string dir = tempDir("ckpt-corrupt");
  PersistOptions o;
  o.dir = dir;
  CheckpointWriter writer(o);
  ShardState s = makeState(3, 16, 5);
  writer.flush({snap(s, 2, 9)});
  CheckpointReader reader(dir);
  const Manifest m = reader.manifest(9);
  const auto& loc = m.layers.at("layers.1");
  const std::string file = dir + "/" + loc.file;
  std::string bytes = posixEnv()->readFile(file);
  const uint64_t dataStart = 8 + *reinterpret_cast<const uint64_t*>(bytes.data());
  const TensorRecord& bias = loc.tensors[1];
  ASSERT_EQ(bias.name, "bias");
  bytes[dataStart + bias.offset + 5] ^= 0x10;
  {
    std::ofstream f(file, std::ios::binary | std::ios::trunc);
    f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  EXPECT_NO_THROW(reader.load(9, {"layers.0"}));  // Other layers still load.
  try {
    reader.load(9, {"layers.1"});
    ADD_FAILURE() << "a flipped byte went unnoticed";
  } catch (const Corruption& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(file), std::string::npos) << what;
    EXPECT_NE(what.find("layer layers.1 tensor bias"), std::string::npos) << what;
    EXPECT_NE(what.find("expected " + hex32(bias.crc32c)), std::string::npos) << what;
    uint32_t actual = ::sinew::detail::crc32c(bytes.data() + dataStart + bias.offset, bias.nbytes);
    EXPECT_NE(what.find("crc32c " + hex32(actual)), std::string::npos) << what;
  }
  // Truncated.
  ASSERT_EQ(::truncate(file.c_str(), static_cast<off_t>(bytes.size() - 3)), 0);
  try {
    reader.load(9, {"layers.2"});
    ADD_FAILURE() << "a truncated file went unnoticed";
  } catch (const Corruption& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(file), std::string::npos) << what;
    EXPECT_NE(what.find("layer layers.2"), std::string::npos) << what;
    EXPECT_NE(what.find(std::to_string(bytes.size() - 3) + " bytes, manifest says " +
                        std::to_string(bytes.size())),
              std::string::npos)
        << what;
  }
  removeTree(dir);
}

TEST(PersistTest, CrashAtEveryIoOperationLeavesLatestOnACompleteVersion) {
  // Version 1 is durable; flushing version 2 (two shards) crashes after k operations, for
  // every k, and the power-loss model drops what was not fsynced. LATEST must name version
  // 1 or 2, and that version must load with exactly its bytes.
  ShardState a1 = makeState(2, 8, 1, "a."), b1 = makeState(2, 8, 2, "b.");
  ShardState a2 = makeState(2, 8, 3, "a."), b2 = makeState(2, 8, 4, "b.");
  auto sa1 = snap(a1, 0, 1), sb1 = snap(b1, 1, 1), sa2 = snap(a2, 0, 2), sb2 = snap(b2, 1, 2);
  int sawOld = 0, sawNew = 0;
  for (int64_t k = 0;; ++k) {
    const std::string dir = tempDir("ckpt-crash");
    testing::FaultEnv env;
    PersistOptions o;
    o.dir = dir;
    o.env = &env;
    o.keep = 1;
    CheckpointWriter writer(o);
    writer.flush({sa1, sb1});
    env.failAfter(k);
    bool finished = true;
    try {
      writer.flush({sa2, sb2});
    } catch (const IoError&) {
      finished = false;
    }
    env.crash();
    CheckpointReader reader(dir, &env);
    const int64_t latest = reader.latestStep();
    ASSERT_TRUE(latest == 1 || latest == 2) << "k=" << k << " latest=" << latest;
    auto got = reader.load(latest);
    expectLayersEqual(latest == 1 ? a1 : a2, got);
    expectLayersEqual(latest == 1 ? b1 : b2, got);
    (latest == 1 ? sawOld : sawNew)++;
    removeTree(dir);
    if (finished) {
      EXPECT_EQ(latest, 2);
      break;
    }
    ASSERT_LT(k, 1000);
  }
  EXPECT_GT(sawOld, 5);
  EXPECT_GT(sawNew, 0);
}

// A reader in another language (Python's standard library) reads every tensor byte-exact and
// recomputes every layer's digest from the manifest as docs/checkpoint_format.md defines it.
TEST(PersistTest, PythonStandardLibraryReadsTheSafetensorsFileByteExact) {
  const std::string dir = tempDir("ckpt-python");
  PersistOptions o;
  o.dir = dir;
  CheckpointWriter writer(o);
  ShardState s = allDtypeState(3);
  writer.flush({snap(s, 4, 11)});
  // Python writes each tensor's raw bytes (read through json + struct, the safetensors
  // layout) to <dir>/py/<layer>__<name>.bin; we compare them with the tensors.
  const std::string script = dir + "/read.py";
  {
    std::ofstream f(script);
    f << R"PY(import json, os, struct, sys
root = sys.argv[1]
latest = json.load(open(os.path.join(root, "LATEST")))
manifest = json.load(open(os.path.join(root, latest["manifest"])))
assert manifest["step"] == 11, manifest["step"]
os.makedirs(os.path.join(root, "py"))
sizes = {"F32": 4, "F64": 8, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
         "U8": 1, "BOOL": 1}
def crc32c(data, crc=0):  # docs/checkpoint_format.md's parameters, bit by bit
    crc ^= 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF
assert crc32c(b"123456789") == 0xE3069283
for layer, loc in manifest["layers"].items():
    # The layer digest as the format doc defines it, from the manifest alone.
    digest = 0
    for name, t in sorted(loc["tensors"].items(), key=lambda kv: kv[1]["data_offsets"][0]):
        key = name + "|" + t["dtype"] + "|" + "".join(str(d) + "," for d in t["shape"])
        digest = crc32c(key.encode(), digest)
        digest = crc32c(struct.pack("<I", int(t["crc32c"], 16)), digest)
    assert loc["digest"] == "0x%08x" % digest, (layer, loc["digest"], "0x%08x" % digest)
    with open(os.path.join(root, loc["file"]), "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    assert header["__metadata__"]["sinew_step"] == "11"
    for name, t in loc["tensors"].items():
        h = header[layer + "/" + name]
        assert h["dtype"] == t["dtype"] and h["shape"] == t["shape"], (layer, name)
        begin, end = h["data_offsets"]
        count = 1
        for d in h["shape"]:
            count *= d
        assert end - begin == count * sizes[h["dtype"]], (layer, name)
        with open(os.path.join(root, "py", layer + "__" + name + ".bin"), "wb") as out:
            out.write(data[8 + n + begin:8 + n + end])
print("ok")
)PY";
  }
  const std::string cmd = "python3 '" + script + "' '" + dir + "'";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  for (const auto& l : s) {
    for (const auto& t : l.tensors) {
      std::string bytes = posixEnv()->readFile(dir + "/py/" + l.name + "__" + t.name + ".bin");
      ASSERT_EQ(bytes.size(), static_cast<size_t>(t.tensor.numel() * t.tensor.element_size()))
          << l.name << "/" << t.name;
      if (bytes.empty()) continue;  // data_ptr() may be null; memcmp must not see it (UBSan).
      EXPECT_EQ(std::memcmp(bytes.data(), t.tensor.data_ptr(), bytes.size()), 0)
          << l.name << "/" << t.name;
    }
  }
  removeTree(dir);
}

TEST(PersistTest, IncrementalVersionsWriteOnlyChangedLayers) {
  const std::string dir = tempDir("ckpt-incremental");
  PersistOptions o;
  o.dir = dir;
  o.keep = 1;
  o.incremental = true;
  CheckpointWriter writer(o);
  ShardState s = makeState(4, 16, 1);
  writer.flush({snap(s, 0, 1)});
  // Step 2: only layers.2 changes (layers 0, 1 and 3 are frozen).
  s[2].tensors[0].tensor.add_(1);
  writer.flush({snap(s, 0, 2)});
  CheckpointReader reader(dir);
  Manifest m = reader.manifest(2);
  EXPECT_EQ(m.layers.at("layers.2").file, "step-00000002/shard-w0.safetensors");
  for (const char* l : {"layers.0", "layers.1", "layers.3"}) {
    EXPECT_EQ(m.layers.at(l).file, "step-00000001/shard-w0.safetensors") << l;
  }
  // Version 1's manifest is gone (keep = 1) but its file stays: version 2 needs it.
  EXPECT_EQ(reader.durableSteps(), (std::vector<int64_t>{2}));
  EXPECT_TRUE(posixEnv()->fileExists(dir + "/step-00000001/shard-w0.safetensors"));
  expectLayersEqual(s, reader.load(2));
  const auto newFile = posixEnv()->readFile(dir + "/step-00000002/shard-w0.safetensors");
  EXPECT_LT(newFile.size(), 16 * 16 * 4 * 2 + 16 * 4 + 8 + 1024u);  // One layer's bytes.
  // Step 3: layers.0 changes; layers.2 now comes from step 2, the rest from step 1.
  s[0].tensors[1].tensor.add_(1);
  writer.flush({snap(s, 0, 3)});
  m = reader.manifest(3);
  EXPECT_EQ(m.layers.at("layers.0").file, "step-00000003/shard-w0.safetensors");
  EXPECT_EQ(m.layers.at("layers.2").file, "step-00000002/shard-w0.safetensors");
  EXPECT_EQ(m.layers.at("layers.3").file, "step-00000001/shard-w0.safetensors");
  expectLayersEqual(s, reader.load(3));
  // Nothing changed: no new file, every layer points back.
  writer.flush({snap(s, 0, 4)});
  EXPECT_FALSE(posixEnv()->fileExists(dir + "/step-00000004/shard-w0.safetensors"));
  expectLayersEqual(s, reader.load(4));
  removeTree(dir);
}

// Parameters tied across layers of two writers' shards (a token embedding and the head that
// shares its weight) are written once: the follower's parameter and its optimizer state are
// named in the manifest as the owner's, are absent from its file, and load back as the
// owner's bytes; the follower's own bias is stored as usual.
TEST(PersistTest, TiedTensorsAreStoredOnceAndLoadAsTheOwners) {
  const std::string dir = tempDir("ckpt-tied");
  PersistOptions o;
  o.dir = dir;
  o.sameAs = {{"head/weight", "emb/weight"}};
  const at::Tensor w = randomBits(at::kFloat, {64, 16}, 1);
  const at::Tensor m = randomBits(at::kFloat, {64, 16}, 2);
  const at::Tensor step = at::tensor({int64_t{7}}, at::kLong);
  const at::Tensor bias = randomBits(at::kFloat, {64}, 3);
  ShardState first = {{"emb", {{"weight", w}, {"weight.exp_avg", m}, {"weight.step", step}}}};
  ShardState second = {{"head",
                        {{"weight", w.clone()},
                         {"weight.exp_avg", m.clone()},
                         {"weight.step", step.clone()},
                         {"bias", bias}}}};
  CheckpointWriter writer(o);
  std::vector<ShardFileRecord> records = {writer.writeShard(*snap(first, 0, 5)),
                                          writer.writeShard(*snap(second, 1, 5))};
  writer.commitVersion(5, records);
  CheckpointReader reader(dir);
  const Manifest manifest = reader.manifest(5);
  const LayerLocation& head = manifest.layers.at("head");
  EXPECT_EQ(head.sameAs,
            (std::map<std::string, std::string>{{"weight", "emb/weight"},
                                                {"weight.exp_avg", "emb/weight.exp_avg"},
                                                {"weight.step", "emb/weight.step"}}));
  ASSERT_EQ(head.tensors.size(), 1u);
  EXPECT_EQ(head.tensors[0].name, "bias");
  // The follower's file holds its bias alone: 64 floats after the header.
  const std::string file = posixEnv()->readFile(dir + "/step-00000005/shard-w1.safetensors");
  uint64_t headerBytes = 0;
  std::memcpy(&headerBytes, file.data(), 8);
  EXPECT_EQ(file.size(), 8 + headerBytes + 64 * 4);
  const auto loaded = reader.load(5, {"head"});
  const RestoredLayer& got = loaded.at("head");
  ASSERT_EQ(got.size(), 4u);
  EXPECT_TRUE(sameBytes(got.at("weight"), w));
  EXPECT_TRUE(sameBytes(got.at("weight.exp_avg"), m));
  EXPECT_TRUE(sameBytes(got.at("weight.step"), step));
  EXPECT_TRUE(sameBytes(got.at("bias"), bias));
  // A damaged owner tensor is found when the follower is read.
  const std::string ownerPath = dir + "/step-00000005/shard-w0.safetensors";
  std::string bytes = posixEnv()->readFile(ownerPath);
  bytes[bytes.size() - 100] ^= 1;  // Within emb's weight or exp_avg.
  {
    auto f = posixEnv()->newWritableFile(ownerPath);
    f->append(bytes.data(), bytes.size());
    f->close();
  }
  try {
    reader.load(5, {"head"});
    ADD_FAILURE() << "a damaged owner tensor was read for the follower";
  } catch (const Corruption& e) {
    EXPECT_NE(std::string(e.what()).find("layer emb tensor weight"), std::string::npos) << e.what();
  }
  removeTree(dir);
}

// ---------------------------------------------------------------------------------------

// The replica service checks a shard's checksums chunk by chunk as it arrives
// (IncrementalVerify), instead of re-reading the whole shard at the end: for any chunking,
// intact or with one byte flipped, it must say exactly what verify() says.
TEST(ReplicaTest, IncrementalVerifyAgreesWithVerifyForAnyChunking) {
  auto shard = snap(allDtypeState(1), 0, 1);
  auto& mutableShard = const_cast<HostShard&>(*shard);
  const uint64_t total = shard->layout.totalBytes;
  ASSERT_GT(shard->layout.tensors.size(), 3u);
  auto incremental = [&](uint64_t chunk) {
    IncrementalVerify v(*shard);
    for (uint64_t off = 0; off < total;) {
      off = std::min(total, off + chunk);
      v.advance(off);
    }
    return v.result();
  };
  const std::vector<uint64_t> chunks = {1, 7, 64, 4096, total};
  for (uint64_t chunk : chunks) EXPECT_EQ(incremental(chunk), "") << chunk;
  const TensorRecord& t = *std::max_element(
      shard->layout.tensors.begin(), shard->layout.tensors.end(),
      [](const TensorRecord& a, const TensorRecord& b) { return a.nbytes < b.nbytes; });
  ASSERT_GT(t.nbytes, 0u);
  mutableShard.data()[t.offset + t.nbytes / 2] ^= 0x10;
  const std::string expected = shard->verify();
  ASSERT_NE(expected.find("tensor " + t.name), std::string::npos) << expected;
  for (uint64_t chunk : chunks) EXPECT_EQ(incremental(chunk), expected) << chunk;
}

TEST(ReplicaTest, PutListGetOverLoopbackAndRejectsBadChecksums) {
  ReplicaService service(1, replicaServiceOptions());
  ShardState s = allDtypeState(2);
  ReplicaClientOptions co = replicaClientOptions();
  co.chunkBytes = 64;  // Many chunks.
  ReplicaClient client(1, service.address(), co);
  for (int64_t step = 0; step < 3; ++step) client.put(*snap(allDtypeState(step), 0, step));
  // The two newest versions are kept.
  EXPECT_EQ(service.find(0, 0), nullptr);
  ASSERT_NE(service.find(0, 2), nullptr);
  expectLayersEqual(allDtypeState(2), extractAll(*service.find(0, 2)));
  auto list = client.list();
  std::set<int64_t> steps;
  for (const auto& r : list) steps.insert(r.step);
  EXPECT_EQ(steps, (std::set<int64_t>{1, 2}));
  auto got = client.get(0, 1);
  EXPECT_EQ(got->verify(), "");
  expectLayersEqual(allDtypeState(1), extractAll(*got));
  EXPECT_THROW(client.get(0, 0), IoError);
  // A shard whose bytes disagree with its checksums is rejected and not kept; the newest
  // complete version survives.
  auto bad = snap(allDtypeState(3), 0, 3);
  auto& mutableBad = const_cast<HostShard&>(*bad);
  mutableBad.layout.tensors[0].crc32c ^= 1;
  try {
    client.put(*bad);
    ADD_FAILURE() << "corrupt replica accepted";
  } catch (const Corruption& e) {
    EXPECT_NE(std::string(e.what()).find("crc32c"), std::string::npos) << e.what();
  }
  EXPECT_EQ(service.find(0, 3), nullptr);
  EXPECT_NE(service.find(0, 2), nullptr);
}

// A restore that wants some layers of a peer's shard gets only those: the peer answers a get of
// named layers with their tensors alone (ShardLayout::onlyLayers: back to back, checksums
// kept), and restoreLayers asks each peer for the wanted layers of each shard it lists. Names
// the shard lacks are skipped.
TEST(ReplicaTest, AGetOfSomeLayersSendsOnlyTheirBytes) {
  ReplicaService service(1, replicaServiceOptions());
  ReplicaClientOptions co = replicaClientOptions();
  co.chunkBytes = 100;
  ReplicaClient client(1, service.address(), co);
  const ShardState s = makeState(4, 32, 3);
  auto whole = snap(s, 0, 7);
  client.put(*whole);
  auto got = client.get(0, 7, {"layers.3", "layers.1", "nope"});
  EXPECT_EQ(got->layout.layers(), (std::vector<std::string>{"layers.1", "layers.3"}));
  uint64_t want = 0;
  for (const auto& t : whole->layout.tensors) {
    if (t.layer == "layers.1" || t.layer == "layers.3") want += t.nbytes;
  }
  EXPECT_EQ(got->layout.totalBytes, want);
  EXPECT_EQ(got->capacity(), want);
  EXPECT_LT(want, whole->layout.totalBytes / 2 + 1);
  EXPECT_EQ(got->verify(), "");
  expectLayersEqual({s[1], s[3]}, extractAll(*got));
  EXPECT_THROW(client.get(0, 6, {"layers.1"}), IoError);  // A version it does not hold.
  // Through restoreLayers: only the wanted layer's bytes are fetched.
  RestoreSources src;
  src.client.token = sinew::testing::kTestToken;
  src.peers = {{1, service.address()}};
  auto r = restoreLayers(src, 7, {"layers.2"});
  EXPECT_EQ(r.source.at("layers.2"), "peer 1");
  expectLayersEqual({s[2]}, r.layers);
}

// Incremental versions (ReplicaClientOptions::incremental): once the peer acknowledged a
// version, the next one sends only the tensors whose checksum changed, and the peer's replica
// of it equals the shard byte for byte. A model of a frozen base (three layers that never
// change) under a trained head: every version after the first sends the head alone. A peer
// that lost the base (a new service) gets the version whole; a delta whose bytes disagree with
// its checksums is refused like any replica; without the option every version goes whole.
TEST(ReplicaTest, IncrementalVersionsSendOnlyTheTensorsThatChanged) {
  ShardState frozen = makeState(3, 64, 1, "base.");
  ShardState head = makeState(1, 16, 1, "head.");
  auto state = [&](int64_t step) {
    ShardState s = frozen;
    ShardState h = makeState(1, 16, step + 1, "head.");
    s.insert(s.end(), h.begin(), h.end());
    return s;
  };
  auto full = snap(state(0), 0, 0);
  const uint64_t total = full->layout.totalBytes;
  const uint64_t headBytes = ShardLayout::of(makeState(1, 16, 1, "head.")).totalBytes;
  auto run = [&](bool incremental, std::vector<uint64_t>* sent) {
    ReplicaService service(1, replicaServiceOptions());
    ReplicaClientOptions co = replicaClientOptions();
    co.chunkBytes = 1000;  // Ranges of several chunks, chunks that end within a tensor.
    co.incremental = incremental;
    ReplicaClient client(1, service.address(), co);
    for (int64_t step = 0; step < 4; ++step) {
      auto shard = snap(state(step), 0, step);
      const uint64_t before = service.bytesReceived();
      sent->push_back(client.put(*shard));
      EXPECT_EQ(service.bytesReceived() - before, sent->back()) << "step " << step;
      ASSERT_NE(service.find(0, step), nullptr) << "step " << step;
      EXPECT_EQ(std::memcmp(service.find(0, step)->data(), shard->data(), total), 0)
          << "step " << step << ": the replica differs from the shard";
    }
  };
  std::vector<uint64_t> whole, delta;
  run(false, &whole);
  run(true, &delta);
  EXPECT_EQ(whole, std::vector<uint64_t>(4, total));
  ASSERT_EQ(delta.size(), 4u);
  EXPECT_EQ(delta[0], total);
  for (int i = 1; i < 4; ++i) {
    // The head's tensors, less its step count's 8 bytes when they did not change.
    EXPECT_LE(delta[i], headBytes) << "version " << i;
    EXPECT_GE(delta[i], headBytes - 8) << "version " << i;
  }
  EXPECT_LT(delta[1] * 10, total);

  ReplicaClientOptions co = replicaClientOptions();
  co.incremental = true;
  // Same client, a service that restarted: its base is gone.
  auto restartable = std::make_unique<ReplicaService>(1, replicaServiceOptions());
  const std::string address = restartable->address();
  ReplicaClient sticky(1, address, co);
  EXPECT_EQ(sticky.put(*snap(state(0), 0, 0)), total);
  restartable.reset();
  ReplicaServiceOptions same = replicaServiceOptions();
  same.port = static_cast<uint16_t>(std::stoi(address.substr(address.rfind(':') + 1)));
  ReplicaService restarted(1, same);
  const uint64_t resent = sticky.put(*snap(state(1), 0, 1));
  EXPECT_GT(resent, total) << "the delta then the whole version";
  ASSERT_NE(restarted.find(0, 1), nullptr);
  EXPECT_EQ(restarted.find(0, 1)->verify(), "");

  // A service that keeps one version has no slot for a delta besides its base: each delta is
  // refused, then sent whole, and after two such refusals the client sends versions whole.
  ReplicaServiceOptions one = replicaServiceOptions();
  one.versionsKept = 1;
  ReplicaService single(1, one);
  ReplicaClient toSingle(1, single.address(), co);
  std::vector<uint64_t> sentToSingle;
  for (int64_t step = 0; step < 4; ++step) {
    sentToSingle.push_back(toSingle.put(*snap(state(step), 0, step)));
    ASSERT_NE(single.find(0, step), nullptr) << "step " << step;
  }
  EXPECT_EQ(sentToSingle[0], total);
  EXPECT_GT(sentToSingle[1], total);
  EXPECT_GT(sentToSingle[2], total);
  EXPECT_EQ(sentToSingle[3], total) << "the client kept sending deltas it knew were refused";

  // A delta whose bytes disagree with its checksums is refused; the newest version stays.
  auto bad = snap(state(2), 0, 2);
  auto& mutableBad = const_cast<HostShard&>(*bad);
  mutableBad.layout.tensors.back().crc32c ^= 1;  // The head's step count: changed, sent.
  try {
    sticky.put(*bad);
    ADD_FAILURE() << "a corrupt delta was accepted";
  } catch (const Corruption& e) {
    EXPECT_NE(std::string(e.what()).find("crc32c"), std::string::npos) << e.what();
  }
  EXPECT_EQ(restarted.find(0, 2), nullptr);
  EXPECT_NE(restarted.find(0, 1), nullptr);
}

// Stray bytes on the replica port (an HTTP probe, a header with a bad magic, a header that
// claims an absurd size) cost only that connection; replicas already held and later puts
// are unaffected.
TEST(ReplicaTest, GarbageOnThePortDropsOnlyThatConnection) {
  ReplicaServiceOptions so = replicaServiceOptions();
  so.maxShardBytes = 1 << 20;
  ReplicaService service(1, so);
  ReplicaClient client(1, service.address(), replicaClientOptions());
  client.put(*snap(allDtypeState(0), 0, 0));
  std::vector<std::vector<uint8_t>> strays;
  std::string http = "GET / HTTP/1.1\r\nHost: localhost\r\n\r\n";
  strays.emplace_back(http.begin(), http.end());
  std::vector<uint8_t> badMagic(32, 0xAB);
  strays.push_back(badMagic);
  // A well-formed chunk header with the right token claiming 2^31 bytes.
  sinew::testing::RawFrame huge;
  huge.service = 3;
  huge.type = 2;
  huge.length = int64_t(1) << 31;
  strays.push_back(sinew::testing::rawFrame(huge));
  // A begin with a wrong token.
  sinew::testing::RawFrame stranger;
  stranger.service = 3;
  stranger.type = 1;
  stranger.token = 42;
  stranger.length = 1 << 20;
  strays.push_back(sinew::testing::rawFrame(stranger));
  // A begin whose layout claims more than maxShardBytes.
  sinew::testing::RawFrame big;
  big.service = 3;
  big.type = 1;
  big.payload = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  std::string layout = R"({"total_bytes": 1099511627776, "tensors": []})";
  big.payload.insert(big.payload.end(), layout.begin(), layout.end());
  strays.push_back(sinew::testing::rawFrame(big));
  // Gets of some layers whose names are not a list of names.
  for (const std::string names :
       {"[7]", "[]", "{\"a\": 1}", "[\"fc\"",
        "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["
        "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["
        "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["
        "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["
        "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["
        "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["
        "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}) {
    sinew::testing::RawFrame get;
    get.service = 3;
    get.type = 12;
    get.payload = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    get.payload.insert(get.payload.end(), names.begin(), names.end());
    strays.push_back(sinew::testing::rawFrame(get));
  }
  for (const auto& bytes : strays) {
    int fd = sinew::testing::connectLoopback(service.port());
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    EXPECT_TRUE(sinew::testing::closedByPeer(fd, std::chrono::seconds(3)))
        << "the service kept a connection that sent " << bytes.size() << " stray bytes";
    ::close(fd);
  }
  EXPECT_EQ(service.bytesAllocated(), service.find(0, 0)->capacity() * 1)
      << "a stray header made the service allocate memory";
  client.put(*snap(allDtypeState(1), 0, 1));
  ASSERT_NE(service.find(0, 1), nullptr);
  expectLayersEqual(allDtypeState(1), extractAll(*service.find(0, 1)));
  expectLayersEqual(allDtypeState(0), extractAll(*service.find(0, 0)));
}

TEST(RestoreTest, OwnRamThenPeerThenDiskFallingThroughOnMismatch) {
  const std::string dir = tempDir("ckpt-restore");
  ShardState s = makeState(3, 8, 7);
  auto good = snap(s, 0, 5);
  PersistOptions po;
  po.dir = dir;
  CheckpointWriter(po).flush({good});
  ReplicaService peer(1, replicaServiceOptions());
  ReplicaClient(1, peer.address(), replicaClientOptions()).put(*good);

  // A local copy with a flipped byte in layers.1.
  auto local = snap(s, 0, 5);
  const auto& rec = local->layout.tensors[4];
  ASSERT_EQ(rec.layer, "layers.1");
  const_cast<HostShard&>(*local).data()[rec.offset] ^= 1;

  RestoreSources src;

  src.client.token = sinew::testing::kTestToken;
  src.local = {local};
  src.peers = {{1, peer.address()}};
  src.dir = dir;
  auto r = restoreLayers(src, 5, {"layers.0", "layers.1", "layers.2"});
  EXPECT_EQ(r.source.at("layers.0"), "peer 1");  // The whole local shard was rejected.
  EXPECT_EQ(r.source.at("layers.1"), "peer 1");
  ASSERT_EQ(r.fellThrough.size(), 1u);
  EXPECT_NE(r.fellThrough[0].find("local: layer layers.1 tensor weight"), std::string::npos)
      << r.fellThrough[0];
  expectLayersEqual(s, r.layers);

  // Only an intact local copy: served locally.
  src.local = {good};
  r = restoreLayers(src, 5, {"layers.2"});
  EXPECT_EQ(r.source.at("layers.2"), "local");

  // No RAM copy (the peer is gone): disk.
  src.local.clear();
  src.peers = {{1, "127.0.0.1:1"}};
  src.client.connectTimeout = 100ms;
  r = restoreLayers(src, 5, {"layers.0", "layers.2"});
  EXPECT_EQ(r.source.at("layers.0"), "disk step-00000005/shard-w0.safetensors");
  expectLayersEqual({s[0], s[2]}, r.layers);

  // Nothing anywhere: an error naming the layer and the version.
  src.dir.clear();
  try {
    restoreLayers(src, 5, {"layers.0"});
    ADD_FAILURE();
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("version 5: no source holds layers layers.0"),
              std::string::npos)
        << e.what();
  }
  removeTree(dir);
}

}  // namespace
}  // namespace checkpoint
}  // namespace sinew
