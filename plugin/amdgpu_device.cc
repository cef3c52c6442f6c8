// The real AmdgpuDevice over libdrm_amdgpu. Compiled always; never run on this project's
// machines (no AMD GPU): see docs/criu.md.
#include "plugin/amdgpu_device.h"

#include <amdgpu.h>
#include <amdgpu_drm.h>

#include <cstring>
#include <map>
#include <mutex>

namespace gpulazy::plugin {
namespace {

constexpr uint64_t kIbBytes = 64 * 1024;  // room for ~9000 copy packets (18 GiB per submit)

class LibdrmDevice : public AmdgpuDevice {
 public:
  LibdrmDevice(UniqueFd fd, amdgpu_device_handle dev, amdgpu_context_handle ctx, SdmaGeneration gen)
      : fd_(std::move(fd)), dev_(dev), ctx_(ctx), gen_(gen) {}
  ~LibdrmDevice() override {
    std::map<BoHandle, Mapped> left;
    std::map<uint64_t, Mapped> ibs;  // of submissions never seen done (a fence timed out)
    {
      std::lock_guard lock(mutex_);
      left.swap(bos_);
      ibs.swap(ibs_);
    }
    // The kernel keeps what a job still running uses alive; these are our handles only.
    for (auto& [seq, m] : ibs)
      Free(m);
    for (auto& [h, m] : left)
      Free(m);
    amdgpu_cs_ctx_free(ctx_);
    amdgpu_device_deinitialize(dev_);
  }

  SdmaGeneration generation() const override { return gen_; }

  Result<BoHandle> ImportDmabuf(int fd, uint64_t size) override {
    amdgpu_bo_import_result out{};
    int rc =
        amdgpu_bo_import(dev_, amdgpu_bo_handle_type_dma_buf_fd, static_cast<uint32_t>(fd), &out);
    if (rc != 0) return ErrnoError(-rc, "amdgpu_bo_import(dmabuf fd {})", fd);
    return Add(Mapped{out.buf_handle, nullptr, 0, size});
  }

  Result<BoHandle> CreateFromUserMem(void* ptr, uint64_t size) override {
    amdgpu_bo_handle bo = nullptr;
    int rc = amdgpu_create_bo_from_user_mem(dev_, ptr, size, &bo);
    if (rc != 0) return ErrnoError(-rc, "amdgpu_create_bo_from_user_mem({} bytes)", size);
    return Add(Mapped{bo, nullptr, 0, size});
  }

  Result<uint64_t> MapVa(BoHandle h, uint64_t size) override {
    std::lock_guard lock(mutex_);
    auto it = bos_.find(h);
    if (it == bos_.end()) return NotFound("amdgpu BO handle {}", h);
    GPULAZY_RETURN_IF_ERROR(MapLocked(it->second, size));
    return it->second.va;
  }

  void Release(BoHandle h) override {
    Mapped m;
    {
      std::lock_guard lock(mutex_);
      auto it = bos_.find(h);
      if (it == bos_.end()) return;
      m = it->second;
      bos_.erase(it);
    }
    Free(m);
  }

  Result<uint64_t> Submit(std::span<const uint32_t> ib,
                          std::span<const BoHandle> resources) override {
    if (ib.size() * 4 > kIbBytes) return InvalidArgument("IB of {} dwords too large", ib.size());
    // A fresh GTT IB buffer per submission, freed once its fence signals.
    amdgpu_bo_alloc_request req{};
    req.alloc_size = kIbBytes;
    req.phys_alignment = 4096;
    req.preferred_heap = AMDGPU_GEM_DOMAIN_GTT;
    amdgpu_bo_handle ib_bo = nullptr;
    int rc = amdgpu_bo_alloc(dev_, &req, &ib_bo);
    if (rc != 0) return ErrnoError(-rc, "amdgpu_bo_alloc(IB)");
    Mapped ib_mapped{ib_bo, nullptr, 0, kIbBytes};
    void* cpu = nullptr;
    if ((rc = amdgpu_bo_cpu_map(ib_bo, &cpu)) != 0) {
      Free(ib_mapped);
      return ErrnoError(-rc, "amdgpu_bo_cpu_map(IB)");
    }
    std::memcpy(cpu, ib.data(), ib.size() * 4);
    amdgpu_bo_cpu_unmap(ib_bo);
    std::lock_guard lock(mutex_);
    Status mapped = MapLocked(ib_mapped, kIbBytes);
    if (!mapped.ok()) {
      Free(ib_mapped);
      return mapped;
    }
    std::vector<amdgpu_bo_handle> list{ib_bo};
    for (BoHandle h : resources) {
      auto it = bos_.find(h);
      if (it == bos_.end()) {
        Free(ib_mapped);
        return NotFound("amdgpu BO handle {}", h);
      }
      list.push_back(it->second.bo);
    }
    amdgpu_bo_list_handle bo_list = nullptr;
    if ((rc = amdgpu_bo_list_create(dev_, static_cast<uint32_t>(list.size()), list.data(), nullptr,
                                    &bo_list)) != 0) {
      Free(ib_mapped);
      return ErrnoError(-rc, "amdgpu_bo_list_create");
    }
    amdgpu_cs_ib_info ib_info{};
    ib_info.ib_mc_address = ib_mapped.va;
    ib_info.size = static_cast<uint32_t>(ib.size());
    amdgpu_cs_request request{};
    request.ip_type = AMDGPU_HW_IP_DMA;
    request.ring = 0;
    request.resources = bo_list;
    request.number_of_ibs = 1;
    request.ibs = &ib_info;
    rc = amdgpu_cs_submit(ctx_, 0, &request, 1);
    amdgpu_bo_list_destroy(bo_list);
    if (rc != 0) {
      Free(ib_mapped);
      return ErrnoError(-rc, "amdgpu_cs_submit(SDMA)");
    }
    ibs_[request.seq_no] = ib_mapped;
    return request.seq_no;
  }

  Result<bool> WaitFence(uint64_t seq, std::chrono::nanoseconds timeout) override {
    amdgpu_cs_fence fence{};
    fence.context = ctx_;
    fence.ip_type = AMDGPU_HW_IP_DMA;
    fence.ring = 0;
    fence.fence = seq;
    uint32_t expired = 0;
    int rc =
        amdgpu_cs_query_fence_status(&fence, static_cast<uint64_t>(timeout.count()), 0, &expired);
    if (rc != 0) return ErrnoError(-rc, "amdgpu_cs_query_fence_status(seq {})", seq);
    if (!expired) return false;
    Mapped ib;
    {
      std::lock_guard lock(mutex_);
      auto it = ibs_.find(seq);
      if (it == ibs_.end()) return true;
      ib = it->second;
      ibs_.erase(it);
    }
    Free(ib);
    return true;
  }

 private:
  struct Mapped {
    amdgpu_bo_handle bo = nullptr;
    amdgpu_va_handle va_handle = nullptr;
    uint64_t va = 0;
    uint64_t size = 0;
  };

  BoHandle Add(Mapped m) {
    std::lock_guard lock(mutex_);
    BoHandle h = ++next_;
    bos_[h] = m;
    return h;
  }

  Status MapLocked(Mapped& m, uint64_t size) {
    if (m.va != 0) return Status::Ok();
    int rc = amdgpu_va_range_alloc(dev_, amdgpu_gpu_va_range_general, size, 4096, 0, &m.va,
                                   &m.va_handle, 0);
    if (rc != 0) return ErrnoError(-rc, "amdgpu_va_range_alloc({} bytes)", size);
    rc = amdgpu_bo_va_op(m.bo, 0, size, m.va, 0, AMDGPU_VA_OP_MAP);
    if (rc != 0) {
      amdgpu_va_range_free(m.va_handle);
      m.va = 0;
      m.va_handle = nullptr;
      return ErrnoError(-rc, "amdgpu_bo_va_op(MAP {} bytes)", size);
    }
    m.size = size;
    return Status::Ok();
  }

  static void Free(const Mapped& m) {
    if (m.va != 0) {
      amdgpu_bo_va_op(m.bo, 0, m.size, m.va, 0, AMDGPU_VA_OP_UNMAP);
      amdgpu_va_range_free(m.va_handle);
    }
    if (m.bo != nullptr) amdgpu_bo_free(m.bo);
  }

  UniqueFd fd_;
  amdgpu_device_handle dev_;
  amdgpu_context_handle ctx_;
  SdmaGeneration gen_;
  std::mutex mutex_;
  BoHandle next_ = 0;
  std::map<BoHandle, Mapped> bos_;
  std::map<uint64_t, Mapped> ibs_;
};

}  // namespace

Result<std::unique_ptr<AmdgpuDevice>> OpenAmdgpuDevice(UniqueFd render_fd) {
  uint32_t major = 0, minor = 0;
  amdgpu_device_handle dev = nullptr;
  int rc = amdgpu_device_initialize(render_fd.get(), &major, &minor, &dev);
  if (rc != 0) return ErrnoError(-rc, "amdgpu_device_initialize(fd {})", render_fd.get());
  amdgpu_gpu_info info{};
  if ((rc = amdgpu_query_gpu_info(dev, &info)) != 0) {
    amdgpu_device_deinitialize(dev);
    return ErrnoError(-rc, "amdgpu_query_gpu_info");
  }
  amdgpu_context_handle ctx = nullptr;
  if ((rc = amdgpu_cs_ctx_create(dev, &ctx)) != 0) {
    amdgpu_device_deinitialize(dev);
    return ErrnoError(-rc, "amdgpu_cs_ctx_create");
  }
  return std::unique_ptr<AmdgpuDevice>(std::make_unique<LibdrmDevice>(
      std::move(render_fd), dev, ctx, SdmaGenerationForFamily(info.family_id)));
}

}  // namespace gpulazy::plugin
