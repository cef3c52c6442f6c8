// Dump of one KFD file (DUMP_EXT_FILE): PROCESS_INFO -> CHECKPOINT -> contents -> UNPAUSE, then
// amdgpu-kfd-<id>.img and amdgpu-pages-<id>-<gpu>.img exactly as upstream CRIU writes them. The
// device entries describe the dumping host's GPUs from the KFD topology (sysfs), which restore
// compares with the target host's (topology.h).
// Contents are read back through the GPU's engine from `engines` (SDMA on hardware: a copy
// from the BO into a staging slot; the host engine's pread on the fake KFD's memfds).
#pragma once

#include <filesystem>

#include "plugin/device_engine.h"
#include "plugin/kfd.h"
#include "plugin/topology.h"

namespace gpulazy::plugin {

Status DumpKfdFile(Kfd& kfd, int id, const std::filesystem::path& image_dir,
                   const std::vector<LocalGpu>& topology, const EngineFactory& engines);

// Fills every scalar field of `device` from `gpu`: the sysfs property of the same name (the
// image's field names are sysfs's), node and gpu ids, VRAM from the memory banks, and the io
// links that lead to another GPU of `topology` (kfd_device_entry.iolinks, field 32).
void DescribeDevice(const LocalGpu& gpu, const std::vector<LocalGpu>& topology,
                    criu::KfdDevice* device);

}  // namespace gpulazy::plugin
