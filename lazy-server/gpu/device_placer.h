// lazy-server/gpu/: the page server's side of placing chunks straight into a restoring
// process's device memory (docs/benchmarks.md, "Session 38"). The server is the long-lived
// process on the host, so it can keep an image's page cache registered for DMA across restores,
// which a one-shot restore cannot afford (registering costs more than the copy it saves,
// session 14). A DevicePlacer copies each chunk from that registered page cache into a device
// staging slot of its own, checks it there with the CUDA engine's verify kernel, and only on a
// match installs it into a destination the restoring process exported (CUDA IPC). No CPU copies
// a byte. Only built with GPULAZY_WITH_CUDA; `gpulazy-server --placement cuda` drives it
// (cuda_placement.h).
//
// Trust: the destination handle, its claimed size and every offset come from a client and are
// checked (the claimed size against the allocation the handle opens); the checksum comes from
// the image, so the check catches a page cache or a DMA that does not hold what the image says,
// not a server that lies (the server supplies both in any case).
//
// Thread-safety: every method from any thread. Place blocks while all staging slots are in
// flight (they free themselves as the GPU finishes).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "proto/status.h"

namespace gpulazy::server::gpu {

// A cudaIpcMemHandle_t as bytes, as a client sends it.
inline constexpr size_t kIpcHandleBytes = 64;
using IpcHandle = std::array<uint8_t, kIpcHandleBytes>;

struct PlacerOptions {
  int device = 0;
  // Page cache the placer may keep registered (pinned) at once; 0 registers nothing. Files no
  // placement uses any more are let go, least recently used first, to make room.
  uint64_t pin_budget_bytes = 0;
  uint32_t slot_bytes = 2u << 20;  // the largest chunk it places
  uint32_t slots = 32;
  // Each slot's copy and check run in order on one stream; with 4 streams the probe's checked
  // placement reached 0.62-0.69 of the pinned rate, with 16 0.88-0.95 (session 38).
  uint32_t streams = 16;
  // The completion thread sleeps until the driver signals a copy done (cudaEventBlockingSync)
  // instead of spinning on it: a core's worth of CPU less while placing.
  bool blocking_sync = false;
};

// A file whose page cache is mapped and registered for DMA. Stays registered while a reference
// lives or the placer's cache keeps it.
class RegisteredFile;
using SourceRef = std::shared_ptr<const RegisteredFile>;
// A client's device allocation, opened from its IPC handle; closed with the last reference.
class Destination;
using DestinationRef = std::shared_ptr<const Destination>;

// Runs once per accepted placement, on the placer's thread (or inside Place, for a short chunk
// that fails its check there): Ok once the bytes are installed, kCorrupt if they did not hash to
// the checksum (the destination is untouched), another error if the device failed.
using PlaceDone = std::function<void(Status)>;

struct PlacerStats {
  uint64_t placed_chunks = 0;
  uint64_t placed_bytes = 0;
  // Of placed_chunks, those checked against their checksum before they counted as placed: on the
  // GPU, or a chunk too short for the kernel on the CPU first. The others came with none (a plain
  // checkpoint's chunks the server has not hashed).
  uint64_t verified_chunks = 0;
  uint64_t mismatches = 0;
  uint64_t registrations = 0;  // files registered (a cached one counts once)
  uint64_t evictions = 0;      // registrations let go to make room
  // Registrations refused for the pin budget (the file larger than it, or the budget held by
  // files in use): their chunks go as bytes. Every refusal counts; each file is warned of once.
  uint64_t budget_refusals = 0;
  uint64_t pinned_bytes = 0;  // registered now
  // Where a stream of placements spends its time, to tell a placer that holds the stream back
  // from one that waits for work (docs/server.md, "Placement"). Nanoseconds since Create.
  uint64_t active_ns = 0;     // with at least one placement in flight
  uint64_t slot_busy_ns = 0;  // summed over slots: queued until its `done` returned
  uint64_t slot_wait_ns = 0;  // summed over Place callers: waiting for a free slot
  uint64_t done_ns = 0;       // in the `done` callbacks, on the placer's thread
  uint64_t opens = 0;         // OpenDestination calls (failed ones too)
  uint64_t open_ns = 0;       // the time they took, summed
};

class DevicePlacer {
 public:
  static Result<std::unique_ptr<DevicePlacer>> Create(const PlacerOptions& options);
  // Waits for the placements in flight (their `done` runs) and lets every registration go.
  ~DevicePlacer();
  DevicePlacer(const DevicePlacer&) = delete;
  DevicePlacer& operator=(const DevicePlacer&) = delete;

  // The file open as `fd` (a regular file; `name` for messages), registered whole, or the
  // registration already made for the same file (device, inode, size and modification time).
  Result<SourceRef> RegisterFile(int fd, std::string_view name);
  // Opens a destination a client exported; `size` is what the client says it holds and must
  // not exceed the allocation the handle opens.
  Result<DestinationRef> OpenDestination(const IpcHandle& handle, uint64_t size);

  // Queues [offset, offset + length) of `source` for [destination_offset, + length) of
  // `destination` (a 16-byte-aligned destination_offset installs 16 bytes at a time, any other
  // byte by byte: a BO's chunks start at multiples of the chunk size). With a checksum (XXH3-64 of
  // the bytes) nothing reaches the destination unless the bytes match it; without one they are
  // copied as they are (a plain CRIU checkpoint records none). An error return means nothing was
  // queued and `done` never runs.
  Status Place(const SourceRef& source, uint64_t offset, uint32_t length,
               std::optional<uint64_t> checksum, const DestinationRef& destination,
               uint64_t destination_offset, PlaceDone done);
  // Returns once every accepted placement's `done` has run.
  void Flush();

  // Copies [offset, offset + out.size()) of a destination back to host memory (tests, checks).
  Status ReadBack(const DestinationRef& destination, uint64_t offset, std::span<uint8_t> out);
  PlacerStats stats() const;

 private:
  class Impl;
  explicit DevicePlacer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace gpulazy::server::gpu
