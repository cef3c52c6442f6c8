// Verifying a staged chunk in one kernel launch. XXH3's 1024-byte blocks are summed in parallel
// (proto/xxh3_blocks.h says why they may be): one warp per block, each thread loading 32
// contiguous bytes (half a stripe) and the half-stripes' sums meeting by shuffles. The thread
// block that finishes last (counted in `arrivals`, after a memory fence, the CUDA samples'
// threadFenceReduction pattern) then runs the sequential scramble chain over all the sums,
// eight threads, one lane each; one thread adds the tail, merges and compares; and only if the
// hash matches do its threads copy the staged bytes into the destination, so a bad copy never
// reaches it.
#include "page-client/cuda/verify_kernel.h"
#include "proto/xxh3_blocks.h"

namespace gpulazy::client::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kChainRound = 256;  // block sums the chain holds in shared memory at once (16 KiB)

// Every thread block: its share of the block sums.
__device__ void SumBlocks(const uint8_t* staged, size_t blocks, const uint8_t* secret,
                          uint64_t* sums) {
  const int lane_in_warp = static_cast<int>(threadIdx.x % 32);
  const size_t first_warp = (size_t{blockIdx.x} * kThreads + threadIdx.x) / 32;
  const size_t warps = size_t{gridDim.x} * kWarps;
  // This thread's half stripe in every block: stripe lane_in_warp / 2, words 4 * half...+4.
  const int stripe = lane_in_warp >> 1;
  const int half = lane_in_warp & 1;
  uint64_t keys[4];
  for (int k = 0; k < 4; ++k)
    keys[k] = xxh3::Read64(secret + 8 * stripe + 8 * (4 * half + k));
  for (size_t b = first_warp; b < blocks; b += warps) {
    // Staging slots start on a page, blocks on a KiB: these 32 bytes are 32-byte aligned.
    const auto* words = reinterpret_cast<const ulonglong2*>(
        staged + b * xxh3::kBlockBytes + stripe * xxh3::kStripeBytes + 32 * half);
    const ulonglong2 low = words[0];
    const ulonglong2 high = words[1];
    const uint64_t data[4] = {low.x, low.y, high.x, high.y};
    uint64_t sum[4] = {0, 0, 0, 0};
    xxh3::AddHalfStripe(data, keys, sum);
    // Threads of the same half (same parity) hold the same four lanes: add across stripes.
    for (int offset = 2; offset < 32; offset <<= 1)
      for (int k = 0; k < 4; ++k)
        sum[k] += __shfl_xor_sync(0xffffffffu, sum[k], offset);
    if (lane_in_warp < 2)
      for (int k = 0; k < 4; ++k)
        sums[b * xxh3::kLanes + 4 * half + k] = sum[k];
  }
}

__global__ void __launch_bounds__(kThreads) VerifyAndInstall(VerifyJob job) {
  __shared__ uint64_t secret_words[xxh3::kSecretBytes / 8];
  __shared__ uint64_t round_sums[kChainRound * xxh3::kLanes];
  __shared__ uint64_t lanes[xxh3::kLanes];
  __shared__ bool last_block;
  __shared__ bool matches;
  const int thread = static_cast<int>(threadIdx.x);
  const auto* secret = reinterpret_cast<const uint8_t*>(secret_words);
  if (thread < static_cast<int>(xxh3::kSecretBytes / 8))
    secret_words[thread] = reinterpret_cast<const uint64_t*>(job.secret)[thread];
  __syncthreads();

  const size_t blocks = xxh3::WholeBlocks(job.length);
  SumBlocks(job.staged, blocks, secret, job.block_sums);
  // This block's sums are visible device-wide before it counts itself in.
  __threadfence();
  __syncthreads();
  if (thread == 0) last_block = atomicAdd(job.arrivals, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!last_block) return;

  if (thread == 0) {
    uint64_t init[xxh3::kLanes];
    xxh3::InitLanes(init);
    for (int i = 0; i < static_cast<int>(xxh3::kLanes); ++i)
      lanes[i] = init[i];
  }
  for (size_t round = 0; round < blocks; round += kChainRound) {
    const size_t in_round = blocks - round < kChainRound ? blocks - round : kChainRound;
    __syncthreads();
    // Past L1 (__ldcg): other blocks wrote these.
    for (size_t i = thread; i < in_round * xxh3::kLanes; i += kThreads)
      round_sums[i] = __ldcg(reinterpret_cast<const unsigned long long*>(job.block_sums) +
                             round * xxh3::kLanes + i);
    __syncthreads();
    if (thread < static_cast<int>(xxh3::kLanes)) {
      uint64_t value = lanes[thread];
      for (size_t b = 0; b < in_round; ++b)
        value = xxh3::ScrambleLane(value + round_sums[b * xxh3::kLanes + thread], secret, thread);
      lanes[thread] = value;
    }
  }
  __syncthreads();
  if (thread == 0) {
    uint64_t acc[xxh3::kLanes];
    for (int i = 0; i < static_cast<int>(xxh3::kLanes); ++i)
      acc[i] = lanes[i];
    xxh3::AddTail(acc, job.staged, job.length, secret);
    matches = xxh3::Finish(acc, secret, job.length) == job.expected;
    *job.verdict = matches ? kVerdictMatches : kVerdictMismatch;
    *job.arrivals = 0;  // the slot's next chunk counts from zero (stream order)
  }
  __syncthreads();
  if (!matches) return;

  const uint8_t* staged = job.staged;
  uint8_t* destination = job.destination;
  size_t copied = 0;
  if (((reinterpret_cast<uintptr_t>(destination) | reinterpret_cast<uintptr_t>(staged)) & 15) ==
      0) {
    const size_t vectors = job.length / 16;
    const auto* from = reinterpret_cast<const uint4*>(staged);
    auto* to = reinterpret_cast<uint4*>(destination);
    for (size_t i = thread; i < vectors; i += kThreads)
      to[i] = from[i];
    copied = vectors * 16;
  }
  for (size_t i = copied + thread; i < job.length; i += kThreads)
    destination[i] = staged[i];
}

}  // namespace

size_t BlockSumBytes(uint64_t length) {
  return (length == 0 ? 1 : xxh3::WholeBlocks(length) + 1) * xxh3::kLanes * sizeof(uint64_t);
}

cudaError_t LaunchVerifyAndInstall(const VerifyJob& job, cudaStream_t stream) {
  if (job.length < kMinVerifiedBytes) return cudaErrorInvalidValue;
  const size_t blocks = xxh3::WholeBlocks(job.length);
  const unsigned grid = blocks == 0 ? 1 : static_cast<unsigned>((blocks + kWarps - 1) / kWarps);
  // A launch reports through the thread's last error, which may still hold an earlier call's
  // (a cleanup that failed and was ignored): clear it, or that one would fail this launch.
  (void)cudaGetLastError();
  VerifyAndInstall<<<grid, kThreads, 0, stream>>>(job);
  return cudaGetLastError();
}

}  // namespace gpulazy::client::cuda
