// The block decomposition the CUDA engine verifies chunks with must give libxxhash's XXH3-64 of
// every input longer than 240 bytes, bit for bit.
#include "proto/xxh3_blocks.h"

#include <gtest/gtest.h>
#define XXH_STATIC_LINKING_ONLY  // XXH3_generateSecret_fromSeed
#include <xxhash.h>

#include <array>
#include <cstdint>
#include <random>
#include <vector>

#include "proto/checksum.h"

namespace gpulazy {
namespace {

std::array<uint8_t, xxh3::kSecretBytes> DefaultSecret() {
  std::array<uint8_t, xxh3::kSecretBytes> secret{};
  XXH3_generateSecret_fromSeed(secret.data(), 0);
  return secret;
}

std::vector<uint8_t> RandomBytes(size_t length, uint32_t seed) {
  std::mt19937_64 random(seed);
  std::vector<uint8_t> bytes(length + 8);
  for (uint8_t& b : bytes)
    b = static_cast<uint8_t>(random());
  return bytes;
}

TEST(Xxh3BlocksTest, EqualsTheLibraryAtEveryBoundary) {
  const auto secret = DefaultSecret();
  const std::vector<uint8_t> input = RandomBytes(size_t{5} << 20, 1);
  // Around the midsize limit, stripe and block edges, and chunk sizes the engine sees.
  std::vector<size_t> lengths;
  for (size_t base : {size_t{241}, size_t{256}, size_t{1024}, size_t{1088}, size_t{2048},
                      size_t{16} << 10, size_t{256} << 10, size_t{2} << 20, size_t{4} << 20})
    for (size_t delta : {size_t{0}, size_t{1}, size_t{63}, size_t{64}, size_t{65}})
      lengths.push_back(base + delta);
  for (size_t length = 241; length < 3200; length += 7)
    lengths.push_back(length);
  for (size_t length : lengths) {
    ASSERT_EQ(xxh3::Xxh3LongByBlocks(input.data(), length, secret.data()),
              XXH3_64bits(input.data(), length))
        << length << " bytes";
    ASSERT_EQ(xxh3::Xxh3LongByBlocks(input.data(), length, secret.data()),
              Checksum64({input.data(), length}))
        << length << " bytes";
  }
}

TEST(Xxh3BlocksTest, UnalignedInputsAndOtherContents) {
  const auto secret = DefaultSecret();
  for (uint32_t seed = 2; seed < 12; ++seed) {
    const std::vector<uint8_t> bytes = RandomBytes(70000, seed);
    const size_t offset = seed % 8;  // the engine's staging is aligned; the math must not care
    const size_t length = 241 + (seed * 6151) % 69000;
    EXPECT_EQ(xxh3::Xxh3LongByBlocks(bytes.data() + offset, length, secret.data()),
              XXH3_64bits(bytes.data() + offset, length))
        << length << " bytes at offset " << offset;
  }
  const std::vector<uint8_t> zeros(size_t{2} << 20, 0);
  EXPECT_EQ(xxh3::Xxh3LongByBlocks(zeros.data(), zeros.size(), secret.data()),
            XXH3_64bits(zeros.data(), zeros.size()));
}

TEST(Xxh3BlocksTest, OneFlippedBitChangesTheHash) {
  const auto secret = DefaultSecret();
  std::vector<uint8_t> bytes = RandomBytes(size_t{1} << 20, 99);
  const size_t length = size_t{1} << 20;
  const uint64_t clean = xxh3::Xxh3LongByBlocks(bytes.data(), length, secret.data());
  for (size_t at :
       {size_t{0}, size_t{1023}, size_t{1024}, length / 2 + 3, length - 65, length - 1}) {
    bytes[at] ^= 0x10;
    EXPECT_NE(xxh3::Xxh3LongByBlocks(bytes.data(), length, secret.data()), clean) << at;
    bytes[at] ^= 0x10;
  }
  EXPECT_EQ(xxh3::Xxh3LongByBlocks(bytes.data(), length, secret.data()), clean);
}

}  // namespace
}  // namespace gpulazy
