#include "plugin/router.h"

#include <algorithm>

namespace gpulazy::plugin {

Status Router::AddDestination(uint32_t bo, uint64_t size) {
  std::lock_guard lock(mutex_);
  sizes_[bo] = size;
  return Status::Ok();
}

Status Router::Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw,
                     client::CopyDone done) {
  DeviceEngine* engine = nullptr;
  {
    std::lock_guard lock(mutex_);
    auto size = sizes_.find(bo);
    if (size == sizes_.end()) return NotFound("BO {} has no destination", bo);
    if (offset > size->second || raw.size() > size->second - offset)
      return OutOfRange("write [{}, +{}) past BO {} of {} bytes", offset, raw.size(), bo,
                        size->second);
    if (dropped_.count(bo) != 0) {
      engine = nullptr;  // its task is gone: nobody will read these bytes
    } else if (auto it = bound_.find(bo); it != bound_.end()) {
      engine = it->second;
    } else if (!discard_unbound_) {
      if (!closed_.ok()) return closed_;  // the caller keeps `done`; it is never called
      parked_[bo].push_back(Parked{offset, raw, std::move(done)});
      return Status::Ok();
    }
  }
  if (engine == nullptr) {  // another task's BO (in a restored task) or a dead task's
    done(Status::Ok());
    return Status::Ok();
  }
  client::CopyDone keep = done;  // Write keeps no callback when it fails
  Status written = engine->Write(bo, offset, raw, std::move(done));
  if (written.ok()) return written;
  // Drop() may have released the BO between the lookup and the write.
  GPULAZY_RETURN_IF_ERROR(UnlessDropped(bo, std::move(written)));
  keep(Status::Ok());
  return Status::Ok();
}

Status Router::UnlessDropped(uint32_t bo, Status refused) const {
  std::lock_guard lock(mutex_);
  if (dropped_.count(bo) != 0) return Status::Ok();
  return refused;
}

Status Router::Flush() {
  std::vector<DeviceEngine*> engines;
  {
    std::lock_guard lock(mutex_);
    engines = engines_;
  }
  Status first;
  for (DeviceEngine* e : engines) {
    Status s = e->Flush();
    if (first.ok()) first = s;
  }
  return first;
}

Status Router::ExpectChunkBytes(uint32_t max_bytes) {
  std::vector<DeviceEngine*> engines;
  {
    std::lock_guard lock(mutex_);
    chunk_bytes_ = max_bytes;
    engines = engines_;
  }
  for (DeviceEngine* engine : engines)
    GPULAZY_RETURN_IF_ERROR(engine->ExpectChunkBytes(max_bytes));
  return Status::Ok();
}

Status Router::Bind(uint32_t bo, DeviceEngine* engine, UniqueFd dmabuf, uint64_t size) {
  {
    std::lock_guard lock(mutex_);
    auto it = sizes_.find(bo);
    if (it == sizes_.end()) return NotFound("BO {} is not in the image", bo);
    if (it->second != size)
      return InvalidArgument("BO {}: restored with {} bytes, image has {}", bo, size, it->second);
    if (bound_.count(bo)) return InvalidArgument("BO {} handed over twice", bo);
  }
  std::optional<uint32_t> chunk_bytes;
  {
    std::lock_guard lock(mutex_);
    if (dropped_.count(bo) != 0) return Status::Ok();  // its task died meanwhile; fd closes
    if (std::find(engines_.begin(), engines_.end(), engine) == engines_.end())
      chunk_bytes = chunk_bytes_;
  }
  // A new engine hears the image's chunk size before its first BO, so one that cannot stage
  // such chunks fails this hand-over (the restore, before the task runs) and takes no writes.
  // Engines already in engines_ heard it then, or at ExpectChunkBytes.
  if (chunk_bytes)
    GPULAZY_RETURN_IF_ERROR(engine->ExpectChunkBytes(*chunk_bytes)
                                .Context(fmt::format("the {} engine", engine->name())));
  GPULAZY_RETURN_IF_ERROR(engine->Bind(bo, std::move(dmabuf), size));
  std::vector<Parked> replay;
  {
    std::lock_guard lock(mutex_);
    if (dropped_.count(bo) != 0) {  // dropped while binding: Drop saw no binding to release
      engine->Release(bo);
      return Status::Ok();
    }
    bound_[bo] = engine;
    if (std::find(engines_.begin(), engines_.end(), engine) == engines_.end())
      engines_.push_back(engine);
    if (auto it = parked_.find(bo); it != parked_.end()) {
      replay = std::move(it->second);
      parked_.erase(it);
    }
  }
  for (Parked& p : replay) {
    client::CopyDone done = p.done;  // Write keeps no callback when it fails
    Status s = engine->Write(bo, p.offset, p.raw, std::move(p.done));
    if (!s.ok()) done(UnlessDropped(bo, std::move(s)));
  }
  return Status::Ok();
}

size_t Router::Drop(const std::vector<uint32_t>& bos) {
  std::vector<Parked> discarded;
  std::vector<std::pair<uint32_t, DeviceEngine*>> release;
  {
    std::lock_guard lock(mutex_);
    for (uint32_t bo : bos) {
      if (!dropped_.insert(bo).second) continue;
      if (auto it = bound_.find(bo); it != bound_.end()) {
        release.emplace_back(bo, it->second);
        bound_.erase(it);
      }
      if (auto it = parked_.find(bo); it != parked_.end()) {
        for (Parked& p : it->second)
          discarded.push_back(std::move(p));
        parked_.erase(it);
      }
    }
  }
  for (Parked& p : discarded)
    p.done(Status::Ok());
  for (auto& [bo, engine] : release)
    engine->Release(bo);
  return discarded.size();
}

void Router::FailParked(const Status& why) {
  std::map<uint32_t, std::vector<Parked>> parked;
  {
    std::lock_guard lock(mutex_);
    closed_ = why.ok() ? Aborted("restore abandoned") : why;
    parked.swap(parked_);
  }
  for (auto& [bo, list] : parked)
    for (Parked& p : list)
      p.done(why);
}

size_t Router::parked() const {
  std::lock_guard lock(mutex_);
  size_t n = 0;
  for (const auto& [bo, list] : parked_)
    n += list.size();
  return n;
}

}  // namespace gpulazy::plugin
