// Whole jobs on a GPU (issue 13, docs/gpu.md): examples/train_dp and train_pp under sinew-run
// with --device cuda, every worker on the machine's one GPU (so their transfers go through
// Gloo and host memory: NCCL refuses two ranks of one communicator on one GPU), faults
// injected into real processes, parameters compared with the single-process CPU reference.
// Skipped, with the reason, without a GPU.

#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <vector>

#include "../gpu_support.h"
#include "job_support.h"

namespace {

using namespace std::chrono_literals;
using sinew::testing::JobRun;
using sinew::testing::logDir;
using sinew::testing::parseResult;
using sinew::testing::Result;
using sinew::testing::slurp;

JobRun run(const std::string& name, int workers, const char* program,
           const std::vector<std::string>& args, const std::string& inject = "") {
  return sinew::testing::runJob(name, workers, program, args, inject);
}

bool has(const JobRun& r, const std::string& text) {
  return r.output.find(text) != std::string::npos;
}

TEST(GpuJobTest, DataParallelWorkersSharingTheGpuSurviveAKill) {
  SINEW_REQUIRE_GPU();
  JobRun r = run("gpu-dp-kill", 3, TRAIN_DP_PATH, {"--device", "cuda"},
                 "kill:worker=1:step=12:phase=backward");
  SCOPED_TRACE(r.output);
  sinew::testing::expectFinishedExact(r, "1");
  EXPECT_TRUE(has(r, "transfers over gloo through host memory (workers 0 and 1 share GPU GPU-"));
  EXPECT_TRUE(has(r, "worker 0 done: 80 steps"));
  EXPECT_TRUE(has(r, "device cuda:0, backend gloo"));
}

TEST(GpuJobTest, OneWorkerTrainsOverNccl) {
  SINEW_REQUIRE_GPU();
  JobRun r = run("gpu-dp-nccl", 1, TRAIN_DP_PATH, {"--device", "cuda", "--backend", "nccl"});
  SCOPED_TRACE(r.output);
  sinew::testing::expectFinishedExact(r, "");
  EXPECT_TRUE(has(r, "transfers over nccl (every worker has a GPU of its own)"));
  EXPECT_TRUE(has(r, "device cuda:0, backend nccl"));
}

TEST(GpuJobTest, NcclIsRefusedForWorkersSharingAGpuWithAClearError) {
  SINEW_REQUIRE_GPU();
  JobRun r = run("gpu-nccl-shared", 2, TRAIN_DP_PATH,
                 {"--device", "cuda", "--backend", "nccl", "--steps", "5"});
  SCOPED_TRACE(r.output);
  EXPECT_FALSE(r.timedOut) << "the job hung";
  EXPECT_NE(r.exitCode, 0);
  EXPECT_TRUE(has(r, "TrainerOptions::backend is kNccl, but communicator 'dp' of epoch"));
  EXPECT_TRUE(has(r, "cannot use NCCL: workers 0 and 1 share GPU GPU-"));
}

// Mixed precision on the GPU: train_gpt as pipelines of four workers whose layers compute in
// bfloat16, then in float16 with dynamic loss scaling, each against the single-process float32
// reference on the CPU: the final training loss and the held-out loss within 3%.
namespace {
void expectMixedPrecisionFollowsFloat32(const std::string& flag) {
  JobRun r = run("gpu-gpt" + flag, 4, TRAIN_GPT_PATH,
                 {"--device", "cuda", flag, "--steps", "40", "--eval-every", "10"});
  SCOPED_TRACE(r.output);
  EXPECT_FALSE(r.timedOut) << "the job hung";
  EXPECT_EQ(r.exitCode, 0);
  std::smatch m;
  ASSERT_TRUE(
      std::regex_search(r.output, m,
                        std::regex("final_loss=(\\S+) reference_loss=(\\S+) .* eval_loss=(\\S+) "
                                   "reference_eval_loss=(\\S+) .* loss_scale=(\\S+)")))
      << "no RESULT line";
  EXPECT_NEAR(std::stod(m[1]), std::stod(m[2]), 0.03 * std::stod(m[2]));
  EXPECT_NEAR(std::stod(m[3]), std::stod(m[4]), 0.03 * std::stod(m[4]));
  EXPECT_LT(std::stod(m[3]), 4.0) << "the model did not learn (a uniform guess is ln 256 = 5.5)";
  if (flag == "--fp16") {
    EXPECT_GT(std::stod(m[5]), 1.0) << "float16 trained without loss scaling";
  } else {
    EXPECT_EQ(std::stod(m[5]), 1.0);
  }
}
}  // namespace

TEST(GpuJobTest, Bf16PipelinesFollowTheFloat32Run) {
  SINEW_REQUIRE_GPU();
  expectMixedPrecisionFollowsFloat32("--bf16");
}

TEST(GpuJobTest, Fp16PipelinesWithLossScalingFollowTheFloat32Run) {
  SINEW_REQUIRE_GPU();
  expectMixedPrecisionFollowsFloat32("--fp16");
}

// Two pipelines on the GPU; pipeline 0's stage writers snapshot their layers out of GPU
// memory and commit durable versions together.
TEST(GpuJobTest, PipelinesOnTheGpu) {
  SINEW_REQUIRE_GPU();
  const std::string ckpt = logDir("gpu-pp-ckpt");
  JobRun r = run("gpu-pp", 4, TRAIN_PP_PATH,
                 {"--device", "cuda", "--devices-per-node", "1", "--checkpoint-dir", ckpt,
                  "--checkpoint-every", "10"});
  SCOPED_TRACE(r.output);
  EXPECT_FALSE(r.timedOut) << "the job hung";
  EXPECT_EQ(r.exitCode, 0);
  Result res = parseResult(r.output);
  ASSERT_TRUE(res.found) << "no RESULT line";
  EXPECT_LE(res.maxRel, 1e-5);
  EXPECT_LT(res.finalLoss, 2.0) << "the model did not learn";
  EXPECT_TRUE(has(r, "pipeline 1:")) << "fault tolerance 1 needs two pipelines";
  const std::regex done("train_pp: worker \\d+ done: [^\\n]*device cuda:0, backend gloo");
  EXPECT_EQ(std::distance(std::sregex_iterator(r.output.begin(), r.output.end(), done),
                          std::sregex_iterator()),
            4);
  std::smatch m;
  const std::string latest = slurp(ckpt + "/LATEST");
  ASSERT_TRUE(std::regex_search(latest, m, std::regex("\"step\":(\\d+)"))) << latest;
  EXPECT_EQ(std::stoi(m[1]), 39) << "the last step is not durable";
}

// The writer is killed while its snapshot of step 29 is being copied out of GPU memory (the
// snapshot phase fires once the copies are queued); the next writer snapshots from its own
// GPU memory, the job ends exact with its last step durable, and a new job resumes from that
// version onto the GPU, exact again.
TEST(GpuJobTest, KillDuringACudaSnapshotThenRestartFromDisk) {
  SINEW_REQUIRE_GPU();
  const std::string ckpt = logDir("gpu-snapshot-ckpt");
  JobRun r = run("gpu-snapshot-kill", 3, TRAIN_DP_PATH,
                 {"--device", "cuda", "--checkpoint-dir", ckpt, "--checkpoint-every", "10"},
                 "kill:worker=0:step=29:phase=snapshot");
  {
    SCOPED_TRACE(r.output);
    sinew::testing::expectFinishedExact(r, "0");
  }
  std::smatch m;
  const std::string latest = slurp(ckpt + "/LATEST");
  ASSERT_TRUE(std::regex_search(latest, m, std::regex("\"step\":(\\d+)"))) << latest;
  EXPECT_EQ(std::stoi(m[1]), 79) << "the last step is not durable";

  JobRun resumed = run(
      "gpu-snapshot-resume", 2, TRAIN_DP_PATH,
      {"--device", "cuda", "--checkpoint-dir", ckpt, "--checkpoint-every", "1", "--steps", "100"});
  SCOPED_TRACE(resumed.output);
  sinew::testing::expectFinishedExact(resumed, "");
  EXPECT_TRUE(has(resumed, "resumed from the durable checkpoint of step 79"));
}

}  // namespace
