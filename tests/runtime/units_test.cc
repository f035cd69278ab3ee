// The runtime's units in one process: optimizer state turned into named tensors and back
// (runtime/optimizer_state.h), the layer copy manifest's decoder (runtime/layer_copy_manifest.h),
// the Context's preemption request, and the coordinator's message table (runtime/wire.cc)
// against docs/coordinator_protocol.md.

#include <gtest/gtest.h>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include "sinew/base/error.h"
#include "sinew/init.h"
#include "sinew/runtime/detail/wire.h"
#include "sinew/runtime/layer_copy_manifest.h"
#include "sinew/runtime/optimizer_state.h"

namespace sinew {
namespace runtime {
namespace {

using Saved = std::map<std::string, checkpoint::RestoredLayer>;

// Two layers with parameters around one without ("act"), in float32.
torch::nn::Sequential makeLayers(uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential s;
  s->push_back("fc1", torch::nn::Linear(4, 6));
  s->push_back("act", torch::nn::ReLU());
  s->push_back("fc2", torch::nn::Linear(6, 2));
  return s;
}

void trainSteps(torch::nn::Sequential& layers, torch::optim::Optimizer& opt, int steps,
                int64_t seed) {
  torch::manual_seed(seed);
  for (int i = 0; i < steps; ++i) {
    opt.zero_grad();
    at::Tensor x = at::randn({5, 4});
    layers->forward(x).pow(2).mean().backward();
    opt.step();
  }
}

// Copies of the captured tensors (captureState aliases the live ones), by layer and name.
Saved snapshot(const checkpoint::ShardState& state) {
  Saved out;
  for (const auto& l : state) {
    for (const auto& t : l.tensors) out[l.name][t.name] = t.tensor.clone();
  }
  return out;
}

void expectSameParameters(torch::nn::Sequential& a, torch::nn::Sequential& b) {
  auto pa = a->named_parameters(), pb = b->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& p : pa) {
    EXPECT_TRUE(at::equal(p.value(), pb[p.key()])) << p.key();
  }
}

TEST(OptimizerStateTest, NamesEveryTensorOfAdamAndSkipsLayersWithoutParameters) {
  auto layers = makeLayers(1);
  torch::optim::Adam opt(layers->parameters(), torch::optim::AdamOptions(1e-2).amsgrad(true));
  trainSteps(layers, opt, 3, 5);
  checkpoint::ShardState state = captureState(layers, opt);
  ASSERT_EQ(state.size(), 2u);  // "act" has no parameters.
  EXPECT_EQ(state[0].name, "fc1");
  EXPECT_EQ(state[1].name, "fc2");
  std::vector<std::string> names;
  for (const auto& t : state[0].tensors) names.push_back(t.name);
  EXPECT_EQ(names, (std::vector<std::string>{"weight", "weight.exp_avg", "weight.exp_avg_sq",
                                             "weight.max_exp_avg_sq", "weight.step", "bias",
                                             "bias.exp_avg", "bias.exp_avg_sq",
                                             "bias.max_exp_avg_sq", "bias.step"}));
  EXPECT_EQ(state[0].tensors[4].tensor.item<int64_t>(), 3);
  EXPECT_TRUE(optimizerStateSupported(opt));
}

// Loading a captured state into fresh layers and optimizer gives the same parameters, and the
// next steps of both are equal bit for bit (the state was whole).
template <typename MakeOptimizer>
void expectRoundTrip(MakeOptimizer make, const std::vector<std::string>& stateSuffixes) {
  auto layers = makeLayers(1);
  auto opt = make(layers->parameters());
  trainSteps(layers, *opt, 3, 5);
  Saved saved = snapshot(captureState(layers, *opt));
  for (const std::string& suffix : stateSuffixes) {
    EXPECT_EQ(saved["fc2"].count("weight" + suffix), 1u) << suffix;
  }
  auto restored = makeLayers(2);  // Other parameters, then loaded over.
  auto restoredOpt = make(restored->parameters());
  loadState(restored, *restoredOpt, saved, "the test's state");
  expectSameParameters(layers, restored);
  trainSteps(layers, *opt, 2, 9);
  trainSteps(restored, *restoredOpt, 2, 9);
  expectSameParameters(layers, restored);
}

TEST(OptimizerStateTest, SgdWithMomentumRoundTrips) {
  expectRoundTrip(
      [](std::vector<at::Tensor> ps) {
        return std::make_unique<torch::optim::SGD>(ps, torch::optim::SGDOptions(0.1).momentum(0.9));
      },
      {"", ".momentum_buffer"});
}

TEST(OptimizerStateTest, AdamRoundTrips) {
  expectRoundTrip(
      [](std::vector<at::Tensor> ps) {
        return std::make_unique<torch::optim::Adam>(ps, torch::optim::AdamOptions(1e-2));
      },
      {"", ".exp_avg", ".exp_avg_sq", ".step"});
}

TEST(OptimizerStateTest, AmsgradRoundTrips) {
  expectRoundTrip(
      [](std::vector<at::Tensor> ps) {
        return std::make_unique<torch::optim::Adam>(ps,
                                                    torch::optim::AdamOptions(1e-2).amsgrad(true));
      },
      {"", ".exp_avg", ".exp_avg_sq", ".max_exp_avg_sq", ".step"});
}

// A checkpoint whose Adam state lacks exp_avg_sq (or step) is refused with Corruption naming
// the source, the layer and the tensor, instead of dereferencing a missing tensor.
TEST(OptimizerStateTest, AdamStateWithoutExpAvgSqOrStepIsCorruption) {
  auto layers = makeLayers(1);
  torch::optim::Adam opt(layers->parameters(), torch::optim::AdamOptions(1e-2));
  trainSteps(layers, opt, 2, 5);
  const Saved whole = snapshot(captureState(layers, opt));
  for (const std::string dropped : {"bias.exp_avg_sq", "bias.step"}) {
    Saved saved = whole;
    saved["fc2"].erase(dropped);
    auto fresh = makeLayers(2);
    torch::optim::Adam freshOpt(fresh->parameters(), torch::optim::AdamOptions(1e-2));
    try {
      loadState(fresh, freshOpt, saved, "checkpoint 7");
      ADD_FAILURE() << "a state without " << dropped << " was loaded";
    } catch (const Corruption& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("checkpoint 7, layer 'fc2'"), std::string::npos) << what;
      EXPECT_NE(what.find("'" + dropped + "'"), std::string::npos) << what;
    }
  }
}

TEST(OptimizerStateTest, AMissingLayerOrParameterIsInvalidArgument) {
  auto layers = makeLayers(1);
  torch::optim::SGD opt(layers->parameters(), torch::optim::SGDOptions(0.1));
  Saved saved = snapshot(captureState(layers, opt));
  Saved noLayer = saved;
  noLayer.erase("fc1");
  EXPECT_THROW(loadState(layers, opt, noLayer, "x"), InvalidArgument);
  Saved wrongShape = saved;
  wrongShape["fc2"]["weight"] = at::zeros({3, 3});
  EXPECT_THROW(loadState(layers, opt, wrongShape, "x"), InvalidArgument);
}

TEST(LayerCopyManifestTest, EncodesAndDecodes) {
  LayerCopyManifest m;
  m.parameters = {{LayerCopyManifest::kHasAdam, 12},
                  {LayerCopyManifest::kHasAdam | LayerCopyManifest::kHasMaxSq, 3},
                  {LayerCopyManifest::kHasMomentum, 0},
                  {0, 0}};
  m.crc32c = 0xFFFFFFFFu;
  std::vector<int64_t> words = m.encode();
  ASSERT_EQ(words.size(), 9u);
  EXPECT_EQ(words[4], 12);  // Steps follow the flags; the checksum is last.
  EXPECT_EQ(words[8], 0xFFFFFFFFll);
  LayerCopyManifest back = LayerCopyManifest::decode(words.data(), words.size(), 4, "layer 'x'");
  ASSERT_EQ(back.parameters.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(back.parameters[i].flags, m.parameters[i].flags);
    EXPECT_EQ(back.parameters[i].step, m.parameters[i].step);
  }
  EXPECT_EQ(back.crc32c, m.crc32c);
  EXPECT_EQ(LayerCopyManifest::tensorSuffixes(m.parameters[1].flags),
            (std::vector<std::string>{"", ".exp_avg", ".exp_avg_sq", ".max_exp_avg_sq"}));
  EXPECT_EQ(LayerCopyManifest::tensorSuffixes(m.parameters[2].flags),
            (std::vector<std::string>{"", ".momentum_buffer"}));
}

TEST(LayerCopyManifestTest, BadWordsAreCorruptionNamingTheLayerAndTheWord) {
  struct Case {
    std::vector<int64_t> words;
    size_t parameters;
    std::string says;
  };
  const std::vector<Case> cases = {
      {{0, 0}, 1, "has 2 words; a layer of 1 parameters needs 3"},
      {{0, 0, 0, 0, 0}, 1, "has 5 words"},
      {{8, 0, 0}, 1, "flags 8 for parameter 0"},
      {{-1, 0, 0}, 1, "flags -1"},
      {{0, 5, 0, 0, 0}, 2, "flags 5 for parameter 1"},  // Adam and momentum
      {{2, 0, 0}, 1, "flags 2"},                        // max_exp_avg_sq without Adam
      {{1, -4, 0}, 1, "step count -4"},
      {{4, 7, 0}, 1, "step count 7 for parameter 0, which has no Adam state"},
      {{0, 0, int64_t{1} << 32}, 1, "checksum word 4294967296"},
      {{0, 0, -1}, 1, "checksum word -1"},
  };
  for (const Case& c : cases) {
    try {
      LayerCopyManifest::decode(c.words.data(), c.words.size(), c.parameters,
                                "layer 'h3' from worker 2");
      ADD_FAILURE() << "accepted: " << c.says;
    } catch (const Corruption& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("the manifest of layer 'h3' from worker 2"), std::string::npos) << what;
      EXPECT_NE(what.find(c.says), std::string::npos) << what;
    }
  }
}

// requestPreemption() asks its own Context, not every Context the process makes after it.
TEST(ContextTest, RequestPreemptionIsPerContext) {
  {
    auto first = init(nullptr, nullptr);
    EXPECT_FALSE(first->preemptionRequested());
    first->requestPreemption();
    EXPECT_TRUE(first->preemptionRequested());
  }
  auto second = init(nullptr, nullptr);
  EXPECT_FALSE(second->preemptionRequested());
}

// The protocol doc shows the message table that decodeBody checks, as messageTable() renders
// it. With SINEW_UPDATE_DOCS=1 the test writes the table into the doc instead.
TEST(WireTest, TheProtocolDocShowsTheMessageTable) {
  const std::string begin = "<!-- BEGIN generated from runtime/wire.cc: wire::messageTable() -->\n";
  const std::string end = "<!-- END generated -->";
  std::ifstream in(SINEW_PROTOCOL_DOC);
  ASSERT_TRUE(in) << SINEW_PROTOCOL_DOC;
  std::stringstream buf;
  buf << in.rdbuf();
  std::string doc = buf.str();
  const size_t a = doc.find(begin), b = doc.find(end);
  ASSERT_NE(a, std::string::npos) << "no BEGIN marker in " << SINEW_PROTOCOL_DOC;
  ASSERT_NE(b, std::string::npos) << "no END marker in " << SINEW_PROTOCOL_DOC;
  ASSERT_LT(a, b);
  const std::string shown = doc.substr(a + begin.size(), b - a - begin.size());
  const std::string table = wire::messageTable();
  const char* update = std::getenv("SINEW_UPDATE_DOCS");
  if (update != nullptr && std::string(update) == "1" && shown != table) {
    doc.replace(a + begin.size(), b - a - begin.size(), table);
    std::ofstream(SINEW_PROTOCOL_DOC) << doc;
    return;
  }
  EXPECT_EQ(shown, table) << "docs/coordinator_protocol.md's message table differs from "
                             "runtime/wire.cc's; rerun with SINEW_UPDATE_DOCS=1 to rewrite it";
}

// Every message type of the table decodes a body with its required fields and names a field
// of a nested object by its path when it is wrong.
TEST(WireTest, DecodeChecksNestedFields) {
  const auto bytes = [](const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); };
  const uint8_t hello = static_cast<uint8_t>(wire::Type::kHello);
  EXPECT_NO_THROW(wire::decodeBody(
      hello, bytes(R"({"worker": 1, "node": "n", "rejoin": {"epoch": 3, "committed": 7}})")));
  try {
    wire::decodeBody(hello, bytes(R"({"worker": 1, "node": "n", "rejoin": {"epoch": 3}})"));
    ADD_FAILURE() << "a rejoin without committed was accepted";
  } catch (const Corruption& e) {
    EXPECT_NE(std::string(e.what()).find("hello message: field 'rejoin.committed' is missing"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(wire::decodeBody(hello, bytes(R"({"worker": 1, "node": "n", "rejoin": 5})")),
               Corruption);
  const uint8_t pipeline = static_cast<uint8_t>(wire::Type::kPipeline);
  EXPECT_THROW(wire::decodeBody(pipeline, bytes(R"({"profile": "{}", "fault_tolerance": 1, )"
                                                R"("microbatches": 4, "max_workers": "many"})")),
               Corruption);
  EXPECT_STREQ(wire::workerTypeName(hello), "hello");
  EXPECT_EQ(wire::coordinatorTypeName(hello), nullptr);
  EXPECT_STREQ(wire::coordinatorTypeName(static_cast<uint8_t>(wire::Type::kEpoch)), "epoch");
  EXPECT_EQ(wire::typeName(0), nullptr);
  EXPECT_EQ(wire::typeName(17), nullptr);
}

}  // namespace
}  // namespace runtime
}  // namespace sinew
