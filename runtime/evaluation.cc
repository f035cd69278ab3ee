#include "sinew/runtime/evaluation.h"

#include <ATen/ATen.h>

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
        lossSum +=
            pass.loss(layers->forward(x), y).item<double>() * static_cast<double>(pass.microbatch);
      }
    } else if (pass.executor != nullptr) {
      pipeline::StageStep step;
      step.forwardOnly = true;
      step.forward = [&layers](const at::Tensor& x) { return layers->forward(x); };
      step.loss = pass.loss;
      step.data = [&](int64_t m, int64_t begin, int64_t end) {
        return pass.data(indices, m, begin, end);
      };
      step.aroundExchange = pass.aroundExchange;
      step.timeout = pass.timeout;
      lossSum += pass.executor->run(step).lossSum;
    }
  }
  return lossSum;
}

}  // namespace runtime
}  // namespace sinew
