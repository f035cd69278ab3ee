#pragma once

// A Store in a directory that every process can reach (a local or shared filesystem):
// the rendezvous of last resort when no TCP server is running, e.g. under srun with a
// shared scratch directory.
//
// Each key is a file (its name is the key with every byte outside [A-Za-z0-9._-] escaped
// as %XX). set writes a temporary file and renames it over the key, so readers never see a
// partial value; add, compareSet, set and delete hold an exclusive flock on "<dir>/.lock",
// which makes add and compareSet atomic across processes. Waits poll the directory, starting
// at 1 ms and backing off to pollInterval. Values are not fsynced: a rendezvous does not
// outlive its job.
//
// Thread safety: all methods are thread-safe, across threads and processes.

#include "sinew/base/error.h"
#include "sinew/store.h"

namespace sinew {
namespace collectives {

struct FileStoreOptions {
  // Longest sleep between two looks at the directory while waiting.
  std::chrono::milliseconds pollInterval{20};
};

class FileStore : public Store {
 public:
  // Creates dir (and its parents) if missing. Throws IoError naming the path on failure.
  explicit FileStore(std::string dir, FileStoreOptions options = FileStoreOptions());

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  Bytes compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  bool check(const std::vector<std::string>& keys) override;
  bool deleteKey(const std::string& key) override;
  using Store::get;
  using Store::wait;

  const std::string& dir() const { return dir_; }

 private:
  std::string pathOf(const std::string& key) const;
  // Reads key's file; returns false if it does not exist.
  bool read(const std::string& key, Bytes* value) const;
  // Writes key's file atomically. REQUIRES: the lock is held.
  void write(const std::string& key, const Bytes& value);

  const std::string dir_;
  const FileStoreOptions options_;
};

}  // namespace collectives
}  // namespace sinew
