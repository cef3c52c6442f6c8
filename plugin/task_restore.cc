#include "plugin/task_restore.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
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
  std::error_code ec;
  fs::path image = image_dir / criu_format::KfdImageName(file_id);
  if (fs::exists(image, ec)) {
    Result<int> fd = RestoreKfdImage(image_dir, file_id, image, handoff);
    if (!fd.ok()) return OursFailed(fd.status());
    return fd;
  }
  image = image_dir / criu_format::RenderNodeImageName(file_id);
  if (fs::exists(image, ec)) {
    Result<int> fd = RestoreRenderNode(image_dir, file_id, image);
    if (!fd.ok()) return OursFailed(fd.status());
    return fd;
  }
  // criu-dev's dmabuf files (criu_dmabuf_node) are not restored here: docs/criu.md.
  return NotFound("neither {} nor {} exists: not a KFD or render-node file",
                  criu_format::KfdImageName(file_id), criu_format::RenderNodeImageName(file_id));
}

Result<GpuMapping> TaskRestorer::MappingFrom(const std::vector<criu::KfdDevice>& devices,
                                             const std::string& image) {
  if (mapping_) {
    // The same devices as the file that fixed the mapping (in any order: every KFD image of a
    // dump lists the same GPUs, not always in the same order, and MapGpus' choice among equal
    // GPUs follows the order): keep the mapping, already checked against the topology.
    const bool same = std::all_of(devices.begin(), devices.end(), [&](const criu::KfdDevice& d) {
      auto it = mapped_devices_.find(d.gpu_id());
      return it != mapped_devices_.end() && it->second == d.SerializeAsString();
    });
    if (same) return *mapping_;
  }
  GPULAZY_ASSIGN_OR_RETURN(std::vector<LocalGpu> local, ReadTopology(config_.topology_root));
  GPULAZY_ASSIGN_OR_RETURN(GpuMapping mapping, MapGpus(devices, local, config_.checks));
  for (const criu::KfdDevice& d : devices)
    mapped_devices_.emplace(d.gpu_id(), d.SerializeAsString());
  if (!mapping_) {
    mapping_ = mapping;
    return mapping;
  }
  // A second file of this task: its GPUs must land where the first file's did, or the render
  // node CRIU installed and the driver's device buckets would name different GPUs.
  for (const auto& [checkpointed, local_id] : mapping.checkpoint_to_local) {
    auto before = mapping_->checkpoint_to_local.find(checkpointed);
    if (before == mapping_->checkpoint_to_local.end()) {
      mapping_->checkpoint_to_local[checkpointed] = local_id;
      mapping_->render_minor[local_id] = mapping.render_minor.at(local_id);
    } else if (before->second != local_id) {
      return InvalidArgument(
          "{}: gpu {:#x} maps to local gpu {:#x}, but an earlier file of this task mapped it to "
          "{:#x}",
          image, checkpointed, local_id, before->second);
    }
  }
  return *mapping_;
}

Result<GpuMapping> TaskRestorer::MappingForRenderNode(const fs::path& image_dir,
                                                      const std::string& image) {
  if (mapping_) return *mapping_;
  // CRIU may restore the render node before the task's KFD file (upstream's plugin then fails;
  // its TODO says so). Every KFD image of a checkpoint lists the same devices (the dump host's
  // GPUs), so the first one tells how GPUs map.
  std::optional<uint32_t> first;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(image_dir, ec)) {
    const std::string name = e.path().filename().string();
    constexpr std::string_view kPrefix = "amdgpu-kfd-";
    if (!name.starts_with(kPrefix) || !name.ends_with(".img")) continue;
    const std::string digits = name.substr(kPrefix.size(), name.size() - kPrefix.size() - 4);
    if (digits.empty() || digits.size() > 9 ||
        digits.find_first_not_of("0123456789") != std::string::npos)
      continue;
    const auto id = static_cast<uint32_t>(std::stoul(digits));
    if (!first || id < *first) first = id;
  }
  if (ec) return ErrnoError(ec.value(), "list the image directory {}", image_dir.string());
  if (!first)
    return NotFound("{}: no amdgpu-kfd-<id>.img in {} to map the checkpoint's GPUs with", image,
                    image_dir.string());
  const fs::path kfd_image = image_dir / criu_format::KfdImageName(*first);
  GPULAZY_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadWholeFile(kfd_image, 1ull << 30));
  if (bytes.size() < criu_format::kHeaderSize)
    return Corrupt("{}: shorter than its header", kfd_image.string());
  GPULAZY_ASSIGN_OR_RETURN(
      criu::KfdProcess process,
      criu_format::ParseKfdProcess(std::span(bytes).subspan(criu_format::kHeaderSize),
                                   kfd_image.filename().string()));
  std::vector<criu::KfdDevice> devices(process.devices().begin(), process.devices().end());
  return MappingFrom(devices, image);
}

Result<int> TaskRestorer::RenderFd(uint32_t local_id, uint32_t minor) {
  auto open = render_fds_.find(local_id);
  if (open == render_fds_.end()) {
    GPULAZY_ASSIGN_OR_RETURN(UniqueFd drm, kfd_.OpenRenderNode(minor));
    open = render_fds_.emplace(local_id, std::move(drm)).first;
  }
  return open->second.get();
}

Result<int> TaskRestorer::RestoreRenderNode(const fs::path& image_dir, uint32_t file_id,
                                            const fs::path& image) {
  const std::string name = image.filename().string();
  GPULAZY_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, ReadWholeFile(image, 1ull << 30));
  if (bytes.size() < criu_format::kHeaderSize)
    return Corrupt("{}: {} bytes, shorter than its 8-byte header", name, bytes.size());
  const uint64_t declared = criu_format::DecodeHeader(bytes.data());
  if (declared != bytes.size() - criu_format::kHeaderSize)
    return Corrupt("{}: header says {} bytes follow, the file holds {}", name, declared,
                   bytes.size() - criu_format::kHeaderSize);
  GPULAZY_ASSIGN_OR_RETURN(
      criu::RenderNode node,
      criu_format::ParseRenderNode(std::span(bytes).subspan(criu_format::kHeaderSize), name));
  GPULAZY_ASSIGN_OR_RETURN(GpuMapping mapping, MappingForRenderNode(image_dir, name));
  auto local = mapping.checkpoint_to_local.find(node.gpu_id());
  if (local == mapping.checkpoint_to_local.end()) {
    std::string known;
    for (const auto& [checkpointed, l] : mapping.checkpoint_to_local)
      known += fmt::format("{}{:#x}", known.empty() ? "" : ", ", checkpointed);
    return NotFound("{}: gpu {:#x} is none of the checkpoint's GPUs ({})", name, node.gpu_id(),
                    known);
  }
  const uint32_t local_id = local->second;
  GPULAZY_ASSIGN_OR_RETURN(int render, RenderFd(local_id, mapping.render_minor.at(local_id)));
  if (node.bos_size() > 0) {
    auto drm = drm_files_.find(local_id);
    if (drm == drm_files_.end()) drm = drm_files_.emplace(local_id, kfd_.AttachDrm(render)).first;
    GPULAZY_RETURN_IF_ERROR(
        RestoreRenderBos(image_dir, file_id, name, node, local_id, *drm->second));
  }
  // CRIU installs a dup of what we return and closes ours; the task-wide file stays open here
  // for the KFD restore and for UPDATE_VMA_MAP (DRM mmaps only through the file that made a BO).
  int fd = ::fcntl(render, F_DUPFD_CLOEXEC, 0);
  if (fd < 0) return ErrnoError(errno, "dup of the render node for {}", name);
  spdlog::info("gpulazy: {} restored: gpu {:#x} -> local {:#x} (renderD{}), {} BOs", name,
               node.gpu_id(), local_id, mapping.render_minor.at(local_id), node.bos_size());
  return fd;
}

Status TaskRestorer::RestoreRenderBos(const fs::path& image_dir, uint32_t file_id,
                                      const std::string& name, const criu::RenderNode& node,
                                      uint32_t local_id, DrmFile& drm) {
  // First everything that can be checked without touching the driver, so that a bad image
  // leaves nothing behind: no imports, and every pages file present with the BO's size.
  constexpr uint32_t kContentDomains = criu_format::kGemDomainVram | criu_format::kGemDomainGtt;
  std::map<int, UniqueFd> pages;  // BO index -> its amdgpu-drm-pages file
  for (int i = 0; i < node.bos_size(); ++i) {
    const criu::RenderBo& bo = node.bos(i);
    if (bo.is_import() != 0)
      return Unsupported(
          "{}: BO {} (GEM handle {}) is imported from another file (dmabuf IPC); gpulazy does "
          "not restore imported render-node BOs",
          name, i, bo.handle());
    // As upstream: contents only of VRAM/GTT BOs that are mapped into the GPU's VA space.
    if ((bo.preferred_domains() & kContentDomains) == 0 || bo.mappings_size() == 0) continue;
    const std::string file =
        criu_format::DrmPagesImageName(file_id, node.drm_render_minor(), static_cast<uint32_t>(i));
    GPULAZY_ASSIGN_OR_RETURN(UniqueFd in, OpenForRead(image_dir / file));
    uint8_t header[criu_format::kHeaderSize];
    GPULAZY_RETURN_IF_ERROR(ReadExactAt(in.get(), 0, header, file));
    struct stat st {};
    if (::fstat(in.get(), &st) != 0) return ErrnoError(errno, "stat {}", file);
    const uint64_t declared = criu_format::DecodeHeader(header);
    const uint64_t held = static_cast<uint64_t>(st.st_size) - criu_format::kHeaderSize;
    if (declared != bo.size() || held != bo.size())
      return Corrupt("{}: BO {} of {} is {} bytes, but the header says {} and the file holds {}",
                     file, i, name, bo.size(), declared, held);
    pages.emplace(i, std::move(in));
  }

  // Then the driver: every BO under its old handle, its new mmap offset, its VA mappings. A
  // failure closes what this file created.
  std::vector<uint32_t> created;
  std::map<std::pair<uint64_t, uint64_t>, Remap> remaps;
  std::map<int, UniqueFd> dmabufs;
  Status made = [&]() -> Status {
    for (int i = 0; i < node.bos_size(); ++i) {
      const criu::RenderBo& bo = node.bos(i);
      GPULAZY_ASSIGN_OR_RETURN(
          uint32_t handle,
          drm.Create(bo.size(), bo.alignment(), bo.preferred_domains(), bo.alloc_flags()));
      created.push_back(handle);
      if (handle != bo.handle()) {
        GPULAZY_RETURN_IF_ERROR(drm.ChangeHandle(handle, bo.handle()));
        created.back() = bo.handle();
      }
      if (pages.count(i) != 0) {
        GPULAZY_ASSIGN_OR_RETURN(UniqueFd dmabuf, drm.Export(bo.handle()));
        dmabufs.emplace(i, std::move(dmabuf));
      }
      GPULAZY_ASSIGN_OR_RETURN(uint64_t offset, drm.MmapOffset(bo.handle()));
      remaps.emplace(std::pair{bo.gpu_va(), bo.mmap_offset()}, Remap{offset, local_id});
      for (const criu::RenderBoMapping& m : bo.mappings())
        GPULAZY_RETURN_IF_ERROR(
            drm.MapVa(bo.handle(), m.gpu_va(), m.offset_in_bo(), m.size(), m.flags()));
    }
    // Contents: here, now, one BO after another, and read back where the engine can (render-node
    // BOs are not lazy).
    GPULAZY_ASSIGN_OR_RETURN(std::unique_ptr<DeviceEngine> engine_owner, make_engine_(local_id));
    DeviceEngine& engine = *engine_owner;
    std::vector<uint8_t> buffer, check;
    for (auto& [i, in] : pages) {
      const criu::RenderBo& bo = node.bos(i);
      const std::string file = criu_format::DrmPagesImageName(file_id, node.drm_render_minor(),
                                                              static_cast<uint32_t>(i));
      const int out = dmabufs.at(i).get();
      const auto index = static_cast<uint32_t>(i);
      int copy = ::fcntl(out, F_DUPFD_CLOEXEC, 0);
      if (copy < 0) return ErrnoError(errno, "dup of the dmabuf of BO {} of {}", i, name);
      GPULAZY_RETURN_IF_ERROR(engine.Bind(index, UniqueFd(copy), bo.size()));
      constexpr uint64_t kStep = 2u << 20;
      for (uint64_t off = 0; off < bo.size(); off += kStep) {
        buffer.resize(std::min<uint64_t>(kStep, bo.size() - off));
        check.resize(buffer.size());
        GPULAZY_RETURN_IF_ERROR(
            ReadExactAt(in.get(), criu_format::kHeaderSize + off, buffer, file));
        GPULAZY_RETURN_IF_ERROR(engine.Write(index, off, buffer, [](const Status&) {}));
        GPULAZY_RETURN_IF_ERROR(engine.Flush());
        Status read_back = engine.ReadBack(index, off, check);
        if (read_back.code() == Code::kUnsupported) continue;  // SDMA: see DeviceEngine::ReadBack
        GPULAZY_RETURN_IF_ERROR(read_back);
        if (check != buffer)
          return IoError("{}: BO {} reads back different bytes at offset {} after the copy", name,
                         i, off);
      }
      engine.Release(index);
    }
    return Status::Ok();
  }();
  if (!made.ok()) {
    for (uint32_t handle : created)
      drm.Close(handle);
    return made.Context(name);
  }
  for (auto& [key, remap] : remaps)
    remaps_.emplace(key, remap);
  return Status::Ok();
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

  std::vector<criu::KfdDevice> devices(process.devices().begin(), process.devices().end());
  GPULAZY_ASSIGN_OR_RETURN(GpuMapping mapping, MappingFrom(devices, image.filename().string()));

  GPULAZY_ASSIGN_OR_RETURN(std::unique_ptr<Kfd> kfd, kfd_.Open());
  std::vector<kfd_criu_device_bucket> device_buckets(devices.size());
  for (size_t i = 0; i < devices.size(); ++i) {
    uint32_t local_id = mapping.checkpoint_to_local.at(devices[i].gpu_id());
    GPULAZY_ASSIGN_OR_RETURN(int drm, RenderFd(local_id, mapping.render_minor.at(local_id)));
    device_buckets[i].user_gpu_id = devices[i].gpu_id();
    device_buckets[i].actual_gpu_id = local_id;
    device_buckets[i].drm_fd = static_cast<uint32_t>(drm);
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
  // Eager is the baseline: this task copies its own BOs, one after another, through the engine
  // its GPU needs (SDMA on hardware: a dmabuf of VRAM cannot simply be written).
  std::map<uint32_t, std::unique_ptr<DeviceEngine>> engines;  // by local gpu id
  auto engine_for = [&](uint32_t local_gpu_id) -> Result<DeviceEngine*> {
    auto it = engines.find(local_gpu_id);
    if (it == engines.end()) {
      GPULAZY_ASSIGN_OR_RETURN(std::unique_ptr<DeviceEngine> made, make_engine_(local_gpu_id));
      it = engines.emplace(local_gpu_id, std::move(made)).first;
    }
    return it->second.get();
  };
  if (!config_.server.empty()) {
    // Contents from the page server: only this task's BOs, one after another. The session
    // streams from Start on, so writes to BOs not bound yet must be parked, not dropped (a
    // dropped chunk still counts as resident and Ensure would not ask for it again): every
    // BO is bound right after Start, ours to the dmabufs, other tasks' to a sink.
    GPULAZY_RETURN_IF_ERROR(CheckServerTransport(config_).Context("eager restore"));
    Router router(/*discard_unbound=*/false);
    DiscardEngine sink;
    client::SessionOptions options;
    options.endpoint = config_.server;
    options.image = config_.image.empty() ? image_dir.filename().string() : config_.image;
    options.token = config_.token;
    options.tls = config_.tls;
    options.insecure_tcp = config_.insecure_tcp;
    options.window_bytes = config_.window_bytes;
    // The task waits for the whole copy, never for one chunk: a bulk client's window.
    options.window_per_connection_bytes = client::kBulkWindowPerConnection;
    options.lanes = config_.lanes;
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
        GPULAZY_ASSIGN_OR_RETURN(DeviceEngine * engine, engine_for(bo.local_gpu_id));
        GPULAZY_RETURN_IF_ERROR(router.Bind(it->second, engine, std::move(bo.dmabuf), bo.size));
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
    GPULAZY_ASSIGN_OR_RETURN(DeviceEngine * engine, engine_for(bo.local_gpu_id));
    GPULAZY_RETURN_IF_ERROR(engine->Bind(bo.bo_index, std::move(bo.dmabuf), bo.size));
    constexpr uint64_t kStep = 2u << 20;
    for (uint64_t off = 0; off < bo.size; off += kStep) {
      buffer.resize(std::min<uint64_t>(kStep, bo.size - off));
      GPULAZY_RETURN_IF_ERROR(ReadExactAt(in.get(),
                                          criu_format::kHeaderSize + it->second->pages_offset + off,
                                          buffer, it->second->pages_file));
      // The engine may copy asynchronously (SDMA) and `buffer` is reused next round: wait for
      // this copy to land first. Eager mode is sequential by definition (upstream's baseline).
      GPULAZY_RETURN_IF_ERROR(engine->Write(bo.bo_index, off, buffer, [](const Status&) {}));
      GPULAZY_RETURN_IF_ERROR(engine->Flush());
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
