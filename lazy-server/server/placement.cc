#include "lazy-server/server/placement.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <vector>

#include "lazy-server/image/io.h"
#include "proto/checksum.h"
#include "proto/endian.h"

#ifdef GPULAZY_SERVER_CUDA
#include "lazy-server/gpu/cuda_placement.h"
#endif

namespace gpulazy::server {
namespace {

// A memfd of the client's, mapped shared and writable here.
class MemfdTarget final : public PlacementTarget {
 public:
  MemfdTarget(UniqueFd fd, uint8_t* data, uint64_t size)
      : fd_(std::move(fd)), data_(data), size_(size) {}
  ~MemfdTarget() override {
    if (data_ != nullptr) ::munmap(data_, size_);
  }
  MemfdTarget(const MemfdTarget&) = delete;
  MemfdTarget& operator=(const MemfdTarget&) = delete;
  uint64_t size() const override { return size_; }
  uint8_t* data() const { return data_; }

 private:
  UniqueFd fd_;
  uint8_t* data_;
  uint64_t size_;
};

// Taken and checked; mapped when opened. (The client can still seal it in between: the mapping
// then fails, and its BO goes as bytes.)
class AcceptedMemfd final : public AcceptedTarget {
 public:
  AcceptedMemfd(UniqueFd fd, uint32_t number, uint64_t size)
      : fd_(std::move(fd)), number_(number), size_(size) {}
  Result<PlacementTargetRef> Open() override {
    if (size_ == 0)
      return PlacementTargetRef(std::make_shared<MemfdTarget>(std::move(fd_), nullptr, 0));
    void* data = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_.get(), 0);
    if (data == MAP_FAILED) return ErrnoError(errno, "mapping the client's memfd {}", number_);
    return PlacementTargetRef(
        std::make_shared<MemfdTarget>(std::move(fd_), static_cast<uint8_t*>(data), size_));
  }

 private:
  UniqueFd fd_;
  uint32_t number_;
  uint64_t size_;
};

Result<UniqueFd> TakePeerDescriptor(const PeerIdentity& peer, int fd) {
  const pid_t pid = *peer.pid;
  // pidfd_open and pidfd_getfd (Linux 5.3 and 5.6) through syscall(): Debian 12's glibc has no
  // wrappers for them. The pidfd taken as the client connected, where the kernel gave one: a pid
  // opened now could be a new process's that reused the number of a client that exited.
  UniqueFd opened_now;
  int pidfd = peer.pidfd ? peer.pidfd->get() : -1;
  if (pidfd < 0) {
    const long opened = ::syscall(SYS_pidfd_open, pid, 0);
    if (opened < 0) return ErrnoError(errno, "pidfd_open of the client's process {}", pid);
    opened_now.reset(static_cast<int>(opened));
    pidfd = opened_now.get();
  }
  const long taken = ::syscall(SYS_pidfd_getfd, pidfd, fd, 0);
  if (taken < 0) {
    const int error = errno;
    if (error == ESRCH)
      return Unavailable("taking descriptor {} of process {}: the client's process has exited", fd,
                         pid);
    if (error == EPERM)
      return PermissionDenied(
          "taking descriptor {} of process {}: not allowed (the server needs ptrace access to "
          "the client: the same user, or CAP_SYS_PTRACE)",
          fd, pid);
    return ErrnoError(error, "pidfd_getfd of descriptor {} of process {}", fd, pid);
  }
  return UniqueFd(static_cast<int>(taken));
}

class MemfdPlacement final : public PlacementBackend {
 public:
  std::string_view kind() const override { return "memfd"; }
  std::string device() const override { return {}; }

  Result<std::unique_ptr<AcceptedTarget>> Accept(std::string_view handle, uint64_t size,
                                                 const PeerIdentity& peer) override {
    if (handle.size() != 4)
      return InvalidArgument("a memfd destination is a 4-byte descriptor number, not {} bytes",
                             handle.size());
    if (!peer.pid) return InvalidArgument("memfd destinations need a Unix peer with credentials");
    const uint32_t number = LoadLe32(reinterpret_cast<const uint8_t*>(handle.data()));
    if (number > static_cast<uint32_t>(INT32_MAX))
      return InvalidArgument("descriptor number {} out of range", number);
    GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, TakePeerDescriptor(peer, static_cast<int>(number)));
    // Only a memfd answers F_GET_SEALS: no regular file, device or socket of the client's is
    // written through this. One sealed against writing is refused here rather than at mmap.
    const int seals = ::fcntl(fd.get(), F_GET_SEALS);
    if (seals < 0) return InvalidArgument("descriptor {} of the client is not a memfd", number);
    if ((seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0)
      return PermissionDenied("the client's memfd {} is sealed against writing", number);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) return ErrnoError(errno, "fstat of the client's memfd");
    if (static_cast<uint64_t>(st.st_size) < size)
      return OutOfRange("the client's memfd {} holds {} bytes, not the {} claimed", number,
                        st.st_size, size);
    return std::unique_ptr<AcceptedTarget>(
        std::make_unique<AcceptedMemfd>(std::move(fd), number, size));
  }

  Status Place(const image::DiskRange& from, std::string_view file_name,
               std::optional<uint64_t> checksum, const PlacementTargetRef& target,
               uint64_t target_offset, PlacementDone done) override {
    const auto* memfd = dynamic_cast<const MemfdTarget*>(target.get());
    if (memfd == nullptr) return Internal("a memfd placement into another kind of destination");
    if (target_offset > memfd->size() || from.length > memfd->size() - target_offset)
      return OutOfRange("[{}, +{}) lies past the destination's {} bytes", target_offset,
                        from.length, memfd->size());
    // Staged, not read into the destination: unchecked bytes never appear there, not even for
    // a moment (the client's own receive in place zeroes them afterwards; this has no need to).
    thread_local std::vector<uint8_t> staging;
    staging.resize(from.length);
    Status read = ReadExactAt(from.fd, from.offset, staging, file_name);
    if (read.ok() && checksum && Checksum64(staging) != *checksum)
      read = Corrupt("{} at [{}, +{}): checksum mismatch", file_name, from.offset, from.length);
    if (read.ok()) {
      std::memcpy(memfd->data() + target_offset, staging.data(), staging.size());
      placed_bytes_.fetch_add(from.length, std::memory_order_relaxed);
      placed_chunks_.fetch_add(1, std::memory_order_relaxed);
      if (checksum) verified_chunks_.fetch_add(1, std::memory_order_relaxed);
    } else if (read.code() == Code::kCorrupt) {
      mismatches_.fetch_add(1, std::memory_order_relaxed);
    }
    done(read);
    return Status::Ok();
  }

  Status Prepare(int /*fd*/, std::string_view /*file_name*/) override {
    return Status::Ok();  // reads its source at each placement: nothing to keep ready
  }

  void Flush() override {}  // every placement completes inside Place

  std::vector<std::pair<std::string, uint64_t>> Counters() const override {
    return {{"placed_chunks", placed_chunks_.load()},
            {"placed_bytes", placed_bytes_.load()},
            {"verified_chunks", verified_chunks_.load()},
            {"mismatches", mismatches_.load()}};
  }

 private:
  std::atomic<uint64_t> placed_chunks_{0};
  std::atomic<uint64_t> placed_bytes_{0};
  std::atomic<uint64_t> verified_chunks_{0};
  std::atomic<uint64_t> mismatches_{0};
};

}  // namespace

std::unique_ptr<PlacementBackend> CreateMemfdPlacement() {
  return std::make_unique<MemfdPlacement>();
}

Result<std::unique_ptr<PlacementBackend>> CreatePlacement(const PlacementOptions& options) {
  if (options.kind == "memfd") return CreateMemfdPlacement();
  if (options.kind == "cuda") {
#ifdef GPULAZY_SERVER_CUDA
    return gpu::CreateCudaPlacement(options);
#else
    return Unsupported("placement \"cuda\": this gpulazy-server was built without CUDA");
#endif
  }
  return InvalidArgument("unknown placement \"{}\" (memfd or cuda)", options.kind);
}

}  // namespace gpulazy::server
