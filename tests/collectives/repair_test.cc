// Repair (docs/collectives.md, "Repair: kept connections"), with forked processes: survivors
// of a SIGKILL keep their connections to each other, a joiner connects only its own pairs, a
// message an older epoch left on a kept connection never reaches the next, and a loss during
// a repair still leaves the rest kept, and a goodbye to a member that has just died costs the
// connections to the others nothing.

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <gloo/transport/tcp/device.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>

#include <iostream>
#include <string>
#include <thread>

#include "../support.h"
#include "multiproc.h"
#include "sinew/collectives/gloo/gloo_communicator.h"
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

// Every child in `which` exited with 0 (its checks all passed).
void expectPassed(const std::vector<testing::ChildExit>& exits, const std::vector<size_t>& which) {
  for (size_t i : which) {
    EXPECT_TRUE(exits[i].exited && exits[i].code == 0) << "child " << i << " " << exits[i].str();
  }
}

// Starts the children 0..n-1 on `server`'s port.
void startAll(PreForked& children, size_t n, const TcpStoreServer& server) {
  for (size_t i = 0; i < n; ++i) children.start(i, server.port());
}

std::shared_ptr<Store> connectTo(uint16_t port) {
  return std::make_shared<TcpStore>("127.0.0.1", port, sinew::testing::storeOptions());
}

void waitReady(Store& store, const std::vector<int>& workers) {
  std::vector<std::string> keys;
  for (int w : workers) keys.push_back("ready/" + std::to_string(w));
  store.wait(keys, 60s);
}

// Holds the loop thread of this process's Gloo device for `hostname` (every pair's events wait)
// from construction, once the loop is inside it, until release() or destruction.
class LoopStall : public gloo::transport::tcp::Handler {
 public:
  explicit LoopStall(const std::string& hostname)
      : device_(std::dynamic_pointer_cast<gloo::transport::tcp::Device>(
            gloo_backend::sharedDevice(hostname))),
        fd_(::eventfd(1, EFD_NONBLOCK | EFD_CLOEXEC)) {
    if (!device_ || fd_ < 0) throw std::runtime_error("LoopStall: no TCP device or eventfd");
    device_->registerDescriptor(fd_, EPOLLIN, this);
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_for(lock, 10s, [&] { return entered_; })) {
      lock.unlock();
      device_->unregisterDescriptor(fd_, this);  // Waits for a tick: then it never runs.
      ::close(fd_);
      throw std::runtime_error("LoopStall: the loop never ran the handler");
    }
  }
  void release() {
    std::unique_lock<std::mutex> lock(mu_);
    if (!entered_ || done_) return;
    released_ = true;
    cv_.notify_all();
    cv_.wait(lock, [&] { return done_; });
  }
  ~LoopStall() override {
    release();
    if (fd_ >= 0) ::close(fd_);
  }
  void handleEvents(int) override {
    uint64_t v;
    while (::read(fd_, &v, sizeof(v)) == static_cast<ssize_t>(sizeof(v))) {
    }
    std::unique_lock<std::mutex> lock(mu_);
    entered_ = true;
    cv_.notify_all();
    cv_.wait(lock, [&] { return released_; });
    device_->unregisterDescriptor(fd_, this);  // On the loop thread: no wait for a tick.
    done_ = true;
    cv_.notify_all();
  }

 private:
  std::shared_ptr<gloo::transport::tcp::Device> device_;
  int fd_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool entered_ = false, released_ = false, done_ = false;
};

// Waits until child `pid` has exited (its sockets closed), without reaping it.
void waitExited(pid_t pid) {
  siginfo_t info{};
  while (::waitid(P_PID, static_cast<id_t>(pid), &info, WEXITED | WNOWAIT) != 0) {
    if (errno != EINTR) throw std::runtime_error("waitid failed");
  }
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
  startAll(children, first.size(), server);
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
  expectPassed(exits, {0, 1, 2, 4});
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
  startAll(children, children.size(), server);
  auto exits = group.waitAll(120s);
  expectPassed(exits, {0, 1, 2});
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
  startAll(children, children.size(), server);
  auto store = connectTo(server.port());
  waitReady(*store, first);
  group.signal(3, SIGKILL);
  store->wait({"sinew/comm/repair/epoch/1/joined/0", "sinew/comm/repair/epoch/1/joined/1"}, 60s);
  group.signal(2, SIGKILL);
  auto exits = group.waitAll(120s);
  EXPECT_TRUE(exits[2].signaled && exits[3].signaled) << exits[2].str() << " " << exits[3].str();
  expectPassed(exits, {0, 1});
}

// Three members; worker 12 is SIGKILLed while worker 10's Gloo loop is held, so that 10's
// watchers have not seen the loss (nor worker 11's goodbye) when 10 closes its communicator:
// 10 sends goodbyes to both. The one to 12 fails in its in-place write and Gloo queues it for
// good; it must cost no more than the goodbye budget, and the link to 11 must survive it (a
// Gloo timeout there closes every pair: 10 then kept nothing and connected 11 anew). Epoch 1 of
// 10 and 11 keeps their link and reduces exactly.
TEST(RepairTest, AGoodbyeToAMemberThatHasJustDiedCostsTheOthersNothing) {
  if (!gloo_backend::pairsAdoptConnections()) GTEST_SKIP() << "this Gloo's pairs cannot be kept";
  ProcessGroup group;
  PreForked children;
  const std::vector<int> first = {10, 11, 12}, last = {10, 11};
  for (int w : first) {
    children.spawn(group, [&, w](uint16_t port) {
      at::set_num_threads(1);
      auto store = connectTo(port);
      Checker c{w};
      Built b;
      auto comm = build(store, options(first, w, 0), &b);
      if (w == 12) {
        store->set("ready/12", toBytes("1"));
        for (;;) std::this_thread::sleep_for(1s);  // Killed.
      }
      if (w == 11) {
        runUntilLost(comm, *store);  // Its allreduce fails with the loss of 12.
      } else {
        LoopStall stall(options(first, w, 0).hostname);
        store->set("ready/10", toBytes("1"));
        store->get("killed", 60s);
        const auto start = std::chrono::steady_clock::now();
        std::thread closer([&] { comm.reset(); });
        // Longer than the budget: the goodbyes are over (one written, one queued for good).
        std::this_thread::sleep_for(500ms);
        stall.release();
        closer.join();
        c.expectEq(sinew::testing::elapsedMs(start) < 2000, 1, "closing took under 2 s");
      }
      buildAndCheck(c, comm, store, options(last, w, 1), 0, 1);
      return c.failures;
    });
  }
  TcpStoreServer server{sinew::testing::serverOptions()};
  startAll(children, children.size(), server);
  auto store = connectTo(server.port());
  waitReady(*store, first);
  group.signal(2, SIGKILL);
  waitExited(group.pid(2));
  store->set("killed", toBytes("1"));
  auto exits = group.waitAll(120s);
  EXPECT_TRUE(exits[2].signaled) << exits[2].str();
  expectPassed(exits, {0, 1});
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
  startAll(children, children.size(), server);
  auto store = connectTo(server.port());
  waitReady(*store, first);
  group.signal(2, SIGKILL);
  auto exits = group.waitAll(120s);
  expectPassed(exits, {0, 1});
}

}  // namespace
}  // namespace collectives
}  // namespace sinew
