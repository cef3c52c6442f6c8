// ChunkBufferPool: reusable buffers for chunk reads. A fresh 2 MiB std::vector per chunk costs a
// zero-fill and, since glibc serves allocations that large with mmap, 512 page faults and an
// munmap: as much CPU as the read itself. The Dispatcher reads each chunk into a buffer from
// this pool (ImageSource::ReadChunkInto); the buffer goes back when the chunk has been written
// to the socket or dropped (ChunkBuffer's destructor).
//
// Bounded: at most `max_free` idle buffers are kept. When none is idle, Acquire allocates a new
// one (never blocks: a slow client holding buffers must not stall the disk threads), and a
// buffer released while `max_free` are idle is freed. So the pool's own memory is at most
// max_free * buffer_bytes (only the pages chunks touched are resident). A request larger than
// buffer_bytes gets a one-off buffer of its own size that is never pooled.
//
// Buffers are not initialized: whoever fills one writes what it reads.
//
// Thread-safety: Acquire, counters and the ChunkBuffer destructors may run on any thread. A
// ChunkBuffer may outlive its pool (it is then simply freed).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

namespace gpulazy::server {

class ChunkBufferPool;

// A buffer from a ChunkBufferPool (or none: default-constructed or moved from). Move-only; goes
// back to its pool when destroyed.
class ChunkBuffer {
 public:
  ChunkBuffer() = default;
  ChunkBuffer(ChunkBuffer&& other) noexcept;
  ChunkBuffer& operator=(ChunkBuffer&& other) noexcept;
  ChunkBuffer(const ChunkBuffer&) = delete;
  ChunkBuffer& operator=(const ChunkBuffer&) = delete;
  ~ChunkBuffer();

  std::span<uint8_t> span() { return {bytes_.get(), capacity_}; }
  std::span<const uint8_t> span() const { return {bytes_.get(), capacity_}; }
  size_t capacity() const { return capacity_; }
  const uint8_t* data() const { return bytes_.get(); }

 private:
  friend class ChunkBufferPool;
  struct Shared;
  ChunkBuffer(std::shared_ptr<Shared> pool, std::unique_ptr<uint8_t[]> bytes, size_t capacity)
      : pool_(std::move(pool)), bytes_(std::move(bytes)), capacity_(capacity) {}
  void Release();

  std::shared_ptr<Shared> pool_;  // null: not pooled (one-off or empty)
  std::unique_ptr<uint8_t[]> bytes_;
  size_t capacity_ = 0;
};

class ChunkBufferPool {
 public:
  // buffer_bytes: the capacity of pooled buffers (the largest chunk payload expected);
  // max_free: how many idle buffers are kept for reuse.
  ChunkBufferPool(size_t buffer_bytes, size_t max_free);

  // A buffer of at least `bytes` bytes, not initialized.
  ChunkBuffer Acquire(size_t bytes);

  struct Counters {
    uint64_t allocated = 0;  // buffers allocated (pooled and one-off)
    uint64_t reused = 0;     // Acquire calls served by an idle buffer
    uint64_t freed = 0;      // pooled buffers freed on release because max_free were idle
    uint64_t idle = 0;       // idle buffers now
    uint64_t out = 0;        // buffers handed out and not yet back
  };
  Counters counters() const;
  size_t buffer_bytes() const;
  size_t max_free() const;

 private:
  std::shared_ptr<ChunkBuffer::Shared> shared_;
};

}  // namespace gpulazy::server
