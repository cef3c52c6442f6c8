// SDMA linear-copy packets (design.md 5), as the kernel's sdma_v*_emit_copy_buffer writes them:
//   dw0 header: op COPY (1) in bits 0..7, sub-op LINEAR (0) in bits 8..15
//   dw1 count:  bytes - 1 on SDMA v4 and newer (family AI+: sdma_v4_0 .. v7_0 write
//               `byte_count - 1`); bytes on CIK / VI (cik_sdma, sdma_v2_4, sdma_v3_0 write
//               `byte_count`)
//   dw2 0 (endian swap / parameters)
//   dw3..4 source address lo, hi; dw5..6 destination address lo, hi
// An IB is padded with NOPs (header 0) to a multiple of 8 dwords. One packet moves at most
// 2 MiB here (kSdmaMaxPacketBytes, what CRIU's amdgpu plugin uses on AI+); longer copies are
// split. Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <vector>

#include "proto/status.h"

namespace gpulazy::plugin {

enum class SdmaGeneration {
  kCikVi,   // SDMA v2.x / v3.x: count = bytes
  kV4Plus,  // SDMA v4.x and newer (family AI and later): count = bytes - 1
};

// From libdrm's amdgpu_gpu_info.family_id: AMDGPU_FAMILY_AI (141) and later are v4+.
SdmaGeneration SdmaGenerationForFamily(uint32_t family_id);

inline constexpr uint32_t kSdmaOpNop = 0;
inline constexpr uint32_t kSdmaOpCopy = 1;
inline constexpr uint32_t kSdmaSubOpCopyLinear = 0;
inline constexpr uint32_t kSdmaCopyPacketDwords = 7;
inline constexpr uint32_t kSdmaIbAlignDwords = 8;
inline constexpr uint64_t kSdmaMaxPacketBytes = 2ull << 20;

uint32_t SdmaHeader(uint32_t op, uint32_t sub_op);

// Appends one linear-copy packet; bytes must be 1..kSdmaMaxPacketBytes.
Status AppendLinearCopy(std::vector<uint32_t>& ib, SdmaGeneration gen, uint64_t src, uint64_t dst,
                        uint64_t bytes);
// Pads with NOPs to a multiple of kSdmaIbAlignDwords.
void PadWithNops(std::vector<uint32_t>& ib);
// A whole IB copying `bytes` (> 0) from src to dst, split into packets, padded.
Result<std::vector<uint32_t>> BuildCopyIb(SdmaGeneration gen, uint64_t src, uint64_t dst,
                                          uint64_t bytes);

// The inverse, for tests and the fake device: one decoded copy.
struct DecodedCopy {
  uint64_t src = 0;
  uint64_t dst = 0;
  uint64_t bytes = 0;
};
// Checks alignment, NOP padding and every packet's header; returns the copies in order.
Result<std::vector<DecodedCopy>> DecodeCopyIb(SdmaGeneration gen, const std::vector<uint32_t>& ib);

}  // namespace gpulazy::plugin
