#pragma once

// CRC-32C (Castagnoli, the checksum of iSCSI, ext4 and LevelDB): SSE4.2's crc32
// instruction when the CPU has it, else table-driven slicing-by-8. Both give the same value;
// tests compare them and check the standard vectors ("123456789" → 0xE3069283).
//
// Thread safety: pure functions.

#include <cstddef>
#include <cstdint>

namespace sinew {
namespace detail {

// Extends crc (the value of earlier bytes; 0 to start) with n bytes at data.
uint32_t crc32cExtend(uint32_t crc, const void* data, size_t n);
inline uint32_t crc32c(const void* data, size_t n) { return crc32cExtend(0, data, n); }

// The portable implementation, exposed so tests can compare it with the hardware one.
uint32_t crc32cPortable(uint32_t crc, const void* data, size_t n);
// Whether crc32cExtend uses the SSE4.2 instruction on this CPU.
bool crc32cHardware();

}  // namespace detail
}  // namespace sinew
