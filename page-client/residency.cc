#include "page-client/residency.h"

namespace gpulazy::client {

uint32_t ResidencyMap::ChunkCountFor(uint64_t size, uint32_t chunk_size) {
  uint64_t count = size / chunk_size + (size % chunk_size != 0 ? 1 : 0);
  return count > UINT32_MAX ? UINT32_MAX : static_cast<uint32_t>(count);
}

Result<ResidencyMap> ResidencyMap::Create(uint32_t chunk_size, std::span<const uint64_t> bo_sizes) {
  if (chunk_size == 0) return InvalidArgument("chunk size is zero");
  if (bo_sizes.size() > UINT32_MAX) return OutOfRange("{} BOs is too many", bo_sizes.size());
  ResidencyMap map;
  map.chunk_size_ = chunk_size;
  uint64_t chunks = 0;
  for (uint64_t size : bo_sizes) {
    uint64_t count = size / chunk_size + (size % chunk_size != 0 ? 1 : 0);
    if (count > kMaxChunks || chunks + count > kMaxChunks)
      return ResourceExhausted("image has more than {} chunks of {} bytes", kMaxChunks, chunk_size);
    map.bos_.push_back(Bo{size, static_cast<uint32_t>(count), chunks});
    chunks += count;
    map.total_bytes_ += size;
  }
  map.states_.resize(chunks);
  return map;
}

Status ResidencyMap::CheckChunk(uint32_t bo, uint32_t chunk) const {
  if (bo >= bos_.size())
    return OutOfRange("BO {} out of range (image has {} BOs)", bo, bos_.size());
  if (chunk >= bos_[bo].chunk_count)
    return OutOfRange("BO {} chunk {} out of range (BO has {} chunks)", bo, chunk,
                      bos_[bo].chunk_count);
  return Status::Ok();
}

uint32_t ResidencyMap::ChunkLength(uint32_t bo, uint32_t chunk) const {
  uint64_t start = ChunkOffset(chunk);
  uint64_t size = bos_[bo].size;
  uint64_t left = size > start ? size - start : 0;
  return static_cast<uint32_t>(left < chunk_size_ ? left : chunk_size_);
}

Result<ChunkRun> ResidencyMap::Covering(uint32_t bo, uint64_t offset, uint64_t length) const {
  if (bo >= bos_.size())
    return OutOfRange("BO {} out of range (image has {} BOs)", bo, bos_.size());
  uint64_t size = bos_[bo].size;
  if (length == 0) return InvalidArgument("empty range at offset {} of BO {}", offset, bo);
  if (offset > size || length > size - offset)
    return OutOfRange("range [{}, +{}) past the end of BO {} ({} bytes)", offset, length, bo, size);
  uint64_t first = offset / chunk_size_;
  uint64_t last = (offset + length - 1) / chunk_size_;
  return ChunkRun{bo, static_cast<uint32_t>(first), static_cast<uint32_t>(last - first + 1)};
}

bool ResidencyMap::MarkLanding(uint32_t bo, uint32_t chunk) {
  ChunkState& state = At(bo, chunk);
  if (state.flags & (kLanding | kResident | kAbandoned)) return false;
  state.flags |= kLanding;
  return true;
}

bool ResidencyMap::ClearLanding(uint32_t bo, uint32_t chunk) {
  ChunkState& state = At(bo, chunk);
  if ((state.flags & kLanding) == 0 || (state.flags & kResident) != 0) return false;
  state.flags &= static_cast<uint8_t>(~kLanding);
  return true;
}

bool ResidencyMap::MarkResident(uint32_t bo, uint32_t chunk) {
  ChunkState& state = At(bo, chunk);
  if (!(state.flags & kLanding)) return false;
  state.flags = static_cast<uint8_t>((state.flags & ~kLanding) | kResident);
  ++resident_chunks_;
  resident_bytes_ += ChunkLength(bo, chunk);
  return true;
}

void ResidencyMap::Abandon(uint32_t bo, std::vector<ChunkRun>* runs) {
  for (uint32_t chunk = 0; chunk < bos_[bo].chunk_count; ++chunk) {
    ChunkState& state = At(bo, chunk);
    if (state.flags & (kLanding | kResident | kAbandoned)) continue;
    state.flags |= kAbandoned;
    ++abandoned_chunks_;
    abandoned_bytes_ += ChunkLength(bo, chunk);
    if (!runs->empty() && runs->back().bo == bo && runs->back().first + runs->back().count == chunk)
      ++runs->back().count;
    else
      runs->push_back(ChunkRun{bo, chunk, 1});
  }
}

bool ResidencyMap::AllResident(const ChunkRun& run) const {
  for (uint32_t i = 0; i < run.count; ++i)
    if (!resident(run.bo, run.first + i)) return false;
  return true;
}

template <typename Pred>
std::vector<ChunkRun> ResidencyMap::Runs(Pred pred) const {
  std::vector<ChunkRun> runs;
  for (uint32_t bo = 0; bo < bos_.size(); ++bo) {
    const Bo& b = bos_[bo];
    for (uint32_t chunk = 0; chunk < b.chunk_count; ++chunk) {
      if (!pred(states_[b.first_state + chunk])) continue;
      if (!runs.empty() && runs.back().bo == bo && runs.back().first + runs.back().count == chunk)
        ++runs.back().count;
      else
        runs.push_back(ChunkRun{bo, chunk, 1});
    }
  }
  return runs;
}

std::vector<ChunkRun> ResidencyMap::HeldRuns() const {
  return Runs(
      [](const ChunkState& s) { return (s.flags & (kLanding | kResident | kAbandoned)) != 0; });
}

std::vector<ChunkRun> ResidencyMap::PendingDemandRuns() const {
  return Runs([](const ChunkState& s) {
    return (s.flags & kDemanded) != 0 && (s.flags & (kLanding | kResident | kAbandoned)) == 0;
  });
}

std::vector<ChunkRun> ResidencyMap::UnrequestedRuns() const {
  return Runs([](const ChunkState& s) {
    return (s.flags & (kLanding | kResident | kDemanded | kAbandoned)) == 0;
  });
}

}  // namespace gpulazy::client
