// The communicators with CUDA tensors (docs/gpu.md): NCCL with one rank (non-blocking init,
// every collective, abort), NCCL refusing two ranks on one GPU within its init deadline, and
// Gloo through host memory for several ranks sharing one GPU. Skipped, with the reason,
// without a GPU.

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "../gpu_support.h"
#include "sinew/collectives/hash_store.h"
#include "sinew/communicator.h"

namespace sinew {
namespace collectives {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

double secondsSince(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

CommunicatorOptions options(std::vector<int> members, int self, const std::string& name) {
  CommunicatorOptions o;
  o.members = std::move(members);
  o.self = self;
  o.name = name;
  o.initTimeout = 60s;
  o.timeout = 20s;
  o.device = 0;
  return o;
}

at::Tensor cuda(const at::Tensor& t) { return t.to(at::Device(at::kCUDA, 0)); }

TEST(NcclTest, SingleRankCollectivesThenAbort) {
  SINEW_REQUIRE_GPU();
  auto store = std::make_shared<HashStore>();
  auto t0 = Clock::now();
  auto comm = createNcclCommunicator(store, options({0}, 0, "nccl-one"));
  std::printf("non-blocking NCCL init took %.0f ms\n", secondsSince(t0) * 1e3);
  EXPECT_STREQ(comm->backend(), "nccl");
  for (auto dtype : {at::kFloat, at::kDouble, at::kLong}) {
    at::Tensor want = at::arange(1000, at::TensorOptions().dtype(dtype));
    at::Tensor t = cuda(want);
    comm->allreduce(t);
    EXPECT_TRUE(t.cpu().equal(want)) << c10::toString(dtype);
    comm->allreduce(t, ReduceOp::kAvg);
    EXPECT_TRUE(t.cpu().equal(want)) << c10::toString(dtype);
    comm->broadcast(t, 0);
    EXPECT_TRUE(t.cpu().equal(want));
    at::Tensor out = cuda(at::zeros({1000}, at::TensorOptions().dtype(dtype)));
    comm->allgather(out, t);
    EXPECT_TRUE(out.cpu().equal(want));
  }
  comm->barrier();
  at::Tensor host = at::ones({4});
  EXPECT_THROW(comm->allreduce(host), InvalidArgument);  // NCCL takes CUDA tensors only.
  EXPECT_EQ(comm->error(), nullptr);

  comm->abort();
  at::Tensor t = cuda(at::ones({4}));
  t0 = Clock::now();
  EXPECT_THROW(comm->allreduce(t), Aborted);
  EXPECT_LT(secondsSince(t0), 1.0);
  EXPECT_NE(comm->error(), nullptr);
  EXPECT_THROW(comm->broadcast(t, 0), Aborted);  // Dead for good.
}

// Two ranks of one NCCL communicator on the same GPU, which NCCL refuses: the non-blocking
// init, polled against its deadline, ends on both with a typed error (NCCL's own, or Timeout
// at the deadline), never a hang, and the communicator is aborted.
TEST(NcclTest, TwoRanksOnOneGpuFailWithATypedErrorWithinTheDeadline) {
  SINEW_REQUIRE_GPU();
  auto store = std::make_shared<HashStore>();
  std::vector<std::string> errors(2);
  std::vector<double> took(2);
  auto rank = [&](int r) {
    CommunicatorOptions o = options({0, 1}, r, "nccl-shared-gpu");
    o.initTimeout = 10s;
    auto t0 = Clock::now();
    try {
      auto comm = createNcclCommunicator(store, o);
      errors[r] = "built";
    } catch (const Error& e) {
      errors[r] = e.what();
    }
    took[r] = secondsSince(t0);
  };
  std::thread t1(rank, 1);
  rank(0);
  t1.join();
  for (int r = 0; r < 2; ++r) {
    std::printf("rank %d after %.2f s: %s\n", r, took[r], errors[r].c_str());
    EXPECT_NE(errors[r], "built") << "NCCL accepted two ranks on one GPU";
    EXPECT_NE(errors[r], "");
    EXPECT_LT(took[r], 10.0 + 5.0) << "past the 10 s init deadline";
    EXPECT_NE(errors[r].find("communicator 'nccl-shared-gpu"), std::string::npos)
        << "the error does not say which communicator";
  }
}

// Ranks sharing one GPU (which NCCL refuses) move CUDA tensors through Gloo.
// Ranks as threads, rank r on GPU r: epoch 0 of all, the last rank's communicator dies
// (aborted mid-call: it fails, as at a lost peer), the others build epoch 1 without it, which
// this NCCL makes by ncclCommShrink of epoch 0's communicator, and reduce exactly. Needs one
// GPU per rank (NCCL refuses two ranks on one GPU) and NCCL >= 2.27; skipped otherwise.
TEST(NcclTest, SurvivorsShrinkTheCommunicatorBefore) {
  SINEW_REQUIRE_GPU();
  const int gpus = cudaDeviceCount();
  if (gpus < 2) GTEST_SKIP() << "needs 2 GPUs or more, this machine has " << gpus;
  if (ncclMembershipChange().rfind("shrink", 0) != 0) {
    GTEST_SKIP() << "this NCCL cannot shrink: " << ncclMembershipChange();
  }
  const int n = std::min(gpus, 4);
  auto store = std::make_shared<HashStore>();
  std::vector<int> all, survivors;
  for (int r = 0; r < n; ++r) all.push_back(r);
  survivors.assign(all.begin(), all.end() - 1);
  std::vector<std::string> how(n), failures(n);
  auto rank = [&](int r) {
    try {
      CommunicatorOptions o = options(all, r, "nccl-shrink");
      o.device = r;
      auto comm = createNcclCommunicator(store, o);
      at::Tensor t = at::ones({1 << 20}, at::TensorOptions().device(at::kCUDA, r));
      comm->allreduce(t);
      if (t.cpu().sum().item<double>() != double(n) * (1 << 20)) failures[r] += "epoch 0 sum; ";
      comm->abort();
      try {
        comm->allreduce(t);
      } catch (const Aborted&) {
      }
      comm.reset();
      if (r == n - 1) return;  // The lost member.
      CommunicatorOptions o1 = options(survivors, r, "nccl-shrink");
      o1.device = r;
      o1.epoch = 1;
      auto next = createNcclCommunicator(store, o1);
      how[r] = next->setUp();
      at::Tensor u = at::full({1 << 20}, r + 1.0, at::TensorOptions().device(at::kCUDA, r));
      next->allreduce(u);
      const double want = (n - 1) * n / 2.0;
      if (!u.cpu().equal(at::full({1 << 20}, want))) failures[r] += "epoch 1 sum; ";
    } catch (const std::exception& e) {
      failures[r] += e.what();
    }
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(rank, r);
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    EXPECT_EQ(failures[r], "") << "rank " << r;
    if (r < n - 1) {
      EXPECT_EQ(how[r], "shrink") << "rank " << r;
    }
  }
}

TEST(HostStagedTest, CudaTensorsThroughGlooOnOneGpu) {
  SINEW_REQUIRE_GPU();
  auto store = std::make_shared<HashStore>();
  std::vector<std::string> failures(2);
  auto rank = [&](int r) {
    try {
      auto comm = createHostStagedCommunicator(store, options({0, 1}, r, "staged"));
      if (std::string(comm->backend()) != "gloo") failures[r] += "backend not gloo; ";
      at::Tensor t = cuda(at::full({1000}, static_cast<double>(r + 1), at::kDouble));
      comm->allreduce(t);
      if (!t.is_cuda() || t.min().item<double>() != 3 || t.max().item<double>() != 3) {
        failures[r] += "allreduce; ";
      }
      at::Tensor b = cuda(at::full({7}, static_cast<int64_t>(r * 10 + 5), at::kLong));
      comm->broadcast(b, 1);
      if (!b.cpu().equal(at::full({7}, int64_t{15}, at::kLong))) failures[r] += "broadcast; ";
      at::Tensor out = cuda(at::zeros({2, 3}));
      comm->allgather(out, cuda(at::full({3}, static_cast<float>(r))));
      if (!out.cpu().equal(at::stack({at::zeros({3}), at::ones({3})}))) {
        failures[r] += "allgather; ";
      }
      // Both send at once; each receives into some rows of a CUDA tensor (a view).
      at::Tensor mine = cuda(at::arange(12, at::kDouble).view({6, 2}) + 100 * r);
      at::Tensor got = cuda(at::zeros({6, 2}, at::kDouble));
      const int peer = 1 - r;
      comm->exchange(
          {P2POp::send(mine.narrow(0, 2, 2), peer, 7), P2POp::recv(got.narrow(0, 4, 2), peer, 7)});
      at::Tensor want = at::zeros({6, 2}, at::kDouble);
      want.narrow(0, 4, 2).copy_(at::arange(4, 8, at::kDouble).view({2, 2}) + 100 * peer);
      if (!got.cpu().equal(want)) failures[r] += "exchange into rows; ";
      // Host tensors pass through.
      at::Tensor h = at::ones({3});
      comm->allreduce(h);
      if (!h.equal(at::full({3}, 2.0f))) failures[r] += "host allreduce; ";
      comm->barrier();
    } catch (const std::exception& e) {
      failures[r] += e.what();
    }
  };
  std::thread t1(rank, 1);
  rank(0);
  t1.join();
  EXPECT_EQ(failures[0], "");
  EXPECT_EQ(failures[1], "");
}

}  // namespace
}  // namespace collectives
}  // namespace sinew
