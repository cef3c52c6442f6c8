// The framing of CRIU amdgpu plugin image files: every file starts with an 8-byte
// little-endian length (CRIU writes a native size_t on x86-64) of what follows. For
// amdgpu-kfd-<id>.img what follows is a KfdProcess message; for amdgpu-pages-<id>-<gpu>.img
// it is the raw contents of the GPU's VRAM and GTT BOs, back to back. amdgpu-renderD-<id>.img
// holds a RenderNode message, and amdgpu-drm-pages-<id>-<minor>-<bo %04x>.img the raw
// contents of one render-node BO (criu-dev; the header says how many bytes follow).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "proto/criu_amdgpu.pb.h"
#include "proto/status.h"

namespace gpulazy::criu_format {

inline constexpr size_t kHeaderSize = 8;

// KFD alloc_flags bits (linux/kfd_ioctl.h KFD_IOC_ALLOC_MEM_FLAGS_*).
inline constexpr uint32_t kAllocVram = 1u << 0;
inline constexpr uint32_t kAllocGtt = 1u << 1;
inline constexpr uint32_t kAllocUserptr = 1u << 2;
inline constexpr uint32_t kAllocDoorbell = 1u << 3;
inline constexpr uint32_t kAllocMmioRemap = 1u << 4;
inline constexpr uint32_t kAllocWritable = 1u << 31;
inline constexpr uint32_t kAllocExecutable = 1u << 30;
inline constexpr uint32_t kAllocPublic = 1u << 29;

// Whether CRIU stores this BO's contents in the pages file (VRAM or GTT).
inline bool HasContents(uint32_t alloc_flags) {
  return (alloc_flags & (kAllocVram | kAllocGtt)) != 0;
}

void EncodeHeader(uint64_t payload_length, uint8_t out[kHeaderSize]);
uint64_t DecodeHeader(const uint8_t in[kHeaderSize]);

// Parses the payload of an amdgpu-kfd image (the bytes after the header). `what` names the
// file in errors. Checks the counts the message carries against its repeated fields.
Result<criu::KfdProcess> ParseKfdProcess(std::span<const uint8_t> payload, std::string_view what);
// A render-node image: either CRIU 4.x's form (gpu_id alone; no BOs) or criu-dev's whole
// message, whose BO table is checked (counts, non-zero sizes, distinct handles, every VA
// mapping inside its BO).
Result<criu::RenderNode> ParseRenderNode(std::span<const uint8_t> payload, std::string_view what);
Result<criu::DmabufNode> ParseDmabufNode(std::span<const uint8_t> payload, std::string_view what);

// AMDGPU_GEM_DOMAIN_* (drm/amdgpu_drm.h): upstream saves and restores the contents of
// render-node BOs in these domains.
inline constexpr uint32_t kGemDomainGtt = 0x2;
inline constexpr uint32_t kGemDomainVram = 0x4;

// File names, as CRIU's amdgpu plugin makes them.
std::string KfdImageName(uint32_t file_id);                     // amdgpu-kfd-<id>.img
std::string PagesImageName(uint32_t file_id, uint32_t gpu_id);  // amdgpu-pages-<id>-<gpu %04x>.img
std::string RenderNodeImageName(uint32_t file_id);              // amdgpu-renderD-<id>.img
// amdgpu-drm-pages-<id>-<minor>-<bo %04x>.img (minor: the render minor at dump).
std::string DrmPagesImageName(uint32_t file_id, uint32_t render_minor, uint32_t bo_index);

}  // namespace gpulazy::criu_format
