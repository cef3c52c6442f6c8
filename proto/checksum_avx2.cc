// xxhash's own XXH3 code, compiled into this file alone with -mavx2 (proto/CMakeLists.txt), so
// its AVX2 accumulate loop serves Checksum64 where the CPU has AVX2. The distribution's
// libxxhash is built for the x86-64 baseline (SSE2) and ships no run-time dispatch of its own.
// Includes no C++ library header (see checksum_avx2.h).
#include "proto/checksum_avx2.h"

#define XXH_INLINE_ALL  // every xxhash function private to this file, built with its flags
#include <xxhash.h>

#if !defined(__AVX2__)
#error "checksum_avx2.cc must be compiled with -mavx2"
#endif

namespace gpulazy::checksum_internal {

uint64_t Avx2Hash(const void* bytes, size_t length) {
  return XXH3_64bits(bytes, length);
}
void Avx2Reset(void* state) {
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state));
}
void Avx2Update(void* state, const void* bytes, size_t length) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state), bytes, length);
}
uint64_t Avx2Digest(const void* state) {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state));
}

}  // namespace gpulazy::checksum_internal
