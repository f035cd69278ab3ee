// Untrusted text the runtime reads (issue 8): SINEW_INJECT fault specs, SINEW_* environment
// variables and sinew-run's command line. Bad numbers (nan, inf, negative, out of range,
// trailing junk) are rejected with a message naming the field and the value; --help works.

#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "../env_support.h"
#include "../fs_support.h"
#include "../tool_support.h"
#include "sinew/base/error.h"
#include "sinew/base/parse.h"
#include "sinew/init.h"
#include "sinew/runtime/failure_injection.h"

namespace sinew {
namespace runtime {
namespace {

TEST(ParseTest, WholeStringIntegersAndFiniteNumbersOnly) {
  using ::sinew::detail::parseFinite;
  using ::sinew::detail::parseInt;
  EXPECT_EQ(parseInt("42", "x", 0, 100), 42);
  EXPECT_EQ(parseInt("-7", "x", -10, 10), -7);
  for (const char* bad : {"", "4x", " 4", "4 ", "+4", "0x10", "1e3", "4.0", "-", "nan"}) {
    try {
      parseInt(bad, "--flag", 0, 1000);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(
          std::string(e.what()).find("--flag needs an integer, got '" + std::string(bad) + "'"),
          std::string::npos)
          << e.what();
    }
  }
  for (const char* bad : {"101", "-1", "99999999999999999999", "-99999999999999999999"}) {
    try {
      parseInt(bad, "--flag", 0, 100);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("--flag must be in [0, 100], got " + std::string(bad)),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_DOUBLE_EQ(parseFinite("2.5", "secs", 0, 10), 2.5);
  EXPECT_DOUBLE_EQ(parseFinite("1e-3", "secs", 0, 10), 1e-3);
  for (const char* bad : {"nan", "inf", "-inf", "NaN", "1e999", "2.5s", ""}) {
    EXPECT_THROW(parseFinite(bad, "secs", 0, 10), InvalidArgument) << bad;
  }
  EXPECT_THROW(parseFinite("-1", "secs", 0, 10), InvalidArgument);
  EXPECT_THROW(parseFinite("11", "secs", 0, 10), InvalidArgument);
}

TEST(FailureInjectionValidationTest, NanInfNegativeAndOutOfRangeNumbersAreRejected) {
  struct Bad {
    std::string spec, says;
  };
  for (const Bad& b : std::vector<Bad>{
           // A stop of nan seconds used to leave the worker stopped forever.
           {"stop:worker=1:step=5:secs=nan", "secs='nan' is not a non-negative number"},
           {"stop:worker=1:step=5:secs=inf", "secs='inf' is not a non-negative number"},
           {"stop:worker=1:step=5:secs=-3", "secs='-3' must be in [0, "},
           {"stop:worker=1:step=5:secs=1e300", "secs='1e300' must be in [0, "},
           {"mute:worker=1:step=5:secs=3s", "secs='3s' is not a non-negative number"},
           {"slow:worker=0:ms=NaN", "ms='NaN' is not a non-negative number"},
           {"slow:worker=0:ms=1e12", "ms='1e12' must be in [0, "},
           {"kill:worker=-1:step=3", "worker='-1' must be a whole number in [0, 2147483647]"},
           {"kill:worker=99999999999:step=3", "worker='99999999999' must be a whole number"},
           {"kill:worker=1.5:step=3", "worker='1.5' must be a whole number"},
           {"kill:worker=1:step=3junk", "step='3junk' is not a non-negative number"},
           {"kill:worker=1:step=1e20", "step='1e20' must be a whole number"},
           {"kill:worker=1:step=99999999999999999999", "step='99999999999999999999'"},
           {"kill:worker= 1:step=3", "worker=' 1'"},
           // Emulated compute and communication: one time per slow fault, only for slow.
           {"slow:worker=0:ms=2:us_per_sample=5", "needs one of ms=<milliseconds>, us_per_sample"},
           {"slow:worker=0", "needs one of ms=<milliseconds>, us_per_sample"},
           {"kill:worker=0:step=3:comm_ms=5", "unknown key 'comm_ms'"},
           {"slow:worker=0:us_per_sample=nan", "us_per_sample='nan' is not a non-negative number"},
       }) {
    try {
      FailureInjector::parse(b.spec);
      ADD_FAILURE() << "accepted '" << b.spec << "'";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(b.says), std::string::npos)
          << "'" << b.spec << "' gave: " << e.what();
      EXPECT_NE(std::string(e.what()).find("fault '" + b.spec + "'"), std::string::npos)
          << e.what();
    }
  }
  auto ok = FailureInjector::parse("stop:worker=1:step=5:secs=0.5;slow:worker=*:ms=2.5");
  ASSERT_EQ(ok.faults().size(), 2u);
  EXPECT_DOUBLE_EQ(ok.faults()[0].seconds, 0.5);
  EXPECT_DOUBLE_EQ(ok.faults()[1].milliseconds, 2.5);
  auto emulated =
      FailureInjector::parse("slow:worker=*:us_per_sample=500;slow:worker=1:comm_ms=40");
  ASSERT_EQ(emulated.faults().size(), 2u);
  EXPECT_DOUBLE_EQ(emulated.faults()[0].microsPerSample, 500);
  EXPECT_DOUBLE_EQ(emulated.faults()[1].commMilliseconds, 40);
  // Each sleeps only where it is due: 500 us for each of 8 samples on any worker; 40 ms of
  // communication on worker 1 only.
  auto t0 = std::chrono::steady_clock::now();
  emulated.emulateCompute(3, 0, 8);
  const double compute =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GE(compute, 0.004);
  t0 = std::chrono::steady_clock::now();
  emulated.emulateCommunication(0, 0);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0.02);
  t0 = std::chrono::steady_clock::now();
  emulated.emulateCommunication(1, 0);
  EXPECT_GE(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 0.04);
}

using sinew::testing::ScopedEnv;

TEST(InitValidationTest, BadEnvironmentVariablesNameTheVariableAndValue) {
  struct Bad {
    std::map<std::string, std::string> env;
    std::string says;
  };
  const std::map<std::string, std::string> good = {
      {"SINEW_COORDINATOR", "127.0.0.1:1"}, {"SINEW_TOKEN", "abc"}, {"SINEW_WORKER_ID", "0"}};
  for (const Bad& b : std::vector<Bad>{
           {{{"SINEW_WORKER_ID", "1x"}}, "SINEW_WORKER_ID needs an integer, got '1x'"},
           {{{"SINEW_WORKER_ID", "4294967296"}}, "SINEW_WORKER_ID must be in [-1, 2147483647]"},
           {{{"SINEW_COORDINATOR", "127.0.0.1:99999"}},
            "SINEW_COORDINATOR port must be in [1, 65535]"},
           {{{"SINEW_COORDINATOR", "127.0.0.1:80x"}}, "SINEW_COORDINATOR port needs an integer"},
           {{{"SINEW_COORDINATOR", "127.0.0.1:-80"}}, "SINEW_COORDINATOR port must be in"},
           {{{"SINEW_TOKEN", "-1"}}, "SINEW_TOKEN='-1' is not a non-zero hexadecimal job token"},
           {{{"SINEW_TOKEN", "0xabc"}}, "SINEW_TOKEN='0xabc'"},
           {{{"SINEW_TOKEN", "abc "}}, "SINEW_TOKEN='abc '"},
           {{{"SINEW_INJECT", "stop:worker=0:step=1:secs=nan"}}, "secs='nan'"},
           // HA mode (docs/ha.md).
           {{{"SINEW_ETCD", "nope"}}, "SINEW_ETCD='nope': 'nope' is not host:port"},
           {{{"SINEW_ETCD", "127.0.0.1:2379,h:0"}}, "'h:0' has no port in 1..65535"},
           {{{"SINEW_ETCD", "127.0.0.1:1"}}, "SINEW_ETCD is set but SINEW_JOB is not"},
           {{{"SINEW_ETCD", "127.0.0.1:1"}, {"SINEW_JOB", "a/b"}}, "job name 'a/b' may hold only"},
           {{{"SINEW_ETCD", "127.0.0.1:1"}, {"SINEW_JOB", "j"}, {"SINEW_TOKEN", "zz"}},
            "SINEW_TOKEN='zz'"},
       }) {
    std::map<std::string, std::string> env = good;
    for (const auto& kv : b.env) env[kv.first] = kv.second;
    ScopedEnv scoped(env);
    try {
      InitOptions o;
      o.connectTimeout = std::chrono::milliseconds(2000);  // Should a bad value slip through.
      init(nullptr, nullptr, o);
      ADD_FAILURE() << "init accepted " << b.env.begin()->first << "=" << b.env.begin()->second;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(b.says), std::string::npos) << e.what();
    }
  }
}

using testing::ToolRun;

ToolRun runTool(const std::string& args) { return testing::runTool(SINEW_RUN_PATH, args); }

TEST(SinewRunArgumentsTest, HelpAndBadNumbers) {
  ToolRun r = runTool("--help");
  EXPECT_EQ(r.status, 0) << r.out;
  for (const char* flag :
       {"--nproc", "--inject", "--log-dir", "--heartbeat-ms", "--dead-after-ms", "--quiet",
        "--max-workers", "--control-port", "--drain-signal", "--deadline-s", "--exit-grace-s"}) {
    EXPECT_NE(r.out.find(flag), std::string::npos) << r.out;
  }
  struct Bad {
    std::string args, says;
  };
  for (const Bad& b : std::vector<Bad>{
           {"-n abc true", "-n needs an integer, got 'abc'"},
           {"-n 0 true", "-n must be in [1, 1000000], got 0"},
           {"--nproc=4x true", "-n needs an integer, got '4x'"},
           {"-n 99999999999999999999 true", "-n must be in [1, 1000000], got 99999999999999999999"},
           {"-n 2 --heartbeat-ms 1e3 true", "--heartbeat-ms needs an integer, got '1e3'"},
           {"-n 2 --dead-after-ms=nan true", "--dead-after-ms needs an integer, got 'nan'"},
           {"-n 2 --heartbeat-ms 500 --dead-after-ms 400 true",
            "--dead-after-ms must exceed --heartbeat-ms"},
           {"-n 2 --inject stop:worker=0:step=1:secs=inf true", "secs='inf'"},
           {"-n 2 --bogus true", "--bogus"},
           {"-n 2", "no program to run"},
           {"true", "-n N is required"},
           {"-n 4 --max-workers 3 true", "--max-workers must be at least -n"},
           {"-n 2 --control-port 70000 true", "--control-port must be in [0, 65535]"},
           {"-n 2 --drain-signal KILL true", "--drain-signal = 'KILL' is not a signal"},
           {"-n 2 --drain-signal TERM true", "must not be INT or TERM"},
           {"-n 2 --drain-deadline-s 0 true", "--drain-deadline-s = '0' must be a number"},
           {"-n 2 --deadline-s -1 true", "--deadline-s = '-1' must be a number"},
           {"-n 2 --exit-grace-s nan true", "--exit-grace-s = 'nan' must be a number"},
       }) {
    ToolRun bad = runTool(b.args);
    EXPECT_EQ(bad.status, 2) << b.args << ": " << bad.out;
    EXPECT_NE(bad.out.find(b.says), std::string::npos) << b.args << ": " << bad.out;
  }
}

// A SIGTERM that reaches sinew-run while it is still starting its workers is forwarded to all
// of them once they are started, as one that comes later is: sinew-run then ends with them and
// none is left running. Before, sinew-run installed its handlers only after the last start, so
// a signal during the starts killed it and left the workers started so far running (orphans).
// The signal goes as soon as sinew-run says it started worker `after` of 48. Each launcher runs
// in a process group of its own, and this process adopts the orphans (PR_SET_CHILD_SUBREAPER),
// so that only processes this test started are looked at or killed.
TEST(SinewRunSignalsTest, ASigtermWhileTheWorkersStartLeavesNoneRunning) {
  ASSERT_EQ(::prctl(PR_SET_CHILD_SUBREAPER, 1), 0);
  const std::string logs = testing::tempDir("sinew-run-early-term");
  auto reap = [] {
    while (::waitpid(-1, nullptr, WNOHANG) > 0) {
    }
  };
  for (int after : {0, 5, 20}) {
    SCOPED_TRACE("SIGTERM after worker " + std::to_string(after) + " started");
    const std::string dir = logs + "/" + std::to_string(after);
    int out[2];
    ASSERT_EQ(::pipe(out), 0);
    const pid_t launcher = ::fork();
    ASSERT_GE(launcher, 0);
    if (launcher == 0) {
      ::setpgid(0, 0);
      ::dup2(out[1], 1);
      ::dup2(out[1], 2);
      ::close(out[0]);
      ::close(out[1]);
      ::execl(SINEW_RUN_PATH, SINEW_RUN_PATH, "-n", "48", "--log-dir", dir.c_str(), "/bin/sleep",
              "60", static_cast<char*>(nullptr));
      _exit(127);
    }
    ::setpgid(launcher, launcher);  // Either side may set it first.
    ::close(out[1]);
    std::string said;
    const std::string mark = "worker " + std::to_string(after) + " pid ";
    bool sent = false;
    std::thread reader([&] {
      char buf[4096];
      ssize_t n;
      while ((n = ::read(out[0], buf, sizeof(buf))) > 0) {
        said.append(buf, static_cast<size_t>(n));
        if (!sent && said.find(mark) != std::string::npos) {
          ::kill(launcher, SIGTERM);
          sent = true;
        }
      }
    });
    int status = 0;
    pid_t got = 0;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while ((got = ::waitpid(launcher, &status, WNOHANG)) == 0 &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (got == 0) {
      ::kill(-launcher, SIGKILL);
      ::waitpid(launcher, &status, 0);
      ADD_FAILURE() << "sinew-run did not end within 30 s";
    }
    // What is left of its group once it ended (the adopted ones that exit are reaped).
    bool left = false;
    const auto settle = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (::kill(-launcher, 0) == 0) {
      reap();
      if (std::chrono::steady_clock::now() > settle) {
        left = true;
        ::kill(-launcher, SIGKILL);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    reader.join();
    ::close(out[0]);
    EXPECT_TRUE(sent) << said;
    EXPECT_FALSE(left) << "workers outlived sinew-run:\n" << said;
    EXPECT_FALSE(WIFSIGNALED(status)) << "the SIGTERM killed sinew-run:\n" << said;
    EXPECT_NE(said.find("worker 47 pid "), std::string::npos) << said;
  }
  testing::removeTree(logs);
}

}  // namespace
}  // namespace runtime
}  // namespace sinew
