// KFD topology: the local GPUs as /sys/class/kfd/kfd/topology/nodes/*/ describes them, and the
// mapping of checkpointed GPUs (KfdDevice entries of an amdgpu-kfd image) onto local ones, with
// upstream-like compatibility checks, each of which can be switched off.
// Thread-safety: plain data and pure functions.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "proto/criu_amdgpu.pb.h"
#include "proto/status.h"

namespace gpulazy::plugin {

// One io link of a node (nodes/<n>/io_links/<m>/properties): its type (KFD's
// CRAT_IOLINK_TYPE_*, e.g. 2 PCIe express, 11 XGMI) and the node it leads to.
struct IoLink {
  uint32_t type = 0;
  uint32_t node_to = 0;
};

struct LocalGpu {
  uint32_t node_id = 0;
  uint32_t gpu_id = 0;
  std::map<std::string, uint64_t> properties;  // the node's `properties` file, key -> value
  // From mem_banks/*/properties: the frame-buffer heaps (heap_type 1 public, 2 private), as
  // the thunk counts VRAM; the node's properties file has no VRAM size.
  uint64_t vram_size = 0;
  bool vram_public = false;                    // a public (CPU-visible) frame-buffer heap exists
  std::vector<IoLink> io_links;                // in link-number order
  uint64_t Get(const std::string& key) const;  // 0 when absent
};

// Reads root/nodes/<n>/{gpu_id,properties,mem_banks/<m>/properties,io_links/<m>/properties};
// nodes whose gpu_id is 0 are CPUs and skipped. A missing root is kNotFound ("no KFD topology at
// ...").
Result<std::vector<LocalGpu>> ReadTopology(const std::filesystem::path& root);

// Which properties must agree. Names are the config keys (check_<name>).
struct TopologyChecks {
  bool device_id = true;  // same ASIC (device_id, vendor_id)
  bool compute = true;    // simd_count, array_count, cu_per_simd_array, simd_per_cu, waves,
                          // wave_front_size, lds
  bool sdma = true;       // num_sdma_engines, num_sdma_xgmi_engines, num_sdma_queues_per_engine
  bool queues = true;     // num_cp_queues
  bool vram = true;       // local VRAM (frame-buffer mem_banks) >= checkpointed vram_size
  bool firmware = true;   // local fw_version, sdma_fw_version >= checkpointed

  static const std::vector<std::string>& Names();
  bool* Find(const std::string& name);
};

struct GpuMapping {
  std::map<uint32_t, uint32_t> checkpoint_to_local;  // gpu_id -> gpu_id
  std::map<uint32_t, uint32_t> render_minor;         // local gpu_id -> drm render minor
};

// Maps every checkpointed device to a distinct compatible local GPU (backtracking, so one
// early greedy choice cannot block a later device). Errors list, per unmatched device, why
// each local GPU was refused.
Result<GpuMapping> MapGpus(const std::vector<criu::KfdDevice>& checkpointed,
                           const std::vector<LocalGpu>& local, const TopologyChecks& checks);

// Why `local` cannot stand in for `device` ("" when it can).
std::string Incompatibility(const criu::KfdDevice& device, const LocalGpu& local,
                            const TopologyChecks& checks);

// Writes a fake topology tree describing `devices` (tests and demos): one node per device, its
// VRAM as one public frame-buffer bank plus a system-memory bank (which is not VRAM), its
// links as io_links as they stand (peer node ids are not renumbered).
Status WriteFakeTopology(const std::filesystem::path& root,
                         const std::vector<criu::KfdDevice>& devices);

}  // namespace gpulazy::plugin
