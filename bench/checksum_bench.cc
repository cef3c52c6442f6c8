#include "bench/checksum_bench.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <random>
#include <span>
#include <vector>

#include "proto/checksum.h"
#include "proto/checksum_variants.h"

namespace gpulazy::bench {
namespace {

constexpr size_t kSlice = kChecksumSliceBytes;

// The read ceiling: every byte loaded once, nothing else done with it.
uint64_t XorWords(const uint8_t* bytes, size_t length) {
  uint64_t acc[4] = {0, 0, 0, 0};
  size_t i = 0;
  for (; i + 32 <= length; i += 32) {
    for (int lane = 0; lane < 4; ++lane) {
      uint64_t word;
      std::memcpy(&word, bytes + i + 8 * lane, sizeof word);
      acc[lane] ^= word;
    }
  }
  for (; i < length; ++i)
    acc[0] ^= bytes[i];
  return acc[0] ^ acc[1] ^ acc[2] ^ acc[3];
}

// Best of `rounds` passes of `pass` over `bytes` bytes, in bytes per second.
template <typename Pass>
double BestRate(uint32_t rounds, uint64_t bytes, Pass&& pass) {
  double best = 0;
  for (uint32_t r = 0; r < rounds; ++r) {
    const auto start = Clock::now();
    pass();
    best = std::max(best, static_cast<double>(bytes) / SecondsSince(start));
  }
  return best;
}

}  // namespace

Status RunChecksumBench(const CommonOptions& common, const ChecksumOptions& options) {
  if (options.memory_bytes < kSlice)
    return InvalidArgument("--memory {} is smaller than one {}-byte slice", options.memory_bytes,
                           kSlice);
  std::vector<uint8_t> memory(options.memory_bytes);
  std::mt19937_64 random(7);
  for (size_t i = 0; i + 8 <= memory.size(); i += 8) {
    const uint64_t word = random();
    std::memcpy(memory.data() + i, &word, sizeof word);
  }
  // Results feed `sink`, so no pass can be optimized away.
  volatile uint64_t sink = 0;
  const std::span<uint8_t> slice(memory.data(), kSlice);
  constexpr uint32_t kCachedPasses = 4096;  // 1 GiB of hashing in the cached case
  for (const checksum_internal::Xxh3Variant* variant : checksum_internal::AvailableXxh3Variants()) {
    struct Case {
      const char* name;
      uint64_t bytes;
      std::function<void()> hash;
      std::function<void()> read;
    };
    const Case cases[] = {
        {"cached_slice", uint64_t{kCachedPasses} * kSlice,
         [&] {
           for (uint32_t p = 0; p < kCachedPasses; ++p) {
             slice[p % kSlice] ^= 1;  // a new slice each pass, as after each receive
             sink = sink + variant->hash(slice.data(), slice.size());
           }
         },
         [&] {
           for (uint32_t p = 0; p < kCachedPasses; ++p) {
             slice[p % kSlice] ^= 1;
             sink = sink + XorWords(slice.data(), slice.size());
           }
         }},
        {"from_memory", memory.size() / kSlice * kSlice,
         [&] {
           for (size_t at = 0; at + kSlice <= memory.size(); at += kSlice)
             sink = sink + variant->hash(memory.data() + at, kSlice);
         },
         [&] { sink = sink + XorWords(memory.data(), memory.size() / kSlice * kSlice); }},
    };
    for (const Case& c : cases) {
      const double rate = BestRate(options.rounds, c.bytes, c.hash);
      const double ceiling = BestRate(options.rounds, c.bytes, c.read);
      Emit(common,
           nlohmann::json{{"bench", "checksum"},
                          {"variant", std::string(variant->name)},
                          {"selected", variant == &checksum_internal::SelectedXxh3()},
                          {"case", c.name},
                          {"slice_bytes", kSlice},
                          {"bytes", c.bytes},
                          {"throughput_Bps", rate},
                          {"ceiling_Bps", ceiling},
                          {"ratio", rate / ceiling},
                          {"machine", MachineDescription()}},
           {"bench", "variant", "case", "throughput_Bps", "ceiling_Bps", "ratio"});
    }
  }
  return Status::Ok();
}

}  // namespace gpulazy::bench
