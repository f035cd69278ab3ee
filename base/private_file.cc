#include "sinew/base/private_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "sinew/base/error.h"

namespace sinew {
namespace detail {

void makePrivateDirs(const std::string& dir) {
  for (size_t slash = dir.find('/', 1); !dir.empty(); slash = dir.find('/', slash + 1)) {
    const std::string part = dir.substr(0, slash);
    if (::mkdir(part.c_str(), 0700) != 0 && errno != EEXIST) {
      SINEW_THROW(IoError, "cannot make the folder ", part, ": ", std::strerror(errno));
    }
    if (slash == std::string::npos) break;
  }
}

void writePrivateFile(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp-" + std::to_string(::getpid());
  // fchmod too: O_TRUNC of a leftover temporary file keeps its mode.
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0 || ::fchmod(fd, 0600) != 0) {
    const int e = errno;
    if (fd >= 0) ::close(fd);
    ::unlink(tmp.c_str());
    SINEW_THROW(IoError, "cannot create ", tmp, ": ", std::strerror(e));
  }
  const bool ok = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size()) &&
                  ::fsync(fd) == 0;
  int e = errno;
  ::close(fd);
  if (ok && ::rename(tmp.c_str(), path.c_str()) == 0) return;
  if (ok) e = errno;
  ::unlink(tmp.c_str());
  SINEW_THROW(IoError, "cannot write ", path, ": ", std::strerror(e));
}

}  // namespace detail
}  // namespace sinew
