// XXH3-64 compiled for AVX2 (checksum_avx2.cc). Call only where the CPU runs AVX2: checksum.cc
// checks. Plain functions and C headers only: an inline C++ function instantiated in the AVX2
// file could be the copy the linker keeps for every caller, AVX2 instructions and all.
#pragma once

#include <stddef.h>
#include <stdint.h>

namespace gpulazy::checksum_internal {

uint64_t Avx2Hash(const void* bytes, size_t length);
void Avx2Reset(void* state);  // an XXH3_state_t
void Avx2Update(void* state, const void* bytes, size_t length);
uint64_t Avx2Digest(const void* state);

}  // namespace gpulazy::checksum_internal
