#include "plugin/device_engine.h"

namespace gpulazy::plugin {

Status HostDmabufEngine::Bind(uint32_t bo, UniqueFd dmabuf, uint64_t size) {
  auto target = std::make_shared<Target>();
  target->fd = std::move(dmabuf);
  target->size = size;
  std::lock_guard lock(mutex_);
  if (!targets_.emplace(bo, std::move(target)).second)
    return InvalidArgument("BO {} bound twice", bo);
  return Status::Ok();
}

void HostDmabufEngine::Release(uint32_t bo) {
  // A Write in progress holds its own reference to the target; the fd closes after it.
  std::lock_guard lock(mutex_);
  targets_.erase(bo);
}

Result<std::shared_ptr<HostDmabufEngine::Target>> HostDmabufEngine::Range(uint32_t bo,
                                                                          uint64_t offset,
                                                                          uint64_t length,
                                                                          std::string_view what) {
  std::shared_ptr<Target> target;
  {
    std::lock_guard lock(mutex_);
    auto it = targets_.find(bo);
    if (it == targets_.end()) return NotFound("BO {} has no bound dmabuf", bo);
    target = it->second;
  }
  if (offset > target->size || length > target->size - offset)
    return OutOfRange("{} [{}, +{}) past BO {} of {} bytes", what, offset, length, bo,
                      target->size);
  return target;
}

Status HostDmabufEngine::Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw,
                               client::CopyDone done) {
  GPULAZY_ASSIGN_OR_RETURN(std::shared_ptr<Target> target, Range(bo, offset, raw.size(), "write"));
  GPULAZY_RETURN_IF_ERROR(WriteAllAt(target->fd.get(), offset, raw, fmt::format("BO {}", bo)));
  done(Status::Ok());
  return Status::Ok();
}

Status HostDmabufEngine::ReadBack(uint32_t bo, uint64_t offset, std::span<uint8_t> out) {
  GPULAZY_ASSIGN_OR_RETURN(std::shared_ptr<Target> target,
                           Range(bo, offset, out.size(), "read-back"));
  return ReadExactAt(target->fd.get(), offset, out, fmt::format("dmabuf of BO {}", bo));
}

}  // namespace gpulazy::plugin
