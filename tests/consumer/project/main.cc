// A program outside the Sinew tree that uses the installed package: only the public headers
// of include/sinew/ (docs/api.md).
#include <sinew/communicator.h>
#include <sinew/config.h>
#include <sinew/error.h>
#include <sinew/init.h>
#include <sinew/model.h>
#include <sinew/store.h>
#include <sinew/trainer.h>

#include <ATen/ATen.h>
#include <torch/nn/modules/linear.h>

#include <cstdio>
#include <type_traits>

int main() {
  // The lower layer: a store from a factory and a communicator over it.
  std::shared_ptr<sinew::collectives::Store> store = sinew::collectives::makeHashStore();
  auto prefixed = sinew::collectives::makePrefixStore("consumer", store);
  sinew::collectives::CommunicatorOptions o;
  o.members = {7};
  o.self = 7;
  auto comm = sinew::collectives::createGlooCommunicator(prefixed, o);
  at::Tensor t = at::full({4}, 3.0f);
  comm->allreduce(t, sinew::collectives::ReduceOp::kAvg);
  try {
    comm->broadcast(t, 5);
    return 1;
  } catch (const sinew::InvalidArgument&) {
  }
  static_assert(std::is_base_of<sinew::Error, sinew::Expelled>::value, "one error family");
  // The global batch is a function of (seed, step).
  auto batch = sinew::globalBatchIndices(3, 7, 16, 1000);
  if (batch != sinew::globalBatchIndices(3, 7, 16, 1000) || batch.size() != 16) return 2;
  // The trainer: a job of one worker (no launcher: an in-process coordinator), two steps.
  auto ctx = sinew::init(nullptr, nullptr);
  sinew::ModelSpec spec;
  spec.layers.push_back({"fc", [] { return torch::nn::AnyModule(torch::nn::Linear(2, 1)); }});
  spec.loss = [](const at::Tensor& y, const at::Tensor& target) {
    return (y - target).pow(2).mean();
  };
  spec.optimizer = sinew::sgd(0.1);
  spec.dataset = [](int64_t i) {
    double x = static_cast<double>(i % 10) / 10;
    return sinew::Sample{at::full({2}, x, at::kDouble), at::full({1}, 2 * x, at::kDouble)};
  };
  spec.datasetSize = 100;
  sinew::TrainerOptions to;
  to.globalBatch = 4;
  to.microbatch = 2;
  to.steps = 2;
  to.progressEvery = 0;
  sinew::Trainer trainer(*ctx, spec, to);
  sinew::TrainResult r = trainer.run();
  if (r.steps != 2 || ctx->launchMode() != "single") return 3;
  std::printf("consumer ok: allreduce=%g version=%d.%d nccl=%d steps=%lld\n", t[0].item<float>(),
              SINEW_VERSION_MAJOR, SINEW_VERSION_MINOR, SINEW_WITH_NCCL,
              static_cast<long long>(r.steps));
  return 0;
}
