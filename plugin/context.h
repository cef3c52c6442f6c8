// PluginContext: the plugin's one piece of state (style.md: no other globals). The extern "C"
// hooks in plugin.cc forward here; every method returns a Status that the hook maps to -errno.
// Lives in CRIU's master; restored tasks get a copy by fork.
// Thread-safety: CRIU calls hooks from one thread per process.
#pragma once

#include <filesystem>
#include <memory>
#include <optional>

#include "plugin/config.h"
#include "plugin/coordinator.h"
#include "plugin/criu_host.h"
#include "plugin/kfd.h"
#include "plugin/task_restore.h"

namespace gpulazy::plugin {

inline constexpr const char* kPluginName = "gpulazy_plugin";
inline constexpr const char* kUpstreamPluginName = "amdgpu_plugin";

class PluginContext {
 public:
  static PluginContext& Get();

  Status Init(int stage);
  void Exit(int stage, int ret);
  // kNotFound from these means "not ours": the hook answers -ENOTSUP.
  Result<int> RestoreExtFile(int id);
  // 1: adjusted, 0: a GPU mapping left as it is (task_restore.h).
  Result<int> UpdateVmaMap(const char* path, uint64_t addr, uint64_t old_pgoff, uint64_t* new_pgoff,
                           int* plugin_fd);
  Status PostForking();
  Status ResumeDevicesLate(int pid);
  Status DumpExtFile(int fd, int id);
  Status HandleDeviceVma(int fd);

 private:
  Status EnsureConfig();
  Result<std::unique_ptr<DeviceEngine>> MakeEngine(uint32_t local_gpu_id);
  Result<int> TaskHandoffFd();
  void WriteLazyImage();  // of dumped_dir_, at exit(DUMP) with config lazy_image

  CriuHost host_;
  std::optional<PluginConfig> config_;
  std::unique_ptr<KfdProvider> kfd_;
  std::filesystem::path image_dir_;
  bool gpu_restore_ = false;   // the image directory holds amdgpu-kfd images
  UniqueFd handoff_master_;    // master's end (receiver)
  UniqueFd handoff_task_;      // tasks' end when there is no fdstore (test hosts)
  int handoff_store_id_ = -1;  // tasks' end in CRIU's fdstore
  std::unique_ptr<TaskRestorer> task_;
  std::unique_ptr<RestoreCoordinator> coordinator_;
  std::filesystem::path dumped_dir_;  // where DUMP_EXT_FILE wrote KFD images, if it did
};

}  // namespace gpulazy::plugin
