// PopulateAhead: faults in fresh shared memory (the host engine's memfds) on a thread of its
// own, a little ahead of where the restore is writing, so the thread that receives a chunk
// copies into pages that already exist instead of allocating and zeroing each one as it goes.
//
// Why: on the socket path one thread per session receives every byte, and with fresh memfd
// destinations most of its time goes to the page faults of that copy, not to the copy
// (docs/benchmarks.md, issue 3: a read into fresh memfd pages runs at a third of a read into
// populated ones). The pages would be allocated anyway; this only moves the work off the
// critical thread. It is bounded: at most `ahead_bytes` past the latest write position are
// populated early, so a cancelled restore has allocated at most that much more than it wrote.
//
// The thread runs at a lower priority (nice +10 by default): it is worth having only on cores
// nobody else needs. When the restore's own threads keep every core busy (many sessions, file
// readers) populating early saves nothing (docs/benchmarks.md, issue 3; nice +10 and 0
// measured alike there, the lower priority is kept so that it yields on a busy host).
//
// Correctness never depends on it: a writer that gets ahead simply takes its own faults, and a
// page both touch is allocated once (the kernel's page lock). Kernels without
// MADV_POPULATE_WRITE (before 5.14) make it a no-op after the first attempt.
//
// Thread-safety: every member may be called from any thread. The regions must stay mapped
// until the PopulateAhead is destroyed (the destructor stops and joins the thread).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

namespace gpulazy::client {

class PopulateAhead {
 public:
  // Populates in blocks of this size (a block is the unit of both work and bookkeeping).
  static constexpr uint64_t kBlockBytes = 2u << 20;

  // `ahead_bytes` == 0 disables it (no thread is started). `nice_increment` is added to the
  // thread's nice value (capped at 19).
  explicit PopulateAhead(uint64_t ahead_bytes, int nice_increment = 10);
  ~PopulateAhead();
  PopulateAhead(const PopulateAhead&) = delete;
  PopulateAhead& operator=(const PopulateAhead&) = delete;

  // Stops (and joins) the thread; WritingAt does nothing afterwards. Idempotent.
  void Stop();
  // Paused, the thread ends (joined) and WritingAt does nothing; unpaused, a new thread follows
  // the writes again. For a restore whose count of writers changes (CopyEngine::ExpectWriters).
  // After Stop it does nothing.
  void SetPaused(bool paused);
  // Registers region `id` (a BO number, say). Re-registering an id is ignored.
  void AddRegion(uint32_t id, std::span<uint8_t> memory);
  // Someone is about to write [offset, offset + length) of region `id`: populate what follows,
  // up to `ahead_bytes` past its end. Cheap: records the position and wakes the thread if idle.
  void WritingAt(uint32_t id, uint64_t offset, uint64_t length);

  bool enabled() const { return ahead_bytes_ > 0; }
  // Bytes this thread has populated (whole blocks; tests and summaries).
  uint64_t populated_bytes() const;

 private:
  struct Region {
    std::span<uint8_t> memory;
    std::vector<bool> populated;  // per block
  };
  struct Goal {
    uint32_t id = 0;
    uint64_t from = 0;  // bytes
    uint64_t to = 0;
    uint64_t generation = 0;
  };

  void Run();

  const uint64_t ahead_bytes_;
  const int nice_increment_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::map<uint32_t, Region> regions_;
  Goal goal_;
  uint64_t done_generation_ = 0;  // the goal generation the thread has finished
  uint64_t populated_bytes_ = 0;
  bool unsupported_ = false;
  bool stopping_ = false;
  bool paused_ = false;
  std::mutex join_mu_;  // serializes Stop's join
  std::thread thread_;  // last: started after every member above exists
};

}  // namespace gpulazy::client
