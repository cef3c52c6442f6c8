#include "page-client/cuda/cuda_engine.h"

#include <cuda_runtime.h>
#include <sys/mman.h>
#define XXH_STATIC_LINKING_ONLY  // XXH3_generateSecret_fromSeed
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "page-client/cuda/verify_kernel.h"
#include "page-client/net/threads.h"
#include "proto/xxh3_blocks.h"

namespace gpulazy::client {

namespace {

Status CudaError(cudaError_t error, std::string_view what) {
  return Unavailable("{}: {} ({})", what, cudaGetErrorString(error), cudaGetErrorName(error));
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older C libraries lack the name
#endif

constexpr uint32_t kDefaultSlotBytes = 4u << 20;  // the largest chunk a server sends
// staging_slots = 0: slots per announced writer, and the bounds of the count. Measured on the
// lent H100 (docs/benchmarks.md, session 14): with 16 readers, 16 slots gave 0.58-0.63 of the
// pinned rate, 32 gave 0.76-0.83, 64 gave 0.73-0.81 by reference and 0.81-0.86 local, and 96
// no more.
constexpr uint32_t kSlotsPerWriter = 4;
constexpr uint32_t kMinAutoSlots = 16;
constexpr uint32_t kMaxAutoSlots = 128;
// Slots larger than this get fewer, for the same ring bytes (SlotCount), but never fewer than
// kMinLargeSlots.
constexpr uint32_t kReferenceSlotBytes = 2u << 20;
constexpr uint32_t kMinLargeSlots = 8;
constexpr uint32_t kMaxSlotBytes = 64u << 20;
constexpr size_t kPageBytes = 4096;
constexpr size_t kHugePageBytes = size_t{2} << 20;

// Pinned host memory for the staging ring, made before a lazy restore lets its program run, so
// its cost is resume time. Preferably one anonymous mapping on transparent huge pages that we
// fault in ourselves and register with CUDA once: on the lent H100 host a 64 MiB ring took
// 15-18 ms that way against 47-64 ms as one cudaMallocHost per slot (docs/benchmarks.md,
// session 10): the kernel clears 32 huge pages instead of 16384 small ones, and the driver pins
// one range. Where registering is refused it falls back to one cudaMallocHost.
class StagingMemory {
 public:
  StagingMemory() = default;
  StagingMemory(const StagingMemory&) = delete;
  StagingMemory& operator=(const StagingMemory&) = delete;
  ~StagingMemory() {
    if (registered_) cudaHostUnregister(data_);
    if (mapping_ != nullptr) ::munmap(mapping_, mapping_bytes_);
    if (cuda_allocated_) cudaFreeHost(data_);
  }

  Status Allocate(size_t bytes) {
    if (TryRegisteredHugePages(bytes)) return Status::Ok();
    void* pinned = nullptr;
    if (cudaError_t e = cudaHostAlloc(&pinned, bytes, cudaHostAllocPortable); e != cudaSuccess)
      return CudaError(e, fmt::format("pinning a {}-byte staging ring", bytes));
    data_ = static_cast<uint8_t*>(pinned);
    cuda_allocated_ = true;
    return Status::Ok();
  }
  uint8_t* data() const { return data_; }

 private:
  bool TryRegisteredHugePages(size_t bytes) {
    // One huge page more than asked, to start the ring on a huge-page boundary; the slack is
    // never touched, so it costs address space only.
    const size_t mapped = bytes + kHugePageBytes;
    void* mapping =
        ::mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapping == MAP_FAILED) return false;
    mapping_ = mapping;
    mapping_bytes_ = mapped;
    const auto start = (reinterpret_cast<uintptr_t>(mapping) + kHugePageBytes - 1) &
                       ~uintptr_t{kHugePageBytes - 1};
    data_ = reinterpret_cast<uint8_t*>(start);
    (void)::madvise(data_, bytes, MADV_HUGEPAGE);  // a hint: without THP, small pages
    (void)::madvise(data_, bytes, MADV_DONTFORK);  // pinned for DMA: a fork must not share it
    if (::madvise(data_, bytes, MADV_POPULATE_WRITE) != 0) {
      for (size_t offset = 0; offset < bytes; offset += kPageBytes)  // kernels before 5.14
        static_cast<volatile uint8_t*>(data_)[offset] = 0;
    }
    if (cudaHostRegister(data_, bytes, cudaHostRegisterPortable) == cudaSuccess) {
      registered_ = true;
      return true;
    }
    (void)cudaGetLastError();  // the fallback's calls must not see this failure
    ::munmap(mapping_, mapping_bytes_);
    mapping_ = nullptr;
    data_ = nullptr;
    return false;
  }

  void* mapping_ = nullptr;
  size_t mapping_bytes_ = 0;
  uint8_t* data_ = nullptr;
  bool registered_ = false;
  bool cuda_allocated_ = false;
};

}  // namespace

bool CudaDeviceAvailable() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

class CudaCopyEngine::Impl {
 public:
  struct Slot {
    uint8_t* pinned = nullptr;
    uint8_t* device = nullptr;       // verified copies land here first (verify_on_device)
    uint64_t* block_sums = nullptr;  // the verify kernel's scratch
    cudaEvent_t event = nullptr;
    CopyDone done;
    uint32_t bytes = 0;
    bool verified = false;  // the write runs the verify kernel; its verdict decides
    uint32_t bo = 0;
    uint64_t offset = 0;
  };

  explicit Impl(const CudaEngineOptions& options) : options_(options) {}

  ~Impl() {
    {
      std::unique_lock lock(mu_);
      idle_.wait(lock, [&] { return in_flight_.empty(); });
      stopping_ = true;
    }
    work_.notify_all();
    if (reaper_.joinable()) reaper_.join();
    for (Slot& slot : slots_)
      if (slot.event != nullptr) cudaEventDestroy(slot.event);
    for (cudaStream_t stream : streams_)
      cudaStreamDestroy(stream);
    for (void* buffer : destinations_)
      if (buffer != nullptr) cudaFree(buffer);
    if (secret_ != nullptr) cudaFree(secret_);
    FreeVerifyScratch();
  }

  Status Init() {
    if (options_.streams == 0) return InvalidArgument("CUDA engine needs at least one stream");
    if (options_.slot_bytes > kMaxSlotBytes)
      return InvalidArgument("CUDA engine staging slots of {} bytes (at most {})",
                             options_.slot_bytes, kMaxSlotBytes);
    if (cudaError_t e = cudaSetDevice(options_.device); e != cudaSuccess)
      return CudaError(e, fmt::format("selecting CUDA device {}", options_.device));
    for (uint32_t i = 0; i < options_.streams; ++i) {
      cudaStream_t stream = nullptr;
      if (cudaError_t e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
          e != cudaSuccess)
        return CudaError(e, "creating a copy stream");
      streams_.push_back(stream);
    }
    if (options_.verify_on_device) GPULAZY_RETURN_IF_ERROR(PrepareVerification());
    // A fixed ring now; one sized to the restore's writers waits until they are announced.
    if (options_.slot_bytes != 0 && options_.staging_slots != 0)
      GPULAZY_RETURN_IF_ERROR(MakeRing(options_.slot_bytes));
    reaper_ = std::thread([this] { ReapLoop(); });
    return Status::Ok();
  }

  // XXH3's secret in device memory (from the library: the kernel must hash as it does).
  Status PrepareVerification() {
    uint8_t secret[xxh3::kSecretBytes];
    XXH3_generateSecret_fromSeed(secret, 0);
    if (cudaError_t e = cudaMalloc(&secret_, sizeof secret); e != cudaSuccess)
      return CudaError(e, "allocating the verification secret");
    if (cudaError_t e = cudaMemcpy(secret_, secret, sizeof secret, cudaMemcpyHostToDevice);
        e != cudaSuccess)
      return CudaError(e, "copying the verification secret");
    return Status::Ok();
  }

  // The verify kernel's memory for `slots` slots of `stride` bytes: device staging and block
  // sums per slot, an arrivals counter per slot, and a verdict word per slot that the kernel
  // writes straight into pinned host memory.
  Status AllocateVerifyScratch(size_t slots, size_t stride, size_t sums_stride) {
    if (cudaError_t e = cudaMalloc(&device_staging_, stride * slots); e != cudaSuccess) {
      device_staging_ = nullptr;
      return CudaError(e, fmt::format("allocating {} bytes of device staging", stride * slots));
    }
    if (cudaError_t e = cudaMalloc(&block_sums_, sums_stride * slots); e != cudaSuccess) {
      block_sums_ = nullptr;
      return CudaError(e, "allocating the verify kernel's scratch");
    }
    void* verdicts = nullptr;
    if (cudaError_t e = cudaHostAlloc(&verdicts, sizeof(uint32_t) * slots,
                                      cudaHostAllocMapped | cudaHostAllocPortable);
        e != cudaSuccess)
      return CudaError(e, "allocating verdict words");
    verdicts_ = static_cast<uint32_t*>(verdicts);
    if (cudaError_t e =
            cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped_verdicts_), verdicts_, 0);
        e != cudaSuccess)
      return CudaError(e, "mapping verdict words for the device");
    if (cudaError_t e = cudaMalloc(&arrivals_, sizeof(uint32_t) * slots); e != cudaSuccess) {
      arrivals_ = nullptr;
      return CudaError(e, "allocating the verify kernel's counters");
    }
    if (cudaError_t e = cudaMemset(arrivals_, 0, sizeof(uint32_t) * slots); e != cudaSuccess)
      return CudaError(e, "clearing the verify kernel's counters");
    return Status::Ok();
  }

  // Also what a failed MakeRing left behind, before it is tried again.
  void FreeVerifyScratch() {
    if (device_staging_ != nullptr) cudaFree(device_staging_);
    if (block_sums_ != nullptr) cudaFree(block_sums_);
    if (arrivals_ != nullptr) cudaFree(arrivals_);
    if (verdicts_ != nullptr) cudaFreeHost(verdicts_);
    device_staging_ = nullptr;
    block_sums_ = nullptr;
    arrivals_ = nullptr;
    verdicts_ = nullptr;
    mapped_verdicts_ = nullptr;
  }

  bool VerifiesChunks(uint64_t length) const {
    return options_.verify_on_device && length >= cuda::kMinVerifiedBytes;
  }

  // Slots sized to the image's chunks when the options left the size open. The size comes
  // from the server: sized automatically only up to the largest chunk a server sends, so a
  // server cannot make the client pin more than staging_slots x 4 MiB.
  Status ExpectChunkBytes(uint32_t max_bytes) {
    if (max_bytes == 0 || max_bytes > kMaxSlotBytes)
      return InvalidArgument("chunks of {} bytes (the CUDA engine stages 1 to {} bytes)", max_bytes,
                             kMaxSlotBytes);
    if (slots_.empty() && options_.slot_bytes != 0) {  // fixed slots, count waited for writers
      if (max_bytes > options_.slot_bytes)
        return InvalidArgument(
            "the image's {}-byte chunks do not fit the CUDA engine's {}-byte staging slots",
            max_bytes, options_.slot_bytes);
      return MakeRing(options_.slot_bytes);
    }
    if (slots_.empty()) {
      if (max_bytes > kDefaultSlotBytes)
        return InvalidArgument(
            "chunks of {} bytes are larger than the {} bytes the CUDA engine stages unless "
            "CudaEngineOptions::slot_bytes says so",
            max_bytes, kDefaultSlotBytes);
      return MakeRing(max_bytes);
    }
    if (max_bytes > slot_bytes_)
      return InvalidArgument(
          "the image's {}-byte chunks do not fit the CUDA engine's {}-byte staging slots "
          "(CudaEngineOptions::slot_bytes; 0 sizes them to the image)",
          max_bytes, slot_bytes_);
    return Status::Ok();
  }

  Status AddDestination(uint32_t bo, uint64_t size) {
    // A restore that never said its chunk size gets slots for the largest chunk a server sends.
    if (slots_.empty())
      GPULAZY_RETURN_IF_ERROR(
          MakeRing(options_.slot_bytes != 0 ? options_.slot_bytes : kDefaultSlotBytes));
    GPULAZY_RETURN_IF_ERROR(UseDevice());
    if (bo >= destinations_.size()) {
      destinations_.resize(bo + 1, nullptr);
      sizes_.resize(bo + 1, 0);
    }
    if (destinations_[bo] != nullptr) return InvalidArgument("BO {} already has a destination", bo);
    // Whole 2 MiB pages: a page server opening the buffer's IPC handle (placement) maps one of
    // another size in 6-9 ms a GiB on an H200, one of whole pages in well under a millisecond,
    // and that mapping holds its DMA back meanwhile (docs/benchmarks.md, "Session 41"). Also
    // keeps a zero-length BO an address (cudaMalloc(0) returns none).
    const uint64_t allocated =
        (std::max<uint64_t>(size, 1) + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
    void* buffer = nullptr;
    if (cudaError_t e = cudaMalloc(&buffer, allocated); e != cudaSuccess)
      return CudaError(e, fmt::format("allocating {} bytes of device memory for BO {}", size, bo));
    destinations_[bo] = buffer;
    sizes_[bo] = size;
    return Status::Ok();
  }

  // The calling thread's CUDA device: the restore calls in from threads of its own, and events,
  // streams and allocations must all be on the engine's device.
  Status UseDevice() const {
    if (cudaError_t e = cudaSetDevice(options_.device); e != cudaSuccess)
      return CudaError(e, fmt::format("selecting CUDA device {}", options_.device));
    return Status::Ok();
  }

  // The staging ring: one pinned allocation cut into slots (made once, before any write, and
  // whole or not at all).
  Status MakeRing(uint32_t slot_bytes) {
    GPULAZY_RETURN_IF_ERROR(UseDevice());
    std::vector<Slot> slots(SlotCount(slot_bytes));
    auto destroy_events = [&] {
      for (Slot& made : slots)
        if (made.event != nullptr) cudaEventDestroy(made.event);
    };
    for (Slot& slot : slots) {
      const unsigned flags =
          cudaEventDisableTiming | (options_.blocking_sync ? cudaEventBlockingSync : 0u);
      if (cudaError_t e = cudaEventCreateWithFlags(&slot.event, flags); e != cudaSuccess) {
        destroy_events();
        return CudaError(e, "creating a copy event");
      }
    }
    // The memory last: a failed allocation leaves nothing behind (events destroyed, no mapping).
    const size_t stride = (size_t{slot_bytes} + kPageBytes - 1) / kPageBytes * kPageBytes;
    const size_t sums_stride =
        options_.verify_on_device ? (cuda::BlockSumBytes(slot_bytes) + 255) / 256 * 256 : 0;
    if (options_.verify_on_device) {
      FreeVerifyScratch();
      if (Status allocated = AllocateVerifyScratch(slots.size(), stride, sums_stride);
          !allocated.ok()) {
        destroy_events();
        return allocated;
      }
    }
    if (Status allocated = staging_.Allocate(stride * slots.size()); !allocated.ok()) {
      destroy_events();
      return allocated;
    }
    for (size_t i = 0; i < slots.size(); ++i) {
      slots[i].pinned = staging_.data() + stride * i;
      if (device_staging_ != nullptr) {
        slots[i].device = device_staging_ + stride * i;
        slots[i].block_sums = reinterpret_cast<uint64_t*>(block_sums_ + sums_stride * i);
      }
    }
    slots_ = std::move(slots);
    slot_bytes_ = slot_bytes;
    std::lock_guard lock(mu_);
    for (uint32_t i = 0; i < slots_.size(); ++i)
      free_.push_back(i);
    return Status::Ok();
  }

  // staging_slots, or with 0 four per announced writer within [16, 128], as many bytes as that
  // many 2 MiB slots where slots are larger: the pinned ring is made inside the restore's resume
  // (on an H200 a restore's Start took 50-69 ms with 64 slots of 4 MiB, 25-40 ms with 32;
  // docs/benchmarks.md, "Session 42"), and the bytes in flight, not the slots, are what the
  // copies need.
  uint32_t SlotCount(uint32_t slot_bytes) const {
    if (options_.staging_slots != 0) return options_.staging_slots;
    const uint32_t writers = std::max(1u, writers_.load(std::memory_order_relaxed));
    const uint32_t count = std::clamp(writers * kSlotsPerWriter, kMinAutoSlots, kMaxAutoSlots);
    if (slot_bytes <= kReferenceSlotBytes) return count;
    return std::max<uint32_t>(
        kMinLargeSlots, static_cast<uint32_t>(uint64_t{count} * kReferenceSlotBytes / slot_bytes));
  }

  void ExpectWriters(uint32_t writers) {
    // Only the ring not made yet hears it: the slots of a made ring stay as they are.
    writers_.store(std::min(writers, kMaxAutoSlots), std::memory_order_relaxed);
  }

  uint32_t slot_bytes() const { return slot_bytes_; }
  uint32_t staging_slots() const { return static_cast<uint32_t>(slots_.size()); }

  Status CheckRange(uint32_t bo, uint64_t offset, uint64_t length) const {
    if (bo >= destinations_.size() || destinations_[bo] == nullptr)
      return InvalidArgument("write to BO {}, which has no destination", bo);
    if (offset > sizes_[bo] || length > sizes_[bo] - offset)
      return OutOfRange("write of {} bytes at {} past the end of BO {} ({} bytes)", length, offset,
                        bo, sizes_[bo]);
    return Status::Ok();
  }

  Status Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw, CopyDone done) {
    GPULAZY_RETURN_IF_ERROR(CheckRange(bo, offset, raw.size()));
    if (raw.size() > slot_bytes_)
      return InvalidArgument("write of {} bytes exceeds the {}-byte staging slot", raw.size(),
                             slot_bytes_);
    uint32_t index;
    {
      std::unique_lock lock(mu_);
      WaitForFreeSlot(lock);
      index = free_.front();
      free_.pop_front();
    }
    std::memcpy(slots_[index].pinned, raw.data(), raw.size());
    return Queue(index, bo, offset, raw.size(), std::move(done));
  }

  // A zero chunk: a memset on the GPU, in a slot for its event (it stages nothing), so it
  // completes in order with the copies around it.
  Status WriteZeros(uint32_t bo, uint64_t offset, uint64_t length, CopyDone done) {
    GPULAZY_RETURN_IF_ERROR(CheckRange(bo, offset, length));
    if (length > slot_bytes_)
      return InvalidArgument("zeroing {} bytes exceeds the {}-byte chunks the engine was sized to",
                             length, slot_bytes_);
    uint32_t index;
    {
      std::unique_lock lock(mu_);
      WaitForFreeSlot(lock);
      index = free_.front();
      free_.pop_front();
    }
    return Queue(index, bo, offset, length, std::move(done), std::nullopt, /*zeros=*/true);
  }

  // Queues the DMA of a filled staging slot; on failure the slot is free again. With
  // `checksum`, the bytes go to the slot's device staging first and the verify kernel installs
  // them only if they hash to it. With `zeros`, the range is zeroed instead (nothing staged).
  Status Queue(uint32_t index, uint32_t bo, uint64_t offset, uint64_t length, CopyDone done,
               std::optional<uint64_t> checksum = std::nullopt, bool zeros = false) {
    Slot& slot = slots_[index];
    cudaError_t e = cudaSetDevice(options_.device);  // the caller's thread may be on another
    cudaStream_t stream =
        streams_[next_stream_.fetch_add(1, std::memory_order_relaxed) % streams_.size()];
    auto* target = static_cast<uint8_t*>(destinations_[bo]) + offset;
    if (zeros) {
      if (e == cudaSuccess) e = cudaMemsetAsync(target, 0, length, stream);
    } else if (checksum) {
      verdicts_[index] = cuda::kVerdictPending;
      const cuda::VerifyJob job{.staged = slot.device,
                                .destination = target,
                                .length = length,
                                .expected = *checksum,
                                .secret = secret_,
                                .block_sums = slot.block_sums,
                                .arrivals = arrivals_ + index,
                                .verdict = mapped_verdicts_ + index};
      if (e == cudaSuccess)
        e = cudaMemcpyAsync(slot.device, slot.pinned, length, cudaMemcpyHostToDevice, stream);
      if (e == cudaSuccess) e = cuda::LaunchVerifyAndInstall(job, stream);
    } else if (e == cudaSuccess) {
      e = cudaMemcpyAsync(target, slot.pinned, length, cudaMemcpyHostToDevice, stream);
    }
    if (e == cudaSuccess) e = cudaEventRecord(slot.event, stream);
    if (e != cudaSuccess) {
      std::lock_guard lock(mu_);
      free_.push_back(index);
      freed_.notify_one();
      return CudaError(e,
                       fmt::format("queueing a {} BO {}", zeros ? "memset of" : "copy into", bo));
    }
    slot.done = std::move(done);
    slot.bytes = static_cast<uint32_t>(length);
    slot.verified = checksum.has_value();
    slot.bo = bo;
    slot.offset = offset;
    {
      std::lock_guard lock(mu_);
      // The first copy starts the clock of stats().copy_queue_empty_s; later ones end an empty
      // stretch the reaper began.
      if (in_flight_.empty()) {
        const auto now = Clock::now();
        if (queue_empty_since_) queue_empty_ += now - *queue_empty_since_;
        queue_empty_since_ = now;
      }
      in_flight_.push_back(index);
    }
    work_.notify_one();
    return Status::Ok();
  }

  // Lends a free staging slot for [offset, offset + length) of the BO; blocks while every slot
  // is in flight, as Write does.
  std::optional<std::span<uint8_t>> ReceiveTarget(uint32_t bo, uint64_t offset, uint64_t length) {
    if (!CheckRange(bo, offset, length).ok() || length == 0 || length > slot_bytes_)
      return std::nullopt;  // Write will say why, or take it through its own path
    std::unique_lock lock(mu_);
    // Never the last slot: callers serialize their engine calls (the restore's engine gate) and
    // may call here holding that gate, which a caller with a lent slot needs to commit it. Were
    // every slot lent, the wait below could only end by a commit it blocks. With one slot never
    // lent, some slot is free or in flight, and the reaper frees those without any caller. The
    // caller then goes through Write (its own buffer), which waits the same safe way.
    if (lent_.size() + 1 >= slots_.size()) return std::nullopt;
    WaitForFreeSlot(lock);
    const uint32_t index = free_.front();
    free_.pop_front();
    lent_[{bo, offset}] = index;
    return std::span<uint8_t>(slots_[index].pinned, length);
  }

  Status CommitReceived(uint32_t bo, uint64_t offset, uint64_t length, CopyDone done) {
    std::optional<uint32_t> index = TakeLent(bo, offset);
    if (!index)
      return InvalidArgument("commit of BO {} offset {}, which was never lent a staging slot", bo,
                             offset);
    return Queue(*index, bo, offset, length, std::move(done));
  }

  Status CommitUnverified(uint32_t bo, uint64_t offset, uint64_t length, uint64_t checksum,
                          CopyDone done) {
    if (!VerifiesChunks(length)) {
      ReleaseReceived(bo, offset);
      return Unsupported("the CUDA engine verifies no {}-byte chunks{}", length,
                         options_.verify_on_device ? "" : " (verify_on_device is off)");
    }
    std::optional<uint32_t> index = TakeLent(bo, offset);
    if (!index)
      return InvalidArgument("commit of BO {} offset {}, which was never lent a staging slot", bo,
                             offset);
    return Queue(*index, bo, offset, length, std::move(done), checksum);
  }

  void ReleaseReceived(uint32_t bo, uint64_t offset) {
    std::optional<uint32_t> index = TakeLent(bo, offset);
    if (!index) return;
    {
      std::lock_guard lock(mu_);
      free_.push_back(*index);
    }
    freed_.notify_one();
  }

  Status Flush() {
    std::unique_lock lock(mu_);
    // Also until the last `done` has returned: CopyEngine::Flush promises that, and a session
    // destroyed after Flush must not be touched by a completion still running.
    flush_waiters_.fetch_add(1);
    idle_.wait(lock, [&] { return in_flight_.empty() && completing_.load() == 0; });
    flush_waiters_.fetch_sub(1);
    return std::exchange(first_error_, Status::Ok());
  }

  void* DevicePointer(uint32_t bo) const {
    return bo < destinations_.size() ? destinations_[bo] : nullptr;
  }

  // The device's UUID, asked once: a restore exports every BO (thousands), and
  // cudaGetDeviceProperties fills the whole property table each time.
  const std::optional<std::string>& DeviceUuid() {
    std::call_once(uuid_once_, [this] {
      cudaDeviceProp properties{};
      if (cudaGetDeviceProperties(&properties, options_.device) == cudaSuccess)
        uuid_.emplace(reinterpret_cast<const char*>(properties.uuid.bytes),
                      sizeof properties.uuid.bytes);
      else
        cudaGetLastError();
    });
    return uuid_;
  }

  std::optional<PlacementExport> ExportDestination(uint32_t bo) {
    if (!options_.export_for_placement || bo >= destinations_.size() ||
        destinations_[bo] == nullptr || !UseDevice().ok())
      return std::nullopt;
    const std::optional<std::string>& uuid = DeviceUuid();
    cudaIpcMemHandle_t handle{};
    if (!uuid || cudaIpcGetMemHandle(&handle, destinations_[bo]) != cudaSuccess) {
      cudaGetLastError();  // not sticky, but it would be reported by the next launch's check
      return std::nullopt;
    }
    PlacementExport exported;
    exported.kind = "cuda";
    exported.device = *uuid;
    exported.handle.assign(reinterpret_cast<const char*>(&handle), sizeof handle);
    exported.size = sizes_[bo];
    return exported;
  }

  Status CopyToHost(uint32_t bo, uint64_t offset, std::span<uint8_t> out) const {
    if (bo >= destinations_.size() || destinations_[bo] == nullptr)
      return InvalidArgument("BO {} has no destination", bo);
    if (offset > sizes_[bo] || out.size() > sizes_[bo] - offset)
      return OutOfRange("read of {} bytes at {} past the end of BO {}", out.size(), offset, bo);
    GPULAZY_RETURN_IF_ERROR(UseDevice());
    const auto* source = static_cast<const uint8_t*>(destinations_[bo]) + offset;
    if (cudaError_t e = cudaMemcpy(out.data(), source, out.size(), cudaMemcpyDeviceToHost);
        e != cudaSuccess)
      return CudaError(e, fmt::format("reading back BO {}", bo));
    return Status::Ok();
  }

  uint64_t bytes_written() const {
    std::lock_guard lock(mu_);
    return bytes_written_;
  }
  uint64_t chunks_verified() const {
    std::lock_guard lock(mu_);
    return chunks_verified_;
  }
  CudaEngineStats stats() const {
    std::lock_guard lock(mu_);
    return {.slot_waits = slot_waits_,
            .slot_wait_s = std::chrono::duration<double>(slot_wait_).count(),
            .copy_queue_empty_s = std::chrono::duration<double>(queue_empty_).count()};
  }

 private:
  using Clock = std::chrono::steady_clock;

  // Blocks (lock held on return) until a slot is free; a wait is counted and timed, a free slot
  // found at once costs no clock read.
  void WaitForFreeSlot(std::unique_lock<std::mutex>& lock) {
    if (!free_.empty()) return;
    const auto start = Clock::now();
    freed_.wait(lock, [&] { return !free_.empty(); });
    ++slot_waits_;
    slot_wait_ += Clock::now() - start;
  }

  std::optional<uint32_t> TakeLent(uint32_t bo, uint64_t offset) {
    std::lock_guard lock(mu_);
    auto it = lent_.find({bo, offset});
    if (it == lent_.end()) return std::nullopt;
    const uint32_t index = it->second;
    lent_.erase(it);
    return index;
  }

  // Waits for copies in submission order and completes them. In-order completion is slightly
  // conservative with several streams, but keeps the ring simple and callbacks ordered.
  void ReapLoop() {
    net::NameThisThread("gl-cuda-reap");  // for top -H and the cuda bench's per-thread CPU
    cudaSetDevice(options_.device);
    while (true) {
      uint32_t index;
      {
        std::unique_lock lock(mu_);
        work_.wait(lock, [&] { return stopping_ || !in_flight_.empty(); });
        if (in_flight_.empty()) return;
        index = in_flight_.front();
      }
      Slot& slot = slots_[index];
      cudaError_t e = cudaEventSynchronize(slot.event);
      Status status = e == cudaSuccess ? Status::Ok() : CudaError(e, "waiting for a copy");
      if (status.ok() && slot.verified) status = Verdict(index);
      CopyDone done = std::move(slot.done);
      {
        std::lock_guard lock(mu_);
        in_flight_.pop_front();
        if (in_flight_.empty()) queue_empty_since_ = Clock::now();
        free_.push_back(index);
        completing_.fetch_add(1);
        if (status.ok()) {
          bytes_written_ += slot.bytes;
          if (slot.verified) ++chunks_verified_;
        } else if (first_error_.ok() && status.code() != Code::kCorrupt)
          first_error_ = status;  // a bad copy is the restore's to fetch again, not a failure
      }
      freed_.notify_one();
      if (done) done(status);
      // mu_ is every reader's lock: take it again only when a Flush waits, to close the gap
      // between its check and its wait (seq_cst: it counts itself in before it checks).
      if (completing_.fetch_sub(1) == 1 && flush_waiters_.load() > 0) {
        std::lock_guard lock(mu_);
      }
      idle_.notify_all();
    }
  }

  // What the verify kernel found for the slot's chunk (its stream's event has completed).
  Status Verdict(uint32_t index) const {
    const Slot& slot = slots_[index];
    switch (static_cast<volatile uint32_t*>(verdicts_)[index]) {
      case cuda::kVerdictMatches:
        return Status::Ok();
      case cuda::kVerdictMismatch:
        return Corrupt("BO {} bytes [{}, {}): checksum mismatch on the GPU; not installed", slot.bo,
                       slot.offset, slot.offset + slot.bytes);
      default:
        return Internal("BO {} bytes [{}, {}): the verify kernel left no verdict", slot.bo,
                        slot.offset, slot.offset + slot.bytes);
    }
  }

  CudaEngineOptions options_;
  std::vector<cudaStream_t> streams_;
  StagingMemory staging_;
  std::vector<Slot> slots_;              // empty until MakeRing
  uint8_t* device_staging_ = nullptr;    // verify_on_device: one slot's worth per staging slot
  uint8_t* secret_ = nullptr;            // device memory
  uint8_t* block_sums_ = nullptr;        // device memory, a slot's scratch per slot
  uint32_t* verdicts_ = nullptr;         // pinned, one per slot
  uint32_t* mapped_verdicts_ = nullptr;  // the same, as the device addresses them
  uint32_t* arrivals_ = nullptr;         // device memory, one per slot
  uint32_t slot_bytes_ = 0;
  std::atomic<uint32_t> writers_{1};  // ExpectWriters, for a ring sized to them
  std::vector<void*> destinations_;
  std::once_flag uuid_once_;
  std::optional<std::string> uuid_;  // DeviceUuid
  std::vector<uint64_t> sizes_;
  std::atomic<uint64_t> next_stream_{0};

  mutable std::mutex mu_;
  std::condition_variable freed_;
  std::condition_variable work_;
  std::condition_variable idle_;
  std::deque<uint32_t> free_;
  std::deque<uint32_t> in_flight_;
  std::atomic<uint32_t> completing_{0};     // reaped copies whose `done` is still running
  std::atomic<uint32_t> flush_waiters_{0};  // Flush calls waiting on idle_
  std::map<std::pair<uint32_t, uint64_t>, uint32_t> lent_;  // (BO, offset) -> slot
  bool stopping_ = false;
  Status first_error_;
  uint64_t bytes_written_ = 0;
  uint64_t chunks_verified_ = 0;
  // stats(): callers blocked for a slot, and time with no copy queued or unreaped since the
  // first copy (set while the queue is empty; the reaper sets it when it empties the queue).
  uint64_t slot_waits_ = 0;
  Clock::duration slot_wait_{};
  std::optional<Clock::time_point> queue_empty_since_;
  Clock::duration queue_empty_{};
  std::thread reaper_;
};

Result<std::unique_ptr<CudaCopyEngine>> CudaCopyEngine::Create(const CudaEngineOptions& options) {
  if (!CudaDeviceAvailable()) return Unavailable("no CUDA device is available");
  auto impl = std::make_unique<Impl>(options);
  GPULAZY_RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<CudaCopyEngine>(new CudaCopyEngine(std::move(impl)));
}

CudaCopyEngine::CudaCopyEngine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudaCopyEngine::~CudaCopyEngine() = default;
Status CudaCopyEngine::ExpectChunkBytes(uint32_t max_bytes) {
  return impl_->ExpectChunkBytes(max_bytes);
}
Status CudaCopyEngine::AddDestination(uint32_t bo, uint64_t size) {
  return impl_->AddDestination(bo, size);
}
Status CudaCopyEngine::Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw,
                             CopyDone done) {
  return impl_->Write(bo, offset, raw, std::move(done));
}
std::optional<std::span<uint8_t>> CudaCopyEngine::ReceiveTarget(uint32_t bo, uint64_t offset,
                                                                uint64_t length) {
  return impl_->ReceiveTarget(bo, offset, length);
}
Status CudaCopyEngine::WriteZeros(uint32_t bo, uint64_t offset, uint64_t length, CopyDone done) {
  return impl_->WriteZeros(bo, offset, length, std::move(done));
}

Status CudaCopyEngine::CommitReceived(uint32_t bo, uint64_t offset, uint64_t length,
                                      CopyDone done) {
  return impl_->CommitReceived(bo, offset, length, std::move(done));
}
bool CudaCopyEngine::VerifiesChunks(uint64_t length) const {
  return impl_->VerifiesChunks(length);
}
Status CudaCopyEngine::CommitUnverified(uint32_t bo, uint64_t offset, uint64_t length,
                                        uint64_t checksum, CopyDone done) {
  return impl_->CommitUnverified(bo, offset, length, checksum, std::move(done));
}
void CudaCopyEngine::ReleaseReceived(uint32_t bo, uint64_t offset, uint64_t length) {
  (void)length;
  impl_->ReleaseReceived(bo, offset);
}
Status CudaCopyEngine::Flush() {
  return impl_->Flush();
}
std::optional<CopyEngine::PlacementExport> CudaCopyEngine::ExportDestination(uint32_t bo) {
  return impl_->ExportDestination(bo);
}
void* CudaCopyEngine::DevicePointer(uint32_t bo) const {
  return impl_->DevicePointer(bo);
}
Status CudaCopyEngine::CopyToHost(uint32_t bo, uint64_t offset, std::span<uint8_t> out) const {
  return impl_->CopyToHost(bo, offset, out);
}
uint64_t CudaCopyEngine::bytes_written() const {
  return impl_->bytes_written();
}
uint64_t CudaCopyEngine::chunks_verified_on_device() const {
  return impl_->chunks_verified();
}
CudaEngineStats CudaCopyEngine::stats() const {
  return impl_->stats();
}
uint32_t CudaCopyEngine::slot_bytes() const {
  return impl_->slot_bytes();
}
uint32_t CudaCopyEngine::staging_slots() const {
  return impl_->staging_slots();
}
void CudaCopyEngine::ExpectWriters(uint32_t writers) {
  impl_->ExpectWriters(writers);
}
uint32_t CudaCopyEngine::PreferredWriters() const {
  return DefaultWriters();
}
uint32_t CudaCopyEngine::DefaultWriters() {
  return std::clamp(net::UsableCpus(), kMinDefaultWriters, kMaxDefaultWriters);
}

}  // namespace gpulazy::client
