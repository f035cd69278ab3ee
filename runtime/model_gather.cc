#include "sinew/runtime/model_gather.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

#include "sinew/base/error.h"

namespace sinew {
namespace runtime {

namespace {

constexpr size_t kGatherChunkBytes = size_t{4} << 20;

}  // namespace

torch::nn::Sequential gatherLayers(const GatherInputs& in) {
  const pipeline::Plan& plan = *in.plan;
  const int layers = static_cast<int>(in.spec->layers.size());
  // The lowest-id holder of every layer.
  std::vector<int> holder(static_cast<size_t>(layers), -1);
  for (const auto& w : plan.workers) {
    for (int l = w.firstLayer; l < w.endLayer; ++l) {
      if (holder[l] < 0 || w.worker < holder[l]) holder[l] = w.worker;
    }
  }
  const std::vector<int>& members = in.comm->members();
  auto rankOf = [&](int worker) {
    auto it = std::find(members.begin(), members.end(), worker);
    SINEW_ENFORCE(it != members.end(), "worker ", worker, " is not a member of the gather");
    return static_cast<int>(it - members.begin());
  };
  const bool isRoot = in.self == in.root;
  torch::nn::Sequential whole;
  if (isRoot) whole = buildModel(*in.spec, in.seed, in.dtype);
  std::vector<collectives::P2POp> ops;
  std::vector<std::pair<at::Tensor, at::Tensor>> landed;  // (received on the device, CPU target)
  for (int l = 0; l < layers; ++l) {
    SINEW_ENFORCE(holder[l] >= 0, "no worker of the plan holds layer ", l);
    if (holder[l] == in.self) {
      auto mine = (**in.held)[l - in.heldFirst]->named_parameters(/*recurse=*/true);
      if (isRoot) {
        auto target = (*whole)[l]->named_parameters(/*recurse=*/true);
        at::NoGradGuard noGrad;
        for (const auto& np : mine) target[np.key()].copy_(np.value().detach());
      } else {
        for (const auto& np : mine) {
          ops.push_back(collectives::P2POp::send(np.value().detach().contiguous(), rankOf(in.root),
                                                 kTagGather));
        }
      }
    } else if (isRoot) {
      for (const auto& np : (*whole)[l]->named_parameters(/*recurse=*/true)) {
        // Received on the communicator's device, then copied into the CPU model.
        at::Tensor buf = at::empty(np.value().sizes(), np.value().options().device(in.device));
        ops.push_back(collectives::P2POp::recv(buf, rankOf(holder[l]), kTagGather));
        landed.emplace_back(buf, np.value());
      }
    }
  }
  if (!ops.empty()) collectives::exchangeInChunks(*in.comm, ops, kGatherChunkBytes, in.timeout);
  at::NoGradGuard noGrad;
  for (auto& [buf, target] : landed) target.copy_(buf);
  return whole;
}

torch::nn::Sequential copyModel(const ModelSpec& spec, uint64_t seed, at::ScalarType dtype,
                                const torch::nn::Sequential& trained) {
  torch::nn::Sequential whole = buildModel(spec, seed, dtype);
  at::NoGradGuard noGrad;
  auto target = whole->named_parameters(/*recurse=*/true);
  for (const auto& np : trained->named_parameters(/*recurse=*/true)) {
    target[np.key()].copy_(np.value().detach());
  }
  return whole;
}

}  // namespace runtime
}  // namespace sinew
