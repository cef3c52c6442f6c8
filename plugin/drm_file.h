// DrmFile: the GEM ioctls that recreating a render-node file's buffer objects needs, on one
// open render node (/dev/dri/renderD<minor>), as upstream CRIU's amdgpu plugin issues them
// (plugins/amdgpu/amdgpu_plugin_drm.c, amdgpu_plugin_drm_restore_file): GEM_CREATE, then
// GEM_CHANGE_HANDLE to the handle the process knew, a dmabuf export to fill the contents,
// GEM_MMAP for the new mmap offset, GEM_VA to map the BO at its old GPU addresses.
// The real implementation (drm_file_real.cc) is compiled always and never run here (no AMD
// GPU); the fake (kfd_fake.cc) keeps the same contract with memfds as BOs.
//
// Contract (both implementations):
//   Create:       size > 0 and a multiple of 4 KiB, alignment 0 or a power of two, domains a
//                 non-empty subset of AMDGPU_GEM_DOMAIN_*; returns a fresh handle. -EINVAL else.
//   ChangeHandle: `handle` must exist and `new_handle` (non-zero) must be free; afterwards the
//                 BO answers to `new_handle` only. (DRM_IOCTL_GEM_CHANGE_HANDLE is new in the
//                 kernel: an older one answers -ENOTTY / -EINVAL.)
//   Export:       a dmabuf fd of the BO, owned by the caller (the BO lives on without it).
//   MmapOffset:   the offset to mmap the BO at through this file.
//   MapVa:        page-aligned VA and size, offset_in_bo + size <= the BO's size; the fake also
//                 refuses a range that overlaps one already mapped in this file.
//   Close:        drops a handle (used to undo a half-restored file).
//   errors:       -errno, as the ioctls return them.
// Does not own the render node's fd. Thread-safety: one DrmFile per thread.
#pragma once

#include <cstdint>
#include <memory>

#include "lazy-server/image/io.h"
#include "proto/status.h"

namespace gpulazy::plugin {

class DrmFile {
 public:
  virtual ~DrmFile() = default;
  virtual Result<uint32_t> Create(uint64_t size, uint64_t alignment, uint32_t domains,
                                  uint64_t domain_flags) = 0;
  virtual Status ChangeHandle(uint32_t handle, uint32_t new_handle) = 0;
  virtual Result<UniqueFd> Export(uint32_t handle) = 0;
  virtual Result<uint64_t> MmapOffset(uint32_t handle) = 0;
  virtual Status MapVa(uint32_t handle, uint64_t va, uint64_t offset_in_bo, uint64_t size,
                       uint64_t flags) = 0;
  virtual void Close(uint32_t handle) = 0;
};

// The real one: ioctls on `render_fd`.
std::unique_ptr<DrmFile> MakeRealDrmFile(int render_fd);

}  // namespace gpulazy::plugin
