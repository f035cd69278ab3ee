#include "sinew/runtime/leader_election.h"

#include <algorithm>

namespace sinew {
namespace runtime {

using Clock = std::chrono::steady_clock;
using collectives::EtcdCompare;
using collectives::EtcdOp;

namespace {

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
      .count();
}

}  // namespace

LeaderElection::LeaderElection(LeaderElectionOptions options) : options_(std::move(options)) {
  if (!options_.etcd) SINEW_THROW(InvalidArgument, "LeaderElection without an etcd client");
  if (options_.key.empty()) SINEW_THROW(InvalidArgument, "LeaderElection without a key");
  if (options_.ttlSeconds < 1) {
    SINEW_THROW(InvalidArgument, "leader lease TTL of ", options_.ttlSeconds, " s (at least 1)");
  }
}

LeaderElection::~LeaderElection() {
  try {
    resign();
  } catch (const std::exception&) {
    // etcd unreachable: the lease ends by itself after its TTL.
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (renewer_.joinable()) renewer_.join();
}

bool LeaderElection::campaign(const std::string& value, std::chrono::milliseconds timeout,
                              const std::function<bool()>& giveUp) {
  SINEW_ENFORCE(term_.load() == 0, "campaign while leading");
  if (renewer_.joinable()) renewer_.join();  // The thread of an earlier, lost term.
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = false;
  }
  const auto deadline = Clock::now() + timeout;
  auto& etcd = *options_.etcd;
  int64_t lease = 0, granted = 0;
  while (Clock::now() < deadline) {
    if (giveUp && giveUp()) break;
    try {
      if (lease == 0) {
        const auto asked = nowNs();
        lease = etcd.grantLease(options_.ttlSeconds, &granted);
        renewedAtNs_.store(asked);
      } else {
        // Keep the campaign's lease alive while waiting; a lease that ended is replaced.
        const auto asked = nowNs();
        if (etcd.keepAlive(lease) <= 0) {
          lease = 0;
          continue;
        }
        renewedAtNs_.store(asked);
      }
      // Create the key if nobody holds it (create revision 0), bound to our lease.
      EtcdCompare free;
      free.key = options_.key;
      free.target = EtcdCompare::Target::kCreateRevision;
      free.number = 0;
      auto r =
          etcd.txn({free}, {EtcdOp::put(options_.key, value, lease), EtcdOp::get(options_.key)},
                   {EtcdOp::get(options_.key)});
      if (r.succeeded && !r.gets.empty() && r.gets[0]) {
        lease_.store(lease);
        grantedTtlMs_.store(granted * 1000);
        term_.store(r.gets[0]->createRevision);
        renewer_ = std::thread([this] { renewLoop(); });
        return true;
      }
      // Someone leads: wait for its key to change (deleted when its lease ends), renewing
      // our own lease at a third of its TTL.
      const int64_t holderRevision = (!r.gets.empty() && r.gets[0]) ? r.gets[0]->modRevision : 0;
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      auto slice = std::min<std::chrono::milliseconds>(
          {left, std::chrono::milliseconds(granted * 1000 / 3), std::chrono::milliseconds(500)});
      if (slice.count() > 0) {
        etcd.watch(options_.key, false, std::max<int64_t>(holderRevision, r.revision) + 1, slice);
      }
    } catch (const Error&) {
      // etcd unreachable or busy: wait and try again, within the campaign's deadline.
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  if (lease != 0) {
    try {
      etcd.revokeLease(lease);
    } catch (const Error&) {
    }
  }
  return false;
}

bool LeaderElection::leads() const {
  if (term_.load() == 0) return false;
  // The lease may have ended on etcd's clock once a TTL has passed since the newest renewal
  // it confirmed was sent; a margin of a quarter TTL covers clock-rate differences.
  const int64_t ttlNs = grantedTtlMs_.load() * 1000000;
  return nowNs() - renewedAtNs_.load() < ttlNs - ttlNs / 4;
}

int64_t LeaderElection::term() const { return term_.load(); }
int64_t LeaderElection::lease() const { return lease_.load(); }

void LeaderElection::fencedWrite(const std::vector<EtcdOp>& ops) {
  const int64_t term = term_.load();
  if (term == 0) SINEW_THROW(NotLeader, "not the leader of '", options_.key, "'");
  EtcdCompare mine;
  mine.key = options_.key;
  mine.target = EtcdCompare::Target::kCreateRevision;
  mine.number = term;
  auto r = options_.etcd->txn({mine}, ops);
  if (!r.succeeded) {
    lose("a fenced write found another term at '" + options_.key + "'");
    SINEW_THROW(NotLeader, "the term ", term, " at '", options_.key,
                "' is over (another leader, or the lease ended): write refused");
  }
}

void LeaderElection::setValue(const std::string& value) {
  fencedWrite({EtcdOp::put(options_.key, value, lease_.load())});
}

void LeaderElection::resign() {
  const int64_t lease = lease_.exchange(0);
  term_.store(0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    onLost_ = nullptr;
  }
  cv_.notify_all();
  if (lease != 0) options_.etcd->revokeLease(lease);
}

void LeaderElection::setOnLost(std::function<void(const std::string&)> onLost) {
  std::lock_guard<std::mutex> lock(mu_);
  onLost_ = std::move(onLost);
}

void LeaderElection::lose(const std::string& why) {
  std::function<void(const std::string&)> onLost;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (term_.exchange(0) == 0) return;
    stop_ = true;
    onLost = std::move(onLost_);
    onLost_ = nullptr;
  }
  cv_.notify_all();
  if (onLost) onLost(why);
}

void LeaderElection::renewLoop() {
  const auto every = std::chrono::milliseconds(std::max<int64_t>(grantedTtlMs_.load() / 4, 50));
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (cv_.wait_for(lock, every, [&] { return stop_; })) return;
    }
    const int64_t lease = lease_.load();
    if (lease == 0) return;
    const auto asked = nowNs();
    try {
      if (options_.etcd->keepAlive(lease) <= 0) {
        return lose("etcd says the lease ended");
      }
      renewedAtNs_.store(asked);
      // The term is the key's, not the lease's: a key deleted or made anew (by another
      // candidate after a deletion) ends this term though the lease lives on.
      const auto key = options_.etcd->get(options_.key);
      if (!key || key->createRevision != term_.load()) {
        return lose("the leader key '" + options_.key + "' " +
                    (key ? "belongs to term " + std::to_string(key->createRevision)
                         : std::string("was deleted")) +
                    " (this term: " + std::to_string(term_.load()) + ")");
      }
    } catch (const Error& e) {
      if (!leads()) {
        return lose(std::string("no renewal of the lease for a TTL: ") + e.what());
      }
    }
  }
}

}  // namespace runtime
}  // namespace sinew
