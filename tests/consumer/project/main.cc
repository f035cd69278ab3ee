// A program outside the Sinew tree that uses the installed package.
#include <sinew/collectives/communicator.h>
#include <sinew/collectives/hash_store.h>
#include <sinew/config.h>
#include <sinew/runtime/trainer.h>

#include <ATen/ATen.h>

#include <cstdio>

int main() {
  auto store = std::make_shared<sinew::collectives::HashStore>();
  sinew::collectives::CommunicatorOptions o;
  o.members = {7};
  o.self = 7;
  auto comm = sinew::collectives::createGlooCommunicator(store, o);
  at::Tensor t = at::full({4}, 3.0f);
  comm->allreduce(t, sinew::collectives::ReduceOp::kAvg);
  try {
    comm->broadcast(t, 5);
    return 1;
  } catch (const sinew::InvalidArgument&) {
  }
  // The runtime's public API is usable too: the global batch is a function of (seed, step).
  auto batch = sinew::globalBatchIndices(3, 7, 16, 1000);
  if (batch != sinew::globalBatchIndices(3, 7, 16, 1000) || batch.size() != 16) return 2;
  auto plan = sinew::Plan::dataParallel(0, {4, 9, 2}, 5, 8);
  if (plan.of(9).microbatches.size() != 3) return 3;
  std::printf("consumer ok: allreduce=%g version=%d.%d nccl=%d\n", t[0].item<float>(),
              SINEW_VERSION_MAJOR, SINEW_VERSION_MINOR, SINEW_WITH_NCCL);
  return 0;
}
