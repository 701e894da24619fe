// CRC-32C (Castagnoli), the checksum of checkpoint shards. Software slicing-by-8, ~1 GB/s: a
// checkpoint is read once per load, so this never dominates.
#ifndef LOOM_STORAGE_CRC32C_H_
#define LOOM_STORAGE_CRC32C_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace loom::storage {

// Extends `crc` (0 to start) over `size` bytes.
uint32_t Crc32c(const void* data, size_t size, uint32_t crc = 0);

// Eight lowercase hex digits.
std::string Crc32cHex(uint32_t crc);
// Whether `text` is what Crc32cHex writes (a manifest's or an index's checksum, hostile input).
bool IsCrc32cHex(std::string_view text);

}  // namespace loom::storage

#endif  // LOOM_STORAGE_CRC32C_H_
