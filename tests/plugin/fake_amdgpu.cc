#include "tests/plugin/fake_amdgpu.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstring>

namespace gpulazy::plugin::testing {

FakeAmdgpuDevice::FakeAmdgpuDevice(SdmaGeneration gen, std::chrono::microseconds latency)
    : gen_(gen), latency_(latency), gpu_([this] { Run(); }) {}

FakeAmdgpuDevice::~FakeAmdgpuDevice() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  gpu_.join();
  live_at_exit_->store(bos_.size());
  for (auto& [h, bo] : bos_)
    if (bo.mapped_fd) ::munmap(bo.host, bo.size);
}

Result<BoHandle> FakeAmdgpuDevice::ImportDmabuf(int fd, uint64_t size) {
  void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) return ErrnoError(errno, "mmap dmabuf {}", fd);
  std::lock_guard lock(mutex_);
  bos_[++next_] = Bo{static_cast<uint8_t*>(p), size, 0, true};
  return next_;
}

Result<BoHandle> FakeAmdgpuDevice::CreateFromUserMem(void* ptr, uint64_t size) {
  if (reinterpret_cast<uintptr_t>(ptr) % 4096 != 0)
    return InvalidArgument("userptr not page aligned");
  std::lock_guard lock(mutex_);
  bos_[++next_] = Bo{static_cast<uint8_t*>(ptr), size, 0, false};
  return next_;
}

Result<uint64_t> FakeAmdgpuDevice::MapVa(BoHandle h, uint64_t size) {
  std::lock_guard lock(mutex_);
  auto it = bos_.find(h);
  if (it == bos_.end()) return NotFound("handle {}", h);
  it->second.va = next_va_;
  next_va_ += (size + 0xfffff) & ~0xfffffull;
  return it->second.va;
}

void FakeAmdgpuDevice::Release(BoHandle h) {
  std::lock_guard lock(mutex_);
  auto it = bos_.find(h);
  if (it == bos_.end()) return;
  for (const Submission& s : queue_) {
    if (std::find(s.resources.begin(), s.resources.end(), h) != s.resources.end()) {
      ++busy_releases_;
      return;
    }
  }
  if (it->second.mapped_fd) ::munmap(it->second.host, it->second.size);
  bos_.erase(it);
}

Result<uint64_t> FakeAmdgpuDevice::Submit(std::span<const uint32_t> ib,
                                          std::span<const BoHandle> resources) {
  std::vector<uint32_t> copy(ib.begin(), ib.end());
  GPULAZY_ASSIGN_OR_RETURN(auto copies, DecodeCopyIb(gen_, copy));
  std::lock_guard lock(mutex_);
  for (BoHandle h : resources)
    if (!bos_.count(h)) return NotFound("resource {} not a live BO", h);
  for (const DecodedCopy& c : copies)
    if (!Translate(c.src, c.bytes) || !Translate(c.dst, c.bytes))
      return OutOfRange("copy outside mapped BOs");
  queue_.push_back(Submission{++next_seq_, std::move(copy), {resources.begin(), resources.end()}});
  max_outstanding_ =
      std::max<uint32_t>(max_outstanding_, static_cast<uint32_t>(next_seq_ - completed_));
  cv_.notify_all();
  return next_seq_;
}

uint8_t* FakeAmdgpuDevice::Translate(uint64_t va, uint64_t len) {
  for (auto& [h, bo] : bos_)
    if (bo.va != 0 && va >= bo.va && va + len <= bo.va + bo.size) return bo.host + (va - bo.va);
  return nullptr;
}

void FakeAmdgpuDevice::Run() {
  std::unique_lock lock(mutex_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || (!queue_.empty() && !held_); });
    if (queue_.empty()) return;
    const uint64_t seq = queue_.front().seq;
    const std::vector<uint32_t> ib = queue_.front().ib;
    lock.unlock();
    std::this_thread::sleep_for(latency_);
    lock.lock();
    auto copies = DecodeCopyIb(gen_, ib);  // validated at Submit
    for (const DecodedCopy& c : *copies)
      std::memcpy(Translate(c.dst, c.bytes), Translate(c.src, c.bytes), c.bytes);
    queue_.pop_front();
    completed_ = seq;
    cv_.notify_all();
  }
}

Result<bool> FakeAmdgpuDevice::WaitFence(uint64_t seq, std::chrono::nanoseconds timeout) {
  std::unique_lock lock(mutex_);
  return cv_.wait_for(lock, timeout, [&] { return completed_ >= seq; });
}

void FakeAmdgpuDevice::HoldCompletions(bool hold) {
  {
    std::lock_guard lock(mutex_);
    held_ = hold;
  }
  cv_.notify_all();
}

uint32_t FakeAmdgpuDevice::max_outstanding() const {
  std::lock_guard lock(mutex_);
  return max_outstanding_;
}

size_t FakeAmdgpuDevice::live_bos() const {
  std::lock_guard lock(mutex_);
  return bos_.size();
}

uint32_t FakeAmdgpuDevice::busy_releases() const {
  std::lock_guard lock(mutex_);
  return busy_releases_;
}

}  // namespace gpulazy::plugin::testing
