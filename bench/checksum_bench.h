// `gpulazy-bench checksum`: how fast each XXH3 entry point (proto/checksum_variants.h)
// hashes chunk bytes, in 256 KiB slices as the client and the readers hash them: a slice just
// written (in the cache, the client's case) and a large buffer streamed from memory. The ceiling
// is one plain read pass over the same bytes (64-bit XOR), measured in the same run.
#pragma once

#include <cstdint>

#include "bench/harness.h"

namespace gpulazy::bench {

struct ChecksumOptions {
  uint64_t memory_bytes = 1ull << 30;  // the streamed-from-memory case
  uint32_t rounds = 5;                 // best of
};

Status RunChecksumBench(const CommonOptions& common, const ChecksumOptions& options);

}  // namespace gpulazy::bench
