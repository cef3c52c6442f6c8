// Router: the CopyEngine the master's RestoreSession writes into. It routes each BO's writes to
// the DeviceEngine of the GPU the BO was restored on, once the restored task has handed the
// BO's dmabuf over (handoff.h). Writes that arrive earlier are parked (the session keeps their
// bytes alive and withholds their credit, so parking is bounded by the credit window) and
// replayed at Bind. In a restored task (eager mode with a server) BOs of other tasks are
// discarded instead.
// Thread-safety: Write/Flush one call at a time (the session serializes the engine calls of its
// stream and demand threads), Bind/FailParked from any thread.
#pragma once

#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <vector>

#include "plugin/device_engine.h"

namespace gpulazy::plugin {

class Router : public client::CopyEngine {
 public:
  explicit Router(bool discard_unbound) : discard_unbound_(discard_unbound) {}
  std::string_view name() const override { return "router"; }
  Status AddDestination(uint32_t bo, uint64_t size) override;
  Status Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw,
               client::CopyDone done) override;
  Status Flush() override;
  // Remembered: the device engines come later, one per GPU as its first BO is handed over, and
  // each is asked at its first Bind (which fails if the engine cannot stage such chunks, before
  // the task may run). Engines already bound are asked at once.
  Status ExpectChunkBytes(uint32_t max_bytes) override;

  // Binds BO `bo` (the session's index) to `engine` with its dmabuf and replays parked writes.
  Status Bind(uint32_t bo, DeviceEngine* engine, UniqueFd dmabuf, uint64_t size);
  // Stops delivering to `bos` (their task died): parked and later writes to them complete at
  // once as if they had landed, so the session counts them resident and never fetches them
  // again, and their engines release the dmabufs. A later Bind of one of them just closes the
  // dmabuf. Returns how many parked writes were discarded.
  size_t Drop(const std::vector<uint32_t>& bos);
  // Completes every parked write with `why` (the restore is being abandoned) and
  // closes the router to unbound BOs: later writes to them fail at once instead of parking, so
  // no callback can outlive the session that owns it.
  void FailParked(const Status& why);
  size_t parked() const;

 private:
  struct Parked {
    uint64_t offset;
    std::span<const uint8_t> raw;
    client::CopyDone done;
  };
  // What an engine's refused write of BO `bo` means: nothing, where Drop() released the BO
  // meanwhile (its task died), else `refused`.
  Status UnlessDropped(uint32_t bo, Status refused) const;

  mutable std::mutex mutex_;
  bool discard_unbound_;
  Status closed_;  // not ok once FailParked ran
  std::map<uint32_t, uint64_t> sizes_;
  std::map<uint32_t, DeviceEngine*> bound_;
  std::set<uint32_t> dropped_;
  std::map<uint32_t, std::vector<Parked>> parked_;
  std::vector<DeviceEngine*> engines_;
  std::optional<uint32_t> chunk_bytes_;  // from ExpectChunkBytes
};

}  // namespace gpulazy::plugin
