// Pager: serves a restored process's userfaultfd faults from a RestoreSession. The core loop is
// poll + read + dispatch (as Firecracker's handler): a fault on a chunk that is already resident
// is woken at once; otherwise the chunk goes to a few demand threads that call
// RestoreSession::Ensure (demand priority), and the engine's install wakes the faulting thread
// (an explicit UFFDIO_WAKE follows, for pages that someone else installed first).
//
// Policy kept outside the loop: which chunks were first needed, in what order (AccessRecorder,
// the source of a recorded access profile), and when to stop.
//
// Follows BO memory the program moves (remap events) in the engine's AddressMap, so faults,
// installs and wakes find it where it is now (docs/uffd.md, "Memory the program moved").
//
// Ends cleanly when the restored process goes away (its handover socket hangs up, or installs
// fail with ESRCH): the session is cancelled and peer_gone() says why.
//
// Thread-safety: Start/Stop/UnregisterAll from one owner thread; the rest from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "page-client/restore_session.h"
#include "page-client/uffd/mappings.h"
#include "page-client/uffd/memory.h"
#include "page-client/uffd/uffd_engine.h"
#include "page-client/uffd/userfaultfd.h"

namespace gpulazy::uffd {

struct ChunkRef {
  uint32_t bo = 0;
  uint32_t chunk = 0;
};

// First-need order of chunks (each chunk once). Thread-safe.
class AccessRecorder {
 public:
  void Reset(const std::vector<client::BoEntry>& bos);
  // True when this is the chunk's first note.
  bool Note(uint32_t bo, uint32_t chunk);
  // Notes every chunk of [offset, offset + length) of `bo`.
  void NoteRange(uint32_t bo, uint64_t offset, uint64_t length, uint32_t chunk_size);
  std::vector<ChunkRef> order() const;
  size_t size() const;

 private:
  mutable std::mutex mutex_;
  std::vector<std::vector<bool>> seen_;
  std::vector<ChunkRef> order_;
};

struct PagerOptions {
  uint32_t demand_threads = 4;                   // concurrent Ensure calls
  std::chrono::milliseconds ensure_slice{500};   // Ensure timeout, retried while running
  std::chrono::milliseconds poll_interval{100};  // how often the loop checks for a dead peer
  int peer_fd = -1;  // handover socket: hang-up means the restored process is gone
  AccessRecorder* recorder = nullptr;  // notes the first fault per chunk, when set
  // With deferred zeros (UffdCopyEngine): once the profile's hot set is resident, install its
  // zero chunks from a thread of their own, before the program touches them. The hot set is
  // what the program needs first: one fault per zero chunk there would sit on its path.
  bool install_hot_zeros = true;
  // Tests only: runs on the loop thread after each read that returned fault events, before they
  // are handled, so a test can change the world in between (e.g. let the process exit).
  std::function<void()> after_events_read;
  // Tests only: runs in UnregisterAll after each walk has taken the map's ranges, before it
  // unregisters them (e.g. to move a BO then).
  std::function<void()> after_unregister_snapshot;
  // Tests only: runs in UnregisterAll after each read of the program's maps (e.g. to split one of
  // the mappings read).
  std::function<void()> after_maps_read;
};

struct PagerStats {
  uint64_t faults = 0;  // page-fault events read
  // Served at once: already resident when read, or private memory a move left (below).
  uint64_t resident_faults = 0;
  // Of resident_faults, pages the program dropped after they landed (MADV_DONTNEED on private
  // anonymous memory, a hole punched in a memfd), filled with zeros as the kernel would.
  uint64_t dropped_pages_zeroed = 0;
  uint64_t demand_chunks = 0;  // chunks sent to Ensure
  uint64_t bytes_moved = 0;    // BO memory the program moved (mremap) while registered
  // Faults in a range a move left registered (MREMAP_DONTUNMAP), served as what the kernel
  // leaves there: zeros in private memory, the BO's pages in a shared mapping of its memfd.
  uint64_t left_behind_faults = 0;
  // Of left_behind_faults, those in private anonymous memory (the program's maps say so) in
  // MISSING mode whose chunk was still to come: served zeros at once, not after that chunk,
  // which that memory never shows.
  uint64_t private_left_behind_zeroed = 0;
  // Mappings of a BO's memfd that no event told of (`mremap(old, 0, ...)` of a BO's mapping),
  // found in the program's maps at a fault there; served as the shared ranges above, and their
  // faults counted in left_behind_faults.
  uint64_t aliases_found = 0;
  std::vector<double> latencies_s;  // per fault: read -> woken
  std::vector<double> fault_at_s;   // per fault, as latencies_s: read, seconds after Start
  uint64_t unregister_calls = 0;    // UFFDIO_UNREGISTER calls made by UnregisterAll
  // Readings of the program's /proc/PID/maps by UnregisterAll, and lookups of one address in them
  // (PROCMAP_QUERY where the kernel has it) at a length-0 remap event, a fault in no known BO, or
  // a fault in a range a move left whose chunk is still to come (MISSING mode).
  uint64_t maps_reads = 0;
};

class Pager {
 public:
  Pager(const Userfaultfd& uffd, client::RestoreSession& session, UffdCopyEngine& engine,
        std::vector<Region> regions, PagerOptions options = {});
  ~Pager();  // Stop()
  Pager(const Pager&) = delete;
  Pager& operator=(const Pager&) = delete;

  Status Start();
  // Stops the loop and the demand threads (faults still pending stay blocked).
  void Stop();
  // After every chunk is resident: unregisters every range of BO memory (where the program
  // moved it), so the memory is plain memory. Goes on past a range that fails and returns the
  // first error; a range or part of one the program unmapped, or mapped a file of its own over,
  // holds nothing registered and is no error.
  Status UnregisterAll();

  bool peer_gone() const { return peer_gone_.load(); }
  // The error that stopped the loop (Ok while running or after a clean stop).
  Status status() const;
  PagerStats stats() const;

 private:
  struct Pending {
    std::vector<std::chrono::steady_clock::time_point> faulted;  // one per fault waiting
    // Pages of ranges a move left (AddressMap::FindLeftBehind) whose threads wait for the chunk:
    // woken when it lands, they fault again there and are served as resident.
    std::vector<uint64_t> left_behind_pages;
  };
  using Key = std::pair<uint32_t, uint32_t>;  // (bo, chunk)

  void Loop();
  // Under mutex_: one fault read at `when` was woken at `woken`.
  void RecordLatency(std::chrono::steady_clock::time_point when,
                     std::chrono::steady_clock::time_point woken);
  // A fault read: its address, and the BO byte there once the moves read with it are applied
  // (nullopt: in no BO).
  struct ReadFault {
    uint64_t address = 0;
    std::optional<AddressMap::Location> at;
    bool left_behind = false;  // in no BO, in a range a move read with it left
  };
  struct Deferred;
  // The program's mapping at `address`, if it is a shared mapping of a bound BO's memfd:
  // recorded whole in the map as showing that BO (AddressMap::RecordAlias), and the BO byte at
  // `address` returned. nullopt when it maps no BO's memfd; kUnavailable when the maps cannot
  // be read. Called where a move of length 0 went (its event says where, not how long) and at a
  // fault in no range the map knows.
  Result<std::optional<AddressMap::Location>> AliasFromMaps(uint64_t address);
  // The program's mapping at `address` (MappingAt), counted in maps_reads; kUnavailable when the
  // pager does not know the program's pid.
  Result<std::optional<MappingDetails>> OwnerMappingAt(
      uint64_t address, MapsLookup lookup = MapsLookup::kQueryOrText);
  // Whether a fault at `address`, in a range a move left, is in private anonymous memory, which
  // reads zeros whatever the BO holds (MISSING mode; the kernel's PROCMAP_QUERY says so). The
  // caller has found the program not moving memory. False where it cannot tell: the fault then
  // waits for its chunk as in a shared range.
  bool LeftBehindIsPrivate(uint64_t address);
  // `earlier`: the fault was deferred before (when, and whether it was counted then).
  void HandleFault(const ReadFault& fault, std::chrono::steady_clock::time_point when,
                   const Deferred* earlier = nullptr);
  // Reads pending events; applies the program's moves among them to the engine's AddressMap
  // (waking the ranges they left and took) and appends the faults to `faults`, located in the
  // map as it is after those moves: the kernel hands out faults before other events, so a fault
  // at a move's destination can come in the same read as the move.
  Status ReadEvents(std::vector<ReadFault>* faults);
  void DemandWorker();
  void InstallHotZeros();
  void Resolve(const Key& key, bool landed);
  enum class Served {
    kWoken,          // installed zeros, or woke a page someone else installed
    kFilledDropped,  // filled a page the program had dropped (reads zeros)
    kAfterMoves,     // the program is moving memory (an unread event): try after the next read
  };
  // A fault at `page` of `chunk` of `region`, a chunk the session has: installs the chunk's
  // deferred zeros if it has any, else a zero page where the program dropped the page, else
  // wakes the page. kAborted when the process is gone. On the loop thread: never waits for
  // moves (it is the one that reads them). `left_behind`: `page` is in a range a move left
  // (not where the chunk's installs go): it is served after the chunk's deferred zeros, as a
  // page of its own.
  Result<Served> ServeResident(const Region& region, uint32_t chunk, uint64_t page,
                               bool left_behind = false);
  // A zero page at `page` where it has none (it reads zeros, as with no pager), else a wake (a
  // page is there: EEXIST).
  Result<Served> ZeroOrWake(uint64_t page);
  // Faults the loop could not serve yet: a move the program is making (an unread event) stopped
  // their install, or put them at an address the map does not know yet. Loop thread only.
  struct Deferred {
    uint64_t address = 0;
    std::chrono::steady_clock::time_point when;
    bool counted = false;  // in stats_.faults and the recorder
  };
  void RetryDeferred();
  std::vector<Deferred> deferred_;
  // Mappings whose length-0 move was read and is not yet looked up in the maps.
  std::atomic<int> alias_lookups_{0};
  // One walk of UnregisterAll: its calls, and the owner's maps as last read, read at the walk's
  // first refusal and again only where a conclusion needs a reading taken after a refusal.
  struct UnregisterWalk {
    uint64_t calls = 0;
    uint64_t maps_reads = 0;
    std::optional<std::vector<MappedRange>> mappings;
    bool maps_unreadable = false;  // warned once; the walk halves what is refused
  };
  // Unregisters [addr, addr + length); where the kernel refuses it, what is mapped there, found
  // in the owner's maps (down to `depth` kMaxMapsDepth) or, failing those, by halving. Owner
  // thread.
  Status UnregisterRange(uint64_t addr, uint64_t length, UnregisterWalk& walk, int depth = 0);
  // After the walks: unregisters the shared mappings of a bound BO's memfd the maps show outside
  // every range `walked` (mappings the map never recorded). Counts its calls and its reading.
  Status UnregisterUnrecordedAliases(std::vector<std::pair<uint64_t, uint64_t>> walked,
                                     uint64_t* calls, uint64_t* maps_reads);
  // One UFFDIO_UNREGISTER; ENOMEM from an owner that has exited is no error.
  Status UnregisterOne(uint64_t addr, uint64_t length, uint64_t* calls);
  Status UnregisterByHalves(uint64_t addr, uint64_t length, uint64_t* calls);
  void Fail(Status status);
  // The restored process went away: cancels the session and stops, without an error.
  void EndPeerGone(const char* how);
  uint64_t ChunkLength(const Region& region, uint32_t chunk) const;

  const Userfaultfd& uffd_;
  client::RestoreSession& session_;
  UffdCopyEngine& engine_;
  std::vector<Region> regions_;       // as given; by_bo_ points into it
  std::vector<const Region*> by_bo_;  // index: BO
  PagerOptions options_;
  uint32_t chunk_size_ = 0;
  std::chrono::steady_clock::time_point started_;  // set by Start
  UniqueFd stop_event_;

  mutable std::mutex mutex_;  // guards the queue, pending faults, stats, status
  std::condition_variable wake_workers_;
  std::deque<Key> queue_;
  std::map<Key, Pending> pending_;
  PagerStats stats_;
  Status status_;
  bool stopping_ = false;
  std::atomic<bool> peer_gone_{false};
  std::thread loop_;
  std::vector<std::thread> workers_;
  std::thread hot_zeros_;
};

}  // namespace gpulazy::uffd
