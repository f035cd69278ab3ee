#include "sinew/collectives/file_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <thread>

#include "sinew/collectives/hash_store.h"

namespace sinew {
namespace collectives {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kMaxFileName = 240;

std::string errnoText(int err) { return std::strerror(err); }

void makeDirs(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) SINEW_THROW(IoError, "file store: cannot create directory ", dir, ": ", ec.message());
  if (!std::filesystem::is_directory(dir, ec)) {
    SINEW_THROW(IoError, "file store: ", dir, " is not a directory");
  }
}

// An exclusive flock on <dir>/.lock for the lifetime of the object. Each instance opens its
// own file description, so it also excludes other threads of this process.
class DirLock {
 public:
  explicit DirLock(const std::string& dir) {
    std::string path = dir + "/.lock";
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) SINEW_THROW(IoError, "file store: cannot open ", path, ": ", errnoText(errno));
    while (::flock(fd_, LOCK_EX) != 0) {
      if (errno != EINTR) {
        int err = errno;
        ::close(fd_);
        SINEW_THROW(IoError, "file store: cannot lock ", path, ": ", errnoText(err));
      }
    }
  }
  ~DirLock() { ::close(fd_); }  // Closing the description releases the flock.
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;

 private:
  int fd_ = -1;
};

void writeAll(int fd, const uint8_t* data, size_t n, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::write(fd, data, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      SINEW_THROW(IoError, "file store: cannot write ", path, ": ", errnoText(errno));
    }
    data += w;
    n -= static_cast<size_t>(w);
  }
}

}  // namespace

FileStore::FileStore(std::string dir, FileStoreOptions options)
    : dir_(std::move(dir)), options_(options) {
  if (dir_.empty()) SINEW_THROW(InvalidArgument, "FileStore: dir is empty");
  if (options_.pollInterval.count() <= 0) {
    SINEW_THROW(InvalidArgument, "FileStoreOptions::pollInterval = ", options_.pollInterval.count(),
                " ms must be positive");
  }
  makeDirs(dir_);
}

std::string FileStore::pathOf(const std::string& key) const {
  static const char* kHex = "0123456789ABCDEF";
  std::string name = "k_";
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '.' || c == '_' || c == '-') {
      name.push_back(static_cast<char>(c));
    } else {
      name.push_back('%');
      name.push_back(kHex[c >> 4]);
      name.push_back(kHex[c & 15]);
    }
  }
  if (name.size() > kMaxFileName) {
    SINEW_THROW(InvalidArgument, "file store key '", key.substr(0, 64), "...' is too long (",
                key.size(), " bytes escape to a ", name.size(), "-byte file name; at most ",
                kMaxFileName, ")");
  }
  return dir_ + "/" + name;
}

bool FileStore::read(const std::string& key, Bytes* value) const {
  std::string path = pathOf(key);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return false;
    SINEW_THROW(IoError, "file store: cannot open ", path, ": ", errnoText(errno));
  }
  value->clear();
  uint8_t buf[65536];
  while (true) {
    ssize_t r = ::read(fd, buf, sizeof(buf));
    if (r < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      SINEW_THROW(IoError, "file store: cannot read ", path, ": ", errnoText(err));
    }
    if (r == 0) break;
    value->insert(value->end(), buf, buf + r);
  }
  ::close(fd);
  return true;
}

void FileStore::write(const std::string& key, const Bytes& value) {
  static std::atomic<uint64_t> counter{0};
  std::string path = pathOf(key);
  std::string tmp =
      dir_ + "/.tmp." + std::to_string(::getpid()) + "." + std::to_string(counter.fetch_add(1));
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) SINEW_THROW(IoError, "file store: cannot create ", tmp, ": ", errnoText(errno));
  try {
    writeAll(fd, value.data(), value.size(), tmp);
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    SINEW_THROW(IoError, "file store: cannot rename ", tmp, " to ", path, ": ", errnoText(err));
  }
}

void FileStore::set(const std::string& key, const Bytes& value) {
  DirLock lock(dir_);
  write(key, value);
}

Bytes FileStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  wait({key}, timeout);  // As HashStore::get.
  Bytes value;
  if (!read(key, &value)) {
    SINEW_THROW(Timeout, "store key '", key, "' was deleted while waiting for it (file store ",
                dir_, ")");
  }
  return value;
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  DirLock lock(dir_);
  Bytes current;
  int64_t value = read(key, &current) ? parseStoreInteger(key, current) : 0;
  value += delta;
  write(key, toBytes(std::to_string(value)));
  return value;
}

Bytes FileStore::compareSet(const std::string& key, const Bytes& expected, const Bytes& desired) {
  DirLock lock(dir_);
  Bytes current;
  bool exists = read(key, &current);
  if ((!exists && expected.empty()) || (exists && current == expected)) {
    write(key, desired);
    return desired;
  }
  return exists ? current : Bytes();
}

void FileStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  auto sleep = std::chrono::milliseconds(1);
  while (!check(keys)) {
    if (Clock::now() >= deadline) {
      std::string missing;
      for (const auto& k : keys) {
        if (!check({k})) missing += (missing.empty() ? "" : ", ") + k;
      }
      SINEW_THROW(Timeout, "store wait timed out after ", timeout.count(),
                  " ms; missing keys: ", missing, " (file store ", dir_, ")");
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(sleep, deadline - Clock::now()));
    sleep = std::min(sleep * 2, options_.pollInterval);
  }
}

bool FileStore::check(const std::vector<std::string>& keys) {
  for (const auto& k : keys) {
    std::string path = pathOf(k);
    if (::access(path.c_str(), F_OK) != 0) return false;
  }
  return true;
}

bool FileStore::deleteKey(const std::string& key) {
  DirLock lock(dir_);
  std::string path = pathOf(key);
  if (::unlink(path.c_str()) == 0) return true;
  if (errno == ENOENT) return false;
  SINEW_THROW(IoError, "file store: cannot delete ", path, ": ", errnoText(errno));
}

}  // namespace collectives
}  // namespace sinew
