// DeviceEngine: a CopyEngine whose destinations are BOs the KFD restored, handed over as dmabuf
// fds (one engine per GPU). Bind() attaches a BO's dmabuf before writes to it; the host
// implementation (tests, CI) writes into the fd with pwrite (the fake KFD's dmabufs are
// memfds); the SDMA one (sdma_engine.h) imports the dmabuf into libdrm_amdgpu.
// Thread-safety: as CopyEngine; Bind may run concurrently with Write for other BOs.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>

#include "lazy-server/image/io.h"
#include "page-client/copy_engine.h"

namespace gpulazy::plugin {

class DeviceEngine : public client::CopyEngine {
 public:
  // Takes ownership of `dmabuf`. AddDestination is not used by device engines: a destination
  // exists once bound.
  virtual Status Bind(uint32_t bo, UniqueFd dmabuf, uint64_t size) = 0;
  // Lets go of BO `bo` (its task died): once writes to it already accepted have completed, the
  // dmabuf is closed, so the driver can free the memory. Called after the last Write to `bo`
  // was issued. The default keeps the BO until the engine goes away.
  virtual void Release(uint32_t bo) { (void)bo; }
  Status AddDestination(uint32_t bo, uint64_t size) override { return Status::Ok(); }
  // Reads [offset, offset + out.size()) of a bound BO back, to check a copy that must be
  // checked before anything runs (render-node BOs). kUnsupported where reading back needs a
  // DMA of its own (SDMA: not implemented yet).
  virtual Status ReadBack(uint32_t bo, uint64_t offset, std::span<uint8_t> out) {
    (void)bo, (void)offset, (void)out;
    return Unsupported("{} engine: no read-back", name());
  }
};

// Makes the engine for a local GPU (SDMA on hardware, host in tests): the master's coordinator
// and an eager task's own copy both use it, so eager mode copies the way the hardware allows.
using EngineFactory = std::function<Result<std::unique_ptr<DeviceEngine>>(uint32_t local_gpu_id)>;

class HostDmabufEngine : public DeviceEngine {
 public:
  std::string_view name() const override { return "host-dmabuf"; }
  Status Bind(uint32_t bo, UniqueFd dmabuf, uint64_t size) override;
  void Release(uint32_t bo) override;
  Status Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw,
               client::CopyDone done) override;
  Status Flush() override { return Status::Ok(); }
  Status ReadBack(uint32_t bo, uint64_t offset, std::span<uint8_t> out) override;

 private:
  struct Target {
    UniqueFd fd;
    uint64_t size = 0;
  };
  // The bound BO, checked to hold [offset, offset + length); `what` names the access in errors.
  Result<std::shared_ptr<Target>> Range(uint32_t bo, uint64_t offset, uint64_t length,
                                        std::string_view what);
  std::mutex mutex_;
  std::map<uint32_t, std::shared_ptr<Target>> targets_;
};

}  // namespace gpulazy::plugin
