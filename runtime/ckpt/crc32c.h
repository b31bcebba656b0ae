// CRC-32C (Castagnoli), the checksum of checkpoint chunks: table-driven, 8 bytes per step.
// Pure function; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ft::ckpt {

// The CRC-32C of `len` bytes, continuing from `crc` (0 for a fresh checksum):
// crc32c(b, n2, crc32c(a, n1)) == crc32c of a followed by b. crc32c("123456789") == 0xE3069283.
uint32_t crc32c(const void* data, size_t len, uint32_t crc = 0);

}  // namespace ft::ckpt
