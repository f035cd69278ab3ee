#pragma once

// The file-system interface every checkpoint write and read goes through (LevelDB's Env),
// so tests can fail writes, crash between any two operations and drop data that was not
// fsynced (tests/checkpoint/fault_env.h). posixEnv() is the real one.
//
// Errors are reported as IoError naming the operation, the path and strerror(errno).
// Thread safety: Env methods may be called from any thread; a WritableFile or
// RandomAccessFile is used by one thread at a time.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace sinew {
namespace checkpoint {

class WritableFile {
 public:
  virtual ~WritableFile() = default;
  virtual void append(const void* data, size_t n) = 0;
  // Makes everything appended so far durable (fsync).
  virtual void sync() = 0;
  virtual void close() = 0;
};

class RandomAccessFile {
 public:
  virtual ~RandomAccessFile() = default;
  virtual uint64_t size() const = 0;
  // Reads exactly n bytes at offset into dst; IoError if the file is shorter.
  virtual void read(uint64_t offset, size_t n, void* dst) const = 0;
};

class Env {
 public:
  virtual ~Env() = default;
  // Creates or truncates path for writing.
  virtual std::unique_ptr<WritableFile> newWritableFile(const std::string& path) = 0;
  virtual std::unique_ptr<RandomAccessFile> newRandomAccessFile(const std::string& path) = 0;
  // Atomically replaces to with from (rename(2)); durable only after syncDir of its folder.
  virtual void renameFile(const std::string& from, const std::string& to) = 0;
  // fsyncs a directory, making creations, renames and deletions in it durable.
  virtual void syncDir(const std::string& dir) = 0;
  virtual void removeFile(const std::string& path) = 0;
  // Removes an empty directory.
  virtual void removeDir(const std::string& dir) = 0;
  // Creates dir (one level) if it does not exist.
  virtual void createDir(const std::string& dir) = 0;
  virtual bool fileExists(const std::string& path) = 0;
  // Names (not paths) of the entries of dir, without "." and "..".
  virtual std::vector<std::string> listDir(const std::string& dir) = 0;

  // Held until destroyed: an exclusive lock on a file (created if missing), across processes.
  class FileLock {
   public:
    virtual ~FileLock() = default;
  };
  // Blocks until this process holds the lock on path. The default uses flock(2) on the real
  // file system; an Env without files may override it.
  virtual std::unique_ptr<FileLock> lockFile(const std::string& path);

  // Whole-file helpers built on the above.
  std::string readFile(const std::string& path);
  // Writes data to path + ".tmp", fsyncs it, renames it to path and fsyncs the folder.
  void writeFileDurably(const std::string& path, const std::string& data);
};

// The POSIX file system. The object is stateless and lives for the whole program.
Env* posixEnv();

// "a/b" from "a/b/c"; "." when there is no slash.
std::string parentDir(const std::string& path);
std::string joinPath(const std::string& dir, const std::string& name);

}  // namespace checkpoint
}  // namespace sinew
