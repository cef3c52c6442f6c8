// Status and Result<T>: the one error type of gpulazy. Every fallible call returns one; the
// message names what failed and on what ("amdgpu-pages-3-c0de.img: header says 1048576 bytes,
// file holds 4096"). At C boundaries (the CRIU plugin) a Status maps to -errno.
// Thread-safety: value types, no shared state.
#pragma once

#include <fmt/format.h>

#include <cassert>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace gpulazy {

enum class Code {
  kOk = 0,
  kInvalidArgument,    // the caller asked for something malformed
  kNotFound,           // a file, image, BO or chunk that is not there
  kCorrupt,            // bytes on disk or on the wire that break the format
  kIoError,            // the OS refused a read, write or open
  kOutOfRange,         // an index, offset or length past its bounds
  kUnsupported,        // a version or feature we do not speak
  kPermissionDenied,   // access outside the image roots, bad credentials
  kUnavailable,        // the peer went away; retrying may help
  kResourceExhausted,  // a limit was hit
  kTimeout,
  kAborted,   // cancelled or shut down
  kInternal,  // a bug of ours
};

std::string_view CodeName(Code code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Code code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status Ok() { return {}; }
  bool ok() const { return code_ == Code::kOk; }
  Code code() const { return code_; }
  const std::string& message() const { return message_; }
  std::string ToString() const;
  // The negative errno a C ABI caller expects (-EINVAL, -ENOENT, -EIO, ...); 0 when ok.
  int ToNegativeErrno() const;
  // Prefixes the message with what was being done: "opening image x: <message>".
  Status Context(std::string_view what) const;

 private:
  Code code_ = Code::kOk;
  std::string message_;
};

// fmt-style constructors: Corrupt("{}: header says {} bytes", path, n).
#define GPULAZY_STATUS_CTOR(Name, CodeValue)                                    \
  template <typename... Args>                                                   \
  Status Name(fmt::format_string<Args...> format, Args&&... args) {             \
    return Status(CodeValue, fmt::format(format, std::forward<Args>(args)...)); \
  }
GPULAZY_STATUS_CTOR(InvalidArgument, Code::kInvalidArgument)
GPULAZY_STATUS_CTOR(NotFound, Code::kNotFound)
GPULAZY_STATUS_CTOR(Corrupt, Code::kCorrupt)
GPULAZY_STATUS_CTOR(IoError, Code::kIoError)
GPULAZY_STATUS_CTOR(OutOfRange, Code::kOutOfRange)
GPULAZY_STATUS_CTOR(Unsupported, Code::kUnsupported)
GPULAZY_STATUS_CTOR(PermissionDenied, Code::kPermissionDenied)
GPULAZY_STATUS_CTOR(Unavailable, Code::kUnavailable)
GPULAZY_STATUS_CTOR(ResourceExhausted, Code::kResourceExhausted)
GPULAZY_STATUS_CTOR(TimedOut, Code::kTimeout)
GPULAZY_STATUS_CTOR(Aborted, Code::kAborted)
GPULAZY_STATUS_CTOR(Internal, Code::kInternal)
#undef GPULAZY_STATUS_CTOR

// An IoError carrying strerror(errno_value): ErrnoError(errno, "open {}", path).
template <typename... Args>
Status ErrnoError(int errno_value, fmt::format_string<Args...> format, Args&&... args);
Status ErrnoStatus(int errno_value, std::string what);
template <typename... Args>
Status ErrnoError(int errno_value, fmt::format_string<Args...> format, Args&&... args) {
  return ErrnoStatus(errno_value, fmt::format(format, std::forward<Args>(args)...));
}

// A value or the Status saying why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}         // NOLINT(google-explicit-constructor)
  Result(Status status) : status_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    assert(!status_.ok() && "Result built from an ok Status has no value");
    if (status_.ok()) status_ = Status(Code::kInternal, "Result built from an ok Status");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace gpulazy

// Early-return helpers. GPULAZY_ASSIGN_OR_RETURN(auto x, Foo()) declares x from Foo()'s value.
#define GPULAZY_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::gpulazy::Status gpulazy_status_ = (expr);        \
    if (!gpulazy_status_.ok()) return gpulazy_status_; \
  } while (0)

#define GPULAZY_CONCAT_INNER(a, b) a##b
#define GPULAZY_CONCAT(a, b) GPULAZY_CONCAT_INNER(a, b)
#define GPULAZY_ASSIGN_OR_RETURN(decl, expr) \
  GPULAZY_ASSIGN_OR_RETURN_IMPL(GPULAZY_CONCAT(gpulazy_result_, __LINE__), decl, expr)
// `decl` is a declaration and `tmp` an identifier: neither may be parenthesized.
// NOLINTBEGIN(bugprone-macro-parentheses)
#define GPULAZY_ASSIGN_OR_RETURN_IMPL(tmp, decl, expr) \
  auto tmp = (expr);                                   \
  if (!tmp.ok()) return tmp.status();                  \
  decl = std::move(tmp).value()
// NOLINTEND(bugprone-macro-parentheses)
