#include "sinew/base/open_files.h"

#include <sys/resource.h>

#include <algorithm>
#include <numeric>

namespace sinew {

int64_t raiseOpenFileLimit(int64_t needed) {
  struct rlimit r {};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0) return needed;
  const auto wanted = static_cast<rlim_t>(std::max<int64_t>(needed, 0));
  if (r.rlim_cur != RLIM_INFINITY && r.rlim_cur < wanted) {
    const rlim_t raised = r.rlim_max == RLIM_INFINITY ? wanted : std::min(wanted, r.rlim_max);
    struct rlimit next = r;
    next.rlim_cur = raised;
    if (::setrlimit(RLIMIT_NOFILE, &next) == 0) r = next;
  }
  return r.rlim_cur == RLIM_INFINITY ? INT64_MAX : static_cast<int64_t>(r.rlim_cur);
}

std::vector<int64_t> capsWithin(const std::vector<int64_t>& caps, int64_t limit, int64_t reserve) {
  const int64_t sum = std::accumulate(caps.begin(), caps.end(), int64_t{0});
  const int64_t room = std::max<int64_t>(0, limit - reserve);
  if (sum <= room) return caps;
  std::vector<int64_t> out;
  for (int64_t c : caps) {
    out.push_back(
        std::max<int64_t>(8, static_cast<int64_t>(static_cast<__int128>(c) * room / sum)));
  }
  return out;
}

}  // namespace sinew
