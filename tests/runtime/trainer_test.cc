// The trainer in a job of one worker (sinew::init() with no launcher: an in-process
// coordinator): errors of its background checkpoint flush reach Trainer::run()'s caller as
// the exception itself, not as a string in a log.

#include <gtest/gtest.h>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/lbfgs.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "../checkpoint/fault_env.h"
#include "../fs_support.h"
#include "sinew/checkpoint_reader.h"
#include "sinew/error.h"
#include "sinew/init.h"
#include "sinew/runtime/context_state.h"
#include "sinew/trainer.h"

namespace sinew {
namespace {

std::string tempDir() {
  std::string tmpl = "/tmp/sinew-trainer-XXXXXX";
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  const char* d = mkdtemp(buf.data());
  if (d == nullptr) throw std::runtime_error("mkdtemp failed");
  return d;
}

ModelSpec tinyModel() {
  ModelSpec spec;
  spec.layers.push_back({"fc", [] { return torch::nn::AnyModule(torch::nn::Linear(2, 1)); }});
  spec.loss = [](const at::Tensor& y, const at::Tensor& t) { return (y - t).pow(2).mean(); };
  spec.optimizer = sgd(0.1);
  spec.dataset = [](int64_t i) {
    double x = static_cast<double>(i % 10) / 10;
    return Sample{at::full({2}, x, at::kDouble), at::full({1}, 2 * x, at::kDouble)};
  };
  spec.datasetSize = 100;
  return spec;
}

TrainerOptions tinyOptions() {
  TrainerOptions o;
  o.dtype = at::kDouble;  // These tests assert values to 1e-12.
  o.globalBatch = 4;
  o.microbatch = 2;
  o.steps = 3;
  o.progressEvery = 0;
  return o;
}

TEST(TrainerTest, AFailingCheckpointDiskSurfacesAsIoErrorFromRun) {
  const std::string dir = tempDir();
  checkpoint::testing::FaultEnv env;
  auto ctx = init(nullptr, nullptr);
  runtime::ContextAccess::state(*ctx).checkpointEnv = &env;
  TrainerOptions o = tinyOptions();
  o.checkpointDir = dir;
  o.checkpointEvery = 1;
  Trainer trainer(*ctx, tinyModel(), o);
  env.failAfter(1);  // The writer creates the folder; every write after that fails.
  try {
    trainer.run();
    ADD_FAILURE() << "run() returned although no checkpoint could be written";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("injected failure"), std::string::npos) << e.what();
  }
  sinew::testing::removeTree(dir);
}

TEST(TrainerTest, BadOptionsAreInvalidArgumentsNamingTheOption) {
  auto ctx = init(nullptr, nullptr);
  TrainerOptions o = tinyOptions();
  o.microbatch = 3;
  try {
    Trainer trainer(*ctx, tinyModel(), o);
    ADD_FAILURE() << "accepted a microbatch that does not divide the global batch";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("TrainerOptions::microbatch = 3"), std::string::npos)
        << e.what();
  }
  ModelSpec noLayers = tinyModel();
  noLayers.layers.clear();
  EXPECT_THROW(Trainer(*ctx, noLayers, tinyOptions()), InvalidArgument);
}

// Making a trainer with `o` throws InvalidArgument whose message contains `says`.
void expectRefused(Context& ctx, const TrainerOptions& o, const std::string& says) {
  try {
    Trainer trainer(ctx, tinyModel(), o);
    ADD_FAILURE() << "accepted options that should fail with: " << says;
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
  }
}

// A measured profile's node size: in [1, 4096], and no wider than a microbatch (a stage as
// wide as a node gives each of its workers a share of every microbatch).
TEST(TrainerTest, DevicesPerNodeIsCheckedBeforeAnyProfiling) {
  auto ctx = init(nullptr, nullptr);
  auto refused = [&](int g, const std::string& says) {
    TrainerOptions o = tinyOptions();
    o.parallelism = Parallelism::kPipeline;
    o.devicesPerNode = g;
    expectRefused(*ctx, o, says);
  };
  refused(0, "TrainerOptions::devicesPerNode = 0 must be in [1, 4096]");
  refused(5000, "TrainerOptions::devicesPerNode = 5000 must be in [1, 4096]");
  refused(3, "TrainerOptions::devicesPerNode = 3 is more than microbatch = 2");
  TrainerOptions o = tinyOptions();
  o.parallelism = Parallelism::kPipeline;
  o.devicesPerNode = 2;
  EXPECT_NO_THROW(Trainer(*ctx, tinyModel(), o));
}

// The pipeline communicator's lane socket buffers come from SINEW_GLOO_LANE_SOCKET_BUFFER_BYTES
// (the Gloo backend's knob, not a TrainerOptions field): a value that is no count of bytes in
// [0, 2^30] is refused when the trainer is made, naming the variable and the value.
TEST(TrainerTest, BadLaneSocketBufferVariableIsRefused) {
  auto ctx = init(nullptr, nullptr);
  for (const char* bad : {"-1", "1073741825", "4M", ""}) {
    ::setenv("SINEW_GLOO_LANE_SOCKET_BUFFER_BYTES", bad, 1);
    TrainerOptions o = tinyOptions();
    o.parallelism = Parallelism::kPipeline;
    expectRefused(*ctx, o,
                  std::string("SINEW_GLOO_LANE_SOCKET_BUFFER_BYTES = '") + bad +
                      "' is not a count of bytes in [0, 1073741824]");
  }
  ::setenv("SINEW_GLOO_LANE_SOCKET_BUFFER_BYTES", "0", 1);
  TrainerOptions o = tinyOptions();
  o.parallelism = Parallelism::kPipeline;
  EXPECT_NO_THROW(Trainer(*ctx, tinyModel(), o));
  ::unsetenv("SINEW_GLOO_LANE_SOCKET_BUFFER_BYTES");
}

// A model of three layers (one without parameters) whose gradients are large enough for
// clipping at 0.5 to act, in float64.
ModelSpec recipeModel() {
  ModelSpec spec;
  spec.layers.push_back({"fc1", [] { return torch::nn::AnyModule(torch::nn::Linear(3, 8)); }});
  spec.layers.push_back({"act", [] { return torch::nn::AnyModule(torch::nn::Tanh()); }});
  spec.layers.push_back({"fc2", [] { return torch::nn::AnyModule(torch::nn::Linear(8, 1)); }});
  spec.loss = [](const at::Tensor& y, const at::Tensor& t) { return (y - t).pow(2).mean(); };
  spec.optimizer = adamw(0.05, 0.1);
  spec.dataset = [](int64_t i) {
    const double x = static_cast<double>(i % 17) / 4;
    return Sample{at::tensor({x, -x, 1.0}, at::kDouble), at::full({1}, 3 * x + 2, at::kDouble)};
  };
  spec.datasetSize = 64;
  return spec;
}

// tinyOptions() with global batches of 8 in microbatches of 4, for `steps` steps.
// Step s's global batch, stacked as one microbatch: inputs, targets and each extra input.
struct StepBatch {
  at::Tensor x, y;
  std::vector<at::Tensor> extra;
};
StepBatch stepBatch(const ModelSpec& spec, const TrainerOptions& o, int64_t s) {
  std::vector<at::Tensor> xs, ys;
  std::vector<std::vector<at::Tensor>> extras;
  for (int64_t i : globalBatchIndices(o.seed, s, o.globalBatch, spec.datasetSize)) {
    Sample smp = spec.dataset(i);
    xs.push_back(smp.input);
    ys.push_back(smp.target);
    extras.resize(smp.extraInputs.size());
    for (size_t k = 0; k < extras.size(); ++k) extras[k].push_back(smp.extraInputs[k]);
  }
  StepBatch b{at::stack(xs), at::stack(ys), {}};
  for (const auto& e : extras) b.extra.push_back(at::stack(e));
  return b;
}

TrainerOptions recipeOptions(int64_t steps) {
  TrainerOptions o = tinyOptions();
  o.steps = steps;
  o.globalBatch = 8;
  o.microbatch = 4;
  return o;
}

// The step API: a loop of step() with AdamW, warm-up + cosine and clipping gives, step by
// step, the loss, rate and gradient norm of the same recipe in plain libtorch, and the same
// parameters at the end; then done, and finish() reports the steps.
TEST(TrainerTest, AStepLoopTrainsAsPlainLibtorchDoesWithScheduleAndClipping) {
  auto ctx = init(nullptr, nullptr);
  TrainerOptions o = recipeOptions(12);
  o.seed = 3;
  o.lrSchedule = warmupCosine(0.05, 3, 12, 0.005);
  o.clipGradNorm = 0.5;
  const ModelSpec spec = recipeModel();
  Trainer trainer(*ctx, spec, o);

  torch::nn::Sequential ref = buildModel(spec, o.seed, o.dtype);
  auto opt = spec.optimizer(ref->parameters());
  int clipped = 0;
  for (int64_t s = 0; s < o.steps; ++s) {
    ASSERT_EQ(trainer.nextStep(), s);
    StepResult r = trainer.step();
    ASSERT_FALSE(r.done);
    EXPECT_EQ(r.step, s);
    EXPECT_EQ(r.nextStep, s + 1);
    EXPECT_EQ(r.recoveries, 0);
    EXPECT_EQ(r.rolledBackTo, -1);
    // The same step in one process.
    const StepBatch batch = stepBatch(spec, o, s);
    opt->zero_grad();
    at::Tensor loss = spec.loss(ref->forward(batch.x), batch.y);
    loss.backward();
    const double norm = torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.5);
    clipped += norm > 0.5;
    const double lr = o.lrSchedule(s);
    for (auto& g : opt->param_groups()) g.options().set_lr(lr);
    opt->step();
    EXPECT_NEAR(r.loss, loss.item<double>(), 1e-12 * std::abs(loss.item<double>())) << s;
    EXPECT_DOUBLE_EQ(r.learningRate, lr) << s;
    EXPECT_NEAR(r.gradNorm, norm, 1e-12 * norm) << s;
  }
  EXPECT_GT(clipped, 3) << "clipping at 0.5 never acted: the test could not tell it apart";
  // Evaluation of a held-out split: the reference's mean loss over the same samples.
  Dataset heldOut = [&spec](int64_t i) { return spec.dataset(spec.datasetSize + 5 + i); };
  EvalResult e = trainer.evaluate(heldOut, 16);
  std::vector<at::Tensor> xs, ys;
  for (int64_t i = 0; i < 16; ++i) {
    xs.push_back(heldOut(i).input);
    ys.push_back(heldOut(i).target);
  }
  const double refEval = spec.loss(ref->forward(at::stack(xs)), at::stack(ys)).item<double>();
  EXPECT_FALSE(e.done);
  EXPECT_EQ(e.samples, 16);
  EXPECT_EQ(e.afterStep, o.steps - 1);
  EXPECT_NEAR(e.loss, refEval, 1e-10 * refEval);
  EXPECT_FALSE(e.outputs.defined());
  // With the outputs: the reference's outputs for the same samples, in sample order.
  EvalResult withOutputs = trainer.evaluate(heldOut, 16, /*keepOutputs=*/true);
  ASSERT_TRUE(withOutputs.outputs.defined());
  at::Tensor refOut = ref->forward(at::stack(xs)).detach();
  ASSERT_EQ(withOutputs.outputs.sizes(), refOut.sizes());
  EXPECT_LT((withOutputs.outputs - refOut).abs().max().item<double>(), 1e-12);
  EXPECT_EQ(withOutputs.loss, e.loss);
  EXPECT_THROW(trainer.evaluate(heldOut, 12), InvalidArgument);  // not whole global batches
  StepResult last = trainer.step();
  EXPECT_TRUE(last.done);
  // The model out of the job (one worker: its own layers, as a new CPU model).
  torch::nn::Sequential whole = trainer.gatherModel();
  ASSERT_EQ(whole->size(), 3u);
  auto gathered = whole->named_parameters();
  for (const auto& p : trainer.model()->named_parameters()) {
    EXPECT_TRUE(at::equal(p.value(), gathered[p.key()])) << p.key();
    EXPECT_NE(p.value().data_ptr(), gathered[p.key()].data_ptr()) << "not a copy";
  }
  EXPECT_EQ(last.nextStep, o.steps);
  TrainResult result = trainer.finish();
  EXPECT_EQ(result.steps, o.steps);
  EXPECT_FALSE(result.preempted);
  auto mine = trainer.model()->named_parameters(), theirs = ref->named_parameters();
  ASSERT_EQ(mine.size(), theirs.size());
  for (const auto& p : mine) {
    EXPECT_TRUE(at::allclose(p.value(), theirs[p.key()], 1e-10, 1e-12)) << p.key();
  }
}

// A frozen layer (requires_grad false, as a frozen base under a trainable head) is neither
// reduced nor stepped: under AdamW with weight decay it keeps its initial values, and the
// trainable layers train as plain libtorch trains them.
TEST(TrainerTest, FrozenParametersAreNeitherReducedNorStepped) {
  auto ctx = init(nullptr, nullptr);
  TrainerOptions o = recipeOptions(6);
  ModelSpec spec = recipeModel();
  spec.layers[0].build = [] {
    torch::nn::Linear frozen(3, 8);
    for (auto& p : frozen->parameters()) p.set_requires_grad(false);
    return torch::nn::AnyModule(frozen);
  };
  Trainer trainer(*ctx, spec, o);
  trainer.run();
  torch::nn::Sequential ref = buildModel(spec, o.seed, o.dtype);
  const auto initial = ref->named_parameters();
  std::map<std::string, at::Tensor> before;
  for (const auto& p : initial) before[p.key()] = p.value().detach().clone();
  auto opt = spec.optimizer(ref->parameters());
  for (int64_t s = 0; s < o.steps; ++s) {
    const StepBatch batch = stepBatch(spec, o, s);
    opt->zero_grad();
    spec.loss(ref->forward(batch.x), batch.y).backward();
    opt->step();
  }
  auto mine = trainer.model()->named_parameters(), theirs = ref->named_parameters();
  for (const auto& p : mine) {
    EXPECT_TRUE(at::allclose(p.value(), theirs[p.key()], 1e-10, 1e-12)) << p.key();
    if (p.key().rfind("fc1.", 0) == 0) {
      EXPECT_TRUE(at::equal(p.value(), before[p.key()])) << p.key() << " moved";
      EXPECT_FALSE(p.value().grad().defined()) << p.key() << " got a gradient";
    }
  }
}

// The model out of a checkpoint: CheckpointReader::loadInto() fills a freshly built model of
// the same spec (its parameter-free "act" layer needs nothing) with the trained parameters;
// a model with a layer the checkpoint lacks is refused, naming it.
TEST(TrainerTest, ACheckpointLoadsIntoAPlainModel) {
  const std::string dir = tempDir();
  auto ctx = init(nullptr, nullptr);
  TrainerOptions o = recipeOptions(4);
  o.checkpointDir = dir;
  o.checkpointEvery = 2;
  const ModelSpec spec = recipeModel();
  Trainer trainer(*ctx, spec, o);
  trainer.run();
  torch::nn::Sequential plain = buildModel(spec, /*seed=*/99, at::kDouble);
  auto reader = CheckpointReader::open(dir);
  EXPECT_EQ(reader->step(), 3);
  EXPECT_EQ(reader->loadInto(*plain), 2);
  auto mine = trainer.model()->named_parameters(), theirs = plain->named_parameters();
  for (const auto& p : mine) EXPECT_TRUE(at::equal(p.value(), theirs[p.key()])) << p.key();
  ModelSpec other = spec;
  other.layers[2].name = "head";
  torch::nn::Sequential wrong = buildModel(other, 1, at::kDouble);
  try {
    reader->loadInto(*wrong);
    ADD_FAILURE() << "a model with a layer the checkpoint lacks was loaded";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("no layer 'head'"), std::string::npos) << e.what();
  }
  sinew::testing::removeTree(dir);
}

// An optimizer whose state cannot be captured, a schedule that goes bad at a later step and a
// clip value <= 0 are refused when the trainer is made, each named.
TEST(TrainerTest, UncapturableOptimizersAndBadRecipesAreRefusedByName) {
  auto ctx = init(nullptr, nullptr);
  ModelSpec lbfgs = tinyModel();
  lbfgs.optimizer = [](std::vector<at::Tensor> ps) {
    return std::make_unique<torch::optim::LBFGS>(std::move(ps), torch::optim::LBFGSOptions(1));
  };
  try {
    Trainer trainer(*ctx, lbfgs, tinyOptions());
    ADD_FAILURE() << "LBFGS was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("ModelSpec::optimizer made torch::optim::LBFGS"),
              std::string::npos)
        << e.what();
  }
  TrainerOptions o = tinyOptions();
  o.lrSchedule = [](int64_t s) { return s < 2 ? 0.1 : -0.1; };
  expectRefused(*ctx, o, "gave learning rate -0.1 for step 2");
  o = tinyOptions();
  o.clipGradNorm = 0.0;
  expectRefused(*ctx, o, "TrainerOptions::clipGradNorm = 0");
}

// A sample whose input disagrees in shape with its microbatch's first sample's is an
// InvalidArgument naming both samples and both shapes, at the step that reads it (not a
// libtorch error from deep inside stack()).
TEST(TrainerTest, ASampleOfAnotherShapeIsRefusedNamingIt) {
  auto ctx = init(nullptr, nullptr);
  ModelSpec spec = tinyModel();
  spec.dataset = [](int64_t i) {
    const int64_t width = i == 37 ? 3 : 2;
    return Sample{at::full({width}, 0.5, at::kDouble), at::full({1}, 1.0, at::kDouble)};
  };
  TrainerOptions o = tinyOptions();
  o.sampling = Sampling::kEpochs;
  o.steps = 100;  // Every sample of the first epoch, sample 37 included.
  Trainer trainer(*ctx, spec, o);
  try {
    trainer.run();
    ADD_FAILURE() << "a sample of another shape was trained on";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("sample 37"), std::string::npos) << what;
    EXPECT_NE(what.find("input of shape ["), std::string::npos) << what;
    EXPECT_NE(what.find("[3]"), std::string::npos) << what;
    EXPECT_NE(what.find("[2]"), std::string::npos) << what;
  }
}

// A layer that takes several tensors: {x, gate} -> W (x * gate), and one that passes a list on.
struct GatedImpl : torch::nn::Module {
  GatedImpl() : lin(register_module("lin", torch::nn::Linear(3, 3))) {}
  std::vector<at::Tensor> forward(const std::vector<at::Tensor>& in) {
    return {lin->forward(in.at(0) * in.at(1)), in.at(1)};
  }
  torch::nn::Linear lin;
};
TORCH_MODULE(Gated);
struct UngateImpl : torch::nn::Module {
  at::Tensor forward(const std::vector<at::Tensor>& in) { return at::tanh(in.at(0)) * in.at(1); }
};
TORCH_MODULE(Ungate);

// Samples with an extra input: x and a gate (1 or 0 per feature). The first layer gets the
// list {x, gate} stacked per microbatch, passes {h, gate} on, and the trained weights equal a
// plain-libtorch loop's.
ModelSpec gatedModel() {
  ModelSpec spec;
  spec.layers.push_back({"gated", [] { return torch::nn::AnyModule(Gated()); }});
  spec.layers.push_back({"ungate", [] { return torch::nn::AnyModule(Ungate()); }});
  spec.loss = [](const at::Tensor& y, const at::Tensor& t) { return (y - t).pow(2).mean(); };
  spec.optimizer = adamw(0.05, 0.1);
  spec.dataset = [](int64_t i) {
    const double x = static_cast<double>(i % 13) / 5;
    Sample s{at::tensor({x, -x, 1.0}, at::kDouble), at::tensor({x, 0.5, -1.0}, at::kDouble)};
    s.extraInputs = {at::tensor({1.0, i % 2 == 0 ? 0.0 : 1.0, 1.0}, at::kDouble)};
    return s;
  };
  spec.datasetSize = 64;
  return spec;
}

TEST(TrainerTest, SamplesWithTwoInputsReachTheFirstLayerAsAList) {
  auto ctx = init(nullptr, nullptr);
  TrainerOptions o = recipeOptions(6);
  o.clipGradNorm = 0.5;
  const ModelSpec spec = gatedModel();
  Trainer trainer(*ctx, spec, o);
  torch::nn::Sequential ref = buildModel(spec, o.seed, o.dtype);
  auto opt = spec.optimizer(ref->parameters());
  for (int64_t s = 0; s < o.steps; ++s) {
    StepResult r = trainer.step();
    const StepBatch batch = stepBatch(spec, o, s);
    opt->zero_grad();
    at::Tensor loss =
        spec.loss(ref->forward(std::vector<at::Tensor>{batch.x, batch.extra.at(0)}), batch.y);
    loss.backward();
    torch::nn::utils::clip_grad_norm_(ref->parameters(), 0.5);
    opt->step();
    EXPECT_NEAR(r.loss, loss.item<double>(), 1e-12) << "step " << s;
  }
  auto mine = trainer.model()->named_parameters();
  for (const auto& np : ref->named_parameters()) {
    EXPECT_LT((mine[np.key()] - np.value()).abs().max().item<double>(), 1e-12) << np.key();
  }
  trainer.finish();
}

// A sample without the extra input the others have, and a layer that cannot take a list, are
// InvalidArguments naming the sample and the layer.
TEST(TrainerTest, MissingExtraInputsAndLayersThatCannotTakeAListAreNamed) {
  auto ctx = init(nullptr, nullptr);
  auto failure = [&](const ModelSpec& spec) {
    TrainerOptions o = tinyOptions();
    o.sampling = Sampling::kEpochs;
    o.steps = 40;
    try {
      Trainer trainer(*ctx, spec, o);
      trainer.run();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  ModelSpec missing = gatedModel();
  const Dataset full = missing.dataset;
  missing.dataset = [full](int64_t i) {
    Sample s = full(i);
    if (i == 21) s.extraInputs.clear();
    return s;
  };
  const std::string a = failure(missing);
  EXPECT_NE(a.find("sample 21 has 0 extra inputs"), std::string::npos) << a;
  ModelSpec plain = gatedModel();
  plain.layers[0] = {"plain", [] { return torch::nn::AnyModule(torch::nn::Linear(3, 3)); }};
  const std::string b = failure(plain);
  EXPECT_NE(b.find("layer 'plain' cannot take a list of 2 tensors"), std::string::npos) << b;
}

// Dynamic loss scaling: a step whose global batch holds a sample of input 1e200 has an
// infinite loss and gradient. Every such step commits without an optimizer step and halves the
// scale; three finite steps in a row double it. Step by step the loss scale, the skips and the
// loss follow a plain-libtorch loop that skips the same steps, and the parameters end equal
// (float64, scales that are powers of two: scaling and unscaling are exact).
TEST(TrainerTest, LossScalingSkipsStepsWithInfiniteGradientsOnEveryWorkerAlike) {
  auto ctx = init(nullptr, nullptr);
  TrainerOptions o = recipeOptions(24);
  o.lossScaling = TrainerOptions::LossScaling{1024.0, 3};
  ModelSpec spec = tinyModel();
  const Dataset finite = spec.dataset;
  spec.dataset = [finite](int64_t i) {
    Sample s = finite(i);
    if (i % 23 == 5) s.input = at::full_like(s.input, 1e200);
    return s;
  };
  Trainer trainer(*ctx, spec, o);
  torch::nn::Sequential ref = buildModel(spec, o.seed, o.dtype);
  auto opt = spec.optimizer(ref->parameters());
  double scale = 1024.0;
  int finiteInARow = 0, skipped = 0, grown = 0;
  for (int64_t s = 0; s < o.steps; ++s) {
    StepResult r = trainer.step();
    const StepBatch batch = stepBatch(spec, o, s);
    opt->zero_grad();
    at::Tensor loss = spec.loss(ref->forward(batch.x), batch.y);
    loss.backward();
    bool allFinite = true;
    for (const auto& p : ref->parameters())
      allFinite = allFinite && p.grad().isfinite().all().item<bool>();
    EXPECT_EQ(r.lossScale, scale) << "step " << s;
    EXPECT_EQ(r.skipped, !allFinite) << "step " << s;
    if (allFinite) {
      opt->step();
      EXPECT_NEAR(r.loss, loss.item<double>(), 1e-12) << "step " << s;
      if (++finiteInARow == 3) {
        scale *= 2;
        finiteInARow = 0;
        ++grown;
      }
    } else {
      scale /= 2;
      finiteInARow = 0;
      ++skipped;
    }
  }
  EXPECT_GT(skipped, 0) << "no step had an infinite gradient: the test would not see a skip";
  EXPECT_GT(grown, 0) << "the scale never grew";
  auto mine = trainer.model()->named_parameters();
  for (const auto& np : ref->named_parameters()) {
    EXPECT_LT((mine[np.key()] - np.value()).abs().max().item<double>(), 1e-12) << np.key();
  }
  EXPECT_EQ(trainer.finish().lossScale, scale);
}

// Mixed precision on the CPU: the layers compute in bfloat16 under autocast (what a Linear
// returns inside the model is BFloat16) while the parameters and the optimizer state stay
// float32, and the loss curve follows the float32 run's within 2% at every step.
struct DtypeProbeImpl : torch::nn::Module {
  DtypeProbeImpl() : lin(register_module("lin", torch::nn::Linear(8, 8))) {}
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor y = lin->forward(x);
    seen = y.scalar_type();
    return at::tanh(y).to(at::kFloat);
  }
  torch::nn::Linear lin;
  at::ScalarType seen = at::ScalarType::Undefined;
};
TORCH_MODULE(DtypeProbe);

TEST(TrainerTest, Bf16ComputeKeepsFloat32MastersAndTheFloat32LossCurve) {
  auto ctx = init(nullptr, nullptr);
  ModelSpec spec;
  spec.layers.push_back({"probe", [] { return torch::nn::AnyModule(DtypeProbe()); }});
  spec.layers.push_back({"out", [] { return torch::nn::AnyModule(torch::nn::Linear(8, 2)); }});
  spec.loss = [](const at::Tensor& y, const at::Tensor& t) { return (y - t).pow(2).mean(); };
  spec.optimizer = adamw(0.01, 0.1);
  spec.dataset = [](int64_t i) {
    at::Tensor x = at::sin(at::arange(8, at::kFloat) * (0.3 + 0.01 * static_cast<double>(i % 17)));
    return Sample{x, at::stack({x.sum() / 4, x.mean()})};
  };
  spec.datasetSize = 68;
  const std::string dir = tempDir();
  auto curve = [&](at::ScalarType compute, at::ScalarType* seen) {
    TrainerOptions o = recipeOptions(30);
    o.dtype = at::kFloat;
    o.computeDtype = compute;
    if (compute == at::kBFloat16) {
      o.checkpointDir = dir;
      o.checkpointEvery = 10;
    }
    Trainer trainer(*ctx, spec, o);
    std::vector<double> losses;
    for (StepResult r; !(r = trainer.step()).done;) losses.push_back(r.loss);
    auto* probe = trainer.model()->ptr(0)->as<DtypeProbeImpl>();
    *seen = probe->seen;
    for (const auto& p : trainer.model()->parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
    trainer.finish();
    return losses;
  };
  at::ScalarType seenBf16, seenFloat;
  const std::vector<double> bf16 = curve(at::kBFloat16, &seenBf16);
  const std::vector<double> f32 = curve(at::ScalarType::Undefined, &seenFloat);
  EXPECT_EQ(seenBf16, at::kBFloat16);
  EXPECT_EQ(seenFloat, at::kFloat);
  ASSERT_EQ(bf16.size(), 30u);
  ASSERT_EQ(f32.size(), 30u);
  bool differs = false;
  for (size_t s = 0; s < bf16.size(); ++s) {
    EXPECT_NEAR(bf16[s], f32[s], 0.02 * f32[s]) << "step " << s;
    differs = differs || bf16[s] != f32[s];
  }
  EXPECT_TRUE(differs) << "bfloat16 gave the float32 losses bit for bit: autocast did not engage";
  EXPECT_LT(f32.back(), 0.5 * f32.front()) << "the model did not learn";
  // The bfloat16 run's checkpoints hold the float32 masters and float32 optimizer state.
  auto reader = CheckpointReader::open(dir);
  EXPECT_EQ(reader->step(), 29);
  int tensors = 0;
  for (const std::string& layer : reader->layers()) {
    for (const auto& [name, t] : reader->loadLayer(layer)) {
      if (name.rfind("@", 0) == 0 || !t.is_floating_point()) continue;  // step counts
      EXPECT_EQ(t.scalar_type(), at::kFloat) << layer << "/" << name;
      ++tensors;
    }
  }
  EXPECT_GE(tensors, 6) << "out's weight and bias, each with AdamW's two moments";
  sinew::testing::removeTree(dir);
}

// Bad mixed-precision options are refused before training, naming the option.
TEST(TrainerTest, BadMixedPrecisionOptionsAreRefused) {
  auto ctx = init(nullptr, nullptr);
  auto refusal = [&](const std::function<void(TrainerOptions&)>& set) {
    TrainerOptions o = tinyOptions();
    set(o);
    try {
      Trainer trainer(*ctx, tinyModel(), o);
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const std::string f64 = refusal([](TrainerOptions& o) { o.computeDtype = at::kBFloat16; });
  EXPECT_NE(f64.find("TrainerOptions::dtype must be Float"), std::string::npos) << f64;
  const std::string half = refusal([](TrainerOptions& o) {
    o.dtype = at::kFloat;
    o.computeDtype = at::kHalf;
  });
  EXPECT_NE(half.find("Half needs a CUDA device"), std::string::npos) << half;
  const std::string scale = refusal([](TrainerOptions& o) {
    o.lossScaling = TrainerOptions::LossScaling{0.0, 10};
  });
  EXPECT_NE(scale.find("lossScaling.initialScale = 0"), std::string::npos) << scale;
}

// The program's kept state: save() runs once per committed step, in step order, and what it
// returns is in the checkpoint of that step (as "@user.<name>", in every layer); a bad name or a
// missing function is refused by name, and a value of another shape at a commit too.
TEST(TrainerTest, KeptStateIsSavedOncePerCommittedStepIntoTheCheckpoints) {
  const std::string dir = tempDir();
  auto ctx = init(nullptr, nullptr);
  TrainerOptions o = recipeOptions(5);
  o.checkpointDir = dir;
  o.checkpointEvery = 1;
  o.checkpointKeep = 8;
  std::vector<int64_t> saved;
  o.keptState.push_back({"seen", at::zeros({2}, at::kLong),
                         [&saved](int64_t step) {
                           saved.push_back(step);
                           return at::tensor({step, 10 * step}, at::kLong);
                         },
                         [](int64_t, const at::Tensor&) { ADD_FAILURE() << "nothing to load"; }});
  const ModelSpec spec = recipeModel();
  Trainer trainer(*ctx, spec, o);
  trainer.run();
  EXPECT_EQ(saved, (std::vector<int64_t>{0, 1, 2, 3, 4}));
  auto reader = CheckpointReader::open(dir);
  EXPECT_EQ(reader->step(), 4);
  std::map<std::string, std::map<std::string, at::Tensor>> layers;
  for (const std::string& name : reader->layers()) layers[name] = reader->loadLayer(name);
  ASSERT_FALSE(layers.empty());
  for (const auto& [name, tensors] : layers) {
    auto it = tensors.find("@user.seen");
    ASSERT_NE(it, tensors.end()) << name;
    EXPECT_TRUE(at::equal(it->second, at::tensor({4, 40}, at::kLong))) << name;
  }
  sinew::testing::removeTree(dir);

  auto refusal = [&](KeptState k) {
    TrainerOptions bad = tinyOptions();
    bad.keptState.push_back(std::move(k));
    try {
      Trainer t(*ctx, tinyModel(), bad);
      t.run();
    } catch (const InvalidArgument& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  auto save = [](int64_t) { return at::zeros({1}); };
  auto load = [](int64_t, const at::Tensor&) {};
  EXPECT_NE(refusal({"a/b", at::zeros({1}), save, load}).find("has the name 'a/b'"),
            std::string::npos);
  EXPECT_NE(refusal({"x", at::zeros({1}), nullptr, load}).find("needs an initial tensor, a save"),
            std::string::npos);
  EXPECT_NE(refusal({"x", at::zeros({3}), save, load}).find("registered as [3]"),
            std::string::npos);
}

// Two square layers whose weights are tied: "in.weight" owns, "out.weight" follows.
ModelSpec tiedModel() {
  ModelSpec spec;
  auto square = [] {
    return torch::nn::AnyModule(torch::nn::Linear(torch::nn::LinearOptions(3, 3).bias(false)));
  };
  spec.layers.push_back({"in", square});
  spec.layers.push_back({"act", [] { return torch::nn::AnyModule(torch::nn::Tanh()); }});
  spec.layers.push_back({"out", square});
  spec.tied.push_back({"in.weight", "out.weight"});
  spec.loss = [](const at::Tensor& y, const at::Tensor& t) { return (y - t).pow(2).mean(); };
  spec.optimizer = adamw(0.05, 0.1);
  spec.dataset = [](int64_t i) {
    const double x = static_cast<double>(i % 13) / 5;
    return Sample{at::tensor({x, -x, 1.0}, at::kDouble), at::tensor({x, 2 * x, -1.0}, at::kDouble)};
  };
  spec.datasetSize = 64;
  return spec;
}

// A model whose two layers share one weight trains as plain libtorch trains the model that uses
// one tensor in both places: the same loss, gradient norm (the tensor counted once) and, with
// clipping that engages, the same weights; the follower stays equal to its owner.
TEST(TrainerTest, TiedParametersTrainAsOneTensor) {
  auto ctx = init(nullptr, nullptr);
  TrainerOptions o = recipeOptions(8);
  o.clipGradNorm = 0.3;
  const ModelSpec spec = tiedModel();
  Trainer trainer(*ctx, spec, o);
  // The reference: one weight W, y = W tanh(W x).
  torch::nn::Sequential built = buildModel(spec, o.seed, o.dtype);
  at::Tensor w = built->named_parameters()["in.weight"].detach().clone().requires_grad_(true);
  EXPECT_TRUE(at::equal(w, built->named_parameters()["out.weight"]));
  auto opt = spec.optimizer({w});
  int clipped = 0;
  for (int64_t s = 0; s < o.steps; ++s) {
    StepResult r = trainer.step();
    const StepBatch batch = stepBatch(spec, o, s);
    opt->zero_grad();
    at::Tensor x = batch.x;
    at::Tensor loss = spec.loss(at::matmul(at::tanh(at::matmul(x, w.t())), w.t()), batch.y);
    loss.backward();
    const double norm = torch::nn::utils::clip_grad_norm_(std::vector<at::Tensor>{w}, 0.3);
    clipped += norm > 0.3 ? 1 : 0;
    opt->step();
    EXPECT_NEAR(r.loss, loss.item<double>(), 1e-12) << "step " << s;
    EXPECT_NEAR(r.gradNorm, norm, 1e-12) << "step " << s;
  }
  EXPECT_GT(clipped, 0) << "clipping never engaged: the test would not see a norm counted twice";
  auto mine = trainer.model()->named_parameters();
  EXPECT_LT((mine["in.weight"] - w).abs().max().item<double>(), 1e-12);
  EXPECT_TRUE(at::equal(mine["in.weight"], mine["out.weight"]));
  trainer.finish();
}

// A durable checkpoint stores a tied tensor once: the follower's weight and its AdamW state are
// named in the manifest as the owner's and take no bytes of their own; the checkpoint still
// loads into a plain model with both layers equal, and a job that resumes from it ends equal,
// bit for bit, to one that never stopped.
TEST(TrainerTest, TiedParametersAreStoredOnceAndAJobResumesFromThemExactly) {
  const ModelSpec spec = tiedModel();
  auto train = [&](const std::string& dir, int64_t steps) {
    auto ctx = init(nullptr, nullptr);
    TrainerOptions o = recipeOptions(steps);
    o.checkpointDir = dir;
    o.checkpointEvery = 4;
    Trainer trainer(*ctx, spec, o);
    trainer.run();
    std::map<std::string, at::Tensor> out;
    for (const auto& p : trainer.model()->named_parameters()) out[p.key()] = p.value().clone();
    return out;
  };
  const std::string dir = tempDir(), reference = tempDir();
  train(dir, 8);
  const std::string manifestPath = dir + "/step-00000007/manifest.json";
  std::ifstream in(manifestPath);
  const auto manifest = nlohmann::json::parse(in);
  const auto& out = manifest["layers"]["out"];
  EXPECT_EQ(out["same_as"]["weight"], "in/weight") << out.dump();
  EXPECT_EQ(out["same_as"]["weight.exp_avg"], "in/weight.exp_avg") << out.dump();
  EXPECT_EQ(out["same_as"]["weight.exp_avg_sq"], "in/weight.exp_avg_sq") << out.dump();
  EXPECT_TRUE(out["tensors"].empty()) << out.dump();
  EXPECT_TRUE(manifest["layers"]["in"]["tensors"].contains("weight")) << manifest.dump();
  torch::nn::Sequential plain = buildModel(spec, /*seed=*/99, at::kDouble);
  EXPECT_EQ(CheckpointReader::open(dir)->loadInto(*plain), 2);
  auto loaded = plain->named_parameters();
  EXPECT_TRUE(at::equal(loaded["in.weight"], loaded["out.weight"]));
  const auto resumed = train(dir, 12);  // From version 7: steps 8..11.
  const auto whole = train(reference, 12);
  for (const auto& [name, value] : whole) {
    EXPECT_TRUE(at::equal(resumed.at(name), value)) << name;
  }
  EXPECT_TRUE(at::equal(resumed.at("in.weight"), resumed.at("out.weight")));
  EXPECT_FALSE(at::equal(whole.at("in.weight"), loaded["in.weight"])) << "nothing trained after";
  sinew::testing::removeTree(dir);
  sinew::testing::removeTree(reference);
}

// Ties that name no layer or parameter, tie a parameter to itself, follow twice, chain, or
// disagree in shape are refused with errors naming them; a follower built without its owner's
// layer starts as the owner's copy.
TEST(TrainerTest, BadTiesAreRefusedAndAFollowerBuiltAloneCopiesItsOwner) {
  auto ctx = init(nullptr, nullptr);
  auto refused = [&](std::vector<TiedParameters> tied, const std::string& says) {
    ModelSpec spec = tiedModel();
    spec.tied = std::move(tied);
    try {
      Trainer trainer(*ctx, spec, recipeOptions(1));
      trainer.run();
      ADD_FAILURE() << "accepted ties that should fail with: " << says;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused({{"nope.weight", "out.weight"}}, "ModelSpec::tied[0].owner = 'nope.weight'");
  refused({{"in", "out.weight"}}, "ModelSpec::tied[0].owner = 'in'");
  refused({{"in.weight", "in.weight"}}, "ties 'in.weight' to itself");
  refused({{"in.weight", "out.weight"}, {"act.x", "out.weight"}},
          "'out.weight' is already the follower of ModelSpec::tied[0]");
  refused({{"in.weight", "out.weight"}, {"out.weight", "act.x"}},
          "'out.weight' is the follower of ModelSpec::tied[0]");
  refused({{"in.bias", "out.weight"}}, "layer 0 ('in') has no parameter 'bias'");
  ModelSpec other = tiedModel();
  other.layers[2].build = [] { return torch::nn::AnyModule(torch::nn::Linear(3, 2)); };
  try {
    buildModel(other, 1, at::kDouble);
    ADD_FAILURE() << "tied parameters of two shapes were built";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("(shape [2, 3]"), std::string::npos) << e.what();
  }
  const ModelSpec spec = tiedModel();
  torch::nn::Sequential whole = buildModel(spec, 5, at::kFloat);
  torch::nn::Sequential last = buildLayers(spec, 5, at::kFloat, 2, 3);
  EXPECT_TRUE(
      at::equal(last->named_parameters()["out.weight"], whole->named_parameters()["in.weight"]));
  ModelSpec untied = spec;
  untied.tied.clear();
  EXPECT_FALSE(at::equal(buildLayers(untied, 5, at::kFloat, 2, 3)->named_parameters()["out.weight"],
                         whole->named_parameters()["in.weight"]))
      << "the layers' own initial weights are equal: the copy is not seen";
}

// The bytes of the shard files each version in `dir` wrote itself (not those it reads from
// older versions), oldest version first.
std::vector<int64_t> shardBytesPerVersion(const std::string& dir) {
  std::map<std::string, int64_t> bytes;  // "step-%08d" sorts by step
  for (const auto& v : std::filesystem::directory_iterator(dir)) {
    const std::string name = v.path().filename().string();
    if (!v.is_directory() || name.rfind("step-", 0) != 0) continue;
    int64_t& b = bytes[name];
    for (const auto& e : std::filesystem::directory_iterator(v.path())) {
      if (e.path().extension() == ".safetensors") b += static_cast<int64_t>(e.file_size());
    }
  }
  std::vector<int64_t> out;
  for (const auto& [name, b] : bytes) out.push_back(b);
  return out;
}

// A frozen base (a 256 x 256 linear layer, requires_grad false) under a small trainable head,
// a durable version every step: with incremental checkpoints the base is written by the first
// version only and every later one writes the head and its AdamW state alone; the newest
// version still loads the whole model, base included. Without them every version writes the
// base again.
TEST(TrainerTest, IncrementalCheckpointsWriteAFrozenBaseOnce) {
  auto bytesPerVersion = [](bool incremental, std::vector<int64_t>* sizes) {
    const std::string dir = tempDir();
    auto ctx = init(nullptr, nullptr);
    ModelSpec spec;
    spec.layers.push_back({"base", [] {
                             torch::nn::Linear l(256, 256);
                             for (auto& p : l->parameters()) p.requires_grad_(false);
                             return torch::nn::AnyModule(l);
                           }});
    spec.layers.push_back({"head", [] { return torch::nn::AnyModule(torch::nn::Linear(256, 1)); }});
    spec.loss = [](const at::Tensor& y, const at::Tensor& t) { return (y - t).pow(2).mean(); };
    spec.optimizer = adamw(0.01);
    spec.dataset = [](int64_t i) {
      return Sample{at::full({256}, static_cast<double>(i % 7) / 7, at::kDouble),
                    at::full({1}, static_cast<double>(i % 3), at::kDouble)};
    };
    spec.datasetSize = 64;
    TrainerOptions o = recipeOptions(8);
    o.checkpointDir = dir;
    o.checkpointEvery = 1;
    o.checkpointKeep = 8;
    o.incrementalCheckpoints = incremental;
    Trainer trainer(*ctx, spec, o);
    trainer.run();
    *sizes = shardBytesPerVersion(dir);  // A version may be skipped while one is written.
    torch::nn::Sequential loaded = buildModel(spec, 77, at::kDouble);
    CheckpointReader::open(dir)->loadInto(*loaded);
    auto mine = trainer.model()->named_parameters(), theirs = loaded->named_parameters();
    for (const auto& p : mine) EXPECT_TRUE(at::equal(p.value(), theirs[p.key()])) << p.key();
    sinew::testing::removeTree(dir);
  };
  std::vector<int64_t> full, incremental;
  bytesPerVersion(false, &full);
  bytesPerVersion(true, &incremental);
  const int64_t base = (256 * 256 + 256) * 8;
  ASSERT_GE(full.size(), 2u);
  ASSERT_GE(incremental.size(), 2u);
  for (int64_t b : full) EXPECT_GT(b, base);
  EXPECT_GT(incremental[0], base);
  for (size_t v = 1; v < incremental.size(); ++v) {
    EXPECT_LT(incremental[v], base / 50) << "version " << v;  // The head and its two moments.
  }
  std::printf("bytes per version, frozen base: full %lld, incremental %lld (first %lld)\n",
              static_cast<long long>(full[1]), static_cast<long long>(incremental[1]),
              static_cast<long long>(incremental[0]));
}

// Self-attention without projections over [b, T, 4]: autograd keeps its [b, T, T] weights.
struct AttendImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    return at::matmul(at::softmax(at::matmul(x, x.transpose(1, 2)), -1), x);
  }
};
TORCH_MODULE(Attend);

// The activation bytes of layer `layer` in the "profiled" event of the one-worker pipeline job
// that `measure` configures.
int64_t profiledActivationBytes(bool measure, int layer) {
  const std::string dir = tempDir();
  auto ctx = init(nullptr, nullptr);
  ModelSpec spec;
  spec.layers.push_back({"in", [] { return torch::nn::AnyModule(torch::nn::Linear(4, 4)); }});
  spec.layers.push_back({"attend", [] { return torch::nn::AnyModule(Attend()); }});
  spec.layers.push_back({"out", [] { return torch::nn::AnyModule(torch::nn::Linear(4, 1)); }});
  spec.loss = [](const at::Tensor& y, const at::Tensor& t) { return (y - t).pow(2).mean(); };
  spec.optimizer = adamw(0.01);
  spec.dataset = [](int64_t i) {
    return Sample{at::full({64, 4}, static_cast<double>(i % 5) / 5, at::kDouble),
                  at::zeros({64, 1}, at::kDouble)};
  };
  spec.datasetSize = 16;
  TrainerOptions o = recipeOptions(1);
  o.parallelism = Parallelism::kPipeline;
  o.faultTolerance = 0;
  o.measureActivationMemory = measure;
  o.eventLog = dir + "/events.jsonl";
  Trainer trainer(*ctx, spec, o);
  trainer.run();
  std::ifstream in(o.eventLog);
  int64_t bytes = -1;
  for (std::string line; std::getline(in, line);) {
    auto e = nlohmann::json::parse(line);
    if (e.value("event", "") == "profiled") {
      bytes = e["profile"]["layers"][layer]["activation_bytes"].get<int64_t>();
    }
  }
  sinew::testing::removeTree(dir);
  return bytes;
}

// TrainerOptions::measureActivationMemory reaches the profiler: the attention layer's measured
// activation bytes hold its [4, 64, 64] float64 weights, which the input + output estimate
// lacks.
TEST(TrainerTest, MeasuredActivationMemoryCountsAttentionWeights) {
  const int64_t io = 2 * 4 * 64 * 4 * 8, weights = 4 * 64 * 64 * 8;
  EXPECT_EQ(profiledActivationBytes(false, 1), io);
  EXPECT_GE(profiledActivationBytes(true, 1), io / 2 + weights);
}

// A layer that takes 30 ms per forward.
struct SlowImpl : torch::nn::Module {
  at::Tensor forward(const at::Tensor& x) {
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    return x * 2;
  }
};
TORCH_MODULE(Slow);

// The members measure their profile inside the job's first epoch, which a large model makes
// last minutes (GPT-2 small: 155 s per worker on this machine); that is not a recovery that
// failed to find an epoch. Here the profile's 24 runs take over 0.7 s against a recovery
// timeout of 0.3 s (before: "worker 0 could not recover within 300 ms (start)"). The done event
// reports the process's peak resident memory, the peak since training began and, asked for,
// the peak of each phase of a step.
TEST(TrainerTest, AProfileLongerThanTheRecoveryTimeoutDoesNotFailTheStart) {
  const std::string dir = tempDir();
  auto ctx = init(nullptr, nullptr);
  ModelSpec spec = tinyModel();
  spec.layers.insert(spec.layers.begin() + 1,
                     {"slow", [] { return torch::nn::AnyModule(Slow()); }});
  TrainerOptions o = tinyOptions();
  o.parallelism = Parallelism::kPipeline;
  o.faultTolerance = 0;
  o.recoveryTimeout = std::chrono::milliseconds(300);
  o.eventLog = dir + "/events.jsonl";
  o.memoryByPhase = true;
  Trainer trainer(*ctx, spec, o);
  TrainResult r = trainer.run();
  EXPECT_EQ(r.steps, o.steps);
  std::ifstream in(o.eventLog);
  double profiled = -1;
  int64_t peak = -1, trainingPeak = -1;
  std::map<std::string, int64_t> phases;
  for (std::string line; std::getline(in, line);) {
    auto e = nlohmann::json::parse(line);
    if (e.value("event", "") == "profiled") profiled = e.at("duration_s").get<double>();
    if (e.value("event", "") == "done") {
      peak = e.at("peak_rss_bytes").get<int64_t>();
      trainingPeak = e.at("training_peak_rss_bytes").get<int64_t>();
      phases = e.at("peak_rss_by_phase_bytes").get<std::map<std::string, int64_t>>();
    }
  }
  EXPECT_GT(profiled, 0.3) << "the profile was shorter than the recovery timeout";
  EXPECT_GT(trainingPeak, 10 << 20);
  EXPECT_GE(peak, trainingPeak);
  for (const char* phase : {"schedule", "reduce", "clip", "optimizer", "checkpoint"}) {
    ASSERT_EQ(phases.count(phase), 1u) << phase;
    EXPECT_GT(phases[phase], 10 << 20) << phase;
    EXPECT_LE(phases[phase], trainingPeak) << phase;
  }
  sinew::testing::removeTree(dir);
}

// The data-parallel step sums its gradients in buckets, as DDP does: the reduce and clip
// phases need one bucket beside the gradients, not a flat copy of them all. Four layers of
// 16 MiB of weights: a flat copy (and its concatenation) was 64 MiB more than the step before
// the reduction held.
TEST(TrainerTest, TheDataParallelGradientSumNeedsABucketNotACopyOfEveryGradient) {
  const std::string dir = tempDir();
  auto ctx = init(nullptr, nullptr);
  constexpr int64_t kWidth = 2048;  // 2048 x 2048 floats: 16 MiB a layer
  ModelSpec spec;
  for (int i = 0; i < 4; ++i) {
    spec.layers.push_back({"fc" + std::to_string(i), [] {
                             return torch::nn::AnyModule(torch::nn::Linear(
                                 torch::nn::LinearOptions(kWidth, kWidth).bias(false)));
                           }});
  }
  spec.loss = [](const at::Tensor& y, const at::Tensor& t) { return (y - t).pow(2).mean(); };
  spec.optimizer = sgd(1e-3);
  spec.dataset = [](int64_t i) {
    return Sample{at::full({kWidth}, 0.01 * static_cast<double>(i % 7 + 1), at::kFloat),
                  at::zeros({kWidth}, at::kFloat)};
  };
  spec.datasetSize = 64;
  TrainerOptions o;
  o.dtype = at::kFloat;
  o.globalBatch = 2;
  o.microbatch = 1;
  o.steps = 4;
  o.progressEvery = 0;
  o.eventLog = dir + "/events.jsonl";
  o.memoryByPhase = true;
  Trainer trainer(*ctx, spec, o);
  TrainResult r = trainer.run();
  EXPECT_EQ(r.steps, o.steps);
  std::map<std::string, int64_t> phases;
  std::ifstream in(o.eventLog);
  for (std::string line; std::getline(in, line);) {
    auto e = nlohmann::json::parse(line);
    if (e.value("event", "") == "done") {
      phases = e.at("peak_rss_by_phase_bytes").get<std::map<std::string, int64_t>>();
    }
  }
  ASSERT_EQ(phases.count("schedule"), 1u);
  const int64_t before = phases["schedule"];  // forward and backward: the gradients exist
  for (const char* phase : {"reduce", "clip"}) {
    ASSERT_EQ(phases.count(phase), 1u) << phase;
    EXPECT_LT(phases[phase] - before, int64_t{40} << 20)
        << phase << ": " << phases[phase] << " bytes against " << before << " in forward+backward";
  }
  sinew::testing::removeTree(dir);
}

}  // namespace
}  // namespace sinew
