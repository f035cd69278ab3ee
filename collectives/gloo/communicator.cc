// The Gloo backend's lifecycle (gloo/gloo_communicator.h has the failure protocol and the
// files of the rest): Gloo's TCP device and the full mesh of pairs, the lanes, the control
// slot's watchers, the deadline timer, failing, the goodbyes and closing.

#include <gloo/common/error.h>
#include <gloo/context.h>
#include <gloo/transport/tcp/device.h>

#include <ATen/ATen.h>

#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>

#include "sinew/base/error.h"
#include "sinew/base/parse.h"
#include "sinew/collectives/gloo/gloo_communicator.h"
#include "sinew/collectives/gloo/loop_kicker.h"
#include "sinew/collectives/gloo/pair_mesh.h"
#include "sinew/collectives/gloo/parked_threads.h"
#include "sinew/collectives/gloo/reduce.h"
#include "sinew/collectives/prefix_store.h"

namespace sinew {
namespace collectives {
namespace gloo_backend {
namespace {

// Gloo's TCP pairs write with writev, which raises SIGPIPE when the peer's socket is gone.
// A dead peer must surface as PeerLost, not kill this process, so SIGPIPE is ignored when it
// still has its default action (a handler the program installed is left alone), as c10d does.
void ignoreSigpipe() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      ::signal(SIGPIPE, SIG_IGN);
    }
  });
}

}  // namespace

// A device owns an epoll loop thread, which its destructor joins, and an idle loop notices only
// at its next 10 ms timeout: with a device per communicator, every communicator destroyed cost
// about 10 ms (measured: 9.6-14 ms in its shutdown), and a reconfiguration drops several. The
// devices live as long as the process (never destroyed: no join at exit). A forked child starts
// a map of its own: the parent's devices have no loop thread in it (they are left alone, not
// destroyed).
std::shared_ptr<gloo::transport::Device> sharedDevice(const std::string& hostname) {
  struct Devices {
    pid_t pid;
    std::map<std::string, std::shared_ptr<gloo::transport::Device>> byHost;
  };
  static std::mutex mu;
  static Devices* devices = nullptr;
  std::lock_guard<std::mutex> lock(mu);
  if (devices == nullptr || devices->pid != ::getpid()) devices = new Devices{::getpid(), {}};
  auto& device = devices->byHost[hostname];
  if (!device) {
    gloo::transport::tcp::attr attr;
    attr.hostname = hostname;
    device = gloo::transport::tcp::CreateDevice(attr);
  }
  return device;
}

GlooCommunicator::GlooCommunicator(const std::shared_ptr<Store>& store,
                                   const CommunicatorOptions& options, const GlooOptions& gloo)
    : Communicator(options),
      gloo_(gloo),
      keep_(gloo.keepConnections && pairsAdoptConnections()),
      pairFds_(options.members.size(), -1),
      linkIds_(options.members.size(), 0),
      verdicts_(options.members.size()) {
  if (gloo_.laneSocketBufferBytes < 0 ||
      gloo_.laneSocketBufferBytes > GlooOptions::kMaxLaneSocketBufferBytes) {
    SINEW_THROW(InvalidArgument, "createGlooCommunicator: GlooOptions::laneSocketBufferBytes = ",
                gloo_.laneSocketBufferBytes, " is not in [0, ",
                GlooOptions::kMaxLaneSocketBufferBytes, "]");
  }
  if (store == nullptr) SINEW_THROW(InvalidArgument, "createGlooCommunicator: store is null");
  ignoreSigpipe();
  // The timer runs from the start: the goodbyes of a set-up that fails end at its deadline.
  timer_ = std::thread([this] { timerLoop(); });
  if (size() > 1) {
    const LinkCounters before = linkCounters();
    try {
      connect(store);
    } catch (...) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        stopping_ = true;
        cv_.notify_all();
      }
      if (timer_.joinable()) timer_.join();
      throw;
    }
    const LinkCounters after = linkCounters();
    // Process-wide counts: exact where one thread builds communicators at a time.
    linksKept_ = after.linksKept - before.linksKept;
    connectionsMade_ = after.connectionsMade - before.connectionsMade;
  }
}

std::string GlooCommunicator::describe() const {
  std::ostringstream os;
  os << "communicator '" << options_.name << "' (gloo, epoch " << epoch() << ", worker " << self()
     << ", rank " << rank_ << "/" << size() << ")";
  return os.str();
}

void GlooCommunicator::connect(const std::shared_ptr<Store>& store) {
  auto deadline = Clock::now() + options_.initTimeout;
  auto prefixed = std::make_shared<PrefixStore>(
      "sinew/comm/" + options_.name + "/epoch/" + std::to_string(epoch()), store);

  // 1. Announce ourselves and wait for every member, so a missing member is named; keep the
  //    connections both ends of a pair kept (repair), resynchronised for this epoch.
  std::map<int, Link> pooled;
  if (keep_) {
    std::vector<int> peers;
    for (int r = 0; r < size(); ++r) {
      if (r != rank_) peers.push_back(workerOf(r));
    }
    pooled = LinkPool::instance().takeFor(options_.name, self(), peers, epoch());
  }
  std::vector<Link> kept = join(*prefixed, std::move(pooled), deadline);
  std::vector<int> keptPairs(size(), -1);
  std::vector<std::pair<int, int>> keptLanes(size(), {-1, -1});
  for (int r = 0; r < size(); ++r) {
    if (kept[r].id == 0) continue;
    keptPairs[r] = kept[r].pairFd;
    keptLanes[r] = {kept[r].sendFd, kept[r].recvFd};
    linkIds_[r] = kept[r].id;
  }
  // The kept lanes' descriptors until the lanes own them (step 4).
  auto closeKeptLanes = [&keptLanes] {
    for (auto& [sendFd, recvFd] : keptLanes) {
      for (int fd : {sendFd, recvFd}) {
        if (fd >= 0) ::close(fd);
      }
    }
  };

  // 2. Full mesh of Gloo's pairs, on connections that presented the store's nonce
  //    (gloo/pair_mesh.h): Gloo's own rendezvous has each pair take whoever connects first.
  //    Kept connections are adopted as they are.
  try {
    device_ = sharedDevice(options_.hostname);
    PairLinks links;
    context_ = connectPairs(
        prefixed, rank_, size(), options_.hostname, epoch(), deadline, describe(),
        [this](int r) { return workerOf(r); }, device_, keptPairs, &links);
    pairFds_ = std::move(links.fds);
    for (int r = 0; r < size(); ++r) {
      if (linkIds_[r] == 0) linkIds_[r] = links.ids[r];
    }
  } catch (...) {
    closeKeptLanes();
    closeContext();
    throw;
  }

  // 3. Post the control receives and start their watchers. A peer that left right after the
  //    mesh connected (it crashed, or gave up on this epoch) has a closed pair, on which
  //    posting throws Gloo's IoException: that is this constructor's error like any other
  //    broken connection, never a Gloo exception in the caller (which handles Sinew's only).
  controlIn_.assign(size() * Goodbye::kWireBytes, 0);
  controlBufs_.resize(size());
  for (int r = 0; r < size(); ++r) {
    if (r == rank_) continue;
    controlBufs_[r] = buffer(controlIn_.data() + r * Goodbye::kWireBytes, Goodbye::kWireBytes);
    try {
      controlBufs_[r]->recv(r, kControlSlot, 0, Goodbye::kWireBytes);
    } catch (const gloo::Exception& e) {
      // The members whose connections work may already watch this one: they learn which
      // member left, instead of losing this one (still alive) without a goodbye.
      sayGoodbye(GoodbyeKind::kPeerLost, workerOf(r));
      controlBufs_.clear();  // No watcher runs yet.
      closeContext();
      closeKeptLanes();
      leaveLinks();  // Keeps nothing: there are no lanes.
      SINEW_THROW(IoError, describe(), ": the connection to worker ", workerOf(r), " (rank ", r,
                  ") broke as it was set up: ", e.what());
    }
  }
  for (int r = 0; r < size(); ++r) {
    if (r == rank_) continue;
    watchers_.push_back(ParkedThreads::instance().run([this, r] { watch(r); }));
  }

  // 4. The lanes: the two-member allreduce and every point-to-point message travel on them.
  //    Set up once the watchers run, so that a peer that dies meanwhile ends the set-up within
  //    a slice (its watcher fails this communicator) instead of at the deadline.
  try {
    auto lanes = std::make_unique<Lanes>(
        *prefixed, rank_, size(), options_.hostname, epoch(), deadline, describe(),
        [this](int r) { return workerOf(r); },
        [this] { return failed_.load(std::memory_order_acquire); }, gloo_.laneSocketBufferBytes,
        Lanes::Purpose::kData, keptLanes);
    std::lock_guard<std::mutex> lock(mu_);
    lanes_ = std::move(lanes);
  } catch (...) {
    {
      // A lane that broke because the peer died or left: its watcher's verdict names the
      // cause (PeerLost, or the peer's reason), as onPairError does.
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, kVerdictWait, [&] { return failure_ != nullptr; });
      failLocked(std::current_exception(), GoodbyeKind::kAborted, self());
    }
    shutdown();
    throwFailure();
  }
}

std::vector<Link> GlooCommunicator::join(Store& store, std::map<int, Link> pooled,
                                         Clock::time_point deadline) {
  auto putBack = [&] {
    for (auto& [peer, link] : pooled) LinkPool::instance().put(options_.name, self(), link);
    pooled.clear();
  };
  // "<worker>" and a " <peer worker>:<link id>" for each connection kept for a member.
  std::string joined = std::to_string(self());
  for (const auto& [peer, link] : pooled) {
    joined += " " + std::to_string(peer) + ":" + std::to_string(link.id);
  }
  try {
    store.set("joined/" + std::to_string(rank_), toBytes(joined));
  } catch (...) {
    putBack();
    throw;
  }
  std::vector<std::string> keys;
  for (int r = 0; r < size(); ++r) keys.push_back("joined/" + std::to_string(r));
  try {
    store.wait(keys, options_.initTimeout);
  } catch (const Timeout&) {
    putBack();
    std::ostringstream missing;
    for (int r = 0; r < size(); ++r) {
      if (!store.check({keys[r]})) missing << " " << workerOf(r);
    }
    SINEW_THROW(Timeout, describe(), ": members did not join within ", options_.initTimeout.count(),
                " ms: workers", missing.str());
  } catch (...) {
    putBack();
    throw;
  }
  std::vector<Link> kept(size());
  // Back to the pool for the next attempt, all but the link to `closedPeer` (closed).
  auto putBackKept = [&](int closedPeer) {
    for (auto& l : kept) {
      if (l.id == 0) continue;
      if (l.peerWorker == closedPeer) {
        l.close();
      } else {
        LinkPool::instance().put(options_.name, self(), l);
      }
    }
  };
  // A link is kept where the member at its other end kept the same one for this member.
  std::vector<Link*> resync;
  try {
    const std::vector<bool> agreed = agreeOnLinks(store, keys, joined, !pooled.empty());
    for (int r = 0; r < size(); ++r) {
      auto it = pooled.find(workerOf(r));
      if (r == rank_ || it == pooled.end()) continue;
      if (agreed[r]) {
        kept[r] = it->second;
        resync.push_back(&kept[r]);
      } else {
        it->second.close();
      }
      pooled.erase(it);
    }
  } catch (...) {
    putBackKept(-1);
    putBack();
    throw;
  }
  for (auto& [peer, link] : pooled) link.close();  // Kept for workers no longer members.
  pooled.clear();
  int broken = -1;
  const std::string ownKey = keys[rank_];
  std::string why;
  try {
    why = resyncLinks(
        resync, epoch(), deadline, [&] { store.wait({ownKey}, std::chrono::milliseconds(1)); },
        &broken);
  } catch (...) {
    putBackKept(-1);  // Given up (the store says the epoch is over).
    throw;
  }
  if (!why.empty()) {
    putBackKept(broken);  // The others' next marks name another epoch.
    SINEW_THROW(IoError, describe(), ": ", why);
  }
  countLinksKept(static_cast<int64_t>(resync.size()));
  return kept;
}

std::vector<bool> GlooCommunicator::agreeOnLinks(Store& store, const std::vector<std::string>& keys,
                                                 const std::string& own, bool holding) {
  std::vector<bool> agreed(size(), false);
  if (rank_ == 0) {
    // By rank: worker -> link id, as announced.
    std::vector<std::map<int, uint64_t>> lists(size());
    bool any = false;
    for (int r = 0; r < size(); ++r) {
      std::string value = own;
      if (r != 0) {
        const Bytes b = store.get(keys[r], options_.initTimeout);
        value.assign(b.begin(), b.end());
      }
      std::istringstream is(value);
      std::string token;
      is >> token;  // The member's worker id.
      while (is >> token) {
        const size_t colon = token.find(':');
        const auto peer = ::sinew::detail::tryParseInt(token.substr(0, colon));
        const auto id = colon == std::string::npos
                            ? std::nullopt
                            : ::sinew::detail::tryParseUint(token.substr(colon + 1));
        if (!peer || !id) {
          SINEW_THROW(Corruption, describe(), ": malformed announcement of rank ", r, ": '", value,
                      "'");
        }
        lists[r][static_cast<int>(*peer)] = *id;
        any = true;
      }
    }
    if (!any) return agreed;  // Nobody holds a link: nobody waits for the verdict.
    std::string verdict = "pairs";
    for (int a = 0; a < size(); ++a) {
      for (int b = a + 1; b < size(); ++b) {
        auto ab = lists[a].find(workerOf(b));
        auto ba = lists[b].find(workerOf(a));
        if (ab == lists[a].end() || ba == lists[b].end() || ab->second != ba->second) continue;
        verdict += " " + std::to_string(a) + "-" + std::to_string(b);
        if (a == 0) agreed[b] = true;
      }
    }
    store.set("kept", toBytes(verdict));
    return agreed;
  }
  if (!holding) return agreed;
  const Bytes b = store.get("kept", options_.initTimeout);
  std::istringstream is(std::string(b.begin(), b.end()));
  std::string token;
  is >> token;  // "pairs"
  while (is >> token) {
    int x = -1, y = -1;
    if (std::sscanf(token.c_str(), "%d-%d", &x, &y) != 2 || x < 0 || y <= x || y >= size()) {
      SINEW_THROW(Corruption, describe(), ": malformed verdict on kept links: '", token, "'");
    }
    if (x == rank_) agreed[y] = true;
    if (y == rank_) agreed[x] = true;
  }
  return agreed;
}

void GlooCommunicator::leaveLinks() {
  for (int r = 0; r < size(); ++r) {
    int& pairFd = pairFds_[r];
    if (pairFd < 0) continue;
    std::pair<int, int> lanes{-1, -1};
    if (lanes_) lanes = lanes_->release(r);
    Link link;
    link.peerWorker = workerOf(r);
    link.id = linkIds_[r];
    link.pairFd = pairFd;
    link.sendFd = lanes.first;
    link.recvFd = lanes.second;
    link.epoch = epoch();
    pairFd = -1;
    bool intact;
    {
      std::lock_guard<std::mutex> lock(mu_);
      intact = verdicts_[r].kind != VerdictKind::kLost;
    }
    if (keep_ && intact && link.complete()) {
      LinkPool::instance().put(options_.name, self(), link);
    } else {
      link.close();
    }
  }
}

GlooCommunicator::~GlooCommunicator() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_) {
      failure_ = std::make_exception_ptr(Aborted(describe() + " was destroyed"));
      failureKind_ = GoodbyeKind::kClosed;
      failureWorker_ = self();
    }
  }
  shutdown();
}

void GlooCommunicator::watch(int peer) {
  Verdict v;
  try {
    if (!controlBufs_[peer]->waitRecv(nullptr, kForever)) return;  // Shutting down.
    const Goodbye g = Goodbye::decode(controlIn_.data() + peer * Goodbye::kWireBytes);
    if (g.magic != kGoodbyeMagic || g.kind < 1 || g.kind > 4) {
      v.kind = VerdictKind::kLost;
      v.detail = "malformed control message";
    } else {
      v.kind = VerdictKind::kGoodbye;
      v.goodbye = g;
    }
  } catch (const std::exception& e) {
    v.kind = VerdictKind::kLost;
    v.detail = e.what();
  }
  std::lock_guard<std::mutex> lock(mu_);
  verdicts_[peer] = v;
  cv_.notify_all();
  if (stopping_) return;
  int worker = workerOf(peer);
  if (v.kind == VerdictKind::kLost) {
    std::ostringstream os;
    os << describe() << ": lost worker " << worker << " (rank " << peer
       << "): its connection broke without a goodbye (" << v.detail << ")";
    failLocked(std::make_exception_ptr(PeerLost(worker, os.str())), GoodbyeKind::kPeerLost, worker);
    return;
  }
  auto kind = static_cast<GoodbyeKind>(v.goodbye.kind);
  int culprit = static_cast<int>(v.goodbye.worker);
  std::ostringstream os;
  os << describe() << ": ";
  switch (kind) {
    case GoodbyeKind::kClosed:
      return;  // Orderly exit; only an operation that still needs this peer fails.
    case GoodbyeKind::kPeerLost:
      os << "worker " << worker << " reports worker " << culprit << " lost";
      failLocked(std::make_exception_ptr(PeerLost(culprit, os.str())), kind, culprit);
      return;
    case GoodbyeKind::kTimeout:
      os << "worker " << culprit << " timed out";
      failLocked(std::make_exception_ptr(Timeout(os.str())), kind, culprit);
      return;
    case GoodbyeKind::kAborted:
      os << "worker " << culprit << " aborted the communicator";
      failLocked(std::make_exception_ptr(Aborted(os.str())), kind, culprit);
      return;
  }
}

// Operations do not wake this thread: it sleeps until the deadline it last saw and then
// looks at the operation in flight, if any (an operation only notifies it when its deadline
// is earlier than that, or when it sleeps without one). Two wake-ups per operation cost the
// two-member allreduce a context switch on the other member's core each time.
void GlooCommunicator::timerLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    if (!deadline_) {
      timerWake_.reset();
      cv_.wait(lock);
      continue;
    }
    uint64_t generation = opGeneration_;
    auto deadline = *deadline_;
    timerWake_ = deadline;
    bool changed = cv_.wait_until(
        lock, deadline, [&] { return stopping_ || opGeneration_ != generation || !deadline_; });
    if (changed) continue;
    deadline_.reset();
    if (failure_) {
      // An operation after the failure (the goodbyes): its deadline only ends its waits.
      interruptActiveLocked();
      continue;
    }
    std::ostringstream os;
    int waiting = waitingOn_.load();
    os << describe() << ": " << (activeOp_ ? activeOp_ : "operation") << " timed out after "
       << activeTimeout_.count() << " ms";
    if (waiting >= 0)
      os << " waiting for worker " << workerOf(waiting) << " (rank " << waiting << ")";
    failLocked(std::make_exception_ptr(Timeout(os.str())), GoodbyeKind::kTimeout, self());
  }
}

void GlooCommunicator::interruptActiveLocked() {
  for (auto* b : active_) {
    b->abortWaitRecv();
    b->abortWaitSend();
  }
}

void GlooCommunicator::failLocked(std::exception_ptr error, GoodbyeKind kind, int worker) {
  if (failure_) return;
  failure_ = std::move(error);
  failureKind_ = kind;
  failureWorker_ = worker;
  failed_.store(true, std::memory_order_release);
  if (lanes_) lanes_->wake();
  interruptActiveLocked();
  cv_.notify_all();
}

void GlooCommunicator::fail(std::exception_ptr error, GoodbyeKind kind, int worker) {
  std::lock_guard<std::mutex> lock(mu_);
  failLocked(std::move(error), kind, worker);
}

void GlooCommunicator::abort() {
  fail(std::make_exception_ptr(Aborted(describe() + ": abort() was called")), GoodbyeKind::kAborted,
       self());
}

std::exception_ptr GlooCommunicator::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failure_;
}

void GlooCommunicator::throwFailure() {
  std::exception_ptr e;
  {
    std::lock_guard<std::mutex> lock(mu_);
    e = failure_;
  }
  SINEW_ENFORCE(e != nullptr, describe(), ": interrupted without a recorded failure");
  std::rethrow_exception(e);
}

void GlooCommunicator::onPairError(int peer, const std::string& what) {
  std::unique_lock<std::mutex> lock(mu_);
  // The peer's watcher sees the same broken connection, after any Goodbye it delivered.
  cv_.wait_for(lock, kVerdictWait, [&] { return verdicts_[peer].kind != VerdictKind::kNone; });
  const Verdict& v = verdicts_[peer];
  int worker = workerOf(peer);
  std::ostringstream os;
  os << describe() << ": ";
  if (v.kind == VerdictKind::kGoodbye &&
      static_cast<GoodbyeKind>(v.goodbye.kind) == GoodbyeKind::kClosed) {
    os << "worker " << worker << " closed the communicator while "
       << (activeOp_ ? activeOp_ : "an operation") << " still needed it";
    failLocked(std::make_exception_ptr(Aborted(os.str())), GoodbyeKind::kAborted, worker);
  } else if (v.kind != VerdictKind::kGoodbye) {
    os << "lost worker " << worker << " (rank " << peer << "): " << what;
    failLocked(std::make_exception_ptr(PeerLost(worker, os.str())), GoodbyeKind::kPeerLost, worker);
  }
  // Otherwise the watcher already failed us with the Goodbye's cause.
  std::exception_ptr e = failure_;
  lock.unlock();
  std::rethrow_exception(e);
}

void GlooCommunicator::waitRecv(UnboundBuffer* buf, int peer) {
  waitingOn_.store(peer);
  bool ok;
  try {
    ok = buf->waitRecv(nullptr, kForever);
  } catch (const gloo::IoException& e) {
    onPairError(peer, e.what());
  }
  waitingOn_.store(-1);
  if (!ok) throwFailure();
}

void GlooCommunicator::waitSend(UnboundBuffer* buf, int peer) {
  waitingOn_.store(peer);
  bool ok;
  try {
    ok = buf->waitSend(nullptr, kForever);
  } catch (const gloo::IoException& e) {
    onPairError(peer, e.what());
  }
  waitingOn_.store(-1);
  if (!ok) throwFailure();
}

GlooCommunicator::OpScope::OpScope(GlooCommunicator* comm, const char* name,
                                   std::chrono::milliseconds timeout,
                                   std::vector<UnboundBuffer*> buffers)
    : comm_(comm) {
  std::lock_guard<std::mutex> lock(comm_->mu_);
  comm_->active_ = std::move(buffers);
  comm_->activeOp_ = name;
  comm_->activeTimeout_ = timeout;
  comm_->deadline_ = Clock::now() + timeout;
  comm_->opGeneration_++;
  // The timer thread wakes by itself in time unless it sleeps past this deadline.
  if (!comm_->timerWake_ || *comm_->deadline_ < *comm_->timerWake_) comm_->cv_.notify_all();
}

GlooCommunicator::OpScope::~OpScope() {
  std::lock_guard<std::mutex> lock(comm_->mu_);
  comm_->active_.clear();
  comm_->deadline_.reset();
  comm_->activeOp_ = nullptr;
  comm_->opGeneration_++;  // The timer thread sees it when it wakes; it need not wake now.
}

void GlooCommunicator::runOp(const char* name, std::chrono::milliseconds timeout,
                             std::vector<UnboundBuffer*> buffers,
                             const std::function<void()>& body) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_) std::rethrow_exception(failure_);
  }
  try {
    OpScope scope(this, name, timeout, std::move(buffers));
    // A failure recorded before the scope registered its buffers interrupted nothing.
    if (error()) throwFailure();
    body();
  } catch (const gloo::Exception& e) {
    // Posting a send or receive on a pair whose peer just aborted fails here, possibly before
    // that peer's watcher has delivered its Goodbye (the peer closes right after sending it):
    // give the watchers the grace onPairError gives them, so the failure names its cause.
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, kVerdictWait, [&] { return failure_ != nullptr; });
    failLocked(std::make_exception_ptr(
                   Aborted(describe() + ": " + name + ": transport error: " + e.what())),
               GoodbyeKind::kAborted, self());
  } catch (...) {
    // Usually the recorded failure rethrown; otherwise this exception becomes it.
    fail(std::current_exception(), GoodbyeKind::kAborted, self());
  }
  if (error()) {
    shutdown();
    throwFailure();
  }
}

void GlooCommunicator::sayGoodbye(GoodbyeKind kind, int worker) {
  // Tell every peer whose connection still works, and that has not left, why we leave
  // (protocol step 2). A peer whose goodbye arrived reads no more: a send to it could only
  // wait out the budget on its closed connection.
  std::vector<uint8_t> out(size() * Goodbye::kWireBytes);
  const Goodbye g{kGoodbyeMagic, static_cast<uint32_t>(kind), static_cast<int64_t>(worker)};
  for (int r = 0; r < size(); ++r) g.encode(out.data() + r * Goodbye::kWireBytes);
  auto buf = buffer(out.data(), out.size());
  int posted = 0;
  for (int r = 0; r < size(); ++r) {
    if (r == rank_) continue;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (verdicts_[r].kind != VerdictKind::kNone) continue;
    }
    try {
      buf->send(r, kControlSlot, r * Goodbye::kWireBytes, Goodbye::kWireBytes);
      posted++;
    } catch (const std::exception&) {
      // That peer's connection is already broken; it needs no goodbye.
    }
  }
  // The sends end within the budget by the deadline timer, never by a Gloo timeout: that would
  // close every pair (UnboundBuffer::waitSend signals the whole context), and the watchers
  // would then find every peer lost, so that no connection to a live member would be kept for
  // the next communicator. A send to a peer that has just died, before its watcher has seen
  // it, may never complete: its in-place write fails (ECONNRESET) and Gloo queues it, and its
  // pair's failure does not signal a queued unbound send.
  OpScope scope(this, "goodbye", kGoodbyeBudget, {buf.get()});
  try {
    for (int i = 0; i < posted; ++i) {
      if (!buf->waitSend(nullptr, kForever)) break;  // The budget is spent.
    }
  } catch (const std::exception&) {
    // A pair that broke meanwhile: the other goodbyes were written or never will be.
  }
}

void GlooCommunicator::shutdown() {
  GoodbyeKind kind;
  int worker;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
    kind = failureKind_;
    worker = failureWorker_;
  }
  if (context_) sayGoodbye(kind, worker);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    cv_.notify_all();
  }
  for (auto& b : controlBufs_) {
    if (b) b->abortWaitRecv();
  }
  for (auto& t : watchers_) t->wait();
  watchers_.clear();
  if (timer_.joinable()) timer_.join();
  controlBufs_.clear();
  closeContext();
  // The pairs are closed: what is intact stays for the next communicator of this name.
  leaveLinks();
  // After the goodbyes, so a peer in a lane operation learns why we left. Under mu_, as
  // failLocked reads lanes_ (it cannot run here anyway: a failure is recorded before any
  // shutdown, and failLocked returns early then).
  std::unique_ptr<Lanes> lanes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    lanes.swap(lanes_);
  }
  lanes.reset();
  device_.reset();
}

void GlooCommunicator::closeContext() {
  if (!context_) return;
  if (closePairsOnLoop(*context_)) {
    context_.reset();
    return;
  }
  LoopKicker kicker(device_);
  context_.reset();
}

void GlooCommunicator::validate(const at::Tensor& t, const char* op, bool needReduce) const {
  if (!t.defined()) SINEW_THROW(InvalidArgument, describe(), ": ", op, ": undefined tensor");
  if (!t.device().is_cpu()) {
    SINEW_THROW(InvalidArgument, describe(), ": ", op, ": the gloo backend takes CPU tensors, got ",
                t.device().str());
  }
  if (!t.is_contiguous()) {
    SINEW_THROW(InvalidArgument, describe(), ": ", op, ": tensor must be contiguous");
  }
  if (needReduce && !reducible(t.scalar_type())) {
    SINEW_THROW(InvalidArgument, describe(), ": ", op, ": unsupported dtype ", dtypeName(t),
                " (float32, float64, float16, bfloat16 and int64 can be reduced)");
  }
}

}  // namespace gloo_backend

namespace {

// Empty if the process's gloo:: functions are those of the libgloo Sinew was built against;
// else why not. libtorch 2.x exports a bundled Gloo of another version: if it precedes
// libgloo in the executable's DT_NEEDED list, the dynamic linker binds Sinew's calls to it,
// whose classes have other layouts, and the first operation crashes.
std::string glooBindingProblem() {
  // Where Sinew's own reference to a Gloo function went, whatever the libraries are called.
  Dl_info mine{};
  auto* fn = reinterpret_cast<void*>(&gloo::transport::tcp::CreateDevice);
  if (::dladdr(fn, &mine) != 0 && mine.dli_fname != nullptr &&
      std::strstr(mine.dli_fname, "libtorch") != nullptr) {
    return std::string("gloo::transport::tcp::CreateDevice resolves to ") + mine.dli_fname +
           ": libtorch 2.x bundles its own Gloo, and it comes before libgloo in this "
           "program's link order. Link Sinew::sinew (or gloo) before ${TORCH_LIBRARIES}, or "
           "run with LD_PRELOAD=libgloo.so.0";
  }
  void* ours = ::dlopen("libgloo.so.0", RTLD_NOW | RTLD_NOLOAD);
  if (ours == nullptr) return {};  // Gloo linked in statically: nothing can interpose.
  const char* symbol = "_ZN4gloo9transport3tcp12CreateDeviceERKNS1_4attrE";
  void* bound = ::dlsym(RTLD_DEFAULT, symbol);
  void* expected = ::dlsym(ours, symbol);
  ::dlclose(ours);
  if (bound == nullptr || expected == nullptr || bound == expected) return {};
  Dl_info info{};
  std::string from = ::dladdr(bound, &info) != 0 && info.dli_fname ? info.dli_fname : "?";
  return "gloo::transport::tcp::CreateDevice resolves to " + from +
         " instead of libgloo.so.0: libtorch 2.x bundles its own Gloo, and it comes before "
         "libgloo in this program's link order. Link Sinew::sinew (or gloo) before "
         "${TORCH_LIBRARIES}, or run with LD_PRELOAD=libgloo.so.0";
}

}  // namespace

GlooOptions GlooOptions::fromEnvironment(int laneSocketBufferBytes) {
  GlooOptions o;
  o.laneSocketBufferBytes = laneSocketBufferBytes;
  const char* v = std::getenv(kLaneSocketBufferEnv);
  if (v == nullptr) return o;
  const std::optional<int64_t> bytes = ::sinew::detail::tryParseInt(v);
  if (!bytes || *bytes < 0 || *bytes > kMaxLaneSocketBufferBytes) {
    SINEW_THROW(InvalidArgument, kLaneSocketBufferEnv, " = '", v,
                "' is not a count of bytes in [0, ", kMaxLaneSocketBufferBytes, "]");
  }
  o.laneSocketBufferBytes = static_cast<int>(*bytes);
  return o;
}

std::unique_ptr<Communicator> createGlooCommunicator(const std::shared_ptr<Store>& store,
                                                     const CommunicatorOptions& options,
                                                     const GlooOptions& gloo) {
  static const std::string problem = glooBindingProblem();
  if (!problem.empty()) SINEW_THROW(InvalidArgument, "createGlooCommunicator: ", problem);
  return std::make_unique<gloo_backend::GlooCommunicator>(store, options, gloo);
}

std::unique_ptr<Communicator> createGlooCommunicator(const std::shared_ptr<Store>& store,
                                                     const CommunicatorOptions& options) {
  return createGlooCommunicator(store, options, GlooOptions{});
}

}  // namespace collectives
}  // namespace sinew
