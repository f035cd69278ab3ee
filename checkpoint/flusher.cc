#include "sinew/checkpoint/flusher.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "sinew/base/error.h"
#include "sinew/base/parse.h"

namespace sinew {
namespace checkpoint {
namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

void lowerThisThreadsPriority() {
  ::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 10);
}

int64_t parseStoredStep(const collectives::Bytes& b) {
  if (b.empty()) return -1;
  const std::string text = collectives::toString(b);
  const auto step = ::sinew::detail::tryParseInt(text);
  if (!step || *step < -1) {
    SINEW_THROW(Corruption, "checkpoint step in the store must be an integer >= -1, got '",
                text.substr(0, 80), "'");
  }
  return *step;
}

void advanceStoredStep(collectives::Store& store, const std::string& key, int64_t value) {
  for (;;) {
    collectives::Bytes cur = store.check({key}) ? store.get(key) : collectives::Bytes();
    if (parseStoredStep(cur) >= value) return;
    collectives::Bytes after =
        store.compareSet(key, cur, collectives::toBytes(std::to_string(value)));
    if (parseStoredStep(after) >= value) return;
  }
}

VersionFlusher::VersionFlusher(VersionFlusherOptions options) : options_(std::move(options)) {
  if (options_.persist.dir.empty()) {
    SINEW_THROW(InvalidArgument, "VersionFlusherOptions::persist.dir is empty (worker ",
                options_.self, ")");
  }
  if (options_.store == nullptr) {
    SINEW_THROW(InvalidArgument, "VersionFlusherOptions::store is null (worker ", options_.self,
                ")");
  }
  writer_ = std::make_unique<CheckpointWriter>(options_.persist);
  thread_ = std::thread([this] { loop(); });
}

VersionFlusher::~VersionFlusher() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::string VersionFlusher::recordKey(int64_t step, int worker) const {
  return options_.prefix + "/flush/" + std::to_string(step) + "/" + std::to_string(worker);
}

void VersionFlusher::reserve() {
  std::lock_guard<std::mutex> lock(mu_);
  outstanding_++;
}

void VersionFlusher::submit(std::shared_ptr<const HostShard> shard, FlushRole role, bool shared) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back({std::move(shard), std::move(role), shared});
  }
  cv_.notify_all();
}

void VersionFlusher::cancel() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    outstanding_--;
  }
  cv_.notify_all();
}

void VersionFlusher::fail(int64_t step, std::exception_ptr error, const std::string& verb,
                          const std::string& where) {
  if (options_.onFailed) options_.onFailed(step, verb, where, error);
  cancel();
}

int64_t VersionFlusher::outstanding() const {
  std::lock_guard<std::mutex> lock(mu_);
  return outstanding_;
}

void VersionFlusher::waitIdle() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return outstanding_ <= 0; });
}

int64_t VersionFlusher::flushed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return flushed_;
}

void VersionFlusher::loop() {
  if (options_.lowPriority) {
    lowerThisThreadsPriority();
  }
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // Stopping with nothing left to write.
    Job job = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    const auto t0 = Clock::now();
    std::exception_ptr error;
    bool superseded = false;
    try {
      if (options_.beforeWrite) options_.beforeWrite(job.shard->step);
      write(job);
    } catch (const StaleVersion& e) {
      superseded = true;
      if (options_.onSuperseded) {
        options_.onSuperseded(e.step(), e.newer(), e.what());
      } else {
        std::fprintf(stderr, "sinew checkpoint: worker %d: %s\n", options_.self, e.what());
      }
    } catch (...) {
      error = std::current_exception();
    }
    const double took = std::chrono::duration<double>(Clock::now() - t0).count();
    if (superseded) {
      // Neither written nor failed: a newer version is durable.
    } else if (!error) {
      if (options_.onFlushed) {
        options_.onFlushed({job.shard->step, job.role.how, took,
                            static_cast<int64_t>(job.shard->capacity()), job.shared});
      }
    } else if (options_.onFailed) {
      options_.onFailed(job.shard->step, "write", "'" + options_.persist.dir + "'", error);
    }
    lock.lock();
    if (!error && !superseded) flushed_++;
    outstanding_--;
    cv_.notify_all();
  }
}

void VersionFlusher::write(const Job& job) {
  const HostShard& shard = *job.shard;
  auto& store = *options_.store;
  if (job.role.how == FlushRole::How::kAlone) {
    writer_->flush({job.shard});
    advanceStoredStep(store, durableKey(), shard.step);
    return;
  }
  ShardFileRecord mine = writer_->writeShard(shard);
  if (job.role.how == FlushRole::How::kPost) {
    store.set(recordKey(shard.step, options_.self), collectives::toBytes(mine.toJson()));
    return;
  }
  std::vector<std::string> keys;
  for (int w : job.role.others) keys.push_back(recordKey(shard.step, w));
  // Polled, not one blocking wait: a writer that left before posting its record never will,
  // so the version cannot be completed; the flush then fails at once instead of waiting out
  // the deadline with the next versions queued behind it.
  const auto deadline = Clock::now() + options_.timeout;
  auto pause = kStorePollFirst;
  while (!store.check(keys)) {
    if (options_.gone) {
      for (size_t i = 0; i < keys.size(); ++i) {
        if (store.check({keys[i]})) continue;
        const std::string why = options_.gone(job.role.others[i]);
        if (!why.empty()) {
          SINEW_THROW(Aborted, "checkpoint ", shard.step, " is not durable: worker ",
                      job.role.others[i], ", one of its writers, ", why,
                      " before its shard of it arrived");
        }
      }
    }
    if (Clock::now() > deadline) {
      SINEW_THROW(Timeout, "checkpoint ", shard.step, ": the shards of its other writers did ",
                  "not all arrive within ", options_.timeout.count(), " ms");
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, kStorePollLast);
  }
  std::vector<ShardFileRecord> records = {mine};
  for (const std::string& k : keys) {
    records.push_back(
        ShardFileRecord::fromJson(collectives::toString(store.get(k, options_.timeout))));
  }
  try {
    writer_->commitVersion(shard.step, records);
  } catch (const StaleVersion&) {
    for (const std::string& k : keys) store.deleteKey(k);  // Nobody completes it now.
    throw;
  }
  advanceStoredStep(store, durableKey(), shard.step);
  for (const std::string& k : keys) store.deleteKey(k);
}

}  // namespace checkpoint
}  // namespace sinew
