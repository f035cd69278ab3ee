#pragma once

// Internal: the few CUDA runtime calls Sinew makes outside the NCCL backend, in one place so
// that the rest builds without a CUDA toolkit (Sinew built without NCCL, SINEW_WITH_NCCL=0:
// every function here then says so with InvalidArgument, except cudaDeviceCount(), which is 0).

#include <string>

namespace sinew {
namespace collectives {

// GPUs this process can see (after CUDA_VISIBLE_DEVICES); 0 without CUDA or a driver.
int cudaDeviceCount();

// Makes `device` the calling thread's current CUDA device (cudaSetDevice).
void setCudaDevice(int device);

// A name of the GPU `device` that is the same in every process that sees it, whatever its
// index there: "GPU-" and the device's UUID in hex (as nvidia-smi -L prints it).
std::string cudaDeviceUuid(int device);

}  // namespace collectives
}  // namespace sinew
