// Checksums and content digests of chunk bytes (XXH3). The checksum guards integrity end to end
// (image -> server -> client -> engine); the digest names content for deduplication.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>

namespace gpulazy {

using Digest128 = std::array<uint8_t, 16>;

uint64_t Checksum64(std::span<const uint8_t> bytes);

// How much to receive or read before hashing it: small enough to still be in the cache when
// hashed, large enough that the calls per chunk stay few.
inline constexpr size_t kChecksumSliceBytes = 256u << 10;

// Checksum64 of bytes that arrive in pieces: hashing each piece right after it lands, while it
// is still in the cache, saves a second pass over memory. Equals Checksum64 of the pieces
// concatenated.
class Checksum64Stream {
 public:
  Checksum64Stream();
  ~Checksum64Stream();
  Checksum64Stream(Checksum64Stream&&) noexcept;
  Checksum64Stream& operator=(Checksum64Stream&&) noexcept;

  void Update(std::span<const uint8_t> bytes);
  uint64_t Digest() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};
Digest128 ContentDigest(std::span<const uint8_t> bytes);
std::string DigestToString(const Digest128& digest);  // 32 hex digits
bool IsAllZero(std::span<const uint8_t> bytes);

// Checksum64 of `length` zero bytes, what a CODEC_ZERO chunk of that raw length must carry:
// hashed once per length (an image's chunks come in one or a few lengths) and remembered, so a
// zero chunk is checked without a pass over bytes that are known. Any thread.
uint64_t ZeroChecksum64(uint64_t length);

inline std::span<const uint8_t> AsBytes(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

}  // namespace gpulazy
