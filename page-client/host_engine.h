// HostCopyEngine: the embedded CopyEngine where "device memory" is host memory, one memfd per
// BO (mapped shared, so the userfaultfd pager and demos can map or pass the same memory).
// Writes are memcpy and complete inside Write. Every write is bounds-checked.
// Thread-safety: as CopyEngine; Write may also run concurrently for disjoint ranges, and the
// accessors are safe once AddDestination has returned.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <span>
#include <string>

#include "page-client/copy_engine.h"

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

class HostCopyEngine : public CopyEngine {
 public:
  HostCopyEngine() = default;

  std::string_view name() const override { return "host"; }
  Status AddDestination(uint32_t bo, uint64_t size) override;
  Status Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw, CopyDone done) override;
  Status Flush() override { return Status::Ok(); }

  // The BO's memory: kNotFound for a BO without a destination.
  Result<std::span<uint8_t>> Mapping(uint32_t bo) const;
  // The BO's memfd (owned by the engine; dup it to keep it past the engine's life).
  Result<int> Fd(uint32_t bo) const;
  uint64_t bytes_written() const;

 private:
  Result<const MemfdRegion*> Find(uint32_t bo) const;

  mutable std::mutex mutex_;  // guards the map's shape, not the bytes
  std::map<uint32_t, MemfdRegion> regions_;
  std::atomic<uint64_t> bytes_written_{0};
};

}  // namespace gpulazy::client
