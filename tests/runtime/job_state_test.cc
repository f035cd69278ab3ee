// The coordinator's job-state machine (runtime/job_state.h) driven by exact event sequences
// and times: no sockets, no threads, no sleeps. What the coordinator decides — when an epoch
// forms, when a step commits, who is declared dead and when, who is released — is checked
// against the frames and events it emits. The socket side (bad input, the wire) is tested over
// real connections in coordinator_test.cc and validation_test.cc.

#include <gtest/gtest.h>

#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "sinew/runtime/job_state.h"

namespace sinew {
namespace runtime {
namespace {

using namespace std::chrono_literals;
using Type = wire::Type;

class Machine {
 public:
  explicit Machine(int workers, CoordinatorOptions o = {}) {
    o.expectedWorkers = workers;
    o.heartbeatInterval = 100ms;
    o.deadAfter = 1000ms;
    o.startTimeout = 5000ms;
    o.log = [this](const std::string& line) { logs.push_back(line); };
    options = o;
    state = std::make_unique<JobState>(o, 4242, t);
  }

  // Advances the clock and ticks.
  void advance(std::chrono::milliseconds d) {
    t += d;
    state->tick(t);
    collect();
  }
  // Advances by `d` in heartbeat intervals, each of `sessions` heartbeating (epoch `epoch`).
  void idle(std::chrono::milliseconds d, const std::vector<JobState::SessionId>& sessions,
            int64_t epoch = -1) {
    for (auto left = d; left.count() > 0; left -= std::min(left, options.heartbeatInterval)) {
      advance(std::min(left, options.heartbeatInterval));
      for (auto s : sessions) frame(s, Type::kHeartbeat, epoch, json::object());
    }
  }
  void frame(JobState::SessionId s, Type type, int64_t epoch, const json& body) {
    state->onFrame(s, static_cast<uint8_t>(type), epoch, body, t);
    collect();
  }
  void closed(JobState::SessionId s, const std::string& why = "connection closed") {
    state->onClosed(s, why, t);
    collect();
  }
  // Worker `id` (its connection is session id + 1) says hello from `node` and is ready.
  void join(int id, const std::string& node, int64_t resume = 0) {
    hello(id + 1, id, node);
    frame(id + 1, Type::kReady, -1, json{{"resume_step", resume}});
  }
  void hello(JobState::SessionId s, int id, const std::string& node) {
    frame(s, Type::kHello, -1, json{{"worker", id}, {"node", node}, {"pid", 1000 + s}});
  }
  void vote(int id, int64_t epoch, int64_t step) {
    frame(id + 1, Type::kVote, epoch, json{{"step", step}});
  }

  // Frames of `type` sent on session s since the last clear().
  std::vector<json> sent(JobState::SessionId s, Type type) const {
    std::vector<json> out;
    for (const auto& f : frames) {
      if (f.session == s && f.type == type) out.push_back(*f.body);
    }
    return out;
  }
  bool hasEvent(const std::string& name, int worker = -1) const {
    for (const auto& e : events) {
      if (e.at("event") == name && (worker < 0 || e.value("worker", -1) == worker)) return true;
    }
    return false;
  }
  void clear() {
    frames.clear();
    events.clear();
  }

  CoordinatorOptions options;
  Clock::time_point t{std::chrono::seconds(1000)};
  std::unique_ptr<JobState> state;
  std::vector<JobState::Frame> frames;
  std::vector<json> events;
  std::vector<JobState::SessionId> closes;
  std::vector<std::string> logs;

 private:
  void collect() {
    JobState::Effects fx = state->take();
    frames.insert(frames.end(), fx.frames.begin(), fx.frames.end());
    events.insert(events.end(), fx.events.begin(), fx.events.end());
    closes.insert(closes.end(), fx.closes.begin(), fx.closes.end());
  }
};

// The first epoch waits for every launch rank's ready, resumes after the oldest checkpoint any
// rank found, and a joiner that came first neither takes a rank's id nor counts as one.
TEST(JobStateTest, FirstEpochWaitsForEveryRankAndResumesAfterTheOldestCheckpoint) {
  Machine m(2);
  m.hello(9, -1, "j");  // A joiner before the ranks: id 2, after every launch rank.
  ASSERT_EQ(m.sent(9, Type::kWelcome).size(), 1u);
  EXPECT_EQ(m.sent(9, Type::kWelcome)[0].at("worker"), 2);
  EXPECT_EQ(m.sent(9, Type::kWelcome)[0].at("store_port"), 4242);
  m.join(0, "a", 40);
  EXPECT_EQ(m.state->epoch(), -1) << "the first epoch formed without rank 1";
  m.idle(4999ms, {1, 9});
  EXPECT_EQ(m.state->epoch(), -1);
  m.join(1, "b", 30);
  EXPECT_EQ(m.state->epoch(), 0);
  EXPECT_EQ(m.state->committed(), 29);
  for (JobState::SessionId s : {1, 2, 9}) {
    auto epochs = m.sent(s, Type::kEpoch);
    ASSERT_EQ(epochs.size(), 1u) << "session " << s;
    EXPECT_EQ(epochs[0].at("members"), (std::vector<int>{0, 1, 2}));
    EXPECT_EQ(epochs[0].at("joined"), std::vector<int>{2});
    EXPECT_EQ(epochs[0].at("resume_step"), 30);
    EXPECT_EQ(epochs[0].at("source"), 0);
    EXPECT_TRUE(epochs[0].at("sync").get<bool>());
  }
}

// Without every rank, the first epoch forms at the start timeout, to the millisecond, with the
// ranks that were ready; one that said hello but never became ready is left out and told so.
TEST(JobStateTest, StartTimeoutFormsTheFirstEpochWithTheReadyRanks) {
  Machine m(3);
  m.join(0, "a");
  m.hello(2, 1, "b");  // Never ready.
  m.idle(4999ms, {1, 2});
  EXPECT_EQ(m.state->epoch(), -1);
  m.advance(1ms);
  EXPECT_EQ(m.state->epoch(), 0);
  EXPECT_EQ(m.state->members(), std::vector<int>{0});
  auto expelled = m.sent(2, Type::kExpelled);
  ASSERT_EQ(expelled.size(), 1u);
  EXPECT_EQ(expelled[0].at("reason"), "not ready when the first epoch formed");
}

// A step commits only when every member voted; a member that dies after one vote is in leaves
// that step uncommitted, and the next epoch resumes at it without the dead member (whose node
// partner goes with it).
TEST(JobStateTest, StepCommitsOnlyWhenEveryMemberVoted) {
  Machine m(3);
  m.join(0, "a");
  m.join(1, "b");
  m.join(2, "b");
  m.clear();
  m.vote(0, 0, 0);
  m.vote(1, 0, 0);
  EXPECT_TRUE(m.sent(1, Type::kCommit).empty()) << "committed before worker 2 voted";
  m.vote(2, 0, 0);
  for (JobState::SessionId s : {1, 2, 3}) {
    auto commits = m.sent(s, Type::kCommit);
    ASSERT_EQ(commits.size(), 1u);
    EXPECT_EQ(commits[0].at("step"), 0);
    EXPECT_FALSE(commits[0].contains("next_epoch"));
  }
  EXPECT_EQ(m.state->committed(), 0);
  m.clear();
  m.vote(0, 0, 1);
  m.closed(2);  // Worker 1 dies; worker 2 shares its node "b".
  EXPECT_TRUE(m.sent(1, Type::kCommit).empty());
  EXPECT_EQ(m.state->committed(), 0);
  EXPECT_EQ(m.state->epoch(), 1);
  EXPECT_EQ(m.state->members(), std::vector<int>{0});
  auto epochs = m.sent(1, Type::kEpoch);
  ASSERT_EQ(epochs.size(), 1u);
  EXPECT_EQ(epochs[0].at("resume_step"), 1);
  EXPECT_FALSE(epochs[0].at("sync").get<bool>());
  EXPECT_EQ(m.sent(3, Type::kExpelled).size(), 1u) << "worker 2 of the same node stayed";
  EXPECT_EQ(m.state->coordinatorStatus().dead, (std::vector<int>{1, 2}));
  // A vote of the old epoch that crossed the change is ignored, not a violation.
  m.vote(0, 0, 1);
  EXPECT_EQ(m.state->committed(), 0);
}

// A member that had no verdict on its vote in time withdraws it (issue 39, item 2). If the step
// is already committed (a paused coordinator read every vote first), the withdrawal changes
// nothing: the commit was sent before it was read. Otherwise the vote is dropped and the next
// epoch, with the same members and no state copy, resumes at that step; the other member's
// vote for it, sent in the old epoch, is ignored.
TEST(JobStateTest, AWithdrawnVoteCountsOnlyIfItsStepIsAlreadyCommitted) {
  Machine m(2);
  m.join(0, "a");
  m.join(1, "b");
  m.clear();
  m.vote(0, 0, 0);
  m.vote(1, 0, 0);
  m.frame(1, Type::kWithdraw, 0, json{{"step", 0}});
  m.frame(2, Type::kWithdraw, 0, json{{"step", 0}});
  EXPECT_EQ(m.state->committed(), 0);
  EXPECT_EQ(m.state->epoch(), 0) << "a withdrawal of a committed step started an epoch";
  EXPECT_EQ(m.sent(1, Type::kCommit).size(), 1u);
  m.clear();
  m.vote(0, 0, 1);
  m.frame(2, Type::kWithdraw, 0, json{{"step", 1}});  // Worker 1 gave no vote: ignored.
  EXPECT_EQ(m.state->epoch(), 0);
  m.frame(1, Type::kWithdraw, 0, json{{"step", 1}});
  EXPECT_EQ(m.state->committed(), 0);
  EXPECT_EQ(m.state->epoch(), 1);
  EXPECT_TRUE(m.hasEvent("vote_withdrawn", 0));
  for (JobState::SessionId s : {1, 2}) {
    auto epochs = m.sent(s, Type::kEpoch);
    ASSERT_EQ(epochs.size(), 1u) << "session " << s;
    EXPECT_EQ(epochs[0].at("resume_step"), 1);
    EXPECT_EQ(epochs[0].at("members"), (std::vector<int>{0, 1}));
    EXPECT_FALSE(epochs[0].at("sync").get<bool>());
  }
  m.vote(1, 0, 1);  // Crossed the epoch change: ignored.
  m.frame(2, Type::kWithdraw, 0, json{{"step", 1}});
  EXPECT_EQ(m.state->committed(), 0);
  EXPECT_EQ(m.state->epoch(), 1);
  m.vote(0, 1, 1);
  m.vote(1, 1, 1);
  EXPECT_EQ(m.state->committed(), 1);
  EXPECT_TRUE(m.state->coordinatorStatus().dead.empty());
}

// The metrics of a job that committed steps, lost a worker and recovered.
std::string metricsAfterARecovery() {
  Machine m(3);
  m.join(0, "a");
  m.join(1, "b");
  m.join(2, "c");
  for (int w = 0; w < 3; ++w) m.vote(w, 0, 0);
  m.closed(3);  // Worker 2 dies.
  m.frame(1, Type::kHeartbeat, 1, json::object());
  m.advance(200ms);
  m.vote(0, 1, 1);
  m.vote(1, 1, 1);
  EXPECT_EQ(m.state->committed(), 1);
  return m.state->metrics(m.t);
}

std::set<std::string> metricNames(const std::string& text) {
  std::set<std::string> names;
  const std::regex type(R"(# TYPE (\S+) \S+)");
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (std::regex_match(line, m, type)) names.insert(m[1]);
  }
  return names;
}

// Every metric the coordinator exports is a row of docs/control_api.md's metrics table (with
// its type), and every row is exported.
TEST(JobStateTest, EveryMetricIsDocumentedWithItsType) {
  const std::string text = metricsAfterARecovery();
  std::ifstream doc(SINEW_CONTROL_DOC);
  ASSERT_TRUE(doc) << SINEW_CONTROL_DOC;
  std::map<std::string, std::string> documented;  // name -> type
  const std::regex row(R"(\| `(sinew_[a-z_]+)(\{[a-z,]+\})?` \| (counter|gauge) \|.*)");
  for (std::string line; std::getline(doc, line);) {
    std::smatch m;
    if (std::regex_match(line, m, row)) documented[m[1]] = m[3];
  }
  const std::set<std::string> exported = metricNames(text);
  EXPECT_GE(exported.size(), 19u);
  for (const std::string& name : exported) {
    ASSERT_TRUE(documented.count(name)) << name << " is not in the doc's table";
    const std::regex typeLine("# TYPE " + name + " " + documented[name]);
    EXPECT_TRUE(std::regex_search(text, typeLine)) << name << " is not a " << documented[name];
  }
  for (const auto& [name, type] : documented) {
    EXPECT_TRUE(exported.count(name)) << name << " is documented but not exported";
  }
}

// Prometheus's own linter accepts the text (counters end in _total, no reserved suffixes).
TEST(JobStateTest, MetricsPassPromtool) {
#ifndef PROMTOOL_PATH
  GTEST_SKIP() << "promtool not found at configure time (Debian's prometheus package has it)";
#else
  const std::string text = metricsAfterARecovery();
  const std::string out = ::testing::TempDir() + "promtool-" + std::to_string(getpid());
  const std::string cmd = std::string(PROMTOOL_PATH) + " check metrics > " + out + " 2>&1";
  FILE* pipe = popen(cmd.c_str(), "w");
  ASSERT_NE(pipe, nullptr);
  fwrite(text.data(), 1, text.size(), pipe);
  const int status = pclose(pipe);
  std::ifstream in(out);
  std::stringstream said;
  said << in.rdbuf();
  std::remove(out.c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "promtool check metrics: " << said.str() << "\n"
      << text;
  EXPECT_EQ(said.str(), "");
#endif
}

// Liveness: a worker that says nothing for deadAfter is declared dead at the first check after
// that, not before; anything it sends counts as a heartbeat. A coordinator that did not run for
// a while (a pause longer than a check interval plus a heartbeat) does not count that time
// against the workers.
TEST(JobStateTest, SilenceIsDeathAfterDeadAfterButTheCoordinatorsOwnPauseIsNot) {
  Machine m(2);
  m.join(0, "a");
  m.join(1, "b");
  for (int i = 0; i < 9; ++i) {
    m.advance(50ms);
    m.frame(1, Type::kHeartbeat, 0, json::object());
  }
  m.advance(50ms);  // Worker 1 silent for 500 ms so far.
  for (int i = 0; i < 9; ++i) {
    m.advance(50ms);
    m.frame(1, Type::kHeartbeat, 0, json::object());
  }
  EXPECT_EQ(m.state->epoch(), 0) << "declared dead before deadAfter";
  m.advance(50ms);  // 1000 ms: not yet more than deadAfter.
  EXPECT_EQ(m.state->epoch(), 0);
  m.frame(1, Type::kHeartbeat, 0, json::object());
  m.advance(50ms);
  EXPECT_EQ(m.state->epoch(), 1) << "worker 1 silent for 1050 ms is still a member";
  EXPECT_TRUE(m.hasEvent("failure", 1));
  EXPECT_EQ(m.state->members(), std::vector<int>{0});

  Machine p(2);
  p.join(0, "a");
  p.join(1, "b");
  p.advance(50ms);
  p.advance(5000ms);  // The coordinator itself stopped for 5 s.
  EXPECT_EQ(p.state->epoch(), 0) << "the coordinator's pause was blamed on the workers";
  EXPECT_TRUE(p.hasEvent("coordinator_paused"));
}

// A preempted member is released at the next step boundary: the commit tells everyone a new
// epoch follows, the leaver gets its release, the others a new epoch without it; its closing
// connection is then no failure. The last member leaving stops the job.
TEST(JobStateTest, PreemptedWorkerIsReleasedAtTheBoundaryAndItsExitIsNoFailure) {
  Machine m(2);
  m.join(0, "a");
  m.join(1, "b");
  m.clear();
  m.frame(2, Type::kLeave, 0, json{{"step", 0}});
  m.vote(0, 0, 0);
  m.vote(1, 0, 0);
  for (JobState::SessionId s : {1, 2}) {
    auto commits = m.sent(s, Type::kCommit);
    ASSERT_EQ(commits.size(), 1u);
    EXPECT_TRUE(commits[0].value("next_epoch", false));
  }
  ASSERT_EQ(m.sent(2, Type::kReleased).size(), 1u);
  EXPECT_EQ(m.state->members(), std::vector<int>{0});
  EXPECT_EQ(m.sent(1, Type::kEpoch).at(0).at("resume_step"), 1);
  m.closed(2);
  EXPECT_TRUE(m.hasEvent("worker_exited", 1));
  EXPECT_FALSE(m.hasEvent("failure"));
  EXPECT_TRUE(m.state->coordinatorStatus().dead.empty());
  EXPECT_EQ(m.state->coordinatorStatus().released, std::vector<int>{1});
  m.frame(1, Type::kLeave, 1, json{{"step", 1}});
  m.vote(0, 1, 1);
  EXPECT_TRUE(m.state->over());
  EXPECT_TRUE(m.state->coordinatorStatus().stopped);
}

// The job finishes when every member is done, not before; done workers closing their
// connections are no failure.
TEST(JobStateTest, JobFinishesWhenEveryMemberIsDone) {
  Machine m(2);
  m.join(0, "a");
  m.join(1, "b");
  m.frame(1, Type::kDone, 0, json{{"step", 10}});
  EXPECT_FALSE(m.state->over());
  m.frame(2, Type::kDone, 0, json{{"step", 10}});
  EXPECT_TRUE(m.state->over());
  EXPECT_TRUE(m.state->finishedWithWork());
  m.closed(1);
  m.closed(2);
  EXPECT_TRUE(m.state->coordinatorStatus().dead.empty());
  EXPECT_FALSE(m.hasEvent("failure"));
}

// A member that dies after the last step was committed (here after the others are done and
// gone) does not fail the job: every step is committed and the others applied it. Before, a new
// epoch of no members followed and the job was reported failed ("every member was lost before
// the last step"; seen with sinew-run and a kill at the last step's optimizer phase). The
// outcome says finished, with the dead worker lost.
TEST(JobStateTest, ADeathAfterTheLastCommitDoesNotFailTheJob) {
  Machine m(3);
  for (int id = 0; id < 3; ++id) {
    m.hello(id + 1, id, "n" + std::to_string(id));
    m.frame(id + 1, Type::kReady, -1,
            json{{"resume_step", 0}, {"global_batch", 6}, {"microbatch", 2}, {"steps", 2}});
  }
  for (int64_t step = 0; step < 2; ++step) {
    for (int id = 0; id < 3; ++id) m.vote(id, 0, step);
  }
  ASSERT_EQ(m.state->committed(), 1);
  m.frame(1, Type::kDone, 0, json{{"step", 2}});
  m.frame(2, Type::kDone, 0, json{{"step", 2}});
  m.closed(1);
  m.closed(2);
  m.closed(3);  // Worker 2 dies before its done.
  EXPECT_TRUE(m.state->over());
  EXPECT_TRUE(m.state->finishedWithWork());
  EXPECT_EQ(m.state->epoch(), 0) << "no new epoch after the last commit";
  const json outcome = m.state->outcome();
  EXPECT_EQ(outcome.value("outcome", ""), "finished") << outcome;
  EXPECT_EQ(outcome["workers_lost"], json::array({2})) << outcome;
}

// Rule 1 of docs/failure_semantics.md: with step times measured, a member that computes on
// while the others have waited past the step deadline is declared dead; a member that was
// waiting moments ago (its neighbour's stall just ended) is not blamed.
TEST(JobStateTest, AStuckMemberIsBlamedNotTheOnesThatWaitedForIt) {
  CoordinatorOptions o;
  o.progressFloor = 800ms;
  o.progressFactor = 1;
  Machine m(3, o);
  m.join(0, "a");
  m.join(1, "b");
  m.join(2, "c");
  for (int64_t step : {0, 1}) {
    m.advance(100ms);
    for (int w : {0, 1, 2}) m.vote(w, 0, step);
  }
  EXPECT_EQ(m.state->committed(), 1);
  auto progress = [&](int w, bool waiting) {
    m.frame(w + 1, Type::kHeartbeat, 0, json{{"step", 2}, {"waiting", waiting}});
  };
  progress(2, false);  // Computing step 2, and stuck there.
  progress(0, true);
  progress(1, true);
  for (int i = 0; i < 6; ++i) {
    m.advance(100ms);
    for (int w : {0, 1, 2}) progress(w, w != 2);
  }
  progress(1, false);  // Worker 1 answered: computing again.
  for (int i = 0; i < 3; ++i) {
    m.advance(100ms);
    progress(0, true);
    progress(1, false);
    progress(2, false);
  }
  EXPECT_EQ(m.state->members(), (std::vector<int>{0, 1})) << "worker 1 was blamed for 2's stall";
  bool blamed2 = false, blamed1 = false;
  for (const auto& line : m.logs) {
    blamed2 = blamed2 || line.find("worker 2 declared dead: no progress on step 2") != line.npos;
    blamed1 = blamed1 || line.find("worker 1 declared dead") != line.npos;
  }
  EXPECT_TRUE(blamed2);
  EXPECT_FALSE(blamed1);
}

// A job's limits (docs/control_api.md, "Limits"): set at launch, shown in status, changed
// through the API, kept across a change of leader, and a resize or a drain outside them is
// refused naming the limit; one inside them goes ahead.
TEST(JobStateTest, LimitsRefuseResizesAndDrainsOutsideThem) {
  CoordinatorOptions o;
  o.limits.minNodes = 2;
  o.limits.maxNodes = 6;
  o.limits.sizes = {2, 3, 4, 6};
  o.limits.priority = 5;
  std::string stored;  // What a leader stores in etcd (HA), for a new leader to take over.
  o.persist = [&stored](const std::string& state) { stored = state; };
  Machine m(3, o);
  m.join(0, "a");
  m.join(1, "b");
  m.join(2, "c");
  ASSERT_EQ(m.state->epoch(), 0);
  const json limits = m.state->status(m.t).body.at("limits");
  EXPECT_EQ(limits.at("min_nodes"), 2);
  EXPECT_EQ(limits.at("max_nodes"), 6);
  EXPECT_EQ(limits.at("sizes"), (std::vector<int64_t>{2, 3, 4, 6}));
  EXPECT_EQ(limits.at("priority"), 5);
  EXPECT_TRUE(limits.at("preemptible").get<bool>());
  EXPECT_TRUE(limits.at("deadline_unix_s").is_null());

  ControlReply r = m.state->resize(1, m.t);
  EXPECT_EQ(r.status, 409);
  EXPECT_EQ(r.body.at("error"),
            "resize to 1 nodes: below the job's min_nodes 2 (POST /v1/limits changes them)");
  r = m.state->resize(7, m.t);
  EXPECT_EQ(r.status, 409);
  EXPECT_NE(r.body.at("error").get<std::string>().find("above the job's max_nodes 6"),
            std::string::npos);
  r = m.state->resize(5, m.t);
  EXPECT_EQ(r.status, 409);
  EXPECT_NE(r.body.at("error").get<std::string>().find("not one of the job's sizes [2, 3, 4, 6]"),
            std::string::npos);
  m.advance(0ms);  // Collects what the calls emitted.
  EXPECT_FALSE(m.hasEvent("resize")) << "a refused resize changed the job";

  // Two of three nodes drained would leave 1, below the minimum; one leaves 2.
  control::DrainRequest d;
  d.nodes = {"a", "b"};
  d.deadlineSeconds = 60;
  r = m.state->drain(d, m.t);
  EXPECT_EQ(r.status, 409);
  EXPECT_EQ(r.body.at("error"),
            "drain: it would leave 1 nodes, below the job's min_nodes 2 (stop the job, or lower "
            "min_nodes with POST /v1/limits)");
  m.advance(0ms);
  EXPECT_FALSE(m.hasEvent("drain"));

  // Lowered through the API: the same drain is taken (it leaves 1 node, the new minimum), and
  // the change is an event.
  r = m.state->limits(json{{"min_nodes", 1}, {"sizes", nullptr}}, m.t);
  ASSERT_EQ(r.status, 200) << r.body.dump();
  EXPECT_EQ(r.body.at("limits").at("min_nodes"), 1);
  EXPECT_EQ(r.body.at("limits").at("max_nodes"), 6) << "a field not given was changed";
  EXPECT_EQ(r.body.at("limits").at("sizes"), json::array());
  m.advance(0ms);
  EXPECT_TRUE(m.hasEvent("limits"));
  r = m.state->drain(d, m.t);
  EXPECT_EQ(r.status, 200) << r.body.dump();
  m.advance(0ms);
  EXPECT_TRUE(m.hasEvent("drain"));
  r = m.state->limits(json{{"min_nodes", 7}}, m.t);
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(
      r.body.at("error").get<std::string>().rfind("limits: min_nodes 7 is above max_nodes 6", 0),
      0u)
      << r.body.dump();

  // A new leader takes the limits over with the state.
  CoordinatorOptions o2;
  o2.expectedWorkers = 3;
  o2.takeoverState = stored;
  JobState next(o2, 4242, m.t);
  const json taken = next.status(m.t).body.at("limits");
  EXPECT_EQ(taken.at("min_nodes"), 1);
  EXPECT_EQ(taken.at("max_nodes"), 6);
  EXPECT_EQ(taken.at("priority"), 5);
}

// A drain's reply prices the drain as its dry run did: the workers it takes out are still
// counted as they were before it (before, the reply's cost was the present size's, since the
// drained workers were already on their way out: no pause, no straggler's speed-up).
TEST(JobStateTest, ADrainRepliesWithTheCostItsDryRunPredicted) {
  Machine m(3);
  const json shape = {{"resume_step", 0}, {"global_batch", 64}, {"microbatch", 8}, {"steps", 1000}};
  const std::vector<std::string> nodes = {"a", "b", "c"};
  for (int id = 0; id < 3; ++id) {
    m.hello(id + 1, id, nodes[id]);
    m.frame(id + 1, Type::kReady, -1, shape);
  }
  ASSERT_EQ(m.state->epoch(), 0);
  // Six steps of 80 ms; node c's worker computes for 70 ms of each, the others for 30.
  for (int64_t step = 0; step < 6; ++step) {
    m.advance(80ms);
    for (int id = 0; id < 3; ++id) {
      m.frame(id + 1, Type::kVote, 0, {{"step", step}, {"compute_us", id == 2 ? 70000 : 30000}});
    }
    ASSERT_EQ(m.state->committed(), step);
  }
  control::DrainRequest d;
  d.nodes = {"c"};
  d.dryRun = true;
  ControlReply dry = m.state->drain(d, m.t);
  ASSERT_EQ(dry.status, 200) << dry.body.dump();
  d.dryRun = false;
  ControlReply real = m.state->drain(d, m.t);
  ASSERT_EQ(real.status, 200) << real.body.dump();
  const json& want = dry.body.at("cost");
  const json& got = real.body.at("cost");
  EXPECT_NEAR(want.at("straggler_speedup").get<double>(), 70.0 / 30, 1e-9) << want.dump();
  for (const char* key :
       {"workers_after", "nodes_after", "samples_per_s_now", "samples_per_s_after",
        "straggler_speedup", "pause_s", "basis", "bytes", "rollback", "feasible"}) {
    EXPECT_EQ(got.value(key, json()), want.value(key, json())) << key << ": " << got.dump();
  }
}

// Bad messages are refused with a typed error the caller drops the connection for; the
// machine's state does not change.
// What a scheduler reads (docs/control_api.md, "GET /v1/scaling" and "The scheduler
// contract"): a job that ran at 2, 3 and 1 workers shows each measured point as its prediction,
// predicts the sizes around them from the fit, prices each size from the changes it measured
// (a grow's pause and bytes per joiner), names the straggler's node as the cheapest to take
// back, and ends each epoch change with a "reconfigured" event carrying its pause and bytes.
TEST(JobStateTest, ScalingCostsAndReconfiguredEventsComeFromWhatTheJobMeasured) {
  Machine m(2);
  const json shape = {{"resume_step", 0}, {"global_batch", 64}, {"microbatch", 8}, {"steps", 1000}};
  m.hello(1, 0, "a");
  m.frame(1, Type::kReady, -1, shape);
  m.hello(2, 1, "b");
  m.frame(2, Type::kReady, -1, shape);
  ASSERT_EQ(m.state->epoch(), 0);
  int64_t step = 0;
  // `count` steps of `ms` each by `members`; compute_us per worker from `compute` (ms).
  auto steps = [&](int count, int ms, const std::vector<int>& members,
                   std::map<int, int> compute = {}, std::map<int, int64_t> bytesIn = {}) {
    for (int k = 0; k < count; ++k) {
      m.advance(std::chrono::milliseconds(ms));
      for (int id : members) {
        json body = {{"step", step}, {"compute_us", 1000 * (compute.count(id) ? compute[id] : 30)}};
        if (k == 0 && bytesIn.count(id)) body["state_bytes_in"] = bytesIn[id];
        m.frame(id + 1, Type::kVote, m.state->epoch(), body);
      }
      ASSERT_EQ(m.state->committed(), step) << "step " << step << " did not commit";
      step++;
    }
  };
  steps(6, 100, {0, 1});
  // A joiner enters at the next boundary; its epoch's first step takes 400 ms (one 100 ms
  // step and 300 ms of set-up), and it took in 1000 bytes of state.
  m.hello(3, 2, "c");
  m.frame(3, Type::kReady, -1, shape);
  steps(1, 100, {0, 1});
  ASSERT_EQ(m.state->members(), (std::vector<int>{0, 1, 2}));
  m.clear();
  steps(1, 400, {0, 1, 2}, {}, {{2, 1000}});
  json grown;
  for (const auto& e : m.events) {
    if (e.at("event") == "reconfigured") grown = e;
  }
  ASSERT_FALSE(grown.is_null()) << "no reconfigured event after the join";
  EXPECT_EQ(grown.at("kind"), "grow");
  EXPECT_EQ(grown.at("causes"), std::vector<std::string>{"join"});
  EXPECT_EQ(grown.at("from_workers"), 2);
  EXPECT_EQ(grown.at("to_workers"), 3);
  EXPECT_NEAR(grown.at("pause_s").get<double>(), 0.3, 1e-9);
  EXPECT_EQ(grown.at("state_bytes_in"), 1000);
  // Three workers, node c's twice as slow in compute as the others.
  steps(6, 80, {0, 1, 2}, {{2, 70}});

  json s = m.state->scaling(m.t).body;
  ASSERT_EQ(s.at("node_costs").size(), 3u) << s.dump();
  const json& cheapest = s.at("node_costs")[0];
  EXPECT_EQ(cheapest.at("node"), "c") << "the straggler's node is not the cheapest to take back";
  // Two workers measured 640 samples/s; without the 70 ms straggler the 30 ms ones run 7/3 as fast.
  EXPECT_NEAR(cheapest.at("samples_per_s_after").get<double>(), 640.0 * 70 / 30, 1e-6);
  EXPECT_EQ(cheapest.at("bytes"), 0);
  EXPECT_FALSE(cheapest.at("rollback").get<bool>());
  control::DrainRequest dry;
  dry.nodes = {"a"};
  dry.dryRun = true;
  ControlReply r = m.state->drain(dry, m.t);
  ASSERT_EQ(r.status, 200) << r.body.dump();
  EXPECT_TRUE(r.body.at("dry_run").get<bool>());
  EXPECT_EQ(r.body.at("workers"), std::vector<int>{0});
  EXPECT_EQ(r.body.at("cost").at("workers_after"), 2);
  m.advance(0ms);
  EXPECT_FALSE(m.hasEvent("drain")) << "a dry run drained";
  EXPECT_TRUE(m.state->status(m.t).body.at("drains").empty());

  // Shrunk to one node: c (the slowest) and b (the newest of the rest) go at the boundary.
  r = m.state->resize(1, m.t);
  ASSERT_EQ(r.status, 200) << r.body.dump();
  steps(1, 80, {0, 1, 2}, {{2, 70}});
  ASSERT_EQ(m.state->members(), std::vector<int>{0});
  m.clear();
  steps(1, 250, {0});
  ASSERT_TRUE(m.hasEvent("reconfigured"));
  steps(5, 150, {0});

  s = m.state->scaling(m.t).body;
  std::map<int, json> at;
  for (const auto& p : s.at("points")) at[p.at("workers").get<int>()] = p;
  // Measured sizes: the prediction is the measurement, with its spread and step count.
  for (const auto& [n, seconds] : std::map<int, double>{{1, 0.15}, {2, 0.1}, {3, 0.08}}) {
    const json& p = at.at(n);
    EXPECT_NEAR(p.at("measured_samples_per_s").get<double>(), 64 / seconds, 1e-6) << n;
    EXPECT_EQ(p.at("predicted_samples_per_s"), p.at("measured_samples_per_s")) << n;
    EXPECT_EQ(p.at("basis"), "measured") << n;
    EXPECT_NEAR(p.at("measured_p10_samples_per_s").get<double>(), 64 / seconds, 1e-6) << n;
  }
  EXPECT_EQ(at.at(2).at("measured_steps"), 6);
  EXPECT_EQ(at.at(4).at("basis"), "extrapolated");
  EXPECT_TRUE(at.at(4).at("model_error").is_number());
  EXPECT_GT(at.at(4).at("predicted_samples_per_s").get<double>(), 0);
  // Eight microbatches: nine workers cannot take part.
  EXPECT_FALSE(at.at(9).at("feasible").get<bool>());
  // The cost of going back to 3: the grow's pause; the state (1000 bytes a member, as
  // measured) broadcast to the two members that are not its source.
  const json& cost = at.at(3).at("cost");
  EXPECT_NEAR(cost.at("pause_s").get<double>(), 0.3, 1e-9);
  EXPECT_EQ(cost.at("basis"), "measured grow (1)");
  EXPECT_EQ(cost.at("bytes"), 2000);
  EXPECT_EQ(at.at(1).at("cost").at("pause_s"), 0.0);
  EXPECT_EQ(at.at(2).at("cost").at("bytes"), 1000);
  const int64_t left = 1000 - step;
  EXPECT_EQ(at.at(1).at("remaining_steps"), left);
  EXPECT_NEAR(at.at(1).at("time_to_finish_s").get<double>(), left * 0.15, 1e-6);
  EXPECT_NEAR(at.at(3).at("time_to_finish_s").get<double>(), 0.3 + left * 0.08, 1e-6);
  ASSERT_EQ(s.at("reconfigurations").size(), 2u);
  EXPECT_EQ(s.at("reconfigurations")[1].at("kind"), "shrink");
  EXPECT_EQ(s.at("reconfigurations")[1].at("causes"), std::vector<std::string>{"resize"});
  // The shrink's pause: 250 ms less the 80 ms step before it; it moved no state.
  EXPECT_NEAR(s.at("reconfigurations")[1].at("pause_s").get<double>(), 0.17, 1e-9);
  EXPECT_EQ(s.at("reconfigurations")[1].at("state_bytes_in"), 0);
}

TEST(JobStateTest, MessagesThatBreakTheProtocolAreViolations) {
  Machine m(2);
  EXPECT_THROW(m.frame(1, Type::kVote, 0, json{{"step", 0}}),
               coordinator_detail::ProtocolViolation);
  m.hello(1, 0, "a");
  EXPECT_THROW(m.hello(1, 0, "a"), coordinator_detail::ProtocolViolation);
  EXPECT_THROW(m.hello(2, 0, "b"), coordinator_detail::ProtocolViolation);  // id taken
  m.frame(1, Type::kReady, -1, json{{"resume_step", 0}});
  m.join(1, "b");
  EXPECT_THROW(m.frame(1, Type::kVote, 5, json{{"step", 0}}),
               coordinator_detail::ProtocolViolation);  // from the future
  EXPECT_THROW(m.frame(1, Type::kCommit, 0, json{{"step", 0}}),
               coordinator_detail::ProtocolViolation);  // a worker may not send it
  EXPECT_EQ(m.state->epoch(), 0);
  EXPECT_EQ(m.state->members(), (std::vector<int>{0, 1}));
}

}  // namespace
}  // namespace runtime
}  // namespace sinew
