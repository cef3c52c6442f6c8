// Memory of a restored process's BOs, as the pager sees it: one memfd per BO mapped shared in
// the restored ("faulting") process and registered with its userfaultfd. The pager may live in
// another process; it then knows a region by its address in the faulting process (for
// UFFDIO_COPY / CONTINUE / WAKE) and, in MINOR mode, maps the memfd itself to write the bytes.
//
// Thread-safety: Mapping and RestoredMemory are immutable after creation but for Forget, which
// only their owner calls. AddressMap says its own below.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <span>
#include <string>
#include <utility>
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

// Adds [start, end) to `ranges` (disjoint [start, end) ranges keyed by start), merged with every
// range it overlaps or touches.
void AddRange(std::map<uint64_t, uint64_t>& ranges, uint64_t start, uint64_t end);

// An owned mmap; munmaps on destruction what it was not told to forget.
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
  // The pages of [addr, addr + length) (whole pages; clipped to the mapping) are no longer this
  // mapping's: its user unmapped or moved them, and the address may hold someone else's mapping
  // by now, so destruction leaves them alone.
  void Forget(uint64_t addr, uint64_t length);

 private:
  void Reset();
  uint8_t* data_ = nullptr;
  uint64_t size_ = 0;                       // mapped length (page aligned)
  std::map<uint64_t, uint64_t> forgotten_;  // disjoint [start, end) by start
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
  // The program unmapped or moved the pages of [addr, addr + length) itself (parts outside
  // every BO's mapping are ignored): destruction then leaves that range alone instead of
  // unmapping whatever another mapping put there since. Not thread-safe: for the owner.
  void Forget(uint64_t addr, uint64_t length);

 private:
  std::vector<UniqueFd> memfds_;
  std::vector<Mapping> mappings_;
  std::vector<Region> regions_;
};

// Where each BO's bytes are in the faulting process *now*. A BO starts as one range (its
// Region); the program may move some or all of it (`mremap`, reported as UFFD_EVENT_REMAP), after
// which its offsets map to several ranges. Shared by the engine (where to install) and the pager
// (which BO a fault is in, what to wake and unregister).
//
// Thread-safety: every method locks, but Move, Find(addr, hold) and generation(hold), which run
// under the holds they take (a hold of another map, or none, aborts: a caller's bug). The pager
// holds hold_for_events() (exclusive) from before it reads events until it has applied the moves
// among them, and hold_installs_for_moves() inside it for as long. An installer looks
// its addresses up, then holds hold_for_install() until its ioctls return (looking up again if a
// move was applied in between), so no move is applied under an install that predates it. One
// that found a range unregistered or was refused (a move's event unread) waits until the kernel
// has no move unread (Userfaultfd::MappingsChanging), then compares generation() (the shared
// side, so after any move being applied): a move that took the range was read by then, so it
// shows.
class AddressMap {
 public:
  struct Piece {
    uint64_t addr = 0;    // in the faulting process
    uint64_t offset = 0;  // in the BO
    uint64_t length = 0;
  };
  struct Location {
    uint32_t bo = 0;
    uint64_t offset = 0;
  };

  // Adds BO `region.bo` at its region's address, page-rounded; a BO already there is kept as it
  // is (the engine and the pager both add what they are given).
  void Add(const Region& region);
  using EventHold = std::unique_lock<std::shared_mutex>;
  // Held by the pager from before it reads events until it has applied the moves among them.
  EventHold hold_for_events() { return EventHold(mutex_); }
  // Held shared by an installer from just after its Resolve until its ioctls at those addresses
  // have returned, and exclusively by the pager across each read of events and the moves it
  // applies (inside hold_for_events()): no install that looked its addresses up before a move
  // is in flight once the kernel accepts installs at the new layout (after the read). Installers
  // never take the map's own lock while holding it.
  using InstallHold = std::shared_lock<std::shared_mutex>;
  using MoveHold = std::unique_lock<std::shared_mutex>;
  InstallHold hold_for_install() const { return InstallHold(installs_); }
  MoveHold hold_installs_for_moves() { return MoveHold(installs_); }
  // The program moved [from, from + length) to `to` (page aligned): BO bytes there now live at
  // the new address. Returns how many bytes of BO memory moved. Under both holds.
  uint64_t Move(uint64_t from, uint64_t to, uint64_t length, const EventHold& hold,
                const MoveHold& installs);
  // The pieces of [offset, offset + length) of `bo`, in offset order (none for an unknown BO);
  // `generation`, when given, is set to the generation they belong to.
  std::vector<Piece> Resolve(uint32_t bo, uint64_t offset, uint64_t length,
                             uint64_t* generation = nullptr) const;
  // The BO byte at `addr` (nullopt: none, or the page-rounded tail past a BO's size).
  std::optional<Location> Find(uint64_t addr) const;
  std::optional<Location> Find(uint64_t addr, const EventHold& hold) const;  // under the hold
  // Every range holding BO memory now, page-rounded: what to unregister.
  std::vector<std::pair<uint64_t, uint64_t>> Ranges() const;
  // A range a move took BO memory from, and the BO byte that was there. A move with
  // MREMAP_DONTUNMAP leaves that range mapped and registered: private anonymous memory reads
  // zeros there, and a shared mapping shows the BO's memfd pages (an alias of the BO). Ranges
  // that hold BO memory again are not listed (Find answers there); nullopt where no move left.
  std::optional<Location> FindLeftBehind(uint64_t addr) const;
  // Records [addr, addr + length) (page aligned) as another mapping of `bo`'s memfd showing the
  // BO from `offset`, as the program's maps list it (a mapping the program made with
  // `mremap(old, 0, ...)`, whose event does not say how long it is): FindLeftBehind answers
  // there from now on, and LeftBehindRanges lists it. The maps are newer than anything the map
  // says of the range (no event tells of a munmap, so records and BO memory the program unmapped
  // linger): records there go, and so does BO memory of another BO or offset. Clipped to the
  // BO's end. False, recording nothing, where the map has this very BO memory there already.
  // Takes both holds' locks itself: the pager's loop calls it outside them.
  bool RecordAlias(uint64_t addr, uint64_t length, uint32_t bo, uint64_t offset);
  // Every range a move left, page-rounded: unregistered too, in case it is still registered.
  std::vector<std::pair<uint64_t, uint64_t>> LeftBehindRanges() const;
  // Changes with every Move that changed the map: BO memory moved or replaced, or a range a
  // move left moved on.
  uint64_t generation() const;
  // The same, under an install hold: no move can be applied while it is held.
  uint64_t generation(const InstallHold& hold) const;

 private:
  struct Segment {
    uint32_t bo = 0;
    uint64_t offset = 0;  // of the BO at the segment's start
    uint64_t length = 0;  // page multiple
  };
  void Insert(uint64_t addr, const Segment& segment);  // into both indexes
  void SplitAt(uint64_t at);  // cuts the BO memory segment holding `at` in two there
  std::optional<Location> FindUnlocked(uint64_t addr) const;
  // The BO byte at `addr` in `segments` (by_addr_ or left_), past no BO's size.
  std::optional<Location> FindIn(const std::map<uint64_t, Segment>& segments, uint64_t addr) const;
  static std::vector<std::pair<uint64_t, uint64_t>> RangesOf(
      const std::map<uint64_t, Segment>& segments);
  // The records of left_ overlapping [from, to), clipped to it.
  std::vector<std::pair<uint64_t, Segment>> LeftIn(uint64_t from, uint64_t to) const;
  void EraseLeft(uint64_t from, uint64_t to);
  mutable std::shared_mutex mutex_;
  mutable std::shared_mutex installs_;                       // see hold_for_install()
  std::map<uint64_t, Segment> by_addr_;                      // start address -> segment; disjoint
  std::map<std::pair<uint32_t, uint64_t>, uint64_t> by_bo_;  // (BO, offset) -> start address
  std::map<uint32_t, uint64_t> sizes_;                       // BO -> size in bytes
  std::map<uint64_t, Segment> left_;     // ranges moves left -> what was there; disjoint, not BO
  std::atomic<uint64_t> generation_{0};  // written under both locks
};

}  // namespace gpulazy::uffd
