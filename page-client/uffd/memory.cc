#include "page-client/uffd/memory.h"

#include <errno.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <iterator>

namespace gpulazy::uffd {

void AddRange(std::map<uint64_t, uint64_t>& ranges, uint64_t start, uint64_t end) {
  auto it = ranges.upper_bound(start);
  if (it != ranges.begin() && std::prev(it)->second >= start) --it;
  while (it != ranges.end() && it->first <= end) {
    start = std::min(start, it->first);
    end = std::max(end, it->second);
    it = ranges.erase(it);
  }
  ranges.emplace(start, end);
}

Result<Mapping> Mapping::Map(int fd, uint64_t size) {
  Mapping mapping;
  mapping.size_ = PageAlignUp(std::max<uint64_t>(size, 1));
  const int flags = fd >= 0 ? MAP_SHARED : (MAP_PRIVATE | MAP_ANONYMOUS);
  void* data = mmap(nullptr, mapping.size_, PROT_READ | PROT_WRITE, flags, fd, 0);
  if (data == MAP_FAILED) return ErrnoError(errno, "mmap {} bytes", mapping.size_);
  mapping.data_ = static_cast<uint8_t*>(data);
  return mapping;
}

Mapping::Mapping(Mapping&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      forgotten_(std::exchange(other.forgotten_, {})) {}

Mapping& Mapping::operator=(Mapping&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    forgotten_ = std::exchange(other.forgotten_, {});
  }
  return *this;
}

Mapping::~Mapping() {
  Reset();
}

void Mapping::Forget(uint64_t addr, uint64_t length) {
  const uint64_t begin = reinterpret_cast<uint64_t>(data_);
  const uint64_t limit = begin + size_;
  if (data_ == nullptr || addr >= limit || length == 0) return;
  const uint64_t start = std::max(PageAlignDown(addr), begin);
  // No wrap past the mapping's end (a page-aligned limit, so rounding up stays within it).
  const uint64_t end = length >= limit - addr ? limit : PageAlignUp(addr + length);
  if (start >= end) return;
  AddRange(forgotten_, start, end);
}

void Mapping::Reset() {
  if (data_ != nullptr) {
    uint64_t from = reinterpret_cast<uint64_t>(data_);
    for (const auto& [start, end] : forgotten_) {
      if (start > from) munmap(reinterpret_cast<void*>(from), start - from);
      from = end;
    }
    const uint64_t end = reinterpret_cast<uint64_t>(data_) + size_;
    if (end > from) munmap(reinterpret_cast<void*>(from), end - from);
  }
  data_ = nullptr;
  size_ = 0;
  forgotten_.clear();
}

Result<RestoredMemory> RestoredMemory::Create(const Userfaultfd& uffd,
                                              const std::vector<uint64_t>& sizes, bool anonymous) {
  RestoredMemory memory;
  for (uint32_t bo = 0; bo < sizes.size(); ++bo) {
    UniqueFd memfd;
    if (!anonymous) {
      // MFD_CLOEXEC: a pager in another process gets it by SCM_RIGHTS, not by inheritance, and a
      // helper the faulting process execs must not hold it.
      int raw = memfd_create(("gpulazy-bo-" + std::to_string(bo)).c_str(), MFD_CLOEXEC);
      if (raw < 0) return ErrnoError(errno, "memfd_create for BO {}", bo);
      memfd = UniqueFd(raw);
      if (ftruncate(memfd.get(), static_cast<off_t>(PageAlignUp(sizes[bo]))) != 0)
        return ErrnoError(errno, "sizing the memfd of BO {} to {} bytes", bo, sizes[bo]);
    }
    GPULAZY_ASSIGN_OR_RETURN(Mapping mapping, Mapping::Map(memfd.get(), sizes[bo]));
    // Not inherited by a child (as memory a device reads commonly is: RDMA registration does the
    // same). A child's copy of the mapping would not be registered with us: in MISSING mode a
    // page the child touched before its chunk landed would become zeros in the shared memfd,
    // and our install would then find it there and skip it, leaving the parent those zeros.
    if (madvise(mapping.data(), mapping.size(), MADV_DONTFORK) != 0)
      return ErrnoError(errno, "MADV_DONTFORK on the memory of BO {}", bo);
    GPULAZY_RETURN_IF_ERROR(
        uffd.Register(reinterpret_cast<uint64_t>(mapping.data()), mapping.size()));
    memory.regions_.push_back({bo, reinterpret_cast<uint64_t>(mapping.data()), sizes[bo]});
    memory.memfds_.push_back(std::move(memfd));
    memory.mappings_.push_back(std::move(mapping));
  }
  return memory;
}

void RestoredMemory::Forget(uint64_t addr, uint64_t length) {
  for (Mapping& mapping : mappings_)
    mapping.Forget(addr, length);
}

std::vector<int> RestoredMemory::memfds() const {
  std::vector<int> fds;
  for (const UniqueFd& fd : memfds_)
    fds.push_back(fd.get());
  return fds;
}

void AddressMap::Insert(uint64_t addr, const Segment& segment) {
  by_addr_[addr] = segment;
  by_bo_[{segment.bo, segment.offset}] = addr;
}

void AddressMap::SplitAt(uint64_t at) {
  auto it = by_addr_.upper_bound(at);
  if (it == by_addr_.begin()) return;
  --it;
  const uint64_t start = it->first;
  Segment& segment = it->second;
  if (at <= start || at >= start + segment.length) return;
  const Segment tail{segment.bo, segment.offset + (at - start), start + segment.length - at};
  segment.length = at - start;
  Insert(at, tail);
}

void AddressMap::Add(const Region& region) {
  std::unique_lock lock(mutex_);
  if (sizes_.contains(region.bo)) return;
  sizes_[region.bo] = region.size;
  const uint64_t length = PageAlignUp(std::max<uint64_t>(region.size, 1));
  Insert(region.addr, {region.bo, 0, length});
  EraseLeft(region.addr, region.addr + length);
}

uint64_t AddressMap::Move(uint64_t from, uint64_t to, uint64_t length, const EventHold& hold,
                          const MoveHold& installs) {
  if (hold.mutex() != &mutex_ || !hold.owns_lock()) std::abort();  // a caller's bug
  if (installs.mutex() != &installs_ || !installs.owns_lock()) std::abort();
  // Cut the segments overlapping [from, from + length) at its ends, then move the inside ones.
  SplitAt(from);
  SplitAt(from + length);
  // What moves: BO memory, and what earlier moves left in the range (still registered if they
  // did not unmap it: it goes on being an alias where it goes). What stays behind: a record of
  // the BO memory that was here.
  std::vector<std::pair<uint64_t, Segment>> carried = LeftIn(from, from + length);
  for (auto& [addr, segment] : carried)
    addr = addr - from + to;
  // (left_ never overlaps BO memory, so the records need no room made for them.)
  std::vector<std::pair<uint64_t, Segment>> moved;  // at the addresses they left
  for (auto it = by_addr_.lower_bound(from); it != by_addr_.end() && it->first < from + length;) {
    moved.emplace_back(it->first, it->second);
    left_[it->first] = it->second;
    by_bo_.erase({it->second.bo, it->second.offset});
    it = by_addr_.erase(it);
  }
  // MREMAP_FIXED onto BO memory unmapped what was there: those bytes are no longer anywhere.
  SplitAt(to);
  SplitAt(to + length);
  bool replaced = false;
  for (auto it = by_addr_.lower_bound(to); it != by_addr_.end() && it->first < to + length;) {
    by_bo_.erase({it->second.bo, it->second.offset});
    it = by_addr_.erase(it);
    replaced = true;
  }
  EraseLeft(to, to + length);
  for (const auto& [addr, segment] : carried)
    left_[addr] = segment;
  uint64_t bytes = 0;
  for (const auto& [addr, segment] : moved) {
    Insert(addr - from + to, segment);  // inside [to, +length): no record left there
    bytes += segment.length;
  }
  // Any change of where BO bytes are (or were) makes an installer that looked its addresses up
  // before it look again, and UnregisterAll walk again.
  if (bytes > 0 || replaced || !carried.empty())
    generation_.fetch_add(1, std::memory_order_relaxed);
  return bytes;
}

std::vector<AddressMap::Piece> AddressMap::Resolve(uint32_t bo, uint64_t offset, uint64_t length,
                                                   uint64_t* generation) const {
  std::shared_lock lock(mutex_);
  if (generation != nullptr) *generation = generation_.load(std::memory_order_relaxed);
  std::vector<Piece> pieces;
  auto it = by_bo_.upper_bound({bo, offset});
  if (it != by_bo_.begin() && std::prev(it)->first.first == bo) --it;
  for (; it != by_bo_.end() && it->first.first == bo && it->first.second < offset + length; ++it) {
    const Segment& segment = by_addr_.at(it->second);
    const uint64_t from = std::max(offset, segment.offset);
    const uint64_t to = std::min(offset + length, segment.offset + segment.length);
    if (from < to) pieces.push_back({it->second + (from - segment.offset), from, to - from});
  }
  return pieces;
}

std::optional<AddressMap::Location> AddressMap::Find(uint64_t addr) const {
  std::shared_lock lock(mutex_);
  return FindUnlocked(addr);
}

std::optional<AddressMap::Location> AddressMap::Find(uint64_t addr, const EventHold& hold) const {
  if (hold.mutex() != &mutex_ || !hold.owns_lock()) std::abort();  // a caller's bug
  return FindUnlocked(addr);
}

std::optional<AddressMap::Location> AddressMap::FindUnlocked(uint64_t addr) const {
  return FindIn(by_addr_, addr);
}

std::optional<AddressMap::Location> AddressMap::FindIn(const std::map<uint64_t, Segment>& segments,
                                                       uint64_t addr) const {
  auto it = segments.upper_bound(addr);
  if (it == segments.begin()) return std::nullopt;
  --it;
  const Segment& segment = it->second;
  if (addr >= it->first + segment.length) return std::nullopt;
  const uint64_t offset = segment.offset + (addr - it->first);
  if (offset >= sizes_.at(segment.bo)) return std::nullopt;
  return Location{segment.bo, offset};
}

std::optional<AddressMap::Location> AddressMap::FindLeftBehind(uint64_t addr) const {
  std::shared_lock lock(mutex_);
  return FindIn(left_, addr);
}

bool AddressMap::RecordAlias(uint64_t addr, uint64_t length, uint32_t bo, uint64_t offset) {
  std::unique_lock lock(mutex_);
  std::unique_lock installs(installs_);
  auto size = sizes_.find(bo);
  if (size == sizes_.end() || offset >= size->second) return false;
  length = std::min(length, PageAlignUp(size->second) - offset);
  if (length == 0) return false;
  const uint64_t end = addr + length;
  // BO memory the map has in the range: this BO at the offsets the maps show is the map being
  // right; anything else there was unmapped since (the maps show another file there now).
  auto it = by_addr_.upper_bound(addr);
  if (it != by_addr_.begin()) --it;
  for (; it != by_addr_.end() && it->first < end; ++it) {
    if (it->first + it->second.length <= addr) continue;
    const uint64_t common = std::max(it->first, addr);
    if (it->second.bo == bo && it->second.offset + (common - it->first) == offset + (common - addr))
      return false;
  }
  SplitAt(addr);
  SplitAt(end);
  for (it = by_addr_.lower_bound(addr); it != by_addr_.end() && it->first < end;) {
    by_bo_.erase({it->second.bo, it->second.offset});
    it = by_addr_.erase(it);
  }
  EraseLeft(addr, end);
  left_[addr] = Segment{bo, offset, length};
  // Installers look again, and UnregisterAll walks again if it began before this.
  generation_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

std::vector<std::pair<uint64_t, uint64_t>> AddressMap::LeftBehindRanges() const {
  std::shared_lock lock(mutex_);
  return RangesOf(left_);
}

std::vector<std::pair<uint64_t, AddressMap::Segment>> AddressMap::LeftIn(uint64_t from,
                                                                         uint64_t to) const {
  std::vector<std::pair<uint64_t, Segment>> found;
  auto it = left_.upper_bound(from);
  if (it != left_.begin()) --it;
  for (; it != left_.end() && it->first < to; ++it) {
    const uint64_t start = std::max(it->first, from);
    const uint64_t end = std::min(it->first + it->second.length, to);
    if (start >= end) continue;
    found.emplace_back(
        start, Segment{it->second.bo, it->second.offset + (start - it->first), end - start});
  }
  return found;
}

void AddressMap::EraseLeft(uint64_t from, uint64_t to) {
  std::vector<std::pair<uint64_t, Segment>> kept;  // the parts outside [from, to)
  auto it = left_.upper_bound(from);
  if (it != left_.begin()) --it;
  while (it != left_.end() && it->first < to) {
    const uint64_t start = it->first;
    const Segment segment = it->second;
    const uint64_t end = start + segment.length;
    if (end <= from) {
      ++it;
      continue;
    }
    if (start < from) kept.emplace_back(start, Segment{segment.bo, segment.offset, from - start});
    if (end > to)
      kept.emplace_back(to, Segment{segment.bo, segment.offset + (to - start), end - to});
    it = left_.erase(it);
  }
  for (const auto& [addr, segment] : kept)
    left_[addr] = segment;
}

std::vector<std::pair<uint64_t, uint64_t>> AddressMap::Ranges() const {
  std::shared_lock lock(mutex_);
  return RangesOf(by_addr_);
}

std::vector<std::pair<uint64_t, uint64_t>> AddressMap::RangesOf(
    const std::map<uint64_t, Segment>& segments) {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  ranges.reserve(segments.size());
  for (const auto& [addr, segment] : segments)
    ranges.emplace_back(addr, segment.length);
  return ranges;
}

uint64_t AddressMap::generation() const {
  // Under the lock: waits for moves being applied (the pager holds it while it reads them).
  std::shared_lock lock(mutex_);
  return generation_.load(std::memory_order_relaxed);
}

uint64_t AddressMap::generation(const InstallHold& hold) const {
  if (hold.mutex() != &installs_ || !hold.owns_lock()) std::abort();  // a caller's bug
  return generation_.load(std::memory_order_relaxed);
}

}  // namespace gpulazy::uffd
