// The CUDA engine's on-device verification of a staged chunk: XXH3-64 (proto/xxh3_blocks.h)
// computed on the GPU, and the bytes copied into the destination only if it matches. Plain C++
// interface so the engine's host code needs no nvcc.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace gpulazy::client::cuda {

// Written by the kernel into VerifyJob::verdict (pinned host memory, read after the stream's
// event): kVerdictPending until the hash has been compared.
inline constexpr uint32_t kVerdictPending = 0;
inline constexpr uint32_t kVerdictMatches = 1;
inline constexpr uint32_t kVerdictMismatch = 2;

// Lengths the kernels verify: XXH3's long inputs (its short paths are not implemented).
inline constexpr uint64_t kMinVerifiedBytes = 241;

// Device scratch a chunk of `length` bytes needs for its block sums.
size_t BlockSumBytes(uint64_t length);

struct VerifyJob {
  const uint8_t* staged = nullptr;  // device memory, the chunk's bytes as copied
  uint8_t* destination = nullptr;   // device memory, untouched unless the hash matches
  uint64_t length = 0;              // >= kMinVerifiedBytes
  uint64_t expected = 0;            // Checksum64 the bytes must have
  const uint8_t* secret = nullptr;  // device memory, XXH3's 192-byte default secret
  uint64_t* block_sums = nullptr;   // device memory, BlockSumBytes(length)
  uint32_t* arrivals = nullptr;     // device memory, zero before (and after) the kernel
  uint32_t* verdict = nullptr;      // host memory mapped for the device
};

// Queues the kernel on `stream`: one launch per chunk (a launch costs the calling thread several
// microseconds, inside the restore's serialized engine calls). Errors are launch errors; the
// verdict says what the hash found.
cudaError_t LaunchVerifyAndInstall(const VerifyJob& job, cudaStream_t stream);

}  // namespace gpulazy::client::cuda
