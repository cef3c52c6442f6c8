#include "lazy-server/gpu/cuda_placement.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "lazy-server/gpu/device_placer.h"

namespace gpulazy::server::gpu {
namespace {

class CudaDestination final : public PlacementTarget {
 public:
  CudaDestination(DestinationRef destination, uint64_t size)
      : destination_(std::move(destination)), size_(size) {}
  uint64_t size() const override { return size_; }
  const DestinationRef& destination() const { return destination_; }

 private:
  DestinationRef destination_;
  uint64_t size_;
};

// Opened by the placer, which outlives it: sessions open their destinations on the server's disk
// threads, which stop before the backend goes.
class AcceptedCudaDestination final : public AcceptedTarget {
 public:
  AcceptedCudaDestination(DevicePlacer& placer, const IpcHandle& handle, uint64_t size)
      : placer_(placer), handle_(handle), size_(size) {}
  Result<PlacementTargetRef> Open() override {
    GPULAZY_ASSIGN_OR_RETURN(DestinationRef destination, placer_.OpenDestination(handle_, size_));
    return PlacementTargetRef(std::make_shared<CudaDestination>(std::move(destination), size_));
  }

 private:
  DevicePlacer& placer_;
  IpcHandle handle_;
  uint64_t size_;
};

class CudaPlacement final : public PlacementBackend {
 public:
  CudaPlacement(std::unique_ptr<DevicePlacer> placer, std::string uuid)
      : placer_(std::move(placer)), uuid_(std::move(uuid)) {}

  std::string_view kind() const override { return "cuda"; }
  std::string device() const override { return uuid_; }

  Result<std::unique_ptr<AcceptedTarget>> Accept(std::string_view handle, uint64_t size,
                                                 const PeerIdentity& peer) override {
    (void)peer;  // a CUDA IPC handle opens the exporter's allocation whoever sends it
    if (handle.size() != kIpcHandleBytes)
      return InvalidArgument("a cuda destination is a {}-byte IPC handle, not {} bytes",
                             kIpcHandleBytes, handle.size());
    if (size == 0) return InvalidArgument("a cuda destination of 0 bytes");
    IpcHandle bytes{};
    std::memcpy(bytes.data(), handle.data(), bytes.size());
    // Whether the handle opens, and holds `size` bytes, only opening tells.
    return std::unique_ptr<AcceptedTarget>(
        std::make_unique<AcceptedCudaDestination>(*placer_, bytes, size));
  }

  Status Place(const image::DiskRange& from, std::string_view file_name,
               std::optional<uint64_t> checksum, const PlacementTargetRef& target,
               uint64_t target_offset, PlacementDone done) override {
    const auto* cuda = dynamic_cast<const CudaDestination*>(target.get());
    if (cuda == nullptr) return Internal("a cuda placement into another kind of destination");
    if (from.length > UINT32_MAX) return OutOfRange("a {}-byte chunk", from.length);
    // Registered once per file and then found in the placer's cache (by device, inode, size
    // and modification time).
    GPULAZY_ASSIGN_OR_RETURN(SourceRef source, placer_->RegisterFile(from.fd, file_name));
    return placer_->Place(source, from.offset, static_cast<uint32_t>(from.length), checksum,
                          cuda->destination(), target_offset, std::move(done));
  }

  Status Prepare(int fd, std::string_view file_name) override {
    // The placer's cache keeps the registration once this reference goes (and lets it go, least
    // recently used first, only when the budget needs the room).
    return placer_->RegisterFile(fd, file_name).status();
  }

  void Flush() override { placer_->Flush(); }
  // A file it cannot register (over the pin budget) makes its chunks go as bytes, read then.
  bool SourcesResident() const override { return true; }

  std::vector<std::pair<std::string, uint64_t>> Counters() const override {
    const PlacerStats s = placer_->stats();
    return {{"placed_chunks", s.placed_chunks},
            {"placed_bytes", s.placed_bytes},
            {"verified_chunks", s.verified_chunks},
            {"mismatches", s.mismatches},
            {"registrations", s.registrations},
            {"evictions", s.evictions},
            {"budget_refusals", s.budget_refusals},
            {"pinned_bytes", s.pinned_bytes},
            {"active_ns", s.active_ns},
            {"slot_busy_ns", s.slot_busy_ns},
            {"slot_wait_ns", s.slot_wait_ns},
            {"done_ns", s.done_ns},
            {"opens", s.opens},
            {"open_ns", s.open_ns}};
  }

 private:
  std::unique_ptr<DevicePlacer> placer_;
  std::string uuid_;
};

}  // namespace

Result<std::unique_ptr<PlacementBackend>> CreateCudaPlacement(const PlacementOptions& options) {
  cudaDeviceProp properties{};
  if (cudaError_t e = cudaGetDeviceProperties(&properties, options.device); e != cudaSuccess)
    return Unavailable("placement into GPU {}: {} ({})", options.device, cudaGetErrorString(e),
                       cudaGetErrorName(e));
  PlacerOptions placer_options;
  placer_options.device = options.device;
  placer_options.pin_budget_bytes = options.pin_budget_bytes;
  placer_options.slot_bytes = std::max<uint32_t>(options.largest_chunk, 4096);
  placer_options.blocking_sync = options.blocking_sync;
  GPULAZY_ASSIGN_OR_RETURN(std::unique_ptr<DevicePlacer> placer,
                           DevicePlacer::Create(placer_options));
  std::string uuid(reinterpret_cast<const char*>(properties.uuid.bytes),
                   sizeof properties.uuid.bytes);
  return std::unique_ptr<PlacementBackend>(
      std::make_unique<CudaPlacement>(std::move(placer), std::move(uuid)));
}

}  // namespace gpulazy::server::gpu
