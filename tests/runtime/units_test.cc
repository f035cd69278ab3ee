// The runtime's units in one process: optimizer state turned into named tensors and back
// (runtime/optimizer_state.h), the layer copy manifest's decoder (runtime/layer_copy_manifest.h),
// the Context's preemption request, and the coordinator's message table (runtime/wire.cc)
// against docs/coordinator_protocol.md.

#include <gtest/gtest.h>

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>

#include "../env_support.h"
#include "sinew/base/error.h"
#include "sinew/base/parse.h"
#include "sinew/data.h"
#include "sinew/init.h"
#include "sinew/model.h"
#include "sinew/pipeline/memory_meter.h"
#include "sinew/pipeline/plan.h"
#include "sinew/pipeline/profile.h"
#include "sinew/runtime/control_api.h"
#include "sinew/runtime/detail/wire.h"
#include "sinew/runtime/epoch_recovery.h"
#include "sinew/runtime/goodput_meter.h"
#include "sinew/runtime/job_tensors.h"
#include "sinew/runtime/layer_copy_manifest.h"
#include "sinew/runtime/optimizer_state.h"
#include "sinew/runtime/peer_versions.h"
#include "sinew/runtime/plan_report.h"
#include "sinew/runtime/resident_memory.h"
#include "sinew/runtime/slurm_bootstrap.h"
#include "sinew/runtime/step_update.h"
#include "sinew/runtime/tied_parameters.h"
#include "sinew/schedule.h"
#include "sinew/store.h"

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

TEST(OptimizerStateTest, SgdWithNesterovAndWeightDecayRoundTrips) {
  expectRoundTrip(
      [](std::vector<at::Tensor> ps) {
        return std::make_unique<torch::optim::SGD>(
            ps, torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true).weight_decay(1e-2));
      },
      {"", ".momentum_buffer"});
}

TEST(OptimizerStateTest, AdamWRoundTripsWithAndWithoutAmsgrad) {
  for (bool amsgrad : {false, true}) {
    std::vector<std::string> suffixes = {"", ".exp_avg", ".exp_avg_sq", ".step"};
    if (amsgrad) suffixes.push_back(".max_exp_avg_sq");
    expectRoundTrip(
        [amsgrad](std::vector<at::Tensor> ps) {
          return std::make_unique<torch::optim::AdamW>(
              ps, torch::optim::AdamWOptions(1e-2).weight_decay(0.1).amsgrad(amsgrad));
        },
        suffixes);
  }
}

TEST(OptimizerStateTest, RmspropRoundTripsPlainCenteredAndWithMomentum) {
  expectRoundTrip(
      [](std::vector<at::Tensor> ps) {
        return std::make_unique<torch::optim::RMSprop>(ps, torch::optim::RMSpropOptions(1e-2));
      },
      {"", ".square_avg", ".step"});
  expectRoundTrip(
      [](std::vector<at::Tensor> ps) {
        return std::make_unique<torch::optim::RMSprop>(
            ps, torch::optim::RMSpropOptions(1e-2).momentum(0.9).centered(true));
      },
      {"", ".square_avg", ".momentum_buffer", ".grad_avg", ".step"});
}

TEST(OptimizerStateTest, AdagradRoundTrips) {
  expectRoundTrip(
      [](std::vector<at::Tensor> ps) {
        return std::make_unique<torch::optim::Adagrad>(ps, torch::optim::AdagradOptions(1e-1));
      },
      {"", ".sum", ".step"});
}

// A field the options need (RMSprop's momentum buffer with momentum) missing is Corruption;
// a state with no field at all is a parameter before its first step.
TEST(OptimizerStateTest, RmspropWithoutItsMomentumBufferIsCorruption) {
  auto layers = makeLayers(1);
  torch::optim::RMSprop opt(layers->parameters(), torch::optim::RMSpropOptions(1e-2).momentum(0.5));
  trainSteps(layers, opt, 2, 5);
  Saved saved = snapshot(captureState(layers, opt));
  saved["fc1"].erase("weight.momentum_buffer");
  auto fresh = makeLayers(2);
  torch::optim::RMSprop freshOpt(fresh->parameters(),
                                 torch::optim::RMSpropOptions(1e-2).momentum(0.5));
  try {
    loadState(fresh, freshOpt, saved, "version 4");
    ADD_FAILURE() << "a state without its momentum buffer was loaded";
  } catch (const Corruption& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("version 4, layer 'fc1'"), std::string::npos) << what;
    EXPECT_NE(what.find("torch::optim::RMSprop state without 'weight.momentum_buffer'"),
              std::string::npos)
        << what;
  }
}

// An optimizer whose state Sinew cannot capture is refused, naming its type and the
// supported ones.
TEST(OptimizerStateTest, LbfgsIsRefusedByName) {
  auto layers = makeLayers(1);
  torch::optim::LBFGS opt(layers->parameters(), torch::optim::LBFGSOptions(1));
  EXPECT_FALSE(optimizerStateSupported(opt));
  try {
    optimizerStateCodec(opt, "ModelSpec::optimizer");
    ADD_FAILURE() << "LBFGS was accepted";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("ModelSpec::optimizer made torch::optim::LBFGS"), std::string::npos)
        << what;
    EXPECT_NE(what.find("torch::optim::AdamW"), std::string::npos) << what;
  }
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

// Adam's layout: three tensor fields, then the step count.
StateLayout adamLayout() {
  StateLayout l;
  l.fields = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"};
  l.countField = 3;
  return l;
}

// ---- JobTensors -------------------------------------------------------------------------

// Members of one job in threads, each with one job tensor "@c" whose value after step s is
// {s, 10 s} (made by save) and with every load recorded.
struct JobTensorMember {
  JobTensors jobs;
  std::vector<std::pair<int64_t, at::Tensor>> loads;
  explicit JobTensorMember(bool failSave = false) {
    jobs.add({"@c", at::tensor({-1.0, -10.0}, at::kDouble),
              [failSave](int64_t s) -> at::Tensor {
                if (failSave && s == 3) throw std::runtime_error("cannot count step 3");
                return at::tensor({double(s), 10.0 * s}, at::kDouble);
              },
              [this](int64_t s, const at::Tensor& v) { loads.emplace_back(s, v.clone()); }});
  }
};

// Runs body(rank, communicator) on `world` threads, one Gloo communicator each (epoch `epoch`).
void onMembers(int world, int64_t epoch,
               const std::function<void(int, collectives::Communicator&)>& body) {
  auto store = collectives::makeHashStore();
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(world);
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      try {
        collectives::CommunicatorOptions o;
        for (int m = 0; m < world; ++m) o.members.push_back(m);
        o.self = r;
        o.epoch = epoch;
        o.timeout = std::chrono::seconds(30);
        auto comm = collectives::createGlooCommunicator(store, o);
        body(r, *comm);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

at::Tensor counted(double step) { return at::tensor({step, 10.0 * step}, at::kDouble); }

TEST(JobTensorsTest, ARestoreWhoseEpochFailedIsWhatTheNextEpochAgreesOn) {
  // Every member committed steps 0..9; member 0 then restored its layers' version of step 7
  // (a rollback), and that epoch failed before the members agreed. The next epoch resumes
  // after step 7 again: every member must end with step 7's values, not member 0's step 9.
  // (Before the values followed their step, member 0 counted as live and sent step 9's.)
  std::vector<std::unique_ptr<JobTensorMember>> m;
  for (int r = 0; r < 3; ++r) m.push_back(std::make_unique<JobTensorMember>());
  for (auto& x : m) {
    for (int64_t s = 0; s <= 9; ++s) x->jobs.commit(s);
  }
  EXPECT_TRUE(m[0]->jobs.take({{"@c", counted(7)}}, "version 7", 7));
  EXPECT_EQ(m[0]->jobs.step(), 7);
  onMembers(3, 2, [&](int r, collectives::Communicator& world) {
    m[r]->jobs.agree(world, 7, at::kCPU, std::chrono::seconds(30));
  });
  for (int r = 2; r >= 0; --r) {
    ASSERT_EQ(m[r]->loads.size(), 1u) << "member " << r;
    EXPECT_EQ(m[r]->loads.back().first, 7) << "member " << r;
    EXPECT_TRUE(at::equal(m[r]->loads.back().second, counted(7)))
        << "member " << r << ": " << m[r]->loads.back().second;
    EXPECT_EQ(m[r]->jobs.step(), 7);
  }
  // Its next version carries step 7's values.
  checkpoint::ShardState state(1);
  state[0].name = "fc";
  m[1]->jobs.appendTo(state);
  ASSERT_EQ(state[0].tensors.size(), 1u);
  EXPECT_TRUE(at::equal(state[0].tensors[0].tensor, counted(7)));
}

TEST(JobTensorsTest, MembersThatKnowTheStepKeepTheirsAndThePreferredRootSends) {
  // Members 0 and 2 hold step 4's values (member 2's differ, to see who sends); member 1
  // joined. With member 2 preferred, member 1 gets member 2's values and nobody else loads.
  std::vector<std::unique_ptr<JobTensorMember>> m;
  for (int r = 0; r < 3; ++r) m.push_back(std::make_unique<JobTensorMember>());
  for (int64_t s = 0; s <= 4; ++s) m[0]->jobs.commit(s);
  ASSERT_TRUE(m[2]->jobs.take({{"@c", at::tensor({4.0, 41.0}, at::kDouble)}}, "version 4", 4));
  m[2]->loads.clear();
  onMembers(3, 3, [&](int r, collectives::Communicator& world) {
    m[r]->jobs.agree(world, 4, at::kCPU, std::chrono::seconds(30), /*preferredRoot=*/2);
  });
  EXPECT_TRUE(m[0]->loads.empty());
  EXPECT_TRUE(m[2]->loads.empty());
  ASSERT_EQ(m[1]->loads.size(), 1u);
  EXPECT_TRUE(at::equal(m[1]->loads[0].second, at::tensor({4.0, 41.0}, at::kDouble)));
  // A preferred root that does not know is passed over for the lowest one that does.
  onMembers(3, 4, [&](int r, collectives::Communicator& world) {
    if (r == 1) m[1]->jobs.commit(5);  // Knows step 5 only.
    m[r]->jobs.agree(world, 4, at::kCPU, std::chrono::seconds(30), /*preferredRoot=*/1);
  });
  ASSERT_EQ(m[1]->loads.size(), 2u);
  EXPECT_TRUE(at::equal(m[1]->loads[1].second, counted(4)));
}

TEST(JobTensorsTest, NobodyKnowingChangesNothingAndAVersionWithoutThemIsNotTaken) {
  std::vector<std::unique_ptr<JobTensorMember>> m;
  for (int r = 0; r < 2; ++r) m.push_back(std::make_unique<JobTensorMember>());
  m[0]->jobs.commit(0);
  EXPECT_FALSE(m[1]->jobs.take({{"@other", counted(3)}}, "an old version", 3));
  EXPECT_EQ(m[1]->jobs.step(), -1);
  onMembers(2, 5, [&](int r, collectives::Communicator& world) {
    m[r]->jobs.agree(world, 3, at::kCPU, std::chrono::seconds(30));
  });
  EXPECT_TRUE(m[0]->loads.empty());
  EXPECT_TRUE(m[1]->loads.empty());
  EXPECT_EQ(m[0]->jobs.step(), 0);
  // A restored tensor of another shape names the version and the tensor.
  try {
    m[1]->jobs.take({{"@c", at::zeros({3}, at::kDouble)}}, "durable checkpoint 3", 3);
    ADD_FAILURE() << "took a tensor of another shape";
  } catch (const Corruption& e) {
    EXPECT_NE(std::string(e.what()).find("durable checkpoint 3: the job tensor '@c'"),
              std::string::npos)
        << e.what();
  }
}

TEST(JobTensorsTest, ASaveThatThrowsOrChangesShapeNamesTheEntryAndKeepsTheValues) {
  JobTensorMember m(/*failSave=*/true);
  m.jobs.commit(2);
  try {
    m.jobs.commit(3);
    ADD_FAILURE() << "a throwing save committed";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("'@c' after step 3 failed: cannot count step 3"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(m.jobs.step(), 2);
  checkpoint::ShardState state(1);
  m.jobs.appendTo(state);
  EXPECT_TRUE(at::equal(state[0].tensors[0].tensor, counted(2)));
  JobTensors other;
  other.add({"@x", at::zeros({2}), [](int64_t) { return at::zeros({3}); },
             [](int64_t, const at::Tensor&) {}});
  EXPECT_THROW(other.commit(0), InvalidArgument);
  EXPECT_THROW(other.add({"x", at::zeros({1}), nullptr, nullptr}), InvalidArgument);
}

// ---- srun without MPI (runtime/slurm_bootstrap) -------------------------------------------

TEST(SlurmBootstrapTest, HostListsExpandAsSlurmWritesThem) {
  using V = std::vector<std::string>;
  EXPECT_EQ(expandHostlist("localhost"), V{"localhost"});
  EXPECT_EQ(expandHostlist("a,b[1-3,5],c"), (V{"a", "b1", "b2", "b3", "b5", "c"}));
  EXPECT_EQ(expandHostlist("gpu[08-10]"), (V{"gpu08", "gpu09", "gpu10"}));
  EXPECT_EQ(expandHostlist("r[1-2]-n[1-2]"), (V{"r1-n1", "r1-n2", "r2-n1", "r2-n2"}));
  for (const char* bad : {"", "a,,b", "a[1-", "a]", "a[3-1]", "a[x-2]", "a[]"}) {
    try {
      expandHostlist(bad);
      ADD_FAILURE() << "'" << bad << "' expanded";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("the host list '") + bad + "'"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(SlurmBootstrapTest, ThePortIsTheSameForEveryTaskOfAStepAndInItsRange) {
  const uint16_t p = derivedCoordinatorPort("4242", "0");
  EXPECT_EQ(p, derivedCoordinatorPort("4242", "0"));
  EXPECT_NE(p, derivedCoordinatorPort("4242", "1"));
  EXPECT_NE(p, derivedCoordinatorPort("4243", "0"));
  for (int j = 0; j < 1000; ++j) {
    const uint16_t q = derivedCoordinatorPort(std::to_string(j), "0");
    EXPECT_GE(q, 30000);
    EXPECT_LT(q, 55000);
  }
}

using EnvVars = sinew::testing::ScopedEnv::Vars;
using sinew::testing::ScopedEnv;

std::map<std::string, std::string> srunTask(int rank) {
  return {{"SLURM_JOB_ID", "77"},
          {"SLURM_STEP_ID", "3"},
          {"SLURM_PROCID", std::to_string(rank)},
          {"SLURM_STEP_NUM_TASKS", "4"},
          {"SLURM_LOCALID", "1"},
          {"SLURM_STEP_NODELIST", "n[1-2]"},
          {"SLURMD_NODENAME", "n2"},
          {"OMPI_COMM_WORLD_RANK", ""},
          {"PMI_RANK", ""},
          {"PMIX_RANK", ""},
          {"SINEW_BOOTSTRAP", ""},
          {"SINEW_COORDINATOR_HOST", ""},
          {"SINEW_COORDINATOR_PORT", ""},
          {"SINEW_TOKEN", ""},
          {"SINEW_RENDEZVOUS_DIR", "/shared/rv"},
          {"SLURM_RESTART_COUNT", ""}};
}

TEST(SlurmBootstrapTest, AnSrunTaskIsReadFromItsEnvironmentAndMeetsOnTheFirstNode) {
  ScopedEnv task(srunTask(2));
  std::optional<SlurmStep> step = slurmStepFromEnvironment();
  ASSERT_TRUE(step.has_value());
  EXPECT_EQ(step->rank, 2);
  EXPECT_EQ(step->size, 4);
  EXPECT_EQ(step->localRank, 1);
  EXPECT_EQ(step->nodes, (std::vector<std::string>{"n1", "n2"}));
  EXPECT_EQ(step->nodeName, "n2");
  SlurmRendezvous rv = slurmRendezvous(*step);
  EXPECT_EQ(rv.host, "");  // Rank 0's address, which it writes to the rendezvous file.
  EXPECT_EQ(rv.port, 0);   // A free one, also in the file.
  EXPECT_EQ(rv.portFrom, "free");
  EXPECT_EQ(rv.token, 0u);
  EXPECT_EQ(rv.file, "/shared/rv/slurm-77.3.0.rendezvous");
  {
    // No shared folder: the token in the environment, the port derived, the first node.
    ScopedEnv given(EnvVars{{"SINEW_TOKEN", "abc123"}, {"SLURM_RESTART_COUNT", "2"}});
    rv = slurmRendezvous(*step);
    EXPECT_EQ(rv.token, 0xabc123u);
    EXPECT_EQ(rv.port, derivedCoordinatorPort("77", "3"));
    EXPECT_EQ(rv.portFrom, "derived from job 77 step 3");
    EXPECT_EQ(rv.host, "");  // The step's first node, n1.
    EXPECT_EQ(rv.file, "/shared/rv/slurm-77.3.2.rendezvous");
  }
  {
    ScopedEnv given(
        EnvVars{{"SINEW_COORDINATOR_PORT", "40001"}, {"SINEW_COORDINATOR_HOST", "10.0.0.5"}});
    rv = slurmRendezvous(*step);
    EXPECT_EQ(rv.port, 40001);
    EXPECT_EQ(rv.portFrom, "SINEW_COORDINATOR_PORT");
    EXPECT_EQ(rv.host, "10.0.0.5");
  }
  // MPI meets the ranks under mpirun and srun --mpi=pmix, or when asked to.
  for (const char* mpi : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
    ScopedEnv underMpi(EnvVars{{mpi, "2"}});
    EXPECT_FALSE(slurmStepFromEnvironment().has_value()) << mpi;
  }
  {
    ScopedEnv asked(EnvVars{{"SINEW_BOOTSTRAP", "mpi"}});
    EXPECT_FALSE(slurmStepFromEnvironment().has_value());
  }
  // A batch script's environment (no step of srun's) is no task.
  {
    ScopedEnv batch(EnvVars{{"SLURM_STEP_ID", ""}, {"SLURM_STEP_NUM_TASKS", ""}});
    EXPECT_FALSE(slurmStepFromEnvironment().has_value());
    ScopedEnv insist(EnvVars{{"SINEW_BOOTSTRAP", "slurm"}});
    try {
      slurmStepFromEnvironment();
      ADD_FAILURE() << "a step without SLURM_STEP_NUM_TASKS";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("SLURM_STEP_NUM_TASKS is not set"), std::string::npos)
          << e.what();
    }
  }
  for (const auto& [var, value] :
       std::vector<std::pair<std::string, std::string>>{{"SLURM_PROCID", "4"},
                                                        {"SLURM_PROCID", "x"},
                                                        {"SLURM_STEP_NUM_TASKS", "0"},
                                                        {"SLURM_STEP_NODELIST", "n[2-1]"},
                                                        {"SINEW_BOOTSTRAP", "pmi"}}) {
    ScopedEnv bad(EnvVars{{var, value}});
    try {
      slurmStepFromEnvironment();
      ADD_FAILURE() << var << "=" << value << " was taken";
    } catch (const InvalidArgument& e) {
      const std::string what = e.what();
      EXPECT_TRUE(what.find(var) != std::string::npos || what.find(value) != std::string::npos)
          << what;
    }
  }
  {
    ScopedEnv badToken(EnvVars{{"SINEW_TOKEN", "nothex"}});
    EXPECT_THROW(slurmRendezvous(*step), InvalidArgument);
  }
}

TEST(SlurmBootstrapTest, TheRendezvousFileIsTheUsersOnlyAndABadOrMissingOneIsNamed) {
  const std::string dir = ::testing::TempDir() + "sinew-rv-" + std::to_string(::getpid());
  const std::string path = dir + "/a/slurm-1.0.0.rendezvous";
  writeRendezvousFile(path, {"10.1.2.3", 40123, 0x1234abcdULL});
  struct stat st {};
  ASSERT_EQ(::stat((dir + "/a").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u);
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  RendezvousRecord r = readRendezvousFile(path, std::chrono::milliseconds(10));
  EXPECT_EQ(r.host, "10.1.2.3");
  EXPECT_EQ(r.port, 40123);
  EXPECT_EQ(r.token, 0x1234abcdULL);
  for (const char* bad : {"garbage\n", "10.1.2.3 0 1234\n", "10.1.2.3 40123 zz\n",
                          "10.1.2.3 40123 1234 more\n", "\n"}) {
    std::ofstream(path) << bad;
    try {
      readRendezvousFile(path, std::chrono::milliseconds(10));
      ADD_FAILURE() << "read '" << bad << "'";
    } catch (const Corruption& e) {
      EXPECT_NE(std::string(e.what()).find("the rendezvous file " + path), std::string::npos)
          << e.what();
    }
  }
  ::unlink(path.c_str());
  const auto t0 = std::chrono::steady_clock::now();
  try {
    readRendezvousFile(path, std::chrono::milliseconds(300));
    ADD_FAILURE() << "read a missing rendezvous file";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("SINEW_TOKEN"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_EQ(addressOf("localhost"), "127.0.0.1");
  EXPECT_THROW(addressOf("no-such-host.invalid"), IoError);
  ::rmdir((dir + "/a").c_str());
  ::rmdir(dir.c_str());
}

TEST(LayerCopyManifestTest, EncodesAndDecodes) {
  const StateLayout layout = adamLayout();
  LayerCopyManifest m;
  m.parameters = {{0b1011, 12}, {0b1111, 3}, {0b0011, 0}, {0, 0}};
  m.crc32c = 0xFFFFFFFFu;
  std::vector<int64_t> words = m.encode();
  ASSERT_EQ(words.size(), 9u);
  EXPECT_EQ(words[4], 12);  // Counts follow the field masks; the checksum is last.
  EXPECT_EQ(words[8], 0xFFFFFFFFll);
  LayerCopyManifest back =
      LayerCopyManifest::decode(words.data(), words.size(), 4, layout, "layer 'x'");
  ASSERT_EQ(back.parameters.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(back.parameters[i].fields, m.parameters[i].fields);
    EXPECT_EQ(back.parameters[i].count, m.parameters[i].count);
  }
  EXPECT_EQ(back.crc32c, m.crc32c);
  EXPECT_EQ(LayerCopyManifest::tensorSuffixes(m.parameters[1].fields, layout),
            (std::vector<std::string>{"", ".exp_avg", ".exp_avg_sq", ".max_exp_avg_sq"}));
  EXPECT_EQ(LayerCopyManifest::tensorSuffixes(m.parameters[0].fields, layout),
            (std::vector<std::string>{"", ".exp_avg", ".exp_avg_sq"}));
  EXPECT_EQ(LayerCopyManifest::tensorSuffixes(0, layout), (std::vector<std::string>{""}));
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
      {{16, 0, 0}, 1, "field mask 16 for parameter 0; the optimizer's state has 4 fields"},
      {{-1, 0, 0}, 1, "field mask -1"},
      {{0, 32, 0, 0, 0}, 2, "field mask 32 for parameter 1"},
      {{9, -4, 0}, 1, "count -4"},
      {{3, 7, 0}, 1, "count 7 for parameter 0, whose state has no count"},
      {{0, 0, int64_t{1} << 32}, 1, "checksum word 4294967296"},
      {{0, 0, -1}, 1, "checksum word -1"},
  };
  for (const Case& c : cases) {
    try {
      LayerCopyManifest::decode(c.words.data(), c.words.size(), c.parameters, adamLayout(),
                                "layer 'h3' from worker 2");
      ADD_FAILURE() << "accepted: " << c.says;
    } catch (const Corruption& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("the manifest of layer 'h3' from worker 2"), std::string::npos) << what;
      EXPECT_NE(what.find(c.says), std::string::npos) << what;
    }
  }
  // A layout without a count (SGD's): no count is valid.
  StateLayout sgd;
  sgd.fields = {"momentum_buffer"};
  const std::vector<int64_t> withCount = {1, 2, 0};
  EXPECT_THROW(LayerCopyManifest::decode(withCount.data(), 3, 1, sgd, "x"), Corruption);
  const std::vector<int64_t> fine = {1, 0, 0};
  EXPECT_EQ(LayerCopyManifest::decode(fine.data(), 3, 1, sgd, "x").parameters[0].fields, 1);
}

TEST(ScheduleTest, WarmupCosineStepDecayAndConstantGiveTheirRates) {
  LrSchedule cosine = warmupCosine(1.0, 4, 14, 0.1);
  EXPECT_DOUBLE_EQ(cosine(0), 0.25);  // warm-up: (s + 1) / 4
  EXPECT_DOUBLE_EQ(cosine(3), 1.0);
  EXPECT_DOUBLE_EQ(cosine(4), 1.0);   // the cosine starts at the peak
  EXPECT_DOUBLE_EQ(cosine(9), 0.55);  // half way: (peak + min) / 2
  EXPECT_DOUBLE_EQ(cosine(14), 0.1);
  EXPECT_DOUBLE_EQ(cosine(1000), 0.1);
  EXPECT_DOUBLE_EQ(warmupCosine(2.0, 0, 10)(0), 2.0);
  LrSchedule decay = stepDecay(0.8, 3, 0.5);
  EXPECT_DOUBLE_EQ(decay(2), 0.8);
  EXPECT_DOUBLE_EQ(decay(3), 0.4);
  EXPECT_DOUBLE_EQ(decay(7), 0.2);
  EXPECT_DOUBLE_EQ(constantLr(0.3)(12345), 0.3);
  EXPECT_THROW(warmupCosine(1.0, 5, 4), InvalidArgument);
  EXPECT_THROW(warmupCosine(0.1, 0, 4, 0.2), InvalidArgument);
  EXPECT_THROW(stepDecay(0.1, 0, 0.5), InvalidArgument);
  EXPECT_THROW(constantLr(-1), InvalidArgument);
  EXPECT_THROW(constantLr(std::nan("")), InvalidArgument);
}

// A schedule that gives NaN or a negative rate, or a clip value <= 0, is refused before
// training, naming the step and the value.
TEST(ScheduleTest, BadRatesAndClipValuesAreRefusedNamingThem) {
  auto expectRefused = [](const TrainerOptions& o, const std::string& says) {
    try {
      checkStepUpdateOptions(o);
      ADD_FAILURE() << "accepted: " << says;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  TrainerOptions o;
  o.steps = 10;
  o.lrSchedule = [](int64_t s) { return s == 3 ? std::nan("") : 0.1; };
  expectRefused(o, "gave learning rate nan for step 3");
  o.lrSchedule = [](int64_t s) { return 0.1 - 0.02 * static_cast<double>(s); };
  expectRefused(o, "gave learning rate -0.02 for step 6");
  o.lrSchedule = {};
  o.clipGradNorm = 0.0;
  expectRefused(o, "TrainerOptions::clipGradNorm = 0 must be finite and > 0");
  o.clipGradNorm = -1.0;
  expectRefused(o, "TrainerOptions::clipGradNorm = -1");
  o.clipGradNorm = 1.0;
  o.lrSchedule = warmupCosine(0.1, 2, 10);
  EXPECT_NO_THROW(checkStepUpdateOptions(o));
  // Beyond the steps checked up front, the step itself refuses it.
  EXPECT_THROW(scheduledRate([](int64_t) { return -1.0; }, 1 << 21), InvalidArgument);
}

// The norm of gradients split over two holders, summed as the trainer sums them, clips them
// exactly as clip_grad_norm_ clips them in one process.
TEST(ClipTest, SplitGradientsClipAsClipGradNormDoes) {
  auto layers = makeLayers(1);
  auto copy = makeLayers(1);
  for (auto* l : {&layers, &copy}) {
    torch::manual_seed(3);
    (*l)->forward(at::randn({5, 4})).pow(2).sum().backward();
  }
  auto first = layers[0]->parameters(), second = layers[2]->parameters();
  const double squares = squaredGradientNorm(first) + squaredGradientNorm(second);
  const double norm = std::sqrt(squares);
  ASSERT_GT(norm, 0.5);  // so that clipping at 0.5 does something
  const double factor = clipFactor(norm, 0.5);
  scaleGradients(first, factor);
  scaleGradients(second, factor);
  const double expected = torch::nn::utils::clip_grad_norm_(copy->parameters(), 0.5);
  EXPECT_NEAR(norm, expected, 1e-6 * expected);
  auto pa = layers->named_parameters(), pb = copy->named_parameters();
  for (const auto& p : pa) {
    EXPECT_TRUE(at::allclose(p.value().grad(), pb[p.key()].grad(), 1e-6, 0)) << p.key();
  }
  EXPECT_EQ(clipFactor(0.1, 0.5), 1.0);
  EXPECT_EQ(clipFactor(std::numeric_limits<double>::infinity(), 0.5), 1.0);
}

// Gradients summed in buckets: every trainable gradient reduced exactly once, in the
// parameters' order; small ones packed into flat tensors of at most the bucket's size, a large
// contiguous one reduced in place (no copy of it), a missing gradient made zeros, a frozen
// parameter left without one.
TEST(ReduceInBucketsTest, PacksSmallGradientsAndReducesLargeOnesInPlace) {
  const int64_t bucket = 64 * 4;  // 64 floats
  std::vector<at::Tensor> params;
  for (int64_t n : {10, 20, 40, 100, 30, 64, 5}) {
    params.push_back(at::ones({n}).requires_grad_(true));
    params.back().mutable_grad() = at::full({n}, static_cast<double>(n));
  }
  params[4].mutable_grad() = at::Tensor();  // no gradient yet
  params.push_back(at::ones({7}));          // frozen
  const void* large = params[3].grad().data_ptr();
  const void* exact = params[5].grad().data_ptr();
  std::vector<int64_t> sizes;
  std::vector<const void*> where;
  reduceInBuckets(params, bucket, [&](at::Tensor& t) {
    sizes.push_back(t.numel());
    where.push_back(t.data_ptr());
    t.mul_(2);
  });
  // 10 + 20 fill 30 of 64; 40 would overflow: flushed. 40 alone; 100 in place; 30 (zeros);
  // 64 (= the bucket) in place; 5.
  EXPECT_EQ(sizes, (std::vector<int64_t>{30, 40, 100, 30, 64, 5}));
  EXPECT_EQ(where[2], large);
  EXPECT_EQ(where[4], exact);
  for (int i : {0, 1, 2, 3, 5, 6}) {
    const double n = static_cast<double>(params[i].numel());
    EXPECT_TRUE(at::equal(params[i].grad(), at::full({params[i].numel()}, 2 * n))) << i;
  }
  ASSERT_TRUE(params[4].grad().defined());
  EXPECT_TRUE(at::equal(params[4].grad(), at::zeros({30})));
  EXPECT_FALSE(params[7].grad().defined());
  // A tail (a loss sum) rides in the last bucket: no reduction of its own.
  sizes.clear();
  at::Tensor tail = at::full({1}, 3.0);
  reduceInBuckets(
      params, bucket,
      [&](at::Tensor& t) {
        sizes.push_back(t.numel());
        t.mul_(2);
      },
      tail);
  EXPECT_EQ(sizes, (std::vector<int64_t>{30, 40, 100, 30, 64, 6}));
  EXPECT_EQ(tail.item<double>(), 6.0);
  EXPECT_TRUE(at::equal(params[6].grad(), at::full({5}, 20.0)));
}

// Epoch sampling visits every sample exactly once per epoch, for batches that do and do not
// divide the dataset, in another order each epoch and for each seed.
TEST(DataTest, EpochBatchIndicesVisitEverySampleOncePerEpoch) {
  for (int64_t n : {1, 2, 7, 64, 100, 1000}) {
    for (int64_t batch : {1, 8, 33, 64}) {
      std::vector<int64_t> seen;
      for (int64_t step = 0; static_cast<int64_t>(seen.size()) < 3 * n; ++step) {
        EXPECT_EQ(epochOfStep(step, batch, n), step * batch / n);
        for (int64_t i : epochBatchIndices(5, step, batch, n)) seen.push_back(i);
      }
      for (int64_t e = 0; e < 3; ++e) {
        std::vector<int64_t> epoch(seen.begin() + e * n, seen.begin() + (e + 1) * n);
        std::vector<int64_t> order = epoch;
        std::sort(epoch.begin(), epoch.end());
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(epoch[i], i) << "n " << n << " batch " << batch << " epoch " << e;
        }
        if (n >= 7) {
          std::vector<int64_t> next(n);
          for (int64_t p = 0; p < n; ++p) next[p] = epochOrder(5, e + 1, p, n);
          EXPECT_NE(order, next) << "epochs " << e << " and " << e + 1 << " in the same order";
        }
      }
    }
  }
  EXPECT_NE(epochBatchIndices(1, 0, 64, 1000), epochBatchIndices(2, 0, 64, 1000));
  EXPECT_EQ(batchIndices(Sampling::kEpochs, 3, 4, 16, 50), epochBatchIndices(3, 4, 16, 50));
  EXPECT_EQ(batchIndices(Sampling::kWithReplacement, 3, 4, 16, 50),
            globalBatchIndices(3, 4, 16, 50));
  EXPECT_THROW(epochBatchIndices(1, -1, 4, 10), InvalidArgument);
  EXPECT_THROW(epochBatchIndices(1, 0, 4, 0), InvalidArgument);
}

std::string tempPath(const std::string& name) {
  return (std::filesystem::temp_directory_path() /
          ("sinew-units-" + std::to_string(::getpid()) + "-" + name))
      .string();
}

TEST(DataTest, TokenFileWindowsAreNextTokenPairs) {
  for (int width : {2, 4}) {
    const std::string path = tempPath("tokens-" + std::to_string(width));
    std::vector<int64_t> tokens;
    for (int64_t i = 0; i < 23; ++i) tokens.push_back(width == 2 ? 65000 - i : 70000 + 3 * i);
    TokenFile::write(path, tokens, width);
    TokenFile file(path, width);
    ASSERT_EQ(file.tokens(), 23);
    EXPECT_EQ(file.token(22), tokens[22]);
    EXPECT_EQ(file.windows(5), 4);  // 4 windows of 5, each with the token after it
    Dataset all = file.dataset(5);
    Sample s = all(3);
    EXPECT_EQ(s.input.scalar_type(), at::kLong);
    for (int64_t k = 0; k < 5; ++k) {
      EXPECT_EQ(s.input[k].item<int64_t>(), tokens[15 + k]);
      EXPECT_EQ(s.target[k].item<int64_t>(), tokens[16 + k]);
    }
    Dataset heldOut = file.dataset(5, 3, 1);  // the last window as a held-out split
    EXPECT_TRUE(at::equal(heldOut(0).input, s.input));
    EXPECT_THROW(heldOut(1), InvalidArgument);
    EXPECT_THROW(file.dataset(5, 2, 3), InvalidArgument);
    std::filesystem::remove(path);
  }
}

// A file whose size is not a multiple of the token width, a width other than 2 or 4, a
// missing file and a token that does not fit are refused, naming the path and what is wrong.
TEST(DataTest, BadTokenFilesAreRefusedByName) {
  const std::string path = tempPath("odd");
  { std::ofstream(path, std::ios::binary) << "abcde"; }  // 5 bytes
  try {
    TokenFile file(path, 2);
    ADD_FAILURE() << "a 5-byte file of 2-byte tokens was opened";
  } catch (const InvalidArgument& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("'" + path +
                        "' has 5 bytes, which is not a positive multiple of its "
                        "token width of 2 bytes"),
              std::string::npos)
        << what;
  }
  EXPECT_THROW(TokenFile(path, 3), InvalidArgument);
  std::filesystem::remove(path);
  try {
    TokenFile file(path, 2);
    ADD_FAILURE() << "a missing file was opened";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("'" + path + "' cannot be opened"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(TokenFile::write(path, {1, 70000}, 2), InvalidArgument);
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
// JSON nested deeper than sinew::detail::kMaxJsonDepth (64) is refused before it is parsed:
// formatting or walking a value nested 200,000 deep recursed that deep (an error message's
// dump()) and crashed the process. Brackets inside strings do not count.
TEST(DeepJsonTest, DepthIsCountedOutsideStringsUpToTheLimit) {
  using sinew::detail::jsonTooDeep;
  const auto nested = [](int n) { return std::string(n, '[') + std::string(n, ']'); };
  EXPECT_FALSE(jsonTooDeep(nested(64)));
  EXPECT_TRUE(jsonTooDeep(nested(65)));
  EXPECT_TRUE(jsonTooDeep(std::string(65, '{')));  // Unbalanced: still too deep.
  EXPECT_FALSE(jsonTooDeep("[\"" + std::string(1000, '[') + "\"]"));
  EXPECT_FALSE(
      jsonTooDeep(R"(["\"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["])"));
  EXPECT_TRUE(jsonTooDeep(R"([{"a": "\\"}, )" + nested(64) + "]"));  // The string ends at \\".
  EXPECT_FALSE(jsonTooDeep(nested(20), 20));
  EXPECT_TRUE(jsonTooDeep(nested(21), 20));
}

// Every parser of text from outside the process: a coordinator message, a control request, a
// profile, a plan; each one a document 200,000 deep, and one nested inside an otherwise valid
// document. Each is the parser's own error type naming the limit. (Before, the deep hello
// message crashed the test process in the error message's dump().)
TEST(DeepJsonTest, EveryParserRefusesDeepDocumentsNamingTheLimit) {
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  const std::string deepObject = [] {
    std::string s;
    for (int i = 0; i < 100000; ++i) s += "{\"a\":";
    s += "1";
    for (int i = 0; i < 100000; ++i) s += "}";
    return s;
  }();
  const auto says = [](const std::function<void()>& f, const std::string& label) {
    try {
      f();
      ADD_FAILURE() << label << ": accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("nests JSON deeper than 64 levels"), std::string::npos)
          << label << ": " << e.what();
    }
  };
  const auto bytes = [](const std::string& t) { return std::vector<uint8_t>(t.begin(), t.end()); };
  const uint8_t hello = static_cast<uint8_t>(wire::Type::kHello);
  says([&] { wire::decodeBody(hello, bytes(deep)); }, "hello, deep array");
  says([&] { wire::decodeBody(hello, bytes(R"({"worker": 1, "node": )" + deepObject + "}")); },
       "hello, deep node");
  EXPECT_THROW(wire::decodeBody(hello, bytes(deep)), Corruption);
  says([&] { runtime::control::parseObject(deep); }, "control request");
  EXPECT_THROW(runtime::control::parseObject(deepObject), InvalidArgument);
  says([&] { pipeline::parseProfileJson(deep); }, "profile");
  says([&] { pipeline::parseProfileJson(R"({"layers": )" + deepObject + "}"); }, "profile field");
  says([&] { pipeline::planFromJson(deepObject); }, "plan");
}

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
  EXPECT_STREQ(wire::typeName(17), "withdraw");
  EXPECT_EQ(wire::typeName(18), nullptr);
}

// The plan event gives each worker the cost model's memory for its stage: parameters,
// gradients and optimizer state of its layers, and the activations of the microbatches 1F1B
// keeps in flight at its position, split over the stage's width. The optimizer bytes of a
// measured profile count the gradient and the optimizer's state tensors.
// Peer-RAM versions: pipeline 0's first worker of each stage owns a shard; every other worker
// that holds layers holds copies of them and partners an owner whose layers it does not hold.
TEST(PeerPlacementTest, OwnersArePipelineZerosStagesEachPartneredByAHolderOfOtherLayers) {
  auto plan = [](std::vector<std::array<int, 5>> ws) {  // worker, pipeline, stage, first, end
    pipeline::Plan p;
    for (const auto& w : ws) {
      pipeline::WorkerAssignment a;
      a.worker = w[0];
      a.pipeline = w[1];
      a.stage = w[2];
      a.firstLayer = w[3];
      a.endLayer = w[4];
      p.workers.push_back(a);
    }
    return p;
  };
  using runtime::PeerVersions;
  // Two pipelines of two stages (workers listed out of order).
  pipeline::Plan two = plan({{3, 1, 1, 4, 8}, {0, 0, 0, 0, 4}, {2, 1, 0, 0, 4}, {1, 0, 1, 4, 8}});
  EXPECT_TRUE(PeerVersions::ownsShard(two, 0));
  EXPECT_TRUE(PeerVersions::ownsShard(two, 1));
  EXPECT_FALSE(PeerVersions::ownsShard(two, 2));
  EXPECT_FALSE(PeerVersions::ownsShard(two, 3));
  EXPECT_EQ(PeerVersions::placementOrder(two, 2), (std::vector<int>{0, 3, 1, 2}));
  // m = 3: each owner takes two partners where there are; those left go last.
  EXPECT_EQ(PeerVersions::placementOrder(two, 3), (std::vector<int>{0, 3, 1, 2}));
  // One pipeline: the stages in order, as before.
  pipeline::Plan one = plan({{5, 0, 2, 6, 9}, {4, 0, 0, 0, 3}, {7, 0, 1, 3, 6}});
  EXPECT_EQ(PeerVersions::placementOrder(one, 2), (std::vector<int>{4, 7, 5}));
  // Pipelines of different lengths (4 and 3 stages over 10 layers), a stage two workers wide
  // (worker 9 shares stage 1 of pipeline 0 with worker 1: not an owner, nor 1's partner), and
  // an idle worker (no layers: not in the placement).
  pipeline::Plan mixed = plan({{0, 0, 0, 0, 2},
                               {1, 0, 1, 2, 5},
                               {9, 0, 1, 2, 5},
                               {2, 0, 2, 5, 7},
                               {3, 0, 3, 7, 10},
                               {4, 1, 0, 0, 3},
                               {5, 1, 1, 3, 6},
                               {6, 1, 2, 6, 10},
                               {8, 2, 0, 0, 0}});
  EXPECT_FALSE(PeerVersions::ownsShard(mixed, 9));
  EXPECT_FALSE(PeerVersions::ownsShard(mixed, 8));
  // The others by pipeline, then stage: 9, 4, 5, 6. 0 [0,2) -> 9 [2,5); 1 [2,5) -> 6 [6,10);
  // 2 [5,7) -> 4 [0,3); 3 [7,10) -> 5 [3,6).
  EXPECT_EQ(PeerVersions::placementOrder(mixed, 2), (std::vector<int>{0, 9, 1, 6, 2, 4, 3, 5}));
}

TEST(PlanReportTest, EachWorkerHasItsStagesPredictedMemory) {
  pipeline::Profile profile;
  profile.job.devices_per_node = 2;
  profile.job.device_memory_bytes = 1 << 20;
  for (int64_t act : {12, 20}) {
    pipeline::LayerCost c;
    c.name = "l" + std::to_string(act);
    c.forward_ns = c.backward_ns = 1000;
    c.param_bytes = 100;
    c.optimizer_bytes = 300;
    c.activation_bytes = act;
    c.output_bytes = 8;
    profile.layers.push_back(c);
  }
  pipeline::Plan plan;
  plan.numLayers = 2;
  plan.microbatchesPerStep = 4;
  plan.pipelines = {pipeline::PipelinePlan{2, {0, 1}, 4, 0}};
  plan.workers = {{0, 0, 0, 0, 0, 0, 1, {}}, {1, 0, 1, 0, 0, 0, 1, {}}, {2, 1, 0, 0, 1, 1, 2, {}}};
  ModelSpec spec;
  spec.layers = {{"l12", nullptr}, {"l20", nullptr}};
  const PlanReport r = reportPlan(plan, spec, 3, 0.5, &profile);
  const auto& stages = r.event.at("pipelines").at(0).at("stages");
  ASSERT_EQ(stages.size(), 3u);
  EXPECT_EQ(stages[0].at("memory_bytes"), 400 + 2 * 6);  // Width 2, two microbatches in flight.
  EXPECT_EQ(stages[1].at("memory_bytes"), 400 + 2 * 6);
  EXPECT_EQ(stages[2].at("memory_bytes"), 400 + 1 * 20);  // The last stage keeps one.
  EXPECT_FALSE(reportPlan(plan, spec, 3, 0.5)
                   .event.at("pipelines")[0]["stages"][0]
                   .contains("memory_bytes"));
  auto adamw = torch::optim::AdamW({at::zeros({2}, at::kFloat)});
  EXPECT_EQ(stateBytesPerParameterByte(adamw), 3);
  auto amsgrad = torch::optim::Adam({at::zeros({2})}, torch::optim::AdamOptions(0.1).amsgrad(true));
  EXPECT_EQ(stateBytesPerParameterByte(amsgrad), 4);
  auto sgd = torch::optim::SGD({at::zeros({2})}, torch::optim::SGDOptions(0.1));
  EXPECT_EQ(stateBytesPerParameterByte(sgd), 1);
  auto momentum = torch::optim::SGD({at::zeros({2})}, torch::optim::SGDOptions(0.1).momentum(0.9));
  EXPECT_EQ(stateBytesPerParameterByte(momentum), 2);
}

// A member whose epochs keep failing to build asks for the next one ever more slowly: none
// before its first retry, then 50 ms doubling to 2 s (before: at once, every time; a flooded
// store made 6,805 epochs in 60 s).
TEST(EpochRecoveryTest, RebuildRequestsBackOffFrom50MsTo2S) {
  using std::chrono::milliseconds;
  EXPECT_EQ(rebuildBackoff(0), milliseconds(0));
  EXPECT_EQ(rebuildBackoff(1), milliseconds(0));
  EXPECT_EQ(rebuildBackoff(2), milliseconds(50));
  EXPECT_EQ(rebuildBackoff(3), milliseconds(100));
  EXPECT_EQ(rebuildBackoff(7), milliseconds(1600));
  EXPECT_EQ(rebuildBackoff(8), milliseconds(2000));
  EXPECT_EQ(rebuildBackoff(1000000), milliseconds(2000));
}

// The optimizer step's temporaries, measured through the CPU allocator: libtorch's AdamW makes
// the square root of its second moment and the quotient (2 x the parameter), plain SGD
// updates in place (0).
TEST(OptimizerStateTest, TheStepsTemporariesAreMeasuredPerParameterByte) {
  const double adamw = measureStepWorkspacePerParameterByte(sinew::adamw(0.01), at::kFloat);
  EXPECT_GE(adamw, 1.99);
  EXPECT_LE(adamw, 2.1);
  EXPECT_LE(measureStepWorkspacePerParameterByte(sinew::sgd(0.1), at::kFloat), 0.05);
  const double f64 = measureStepWorkspacePerParameterByte(sinew::adamw(0.01), at::kDouble);
  EXPECT_GE(f64, 1.99);
}

// Data parallel sums a tied pair's gradients into the owner's gradient in place and copies
// the sum into the follower's: for a model whose largest tensor is a tied embedding, no
// second or third copy of it (before: a clone for the sum and one for the follower, 2 x the
// tensor in flight).
TEST(TiedParametersTest, SummingTiedGradientsAllocatesNothingWhenBothHaveGradients) {
  ModelSpec spec;
  spec.layers = {{"embed", [] { return torch::nn::AnyModule(torch::nn::Linear(256, 512)); }},
                 {"head", [] { return torch::nn::AnyModule(torch::nn::Linear(256, 512)); }}};
  spec.tied = {{"embed.weight", "head.weight"}};
  const std::vector<Tie> ties = resolveTies(spec);
  torch::nn::Sequential model = buildUntiedLayers(spec, 1, at::kFloat, 0, 2);
  at::Tensor owner = tiedParameter(*model[0], "weight", 0, "embed");
  at::Tensor follower = tiedParameter(*model[1], "weight", 1, "head");
  owner.mutable_grad() = at::full_like(owner, 1.5);
  follower.mutable_grad() = at::full_like(follower, 0.25);
  const void* ownerGrad = owner.grad().data_ptr();
  pipeline::CpuMemoryMeter meter;
  ASSERT_TRUE(meter.installed());
  const int64_t before = meter.live();
  meter.resetPeak();
  sumTiedGradients(model, ties);
  EXPECT_LT(meter.peak() - before, owner.numel() * 4 / 4) << "a copy of the tied gradient";
  EXPECT_EQ(owner.grad().data_ptr(), ownerGrad);
  EXPECT_TRUE(owner.grad().equal(at::full_like(owner, 1.75)));
  EXPECT_TRUE(follower.grad().equal(at::full_like(follower, 1.75)));
  EXPECT_NE(follower.grad().data_ptr(), owner.grad().data_ptr());
  // A follower without a gradient gets its own copy of the sum.
  follower.mutable_grad().reset();
  sumTiedGradients(model, ties);
  EXPECT_TRUE(follower.grad().equal(owner.grad()));
  EXPECT_NE(follower.grad().data_ptr(), owner.grad().data_ptr());
}

// With phases, each phase's peak is what was resident at its highest while it ran: 64 MiB
// touched and freed in one phase show in that phase and in the training peak, not in the next.
TEST(ResidentMemoryTest, EachPhaseGetsItsOwnPeak) {
  ResidentMemory rss(/*byPhase=*/true);
  rss.startTraining();
  if (rss.trainingPeak() < 0) GTEST_SKIP() << "/proc/self/clear_refs cannot be written here";
  constexpr size_t kBytes = size_t{64} << 20;
  rss.phase("small");
  rss.phase("big");
  {
    // Mapped and unmapped directly: freed through malloc, the pages could stay resident (an
    // allocator's cache, ASan's quarantine).
    void* p = ::mmap(nullptr, kBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(p, MAP_FAILED);
    std::memset(p, 1, kBytes);  // every page written
    ASSERT_EQ(::munmap(p, kBytes), 0);
  }
  rss.phase("after");
  const std::map<std::string, int64_t> phases = rss.byPhase();
  ASSERT_EQ(phases.size(), 3u);
  EXPECT_GE(phases.at("big") - phases.at("small"), static_cast<int64_t>(kBytes) * 3 / 4);
  EXPECT_GE(phases.at("big") - phases.at("after"), static_cast<int64_t>(kBytes) * 3 / 4);
  EXPECT_GE(rss.trainingPeak(), phases.at("big"));
  EXPECT_GE(rss.lifetimePeak(), rss.trainingPeak());
  ResidentMemory off(/*byPhase=*/false);
  off.phase("ignored");
  EXPECT_TRUE(off.byPhase().empty());
}

// The coordinator's live account, on a hand-computed timeline (seconds): commits at 0 (the
// clock starts), 1, 2, 3; a loss noticed at 3.4 (0.4 s redone) and its epoch, the first commit
// after it at 5.4 (1 s step, 1 s reconfiguration), 6.4; a join's epoch at 6.4, its first
// commit at 7.9 (0.5 s reconfiguration); a loss at 8.3 (0.4 s redone), its epoch, then a
// rollback of two steps (their 2 s move to rollback) whose epoch forms at 8.8 (0.5 s
// reconfiguration before it) and commits at 10.8 (1 s step, 1 s rollback); at 11.3 a step is
// in flight (0.5 s training so far).
TEST(GoodputMeterTest, AccountsForEverySecondByCause) {
  using Clock = GoodputMeter::Clock;
  const Clock::time_point t0 = Clock::now();
  auto at = [&](double s) {
    return t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(s));
  };
  GoodputMeter m;
  m.onEpoch(at(0));  // before the first commit: start-up, not counted
  for (double t : {0.0, 1.0, 2.0, 3.0}) m.onCommit(at(t), 64);
  m.onLoss(at(3.4));
  m.onEpoch(at(3.4));
  m.onCommit(at(5.4), 64);
  m.onCommit(at(6.4), 64);
  m.onEpoch(at(6.4));
  m.onCommit(at(7.9), 64);
  m.onLoss(at(8.3));
  m.onEpoch(at(8.3));
  m.onRollback(2);
  m.onEpoch(at(8.8));  // the rollback's
  m.onCommit(at(10.8), 64);
  const GoodputMeter::Account a = m.at(at(11.3));
  EXPECT_NEAR(a.wall_s, 11.3, 1e-6);
  EXPECT_NEAR(a.samples, 5 * 64, 1e-9);
  EXPECT_NEAR(a.seconds[GoodputMeter::kTraining], 5.5, 1e-6);
  EXPECT_NEAR(a.seconds[GoodputMeter::kRedone], 0.8, 1e-6);
  EXPECT_NEAR(a.seconds[GoodputMeter::kReconfiguration], 2.0, 1e-6);
  EXPECT_NEAR(a.seconds[GoodputMeter::kRollback], 3.0, 1e-6);
  double sum = 0;
  for (double s : a.seconds) sum += s;
  EXPECT_NEAR(sum, a.wall_s, 1e-6);
  EXPECT_STREQ(GoodputMeter::causeName(GoodputMeter::kRollback), "rollback");
}

}  // namespace
}  // namespace runtime
}  // namespace sinew
