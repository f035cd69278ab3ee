// Coordinator tests in one process: the step agreement, failure detection from closed
// connections and from heartbeat silence, joins at a step boundary, and a coordinator that
// drops bad connections with a logged reason and lives on. Also the failure-injection spec
// parser.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

#include "../fs_support.h"
#include "../support.h"
#include "sinew/runtime/coordinator.h"
#include "sinew/runtime/coordinator_client.h"
#include "sinew/runtime/detail/wire.h"
#include "sinew/runtime/event_log.h"
#include "sinew/runtime/failure_injection.h"

namespace sinew {
namespace runtime {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using nlohmann::json;
using testing::closedByPeer;
using testing::connectLoopback;
using testing::eventually;
using testing::LogSink;

CoordinatorOptions options(int expected, LogSink* sink) {
  CoordinatorOptions o;
  o.expectedWorkers = expected;
  o.heartbeatInterval = 50ms;
  o.deadAfter = 500ms;
  if (sink) o.log = sink->fn();
  return o;
}

std::unique_ptr<CoordinatorClient> client(const Coordinator& c, int worker,
                                          const std::string& node = "",
                                          std::shared_ptr<ClientIoThreads> io = nullptr) {
  CoordinatorClientOptions o;
  o.port = c.port();
  o.token = c.token();
  o.worker = worker;
  o.node = node.empty() ? "node" + std::to_string(worker) : node;
  o.connectTimeout = 5s;
  o.ioThreads = std::move(io);
  auto cl = std::make_unique<CoordinatorClient>(o);
  cl->ready(0);
  return cl;
}

TEST(CoordinatorTest, StepIsCommittedOnlyWhenEveryMemberVoted) {
  Coordinator coord(options(2, nullptr));
  auto a = client(coord, 0);
  auto b = client(coord, 1);
  EpochInfo e = a->waitEpochAfter(-1, 5s);
  EXPECT_EQ(e.epoch, 0);
  EXPECT_EQ(e.members, (std::vector<int>{0, 1}));
  EXPECT_EQ(e.resumeStep, 0);
  EXPECT_TRUE(e.sync);
  EXPECT_EQ(e.source, 0);
  EXPECT_EQ(b->waitEpochAfter(-1, 5s).epoch, 0);

  // A alone: no verdict within its wait, so A withdraws its vote and the coordinator starts
  // epoch 1, which resumes at step 0 (docs/failure_semantics.md, rule 14).
  EXPECT_EQ(a->vote(0, 0, 200ms), CoordinatorClient::VoteResult::kSuperseded);
  EpochInfo again = b->waitEpochAfter(0, 5s);
  EXPECT_EQ(again.epoch, 1);
  EXPECT_EQ(again.resumeStep, 0);
  EXPECT_EQ(coord.status().committedStep, -1);
  auto fb = std::async(std::launch::async, [&] { return b->vote(1, 0, 5s); });
  EXPECT_EQ(a->vote(1, 0, 5s), CoordinatorClient::VoteResult::kCommitted);
  EXPECT_EQ(fb.get(), CoordinatorClient::VoteResult::kCommitted);
  EXPECT_EQ(coord.status().committedStep, 0);

  // A votes for step 1, then B dies before voting: step 1 is never committed, and the new
  // epoch resumes at step 1 without B.
  // (JobStateTest.StepCommitsOnlyWhenEveryMemberVoted has the exact order: A's vote is in
  // when B dies.)
  auto fa = std::async(std::launch::async, [&] { return a->vote(1, 1, 5s); });
  b.reset();
  EXPECT_EQ(fa.get(), CoordinatorClient::VoteResult::kSuperseded);
  EpochInfo e1 = a->waitEpochAfter(1, 5s);
  EXPECT_EQ(e1.epoch, 2);
  EXPECT_EQ(e1.members, std::vector<int>{0});
  EXPECT_EQ(e1.resumeStep, 1);
  EXPECT_FALSE(e1.sync);
  auto st = coord.status();
  EXPECT_EQ(st.committedStep, 0);
  EXPECT_EQ(st.dead, std::vector<int>{1});
}

// A rollback (docs/pipeline.md, "Rollback") is for pipeline jobs only: in a data-parallel job
// the request is logged and ignored, and nothing moves back.
TEST(CoordinatorTest, RollbackRequestOutsideAPipelineJobIsIgnored) {
  LogSink sink;
  Coordinator coord(options(1, &sink));
  auto a = client(coord, 0);
  EXPECT_EQ(a->waitEpochAfter(-1, 5s).epoch, 0);
  EXPECT_EQ(a->vote(0, 0, 5s), CoordinatorClient::VoteResult::kCommitted);
  EXPECT_EQ(a->vote(0, 1, 5s), CoordinatorClient::VoteResult::kCommitted);
  a->requestRollback(0, 0);
  EXPECT_TRUE(eventually([&] { return sink.contains("ignoring worker 0's rollback to step 0"); }));
  EXPECT_EQ(coord.status().committedStep, 1);
  EXPECT_THROW(a->waitEpochAfter(0, 200ms), Timeout);  // No new epoch.
  EXPECT_EQ(a->vote(0, 2, 5s), CoordinatorClient::VoteResult::kCommitted);
}

TEST(CoordinatorTest, HeartbeatSilenceDeclaresDeadAtTheDeadline) {
  Coordinator coord(options(2, nullptr));
  auto a = client(coord, 0);
  auto b = client(coord, 1);
  a->waitEpochAfter(-1, 5s);
  auto start = Clock::now();
  b->muteHeartbeats(5s);
  EpochInfo e1 = a->waitEpochAfter(0, 5s);
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count();
  EXPECT_EQ(e1.members, std::vector<int>{0});
  EXPECT_GE(ms, 450);  // deadAfter 500 ms, measured from B's last heartbeat
  EXPECT_LE(ms, 900);
  // B is told it was expelled.
  EXPECT_THROW(b->waitEpochAfter(0, 2s), Expelled);
}

// Rule 1 (a stuck member is blamed, not the ones that waited for it) is tested by exact
// event sequences: JobStateTest.AStuckMemberIsBlamedNotTheOnesThatWaitedForIt.

TEST(CoordinatorTest, ReportedPeerLossAndNodeFailureExpelTheNode) {
  Coordinator coord(options(3, nullptr));
  auto a = client(coord, 0, "hostA");
  auto b = client(coord, 1, "hostB");
  auto c = client(coord, 2, "hostB");
  a->waitEpochAfter(-1, 5s);
  a->reportLost(0, 1);  // The data plane lost worker 1: its whole node (1 and 2) goes.
  EpochInfo e1 = a->waitEpochAfter(0, 5s);
  EXPECT_EQ(e1.members, std::vector<int>{0});
  EXPECT_THROW(c->waitEpochAfter(0, 2s), Expelled);
  auto dead = coord.status().dead;
  std::sort(dead.begin(), dead.end());
  EXPECT_EQ(dead, (std::vector<int>{1, 2}));
}

TEST(CoordinatorTest, JoinerEntersAtTheNextStepBoundaryWithAStateCopy) {
  Coordinator coord(options(1, nullptr));
  auto a = client(coord, 0);
  a->waitEpochAfter(-1, 5s);
  EXPECT_EQ(a->vote(0, 0, 5s), CoordinatorClient::VoteResult::kCommitted);
  auto j = client(coord, -1);
  EXPECT_EQ(j->worker(), 1);
  EXPECT_TRUE(eventually([&] { return coord.status().members.size() == 1; }));
  EXPECT_EQ(a->vote(0, 1, 5s), CoordinatorClient::VoteResult::kCommittedThenReshape);
  EpochInfo e = j->waitEpochAfter(-1, 5s);
  EXPECT_EQ(e.epoch, 1);
  EXPECT_EQ(e.members, (std::vector<int>{0, 1}));
  EXPECT_EQ(e.joined, std::vector<int>{1});
  EXPECT_EQ(e.resumeStep, 2);
  EXPECT_EQ(e.source, 0);
  EXPECT_TRUE(e.sync);
}

TEST(CoordinatorTest, EarlyJoinerNeitherTakesARankNorCountsAsOne) {
  Coordinator coord(options(2, nullptr));
  auto j = client(coord, -1);  // Before the launched ranks said hello.
  EXPECT_EQ(j->worker(), 2);
  auto a = client(coord, 0);
  // That the first epoch waits for rank 1: JobStateTest.FirstEpochWaitsForEveryRank...
  auto b = client(coord, 1);
  EpochInfo e = j->waitEpochAfter(-1, 5s);
  EXPECT_EQ(e.members, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(e.joined, std::vector<int>{2});
  EXPECT_EQ(e.source, 0);
  EXPECT_TRUE(e.sync);
}

TEST(CoordinatorTest, FirstEpochResumesAfterTheOldestCheckpointAnyRankFound) {
  Coordinator coord(options(2, nullptr));
  CoordinatorClientOptions o;
  o.port = coord.port();
  o.token = coord.token();
  o.worker = 0;
  o.node = "a";
  CoordinatorClient a(o);
  o.worker = 1;
  o.node = "b";
  CoordinatorClient b(o);
  a.ready(40);
  b.ready(30);
  EpochInfo e = a.waitEpochAfter(-1, 5s);
  EXPECT_EQ(e.resumeStep, 30);
  EXPECT_TRUE(e.sync);
  EXPECT_EQ(e.source, 0);
  EXPECT_EQ(coord.status().committedStep, 29);
}

TEST(CoordinatorTest, PreemptedWorkerIsReleasedAtTheNextStepBoundary) {
  Coordinator coord(options(2, nullptr));
  auto a = client(coord, 0);
  auto b = client(coord, 1);
  a->waitEpochAfter(-1, 5s);
  b->leave(0);
  auto fa = std::async(std::launch::async, [&] { return a->vote(0, 0, 5s); });
  EXPECT_EQ(b->vote(0, 0, 5s), CoordinatorClient::VoteResult::kCommittedThenReshape);
  EXPECT_EQ(fa.get(), CoordinatorClient::VoteResult::kCommittedThenReshape);
  EXPECT_THROW(b->waitEpochAfter(0, 5s), Released);
  EpochInfo e = a->waitEpochAfter(0, 5s);
  EXPECT_EQ(e.members, std::vector<int>{0});
  EXPECT_EQ(e.resumeStep, 1);
  b.reset();  // Its closing connection is no failure (JobStateTest.PreemptedWorker...).
  auto st = coord.status();
  EXPECT_EQ(st.released, std::vector<int>{1});
  // The last member leaving stops the job.
  a->leave(1);
  EXPECT_EQ(a->vote(1, 1, 5s), CoordinatorClient::VoteResult::kCommittedThenReshape);
  EXPECT_THROW(a->waitEpochAfter(1, 5s), Released);
  EXPECT_TRUE(coord.waitFinished(5s));
  EXPECT_TRUE(coord.status().stopped);
}

// A trainer clears its epoch listener before it is destroyed; the client's io thread may be
// inside the listener at that moment (it calls it when a released or expelled message
// arrives, just as the waiting trainer wakes up). Once setEpochListener(nullptr) returns, the
// old listener must have finished and never run again: before, the io thread called a copy
// made before the reset, and ASan saw the trainer's listener touch the destroyed trainer
// (runtime_job_test, SigtermPreemptsOneWorker).
TEST(CoordinatorTest, ClearingTheEpochListenerWaitsForACallInFlight) {
  Coordinator coord(options(2, nullptr));
  auto a = client(coord, 0);
  auto b = client(coord, 1);
  a->waitEpochAfter(-1, 5s);
  std::atomic<bool> inside{false}, cleared{false}, calledAfterClear{false};
  b->setEpochListener([&](int64_t epoch) {
    if (cleared.load()) calledAfterClear = true;
    if (epoch != -1) return;
    inside = true;
    std::this_thread::sleep_for(300ms);  // Still running when the owner wants it gone.
    if (cleared.load()) calledAfterClear = true;
    inside = false;
  });
  b->leave(0);
  auto fa = std::async(std::launch::async, [&] { return a->vote(0, 0, 5s); });
  b->vote(0, 0, 5s);
  fa.get();
  EXPECT_THROW(b->waitEpochAfter(0, 5s), Released);
  ASSERT_TRUE(eventually([&] { return inside.load(); }, 2s)) << "released without a call";
  b->setEpochListener(nullptr);
  cleared = true;
  EXPECT_FALSE(inside.load()) << "setEpochListener(nullptr) returned while the listener ran";
  std::this_thread::sleep_for(400ms);
  EXPECT_FALSE(calledAfterClear.load());
}

TEST(CoordinatorTest, JobFinishesWhenEveryMemberIsDone) {
  Coordinator coord(options(2, nullptr));
  auto a = client(coord, 0);
  auto b = client(coord, 1);
  a->waitEpochAfter(-1, 5s);
  a->done(10);
  EXPECT_FALSE(coord.waitFinished(100ms));
  b->done(10);
  EXPECT_TRUE(coord.waitFinished(5s));
  // Done workers leaving is no failure: JobStateTest.JobFinishesWhenEveryMemberIsDone.
}

// A client's destructor flushes what it queued (here the last worker's done) and returns as
// soon as the channel has closed. The one-second timer that bounds the flush must not hold the
// io thread: before, every worker process ended a second after its last message.
TEST(CoordinatorTest, AClientClosesOnceItsLastMessageIsWrittenNotAfterTheFlushBound) {
  Coordinator coord(options(2, nullptr));
  auto a = client(coord, 0);
  auto b = client(coord, 1);
  a->waitEpochAfter(-1, 5s);
  a->done(10);
  a.reset();
  b->done(10);
  const auto t0 = Clock::now();
  b.reset();  // Queued done, then close.
  const auto took = Clock::now() - t0;
  EXPECT_TRUE(coord.waitFinished(5s)) << "the done queued before the destructor was lost";
  EXPECT_LT(took, 600ms) << "the destructor took "
                         << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
                         << " ms: it waited out the flush bound (1 s)";
}

// A process that speaks for many workers (the control-plane bench's harness): clients on two
// shared io threads, every vote cast and awaited from one thread. Each step commits only when
// all have voted; a withdrawn vote supersedes the step; a client destroyed while the threads
// run is a closed connection to the coordinator (and, under ASan, no handler of it runs after
// it is gone); the threads end with the last client.
TEST(CoordinatorTest, ClientsOnSharedIoThreadsVoteFromOneThreadAndLeaveCleanly) {
  Coordinator coord(options(6, nullptr));
  auto io = std::make_shared<ClientIoThreads>(2);
  EXPECT_EQ(io->size(), 2);
  std::vector<std::unique_ptr<CoordinatorClient>> cs;
  for (int i = 0; i < 6; ++i) cs.push_back(client(coord, i, "", io));
  for (auto& c : cs) EXPECT_EQ(c->waitEpochAfter(-1, 5s).members.size(), 6u);
  for (int64_t step = 0; step < 3; ++step) {
    for (auto& c : cs) c->castVote(0, step);
    for (auto& c : cs)
      EXPECT_EQ(c->awaitVerdict(0, step, 5s), CoordinatorClient::VoteResult::kCommitted);
  }
  EXPECT_EQ(coord.status().committedStep, 2);

  // Five of six vote step 3: no verdict, the first withdraws, and the step is superseded.
  for (int i = 0; i < 5; ++i) cs[i]->castVote(0, 3);
  EXPECT_EQ(cs[0]->awaitVerdict(0, 3, 200ms), CoordinatorClient::VoteResult::kSuperseded);
  const EpochInfo e1 = cs[5]->waitEpochAfter(0, 5s);
  EXPECT_EQ(e1.resumeStep, 3);
  EXPECT_EQ(e1.members.size(), 6u);
  EXPECT_EQ(coord.status().committedStep, 2);

  // Worker 2's client goes while the shared threads run on: the rest get an epoch without it.
  cs[2].reset();
  const EpochInfo e2 = cs[0]->waitEpochAfter(e1.epoch, 5s);
  EXPECT_EQ(e2.members, (std::vector<int>{0, 1, 3, 4, 5}));
  EXPECT_EQ(coord.status().dead, std::vector<int>{2});
  // A step of the new epoch from one thread again.
  std::vector<CoordinatorClient*> live;
  for (auto& c : cs) {
    if (c) live.push_back(c.get());
  }
  for (auto* c : live) c->waitEpochAfter(e1.epoch, 5s);
  for (auto* c : live) c->castVote(e2.epoch, 3);
  for (auto* c : live) {
    EXPECT_EQ(c->awaitVerdict(e2.epoch, 3, 5s), CoordinatorClient::VoteResult::kCommitted);
  }
  EXPECT_EQ(coord.status().committedStep, 3);
  // Each done is flushed before its client closes; the job finishes.
  for (auto* c : live) c->done(3);
  std::weak_ptr<ClientIoThreads> weak = io;
  io.reset();  // The clients hold the threads now.
  EXPECT_FALSE(weak.expired());
  cs.clear();
  EXPECT_TRUE(weak.expired());
  EXPECT_TRUE(coord.waitFinished(5s));
}

TEST(CoordinatorTest, StaleEpochMessagesAreIgnoredNotFatal) {
  LogSink sink;
  Coordinator coord(options(3, &sink));
  auto a = client(coord, 0);
  auto b = client(coord, 1);
  auto c = client(coord, 2);
  a->waitEpochAfter(-1, 5s);
  c.reset();
  a->waitEpochAfter(0, 5s);
  // A vote that crossed the epoch change.
  EXPECT_EQ(b->vote(0, 0, 5s), CoordinatorClient::VoteResult::kSuperseded);
  EXPECT_TRUE(eventually([&] { return coord.status().ignoredMessages >= 1; }));
  EXPECT_TRUE(sink.contains("ignoring a vote of epoch 0 from worker 1"));
  auto st = coord.status();
  EXPECT_EQ(st.members, (std::vector<int>{0, 1}));
  EXPECT_EQ(st.droppedConnections, 0);
}

// ---- Bad input on the coordinator's port ---------------------------------------------

struct BadCase {
  std::string name;
  // Builds the bytes to send, given the job token.
  std::function<std::vector<uint8_t>(uint64_t)> bytes;
  std::string reason;
};

// A coordinator frame of Sinew's transport carrying `body`.
std::vector<uint8_t> frame(wire::Type type, uint64_t token, int64_t epoch, const json& body) {
  sinew::testing::RawFrame f;
  f.service = 2;
  f.type = static_cast<uint8_t>(type);
  f.token = token;
  f.epoch = epoch;
  f.payload = wire::encodeBody(body);
  return sinew::testing::rawFrame(f);
}

std::vector<uint8_t> hello(uint64_t token, int64_t worker) {
  return frame(wire::Type::kHello, token, -1,
               json{{"worker", worker}, {"node", "raw"}, {"pid", 1}});
}

std::vector<uint8_t> concat(std::vector<uint8_t> a, const std::vector<uint8_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

class CoordinatorBadInputTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(CoordinatorBadInputTest, ConnectionIsDroppedWithReasonAndCoordinatorLivesOn) {
  LogSink sink;
  auto o = options(1, &sink);
  o.maxMessageBytes = 4096;
  Coordinator coord(o);
  auto a = client(coord, 0);
  a->waitEpochAfter(-1, 5s);

  int fd = connectLoopback(coord.port());
  ASSERT_GE(fd, 0);
  auto bytes = GetParam().bytes(coord.token());
  ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  EXPECT_TRUE(closedByPeer(fd, 3s))
      << "coordinator kept a connection that sent " << GetParam().name;
  ::close(fd);
  EXPECT_TRUE(eventually([&] { return sink.contains(GetParam().reason); }))
      << "no log line containing '" << GetParam().reason << "'";
  EXPECT_TRUE(eventually([&] { return coord.status().droppedConnections == 1; }));

  // The job goes on: the member still votes and commits.
  EXPECT_EQ(a->vote(0, 0, 5s), CoordinatorClient::VoteResult::kCommitted);
  EXPECT_EQ(coord.status().members, std::vector<int>{0});
}

INSTANTIATE_TEST_SUITE_P(
    Cases, CoordinatorBadInputTest,
    ::testing::Values(
        BadCase{"garbage",
                [](uint64_t) {
                  std::string s = "GET /status HTTP/1.1\r\nHost: localhost\r\n\r\n....";
                  return std::vector<uint8_t>(s.begin(), s.end());
                },
                "not a Sinew message"},
        BadCase{"wrong_token", [](uint64_t t) { return hello(t + 1, 7); }, "wrong job token"},
        BadCase{"wrong_service",
                [](uint64_t t) {
                  auto b = hello(t, 7);
                  b[5] = 1;  // a store frame
                  return b;
                },
                "sent to the coordinator port"},
        BadCase{"oversize",
                [](uint64_t t) {
                  auto b = hello(t, 7);
                  b[8] = 0;
                  b[9] = 0;
                  b[10] = 1;  // 65536 bytes
                  return b;
                },
                "exceeds the limit of 4096"},
        BadCase{"malformed_json",
                [](uint64_t t) {
                  auto b = frame(wire::Type::kHello, t, -1, json{{"x", 1}});
                  b[collectives::transport::kFrameHeaderBytes] = '[';
                  b.back() = 'x';
                  return b;
                },
                "hello message: payload is not a JSON object"},
        BadCase{"missing_field",
                [](uint64_t t) {
                  return frame(wire::Type::kHello, t, -1, json{{"node", "n"}});
                },
                "field 'worker' is missing"},
        BadCase{"worker_id_overflow", [](uint64_t t) { return hello(t, 2147483647); },
                "field 'worker' = 2147483647 is outside"},
        BadCase{"worker_id_not_integer",
                [](uint64_t t) {
                  return frame(wire::Type::kHello, t, -1, json{{"worker", 1.5}, {"node", "n"}});
                },
                "field 'worker' = 1.5 is not an integer"},
        BadCase{"vote_before_hello",
                [](uint64_t t) {
                  return frame(wire::Type::kVote, t, 0, json{{"step", 0}});
                },
                "vote before hello"},
        BadCase{"unknown_type",
                [](uint64_t t) {
                  auto b = hello(t, 7);
                  b[6] = 77;
                  return b;
                },
                "unknown coordinator message type 77"},
        BadCase{"future_epoch",
                [](uint64_t t) {
                  return concat(hello(t, 7), frame(wire::Type::kVote, t, 99, json{{"step", 0}}));
                },
                "from the future"},
        BadCase{"taken_worker_id", [](uint64_t t) { return hello(t, 0); }, "already taken"},
        BadCase{"coordinator_only_message",
                [](uint64_t t) {
                  return concat(hello(t, 7), frame(wire::Type::kCommit, t, 0, json{{"step", 0}}));
                },
                "unknown coordinator message type 6"}),
    [](const ::testing::TestParamInfo<BadCase>& i) { return i.param.name; });

// ---- Failure injection spec ------------------------------------------------------------

TEST(FailureInjectionTest, ParsesTheDocumentedSpec) {
  auto inj = FailureInjector::parse(
      "kill:worker=2:step=30:phase=backward;stop:worker=1:step=50:secs=3;"
      "mute:worker=0:step=5:secs=1.5;slow:worker=*:ms=20");
  ASSERT_EQ(inj.faults().size(), 4u);
  EXPECT_EQ(inj.faults()[0].kind, Fault::Kind::kKill);
  EXPECT_EQ(inj.faults()[0].worker, 2);
  EXPECT_EQ(inj.faults()[0].step, 30);
  EXPECT_EQ(inj.faults()[0].phase, Phase::kBackward);
  EXPECT_EQ(inj.faults()[1].kind, Fault::Kind::kStop);
  EXPECT_DOUBLE_EQ(inj.faults()[1].seconds, 3.0);
  EXPECT_EQ(inj.faults()[1].phase, Phase::kForward);
  EXPECT_DOUBLE_EQ(inj.faults()[2].seconds, 1.5);
  EXPECT_EQ(inj.faults()[3].worker, -1);
  EXPECT_EQ(inj.faults()[3].step, -1);
  EXPECT_TRUE(FailureInjector::parse("").empty());
  auto more = FailureInjector::parse(
      "corrupt:worker=0:step=19;kill:worker=1:step=4:phase=snapshot;"
      "stop:worker=2:step=7:secs=1:phase=reconfiguration");
  ASSERT_EQ(more.faults().size(), 3u);
  EXPECT_EQ(more.faults()[0].kind, Fault::Kind::kCorrupt);
  EXPECT_EQ(more.faults()[0].phase, Phase::kFlush);
  EXPECT_EQ(more.faults()[1].phase, Phase::kSnapshot);
  EXPECT_EQ(more.faults()[2].phase, Phase::kReconfiguration);
}

// corrupt damages the shard files of its version once it is written, and only that version.
TEST(FailureInjectionTest, CorruptDamagesTheShardFilesOfItsVersionOnce) {
  char dir[] = "/tmp/sinew-corrupt-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string root = dir;
  for (const char* step : {"step-00000019", "step-00000029"}) {
    std::filesystem::create_directories(root + "/" + step);
    std::ofstream(root + "/" + step + "/shard-w0.safetensors") << std::string(256, 'a');
    std::ofstream(root + "/" + step + "/manifest.json") << "{}";
  }
  auto inj = FailureInjector::parse("corrupt:worker=0:step=19");
  EXPECT_EQ(inj.afterFlush(1, 19, root), 0);  // another worker
  EXPECT_EQ(inj.afterFlush(0, 29, root), 0);  // another version
  inj.fire(0, 19, Phase::kFlush, nullptr);    // the flush itself: nothing yet
  auto read = [&](const std::string& f) {
    std::ifstream in(root + "/" + f);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  EXPECT_EQ(read("step-00000019/shard-w0.safetensors"), std::string(256, 'a'));
  EXPECT_EQ(inj.afterFlush(0, 19, root), 1);
  const std::string damaged = read("step-00000019/shard-w0.safetensors");
  EXPECT_EQ(damaged.size(), 256u);
  EXPECT_EQ(damaged.substr(192, 8), "\xde\xad\xbe\xef\xde\xad\xbe\xef");
  EXPECT_EQ(read("step-00000029/shard-w0.safetensors"), std::string(256, 'a'));
  EXPECT_EQ(read("step-00000019/manifest.json"), "{}");
  EXPECT_EQ(inj.afterFlush(0, 19, root), 0);  // once
  EXPECT_FALSE(inj.damageCopy(0, 19));        // a flush fault damages no copy
  sinew::testing::removeTree(root);
}

// corrupt in phase copy: the first copy a worker sends at or after the step, once; never a
// file.
TEST(FailureInjectionTest, CorruptInPhaseCopyDamagesOneCopyOnce) {
  auto inj = FailureInjector::parse("corrupt:worker=2:step=10:phase=copy");
  EXPECT_FALSE(inj.damageCopy(1, 12));  // another worker
  EXPECT_FALSE(inj.damageCopy(2, 9));   // before its step
  EXPECT_EQ(inj.afterFlush(2, 10, "/nonexistent"), 0);
  EXPECT_TRUE(inj.damageCopy(2, 11));   // the first at or after it
  EXPECT_FALSE(inj.damageCopy(2, 11));  // once
}

TEST(FailureInjectionTest, MalformedSpecsNameWhatIsWrong) {
  struct Bad {
    std::string spec, says;
  };
  for (const Bad& b : std::vector<Bad>{
           {"explode:worker=1:step=2", "unknown kind 'explode'"},
           {"kill:worker=1:step=2:phase=lunch", "unknown phase 'lunch'"},
           {"kill:worker=1", "needs step"},
           {"kill:step=3", "needs worker"},
           {"kill:worker=x:step=3", "worker='x' is not a non-negative number"},
           {"stop:worker=1:step=3", "needs secs"},
           {"kill:worker=1:step=3:color=red", "unknown key 'color'"},
           {"kill:worker=1:step", "'step' is not key=value"},
           {"failwrite:worker=1:step=2:phase=forward", "failwrite fires only in phase flush"},
           {"failwrite:worker=1", "needs step"},
           {"mute:worker=1:step=2:secs=1:phase=flush", "mute cannot fire in phase flush"},
           {"corrupt:worker=1:step=2:phase=backward", "corrupt fires only in phase flush"},
           {"corrupt:worker=1", "needs step"},
           {"mute:worker=1:step=2:secs=1:phase=replication",
            "mute cannot fire in phase replication"},
       }) {
    try {
      FailureInjector::parse(b.spec);
      ADD_FAILURE() << "accepted '" << b.spec << "'";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(b.says), std::string::npos)
          << "'" << b.spec << "' gave: " << e.what();
    }
  }
}

TEST(FailureInjectionTest, MuteFiresOnceAtItsStepAndPhase) {
  Coordinator coord(options(1, nullptr));
  auto a = client(coord, 0);
  a->waitEpochAfter(-1, 5s);
  auto inj = FailureInjector::parse("mute:worker=0:step=3:phase=reduce:secs=2");
  inj.fire(0, 3, Phase::kForward, a.get());  // wrong phase
  inj.fire(1, 3, Phase::kReduce, a.get());   // wrong worker
  inj.fire(0, 2, Phase::kReduce, a.get());   // wrong step
  std::this_thread::sleep_for(700ms);        // longer than deadAfter: still alive
  EXPECT_TRUE(coord.status().dead.empty());
  inj.fire(0, 3, Phase::kReduce, a.get());
  EXPECT_TRUE(eventually([&] { return coord.status().dead == std::vector<int>{0}; }, 3s));
}

// The one event-log writer of the coordinator and the workers.
TEST(EventLogTest, LinesAreWholeStampedAndAppendedFromManyThreads) {
  char dir[] = "/tmp/sinew-eventlog-XXXXXX";
  ASSERT_NE(::mkdtemp(dir), nullptr);
  const std::string path = std::string(dir) + "/events.jsonl";
  {
    EventLog before;
    before.open(path, {{"source", "earlier run"}});
    before.write({{"event", "first"}});
  }
  EventLog log;
  log.write({{"event", "dropped: not open yet"}});
  log.open(path, {{"worker", 7}});
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) log.write({{"event", "e"}, {"thread", t}, {"i", i}});
    });
  }
  for (auto& t : threads) t.join();
  log.write({{"event", "bad utf-8"}, {"what", std::string("\xff\xfe")}});
  std::ifstream in(path);
  std::string line;
  int lines = 0, stamped = 0;
  while (std::getline(in, line)) {
    json j = json::parse(line);  // Every line is one whole object.
    ASSERT_TRUE(j.contains("time")) << line;
    if (lines == 0) {
      EXPECT_EQ(j["source"], "earlier run");  // Appended, not truncated.
    }
    if (j.value("worker", -1) == 7) stamped++;
    lines++;
  }
  EXPECT_EQ(lines, 1 + 4 * 200 + 1);
  EXPECT_EQ(stamped, 4 * 200 + 1);
  std::remove(path.c_str());
  ::rmdir(dir);
}

TEST(EventLogTest, AnUnopenableFileIsAnIoErrorNamingIt) {
  EventLog log;
  try {
    log.open("/nonexistent-sinew-dir/events.jsonl", {});
    FAIL() << "opened a file in a folder that does not exist";
  } catch (const IoError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-sinew-dir/events.jsonl"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace runtime
}  // namespace sinew
