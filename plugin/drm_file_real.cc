// The real DrmFile: GEM ioctls on a render node. Compiled always; never run on this project's
// machines (no AMD GPU): see docs/criu.md.
#include <amdgpu_drm.h>
#include <fcntl.h>
#include <sys/ioctl.h>

#include <cerrno>

#include "plugin/drm_file.h"

// DRM_IOCTL_GEM_CHANGE_HANDLE arrived with the kernel's CRIU support for render nodes, after
// the drm.h libdrm ships here; the layout is the kernel's (include/uapi/drm/drm.h).
#ifndef DRM_IOCTL_GEM_CHANGE_HANDLE
struct drm_gem_change_handle {
  __u32 handle;
  __u32 new_handle;
};
#define DRM_IOCTL_GEM_CHANGE_HANDLE DRM_IOWR(0xD2, struct drm_gem_change_handle)
#endif

namespace gpulazy::plugin {
namespace {

// As drmIoctl: restart on EINTR/EAGAIN; 0 or -errno.
int Ioctl(int fd, unsigned long request, void* arg) {
  int rc;
  do {
    rc = ::ioctl(fd, request, arg);
  } while (rc == -1 && (errno == EINTR || errno == EAGAIN));
  return rc == -1 ? -errno : 0;
}

class RealDrmFile : public DrmFile {
 public:
  explicit RealDrmFile(int fd) : fd_(fd) {}

  Result<uint32_t> Create(uint64_t size, uint64_t alignment, uint32_t domains,
                          uint64_t domain_flags) override {
    union drm_amdgpu_gem_create args {};
    args.in.bo_size = size;
    args.in.alignment = alignment;
    args.in.domains = domains;
    args.in.domain_flags = domain_flags;
    if (int rc = Ioctl(fd_, DRM_IOCTL_AMDGPU_GEM_CREATE, &args); rc != 0)
      return ErrnoError(-rc, "AMDGPU_GEM_CREATE of {} bytes in domains {:#x}", size, domains);
    return args.out.handle;
  }
  Status ChangeHandle(uint32_t handle, uint32_t new_handle) override {
    drm_gem_change_handle args{handle, new_handle};
    if (int rc = Ioctl(fd_, DRM_IOCTL_GEM_CHANGE_HANDLE, &args); rc != 0)
      return ErrnoError(-rc,
                        "GEM_CHANGE_HANDLE {} -> {} (the kernel needs DRM_IOCTL_GEM_CHANGE_HANDLE)",
                        handle, new_handle);
    return Status::Ok();
  }
  Result<UniqueFd> Export(uint32_t handle) override {
    drm_prime_handle args{};
    args.handle = handle;
    args.flags = DRM_CLOEXEC | DRM_RDWR;
    if (int rc = Ioctl(fd_, DRM_IOCTL_PRIME_HANDLE_TO_FD, &args); rc != 0)
      return ErrnoError(-rc, "PRIME_HANDLE_TO_FD of GEM handle {}", handle);
    return UniqueFd(args.fd);
  }
  Result<uint64_t> MmapOffset(uint32_t handle) override {
    union drm_amdgpu_gem_mmap args {};
    args.in.handle = handle;
    if (int rc = Ioctl(fd_, DRM_IOCTL_AMDGPU_GEM_MMAP, &args); rc != 0)
      return ErrnoError(-rc, "AMDGPU_GEM_MMAP of GEM handle {}", handle);
    return args.out.addr_ptr;
  }
  Status MapVa(uint32_t handle, uint64_t va, uint64_t offset_in_bo, uint64_t size,
               uint64_t flags) override {
    drm_amdgpu_gem_va args{};
    args.handle = handle;
    args.operation = AMDGPU_VA_OP_MAP;
    args.flags = static_cast<uint32_t>(flags);
    args.va_address = va;
    args.offset_in_bo = offset_in_bo;
    args.map_size = size;
    if (int rc = Ioctl(fd_, DRM_IOCTL_AMDGPU_GEM_VA, &args); rc != 0)
      return ErrnoError(-rc, "AMDGPU_GEM_VA map of GEM handle {} at {:#x} ({} bytes)", handle, va,
                        size);
    return Status::Ok();
  }
  void Close(uint32_t handle) override {
    drm_gem_close args{};
    args.handle = handle;
    (void)Ioctl(fd_, DRM_IOCTL_GEM_CLOSE, &args);
  }

 private:
  int fd_;
};

}  // namespace

std::unique_ptr<DrmFile> MakeRealDrmFile(int render_fd) {
  return std::make_unique<RealDrmFile>(render_fd);
}

}  // namespace gpulazy::plugin
