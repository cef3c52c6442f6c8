// AmdgpuDevice: the seam over libdrm_amdgpu that the SDMA engine needs (design.md 5), one per
// GPU render node. The real implementation (amdgpu_device.cc) is compiled always and never run
// here; tests use a fake that executes the IB's copy packets on host memory.
// Thread-safety: implementations must allow calls from several threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "lazy-server/image/io.h"
#include "plugin/sdma_packets.h"
#include "proto/status.h"

namespace gpulazy::plugin {

using BoHandle = uint64_t;  // opaque; 0 is never a valid handle

class AmdgpuDevice {
 public:
  virtual ~AmdgpuDevice() = default;
  virtual SdmaGeneration generation() const = 0;
  // amdgpu_bo_import(dma-buf fd).
  virtual Result<BoHandle> ImportDmabuf(int fd, uint64_t size) = 0;
  // amdgpu_create_bo_from_user_mem: host memory the DMA engine reads from.
  virtual Result<BoHandle> CreateFromUserMem(void* ptr, uint64_t size) = 0;
  // amdgpu_va_range_alloc + amdgpu_bo_va_op(MAP): the GPU virtual address of the whole BO.
  virtual Result<uint64_t> MapVa(BoHandle bo, uint64_t size) = 0;
  // amdgpu_bo_va_op(UNMAP) + amdgpu_va_range_free + amdgpu_bo_free.
  virtual void Release(BoHandle bo) = 0;
  // Writes `ib` into an IB buffer and submits it on AMDGPU_HW_IP_DMA with `resources` in the
  // BO list (amdgpu_cs_submit); returns the fence's sequence number.
  virtual Result<uint64_t> Submit(std::span<const uint32_t> ib,
                                  std::span<const BoHandle> resources) = 0;
  // amdgpu_cs_query_fence_status: true once signalled, false on timeout.
  virtual Result<bool> WaitFence(uint64_t seq, std::chrono::nanoseconds timeout) = 0;
};

// Opens the render node through libdrm_amdgpu (amdgpu_device_initialize, a context).
Result<std::unique_ptr<AmdgpuDevice>> OpenAmdgpuDevice(UniqueFd render_fd);

}  // namespace gpulazy::plugin
