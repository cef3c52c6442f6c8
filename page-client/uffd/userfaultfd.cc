#include "page-client/uffd/userfaultfd.h"

#include <errno.h>
#include <fcntl.h>
#include <linux/userfaultfd.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/ioctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <vector>

namespace gpulazy::uffd {

const char* FillModeName(FillMode mode) {
  return mode == FillMode::kMissingCopy ? "missing-copy" : "minor-continue";
}

uint64_t PageSize() {
  static const uint64_t size = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return size;
}

namespace {

uint64_t FeaturesFor(FillMode mode) {
  // Shmem support is asked for in both modes: the host engine's BO memory is a memfd. Remap
  // events: without them the kernel unregisters a range the program moves, which then reads
  // zeros where its chunks have not landed (docs/uffd.md, "Memory the program moved").
  const uint64_t common = UFFD_FEATURE_MISSING_SHMEM | UFFD_FEATURE_EVENT_REMAP;
  return mode == FillMode::kMissingCopy ? common : (common | UFFD_FEATURE_MINOR_SHMEM);
}

// One ioctl that installs pages (COPY, CONTINUE or ZEROPAGE), repeated past pages that are already
// there (EEXIST) and past interruptions (EAGAIN: the range changed under us, retry the rest).
// ENOENT says the range is not wholly inside one VMA registered with us: the process split the
// mapping (madvise, mprotect on part of it), or unmapped or replaced some of it. The rest is then
// installed page by page, so the pages still registered get their bytes and only those that are
// not are skipped.
template <typename Step>
Result<InstallResult> InstallLoop(uint64_t addr, uint64_t length, const char* what, Step step) {
  InstallResult result;
  uint64_t done = 0;
  const uint64_t page = PageSize();
  bool page_by_page = false;
  while (done < length) {
    int64_t progressed = 0;
    const uint64_t ask = page_by_page ? std::min(page, length - done) : length - done;
    int err = step(addr + done, ask, &progressed);
    if (progressed > 0) {
      done += static_cast<uint64_t>(progressed);
      result.installed += static_cast<uint64_t>(progressed);
    }
    if (err == 0) continue;
    if (err == EEXIST) {  // the page at addr+done is there already: skip it
      done += page;
      result.already_present += page;
      continue;
    }
    if (err == EAGAIN && progressed > 0) continue;  // partial progress (a page there already)
    if (err == EAGAIN) {
      // Nothing done: the program is changing its mappings and the event is unread. Not retried
      // here: the reader of events may be this very thread (the pager serving a fault), and the
      // rest may have moved by the time the event is read.
      result.interrupted += length - done;
      return result;
    }
    if (err == ENOENT) {
      if (!page_by_page && length - done > page) {
        page_by_page = true;
        continue;
      }
      const uint64_t skipped = std::min(page, length - done);
      done += skipped;
      result.unregistered += skipped;
      continue;
    }
    if (err == ESRCH) return Aborted("{} at {:#x}: the registered process is gone", what, addr);
    return ErrnoError(err, "{} [{:#x}, +{})", what, addr + done, length - done);
  }
  return result;
}

}  // namespace

const char* FaultScopeName(FaultScope scope) {
  return scope == FaultScope::kUserAndKernel ? "user and kernel" : "user-mode only";
}

Result<Userfaultfd> Userfaultfd::Create(FillMode mode, std::optional<FaultScope> scope) {
  auto open = [](FaultScope wanted) {
    const int flags =
        O_CLOEXEC | O_NONBLOCK | (wanted == FaultScope::kUserOnly ? UFFD_USER_MODE_ONLY : 0);
    return static_cast<int>(syscall(SYS_userfaultfd, flags));
  };
  FaultScope got = scope.value_or(FaultScope::kUserAndKernel);
  int raw = open(got);
  if (raw < 0 && errno == EPERM && !scope) {
    // Catching the kernel's faults needs CAP_SYS_PTRACE (or vm.unprivileged_userfaultfd=1); a
    // restore as root has it. Without it the program runs, but a syscall handed BO memory that
    // has not arrived fails (docs/uffd.md, "Limits").
    static std::once_flag warned;
    std::call_once(warned, [] {
      spdlog::warn(
          "userfaultfd: not allowed to catch kernel-mode faults (needs CAP_SYS_PTRACE or "
          "vm.unprivileged_userfaultfd=1); user-mode faults only: a system call given restored "
          "memory that has not arrived gets EFAULT");
    });
    got = FaultScope::kUserOnly;
    raw = open(got);
  }
  if (raw < 0) return ErrnoError(errno, "userfaultfd ({} faults)", FaultScopeName(got));
  UniqueFd fd(raw);
  uffdio_api api{};
  api.api = UFFD_API;
  api.features = FeaturesFor(mode);
  if (ioctl(fd.get(), UFFDIO_API, &api) != 0) {
    if (errno == EINVAL)
      return Unsupported("userfaultfd lacks features for {}", FillModeName(mode));
    return ErrnoError(errno, "UFFDIO_API");
  }
  return Userfaultfd(std::move(fd), mode, got, ::getpid(), UniqueFd());
}

Userfaultfd Userfaultfd::Adopt(UniqueFd fd, FillMode mode, std::optional<FaultScope> scope,
                               std::optional<pid_t> owner, UniqueFd owner_pidfd) {
  return Userfaultfd(std::move(fd), mode, scope, owner, std::move(owner_pidfd));
}

bool Userfaultfd::OwnerExited() const {
  if (!owner_pidfd_.valid()) return false;
  pollfd exited{owner_pidfd_.get(), POLLIN, 0};
  int rc;
  do {
    rc = poll(&exited, 1, 0);
  } while (rc < 0 && errno == EINTR);
  return rc == 1 && (exited.revents & POLLIN) != 0;
}

Status Userfaultfd::Register(uint64_t addr, uint64_t length) const {
  uffdio_register reg{};
  reg.range.start = addr;
  reg.range.len = length;
  reg.mode = UFFDIO_REGISTER_MODE_MISSING;
  if (mode_ == FillMode::kMinorContinue) reg.mode |= UFFDIO_REGISTER_MODE_MINOR;
  if (ioctl(fd_.get(), UFFDIO_REGISTER, &reg) != 0)
    return ErrnoError(errno, "UFFDIO_REGISTER [{:#x}, +{}) {}", addr, length, FillModeName(mode_));
  const uint64_t needed =
      mode_ == FillMode::kMissingCopy ? (1ull << _UFFDIO_COPY) : (1ull << _UFFDIO_CONTINUE);
  if ((reg.ioctls & needed) == 0)
    return Unsupported("region [{:#x}, +{}) does not support {}", addr, length,
                       FillModeName(mode_));
  return Status::Ok();
}

Status Userfaultfd::Unregister(uint64_t addr, uint64_t length) const {
  uffdio_range range{addr, length};
  if (ioctl(fd_.get(), UFFDIO_UNREGISTER, &range) != 0) {
    if (errno == ESRCH) return Status::Ok();  // the process is gone, and its registration too
    return ErrnoError(errno, "UFFDIO_UNREGISTER [{:#x}, +{})", addr, length);
  }
  // A fault racing UFFDIO_UNREGISTER can miss its wake and sleep for good (seen on 6.18; taken
  // to be a fault under the per-VMA lock queueing after the wake, before the VMA is cleared).
  // Once the ioctl has returned such a fault is queued and no new one can come: one wake here
  // reaches them all (docs/uffd.md).
  return Wake(addr, length);
}

Result<InstallResult> Userfaultfd::Copy(uint64_t dst, std::span<const uint8_t> src) const {
  const uint64_t page = PageSize();
  const uint64_t whole = src.size() & ~(page - 1);
  auto step = [&](uint64_t at, uint64_t left, int64_t* progressed) {
    uffdio_copy copy{};
    copy.dst = at;
    copy.src = reinterpret_cast<uint64_t>(src.data()) + (at - dst);
    copy.len = left;
    int rc = ioctl(fd_.get(), UFFDIO_COPY, &copy);
    *progressed = copy.copy > 0 ? copy.copy : 0;
    if (rc == 0) return 0;
    return copy.copy < 0 ? static_cast<int>(-copy.copy) : errno;
  };
  GPULAZY_ASSIGN_OR_RETURN(InstallResult result, InstallLoop(dst, whole, "UFFDIO_COPY", step));
  if (whole < src.size()) {  // a short last page: install it zero-padded from a bounce page
    std::vector<uint8_t> bounce(page, 0);
    std::memcpy(bounce.data(), src.data() + whole, src.size() - whole);
    auto tail = [&](uint64_t at, uint64_t left, int64_t* progressed) {
      uffdio_copy copy{};
      copy.dst = at;
      copy.src = reinterpret_cast<uint64_t>(bounce.data());
      copy.len = left;
      int rc = ioctl(fd_.get(), UFFDIO_COPY, &copy);
      *progressed = copy.copy > 0 ? copy.copy : 0;
      if (rc == 0) return 0;
      return copy.copy < 0 ? static_cast<int>(-copy.copy) : errno;
    };
    GPULAZY_ASSIGN_OR_RETURN(InstallResult last,
                             InstallLoop(dst + whole, page, "UFFDIO_COPY", tail));
    result += last;
  }
  return result;
}

Result<InstallResult> Userfaultfd::Continue(uint64_t addr, uint64_t length) const {
  auto step = [&](uint64_t at, uint64_t left, int64_t* progressed) {
    uffdio_continue cont{};
    cont.range.start = at;
    cont.range.len = left;
    int rc = ioctl(fd_.get(), UFFDIO_CONTINUE, &cont);
    *progressed = cont.mapped > 0 ? cont.mapped : 0;
    if (rc == 0) return 0;
    return cont.mapped < 0 ? static_cast<int>(-cont.mapped) : errno;
  };
  return InstallLoop(addr, PageAlignUp(length), "UFFDIO_CONTINUE", step);
}

Result<InstallResult> Userfaultfd::ZeroPage(uint64_t addr, uint64_t length) const {
  auto step = [&](uint64_t at, uint64_t left, int64_t* progressed) {
    uffdio_zeropage zero{};
    zero.range.start = at;
    zero.range.len = left;
    int rc = ioctl(fd_.get(), UFFDIO_ZEROPAGE, &zero);
    *progressed = zero.zeropage > 0 ? zero.zeropage : 0;
    if (rc == 0) return 0;
    return zero.zeropage < 0 ? static_cast<int>(-zero.zeropage) : errno;
  };
  return InstallLoop(addr, PageAlignUp(length), "UFFDIO_ZEROPAGE", step);
}

Status Userfaultfd::Wake(uint64_t addr, uint64_t length) const {
  uffdio_range range{addr, PageAlignUp(length)};
  if (ioctl(fd_.get(), UFFDIO_WAKE, &range) != 0 && errno != ESRCH)
    return ErrnoError(errno, "UFFDIO_WAKE [{:#x}, +{})", addr, length);
  return Status::Ok();
}

bool Userfaultfd::MappingsChanging() const {
  uffdio_zeropage nothing{};
  return ioctl(fd_.get(), UFFDIO_ZEROPAGE, &nothing) != 0 && errno == EAGAIN;
}

Result<size_t> Userfaultfd::Read(std::span<FaultEvent> out) const {
  uffd_msg msgs[64];
  const size_t want = std::min(out.size(), std::size(msgs));
  ssize_t n = ::read(fd_.get(), msgs, want * sizeof(uffd_msg));
  if (n < 0) {
    if (errno == EAGAIN || errno == EINTR) return size_t{0};
    return ErrnoError(errno, "reading userfaultfd");
  }
  if (n == 0) return Aborted("userfaultfd closed");
  const size_t count = static_cast<size_t>(n) / sizeof(uffd_msg);
  for (size_t i = 0; i < count; ++i) {
    FaultEvent& event = out[i];
    event = FaultEvent{};
    switch (msgs[i].event) {
      case UFFD_EVENT_PAGEFAULT:
        event.kind = FaultEvent::Kind::kPagefault;
        event.address = msgs[i].arg.pagefault.address;
        event.minor = (msgs[i].arg.pagefault.flags & UFFD_PAGEFAULT_FLAG_MINOR) != 0;
        event.write = (msgs[i].arg.pagefault.flags & UFFD_PAGEFAULT_FLAG_WRITE) != 0;
        break;
      case UFFD_EVENT_REMOVE:
        event.kind = FaultEvent::Kind::kRemove;
        event.address = msgs[i].arg.remove.start;
        event.end = msgs[i].arg.remove.end;
        break;
      case UFFD_EVENT_UNMAP:
        event.kind = FaultEvent::Kind::kUnmap;
        event.address = msgs[i].arg.remove.start;
        event.end = msgs[i].arg.remove.end;
        break;
      case UFFD_EVENT_REMAP:
        event.kind = FaultEvent::Kind::kRemap;
        event.address = msgs[i].arg.remap.from;
        event.end = msgs[i].arg.remap.from + msgs[i].arg.remap.len;
        event.to = msgs[i].arg.remap.to;
        break;
      default:
        break;
    }
  }
  return count;
}

}  // namespace gpulazy::uffd
