#pragma once

// Internal: how the next NCCL communicator of a name is set up from the one before (its
// parent), decided by rank 0 from every member's announcement (docs/collectives.md, "NCCL:
// shrink and grow"). No NCCL here, so that it is tested on machines without a GPU.

#include <cstdint>
#include <string>
#include <vector>

namespace sinew {
namespace collectives {
namespace nccl_membership {

enum class SetUp : uint8_t { kInit = 1, kShrink = 2, kShrinkAbort = 3, kGrow = 4 };

const char* setUpName(SetUp s);

// A member's announcement of its parent: "<epoch> <w>,<w>,... <healthy 0|1>", or "none".
std::string announce(bool holds, int64_t epoch, const std::vector<int>& members, bool healthy);

// The verdict for a communicator of epoch `epoch` and members `now` (worker ids, rank order),
// from `said` (each rank's announcement), where this NCCL can shrink and/or grow:
// - kShrink / kShrinkAbort: every member holds the same parent (same epoch, same members), of
//   an earlier epoch, and `now` is its member list without some, in order (ncclCommShrink
//   numbers the rest in order); kShrinkAbort when any member's parent had a call that failed or
//   was given up on (NCCL_SHRINK_ABORT ends what is still outstanding);
// - kGrow: the parent's members hold it, none with anything outstanding, and are the first
//   ranks of `now` in order; the others hold none (ncclCommGrow numbers joiners from the
//   parent's size up);
// - kInit otherwise (a fresh ncclCommInitRankConfig), including announcements that do not
//   parse.
SetUp decide(const std::vector<std::string>& said, const std::vector<int>& now, int64_t epoch,
             bool canShrink, bool canGrow);

}  // namespace nccl_membership
}  // namespace collectives
}  // namespace sinew
