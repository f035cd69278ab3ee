// The communicators with CUDA tensors (docs/gpu.md): NCCL with one rank (init, every
// collective, abort, a deadline on a stream that never drains), and Gloo through host memory
// for several ranks sharing one GPU. Skipped, with the reason, without a GPU.

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

// An operation whose stream cannot drain (the GPU is busy with work queued before it on the
// default stream) fails with Timeout at its deadline, not when the work ends.
TEST(NcclTest, DeadlineOnABusyStreamThrowsTimeout) {
  SINEW_REQUIRE_GPU();
  auto store = std::make_shared<HashStore>();
  auto comm = createNcclCommunicator(store, options({0}, 0, "nccl-deadline"));
  at::Tensor a = cuda(at::randn({4096, 4096}));
  at::Tensor b = cuda(at::randn({4096, 4096})) / 64.0;
  (void)a.mm(b).sum().item<float>();  // Warm-up (cuBLAS handles).
  auto t0 = Clock::now();
  for (int i = 0; i < 10; ++i) a = a.mm(b);
  (void)a.sum().item<float>();
  const double perMm = secondsSince(t0) / 10;
  // About 3 s of matrix products on the default stream.
  const int n = static_cast<int>(std::min(20000.0, 3.0 / std::max(perMm, 1e-5)));
  for (int i = 0; i < n; ++i) a = a.mm(b).clamp(-1, 1);
  at::Tensor x = cuda(at::ones({16}));
  t0 = Clock::now();
  try {
    comm->allreduce(x, ReduceOp::kSum, 200ms);
    ADD_FAILURE() << "allreduce behind ~3 s of GPU work met a 200 ms deadline";
  } catch (const Timeout& e) {
    const double took = secondsSince(t0);
    std::printf("Timeout after %.0f ms (%d products of %.2f ms queued): %s\n", took * 1e3, n,
                perMm * 1e3, e.what());
    EXPECT_GE(took, 0.19);
    EXPECT_LT(took, 1.5);
    EXPECT_NE(std::string(e.what()).find("allreduce timed out after 200 ms"), std::string::npos);
  }
  EXPECT_THROW(comm->allreduce(x), Timeout);  // The same error from now on.
  (void)a.sum().item<float>();                // Drain the GPU.
}

// Ranks sharing one GPU (which NCCL refuses) move CUDA tensors through Gloo.
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
      comm->exchange({P2POp::send(mine.narrow(0, 2, 2), peer, 7),
                      P2POp::recv(got.narrow(0, 4, 2), peer, 7)});
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
