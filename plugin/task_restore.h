// TaskRestorer: what runs inside a restored task (RESTORE_EXT_FILE, UPDATE_VMA_MAP). Per KFD
// file: read amdgpu-kfd-<id>.img, map its GPUs onto local ones, CRIU_OP RESTORE with device
// and BO buckets (metadata only), remember the new mmap offsets, then either hand the BO table
// and dmabuf fds to the master (parallel, lazy) or copy the contents here, one BO after another
// (eager, the baseline). Per render-node file (amdgpu-renderD-<id>.img): map its GPU the same
// way, answer with the very render-node file the KFD restore hands the driver for that GPU, and
// recreate the file's GEM objects with their contents, here and at once (not lazily).
// Thread-safety: CRIU calls these hooks from the task's one thread.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "plugin/config.h"
#include "plugin/device_engine.h"
#include "plugin/kfd.h"
#include "plugin/topology.h"

namespace gpulazy::plugin {

class TaskRestorer {
 public:
  // `engines` makes the engine an eager copy (and a render-node BO's contents) goes through,
  // per local GPU: SDMA on hardware, where a dmabuf cannot simply be written.
  TaskRestorer(const PluginConfig& config, KfdProvider& kfd, EngineFactory engines)
      : config_(config), kfd_(kfd), make_engine_(std::move(engines)) {}
  // The restored KFD fd, or for a render-node image a new fd of the render node (CRIU installs
  // it and closes ours); kNotFound when `id` is neither image (-ENOTSUP).
  // `image_dir` is a path that opens the image directory; `handoff` the task's end of the
  // master's socket (-1 in eager mode is fine).
  Result<int> RestoreFile(const std::filesystem::path& image_dir, int id, int handoff);
  // UPDATE_VMA_MAP, CRIU's contract (files-reg.c open_filemap, as upstream's amdgpu plugin
  // answers it): a mapping of /dev/kfd or /dev/dri/renderD* at (addr, old_pgoff) of a BO this
  // task restored gets the driver's new offset and answers 1; `plugin_fd` is then a dup of the
  // render node the BO was restored through (DRM only mmaps through that file; CRIU closes it)
  // or -1 for /dev/kfd (any KFD file of the process will do). 0: a KFD/DRM mapping that is no
  // restored BO (left as it is). kNotFound (-ENOTSUP): not a GPU device path.
  Result<int> UpdateVmaMap(const std::string& path, uint64_t addr, uint64_t old_pgoff,
                           uint64_t* new_pgoff, int* plugin_fd) const;

 private:
  Result<int> RestoreKfdImage(const std::filesystem::path& image_dir, uint32_t file_id,
                              const std::filesystem::path& image, int handoff);
  Status CopyEager(const std::filesystem::path& image_dir, uint32_t file_id,
                   std::vector<struct HandedBo>& bos);
  Result<int> RestoreRenderNode(const std::filesystem::path& image_dir, uint32_t file_id,
                                const std::filesystem::path& image);
  // The GPU mapping this task restores with: the first file restored fixes it (every KFD image
  // of one checkpoint lists the same devices), so the KFD and render-node files of a task agree
  // whichever CRIU restores first. `image` names the file in errors.
  Result<GpuMapping> MappingFrom(const std::vector<criu::KfdDevice>& devices,
                                 const std::string& image);
  Result<GpuMapping> MappingForRenderNode(const std::filesystem::path& image_dir,
                                          const std::string& image);
  Status RestoreRenderBos(const std::filesystem::path& image_dir, uint32_t file_id,
                          const std::string& name, const criu::RenderNode& node, uint32_t local_id,
                          DrmFile& drm);
  // The render node of local GPU `local_id`, opened once per task and shared by every file.
  Result<int> RenderFd(uint32_t local_id, uint32_t minor);

  const PluginConfig& config_;
  KfdProvider& kfd_;
  // Engines live only as long as one copy: they hold the dmabufs and, for SDMA, a device
  // handle, none of which may stay open in the restored task.
  EngineFactory make_engine_;
  std::vector<std::unique_ptr<Kfd>> files_;  // the driver's process state lives as long as these
  struct Remap {
    uint64_t new_pgoff;
    uint32_t local_gpu_id;
  };
  // By (VA, old mmap offset), both in bytes as CRIU keeps them; mappable BOs only.
  std::map<std::pair<uint64_t, uint64_t>, Remap> remaps_;
  // The render nodes the BOs were restored through, by local gpu id, open for UPDATE_VMA_MAP.
  std::map<uint32_t, UniqueFd> render_fds_;
  std::optional<GpuMapping> mapping_;
  std::map<uint32_t, std::string> mapped_devices_;          // gpu_id -> entry mapping_ covers
  std::map<uint32_t, std::unique_ptr<DrmFile>> drm_files_;  // by local gpu id
};

}  // namespace gpulazy::plugin
