// page-client/uffd/: the userfaultfd pager (docs/uffd.md). Restored BO memory is registered with
// userfaultfd; a fault asks RestoreSession::Ensure for the chunk at demand priority, and the
// session's background fill installs bytes through the same ioctls (UffdCopyEngine), so a fault
// and a fill never race.
//
// userfaultfd.h: the one place that speaks the userfaultfd syscall and ioctls. Everything else
// (engine, pager, handover, tests) goes through this small interface.
//
// Thread-safety: the ioctls may be issued from any number of threads at once (the kernel
// serializes per page); Read is meant for one reader thread.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <span>
#include <utility>

#include "lazy-server/image/io.h"  // UniqueFd
#include "proto/status.h"

namespace gpulazy::uffd {

// How a region is registered and filled (docs/uffd.md has the measurement behind the default).
enum class FillMode {
  // MISSING faults; bytes installed with UFFDIO_COPY into the registered range. Works on
  // anonymous and shmem (memfd) mappings; the filler needs only the uffd and the addresses.
  kMissingCopy,
  // MISSING + MINOR faults on a memfd; bytes written through the filler's own mapping of the
  // memfd, then mapped into the registered range with UFFDIO_CONTINUE. Needs the memfd.
  kMinorContinue,
};
const char* FillModeName(FillMode mode);

struct FaultEvent {
  enum class Kind { kPagefault, kRemove, kUnmap, kRemap, kOther };
  Kind kind = Kind::kOther;
  uint64_t address = 0;  // page fault: the faulting address; remove/unmap/remap: range start
  uint64_t end = 0;      // remove/unmap/remap: range end
  uint64_t to = 0;       // remap: where the range now starts
  bool minor = false;    // a MINOR fault (the page is in the page cache, not mapped)
  bool write = false;
};

// The outcome of installing a range: how much was installed now, how much was already there
// (EEXIST: installed earlier by someone else, e.g. a fill that beat a fault), how much lies
// in no range registered with this userfaultfd (ENOENT page by page: the process unmapped or
// replaced that memory, or it was unregistered), where nothing is installed and no fault of
// ours can wait, and how much was not tried because the program is moving memory and the event
// saying so is unread (EAGAIN: every install on this userfaultfd fails until the pager reads
// it; the caller tries again after that, and the pager's own thread must not wait for it).
struct InstallResult {
  uint64_t installed = 0;
  uint64_t already_present = 0;
  uint64_t unregistered = 0;
  uint64_t interrupted = 0;

  InstallResult& operator+=(const InstallResult& more) {
    installed += more.installed;
    already_present += more.already_present;
    unregistered += more.unregistered;
    interrupted += more.interrupted;
    return *this;
  }
};

// Whose accesses to unfilled registered memory become faults for the pager.
enum class FaultScope {
  // The program's own, and the kernel's on its behalf (read(2) into BO memory, write(2) from
  // it, ...): both wait for the pager. Needs CAP_SYS_PTRACE or vm.unprivileged_userfaultfd=1.
  kUserAndKernel,
  // UFFD_USER_MODE_ONLY: any process may open it, but a system call on unfilled memory fails
  // with EFAULT instead of waiting.
  kUserOnly,
};
const char* FaultScopeName(FaultScope scope);

class Userfaultfd {
 public:
  // Opens a userfaultfd (O_CLOEXEC | O_NONBLOCK) and negotiates the API with the features `mode`
  // needs, and remap events (a registered range the program moves stays registered, and its
  // mremap waits for the reader to read the event); kUnsupported when the kernel lacks them.
  // Without a `scope`: kernel-mode faults too where this process may catch them, else user-mode
  // only (warned once); a `scope` given is that or an error.
  static Result<Userfaultfd> Create(FillMode mode, std::optional<FaultScope> scope = std::nullopt);
  // Wraps a descriptor received from another process (API already negotiated there), with the
  // scope its creator says it has and the process whose memory it registers (nullopt: not
  // known).
  // `owner_pidfd`: a pidfd of the owner, when one could be opened, to tell when it has exited.
  static Userfaultfd Adopt(UniqueFd fd, FillMode mode,
                           std::optional<FaultScope> scope = std::nullopt,
                           std::optional<pid_t> owner = std::nullopt, UniqueFd owner_pidfd = {});

  int fd() const { return fd_.get(); }
  FillMode mode() const { return mode_; }
  // The scope it was created with; for an adopted descriptor, its creator's if told.
  std::optional<FaultScope> scope() const { return scope_; }
  // The process whose memory it registers (the one that created it), in this process's pid
  // namespace: this process for Create; for an adopted descriptor, the sender the kernel vouched
  // for, if known.
  std::optional<pid_t> owner() const { return owner_; }
  // Whether the owner is known to have exited, every thread of it (its pidfd reads readable).
  // False for this process, and where the owner or its pidfd is not known.
  bool OwnerExited() const;

  // Registers [addr, addr + length) (page aligned) for the mode's fault kinds.
  Status Register(uint64_t addr, uint64_t length) const;
  // Unregisters the range, then wakes every fault still asleep in it: such a thread retries and
  // finds ordinary memory. The kernel's own wake at unregister misses a fault that queues itself
  // just after it (see docs/uffd.md); without ours that thread would sleep for good.
  Status Unregister(uint64_t addr, uint64_t length) const;

  // UFFDIO_COPY of src to dst (page aligned; src.size() a multiple of the page size; the last
  // page may be given short and is zero-padded). Pages already present are skipped.
  // kAborted when the registered process is gone (ESRCH): nothing left to fill.
  Result<InstallResult> Copy(uint64_t dst, std::span<const uint8_t> src) const;
  // UFFDIO_CONTINUE over [addr, addr + length): maps page-cache pages. Present pages skipped.
  Result<InstallResult> Continue(uint64_t addr, uint64_t length) const;
  // UFFDIO_ZEROPAGE over [addr, addr + length) (page aligned; the length rounded up to whole
  // pages): zero pages without a source, the shared zero page in private anonymous memory, a
  // cleared page in shmem. Present pages skipped; kAborted as for Copy.
  Result<InstallResult> ZeroPage(uint64_t addr, uint64_t length) const;
  // UFFDIO_WAKE: wakes threads blocked on faults in the range (after someone else installed).
  Status Wake(uint64_t addr, uint64_t length) const;
  // Whether the program is changing its mappings under us and the event saying how (a move)
  // is not read yet: installs then fail with EAGAIN, or with ENOENT where the range has already
  // moved. Asked with an install of nothing, which the kernel refuses with EAGAIN in that state
  // before it looks at the range (seen on 6.18).
  bool MappingsChanging() const;

  // Non-blocking read of pending events; 0 when none. kAborted at EOF.
  Result<size_t> Read(std::span<FaultEvent> out) const;

 private:
  Userfaultfd(UniqueFd fd, FillMode mode, std::optional<FaultScope> scope,
              std::optional<pid_t> owner, UniqueFd owner_pidfd)
      : fd_(std::move(fd)),
        mode_(mode),
        scope_(scope),
        owner_(owner),
        owner_pidfd_(std::move(owner_pidfd)) {}
  UniqueFd fd_;
  FillMode mode_ = FillMode::kMissingCopy;
  std::optional<FaultScope> scope_;
  std::optional<pid_t> owner_;
  UniqueFd owner_pidfd_;
};

uint64_t PageSize();
inline uint64_t PageAlignDown(uint64_t v) {
  return v & ~(PageSize() - 1);
}
inline uint64_t PageAlignUp(uint64_t v) {
  return (v + PageSize() - 1) & ~(PageSize() - 1);
}

}  // namespace gpulazy::uffd
