// The error family (sinew/error.h): every type Sinew throws derives from sinew::Error, and
// SINEW_ENFORCE reports a broken invariant as InternalError naming the file and line.

#include <gtest/gtest.h>

#include <string>
#include <type_traits>

#include "sinew/base/error.h"
#include "sinew/error.h"

namespace sinew {
namespace {

template <typename... E>
constexpr bool allDeriveFromError() {
  return (std::is_base_of<Error, E>::value && ...);
}

TEST(ErrorTest, EveryErrorTypeDerivesFromSinewError) {
  static_assert(allDeriveFromError<PeerLost, Timeout, Aborted, InvalidArgument, Corruption, IoError,
                                   InternalError, Expelled, Released>(),
                "every Sinew error is a sinew::Error");
  static_assert(std::is_base_of<std::runtime_error, Error>::value, "");
  try {
    throw PeerLost(3, "worker 3 is gone");
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "worker 3 is gone");
  }
  PeerLost lost(5, "x");
  EXPECT_EQ(lost.worker(), 5);
}

TEST(ErrorTest, EnforceThrowsInternalErrorWithFileAndLine) {
  const int line = __LINE__ + 2;
  try {
    SINEW_ENFORCE(1 + 1 == 3, "arithmetic is broken: ", 42);
    FAIL() << "SINEW_ENFORCE of a false condition did not throw";
  } catch (const InternalError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("check failed: 1 + 1 == 3"), std::string::npos) << what;
    EXPECT_NE(what.find("arithmetic is broken: 42"), std::string::npos) << what;
    EXPECT_NE(what.find(std::string("error_test.cc:") + std::to_string(line) + "]"),
              std::string::npos)
        << what;
  }
  EXPECT_NO_THROW(SINEW_ENFORCE(true, "never"));
}

TEST(ErrorTest, ThrowNamesTheTypeAndLocation) {
  try {
    SINEW_THROW(InvalidArgument, "Options::x = ", -1, " must be positive");
    FAIL();
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("Options::x = -1 must be positive ["), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace sinew
