#include "sinew/runtime/peer_versions.h"

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <tuple>

#include "sinew/checkpoint/placement.h"

namespace sinew {
namespace runtime {

PeerVersions::PeerVersions(const TrainerServices& services, DurableCheckpoints& durable,
                           bool enabled)
    : s_(services), durable_(durable), enabled_(enabled) {}

PeerVersions::~PeerVersions() {
  gens_.clear();   // Joins their threads (the replication hook uses the injector).
  stopRetiring();  // Likewise for the engines being destroyed in the background.
}

std::string PeerVersions::prefix(int64_t epoch) { return "sinew/gemini/e" + std::to_string(epoch); }

std::string PeerVersions::key(int64_t epoch, const std::string& suffix) {
  return prefix(epoch) + "/" + suffix;
}

bool PeerVersions::due(int64_t step, bool holdsLayers) const {
  const TrainerOptions& o = s_.options;
  return enabled_ && holdsLayers &&
         ((step + 1) % o.peerCheckpointEvery == 0 || step == o.steps - 1);
}

bool PeerVersions::ownsShard(const pipeline::Plan& plan, int worker) {
  // One definition for both: the durable checkpoint's writers are the shards' owners, so the
  // engine's copy a writer hands its flusher is its whole shard.
  return DurableCheckpoints::roleOf(worker, /*pipelineMode=*/true, {}, plan).writer;
}

std::vector<int> PeerVersions::placementOrder(const pipeline::Plan& plan, int replicas) {
  std::vector<pipeline::WorkerAssignment> owners, others;
  for (const auto& w : plan.workers) {
    if (w.endLayer <= w.firstLayer) continue;
    (ownsShard(plan, w.worker) ? owners : others).push_back(w);
  }
  auto byPlace = [](const auto& a, const auto& b) {
    return std::tie(a.pipeline, a.stage, a.worker) < std::tie(b.pipeline, b.stage, b.worker);
  };
  std::sort(owners.begin(), owners.end(), byPlace);
  std::sort(others.begin(), others.end(), byPlace);
  std::vector<int> order;
  std::vector<bool> used(others.size(), false);
  for (const auto& o : owners) {
    order.push_back(o.worker);
    int partners = 0;
    for (size_t i = 0; i < others.size() && partners < replicas - 1; ++i) {
      const auto& x = others[i];
      if (used[i] || (x.firstLayer < o.endLayer && o.firstLayer < x.endLayer)) continue;
      used[i] = true;
      order.push_back(x.worker);
      ++partners;
    }
  }
  for (size_t i = 0; i < others.size(); ++i) {
    if (!used[i]) order.push_back(others[i].worker);
  }
  return order;
}

bool PeerVersions::maybeSnapshot(int64_t step, int64_t epoch, const pipeline::Plan& plan, int first,
                                 int end, const std::function<checkpoint::ShardState()>& state,
                                 int64_t current, double* waited,
                                 checkpoint::VersionFlusher* durable,
                                 const checkpoint::FlushRole& role, bool* taken) {
  *taken = false;
  if (!due(step, end > first)) return false;
  const int self = s_.worker();
  if (gens_.empty() || gens_.back().epoch != epoch) {
    std::vector<int> order = placementOrder(plan, s_.options.replicas);
    if (std::find(order.begin(), order.end(), self) == order.end()) return false;
    checkpoint::CheckpointEngineOptions eo;
    eo.self = self;
    eo.workers = std::move(order);
    eo.replication = s_.options.replicas;
    eo.store = s_.ctx.store();
    eo.prefix = prefix(epoch);
    eo.token = s_.state.token;
    eo.service.host = s_.ctx.host();
    // The committed version, the newest complete one and one being taken: a version that
    // never commits (abandoned) does not keep the next one from being taken.
    eo.snapshot.slots = 3;
    // A peer that stopped answering fails the version within the operation deadline, so an
    // engine being dropped never waits long for its replication thread.
    eo.client.timeout = s_.opTimeout();
    eo.client.connectTimeout = std::min(s_.opTimeout(), std::chrono::milliseconds(5000));
    eo.client.incremental = s_.options.incrementalCheckpoints;
    eo.timeout = s_.recoveryTimeout();
    eo.beforeReplicate = [this](int64_t v) {
      s_.state.injector.fire(s_.worker(), v, Phase::kReplication, nullptr);
    };
    Generation g;
    g.epoch = epoch;
    g.owner = ownsShard(plan, self);
    g.engine = std::make_unique<checkpoint::CheckpointEngine>(
        g.owner ? state() : checkpoint::ShardState{}, std::move(eo));
    // What this generation's shard holds, for a rollback's decision (rollbackTarget()).
    const std::string layers = g.owner ? std::to_string(first) + " " + std::to_string(end) : "0 0";
    s_.ctx.store()->set(key(epoch, "layers/" + std::to_string(self)), collectives::toBytes(layers));
    gens_.push_back(std::move(g));
  }
  Generation& g = gens_.back();
  if (g.lastTaken >= 0 && !waitCommit(g, epoch, current, waited)) {
    return false;  // A newer epoch is announced.
  }
  g.failuresSeen = g.engine->stats().replicationFailures;
  *taken = g.engine->snapshot(step, g.owner ? state() : checkpoint::ShardState{}, durable, role);
  if (*taken) g.lastTaken = step;
  s_.state.injector.fire(self, step, Phase::kSnapshot, &s_.client);
  // Generations older than the newest one with a committed version are never restored.
  for (size_t i = gens_.size(); i-- > 1;) {
    if (gens_[i].engine->committedStep() >= 0) {
      std::vector<std::unique_ptr<checkpoint::CheckpointEngine>> old;
      for (size_t k = 0; k < i; ++k) old.push_back(std::move(gens_[k].engine));
      gens_.erase(gens_.begin(), gens_.begin() + static_cast<std::ptrdiff_t>(i));
      for (auto& e : old) retire(std::move(e));
      break;
    }
  }
  return *taken;
}

void PeerVersions::waitBeforeUpdate(int64_t epoch) {
  if (!gens_.empty() && gens_.back().epoch == epoch) gens_.back().engine->waitBeforeUpdate();
}

checkpoint::TrafficGate* PeerVersions::trafficGate(int64_t epoch) {
  if (gens_.empty() || gens_.back().epoch != epoch) return nullptr;
  return &gens_.back().engine->trafficGate();
}

void PeerVersions::waitSnapshots() {
  for (auto& g : gens_) {
    try {
      g.engine->arena().waitComplete();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "sinew: worker %d: a peer-RAM snapshot failed: %s\n", s_.worker(),
                   e.what());
    }
  }
}

// Destroys an engine no longer needed off the training thread. Its destructor joins its
// replication thread, which may be waiting up to opTimeout for the acknowledgement of a peer
// that was stopped (SIGSTOP) rather than killed and has since been declared dead; on the
// training thread that wait held up the step past the step deadline, and the coordinator
// expelled this healthy worker too (PipelineRecoveryTest.StoppedReplicaPeerCostsOnlyItself).
// The engine's snapshots completed before its generation was dropped.
void PeerVersions::retire(std::unique_ptr<checkpoint::CheckpointEngine> engine) {
  if (!engine) return;
  try {
    engine->arena().waitComplete();
  } catch (const std::exception&) {
    // Its failure was reported when it happened; the engine goes either way.
  }
  std::lock_guard<std::mutex> lock(retireMu_);
  retiring_.push_back(std::move(engine));
  if (!retireThread_.joinable()) retireThread_ = std::thread([this] { retireLoop(); });
  retireCv_.notify_all();
}

void PeerVersions::retireLoop() {
  std::unique_lock<std::mutex> lock(retireMu_);
  for (;;) {
    retireCv_.wait(lock, [&] { return retireStop_ || !retiring_.empty(); });
    if (retiring_.empty()) return;  // Stopping, and nothing left.
    std::unique_ptr<checkpoint::CheckpointEngine> engine = std::move(retiring_.front());
    retiring_.pop_front();
    // What it sent (a chunk still in flight while it is destroyed is not counted).
    retiredBytes_ += static_cast<int64_t>(engine->stats().bytesReplicated);
    lock.unlock();
    engine.reset();  // Joins its threads.
    lock.lock();
  }
}

void PeerVersions::stopRetiring() {
  {
    std::lock_guard<std::mutex> lock(retireMu_);
    retireStop_ = true;
  }
  retireCv_.notify_all();
  if (retireThread_.joinable()) retireThread_.join();
}

// Waits until g's last version committed or was abandoned: this worker's replication of it
// failed (then it abandons it for everyone, under <prefix>/abandoned/<s>), another worker
// abandoned it, or recoveryTimeout passed. Returns false if a newer epoch than `epoch` was
// announced meanwhile (the next step's operations see it). Counts as waiting on the others
// for the next step (the step deadline's rule 1).
bool PeerVersions::waitCommit(Generation& g, int64_t epoch, int64_t current, double* waited) {
  const int64_t version = g.lastTaken;
  if (g.engine->committedStep() >= version) return true;
  const std::string abandoned = key(g.epoch, "abandoned/" + std::to_string(version));
  auto& store = *s_.ctx.store();
  WaitingOnOthers waiting(s_.client, current + 1, waited);
  const auto deadline = TrainerClock::now() + s_.recoveryTimeout();
  std::string why;
  auto pause = checkpoint::CheckpointEngine::kFirstPoll;
  while (g.engine->committedStep() < version) {
    if (s_.client.latestEpoch().epoch > epoch) return false;
    if (g.engine->stats().replicationFailures > g.failuresSeen) {
      why = "its replication failed: " + g.engine->stats().lastError;
      store.set(abandoned, collectives::toBytes(std::to_string(s_.worker())));
      break;
    }
    if (store.check({abandoned})) {
      why = "worker " + collectives::toString(store.get(abandoned)) + " abandoned it";
      break;
    }
    if (TrainerClock::now() > deadline) {
      why = "it did not commit within " + std::to_string(s_.recoveryTimeout().count()) + " ms";
      break;
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, checkpoint::CheckpointEngine::kLastPoll);
  }
  if (!why.empty()) {
    std::fprintf(stderr, "sinew: worker %d: peer-RAM version %lld abandoned: %s\n", s_.worker(),
                 static_cast<long long>(version), why.c_str());
    s_.event({{"event", "peer_version_abandoned"}, {"step", version}, {"why", why}});
  }
  return true;
}

int64_t PeerVersions::rollbackTarget(int64_t upTo, int64_t epoch, const std::vector<int>& live,
                                     collectives::Store& store, int numLayers,
                                     const std::function<bool(int)>& hasParameters) {
  auto isLive = [&](int w) { return std::find(live.begin(), live.end(), w) != live.end(); };
  const int64_t oldest = gens_.empty() ? 0 : gens_.front().epoch;
  int64_t best = -1;
  for (int64_t e = epoch; e >= oldest; --e) {
    const std::string p = prefix(e);
    // upTo itself if it committed here (a version may commit after a first decision), else
    // the generation's newest.
    auto record = checkpoint::CheckpointEngine::commitRecordIn(store, p, upTo);
    if (!record) {
      const int64_t c = checkpoint::CheckpointEngine::committedIn(store, p);
      if (c < 0 || c > upTo) continue;
      record = checkpoint::CheckpointEngine::commitRecordIn(store, p, c);
    }
    if (!record || record->step <= best) continue;
    checkpoint::ReplicaPlacement placement(record->workers, record->replication);
    std::vector<bool> covered(numLayers, false);
    for (int w : record->workers) {
      const auto& holders = placement.holders(w);
      if (std::none_of(holders.begin(), holders.end(), isLive)) continue;
      std::istringstream is(collectives::toString(
          store.get(key(e, "layers/" + std::to_string(w)), s_.recoveryTimeout())));
      int first = 0, end = 0;
      if (!(is >> first >> end)) continue;
      for (int l = std::max(first, 0); l < std::min(end, numLayers); ++l) covered[l] = true;
    }
    bool all = true;
    for (int l = 0; l < numLayers; ++l) all = all && (covered[l] || !hasParameters(l));
    if (all) best = record->step;
  }
  // The newest durable version at or before upTo (restoreLayers verifies its checksums).
  for (int64_t d : durable_.durableSteps()) {
    if (d <= upTo) {
      best = std::max(best, d);
      break;
    }
  }
  return best;
}

PeerVersions::HostBytes PeerVersions::hostBytes() const {
  HostBytes b;
  for (const auto& g : gens_) {
    b.own += static_cast<int64_t>(g.engine->stats().snapshot.bytesAllocated);
    b.replicas += static_cast<int64_t>(g.engine->service().bytesAllocated());
  }
  return b;
}

int64_t PeerVersions::replicatedBytes() {
  int64_t bytes = 0;
  for (const auto& g : gens_) bytes += static_cast<int64_t>(g.engine->stats().bytesReplicated);
  std::lock_guard<std::mutex> lock(retireMu_);
  bytes += retiredBytes_;
  for (const auto& e : retiring_) bytes += static_cast<int64_t>(e->stats().bytesReplicated);
  return bytes;
}

checkpoint::RestoreResult PeerVersions::restore(int64_t step,
                                                const std::vector<std::string>& layers,
                                                const std::vector<int>& live) {
  checkpoint::RestoreSources src;
  for (auto it = gens_.rbegin(); it != gens_.rend(); ++it) {
    checkpoint::RestoreSources g = it->engine->restoreSources(step);
    src.local.insert(src.local.end(), g.local.begin(), g.local.end());
    for (auto& peer : g.peers) {
      // Workers that left are gone (a stopped one would only cost its timeout).
      if (std::find(live.begin(), live.end(), peer.first) != live.end()) {
        src.peers.push_back(std::move(peer));
      }
    }
    src.client = g.client;
  }
  src.client.token = s_.state.token;
  src.client.connectTimeout = std::chrono::milliseconds(1000);
  src.client.timeout = s_.recoveryTimeout();
  src.dir = s_.options.checkpointDir;
  src.env = s_.state.checkpointEnv;
  return checkpoint::restoreLayers(src, step, layers);
}

}  // namespace runtime
}  // namespace sinew
