#include "sinew/collectives/cuda_device.h"

#include <cstdio>

#include "sinew/base/error.h"
#include "sinew/config.h"

#if SINEW_WITH_NCCL
#include <cuda_runtime_api.h>
#endif

namespace sinew {
namespace collectives {

#if SINEW_WITH_NCCL

int cudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // No driver or no device: not an error for later calls.
    return 0;
  }
  return n;
}

void setCudaDevice(int device) {
  cudaError_t e = cudaSetDevice(device);
  if (e != cudaSuccess) {
    SINEW_THROW(InvalidArgument, "cudaSetDevice(", device, "): ", cudaGetErrorString(e));
  }
}

std::string cudaDeviceUuid(int device) {
  cudaDeviceProp prop{};
  cudaError_t e = cudaGetDeviceProperties(&prop, device);
  if (e != cudaSuccess) {
    SINEW_THROW(InvalidArgument, "cudaGetDeviceProperties(", device, "): ", cudaGetErrorString(e));
  }
  const auto* b = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  char out[64];
  std::snprintf(out, sizeof(out),
                "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0],
                b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13],
                b[14], b[15]);
  return out;
}

#else

int cudaDeviceCount() { return 0; }

void setCudaDevice(int device) {
  SINEW_THROW(InvalidArgument, "CUDA device ", device,
              ": this Sinew was built without CUDA (SINEW_WITH_NCCL=OFF)");
}

std::string cudaDeviceUuid(int device) {
  SINEW_THROW(InvalidArgument, "CUDA device ", device,
              ": this Sinew was built without CUDA (SINEW_WITH_NCCL=OFF)");
}

#endif

}  // namespace collectives
}  // namespace sinew
