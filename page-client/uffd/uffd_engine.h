// UffdCopyEngine: a CopyEngine whose writes land in userfaultfd-registered memory of a restored
// process (possibly another process) through the uffd itself: UFFDIO_COPY in MISSING mode, or a
// write through the pager's own mapping of the BO's memfd followed by UFFDIO_CONTINUE in MINOR
// mode. Installing a page wakes the threads that fault on it, and a page that is already there
// (EEXIST) is skipped, so the background fill and the fault path can never race.
//
// Binding: the session creates destinations (AddDestination) before the restored process has
// described its memory; writes to a BO that is not bound yet are held (the session's credit
// window bounds them) and applied when Bind runs.
//
// When the restored process is gone (ESRCH), writes complete with Ok and change nothing, and
// target_gone() turns true: there is no memory left to fill, and the pager ends the session.
//
// A BO's bytes outlive its mappings, as a GPU BO's do: the program may unmap (part of) a shared
// BO, or map something else over it, and still see the BO through another mapping of its memfd
// (a range a MREMAP_DONTUNMAP move left, a mapping it makes afresh). Bytes that find no
// registered range of the program's (bytes_unregistered) therefore still go into the BO's
// memfd: in MINOR mode they are there already (written through the engine's own mapping); in
// MISSING mode, for a BO bound with its memfd, they are written into the memfd's holes only
// (SEEK_HOLE), so a page the program has written through another mapping stays as it is
// (bytes_kept_in_memfd). Private anonymous memory unmapped is gone: its bytes are skipped.
//
// Deferred zeros (MISSING mode, the default there): a zero chunk is recorded, not installed, and
// completes at once; the pager installs a page of it (UFFDIO_ZEROPAGE) when the program first
// touches that page (InstallDeferredZeros). In shmem, where UFFDIO_ZEROPAGE allocates a cleared
// page, the zeros nobody touches then cost no memory, and after unregistration they stay holes
// (reading one there allocates it, as for any shmem hole). Until unregistration such a chunk is
// resident for the session but unmapped: a system call on it faults in the kernel and waits for
// the pager as the program's touch does, or gets EFAULT, as on any unfilled page, where the
// registration is user-mode only (Userfaultfd::scope()).
//
// Thread-safety: as CopyEngine; Bind, Abandon and the accessors from any thread.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "page-client/copy_engine.h"
#include "page-client/uffd/memory.h"
#include "page-client/uffd/userfaultfd.h"

namespace gpulazy::uffd {

// Whether a write(2) into a hole of a memfd may allocate a folio larger than a page (and so
// fill the neighbouring holes with zeros), from the texts of
// /sys/kernel/mm/transparent_hugepage/shmem_enabled (`global`; empty: no such file) and of each
// hugepages-*/shmem_enabled beside it (`per_size`). A memfd follows these settings; a write has
// no mapping, so only "always", "within_size" and "force" count ("inherit" takes the global one).
bool ShmemWritesMayAllocateLargeFolios(std::string_view global,
                                       const std::vector<std::string>& per_size);
// The same for this machine, read once.
bool ShmemWritesMayAllocateLargeFoliosHere();

struct UffdEngineOptions {
  bool defer_zeros = true;  // MISSING mode only; MINOR mode always installs zeros
};

class UffdCopyEngine : public client::CopyEngine {
 public:
  explicit UffdCopyEngine(const Userfaultfd& uffd, UffdEngineOptions options = {})
      : uffd_(uffd), options_(options) {}

  std::string_view name() const override { return "uffd"; }
  Status AddDestination(uint32_t bo, uint64_t size) override;
  Status Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw,
               client::CopyDone done) override;
  // Zero chunks without bytes. MISSING mode: deferred (above), or else UFFDIO_ZEROPAGE at once
  // (in private anonymous memory the shared zero page: nothing allocated until the program
  // writes); MINOR mode: zeroed through our mapping, then mapped (UFFDIO_CONTINUE).
  bool WritesZeros() const override { return true; }
  Status WriteZeros(uint32_t bo, uint64_t offset, uint64_t length, client::CopyDone done) override;
  Status Flush() override;

  // Where BO `region.bo` lives in the faulting process. `memfd` is the BO's memfd (-1: private
  // anonymous memory, or not known): MINOR mode needs it (the engine maps it to write); in
  // MISSING mode it keeps bytes the program has no registered range for (above). Applies held
  // writes.
  Status Bind(const Region& region, int memfd = -1);
  // The BO whose memfd, as given at Bind, is the file `device`/`inode`, and its byte at
  // `file_offset`; nullopt where no bound BO's memfd is that file or the offset is past the BO.
  // The pager asks on a fault in no range the address map knows (a mapping of a BO's memfd the
  // program made without an event that says where: docs/uffd.md).
  std::optional<AddressMap::Location> FindByFile(dev_t device, uint64_t inode,
                                                 uint64_t file_offset) const;
  // The engine's own mappings of BO memfds (MINOR mode writes through them): in the pager's
  // process, not the program's, but the same process when the pager runs in the program.
  std::vector<std::pair<uint64_t, uint64_t>> OwnMappings() const;
  // Where every bound BO's bytes are now; the pager applies the program's moves to it, and an
  // install that a move raced is made again at the new address.
  AddressMap& addresses() { return addresses_; }
  // The pager, on a fault at [offset, offset + length) of `bo` (page aligned) in a chunk the
  // session has: installs the deferred zero pages there (UFFDIO_ZEROPAGE, which wakes their
  // faulting threads) and drops them from the record. nullopt when no deferred zero overlaps the
  // range (the fault is for a page an install is mapping or has mapped: wake it); kAborted when
  // the process is gone. The pager's event-reading thread passes kNoWait: a move the program is
  // making then leaves the zeros in the record and counts them `interrupted` (try again after
  // reading the event), where other threads wait for the pager to read it.
  enum class MovesPending { kWait, kNoWait };
  Result<std::optional<InstallResult>> InstallDeferredZeros(
      uint32_t bo, uint64_t offset, uint64_t length, MovesPending moves = MovesPending::kWait);
  // Not where faults are user-mode only: there a system call on a deferred zero page fails
  // with EFAULT until the restore completes, where an installed one just works.
  bool defers_zeros() const {
    return options_.defer_zeros && uffd_.mode() == FillMode::kMissingCopy &&
           uffd_.scope() != FaultScope::kUserOnly;
  }
  // Completes every held write with kAborted (the restored process will never bind); later
  // writes to unbound BOs fail at once instead of being held.
  void Abandon();

  // Tests only, before the first Bind: runs on the installing thread once an install has looked
  // up where the bytes of [offset, ...) of `bo` go, before it installs them there.
  void set_after_resolve_for_testing(std::function<void(uint32_t bo, uint64_t offset)> hook) {
    after_resolve_ = std::move(hook);
  }

  bool target_gone() const { return target_gone_.load(); }
  uint64_t bytes_installed() const { return bytes_installed_.load(); }
  uint64_t bytes_already_present() const { return already_present_.load(); }
  // Of bytes_installed, zero pages (by WriteZeros, or deferred and installed on a fault).
  uint64_t bytes_zeroed() const { return zeroed_.load(); }
  uint64_t bytes_zero_deferred() const { return deferred_.load(); }  // recorded, not installed
  // Bytes not installed because the restored process no longer has them registered (unmapped,
  // replaced, or unregistered): nobody can read them through a fault of ours, so they are skipped.
  uint64_t bytes_unregistered() const { return unregistered_.load(); }
  // Of bytes_unregistered, those that are in the BO's memfd all the same (see above).
  uint64_t bytes_kept_in_memfd() const { return kept_.load(); }

 private:
  struct Held {
    uint64_t offset;
    std::span<const uint8_t> raw;  // empty for zeros
    uint64_t length;               // raw.size(), or the bytes to zero
    bool zeros;
    client::CopyDone done;
  };
  struct Destination {
    uint64_t size = 0;
    std::optional<Region> region;
    Mapping filler;  // MINOR mode: our own mapping of the memfd
    // MISSING mode, a BO bound with its memfd: the memfd opened afresh (an offset of our own
    // for SEEK_HOLE), to keep bytes the program has no registered range for.
    UniqueFd keeper;
    std::vector<Held> held;
    // Deferred zero ranges, start -> end, disjoint and merged where they touch. Guarded by
    // zeros_mutex_ (not mutex_: installs run without mutex_, and so does the fault path).
    std::map<uint64_t, uint64_t> deferred_zeros;
    std::atomic<bool> told_unregistered{false};  // logged that installs here were skipped
    std::atomic<bool> told_keep_failed{false};   // logged that keeping bytes in the memfd failed
  };
  // Checks the range and installs the write, or holds it while the BO is not bound.
  Status Submit(uint32_t bo, Held write);
  // Installs into a bound destination; called without mutex_ held.
  Status Install(Destination& dest, const Held& write);
  // Records [offset, offset + length) as zeros to install on a fault (counted when `count`).
  void DeferZeros(Destination& dest, uint64_t offset, uint64_t length, bool count);
  // Installs [offset, offset + length) of `bo` wherever it lives now, one `step(addr, offset,
  // length)` per piece; again, where the program moved part of it under the install or was
  // moving memory (kWait). With kNoWait what a move stopped is returned `interrupted`.
  template <typename Step>
  Result<InstallResult> InstallResolved(uint32_t bo, uint64_t offset, uint64_t length,
                                        MovesPending moves, Step step);
  // Returns once the kernel has no move of the program's unread; kUnavailable after 5 s (the
  // pager is not reading events: the move and the install cannot finish).
  Status WaitForUnreadMoves();
  // Counts an install's outcome, or turns kAborted into target_gone.
  Status Account(Result<InstallResult> result, bool zeros, uint32_t bo, uint64_t offset);
  void NoteUnregistered(uint32_t bo, uint64_t offset);
  // Puts into the BO's memfd the bytes of `write` an install found no registered range for.
  void KeepUnregistered(Destination& dest, const Held& write, uint64_t unregistered);

  const Userfaultfd& uffd_;
  const UffdEngineOptions options_;
  mutable std::mutex mutex_;  // guards destinations_' shape, bindings and held writes
  // The memfds given at Bind, as fstat(2) names them (device, inode) -> BO: which BO a mapping
  // of one shows (FindByFile). Guarded by mutex_.
  std::map<std::pair<dev_t, uint64_t>, uint32_t> bo_by_file_;
  std::mutex zeros_mutex_;  // guards every Destination::deferred_zeros
  std::map<uint32_t, Destination> destinations_;
  AddressMap addresses_;
  bool abandoned_ = false;  // guarded by mutex_
  std::atomic<bool> target_gone_{false};
  std::atomic<uint64_t> bytes_installed_{0};
  std::atomic<uint64_t> already_present_{0};
  std::atomic<uint64_t> zeroed_{0};
  std::atomic<uint64_t> deferred_{0};
  std::atomic<uint64_t> unregistered_{0};
  std::atomic<uint64_t> kept_{0};
  std::function<void(uint32_t, uint64_t)> after_resolve_;  // tests only
};

}  // namespace gpulazy::uffd
