#include "plugin/context.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/lazy_image.h"
#include "plugin/dump.h"
#include "plugin/handoff.h"
#include "plugin/sdma_engine.h"
#include "proto/criu_file.h"

namespace gpulazy::plugin {
namespace fs = std::filesystem;

PluginContext& PluginContext::Get() {
  static PluginContext context;
  return context;
}

Status PluginContext::EnsureConfig() {
  if (config_) return Status::Ok();
  GPULAZY_ASSIGN_OR_RETURN(PluginConfig c, LoadConfigFromProcess());
  spdlog::set_level(spdlog::level::from_str(c.log_level));
  kfd_ = c.fake_kfd.empty() ? MakeRealKfdProvider(c.dri_root.string())
                            : MakeFakeKfdProvider(c.fake_kfd.string(), c.dri_root.string());
  config_ = std::move(c);
  return Status::Ok();
}

Status PluginContext::Init(int stage) {
  host_ = CriuHost::Resolve();
  GPULAZY_RETURN_IF_ERROR(EnsureConfig().Context("gpulazy plugin configuration"));
  if (stage != GPULAZY_CRIU_STAGE_RESTORE) return Status::Ok();
  // Images dumped by upstream's amdgpu plugin (or by us) list a plugin in the inventory.
  host_.Claim(kUpstreamPluginName);
  host_.Claim(kPluginName);
  GPULAZY_ASSIGN_OR_RETURN(image_dir_, host_.ImageDir());
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(image_dir_, ec)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with("amdgpu-kfd-") && name.ends_with(".img")) gpu_restore_ = true;
  }
  if (!gpu_restore_) return Status::Ok();  // nothing of ours: stay out of the way
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds) != 0)
    return ErrnoError(errno, "socketpair for the BO handoff");
  handoff_master_.reset(fds[0]);
  UniqueFd task_end(fds[1]);
  GPULAZY_RETURN_IF_ERROR(EnableSenderCredentials(handoff_master_.get()));
  int bytes = 4 << 20;
  (void)::setsockopt(task_end.get(), SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
  (void)::setsockopt(handoff_master_.get(), SOL_SOCKET, SO_RCVBUF, &bytes, sizeof(bytes));
  if (host_.fdstore_add != nullptr) {
    // CRIU closes inherited fds in restored tasks; its fdstore is how a task gets ours back.
    handoff_store_id_ = host_.fdstore_add(task_end.get());
    if (handoff_store_id_ < 0) return Internal("fdstore_add failed: {}", handoff_store_id_);
  } else {
    handoff_task_ = std::move(task_end);
  }
  task_ = std::make_unique<TaskRestorer>(*config_, *kfd_,
                                         [this](uint32_t gpu) { return MakeEngine(gpu); });
  spdlog::info("gpulazy: restoring GPU state from {} ({} mode)", image_dir_.string(),
               ModeName(config_->mode));
  return Status::Ok();
}

Result<int> PluginContext::TaskHandoffFd() {
  if (handoff_store_id_ >= 0 && host_.fdstore_get != nullptr) {
    int fd = host_.fdstore_get(handoff_store_id_);
    if (fd < 0) return Internal("fdstore_get({}) failed", handoff_store_id_);
    return fd;
  }
  if (!handoff_task_.valid()) return Internal("no handoff socket");
  int fd = ::fcntl(handoff_task_.get(), F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return ErrnoError(errno, "dup handoff socket");
  return fd;
}

Result<int> PluginContext::RestoreExtFile(int id) {
  if (!gpu_restore_ || !task_) return NotFound("no GPU state in this restore");
  GPULAZY_ASSIGN_OR_RETURN(int handoff, TaskHandoffFd());
  UniqueFd owned(handoff);
  // Runs in the restored task, which may be in the container's mount namespace by now: the
  // master's path to the images may name nothing there.
  Result<fs::path> dir = host_.ImageDir();
  if (!dir.ok()) return OursFailed(dir.status());
  return task_->RestoreFile(*dir, id, owned.get());
}

Result<int> PluginContext::UpdateVmaMap(const char* path, uint64_t addr, uint64_t old_pgoff,
                                        uint64_t* new_pgoff, int* plugin_fd) {
  if (!task_ || path == nullptr) return NotFound("not a GPU mapping");
  return task_->UpdateVmaMap(path, addr, old_pgoff, new_pgoff, plugin_fd);
}

Result<std::unique_ptr<DeviceEngine>> PluginContext::MakeEngine(uint32_t local_gpu_id) {
  EngineKind kind = config_->engine;
  if (kind == EngineKind::kAuto) kind = kfd_->real() ? EngineKind::kSdma : EngineKind::kHost;
  if (kind == EngineKind::kHost)
    return std::unique_ptr<DeviceEngine>(std::make_unique<HostDmabufEngine>());
  GPULAZY_ASSIGN_OR_RETURN(std::vector<LocalGpu> local, ReadTopology(config_->topology_root));
  for (const LocalGpu& g : local) {
    if (g.gpu_id != local_gpu_id) continue;
    GPULAZY_ASSIGN_OR_RETURN(
        UniqueFd drm, kfd_->OpenRenderNode(static_cast<uint32_t>(g.Get("drm_render_minor"))));
    GPULAZY_ASSIGN_OR_RETURN(std::unique_ptr<AmdgpuDevice> device,
                             OpenAmdgpuDevice(std::move(drm)));
    GPULAZY_ASSIGN_OR_RETURN(std::unique_ptr<SdmaCopyEngine> engine,
                             SdmaCopyEngine::Create(std::move(device)));
    return std::unique_ptr<DeviceEngine>(std::move(engine));
  }
  return NotFound("local gpu {:#x} not in the topology", local_gpu_id);
}

Status PluginContext::PostForking() {
  if (!gpu_restore_) return NotFound("no GPU state in this restore");
  coordinator_ =
      std::make_unique<RestoreCoordinator>(*config_, image_dir_, std::move(handoff_master_), *kfd_,
                                           [this](uint32_t gpu) { return MakeEngine(gpu); });
  // From here every failure is ours: a server without the image (ERROR_NOT_FOUND), a fault
  // socket's missing directory (ENOENT) must fail the restore, not read as "nothing to do".
  return OursFailed(coordinator_->Start());
}

Status PluginContext::ResumeDevicesLate(int pid) {
  if (!coordinator_) return NotFound("no GPU state in this restore");
  return coordinator_->ResumeTask(static_cast<uint32_t>(pid));
}

void PluginContext::Exit(int stage, int ret) {
  if (stage == GPULAZY_CRIU_STAGE_DUMP && ret == 0 && config_ && config_->lazy_image &&
      !dumped_dir_.empty())
    WriteLazyImage();
  if (coordinator_) {
    Status s = coordinator_->Finish(ret == 0);
    if (!s.ok()) spdlog::error("gpulazy: finishing the restore: {}", s.ToString());
    coordinator_.reset();
  }
}

Status PluginContext::DumpExtFile(int fd, int id) {
  GPULAZY_RETURN_IF_ERROR(EnsureConfig());
  if (!kfd_->IsKfd(fd)) return NotFound("fd {} is not a KFD file", fd);
  GPULAZY_ASSIGN_OR_RETURN(fs::path dir, host_.ImageDir());
  // The device entries describe this host's GPUs (sysfs), as restore will compare them.
  Result<std::vector<LocalGpu>> topology = ReadTopology(config_->topology_root);
  if (!topology.ok())
    return OursFailed(topology.status().Context("dump of KFD file " + std::to_string(id)));
  GPULAZY_ASSIGN_OR_RETURN(std::unique_ptr<Kfd> kfd, kfd_->Attach(fd));
  GPULAZY_RETURN_IF_ERROR(OursFailed(
      DumpKfdFile(*kfd, id, dir, *topology, [this](uint32_t gpu) { return MakeEngine(gpu); })));
  dumped_dir_ = dir;
  return Status::Ok();
}

void PluginContext::WriteLazyImage() {
  // exit() cannot fail the dump: the CRIU images are complete and served as they are; a lazy
  // image that could not be written is only a missed optimisation, said loudly.
  Result<image::CriuCheckpoint> checkpoint = image::CriuCheckpoint::Open(dumped_dir_);
  Result<image::ConvertStats> stats =
      checkpoint.ok() ? image::ConvertToLazyImage(*checkpoint, image::ConvertOptions{})
                      : Result<image::ConvertStats>(checkpoint.status());
  if (!stats.ok()) {
    spdlog::error("gpulazy: no lazy image in {}: {}", dumped_dir_.string(),
                  stats.status().ToString());
    return;
  }
  spdlog::info("gpulazy: lazy image of {}: {} chunks, {} of {} bytes stored", dumped_dir_.string(),
               stats->chunks, stats->stored_bytes, stats->raw_bytes);
}

Status PluginContext::HandleDeviceVma(int fd) {
  GPULAZY_RETURN_IF_ERROR(EnsureConfig());
  if (!kfd_->IsKfd(fd)) return NotFound("fd {} is not a KFD file", fd);
  return Status::Ok();  // KFD mappings are recreated through UPDATE_VMA_MAP at restore
}

}  // namespace gpulazy::plugin
