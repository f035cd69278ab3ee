#pragma once

// Little-endian integer fields of Sinew's wire formats (the TCP store, the coordinator
// protocol, checkpoint replication), independent of the host's byte order.
// Internal: included by .cc files only; not installed.

#include <cstdint>
#include <vector>

namespace sinew {
namespace detail {

// Writes the low `bytes` bytes of v to p, least significant first.
inline void storeLe(uint8_t* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

// Appends the low `bytes` bytes of v to b, least significant first.
inline void appendLe(std::vector<uint8_t>& b, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) b.push_back(static_cast<uint8_t>(v >> (8 * i)));
}

// Reads a `bytes`-byte little-endian unsigned integer from p.
inline uint64_t loadLe(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

}  // namespace detail
}  // namespace sinew
