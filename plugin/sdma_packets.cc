#include "plugin/sdma_packets.h"

namespace gpulazy::plugin {

namespace {
constexpr uint32_t kFamilyAi = 141;  // AMDGPU_FAMILY_AI (amdgpu_drm.h)
}

SdmaGeneration SdmaGenerationForFamily(uint32_t family_id) {
  return family_id >= kFamilyAi ? SdmaGeneration::kV4Plus : SdmaGeneration::kCikVi;
}

uint32_t SdmaHeader(uint32_t op, uint32_t sub_op) {
  return (op & 0xff) | ((sub_op & 0xff) << 8);
}

Status AppendLinearCopy(std::vector<uint32_t>& ib, SdmaGeneration gen, uint64_t src, uint64_t dst,
                        uint64_t bytes) {
  if (bytes == 0 || bytes > kSdmaMaxPacketBytes)
    return InvalidArgument("SDMA linear copy of {} bytes (1..{} per packet)", bytes,
                           kSdmaMaxPacketBytes);
  ib.push_back(SdmaHeader(kSdmaOpCopy, kSdmaSubOpCopyLinear));
  ib.push_back(static_cast<uint32_t>(gen == SdmaGeneration::kV4Plus ? bytes - 1 : bytes));
  ib.push_back(0);
  ib.push_back(static_cast<uint32_t>(src));
  ib.push_back(static_cast<uint32_t>(src >> 32));
  ib.push_back(static_cast<uint32_t>(dst));
  ib.push_back(static_cast<uint32_t>(dst >> 32));
  return Status::Ok();
}

void PadWithNops(std::vector<uint32_t>& ib) {
  while (ib.size() % kSdmaIbAlignDwords != 0)
    ib.push_back(SdmaHeader(kSdmaOpNop, 0));
}

Result<std::vector<uint32_t>> BuildCopyIb(SdmaGeneration gen, uint64_t src, uint64_t dst,
                                          uint64_t bytes) {
  if (bytes == 0) return InvalidArgument("SDMA copy of 0 bytes");
  std::vector<uint32_t> ib;
  ib.reserve((bytes / kSdmaMaxPacketBytes + 1) * kSdmaCopyPacketDwords + kSdmaIbAlignDwords);
  for (uint64_t done = 0; done < bytes;) {
    uint64_t n = std::min(bytes - done, kSdmaMaxPacketBytes);
    GPULAZY_RETURN_IF_ERROR(AppendLinearCopy(ib, gen, src + done, dst + done, n));
    done += n;
  }
  PadWithNops(ib);
  return ib;
}

Result<std::vector<DecodedCopy>> DecodeCopyIb(SdmaGeneration gen, const std::vector<uint32_t>& ib) {
  if (ib.empty() || ib.size() % kSdmaIbAlignDwords != 0)
    return Corrupt("IB of {} dwords is not a non-empty multiple of {}", ib.size(),
                   kSdmaIbAlignDwords);
  std::vector<DecodedCopy> copies;
  size_t i = 0;
  while (i < ib.size()) {
    uint32_t header = ib[i];
    if (header == SdmaHeader(kSdmaOpNop, 0)) {
      ++i;
      continue;
    }
    if (header != SdmaHeader(kSdmaOpCopy, kSdmaSubOpCopyLinear))
      return Corrupt("dword {}: header {:#x} is neither NOP nor COPY_LINEAR", i, header);
    if (i + kSdmaCopyPacketDwords > ib.size()) return Corrupt("dword {}: truncated packet", i);
    if (ib[i + 2] != 0) return Corrupt("dword {}: parameter dword {:#x} != 0", i + 2, ib[i + 2]);
    DecodedCopy c;
    c.bytes = gen == SdmaGeneration::kV4Plus ? uint64_t{ib[i + 1]} + 1 : ib[i + 1];
    c.src = ib[i + 3] | (uint64_t{ib[i + 4]} << 32);
    c.dst = ib[i + 5] | (uint64_t{ib[i + 6]} << 32);
    if (c.bytes == 0 || c.bytes > kSdmaMaxPacketBytes)
      return Corrupt("dword {}: copy of {} bytes", i, c.bytes);
    copies.push_back(c);
    i += kSdmaCopyPacketDwords;
  }
  return copies;
}

}  // namespace gpulazy::plugin
