// FakeAmdgpuDevice: an AmdgpuDevice whose "GPU" is a thread that decodes each submitted IB
// (checking packet format, NOP padding and the count encoding of its SDMA generation) and
// performs the copies on host memory after a delay, so fences complete asynchronously.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "plugin/amdgpu_device.h"

namespace gpulazy::plugin::testing {

class FakeAmdgpuDevice : public AmdgpuDevice {
 public:
  FakeAmdgpuDevice(SdmaGeneration gen, std::chrono::microseconds latency);
  ~FakeAmdgpuDevice() override;
  SdmaGeneration generation() const override { return gen_; }
  Result<BoHandle> ImportDmabuf(int fd, uint64_t size) override;
  Result<BoHandle> CreateFromUserMem(void* ptr, uint64_t size) override;
  Result<uint64_t> MapVa(BoHandle bo, uint64_t size) override;
  void Release(BoHandle bo) override;
  Result<uint64_t> Submit(std::span<const uint32_t> ib,
                          std::span<const BoHandle> resources) override;
  Result<bool> WaitFence(uint64_t seq, std::chrono::nanoseconds timeout) override;

  // While held, the "GPU" completes nothing (submissions still queue): a test can see what is
  // in flight at once without racing the device's latency.
  void HoldCompletions(bool hold);
  uint32_t max_outstanding() const;
  size_t live_bos() const;
  // Releases of a BO that a submitted, unfinished copy still uses. On hardware that unmaps a VA
  // the GPU is about to touch (a GPU page fault), so it is a breach of the driver's contract:
  // counted, and the BO kept so this fake's "GPU" can still finish the copy.
  uint32_t busy_releases() const;
  // Outlives the device: the BOs still live when it was destroyed (SIZE_MAX until then), so a
  // test can check that the engine released everything before it released the device.
  std::shared_ptr<std::atomic<size_t>> live_bos_at_destruction() const { return live_at_exit_; }

 private:
  struct Bo {
    uint8_t* host = nullptr;
    uint64_t size = 0;
    uint64_t va = 0;
    bool mapped_fd = false;
  };
  void Run();
  uint8_t* Translate(uint64_t va, uint64_t len);

  SdmaGeneration gen_;
  std::chrono::microseconds latency_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::map<BoHandle, Bo> bos_;
  std::shared_ptr<std::atomic<size_t>> live_at_exit_ =
      std::make_shared<std::atomic<size_t>>(SIZE_MAX);
  BoHandle next_ = 0;
  uint64_t next_va_ = 1ull << 32;
  struct Submission {
    uint64_t seq = 0;
    std::vector<uint32_t> ib;
    std::vector<BoHandle> resources;
  };
  std::deque<Submission> queue_;
  uint32_t busy_releases_ = 0;
  uint64_t next_seq_ = 0;
  uint64_t completed_ = 0;
  uint32_t max_outstanding_ = 0;
  bool stop_ = false;
  bool held_ = false;
  std::thread gpu_;
};

}  // namespace gpulazy::plugin::testing
