// The stage executor in one process: workers are threads with Gloo communicators over an
// in-memory store. Each test runs one 1F1B step of a two-stage pipeline over 3 microbatches
// and compares the loss and every parameter gradient with a single-process forward and
// backward of the whole model over the same samples.

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <chrono>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "sinew/collectives/hash_store.h"
#include "sinew/communicator.h"
#include "sinew/pipeline/stage_executor.h"

namespace sinew {
namespace pipeline {
namespace {

using namespace std::chrono_literals;

constexpr int64_t kMicrobatch = 4;
constexpr int64_t kMicrobatches = 3;
constexpr int64_t kGlobalBatch = kMicrobatch * kMicrobatches;

// Layer 0: tanh(x W0^T + b0), 4 -> 8; layer 1: x W1^T + b1, 8 -> 3. Loss: mean squared error.
struct Model {
  std::vector<at::Tensor> params;  // W0, b0, W1, b1

  static Model make() {
    at::manual_seed(7);
    Model m;
    for (auto sizes : std::vector<std::vector<int64_t>>{{8, 4}, {8}, {3, 8}, {3}}) {
      m.params.push_back(at::randn(sizes, at::kDouble).requires_grad_(true));
    }
    return m;
  }
  Model clone() const {
    Model m;
    for (const auto& p : params) m.params.push_back(p.detach().clone().requires_grad_(true));
    return m;
  }
  at::Tensor layer0(const at::Tensor& x) const {
    return at::tanh(at::linear(x, params[0], params[1]));
  }
  at::Tensor layer1(const at::Tensor& x) const { return at::linear(x, params[2], params[3]); }
};

at::Tensor loss(const at::Tensor& y, const at::Tensor& t) { return (y - t).pow(2).mean(); }

struct Data {
  at::Tensor x, y;  // kGlobalBatch samples
  Data() {
    at::manual_seed(11);
    x = at::randn({kGlobalBatch, 4}, at::kDouble);
    y = at::randn({kGlobalBatch, 3}, at::kDouble);
  }
  std::pair<at::Tensor, at::Tensor> slice(int64_t m, int64_t begin, int64_t end) const {
    return {x.narrow(0, m * kMicrobatch + begin, end - begin),
            y.narrow(0, m * kMicrobatch + begin, end - begin)};
  }
};

// One pipeline whose stage 0 is `widths[0]` workers wide and stage 1 `widths[1]`; worker ids in
// order of stage, then device; every worker runs all 3 microbatches.
Plan twoStagePlan(int width0, int width1) {
  Plan plan;
  plan.epoch = 1;
  plan.numLayers = 2;
  plan.microbatchesPerStep = kMicrobatches;
  plan.pipelines.push_back({2, {0, 1}, kMicrobatches, 0});
  int worker = 0;
  for (int stage = 0; stage < 2; ++stage) {
    for (int d = 0; d < (stage == 0 ? width0 : width1); ++d) {
      WorkerAssignment w;
      w.worker = worker++;
      w.node = stage;
      w.device = d;
      w.pipeline = 0;
      w.stage = stage;
      w.firstLayer = stage;
      w.endLayer = stage + 1;
      w.microbatches = {0, 1, 2};
      plan.workers.push_back(w);
    }
  }
  return plan;
}

// Runs body(worker, communicator) on one thread per worker 0..n-1, each with a Gloo
// communicator of all of them (point to point on lanes, as the trainer's), and rethrows the
// first worker's error.
void onThreads(int n, const std::function<void(int, collectives::Communicator&)>& body) {
  std::vector<int> members;
  for (int w = 0; w < n; ++w) members.push_back(w);
  auto store = std::make_shared<collectives::HashStore>();
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (int w = 0; w < n; ++w) {
    threads.emplace_back([&, w] {
      try {
        collectives::CommunicatorOptions co;
        co.members = members;
        co.self = w;
        co.epoch = 1;
        co.name = "pp";
        co.timeout = 30s;
        co.initTimeout = 30s;
        auto comm = collectives::createGlooCommunicator(store, co);
        body(w, *comm);
      } catch (...) {
        errors[w] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

struct WorkerOutcome {
  Model model;
  StageStepResult result;
  int exchanges = 0;
  bool firstBackwardHookRan = false;
};

// Runs one step of `plan` with one thread per worker; returns each worker's outcome.
std::vector<WorkerOutcome> runStep(const Plan& plan, const Model& start, const Data& data,
                                   bool forwardOnly = false) {
  std::vector<WorkerOutcome> out(plan.workers.size());
  onThreads(static_cast<int>(plan.workers.size()), [&](int w, collectives::Communicator& comm) {
    WorkerOutcome& o = out[w];
    o.model = start.clone();
    const int layer = plan.workers[w].firstLayer;
    StageExecutorOptions eo;
    eo.microbatch = kMicrobatch;
    eo.globalBatch = kGlobalBatch;
    eo.lastLayerName = "layer" + std::to_string(layer);
    StageExecutor executor(plan, w, comm, eo);
    StageStep step;
    step.forward = [&o, layer](const Activation& a) -> Activation {
      const at::Tensor& x = a.tensors[0];
      return layer == 0 ? o.model.layer0(x) : o.model.layer1(x);
    };
    step.loss = loss;
    step.data = [&data](int64_t m, int64_t b, int64_t e) { return data.slice(m, b, e); };
    step.timeout = 30s;
    step.aroundExchange = [&o](const std::function<void()>& transfer) {
      o.exchanges++;
      transfer();
    };
    step.beforeFirstBackward = [&o] { o.firstBackwardHookRan = true; };
    step.forwardOnly = forwardOnly;
    o.result = executor.run(step);
  });
  return out;
}

// The reference: the whole model, one process, the same microbatches and loss scaling.
struct Reference {
  Model model;
  double lossSum = 0;
};
Reference reference(const Model& start, const Data& data) {
  Reference r{start.clone()};
  for (int64_t m = 0; m < kMicrobatches; ++m) {
    auto [x, y] = data.slice(m, 0, kMicrobatch);
    at::Tensor l = loss(r.model.layer1(r.model.layer0(x)), y);
    (l * (static_cast<double>(kMicrobatch) / kGlobalBatch)).backward();
    r.lossSum += l.item<double>() * kMicrobatch;
  }
  return r;
}

class StageExecutorTest : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(StageExecutorTest, OneStepEqualsASingleProcessForwardAndBackward) {
  const auto [width0, width1] = GetParam();
  const Model start = Model::make();
  const Data data;
  const Plan plan = twoStagePlan(width0, width1);
  std::vector<WorkerOutcome> out = runStep(plan, start, data);
  Reference ref = reference(start, data);

  // The loss: the last stage's workers together hold the sum over the global batch; the first
  // stage's report none.
  double lossSum = 0;
  for (int w = 0; w < width0 + width1; ++w) {
    if (w < width0) {
      EXPECT_EQ(out[w].result.lossSum, 0) << "worker " << w;
    }
    lossSum += out[w].result.lossSum;
    EXPECT_TRUE(out[w].firstBackwardHookRan) << "worker " << w;
    EXPECT_GT(out[w].exchanges, 0) << "worker " << w;
  }
  EXPECT_NEAR(lossSum, ref.lossSum, 1e-12 * std::abs(ref.lossSum));

  // Each stage's parameter gradients, summed over the stage's workers (each ran its slice of
  // every microbatch), are the reference's; the layers a worker does not hold got none.
  for (int stage = 0; stage < 2; ++stage) {
    for (int p = 2 * stage; p < 2 * stage + 2; ++p) {
      at::Tensor sum = at::zeros_like(ref.model.params[p]);
      for (const auto& w : plan.workers) {
        const at::Tensor& g = out[w.worker].model.params[p].grad();
        if (w.stage != stage) {
          EXPECT_FALSE(g.defined()) << "worker " << w.worker << " param " << p;
          continue;
        }
        ASSERT_TRUE(g.defined()) << "worker " << w.worker << " param " << p;
        sum += g;
      }
      EXPECT_TRUE(at::allclose(sum, ref.model.params[p].grad(), 1e-12, 1e-12))
          << "param " << p << ": " << (sum - ref.model.params[p].grad()).abs().max().item<double>();
    }
  }
}

// Evaluation: forwards only give the single-process loss, and no worker's layers get a
// gradient or run a backward.
TEST_P(StageExecutorTest, ForwardOnlyGivesTheLossAndNoGradients) {
  const auto [width0, width1] = GetParam();
  const Model start = Model::make();
  const Data data;
  std::vector<WorkerOutcome> out =
      runStep(twoStagePlan(width0, width1), start, data, /*forwardOnly=*/true);
  Reference ref = reference(start, data);
  double lossSum = 0;
  for (const auto& o : out) {
    lossSum += o.result.lossSum;
    EXPECT_FALSE(o.firstBackwardHookRan);
    for (const auto& p : o.model.params) EXPECT_FALSE(p.grad().defined());
  }
  EXPECT_NEAR(lossSum, ref.lossSum, 1e-12 * std::abs(ref.lossSum));
}

INSTANTIATE_TEST_SUITE_P(Widths, StageExecutorTest,
                         ::testing::Values(std::make_pair(1, 1), std::make_pair(2, 1),
                                           std::make_pair(1, 2)),
                         [](const auto& info) {
                           return "stage0x" + std::to_string(info.param.first) + "_stage1x" +
                                  std::to_string(info.param.second);
                         });

// The schedule is 1F1B: with 2 stages and 3 microbatches, stage 0 runs one warm-up forward,
// and the order of its forwards (F) and backwards (B) is F F B F B B; stage 1 alternates F B.
TEST(StageExecutorScheduleTest, RunsOneForwardOneBackward) {
  const Model start = Model::make();
  const Data data;
  const Plan plan = twoStagePlan(1, 1);
  std::vector<std::string> order(2);
  onThreads(2, [&](int w, collectives::Communicator& comm) {
    Model model = start.clone();
    StageExecutorOptions eo;
    eo.microbatch = kMicrobatch;
    eo.globalBatch = kGlobalBatch;
    StageExecutor executor(plan, w, comm, eo);
    StageStep step;
    // A hook on the stage's output's gradient marks each backward.
    step.forward = [&, w](const Activation& a) -> Activation {
      const at::Tensor& x = a.tensors[0];
      order[w] += "F";
      at::Tensor y = w == 0 ? model.layer0(x) : model.layer1(x);
      y.register_hook([&order, w](const at::Tensor& g) {
        order[w] += "B";
        return g;
      });
      return y;
    };
    step.loss = loss;
    step.data = [&data](int64_t m, int64_t b, int64_t e) { return data.slice(m, b, e); };
    executor.run(step);
  });
  EXPECT_EQ(order[0], "FFBFBB");
  EXPECT_EQ(order[1], "FBFBFB");
}

// Activations of several tensors: stage 0 outputs a list of the hidden state and an integer
// mask, with a third tensor for microbatch 1 and a narrower hidden state for microbatch 2 (so
// the layouts change between microbatches and are sent again). Stage 1 gets the same list,
// the gradients of both floating-point tensors come back, and the loss and gradients are the
// single-process ones, for every combination of stage widths.
Activation listLayer0(const Model& m, const at::Tensor& x, int64_t microbatch) {
  at::Tensor h = m.layer0(x);
  at::Tensor mask = (x.select(1, 0) > 0).to(at::kLong);
  if (microbatch == 1) return Activation::ofList({h, mask, h * h});
  if (microbatch == 2) return Activation::ofList({h.narrow(1, 0, 6), mask});
  return Activation::ofList({h, mask});
}

at::Tensor listLayer1(const Model& m, const Activation& a) {
  EXPECT_TRUE(a.list);
  const at::Tensor& h = a.tensors.at(0);
  const at::Tensor& mask = a.tensors.at(1);
  EXPECT_EQ(mask.scalar_type(), at::kLong);
  at::Tensor y = at::linear(h, m.params[2].narrow(1, 0, h.size(1)), m.params[3]);
  if (a.tensors.size() == 3) y = y + 0.5 * at::linear(a.tensors[2], m.params[2], m.params[3]);
  return y * (1 + mask.unsqueeze(1).to(y.scalar_type()));
}

class StageExecutorListTest : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(StageExecutorListTest, ActivationsOfSeveralTensorsAndTheirGradientsCrossTheStages) {
  const auto [width0, width1] = GetParam();
  const Model start = Model::make();
  const Data data;
  const Plan plan = twoStagePlan(width0, width1);
  std::vector<Model> models(plan.workers.size());
  std::vector<double> lossSums(plan.workers.size());
  onThreads(static_cast<int>(plan.workers.size()), [&](int w, collectives::Communicator& comm) {
    Model& m = models[w];
    m = start.clone();
    StageExecutorOptions eo;
    eo.microbatch = kMicrobatch;
    eo.globalBatch = kGlobalBatch;
    StageExecutor executor(plan, w, comm, eo);
    int64_t forwards = 0;  // Forwards run in microbatch order.
    StageStep step;
    step.forward = [&](const Activation& a) -> Activation {
      const int64_t microbatch = forwards++;
      if (executor.stage() == 0) return listLayer0(m, a.single("input"), microbatch);
      return listLayer1(m, a);
    };
    step.loss = loss;
    step.data = [&data](int64_t mb, int64_t b, int64_t e) { return data.slice(mb, b, e); };
    step.timeout = 30s;
    lossSums[w] = executor.run(step).lossSum;
  });
  Model ref = start.clone();
  double refLoss = 0;
  for (int64_t mb = 0; mb < kMicrobatches; ++mb) {
    auto [x, y] = data.slice(mb, 0, kMicrobatch);
    at::Tensor l = loss(listLayer1(ref, listLayer0(ref, x, mb)), y);
    (l * (static_cast<double>(kMicrobatch) / kGlobalBatch)).backward();
    refLoss += l.item<double>() * kMicrobatch;
  }
  double lossSum = 0;
  for (double l : lossSums) lossSum += l;
  EXPECT_NEAR(lossSum, refLoss, 1e-12 * std::abs(refLoss));
  for (int p = 0; p < 4; ++p) {
    at::Tensor sum = at::zeros_like(ref.params[p]);
    for (const auto& w : plan.workers) {
      if (w.stage == p / 2) sum += models[w.worker].params[p].grad();
    }
    EXPECT_TRUE(at::allclose(sum, ref.params[p].grad(), 1e-12, 1e-12))
        << "param " << p << ": " << (sum - ref.params[p].grad()).abs().max().item<double>();
  }
}

INSTANTIATE_TEST_SUITE_P(Widths, StageExecutorListTest,
                         ::testing::Values(std::make_pair(1, 1), std::make_pair(2, 1),
                                           std::make_pair(1, 2), std::make_pair(2, 2)),
                         [](const auto& info) {
                           return "stage0x" + std::to_string(info.param.first) + "_stage1x" +
                                  std::to_string(info.param.second);
                         });

// The last stage's output must be one tensor (the loss's input): a list is refused naming the
// layer, on every worker of the step, rather than handed to the loss.
TEST(StageExecutorScheduleTest, RefusesAListAsTheModelsOutput) {
  const Plan plan = twoStagePlan(1, 1);
  const Data data;
  const Model start = Model::make();
  std::string refusal = "none";
  onThreads(2, [&](int w, collectives::Communicator& comm) {
    Model m = start.clone();
    StageExecutorOptions eo;
    eo.microbatch = kMicrobatch;
    eo.globalBatch = kGlobalBatch;
    eo.lastLayerName = w == 0 ? "layer0" : "head";
    StageExecutor executor(plan, w, comm, eo);
    StageStep step;
    step.forward = [&](const Activation& a) -> Activation {
      if (w == 0) return m.layer0(a.single("input"));
      return Activation::ofList({m.layer1(a.single("input"))});
    };
    step.loss = loss;
    step.data = [&data](int64_t mb, int64_t b, int64_t e) { return data.slice(mb, b, e); };
    step.timeout = 3s;
    try {
      executor.run(step);
    } catch (const InvalidArgument& e) {
      if (w == 1) refusal = e.what();
    } catch (const std::exception&) {
      // Worker 0 loses its neighbour.
    }
  });
  EXPECT_NE(refusal.find("layer 'head'"), std::string::npos) << refusal;
  EXPECT_NE(refusal.find("the loss takes one tensor"), std::string::npos) << refusal;
}

// A worker whose communicator lacks a neighbouring stage's worker is refused by name.
TEST(StageExecutorScheduleTest, RefusesACommunicatorWithoutTheNeighbours) {
  const Plan plan = twoStagePlan(1, 1);
  auto store = std::make_shared<collectives::HashStore>();
  collectives::CommunicatorOptions co;
  co.members = {0};
  co.self = 0;
  co.epoch = 1;
  auto comm = collectives::createGlooCommunicator(store, co);
  StageExecutorOptions eo;
  eo.microbatch = kMicrobatch;
  eo.globalBatch = kGlobalBatch;
  std::string refusal = "none";
  try {
    StageExecutor executor(plan, 0, *comm, eo);
  } catch (const InvalidArgument& e) {
    refusal = e.what();
  }
  EXPECT_NE(refusal.find("worker 1 of stage 1"), std::string::npos) << refusal;
}

}  // namespace
}  // namespace pipeline
}  // namespace sinew
