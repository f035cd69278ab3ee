#pragma once

// Internal to the Gloo backend: the element-wise sum its allreduces apply to received bytes
// (the ring's segments and the two-member lane's scratch), and which dtypes it can reduce.

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstddef>
#include <cstdint>

#include "sinew/base/error.h"

namespace sinew {
namespace collectives {
namespace gloo_backend {

// Blocks of a fixed 64 bytes' worth of elements, which the compiler turns into vector adds even
// at -O2 (its cheap cost model vectorises only loops with a known trip count and no aliasing),
// then the tail. Twice as fast as the plain loop on the allreduce bench's 16 MiB.
template <typename T>
void addInto(T* __restrict dst, const T* __restrict src, size_t n) {
  constexpr size_t kBlock = 64 / sizeof(T);
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    for (size_t k = 0; k < kBlock; ++k) dst[i + k] += src[i + k];
  }
  for (; i < n; ++i) dst[i] += src[i];
}

template <typename T>
void addIntoViaFloat(T* dst, const T* src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    dst[i] = static_cast<T>(static_cast<float>(dst[i]) + static_cast<float>(src[i]));
  }
}

inline void reduceSum(at::ScalarType type, void* dst, const void* src, size_t n) {
  switch (type) {
    case at::kFloat:
      return addInto(static_cast<float*>(dst), static_cast<const float*>(src), n);
    case at::kDouble:
      return addInto(static_cast<double*>(dst), static_cast<const double*>(src), n);
    case at::kLong:
      return addInto(static_cast<int64_t*>(dst), static_cast<const int64_t*>(src), n);
    case at::kHalf:
      return addIntoViaFloat(static_cast<c10::Half*>(dst), static_cast<const c10::Half*>(src), n);
    case at::kBFloat16:
      return addIntoViaFloat(static_cast<c10::BFloat16*>(dst),
                             static_cast<const c10::BFloat16*>(src), n);
    default:
      SINEW_THROW(InvalidArgument, "allreduce: unsupported dtype ", c10::toString(type));
  }
}

inline bool reducible(at::ScalarType t) {
  return t == at::kFloat || t == at::kDouble || t == at::kLong || t == at::kHalf ||
         t == at::kBFloat16;
}

}  // namespace gloo_backend
}  // namespace collectives
}  // namespace sinew
