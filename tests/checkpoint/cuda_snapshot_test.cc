// Lazy snapshots of CUDA tensors (docs/gpu.md, "Snapshots from device memory"): the copy into
// the pinned arena runs on a side stream after the step that made the version, the next
// update waits for it on the GPU (the host does not block), and the bytes that come back are
// the version's, not the update's. Skipped, with the reason, without a GPU.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>

#include "../gpu_support.h"
#include "sinew/checkpoint/snapshot.h"
#include "sinew/error.h"

namespace sinew {
namespace checkpoint {
namespace {

using Clock = std::chrono::steady_clock;

// Queues about `seconds` of matrix products on the default stream (independent of the state).
void busyGpu(double seconds) {
  at::Tensor a = at::randn({4096, 4096}, at::Device(at::kCUDA, 0));
  at::Tensor b = at::randn({4096, 4096}, at::Device(at::kCUDA, 0)) / 64.0;
  (void)a.mm(b).sum().item<float>();
  auto t0 = Clock::now();
  for (int i = 0; i < 10; ++i) a = a.mm(b);
  (void)a.sum().item<float>();
  const double perMm = std::chrono::duration<double>(Clock::now() - t0).count() / 10;
  const int n = static_cast<int>(std::min(20000.0, seconds / std::max(perMm, 1e-5)));
  for (int i = 0; i < n; ++i) a = a.mm(b).clamp(-1, 1);
}

// Every float of the tensor's bytes in the shard equals v.
bool allEqual(const HostShard& s, const std::string& name, float v) {
  for (const auto& rec : s.layout.tensors) {
    if (rec.name != name) continue;
    const auto* f = reinterpret_cast<const float*>(s.data() + rec.offset);
    for (uint64_t i = 0; i < rec.nbytes / sizeof(float); ++i) {
      if (f[i] != v) return false;
    }
    return true;
  }
  return false;
}

TEST(CudaSnapshotTest, UpdateWaitsOnTheGpuForItsTensorsAndTheVersionComesBackWhole) {
  SINEW_REQUIRE_GPU();
  const auto dev = at::Device(at::kCUDA, 0);
  at::Tensor w = at::zeros({8 << 20}, dev);  // 32 MB each
  at::Tensor m = at::zeros({8 << 20}, dev);
  at::Tensor v = at::zeros({1 << 20}, dev);
  at::Tensor step = at::zeros({1}, at::kLong);  // a host tensor, as Adam's step count
  ShardState state = {{"layer0", {{"w", w}, {"w.exp_avg", m}, {"w.exp_avg_sq", v}}},
                      {"layer1", {{"w.step", step}}}};
  SnapshotArena arena(state, SnapshotOptions());

  // The "optimizer step" of version 1 runs behind ~1 s of GPU work.
  busyGpu(1.0);
  w.fill_(1);
  m.fill_(2);
  v.fill_(3);
  step.fill_(1);
  ASSERT_TRUE(arena.snapshot(1, state));
  auto t0 = Clock::now();
  arena.waitBeforeUpdate();
  const double hostWait = std::chrono::duration<double>(Clock::now() - t0).count();
  // The host did not wait for the GPU: the copies cannot have run yet.
  EXPECT_EQ(arena.find(1), nullptr) << "waitBeforeUpdate() blocked until the copy was done";
  EXPECT_LT(hostWait, 0.5);
  // The next "optimizer step", issued at once on the default stream: it must run after the
  // copies of its tensors, so version 1 holds 1, 2, 3.
  w.fill_(10);
  m.fill_(20);
  v.fill_(30);
  step.fill_(2);
  arena.waitComplete();
  auto shard = arena.find(1);
  ASSERT_NE(shard, nullptr);
  EXPECT_TRUE(allEqual(*shard, "w", 1));
  EXPECT_TRUE(allEqual(*shard, "w.exp_avg", 2));
  EXPECT_TRUE(allEqual(*shard, "w.exp_avg_sq", 3));
  int64_t savedStep = 0;
  for (const auto& rec : shard->layout.tensors) {
    if (rec.name == "w.step") std::memcpy(&savedStep, shard->data() + rec.offset, 8);
  }
  EXPECT_EQ(savedStep, 1);
  EXPECT_EQ(shard->verify(), "");  // Checksums computed over the bytes that landed.
  EXPECT_EQ(w.max().item<float>(), 10);

  // Version 2, again behind GPU work. Its wait returns at once, so version 3, asked for while
  // version 2 is still being copied and checksummed, is skipped rather than the step blocked;
  // both complete versions stay whole.
  busyGpu(0.5);
  w.fill_(5);
  ASSERT_TRUE(arena.snapshot(2, state));
  arena.waitBeforeUpdate();
  EXPECT_FALSE(arena.snapshot(3, state));
  EXPECT_EQ(arena.stats().skipped, 1);
  w.fill_(100);
  arena.waitComplete();
  ASSERT_NE(arena.find(2), nullptr);
  EXPECT_TRUE(allEqual(*arena.find(2), "w", 5));
  EXPECT_TRUE(allEqual(*arena.find(1), "w", 1));
  EXPECT_EQ(arena.find(3), nullptr);
}

TEST(CudaSnapshotTest, ATensorOnAnotherDeviceIsRefused) {
  SINEW_REQUIRE_GPU();
  at::Tensor w = at::zeros({1024}, at::Device(at::kCUDA, 0));
  ShardState state = {{"layer0", {{"w", w}}}};
  SnapshotArena arena(state, SnapshotOptions());
  ShardState moved = {{"layer0", {{"w", w.cpu()}}}};
  try {
    arena.snapshot(0, moved);
    ADD_FAILURE() << "a snapshot of a tensor moved to the CPU was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'layer0.w' is on cpu"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace checkpoint
}  // namespace sinew
