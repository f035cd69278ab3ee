// Store tests: the same semantics for every implementation (TEST_P over backends),
// deadlines, exact concurrent adds from 8 forked processes, and a TCP server that survives
// killed clients and garbage on its port.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>

#include "../support.h"
#include "multiproc.h"
#include "sinew/collectives/file_store.h"
#include "sinew/collectives/hash_store.h"
#include "sinew/collectives/prefix_store.h"
#include "sinew/collectives/tcp_store.h"

namespace sinew {
namespace collectives {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::closedByPeer;
using testing::connectLoopback;
using testing::elapsedMs;
using testing::eventually;
using testing::LogSink;
using testing::ProcessGroup;

std::string tempDir(const std::string& tag) {
  std::string pattern = "/tmp/sinew-store-" + tag + "-XXXXXX";
  std::vector<char> buf(pattern.begin(), pattern.end());
  buf.push_back('\0');
  char* dir = mkdtemp(buf.data());
  if (dir == nullptr) throw std::runtime_error("mkdtemp failed");
  return dir;
}

// A store under test, and a way to open a second handle on the same data (another client,
// another process's view), so that cross-handle visibility is tested too.
struct Backend {
  std::shared_ptr<Store> store;
  std::function<std::shared_ptr<Store>()> another;
  std::shared_ptr<void> keepAlive;
};

Backend makeBackend(const std::string& name) {
  Backend b;
  if (name == "hash") {
    auto s = std::make_shared<HashStore>();
    b.store = s;
    b.another = [s] { return s; };
  } else if (name == "file") {
    auto dir = tempDir("sem");
    b.store = std::make_shared<FileStore>(dir);
    b.another = [dir] { return std::make_shared<FileStore>(dir); };
  } else if (name == "tcp_client" || name == "tcp_server") {
    auto server = std::make_shared<TcpStoreServer>(sinew::testing::serverOptions());
    b.keepAlive = server;
    uint16_t port = server->port();
    auto client = [port] {
      return std::make_shared<TcpStore>("127.0.0.1", port, sinew::testing::storeOptions());
    };
    b.store = name == "tcp_server" ? std::shared_ptr<Store>(server) : client();
    b.another = client;
  } else if (name == "prefix") {
    auto base = std::make_shared<HashStore>();
    b.store = std::make_shared<PrefixStore>("epoch/3", base);
    b.another = [base] { return std::make_shared<PrefixStore>("epoch/3", base); };
    b.keepAlive = base;
  }
  return b;
}

class StoreSemanticsTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { b_ = makeBackend(GetParam()); }
  Backend b_;
};

TEST_P(StoreSemanticsTest, SetGetOverwriteAndBinaryValues) {
  Store& s = *b_.store;
  s.set("a", toBytes("1"));
  EXPECT_EQ(toString(s.get("a", 1s)), "1");
  s.set("a", toBytes("two"));
  EXPECT_EQ(toString(s.get("a", 1s)), "two");
  Bytes binary(1 << 20);
  for (size_t i = 0; i < binary.size(); ++i) binary[i] = static_cast<uint8_t>(i * 131 + 7);
  binary[5] = 0;
  s.set("weird key/with spaces%and:colons", binary);
  EXPECT_EQ(b_.another()->get("weird key/with spaces%and:colons", 1s), binary);
  s.set("empty", Bytes());
  EXPECT_TRUE(s.get("empty", 1s).empty());
  EXPECT_TRUE(s.check({"a", "empty"}));
}

TEST_P(StoreSemanticsTest, AddCountsAndRejectsNonIntegers) {
  Store& s = *b_.store;
  EXPECT_EQ(s.add("n", 5), 5);
  EXPECT_EQ(b_.another()->add("n", -2), 3);
  EXPECT_EQ(s.add("n", 0), 3);
  EXPECT_EQ(toString(s.get("n", 1s)), "3");
  s.set("text", toBytes("hello"));
  try {
    s.add("text", 1);
    FAIL() << "add on a non-integer value succeeded";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("text"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("hello"), std::string::npos) << e.what();
  }
  EXPECT_EQ(toString(s.get("text", 1s)), "hello");
}

TEST_P(StoreSemanticsTest, CompareSet) {
  Store& s = *b_.store;
  // Absent key: an empty expectation sets it; a non-empty one does not.
  EXPECT_TRUE(s.compareSet("k", toBytes("x"), toBytes("y")).empty());
  EXPECT_FALSE(s.check({"k"}));
  EXPECT_EQ(toString(s.compareSet("k", Bytes(), toBytes("first"))), "first");
  // Mismatch returns the current value and leaves it.
  EXPECT_EQ(toString(s.compareSet("k", toBytes("nope"), toBytes("second"))), "first");
  EXPECT_EQ(toString(s.get("k", 1s)), "first");
  EXPECT_EQ(toString(b_.another()->compareSet("k", toBytes("first"), toBytes("second"))), "second");
  EXPECT_EQ(toString(s.get("k", 1s)), "second");
}

TEST_P(StoreSemanticsTest, CheckAndDelete) {
  Store& s = *b_.store;
  EXPECT_FALSE(s.check({"x"}));
  EXPECT_FALSE(s.deleteKey("x"));
  s.set("x", toBytes("1"));
  s.set("y", toBytes("2"));
  EXPECT_TRUE(s.check({"x", "y"}));
  EXPECT_FALSE(s.check({"x", "z"}));
  EXPECT_TRUE(b_.another()->deleteKey("x"));
  EXPECT_FALSE(s.check({"x"}));
  EXPECT_THROW(s.get("x", 50ms), Timeout);
}

TEST_P(StoreSemanticsTest, WaitTimesOutAtItsDeadlineNamingMissingKeys) {
  Store& s = *b_.store;
  s.set("present", toBytes("1"));
  auto start = Clock::now();
  try {
    s.wait({"present", "absent-key"}, 300ms);
    FAIL() << "wait for a missing key returned";
  } catch (const Timeout& e) {
    int64_t ms = elapsedMs(start);
    EXPECT_GE(ms, 300);
    EXPECT_LE(ms, 500);
    std::string what = e.what();
    EXPECT_NE(what.find("absent-key"), std::string::npos) << what;
    EXPECT_EQ(what.find("present"), std::string::npos) << what;
  }
  start = Clock::now();
  EXPECT_THROW(s.get("also-absent", 200ms), Timeout);
  EXPECT_GE(elapsedMs(start), 200);
  EXPECT_LE(elapsedMs(start), 400);
}

TEST_P(StoreSemanticsTest, WaitWakesWhenAnotherHandleSets) {
  auto other = b_.another();
  std::atomic<int64_t> setAtMs{-1};
  auto start = Clock::now();
  std::thread setter([&] {
    std::this_thread::sleep_for(150ms);  // Gives the waiter time to block: the subject.
    other->set("late/a", toBytes("A"));
    other->set("late/b", toBytes("B"));
    setAtMs = elapsedMs(start);
  });
  b_.store->wait({"late/a", "late/b"}, 10s);
  int64_t wokeAt = elapsedMs(start);
  Bytes v = b_.store->get("late/b", 1s);
  setter.join();
  EXPECT_EQ(toString(v), "B");
  EXPECT_GE(wokeAt, 140);
  EXPECT_LE(wokeAt, setAtMs.load() + 100) << "woke " << wokeAt << " ms, set at " << setAtMs;
}

INSTANTIATE_TEST_SUITE_P(Backends, StoreSemanticsTest,
                         ::testing::Values("hash", "file", "tcp_client", "tcp_server", "prefix"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

// ---- Multi-process ------------------------------------------------------------------

class StoreMultiprocTest : public ::testing::TestWithParam<std::string> {};

// 8 processes add concurrently; the counter is exact and every add returned a distinct value.
TEST_P(StoreMultiprocTest, ConcurrentAddsFromEightProcessesAreExact) {
  constexpr int kProcs = 8;
  constexpr int kAdds = 200;
  std::unique_ptr<TcpStoreServer> server;
  std::string dir;
  std::function<std::shared_ptr<Store>()> open;
  if (GetParam() == "tcp") {
    server = std::make_unique<TcpStoreServer>(sinew::testing::serverOptions());
    uint16_t port = server->port();
    open = [port] {
      return std::make_shared<TcpStore>("127.0.0.1", port, sinew::testing::storeOptions());
    };
  } else {
    dir = tempDir("add");
    open = [dir] { return std::make_shared<FileStore>(dir); };
  }
  ProcessGroup group;
  for (int p = 0; p < kProcs; ++p) {
    group.spawn([&, p] {
      auto store = open();
      store->add("start", 1);
      store->wait({"go"}, 30s);
      int64_t sum = 0, last = 0;
      for (int i = 0; i < kAdds; ++i) {
        int64_t v = store->add("counter", 1);
        if (v <= last) return 2;  // Values one process sees must increase.
        last = v;
        sum += v;
      }
      store->set("sum/" + std::to_string(p), toBytes(std::to_string(sum)));
      return 0;
    });
  }
  auto store = open();
  ASSERT_TRUE(eventually([&] { return store->add("start", 0) == kProcs; }, 30s));
  store->set("go", toBytes("1"));
  auto exits = group.waitAll(60s);
  for (int p = 0; p < kProcs; ++p) {
    ASSERT_TRUE(exits[p].exited && exits[p].code == 0) << "child " << p << " " << exits[p].str();
  }
  const int64_t n = kProcs * kAdds;
  EXPECT_EQ(store->add("counter", 0), n);
  int64_t total = 0;
  for (int p = 0; p < kProcs; ++p)
    total += std::stoll(toString(store->get("sum/" + std::to_string(p), 1s)));
  EXPECT_EQ(total, n * (n + 1) / 2) << "some add returned a duplicate value";
}

INSTANTIATE_TEST_SUITE_P(Backends, StoreMultiprocTest, ::testing::Values("tcp", "file"),
                         [](const ::testing::TestParamInfo<std::string>& i) { return i.param; });

// ---- TCP server robustness ----------------------------------------------------------

// A store frame of Sinew's transport (header fields overridable for malformed ones).
Bytes storeFrame(uint8_t op, Bytes payload, int64_t length = -1) {
  sinew::testing::RawFrame f;
  f.service = 1;
  f.type = op;
  f.payload = std::move(payload);
  f.length = length;
  return sinew::testing::rawFrame(f);
}

Bytes withVersion(int version) {
  sinew::testing::RawFrame f;
  f.version = version;
  return sinew::testing::rawFrame(f);
}

Bytes withToken(uint64_t token) {
  sinew::testing::RawFrame f;
  f.token = token;
  f.length = 1 << 20;  // Would be allocated if the token were not checked first.
  return sinew::testing::rawFrame(f);
}

Bytes withService(uint8_t service) {
  sinew::testing::RawFrame f;
  f.service = service;
  return sinew::testing::rawFrame(f);
}

struct GarbageCase {
  std::string name;
  Bytes bytes;
  std::string reason;
};

class TcpStoreGarbageTest : public ::testing::TestWithParam<GarbageCase> {};

TEST_P(TcpStoreGarbageTest, ConnectionIsDroppedWithReasonAndServerLivesOn) {
  LogSink sink;
  TcpStoreServerOptions o = sinew::testing::serverOptions();
  o.maxMessageBytes = 1 << 20;
  o.log = sink.fn();
  TcpStoreServer server(o);
  TcpStore good("127.0.0.1", server.port(), sinew::testing::storeOptions());
  good.set("before", toBytes("1"));

  int fd = connectLoopback(server.port());
  ASSERT_GE(fd, 0);
  const Bytes& bytes = GetParam().bytes;
  ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  EXPECT_TRUE(closedByPeer(fd, 2s)) << "server kept a connection that sent " << GetParam().name;
  ::close(fd);
  EXPECT_TRUE(eventually([&] { return sink.contains(GetParam().reason); }))
      << "no log line containing '" << GetParam().reason << "'";
  // Counted when the channel's close reaches the server (right after the log line).
  EXPECT_TRUE(eventually([&] { return server.droppedConnections() == 1; }))
      << server.droppedConnections() << " connections counted as dropped";

  // The server and the existing client are unaffected.
  EXPECT_EQ(toString(good.get("before", 1s)), "1");
  EXPECT_EQ(good.add("after", 2), 2);
  EXPECT_EQ(server.add("after", 1), 3);
}

Bytes setWithTruncatedKey() {
  Bytes payload = {200, 0, 0, 0, 'a', 'b'};  // Claims a 200-byte key, has 2 bytes.
  return storeFrame(1, payload);
}

Bytes twoRequestsAtOnce() {
  // A wait that parks (missing key, long timeout), immediately followed by a second request.
  Bytes payload;
  for (int i = 0; i < 8; ++i) payload.push_back(i == 1 ? 0x27 : 0);  // timeout 9984 ms
  Bytes keys = {1, 0, 0, 0, 3, 0, 0, 0, 'k', 'e', 'y'};
  payload.insert(payload.end(), keys.begin(), keys.end());
  Bytes b = storeFrame(5, payload);
  Bytes again = b;
  b.insert(b.end(), again.begin(), again.end());
  return b;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, TcpStoreGarbageTest,
    ::testing::Values(
        GarbageCase{"http", toBytes("GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"),
                    "not a Sinew message"},
        GarbageCase{"version", withVersion(9), "version 9, this side speaks 1"},
        GarbageCase{"wrong_token", withToken(sinew::testing::kTestToken + 1), "wrong job token"},
        GarbageCase{"wrong_service", withService(3), "service 3 (replica) sent to the store port"},
        GarbageCase{"unknown_op", storeFrame(99, {}), "unknown store message type 99"},
        GarbageCase{"oversize", storeFrame(1, {}, int64_t(1) << 30), "exceeds the limit"},
        GarbageCase{"truncated_field", setWithTruncatedKey(), "payload ends inside field 'key'"},
        GarbageCase{"pipelined", twoRequestsAtOnce(), "before the previous one was answered"}),
    [](const ::testing::TestParamInfo<GarbageCase>& i) { return i.param.name; });

// A client SIGKILLed while parked in a wait, and one killed halfway through sending a
// request, cost the server only their own connections.
TEST(TcpStoreServerTest, KilledClientsLeaveTheServerServing) {
  LogSink sink;
  TcpStoreServerOptions o = sinew::testing::serverOptions();
  o.log = sink.fn();
  TcpStoreServer server(o);
  uint16_t port = server.port();
  ProcessGroup group;
  group.spawn([port] {
    TcpStore s("127.0.0.1", port, sinew::testing::storeOptions());
    s.set("waiter/ready", toBytes("1"));
    s.get("never-set", 60s);
    return 0;
  });
  group.spawn([port] {
    int fd = connectLoopback(port);
    Bytes partial = storeFrame(1, {}, 1000);
    partial.push_back('x');
    if (::write(fd, partial.data(), partial.size()) < 0) return 3;
    TcpStore s("127.0.0.1", port, sinew::testing::storeOptions());
    s.set("partial/ready", toBytes("1"));
    ::pause();
    return 0;
  });
  server.wait({"waiter/ready", "partial/ready"}, 30s);
  ASSERT_TRUE(eventually([&] { return server.openConnections() == 3; }));
  group.signal(0, SIGKILL);
  group.signal(1, SIGKILL);
  auto exits = group.waitAll(10s);
  EXPECT_TRUE(exits[0].signaled && exits[1].signaled);
  EXPECT_TRUE(eventually([&] { return server.openConnections() == 0; }))
      << server.openConnections() << " connections still open";
  EXPECT_TRUE(sink.contains("in the middle of a store set message"))
      << "partial request not logged";
  EXPECT_EQ(server.droppedConnections(), 0);

  TcpStore client("127.0.0.1", port, sinew::testing::storeOptions());
  client.set("never-set", toBytes("now"));
  EXPECT_EQ(toString(client.get("never-set", 1s)), "now");
  EXPECT_EQ(client.add("c", 7), 7);
}

// A client whose server does not answer fails at its deadline, and one with no server at
// all fails at its connect deadline, naming the address.
TEST(TcpStoreClientTest, DeadlinesWhenTheServerIsSilentOrAbsent) {
  int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(::listen(listener, 4), 0);
  socklen_t len = sizeof(addr);
  ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len);
  uint16_t silentPort = ntohs(addr.sin_port);

  TcpStoreOptions o = sinew::testing::storeOptions();
  o.timeout = 300ms;
  o.connectTimeout = 400ms;
  TcpStore silent("127.0.0.1", silentPort, o);
  auto start = Clock::now();
  EXPECT_THROW(silent.set("k", toBytes("v")), Timeout);
  EXPECT_GE(elapsedMs(start), 300);
  EXPECT_LE(elapsedMs(start), 600);
  ::close(listener);

  // Nothing listens on this port any more.
  TcpStore absent("127.0.0.1", silentPort, o);
  start = Clock::now();
  try {
    absent.add("k", 1);
    FAIL() << "add without a server succeeded";
  } catch (const Timeout& e) {
    EXPECT_NE(std::string(e.what()).find("127.0.0.1:" + std::to_string(silentPort)),
              std::string::npos)
        << e.what();
  }
  EXPECT_GE(elapsedMs(start), 350);
  EXPECT_LE(elapsedMs(start), 1000);
}

// A client blocked in a wait fails promptly when the server goes away, and reconnects to a
// server that comes back on the same port.
TEST(TcpStoreClientTest, ServerShutdownFailsBlockedWaitAndClientReconnects) {
  auto server = std::make_unique<TcpStoreServer>(sinew::testing::serverOptions());
  uint16_t port = server->port();
  TcpStore client("127.0.0.1", port, sinew::testing::storeOptions());
  client.set("a", toBytes("1"));
  std::atomic<int64_t> failedAfter{-1};
  std::atomic<bool> ioError{false};
  std::thread waiter([&] {
    auto start = Clock::now();
    try {
      client.wait({"never"}, 20s);
    } catch (const IoError&) {
      ioError = true;
    } catch (const Error&) {
    }
    failedAfter = elapsedMs(start);
  });
  ASSERT_TRUE(eventually([&] { return server->openConnections() == 1; }));
  std::this_thread::sleep_for(50ms);  // Lets the wait park (the state under test).
  server.reset();
  waiter.join();
  EXPECT_TRUE(ioError.load());
  EXPECT_LT(failedAfter.load(), 2000);

  TcpStoreServerOptions o = sinew::testing::serverOptions();
  o.port = port;
  TcpStoreServer again(o);
  again.set("b", toBytes("2"));
  EXPECT_EQ(toString(client.get("b", 1s)), "2");
}

// One client shared by threads: while one thread is parked in a long wait, another's
// requests are answered at once (each runs on a connection of its own), and the wait still
// wakes when its key is set. Before, the second thread queued behind the wait for its whole
// timeout (a worker's flush thread waiting for a dead peer's shard blocked its recovery).
TEST(TcpStoreClientTest, ABlockedWaitDoesNotHoldUpAnotherThreadsRequests) {
  TcpStoreServer server(sinew::testing::serverOptions());
  TcpStore client("127.0.0.1", server.port(), sinew::testing::storeOptions());
  std::atomic<bool> woke{false};
  std::thread waiter([&] {
    try {
      client.wait({"late"}, 5s);
      woke = true;
    } catch (const Error& e) {
      ADD_FAILURE() << "the wait failed: " << e.what();
    }
  });
  ASSERT_TRUE(eventually([&] { return server.openConnections() == 1; }));
  std::this_thread::sleep_for(50ms);  // Lets the wait park.
  auto start = Clock::now();
  client.set("k", toBytes("v"));
  EXPECT_EQ(toString(client.get("k", 1s)), "v");
  EXPECT_EQ(client.add("n", 3), 3);
  EXPECT_TRUE(client.check({"k", "n"}));
  EXPECT_LT(elapsedMs(start), 2000) << "requests queued behind another thread's wait";
  EXPECT_FALSE(woke.load());
  client.set("late", toBytes("1"));
  waiter.join();
  EXPECT_TRUE(woke.load());
  // Both connections stay open for reuse; a third thread's request reuses one of them.
  EXPECT_EQ(server.openConnections(), 2);
  std::thread([&] { EXPECT_EQ(client.add("n", 1), 4); }).join();
  EXPECT_EQ(server.openConnections(), 2);
}

TEST(FileStoreTest, RejectsKeysTooLongForAFileName) {
  FileStore s(tempDir("long"));
  try {
    s.set(std::string(300, 'k'), toBytes("v"));
    FAIL() << "a 300-byte key was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("too long"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace collectives
}  // namespace sinew
