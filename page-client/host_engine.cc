#include "page-client/host_engine.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "proto/endian.h"

namespace gpulazy::client {

Result<MemfdRegion> MemfdRegion::Create(const std::string& name, uint64_t size) {
  if (size > static_cast<uint64_t>(SIZE_MAX / 2))
    return OutOfRange("memfd {}: size {} does not fit the address space", name, size);
  MemfdRegion region;
  region.fd_ = ::memfd_create(name.c_str(), MFD_CLOEXEC);
  if (region.fd_ < 0) {
    if (errno == EMFILE)  // the engine holds one memfd per BO
      return ErrnoError(errno, "memfd_create {} (one descriptor per BO: raise RLIMIT_NOFILE)",
                        name);
    return ErrnoError(errno, "memfd_create {}", name);
  }
  if (::ftruncate(region.fd_, static_cast<off_t>(size)) != 0)
    return ErrnoError(errno, "ftruncate memfd {} to {} bytes", name, size);
  region.size_ = size;
  // mmap of zero bytes is EINVAL; an empty BO simply has no mapping.
  if (size > 0) {
    void* data = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, region.fd_, 0);
    if (data == MAP_FAILED) return ErrnoError(errno, "mmap memfd {} ({} bytes)", name, size);
    region.data_ = static_cast<uint8_t*>(data);
  }
  return region;
}

MemfdRegion::MemfdRegion(MemfdRegion&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

MemfdRegion& MemfdRegion::operator=(MemfdRegion&& other) noexcept {
  if (this != &other) {
    Reset();
    fd_ = std::exchange(other.fd_, -1);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

MemfdRegion::~MemfdRegion() {
  Reset();
}

void MemfdRegion::Reset() {
  if (data_ != nullptr) ::munmap(data_, size_);
  if (fd_ >= 0) ::close(fd_);
  data_ = nullptr;
  fd_ = -1;
  size_ = 0;
}

Status HostCopyEngine::AddDestination(uint32_t bo, uint64_t size) {
  std::lock_guard lock(mutex_);
  if (regions_.contains(bo))
    return InvalidArgument("host engine: BO {} already has a destination", bo);
  GPULAZY_ASSIGN_OR_RETURN(MemfdRegion region,
                           MemfdRegion::Create(fmt::format("gpulazy-bo-{}", bo), size));
  populate_.AddRegion(bo, region.bytes());
  regions_.try_emplace(bo, std::move(region));
  return Status::Ok();
}

std::optional<CopyEngine::PlacementExport> HostCopyEngine::ExportDestination(uint32_t bo) {
  if (!options_.export_for_placement) return std::nullopt;
  Result<const MemfdRegion*> memfd = Memfd(bo);
  if (!memfd.ok() || (*memfd)->fd() < 0) return std::nullopt;
  PlacementExport exported;
  exported.kind = "memfd";
  exported.handle.resize(4);
  StoreLe32(reinterpret_cast<uint8_t*>(exported.handle.data()),
            static_cast<uint32_t>((*memfd)->fd()));
  exported.size = (*memfd)->size();
  return exported;
}

Result<const HostCopyEngine::Destination*> HostCopyEngine::Find(uint32_t bo) const {
  std::lock_guard lock(mutex_);
  auto it = regions_.find(bo);
  if (it == regions_.end()) return NotFound("host engine: BO {} has no destination", bo);
  // std::map nodes never move, so the pointer outlives the lock.
  return &it->second;
}

Result<HostCopyEngine::Destination*> HostCopyEngine::Find(uint32_t bo) {
  GPULAZY_ASSIGN_OR_RETURN(const Destination* destination, std::as_const(*this).Find(bo));
  return const_cast<Destination*>(destination);  // this object is not const
}

Result<const MemfdRegion*> HostCopyEngine::Memfd(uint32_t bo) const {
  GPULAZY_ASSIGN_OR_RETURN(const Destination* destination, Find(bo));
  return &destination->memfd;
}

Status HostCopyEngine::WriteThroughFile(Destination& destination, uint32_t bo, uint64_t offset,
                                        std::span<const uint8_t> raw) {
  Status status = Status::Ok();
  for (size_t done_bytes = 0; done_bytes < raw.size();) {
    const ssize_t n = ::pwrite(destination.memfd.fd(), raw.data() + done_bytes,
                               raw.size() - done_bytes, static_cast<off_t>(offset + done_bytes));
    if (n < 0 && errno == EINTR) continue;
    // The memfd's size is fixed, so a short write means memory ran out (ENOSPC, ENOMEM).
    if (n < 0) {
      status = ErrnoError(errno, "host engine: pwrite of {} bytes at offset {} of BO {}",
                          raw.size() - done_bytes, offset + done_bytes, bo);
      break;
    }
    if (n == 0) {
      status = Internal("host engine: pwrite at offset {} of BO {} wrote nothing",
                        offset + done_bytes, bo);
      break;
    }
    done_bytes += static_cast<size_t>(n);
  }
  EndFileWrite(destination, offset);
  return status;
}

bool HostCopyEngine::ClaimFileWrite(Destination& destination, uint64_t offset) {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard lock(destination.claim_mu);
  if (destination.claimed && destination.claim_offset == offset) return true;
  if (destination.claimed && now < destination.claim_until) return false;
  destination.claimed = true;
  destination.claim_offset = offset;
  destination.claim_until = now + kFileWriteClaim;
  return true;
}

void HostCopyEngine::EndFileWrite(Destination& destination, uint64_t offset) {
  if (fresh_pages_.load(std::memory_order_relaxed) != HostEngineOptions::FreshPages::kOnePerBo)
    return;
  std::lock_guard lock(destination.claim_mu);
  if (destination.claimed && destination.claim_offset == offset) destination.claimed = false;
}

Status HostCopyEngine::Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw,
                             CopyDone done) {
  GPULAZY_ASSIGN_OR_RETURN(Destination * destination, Find(bo));
  const MemfdRegion& region = destination->memfd;
  // Written so that neither sum can overflow: offset is checked against the size first.
  if (offset > region.size() || raw.size() > region.size() - offset)
    return OutOfRange(
        "host engine: write of {} bytes at offset {} past the end of BO {} ({} bytes)", raw.size(),
        offset, bo, region.size());
  populate_.WritingAt(bo, offset, raw.size());
  if (!raw.empty() && ThroughFile(*destination, offset, raw.size())) {
    GPULAZY_RETURN_IF_ERROR(WriteThroughFile(*destination, bo, offset, raw));
  } else if (!raw.empty()) {
    std::memcpy(region.bytes().data() + offset, raw.data(), raw.size());
    EndFileWrite(*destination, offset);  // a claim whose pages came meanwhile (prepared, say)
  }
  bytes_written_.fetch_add(raw.size(), std::memory_order_relaxed);
  if (done) done(Status::Ok());
  return Status::Ok();
}

Status HostCopyEngine::WriteZeros(uint32_t bo, uint64_t offset, uint64_t length, CopyDone done) {
  GPULAZY_ASSIGN_OR_RETURN(Destination * destination, Find(bo));
  const MemfdRegion& region = destination->memfd;
  if (offset > region.size() || length > region.size() - offset)
    return OutOfRange("host engine: zeroing {} bytes at offset {} past the end of BO {} ({} bytes)",
                      length, offset, bo, region.size());
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t end = offset + length;
  uint64_t first_page = std::min(end, (offset + page - 1) / page * page);
  uint64_t last_page = std::max(first_page, end / page * page);
  if (last_page > first_page && ::fallocate(region.fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                            static_cast<off_t>(first_page),
                                            static_cast<off_t>(last_page - first_page)) != 0) {
    if (errno != EOPNOTSUPP)
      return ErrnoError(errno, "host engine: punching [{}, {}) out of BO {}'s memfd", first_page,
                        last_page, bo);
    first_page = last_page = end;  // a memory without holes: zero it all by hand
  }
  // The parts of pages at either end (a BO whose size is not whole pages). An empty range of an
  // empty BO may have no address at all.
  if (length > 0) {
    std::memset(region.bytes().data() + offset, 0, first_page - offset);
    std::memset(region.bytes().data() + last_page, 0, end - last_page);
  }
  bytes_written_.fetch_add(length, std::memory_order_relaxed);
  bytes_zeroed_.fetch_add(length, std::memory_order_relaxed);
  if (done) done(Status::Ok());
  return Status::Ok();
}

std::optional<std::span<uint8_t>> HostCopyEngine::ReceiveTarget(uint32_t bo, uint64_t offset,
                                                                uint64_t length) {
  if (!options_.receive_in_place) return std::nullopt;
  Result<Destination*> destination = Find(bo);
  if (!destination.ok()) return std::nullopt;  // Write will say why
  const MemfdRegion& region = (*destination)->memfd;
  const uint64_t size = region.size();
  if (offset > size || length > size - offset || length == 0) return std::nullopt;
  if (ThroughFile(**destination, offset, length)) return std::nullopt;  // Write: pwrite
  populate_.WritingAt(bo, offset, length);
  return region.bytes().subspan(static_cast<size_t>(offset), static_cast<size_t>(length));
}

Status HostCopyEngine::CommitReceived(uint32_t bo, uint64_t offset, uint64_t length,
                                      CopyDone done) {
  GPULAZY_ASSIGN_OR_RETURN(const MemfdRegion* region, Memfd(bo));
  if (offset > region->size() || length > region->size() - offset)
    return OutOfRange("host engine: commit of {} bytes at offset {} past the end of BO {}", length,
                      offset, bo);
  bytes_written_.fetch_add(length, std::memory_order_relaxed);
  if (done) done(Status::Ok());
  return Status::Ok();
}

void HostCopyEngine::PrepareDestination(uint32_t bo, uint64_t offset, uint64_t length) {
  if (!options_.prepare_waited_ranges || length == 0) return;
  Result<const MemfdRegion*> region = Memfd(bo);
  if (!region.ok()) return;
  const uint64_t size = (*region)->size();
  if (offset >= size || length > size - offset) return;
  static const uint64_t kPage = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  // Pieces of this size, last first: the chunk's receive (or pwrite) starts at its front, so
  // the two meet in the middle and each allocates about half the pages. A piece whose first
  // page exists was reached by the writer (or filled before): what lies in front of it is its.
  constexpr uint64_t kPieceBytes = 256u << 10;
  const uint64_t first = offset / kPage * kPage;
  const uint64_t end = std::min(size, (offset + length + kPage - 1) / kPage * kPage);
  uint8_t* base = (*region)->bytes().data();
  for (uint64_t piece_end = end; piece_end > first;) {
    const uint64_t piece = piece_end - first > kPieceBytes ? piece_end - kPieceBytes : first;
    unsigned char present = 0;
    if (::mincore(base + piece, 1, &present) != 0 || (present & 1) != 0) return;
    // Never changes bytes: MADV_POPULATE_WRITE only faults in what is missing, as a write
    // would. EINVAL (before Linux 5.14), ENOMEM and the like leave the pages to the writer.
    if (::madvise(base + piece, piece_end - piece, MADV_POPULATE_WRITE) != 0) return;
    prepared_bytes_.fetch_add(piece_end - piece, std::memory_order_relaxed);
    piece_end = piece;
  }
}

bool HostCopyEngine::ThroughFile(Destination& destination, uint64_t offset, uint64_t length) {
  using FreshPages = HostEngineOptions::FreshPages;
  const FreshPages mode = fresh_pages_.load(std::memory_order_relaxed);
  if (mode == FreshPages::kMap || !Fresh(destination.memfd, offset, length)) return false;
  // kOnePerBo: a second pwrite into the memfd would wait on its inode lock, while the mapping's
  // page faults run in parallel.
  return mode == FreshPages::kWrite || ClaimFileWrite(destination, offset);
}

bool HostCopyEngine::Fresh(const MemfdRegion& region, uint64_t offset, uint64_t length) const {
  if (length == 0) return false;
  // Only the range's last page is asked about: chunks are written whole and populating ahead
  // runs forwards, so where the last page exists the earlier ones almost always do too, and a
  // wrong guess costs speed, never bytes. mincore reports the memfd's page cache.
  static const uint64_t kPage = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t last_page = (offset + length - 1) / kPage * kPage;
  unsigned char present = 0;
  if (::mincore(region.bytes().data() + last_page, 1, &present) != 0) return false;
  return (present & 1) == 0;
}

Result<std::span<uint8_t>> HostCopyEngine::Mapping(uint32_t bo) const {
  GPULAZY_ASSIGN_OR_RETURN(const MemfdRegion* region, Memfd(bo));
  return region->bytes();
}

Result<int> HostCopyEngine::Fd(uint32_t bo) const {
  GPULAZY_ASSIGN_OR_RETURN(const MemfdRegion* region, Memfd(bo));
  return region->fd();
}

uint64_t HostCopyEngine::bytes_written() const {
  return bytes_written_.load(std::memory_order_relaxed);
}

}  // namespace gpulazy::client
