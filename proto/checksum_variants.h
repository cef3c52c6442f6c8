// The XXH3-64 implementations Checksum64 may run on: the xxhash library as the distribution
// builds it (SSE2 on x86-64, the baseline every such CPU has) and, on x86-64, the same xxhash
// code compiled for AVX2 (checksum_avx2.cc), about twice as fast (docs/benchmarks.md). Each
// computes the same function; checksum.cc picks one per process. Internal to proto/; tests compare
// them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

namespace gpulazy::checksum_internal {

// `state` points at an XXH3_state_t (xxhash.h with XXH_STATIC_LINKING_ONLY): one layout for
// every variant, since all are built from the same header.
struct Xxh3Variant {
  std::string_view name;
  uint64_t (*hash)(const void* bytes, size_t length);
  void (*reset)(void* state);
  void (*update)(void* state, const void* bytes, size_t length);
  uint64_t (*digest)(const void* state);
};

const Xxh3Variant& LibraryXxh3();
// Null where not compiled in (not x86-64).
const Xxh3Variant* Avx2Xxh3();

// The variants this CPU can run, the library's first.
std::vector<const Xxh3Variant*> RunnableXxh3Variants();

// The one Checksum64 uses: AVX2 where the CPU (and the kernel, for the registers' state) has
// it, else the library. GPULAZY_XXH3=library in the environment forces the library (for A/B
// measurements).
const Xxh3Variant& SelectedXxh3();

}  // namespace gpulazy::checksum_internal
