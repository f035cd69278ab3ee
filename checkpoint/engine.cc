#include "sinew/checkpoint/engine.h"

#include <unistd.h>

#include <nlohmann/json.hpp>

#include <cstdio>

#include "sinew/base/error.h"
#include "sinew/base/parse.h"

namespace sinew {
namespace checkpoint {
namespace {

using Clock = std::chrono::steady_clock;
using collectives::Bytes;
using collectives::toBytes;
using collectives::toString;

}  // namespace

CheckpointEngine::CheckpointEngine(const ShardState& like, CheckpointEngineOptions options)
    : options_(std::move(options)), placement_(options_.workers, options_.replication) {
  if (options_.store == nullptr) {
    SINEW_THROW(InvalidArgument, "CheckpointEngineOptions::store is null (worker ", options_.self,
                ")");
  }
  if (options_.token == 0) {
    SINEW_THROW(InvalidArgument, "CheckpointEngineOptions::token is 0: pass the job token");
  }
  ReplicaServiceOptions serviceOptions = options_.service;
  serviceOptions.token = options_.token;
  service_ = std::make_unique<ReplicaService>(options_.self, serviceOptions);
  options_.store->set(key("replica/" + std::to_string(options_.self)),
                      toBytes(options_.service.host + ":" + std::to_string(service_->port())));
  SnapshotOptions so = options_.snapshot;
  so.owner = options_.self;
  arena_ = std::make_unique<SnapshotArena>(like, so);
  service_->setOwnShards([this] { return arena_->all(); });
  if (!options_.persist.dir.empty()) {
    VersionFlusherOptions fo;
    fo.self = options_.self;
    fo.persist = options_.persist;
    fo.store = options_.store;
    fo.prefix = options_.prefix;
    fo.timeout = options_.timeout;
    fo.lowPriority = true;
    fo.onFlushed = [this](const FlushedVersion&) {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.flushed++;
    };
    fo.onFailed = [this](int64_t step, const std::string&, const std::string&,
                         std::exception_ptr error) {
      const std::string what = ::sinew::detail::describe(error);
      std::fprintf(stderr, "sinew checkpoint: worker %d: flush of version %lld failed: %s\n",
                   options_.self, static_cast<long long>(step), what.c_str());
      std::lock_guard<std::mutex> lock(mu_);
      stats_.lastError = what;
      if (!flushError_) flushError_ = error;  // Rethrown by waitDurable().
    };
    fo.onSuperseded = [this](int64_t step, int64_t newer, const std::string&) {
      std::fprintf(stderr,
                   "sinew checkpoint: worker %d: version %lld was written but not made the "
                   "latest: version %lld is already durable (a late writer's; nothing is lost)\n",
                   options_.self, static_cast<long long>(step), static_cast<long long>(newer));
    };
    flusher_ = std::make_unique<VersionFlusher>(std::move(fo));
  }
  arena_->setOnComplete([this](std::shared_ptr<const HostShard> s) { onSnapshot(std::move(s)); });
  arena_->setOnFailed(
      [this](int64_t step, std::exception_ptr error) { onSnapshotFailed(step, error); });
  replicationThread_ = std::thread([this] { replicationLoop(); });
}

CheckpointEngine::~CheckpointEngine() {
  arena_->setOnComplete(nullptr);
  arena_->setOnFailed(nullptr);
  service_->setOwnShards(nullptr);
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  replicationThread_.join();
  flusher_.reset();  // Writes the versions queued, then joins its thread.
  arena_.reset();
  // A caller's version whose copy never completed (the engine went first) will not come.
  for (auto& [step, copy] : durableCopies_) copy.flusher->cancel();
}

bool CheckpointEngine::snapshot(int64_t step, const ShardState& state, VersionFlusher* durable,
                                FlushRole role) {
  if (durable != nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    durableCopies_[step] = {durable, std::move(role)};
  }
  bool taken = false;
  try {
    taken = arena_->snapshot(step, state);
  } catch (...) {
    std::lock_guard<std::mutex> lock(mu_);
    durableCopies_.erase(step);
    throw;
  }
  if (!taken && durable != nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    durableCopies_.erase(step);
  }
  return taken;
}

void CheckpointEngine::waitBeforeUpdate(std::chrono::milliseconds timeout) {
  arena_->waitBeforeUpdate(timeout);
}

void CheckpointEngine::onSnapshotFailed(int64_t step, std::exception_ptr error) {
  DurableCopy copy;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = durableCopies_.find(step);
    if (it == durableCopies_.end()) return;
    copy = std::move(it->second);
    durableCopies_.erase(it);
  }
  copy.flusher->fail(step, error, "copy", "host memory");
}

void CheckpointEngine::onSnapshot(std::shared_ptr<const HostShard> shard) {
  DurableCopy copy;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = durableCopies_.find(shard->step);
    if (it != durableCopies_.end()) {
      copy = std::move(it->second);
      durableCopies_.erase(it);
    }
  }
  if (copy.flusher != nullptr) copy.flusher->submit(shard, std::move(copy.role), /*shared=*/true);
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Every snapshot is sent, in order: workers that took the same snapshots replicate the
    // same versions, so they commit. The queue is bounded by the arena's slots (a queued
    // shard pins its slot; with none free the arena skips a snapshot).
    toReplicate_.push_back(std::move(shard));
  }
  cv_.notify_all();
}

std::string CheckpointEngine::peerAddress(int worker, std::chrono::milliseconds timeout) const {
  // Polled rather than one blocking get, so that stopping the engine (its destructor) never
  // waits for a peer that died before it published its address.
  const std::string k = key("replica/" + std::to_string(worker));
  auto deadline = Clock::now() + timeout;
  auto pause = kFirstPoll;
  for (;;) {
    if (options_.store->check({k})) return toString(options_.store->get(k));
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_)
        SINEW_THROW(Aborted, "checkpoint engine stopped while waiting for worker ", worker,
                    "'s replica address");
    }
    if (Clock::now() > deadline) {
      SINEW_THROW(Timeout, "worker ", worker, " published no replica address within ",
                  timeout.count(), " ms");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, kLastPoll);
  }
}

uint64_t CheckpointEngine::replicate(const HostShard& shard) {
  uint64_t sent = 0;
  for (int peer : placement_.peersOf(options_.self)) {
    auto& client = clients_[peer];
    if (!client) {
      ReplicaClientOptions co = options_.client;
      co.token = options_.token;
      auto userBefore = co.beforeChunk;
      co.beforeChunk = [this, userBefore] {
        gate_.waitIdle(options_.maxYield);
        if (userBefore) userBefore();
      };
      client = std::make_unique<ReplicaClient>(peer, peerAddress(peer, options_.timeout), co);
    }
    sent += client->put(shard);
  }
  return sent;
}

void CheckpointEngine::reportHeld(int64_t step) {
  auto& store = *options_.store;
  const std::string s = std::to_string(step);
  store.set(key("held/" + s + "/" + std::to_string(options_.self)), toBytes("1"));
  int64_t n = store.add(key("held/" + s), 1);
  if (n != static_cast<int64_t>(options_.workers.size())) return;
  const int64_t previous = committedIn(store, options_.prefix);
  nlohmann::json record = {{"step", step},
                           {"workers", options_.workers},
                           {"replication", options_.replication},
                           {"previous", previous}};
  store.set(key("commit/" + s), toBytes(record.dump()));
  advanceStoredStep(store, key("committed"), step);
  // Keys nobody reads again: s's reports, and the record two commits back.
  for (int w : options_.workers) store.deleteKey(key("held/" + s + "/" + std::to_string(w)));
  store.deleteKey(key("held/" + s));
  if (previous >= 0) {
    if (auto before = commitRecordIn(store, options_.prefix, previous)) {
      if (before->previous >= 0) store.deleteKey(key("commit/" + std::to_string(before->previous)));
    }
  }
}

int64_t CheckpointEngine::committedIn(collectives::Store& store, const std::string& prefix) {
  const std::string k = prefix + "/committed";
  return store.check({k}) ? parseStoredStep(store.get(k)) : -1;
}

std::optional<CommitRecord> CheckpointEngine::commitRecordIn(collectives::Store& store,
                                                             const std::string& prefix,
                                                             int64_t step) {
  const std::string k = prefix + "/commit/" + std::to_string(step);
  if (!store.check({k})) return std::nullopt;
  const std::string text = toString(store.get(k));
  try {
    auto j = ::sinew::detail::parseJson<Corruption>(text, "commit record " + k);
    CommitRecord r;
    r.step = j.at("step").get<int64_t>();
    r.workers = j.at("workers").get<std::vector<int>>();
    r.replication = j.at("replication").get<int>();
    r.previous = j.value("previous", int64_t{-1});
    if (r.step != step || r.replication < 1) SINEW_THROW(Corruption, "inconsistent fields");
    return r;
  } catch (const std::exception& e) {
    SINEW_THROW(Corruption, "commit record '", k, "' is malformed (", e.what(), "): '",
                text.substr(0, 200), "'");
  }
}

void CheckpointEngine::replicationLoop() {
  lowerThisThreadsPriority();
  for (;;) {
    std::shared_ptr<const HostShard> shard;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !toReplicate_.empty(); });
      if (stop_) return;
      shard = std::move(toReplicate_.front());
      toReplicate_.pop_front();
    }
    const int64_t step = shard->step;
    try {
      if (options_.beforeReplicate) options_.beforeReplicate(step);
      auto start = Clock::now();
      const uint64_t sent = replicate(*shard);
      double secs = std::chrono::duration<double>(Clock::now() - start).count();
      reportHeld(step);
      {
        std::lock_guard<std::mutex> lock(mu_);
        stats_.replicated++;
        stats_.replicationSeconds += secs;
        stats_.bytesReplicated += sent;
      }
      // Wait (briefly, and only until a newer version is ready) for the other workers'
      // reports; protect the newest committed version from reuse.
      int64_t committed = committedStep();
      {
        auto deadline = Clock::now() + options_.timeout;
        auto pause = kFirstPoll;
        std::unique_lock<std::mutex> lock(mu_);
        while (committed < step && !stop_ && toReplicate_.empty() && Clock::now() < deadline) {
          // Polls the store, backing off: every worker's replication thread polls the one store
          // server, which the training traffic's rendezvous needs too.
          cv_.wait_for(lock, pause);
          pause = std::min(pause * 2, kLastPoll);
          lock.unlock();
          committed = committedStep();
          lock.lock();
        }
      }
      if (committed >= 0) arena_->protect(committed);
      if (committed < step) continue;  // Not (yet) committed: nothing to flush.
      bool flush = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (flusher_ &&
            ((options_.flushEvery > 0 && step % options_.flushEvery == 0) || flushRequested_)) {
          flushRequested_ = false;
          flush = true;
        }
      }
      if (flush) {
        flusher_->reserve();
        flusher_->submit(shard, flushRole());
      }
    } catch (const std::exception& e) {
      // Version step does not commit; the committed version stays the previous one.
      std::lock_guard<std::mutex> lock(mu_);
      stats_.replicationFailures++;
      stats_.lastError = e.what();
      clients_.clear();  // Reconnect for the next version.
    }
  }
}

FlushRole CheckpointEngine::flushRole() const {
  FlushRole role;
  if (options_.workers.size() <= 1) return role;  // kAlone
  if (options_.self != options_.workers.front()) {
    role.how = FlushRole::How::kPost;
    return role;
  }
  role.how = FlushRole::How::kCommit;
  role.others.assign(options_.workers.begin() + 1, options_.workers.end());
  return role;
}

void CheckpointEngine::requestFlush() {
  std::lock_guard<std::mutex> lock(mu_);
  flushRequested_ = true;
}

int64_t CheckpointEngine::committedStep() const {
  int64_t c = committedIn(*options_.store, options_.prefix);
  // Whoever learns of a commit first protects it, so the next snapshot never waits for the
  // replication thread to notice.
  if (c >= 0) arena_->protect(c);
  return c;
}

int64_t CheckpointEngine::waitCommitted(int64_t step, std::chrono::milliseconds timeout) const {
  auto deadline = Clock::now() + timeout;
  auto pause = kFirstPoll;
  for (;;) {
    int64_t c = committedStep();
    if (c >= step) return c;
    if (Clock::now() > deadline) {
      SINEW_THROW(Timeout, "version ", step, " not committed after ", timeout.count(),
                  " ms (committed: ", c, ")");
    }
    std::this_thread::sleep_for(pause);  // Polls the store, backing off.
    pause = std::min(pause * 2, kLastPoll);
  }
}

int64_t CheckpointEngine::durableStep() const {
  auto& store = *options_.store;
  return store.check({key("durable")}) ? parseStoredStep(store.get(key("durable"))) : -1;
}

int64_t CheckpointEngine::waitDurable(int64_t step, std::chrono::milliseconds timeout) const {
  auto deadline = Clock::now() + timeout;
  for (;;) {
    int64_t d = durableStep();
    if (d >= step) return d;
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> lock(mu_);
      std::swap(error, flushError_);
    }
    if (error) std::rethrow_exception(error);
    if (Clock::now() > deadline) {
      SINEW_THROW(Timeout, "version ", step, " not durable after ", timeout.count(),
                  " ms (durable: ", d, ")");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));  // Polls the store.
  }
}

RestoreResult CheckpointEngine::restore(int64_t step,
                                        const std::vector<std::string>& layers) const {
  return restoreLayers(restoreSources(step), step, layers);
}

RestoreSources CheckpointEngine::restoreSources(int64_t step) const {
  RestoreSources src;
  if (auto own = arena_->find(step)) src.local.push_back(own);
  for (auto& r : service_->all()) {
    if (r->step == step) src.local.push_back(r);
  }
  for (int w : options_.workers) {
    if (w == options_.self) continue;
    const std::string k = key("replica/" + std::to_string(w));
    if (options_.store->check({k})) src.peers.emplace_back(w, toString(options_.store->get(k)));
  }
  src.client = options_.client;
  src.client.token = options_.token;
  src.client.connectTimeout = std::chrono::milliseconds(1000);
  src.dir = options_.persist.dir;
  src.env = options_.persist.env;
  return src;
}

EngineStats CheckpointEngine::stats() const {
  EngineStats s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = stats_;
  }
  s.snapshot = arena_->stats();
  return s;
}

}  // namespace checkpoint
}  // namespace sinew
