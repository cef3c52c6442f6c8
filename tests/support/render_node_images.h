// Render-node images as criu-dev's amdgpu plugin writes them at dump (amdgpu_plugin_drm.c
// amdgpu_plugin_drm_dump_file): amdgpu-renderD-<id>.img (8-byte length + criu_render_node) and
// one amdgpu-drm-pages-<id>-<minor>-<bo %04x>.img per BO (8-byte length + the BO's bytes).
// For the plugin tests; contents are a pure function of the seed.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "proto/criu_amdgpu.pb.h"
#include "proto/criu_file.h"

namespace gpulazy::testing {

struct RenderBoSpec {
  uint64_t size = 4096;
  uint32_t domains = criu_format::kGemDomainVram;
  uint32_t handle = 1;
  uint64_t va = 0;  // 0: no GPU VA mapping (then upstream restores no contents)
  uint32_t is_import = 0;
};

inline criu::RenderNode MakeRenderNode(uint32_t file_id, uint32_t gpu_id, uint32_t minor,
                                       const std::vector<RenderBoSpec>& bos) {
  criu::RenderNode node;
  node.set_gpu_id(gpu_id);
  node.set_file_id(file_id);
  node.set_drm_render_minor(minor);
  node.set_bo_count(bos.size());
  for (const RenderBoSpec& spec : bos) {
    criu::RenderBo* bo = node.add_bos();
    bo->set_gpu_va(spec.va);
    bo->set_size(spec.size);
    bo->set_mmap_offset(0x10000000ull + spec.handle * 0x100000ull);
    bo->set_alloc_flags(0);
    bo->set_alignment(4096);
    bo->set_preferred_domains(spec.domains);
    bo->set_handle(spec.handle);
    bo->set_is_import(spec.is_import);
    bo->set_mapping_count(spec.va != 0 ? 1 : 0);
    if (spec.va != 0) {
      criu::RenderBoMapping* m = bo->add_mappings();
      m->set_gpu_va(spec.va);
      m->set_size(spec.size);
      m->set_offset_in_bo(0);
      m->set_flags(0xe);  // readable, writeable, executable
    }
  }
  return node;
}

// header + bytes, as upstream's write_img_file.
inline void WriteCriuFile(const std::filesystem::path& path, const std::string& bytes) {
  uint8_t header[criu_format::kHeaderSize];
  criu_format::EncodeHeader(bytes.size(), header);
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(header), sizeof(header));
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::vector<uint8_t> RenderBoBytes(uint64_t seed, uint32_t bo, uint64_t size) {
  std::mt19937_64 rng(seed * 1000003u + bo);
  std::vector<uint8_t> bytes(size);
  for (uint8_t& b : bytes)
    b = static_cast<uint8_t>(rng());
  return bytes;
}

// Writes the image and, as the dump does, a pages file for every BO. Returns each BO's bytes.
inline std::vector<std::vector<uint8_t>> WriteRenderNodeImages(const std::filesystem::path& dir,
                                                               const criu::RenderNode& node,
                                                               uint64_t seed) {
  WriteCriuFile(dir / criu_format::RenderNodeImageName(node.file_id()), node.SerializeAsString());
  std::vector<std::vector<uint8_t>> contents;
  for (int i = 0; i < node.bos_size(); ++i) {
    contents.push_back(RenderBoBytes(seed, static_cast<uint32_t>(i), node.bos(i).size()));
    const std::vector<uint8_t>& c = contents.back();
    WriteCriuFile(dir / criu_format::DrmPagesImageName(node.file_id(), node.drm_render_minor(),
                                                       static_cast<uint32_t>(i)),
                  std::string(c.begin(), c.end()));
  }
  return contents;
}

}  // namespace gpulazy::testing
