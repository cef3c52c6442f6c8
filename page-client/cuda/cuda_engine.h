// CudaCopyEngine: the CopyEngine for NVIDIA GPUs (built with -DGPULAZY_WITH_CUDA=ON). Each BO
// is one cudaMalloc'd buffer. A write copies the verified chunk into a slot of a pinned staging
// ring, queues cudaMemcpyAsync on one of several copy streams and records an event; a reaper
// thread waits for the events in order and runs the writes' done callbacks, so a chunk becomes
// resident only once its DMA has landed. Write blocks only when every staging slot is in
// flight, which bounds pinned memory to slots x slot_bytes whatever the image size. The ring is
// one pinned allocation, made when the slot size is known (Create, or the restore's
// ExpectChunkBytes).
//
// Write can also be avoided: ReceiveTarget lends a staging slot to be filled in place, and with
// verify_on_device the chunk's checksum is checked on the GPU (CommitUnverified), before any of
// its bytes reach the BO.
//
// Thread-safety: AddDestination before any Write; Write, the receive calls and Flush may run on
// several threads at once; done callbacks run on the reaper thread. DevicePointer and
// CopyToHost may be called from any thread once the BO's writes are done.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "page-client/copy_engine.h"
#include "proto/status.h"

namespace gpulazy::client {

struct CudaEngineOptions {
  int device = 0;
  // Pinned staging slots. 0: four per writer the restore announces (CopyEngine::ExpectWriters,
  // which the restores call before they say their chunk size), at least 16 and at most 128;
  // measured, four per reader is where the stream stops gaining (docs/benchmarks.md, session
  // 14). Slots over 2 MiB come fewer, as many bytes as that count of 2 MiB slots (at least 8).
  // The ring is made once: writers announced later do not resize it.
  uint32_t staging_slots = 0;
  // Bytes per staging slot. 0: the image's chunk size, as the restore tells it
  // (ExpectChunkBytes; up to 4 MiB, the largest chunk a server sends: larger chunks need an
  // explicit size), or 4 MiB if it never does. A slot must hold the largest chunk; staging
  // memory is staging_slots x slot_bytes, pinned before the restore's program may run, so
  // smaller slots resume sooner.
  uint32_t slot_bytes = 0;
  // Copy streams. 16: with verify_on_device each chunk's copy and kernel run on one stream, and
  // on the lent H100 hosts 16 streams streamed faster than 8 and 4 (docs/benchmarks.md, session
  // 23); without it 16 and 4 were alike.
  uint32_t streams = 16;
  // Verify received chunks on the GPU (CopyEngine::VerifiesChunks): the restore reads them into
  // a staging slot unhashed, the slot is copied to device staging memory, and a kernel hashes
  // it there (XXH3-64, bit for bit libxxhash's) and copies it into the BO only if it matches.
  // Takes the CPU's hash pass off the stream, whose readers use every CPU; costs a second
  // staging ring in device memory. On by default since session 23: with the readers' commits
  // (and so the kernel launches) outside the restore's engine gate, the checked stream ran
  // 0.02-0.18 of the pinned rate faster than with the readers hashing, on four lent H100 leases
  // (docs/benchmarks.md).
  bool verify_on_device = true;
  // The reaper sleeps until the driver signals a copy's completion (cudaEventBlockingSync)
  // instead of spinning on it, which CUDA does by default with one context per process: the
  // spinning reaper keeps a CPU busy for the whole restore, beside readers that need CPUs.
  bool blocking_sync = false;
  // Offer the BOs' device buffers to a page server on this host that places chunks itself
  // (ExportDestination: CUDA IPC handles, "cuda").
  bool export_for_placement = true;
};

// Which side of the staging ring holds a stream back (docs/benchmarks.md, session 21). Writers
// waiting for a free slot: the DMA is behind them. Hardly any waits: the writers are what holds
// it, and the copy queue standing empty says so more strongly (one copy in flight already counts
// as a queue, so a short empty time alone does not show the DMA at full speed).
struct CudaEngineStats {
  uint64_t slot_waits = 0;  // Write / ReceiveTarget calls that found no free slot
  double slot_wait_s = 0;   // their time blocked, summed over every calling thread
  // Time with no copy queued or waiting to be reaped, from the first copy on; an empty stretch
  // counts once the next copy has been queued (one still open when stats() is read is left
  // out). An estimate of the DMA engine's idle time: a completed copy counts as queued until
  // the reaper takes it, and a stretch ends just after its next copy was issued.
  double copy_queue_empty_s = 0;
};

class CudaCopyEngine : public CopyEngine {
 public:
  // Fails with kUnavailable when there is no CUDA device (or driver).
  static Result<std::unique_ptr<CudaCopyEngine>> Create(const CudaEngineOptions& options);
  ~CudaCopyEngine() override;

  std::string_view name() const override { return "cuda"; }
  Status ExpectChunkBytes(uint32_t max_bytes) override;
  Status AddDestination(uint32_t bo, uint64_t size) override;
  Status Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw, CopyDone done) override;
  // Zero chunks are zeroed on the GPU (cudaMemsetAsync), completing in order with the copies.
  bool WritesZeros() const override { return true; }
  Status WriteZeros(uint32_t bo, uint64_t offset, uint64_t length, CopyDone done) override;
  // Lends pinned staging slots: the bytes are received (or read) straight into a slot and DMA'd
  // from there once verified, with no copy of ours in between.
  std::optional<std::span<uint8_t>> ReceiveTarget(uint32_t bo, uint64_t offset,
                                                  uint64_t length) override;
  Status CommitReceived(uint32_t bo, uint64_t offset, uint64_t length, CopyDone done) override;
  void ReleaseReceived(uint32_t bo, uint64_t offset, uint64_t length) override;
  // With verify_on_device: every chunk XXH3 hashes by its long path (over 240 bytes).
  bool VerifiesChunks(uint64_t length) const override;
  Status CommitUnverified(uint32_t bo, uint64_t offset, uint64_t length, uint64_t checksum,
                          CopyDone done) override;
  // Commits, releases and Write from several threads at once: the staging ring has its own
  // lock, and a verified commit's kernel launch then holds no other writer.
  bool ConcurrentCommits() const override { return true; }
  // Sizes a ring not made yet (staging_slots = 0).
  void ExpectWriters(uint32_t writers) override;
  // DefaultWriters(): a restore that leaves its reader count to the engine gets one per CPU.
  uint32_t PreferredWriters() const override;
  // One writer per CPU this process may run on, within [kMinDefaultWriters, kMaxDefaultWriters];
  // needs no device. On the lent 16-vCPU hosts one reader per vCPU streamed fastest into device
  // memory, four gave about 0.4 of the pinned rate and more than one per vCPU lost 10-25 %
  // (docs/benchmarks.md, sessions 2, 5 and 14).
  static uint32_t DefaultWriters();
  static constexpr uint32_t kMinDefaultWriters = 4;
  static constexpr uint32_t kMaxDefaultWriters = 32;  // 128 staging slots at four a writer
  Status Flush() override;
  // With export_for_placement: the BO's buffer as a CUDA IPC handle, on this engine's GPU.
  std::optional<PlacementExport> ExportDestination(uint32_t bo) override;

  // The BO's device buffer (nullptr for an unknown BO).
  void* DevicePointer(uint32_t bo) const;
  // Copies [offset, offset + out.size()) of the BO back to host memory (for verification).
  Status CopyToHost(uint32_t bo, uint64_t offset, std::span<uint8_t> out) const;
  uint64_t bytes_written() const;
  // Chunks the GPU verified and installed (CommitUnverified).
  uint64_t chunks_verified_on_device() const;
  CudaEngineStats stats() const;
  // Bytes per staging slot; 0 until the ring is made (options, ExpectChunkBytes or the first
  // AddDestination).
  uint32_t slot_bytes() const;
  // Staging slots in the ring; 0 until it is made.
  uint32_t staging_slots() const;

 private:
  class Impl;
  explicit CudaCopyEngine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Whether a CUDA device is usable here (false without a GPU or driver).
bool CudaDeviceAvailable();

}  // namespace gpulazy::client
