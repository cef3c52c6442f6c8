// The fake KFD driver: enforces the CRIU ioctl contract of kfd.h (bucket layout, op order,
// errno values) without a GPU. BOs are memfds, so bytes written into their "dmabuf" fds are
// observable by the restored task. State shared between the restored task (RESTORE) and
// CRIU's master (RESUME) lives in files under the state directory, as the real driver's state
// lives in the kernel.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <vector>

#include "lazy-server/image/criu_checkpoint.h"
#include "plugin/kfd.h"
#include "plugin/topology.h"
#include "proto/criu_file.h"

namespace gpulazy::plugin {
namespace {
namespace fs = std::filesystem;

constexpr const char* kFakeKfdName = "gpulazy-fake-kfd";
constexpr uint64_t kMaxPrivData = 1ull << 30;
constexpr uint64_t kRestoredOffsetBias = 1ull << 40;

std::string FdTarget(int fd) {
  char buf[256];
  std::string link = "/proc/self/fd/" + std::to_string(fd);
  ssize_t n = ::readlink(link.c_str(), buf, sizeof(buf) - 1);
  return n < 0 ? std::string() : std::string(buf, static_cast<size_t>(n));
}

Result<UniqueFd> MakeMemfd(const std::string& name, uint64_t size) {
  int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "memfd_create {}", name);
  UniqueFd owned(fd);
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0)
    return ErrnoError(errno, "ftruncate {}", name);
  return owned;
}

class FakeKfd : public Kfd {
 public:
  FakeKfd(fs::path state, UniqueFd fd, bool owned)
      : state_(std::move(state)), fd_(std::move(fd)), owned_(owned) {}
  ~FakeKfd() override {
    if (!owned_) (void)fd_.release();
  }
  int fd() const override { return fd_.get(); }

  int CriuOp(kfd_ioctl_criu_args& a) override {
    // The order of calls, for tests: one op name per line in ops-<pid>.
    std::ofstream(state_ / ("ops-" + std::to_string(::getpid())), std::ios::app)
        << CriuOpName(a.op) << "\n";
    switch (a.op) {
      case KFD_CRIU_OP_PROCESS_INFO:
        return ProcessInfo(a);
      case KFD_CRIU_OP_CHECKPOINT:
        return Checkpoint(a);
      case KFD_CRIU_OP_UNPAUSE:
        if (!paused_) return -EINVAL;
        paused_ = false;
        return 0;
      case KFD_CRIU_OP_RESTORE:
        return Restore(a);
      case KFD_CRIU_OP_RESUME:
        return Resume(a);
      default:
        return -EINVAL;
    }
  }

 private:
  int ProcessInfo(kfd_ioctl_criu_args& a) {
    if (paused_) return -EINVAL;  // already paused: the driver refuses a second PROCESS_INFO
    auto cp = image::CriuCheckpoint::Open(state_ / "live");
    if (!cp.ok() || cp->processes().empty()) return -ESRCH;  // no GPU state to checkpoint
    live_ = std::move(*cp);
    const criu::KfdProcess& m = live_->processes().front().message;
    a.num_devices = static_cast<uint32_t>(m.devices_size());
    a.num_bos = static_cast<uint32_t>(m.bos_size());
    a.num_objects = m.object_count();
    a.priv_data_size = m.driver_private().size();
    a.pid = m.pid();
    paused_ = true;
    return 0;
  }

  int Checkpoint(kfd_ioctl_criu_args& a) {
    if (!paused_ || !live_) return -EINVAL;
    const criu::KfdProcess& m = live_->processes().front().message;
    if (a.num_devices != static_cast<uint32_t>(m.devices_size()) ||
        a.num_bos != static_cast<uint32_t>(m.bos_size()) || a.num_objects != m.object_count() ||
        a.priv_data_size != m.driver_private().size())
      return -EINVAL;
    if ((a.num_devices && !a.devices) || (a.num_bos && !a.bos) ||
        (a.priv_data_size && !a.priv_data))
      return -EFAULT;
    auto* devices = reinterpret_cast<kfd_criu_device_bucket*>(a.devices);
    for (int i = 0; i < m.devices_size(); ++i) {
      devices[i] = {};
      devices[i].user_gpu_id = m.devices(i).gpu_id();
      devices[i].actual_gpu_id = m.devices(i).gpu_id();
    }
    auto* bos = reinterpret_cast<kfd_criu_bo_bucket*>(a.bos);
    size_t content = 0;
    const auto& content_bos = live_->content_bos();
    for (int i = 0; i < m.bos_size(); ++i) {
      const criu::KfdBo& bo = m.bos(i);
      kfd_criu_bo_bucket& b = bos[i];
      b = {};
      b.addr = bo.gpu_va();
      b.size = bo.size();
      b.offset = bo.mmap_offset();
      b.gpu_id = bo.gpu_id();
      b.alloc_flags = bo.alloc_flags();
      b.dmabuf_fd = kKfdInvalidFd;
      if (!criu_format::HasContents(bo.alloc_flags())) continue;
      if (content >= content_bos.size()) return -EIO;
      const image::ContentBo& cb = content_bos[content++];
      auto memfd = MakeMemfd("gpulazy-bo-" + std::to_string(i), bo.size());
      if (!memfd.ok()) return -ENOMEM;
      std::vector<uint8_t> bytes(cb.size);
      auto in = OpenForRead(live_->dir() / cb.pages_file);
      if (!in.ok() ||
          !ReadExactAt(in->get(), criu_format::kHeaderSize + cb.pages_offset, bytes, cb.pages_file)
               .ok() ||
          !WriteAllAt(memfd->get(), 0, bytes, "bo").ok())
        return -EIO;
      b.dmabuf_fd = static_cast<uint32_t>(memfd->release());  // the caller owns it
    }
    if (a.priv_data_size)
      std::memcpy(reinterpret_cast<void*>(a.priv_data), m.driver_private().data(),
                  a.priv_data_size);
    return 0;
  }

  int Restore(kfd_ioctl_criu_args& a) {
    if (restored_) return -EINVAL;  // one RESTORE per KFD file
    if ((a.num_devices && !a.devices) || (a.num_bos && !a.bos) ||
        (a.priv_data_size && !a.priv_data))
      return -EINVAL;
    if (a.priv_data_size > kMaxPrivData) return -EINVAL;
    std::set<uint32_t> local;
    if (auto topo = ReadTopology(state_ / "topology"); topo.ok())
      for (const LocalGpu& g : *topo)
        local.insert(g.gpu_id);
    std::set<uint32_t> user_ids;
    const auto* devices = reinterpret_cast<const kfd_criu_device_bucket*>(a.devices);
    for (uint32_t i = 0; i < a.num_devices; ++i) {
      if (!local.count(devices[i].actual_gpu_id)) return -EINVAL;  // no such local GPU
      if (::fcntl(static_cast<int>(devices[i].drm_fd), F_GETFD) < 0) return -EBADF;
      if (!user_ids.insert(devices[i].user_gpu_id).second) return -EINVAL;
    }
    auto* bos = reinterpret_cast<kfd_criu_bo_bucket*>(a.bos);
    for (uint32_t i = 0; i < a.num_bos; ++i) {
      if (!user_ids.count(bos[i].gpu_id) || bos[i].size == 0 || bos[i].size % 4096 != 0)
        return -EINVAL;
    }
    std::vector<UniqueFd> made;
    for (uint32_t i = 0; i < a.num_bos; ++i) {
      kfd_criu_bo_bucket& b = bos[i];
      b.restored_offset = b.offset + kRestoredOffsetBias;
      b.dmabuf_fd = kKfdInvalidFd;
      if (!criu_format::HasContents(b.alloc_flags)) continue;
      auto memfd = MakeMemfd("gpulazy-bo-" + std::to_string(i), b.size);
      if (!memfd.ok()) return -ENOMEM;
      int exported = ::fcntl(memfd->get(), F_DUPFD_CLOEXEC, 0);
      if (exported < 0) return -errno;
      b.dmabuf_fd = static_cast<uint32_t>(exported);
      made.push_back(std::move(*memfd));  // the driver keeps the BO alive
    }
    bos_ = std::move(made);
    restored_ = true;
    // What RESUME checks for, and what a test compares UPDATE_VMA_MAP's answers with: one line
    // per BO, "gpu_va old_offset restored_offset" in hex.
    std::ofstream out(state_ / ("restored-" + std::to_string(::getpid())));
    for (uint32_t i = 0; i < a.num_bos; ++i)
      out << std::hex << bos[i].addr << " " << bos[i].offset << " " << bos[i].restored_offset
          << "\n";
    return 0;
  }

  int Resume(kfd_ioctl_criu_args& a) {
    fs::path restored = state_ / ("restored-" + std::to_string(a.pid));
    fs::path resumed = state_ / ("resumed-" + std::to_string(a.pid));
    std::error_code ec;
    if (!fs::exists(restored, ec)) return -ESRCH;  // no KFD process for that pid
    if (fs::exists(resumed, ec)) return -EINVAL;
    std::ofstream(resumed) << "resumed\n";
    return 0;
  }

  fs::path state_;
  UniqueFd fd_;
  bool owned_;
  bool paused_ = false;
  bool restored_ = false;
  std::optional<image::CriuCheckpoint> live_;
  std::vector<UniqueFd> bos_;
};

// The fake render node's GEM objects: memfds by handle, VA ranges of this file.
class FakeDrmFile : public DrmFile {
 public:
  explicit FakeDrmFile(fs::path state) : state_(std::move(state)) {}

  Result<uint32_t> Create(uint64_t size, uint64_t alignment, uint32_t domains,
                          uint64_t domain_flags) override {
    (void)domain_flags;                     // creation flags only steer placement
    constexpr uint32_t kAllDomains = 0x3f;  // AMDGPU_GEM_DOMAIN_MASK
    if (size == 0 || size % 4096 != 0 || (alignment & (alignment - 1)) != 0 || domains == 0 ||
        (domains & ~kAllDomains) != 0)
      return ErrnoError(EINVAL, "fake GEM_CREATE: size {} alignment {} domains {:#x}", size,
                        alignment, domains);
    GPULAZY_ASSIGN_OR_RETURN(UniqueFd memfd,
                             MakeMemfd("gpulazy-drm-bo-" + std::to_string(next_), size));
    Log(fmt::format("bo {:x} {:x}", next_, memfd.get()));
    bos_.emplace(next_, Bo{std::move(memfd), size});
    return next_++;
  }
  Status ChangeHandle(uint32_t handle, uint32_t new_handle) override {
    auto it = bos_.find(handle);
    if (it == bos_.end() || new_handle == 0)
      return ErrnoError(EINVAL, "fake GEM_CHANGE_HANDLE {} -> {}", handle, new_handle);
    if (bos_.count(new_handle) != 0)
      return ErrnoError(EEXIST, "fake GEM_CHANGE_HANDLE {} -> {}: in use", handle, new_handle);
    Bo bo = std::move(it->second);
    bos_.erase(it);
    Log(fmt::format("mv {:x} {:x}", handle, new_handle));
    bos_.emplace(new_handle, std::move(bo));
    return Status::Ok();
  }
  Result<UniqueFd> Export(uint32_t handle) override {
    GPULAZY_ASSIGN_OR_RETURN(Bo * bo, Find(handle));
    int fd = ::fcntl(bo->memfd.get(), F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return ErrnoError(errno, "fake PRIME_HANDLE_TO_FD {}", handle);
    return UniqueFd(fd);
  }
  Result<uint64_t> MmapOffset(uint32_t handle) override {
    GPULAZY_ASSIGN_OR_RETURN(Bo * bo, Find(handle));
    (void)bo;
    return kRestoredOffsetBias + (static_cast<uint64_t>(handle) << 32);
  }
  Status MapVa(uint32_t handle, uint64_t va, uint64_t offset_in_bo, uint64_t size,
               uint64_t flags) override {
    (void)flags;
    GPULAZY_ASSIGN_OR_RETURN(Bo * bo, Find(handle));
    if (size == 0 || va % 4096 != 0 || size % 4096 != 0 || offset_in_bo % 4096 != 0 ||
        offset_in_bo > bo->size || size > bo->size - offset_in_bo || va + size < va)
      return ErrnoError(EINVAL, "fake GEM_VA of handle {} at {:#x}: {} bytes at offset {}", handle,
                        va, size, offset_in_bo);
    auto next = vas_.lower_bound(va);
    if ((next != vas_.end() && next->first < va + size) ||
        (next != vas_.begin() && std::prev(next)->second > va))
      return ErrnoError(EINVAL, "fake GEM_VA of handle {} at {:#x}: overlaps a mapping", handle,
                        va);
    vas_[va] = va + size;
    Log(fmt::format("va {:x} {:x} {:x} {:x}", handle, va, offset_in_bo, size));
    return Status::Ok();
  }
  void Close(uint32_t handle) override {
    if (bos_.erase(handle) != 0) Log(fmt::format("close {:x}", handle));
  }

 private:
  struct Bo {
    UniqueFd memfd;
    uint64_t size = 0;
  };
  Result<Bo*> Find(uint32_t handle) {
    auto it = bos_.find(handle);
    if (it == bos_.end()) return ErrnoError(ENOENT, "fake GEM handle {} does not exist", handle);
    return &it->second;
  }
  void Log(const std::string& line) {
    std::ofstream(state_ / ("drm-" + std::to_string(::getpid())), std::ios::app) << line << "\n";
  }

  fs::path state_;
  uint32_t next_ = 1;
  std::map<uint32_t, Bo> bos_;
  std::map<uint64_t, uint64_t> vas_;  // start -> end
};

class FakeKfdProvider : public KfdProvider {
 public:
  FakeKfdProvider(fs::path state, fs::path dri_root)
      : state_(std::move(state)), dri_root_(std::move(dri_root)) {}
  std::string_view name() const override { return "fake-kfd"; }
  Result<std::unique_ptr<Kfd>> Open() override {
    GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, MakeMemfd(kFakeKfdName, 0));
    return std::unique_ptr<Kfd>(std::make_unique<FakeKfd>(state_, std::move(fd), true));
  }
  Result<std::unique_ptr<Kfd>> Attach(int fd) override {
    if (!IsKfd(fd)) return InvalidArgument("fd {} is not a (fake) KFD file", fd);
    return std::unique_ptr<Kfd>(std::make_unique<FakeKfd>(state_, UniqueFd(fd), false));
  }
  bool IsKfd(int fd) const override { return IsKfdPath(FdTarget(fd)); }
  bool IsKfdPath(const std::string& path) const override {
    return path == "/dev/kfd" || path.find(kFakeKfdName) != std::string::npos;
  }
  Result<UniqueFd> OpenRenderNode(uint32_t minor) override {
    const fs::path node = dri_root_ / ("renderD" + std::to_string(minor));
    std::error_code ec;
    if (!fs::exists(node, ec)) return MakeMemfd("gpulazy-fake-renderD" + std::to_string(minor), 0);
    int fd = ::open(node.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return ErrnoError(errno, "open {}", node.string());
    return UniqueFd(fd);
  }
  std::unique_ptr<DrmFile> AttachDrm(int render_fd) override {
    (void)render_fd;
    return std::make_unique<FakeDrmFile>(state_);
  }
  bool real() const override { return false; }

 private:
  fs::path state_;
  fs::path dri_root_;
};

}  // namespace

std::unique_ptr<KfdProvider> MakeFakeKfdProvider(const std::string& state_dir,
                                                 std::string dri_root) {
  return std::make_unique<FakeKfdProvider>(state_dir, std::move(dri_root));
}

}  // namespace gpulazy::plugin
