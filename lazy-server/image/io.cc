#include "lazy-server/image/io.h"

#include <fcntl.h>
#include <linux/openat2.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <limits>
#include <utility>
#include <vector>

namespace gpulazy {

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) reset(other.release());
  return *this;
}

UniqueFd::~UniqueFd() {
  reset();
}

void UniqueFd::reset(int fd) {
  // close() errors on a read-only or already-fsynced fd carry no information we could act on;
  // writers fsync explicitly before they let go of a file.
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

Result<UniqueFd> OpenForRead(const std::filesystem::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "open {}", path.string());
  return UniqueFd(fd);
}

Result<UniqueFd> OpenBeneath(int dir_fd, const std::filesystem::path& relative, int flags,
                             std::string_view what) {
  struct open_how how {};
  how.flags = static_cast<uint64_t>(flags | O_CLOEXEC);
  how.resolve = RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS;
  for (;;) {
    const long fd = ::syscall(SYS_openat2, dir_fd, relative.c_str(), &how, sizeof(how));
    if (fd >= 0) return UniqueFd(static_cast<int>(fd));
    const int err = errno;
    if (err == EINTR || err == EAGAIN) continue;  // EAGAIN: a rename raced the lookup
    if (err == EXDEV) return PermissionDenied("{}: resolves outside its directory; refused", what);
    return ErrnoError(err, "open {}", what);
  }
}

Result<UniqueFd> OpenInDir(const std::filesystem::path& dir, const std::filesystem::path& name) {
  const std::filesystem::path path = dir / name;
  int raw_dir = ::open(dir.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
  if (raw_dir < 0) return ErrnoError(errno, "open {}", dir.string());
  UniqueFd dir_fd(raw_dir);
  return OpenBeneath(dir_fd.get(), name, O_RDONLY, path.string());
}

Result<uint64_t> FileSize(int fd, const std::filesystem::path& what) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoError(errno, "stat {}", what.string());
  if (!S_ISREG(st.st_mode)) return InvalidArgument("{}: not a regular file", what.string());
  return static_cast<uint64_t>(st.st_size);
}

namespace {

// pread/pwrite take an off_t; refuse ranges that do not fit rather than wrap.
bool RangeFitsOffT(uint64_t offset, uint64_t length) {
  constexpr uint64_t kMax = static_cast<uint64_t>(std::numeric_limits<off_t>::max());
  return offset <= kMax && length <= kMax - offset;
}

}  // namespace

Status ReadExactAt(int fd, uint64_t offset, std::span<uint8_t> out,
                   const std::filesystem::path& what) {
  if (!RangeFitsOffT(offset, out.size()))
    return OutOfRange("{}: read of {} bytes at offset {} is past any file", what.string(),
                      out.size(), offset);
  size_t done = 0;
  while (done < out.size()) {
    ssize_t n =
        ::pread(fd, out.data() + done, out.size() - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "read {} at offset {}", what.string(), offset + done);
    }
    if (n == 0)
      return Corrupt("{}: file ends at offset {}, wanted {} bytes at offset {}", what.string(),
                     offset + done, out.size(), offset);
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status WriteAllAt(int fd, uint64_t offset, std::span<const uint8_t> bytes,
                  const std::filesystem::path& what) {
  if (!RangeFitsOffT(offset, bytes.size()))
    return OutOfRange("{}: write of {} bytes at offset {} is past any file", what.string(),
                      bytes.size(), offset);
  size_t done = 0;
  while (done < bytes.size()) {
    ssize_t n =
        ::pwrite(fd, bytes.data() + done, bytes.size() - done, static_cast<off_t>(offset + done));
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(errno, "write {} at offset {}", what.string(), offset + done);
    }
    if (n == 0) return IoError("write {} at offset {}: no progress", what.string(), offset + done);
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

namespace {

Result<std::vector<uint8_t>> ReadWholeFd(const UniqueFd& fd, const std::filesystem::path& path,
                                         uint64_t max_bytes) {
  GPULAZY_ASSIGN_OR_RETURN(uint64_t size, FileSize(fd.get(), path));
  // Checked before allocating: the size comes from a file we do not trust.
  if (size > max_bytes)
    return ResourceExhausted("{}: {} bytes is larger than the {}-byte limit", path.string(), size,
                             max_bytes);
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  GPULAZY_RETURN_IF_ERROR(ReadExactAt(fd.get(), 0, bytes, path));
  return bytes;
}

}  // namespace

Result<std::vector<uint8_t>> ReadWholeFile(const std::filesystem::path& path, uint64_t max_bytes) {
  GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(path));
  return ReadWholeFd(fd, path, max_bytes);
}

Result<std::vector<uint8_t>> ReadWholeFileInDir(const std::filesystem::path& dir,
                                                const std::filesystem::path& name,
                                                uint64_t max_bytes) {
  GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenInDir(dir, name));
  return ReadWholeFd(fd, dir / name, max_bytes);
}

Result<std::string> ReadGuardedFile(const std::string& path, const GuardedFileRules& rules) {
  const UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) return ErrnoError(errno, "{} {}", rules.kind, path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) return ErrnoError(errno, "{} {}", rules.kind, path);
  if (!S_ISREG(st.st_mode)) return InvalidArgument("{} {} is not a regular file", rules.kind, path);
  // Refused rather than warned about, so a deployment never runs with one by accident.
  if ((st.st_mode & rules.refused_mode) != 0)
    return PermissionDenied("{} {} {} (mode {:04o}); {}", rules.kind, path, rules.refused_because,
                            st.st_mode & 07777, rules.fix);
  if (static_cast<uint64_t>(st.st_size) > rules.max_bytes)
    return InvalidArgument("{} {} is larger than {} bytes", rules.kind, path, rules.max_bytes);
  std::string bytes(static_cast<size_t>(st.st_size), '\0');
  GPULAZY_RETURN_IF_ERROR(ReadExactAt(
      fd.get(), 0, std::span(reinterpret_cast<uint8_t*>(bytes.data()), bytes.size()), path));
  return bytes;
}

std::vector<NumberedLine> SplitLines(std::string_view text) {
  std::vector<NumberedLine> lines;
  for (size_t start = 0; start < text.size();) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(start, end - start);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    lines.push_back({lines.size() + 1, line});
    start = end + 1;
  }
  return lines;
}

Status WriteFileAtomically(const std::filesystem::path& path, std::span<const uint8_t> bytes) {
  // A unique temporary in the same directory, so the rename stays within one filesystem and
  // concurrent writers of the same target never share a temporary.
  std::string tmp_template = path.string() + ".tmp.XXXXXX";
  std::vector<char> tmp_name(tmp_template.begin(), tmp_template.end());
  tmp_name.push_back('\0');
  int raw_fd = ::mkostemp(tmp_name.data(), O_CLOEXEC);
  if (raw_fd < 0) return ErrnoError(errno, "create temporary for {}", path.string());
  UniqueFd fd(raw_fd);
  const std::filesystem::path tmp_path(tmp_name.data());
  auto fail = [&](Status status) {
    fd.reset();
    ::unlink(tmp_path.c_str());
    return status;
  };
  // mkostemp creates 0600; image files are meant to be readable like CRIU's own.
  if (::fchmod(fd.get(), 0644) != 0) return fail(ErrnoError(errno, "chmod {}", tmp_path.string()));
  Status written = WriteAllAt(fd.get(), 0, bytes, tmp_path);
  if (!written.ok()) return fail(written);
  if (::fsync(fd.get()) != 0) return fail(ErrnoError(errno, "fsync {}", tmp_path.string()));
  if (::close(fd.release()) != 0) return fail(ErrnoError(errno, "close {}", tmp_path.string()));
  if (::rename(tmp_path.c_str(), path.c_str()) != 0)
    return fail(ErrnoError(errno, "rename {} to {}", tmp_path.string(), path.string()));
  // Make the rename itself durable; a failure here leaves a complete file, so it is not fatal
  // to correctness, but report it anyway.
  std::filesystem::path dir = path.parent_path();
  if (dir.empty()) dir = ".";
  int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    UniqueFd dir_guard(dir_fd);
    if (::fsync(dir_fd) != 0) return ErrnoError(errno, "fsync directory {}", dir.string());
  }
  return Status::Ok();
}

Result<PageCacheProbe> PageCacheProbe::Map(int fd, uint64_t size,
                                           const std::filesystem::path& what) {
  PageCacheProbe probe;
  if (size == 0) return probe;
  if (size > std::numeric_limits<size_t>::max())
    return OutOfRange("{}: {} bytes cannot be mapped", what.string(), size);
  void* base = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED)
    return ErrnoError(errno, "mapping {} to probe its page cache", what.string());
  probe.base_ = base;
  probe.size_ = size;
  return probe;
}

PageCacheProbe::PageCacheProbe(PageCacheProbe&& other) noexcept
    : base_(std::exchange(other.base_, nullptr)), size_(std::exchange(other.size_, 0)) {}

PageCacheProbe& PageCacheProbe::operator=(PageCacheProbe&& other) noexcept {
  if (this != &other) {
    if (base_ != nullptr) ::munmap(base_, size_);
    base_ = std::exchange(other.base_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

PageCacheProbe::~PageCacheProbe() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

bool PageCacheProbe::Cached(uint64_t offset, uint64_t length) const {
  if (base_ == nullptr || length == 0 || offset > size_ || length > size_ - offset) return false;
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t first = offset / page * page;
  const uint64_t pages = (offset + length - first + page - 1) / page;
  // A 2 MiB chunk is 512 pages: a small vector, kept per thread to spare an allocation a call.
  thread_local std::vector<unsigned char> resident;
  resident.resize(pages);
  if (::mincore(static_cast<uint8_t*>(base_) + first, pages * page, resident.data()) != 0)
    return false;
  for (unsigned char r : resident)
    if ((r & 1) == 0) return false;
  return true;
}

Result<uint64_t> RaiseOpenFileLimit() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) return ErrnoError(errno, "getrlimit(RLIMIT_NOFILE)");
  if (limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    if (::setrlimit(RLIMIT_NOFILE, &limit) != 0)
      return ErrnoError(errno, "raising the open file limit to {}", limit.rlim_max);
  }
  return static_cast<uint64_t>(limit.rlim_cur);
}

}  // namespace gpulazy
