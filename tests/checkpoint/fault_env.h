#pragma once

// An Env for tests (LevelDB's fault_injection_test): real files, plus
//  - failAfter(n): the n+1-th mutating operation and every later one throw IoError, as if
//    the process died there;
//  - crash(): what a power loss keeps: file bytes not fsynced are dropped, and creations,
//    renames and deletions not followed by an fsync of their folder are undone.

#include <sys/stat.h>
#include <unistd.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "sinew/base/error.h"
#include "sinew/checkpoint/env.h"

namespace sinew {
namespace checkpoint {
namespace testing {

class FaultEnv : public Env {
 public:
  void failAfter(int64_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    budget_ = n;
  }
  void clearFailure() { failAfter(-1); }
  int64_t opsDone() const { return ops_; }

  void crash() {
    std::lock_guard<std::mutex> lock(mu_);
    // Unsynced bytes first (the names still point at the new files), then folder entries.
    for (const auto& kv : synced_) {
      struct stat st;
      if (::stat(kv.first.c_str(), &st) == 0 && static_cast<uint64_t>(st.st_size) > kv.second) {
        if (::truncate(kv.first.c_str(), static_cast<off_t>(kv.second)) != 0) {
          SINEW_THROW(IoError, "truncate ", kv.first);
        }
      }
    }
    for (auto it = pending_.rbegin(); it != pending_.rend(); ++it) {
      const Pending& p = *it;
      if (p.kind == Pending::kCreate) {
        ::unlink(p.path.c_str());
      } else if (p.kind == Pending::kRename) {
        ::rename(p.path.c_str(), p.from.c_str());
        if (p.hadOld) writeRaw(p.path, p.old);
      } else if (p.kind == Pending::kRemove) {
        writeRaw(p.path, p.old);
      } else if (p.kind == Pending::kCreateDir) {
        ::rmdir(p.path.c_str());
      } else if (p.kind == Pending::kRemoveDir) {
        ::mkdir(p.path.c_str(), 0755);
      }
    }
    pending_.clear();
    synced_.clear();
    budget_ = -1;
  }

  std::unique_ptr<WritableFile> newWritableFile(const std::string& path) override {
    tick("create " + path);
    bool existed = base_->fileExists(path);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!existed) pending_.push_back({Pending::kCreate, path, "", false, ""});
      synced_[path] = 0;
    }
    return std::make_unique<File>(this, path, base_->newWritableFile(path));
  }
  std::unique_ptr<RandomAccessFile> newRandomAccessFile(const std::string& path) override {
    return base_->newRandomAccessFile(path);
  }
  void renameFile(const std::string& from, const std::string& to) override {
    tick("rename " + from);
    Pending p{Pending::kRename, to, from, base_->fileExists(to), ""};
    if (p.hadOld) p.old = base_->readFile(to);
    base_->renameFile(from, to);
    std::lock_guard<std::mutex> lock(mu_);
    // The synced size moves with the file.
    auto it = synced_.find(from);
    if (it != synced_.end()) {
      synced_[to] = it->second;
      synced_.erase(it);
    }
    pending_.push_back(p);
  }
  void syncDir(const std::string& dir) override {
    tick("syncdir " + dir);
    base_->syncDir(dir);
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<Pending> keep;
    for (auto& p : pending_) {
      if (parentDir(p.path) != dir) keep.push_back(p);
    }
    pending_.swap(keep);
  }
  void removeFile(const std::string& path) override {
    tick("remove " + path);
    Pending p{Pending::kRemove, path, "", true,
              base_->fileExists(path) ? base_->readFile(path) : ""};
    base_->removeFile(path);
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(p);
  }
  void removeDir(const std::string& dir) override {
    tick("rmdir " + dir);
    base_->removeDir(dir);
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back({Pending::kRemoveDir, dir, "", false, ""});
  }
  void createDir(const std::string& dir) override {
    tick("mkdir " + dir);
    bool existed = base_->fileExists(dir);
    base_->createDir(dir);
    std::lock_guard<std::mutex> lock(mu_);
    if (!existed) pending_.push_back({Pending::kCreateDir, dir, "", false, ""});
  }
  bool fileExists(const std::string& path) override { return base_->fileExists(path); }
  std::vector<std::string> listDir(const std::string& dir) override { return base_->listDir(dir); }

 private:
  struct Pending {
    enum Kind { kCreate, kRename, kRemove, kCreateDir, kRemoveDir } kind;
    std::string path;  // Created, renamed-to or removed path.
    std::string from;  // Rename source.
    bool hadOld;
    std::string old;  // Overwritten or removed content.
  };

  class File : public WritableFile {
   public:
    File(FaultEnv* env, std::string path, std::unique_ptr<WritableFile> base)
        : env_(env), path_(std::move(path)), base_(std::move(base)) {}
    void append(const void* data, size_t n) override {
      env_->tick("append " + path_);
      base_->append(data, n);
      size_ += n;
    }
    void sync() override {
      env_->tick("sync " + path_);
      base_->sync();
      std::lock_guard<std::mutex> lock(env_->mu_);
      env_->synced_[path_] = size_;
    }
    void close() override { base_->close(); }

   private:
    FaultEnv* const env_;  // The env outlives the files it opens (test scope).
    const std::string path_;
    std::unique_ptr<WritableFile> base_;
    uint64_t size_ = 0;
  };

  void tick(const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    ops_++;
    if (budget_ == 0) SINEW_THROW(IoError, "injected failure at ", what);
    if (budget_ > 0) budget_--;
  }

  // Restores a file, unless its folder's removal was made durable (then so was its own).
  static void writeRaw(const std::string& path, const std::string& data) {
    if (!posixEnv()->fileExists(parentDir(path))) return;
    auto f = posixEnv()->newWritableFile(path);
    f->append(data.data(), data.size());
    f->close();
  }

  Env* const base_ = posixEnv();
  std::mutex mu_;
  int64_t budget_ = -1;  // Guarded by mu_; -1: never fail.
  int64_t ops_ = 0;
  std::map<std::string, uint64_t> synced_;
  std::vector<Pending> pending_;
};

}  // namespace testing
}  // namespace checkpoint
}  // namespace sinew
