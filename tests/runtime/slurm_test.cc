// Whole jobs of examples/train_dp under a real Slurm (Debian's slurm-wlm): scripts/slurm-cluster
// starts a private cluster of three nodes on this machine (a slurmctld, three slurmd, a munged;
// every daemon on 127.0.0.1, stopped by the PIDs it recorded), and the jobs run with srun as on a
// stock cluster: no --mpi, so Sinew's tasks meet without MPI or PMI (docs/runtime.md, "Under
// srun"). The suite skips, saying why, where the cluster cannot start (not root, slurm-wlm or
// munge missing).

#include <signal.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "job_support.h"

namespace {

using namespace std::chrono_literals;
using namespace sinew::testing;

class SlurmJobTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    state_ = new std::string(logDir("slurm-cluster"));
    JobRun up = finish(start({SINEW_SLURM_CLUSTER, "start", *state_, "3", "4"}, {}), 120s);
    if (up.exitCode != 0) {
      skip_ = new std::string("the Slurm cluster did not start (exit " +
                              std::to_string(up.exitCode) + "): " + up.output);
    }
  }
  static void TearDownTestSuite() {
    finish(start({SINEW_SLURM_CLUSTER, "stop", *state_}, {}), 60s);
    delete state_;
    delete skip_;
    state_ = nullptr;
    skip_ = nullptr;
  }
  void SetUp() override {
    if (skip_ != nullptr) GTEST_SKIP() << *skip_;
  }

  // The cluster's client environment, with the tasks' variables (srun --export=ALL passes ours
  // on): the coordinator on loopback, the rendezvous file in `dir`.
  static std::map<std::string, std::string> clientEnv(const std::string& dir) {
    return {{"SLURM_CONF", *state_ + "/slurm.conf"},
            {"SINEW_COORDINATOR_HOST", "127.0.0.1"},
            {"SINEW_RENDEZVOUS_DIR", dir + "/rv"}};
  }

  // srun `args` then train_dp `program`, as a user types it.
  static std::vector<std::string> srun(const std::vector<std::string>& args,
                                       const std::vector<std::string>& program) {
    std::vector<std::string> argv{"srun", "--kill-on-bad-exit=0"};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.push_back(TRAIN_DP_PATH);
    argv.insert(argv.end(), program.begin(), program.end());
    return argv;
  }

  // Runs srun `args` train_dp `program` with the client environment of `dir` to its end.
  static JobRun runSrun(const std::string& dir, const std::vector<std::string>& args,
                        const std::vector<std::string>& program) {
    return finish(start(srun(args, program), clientEnv(dir)), 240s);
  }

  static std::string* state_;
  static std::string* skip_;
};

std::string* SlurmJobTest::state_ = nullptr;
std::string* SlurmJobTest::skip_ = nullptr;

// Three tasks on three nodes; task 1 is SIGKILLed at step 20: the others finish with the
// reference's parameters. srun's own status is the killed task's (137), as Slurm reports the
// worst task of a step.
TEST_F(SlurmJobTest, ATaskOfAThreeNodeStepKilled) {
  const std::string dir = logDir("slurm-kill");
  JobRun run = runSrun(
      dir, {"-N", "3", "-n", "3", "--export=ALL,SINEW_INJECT=kill:worker=1:step=20:phase=backward"},
      {"--steps", "40"});
  SCOPED_TRACE(run.output);
  EXPECT_FALSE(run.timedOut);
  EXPECT_EQ(run.exitCode, 128 + SIGKILL);
  Result r = parseResult(run.output);
  ASSERT_TRUE(r.found);
  EXPECT_LE(r.maxRel, 1e-5);
  EXPECT_EQ(r.recoveries, 1);
  EXPECT_NE(run.output.find("epoch 1, 2 workers"), std::string::npos);
}

// Two tasks per node, as GPU clusters lay tasks out: a task that dies takes its node (the
// failure domain) with it: its node-mate is expelled, and the other node's two tasks finish
// with the reference's parameters. (Under srun --mpi=pmix, Slurm cancels the whole step.)
TEST_F(SlurmJobTest, ATaskThatSharesItsNodeKilled) {
  const std::string dir = logDir("slurm-shared");
  JobRun run = runSrun(dir,
                       {"-N", "2", "-n", "4", "--ntasks-per-node=2", "--distribution=block",
                        "--export=ALL,SINEW_INJECT=kill:worker=1:step=20:phase=backward"},
                       {"--steps", "40"});
  SCOPED_TRACE(run.output);
  EXPECT_FALSE(run.timedOut);
  EXPECT_NE(run.output.find("worker 0 declared dead: node n1 of worker 1 failed"),
            std::string::npos);
  EXPECT_NE(run.output.find("worker 2 done: 40 steps, epoch 1, 2 workers"), std::string::npos);
  EXPECT_NE(run.output.find("worker 3 done: 40 steps, epoch 1, 2 workers"), std::string::npos);
  Result r = parseResult(run.output);
  ASSERT_TRUE(r.found);
  EXPECT_LE(r.maxRel, 1e-5);
}

// scancel --signal=TERM signals every process of the step, the coordinator rank 0 forked
// included: the job drains into a durable checkpoint of the step it stopped after (every task
// leaves at a step boundary, srun exits 75), and a step of two tasks resumes there and ends
// equal to the reference.
TEST_F(SlurmJobTest, ScancelTermDrainsAndTwoTasksResume) {
  const std::string dir = logDir("slurm-term");
  const std::string ckpt = logDir("slurm-term-ckpt");
  std::filesystem::create_directories(dir);
  const std::string name = "sinew-term-" + std::to_string(::getpid());
  auto env = clientEnv(dir);
  env["SINEW_LOG_DIR"] = dir;
  env["SINEW_INJECT"] = "slow:worker=*:ms=20";
  Child job = start(srun({"-N", "3", "-n", "3", "--job-name=" + name},
                         {"--steps", "150", "--checkpoint-dir", ckpt, "--checkpoint-every", "50"}),
                    env);
  const auto deadline = Clock::now() + 120s;
  while (Clock::now() < deadline &&
         slurp(dir + "/worker-0-events.jsonl").find("\"step\":10,") == std::string::npos) {
    std::this_thread::sleep_for(20ms);
  }
  JobRun cancel = finish(start({"scancel", "--signal=TERM", "--name=" + name},
                               {{"SLURM_CONF", *state_ + "/slurm.conf"}}),
                         60s);
  EXPECT_EQ(cancel.exitCode, 0) << cancel.output;
  JobRun stopped = finish(job, 240s);
  SCOPED_TRACE(stopped.output);
  EXPECT_FALSE(stopped.timedOut);
  EXPECT_EQ(stopped.exitCode, 75) << "srun: the drain status (stopped, resumable)";
  // The signal reaches the tasks a moment apart, so one may train a step more than another;
  // the job stops after the last step any of them trained, and that step is durable.
  std::smatch m;
  ASSERT_TRUE(std::regex_search(stopped.output, m, std::regex("job stopped after step (\\d+)")));
  const std::string last = m[1];
  for (int w = 0; w < 3; ++w) {
    std::smatch left;
    ASSERT_TRUE(std::regex_search(stopped.output, left,
                                  std::regex("worker " + std::to_string(w) +
                                             " left the job \\(preempted\\) after step (\\d+)")))
        << "worker " << w;
    EXPECT_LE(std::stoi(left[1]), std::stoi(last)) << "worker " << w;
    EXPECT_GE(std::stoi(left[1]), std::stoi(last) - 1) << "worker " << w;
  }
  EXPECT_NE(slurp(ckpt + "/LATEST").find("\"step\":" + last), std::string::npos)
      << slurp(ckpt + "/LATEST");
  EXPECT_NE(slurp(dir + "/outcome.json").find("\"outcome\":\"stopped\""), std::string::npos)
      << slurp(dir + "/outcome.json");
  EXPECT_NE(stopped.output.find("sinew: job stopped after step " + last), std::string::npos);

  JobRun resumed =
      runSrun(dir, {"-N", "2", "-n", "2"}, {"--steps", "150", "--checkpoint-dir", ckpt});
  SCOPED_TRACE(resumed.output);
  EXPECT_EQ(resumed.exitCode, 0);
  EXPECT_NE(resumed.output.find("resumed from the durable checkpoint of step " + last),
            std::string::npos);
  Result r = parseResult(resumed.output);
  ASSERT_TRUE(r.found);
  EXPECT_LE(r.maxRel, 1e-5);
}

// Slurm's answer about job `id` (scontrol show job), one "Key=Value" line.
std::string showJob(const std::string& conf, const std::string& id) {
  return finish(start({"scontrol", "--oneliner", "show", "job", id}, {{"SLURM_CONF", conf}}), 30s)
      .output;
}

// `key`=value in a line of scontrol's, or "".
std::string fieldOf(const std::string& line, const std::string& key) {
  std::smatch m;
  if (!std::regex_search(line, m, std::regex("(^| )" + key + "=(\\S*)"))) return "";
  return m[2];
}

// A batch job whose step is sinew-run, as HPC users write it: sbatch --signal=B:USR1@100 sends
// the batch shell USR1 ahead of the two-minute time limit; the script forwards it to sinew-run
// (--drain-signal USR1), which stops the job at a step boundary into a durable checkpoint and
// exits 75; the script then asks Slurm to requeue the job. Requeued (started at once on another
// node: Slurm would hold it for two minutes), the job resumes from that checkpoint with three
// workers instead of two and ends equal to the reference; Slurm says COMPLETED, Restarts=1.
TEST_F(SlurmJobTest, SbatchWarningSignalDrainsSinewRunAndARequeueResumes) {
  const std::string dir = logDir("slurm-sbatch");
  const std::string ckpt = dir + "/ckpt";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const std::string script = dir + "/job.sh";
  {
    std::ofstream f(script);
    f << "#!/bin/bash\n"
         "restart=${SLURM_RESTART_COUNT:-0}\n"
         "pid=0; pending=0\n"
         "if [ $restart = 0 ]; then\n"
         "  trap 'if [ $pid -gt 0 ]; then kill -USR1 $pid; else pending=1; fi' USR1\n"
         "  slow=slow:worker=*:ms=60\n"
         "else\n"
         "  trap '' USR1; slow=\n"
         "fi\n"
      << SINEW_RUN_PATH << " -n $((2 + restart)) --drain-signal USR1 --log-dir " << dir
      << "/run-$restart --inject \"$slow\" " << TRAIN_DP_PATH << " --steps 600 --checkpoint-dir "
      << ckpt
      << " --checkpoint-every 100 &\n"
         "pid=$!\n"
         "[ $pending = 1 ] && kill -USR1 $pid\n"
         "while wait $pid; rc=$?; kill -0 $pid 2>/dev/null; do :; done\n"
         "echo \"batch: sinew-run exited $rc (restart $restart)\"\n"
         "if [ $rc = 75 ]; then scontrol requeue $SLURM_JOB_ID; fi\n"
         "exit $rc\n";
  }
  std::filesystem::permissions(script, std::filesystem::perms::owner_all);
  const std::string conf = *state_ + "/slurm.conf";
  JobRun submitted =
      finish(start({"sbatch", "--parsable", "--requeue", "-N", "1", "--time=2",
                    "--signal=B:USR1@100", "-o", dir + "/batch.out", "--open-mode=append", script},
                   {{"SLURM_CONF", conf}}),
             30s);
  ASSERT_EQ(submitted.exitCode, 0) << submitted.output;
  const std::string id = std::regex_replace(submitted.output, std::regex("[^0-9]"), "");
  // Wait for the requeue, then make the job eligible at once on another node (as when the
  // node it ran on is being taken back): Slurm holds a requeued job for the credential
  // lifetime (two minutes), and the node it ran on refuses it until then ("Job credential
  // revoked").
  const auto deadline = Clock::now() + 200s;
  bool moved = false;
  std::string job, ranOn;
  while (Clock::now() < deadline) {
    job = showJob(conf, id);
    const std::string state = fieldOf(job, "JobState");
    if (state == "RUNNING" && ranOn.empty()) ranOn = fieldOf(job, "BatchHost");
    if (!moved && fieldOf(job, "Restarts") == "1" && state == "PENDING" && !ranOn.empty()) {
      finish(start({"scontrol", "update", "JobId=" + id, "StartTime=now", "ExcNodeList=" + ranOn},
                   {{"SLURM_CONF", conf}}),
             30s);
      moved = true;
    }
    if (state == "COMPLETED" || state == "FAILED" || state == "CANCELLED" || state == "TIMEOUT") {
      break;
    }
    std::this_thread::sleep_for(500ms);
  }
  const std::string out = slurp(dir + "/batch.out");
  SCOPED_TRACE(out + "\n" + job);
  EXPECT_TRUE(moved) << "the job was not requeued";
  EXPECT_EQ(fieldOf(job, "JobState"), "COMPLETED");
  EXPECT_EQ(fieldOf(job, "Restarts"), "1");
  EXPECT_NE(out.find("batch: sinew-run exited 75 (restart 0)"), std::string::npos);
  EXPECT_NE(out.find("batch: sinew-run exited 0 (restart 1)"), std::string::npos);
  std::smatch m;
  ASSERT_TRUE(std::regex_search(out, m, std::regex("job stopped after step (\\d+)")));
  const std::string last = m[1];
  const std::string stopped = slurp(dir + "/run-0/outcome.json");
  EXPECT_NE(stopped.find("\"outcome\":\"stopped\""), std::string::npos) << stopped;
  EXPECT_NE(stopped.find("\"step\":" + last + ","), std::string::npos) << stopped;
  EXPECT_NE(out.find("resumed from the durable checkpoint of step " + last), std::string::npos);
  EXPECT_NE(slurp(dir + "/run-1/outcome.json").find("\"outcome\":\"finished\""), std::string::npos);
  Result r = parseResult(out);
  ASSERT_TRUE(r.found);
  EXPECT_LE(r.maxRel, 1e-5);
  EXPECT_NE(out.find("600 steps, epoch 0, 3 workers"), std::string::npos);
}

// A job grows by a second allocation: a step of two tasks trains; a second job's task joins it
// through the coordinator's address and token (SINEW_COORDINATOR, SINEW_TOKEN, from
// coordinator.json in the first job's log folder), enters at a step boundary, and the three
// end equal to the reference.
TEST_F(SlurmJobTest, ASecondAllocationJoinsARunningJob) {
  const std::string dir = logDir("slurm-grow");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto env = clientEnv(dir);
  env["SINEW_LOG_DIR"] = dir;
  env["SINEW_INJECT"] = "slow:worker=*:ms=30";
  Child first = start(srun({"-N", "2", "-n", "2"}, {"--steps", "300"}), env);
  const auto deadline = Clock::now() + 120s;
  while (Clock::now() < deadline &&
         slurp(dir + "/worker-0-events.jsonl").find("\"step\":10,") == std::string::npos) {
    std::this_thread::sleep_for(50ms);
  }
  const std::string endpoint = slurp(dir + "/coordinator.json");
  std::smatch host, port, token;
  ASSERT_TRUE(std::regex_search(endpoint, host, std::regex("\"host\":\"([^\"]+)\"")) &&
              std::regex_search(endpoint, port, std::regex("\"port\":(\\d+)")) &&
              std::regex_search(endpoint, token, std::regex("\"token\":\"([0-9a-f]+)\"")))
      << endpoint;
  auto joinEnv = clientEnv(dir + "-joiner");
  joinEnv["SINEW_COORDINATOR"] = std::string(host[1]) + ":" + std::string(port[1]);
  joinEnv["SINEW_TOKEN"] = token[1];
  joinEnv["SINEW_INJECT"] = "slow:worker=*:ms=30";
  JobRun joiner = finish(start(srun({"-N", "1", "-n", "1"}, {"--steps", "300"}), joinEnv), 240s);
  JobRun run = finish(first, 240s);
  SCOPED_TRACE(run.output + "\njoiner: " + joiner.output);
  EXPECT_EQ(joiner.exitCode, 0);
  EXPECT_EQ(run.exitCode, 0);
  EXPECT_NE(joiner.output.find("worker 2 done: 300 steps, epoch 1, 3 workers"), std::string::npos);
  EXPECT_NE(run.output.find("worker 0 done: 300 steps, epoch 1, 3 workers"), std::string::npos);
  Result r = parseResult(run.output);
  ASSERT_TRUE(r.found);
  EXPECT_LE(r.maxRel, 1e-5);
}

}  // namespace
