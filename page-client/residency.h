// ResidencyMap: which chunks of an image's BOs are missing, being written, or resident, plus the
// chunk geometry (chunk i of a BO covers [i * chunk_size, min(size, (i + 1) * chunk_size))).
// The RestoreSession keeps one and derives Have and demand requests from it.
// Thread-safety: none; the owner serializes access (RestoreSession holds its mutex).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "proto/status.h"

namespace gpulazy::client {

// `count` consecutive chunks of one BO, as the protocol's ChunkRange.
struct ChunkRun {
  uint32_t bo = 0;
  uint32_t first = 0;
  uint32_t count = 0;
  bool operator==(const ChunkRun&) const = default;
};

class ResidencyMap {
 public:
  // Guards against a hostile reply that would make us allocate without bound.
  static constexpr uint64_t kMaxChunks = uint64_t{1} << 28;

  ResidencyMap() = default;
  // chunk_size > 0; one entry per BO. Fails if the table would exceed kMaxChunks.
  static Result<ResidencyMap> Create(uint32_t chunk_size, std::span<const uint64_t> bo_sizes);

  uint32_t chunk_size() const { return chunk_size_; }
  size_t bo_count() const { return bos_.size(); }
  uint64_t bo_size(uint32_t bo) const { return bos_[bo].size; }
  uint32_t chunk_count(uint32_t bo) const { return bos_[bo].chunk_count; }
  static uint32_t ChunkCountFor(uint64_t size, uint32_t chunk_size);
  uint64_t total_chunks() const { return states_.size(); }
  uint64_t total_bytes() const { return total_bytes_; }

  // kOutOfRange unless bo and chunk name a chunk of the table.
  Status CheckChunk(uint32_t bo, uint32_t chunk) const;
  uint64_t ChunkOffset(uint32_t chunk) const { return uint64_t{chunk} * chunk_size_; }
  uint32_t ChunkLength(uint32_t bo, uint32_t chunk) const;
  // The chunks covering [offset, offset + length) of `bo` (length > 0); kOutOfRange past the end.
  Result<ChunkRun> Covering(uint32_t bo, uint64_t offset, uint64_t length) const;

  // Chunk states. Callers check indices first (CheckChunk / Covering).
  bool resident(uint32_t bo, uint32_t chunk) const { return At(bo, chunk).flags & kResident; }
  // Resident, on its way to the engine, or abandoned: a copy arriving now must be ignored.
  bool held(uint32_t bo, uint32_t chunk) const {
    return At(bo, chunk).flags & (kResident | kLanding | kAbandoned);
  }
  // Its BO was abandoned (Abandon) before the chunk arrived: it will never be resident.
  bool abandoned(uint32_t bo, uint32_t chunk) const { return At(bo, chunk).flags & kAbandoned; }
  // Resident or abandoned: nothing more will happen to it.
  bool settled(uint32_t bo, uint32_t chunk) const {
    return At(bo, chunk).flags & (kResident | kAbandoned);
  }
  bool demanded(uint32_t bo, uint32_t chunk) const { return At(bo, chunk).flags & kDemanded; }
  void set_demanded(uint32_t bo, uint32_t chunk) { At(bo, chunk).flags |= kDemanded; }
  // Someone is (or was) blocked until this chunk is resident: it is installed ahead of
  // background chunks, and its landing wakes the waiters.
  bool waited(uint32_t bo, uint32_t chunk) const { return At(bo, chunk).flags & kWaited; }
  void set_waited(uint32_t bo, uint32_t chunk) { At(bo, chunk).flags |= kWaited; }
  // In the profile's hot set: its landing wakes those waiting for the hot set.
  void set_hot(uint32_t bo, uint32_t chunk) { At(bo, chunk).flags |= kHot; }
  // Whether this chunk's landing may end someone's wait (waited, hot, or the last one).
  bool LandingWakes(uint32_t bo, uint32_t chunk) const {
    return (At(bo, chunk).flags & (kWaited | kHot)) != 0 || complete();
  }
  // Missing -> landing; false when the chunk is already held.
  bool MarkLanding(uint32_t bo, uint32_t chunk);
  // Landing -> missing: a receive straight into the destination failed (bad checksum, lost
  // connection). False (and nothing changes) if it was not landing.
  bool ClearLanding(uint32_t bo, uint32_t chunk);
  // Landing -> resident; false (and nothing changes) if it was not landing.
  bool MarkResident(uint32_t bo, uint32_t chunk);
  // Nobody needs `bo` any more (the process it belonged to is gone): each of its chunks that is
  // neither resident nor landing becomes abandoned, appended to *runs (coalesced). A landing
  // chunk still becomes resident, or missing again should its copy fail. Idempotent.
  void Abandon(uint32_t bo, std::vector<ChunkRun>* runs);
  // Counts a copy that failed verification; returns how many bad copies so far.
  uint32_t CountBadCopy(uint32_t bo, uint32_t chunk) { return ++At(bo, chunk).bad_copies; }

  bool AllResident(const ChunkRun& run) const;
  // Every chunk is resident or abandoned.
  bool complete() const { return resident_chunks_ + abandoned_chunks_ == states_.size(); }
  uint64_t resident_chunks() const { return resident_chunks_; }
  uint64_t resident_bytes() const { return resident_bytes_; }
  uint64_t abandoned_chunks() const { return abandoned_chunks_; }
  uint64_t abandoned_bytes() const { return abandoned_bytes_; }

  // Coalesced runs of held chunks, abandoned ones included (the Have after a reconnect).
  std::vector<ChunkRun> HeldRuns() const;
  // Coalesced runs of demanded chunks not held yet (re-sent after a reconnect).
  std::vector<ChunkRun> PendingDemandRuns() const;
  // Coalesced runs of chunks not held and not demanded.
  std::vector<ChunkRun> UnrequestedRuns() const;

 private:
  static constexpr uint8_t kLanding = 1;
  static constexpr uint8_t kResident = 2;
  static constexpr uint8_t kDemanded = 4;
  static constexpr uint8_t kWaited = 8;
  static constexpr uint8_t kHot = 16;
  static constexpr uint8_t kAbandoned = 32;

  struct ChunkState {
    uint8_t flags = 0;
    uint8_t bad_copies = 0;
  };
  struct Bo {
    uint64_t size = 0;
    uint32_t chunk_count = 0;
    uint64_t first_state = 0;  // index of chunk 0 in states_
  };

  ChunkState& At(uint32_t bo, uint32_t chunk) { return states_[bos_[bo].first_state + chunk]; }
  const ChunkState& At(uint32_t bo, uint32_t chunk) const {
    return states_[bos_[bo].first_state + chunk];
  }
  template <typename Pred>
  std::vector<ChunkRun> Runs(Pred pred) const;

  uint32_t chunk_size_ = 0;
  std::vector<Bo> bos_;
  std::vector<ChunkState> states_;
  uint64_t total_bytes_ = 0;
  uint64_t resident_chunks_ = 0;
  uint64_t resident_bytes_ = 0;
  uint64_t abandoned_chunks_ = 0;
  uint64_t abandoned_bytes_ = 0;
};

}  // namespace gpulazy::client
