// The XXH3-64 entry points Checksum64 may run on. Debian's libxxhash is built for the x86-64
// baseline (SSE2): its plain XXH3_64bits never uses wider vectors. On x86-64 it also exports
// XXH3_64bits_dispatch / XXH3_64bits_update_dispatch (xxh_x86dispatch.h), which pick SSE2,
// AVX2 or AVX-512 by the CPU at run time: 2-3x faster where the CPU has them
// (docs/benchmarks.md). Both compute the same function; checksum.cc uses the dispatching ones
// where the library has them. Internal to proto/; tests and gpulazy-bench compare them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

namespace gpulazy::checksum_internal {

// What differs between them: the one-shot hash and the streaming update, the loops over whole
// stripes. A stream is reset and digested with the library's plain XXH3_64bits_reset and
// XXH3_64bits_digest whichever updates it (the digest hashes at most 256 buffered bytes).
// `state` points at the library's XXH3_state_t (xxhash.h with XXH_STATIC_LINKING_ONLY).
struct Xxh3Variant {
  std::string_view name;
  uint64_t (*hash)(const void* bytes, size_t length);
  void (*update)(void* state, const void* bytes, size_t length);
};

// The plain entry points (the build's baseline vectors).
const Xxh3Variant& LibraryXxh3();
// The library's run-time CPU dispatch; null where the library has none (not x86-64).
const Xxh3Variant* DispatchXxh3();

// The variants available, the plain library's first.
std::vector<const Xxh3Variant*> AvailableXxh3Variants();

// The one Checksum64 uses: the dispatching entry points where available, else the plain ones.
// GPULAZY_XXH3=library in the environment forces the plain ones (for A/B measurements).
const Xxh3Variant& SelectedXxh3();

}  // namespace gpulazy::checksum_internal
