// Memory of a restored process's BOs, as the pager sees it: one memfd per BO mapped shared in
// the restored ("faulting") process and registered with its userfaultfd. The pager may live in
// another process; it then knows a region by its address in the faulting process (for
// UFFDIO_COPY / CONTINUE / WAKE) and, in MINOR mode, maps the memfd itself to write the bytes.
//
// Thread-safety: immutable after creation.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "page-client/uffd/userfaultfd.h"
#include "proto/status.h"

namespace gpulazy::uffd {

// A BO's memory in the faulting process.
struct Region {
  uint32_t bo = 0;    // index in the restore session's BO table
  uint64_t addr = 0;  // start address in the faulting process (page aligned)
  uint64_t size = 0;  // BO size in bytes
};

// An owned mmap; munmaps on destruction.
class Mapping {
 public:
  Mapping() = default;
  // Maps `size` bytes of `fd` shared read-write (fd < 0: private anonymous memory).
  static Result<Mapping> Map(int fd, uint64_t size);
  Mapping(Mapping&& other) noexcept;
  Mapping& operator=(Mapping&& other) noexcept;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  ~Mapping();
  uint8_t* data() const { return data_; }
  uint64_t size() const { return size_; }
  std::span<uint8_t> bytes() const { return {data_, static_cast<size_t>(size_)}; }

 private:
  void Reset();
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;  // mapped length (page aligned)
};

// The restored process's side: creates one memfd + shared mapping per BO and registers every
// mapping with `uffd`. The memory reads as "not there yet" (faults) until the pager fills it.
// The mappings are MADV_DONTFORK, as GPU memory is: a child the process forks does not get them
// (its touch faults with SIGSEGV). Memory registered by other means needs the same, else a
// child touching a page before it lands corrupts the parent's copy (docs/uffd.md, "Limits").
class RestoredMemory {
 public:
  // sizes[i] is BO i's size. anonymous: private anonymous mappings instead of memfds (MISSING
  // mode only; the memory cannot then be shared with a pager in another process by fd).
  static Result<RestoredMemory> Create(const Userfaultfd& uffd, const std::vector<uint64_t>& sizes,
                                       bool anonymous = false);
  const std::vector<Region>& regions() const { return regions_; }
  // BO i's memory in this process (reading it may fault and block until the pager fills it).
  std::span<uint8_t> bytes(uint32_t bo) const {
    return mappings_[bo].bytes().first(regions_[bo].size);
  }
  // BO i's memfd (-1 for anonymous memory).
  int memfd(uint32_t bo) const { return memfds_[bo].get(); }
  std::vector<int> memfds() const;

 private:
  std::vector<UniqueFd> memfds_;
  std::vector<Mapping> mappings_;
  std::vector<Region> regions_;
};

// The region that holds `addr`, or nullptr. regions sorted by addr.
const Region* FindRegion(std::span<const Region> regions, uint64_t addr);

}  // namespace gpulazy::uffd
