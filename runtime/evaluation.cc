#include "sinew/runtime/evaluation.h"

#include <ATen/ATen.h>

#include "sinew/base/error.h"
#include "sinew/runtime/layer_calls.h"
#include "sinew/runtime/mixed_precision.h"

namespace sinew {
namespace runtime {

double localEvaluationLossSum(const EvaluationPass& pass, int64_t count) {
  at::NoGradGuard noGrad;
  torch::nn::Sequential& layers = *pass.layers;
  layers->eval();
  struct BackToTraining {
    torch::nn::Sequential& layers;
    ~BackToTraining() { layers->train(); }
  } backToTraining{layers};
  double lossSum = 0;
  for (int64_t b = 0; b < count / pass.globalBatch; ++b) {
    std::vector<int64_t> indices(static_cast<size_t>(pass.globalBatch));
    for (int64_t j = 0; j < pass.globalBatch; ++j) indices[j] = b * pass.globalBatch + j;
    if (!pass.pipelineMode) {
      for (int64_t m : pass.microbatches) {
        auto [x, y] = pass.data(indices, m, 0, -1);
        AutocastScope autocast(pass.device, pass.computeDtype);
        at::Tensor out = runLayers(layers, x).single("the model's output (its last layer's)");
        lossSum += pass.loss(out, y).item<double>() * static_cast<double>(pass.microbatch);
        if (pass.outputs) {
          pass.outputs->emplace_back(b * pass.globalBatch + m * pass.microbatch, out.detach());
        }
      }
    } else if (pass.executor != nullptr) {
      pipeline::StageStep step;
      step.forwardOnly = true;
      step.forward = [&](const pipeline::Activation& x) {
        AutocastScope autocast(pass.device, pass.computeDtype);
        return runLayers(layers, x);
      };
      // The last stage asks for a microbatch's targets just before its loss: the outputs the
      // loss gets are of the microbatch data() was last asked for.
      int64_t lastMicrobatch = -1;
      const int64_t sliceBegin = pass.executor->sliceBegin();
      step.loss = [&](const at::Tensor& out, const at::Tensor& target) {
        if (pass.outputs) {
          pass.outputs->emplace_back(
              b * pass.globalBatch + lastMicrobatch * pass.microbatch + sliceBegin, out.detach());
        }
        AutocastScope autocast(pass.device, pass.computeDtype);
        return pass.loss(out, target);
      };
      step.data = [&](int64_t m, int64_t begin, int64_t end) {
        lastMicrobatch = m;
        return pass.data(indices, m, begin, end);
      };
      step.aroundExchange = pass.aroundExchange;
      step.timeout = pass.timeout;
      lossSum += pass.executor->run(step).lossSum;
    }
  }
  return lossSum;
}

at::Tensor combineEvaluationOutputs(
    const std::vector<std::pair<int64_t, at::Tensor>>& pieces, int64_t count,
    collectives::Communicator& comm, at::Device device, std::chrono::milliseconds timeout,
    const std::function<void(const std::function<void()>&)>& around) {
  constexpr int kMaxDims = pipeline::StageExecutor::kMaxDims;
  // dtype code + 1 (0: nothing announced), dimensions of one sample's output, its sizes.
  at::Tensor header = at::zeros({2 + kMaxDims}, at::kLong);
  for (const auto& [first, rows] : pieces) {
    if (rows.dim() < 1 || rows.dim() > kMaxDims) {
      SINEW_THROW(InvalidArgument, "Trainer::evaluate: the model's output has ", rows.dim(),
                  " dimensions; outputs are kept with 1 to ", kMaxDims);
    }
    if (first != 0) continue;
    auto a = header.accessor<int64_t, 1>();
    a[0] = static_cast<int64_t>(rows.scalar_type()) + 1;
    a[1] = rows.dim() - 1;
    for (int64_t d = 1; d < rows.dim(); ++d) a[1 + d] = rows.size(d);
  }
  at::Tensor h = header.to(device);
  around([&] { comm.allreduce(h, collectives::ReduceOp::kSum, timeout); });
  h = h.cpu();
  auto a = h.accessor<int64_t, 1>();
  const int64_t type = a[0] - 1, dims = a[1];
  if (type < 0 || type >= static_cast<int64_t>(at::ScalarType::NumOptions) || dims < 0 ||
      dims >= kMaxDims) {
    SINEW_THROW(Corruption, "Trainer::evaluate: the outputs' announced dtype code ", type, " and ",
                dims, " dimensions are malformed");
  }
  std::vector<int64_t> shape{count};
  for (int64_t d = 0; d < dims; ++d) shape.push_back(a[2 + d]);
  at::Tensor all =
      at::zeros(shape, at::TensorOptions().dtype(static_cast<at::ScalarType>(type)).device(device));
  for (const auto& [first, rows] : pieces) {
    if (rows.sizes().slice(1) != all.sizes().slice(1) || first + rows.size(0) > count) {
      SINEW_THROW(InvalidArgument, "Trainer::evaluate: outputs of samples from ", first,
                  " have shape ", rows.sizes(), ", unlike sample 0's ", all.sizes().slice(1),
                  ": outputs are kept only when every sample's has one shape");
    }
    all.narrow(0, first, rows.size(0)).copy_(rows);
  }
  around([&] { comm.allreduce(all, collectives::ReduceOp::kSum, timeout); });
  return all.cpu();
}

}  // namespace runtime
}  // namespace sinew
