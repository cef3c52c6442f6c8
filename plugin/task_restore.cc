#include "plugin/task_restore.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include "lazy-server/image/criu_checkpoint.h"
#include "page-client/restore_session.h"
#include "plugin/criu_host.h"
#include "plugin/device_engine.h"
#include "plugin/handoff.h"
#include "plugin/router.h"
#include "plugin/topology.h"
#include "proto/criu_file.h"

namespace gpulazy::plugin {
namespace fs = std::filesystem;
namespace {

// Where an eager task's session puts other tasks' BOs: nowhere.
class DiscardEngine : public DeviceEngine {
 public:
  std::string_view name() const override { return "discard"; }
  Status Bind(uint32_t, UniqueFd, uint64_t) override { return Status::Ok(); }
  Status Write(uint32_t, uint64_t, std::span<const uint8_t>, client::CopyDone done) override {
    done(Status::Ok());
    return Status::Ok();
  }
  Status Flush() override { return Status::Ok(); }
};

}  // namespace

Result<int> TaskRestorer::RestoreFile(const fs::path& image_dir, int id, int handoff) {
  const uint32_t file_id = static_cast<uint32_t>(id);
  fs::path image = image_dir / criu_format::KfdImageName(file_id);
  std::error_code ec;
  if (!fs::exists(image, ec)) return NotFound("{} does not exist: not a KFD file", image.string());
  Result<int> fd = RestoreKfdImage(image_dir, file_id, image, handoff);
  if (!fd.ok()) return OursFailed(fd.status());
  return fd;
}

Result<int> TaskRestorer::RestoreKfdImage(const fs::path& image_dir, uint32_t file_id,
                                          const fs::path& image, int handoff) {
  GPULAZY_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadWholeFile(image, 1ull << 30));
  if (bytes.size() < criu_format::kHeaderSize)
    return Corrupt("{}: shorter than its header", image.string());
  GPULAZY_ASSIGN_OR_RETURN(
      criu::KfdProcess process,
      criu_format::ParseKfdProcess(std::span(bytes).subspan(criu_format::kHeaderSize),
                                   image.filename().string()));

  GPULAZY_ASSIGN_OR_RETURN(std::vector<LocalGpu> local, ReadTopology(config_.topology_root));
  std::vector<criu::KfdDevice> devices(process.devices().begin(), process.devices().end());
  GPULAZY_ASSIGN_OR_RETURN(GpuMapping mapping, MapGpus(devices, local, config_.checks));

  GPULAZY_ASSIGN_OR_RETURN(std::unique_ptr<Kfd> kfd, kfd_.Open());
  std::vector<kfd_criu_device_bucket> device_buckets(devices.size());
  for (size_t i = 0; i < devices.size(); ++i) {
    uint32_t local_id = mapping.checkpoint_to_local.at(devices[i].gpu_id());
    auto open = render_fds_.find(local_id);
    if (open == render_fds_.end()) {
      GPULAZY_ASSIGN_OR_RETURN(UniqueFd drm,
                               kfd_.OpenRenderNode(mapping.render_minor.at(local_id)));
      open = render_fds_.emplace(local_id, std::move(drm)).first;
    }
    device_buckets[i].user_gpu_id = devices[i].gpu_id();
    device_buckets[i].actual_gpu_id = local_id;
    device_buckets[i].drm_fd = static_cast<uint32_t>(open->second.get());
  }
  std::vector<kfd_criu_bo_bucket> bo_buckets(process.bos_size());
  for (int i = 0; i < process.bos_size(); ++i) {
    const criu::KfdBo& bo = process.bos(i);
    bo_buckets[i] = {};
    bo_buckets[i].addr = bo.gpu_va();
    bo_buckets[i].size = bo.size();
    bo_buckets[i].offset = bo.mmap_offset();
    bo_buckets[i].gpu_id = bo.gpu_id();
    bo_buckets[i].alloc_flags = bo.alloc_flags();
  }
  std::string priv = process.driver_private();
  kfd_ioctl_criu_args args{};
  args.op = KFD_CRIU_OP_RESTORE;
  args.devices = reinterpret_cast<uint64_t>(device_buckets.data());
  args.num_devices = static_cast<uint32_t>(device_buckets.size());
  args.bos = reinterpret_cast<uint64_t>(bo_buckets.data());
  args.num_bos = static_cast<uint32_t>(bo_buckets.size());
  args.priv_data = reinterpret_cast<uint64_t>(priv.data());
  args.priv_data_size = priv.size();
  args.num_objects = process.object_count();
  int rc = kfd->CriuOp(args);
  if (rc != 0)
    return ErrnoError(-rc, "KFD CRIU_OP RESTORE of {} ({} BOs)", image.filename().string(),
                      args.num_bos);

  // Every dmabuf fd is ours now; hold them before anything can fail.
  std::vector<HandedBo> handed;
  std::map<uint32_t, uint32_t> gpu_of_user;
  for (const auto& d : device_buckets)
    gpu_of_user[d.user_gpu_id] = d.actual_gpu_id;
  // The BOs a process maps through a device file; userptr BOs are ordinary memory.
  constexpr uint32_t kMappable = KFD_IOC_ALLOC_MEM_FLAGS_VRAM | KFD_IOC_ALLOC_MEM_FLAGS_GTT |
                                 KFD_IOC_ALLOC_MEM_FLAGS_DOORBELL |
                                 KFD_IOC_ALLOC_MEM_FLAGS_MMIO_REMAP;
  for (int i = 0; i < process.bos_size(); ++i) {
    const kfd_criu_bo_bucket& b = bo_buckets[i];
    if ((b.alloc_flags & kMappable) != 0)
      remaps_[{b.addr, b.offset}] = Remap{b.restored_offset, gpu_of_user[b.gpu_id]};
    if (b.dmabuf_fd == kKfdInvalidFd) continue;
    handed.push_back(HandedBo{static_cast<uint32_t>(i), gpu_of_user[b.gpu_id], b.size,
                              UniqueFd(static_cast<int>(b.dmabuf_fd))});
  }
  if (config_.mode == Mode::kEager) {
    GPULAZY_RETURN_IF_ERROR(CopyEager(image_dir, file_id, handed));
    handed.clear();  // closes the dmabufs; the driver keeps the BOs
  }
  if (handoff < 0) return Internal("no handoff socket to CRIU's master");
  // The master watches this pidfd to notice the task dying mid-restore (coordinator.h). Without
  // pidfds (kernel < 5.3) the handoff still works; the master then learns of a death from CRIU.
  // glibc 2.36 declares pidfd_open without C linkage for C++: call the syscall.
  UniqueFd self(static_cast<int>(::syscall(SYS_pidfd_open, ::getpid(), 0)));
  if (!self.valid())
    spdlog::warn("gpulazy: pidfd_open: {}; the master cannot watch this task",
                 std::strerror(errno));
  GPULAZY_RETURN_IF_ERROR(
      SendHandoff(handoff, static_cast<uint32_t>(::getpid()), file_id, handed, self.get()));
  spdlog::info("gpulazy: {} restored ({} BOs, {} with contents, {} mode)",
               image.filename().string(), process.bos_size(), handed.size(),
               ModeName(config_.mode));
  int fd = kfd->fd();
  files_.push_back(std::move(kfd));
  return fd;
}

Status TaskRestorer::CopyEager(const fs::path& image_dir, uint32_t file_id,
                               std::vector<HandedBo>& bos) {
  HostDmabufEngine engine;  // eager is the baseline: plain writes from this task
  if (!config_.server.empty()) {
    // Contents from the page server: only this task's BOs, one after another. The session
    // streams from Start on, so writes to BOs not bound yet must be parked, not dropped (a
    // dropped chunk still counts as resident and Ensure would not ask for it again): every
    // BO is bound right after Start, ours to the dmabufs, other tasks' to a sink.
    Router router(/*discard_unbound=*/false);
    DiscardEngine sink;
    client::SessionOptions options;
    options.endpoint = config_.server;
    options.image = config_.image.empty() ? image_dir.filename().string() : config_.image;
    options.token = config_.token;
    options.tls = config_.tls;
    options.insecure_tcp = config_.insecure_tcp;
    options.window_bytes = config_.window_bytes;
    client::RestoreSession session(options, router);
    GPULAZY_RETURN_IF_ERROR(
        session.Start().Context(fmt::format("eager restore: page server {}", config_.server)));
    std::map<uint32_t, uint32_t> index;
    for (uint32_t i = 0; i < session.bos().size(); ++i)
      if (session.bos()[i].process_id == file_id) index[session.bos()[i].bo_index] = i;
    Status copied = [&]() -> Status {
      std::map<uint32_t, uint64_t> mine;  // session index -> size
      for (HandedBo& bo : bos) {
        auto it = index.find(bo.bo_index);
        if (it == index.end())
          return NotFound("BO {} of amdgpu-kfd-{}.img not served", bo.bo_index, file_id);
        GPULAZY_RETURN_IF_ERROR(router.Bind(it->second, &engine, std::move(bo.dmabuf), bo.size));
        mine.emplace(it->second, bo.size);
      }
      for (uint32_t i = 0; i < session.bos().size(); ++i)
        if (!mine.count(i))
          GPULAZY_RETURN_IF_ERROR(router.Bind(i, &sink, UniqueFd(), session.bos()[i].size));
      for (const auto& [bo, size] : mine)
        GPULAZY_RETURN_IF_ERROR(session.Ensure(bo, 0, size, config_.resume_timeout));
      return Status::Ok();
    }();
    // Parked writes point into the session's buffers: complete them before it goes away.
    session.Cancel();
    router.FailParked(Aborted("eager restore abandoned"));
    return copied;
  }
  // No server: read the pages files here, as upstream CRIU does.
  GPULAZY_ASSIGN_OR_RETURN(image::CriuCheckpoint cp, image::CriuCheckpoint::Open(image_dir));
  std::map<uint32_t, const image::ContentBo*> content;
  for (const image::ContentBo& c : cp.content_bos())
    if (c.process_id == file_id) content[c.bo_index] = &c;
  std::vector<uint8_t> buffer;
  for (HandedBo& bo : bos) {
    auto it = content.find(bo.bo_index);
    if (it == content.end())
      return NotFound("BO {} of amdgpu-kfd-{}.img has no contents", bo.bo_index, file_id);
    GPULAZY_ASSIGN_OR_RETURN(UniqueFd in, OpenForRead(image_dir / it->second->pages_file));
    GPULAZY_RETURN_IF_ERROR(engine.Bind(bo.bo_index, std::move(bo.dmabuf), bo.size));
    constexpr uint64_t kStep = 2u << 20;
    for (uint64_t off = 0; off < bo.size; off += kStep) {
      buffer.resize(std::min<uint64_t>(kStep, bo.size - off));
      GPULAZY_RETURN_IF_ERROR(ReadExactAt(in.get(),
                                          criu_format::kHeaderSize + it->second->pages_offset + off,
                                          buffer, it->second->pages_file));
      // The engine may copy asynchronously (SDMA) and `buffer` is reused next round: wait for
      // this copy to land first. Eager mode is sequential by definition (upstream's baseline).
      GPULAZY_RETURN_IF_ERROR(engine.Write(bo.bo_index, off, buffer, [](const Status&) {}));
      GPULAZY_RETURN_IF_ERROR(engine.Flush());
    }
  }
  return Status::Ok();
}

Result<int> TaskRestorer::UpdateVmaMap(const std::string& path, uint64_t addr, uint64_t old_pgoff,
                                       uint64_t* new_pgoff, int* plugin_fd) const {
  // CRIU's paths sometimes carry doubled slashes (//dev/dri/renderD128).
  std::string clean;
  for (char c : path)
    if (c != '/' || clean.empty() || clean.back() != '/') clean += c;
  const bool render = clean.starts_with("/dev/dri/renderD");
  if (!render && !kfd_.IsKfdPath(clean)) return NotFound("{} is not a GPU device mapping", path);
  auto it = remaps_.find({addr, old_pgoff});
  if (it == remaps_.end()) {
    spdlog::info("gpulazy: {} at {:#x} offset {:#x} is no restored BO; left as it is", path, addr,
                 old_pgoff);
    return 0;
  }
  int fd = -1;
  if (render) {
    auto drm = render_fds_.find(it->second.local_gpu_id);
    if (drm == render_fds_.end())
      return Internal("no render node open for local gpu {:#x}", it->second.local_gpu_id);
    fd = ::fcntl(drm->second.get(), F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return ErrnoError(errno, "dup of the render node for {}", path);
  }
  *new_pgoff = it->second.new_pgoff;
  *plugin_fd = fd;
  return 1;
}

}  // namespace gpulazy::plugin
