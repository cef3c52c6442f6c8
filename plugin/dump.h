// Dump of one KFD file (DUMP_EXT_FILE): PROCESS_INFO -> CHECKPOINT -> contents -> UNPAUSE, then
// amdgpu-kfd-<id>.img and amdgpu-pages-<id>-<gpu>.img exactly as upstream CRIU writes them.
// Contents are read through the BO's dmabuf with pread (the fake KFD's memfds; on hardware this
// needs an SDMA read-back, which is not written yet: docs/criu.md).
#pragma once

#include <filesystem>

#include "plugin/kfd.h"

namespace gpulazy::plugin {

Status DumpKfdFile(Kfd& kfd, int id, const std::filesystem::path& image_dir);

}  // namespace gpulazy::plugin
