// Kfd: the one wrapper around /dev/kfd's CRIU ioctl (AMDKFD_IOC_CRIU_OP, linux/kfd_ioctl.h).
// The rest of the plugin talks to this interface; the real implementation issues the ioctls
// (compiled always, never run here: no AMD GPU), the fake (kfd_fake.cc) enforces the driver's
// contract so the plugin's logic is tested without one.
//
// Contract (both implementations, and what the plugin relies on):
//   dump:    PROCESS_INFO (pauses the queues; returns num_devices, num_bos, num_objects,
//            priv_data_size) -> CHECKPOINT (fills device buckets, BO buckets with a dmabuf fd
//            per VRAM/GTT BO, and priv_data) -> UNPAUSE. CHECKPOINT or UNPAUSE before
//            PROCESS_INFO is -EINVAL.
//   restore: RESTORE once per KFD file, in the restored task, with device buckets
//            (user_gpu_id = checkpointed, actual_gpu_id = local, drm_fd = render node),
//            BO buckets (as checkpointed) and the checkpoint's priv_data; returns per BO the
//            restored mmap offset and a dmabuf fd (VRAM/GTT; KFD_INVALID_FD otherwise), owned by
//            the caller. Then RESUME with the task's pid, from any process (CRIU's master).
//   errors:  -errno, as the ioctl returns them.
// Thread-safety: one Kfd per thread.
#pragma once

#include <linux/kfd_ioctl.h>

#include <cstdint>
#include <memory>
#include <string>

#include "lazy-server/image/io.h"
#include "plugin/drm_file.h"
#include "proto/status.h"

namespace gpulazy::plugin {

inline constexpr uint32_t kKfdInvalidFd = 0xffffffffu;

class Kfd {
 public:
  virtual ~Kfd() = default;
  // The KFD file this object drives (the fd CRIU installs in the restored task).
  virtual int fd() const = 0;
  // AMDKFD_IOC_CRIU_OP: 0 or -errno. `args` is in/out exactly as the ioctl's.
  virtual int CriuOp(kfd_ioctl_criu_args& args) = 0;
};

class KfdProvider {
 public:
  virtual ~KfdProvider() = default;
  virtual std::string_view name() const = 0;
  // Opens a new KFD file (restore; RESUME from the master).
  virtual Result<std::unique_ptr<Kfd>> Open() = 0;
  // Drives an existing KFD fd (dump: CRIU hands us the dumped task's fd). Does not own it.
  virtual Result<std::unique_ptr<Kfd>> Attach(int fd) = 0;
  // Whether `fd` is a KFD file (dump decides by this whether a file is ours).
  virtual bool IsKfd(int fd) const = 0;
  // Whether `path` (of a mapping, UPDATE_VMA_MAP) is the KFD device node.
  virtual bool IsKfdPath(const std::string& path) const = 0;
  // Opens the DRM render node <dri_root>/renderD<minor> (device buckets, render-node files).
  virtual Result<UniqueFd> OpenRenderNode(uint32_t minor) = 0;
  // The GEM ioctls on an open render node (render-node BOs); does not own `render_fd`.
  virtual std::unique_ptr<DrmFile> AttachDrm(int render_fd) = 0;
  virtual bool real() const = 0;
};

// /dev/kfd and <dri_root>/renderD<minor> (dri_root: /dev/dri unless configured).
std::unique_ptr<KfdProvider> MakeRealKfdProvider(std::string dri_root = "/dev/dri");
// The fake driver: state shared between processes lives in `state_dir` (restored pids, resumed
// pids, and for dump a `live/` CRIU checkpoint standing for the running process's GPU state).
// Render nodes: <dri_root>/renderD<minor> when that exists (tests point dri_root at a
// directory of plain files), else an anonymous memfd named after the node. Its DrmFile keeps
// BOs as memfds and logs, per process, to drm-<pid> in `state_dir`, in hex: "bo <handle> <fd>"
// per created BO (fd: its memfd in that process), "mv <handle> <new handle>", "close <handle>"
// and "va <handle> <va> <offset> <size>" per VA mapping.
std::unique_ptr<KfdProvider> MakeFakeKfdProvider(const std::string& state_dir,
                                                 std::string dri_root = "/dev/dri");

std::string_view CriuOpName(uint32_t op);

}  // namespace gpulazy::plugin
