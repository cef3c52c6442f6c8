#include "plugin/sdma_engine.h"

#include <spdlog/spdlog.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

namespace gpulazy::plugin {

Result<std::unique_ptr<SdmaCopyEngine>> SdmaCopyEngine::Create(std::unique_ptr<AmdgpuDevice> device,
                                                               SdmaOptions options) {
  if (options.staging_slots == 0 || options.slot_bytes == 0 || options.slot_bytes % 4096 != 0)
    return InvalidArgument("SDMA engine: {} staging slots of {} bytes", options.staging_slots,
                           options.slot_bytes);
  std::unique_ptr<SdmaCopyEngine> engine(new SdmaCopyEngine(std::move(device), options));
  GPULAZY_RETURN_IF_ERROR(engine->Init());
  return engine;
}

SdmaCopyEngine::SdmaCopyEngine(std::unique_ptr<AmdgpuDevice> device, SdmaOptions options)
    : device_(std::move(device)), options_(options) {}

Status SdmaCopyEngine::Init() {
  // Page-aligned, so the kernel can pin it as a userptr BO.
  uint64_t bytes = options_.slot_bytes * options_.staging_slots;
  staging_ = std::aligned_alloc(4096, bytes);
  if (staging_ == nullptr) return ResourceExhausted("SDMA staging: {} bytes", bytes);
  for (uint32_t i = 0; i < options_.staging_slots; ++i) {
    Slot slot;
    slot.host = static_cast<uint8_t*>(staging_) + i * options_.slot_bytes;
    GPULAZY_ASSIGN_OR_RETURN(slot.handle,
                             device_->CreateFromUserMem(slot.host, options_.slot_bytes));
    slots_.push_back(slot);
    GPULAZY_ASSIGN_OR_RETURN(slots_.back().va, device_->MapVa(slot.handle, options_.slot_bytes));
    free_slots_.push_back(i);
  }
  reaper_ = std::thread([this] { ReaperLoop(); });
  return Status::Ok();
}

SdmaCopyEngine::~SdmaCopyEngine() {
  if (reaper_.joinable()) {
    (void)Flush();
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    cv_.notify_all();
    reaper_.join();
  }
  for (auto& [bo, t] : targets_)
    device_->Release(t.handle);
  for (const Slot& s : slots_)
    device_->Release(s.handle);
  std::free(staging_);
}

Status SdmaCopyEngine::ExpectChunkBytes(uint32_t max_bytes) {
  if (max_bytes > options_.slot_bytes)
    return InvalidArgument(
        "SDMA engine: the image's chunks of {} bytes do not fit its {}-byte staging slots",
        max_bytes, options_.slot_bytes);
  return Status::Ok();
}

Status SdmaCopyEngine::Bind(uint32_t bo, UniqueFd dmabuf, uint64_t size) {
  GPULAZY_ASSIGN_OR_RETURN(BoHandle handle, device_->ImportDmabuf(dmabuf.get(), size));
  Result<uint64_t> va = device_->MapVa(handle, size);
  if (!va.ok()) {
    device_->Release(handle);
    return va.status().Context(fmt::format("mapping BO {}", bo));
  }
  std::lock_guard lock(mutex_);
  Target& t = targets_[bo];
  if (t.handle != 0) {
    device_->Release(handle);
    return InvalidArgument("BO {} bound twice", bo);
  }
  t = Target{std::move(dmabuf), handle, *va, size};
  return Status::Ok();
}

Status SdmaCopyEngine::LaunchLocked(const Pending& w, client::CopyDone& done) {
  const Target& t = targets_.at(w.bo);
  size_t index = free_slots_.back();
  const Slot& slot = slots_[index];
  std::memcpy(slot.host, w.raw.data(), w.raw.size());
  GPULAZY_ASSIGN_OR_RETURN(std::vector<uint32_t> ib, BuildCopyIb(device_->generation(), slot.va,
                                                                 t.va + w.offset, w.raw.size()));
  const BoHandle resources[] = {slot.handle, t.handle};
  GPULAZY_ASSIGN_OR_RETURN(uint64_t seq, device_->Submit(ib, resources));
  free_slots_.pop_back();
  in_flight_.push_back(InFlight{seq, index, w.bo, std::move(done)});
  ++stats_.submits;
  stats_.max_in_flight =
      std::max<uint32_t>(stats_.max_in_flight, static_cast<uint32_t>(in_flight_.size()));
  cv_.notify_all();
  return Status::Ok();
}

Status SdmaCopyEngine::Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw,
                             client::CopyDone done) {
  if (raw.empty()) {
    done(Status::Ok());
    return Status::Ok();
  }
  std::lock_guard lock(mutex_);
  if (!broken_.ok()) return broken_;
  auto it = targets_.find(bo);
  if (it == targets_.end()) return NotFound("BO {} has no bound dmabuf", bo);
  if (it->second.released) return NotFound("BO {} was released", bo);
  if (offset > it->second.size || raw.size() > it->second.size - offset)
    return OutOfRange("write [{}, +{}) past BO {} of {} bytes", offset, raw.size(), bo,
                      it->second.size);
  if (raw.size() > options_.slot_bytes)
    return InvalidArgument("write of {} bytes exceeds the {}-byte staging slot", raw.size(),
                           options_.slot_bytes);
  Pending w{bo, offset, raw, nullptr};
  if (!free_slots_.empty() && pending_.empty()) {
    GPULAZY_RETURN_IF_ERROR(LaunchLocked(w, done));
    ++outstanding_;
    ++it->second.accepted;
    return Status::Ok();
  }
  w.done = std::move(done);
  ++outstanding_;
  ++it->second.accepted;
  pending_.push_back(std::move(w));
  ++stats_.queued_writes;
  return Status::Ok();
}

void SdmaCopyEngine::ReaperLoop() {
  std::unique_lock lock(mutex_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || !in_flight_.empty(); });
    if (in_flight_.empty()) return;  // stopping, nothing left to reap
    uint64_t seq = in_flight_.front().seq;
    lock.unlock();
    Result<bool> signalled = device_->WaitFence(seq, options_.fence_timeout);
    lock.lock();
    InFlight done = std::move(in_flight_.front());
    in_flight_.pop_front();
    Status status = Status::Ok();
    if (!signalled.ok())
      status = signalled.status();
    else if (!*signalled)
      status =
          TimedOut("SDMA fence {} not signalled after {} ms", seq, options_.fence_timeout.count());
    if (status.ok()) {
      free_slots_.push_back(done.slot);
    } else {
      // The copy may still be running and reading its slot: bytes staged there for another
      // write would land in this BO. The slot stays out of use, and the engine stops.
      ++stats_.quarantined_slots;
      if (broken_.ok()) broken_ = status;
    }
    // A copy whose fence did not signal may still be running: its BO stays until the end.
    SettleLocked(done.bo, /*copied=*/status.ok());
    if (!status.ok() && first_error_.ok()) first_error_ = status;
    ++stats_.reaped_async;
    // Start queued writes while slots are free; their failures complete them at once.
    std::vector<std::pair<client::CopyDone, Status>> failed;
    while (!broken_.ok() && !pending_.empty()) {  // nothing queued will run any more
      Pending next = std::move(pending_.front());
      pending_.pop_front();
      failed.emplace_back(std::move(next.done), broken_);
      SettleLocked(next.bo, /*copied=*/true);  // never submitted
    }
    while (!pending_.empty() && !free_slots_.empty()) {
      Pending next = std::move(pending_.front());
      pending_.pop_front();
      client::CopyDone cb = std::move(next.done);
      Status launched = LaunchLocked(next, cb);
      if (!launched.ok()) {
        if (first_error_.ok()) first_error_ = launched;
        failed.emplace_back(std::move(cb), launched);
        SettleLocked(next.bo, /*copied=*/true);  // never submitted
      }
    }
    cv_.notify_all();
    lock.unlock();
    done.done(std::move(status));
    for (auto& [cb, s] : failed)
      cb(std::move(s));
    lock.lock();
    outstanding_ -= 1 + failed.size();
    cv_.notify_all();
  }
}

void SdmaCopyEngine::SettleLocked(uint32_t bo, bool copied) {
  auto it = targets_.find(bo);
  if (it == targets_.end()) return;
  Target& t = it->second;
  if (t.accepted > 0) --t.accepted;
  if (!copied || !t.released || t.accepted > 0) return;
  device_->Release(t.handle);
  targets_.erase(it);  // closes the dmabuf
}

void SdmaCopyEngine::Release(uint32_t bo) {
  std::lock_guard lock(mutex_);
  auto it = targets_.find(bo);
  if (it == targets_.end() || it->second.released) return;
  it->second.released = true;
  if (it->second.accepted > 0) return;  // the reaper lets go after the last of them
  device_->Release(it->second.handle);
  targets_.erase(it);
}

Status SdmaCopyEngine::Flush() {
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] { return outstanding_ == 0; });
  return std::exchange(first_error_, Status::Ok());
}

Status SdmaCopyEngine::ReadBack(uint32_t bo, uint64_t offset, std::span<uint8_t> out) {
  GPULAZY_RETURN_IF_ERROR(Flush());
  uint64_t done = 0;
  while (done < out.size()) {
    const uint64_t length = std::min<uint64_t>(options_.slot_bytes, out.size() - done);
    size_t index = 0;
    uint64_t source = 0;
    BoHandle target = 0;
    {
      std::unique_lock lock(mutex_);
      auto it = targets_.find(bo);
      if (it == targets_.end() || it->second.released)
        return NotFound("BO {} has no bound dmabuf", bo);
      if (offset > it->second.size || out.size() > it->second.size - offset)
        return OutOfRange("read-back [{}, +{}) past BO {} of {} bytes", offset, out.size(), bo,
                          it->second.size);
      source = it->second.va + offset + done;
      target = it->second.handle;
      cv_.wait(lock, [&] { return !free_slots_.empty() || !broken_.ok(); });
      if (!broken_.ok()) return broken_;
      index = free_slots_.back();
      free_slots_.pop_back();
    }
    // The slot is ours until it goes back on the free list, whatever happens below.
    auto give_back = [&] {
      {
        std::lock_guard lock(mutex_);
        free_slots_.push_back(index);
      }
      cv_.notify_all();
    };
    const Slot& slot = slots_[index];
    Result<std::vector<uint32_t>> ib = BuildCopyIb(device_->generation(), source, slot.va, length);
    if (!ib.ok()) {
      give_back();
      return ib.status();
    }
    const BoHandle resources[] = {target, slot.handle};
    Result<uint64_t> seq = device_->Submit(*ib, resources);
    Result<bool> signalled =
        seq.ok() ? device_->WaitFence(*seq, options_.fence_timeout) : Result<bool>(seq.status());
    if (signalled.ok() && *signalled) std::memcpy(out.data() + done, slot.host, length);
    if (seq.ok() && !(signalled.ok() && *signalled)) {
      // Submitted, and not known to be done: the copy may still write into the slot.
      std::lock_guard lock(mutex_);
      ++stats_.quarantined_slots;
      if (broken_.ok())
        broken_ = signalled.ok() ? TimedOut("SDMA read-back fence {} not signalled after {} ms",
                                            *seq, options_.fence_timeout.count())
                                 : signalled.status();
      cv_.notify_all();
    } else {
      give_back();
    }
    if (!signalled.ok())
      return signalled.status().Context(fmt::format("reading back BO {} at {}", bo, offset + done));
    if (!*signalled)
      return TimedOut("SDMA read-back of BO {} at {}: fence not signalled after {} ms", bo,
                      offset + done, options_.fence_timeout.count());
    done += length;
  }
  return Status::Ok();
}

SdmaStats SdmaCopyEngine::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

}  // namespace gpulazy::plugin
