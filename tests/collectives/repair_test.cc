// Repair (docs/collectives.md, "Repair: kept connections"), with forked processes: survivors
// of a SIGKILL keep their connections to each other, a joiner connects only its own pairs, a
// message an older epoch left on a kept connection never reaches the next, and a loss during
// a repair still leaves the rest kept.

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <unistd.h>

#include <iostream>
#include <string>
#include <thread>

#include "../support.h"
#include "multiproc.h"
#include "sinew/collectives/gloo/gloo_options.h"
#include "sinew/collectives/gloo/kept_links.h"
#include "sinew/collectives/gloo/pair_mesh.h"
#include "sinew/collectives/tcp_store.h"
#include "sinew/communicator.h"

namespace sinew {
namespace collectives {
namespace {

using gloo_backend::LinkCounters;
using gloo_backend::linkCounters;
using testing::ProcessGroup;
using namespace std::chrono_literals;

CommunicatorOptions options(std::vector<int> members, int self, int64_t epoch,
                            std::chrono::milliseconds initTimeout = 60s) {
  CommunicatorOptions o;
  o.members = std::move(members);
  o.self = self;
  o.epoch = epoch;
  o.timeout = 60s;
  o.initTimeout = initTimeout;
  o.name = "repair";
  return o;
}

// What a member did in building one communicator: connections made and links kept.
struct Built {
  int64_t made = 0;
  int64_t kept = 0;
};

// Builds the communicator of `o` and says what it took.
std::unique_ptr<Communicator> build(const std::shared_ptr<Store>& store,
                                    const CommunicatorOptions& o, Built* built) {
  const LinkCounters before = linkCounters();
  auto comm = createGlooCommunicator(store, o);
  const LinkCounters after = linkCounters();
  built->made = after.connectionsMade - before.connectionsMade;
  built->kept = after.linksKept - before.linksKept;
  const std::string said = "kept " + std::to_string(built->kept) + " links, made " +
                           std::to_string(built->made) + " connections";
  if (comm->setUp() != said) {
    std::cerr << "worker " << o.self << ": setUp() says '" << comm->setUp() << "', not '" << said
              << "'" << std::endl;
    built->kept = built->made = -1;  // Fails the caller's checks.
  }
  return comm;
}

// Every member allreduces its worker id; true if each got the sum.
bool sumsWorkerIds(Communicator& comm) {
  at::Tensor t = at::full({1000}, static_cast<float>(comm.self()), at::kFloat);
  comm.allreduce(t);
  float want = 0;
  for (int w : comm.members()) want += static_cast<float>(w);
  return at::equal(t, at::full({1000}, want, at::kFloat));
}

// Counts mismatches inside a child and prints them.
struct Checker {
  int worker;
  int failures = 0;
  void expectEq(int64_t got, int64_t want, const std::string& what) {
    if (got == want) return;
    failures++;
    std::cerr << "worker " << worker << ": FAILED: " << what << ": " << got << ", expected " << want
              << std::endl;
  }
};

// Builds `o`'s communicator into `comm`, checks the connections it made, the links it kept
// and one allreduce.
void buildAndCheck(Checker& c, std::unique_ptr<Communicator>& comm,
                   const std::shared_ptr<Store>& store, const CommunicatorOptions& o, int64_t made,
                   int64_t kept) {
  Built b;
  comm = build(store, o, &b);
  const std::string epoch = "epoch " + std::to_string(o.epoch);
  c.expectEq(b.made, made, epoch + " connections made");
  c.expectEq(b.kept, kept, epoch + " links kept");
  c.expectEq(sumsWorkerIds(*comm), 1, epoch + " allreduce exact");
}

// Blocks in allreduces until the communicator fails (a member was killed); then destroys it.
void runUntilLost(std::unique_ptr<Communicator>& comm, Store& store) {
  store.set("ready/" + std::to_string(comm->self()), toBytes("1"));
  at::Tensor t = at::ones({1 << 16}, at::kFloat);
  try {
    for (;;) comm->allreduce(t);
  } catch (const Error&) {
  }
  comm.reset();
}

// Children forked before the store server's thread exists, each waiting for the server's port
// on a pipe of its own. A child forked while that thread holds a lock of the allocator (as it
// may while it serves the other children) starts with the lock held for good: under
// AddressSanitizer the first member's at::set_num_threads hung so, 4 runs in 5.
class PreForked {
 public:
  // Forks a child that runs body(port) once start(i) gives it the port.
  size_t spawn(ProcessGroup& group, const std::function<int(uint16_t)>& body) {
    int fds[2];
    if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
    group.spawn([fds, body] {
      ::close(fds[1]);
      uint16_t port = 0;
      const ssize_t n = ::read(fds[0], &port, sizeof(port));
      ::close(fds[0]);
      if (n != static_cast<ssize_t>(sizeof(port))) return 97;  // The test gave up.
      return body(port);
    });
    ::close(fds[0]);
    writers_.push_back(fds[1]);
    return writers_.size() - 1;
  }
  void start(size_t i, uint16_t port) {
    if (::write(writers_.at(i), &port, sizeof(port)) != static_cast<ssize_t>(sizeof(port))) {
      throw std::runtime_error("cannot start a child");
    }
    ::close(writers_[i]);
    writers_[i] = -1;
  }
  size_t size() const { return writers_.size(); }
  ~PreForked() {
    for (int fd : writers_) {
      if (fd >= 0) ::close(fd);
    }
  }

 private:
  std::vector<int> writers_;
};

std::shared_ptr<Store> connectTo(uint16_t port) {
  return std::make_shared<TcpStore>("127.0.0.1", port, sinew::testing::storeOptions());
}

void waitReady(Store& store, const std::vector<int>& workers) {
  std::vector<std::string> keys;
  for (int w : workers) keys.push_back("ready/" + std::to_string(w));
  store.wait(keys, 60s);
}

// Four members; one is SIGKILLed in an allreduce. The three survivors build the next epoch
// without connecting anything (each keeps its two links), then a new member joins: it connects
// its three pairs (a Gloo pair and two lanes each, 9 connections), each survivor only its one
// to the joiner (3), and every allreduce is exact.
TEST(RepairTest, SurvivorsKeepTheirConnectionsAndAJoinerConnectsOnlyItsOwn) {
  if (!gloo_backend::pairsAdoptConnections()) GTEST_SKIP() << "this Gloo's pairs cannot be kept";
  ProcessGroup group;
  PreForked children;
  const std::vector<int> first = {10, 11, 12, 13}, survivors = {10, 11, 12},
                         grown = {10, 11, 12, 14};
  for (int w : first) {
    children.spawn(group, [&, w](uint16_t port) {
      at::set_num_threads(1);
      auto store = connectTo(port);
      Checker c{w};
      Built b;
      auto comm = build(store, options(first, w, 0), &b);
      c.expectEq(b.made, 9, "epoch 0 connections made");
      c.expectEq(b.kept, 0, "epoch 0 links kept");
      runUntilLost(comm, *store);
      buildAndCheck(c, comm, store, options(survivors, w, 1), 0, 2);
      comm.reset();
      buildAndCheck(c, comm, store, options(grown, w, 2), 3, 2);
      return c.failures;
    });
  }
  const size_t joiner = children.spawn(group, [&](uint16_t port) {
    at::set_num_threads(1);
    auto s = connectTo(port);
    Checker c{14};
    std::unique_ptr<Communicator> comm;
    buildAndCheck(c, comm, s, options(grown, 14, 2), 9, 0);
    return c.failures;
  });
  TcpStoreServer server{sinew::testing::serverOptions()};
  for (size_t i = 0; i < first.size(); ++i) children.start(i, server.port());
  auto store = connectTo(server.port());
  waitReady(*store, first);
  group.signal(3, SIGKILL);
  // The joiner starts once the survivors are in epoch 1.
  store->wait({"sinew/comm/repair/epoch/1/joined/0", "sinew/comm/repair/epoch/1/joined/1",
               "sinew/comm/repair/epoch/1/joined/2"},
              60s);
  children.start(joiner, server.port());
  auto exits = group.waitAll(120s);
  EXPECT_TRUE(exits[3].signaled) << exits[3].str();
  for (size_t i : {0, 1, 2, 4}) {
    EXPECT_TRUE(exits[i].exited && exits[i].code == 0) << "child " << i << " " << exits[i].str();
  }
}

// A message of epoch 0 that was never received (1,000 floats), and one half written when its
// sender's deadline passed (8 MiB to a member that does not read), are on the lanes between
// two members when their communicator ends. Epoch 1 keeps the connections: the first message
// received there is the one epoch 1 sent, and the bytes before it were dropped.
TEST(RepairTest, AMessageOfTheEpochBeforeIsDroppedOnAKeptConnection) {
  if (!gloo_backend::pairsAdoptConnections()) GTEST_SKIP() << "this Gloo's pairs cannot be kept";
  ProcessGroup group;
  PreForked children;
  const std::vector<int> members = {10, 11, 12};
  for (int w : members) {
    children.spawn(group, [&, w](uint16_t port) {
      at::set_num_threads(1);
      auto store = connectTo(port);
      Checker c{w};
      Built b;
      auto comm = build(store, options(members, w, 0), &b);
      if (w == 10) {
        comm->send(at::full({1000}, 1.0f), 1, 7);
        try {
          comm->send(at::full({2 << 20}, 3.0f), 1, 8, 500ms);  // Never received.
          c.expectEq(0, 1, "the unread 8 MiB send timed out");
        } catch (const Timeout&) {
        }
        store->set("sent", toBytes("1"));
      } else {
        store->get("sent", 60s);
      }
      comm.reset();
      const int64_t droppedBefore = linkCounters().bytesDropped;
      comm = build(store, options(members, w, 1), &b);
      c.expectEq(b.made, 0, "epoch 1 connections made");
      c.expectEq(b.kept, 2, "epoch 1 links kept");
      if (w == 10) comm->send(at::full({1000}, 2.0f), 1, 7);
      if (w == 11) {
        at::Tensor got = at::zeros({1000});
        comm->recv(got, 0, 7);
        c.expectEq(at::equal(got, at::full({1000}, 2.0f)), 1, "epoch 1's message received");
        // The whole first message (frame and 4,000 bytes) and at least what fit of the second.
        c.expectEq(linkCounters().bytesDropped - droppedBefore > 4000 + 64 * 1024, 1,
                   "the epoch 0 bytes were dropped");
      }
      c.expectEq(sumsWorkerIds(*comm), 1, "epoch 1 allreduce exact");
      return c.failures;
    });
  }
  TcpStoreServer server{sinew::testing::serverOptions()};
  for (size_t i = 0; i < children.size(); ++i) children.start(i, server.port());
  auto exits = group.waitAll(120s);
  for (size_t i = 0; i < exits.size(); ++i) {
    EXPECT_TRUE(exits[i].exited && exits[i].code == 0) << "child " << i << " " << exits[i].str();
  }
}

// Four members; one is SIGKILLed. Of the three survivors, one is SIGKILLed too while the
// other two wait for it in epoch 1's set-up: their epoch 1 times out naming it. Epoch 2 of the
// last two keeps their link (nothing connected) and reduces exactly.
TEST(RepairTest, ALossDuringARepairStillKeepsTheRest) {
  if (!gloo_backend::pairsAdoptConnections()) GTEST_SKIP() << "this Gloo's pairs cannot be kept";
  ProcessGroup group;
  PreForked children;
  const std::vector<int> first = {10, 11, 12, 13}, survivors = {10, 11, 12}, last = {10, 11};
  for (int w : first) {
    children.spawn(group, [&, w](uint16_t port) {
      at::set_num_threads(1);
      auto store = connectTo(port);
      Checker c{w};
      Built b;
      auto comm = build(store, options(first, w, 0), &b);
      runUntilLost(comm, *store);
      if (w == 12) {
        for (;;) std::this_thread::sleep_for(1s);  // Killed before it joins epoch 1.
      }
      try {
        comm = build(store, options(survivors, w, 1, 3s), &b);
        c.expectEq(0, 1, "epoch 1 failed");
      } catch (const Timeout& e) {
        c.expectEq(std::string(e.what()).find("workers 12") != std::string::npos, 1,
                   std::string("epoch 1's timeout names worker 12: ") + e.what());
      }
      buildAndCheck(c, comm, store, options(last, w, 2), 0, 1);
      return c.failures;
    });
  }
  TcpStoreServer server{sinew::testing::serverOptions()};
  for (size_t i = 0; i < children.size(); ++i) children.start(i, server.port());
  auto store = connectTo(server.port());
  waitReady(*store, first);
  group.signal(3, SIGKILL);
  store->wait({"sinew/comm/repair/epoch/1/joined/0", "sinew/comm/repair/epoch/1/joined/1"}, 60s);
  group.signal(2, SIGKILL);
  auto exits = group.waitAll(120s);
  EXPECT_TRUE(exits[2].signaled && exits[3].signaled) << exits[2].str() << " " << exits[3].str();
  for (size_t i : {0, 1}) {
    EXPECT_TRUE(exits[i].exited && exits[i].code == 0) << "child " << i << " " << exits[i].str();
  }
}

// With keepConnections off, the survivors connect their pairs anew (one pair: a Gloo pair and two
// lanes).
TEST(RepairTest, WithoutKeepingEveryPairIsConnectedAnew) {
  ProcessGroup group;
  PreForked children;
  const std::vector<int> first = {10, 11, 12}, survivors = {10, 11};
  GlooOptions rebuild;
  rebuild.keepConnections = false;
  for (int w : first) {
    children.spawn(group, [&, w](uint16_t port) {
      at::set_num_threads(1);
      auto store = connectTo(port);
      Checker c{w};
      auto comm = createGlooCommunicator(store, options(first, w, 0), rebuild);
      runUntilLost(comm, *store);
      const LinkCounters before = linkCounters();
      comm = createGlooCommunicator(store, options(survivors, w, 1), rebuild);
      c.expectEq(linkCounters().connectionsMade - before.connectionsMade, 3,
                 "epoch 1 connections made");
      c.expectEq(linkCounters().linksKept - before.linksKept, 0, "epoch 1 links kept");
      c.expectEq(gloo_backend::LinkPool::instance().size(), 0, "links left in the pool");
      c.expectEq(sumsWorkerIds(*comm), 1, "epoch 1 allreduce exact");
      return c.failures;
    });
  }
  TcpStoreServer server{sinew::testing::serverOptions()};
  for (size_t i = 0; i < children.size(); ++i) children.start(i, server.port());
  auto store = connectTo(server.port());
  waitReady(*store, first);
  group.signal(2, SIGKILL);
  auto exits = group.waitAll(120s);
  for (size_t i : {0, 1}) {
    EXPECT_TRUE(exits[i].exited && exits[i].code == 0) << "child " << i << " " << exits[i].str();
  }
}

}  // namespace
}  // namespace collectives
}  // namespace sinew
