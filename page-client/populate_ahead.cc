#include "page-client/populate_ahead.h"

#include <spdlog/spdlog.h>
#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "page-client/net/threads.h"

namespace gpulazy::client {

namespace {

uint64_t BlocksFor(uint64_t bytes) {
  return (bytes + PopulateAhead::kBlockBytes - 1) / PopulateAhead::kBlockBytes;
}

}  // namespace

PopulateAhead::PopulateAhead(uint64_t ahead_bytes, int nice_increment)
    : ahead_bytes_(ahead_bytes), nice_increment_(nice_increment) {
  if (ahead_bytes_ > 0) thread_ = std::thread([this] { Run(); });
}

PopulateAhead::~PopulateAhead() {
  Stop();
}

void PopulateAhead::Stop() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  // Two callers at once (a hint and the destructor) must not both join.
  std::lock_guard join_lock(join_mu_);
  if (thread_.joinable()) thread_.join();
}

void PopulateAhead::SetPaused(bool paused) {
  if (!enabled()) return;
  // join_mu_ orders the thread's end and a new start, and a Stop racing either.
  std::lock_guard join_lock(join_mu_);
  {
    std::lock_guard lock(mu_);
    if (stopping_ || unsupported_ || paused_ == paused) return;
    paused_ = paused;
    // Whatever goal is set now is dropped: a new one comes with the next WritingAt.
    done_generation_ = goal_.generation;
  }
  if (paused) {
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  } else if (!thread_.joinable()) {
    thread_ = std::thread([this] { Run(); });
  }
}

void PopulateAhead::AddRegion(uint32_t id, std::span<uint8_t> memory) {
  if (!enabled()) return;
  std::lock_guard lock(mu_);
  regions_.try_emplace(id, Region{memory, std::vector<bool>(BlocksFor(memory.size()), false)});
}

void PopulateAhead::WritingAt(uint32_t id, uint64_t offset, uint64_t length) {
  if (!enabled()) return;
  {
    std::lock_guard lock(mu_);
    if (unsupported_ || stopping_ || paused_) return;
    auto it = regions_.find(id);
    if (it == regions_.end()) return;
    const Region& region = it->second;
    const uint64_t size = region.memory.size();
    if (offset > size || length > size - offset) return;
    const uint64_t from = offset + length;
    const uint64_t to = from + std::min(ahead_bytes_, size - from);
    if (from >= to) return;
    // The common case once the thread is ahead: everything wanted is there, nothing to wake.
    bool missing = false;
    for (uint64_t block = from / kBlockBytes; block < BlocksFor(to) && !missing; ++block)
      missing = !region.populated[block];
    if (!missing) return;
    goal_ = Goal{id, from, to, goal_.generation + 1};
  }
  wake_.notify_one();
}

uint64_t PopulateAhead::populated_bytes() const {
  std::lock_guard lock(mu_);
  return populated_bytes_;
}

void PopulateAhead::Run() {
  net::NameThisThread("gl-populate");
  if (Status lowered = net::LowerThisThreadPriority(nice_increment_); !lowered.ok())
    spdlog::debug("populate ahead: {}", lowered.message());
  std::unique_lock lock(mu_);
  for (;;) {
    wake_.wait(lock, [&] { return stopping_ || paused_ || goal_.generation != done_generation_; });
    if (stopping_ || paused_) return;
    const Goal goal = goal_;
    // Regions are never removed and std::map nodes never move: the reference outlives unlocks.
    Region& region = regions_.at(goal.id);
    for (uint64_t block = goal.from / kBlockBytes; block < BlocksFor(goal.to); ++block) {
      // A newer position wins: populating behind the writer is wasted time.
      if (stopping_ || paused_ || goal_.generation != goal.generation) break;
      if (region.populated[block]) continue;
      region.populated[block] = true;  // only this thread populates; a failure is not retried
      uint8_t* start = region.memory.data() + block * kBlockBytes;
      const uint64_t length = std::min(kBlockBytes, region.memory.size() - block * kBlockBytes);
      lock.unlock();
      const int rc = ::madvise(start, length, MADV_POPULATE_WRITE);
      const int error = errno;
      lock.lock();
      if (rc == 0) {
        populated_bytes_ += length;
        continue;
      }
      if (error == EINVAL) {
        // Before Linux 5.14 there is no MADV_POPULATE_WRITE: the writers fault pages themselves.
        spdlog::debug("populate ahead: MADV_POPULATE_WRITE unsupported here; off");
        unsupported_ = true;
        return;
      }
      // ENOMEM, EINTR, a hardware-poisoned page: the writer will meet (and report) it itself.
      spdlog::debug("populate ahead: MADV_POPULATE_WRITE of {} bytes: {}", length,
                    std::strerror(error));
    }
    if (goal_.generation == goal.generation) done_generation_ = goal.generation;
  }
}

}  // namespace gpulazy::client
