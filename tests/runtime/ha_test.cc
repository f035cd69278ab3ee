// High-availability mode (issue 14, docs/ha.md): whole train_dp jobs whose state lives in a
// three-member etcd cluster on loopback (each member its own process, data directory and
// ports), with three sinew-coordinator candidates (one leads by an etcd lease) and four
// workers, each its own node. Faults hit real processes by PID: the leader coordinator killed
// mid-step, killed together with a worker, stopped past its lease and resumed (it must step
// down without writing), one etcd member killed, two killed (the job pauses, and continues
// when one is back). Every job must end with every surviving worker's parameters equal to the
// single-process reference (max_param_rel_diff <= 1e-5) and no hang. Skipped without etcd.

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <future>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../etcd_support.h"
#include "../tool_support.h"
#include "job_support.h"
#include "sinew/base/error.h"
#include "sinew/collectives/etcd_client.h"
#include "sinew/runtime/ha_coordinator.h"
#include "sinew/runtime/leader_election.h"

namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using nlohmann::json;
using sinew::collectives::EtcdClient;
using sinew::testing::EtcdCluster;
using sinew::testing::parseResult;
using sinew::testing::slurp;

constexpr int kWorkers = 4;
constexpr int kLeaseTtl = 2;

// A child process whose output goes to a file.
struct Proc {
  pid_t pid = -1;
  std::string log;
  int status = -1;  // exit code once reaped, 128 + signal if killed
  bool reaped = false;
};

Proc spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
           const std::string& log) {
  Proc p;
  p.log = log;
  p.pid = sinew::testing::spawnLogged(argv, env, log);
  return p;
}

bool reap(Proc& p, bool block) {
  if (p.reaped) return true;
  int st = 0;
  pid_t r = ::waitpid(p.pid, &st, block ? 0 : WNOHANG);
  if (r != p.pid) return false;
  p.reaped = true;
  p.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  return true;
}

class HaJobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (sinew::testing::etcdPath().empty()) {
      GTEST_SKIP() << "etcd is not installed (apt-get install etcd-server; "
                      "scripts/install-deps.sh)";
    }
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = sinew::testing::logDir(std::string("ha-") + info->name());
    std::string mk = "mkdir -p '" + dir_ + "'";
    ASSERT_EQ(std::system(mk.c_str()), 0);
    cluster_ = std::make_unique<EtcdCluster>(3);
    etcd_ = std::make_unique<EtcdClient>(cluster_->options());
    std::mt19937_64 rng(std::random_device{}());
    char hex[32];
    std::snprintf(hex, sizeof(hex), "%llx", static_cast<unsigned long long>(rng() | 1));
    token_ = hex;
    job_ = std::string("ha-") + info->name();
  }

  void TearDown() override {
    for (auto* group : {&workers_, &coordinators_}) {
      for (auto& p : *group) {
        if (!p.reaped) {
          ::kill(p.pid, SIGCONT);
          ::kill(p.pid, SIGKILL);
          reap(p, true);
        }
      }
    }
    if (HasFailure()) {
      for (auto* group : {&coordinators_, &workers_}) {
        for (auto& p : *group) std::cout << "==== " << p.log << "\n" << slurp(p.log) << "\n";
      }
    }
  }

  void startCoordinators(const std::vector<std::string>& extra = {}) {
    for (int i = 0; i < 3; ++i) {
      std::vector<std::string> argv = {SINEW_COORDINATOR_PATH,
                                       "--etcd",
                                       cluster_->endpoints(),
                                       "--job",
                                       job_,
                                       "--workers",
                                       std::to_string(kWorkers),
                                       "--name",
                                       "c" + std::to_string(i),
                                       "--lease-ttl-s",
                                       std::to_string(kLeaseTtl),
                                       "--step-deadline-ms",
                                       "10000"};
      argv.insert(argv.end(), extra.begin(), extra.end());
      std::map<std::string, std::string> env = etcdEnv_;
      env["SINEW_TOKEN"] = token_;
      coordinators_.push_back(
          spawn(argv, env, dir_ + "/coordinator-" + std::to_string(i) + ".log"));
    }
  }

  // sinewctl --etcd ... --job ... <args>, with the job token in SINEW_TOKEN.
  sinew::testing::ToolRun sinewctl(const std::string& args) {
    std::string env = "SINEW_TOKEN=" + token_ + " ";
    for (const auto& [k, v] : etcdEnv_) env += k + "=" + v + " ";
    return sinew::testing::runTool(
        env + SINEWCTL_PATH,
        "--etcd " + cluster_->endpoints() + " --job " + job_ + " --timeout-s 20 " + args);
  }

  // train_dp workers (or `program` with `args`), each its own node, every step slowed by
  // `stepMs` so that faults land mid-job.
  void startWorkers(int steps, int stepMs = 25, const std::string& program = TRAIN_DP_PATH,
                    const std::vector<std::string>& args = {}) {
    for (int w = 0; w < kWorkers; ++w) {
      std::vector<std::string> argv = {program, "--steps", std::to_string(steps)};
      argv.insert(argv.end(), args.begin(), args.end());
      std::map<std::string, std::string> env = etcdEnv_;
      env.insert({{"SINEW_ETCD", cluster_->endpoints()},
                  {"SINEW_JOB", job_},
                  {"SINEW_TOKEN", token_},
                  {"SINEW_WORKER_ID", std::to_string(w)},
                  {"SINEW_NODE", "node" + std::to_string(w)},
                  {"SINEW_INJECT", "slow:worker=*:ms=" + std::to_string(stepMs)}});
      workers_.push_back(spawn(argv, env, dir_ + "/worker-" + std::to_string(w) + ".log"));
    }
  }

  std::optional<json> readJson(const std::string& key, int64_t* revision = nullptr) {
    try {
      auto kv = etcd_->get("/sinew/" + job_ + "/" + key, revision);
      if (!kv) return std::nullopt;
      json j = json::parse(kv->value, nullptr, false);
      if (!j.is_object()) return std::nullopt;
      return j;
    } catch (const sinew::Error&) {
      return std::nullopt;  // etcd without a majority (the tests that kill members)
    }
  }
  int64_t committed() {
    auto st = readJson("state");
    return st ? st->value("committed", int64_t(-1)) : -1;
  }
  // Polls the state in etcd until its committed step reaches `step`.
  bool waitCommitted(int64_t step, std::chrono::seconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      if (committed() >= step) return true;
      std::this_thread::sleep_for(10ms);
    }
    return false;
  }
  // The serving leader: its name and pid.
  std::pair<std::string, pid_t> leader(std::chrono::seconds timeout = 30s) {
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      auto l = readJson("leader");
      if (l && l->contains("port")) {
        return {l->value("candidate", std::string()), static_cast<pid_t>(l->value("pid", 0))};
      }
      std::this_thread::sleep_for(20ms);
    }
    return {"", -1};
  }
  Proc* coordinatorByPid(pid_t pid) {
    for (auto& p : coordinators_) {
      if (p.pid == pid) return &p;
    }
    return nullptr;
  }

  // Waits for every worker to exit (at most `timeout`, then they are killed: a hang).
  bool waitWorkers(std::chrono::seconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (Clock::now() < deadline) {
      bool all = true;
      for (auto& p : workers_) all = reap(p, false) && all;
      if (all) return true;
      std::this_thread::sleep_for(50ms);
    }
    return false;
  }

  // Every worker not in `lost` exited 0 with the reference's parameters (the lowest survivor
  // prints the RESULT line, and its final loss is below `learnedLoss`); the coordinators all
  // exit 0 once the job is finished.
  void expectExact(const std::vector<int>& lost, double learnedLoss = 0.05) {
    ASSERT_TRUE(waitWorkers(180s)) << "the job hung";
    int reporter = -1;
    for (int w = 0; w < kWorkers; ++w) {
      if (std::find(lost.begin(), lost.end(), w) != lost.end()) continue;
      EXPECT_EQ(workers_[w].status, 0) << "worker " << w;
      if (reporter < 0) reporter = w;
    }
    ASSERT_GE(reporter, 0);
    const std::string out = slurp(workers_[reporter].log);
    auto r = parseResult(out);
    ASSERT_TRUE(r.found) << "no RESULT line from worker " << reporter;
    EXPECT_LE(r.maxRel, 1e-5);
    EXPECT_LT(r.finalLoss, learnedLoss) << "the model did not learn";
    auto st = readJson("state");
    ASSERT_TRUE(st);
    EXPECT_TRUE(st->value("finished", false)) << st->dump();
    // Exactly the lost workers were declared dead, in the state the leaders stored.
    std::vector<int> dead = st->value("dead", std::vector<int>());
    std::sort(dead.begin(), dead.end());
    EXPECT_EQ(dead, lost) << st->dump();
    // Every candidate still running ends by itself once the job finished.
    const auto deadline = Clock::now() + 30s;
    for (auto& p : coordinators_) {
      while (!reap(p, false) && Clock::now() < deadline) std::this_thread::sleep_for(50ms);
      EXPECT_TRUE(p.reaped) << p.log << " did not exit after the job finished";
    }
  }

  // Kills the leader at a step boundary's neighbourhood and returns the seconds from the kill
  // to the next committed step (the failover time).
  double killLeaderAndTimeFailover(pid_t extraVictim = -1) {
    auto [name, pid] = leader();
    EXPECT_GT(pid, 0) << "no leader";
    const int64_t before = committed();
    const auto killed = Clock::now();
    ::kill(pid, SIGKILL);
    if (extraVictim > 0) ::kill(extraVictim, SIGKILL);
    if (Proc* p = coordinatorByPid(pid)) reap(*p, true);
    while (committed() <= before + 1 && Clock::now() - killed < 60s) {
      std::this_thread::sleep_for(5ms);
    }
    const double s = std::chrono::duration<double>(Clock::now() - killed).count();
    std::cout << "failover: leader " << name << " killed after step " << before
              << ", next step committed " << s << " s later (lease TTL " << kLeaseTtl << " s)"
              << std::endl;
    auto [next, nextPid] = leader();
    EXPECT_NE(next, name) << "the killed leader still leads";
    return s;
  }

  std::string dir_;
  std::string token_;
  std::string job_;
  std::unique_ptr<EtcdCluster> cluster_;
  std::unique_ptr<EtcdClient> etcd_;
  std::vector<Proc> coordinators_;
  std::vector<Proc> workers_;
  // SINEW_ETCD_USER and SINEW_ETCD_PASSWORD for every process, once etcd requires them.
  std::map<std::string, std::string> etcdEnv_;
};

// A leader's term is its key's, not its lease's: when the leader key is deleted behind its
// back (its lease alive and renewed), leads() turns false at the next renewal (a quarter TTL)
// and every fenced write is refused; a candidate that creates the key anew gets a new term.
// Before, leads() looked only at the lease's age and stayed true: in the review, a leader
// whose key was deleted went on expelling workers while the next one took over.
TEST(LeaderElectionTest, ALeaderWhoseKeyIsDeletedStopsLeadingThoughItsLeaseLives) {
  if (sinew::testing::etcdPath().empty()) GTEST_SKIP() << "etcd is not installed";
  EtcdCluster cluster(1);
  auto etcd = std::make_shared<EtcdClient>(cluster.options());
  sinew::runtime::LeaderElectionOptions o;
  o.etcd = etcd;
  o.key = "/sinew/fence/leader";
  o.ttlSeconds = 4;
  sinew::runtime::LeaderElection a(o);
  ASSERT_TRUE(a.campaign("a", 20s, [] { return false; }));
  const int64_t term = a.term();
  ASSERT_TRUE(a.leads());
  etcd->deleteKey(o.key);
  const auto t0 = Clock::now();
  while (a.leads() && Clock::now() - t0 < 5s) std::this_thread::sleep_for(10ms);
  EXPECT_FALSE(a.leads()) << "a leader whose key was deleted still leads";
  EXPECT_LT(Clock::now() - t0, 3s);
  EXPECT_THROW(a.fencedWrite({sinew::collectives::EtcdOp::put("/sinew/fence/state", "x")}),
               sinew::runtime::NotLeader);
  EXPECT_FALSE(etcd->get("/sinew/fence/state").has_value());
  sinew::runtime::LeaderElection b(o);
  ASSERT_TRUE(b.campaign("b", 20s, [] { return false; }));
  EXPECT_NE(b.term(), term);
  EXPECT_FALSE(a.leads());
  b.fencedWrite({sinew::collectives::EtcdOp::put("/sinew/fence/state", "y")});
  EXPECT_EQ(etcd->get("/sinew/fence/state")->value, "y");
}

// Values in etcd are believed only when sealed with the job token: a leader value without a
// seal, with another job's seal, or naming another term than its key's is waited past (a
// worker never connects to, and so never sends the token to, the address it names), and a
// job state that someone without the token wrote is skipped for the newest one a leader of
// the job stored. Before, the leader finder took any JSON with a port, and a garbage state
// made every candidate exit.
TEST(EtcdSealTest, ReadersBelieveOnlyValuesSealedWithTheJobToken) {
  if (sinew::testing::etcdPath().empty()) GTEST_SKIP() << "etcd is not installed";
  using sinew::collectives::openEtcdValue;
  using sinew::collectives::sealEtcdValue;
  const uint64_t token = 0x5eed, other = 0xbad;
  const std::string sealed = sealEtcdValue("/k", R"({"b":1,"a":"x"})", token);
  EXPECT_EQ(openEtcdValue("/k", sealed, token).value_or("none"), R"({"a":"x","b":1})");
  std::string why;
  EXPECT_FALSE(openEtcdValue("/k", sealed, other, &why));
  EXPECT_NE(why.find("seal is wrong"), std::string::npos) << why;
  EXPECT_FALSE(openEtcdValue("/other", sealed, token)) << "a seal binds the value to its key";
  json tampered = json::parse(sealed);
  tampered["b"] = 2;
  EXPECT_FALSE(openEtcdValue("/k", tampered.dump(), token));
  EXPECT_FALSE(openEtcdValue("/k", R"({"a":"x"})", token, &why));
  EXPECT_NE(why.find("no seal"), std::string::npos) << why;
  EXPECT_THROW(sealEtcdValue("/k", "[1]", token), sinew::InvalidArgument);

  EtcdCluster cluster(1);
  auto etcd = std::make_shared<EtcdClient>(cluster.options());
  const std::string key = sinew::runtime::haPrefix("sealed") + "leader";
  auto finder = sinew::runtime::etcdLeaderFinder(etcd, "sealed", token);
  etcd->put(key, R"({"host":"127.0.0.1","port":4242,"term":0})");
  const int64_t term = etcd->get(key)->createRevision;
  EXPECT_FALSE(finder(-1, 300ms, nullptr)) << "an unsealed leader value was believed";
  const std::string value =
      R"({"host":"127.0.0.1","port":4242,"term":)" + std::to_string(term) + "}";
  etcd->put(key, sealEtcdValue(key, value, other));
  EXPECT_FALSE(finder(-1, 300ms, nullptr)) << "another token's seal was believed";
  etcd->put(key, sealEtcdValue(key, R"({"host":"127.0.0.1","port":4242,"term":1})", token));
  EXPECT_FALSE(finder(-1, 300ms, nullptr)) << "a value of another term was believed";
  etcd->put(key, sealEtcdValue(key, value, token));
  auto leader = finder(-1, 300ms, nullptr);
  ASSERT_TRUE(leader);
  EXPECT_EQ(leader->port, 4242);
  EXPECT_EQ(leader->term, term);
  // A wait for another term (a client's watch while connected) ends when another thread
  // cancels it, not at its timeout; one cancelled before it begins does not wait.
  {
    sinew::Cancellation cancel;
    const auto t0 = std::chrono::steady_clock::now();
    auto canceller = std::async(std::launch::async, [&] {
      std::this_thread::sleep_for(300ms);
      cancel.cancel();
    });
    EXPECT_FALSE(finder(term, 30s, &cancel));
    const auto took = std::chrono::steady_clock::now() - t0;
    EXPECT_GE(took, 250ms);
    EXPECT_LT(took, 3s) << "the cancelled watch ran on";
    canceller.get();
    const auto t1 = std::chrono::steady_clock::now();
    EXPECT_FALSE(finder(term, 30s, &cancel));
    EXPECT_LT(std::chrono::steady_clock::now() - t1, 1s);
  }

  const std::string stateKey = sinew::runtime::haPrefix("sealed") + "state";
  etcd->put(stateKey, sealEtcdValue(stateKey, R"({"committed":5})", token));
  etcd->put(stateKey, R"({"committed":999,"failed":true})");
  etcd->put(stateKey, sealEtcdValue(stateKey, R"({"committed":1000})", other));
  std::vector<std::string> lines;
  auto state = sinew::runtime::newestSealedState(*etcd, stateKey, token,
                                                 [&](const std::string& l) { lines.push_back(l); });
  ASSERT_TRUE(state);
  EXPECT_EQ(json::parse(*state).value("committed", -1), 5);
  EXPECT_EQ(lines.size(), 2u);
  const std::string forgedOnly = sinew::runtime::haPrefix("forged") + "state";
  etcd->put(forgedOnly, R"({"finished":true})");
  try {
    sinew::runtime::newestSealedState(*etcd, forgedOnly, token, nullptr);
    ADD_FAILURE() << "a state nobody of the job wrote was used";
  } catch (const sinew::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("no version sealed"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(sinew::runtime::newestSealedState(*etcd, stateKey + "-none", token, nullptr));
}

// A job on an etcd whose authentication is on (every process has the password, as the
// members a job starts itself are set up): a stranger without it can neither forge the state
// nor delete the leader key; a forged "failed" state written with etcd's password but
// without the job token ends nothing (before, every standby candidate read it and exited 1);
// the leader is killed and the next one takes over; the job ends equal to the reference.
TEST_F(HaJobTest, AuthenticatedEtcdAndAForgedStateStopNothing) {
  etcd_->enableAuth("job-secret");
  cluster_->setCredentials("root", "job-secret");
  etcdEnv_ = {{"SINEW_ETCD_USER", "root"}, {"SINEW_ETCD_PASSWORD", "job-secret"}};
  startCoordinators();
  startWorkers(160);
  ASSERT_TRUE(waitCommitted(30, 120s));
  auto o = cluster_->options();
  o.timeout = 2s;
  EtcdClient stranger(o);
  EXPECT_THROW(stranger.put("/sinew/" + job_ + "/state", "garbage"), sinew::IoError);
  EXPECT_THROW(stranger.deleteKey("/sinew/" + job_ + "/leader"), sinew::IoError);
  etcd_->put("/sinew/" + job_ + "/state", R"({"failed":true,"finished":true})");
  std::this_thread::sleep_for(1s);  // the candidates poll the state every 500 ms
  for (auto& c : coordinators_) EXPECT_FALSE(reap(c, false)) << c.log << " ended on a forgery";
  auto ctl = sinewctl("status");
  EXPECT_EQ(ctl.out.find("cannot read"), std::string::npos) << ctl.out;
  killLeaderAndTimeFailover();
  expectExact({});
  for (auto& c : coordinators_) {
    if (c.status != 128 + SIGKILL) {
      EXPECT_EQ(c.status, 0) << c.log;
    }
  }
}

TEST_F(HaJobTest, LeaderKilledMidStep) {
  startCoordinators();
  startWorkers(160);
  ASSERT_TRUE(waitCommitted(40, 120s));
  // Candidates started without --control-port serve no control API, and sinewctl says so.
  auto ctl = sinewctl("status");
  EXPECT_EQ(ctl.status, 1) << ctl.out;
  EXPECT_NE(ctl.out.find("serves no control API"), std::string::npos) << ctl.out;
  const double failover = killLeaderAndTimeFailover();
  EXPECT_LT(failover, 3.0 * kLeaseTtl + 5.0);
  expectExact({});
  auto st = readJson("state");
  EXPECT_GE(st->value("epoch", 0), 1) << "the new leader starts a new epoch";
}

// A pipeline-parallel job (train_pp, 4 workers as two 2-stage pipelines: no worker can hold
// the model) loses its leader mid-step: the new leader takes the job over with the plan and
// templates it rebuilds from the stored request, and the job ends equal to the reference.
TEST_F(HaJobTest, PipelineJobLeaderKilledMidStep) {
#ifndef TRAIN_PP_PATH
  GTEST_SKIP() << "examples/train_pp is not built";
#else
  startCoordinators();
  startWorkers(60, 50, TRAIN_PP_PATH, {"--memory-bytes", "4400000", "--devices-per-node", "1"});
  ASSERT_TRUE(waitCommitted(15, 180s));
  auto st = readJson("state");
  ASSERT_TRUE(st);
  const double failover = killLeaderAndTimeFailover();
  EXPECT_LT(failover, 3.0 * kLeaseTtl + 5.0);
  // The lowest worker trains the single-process reference after the job: generous under ASan.
  expectExact({}, /*learnedLoss=*/2.0);
  const std::string out = slurp(workers_[0].log);
  EXPECT_NE(out.find("pipeline 0 of 2, stage 0"), std::string::npos) << "not a pipeline job:\n"
                                                                     << out;
#endif
}

// The control API moves with the leader (docs/ha.md): every candidate serves it on a free port
// while it leads, the leader key names it, and sinewctl finds it through etcd before and after
// a failover; the new leader refuses a wrong token as the old one did.
TEST_F(HaJobTest, ControlApiMovesWithTheLeader) {
  startCoordinators({"--control-port", "0"});
  startWorkers(160);
  ASSERT_TRUE(waitCommitted(20, 120s));
  auto before = sinewctl("--json status");
  ASSERT_EQ(before.status, 0) << before.out;
  json s = json::parse(before.out, nullptr, false);
  ASSERT_TRUE(s.is_object()) << before.out;
  EXPECT_GE(s.value("step", int64_t(0)), 20) << before.out;
  EXPECT_EQ(s.value("nodes", 0), kWorkers) << before.out;
  const int64_t epochBefore = s.value("epoch", int64_t(-1));
  killLeaderAndTimeFailover();
  ASSERT_TRUE(waitCommitted(committed() + 2, 60s));
  auto after = sinewctl("--json status");
  ASSERT_EQ(after.status, 0) << after.out;
  json s2 = json::parse(after.out, nullptr, false);
  ASSERT_TRUE(s2.is_object()) << after.out;
  EXPECT_GT(s2.value("epoch", int64_t(-1)), epochBefore) << after.out;
  EXPECT_GT(s2.value("step", int64_t(0)), s.value("step", int64_t(0))) << after.out;
  auto wrongToken = sinewctl("--token 1234 status");
  EXPECT_EQ(wrongToken.status, 1) << wrongToken.out;
  EXPECT_NE(wrongToken.out.find("answered 401"), std::string::npos) << wrongToken.out;
  expectExact({});
}

TEST_F(HaJobTest, LeaderKilledWithAWorker) {
  startCoordinators();
  startWorkers(160);
  ASSERT_TRUE(waitCommitted(40, 120s));
  killLeaderAndTimeFailover(workers_[3].pid);
  expectExact({3});
}

TEST_F(HaJobTest, PausedLeaderStepsDownWithoutWriting) {
  startCoordinators();
  startWorkers(200);
  ASSERT_TRUE(waitCommitted(30, 120s));
  auto [name, pid] = leader();
  ASSERT_GT(pid, 0);
  ::kill(pid, SIGSTOP);
  // Past its lease: another candidate leads, and the job goes on under it.
  const int64_t atStop = committed();
  const auto deadline = Clock::now() + 60s;
  std::string next;
  while (Clock::now() < deadline) {
    next = leader().first;
    if (!next.empty() && next != name && committed() > atStop + 5) break;
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_NE(next, name) << "no new leader while the old one was stopped";
  ASSERT_GT(committed(), atStop + 5) << "the job did not go on under the new leader";
  int64_t revision = 0;
  etcd_->get("/sinew/" + job_ + "/state", &revision);
  ::kill(pid, SIGCONT);
  expectExact({});
  // No state written after the resume came from the old leader.
  int writes = 0;
  while (true) {
    auto events = etcd_->watch("/sinew/" + job_ + "/state", false, revision + 1, 300ms);
    if (events.empty()) break;
    for (const auto& e : events) {
      revision = std::max(revision, e.kv.modRevision);
      if (e.deleted) continue;
      ++writes;
      json st = json::parse(e.kv.value);
      EXPECT_NE(st.value("leader", std::string()), name)
          << "the resumed old leader wrote " << e.kv.value;
    }
  }
  EXPECT_GT(writes, 0);
  Proc* old = coordinatorByPid(pid);
  ASSERT_NE(old, nullptr);
  EXPECT_NE(slurp(old->log).find("term is over"), std::string::npos) << slurp(old->log);
}

TEST_F(HaJobTest, OneEtcdMemberKilled) {
  startCoordinators();
  startWorkers(160);
  ASSERT_TRUE(waitCommitted(40, 120s));
  // Member 0 is the one every client talks to first.
  cluster_->kill(0);
  const int64_t at = committed();
  ASSERT_TRUE(waitCommitted(at + 20, 60s)) << "the job stopped with one etcd member lost";
  expectExact({});
}

// The newest "sinew: step N" progress line worker 0 printed (every 10 steps), or -1.
int64_t lastProgress(const std::string& log) {
  const std::string out = slurp(log);
  auto at = out.rfind("sinew: step ");
  if (at == std::string::npos) return -1;
  return std::atoll(out.c_str() + at + 12);
}

TEST_F(HaJobTest, TwoEtcdMembersKilledPauseTheJobUntilOneIsBack) {
  startCoordinators();
  startWorkers(300);
  ASSERT_TRUE(waitCommitted(40, 120s));
  cluster_->kill(0);
  cluster_->kill(1);
  // No majority: the leader cannot renew its lease, so within 3/4 of the TTL it stops
  // sending; no step commits after that (about 30 a second ran before).
  std::this_thread::sleep_for(std::chrono::milliseconds(kLeaseTtl * 750 + 1000));
  const int64_t paused = lastProgress(workers_[0].log);
  std::this_thread::sleep_for(3s);
  EXPECT_EQ(lastProgress(workers_[0].log), paused) << "steps went on without etcd";
  cluster_->restart(1);
  ASSERT_TRUE(cluster_->waitHealthy(30s));
  std::cout << "etcd lost its majority; worker 0 paused at step " << paused << std::endl;
  const auto deadline = Clock::now() + 60s;
  while (lastProgress(workers_[0].log) < paused + 20 && Clock::now() < deadline) {
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_GE(lastProgress(workers_[0].log), paused + 20) << "the job did not continue";
  expectExact({});
}

}  // namespace

#ifdef MPIEXEC_PATH
namespace {

// SINEW_HA=1 under mpirun --enable-recovery: the ranks of the first three nodes start the etcd
// members and the coordinator candidates themselves. Every process of one node (its rank's
// worker, its candidate and its etcd member) is SIGKILLed mid-job: node 0, or the node of the
// leader (which candidate wins is a race, so node 0 may or may not host it). The job runs to
// the end, exact.
// The job token the mpirun tests give (SINEW_TOKEN).
constexpr const char* kMpirunToken = "5eedc0de";

void killNodeUnderMpirun(bool leadersNode) {
  if (sinew::testing::etcdPath().empty()) GTEST_SKIP() << "etcd is not installed";
  const std::string dir = sinew::testing::logDir(leadersNode ? "ha-mpirun-leader" : "ha-mpirun-0");
  ASSERT_EQ(std::system(("mkdir -p '" + dir + "'").c_str()), 0);
  // Both cases give the same SINEW_TOKEN. Neither the job's name nor its etcd directories may
  // follow from it: the name is public (and was the token's low 40 bits), and when it followed
  // from the token, the etcd member killed with its node in the first case left its data
  // directory for the second to reuse, and that job failed.
  auto child = sinew::testing::start({MPIEXEC_PATH,
                                      "--allow-run-as-root",
                                      "--oversubscribe",
                                      "--enable-recovery",
                                      "-np",
                                      "4",
                                      "-x",
                                      "SINEW_NODE=node{rank}",
                                      "-x",
                                      "SINEW_HA=1",
                                      "-x",
                                      "SINEW_LOG_DIR=" + dir,
                                      "-x",
                                      "SINEW_CONTROL_PORT=0",
                                      "-x",
                                      std::string("SINEW_TOKEN=") + kMpirunToken,
                                      "-x",
                                      "SINEW_INJECT=slow:worker=*:ms=25",
                                      TRAIN_DP_PATH,
                                      "--steps",
                                      "200"},
                                     {});
  std::string killed;
  int victim = -1;
  int controlPort = 0;
  std::string jobName, victimDataDir, passwordFile, caFile, anonymousRefusal;
  bool tls = false;
  sinew::testing::ToolRun status;
  std::thread killer([&] {
    const auto deadline = Clock::now() + 120s;
    auto readFile = [&](const std::string& name) -> std::optional<json> {
      json j = json::parse(slurp(dir + "/" + name), nullptr, false);
      return j.is_object() ? std::optional<json>(j) : std::nullopt;
    };
    std::optional<json> any;
    while (Clock::now() < deadline && !(any = readFile("ha-rank-0.json"))) {
      std::this_thread::sleep_for(20ms);
    }
    if (!any) return;
    // The job's etcd speaks TLS with the launch's certificate authority and requires the
    // password the launch drew (each in a file only we may read).
    auto o = sinew::collectives::EtcdOptions();
    o.endpoints = sinew::collectives::parseEtcdEndpoints(any->at("etcd"), "test");
    tls = !o.endpoints.empty() && o.endpoints[0].tls;
    caFile = any->value("etcd_ca_file", std::string());
    o.caFile = caFile;
    EtcdClient anonymous(o);
    passwordFile = any->value("etcd_password_file", std::string());
    o.user = any->value("etcd_user", std::string());
    o.password = slurp(passwordFile);
    if (!o.password.empty() && o.password.back() == '\n') o.password.pop_back();
    EtcdClient etcd(o);
    jobName = any->at("job").get<std::string>();
    const std::string prefix = "/sinew/" + jobName + "/";
    while (Clock::now() < deadline) {
      try {
        auto kv = etcd.get(prefix + "state");
        if (kv && json::parse(kv->value).value("committed", -1) >= 40) break;
      } catch (const sinew::Error&) {
      }
      std::this_thread::sleep_for(20ms);
    }
    // Someone without the password can neither read nor write the job's keys.
    for (int i = 0; i < 100 && anonymousRefusal.empty(); ++i) {
      try {
        anonymous.put(prefix + "state", "garbage");
        std::this_thread::sleep_for(100ms);  // authentication not on yet
      } catch (const sinew::IoError& e) {
        anonymousRefusal = e.what();
      }
    }
    victim = 0;
    // The serving leader's control API (SINEW_CONTROL_PORT=0: a free port), found through etcd
    // and answering with the job token given in SINEW_TOKEN.
    auto leaderKv = etcd.get(prefix + "leader");
    const json leader = leaderKv ? json::parse(leaderKv->value) : json::object();
    controlPort = leader.value("control_port", 0);
    status = sinew::testing::runTool(
        std::string("SINEW_TOKEN=") + kMpirunToken + " SINEW_ETCD_USER=root " +
            "SINEW_ETCD_PASSWORD_FILE=" + passwordFile + " SINEW_ETCD_CA=" + caFile + " " +
            SINEWCTL_PATH,
        "--etcd " + any->at("etcd").get<std::string>() + " --job " + jobName + " --json status");
    if (leadersNode) {
      if (!leaderKv) return;
      victim = std::stoi(leader.value("candidate", std::string("m0")).substr(1));
    }
    auto rank = readFile("ha-rank-" + std::to_string(victim) + ".json");
    auto member = readFile("ha-m" + std::to_string(victim) + ".json");
    if (!rank || !member) return;
    for (const char* key : {"pid", "helper_pid"}) ::kill(rank->at(key).get<pid_t>(), SIGKILL);
    ::kill(member->at("etcd_pid").get<pid_t>(), SIGKILL);
    victimDataDir = member->value("data_dir", std::string());
    killed = rank->dump() + " " + member->dump();
  });
  auto run = sinew::testing::finish(child, 300s);
  killer.join();
  // The killed member's helper could not remove its etcd data; the others removed theirs.
  if (!victimDataDir.empty()) sinew::testing::removeTree(victimDataDir);
  SCOPED_TRACE(run.output);
  ASSERT_FALSE(killed.empty()) << "the node's processes were never found";
  EXPECT_GT(controlPort, 0) << "the leader serves no control API under SINEW_CONTROL_PORT=0";
  EXPECT_EQ(jobName.find(kMpirunToken), std::string::npos) << "the job's name shows its token";
  EXPECT_TRUE(tls) << "the job's etcd members do not speak TLS";
  EXPECT_NE(anonymousRefusal.find("without authentication"), std::string::npos)
      << "the job's etcd took a write without its password: " << anonymousRefusal;
  struct stat st {};
  ASSERT_EQ(::stat(passwordFile.c_str(), &st), 0) << passwordFile;
  EXPECT_EQ(st.st_mode & 0777, 0600u) << passwordFile;
  EXPECT_EQ(status.status, 0) << status.out;
  EXPECT_NE(status.out.find("\"epoch\""), std::string::npos) << status.out;
  std::cout << "killed node " << victim << ": " << killed << std::endl;
  {
    // Three etcd members on three distinct client addresses (two nodes once drew the same
    // port: one member never started, and the loss of a node left no majority).
    auto rank = json::parse(killed.substr(0, killed.find("} {") + 1));
    auto endpoints = sinew::collectives::parseEtcdEndpoints(rank.at("etcd"), "test");
    std::set<std::pair<std::string, uint16_t>> distinct;
    for (const auto& e : endpoints) distinct.insert({e.host, e.port});
    EXPECT_EQ(endpoints.size(), 3u) << rank.at("etcd");
    EXPECT_EQ(distinct.size(), endpoints.size()) << rank.at("etcd");
  }
  std::istringstream lines(run.output);
  for (std::string line; std::getline(lines, line);) {
    for (const char* what : {"leads the job", "took over", "declared dead", "RESULT"}) {
      if (line.find(what) != std::string::npos) std::cout << "  " << line << "\n";
    }
  }
  EXPECT_FALSE(run.timedOut) << "the job hung";
  auto r = parseResult(run.output);
  ASSERT_TRUE(r.found) << "no RESULT line";
  EXPECT_LE(r.maxRel, 1e-5);
  const int reporter = victim == 0 ? 1 : 0;
  EXPECT_NE(run.output.find("train_dp: worker " + std::to_string(reporter) + " done: 200 steps"),
            std::string::npos);
  EXPECT_NE(run.output.find("worker " + std::to_string(victim) + " declared dead"),
            std::string::npos);
  // The candidate that led at the end wrote how the job ended.
  const json outcome = json::parse(slurp(dir + "/outcome.json"), nullptr, false);
  ASSERT_TRUE(outcome.is_object()) << slurp(dir + "/outcome.json");
  EXPECT_EQ(outcome.value("outcome", ""), "finished") << outcome;
  EXPECT_EQ(outcome.value("step", -2), 199) << outcome;
  EXPECT_EQ(outcome.value("workers_lost", json()), json::array({victim})) << outcome;
}

TEST(HaMpirunTest, EveryProcessOfNodeZeroKilled) { killNodeUnderMpirun(false); }
TEST(HaMpirunTest, EveryProcessOfTheLeadersNodeKilled) { killNodeUnderMpirun(true); }

}  // namespace
#endif
