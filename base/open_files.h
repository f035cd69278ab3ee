#pragma once

// The open-file limit a server process needs for its connection caps (issue: the caps of
// the coordinator, its rendezvous store and its control API exceed the usual soft limit of
// 1,024, which would be hit before any cap).
//
// Thread safety: setrlimit is process-wide; call while starting, before serving.

#include <cstdint>
#include <vector>

namespace sinew {

// Raises this process's soft limit on open files (RLIMIT_NOFILE) to `needed` where it is
// lower, up to the hard limit. Returns the soft limit in force afterwards.
int64_t raiseOpenFileLimit(int64_t needed);

// Connection caps that fit `limit` open files with `reserve` kept for everything else: each
// of `caps` scaled by (limit - reserve) / sum(caps) when their sum does not fit, at least 8
// each; unchanged when it fits.
std::vector<int64_t> capsWithin(const std::vector<int64_t>& caps, int64_t limit, int64_t reserve);

}  // namespace sinew
