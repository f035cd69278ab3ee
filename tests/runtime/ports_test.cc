// Every Sinew port (the rendezvous store, the coordinator, a replica service) speaks the one
// framed transport, and every one refuses what a stranger or a broken peer sends: garbage,
// a wrong job token, an oversized length, a slow drip, a payload that never comes, a pile of
// idle connections. Each is closed or refused, the server's memory stays bounded, and the
// port goes on serving its real clients.

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <boost/asio/io_context.hpp>
#include <boost/asio/post.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../support.h"
#include "sinew/base/open_files.h"
#include "sinew/checkpoint/replica.h"
#include "sinew/collectives/tcp_store.h"
#include "sinew/collectives/transport/channel.h"
#include "sinew/runtime/coordinator.h"
#include "sinew/runtime/coordinator_client.h"

namespace sinew {
namespace {

using namespace std::chrono_literals;
using testing::closedByPeer;
using testing::connectLoopback;
using testing::eventually;
using testing::kTestToken;
using testing::RawFrame;
using testing::rawFrame;

// Resident set size of this process, in bytes.
int64_t rssBytes() {
  std::ifstream f("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * ::sysconf(_SC_PAGESIZE);
}

// One port under test: how to reach it and how to check that it still serves.
struct Port {
  uint16_t port = 0;
  uint8_t service = 0;
  uint8_t requestType = 0;  // a type the port accepts
  std::function<void()> stillServes;
  // A client that opens a new connection is served (null: stillServes).
  std::function<void()> newClientServes;
  std::function<int64_t()> dropped;
  std::shared_ptr<void> keep;  // the server and its clients
};

constexpr auto kIdle = 1000ms;
constexpr size_t kCap = 64;

Port storePort() {
  collectives::TcpStoreServerOptions o = testing::serverOptions();
  o.idleTimeout = kIdle;
  o.frameTimeout = kIdle;
  o.maxConnections = kCap;
  o.log = [](const std::string&) {};
  auto server = std::make_shared<collectives::TcpStoreServer>(o);
  auto client =
      std::make_shared<collectives::TcpStore>("127.0.0.1", server->port(), testing::storeOptions());
  auto counter = std::make_shared<int>(0);
  Port p;
  p.port = server->port();
  p.service = 1;
  p.requestType = 1;  // set
  p.stillServes = [client, counter] {
    std::string v = std::to_string(++*counter);
    client->set("k", collectives::toBytes(v));
    EXPECT_EQ(collectives::toString(client->get("k", 2s)), v);
  };
  p.newClientServes = [server] {
    collectives::TcpStore fresh("127.0.0.1", server->port(), testing::storeOptions());
    fresh.set("fresh", collectives::toBytes("yes"));
    EXPECT_EQ(collectives::toString(fresh.get("fresh", 2s)), "yes");
  };
  p.dropped = [server] { return server->droppedConnections(); };
  p.keep = std::make_shared<std::pair<decltype(server), decltype(client)>>(server, client);
  return p;
}

Port coordinatorPort() {
  runtime::CoordinatorOptions o;
  o.token = kTestToken;
  o.expectedWorkers = 1;
  o.idleTimeout = kIdle;
  o.frameTimeout = kIdle;
  o.deadAfter = 500ms;  // idle timeout: max(1 s, 2 x 500 ms)
  o.maxConnections = kCap;
  o.log = [](const std::string&) {};
  auto coord = std::make_shared<runtime::Coordinator>(o);
  runtime::CoordinatorClientOptions co;
  co.port = coord->port();
  co.token = kTestToken;
  co.worker = 0;
  co.node = "n0";
  co.connectTimeout = 5s;
  auto client = std::make_shared<runtime::CoordinatorClient>(co);
  client->ready(0);
  client->waitEpochAfter(-1, 5s);
  auto step = std::make_shared<int64_t>(0);
  Port p;
  p.port = coord->port();
  p.service = 2;
  p.requestType = 3;  // heartbeat
  p.stillServes = [client, step] {
    EXPECT_EQ(client->vote(0, (*step)++, 5s), runtime::CoordinatorClient::VoteResult::kCommitted);
  };
  p.dropped = [coord] { return coord->status().droppedConnections; };
  p.keep = std::make_shared<std::pair<decltype(coord), decltype(client)>>(coord, client);
  return p;
}

Port replicaPort() {
  checkpoint::ReplicaServiceOptions o;
  o.token = kTestToken;
  o.idleTimeout = kIdle;
  o.frameTimeout = kIdle;
  o.maxConnections = kCap;
  auto service = std::make_shared<checkpoint::ReplicaService>(1, o);
  checkpoint::ReplicaClientOptions co;
  co.token = kTestToken;
  auto client = std::make_shared<checkpoint::ReplicaClient>(1, service->address(), co);
  Port p;
  p.port = service->port();
  p.service = 3;
  p.requestType = 5;  // list
  p.stillServes = [client] { EXPECT_TRUE(client->list().empty()); };
  p.newClientServes = [service] {
    checkpoint::ReplicaClientOptions co;
    co.token = kTestToken;
    checkpoint::ReplicaClient fresh(1, service->address(), co);
    EXPECT_TRUE(fresh.list().empty());
  };
  p.dropped = [service] { return service->droppedConnections(); };
  p.keep = std::make_shared<std::pair<decltype(service), decltype(client)>>(service, client);
  return p;
}

class PortTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string& kind = GetParam();
    port_ = kind == "store"         ? storePort()
            : kind == "coordinator" ? coordinatorPort()
                                    : replicaPort();
    port_.stillServes();
  }

  RawFrame validFrame() const {
    RawFrame f;
    f.service = port_.service;
    f.type = port_.requestType;
    return f;
  }

  // Sends bytes on a new connection and expects the port to close it within `within`.
  void expectClosed(const std::vector<uint8_t>& bytes, std::chrono::milliseconds within,
                    const char* what) {
    int fd = connectLoopback(port_.port);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    EXPECT_TRUE(closedByPeer(fd, within)) << "the " << GetParam() << " port kept " << what;
    ::close(fd);
  }

  Port port_;
};

TEST_P(PortTest, GarbageIsDropped) {
  std::string http = "GET /v1/status HTTP/1.1\r\nHost: localhost\r\n\r\n";
  expectClosed(std::vector<uint8_t>(http.begin(), http.end()), 3s, "an HTTP request");
  std::vector<uint8_t> zeros(64, 0);
  expectClosed(zeros, 3s, "64 zero bytes");
  EXPECT_TRUE(eventually([&] { return port_.dropped() >= 2; }));
  port_.stillServes();
}

TEST_P(PortTest, WrongTokenIsRefusedBeforeAnythingIsAllocated) {
  // 20 strangers, each announcing a 1 GiB message: before the token was checked first, each
  // cost the server its announced payload.
  const int64_t before = rssBytes();
  std::vector<int> fds;
  RawFrame f = validFrame();
  f.token = kTestToken ^ 0xff;
  f.length = int64_t{1} << 30;
  auto bytes = rawFrame(f);
  for (int i = 0; i < 20; ++i) {
    int fd = connectLoopback(port_.port);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    fds.push_back(fd);
  }
  for (int fd : fds) {
    EXPECT_TRUE(closedByPeer(fd, 3s)) << "a wrong token was accepted on the " << GetParam();
    ::close(fd);
  }
  const int64_t grown = rssBytes() - before;
  EXPECT_LT(grown, 16 << 20) << "20 strangers grew the " << GetParam() << " server by " << grown
                             << " bytes";
  port_.stillServes();
}

TEST_P(PortTest, OversizedLengthIsDropped) {
  RawFrame f = validFrame();
  f.length = 0xFFFFFFFFll;
  expectClosed(rawFrame(f), 3s, "a 4 GiB announcement");
  port_.stillServes();
}

TEST_P(PortTest, SlowDripHeaderTimesOut) {
  // One header byte every 100 ms: the 32 bytes would take 3.2 s; the idle timeout (1-2 s)
  // ends it first.
  auto bytes = rawFrame(validFrame());
  int fd = connectLoopback(port_.port);
  ASSERT_GE(fd, 0);
  auto start = std::chrono::steady_clock::now();
  bool closed = false;
  for (size_t i = 0; i < bytes.size() && !closed; ++i) {
    if (::send(fd, &bytes[i], 1, MSG_NOSIGNAL) != 1) break;
    closed = closedByPeer(fd, 100ms);
  }
  closed = closed || closedByPeer(fd, 3s);
  EXPECT_TRUE(closed) << "a slow drip kept its connection on the " << GetParam();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 4s);
  ::close(fd);
  port_.stillServes();
}

TEST_P(PortTest, PayloadThatNeverArrivesTimesOut) {
  RawFrame f = validFrame();
  f.type = port_.service == 3 ? 1 : f.type;  // replica: a begin (list takes no payload)
  f.length = 1000;
  auto bytes = rawFrame(f);
  bytes.push_back('{');
  expectClosed(bytes, 4s, "a connection whose payload stopped after one byte");
  port_.stillServes();
}

TEST_P(PortTest, HundredIdleConnectionsAreCappedAndTimedOut) {
  const int64_t before = rssBytes();
  std::vector<int> fds;
  for (int i = 0; i < 100; ++i) {
    int fd = connectLoopback(port_.port);
    ASSERT_GE(fd, 0);
    fds.push_back(fd);
  }
  // Those beyond the unauthenticated pool's 64 per address are evicted at once (oldest
  // first); the others go when their deadline passes.
  int closedSoon = 0;
  for (int fd : fds) closedSoon += closedByPeer(fd, 10ms) ? 1 : 0;
  int stillOpen = 0;
  for (int fd : fds) {
    if (!closedByPeer(fd, 4s)) stillOpen++;
    ::close(fd);
  }
  EXPECT_EQ(stillOpen, 0) << "idle connections outlived the idle timeout on the " << GetParam();
  EXPECT_GE(closedSoon, 100 - static_cast<int>(kCap))
      << "the pool of " << kCap << " strangers per address did not evict the rest at once";
  const int64_t grown = rssBytes() - before;
  EXPECT_LT(grown, 16 << 20) << "100 idle connections grew the server by " << grown << " bytes";
  port_.stillServes();
}

// Connections that have not shown the job token live in a pool of their own (at most 64 from
// one address here): 300 idle strangers evict each other oldest first, never take a member's
// slot (the cap of 64 members is the one that, before, the strangers filled: a joiner then
// failed with "Connection reset by peer"), and a new member gets in at once while they are open.
TEST_P(PortTest, AFloodOfStrangersNeverKeepsAMemberOut) {
  std::vector<int> fds;
  for (int i = 0; i < 300; ++i) {
    int fd = connectLoopback(port_.port);
    ASSERT_GE(fd, 0);
    fds.push_back(fd);
  }
  const auto t0 = std::chrono::steady_clock::now();
  port_.stillServes();
  if (port_.newClientServes) port_.newClientServes();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1s)
      << "a member waited behind the strangers on the " << GetParam();
  // A member's request on its old connection can be served before the server accepted all
  // 300 (the coordinator's, under ASan, was): connections still in the kernel's accept queue
  // look open from here. A later connection with a wrong token that the port closes was
  // accepted after every one of them (the queue is FIFO).
  RawFrame wrong = validFrame();
  wrong.token = kTestToken ^ 0xff;
  expectClosed(rawFrame(wrong), 2s, "a wrong token after the flood");
  int open = 0;
  for (int fd : fds) open += closedByPeer(fd, 1ms) ? 0 : 1;
  EXPECT_LE(open, 64) << "more strangers than the pool holds stayed on the " << GetParam();
  for (int fd : fds) {
    EXPECT_TRUE(closedByPeer(fd, 3s)) << "a stranger outlived its deadline on the " << GetParam();
    ::close(fd);
  }
  port_.stillServes();
}

// The io thread of every port runs transport::runIoThread: an exception out of a handler (a
// bug) is reported, and the thread goes on running the handlers after it instead of ending
// the process through std::terminate or leaving the port dead.
// 200 connections of garbage from one address cost one log line, not 200; the next line
// admitted after the 10 s interval says how many were withheld. Before, every dropped
// connection was logged (1,874 lines for 2,000 connections in the review).
TEST(DropLogTest, AFloodOfGarbageIsLoggedOncePerIntervalWithACount) {
  collectives::TcpStoreServerOptions o = testing::serverOptions();
  auto mu = std::make_shared<std::mutex>();
  auto lines = std::make_shared<std::vector<std::string>>();
  o.log = [mu, lines](const std::string& line) {
    std::lock_guard<std::mutex> lock(*mu);
    lines->push_back(line);
  };
  collectives::TcpStoreServer server(o);
  const std::vector<uint8_t> zeros(64, 0);
  const auto garbage = [&] {
    int fd = connectLoopback(server.port());
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::write(fd, zeros.data(), zeros.size()), static_cast<ssize_t>(zeros.size()));
    EXPECT_TRUE(closedByPeer(fd, 3s));
    ::close(fd);
  };
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < 200; ++i) garbage();
  ASSERT_TRUE(eventually([&] { return server.droppedConnections() >= 200; }));
  const auto flood = std::chrono::steady_clock::now() - t0;
  ASSERT_LT(flood, 9s) << "the flood outlasted the interval; the count below would be split";
  const auto countDrops = [&] {
    std::lock_guard<std::mutex> lock(*mu);
    return std::count_if(lines->begin(), lines->end(), [](const std::string& l) {
      return l.find("dropping connection from 127.0.0.1") != std::string::npos;
    });
  };
  EXPECT_EQ(countDrops(), 1);
  std::this_thread::sleep_for(10s - flood + 200ms);
  garbage();
  ASSERT_TRUE(eventually([&] { return countDrops() == 2; }));
  std::lock_guard<std::mutex> lock(*mu);
  EXPECT_NE(lines->back().find("(and 199 more from 127.0.0.1 since its last logged one"),
            std::string::npos)
      << lines->back();
}

TEST(IoThreadTest, AnExceptionOutOfAHandlerIsReportedAndTheThreadGoesOn) {
  boost::asio::io_context io;
  std::vector<std::string> errors;
  int ran = 0;
  boost::asio::post(io, [&] { ran++; });
  boost::asio::post(io, [] { throw std::runtime_error("handler bug one"); });
  boost::asio::post(io, [&] { ran++; });
  boost::asio::post(io, [] { throw 42; });
  boost::asio::post(io, [&] { ran++; });
  std::thread t([&] {
    collectives::transport::runIoThread(io, [&](const std::string& e) { errors.push_back(e); });
  });
  t.join();
  EXPECT_EQ(ran, 3);
  ASSERT_EQ(errors.size(), 2u);
  EXPECT_EQ(errors[0], "handler bug one");
  EXPECT_NE(errors[1].find("not a std::exception"), std::string::npos) << errors[1];
}

// A rendezvous store with the default idle timeout (120 s): a stranger must show the token
// within the 2 s authentication deadline, not the idle timeout (before, 1,100 idle connections
// held the store's 1,024 slots for 120 s each); the oldest strangers are evicted first when
// the pool (16 here) is full; only connections that showed the token count against the cap of
// members (4 here), and the fifth member is refused with a logged reason.
TEST(ConnectionSlotsTest, StrangersGoOldestFirstAndMembersHaveTheirOwnCap) {
  testing::LogSink logs;
  collectives::TcpStoreServerOptions o = testing::serverOptions();
  o.maxConnections = 4;
  o.maxPending = 16;
  o.log = logs.fn();
  collectives::TcpStoreServer server(o);
  std::vector<int> fds;
  for (int i = 0; i < 40; ++i) {
    int fd = connectLoopback(server.port());
    ASSERT_GE(fd, 0);
    fds.push_back(fd);
  }
  // The 24 oldest go as the newer ones arrive; the 16 newest wait for their deadline.
  for (int i = 0; i < 24; ++i) EXPECT_TRUE(closedByPeer(fds[i], 2s)) << "stranger " << i;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 24; i < 40; ++i) {
    EXPECT_FALSE(closedByPeer(fds[i], 1ms)) << "stranger " << i << " went before older ones";
  }
  std::vector<std::unique_ptr<collectives::TcpStore>> members;
  for (int m = 0; m < 4; ++m) {
    members.push_back(std::make_unique<collectives::TcpStore>("127.0.0.1", server.port(),
                                                              testing::storeOptions()));
    members.back()->set("m" + std::to_string(m), collectives::toBytes("x"));
  }
  for (int i = 24; i < 40; ++i) {
    EXPECT_TRUE(closedByPeer(fds[i], 3s)) << "stranger " << i << " outlived the deadline";
    ::close(fds[i]);
  }
  for (int i = 0; i < 24; ++i) ::close(fds[i]);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  // One line for the whole flood from 127.0.0.1 (the drop log's 10 s interval): the first.
  EXPECT_TRUE(
      logs.contains("evicted by a newer connection: 16 connections from 127.0.0.1 have "
                    "not authenticated (the limit per address)"));
  // A fifth member is over the members' cap: refused; the four go on.
  collectives::TcpStoreOptions so = testing::storeOptions();
  so.connectTimeout = 1s;
  collectives::TcpStore fifth("127.0.0.1", server.port(), so);
  EXPECT_ANY_THROW(fifth.set("m4", collectives::toBytes("x")));
  for (auto& m : members) EXPECT_EQ(collectives::toString(m->get("m0", 2s)), "x");
}

TEST(OpenFilesTest, TheLimitIsRaisedToWhatTheCapsNeedOrTheCapsShrinkToIt) {
  // In a child, so that this process keeps its limit.
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    struct rlimit r {};
    ::getrlimit(RLIMIT_NOFILE, &r);
    if (r.rlim_max != RLIM_INFINITY && r.rlim_max < 5000) _exit(2);  // cannot test here
    r.rlim_cur = 256;
    if (::setrlimit(RLIMIT_NOFILE, &r) != 0) _exit(3);
    if (raiseOpenFileLimit(5000) != 5000) _exit(4);
    ::getrlimit(RLIMIT_NOFILE, &r);
    _exit(r.rlim_cur == 5000 ? 0 : 5);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 2) GTEST_SKIP() << "the hard open-file limit is below 5000";
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(capsWithin({4096, 1024, 128}, 100000, 256), (std::vector<int64_t>{4096, 1024, 128}));
  // 1,024 files, 256 kept: 768 shared in proportion, none below 8.
  EXPECT_EQ(capsWithin({4096, 1024, 16}, 1024, 256), (std::vector<int64_t>{612, 153, 8}));
}

INSTANTIATE_TEST_SUITE_P(Ports, PortTest, ::testing::Values("store", "coordinator", "replica"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

}  // namespace
}  // namespace sinew
