#pragma once

// An Env over a map of path → bytes, for the checkpoint harness: no file system, no
// syscalls, and every missing file is an IoError as from posixEnv(). Folders exist
// implicitly when a file lies under them, or explicitly after createDir.
//
// Thread safety: none; one fuzzing thread uses it.

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "sinew/base/error.h"
#include "sinew/checkpoint/env.h"

namespace sinew {
namespace checkpoint {
namespace fuzzing {

class MemoryEnv : public Env {
 public:
  std::map<std::string, std::string>& files() { return files_; }

  // One process, no real files: the lock is a no-op.
  std::unique_ptr<FileLock> lockFile(const std::string&) override {
    return std::make_unique<FileLock>();
  }

  std::unique_ptr<WritableFile> newWritableFile(const std::string& path) override {
    files_[path].clear();
    return std::make_unique<File>(&files_[path]);
  }
  std::unique_ptr<RandomAccessFile> newRandomAccessFile(const std::string& path) override {
    auto it = files_.find(path);
    if (it == files_.end()) SINEW_THROW(IoError, "open ", path, ": No such file or directory");
    return std::make_unique<Reader>(path, it->second);
  }
  void renameFile(const std::string& from, const std::string& to) override {
    auto it = files_.find(from);
    if (it == files_.end()) SINEW_THROW(IoError, "rename ", from, ": No such file or directory");
    files_[to] = it->second;
    files_.erase(from);
  }
  void syncDir(const std::string&) override {}
  void removeFile(const std::string& path) override {
    if (files_.erase(path) == 0) SINEW_THROW(IoError, "unlink ", path, ": No such file");
  }
  void removeDir(const std::string& dir) override { dirs_.erase(dir); }
  void createDir(const std::string& dir) override { dirs_.insert(dir); }
  bool fileExists(const std::string& path) override {
    if (files_.count(path) != 0 || dirs_.count(path) != 0) return true;
    const std::string prefix = path + "/";
    auto it = files_.lower_bound(prefix);
    return it != files_.end() && it->first.compare(0, prefix.size(), prefix) == 0;
  }
  std::vector<std::string> listDir(const std::string& dir) override {
    const std::string prefix = dir + "/";
    std::set<std::string> names;
    auto add = [&](const std::string& path) {
      if (path.compare(0, prefix.size(), prefix) != 0 || path.size() == prefix.size()) return;
      names.insert(path.substr(prefix.size(), path.find('/', prefix.size()) - prefix.size()));
    };
    for (const auto& kv : files_) add(kv.first);
    for (const auto& d : dirs_) add(d);
    if (names.empty() && !fileExists(dir)) {
      SINEW_THROW(IoError, "opendir ", dir, ": No such file or directory");
    }
    return {names.begin(), names.end()};
  }

 private:
  class File : public WritableFile {
   public:
    explicit File(std::string* bytes) : bytes_(bytes) {}
    void append(const void* data, size_t n) override {
      bytes_->append(static_cast<const char*>(data), n);
    }
    void sync() override {}
    void close() override {}

   private:
    std::string* const bytes_;  // An entry of files_; the harness never erases it meanwhile.
  };
  class Reader : public RandomAccessFile {
   public:
    Reader(std::string path, std::string bytes)
        : path_(std::move(path)), bytes_(std::move(bytes)) {}
    uint64_t size() const override { return bytes_.size(); }
    void read(uint64_t offset, size_t n, void* dst) const override {
      if (offset > bytes_.size() || n > bytes_.size() - offset) {
        SINEW_THROW(IoError, "read ", path_, ": ", n, " bytes at ", offset, " past the end (",
                    bytes_.size(), " bytes)");
      }
      std::memcpy(dst, bytes_.data() + offset, n);
    }

   private:
    const std::string path_;
    const std::string bytes_;  // A copy: the file may be replaced while it is open.
  };

  std::map<std::string, std::string> files_;
  std::set<std::string> dirs_;
};

}  // namespace fuzzing
}  // namespace checkpoint
}  // namespace sinew
