// Synthetic CRIU amdgpu checkpoints for tests, demos and benchmarks: writes the files CRIU's
// amdgpu plugin would have written for `processes` ROCm processes on a node of `gpus` MI-class
// GPUs (design.md 4.1), with BO tables, topology and contents that look like a real inference
// job: incompressible weights, all-zero KV-cache pools (sparse on disk), compressible
// activations and ring buffers, weights shared between processes (so dedup matters), plus
// USERPTR and DOORBELL BOs that have no contents.
//
// Everything is a pure function of the options: the same seed gives byte-identical files.
//
// Sizes: every BO is a whole number of 4 KiB pages, like a real BO. total_bytes must be a
// multiple of 4 KiB (ValidateSynthOptions says so otherwise) and the content BOs of all
// processes sum to exactly total_bytes.
//
// Thread-safety: SynthesizeCheckpoint has no shared state; calls on different `out`
// directories may run concurrently.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "proto/status.h"

namespace gpulazy::image {

inline constexpr uint64_t kSynthPageSize = 4096;
inline constexpr uint32_t kSynthMaxGpus = 64;
inline constexpr uint32_t kSynthMaxProcesses = 256;
inline constexpr uint32_t kSynthMaxBos = 100000;

struct SynthOptions {
  std::filesystem::path out;  // created if missing; must not already hold a checkpoint
  uint32_t gpus = 2;          // GPUs of the node, 1..64; every process uses all of them
  uint32_t bos = 16;          // BOs per process, with and without contents
  uint64_t total_bytes = 0;   // content bytes over all processes, a multiple of 4 KiB
  uint64_t seed = 1;
  uint32_t processes = 1;  // one amdgpu-kfd-<id>.img each, file ids 1..processes
};

// What the contents of a content BO are made of.
enum class SynthContent {
  kWeights,       // incompressible (PRNG) bytes
  kZero,          // all zero, written as a sparse hole
  kCompressible,  // fp16-like activations in runs and ring-buffer records; LZ4 likes them
  kDuplicate,     // a copy of another BO's weights (a second replica of the same model)
  kPartialZero,   // compressible head, zero tail (a half-filled KV cache)
};
std::string_view SynthContentName(SynthContent content);

struct SynthReport {
  std::vector<std::string> files;             // names inside `out`, in the order written
  uint64_t content_bytes = 0;                 // equals options.total_bytes
  std::map<uint32_t, uint64_t> bytes_by_gpu;  // gpu_id -> content bytes over all processes
  std::vector<uint32_t> gpu_ids;              // in device order
  uint32_t vram_bos = 0;
  uint32_t gtt_bos = 0;
  uint32_t userptr_bos = 0;
  uint32_t doorbell_bos = 0;
  std::map<SynthContent, uint32_t> bos_by_content;
  std::map<SynthContent, uint64_t> bytes_by_content;
};

// Checks the options without touching the disk; errors name the option (--gpus, --size, ...).
Status ValidateSynthOptions(const SynthOptions& options);

Result<SynthReport> SynthesizeCheckpoint(const SynthOptions& options);

}  // namespace gpulazy::image
