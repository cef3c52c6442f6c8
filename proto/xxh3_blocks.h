// XXH3-64 (seed 0, the default secret) of inputs longer than 240 bytes, written so that the
// 1024-byte blocks can be summed in parallel: Checksum64 computed by a GPU (the CUDA engine's
// on-device verification) must equal libxxhash's, bit for bit.
//
// Why it parallelises: XXH3's long loop adds each 64-byte stripe's contribution into eight
// accumulator lanes and scrambles the lanes after every block of 16 stripes. A contribution
// depends on the input and the secret only, never on the accumulators, and additions commute, so
// a block's 16 stripes can be summed by many threads in any order; only the scramble between
// blocks is sequential, one step per KiB and lane. Xxh3LongByBlocks is that decomposition on
// the CPU (tests hold it against XXH3_64bits); the kernel does the same arithmetic with the same
// functions. The algorithm's constants and steps are those of the XXH3 specification
// (xxhash's doc/xxhash_spec.md); the secret comes from the library (XXH3_generateSecret_fromSeed
// with seed 0), not from a copy here.
//
// Header-only, C++17, and usable in CUDA device code (GPULAZY_HOST_DEVICE).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define GPULAZY_HOST_DEVICE __host__ __device__
#else
#define GPULAZY_HOST_DEVICE
#endif

namespace gpulazy::xxh3 {

inline constexpr size_t kSecretBytes = 192;
inline constexpr size_t kStripeBytes = 64;
inline constexpr size_t kStripesPerBlock = (kSecretBytes - kStripeBytes) / 8;  // 16
inline constexpr size_t kBlockBytes = kStripeBytes * kStripesPerBlock;         // 1024
inline constexpr size_t kLanes = 8;
// Inputs up to this length take XXH3's short paths, which this header does not implement.
inline constexpr size_t kMidsizeMax = 240;

inline constexpr uint64_t kPrime32_1 = 0x9E3779B1ULL;
inline constexpr uint64_t kPrime32_2 = 0x85EBCA77ULL;
inline constexpr uint64_t kPrime32_3 = 0xC2B2AE3DULL;
inline constexpr uint64_t kPrime64_1 = 0x9E3779B185EBCA87ULL;
inline constexpr uint64_t kPrime64_2 = 0xC2B2AE3D27D4EB4FULL;
inline constexpr uint64_t kPrime64_3 = 0x165667B19E3779F9ULL;
inline constexpr uint64_t kPrime64_4 = 0x85EBCA77C2B2AE63ULL;
inline constexpr uint64_t kPrime64_5 = 0x27D4EB2F165667C5ULL;

// Little-endian, any alignment (x86-64 and CUDA devices are little-endian).
GPULAZY_HOST_DEVICE inline uint64_t Read64(const uint8_t* p) {
  uint64_t v;
  memcpy(&v, p, sizeof v);
  return v;
}

GPULAZY_HOST_DEVICE inline void InitLanes(uint64_t acc[kLanes]) {
  acc[0] = kPrime32_3;
  acc[1] = kPrime64_1;
  acc[2] = kPrime64_2;
  acc[3] = kPrime64_3;
  acc[4] = kPrime64_4;
  acc[5] = kPrime32_2;
  acc[6] = kPrime64_5;
  acc[7] = kPrime32_1;
}

// Adds half a stripe's contribution: lanes [first, first + 4) of the stripe (first is 0 or 4),
// given its four input words and the four secret words they meet. sum[k] receives lane
// first + k's share; a stripe's lanes pair up (0,1), (2,3), ... so each half stays in itself.
GPULAZY_HOST_DEVICE inline void AddHalfStripe(const uint64_t data[4], const uint64_t key[4],
                                              uint64_t sum[4]) {
  for (int k = 0; k < 4; ++k) {
    const uint64_t mixed = data[k] ^ key[k];
    sum[k ^ 1] += data[k];
    sum[k] += (mixed & 0xFFFFFFFFULL) * (mixed >> 32);
  }
}

// A whole stripe at `stripe`, meeting the secret at `key`, into the eight lanes of `sum`.
GPULAZY_HOST_DEVICE inline void AddStripe(const uint8_t* stripe, const uint8_t* key,
                                          uint64_t sum[kLanes]) {
  for (int half = 0; half < 2; ++half) {
    uint64_t data[4];
    uint64_t keys[4];
    for (int k = 0; k < 4; ++k) {
      data[k] = Read64(stripe + 8 * (4 * half + k));
      keys[k] = Read64(key + 8 * (4 * half + k));
    }
    AddHalfStripe(data, keys, sum + 4 * half);
  }
}

// The step between blocks, one lane at a time (lanes are independent here).
GPULAZY_HOST_DEVICE inline uint64_t ScrambleLane(uint64_t lane_value, const uint8_t* secret,
                                                 int lane) {
  lane_value ^= lane_value >> 47;
  lane_value ^= Read64(secret + kSecretBytes - kStripeBytes + 8 * lane);
  return lane_value * kPrime32_1;
}

// After the last whole block: the stripes of the partial block, then the input's last 64
// bytes (which may overlap them), as XXH3 does.
GPULAZY_HOST_DEVICE inline void AddTail(uint64_t acc[kLanes], const uint8_t* input, size_t length,
                                        const uint8_t* secret) {
  const size_t whole_blocks = (length - 1) / kBlockBytes;
  const size_t stripes = ((length - 1) - kBlockBytes * whole_blocks) / kStripeBytes;
  const uint8_t* block = input + whole_blocks * kBlockBytes;
  for (size_t s = 0; s < stripes; ++s)
    AddStripe(block + s * kStripeBytes, secret + 8 * s, acc);
  AddStripe(input + length - kStripeBytes, secret + kSecretBytes - kStripeBytes - 7, acc);
}

GPULAZY_HOST_DEVICE inline uint64_t MulFold64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 product = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(product) ^ static_cast<uint64_t>(product >> 64);
#endif
}

// Merges the lanes into the hash of a `length`-byte input.
GPULAZY_HOST_DEVICE inline uint64_t Finish(const uint64_t acc[kLanes], const uint8_t* secret,
                                           uint64_t length) {
  uint64_t h = length * kPrime64_1;
  for (int i = 0; i < 4; ++i)
    h += MulFold64(acc[2 * i] ^ Read64(secret + 11 + 16 * i),
                   acc[2 * i + 1] ^ Read64(secret + 11 + 16 * i + 8));
  h ^= h >> 37;
  h *= 0x165667919E3779F9ULL;
  h ^= h >> 32;
  return h;
}

// Number of whole blocks whose sums feed the sequential scramble (the rest is AddTail's).
GPULAZY_HOST_DEVICE inline size_t WholeBlocks(size_t length) {
  return (length - 1) / kBlockBytes;
}

// XXH3-64 of `length` > kMidsizeMax bytes, block sums first, then the scramble chain: the
// order of the kernel, on one CPU thread.
inline uint64_t Xxh3LongByBlocks(const uint8_t* input, size_t length, const uint8_t* secret) {
  uint64_t acc[kLanes];
  InitLanes(acc);
  for (size_t b = 0; b < WholeBlocks(length); ++b) {
    uint64_t sum[kLanes] = {};
    // Stripes in reverse: the order inside a block must not matter.
    for (size_t s = kStripesPerBlock; s-- > 0;)
      AddStripe(input + b * kBlockBytes + s * kStripeBytes, secret + 8 * s, sum);
    for (int lane = 0; lane < static_cast<int>(kLanes); ++lane)
      acc[lane] = ScrambleLane(acc[lane] + sum[lane], secret, lane);
  }
  AddTail(acc, input, length, secret);
  return Finish(acc, secret, length);
}

}  // namespace gpulazy::xxh3
