#include "lazy-server/gpu/device_placer.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#define XXH_STATIC_LINKING_ONLY  // XXH3_generateSecret_fromSeed
#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "page-client/cuda/verify_kernel.h"
#include "proto/checksum.h"
#include "proto/xxh3_blocks.h"

namespace gpulazy::server::gpu {
namespace {

Status CudaError(cudaError_t error, std::string_view what) {
  return Unavailable("{}: {} ({})", what, cudaGetErrorString(error), cudaGetErrorName(error));
}

constexpr size_t kPageBytes = 4096;

// cuMemGetAddressRange through the runtime's entry-point lookup: linking libcuda itself would
// make every binary with the placer fail to start on a machine without the driver (the CI and
// development VMs, where the GPU tests skip).
Status AddressRange(CUdeviceptr pointer, CUdeviceptr& base, size_t& size) {
  using Fn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  static Fn fn = [] {
    void* found = nullptr;
    cudaDriverEntryPointQueryResult query{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &found, 12000, cudaEnableDefault,
                                         &query) != cudaSuccess ||
        query != cudaDriverEntryPointSuccess)
      found = nullptr;
    return reinterpret_cast<Fn>(found);
  }();
  if (fn == nullptr) return Unsupported("the CUDA driver offers no cuMemGetAddressRange");
  if (CUresult r = fn(&base, &size, pointer); r != CUDA_SUCCESS)
    return Unavailable("sizing an opened destination: CUDA driver error {}", static_cast<int>(r));
  return Status::Ok();
}

}  // namespace

class RegisteredFile {
 public:
  using Key = std::tuple<dev_t, ino_t, uint64_t, int64_t, int64_t>;  // + mtime s, ns

  RegisteredFile(Key key, std::string name, void* mapping, uint64_t size)
      : key_(key), name_(std::move(name)), mapping_(mapping), size_(size) {}
  ~RegisteredFile() {
    // A failure leaves the pages pinned until the process exits: say so.
    if (cudaError_t e = cudaHostUnregister(mapping_); e != cudaSuccess)
      spdlog::warn("device placer: unregistering {}: {}", name_, cudaGetErrorString(e));
    ::munmap(mapping_, MappedBytes());
  }
  RegisteredFile(const RegisteredFile&) = delete;
  RegisteredFile& operator=(const RegisteredFile&) = delete;

  const Key& key() const { return key_; }
  const std::string& name() const { return name_; }
  const uint8_t* data() const { return static_cast<const uint8_t*>(mapping_); }
  uint64_t size() const { return size_; }
  uint64_t MappedBytes() const { return (size_ + kPageBytes - 1) / kPageBytes * kPageBytes; }

 private:
  Key key_;
  std::string name_;
  void* mapping_;
  uint64_t size_;
};

class Destination {
 public:
  Destination(uint8_t* device, uint64_t size) : device_(device), size_(size) {}
  ~Destination() {
    if (cudaError_t e = cudaIpcCloseMemHandle(device_); e != cudaSuccess)
      spdlog::warn("device placer: closing a destination: {}", cudaGetErrorString(e));
  }
  Destination(const Destination&) = delete;
  Destination& operator=(const Destination&) = delete;

  uint8_t* device() const { return device_; }
  uint64_t size() const { return size_; }

 private:
  uint8_t* device_;
  uint64_t size_;
};

class DevicePlacer::Impl {
 public:
  explicit Impl(const PlacerOptions& options) : options_(options) {}

  ~Impl() {
    Flush();
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    queued_.notify_all();
    if (reaper_.joinable()) reaper_.join();
    cache_.clear();  // unregistered while the context still lives
    for (Slot& slot : slots_)
      if (slot.event != nullptr) cudaEventDestroy(slot.event);
    for (cudaStream_t stream : streams_)
      cudaStreamDestroy(stream);
    if (staging_ != nullptr) cudaFree(staging_);
    if (sums_ != nullptr) cudaFree(sums_);
    if (arrivals_ != nullptr) cudaFree(arrivals_);
    if (secret_ != nullptr) cudaFree(secret_);
    if (verdicts_ != nullptr) cudaFreeHost(verdicts_);
  }

  Status Init() {
    if (options_.slots == 0 || options_.streams == 0)
      return InvalidArgument("device placer: {} slots on {} streams", options_.slots,
                             options_.streams);
    if (options_.slot_bytes < client::cuda::kMinVerifiedBytes || options_.slot_bytes > (64u << 20))
      return InvalidArgument("device placer: slots of {} bytes", options_.slot_bytes);
    if (cudaError_t e = cudaSetDevice(options_.device); e != cudaSuccess)
      return CudaError(e, fmt::format("selecting CUDA device {}", options_.device));
    streams_.resize(options_.streams);
    for (cudaStream_t& stream : streams_)
      if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
          e != cudaSuccess)
        return CudaError(e, "creating a placement stream");
    uint8_t secret[xxh3::kSecretBytes];
    XXH3_generateSecret_fromSeed(secret, 0);
    if (cudaError_t e = cudaMalloc(&secret_, sizeof secret); e != cudaSuccess)
      return CudaError(e, "allocating the verification secret");
    if (cudaError_t e = cudaMemcpy(secret_, secret, sizeof secret, cudaMemcpyHostToDevice);
        e != cudaSuccess)
      return CudaError(e, "copying the verification secret");
    stride_ = (size_t{options_.slot_bytes} + kPageBytes - 1) / kPageBytes * kPageBytes;
    sums_stride_ = (client::cuda::BlockSumBytes(options_.slot_bytes) + 255) / 256 * 256;
    const size_t slots = options_.slots;
    if (cudaError_t e = cudaMalloc(&staging_, stride_ * slots); e != cudaSuccess)
      return CudaError(e, fmt::format("allocating {} bytes of device staging", stride_ * slots));
    if (cudaError_t e = cudaMalloc(&sums_, sums_stride_ * slots); e != cudaSuccess)
      return CudaError(e, "allocating the verify kernel's scratch");
    if (cudaError_t e = cudaMalloc(&arrivals_, sizeof(uint32_t) * slots); e != cudaSuccess)
      return CudaError(e, "allocating the verify kernel's counters");
    if (cudaError_t e = cudaMemset(arrivals_, 0, sizeof(uint32_t) * slots); e != cudaSuccess)
      return CudaError(e, "clearing the verify kernel's counters");
    void* verdicts = nullptr;
    if (cudaError_t e = cudaHostAlloc(&verdicts, sizeof(uint32_t) * slots, cudaHostAllocMapped);
        e != cudaSuccess)
      return CudaError(e, "allocating verdict words");
    verdicts_ = static_cast<uint32_t*>(verdicts);
    if (cudaError_t e =
            cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped_verdicts_), verdicts_, 0);
        e != cudaSuccess)
      return CudaError(e, "mapping verdict words for the device");
    slots_.resize(slots);
    for (Slot& slot : slots_)
      if (cudaError_t e = cudaEventCreateWithFlags(
              &slot.event,
              cudaEventDisableTiming | (options_.blocking_sync ? cudaEventBlockingSync : 0u));
          e != cudaSuccess)
        return CudaError(e, "creating a placement event");
    for (uint32_t i = 0; i < slots; ++i)
      free_.push_back(i);
    reaper_ = std::thread([this] { ReapLoop(); });
    return Status::Ok();
  }

  Result<SourceRef> RegisterFile(int fd, std::string_view name) {
    struct stat st {};
    if (::fstat(fd, &st) != 0) return ErrnoError(errno, "registering {}: fstat", name);
    if (!S_ISREG(st.st_mode)) return InvalidArgument("registering {}: not a regular file", name);
    const auto size = static_cast<uint64_t>(st.st_size);
    if (size == 0) return InvalidArgument("registering {}: the file is empty", name);
    const RegisteredFile::Key key{st.st_dev, st.st_ino, size, st.st_mtim.tv_sec,
                                  st.st_mtim.tv_nsec};
    // Every placement of a stream asks for its file: a registered one is found without waiting
    // behind a registration of another file.
    {
      std::lock_guard lock(mu_);
      if (std::optional<SourceRef> cached = FindCachedLocked(key)) return *std::move(cached);
    }
    // One registration at a time: two of the same file would pin it twice, and registering
    // holds the driver against every other call of the process anyway (session 14).
    std::lock_guard registering(register_mu_);
    const uint64_t pinned = (size + kPageBytes - 1) / kPageBytes * kPageBytes;
    // Unregistered after mu_ is released: unregistering waits for the device's work in flight
    // (session 14), and the reaper needs mu_ meanwhile.
    std::vector<std::shared_ptr<RegisteredFile>> evicted;
    {
      std::lock_guard lock(mu_);
      // Registered by another caller while this one waited for register_mu_.
      if (std::optional<SourceRef> cached = FindCachedLocked(key)) return *std::move(cached);
      if (pinned > options_.pin_budget_bytes)
        return RefusedForBudgetLocked(
            key, ResourceExhausted("registering {}: {} bytes exceed the pin budget of {}", name,
                                   size, options_.pin_budget_bytes));
      // Let go of files nothing uses, least recently used first, until this one fits.
      for (auto it = cache_.end();
           it != cache_.begin() && pinned_ + pinned > options_.pin_budget_bytes;) {
        --it;
        if (it->use_count() > 1) continue;
        pinned_ -= (*it)->MappedBytes();
        ++stats_.evictions;
        evicted.push_back(std::move(*it));
        it = cache_.erase(it);
      }
      if (pinned_ + pinned > options_.pin_budget_bytes)
        return RefusedForBudgetLocked(
            key,
            ResourceExhausted("registering {}: {} bytes, and {} of the pin budget of {} are in use",
                              name, size, pinned_, options_.pin_budget_bytes));
    }
    evicted.clear();  // before the new pin, so the budget is never exceeded
    void* mapping = ::mmap(nullptr, pinned, PROT_READ, MAP_SHARED | MAP_POPULATE, fd, 0);
    if (mapping == MAP_FAILED) return ErrnoError(errno, "registering {}: mmap", name);
    if (cudaError_t e = cudaHostRegister(mapping, pinned, cudaHostRegisterReadOnly);
        e != cudaSuccess) {
      ::munmap(mapping, pinned);
      return CudaError(e, fmt::format("registering {} ({} bytes) for DMA", name, size));
    }
    auto file = std::make_shared<RegisteredFile>(key, std::string(name), mapping, size);
    std::lock_guard lock(mu_);
    pinned_ += file->MappedBytes();
    ++stats_.registrations;
    cache_.push_front(file);
    return SourceRef(file);
  }

  Result<DestinationRef> OpenDestination(const IpcHandle& handle, uint64_t size) {
    const auto opening = Clock::now();
    Result<DestinationRef> opened = OpenDestinationUntimed(handle, size);
    std::lock_guard lock(mu_);
    ++stats_.opens;
    stats_.open_ns += NanosSince(opening);
    return opened;
  }

  Result<DestinationRef> OpenDestinationUntimed(const IpcHandle& handle, uint64_t size) {
    if (size == 0) return InvalidArgument("opening a destination of 0 bytes");
    if (cudaError_t e = cudaSetDevice(options_.device); e != cudaSuccess)
      return CudaError(e, "selecting the placement device");
    cudaIpcMemHandle_t ipc{};
    static_assert(sizeof ipc == kIpcHandleBytes);
    std::memcpy(&ipc, handle.data(), sizeof ipc);
    void* device = nullptr;
    if (cudaError_t e = cudaIpcOpenMemHandle(&device, ipc, cudaIpcMemLazyEnablePeerAccess);
        e != cudaSuccess)
      return CudaError(e, "opening a destination's IPC handle");
    auto destination = std::make_shared<Destination>(static_cast<uint8_t*>(device), size);
    // The claimed size is the client's word: hold it to the allocation the handle opened.
    CUdeviceptr base = 0;
    size_t allocated = 0;
    GPULAZY_RETURN_IF_ERROR(AddressRange(reinterpret_cast<CUdeviceptr>(device), base, allocated));
    const uint64_t available = allocated - (reinterpret_cast<CUdeviceptr>(device) - base);
    if (size > available)
      return InvalidArgument("a destination said to hold {} bytes opens {}", size, available);
    return DestinationRef(std::move(destination));
  }

  Status Place(const SourceRef& source, uint64_t offset, uint32_t length,
               std::optional<uint64_t> checksum, const DestinationRef& destination,
               uint64_t destination_offset, PlaceDone done) {
    if (!source || !destination) return InvalidArgument("placing with no source or destination");
    if (length == 0 || length > options_.slot_bytes)
      return InvalidArgument("placing {} bytes (1 to {} at once)", length, options_.slot_bytes);
    if (offset > source->size() || length > source->size() - offset)
      return OutOfRange("placing [{}, +{}) of {}, which holds {} bytes", offset, length,
                        source->name(), source->size());
    if (destination_offset > destination->size() ||
        length > destination->size() - destination_offset)
      return OutOfRange("placing into [{}, +{}) of a destination of {} bytes", destination_offset,
                        length, destination->size());
    const uint8_t* from = source->data() + offset;
    uint8_t* to = destination->device() + destination_offset;
    // The kernel hashes long inputs only; a short chunk is checked here, from the mapping.
    bool verify_on_device = checksum.has_value();
    if (checksum && length < client::cuda::kMinVerifiedBytes) {
      verify_on_device = false;
      if (Checksum64({from, length}) != *checksum) {
        {
          std::lock_guard lock(mu_);
          ++stats_.mismatches;
        }
        if (done) done(Mismatch(*source, offset, length));
        return Status::Ok();
      }
    }
    uint32_t index = 0;
    {
      std::unique_lock lock(mu_);
      if (free_.empty()) {
        const auto waiting = Clock::now();
        slot_freed_.wait(lock, [&] { return !free_.empty(); });
        stats_.slot_wait_ns += NanosSince(waiting);
      }
      index = free_.front();
      free_.pop_front();
      const auto now = Clock::now();
      if (in_flight_++ == 0) active_since_ = now;
      slots_[index].taken = now;
    }
    Slot& slot = slots_[index];
    cudaStream_t stream = streams_[index % streams_.size()];
    cudaError_t e = cudaSetDevice(options_.device);
    if (verify_on_device) {
      verdicts_[index] = client::cuda::kVerdictPending;
      client::cuda::VerifyJob job;
      job.staged = staging_ + stride_ * index;
      job.destination = to;
      job.length = length;
      job.expected = *checksum;
      job.secret = secret_;
      job.block_sums = reinterpret_cast<uint64_t*>(sums_ + sums_stride_ * index);
      job.arrivals = arrivals_ + index;
      job.verdict = mapped_verdicts_ + index;
      if (e == cudaSuccess)
        e = cudaMemcpyAsync(staging_ + stride_ * index, from, length, cudaMemcpyHostToDevice,
                            stream);
      if (e == cudaSuccess) e = client::cuda::LaunchVerifyAndInstall(job, stream);
    } else if (e == cudaSuccess) {
      e = cudaMemcpyAsync(to, from, length, cudaMemcpyHostToDevice, stream);
    }
    if (e == cudaSuccess) e = cudaEventRecord(slot.event, stream);
    if (e != cudaSuccess) {
      ReleaseSlot(index);
      return CudaError(e, fmt::format("placing [{}, +{}) of {}", offset, length, source->name()));
    }
    slot.source = source;
    slot.destination = destination;
    slot.offset = offset;
    slot.length = length;
    slot.verified = verify_on_device;
    slot.checked = checksum.has_value();
    slot.done = std::move(done);
    {
      std::lock_guard lock(mu_);
      order_.push_back(index);
    }
    queued_.notify_one();
    return Status::Ok();
  }

  void Flush() {
    std::unique_lock lock(mu_);
    slot_freed_.wait(lock, [&] { return in_flight_ == 0; });
  }

  Status ReadBack(const DestinationRef& destination, uint64_t offset, std::span<uint8_t> out) {
    if (!destination || offset > destination->size() || out.size() > destination->size() - offset)
      return OutOfRange("reading back [{}, +{}) of a destination", offset, out.size());
    if (cudaError_t e = cudaSetDevice(options_.device); e != cudaSuccess)
      return CudaError(e, "selecting the placement device");
    if (cudaError_t e = cudaMemcpy(out.data(), destination->device() + offset, out.size(),
                                   cudaMemcpyDeviceToHost);
        e != cudaSuccess)
      return CudaError(e, "reading a destination back");
    return Status::Ok();
  }

  PlacerStats stats() const {
    std::lock_guard lock(mu_);
    PlacerStats stats = stats_;
    stats.pinned_bytes = pinned_;
    if (in_flight_ > 0) stats.active_ns += NanosSince(active_since_);
    return stats;
  }

 private:
  using Clock = std::chrono::steady_clock;
  static uint64_t NanosSince(Clock::time_point since) {
    return static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - since).count());
  }

  struct Slot {
    cudaEvent_t event = nullptr;
    Clock::time_point taken;  // under mu_
    SourceRef source;         // kept registered and open until the copy is done
    DestinationRef destination;
    uint64_t offset = 0;
    uint32_t length = 0;
    bool verified = false;  // by the kernel, on the GPU
    bool checked = false;   // against a checksum, on the GPU or (a short chunk) before the copy
    PlaceDone done;
  };

  static Status Mismatch(const RegisteredFile& source, uint64_t offset, uint32_t length) {
    return Corrupt("{} bytes [{}, +{}) do not hash to the image's checksum; not installed",
                   source.name(), offset, length);
  }

  std::optional<SourceRef> FindCachedLocked(const RegisteredFile::Key& key) {
    for (auto it = cache_.begin(); it != cache_.end(); ++it)
      if ((*it)->key() == key) {
        cache_.splice(cache_.begin(), cache_, it);  // most recently used first
        return SourceRef(*cache_.begin());
      }
    return std::nullopt;
  }

  // Every chunk of a refused file asks again, so the refusal is counted each time and logged
  // once per file: a budget too small for the images placed would otherwise only show as a
  // slower restore.
  Status RefusedForBudgetLocked(const RegisteredFile::Key& key, Status refusal) {
    ++stats_.budget_refusals;
    if (budget_warned_.insert(key).second)
      spdlog::warn("{}; its chunks go as bytes (raise --placement-pin-budget to place them)",
                   refusal.message());
    return refusal;
  }

  void ReleaseSlot(uint32_t index) {
    {
      std::lock_guard lock(mu_);
      free_.push_back(index);
      stats_.slot_busy_ns += NanosSince(slots_[index].taken);
      if (--in_flight_ == 0) stats_.active_ns += NanosSince(active_since_);
    }
    slot_freed_.notify_all();
  }

  // Completions in the order they were queued; a later one that finished first waits a little.
  void ReapLoop() {
    // Named for top -H and the cuda bench's per-thread CPU readings (bench/harness.h).
    (void)::pthread_setname_np(::pthread_self(), "gl-placer-reap");
    cudaSetDevice(options_.device);
    for (;;) {
      uint32_t index = 0;
      {
        std::unique_lock lock(mu_);
        queued_.wait(lock, [&] { return stopping_ || !order_.empty(); });
        if (order_.empty()) return;
        index = order_.front();
        order_.pop_front();
      }
      Slot& slot = slots_[index];
      Status result;
      if (cudaError_t e = cudaEventSynchronize(slot.event); e != cudaSuccess) {
        result = CudaError(e, fmt::format("placing [{}, +{}) of {}", slot.offset, slot.length,
                                          slot.source->name()));
      } else if (slot.verified && static_cast<volatile uint32_t*>(verdicts_)[index] !=
                                      client::cuda::kVerdictMatches) {
        result = Mismatch(*slot.source, slot.offset, slot.length);
      }
      {
        std::lock_guard lock(mu_);
        if (result.ok()) {
          ++stats_.placed_chunks;
          stats_.placed_bytes += slot.length;
          if (slot.checked) ++stats_.verified_chunks;
        } else if (result.code() == Code::kCorrupt) {
          ++stats_.mismatches;
        }
      }
      PlaceDone done = std::move(slot.done);
      slot.source.reset();
      slot.destination.reset();
      if (done) {
        const auto calling = Clock::now();
        done(std::move(result));
        const uint64_t spent = NanosSince(calling);
        std::lock_guard lock(mu_);
        stats_.done_ns += spent;
      }
      ReleaseSlot(index);
    }
  }

  const PlacerOptions options_;
  std::vector<cudaStream_t> streams_;
  std::vector<Slot> slots_;
  size_t stride_ = 0;
  size_t sums_stride_ = 0;
  uint8_t* staging_ = nullptr;    // device memory, a slot per stride_
  uint8_t* sums_ = nullptr;       // device memory, the verify kernel's block sums per slot
  uint32_t* arrivals_ = nullptr;  // device memory, one counter per slot
  uint8_t* secret_ = nullptr;     // device memory, XXH3's default secret
  uint32_t* verdicts_ = nullptr;  // pinned, one per slot
  uint32_t* mapped_verdicts_ = nullptr;

  std::mutex register_mu_;
  mutable std::mutex mu_;
  std::condition_variable slot_freed_;
  std::condition_variable queued_;
  std::deque<uint32_t> free_;
  std::deque<uint32_t> order_;  // queued slots, oldest first
  size_t in_flight_ = 0;
  Clock::time_point active_since_;  // when in_flight_ last left 0
  bool stopping_ = false;
  std::list<std::shared_ptr<RegisteredFile>> cache_;  // most recently used first
  std::set<RegisteredFile::Key> budget_warned_;       // files refused for the budget, logged
  uint64_t pinned_ = 0;
  PlacerStats stats_;
  std::thread reaper_;
};

Result<std::unique_ptr<DevicePlacer>> DevicePlacer::Create(const PlacerOptions& options) {
  auto impl = std::make_unique<Impl>(options);
  GPULAZY_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<DevicePlacer>(new DevicePlacer(std::move(impl)));
}

DevicePlacer::DevicePlacer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
DevicePlacer::~DevicePlacer() = default;

Result<SourceRef> DevicePlacer::RegisterFile(int fd, std::string_view name) {
  return impl_->RegisterFile(fd, name);
}
Result<DestinationRef> DevicePlacer::OpenDestination(const IpcHandle& handle, uint64_t size) {
  return impl_->OpenDestination(handle, size);
}
Status DevicePlacer::Place(const SourceRef& source, uint64_t offset, uint32_t length,
                           std::optional<uint64_t> checksum, const DestinationRef& destination,
                           uint64_t destination_offset, PlaceDone done) {
  return impl_->Place(source, offset, length, checksum, destination, destination_offset,
                      std::move(done));
}
void DevicePlacer::Flush() {
  impl_->Flush();
}
Status DevicePlacer::ReadBack(const DestinationRef& destination, uint64_t offset,
                              std::span<uint8_t> out) {
  return impl_->ReadBack(destination, offset, out);
}
PlacerStats DevicePlacer::stats() const {
  return impl_->stats();
}

}  // namespace gpulazy::server::gpu
