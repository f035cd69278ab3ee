// A training program that uses the job's store after training, as programs gather results:
// every worker trains a small model, then worker w waits w x 700 ms and puts "after/<w>" in the
// store, and the job's first member reads every member's key. Under mpirun and srun the store
// is served by the coordinator rank 0 forks, which must stay up until every worker has left.
// Prints "store after training: <n> keys" on the first member; exits with finishJob()'s status
// (1 when the store failed it).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/nn/modules/linear.h>

#include <chrono>
#include <cstdio>
#include <thread>

#include "sinew/init.h"
#include "sinew/model.h"
#include "sinew/store.h"
#include "sinew/trainer.h"

int main(int argc, char** argv) {
  at::set_num_threads(1);
  std::unique_ptr<sinew::Context> ctx;
  try {
    ctx = sinew::init(&argc, &argv);
    sinew::ModelSpec spec;
    spec.layers = {{"fc", [] { return torch::nn::AnyModule(torch::nn::Linear(4, 1)); }}};
    spec.loss = [](const at::Tensor& out, const at::Tensor& y) { return (out - y).pow(2).mean(); };
    spec.optimizer = sinew::adamw(1e-2, 0.01);
    spec.dataset = [](int64_t i) -> sinew::Sample {
      at::Tensor x = at::full({4}, static_cast<float>(i % 7) / 7.0f);
      return {x, x.sum().reshape({1})};
    };
    spec.datasetSize = 1024;
    sinew::TrainerOptions o;
    o.steps = 10;
    o.globalBatch = 8;
    o.dtype = at::kFloat;
    sinew::Trainer trainer(*ctx, spec, o);
    const sinew::TrainResult r = trainer.run();
    const int me = ctx->worker();
    std::this_thread::sleep_for(std::chrono::milliseconds(700 * me));
    ctx->store()->set("after/" + std::to_string(me), sinew::collectives::toBytes("here"));
    if (!r.finalMembers.empty() && r.finalMembers.front() == me) {
      for (int w : r.finalMembers) {
        ctx->store()->get("after/" + std::to_string(w), std::chrono::seconds(10));
      }
      std::printf("store after training: %zu keys\n", r.finalMembers.size());
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "store_after_training: %s\n", e.what());
    return 1;
  }
  return ctx->finishJob();
}
