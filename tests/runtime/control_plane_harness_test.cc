// The control-plane benchmark's harness as a test (issue 41): 256 simulated workers (real
// CoordinatorClients) against a real coordinator process; a worker's process and a node's
// process are SIGKILLed and every survivor must hold the next epoch, a silent worker must be
// declared dead after the 1 s timeout, and every vote must commit. The workers share the
// harness's io and voter threads (ClientIoThreads, castVote/awaitVerdict).

#include <gtest/gtest.h>

#include <sstream>
#include <string>
#include <vector>

#include "../tool_support.h"

namespace {

using sinew::testing::runTool;

// The figures row of the bench's table for `workers`.
std::vector<double> rowFor(const std::string& out, int workers) {
  std::istringstream in(out);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    int n = 0;
    if (!(fields >> n) || n != workers) continue;
    std::vector<double> v;
    std::string f;
    while (fields >> f) v.push_back(std::stod(f));  // "3.0%" reads as 3.0
    return v;
  }
  return {};
}

TEST(ControlPlaneHarnessTest, TwoHundredFiftySixWorkersSurviveAKilledWorkerAndAKilledNode) {
  const auto r = runTool(CONTROL_PLANE_BENCH_PATH, "--sizes 256 --steps 3 --check");
  ASSERT_EQ(r.status, 0) << r.out;
  std::vector<double> row = rowFor(r.out, 256);
  // start_s vote_rtt_ms vote_e2e_ms kill_1_ms kill_8_ms silent_ms coord_cpu kib/wkr status_ms
  // metrics_ms
  ASSERT_EQ(row.size(), 10u) << r.out;
  // The coordinator's round trip (last vote in, last commit out: its sinew_commit_seconds) is
  // inside the workers' (last vote out, last commit in).
  EXPECT_GT(row[1], 0.0) << r.out;
  EXPECT_LE(row[1], row[2]) << r.out;
  row.erase(row.begin() + 1);
  EXPECT_GT(row[0], 0.0) << r.out;
  EXPECT_LT(row[0], 30.0) << r.out;  // start
  EXPECT_GT(row[1], 0.0) << r.out;
  EXPECT_LT(row[1], 2000.0) << r.out;  // vote round trip, end to end
  // A SIGKILLed worker's closed connection, and a node's, are noticed at once: sooner than
  // the heartbeat timeout (1 s after the last heartbeat) could notice them.
  EXPECT_GT(row[2], 0.0) << r.out;
  EXPECT_LT(row[2], 900.0) << r.out;
  EXPECT_GT(row[3], 0.0) << r.out;
  EXPECT_LT(row[3], 900.0) << r.out;
  // Silence is noticed by the 1 s heartbeat timeout, counted from the last heartbeat heard,
  // which came at most one interval (100 ms) before the mute: not before that.
  EXPECT_GE(row[4], 900.0) << r.out;
  EXPECT_LT(row[4], 10000.0) << r.out;
  // The control API answered at that size (--check fails on any other answer than 200).
  EXPECT_GT(row[7], 0.0) << r.out;
  EXPECT_NE(r.out.find("RESULT epoch_change_s_256="), std::string::npos) << r.out;
}

}  // namespace
