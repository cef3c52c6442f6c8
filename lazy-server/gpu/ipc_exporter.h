// IpcExporterProcess: runs gpulazy-ipc-exporter (ipc_exporter_main.cc), a process that exports
// zeroed device memory as a CUDA IPC handle, the way a restoring process would hand its BOs to
// a DevicePlacer. For tests and benchmarks of the placer, which cannot open a handle of their
// own process.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <filesystem>

#include "lazy-server/gpu/device_placer.h"
#include "proto/status.h"

namespace gpulazy::server::gpu {

class IpcExporterProcess {
 public:
  // Starts `executable` for `size` bytes and reads the handle it prints (30 s at most).
  static Result<std::unique_ptr<IpcExporterProcess>> Start(const std::filesystem::path& executable,
                                                           uint64_t size);
  // Closes its standard input (it frees the memory and exits) and reaps it.
  ~IpcExporterProcess();
  IpcExporterProcess(const IpcExporterProcess&) = delete;
  IpcExporterProcess& operator=(const IpcExporterProcess&) = delete;

  const IpcHandle& handle() const { return handle_; }
  uint64_t size() const { return size_; }

 private:
  IpcExporterProcess(pid_t pid, int stdin_fd, uint64_t size)
      : pid_(pid), stdin_(stdin_fd), size_(size) {}
  pid_t pid_;
  int stdin_;
  uint64_t size_;
  IpcHandle handle_{};
};

}  // namespace gpulazy::server::gpu
