#include "plugin/dump.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <map>

#include "lazy-server/image/criu_checkpoint.h"
#include "proto/criu_file.h"

namespace gpulazy::plugin {

void DescribeDevice(const LocalGpu& gpu, const std::vector<LocalGpu>& topology,
                    criu::KfdDevice* device) {
  const auto* r = device->GetReflection();
  const auto* desc = device->GetDescriptor();
  for (int f = 0; f < desc->field_count(); ++f) {
    const auto* field = desc->field(f);
    if (field->is_repeated()) continue;  // the io links, below
    const uint64_t value = gpu.Get(field->name());
    if (field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_UINT32)
      r->SetUInt32(device, field, static_cast<uint32_t>(value));
    else if (field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_UINT64)
      r->SetUInt64(device, field, value);
  }
  device->set_node_id(gpu.node_id);
  device->set_gpu_id(gpu.gpu_id);
  device->set_vram_size(gpu.vram_size);
  device->set_vram_public(gpu.vram_public ? 1 : 0);
  // As upstream's dump (topology_to_devinfo): the links that lead to another GPU of the
  // topology; links to CPU nodes and to nodes that are not there are left out. io_links_count
  // stays sysfs's count of all links, as upstream keeps it.
  for (const IoLink& link : gpu.io_links) {
    const bool to_gpu = std::any_of(topology.begin(), topology.end(), [&](const LocalGpu& g) {
      return g.node_id == link.node_to && g.gpu_id != gpu.gpu_id;
    });
    if (!to_gpu) continue;
    criu::TopologyLink* l = device->add_links();
    l->set_link_type(link.type);
    l->set_peer_node_id(link.node_to);
  }
}

Status DumpKfdFile(Kfd& kfd, int id, const std::filesystem::path& image_dir,
                   const std::vector<LocalGpu>& topology, const EngineFactory& engines) {
  kfd_ioctl_criu_args info{};
  info.op = KFD_CRIU_OP_PROCESS_INFO;
  int rc = kfd.CriuOp(info);
  if (rc != 0) return ErrnoError(-rc, "KFD CRIU_OP PROCESS_INFO");
  // From here the queues are paused: unpause whatever happens.
  struct Unpause {
    Kfd& kfd;
    ~Unpause() {
      kfd_ioctl_criu_args a{};
      a.op = KFD_CRIU_OP_UNPAUSE;
      if (int rc = kfd.CriuOp(a); rc != 0) spdlog::error("gpulazy: KFD UNPAUSE failed: {}", rc);
    }
  } unpause{kfd};

  std::vector<kfd_criu_device_bucket> devices(info.num_devices);
  std::vector<kfd_criu_bo_bucket> bos(info.num_bos);
  std::string priv(info.priv_data_size, '\0');
  kfd_ioctl_criu_args cp = info;
  cp.op = KFD_CRIU_OP_CHECKPOINT;
  cp.devices = reinterpret_cast<uint64_t>(devices.data());
  cp.bos = reinterpret_cast<uint64_t>(bos.data());
  cp.priv_data = reinterpret_cast<uint64_t>(priv.data());
  rc = kfd.CriuOp(cp);
  if (rc != 0) return ErrnoError(-rc, "KFD CRIU_OP CHECKPOINT ({} BOs)", info.num_bos);
  std::vector<UniqueFd> dmabufs;
  for (const auto& b : bos)
    if (b.dmabuf_fd != kKfdInvalidFd) dmabufs.emplace_back(static_cast<int>(b.dmabuf_fd));

  criu::KfdProcess m;
  m.set_pid(info.pid);
  m.set_gpu_count(info.num_devices);
  m.set_cpu_count(0);
  m.set_bo_count(info.num_bos);
  m.set_object_count(info.num_objects);
  m.set_shared_mem_size(0);
  m.set_shared_mem_magic(0);
  m.set_driver_private(priv);
  for (const auto& d : devices) {
    // CHECKPOINT reports the GPUs by their ids on this host; sysfs describes them.
    auto local = std::find_if(topology.begin(), topology.end(),
                              [&](const LocalGpu& g) { return g.gpu_id == d.actual_gpu_id; });
    if (local == topology.end())
      return NotFound("gpu {:#x} of the dumped process is not in the KFD topology",
                      d.actual_gpu_id);
    criu::KfdDevice* device = m.add_devices();
    DescribeDevice(*local, topology, device);
    device->set_gpu_id(d.user_gpu_id);  // the id the BO entries use (a restored process's)
  }
  std::map<uint32_t, uint64_t> per_gpu;
  for (const auto& b : bos) {
    criu::KfdBo* bo = m.add_bos();
    bo->set_gpu_va(b.addr);
    bo->set_size(b.size);
    bo->set_mmap_offset(b.offset);
    bo->set_alloc_flags(b.alloc_flags);
    bo->set_gpu_id(b.gpu_id);
    bo->set_handle(0);
    if (criu_format::HasContents(b.alloc_flags)) per_gpu[b.gpu_id] += b.size;
  }
  std::vector<uint8_t> buffer;
  for (const auto& [gpu, total] : per_gpu) {
    // BO entries name GPUs by the process's ids; the engine wants this host's.
    auto device = std::find_if(devices.begin(), devices.end(),
                               [&, gpu = gpu](const auto& d) { return d.user_gpu_id == gpu; });
    if (device == devices.end())
      return Corrupt("BOs on gpu {:#x}, which CHECKPOINT did not list as a device", gpu);
    // One engine per GPU, only for this dump: it holds device handles and dmabufs.
    GPULAZY_ASSIGN_OR_RETURN(std::unique_ptr<DeviceEngine> engine, engines(device->actual_gpu_id));
    GPULAZY_ASSIGN_OR_RETURN(
        image::PagesFileWriter w,
        image::PagesFileWriter::Create(image_dir, static_cast<uint32_t>(id), gpu, total));
    for (size_t i = 0; i < bos.size(); ++i) {
      const auto& b = bos[i];
      if (b.gpu_id != gpu || !criu_format::HasContents(b.alloc_flags)) continue;
      if (b.dmabuf_fd == kKfdInvalidFd)
        return Corrupt("BO at {:#x} has contents but no dmabuf", b.addr);
      const int copy = ::fcntl(static_cast<int>(b.dmabuf_fd), F_DUPFD_CLOEXEC, 0);
      if (copy < 0) return ErrnoError(errno, "dup of the dmabuf of the BO at {:#x}", b.addr);
      const auto index = static_cast<uint32_t>(i);
      GPULAZY_RETURN_IF_ERROR(engine->Bind(index, UniqueFd(copy), b.size));
      constexpr uint64_t kStep = 2u << 20;
      for (uint64_t off = 0; off < b.size; off += kStep) {
        buffer.resize(std::min<uint64_t>(kStep, b.size - off));
        GPULAZY_RETURN_IF_ERROR(engine->ReadBack(index, off, buffer)
                                    .Context(fmt::format("reading the BO at {:#x}", b.addr)));
        GPULAZY_RETURN_IF_ERROR(w.Append(buffer));
      }
      engine->Release(index);
    }
    GPULAZY_RETURN_IF_ERROR(w.Finish());
  }
  GPULAZY_RETURN_IF_ERROR(image::WriteKfdImage(image_dir, static_cast<uint32_t>(id), m));
  spdlog::info("gpulazy: dumped {} ({} BOs on {} GPUs)", criu_format::KfdImageName(id),
               info.num_bos, info.num_devices);
  return Status::Ok();
}

}  // namespace gpulazy::plugin
