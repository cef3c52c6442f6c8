#include "page-client/uffd/uffd_engine.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

namespace gpulazy::uffd {

Status UffdCopyEngine::AddDestination(uint32_t bo, uint64_t size) {
  std::lock_guard lock(mutex_);
  if (destinations_.contains(bo)) return InvalidArgument("uffd engine: BO {} added twice", bo);
  destinations_[bo].size = size;
  return Status::Ok();
}

template <typename Step>
Result<InstallResult> UffdCopyEngine::InstallResolved(uint32_t bo, uint64_t offset, uint64_t length,
                                                      MovesPending moves, Step step) {
  auto install = [&]() -> Result<InstallResult> {
    InstallResult total;
    uint64_t placed = 0;
    // Looked up, then held until the ioctls have returned, so no move is applied under them; a
    // move applied between the two shows as a new generation, and the lookup is made again.
    std::vector<AddressMap::Piece> pieces;
    AddressMap::InstallHold hold;
    while (true) {
      uint64_t resolved_at = 0;
      pieces = addresses_.Resolve(bo, offset, length, &resolved_at);
      hold = addresses_.hold_for_install();
      if (addresses_.generation(hold) == resolved_at) break;
      hold.unlock();
    }
    if (after_resolve_) after_resolve_(bo, offset);
    for (const AddressMap::Piece& piece : pieces) {
      GPULAZY_ASSIGN_OR_RETURN(InstallResult part, step(piece.addr, piece.offset, piece.length));
      total += part;
      placed += piece.length;
      if (part.interrupted > 0) {  // a move is under way: nothing more lands until it is read
        total.interrupted += length - std::min(length, placed);
        return total;
      }
    }
    // Bytes at no address at all: the program mapped something else over them.
    total.unregistered += length - std::min(length, placed);
    return total;
  };
  uint64_t generation = addresses_.generation();
  GPULAZY_ASSIGN_OR_RETURN(InstallResult result, install());
  // Interrupted: the program was moving memory, nothing installed past that point. Found
  // unregistered: the range may have moved under us; the kernel can say so before the event
  // that moved it is read. Either way wait until no move is unread; then the pager has read
  // it, and generation() waits until it has applied it (AddressMap).
  while (result.interrupted > 0 || result.unregistered > 0) {
    if (moves == MovesPending::kNoWait) {
      // The pager's event-reading thread: every move it has read is applied, so only an unread
      // one can explain a range found gone; it tries again after its next read.
      if (result.unregistered > 0 && uffd_.MappingsChanging()) {
        result.interrupted += result.unregistered;
        result.unregistered = 0;
      }
      break;
    }
    GPULAZY_RETURN_IF_ERROR(WaitForUnreadMoves());
    const uint64_t now = addresses_.generation();
    if (result.interrupted == 0 && now == generation) break;
    generation = now;
    GPULAZY_ASSIGN_OR_RETURN(InstallResult again, install());
    // The second pass finds what the first one installed or found already there.
    again.already_present -=
        std::min(again.already_present, result.installed + result.already_present);
    result.unregistered = 0;
    result.interrupted = 0;
    result += again;
  }
  return result;
}

Status UffdCopyEngine::WaitForUnreadMoves() {
  // The program's mremap waits for the pager to read its event, so this ends as soon as the
  // pager's loop runs. A pager that stopped reading leaves the move (and the program) waiting:
  // after 5 s without a move applied the install fails, rather than count bytes as installed
  // that are not. (A program that keeps moving memory keeps the pager applying moves.)
  constexpr auto kPatience = std::chrono::seconds(5);
  auto deadline = std::chrono::steady_clock::now() + kPatience;
  uint64_t generation = addresses_.generation();
  while (uffd_.MappingsChanging()) {
    const auto now = std::chrono::steady_clock::now();
    if (const uint64_t applied = addresses_.generation(); applied != generation) {
      generation = applied;
      deadline = now + kPatience;
    }
    if (now > deadline)
      return Unavailable(
          "the restored process has been moving its memory for 5 s and the pager has not read "
          "the event (stopped?): the install cannot be made");
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  return Status::Ok();
}

Status UffdCopyEngine::Install(Destination& dest, const Held& write) {
  if (target_gone_.load()) return Status::Ok();
  const uint32_t bo = dest.region->bo;
  const uint64_t offset = write.offset;
  if (write.zeros && defers_zeros()) {
    DeferZeros(dest, offset, write.length, true);
    return Status::Ok();
  }
  if (uffd_.mode() == FillMode::kMinorContinue) {
    // Bytes first through our own mapping (the faulting process cannot see them yet: its page
    // tables do not map these pages), then map them there.
    if (write.zeros) {
      if (write.length > 0) std::memset(dest.filler.data() + offset, 0, write.length);
    } else {
      if (!write.raw.empty())
        std::memcpy(dest.filler.data() + offset, write.raw.data(), write.raw.size());
    }
  }
  auto step = [&](uint64_t addr, uint64_t at, uint64_t length) -> Result<InstallResult> {
    if (uffd_.mode() == FillMode::kMinorContinue) return uffd_.Continue(addr, length);
    if (write.zeros) return uffd_.ZeroPage(addr, length);
    return uffd_.Copy(addr, write.raw.subspan(at - offset, length));
  };
  Result<InstallResult> result =
      InstallResolved(bo, offset, write.length, MovesPending::kWait, step);
  // Zeros need nothing kept: a memfd page never written reads zeros.
  if (result.ok() && result->unregistered > 0 && !write.zeros)
    KeepUnregistered(dest, write, result->unregistered);
  return Account(std::move(result), write.zeros, bo, offset);
}

void UffdCopyEngine::KeepUnregistered(Destination& dest, const Held& write, uint64_t unregistered) {
  if (uffd_.mode() == FillMode::kMinorContinue) {
    kept_ += unregistered;  // written through the filler before the CONTINUE
    return;
  }
  if (!dest.keeper.valid()) return;
  // Only into the memfd's holes: the pages the program's registered ranges took are there (and
  // may have been written since), as is any page the program wrote through another mapping.
  // A page the program writes between the SEEK_HOLE and the pwrite is overwritten: it would
  // have to write the BO's memory through a mapping that is not registered, in that window.
  const int fd = dest.keeper.get();
  // Never past the memfd's end: a program that shrank it does not get it grown back.
  struct stat st {};
  if (::fstat(fd, &st) != 0) return;
  const uint64_t end =
      std::min<uint64_t>(write.offset + write.raw.size(), static_cast<uint64_t>(st.st_size));
  uint64_t at = write.offset;
  uint64_t kept = 0;
  while (at < end) {
    const off_t hole = ::lseek(fd, static_cast<off_t>(at), SEEK_HOLE);
    if (hole < 0 || static_cast<uint64_t>(hole) >= end) break;  // ENXIO: past the memfd's end
    const off_t data = ::lseek(fd, hole, SEEK_DATA);
    const uint64_t until = data < 0 ? end : std::min<uint64_t>(static_cast<uint64_t>(data), end);
    const auto from = static_cast<uint64_t>(hole);
    const ssize_t n = ::pwrite(fd, write.raw.data() + (from - write.offset), until - from, hole);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (!dest.told_keep_failed.exchange(true))  // once per BO, not per chunk
        spdlog::warn("uffd engine: BO {} offset {}: keeping unmapped bytes in its memfd: {}",
                     dest.region->bo, from, n < 0 ? std::strerror(errno) : "nothing written");
      break;
    }
    kept += static_cast<uint64_t>(n);
    at = from + static_cast<uint64_t>(n);
  }
  kept_ += kept;
}

Status UffdCopyEngine::Account(Result<InstallResult> result, bool zeros, uint32_t bo,
                               uint64_t offset) {
  if (!result.ok()) {
    if (result.status().code() == Code::kAborted) {
      target_gone_.store(true);
      return Status::Ok();
    }
    return result.status().Context(fmt::format("installing BO {} offset {}", bo, offset));
  }
  bytes_installed_ += result->installed;
  already_present_ += result->already_present;
  unregistered_ += result->unregistered;
  if (zeros) zeroed_ += result->installed;
  if (result->unregistered > 0) NoteUnregistered(bo, offset);
  return Status::Ok();
}

void UffdCopyEngine::NoteUnregistered(uint32_t bo, uint64_t offset) {
  Destination* dest = nullptr;
  {
    std::lock_guard lock(mutex_);
    auto it = destinations_.find(bo);
    if (it == destinations_.end()) return;
    dest = &it->second;
  }
  // Once per BO: a program that unmapped a BO would otherwise log every chunk of it.
  if (dest->told_unregistered.exchange(true)) return;
  const bool kept = uffd_.mode() == FillMode::kMinorContinue || dest->keeper.valid();
  spdlog::info(
      "uffd engine: BO {} from offset {}: the restored process no longer has this memory "
      "registered (unmapped, replaced or unregistered); its bytes there are {}",
      bo, offset, kept ? "kept in the BO's memfd only" : "skipped");
}

void UffdCopyEngine::DeferZeros(Destination& dest, uint64_t offset, uint64_t length, bool count) {
  if (length == 0) return;
  std::lock_guard lock(zeros_mutex_);
  AddRange(dest.deferred_zeros, offset, offset + length);
  if (count) deferred_ += length;
}

Result<std::optional<InstallResult>> UffdCopyEngine::InstallDeferredZeros(uint32_t bo,
                                                                          uint64_t offset,
                                                                          uint64_t length,
                                                                          MovesPending moves) {
  Destination* dest = nullptr;
  {
    std::lock_guard lock(mutex_);
    auto it = destinations_.find(bo);
    if (it == destinations_.end() || !it->second.region) return std::optional<InstallResult>{};
    dest = &it->second;  // bound destinations never change again
  }
  // The parts of [offset, offset + length) that are deferred zeros, page-rounded (a deferred
  // range is whole chunks, page aligned; only a BO's last chunk may end inside a page), taken
  // out of the record: whoever takes a page installs it, and a fault after that finds it
  // installed or being installed (a wake, then the install's own wake), not a page-by-page
  // EEXIST walk.
  std::vector<std::pair<uint64_t, uint64_t>> pieces;
  {
    std::lock_guard lock(zeros_mutex_);
    std::map<uint64_t, uint64_t>& ranges = dest->deferred_zeros;
    auto it = ranges.upper_bound(offset);
    if (it != ranges.begin()) --it;
    while (it != ranges.end() && it->first < offset + length) {
      const auto [start, end] = *it;
      const uint64_t from = PageAlignDown(std::max(start, offset));
      const uint64_t to = PageAlignUp(std::min(end, offset + length));
      if (std::max(start, offset) >= std::min(end, offset + length)) {
        ++it;
        continue;
      }
      it = ranges.erase(it);
      if (start < from) ranges.emplace(start, from);
      if (to < end) it = ranges.emplace(to, end).first;
      pieces.emplace_back(from, to);
    }
  }
  if (pieces.empty()) return std::optional<InstallResult>{};
  // Pieces not installed go back into the record: a later fault, or the pager once it has read
  // a move, installs them (pages installed meanwhile are found installed then).
  auto put_back_from = [&](size_t first) {
    for (size_t j = first; j < pieces.size(); ++j)
      DeferZeros(*dest, pieces[j].first, pieces[j].second - pieces[j].first, false);
  };
  InstallResult total;
  for (size_t i = 0; i < pieces.size(); ++i) {
    const auto [from, to] = pieces[i];
    Result<InstallResult> result = InstallResolved(
        bo, from, to - from, moves,
        [&](uint64_t addr, uint64_t, uint64_t length) { return uffd_.ZeroPage(addr, length); });
    if (result.ok() && result->interrupted > 0) {  // a move stopped it
      put_back_from(i);
      GPULAZY_RETURN_IF_ERROR(Account(*result, /*zeros=*/true, bo, from));
      total += *result;
      return std::optional<InstallResult>{total};
    }
    if (!result.ok()) {
      if (result.status().code() == Code::kAborted) {
        target_gone_.store(true);
      } else {
        put_back_from(i);  // so a later fault tries again rather than waking a missing page
      }
      return result.status().Context(
          fmt::format("installing deferred zeros of BO {} offset {}", bo, from));
    }
    GPULAZY_RETURN_IF_ERROR(Account(*result, /*zeros=*/true, bo, from));
    total += *result;
  }
  return std::optional<InstallResult>{total};
}

Status UffdCopyEngine::Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw,
                             client::CopyDone done) {
  return Submit(bo, Held{offset, raw, raw.size(), /*zeros=*/false, std::move(done)});
}

Status UffdCopyEngine::WriteZeros(uint32_t bo, uint64_t offset, uint64_t length,
                                  client::CopyDone done) {
  return Submit(bo, Held{offset, {}, length, /*zeros=*/true, std::move(done)});
}

Status UffdCopyEngine::Submit(uint32_t bo, Held write) {
  Destination* dest = nullptr;
  {
    std::lock_guard lock(mutex_);
    auto it = destinations_.find(bo);
    if (it == destinations_.end()) return NotFound("uffd engine: no destination for BO {}", bo);
    if (write.offset > it->second.size || write.length > it->second.size - write.offset)
      return OutOfRange("uffd engine: {} [{}, +{}) past BO {} of {} bytes",
                        write.zeros ? "zeroing" : "write", write.offset, write.length, bo,
                        it->second.size);
    if (!it->second.region) {
      // After Abandon nothing may be held: a held callback would outlive its session.
      if (abandoned_) return Aborted("uffd engine: BO {} will never be bound (abandoned)", bo);
      it->second.held.push_back(std::move(write));
      return Status::Ok();
    }
    dest = &it->second;  // bound destinations never change again
  }
  write.done(Install(*dest, write));
  return Status::Ok();
}

bool ShmemWritesMayAllocateLargeFolios(std::string_view global,
                                       const std::vector<std::string>& per_size) {
  // The selected value is the one in brackets.
  auto selected = [](std::string_view text) -> std::string_view {
    const size_t open = text.find('[');
    const size_t close = text.find(']', open);
    if (open == std::string_view::npos || close == std::string_view::npos) return {};
    return text.substr(open + 1, close - open - 1);
  };
  auto large = [](std::string_view value) {
    return value == "always" || value == "within_size" || value == "force";
  };
  if (large(selected(global))) return true;
  return std::any_of(per_size.begin(), per_size.end(),
                     [&](const std::string& text) { return large(selected(text)); });
}

bool ShmemWritesMayAllocateLargeFoliosHere() {
  static const bool may = [] {
    const std::filesystem::path thp = "/sys/kernel/mm/transparent_hugepage";
    auto read = [](const std::filesystem::path& path) {
      std::ifstream in(path);
      std::string text;
      std::getline(in, text);
      return text;
    };
    std::vector<std::string> per_size;
    std::error_code error;
    for (const auto& entry : std::filesystem::directory_iterator(thp, error))
      if (entry.path().filename().string().rfind("hugepages-", 0) == 0)
        per_size.push_back(read(entry.path() / "shmem_enabled"));
    return ShmemWritesMayAllocateLargeFolios(read(thp / "shmem_enabled"), per_size);
  }();
  return may;
}

namespace {

// The BO's memfd opened afresh, for KeepUnregistered: a file description of our own, whose
// offset SEEK_HOLE may move (the program's is its own). The descriptor may come from the
// restored process (a handover): it must be a memfd (seals readable) the sender could write
// through, or reopening it by path here, with this process's rights, could open for writing a
// file the sender may only read. Invalid, with the reason logged, otherwise.
UniqueFd OpenKeeper(uint32_t bo, int memfd) {
  auto refuse = [bo](std::string_view why) {
    spdlog::warn(
        "uffd engine: BO {}: {}; bytes the program unmaps before they arrive will be skipped, "
        "not kept in its memfd",
        bo, why);
    return UniqueFd();
  };
  const std::string path = fmt::format("/proc/self/fd/{}", memfd);
  std::array<char, 64> link{};
  const ssize_t link_length = ::readlink(path.c_str(), link.data(), link.size() - 1);
  struct statfs fs {};
  const int flags = ::fcntl(memfd, F_GETFL);
  const int seals = ::fcntl(memfd, F_GET_SEALS);
  // A memfd's link reads "/memfd:NAME (deleted)"; a hugetlbfs one has no holes to find.
  if (link_length < 0 || std::string_view(link.data()).rfind("/memfd:", 0) != 0 || flags < 0 ||
      seals < 0 || ::fstatfs(memfd, &fs) != 0 || fs.f_type == HUGETLBFS_MAGIC)
    return refuse("its descriptor is not a memfd of ordinary pages");
  if ((flags & O_ACCMODE) != O_RDWR) return refuse("its memfd is not open for writing");
  if ((seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0) return refuse("its memfd is sealed");
  // A write into one page's hole could then allocate a huge page over its neighbours, which
  // the program's registered range would show as zeros from then on (their installs: EEXIST).
  if (ShmemWritesMayAllocateLargeFoliosHere()) {
    // A setting of the machine: said once, not for each of thousands of BOs.
    static std::once_flag said;
    std::call_once(said, [&] {
      refuse(
          "shmem may allocate huge pages on write here "
          "(/sys/kernel/mm/transparent_hugepage/shmem_enabled), so for no BO");
    });
    return UniqueFd();
  }
  UniqueFd keeper(::open(path.c_str(), O_RDWR | O_CLOEXEC));
  if (!keeper.valid())
    return refuse(fmt::format("cannot open its memfd again ({}: {})", path, std::strerror(errno)));
  return keeper;
}

}  // namespace

Status UffdCopyEngine::Bind(const Region& region, int memfd) {
  std::vector<Held> held;
  Destination* dest = nullptr;
  {
    std::lock_guard lock(mutex_);
    auto it = destinations_.find(region.bo);
    if (it == destinations_.end()) return NotFound("uffd engine: bind of unknown BO {}", region.bo);
    if (it->second.region) return InvalidArgument("uffd engine: BO {} bound twice", region.bo);
    if (region.size != it->second.size)
      return InvalidArgument("uffd engine: BO {} is {} bytes, its region {}", region.bo,
                             it->second.size, region.size);
    if (uffd_.mode() == FillMode::kMinorContinue) {
      if (memfd < 0)
        return InvalidArgument("uffd engine: MINOR mode needs BO {}'s memfd", region.bo);
      GPULAZY_ASSIGN_OR_RETURN(it->second.filler, Mapping::Map(memfd, region.size));
    } else if (memfd >= 0) {
      it->second.keeper = OpenKeeper(region.bo, memfd);
    }
    if (memfd >= 0) {
      struct stat st {};
      if (::fstat(memfd, &st) == 0)
        bo_by_file_[{st.st_dev, static_cast<uint64_t>(st.st_ino)}] = region.bo;
    }
    it->second.region = region;
    addresses_.Add(region);
    held.swap(it->second.held);
    dest = &it->second;
  }
  for (Held& write : held)
    write.done(Install(*dest, write));
  return Status::Ok();
}

std::optional<AddressMap::Location> UffdCopyEngine::FindByFile(dev_t device, uint64_t inode,
                                                               uint64_t file_offset) const {
  std::lock_guard lock(mutex_);
  auto found = bo_by_file_.find({device, inode});
  if (found == bo_by_file_.end() || file_offset >= destinations_.at(found->second).size)
    return std::nullopt;
  return AddressMap::Location{found->second, file_offset};
}

std::vector<std::pair<uint64_t, uint64_t>> UffdCopyEngine::OwnMappings() const {
  std::lock_guard lock(mutex_);
  std::vector<std::pair<uint64_t, uint64_t>> own;
  for (const auto& [bo, dest] : destinations_)
    if (dest.filler.data() != nullptr)
      own.emplace_back(reinterpret_cast<uint64_t>(dest.filler.data()), dest.filler.size());
  return own;
}

void UffdCopyEngine::Abandon() {
  std::vector<Held> held;
  {
    std::lock_guard lock(mutex_);
    abandoned_ = true;
    for (auto& [bo, dest] : destinations_)
      for (Held& write : dest.held)
        held.push_back(std::move(write));
    for (auto& [bo, dest] : destinations_)
      dest.held.clear();
  }
  for (Held& write : held)
    write.done(Aborted("restored process never described its memory"));
}

Status UffdCopyEngine::Flush() {
  std::lock_guard lock(mutex_);
  for (const auto& [bo, dest] : destinations_)
    if (!dest.held.empty()) return Unavailable("uffd engine: BO {} has writes held until Bind", bo);
  return Status::Ok();
}

}  // namespace gpulazy::uffd
