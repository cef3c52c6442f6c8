// page-client/: the restore client library. RestoreSession (restore_session.h) streams an
// image's chunks from gpulazy-server; a CopyEngine puts the verified bytes into device memory.
//
// CopyEngine: the seam between the session and whatever memory the BOs live in (host memfds,
// AMD SDMA, CUDA). The session hands over only bytes whose checksum it has verified (or, to an
// engine that verifies chunks itself, bytes with the checksum they must match) and marks a chunk
// resident only when the engine reports that its write landed.
//
// Thread-safety: ExpectChunkBytes and AddDestination are called before any Write and never
// concurrently with one.
// Write and Flush may be called from one thread at a time, not always the same one
// (RestoreSession serializes the engine calls of its stream and demand threads); `done`
// callbacks may run on any thread, including inside Write.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "proto/status.h"

namespace gpulazy::client {

// Runs exactly once per accepted write: with Ok once the bytes are in the destination, or with
// the reason they never will be.
using CopyDone = std::function<void(Status)>;

// Writer threads of a restore that leaves the count to an engine with no preference. Tuned for
// the host engine (docs/benchmarks.md, issue 3).
inline constexpr uint32_t kDefaultWriters = 4;

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;

  // "host", "sdma", "cuda": for logs and summaries.
  virtual std::string_view name() const = 0;

  // Creates (or binds) the destination of BO `bo` (the index in the session's BO table),
  // `size` bytes long. Called once per BO before its first write.
  virtual Status AddDestination(uint32_t bo, uint64_t size) = 0;

  // Copies `raw` to [offset, offset + raw.size()) of BO `bo`. May return before the copy is
  // done (a DMA engine queues it). Ownership: the caller keeps `raw` alive and unmodified until
  // `done` has run. If Write returns an error (bad BO, out of bounds, engine dead) it did not
  // keep `raw` and `done` is never called; otherwise `done` is called exactly once.
  virtual Status Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw,
                       CopyDone done) = 0;

  // Optional: receive straight into the destination. An engine whose destination memory is
  // ordinary CPU-writable memory that nothing can observe (or execute from) for a chunk that is
  // not resident yet may return the writable span of [offset, offset + length) of BO `bo`.
  // The session then reads a RAW chunk's payload from the socket into that span, verifies the
  // checksum there, and only if it matches calls CommitReceived (which completes like Write);
  // an engine that VerifiesChunks gets the span unhashed, through CommitUnverified.
  // On a mismatch or a broken connection the session zeroes the span and the chunk stays
  // missing, so corrupt bytes are never marked resident and do not linger (ReleaseReceived).
  // A DMA engine may instead lend a staging buffer of its own for the range (the CUDA engine's
  // pinned slots): CommitReceived then queues the DMA from it. An engine that can promise
  // neither (memory mapped into a running program without a residency gate) keeps the
  // default: nullopt, and every chunk goes through Write. Called only on the restore's I/O or
  // reader threads, for disjoint ranges (a chunk is claimed before it is received); it may
  // block until a buffer is free, as Write may, but only on a buffer that frees itself (a copy
  // in flight): the caller may hold the lock its peers need to commit what they were lent, so
  // an engine that lends buffers keeps one it never lends and returns nullopt rather than wait
  // for a commit.
  virtual std::optional<std::span<uint8_t>> ReceiveTarget(uint32_t bo, uint64_t offset,
                                                          uint64_t length) {
    (void)bo, (void)offset, (void)length;
    return std::nullopt;
  }
  // The bytes of a ReceiveTarget span are verified and in place: complete the "write" (done is
  // called exactly once, as for Write). Only called after ReceiveTarget returned a span. Whether
  // it succeeds or fails, the span is the engine's again.
  // NOLINTNEXTLINE(performance-unnecessary-value-param): overrides take ownership of `done`.
  virtual Status CommitReceived(uint32_t bo, uint64_t offset, uint64_t length, CopyDone done) {
    (void)bo, (void)offset, (void)length, (void)done;
    return Unsupported("{} engine: CommitReceived without ReceiveTarget", name());
  }

  // Optional: whether the engine checks a received chunk of `length` bytes against its XXH3-64
  // itself, after the copy and before any of its bytes reach the destination (the CUDA engine
  // does it on the GPU, which frees the CPU pass that otherwise bounds a verified stream). The
  // caller then fills a ReceiveTarget span without hashing it and commits it with
  // CommitUnverified. Any thread, any time.
  virtual bool VerifiesChunks(uint64_t length) const {
    (void)length;
    return false;
  }
  // CommitReceived for bytes nobody has verified yet: the engine checks them against
  // `checksum` (Checksum64) first. `done` runs exactly once: Ok once the verified bytes are in
  // the destination, kCorrupt if they did not match (the destination is untouched and the
  // chunk may be fetched again), another error if the copy failed. A kCorrupt completion is
  // not an engine failure: Flush does not report it. (Overrides take ownership of `done`.)
  virtual Status CommitUnverified(uint32_t bo, uint64_t offset, uint64_t length, uint64_t checksum,
                                  CopyDone done) {  // NOLINT(performance-unnecessary-value-param)
    (void)bo, (void)offset, (void)length, (void)checksum, (void)done;
    return Unsupported("{} engine does not verify chunks", name());
  }

  // Optional: zeroes [offset, offset + length) of BO `bo` without being handed the bytes (a
  // CODEC_ZERO chunk, whose checksum the caller has checked against the zero bytes' checksum).
  // A DMA engine fills device memory on the device instead of copying zeros across the bus
  // (the CUDA engine: cudaMemsetAsync). Completes like Write: `done` exactly once unless it
  // returns an error. Called only when WritesZeros(); the same callers and threads as Write.
  virtual bool WritesZeros() const { return false; }
  // NOLINTNEXTLINE(performance-unnecessary-value-param): overrides take ownership of `done`.
  virtual Status WriteZeros(uint32_t bo, uint64_t offset, uint64_t length, CopyDone done) {
    (void)bo, (void)offset, (void)length, (void)done;
    return Unsupported("{} engine does not fill zeros", name());
  }

  // A ReceiveTarget span that will not be committed (its bytes failed verification, or the
  // connection broke mid-receive): the engine may reuse it. The caller has zeroed it.
  virtual void ReleaseReceived(uint32_t bo, uint64_t offset, uint64_t length) {
    (void)bo, (void)offset, (void)length;
  }

  // Called before the first AddDestination with the largest write the restore will make (the
  // image's chunk size; RestoreSession and LocalRestore call it once, a caller that prepared
  // the engine may have called it before). An engine that stages writes can size its buffers
  // to the first call instead of to the largest chunk any image may have, and answers later
  // calls with whether the size fits. An error fails the restore's start (an engine whose
  // buffers are smaller than the image's chunks says so here, not on every write).
  virtual Status ExpectChunkBytes(uint32_t max_bytes) {
    (void)max_bytes;
    return Status::Ok();
  }

  // Optional: BO `bo`'s destination as something the page server on this host can write itself
  // (docs/protocol.md, "Placement"): `kind` as a PlacementOffer names it ("memfd", "cuda"), the
  // `device` it lives on (a GPU's UUID; empty for host memory), the `handle` that names it to the
  // server and the bytes it holds. The session then lets the server place chunks there and marks
  // them resident when told; the engine sees no call for them. An engine must offer this only
  // for memory nothing reads before the session reports it resident. Default: nullopt (every
  // chunk comes through Write or a receive). Called after AddDestination, before any write.
  struct PlacementExport {
    std::string kind;
    std::string device;
    std::string handle;
    uint64_t size = 0;
  };
  virtual std::optional<PlacementExport> ExportDestination(uint32_t bo) {
    (void)bo;
    return std::nullopt;
  }

  // A hint from a thread about to wait for [offset, offset + length) of BO `bo` (an Ensure whose
  // chunks the server has been asked for): it has nothing else to do until they arrive, so an
  // engine may ready their destination meanwhile. The host engine faults in the pages that do
  // not exist yet, last first, while the request makes its round trip; the receive then copies
  // into existing pages from the front. Must never change a byte that is there: it runs
  // concurrently with writes to the same range. An engine whose destination a running program
  // already maps keeps the default (nothing): for the userfaultfd engine a page made present
  // would never fault, and the program would read its zeros. Any thread; best effort.
  virtual void PrepareDestination(uint32_t bo, uint64_t offset, uint64_t length) {
    (void)bo;
    (void)offset;
    (void)length;
  }

  // A hint: the restore writes with `writers` threads at once (file readers, local readers).
  // The restores say it before ExpectChunkBytes when they plan several, so an engine that stages
  // writes can size its buffers to them (the CUDA engine: four slots a writer), again when a
  // connection starts them, and 1 when a server refuses the files they would read (the socket
  // then brings every chunk). An engine may put away helpers that only pay off for a single
  // writer while there are several.
  // Any thread, any time, also while writes are in flight.
  virtual void ExpectWriters(uint32_t writers) { (void)writers; }

  // How many threads the engine would write with, were the count left to it (a restore's
  // readers = 0, the default): 0 for no preference, which gives kDefaultWriters. An engine whose
  // throughput needs more writers than that says so here (the CUDA engine: one per CPU).
  virtual uint32_t PreferredWriters() const { return 0; }

  // Whether the engine takes calls from several threads at once, for disjoint ranges (each
  // chunk is claimed before it is written, so a restore never writes one range twice). The
  // restores then call it without serializing (EngineGate), and an urgent chunk never waits
  // for a background write in progress. The default is the one-caller-at-a-time contract.
  virtual bool ConcurrentCalls() const { return false; }

  // Whether the calls that hand the engine a filled buffer or give one back (CommitReceived,
  // CommitUnverified, ReleaseReceived, Write) may run on several threads at once, for disjoint
  // ranges, while ReceiveTarget keeps the one-caller-at-a-time contract. The file readers then
  // take lent buffers one at a time, in order, under the gate, and commit outside it: a commit
  // that is slow (a kernel launch) no longer holds every other reader (docs/benchmarks.md,
  // session 23). Implied by ConcurrentCalls.
  virtual bool ConcurrentCommits() const { return ConcurrentCalls(); }

  // Returns once every accepted write has completed (its `done` has run); the first failure
  // since the last Flush, if any. An engine that holds writes (waiting for a destination to be
  // bound, say) must complete or refuse them before the session that issued them is destroyed:
  // `done` callbacks own session state, and one destroyed later would touch freed memory.
  virtual Status Flush() = 0;
};

// The writer threads a restore starts: `asked`, or with 0 the engine's preference, else
// kDefaultWriters.
inline uint32_t WritersFor(uint32_t asked, const CopyEngine& engine) {
  if (asked != 0) return asked;
  const uint32_t preferred = engine.PreferredWriters();
  return preferred != 0 ? preferred : kDefaultWriters;
}

}  // namespace gpulazy::client
