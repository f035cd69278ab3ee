#pragma once

// removeTree(): std::filesystem::remove_all for tests that link libtorch. libtorch 2.11 (the
// GPU machine's) exports its own copy of std::filesystem::remove_all, which wins symbol
// resolution over libstdc++'s in programs that list libtorch first and jumps to a null
// address (found on the GPU machine; docs/gpu.md). Sinew's library code does not call it.

#include <ftw.h>
#include <sys/stat.h>

#include <cstdio>
#include <string>

namespace sinew {
namespace testing {

inline void removeTree(const std::string& path) {
  ::nftw(
      path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); },
      16, FTW_DEPTH | FTW_PHYS);
}

}  // namespace testing
}  // namespace sinew
