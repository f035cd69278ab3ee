// The main() of every Sinew test binary: GoogleTest's, except that a run in which every test
// that ran was skipped (GTEST_SKIP, e.g. the GPU tests on a machine without a GPU) exits with
// kSkipped, which ctest reports as "Not Run (skipped)" instead of passed (SKIP_RETURN_CODE in
// tests/CMakeLists.txt). A run with a failure still fails; a run with one passing test passes.

#include <gtest/gtest.h>

namespace {
constexpr int kSkipped = 77;
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  const ::testing::UnitTest& unit = *::testing::UnitTest::GetInstance();
  if (rc == 0 && unit.successful_test_count() == 0 && unit.skipped_test_count() > 0) {
    return kSkipped;
  }
  return rc;
}
