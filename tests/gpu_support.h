#pragma once

// Tests that need a GPU skip, with the reason, where there is none (docs/gpu.md, "Tests").
// They run on a machine with a GPU and libtorch 2.x with CUDA (scripts/device-build.sh).

#include <ATen/Context.h>
#include <gtest/gtest.h>

#include <string>

#include "sinew/collectives/cuda_device.h"
#include "sinew/config.h"

namespace sinew {
namespace testing {

// Why this process cannot run CUDA tests, or "" when it can.
inline std::string noGpuReason() {
  if (!SINEW_WITH_NCCL) return "Sinew was built without the CUDA toolkit (SINEW_WITH_NCCL=OFF)";
  if (!at::hasCUDA()) {
    return "this libtorch has no CUDA (Debian's is CPU-only; see scripts/device-build.sh)";
  }
  if (collectives::cudaDeviceCount() == 0) return "no GPU is visible to this process";
  return "";
}

}  // namespace testing
}  // namespace sinew

#define SINEW_REQUIRE_GPU()                                          \
  do {                                                               \
    const std::string why_ = ::sinew::testing::noGpuReason();        \
    if (!why_.empty()) GTEST_SKIP() << "needs a CUDA GPU: " << why_; \
  } while (0)
