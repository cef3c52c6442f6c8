#include "page-client/uffd/memory.h"

#include <errno.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>

namespace gpulazy::uffd {

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
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

Mapping& Mapping::operator=(Mapping&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

Mapping::~Mapping() {
  Reset();
}

void Mapping::Reset() {
  if (data_ != nullptr) munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
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

std::vector<int> RestoredMemory::memfds() const {
  std::vector<int> fds;
  for (const UniqueFd& fd : memfds_)
    fds.push_back(fd.get());
  return fds;
}

const Region* FindRegion(std::span<const Region> regions, uint64_t addr) {
  auto it = std::upper_bound(regions.begin(), regions.end(), addr,
                             [](uint64_t a, const Region& r) { return a < r.addr; });
  if (it == regions.begin()) return nullptr;
  --it;
  if (addr >= it->addr + PageAlignUp(std::max<uint64_t>(it->size, 1))) return nullptr;
  return &*it;
}

}  // namespace gpulazy::uffd
