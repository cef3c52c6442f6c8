#include "proto/status.h"

#include <cerrno>
#include <cstring>

namespace gpulazy {

std::string_view CodeName(Code code) {
  switch (code) {
    case Code::kOk:
      return "ok";
    case Code::kInvalidArgument:
      return "invalid argument";
    case Code::kNotFound:
      return "not found";
    case Code::kCorrupt:
      return "corrupt";
    case Code::kIoError:
      return "I/O error";
    case Code::kOutOfRange:
      return "out of range";
    case Code::kUnsupported:
      return "unsupported";
    case Code::kPermissionDenied:
      return "permission denied";
    case Code::kUnavailable:
      return "unavailable";
    case Code::kResourceExhausted:
      return "resource exhausted";
    case Code::kTimeout:
      return "timed out";
    case Code::kAborted:
      return "aborted";
    case Code::kInternal:
      return "internal error";
  }
  return "unknown";
}

std::string Status::ToString() const {
  if (ok()) return "ok";
  return fmt::format("{}: {}", CodeName(code_), message_);
}

int Status::ToNegativeErrno() const {
  switch (code_) {
    case Code::kOk:
      return 0;
    case Code::kInvalidArgument:
      return -EINVAL;
    case Code::kNotFound:
      return -ENOENT;
    case Code::kCorrupt:
      return -EBADMSG;
    case Code::kIoError:
      return -EIO;
    case Code::kOutOfRange:
      return -ERANGE;
    case Code::kUnsupported:
      return -ENOTSUP;
    case Code::kPermissionDenied:
      return -EACCES;
    case Code::kUnavailable:
      return -ECONNREFUSED;
    case Code::kResourceExhausted:
      return -ENOSPC;
    case Code::kTimeout:
      return -ETIMEDOUT;
    case Code::kAborted:
      return -ECANCELED;
    case Code::kInternal:
      return -EFAULT;
  }
  return -EIO;
}

Status Status::Context(std::string_view what) const {
  if (ok()) return *this;
  return Status(code_, fmt::format("{}: {}", what, message_));
}

Status ErrnoStatus(int errno_value, std::string what) {
  Code code = Code::kIoError;
  switch (errno_value) {
    case ENOENT:
      code = Code::kNotFound;
      break;
    case EACCES:
    case EPERM:
      code = Code::kPermissionDenied;
      break;
    case EINVAL:
      code = Code::kInvalidArgument;
      break;
    case ECONNREFUSED:
    case ECONNRESET:
    case EPIPE:
      code = Code::kUnavailable;
      break;
    case ETIMEDOUT:
      code = Code::kTimeout;
      break;
    case ENOSPC:
    case ENOMEM:
      code = Code::kResourceExhausted;
      break;
    default:
      break;
  }
  return Status(code, fmt::format("{}: {}", what, std::strerror(errno_value)));
}

}  // namespace gpulazy
