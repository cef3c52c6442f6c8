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
// Thread-safety: as CopyEngine; Bind, Abandon and the accessors from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include "page-client/copy_engine.h"
#include "page-client/uffd/memory.h"
#include "page-client/uffd/userfaultfd.h"

namespace gpulazy::uffd {

class UffdCopyEngine : public client::CopyEngine {
 public:
  explicit UffdCopyEngine(const Userfaultfd& uffd) : uffd_(uffd) {}

  std::string_view name() const override { return "uffd"; }
  Status AddDestination(uint32_t bo, uint64_t size) override;
  Status Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw,
               client::CopyDone done) override;
  // Zero chunks without bytes: UFFDIO_ZEROPAGE in MISSING mode (in private anonymous memory the
  // shared zero page: no page allocated until the program writes); in MINOR mode the range is
  // zeroed through our mapping, then mapped (UFFDIO_CONTINUE).
  bool WritesZeros() const override { return true; }
  Status WriteZeros(uint32_t bo, uint64_t offset, uint64_t length, client::CopyDone done) override;
  Status Flush() override;

  // Where BO `region.bo` lives in the faulting process. In MINOR mode `memfd` is the BO's
  // memfd (the engine maps it to write); ignored in MISSING mode. Applies held writes.
  Status Bind(const Region& region, int memfd = -1);
  // Completes every held write with kAborted (the restored process will never bind); later
  // writes to unbound BOs fail at once instead of being held.
  void Abandon();

  bool target_gone() const { return target_gone_.load(); }
  uint64_t bytes_installed() const { return bytes_installed_.load(); }
  uint64_t bytes_already_present() const { return already_present_.load(); }
  uint64_t bytes_zeroed() const { return zeroed_.load(); }  // of bytes_installed, by WriteZeros

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
    std::vector<Held> held;
  };
  // Checks the range and installs the write, or holds it while the BO is not bound.
  Status Submit(uint32_t bo, Held write);
  // Installs into a bound destination; called without mutex_ held.
  Status Install(const Destination& dest, const Held& write);

  const Userfaultfd& uffd_;
  std::mutex mutex_;  // guards destinations_' shape, bindings and held writes
  std::map<uint32_t, Destination> destinations_;
  bool abandoned_ = false;  // guarded by mutex_
  std::atomic<bool> target_gone_{false};
  std::atomic<uint64_t> bytes_installed_{0};
  std::atomic<uint64_t> already_present_{0};
  std::atomic<uint64_t> zeroed_{0};
};

}  // namespace gpulazy::uffd
