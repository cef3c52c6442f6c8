// File-descriptor ownership and positional I/O used by the image library, the server and the
// client. Every fd gpulazy opens lives in a UniqueFd.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "proto/status.h"

namespace gpulazy {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd();

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// Says whether a range of a file is in the page cache: mincore on a read-only mapping of the
// file that is never read through (so a file that shrinks cannot fault us with SIGBUS). Linux
// reports page-cache residency of a mapped file only to a process that owns the file or may
// write it (since 5.0); for anyone else a range counts as cached only where this process has
// it mapped, i.e. never here: the answer is then "not cached", which costs a caller relying on
// it only its fast path. A file of size 0 has nothing cached.
class PageCacheProbe {
 public:
  PageCacheProbe() = default;  // probes nothing: Cached() is false
  // Maps the first `size` bytes of `fd`; `what` names the file in errors.
  static Result<PageCacheProbe> Map(int fd, uint64_t size, const std::filesystem::path& what);
  PageCacheProbe(PageCacheProbe&& other) noexcept;
  PageCacheProbe& operator=(PageCacheProbe&& other) noexcept;
  PageCacheProbe(const PageCacheProbe&) = delete;
  PageCacheProbe& operator=(const PageCacheProbe&) = delete;
  ~PageCacheProbe();

  // Every page of [offset, offset + length) is cached. False for an empty or out-of-range
  // range, and on any error.
  bool Cached(uint64_t offset, uint64_t length) const;

 private:
  void* base_ = nullptr;
  uint64_t size_ = 0;
};

Result<UniqueFd> OpenForRead(const std::filesystem::path& path);
// Opens `relative` below the directory `dir_fd` with openat2(RESOLVE_BENEATH |
// RESOLVE_NO_MAGICLINKS): absolute names, ".." and symlinks that would leave the directory
// fail with EXDEV (kPermissionDenied), so the file opened is always beneath it. `what` names
// the file in errors.
Result<UniqueFd> OpenBeneath(int dir_fd, const std::filesystem::path& relative, int flags,
                             std::string_view what);
// A file of an image directory, opened for reading beneath `dir` (OpenBeneath): a file inside
// an image that is a symlink out of it is refused.
Result<UniqueFd> OpenInDir(const std::filesystem::path& dir, const std::filesystem::path& name);
Result<uint64_t> FileSize(int fd, const std::filesystem::path& what);
// Reads exactly out.size() bytes at offset; a short file is kCorrupt naming `what`.
Status ReadExactAt(int fd, uint64_t offset, std::span<uint8_t> out,
                   const std::filesystem::path& what);
Status WriteAllAt(int fd, uint64_t offset, std::span<const uint8_t> bytes,
                  const std::filesystem::path& what);
// Reads a whole file, refusing files larger than max_bytes.
Result<std::vector<uint8_t>> ReadWholeFile(const std::filesystem::path& path, uint64_t max_bytes);
// ReadWholeFile of dir/name, opened with OpenInDir.
Result<std::vector<uint8_t>> ReadWholeFileInDir(const std::filesystem::path& dir,
                                                const std::filesystem::path& name,
                                                uint64_t max_bytes);
// An operator's file that its mode guards (bearer tokens, image-access rules): read only when it
// is a regular file with none of `refused_mode` set and at most `max_bytes` long. Errors name it
// as "`kind` PATH"; a refused mode is kPermissionDenied: "`kind` PATH `refused_because` (mode
// 0644); `fix`".
struct GuardedFileRules {
  std::string_view kind;             // "token file"
  unsigned refused_mode = 0;         // S_IRWXO
  std::string_view refused_because;  // "is accessible to other users"
  std::string_view fix;              // "chmod o-rwx it"
  size_t max_bytes = 0;
};
Result<std::string> ReadGuardedFile(const std::string& path, const GuardedFileRules& rules);
// The lines of an operator's text file (a ReadGuardedFile's) with their numbers from 1, each
// without its '\n' and a '\r' before it.
struct NumberedLine {
  size_t number = 0;
  std::string_view text;
};
std::vector<NumberedLine> SplitLines(std::string_view text);
// Writes to a temporary file beside `path`, fsyncs and renames, so readers never see half a file.
Status WriteFileAtomically(const std::filesystem::path& path, std::span<const uint8_t> bytes);

// Raises this process's soft limit on open descriptors to its hard limit and returns the new
// soft limit. Restores keep a descriptor per BO (the host engine's memfds), and a ROCm process
// has thousands of BOs: more than the usual soft limit of 1024.
Result<uint64_t> RaiseOpenFileLimit();

}  // namespace gpulazy
