#pragma once

// SplitMix64's finalizer: a fixed, fast 64-bit mixing function, for everything that must be a
// pure function of (seed, index) on every worker: the samplers' orders, the layers' seeds.
// Internal: included by .cc files only; not installed.

#include <cstdint>

namespace sinew {
namespace detail {

inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

}  // namespace detail
}  // namespace sinew
