#include "lazy-server/server/buffer_pool.h"

#include <utility>

namespace gpulazy::server {

struct ChunkBuffer::Shared {
  Shared(size_t buffer_bytes_in, size_t max_free_in)
      : buffer_bytes(buffer_bytes_in), max_free(max_free_in) {}
  const size_t buffer_bytes;
  const size_t max_free;
  mutable std::mutex mu;
  std::vector<std::unique_ptr<uint8_t[]>> idle;  // guarded by mu
  std::atomic<uint64_t> allocated{0};
  std::atomic<uint64_t> reused{0};
  std::atomic<uint64_t> freed{0};
  std::atomic<uint64_t> out{0};
};

ChunkBuffer::ChunkBuffer(ChunkBuffer&& other) noexcept
    : pool_(std::move(other.pool_)),
      bytes_(std::move(other.bytes_)),
      capacity_(std::exchange(other.capacity_, 0)) {}

ChunkBuffer& ChunkBuffer::operator=(ChunkBuffer&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = std::move(other.pool_);
    bytes_ = std::move(other.bytes_);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

ChunkBuffer::~ChunkBuffer() {
  Release();
}

void ChunkBuffer::Release() {
  if (!bytes_) return;
  if (pool_) {
    pool_->out.fetch_sub(1, std::memory_order_relaxed);
    std::lock_guard lock(pool_->mu);
    if (pool_->idle.size() < pool_->max_free) {
      pool_->idle.push_back(std::move(bytes_));
      pool_.reset();
      capacity_ = 0;
      return;
    }
    pool_->freed.fetch_add(1, std::memory_order_relaxed);
  }
  bytes_.reset();
  pool_.reset();
  capacity_ = 0;
}

ChunkBufferPool::ChunkBufferPool(size_t buffer_bytes, size_t max_free)
    : shared_(std::make_shared<ChunkBuffer::Shared>(buffer_bytes, max_free)) {}

ChunkBuffer ChunkBufferPool::Acquire(size_t bytes) {
  ChunkBuffer::Shared& s = *shared_;
  if (bytes > s.buffer_bytes) {
    // Larger than any pooled buffer: a one-off, freed when released (not counted as out).
    s.allocated.fetch_add(1, std::memory_order_relaxed);
    return ChunkBuffer(nullptr, std::make_unique_for_overwrite<uint8_t[]>(bytes), bytes);
  }
  std::unique_ptr<uint8_t[]> buffer;
  {
    std::lock_guard lock(s.mu);
    if (!s.idle.empty()) {
      buffer = std::move(s.idle.back());
      s.idle.pop_back();
    }
  }
  if (buffer) {
    s.reused.fetch_add(1, std::memory_order_relaxed);
  } else {
    // Not value-initialized: no zero-fill; the pages are faulted in once, on first use.
    buffer = std::make_unique_for_overwrite<uint8_t[]>(s.buffer_bytes);
    s.allocated.fetch_add(1, std::memory_order_relaxed);
  }
  s.out.fetch_add(1, std::memory_order_relaxed);
  return ChunkBuffer(shared_, std::move(buffer), s.buffer_bytes);
}

ChunkBufferPool::Counters ChunkBufferPool::counters() const {
  const ChunkBuffer::Shared& s = *shared_;
  Counters c;
  c.allocated = s.allocated.load(std::memory_order_relaxed);
  c.reused = s.reused.load(std::memory_order_relaxed);
  c.freed = s.freed.load(std::memory_order_relaxed);
  c.out = s.out.load(std::memory_order_relaxed);
  std::lock_guard lock(s.mu);
  c.idle = s.idle.size();
  return c;
}

size_t ChunkBufferPool::buffer_bytes() const {
  return shared_->buffer_bytes;
}

size_t ChunkBufferPool::max_free() const {
  return shared_->max_free;
}

}  // namespace gpulazy::server
