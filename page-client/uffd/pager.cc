#include "page-client/uffd/pager.h"

#include <errno.h>
#include <fmt/format.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>

#include "page-client/uffd/mappings.h"

namespace gpulazy::uffd {

using Clock = std::chrono::steady_clock;

// ---- AccessRecorder: policy, not part of the fault loop ----

void AccessRecorder::Reset(const std::vector<client::BoEntry>& bos) {
  std::lock_guard lock(mutex_);
  seen_.clear();
  order_.clear();
  for (const client::BoEntry& bo : bos)
    seen_.emplace_back(bo.chunk_count, false);
}

bool AccessRecorder::Note(uint32_t bo, uint32_t chunk) {
  std::lock_guard lock(mutex_);
  if (bo >= seen_.size() || chunk >= seen_[bo].size() || seen_[bo][chunk]) return false;
  seen_[bo][chunk] = true;
  order_.push_back({bo, chunk});
  return true;
}

void AccessRecorder::NoteRange(uint32_t bo, uint64_t offset, uint64_t length, uint32_t chunk_size) {
  if (length == 0 || chunk_size == 0) return;
  for (uint64_t c = offset / chunk_size; c <= (offset + length - 1) / chunk_size; ++c)
    Note(bo, static_cast<uint32_t>(c));
}

std::vector<ChunkRef> AccessRecorder::order() const {
  std::lock_guard lock(mutex_);
  return order_;
}

size_t AccessRecorder::size() const {
  std::lock_guard lock(mutex_);
  return order_.size();
}

// ---- Pager ----

Pager::Pager(const Userfaultfd& uffd, client::RestoreSession& session, UffdCopyEngine& engine,
             std::vector<Region> regions, PagerOptions options)
    : uffd_(uffd),
      session_(session),
      engine_(engine),
      regions_(std::move(regions)),
      options_(std::move(options)) {
  for (const Region& region : regions_) {
    if (region.bo >= by_bo_.size()) by_bo_.resize(region.bo + 1, nullptr);
    by_bo_[region.bo] = &region;
    engine_.addresses().Add(region);
  }
}

Pager::~Pager() {
  Stop();
}

Status Pager::Start() {
  chunk_size_ = session_.chunk_size();
  started_ = Clock::now();
  if (chunk_size_ == 0) return InvalidArgument("pager: session not started");
  int raw = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (raw < 0) return ErrnoError(errno, "eventfd");
  stop_event_ = UniqueFd(raw);
  loop_ = std::thread([this] { Loop(); });
  for (uint32_t i = 0; i < std::max(1u, options_.demand_threads); ++i)
    workers_.emplace_back([this] { DemandWorker(); });
  if (options_.install_hot_zeros && engine_.defers_zeros() && session_.profile().hot_count() > 0)
    hot_zeros_ = std::thread([this] { InstallHotZeros(); });
  return Status::Ok();
}

void Pager::Stop() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_workers_.notify_all();
  if (stop_event_.valid()) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = write(stop_event_.get(), &one, sizeof one);
  }
  if (loop_.joinable()) loop_.join();
  for (std::thread& worker : workers_)
    if (worker.joinable()) worker.join();
  workers_.clear();
  if (hot_zeros_.joinable()) hot_zeros_.join();
}

Status Pager::UnregisterAll() {
  // Every range, whatever one of them answers: a range left registered would make the program's
  // later faults there (a zero page it first touches) wait on a pager that has stopped. A BO the
  // program moves while this walks is applied to the map by the loop after the walk took its
  // ranges: walk again until a walk saw the map as it stays (no move unread, none applied since
  // the walk began). Ranges already unregistered answer as plain memory again.
  constexpr int kMaxWalks = 8;
  Status first;
  uint64_t calls = 0;
  uint64_t maps_reads = 0;
  for (int walk = 1;; ++walk) {
    const uint64_t generation = engine_.addresses().generation();
    std::vector<std::pair<uint64_t, uint64_t>> ranges = engine_.addresses().Ranges();
    // A range a move left stays registered if the move kept it mapped (MREMAP_DONTUNMAP); one
    // it unmapped is refused, and the walk's reading of the maps shows nothing there.
    for (const auto& range : engine_.addresses().LeftBehindRanges())
      ranges.push_back(range);
    if (options_.after_unregister_snapshot) options_.after_unregister_snapshot();
    first = Status::Ok();
    UnregisterWalk this_walk;
    for (const auto& [addr, length] : ranges) {
      Status unregistered = UnregisterRange(addr, length, this_walk);
      if (!unregistered.ok() && first.ok()) first = std::move(unregistered);
    }
    calls += this_walk.calls;
    maps_reads += this_walk.maps_reads;
    // An unread move is read by the loop within a poll; generation() then waits until it is
    // applied. A loop that has stopped reads nothing: give up on it after a while.
    for (int i = 0; i < 100 && (uffd_.MappingsChanging() || alias_lookups_.load() > 0); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (engine_.addresses().generation() == generation) {
      // Mappings of a BO's memfd the map never recorded (their event came before the BO was
      // bound, or their maps could not be read then): what the maps show now.
      Status swept = UnregisterUnrecordedAliases(ranges, &calls, &maps_reads);
      if (!swept.ok() && first.ok()) first = std::move(swept);
      break;
    }
    if (walk == kMaxWalks) {
      spdlog::warn(
          "uffd pager: the program kept moving BO memory through {} walks of "
          "unregistration; what it moved last may still be registered",
          kMaxWalks);
      break;
    }
  }
  std::lock_guard lock(mutex_);
  stats_.unregister_calls += calls;
  stats_.maps_reads += maps_reads;
  return first;
}

Status Pager::UnregisterUnrecordedAliases(std::vector<std::pair<uint64_t, uint64_t>> walked,
                                          uint64_t* calls, uint64_t* maps_reads) {
  if (!uffd_.owner()) return Status::Ok();
  Result<std::vector<MappingDetails>> mappings = AllMappings(*uffd_.owner());
  ++*maps_reads;
  if (!mappings.ok()) {
    // Gone: its registrations went with it. Otherwise the walk did what it could.
    if (mappings.status().code() != Code::kNotFound)
      spdlog::warn(
          "uffd pager: cannot read the mappings of process {} to unregister mappings "
          "of BO memfds it never recorded: {}",
          *uffd_.owner(), mappings.status().ToString());
    return Status::Ok();
  }
  // In the program's own process the engine's mappings of the memfds (MINOR mode) are there too.
  if (*uffd_.owner() == ::getpid())
    for (const auto& own : engine_.OwnMappings())
      walked.push_back(own);
  std::sort(walked.begin(), walked.end());
  auto walked_over = [&](const MappedRange& range) {
    auto it = std::upper_bound(walked.begin(), walked.end(), std::pair{range.start, ~uint64_t{0}});
    return it != walked.begin() && std::prev(it)->first + std::prev(it)->second >= range.end;
  };
  Status first;
  for (const MappingDetails& mapping : *mappings) {
    if (!mapping.shared || mapping.inode == 0 || walked_over(mapping.range)) continue;
    if (!engine_.FindByFile(mapping.device, mapping.inode, mapping.file_offset)) continue;
    Status status =
        UnregisterOne(mapping.range.start, mapping.range.end - mapping.range.start, calls);
    if (!status.ok() && first.ok()) first = std::move(status);
  }
  return first;
}

Status Pager::UnregisterOne(uint64_t addr, uint64_t length, uint64_t* calls) {
  ++*calls;
  Status status = uffd_.Unregister(addr, length);
  // ENOMEM is also what the kernel answers once the process has exited (its memory is being
  // torn down): its registrations went with it.
  if (status.code() == Code::kResourceExhausted && uffd_.OwnerExited()) {
    spdlog::debug("uffd pager: process {} has exited: nothing left to unregister at [{:#x}, +{})",
                  uffd_.owner().value_or(0), addr, length);
    return Status::Ok();
  }
  return status;
}

Status Pager::UnregisterRange(uint64_t addr, uint64_t length, UnregisterWalk& walk, int depth) {
  // The kernel refuses a whole range (EINVAL) that holds no mapping at all (the program
  // unmapped the BO) or a mapping userfaultfd cannot track (one of the program's own files over
  // part of it), and then unregisters none of it. Then each mapping the owner's maps show there
  // is unregistered on its own. The walk reads the maps once and keeps them for its other
  // refused ranges: a registered mapping cannot appear after a reading except by a move, which
  // the walk after this one finds (or by growing in place, which nothing here follows). So "nothing
  // mapped here" holds in a reading older than the refusal, and a split reading names pieces to
  // try. Only "one mapping, the whole range" needs a reading taken after the refusal: the program
  // may have split a registered mapping since (the kernel then refuses the whole of it), or the
  // mapping is one the kernel cannot track.
  constexpr int kMaxMapsDepth = 3;
  Status status = UnregisterOne(addr, length, &walk.calls);
  if (status.code() != Code::kInvalidArgument) return status;
  if (!uffd_.owner() || walk.maps_unreadable) return UnregisterByHalves(addr, length, &walk.calls);
  bool read_since_refusal = false;
  std::vector<MappedRange> here;
  while (true) {
    if (!walk.mappings) {
      Result<std::vector<MappedRange>> read = MappingsIn(*uffd_.owner(), 0, ~uint64_t{0});
      ++walk.maps_reads;
      if (options_.after_maps_read) options_.after_maps_read();
      if (!read.ok()) {
        spdlog::warn(
            "uffd pager: cannot read the mappings of process {} ({}): unregistering "
            "page by page where refused",
            *uffd_.owner(), read.status().ToString());
        walk.maps_unreadable = true;
        return UnregisterByHalves(addr, length, &walk.calls);
      }
      walk.mappings = std::move(*read);
      read_since_refusal = true;
    }
    here = ClipMappings(*walk.mappings, addr, addr + length);
    if (here.empty()) return Status::Ok();
    const bool whole = here.size() == 1 && here[0].start == addr && here[0].end == addr + length;
    if (!whole) break;
    if (read_since_refusal) return Status::Ok();  // a mapping the kernel cannot track
    walk.mappings.reset();
  }
  if (depth == kMaxMapsDepth) return UnregisterByHalves(addr, length, &walk.calls);
  Status first;
  for (const MappedRange& piece : here) {
    Status unregistered = UnregisterRange(piece.start, piece.end - piece.start, walk, depth + 1);
    if (!unregistered.ok() && first.ok()) first = std::move(unregistered);
  }
  return first;
}

Status Pager::UnregisterByHalves(uint64_t addr, uint64_t length, uint64_t* calls) {
  // [addr, +length) was refused, and the maps cannot say what is there: halve it until the
  // refused pieces are single pages, where nothing is registered. About two calls per page of a
  // range with no mapping at all.
  if (length <= PageSize()) return Status::Ok();
  const uint64_t half = std::max(PageSize(), PageAlignDown(length / 2));
  Status first;
  for (const auto& [at, size] : {std::pair{addr, half}, std::pair{addr + half, length - half}}) {
    Status status = UnregisterOne(at, size, calls);
    if (status.code() == Code::kInvalidArgument) status = UnregisterByHalves(at, size, calls);
    if (!status.ok() && first.ok()) first = std::move(status);
  }
  return first;
}

Status Pager::status() const {
  std::lock_guard lock(mutex_);
  return status_;
}

PagerStats Pager::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void Pager::Fail(Status status) {
  spdlog::warn("uffd pager: {}", status.ToString());
  {
    std::lock_guard lock(mutex_);
    if (status_.ok()) status_ = std::move(status);
    stopping_ = true;
  }
  wake_workers_.notify_all();
}

Status Pager::ReadEvents(std::vector<ReadFault>* faults) {
  FaultEvent events[64];
  struct ReadMove {
    FaultEvent event;
    uint64_t bo_bytes = 0;  // BO memory it moved
  };
  std::vector<ReadMove> moves;
  std::vector<uint64_t> duplicated;
  {
    AddressMap& addresses = engine_.addresses();
    // Held across the read: an install refused because of a move read here waits for the move
    // to be applied before it looks again (AddressMap).
    AddressMap::EventHold hold = addresses.hold_for_events();
    // And no install in flight across the read: once a move's event is read the kernel accepts
    // installs at the new layout again, so an install that looked its addresses up before the
    // move must have returned by then (it would land where other BO memory may be now). New
    // installs cannot look addresses up meanwhile (the hold above), so this waits for the
    // ioctls under way at most.
    AddressMap::MoveHold installs = addresses.hold_installs_for_moves();
    GPULAZY_ASSIGN_OR_RETURN(size_t n, uffd_.Read(events));
    const size_t first = faults->size();
    for (size_t i = 0; i < n; ++i) {
      const FaultEvent& event = events[i];
      if (event.kind == FaultEvent::Kind::kPagefault) {
        faults->push_back({event.address, std::nullopt});
      } else if (event.kind == FaultEvent::Kind::kRemap) {
        const uint64_t moved =
            addresses.Move(event.address, event.to, event.end - event.address, hold, installs);
        // Every move of registered memory is woken, whatever it held: a range a move left
        // mapped (MREMAP_DONTUNMAP) may move onto BO memory a thread is waiting on.
        if (event.end > event.address) moves.push_back({event, moved});
        // A second mapping of the same pages (`mremap(old, 0, ...)`): where it is, not how long.
        // Counted before the holds go, so UnregisterAll waits for it to be recorded.
        if (event.end == event.address) {
          duplicated.push_back(event.to);
          alias_lookups_.fetch_add(1);
        }
        std::lock_guard lock(mutex_);
        stats_.bytes_moved += moved;
      }
    }
    for (size_t i = first; i < faults->size(); ++i) {
      ReadFault& fault = (*faults)[i];
      fault.at = addresses.Find(fault.address, hold);
      // A fault in a range this read's moves left (queued before the move): woken below, the
      // thread finds the memory gone, or faults again where the move left it mapped
      // (MREMAP_DONTUNMAP) and is served then; nothing to serve now.
      fault.left_behind =
          !fault.at && std::any_of(moves.begin(), moves.end(), [&](const ReadMove& move) {
            return fault.address >= move.event.address && fault.address < move.event.end;
          });
    }
  }
  for (const ReadMove& read : moves) {
    const FaultEvent& move = read.event;
    if (read.bo_bytes > 0)
      spdlog::info("uffd pager: the restored process moved BO memory [{:#x}, +{}) to {:#x}",
                   move.address, move.end - move.address, move.to);
    // A thread asleep on a fault in the old range retries, and finds the memory gone (or faults
    // again); one asleep where the memory went (a move onto other BO memory) retries on what is
    // there now.
    GPULAZY_RETURN_IF_ERROR(uffd_.Wake(move.address, move.end - move.address));
    GPULAZY_RETURN_IF_ERROR(uffd_.Wake(move.to, move.end - move.address));
  }
  // Recorded now (the maps say how long), before the faults read with them are located, so
  // that none of them is taken for what a stale record says was there, and UnregisterAll knows
  // of the mapping even if nothing faults in it. Unreadable maps: looked up at its first fault.
  for (const uint64_t to : duplicated) {
    Result<std::optional<AddressMap::Location>> alias = AliasFromMaps(to);
    alias_lookups_.fetch_sub(1);
    if (!alias.ok())
      spdlog::warn("uffd pager: a mapping duplicated at {:#x}: {}", to, alias.status().ToString());
  }
  return Status::Ok();
}

// The core loop: wait for faults (or a hang-up, or Stop), read them, dispatch. Nothing here
// blocks on the network.
void Pager::Loop() {
  std::vector<ReadFault> faults;
  while (true) {
    pollfd fds[3] = {{uffd_.fd(), POLLIN, 0},
                     {stop_event_.get(), POLLIN, 0},
                     {options_.peer_fd, POLLIN | POLLRDHUP, 0}};
    const nfds_t count = options_.peer_fd >= 0 ? 3 : 2;
    // Faults held up by a move are tried again soon even if its event is slow to come.
    const int timeout_ms = deferred_.empty() ? static_cast<int>(options_.poll_interval.count()) : 1;
    int rc = poll(fds, count, timeout_ms);
    if (rc < 0 && errno != EINTR) return Fail(ErrnoError(errno, "poll on userfaultfd"));
    if (fds[1].revents != 0) return;
    if ((count == 3 && (fds[2].revents & (POLLHUP | POLLRDHUP | POLLERR)) != 0) ||
        engine_.target_gone()) {
      return EndPeerGone(engine_.target_gone() ? "an install found it gone" : "its socket hung up");
    }
    if ((fds[0].revents & POLLIN) != 0) {
      faults.clear();
      Status read = ReadEvents(&faults);
      if (!read.ok()) return Fail(read);
      if (!faults.empty() && options_.after_events_read) options_.after_events_read();
      const auto now = Clock::now();
      for (const ReadFault& fault : faults)
        HandleFault(fault, now);
    }
    // After the read: the move that held these up has been read and applied by now, or its
    // event is still to come (the next poll wakes for it).
    RetryDeferred();
    if (peer_gone_.load()) return;
  }
}

void Pager::RetryDeferred() {
  if (deferred_.empty()) return;
  std::vector<Deferred> again;
  again.swap(deferred_);
  for (const Deferred& fault : again)
    HandleFault({fault.address, engine_.addresses().Find(fault.address)}, fault.when, &fault);
}

void Pager::EndPeerGone(const char* how) {
  // Nothing left to serve: end the session quietly.
  peer_gone_.store(true);
  session_.Cancel();
  spdlog::info("uffd pager: restored process gone ({}), session cancelled", how);
  std::lock_guard lock(mutex_);
  stopping_ = true;
  wake_workers_.notify_all();
}

void Pager::RecordLatency(Clock::time_point when, Clock::time_point woken) {
  stats_.latencies_s.push_back(std::chrono::duration<double>(woken - when).count());
  stats_.fault_at_s.push_back(std::chrono::duration<double>(when - started_).count());
}

uint64_t Pager::ChunkLength(const Region& region, uint32_t chunk) const {
  return std::min<uint64_t>(chunk_size_, region.size - uint64_t{chunk} * chunk_size_);
}

void Pager::HandleFault(const ReadFault& fault, Clock::time_point when, const Deferred* earlier) {
  const uint64_t address = fault.address;
  std::optional<AddressMap::Location> at = fault.at;
  const uint64_t page = PageAlignDown(address);
  const Region* region = at && at->bo < by_bo_.size() ? by_bo_[at->bo] : nullptr;
  if (region == nullptr && fault.left_behind) return;
  bool left_behind = false;
  bool recorded_left = false;  // in a range a move left (not a mapping found in the maps)
  if (region == nullptr) {
    // At no BO byte the map knows. While the program is moving memory (its event unread) the
    // fault may be where BO memory is going: try again after the next read.
    if (uffd_.MappingsChanging()) {
      deferred_.push_back({address, when, earlier != nullptr && earlier->counted});
      return;
    }
    if (earlier != nullptr) {
      // It was held up by a move that took the memory away from under it: the thread retries
      // and finds whatever is there now (it faults again where the move left the range mapped,
      // and is served below then).
      Status woken = uffd_.Wake(page, PageSize());
      if (!woken.ok()) Fail(woken);
      return;
    }
    // Where a move took BO memory from and left the range mapped (MREMAP_DONTUNMAP): served as
    // the BO's chunk there, once it is resident, or at once in private memory (below).
    at = engine_.addresses().FindLeftBehind(address);
    const bool recorded = at.has_value();
    Status maps;
    if (!at) {
      // A mapping of a BO's memfd no event told of: the program's maps name it.
      Result<std::optional<AddressMap::Location>> alias = AliasFromMaps(address);
      if (alias.ok())
        at = *alias;
      else
        maps = alias.status();
      // The program moved memory while the maps were read: look again after that move's event.
      if (!at && uffd_.MappingsChanging()) {
        deferred_.push_back({address, when, earlier != nullptr && earlier->counted});
        return;
      }
    }
    region = at && at->bo < by_bo_.size() ? by_bo_[at->bo] : nullptr;
    left_behind = region != nullptr;
    recorded_left = left_behind && recorded;
    if (region == nullptr) {
      // Otherwise it is not ours (or the page-rounded tail of a BO): no chunk will ever fill it.
      Fail(Internal("fault at {:#x} outside every registered BO{}", address,
                    maps.ok() ? "" : fmt::format(" (its maps: {})", maps.message())));
      return;
    }
  }
  const auto chunk = static_cast<uint32_t>(at->offset / chunk_size_);
  const uint64_t offset = uint64_t{chunk} * chunk_size_;
  const bool resident = session_.IsResident(region->bo, offset, ChunkLength(*region, chunk));
  // Private anonymous memory a move left reads zeros whatever the chunk holds (the kernel's own
  // answer there): served now, not after a chunk still to come. (A resident chunk's page gets
  // the same zero page below without asking the maps; a mapping found in the maps is shared.)
  const bool private_left = !resident && recorded_left && LeftBehindIsPrivate(address);
  if (earlier == nullptr || !earlier->counted) {
    // The chunk is not what the program needed there: no note in the access profile.
    if (options_.recorder != nullptr && !private_left) options_.recorder->Note(region->bo, chunk);
    std::lock_guard lock(mutex_);
    ++stats_.faults;
    if (left_behind) ++stats_.left_behind_faults;
  }
  if (private_left || resident) {
    // Installed before we read the fault (the install woke it, or raced with it), or a zero
    // chunk whose pages the engine left for the first touch; or private memory a move left.
    Result<Served> served =
        private_left ? ZeroOrWake(page) : ServeResident(*region, chunk, page, left_behind);
    // A fault read just before its process exited: CONTINUE or ZEROPAGE finds it gone (Wake
    // ignores that).
    if (served.status().code() == Code::kAborted) return EndPeerGone("a wake found it gone");
    if (served.ok() && *served == Served::kAfterMoves) {
      deferred_.push_back({address, when, true});
      return;
    }
    std::lock_guard lock(mutex_);
    ++stats_.resident_faults;
    if (served.ok() && *served == Served::kFilledDropped && !left_behind)
      ++stats_.dropped_pages_zeroed;
    if (served.ok() && private_left) ++stats_.private_left_behind_zeroed;
    RecordLatency(when, Clock::now());
    if (!served.ok() && status_.ok()) status_ = served.status();
    return;
  }
  std::lock_guard lock(mutex_);
  const Key key{region->bo, chunk};
  auto [it, inserted] = pending_.try_emplace(key);
  it->second.faulted.push_back(when);
  if (left_behind) it->second.left_behind_pages.push_back(page);
  if (inserted) {
    queue_.push_back(key);
    ++stats_.demand_chunks;
    wake_workers_.notify_one();
  }
}

void Pager::DemandWorker() {
  while (true) {
    Key key;
    {
      std::unique_lock lock(mutex_);
      wake_workers_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      key = queue_.front();
      queue_.pop_front();
    }
    const Region& region = *by_bo_[key.first];
    while (true) {
      Status status = session_.Ensure(key.first, uint64_t{key.second} * chunk_size_,
                                      ChunkLength(region, key.second), options_.ensure_slice);
      if (status.ok()) {
        Resolve(key, true);
        break;
      }
      // kTimeout: the session is reconnecting or busy; keep asking while we run. Anything else
      // ended the session: the faulting threads stay blocked (reading zeros would be wrong).
      std::lock_guard lock(mutex_);
      if (stopping_) return;
      if (status.code() != Code::kTimeout) {
        if (status_.ok()) status_ = status;
        stopping_ = true;
        wake_workers_.notify_all();
        return;
      }
    }
  }
}

void Pager::InstallHotZeros() {
  auto stopping = [this] {
    std::lock_guard lock(mutex_);
    return stopping_;
  };
  while (true) {
    Status hot = session_.WaitHotSet(options_.poll_interval);
    if (hot.ok()) break;
    // Anything but a timeout ended the session (which says why); zeros left deferred are still
    // installed on their faults.
    if (hot.code() != Code::kTimeout || stopping()) return;
  }
  const manifest::AccessProfile& profile = session_.profile();
  const int hot_count = static_cast<int>(
      std::min<uint64_t>(profile.hot_count(), static_cast<uint64_t>(profile.order_size())));
  for (int i = 0; i < hot_count && !stopping(); ++i) {
    const manifest::ChunkRef& ref = profile.order(i);
    if (ref.bo() >= by_bo_.size() || by_bo_[ref.bo()] == nullptr) continue;
    const Region& region = *by_bo_[ref.bo()];
    if (uint64_t{ref.chunk()} * chunk_size_ >= region.size) continue;
    Result<std::optional<InstallResult>> zeroed = engine_.InstallDeferredZeros(
        ref.bo(), uint64_t{ref.chunk()} * chunk_size_, ChunkLength(region, ref.chunk()));
    if (zeroed.status().code() == Code::kAborted) return EndPeerGone("an install found it gone");
    if (!zeroed.ok()) return Fail(zeroed.status());
  }
}

Result<std::optional<MappingDetails>> Pager::OwnerMappingAt(uint64_t address, MapsLookup lookup) {
  if (!uffd_.owner()) return Unavailable("the restored process is not known to the pager");
  Result<std::optional<MappingDetails>> mapping = MappingAt(*uffd_.owner(), address, lookup);
  std::lock_guard lock(mutex_);
  ++stats_.maps_reads;
  return mapping;
}

Result<std::optional<AddressMap::Location>> Pager::AliasFromMaps(uint64_t address) {
  Result<std::optional<MappingDetails>> mapping = OwnerMappingAt(address);
  if (!mapping.ok()) return Unavailable("{}", mapping.status().ToString());
  // Only a shared mapping shows the memfd's pages; a private one of it is the program's own copy.
  if (!mapping->has_value() || !(*mapping)->shared || (*mapping)->inode == 0)
    return std::optional<AddressMap::Location>();
  const MappingDetails& found = **mapping;
  const uint64_t page = PageAlignDown(address);
  const uint64_t file_offset = found.file_offset + (page - found.range.start);
  std::optional<AddressMap::Location> at =
      engine_.FindByFile(found.device, found.inode, file_offset);
  if (!at) return std::optional<AddressMap::Location>();
  // The whole mapping, so its other pages are found without a reading, and unregistered.
  if (engine_.addresses().RecordAlias(found.range.start, found.range.end - found.range.start,
                                      at->bo, found.file_offset)) {
    spdlog::info(
        "uffd pager: the restored process maps BO {} at [{:#x}, {:#x}) (a mapping no "
        "event told the length of), served as the BO",
        at->bo, found.range.start, found.range.end);
    std::lock_guard lock(mutex_);
    ++stats_.aliases_found;
  } else {
    spdlog::warn("uffd pager: the maps show BO {} at [{:#x}, {:#x}) where BO memory is known to be",
                 at->bo, found.range.start, found.range.end);
  }
  return std::optional<AddressMap::Location>(
      AddressMap::Location{at->bo, file_offset + (address - page)});
}

bool Pager::LeftBehindIsPrivate(uint64_t address) {
  // The caller found no move under way (its event unread), which could be putting other memory
  // here; one starting since stops the install (EAGAIN) until its event is read.
  if (uffd_.mode() != FillMode::kMissingCopy) return false;
  // The ioctl only (a few microseconds): where the kernel lacks or refuses it, the whole text at
  // every such fault would cost more than waiting for the chunk.
  Result<std::optional<MappingDetails>> mapping = OwnerMappingAt(address, MapsLookup::kQuery);
  // Anonymous only: a private mapping of a file reads the file's page where it has no page of
  // its own, not zeros.
  return mapping.ok() && mapping->has_value() && !(*mapping)->shared && (*mapping)->inode == 0;
}

Result<Pager::Served> Pager::ServeResident(const Region& region, uint32_t chunk, uint64_t page,
                                           bool left_behind) {
  // A page a move left: in MINOR mode the chunk's bytes are in the memfd's page cache whatever
  // the program maps, and mapping them here shows them; in MISSING mode the same zero page fills
  // it in private memory (which the move emptied, as the kernel leaves it), and in a shared
  // mapping finds the BO's page in the page cache (EEXIST) unless the program dropped that page.
  if (uffd_.mode() == FillMode::kMinorContinue) {
    GPULAZY_ASSIGN_OR_RETURN(InstallResult mapped, uffd_.Continue(page, PageSize()));
    return mapped.interrupted > 0 ? Served::kAfterMoves : Served::kWoken;
  }
  // The whole chunk's deferred zeros, as a data chunk comes whole: a workload touching a zero
  // pool page by page would otherwise fault on every page.
  Result<std::optional<InstallResult>> zeroed = engine_.InstallDeferredZeros(
      region.bo, uint64_t{chunk} * chunk_size_, ChunkLength(region, chunk),
      UffdCopyEngine::MovesPending::kNoWait);
  if (!zeroed.ok()) return zeroed.status();
  if (zeroed->has_value() && (*zeroed)->interrupted > 0) return Served::kAfterMoves;
  // UFFDIO_ZEROPAGE woke the chunk's threads where it installed; a page found there was
  // installed by someone else (or is being mapped now), or one no longer registered: wake it
  // as for any resident page.
  if (!left_behind && zeroed->has_value() && (*zeroed)->already_present == 0 &&
      (*zeroed)->unregistered == 0)
    return Served::kWoken;
  // The chunk landed whole before it was marked resident, so a missing page here is one the
  // program dropped since (MADV_DONTNEED on private anonymous memory, a hole punched in a
  // memfd): it reads zeros, as it would with no pager, where a wake alone would refault it
  // for good. (Or a deferred zero page that another thread took from the record and is
  // installing now: the same zeros, counted here as dropped.) A page that is there (the fault
  // raced the install) is only woken: EEXIST.
  return ZeroOrWake(page);
}

Result<Pager::Served> Pager::ZeroOrWake(uint64_t page) {
  GPULAZY_ASSIGN_OR_RETURN(InstallResult refilled, uffd_.ZeroPage(page, PageSize()));
  if (refilled.interrupted > 0) return Served::kAfterMoves;
  if (refilled.installed > 0) return Served::kFilledDropped;  // ZEROPAGE woke it
  GPULAZY_RETURN_IF_ERROR(uffd_.Wake(page, PageSize()));
  return Served::kWoken;
}

void Pager::Resolve(const Key& key, bool landed) {
  const Region& region = *by_bo_[key.first];
  Pending pending;
  {
    std::lock_guard lock(mutex_);
    auto it = pending_.find(key);
    if (it != pending_.end()) {
      pending = std::move(it->second);
      pending_.erase(it);
    }
  }
  // The chunk is resident now, so later faults on it take the resident path; these waited.
  Status served;
  if (landed && engine_.defers_zeros() && !pending.faulted.empty())
    served = engine_
                 .InstallDeferredZeros(region.bo, uint64_t{key.second} * chunk_size_,
                                       ChunkLength(region, key.second))
                 .status();
  if (served.code() == Code::kAborted) return EndPeerGone("an install found it gone");
  // The install already woke the faulting threads; this wake covers pages that were present
  // before (EEXIST) and faults that arrived in between.
  Status woken;
  for (const AddressMap::Piece& piece : engine_.addresses().Resolve(
           region.bo, uint64_t{key.second} * chunk_size_, ChunkLength(region, key.second))) {
    woken = uffd_.Wake(piece.addr, piece.length);
    if (!woken.ok()) break;
  }
  for (const uint64_t page : pending.left_behind_pages) {
    if (!woken.ok()) break;
    woken = uffd_.Wake(page, PageSize());
  }
  const auto now = Clock::now();
  std::lock_guard lock(mutex_);
  for (const auto& when : pending.faulted)
    RecordLatency(when, now);
  if (!served.ok() && status_.ok()) status_ = served;
  if (!woken.ok() && status_.ok() && landed) status_ = woken;
}

}  // namespace gpulazy::uffd
