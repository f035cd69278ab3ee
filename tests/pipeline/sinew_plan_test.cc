// End-to-end tests of the sinew-plan tool on docs/profile_example.json. SINEW_PLAN_PATH and
// SINEW_PROFILE_EXAMPLE are set by tests/pipeline/CMakeLists.txt.

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../tool_support.h"
namespace {

using sinew::testing::ToolRun;

ToolRun runPlan(const std::string& args) { return sinew::testing::runTool(SINEW_PLAN_PATH, args); }

const std::string kProfile = SINEW_PROFILE_EXAMPLE;

TEST(SinewPlanTest, PrintsTemplatesInstantiationAndSplitAsDeterministicJson) {
  const std::string args = kProfile + " --nodes 8 --fault-tolerance 1 --microbatches 16";
  ToolRun a = runPlan(args);
  ASSERT_EQ(a.status, 0) << a.out;
  ToolRun b = runPlan(args);
  EXPECT_EQ(a.out, b.out);  // byte for byte
  nlohmann::json j = nlohmann::json::parse(a.out);
  EXPECT_EQ(j["nodes"], 8);
  EXPECT_EQ(j["layers"], 16);
  ASSERT_FALSE(j["templates"].empty());
  EXPECT_EQ(j["templates"][0]["nodes"], j["min_nodes"]);
  for (const auto& t : j["templates"]) {
    ASSERT_FALSE(t["stages"].empty());
    EXPECT_EQ(t["stages"][0]["first_layer"], 0);
    EXPECT_EQ(t["stages"].back()["end_layer"], 16);
  }
  const auto& pipelines = j["plan"]["pipelines"];
  EXPECT_GE(pipelines.size(), 2u);  // f + 1
  int64_t sum = 0;
  int nodes = 0;
  for (const auto& p : pipelines) {
    sum += p["microbatches"].get<int64_t>();
    nodes += p["nodes"].get<int>();
  }
  EXPECT_EQ(sum, 16);
  EXPECT_EQ(nodes + static_cast<int>(j["plan"]["idle_node_ids"].size()), 8);
  // Every node count without a template says why: 1 node is too little memory (the example's
  // 16 layers need 6 devices of 4 GiB), 7 and 8 leave too few nodes for the second pipeline.
  const auto& none = j["no_template"];
  ASSERT_EQ(none.size(), 3u) << none.dump();
  EXPECT_EQ(none[0]["nodes"], 1);
  EXPECT_NE(none[0]["why"].get<std::string>().find("needs at least 6 stages"), std::string::npos)
      << none.dump();
  EXPECT_EQ(none[1]["nodes"], 7);
  EXPECT_NE(none[1]["why"].get<std::string>().find("n_max"), std::string::npos) << none.dump();
}

TEST(SinewPlanTest, TableForHumans) {
  ToolRun r = runPlan(kProfile + " --nodes=8 --fault-tolerance=1 --microbatches=16 --table");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_NE(r.out.find("layers per stage"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("iteration"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("no template on 1 nodes: the model needs at least 6 stages"),
            std::string::npos)
      << r.out;
}

TEST(SinewPlanTest, BadArgumentsAndProfilesAreReported) {
  ToolRun r = runPlan(kProfile + " --nodes 8 --microbatches zero");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.out.find("--microbatches needs an integer, got 'zero'"), std::string::npos) << r.out;
  r = runPlan(kProfile + " --nodes 3 --fault-tolerance 1 --microbatches 4");
  EXPECT_EQ(r.status, 1);  // the model needs 2 nodes, so f = 1 needs 4
  EXPECT_NE(r.out.find("fault_tolerance=1"), std::string::npos) << r.out;
  r = runPlan("/nonexistent/profile.json --nodes 2 --microbatches 4");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("/nonexistent/profile.json"), std::string::npos) << r.out;
  const std::string bad = ::testing::TempDir() + "sinew_plan_bad.json";
  std::ofstream(bad) << R"({"job": {"devices_per_node": 1}, "layers": []})";
  r = runPlan(bad + " --nodes 2 --microbatches 4");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.out.find("job.device_memory_bytes"), std::string::npos) << r.out;
}

TEST(SinewPlanTest, HelpAndBadNumbersGiveClearErrors) {
  ToolRun r = runPlan("--help");
  EXPECT_EQ(r.status, 0) << r.out;
  for (const char* flag : {"--nodes", "--fault-tolerance", "--microbatches", "--table"}) {
    EXPECT_NE(r.out.find(flag), std::string::npos) << r.out;
  }
  struct Bad {
    std::string args, says;
  };
  for (const Bad& b : std::vector<Bad>{
           {" --nodes 0 --microbatches 4", "--nodes must be in [1, 1048576], got 0"},
           {" --nodes=99999999999999999999 --microbatches 4",
            "--nodes must be in [1, 1048576], got 99999999999999999999"},
           {" --nodes 8x --microbatches 4", "--nodes needs an integer, got '8x'"},
           {" --nodes 8 --microbatches 1e3", "--microbatches needs an integer, got '1e3'"},
           {" --nodes 8 --microbatches -4", "--microbatches"},
           {" --nodes 8 --fault-tolerance 1.5 --microbatches 4",
            "--fault-tolerance needs an integer, got '1.5'"},
           {" --nodes 8 --fault-tolerance 8 --microbatches 4",
            "--fault-tolerance must be in [0, 7], got 8"},
           {" --nodes 8", "--microbatches is required"},
           {" --nodes 8 --microbatches 4 --bogus", "--bogus"},
           {" --nodes 8 --microbatches 4 second.json", "second.json"},
       }) {
    ToolRun bad = runPlan(kProfile + b.args);
    EXPECT_EQ(bad.status, 2) << b.args << ": " << bad.out;
    EXPECT_NE(bad.out.find(b.says), std::string::npos) << b.args << ": " << bad.out;
  }
  ToolRun none = runPlan("--nodes 8 --microbatches 4");
  EXPECT_EQ(none.status, 2) << none.out;
  EXPECT_NE(none.out.find("no profile given"), std::string::npos) << none.out;
}

}  // namespace
