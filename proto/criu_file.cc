#include "proto/criu_file.h"

#include <fmt/format.h>

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
  if (!node.ParseFromArray(payload.data(), static_cast<int>(payload.size())))
    return Corrupt("{}: not a valid criu_render_node message", what);
  if (node.bo_count() != static_cast<uint64_t>(node.bos_size()))
    return Corrupt("{}: num_of_bos says {} but the image holds {} BO entries", what,
                   node.bo_count(), node.bos_size());
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

}  // namespace gpulazy::criu_format
