// The trainer in a job of one worker (sinew::init() with no launcher: an in-process
// coordinator): errors of its background checkpoint flush reach Trainer::run()'s caller as
// the exception itself, not as a string in a log.

#include <gtest/gtest.h>

#include <torch/nn/modules/linear.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "../checkpoint/fault_env.h"
#include "../fs_support.h"
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

}  // namespace
}  // namespace sinew
