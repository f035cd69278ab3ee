// The NCCL backend's choice of set-up from the members' announcements (docs/collectives.md,
// "NCCL: shrink and grow"): shrink, shrink with abort, grow, or a new communicator. The
// choice is made without NCCL, so it is tested here on every machine; the NCCL calls it leads
// to need several GPUs.

#include <gtest/gtest.h>

#include "sinew/collectives/nccl/membership.h"

namespace sinew {
namespace collectives {
namespace nccl_membership {
namespace {

const std::vector<int> kOld = {10, 11, 12, 13};

std::string held(bool healthy = true, int64_t epoch = 4, const std::vector<int>& m = kOld) {
  return announce(true, epoch, m, healthy);
}

TEST(NcclMembershipTest, AnnouncementsSayEpochMembersAndHealth) {
  EXPECT_EQ(announce(true, 4, kOld, true), "4 10,11,12,13 1");
  EXPECT_EQ(announce(true, 4, kOld, false), "4 10,11,12,13 0");
  EXPECT_EQ(announce(false, 4, kOld, true), "none");
}

TEST(NcclMembershipTest, SurvivorsThatAllHoldTheParentShrinkIt) {
  EXPECT_EQ(decide({held(), held(), held()}, {10, 11, 13}, 5, true, true), SetUp::kShrink);
  EXPECT_EQ(decide({held(), held()}, {11, 12}, 5, true, false), SetUp::kShrink);
  // A call that failed or was given up on at any survivor: shrink with NCCL_SHRINK_ABORT.
  EXPECT_EQ(decide({held(), held(false), held()}, {10, 11, 13}, 5, true, true),
            SetUp::kShrinkAbort);
}

TEST(NcclMembershipTest, AnythingElseAfterALossIsANewCommunicator) {
  // Without shrink in this NCCL.
  EXPECT_EQ(decide({held(), held(), held()}, {10, 11, 13}, 5, false, false), SetUp::kInit);
  // A survivor without the parent (restarted), or with another one.
  EXPECT_EQ(decide({held(), "none", held()}, {10, 11, 13}, 5, true, true), SetUp::kInit);
  EXPECT_EQ(decide({held(), held(true, 3), held()}, {10, 11, 13}, 5, true, true), SetUp::kInit);
  EXPECT_EQ(decide({held(), held(true, 4, {10, 11, 12, 14}), held()}, {10, 11, 13}, 5, true, true),
            SetUp::kInit);
  // The survivors in another order than the parent's.
  EXPECT_EQ(decide({held(), held(), held()}, {11, 10, 13}, 5, true, true), SetUp::kInit);
  // A loss and a join at once.
  EXPECT_EQ(decide({held(), held(), "none"}, {10, 11, 14}, 5, true, true), SetUp::kInit);
  // A parent that is not older than the new epoch.
  EXPECT_EQ(decide({held(), held(), held()}, {10, 11, 13}, 4, true, true), SetUp::kInit);
  // The same members again: nothing to shrink.
  EXPECT_EQ(decide({held(), held(), held(), held()}, kOld, 5, true, true), SetUp::kInit);
  // Nobody holds anything (the first epoch).
  EXPECT_EQ(decide({"none", "none"}, {10, 11}, 0, true, true), SetUp::kInit);
}

TEST(NcclMembershipTest, JoinersAfterTheParentsMembersGrowIt) {
  const std::vector<std::string> said = {held(), held(), held(), held(), "none", "none"};
  EXPECT_EQ(decide(said, {10, 11, 12, 13, 14, 15}, 5, true, true), SetUp::kGrow);
  // Not where this NCCL cannot grow, nor with anything outstanding on the parent.
  EXPECT_EQ(decide(said, {10, 11, 12, 13, 14, 15}, 5, true, false), SetUp::kInit);
  EXPECT_EQ(
      decide({held(), held(false), held(), held(), "none"}, {10, 11, 12, 13, 14}, 5, true, true),
      SetUp::kInit);
  // A joiner ranked among the old members, or one that claims a parent.
  EXPECT_EQ(decide({held(), "none", held(), held(), held()}, {10, 9, 11, 12, 13}, 5, true, true),
            SetUp::kInit);
  EXPECT_EQ(decide({held(), held(), held(), held(), held()}, {10, 11, 12, 13, 14}, 5, true, true),
            SetUp::kInit);
}

TEST(NcclMembershipTest, AnnouncementsThatDoNotParseMakeANewCommunicator) {
  for (const std::string bad : {"4 10,11,12,13", "x 10,11,12,13 1", "4 10,y,12,13 1",
                                "4 10,11,12,13 2", "4 10,11,12,13 1 extra", ""}) {
    EXPECT_EQ(decide({held(), bad, held()}, {10, 11, 13}, 5, true, true), SetUp::kInit) << bad;
  }
}

}  // namespace
}  // namespace nccl_membership
}  // namespace collectives
}  // namespace sinew
