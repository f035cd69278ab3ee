#include "sinew/checkpoint/env.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "sinew/base/error.h"

namespace sinew {
namespace checkpoint {
namespace {

[[noreturn]] void throwErrno(const char* op, const std::string& path) {
  int e = errno;
  SINEW_THROW(IoError, op, " ", path, ": ", std::strerror(e));
}

class PosixWritableFile : public WritableFile {
 public:
  PosixWritableFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~PosixWritableFile() override {
    if (fd_ >= 0) ::close(fd_);
  }
  void append(const void* data, size_t n) override {
    const auto* p = static_cast<const char*>(data);
    while (n > 0) {
      ssize_t w = ::write(fd_, p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        throwErrno("write", path_);
      }
      p += w;
      n -= static_cast<size_t>(w);
    }
  }
  void sync() override {
    if (::fdatasync(fd_) != 0) throwErrno("fdatasync", path_);
  }
  void close() override {
    if (fd_ >= 0) {
      int fd = fd_;
      fd_ = -1;
      if (::close(fd) != 0) throwErrno("close", path_);
    }
  }

 private:
  const std::string path_;
  int fd_;
};

class PosixRandomAccessFile : public RandomAccessFile {
 public:
  PosixRandomAccessFile(std::string path, int fd, uint64_t size)
      : path_(std::move(path)), fd_(fd), size_(size) {}
  ~PosixRandomAccessFile() override { ::close(fd_); }
  uint64_t size() const override { return size_; }
  void read(uint64_t offset, size_t n, void* dst) const override {
    auto* p = static_cast<char*>(dst);
    while (n > 0) {
      ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (r < 0) {
        if (errno == EINTR) continue;
        throwErrno("pread", path_);
      }
      if (r == 0) {
        SINEW_THROW(IoError, "read ", path_, ": file ends at ", offset, " with ", n,
                    " bytes still to read (file size ", size_, ")");
      }
      p += r;
      n -= static_cast<size_t>(r);
      offset += static_cast<uint64_t>(r);
    }
  }

 private:
  const std::string path_;
  const int fd_;
  const uint64_t size_;
};

class PosixEnv : public Env {
 public:
  std::unique_ptr<WritableFile> newWritableFile(const std::string& path) override {
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) throwErrno("open for writing", path);
    return std::make_unique<PosixWritableFile>(path, fd);
  }
  std::unique_ptr<RandomAccessFile> newRandomAccessFile(const std::string& path) override {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throwErrno("open for reading", path);
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      ::close(fd);
      throwErrno("fstat", path);
    }
    return std::make_unique<PosixRandomAccessFile>(path, fd, static_cast<uint64_t>(st.st_size));
  }
  void renameFile(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) throwErrno("rename to", from + " -> " + to);
  }
  void syncDir(const std::string& dir) override {
    int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) throwErrno("open directory", dir);
    int rc = ::fsync(fd);
    ::close(fd);
    if (rc != 0) throwErrno("fsync directory", dir);
  }
  void removeFile(const std::string& path) override {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) throwErrno("unlink", path);
  }
  void removeDir(const std::string& dir) override {
    if (::rmdir(dir.c_str()) != 0 && errno != ENOENT) throwErrno("rmdir", dir);
  }
  void createDir(const std::string& dir) override {
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) throwErrno("mkdir", dir);
  }
  bool fileExists(const std::string& path) override { return ::access(path.c_str(), F_OK) == 0; }
  std::vector<std::string> listDir(const std::string& dir) override {
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) throwErrno("opendir", dir);
    std::vector<std::string> out;
    while (struct dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name != "." && name != "..") out.push_back(name);
    }
    ::closedir(d);
    return out;
  }
};

}  // namespace

namespace {

class PosixFileLock : public Env::FileLock {
 public:
  explicit PosixFileLock(int fd) : fd_(fd) {}
  ~PosixFileLock() override { ::close(fd_); }  // Releases the flock.

 private:
  const int fd_;
};

}  // namespace

std::unique_ptr<Env::FileLock> Env::lockFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) throwErrno("open lock file", path);
  while (::flock(fd, LOCK_EX) != 0) {
    if (errno == EINTR) continue;
    const int e = errno;
    ::close(fd);
    errno = e;
    throwErrno("flock", path);
  }
  return std::make_unique<PosixFileLock>(fd);
}

std::string Env::readFile(const std::string& path) {
  auto f = newRandomAccessFile(path);
  std::string out(f->size(), '\0');
  if (!out.empty()) f->read(0, out.size(), &out[0]);
  return out;
}

void Env::writeFileDurably(const std::string& path, const std::string& data) {
  const std::string tmp = path + ".tmp";
  auto f = newWritableFile(tmp);
  f->append(data.data(), data.size());
  f->sync();
  f->close();
  renameFile(tmp, path);
  syncDir(parentDir(path));
}

Env* posixEnv() {
  static PosixEnv env;
  return &env;
}

std::string parentDir(const std::string& path) {
  auto pos = path.find_last_of('/');
  if (pos == std::string::npos) return ".";
  if (pos == 0) return "/";
  return path.substr(0, pos);
}

std::string joinPath(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  return dir.back() == '/' ? dir + name : dir + "/" + name;
}

}  // namespace checkpoint
}  // namespace sinew
