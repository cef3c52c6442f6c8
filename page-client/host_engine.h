// HostCopyEngine: the embedded CopyEngine where "device memory" is host memory, one memfd per
// BO (mapped shared, so the userfaultfd pager and demos can map or pass the same memory).
// Writes are memcpy and complete inside Write. Every write is bounds-checked. The session may
// also receive RAW chunks straight into the memfds (ReceiveTarget), verifying them in place.
// A helper thread faults the memfds' pages in just ahead of the writes (PopulateAhead).
// Thread-safety: as CopyEngine; Write may also run concurrently for disjoint ranges, and the
// accessors are safe once AddDestination has returned.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>

#include "page-client/copy_engine.h"
#include "page-client/populate_ahead.h"

namespace gpulazy::client {

// One memfd of `size` bytes mapped read-write shared. Move-only; closes and unmaps on
// destruction.
class MemfdRegion {
 public:
  MemfdRegion() = default;
  static Result<MemfdRegion> Create(const std::string& name, uint64_t size);
  MemfdRegion(MemfdRegion&& other) noexcept;
  MemfdRegion& operator=(MemfdRegion&& other) noexcept;
  MemfdRegion(const MemfdRegion&) = delete;
  MemfdRegion& operator=(const MemfdRegion&) = delete;
  ~MemfdRegion();

  int fd() const { return fd_; }
  uint64_t size() const { return size_; }
  std::span<uint8_t> bytes() const { return {data_, static_cast<size_t>(size_)}; }

 private:
  void Reset();

  int fd_ = -1;
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;
};

struct HostEngineOptions {
  // Let the session receive RAW chunks straight into the memfds (CopyEngine::ReceiveTarget):
  // one copy fewer per byte. Safe as long as nobody reads a chunk's bytes before the session
  // reports it resident (the contract of this engine's Mapping/Fd: the bytes of a chunk that is
  // not resident are unspecified; they are zeros or an in-progress, unverified receive).
  bool receive_in_place = true;
  // Fault destination pages in on a helper thread up to this many bytes past each write
  // (PopulateAhead), so the receiving thread copies into existing pages; 0 turns it off.
  uint64_t populate_ahead_bytes = 32u << 20;
  // Added to that thread's nice value: it should use only cores the restore leaves idle.
  int populate_nice = 10;
  // A chunk whose destination pages do not exist yet is written through the memfd's file
  // (pwrite) instead of the mapping, and ReceiveTarget declines it (the session receives it
  // into a reused staging buffer and calls Write). The kernel then allocates each page and
  // copies into it, without first zeroing it and without a page fault per 4 KiB page: a
  // demand chunk at a random offset, which nothing populated ahead, costs about half as much
  // (docs/benchmarks.md, "Fresh pages by write"). Pages that exist (populated ahead, say)
  // still take the chunk in place or by memcpy.
  bool write_fresh_pages = true;
  // With several writers (ExpectWriters above 1: lanes, file readers) `pwrite` into one memfd
  // serializes them on its inode lock, which halved one restore with eight lanes or its file
  // readers (docs/benchmarks.md, "Session 27"). So by default such chunks go through the
  // mapping (kMap); kOnePerBo writes a fresh chunk through the file only while no other chunk
  // of that BO is on its way there (the rest go through the mapping); kWrite always does.
  // kOnePerBo made eight concurrent restores by reference 12 % faster on less CPU, left one
  // restore as fast, was mixed over sockets and lengthened the demand tail while a stream ran
  // (a demand chunk can end up waiting for a background pwrite): not the default.
  enum class FreshPages { kMap, kOnePerBo, kWrite };
  FreshPages fresh_pages_with_several_writers = FreshPages::kMap;
  // PrepareDestination faults in the missing pages of a range a caller waits for (the thread
  // that called Ensure, idle until the chunk arrives), so the chunk's page allocation overlaps
  // its round trip to the server instead of following it (docs/client.md, "Fresh pages").
  bool prepare_waited_ranges = true;
  // Offer the memfds to a page server that places chunks itself (ExportDestination, "memfd").
  bool export_for_placement = true;
};

class HostCopyEngine : public CopyEngine {
 public:
  HostCopyEngine() : HostCopyEngine(HostEngineOptions{}) {}
  explicit HostCopyEngine(HostEngineOptions options)
      : options_(options), populate_(options.populate_ahead_bytes, options.populate_nice) {}

  std::string_view name() const override { return "host"; }
  Status AddDestination(uint32_t bo, uint64_t size) override;
  Status Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw, CopyDone done) override;
  // Zero chunks: the whole pages of the range are punched out of the memfd (FALLOC_FL_PUNCH_HOLE:
  // they read as zeros and hold no memory until something writes them), the rest memset. A
  // mostly-zero BO (a KV-cache pool) then costs no memory for its zeros.
  bool WritesZeros() const override { return true; }
  Status WriteZeros(uint32_t bo, uint64_t offset, uint64_t length, CopyDone done) override;
  Status Flush() override { return Status::Ok(); }
  std::optional<std::span<uint8_t>> ReceiveTarget(uint32_t bo, uint64_t offset,
                                                  uint64_t length) override;
  Status CommitReceived(uint32_t bo, uint64_t offset, uint64_t length, CopyDone done) override;
  void PrepareDestination(uint32_t bo, uint64_t offset, uint64_t length) override;
  // With export_for_placement: the BO's memfd, by its descriptor number ("memfd"), for a page
  // server on this host to take (pidfd_getfd) and write.
  std::optional<PlacementExport> ExportDestination(uint32_t bo) override;
  // Several writers take their own page faults in parallel, so the populate helper is paused:
  // it has nothing to do they do not do already (docs/benchmarks.md, issue 3: measured 10 %
  // slower with it by reference in session 7; within noise in session 8). Fresh pages then go
  // as fresh_pages_with_several_writers says (by default through the mapping: pwrite from
  // several writers serializes them, session 27). Told one writer again (a server that refused
  // the image files), the engine goes back to both.
  void ExpectWriters(uint32_t writers) override {
    const bool several = writers > 1;
    populate_.SetPaused(several);
    using FreshPages = HostEngineOptions::FreshPages;
    const FreshPages mode = !options_.write_fresh_pages ? FreshPages::kMap
                            : several                   ? options_.fresh_pages_with_several_writers
                                                        : FreshPages::kWrite;
    fresh_pages_.store(mode, std::memory_order_relaxed);
  }
  // Writes to disjoint ranges touch no shared state but the BO map (locked) and counters.
  bool ConcurrentCalls() const override { return true; }

  // The BO's memory: kNotFound for a BO without a destination.
  Result<std::span<uint8_t>> Mapping(uint32_t bo) const;
  // The BO's memfd (owned by the engine; dup it to keep it past the engine's life).
  Result<int> Fd(uint32_t bo) const;
  uint64_t bytes_written() const;
  // Of bytes_written, the bytes of zero chunks (WriteZeros).
  uint64_t bytes_zeroed() const { return bytes_zeroed_.load(std::memory_order_relaxed); }
  // Bytes the populate-ahead thread faulted in (0 when it is off).
  uint64_t populated_bytes() const { return populate_.populated_bytes(); }
  // Bytes PrepareDestination faulted in (whole pieces it found missing).
  uint64_t prepared_bytes() const { return prepared_bytes_.load(std::memory_order_relaxed); }
  // How long a fresh chunk's claim on its BO's file lasts without its Write (kOnePerBo).
  static constexpr std::chrono::milliseconds kFileWriteClaim{20};

 private:
  struct Destination {
    explicit Destination(MemfdRegion m) : memfd(std::move(m)) {}
    MemfdRegion memfd;
    // kOnePerBo: the chunk whose write through this memfd is claimed, from ReceiveTarget's
    // decline to the end of its Write's pwrite. The claim lapses after kFileWriteClaim, so a
    // chunk whose receive failed (and never reaches Write) holds nobody up for long.
    std::mutex claim_mu;
    bool claimed = false;
    uint64_t claim_offset = 0;
    std::chrono::steady_clock::time_point claim_until{};
  };

  Result<const Destination*> Find(uint32_t bo) const;
  Result<Destination*> Find(uint32_t bo);  // the writers', who change its claim
  Result<const MemfdRegion*> Memfd(uint32_t bo) const;
  // Whether [offset, offset + length) of `region` is fresh: pages not allocated yet.
  bool Fresh(const MemfdRegion& region, uint64_t offset, uint64_t length) const;
  // Whether a chunk for that range goes through the BO's file (fresh, and the mode allows it
  // now, claiming it for kOnePerBo): ReceiveTarget declines it and Write uses pwrite.
  bool ThroughFile(Destination& destination, uint64_t offset, uint64_t length);
  // kOnePerBo: claims the memfd's file for the chunk at `offset` (true if it holds it already).
  bool ClaimFileWrite(Destination& destination, uint64_t offset);
  void EndFileWrite(Destination& destination, uint64_t offset);
  Status WriteThroughFile(Destination& destination, uint32_t bo, uint64_t offset,
                          std::span<const uint8_t> raw);

  HostEngineOptions options_;
  mutable std::mutex mutex_;  // guards the map's shape, not the bytes
  std::map<uint32_t, Destination> regions_;
  std::atomic<uint64_t> bytes_written_{0};
  std::atomic<uint64_t> bytes_zeroed_{0};
  std::atomic<uint64_t> prepared_bytes_{0};
  // How fresh chunks are written now (ExpectWriters): kWrite while one thread writes.
  std::atomic<HostEngineOptions::FreshPages> fresh_pages_{
      options_.write_fresh_pages ? HostEngineOptions::FreshPages::kWrite
                                 : HostEngineOptions::FreshPages::kMap};
  PopulateAhead populate_;  // last: its thread stops before the regions are unmapped
};

}  // namespace gpulazy::client
