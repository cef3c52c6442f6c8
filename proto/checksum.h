// Checksums and content digests of chunk bytes (XXH3). The checksum guards integrity end to end
// (image -> server -> client -> engine); the digest names content for deduplication.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace gpulazy {

using Digest128 = std::array<uint8_t, 16>;

uint64_t Checksum64(std::span<const uint8_t> bytes);
Digest128 ContentDigest(std::span<const uint8_t> bytes);
std::string DigestToString(const Digest128& digest);  // 32 hex digits
bool IsAllZero(std::span<const uint8_t> bytes);

inline std::span<const uint8_t> AsBytes(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

}  // namespace gpulazy
