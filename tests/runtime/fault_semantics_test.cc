// Failure semantics beyond a clean kill (issue 9, docs/failure_semantics.md): a paused
// coordinator, a hung worker, a late vote, the last step's durability, a corrupt newest
// checkpoint, a bad checkpoint directory, injection kinds and inherited sockets. Each test runs
// whole jobs of examples/train_dp under sinew-run and checks the outcome a user sees: exit
// status, who was blamed, parameters against the single-process reference, what is on disk.

#include <signal.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "job_support.h"

namespace {

using namespace std::chrono_literals;
using sinew::testing::Child;
using sinew::testing::finish;
using sinew::testing::JobRun;
using sinew::testing::logDir;
using sinew::testing::parseResult;
using sinew::testing::Result;
using sinew::testing::slurp;
using sinew::testing::start;
using sinew::testing::waitForLog;

// The job finished every step with parameters equal to the reference.
void expectExact(const JobRun& run, const std::string& lostList) {
  EXPECT_FALSE(run.timedOut) << "the job hung";
  EXPECT_EQ(run.exitCode, 0);
  Result r = parseResult(run.output);
  ASSERT_TRUE(r.found) << "no RESULT line";
  EXPECT_LE(r.maxRel, 1e-5);
  EXPECT_LT(r.finalLoss, 0.05) << "the model did not learn";
  EXPECT_NE(run.output.find("workers lost: [" + lostList + "]"), std::string::npos)
      << "expected workers lost: [" << lostList << "]";
}

// Item 2: SIGSTOP of the launcher (which hosts the coordinator) for longer than the heartbeat
// timeout, then SIGCONT, as Ctrl-Z/fg, a Slurm suspend or a VM pause do. The silence was the
// coordinator's own: no worker is expelled and the job ends exact.
TEST(FaultSemanticsTest, PausedCoordinatorExpelsNobody) {
  const std::string dir = logDir("coord-pause");
  Child job = start({SINEW_RUN_PATH, "-n", "3", "--log-dir", dir, "--inject", "slow:worker=*:ms=20",
                     TRAIN_DP_PATH, "--steps", "80"},
                    {});
  ASSERT_TRUE(waitForLog(dir, "sinew: step 10 ")) << "the job did not reach step 10";
  ::kill(job.pid, SIGSTOP);  // The launcher this test started.
  std::this_thread::sleep_for(5000ms);
  ::kill(job.pid, SIGCONT);
  JobRun run = finish(job, 240s);
  SCOPED_TRACE(run.output);
  expectExact(run, "");
  EXPECT_EQ(run.output.find("declared dead"), std::string::npos);
  EXPECT_NE(run.output.find("the coordinator did not run for"), std::string::npos);
}

}  // namespace
