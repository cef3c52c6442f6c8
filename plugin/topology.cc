#include "plugin/topology.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <sstream>

namespace gpulazy::plugin {
namespace fs = std::filesystem;

uint64_t LocalGpu::Get(const std::string& key) const {
  auto it = properties.find(key);
  return it == properties.end() ? 0 : it->second;
}

namespace {

constexpr uint64_t kHeapFrameBufferPublic = 1;
constexpr uint64_t kHeapFrameBufferPrivate = 2;

// A sysfs `properties` file: "key value" lines.
Result<std::map<std::string, uint64_t>> ReadProperties(const fs::path& file) {
  std::ifstream in(file);
  if (!in) return Corrupt("{}: cannot read", file.string());
  std::map<std::string, uint64_t> out;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string key;
    uint64_t value = 0;
    if (words >> key >> value) out[key] = value;
  }
  return out;
}

// Sums the frame-buffer banks under node/mem_banks; a node without banks has no VRAM.
Status ReadVram(const fs::path& node, LocalGpu& gpu) {
  std::error_code ec;
  const fs::path banks = node / "mem_banks";
  if (!fs::is_directory(banks, ec)) return Status::Ok();
  for (const fs::directory_entry& bank : fs::directory_iterator(banks, ec)) {
    GPULAZY_ASSIGN_OR_RETURN(auto p, ReadProperties(bank.path() / "properties"));
    const uint64_t heap = p.count("heap_type") ? p["heap_type"] : 0;
    if (heap != kHeapFrameBufferPublic && heap != kHeapFrameBufferPrivate) continue;
    gpu.vram_size += p.count("size_in_bytes") ? p["size_in_bytes"] : 0;
    gpu.vram_public = gpu.vram_public || heap == kHeapFrameBufferPublic;
  }
  if (ec) return IoError("listing {}: {}", banks.string(), ec.message());
  return Status::Ok();
}

}  // namespace

// node/io_links/<m>/properties, by link number; a node without io_links has none.
Status ReadIoLinks(const fs::path& node, LocalGpu& gpu) {
  std::error_code ec;
  const fs::path links = node / "io_links";
  if (!fs::is_directory(links, ec)) return Status::Ok();
  std::map<uint32_t, IoLink> by_number;
  for (const fs::directory_entry& link : fs::directory_iterator(links, ec)) {
    const std::string name = link.path().filename().string();
    if (name.empty() || name.size() > 9 || !std::all_of(name.begin(), name.end(), ::isdigit))
      continue;
    GPULAZY_ASSIGN_OR_RETURN(auto p, ReadProperties(link.path() / "properties"));
    if (!p.count("type") || !p.count("node_to"))
      return Corrupt("{}/properties: an io link without type or node_to", link.path().string());
    by_number[static_cast<uint32_t>(std::stoul(name))] =
        IoLink{static_cast<uint32_t>(p["type"]), static_cast<uint32_t>(p["node_to"])};
  }
  if (ec) return IoError("listing {}: {}", links.string(), ec.message());
  for (const auto& [number, l] : by_number)
    gpu.io_links.push_back(l);
  return Status::Ok();
}

Result<std::vector<LocalGpu>> ReadTopology(const fs::path& root) {
  std::error_code ec;
  fs::path nodes = root / "nodes";
  if (!fs::is_directory(nodes, ec)) return NotFound("no KFD topology at {}", nodes.string());
  std::vector<LocalGpu> gpus;
  for (const fs::directory_entry& entry : fs::directory_iterator(nodes, ec)) {
    LocalGpu gpu;
    const std::string name = entry.path().filename().string();
    if (name.empty() || !std::all_of(name.begin(), name.end(), ::isdigit)) continue;
    gpu.node_id = static_cast<uint32_t>(std::stoul(name));
    std::ifstream id_file(entry.path() / "gpu_id");
    uint64_t id = 0;
    if (!(id_file >> id)) return Corrupt("{}: unreadable gpu_id", entry.path().string());
    if (id == 0) continue;  // a CPU node
    gpu.gpu_id = static_cast<uint32_t>(id);
    GPULAZY_ASSIGN_OR_RETURN(gpu.properties, ReadProperties(entry.path() / "properties"));
    GPULAZY_RETURN_IF_ERROR(ReadVram(entry.path(), gpu));
    GPULAZY_RETURN_IF_ERROR(ReadIoLinks(entry.path(), gpu));
    gpus.push_back(std::move(gpu));
  }
  if (ec) return IoError("listing {}: {}", nodes.string(), ec.message());
  std::sort(gpus.begin(), gpus.end(),
            [](const LocalGpu& a, const LocalGpu& b) { return a.node_id < b.node_id; });
  return gpus;
}

const std::vector<std::string>& TopologyChecks::Names() {
  static const std::vector<std::string> names = {"device_id", "compute", "sdma",
                                                 "queues",    "vram",    "firmware"};
  return names;
}

bool* TopologyChecks::Find(const std::string& name) {
  if (name == "device_id") return &device_id;
  if (name == "compute") return &compute;
  if (name == "sdma") return &sdma;
  if (name == "queues") return &queues;
  if (name == "vram") return &vram;
  if (name == "firmware") return &firmware;
  return nullptr;
}

std::string Incompatibility(const criu::KfdDevice& d, const LocalGpu& l,
                            const TopologyChecks& checks) {
  std::vector<std::string> why;
  auto equal = [&](const char* key, uint64_t want) {
    if (l.Get(key) != want) why.push_back(fmt::format("{} {:#x} != {:#x}", key, l.Get(key), want));
  };
  auto at_least = [&](const char* key, uint64_t want) {
    if (l.Get(key) < want) why.push_back(fmt::format("{} {} < {}", key, l.Get(key), want));
  };
  if (checks.device_id) {
    equal("device_id", d.device_id());
    equal("vendor_id", d.vendor_id());
  }
  if (checks.compute) {
    equal("simd_count", d.simd_count());
    equal("array_count", d.array_count());
    equal("cu_per_simd_array", d.cu_per_simd_array());
    equal("simd_per_cu", d.simd_per_cu());
    equal("max_waves_per_simd", d.max_waves_per_simd());
    equal("wave_front_size", d.wave_front_size());
    equal("lds_size_in_kb", d.lds_size_in_kb());
  }
  if (checks.sdma) {
    equal("num_sdma_engines", d.num_sdma_engines());
    equal("num_sdma_xgmi_engines", d.num_sdma_xgmi_engines());
    equal("num_sdma_queues_per_engine", d.num_sdma_queues_per_engine());
  }
  if (checks.queues) equal("num_cp_queues", d.num_cp_queues());
  if (checks.vram && l.vram_size < d.vram_size())
    why.push_back(fmt::format("vram_size {} < {}", l.vram_size, d.vram_size()));
  if (checks.firmware) {
    at_least("fw_version", d.fw_version());
    at_least("sdma_fw_version", d.sdma_fw_version());
  }
  std::string out;
  for (const std::string& w : why)
    out += (out.empty() ? "" : ", ") + w;
  return out;
}

namespace {

bool Assign(size_t i, const std::vector<std::vector<bool>>& ok, std::vector<int>& choice,
            std::vector<bool>& used) {
  if (i == ok.size()) return true;
  for (size_t j = 0; j < used.size(); ++j) {
    if (used[j] || !ok[i][j]) continue;
    used[j] = true;
    choice[i] = static_cast<int>(j);
    if (Assign(i + 1, ok, choice, used)) return true;
    used[j] = false;
  }
  return false;
}

}  // namespace

Result<GpuMapping> MapGpus(const std::vector<criu::KfdDevice>& checkpointed,
                           const std::vector<LocalGpu>& local, const TopologyChecks& checks) {
  if (checkpointed.size() > local.size())
    return InvalidArgument("checkpoint used {} GPU(s), this host has {}", checkpointed.size(),
                           local.size());
  std::vector<std::vector<bool>> ok(checkpointed.size(), std::vector<bool>(local.size()));
  std::string report;
  for (size_t i = 0; i < checkpointed.size(); ++i) {
    bool any = false;
    std::string reasons;
    for (size_t j = 0; j < local.size(); ++j) {
      std::string why = Incompatibility(checkpointed[i], local[j], checks);
      ok[i][j] = why.empty();
      any = any || ok[i][j];
      if (!why.empty())
        reasons +=
            fmt::format("; local gpu {:#x} (node {}): {}", local[j].gpu_id, local[j].node_id, why);
    }
    if (!any)
      report += fmt::format(
          "{}checkpointed gpu {:#x} (device_id {:#x}) has no compatible local "
          "GPU{}",
          report.empty() ? "" : " | ", checkpointed[i].gpu_id(), checkpointed[i].device_id(),
          reasons);
  }
  if (!report.empty()) return InvalidArgument("wrong topology: {}", report);
  std::vector<int> choice(checkpointed.size(), -1);
  std::vector<bool> used(local.size(), false);
  if (!Assign(0, ok, choice, used))
    return InvalidArgument(
        "wrong topology: the {} checkpointed GPUs cannot each get a distinct "
        "compatible local GPU",
        checkpointed.size());
  GpuMapping mapping;
  for (size_t i = 0; i < checkpointed.size(); ++i) {
    const LocalGpu& l = local[static_cast<size_t>(choice[i])];
    mapping.checkpoint_to_local[checkpointed[i].gpu_id()] = l.gpu_id;
    mapping.render_minor[l.gpu_id] = static_cast<uint32_t>(l.Get("drm_render_minor"));
  }
  return mapping;
}

Status WriteFakeTopology(const fs::path& root, const std::vector<criu::KfdDevice>& devices) {
  std::error_code ec;
  for (size_t i = 0; i < devices.size(); ++i) {
    const criu::KfdDevice& d = devices[i];
    fs::path node = root / "nodes" / std::to_string(i + 1);
    fs::create_directories(node, ec);
    if (ec) return IoError("creating {}: {}", node.string(), ec.message());
    std::ofstream(node / "gpu_id") << d.gpu_id() << "\n";
    // Every scalar of the device entry that sysfs has as a node property, by the same name.
    std::ofstream p(node / "properties");
    const auto* r = d.GetReflection();
    const auto* desc = d.GetDescriptor();
    for (int f = 0; f < desc->field_count(); ++f) {
      const auto* field = desc->field(f);
      const std::string& name = field->name();
      if (field->is_repeated() || name == "node_id" || name == "gpu_id" || name == "vram_size" ||
          name == "vram_public")
        continue;
      const uint64_t value = field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_UINT64
                                 ? r->GetUInt64(d, field)
                                 : r->GetUInt32(d, field);
      p << name << " " << value << "\n";
    }
    if (!p) return IoError("writing {}/properties", node.string());
    const std::pair<uint64_t, uint64_t> banks[] = {{kHeapFrameBufferPublic, d.vram_size()},
                                                   {0, 64ull << 30}};  // system memory
    for (size_t b = 0; b < std::size(banks); ++b) {
      fs::path bank = node / "mem_banks" / std::to_string(b);
      fs::create_directories(bank, ec);
      if (ec) return IoError("creating {}: {}", bank.string(), ec.message());
      std::ofstream(bank / "properties")
          << "heap_type " << banks[b].first << "\nsize_in_bytes " << banks[b].second
          << "\nflags 0\nwidth 4096\nmem_clk_max 1600\n";
    }
    for (int l = 0; l < d.links_size(); ++l) {
      fs::path link = node / "io_links" / std::to_string(l);
      fs::create_directories(link, ec);
      if (ec) return IoError("creating {}: {}", link.string(), ec.message());
      std::ofstream(link / "properties")
          << "type " << d.links(l).link_type() << "\nversion_major 0\nversion_minor 0\nnode_from "
          << i + 1 << "\nnode_to " << d.links(l).peer_node_id() << "\nweight 20\n";
    }
  }
  // A CPU node, as every real tree has one.
  fs::create_directories(root / "nodes" / "0", ec);
  std::ofstream(root / "nodes" / "0" / "gpu_id") << "0\n";
  return Status::Ok();
}

}  // namespace gpulazy::plugin
