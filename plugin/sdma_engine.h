// SdmaCopyEngine: the CopyEngine that puts verified chunks into VRAM/GTT BOs with the GPU's
// SDMA engine (design.md 5). Unlike upstream CRIU, which waits for each chunk's fence before it
// reads the next, it pipelines: several pinned staging slots, so the session keeps receiving
// and decoding while copies run; fences are reaped on a reaper thread, which runs the `done`
// callbacks and starts queued writes as slots free up. Write never blocks on the GPU.
// Thread-safety: as CopyEngine (Write/Flush from one thread; Bind from any thread).
#pragma once

#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "plugin/amdgpu_device.h"
#include "plugin/device_engine.h"

namespace gpulazy::plugin {

struct SdmaOptions {
  uint32_t staging_slots = 4;
  uint64_t slot_bytes = 8u << 20;  // the largest single Write (a chunk)
  std::chrono::milliseconds fence_timeout{10'000};
};

struct SdmaStats {
  uint64_t submits = 0;
  uint64_t queued_writes = 0;      // writes that waited for a free slot
  uint32_t max_in_flight = 0;      // most submissions outstanding at once
  uint64_t reaped_async = 0;       // completions delivered by the reaper thread
  uint32_t quarantined_slots = 0;  // never reused: their copy's fence did not signal
};

class SdmaCopyEngine : public DeviceEngine {
 public:
  static Result<std::unique_ptr<SdmaCopyEngine>> Create(std::unique_ptr<AmdgpuDevice> device,
                                                        SdmaOptions options = {});
  ~SdmaCopyEngine() override;

  std::string_view name() const override { return "sdma"; }
  Status Bind(uint32_t bo, UniqueFd dmabuf, uint64_t size) override;
  // Refuses writes to `bo` from now on; once every write to it already accepted has completed,
  // its handle and VA mapping are released and its dmabuf closed (never earlier: unmapping a VA
  // a submitted copy still targets would fault the GPU).
  void Release(uint32_t bo) override;
  Status Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw,
               client::CopyDone done) override;
  Status Flush() override;
  // The staging slots are made at Create: chunks larger than a slot are refused here, when the
  // restore opens its image, instead of at the first write of one.
  Status ExpectChunkBytes(uint32_t max_bytes) override;
  // Copies the BO back into host memory by SDMA, slot by slot (BO -> staging slot -> `out`),
  // waiting for each copy. Flushes first, so it reads what earlier writes put there. Not for
  // use while other threads write.
  Status ReadBack(uint32_t bo, uint64_t offset, std::span<uint8_t> out) override;
  SdmaStats stats() const;

 private:
  struct Slot {
    uint8_t* host = nullptr;
    BoHandle handle = 0;
    uint64_t va = 0;
  };
  struct Target {
    UniqueFd fd;
    BoHandle handle = 0;
    uint64_t va = 0;
    uint64_t size = 0;
    uint32_t accepted = 0;  // writes accepted (queued or in flight) whose copy has not completed
    bool released = false;  // Release was called: let go once `accepted` is 0
  };
  struct Pending {
    uint32_t bo;
    uint64_t offset;
    std::span<const uint8_t> raw;
    client::CopyDone done;
  };
  struct InFlight {
    uint64_t seq;
    size_t slot;
    uint32_t bo;
    client::CopyDone done;
  };

  SdmaCopyEngine(std::unique_ptr<AmdgpuDevice> device, SdmaOptions options);
  Status Init();
  // Copies into a free slot and submits; caller holds mutex_ and has checked a slot is free.
  Status LaunchLocked(const Pending& write, client::CopyDone& done);
  void ReaperLoop();
  // A write accepted for `bo` has completed (or failed to launch); `copied`: its copy is known
  // to be over, so a released BO may go. Caller holds mutex_.
  void SettleLocked(uint32_t bo, bool copied);

  std::unique_ptr<AmdgpuDevice> device_;
  SdmaOptions options_;
  void* staging_ = nullptr;
  std::vector<Slot> slots_;

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<size_t> free_slots_;
  std::map<uint32_t, Target> targets_;
  std::deque<Pending> pending_;
  std::deque<InFlight> in_flight_;
  Status first_error_;
  // Set once a fence did not signal (or could not be waited for): that copy may still run and
  // read its staging slot, so the slot is never reused, and the engine takes no more work (a
  // stalled ring would not run it either). Every write still queued fails with this.
  Status broken_;
  uint64_t outstanding_ = 0;  // accepted writes whose `done` has not returned yet
  SdmaStats stats_;
  bool stopping_ = false;
  std::thread reaper_;
};

}  // namespace gpulazy::plugin
