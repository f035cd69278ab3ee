#include "sinew/base/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace sinew {
namespace detail {
namespace {

constexpr uint32_t kPoly = 0x82F63B78;  // CRC-32C, reflected.

struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t;
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
  }
};

const Tables& tables() {
  static const Tables kTables;
  return kTables;
}

#if defined(__x86_64__)
// Three interleaved streams of kStride bytes each: the crc32 instruction has a latency of 3
// cycles and a throughput of 1 per cycle, so one stream runs at a third of the speed the
// instruction allows. The streams' registers are joined with the linear map "append kStride
// zero bytes" (shift below), as Intel's white paper on fast CRC32C describes.
constexpr size_t kStride = 4096;

// The CRC register update is linear over GF(2): the register after data A||B from start r
// equals zeros(|B|)(register after A from r) xor (register after B from 0), where zeros(n)
// is the update over n zero bytes. shift applies zeros(kStride) with one table per byte.
struct Shift {
  std::array<std::array<uint32_t, 256>, 4> t;
  Shift() {
    const auto& t0 = tables().t[0];
    uint32_t column[32];
    for (int bit = 0; bit < 32; ++bit) {
      uint32_t c = uint32_t{1} << bit;
      for (size_t i = 0; i < kStride; ++i) c = (c >> 8) ^ t0[c & 0xFF];
      column[bit] = c;
    }
    for (int k = 0; k < 4; ++k) {
      for (uint32_t b = 0; b < 256; ++b) {
        uint32_t v = 0;
        for (int bit = 0; bit < 8; ++bit) {
          if (b & (1u << bit)) v ^= column[8 * k + bit];
        }
        t[k][b] = v;
      }
    }
  }
  uint32_t operator()(uint32_t c) const {
    return t[0][c & 0xFF] ^ t[1][(c >> 8) & 0xFF] ^ t[2][(c >> 16) & 0xFF] ^ t[3][c >> 24];
  }
};

const Shift& shift() {
  static const Shift kShift;
  return kShift;
}

__attribute__((target("sse4.2"))) uint32_t crc32cSse42(uint32_t crc, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t c = ~crc;
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7) != 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  if (n >= 3 * kStride) {
    const Shift& sh = shift();
    while (n >= 3 * kStride) {
      uint64_t c1 = 0, c2 = 0;
      for (size_t i = 0; i < kStride; i += 8) {
        uint64_t v0, v1, v2;
        std::memcpy(&v0, p + i, 8);
        std::memcpy(&v1, p + kStride + i, 8);
        std::memcpy(&v2, p + 2 * kStride + i, 8);
        c = _mm_crc32_u64(c, v0);
        c1 = _mm_crc32_u64(c1, v1);
        c2 = _mm_crc32_u64(c2, v2);
      }
      c = sh(sh(static_cast<uint32_t>(c)) ^ static_cast<uint32_t>(c1)) ^ static_cast<uint32_t>(c2);
      p += 3 * kStride;
      n -= 3 * kStride;
    }
  }
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  while (n > 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  return ~static_cast<uint32_t>(c);
}
#endif

}  // namespace

uint32_t crc32cPortable(uint32_t crc, const void* data, size_t n) {
  const auto& t = tables().t;
  const auto* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
  while (n >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;  // Little-endian hosts only (x86-64, aarch64).
    c = t[7][lo & 0xFF] ^ t[6][(lo >> 8) & 0xFF] ^ t[5][(lo >> 16) & 0xFF] ^ t[4][lo >> 24] ^
        t[3][hi & 0xFF] ^ t[2][(hi >> 8) & 0xFF] ^ t[1][(hi >> 16) & 0xFF] ^ t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n > 0) {
    c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFF];
    --n;
  }
  return ~c;
}

bool crc32cHardware() {
#if defined(__x86_64__)
  static const bool kHas = __builtin_cpu_supports("sse4.2");
  return kHas;
#else
  return false;
#endif
}

uint32_t crc32cExtend(uint32_t crc, const void* data, size_t n) {
#if defined(__x86_64__)
  if (crc32cHardware()) return crc32cSse42(crc, data, n);
#endif
  return crc32cPortable(crc, data, n);
}

}  // namespace detail
}  // namespace sinew
