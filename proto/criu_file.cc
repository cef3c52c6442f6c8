#include "proto/criu_file.h"

#include <fmt/format.h>

#include <set>

#include "proto/endian.h"

namespace gpulazy::criu_format {

void EncodeHeader(uint64_t payload_length, uint8_t out[kHeaderSize]) {
  StoreLe64(out, payload_length);
}

uint64_t DecodeHeader(const uint8_t in[kHeaderSize]) {
  return LoadLe64(in);
}

Result<criu::KfdProcess> ParseKfdProcess(std::span<const uint8_t> payload, std::string_view what) {
  if (payload.size() > static_cast<size_t>(INT32_MAX))
    return Corrupt("{}: {} bytes is too large for a KFD image", what, payload.size());
  criu::KfdProcess process;
  if (!process.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) {
    std::string missing = process.InitializationErrorString();
    return Corrupt("{}: not a valid criu_kfd message{}{}", what,
                   missing.empty() ? "" : "; missing ", missing);
  }
  if (process.bo_count() != static_cast<uint64_t>(process.bos_size()))
    return Corrupt("{}: num_of_bos says {} but the image holds {} BO entries", what,
                   process.bo_count(), process.bos_size());
  if (process.gpu_count() != static_cast<uint32_t>(process.devices_size()))
    return Corrupt("{}: num_of_gpus says {} but the image holds {} device entries", what,
                   process.gpu_count(), process.devices_size());
  return process;
}

Result<criu::RenderNode> ParseRenderNode(std::span<const uint8_t> payload, std::string_view what) {
  if (payload.size() > static_cast<size_t>(INT32_MAX))
    return Corrupt("{}: {} bytes is too large for a render-node image", what, payload.size());
  criu::RenderNode node;
  // Partial first: CRIU 4.x writes gpu_id alone, which full parsing would call incomplete.
  if (!node.ParsePartialFromArray(payload.data(), static_cast<int>(payload.size())))
    return Corrupt("{}: not a valid criu_render_node message", what);
  if (!node.has_gpu_id()) return Corrupt("{}: criu_render_node without gpu_id", what);
  const bool release_form = !node.has_file_id() && !node.has_drm_render_minor() &&
                            !node.has_bo_count() && node.bos_size() == 0;
  if (release_form) return node;
  if (!node.IsInitialized())
    return Corrupt("{}: incomplete criu_render_node message; missing {}", what,
                   node.InitializationErrorString());
  if (node.bo_count() != static_cast<uint64_t>(node.bos_size()))
    return Corrupt("{}: num_of_bos says {} but the image holds {} BO entries", what,
                   node.bo_count(), node.bos_size());
  std::set<uint32_t> handles;
  for (int i = 0; i < node.bos_size(); ++i) {
    const criu::RenderBo& bo = node.bos(i);
    if (bo.size() == 0) return Corrupt("{}: BO {} has size 0", what, i);
    if (!handles.insert(bo.handle()).second)
      return Corrupt("{}: BO {} repeats GEM handle {}", what, i, bo.handle());
    if (bo.mapping_count() != static_cast<uint32_t>(bo.mappings_size()))
      return Corrupt("{}: BO {} says {} VA mappings but holds {}", what, i, bo.mapping_count(),
                     bo.mappings_size());
    for (const criu::RenderBoMapping& m : bo.mappings()) {
      // offset_in_bo + size <= bo.size without overflow.
      if (m.size() == 0 || m.offset_in_bo() > bo.size() || m.size() > bo.size() - m.offset_in_bo())
        return Corrupt("{}: BO {} ({} bytes) has a VA mapping of {} bytes at offset {}", what, i,
                       bo.size(), m.size(), m.offset_in_bo());
      if (m.gpu_va() + m.size() < m.gpu_va())
        return Corrupt("{}: BO {} has a VA mapping that wraps around", what, i);
    }
  }
  return node;
}

Result<criu::DmabufNode> ParseDmabufNode(std::span<const uint8_t> payload, std::string_view what) {
  if (payload.size() > static_cast<size_t>(INT32_MAX))
    return Corrupt("{}: {} bytes is too large for a dmabuf image", what, payload.size());
  criu::DmabufNode node;
  if (!node.ParseFromArray(payload.data(), static_cast<int>(payload.size())))
    return Corrupt("{}: not a valid criu_dmabuf_node message", what);
  return node;
}

std::string KfdImageName(uint32_t file_id) {
  return fmt::format("amdgpu-kfd-{}.img", file_id);
}
std::string PagesImageName(uint32_t file_id, uint32_t gpu_id) {
  return fmt::format("amdgpu-pages-{}-{:04x}.img", file_id, gpu_id);
}
std::string RenderNodeImageName(uint32_t file_id) {
  return fmt::format("amdgpu-renderD-{}.img", file_id);
}
std::string DrmPagesImageName(uint32_t file_id, uint32_t render_minor, uint32_t bo_index) {
  return fmt::format("amdgpu-drm-pages-{}-{}-{:04x}.img", file_id, render_minor, bo_index);
}

}  // namespace gpulazy::criu_format
