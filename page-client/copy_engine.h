// page-client/: the restore client library. RestoreSession (restore_session.h) streams an
// image's chunks from gpulazy-server; a CopyEngine puts the verified bytes into device memory.
//
// CopyEngine: the seam between the session and whatever memory the BOs live in (host memfds,
// AMD SDMA, CUDA). The session hands over only bytes whose checksum it has verified and marks a
// chunk resident only when the engine reports that its write landed.
//
// Thread-safety: AddDestination is called before any Write and never concurrently with one.
// Write and Flush may be called from one thread at a time (the session's I/O thread); `done`
// callbacks may run on any thread, including inside Write.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string_view>

#include "proto/status.h"

namespace gpulazy::client {

// Runs exactly once per accepted write: with Ok once the bytes are in the destination, or with
// the reason they never will be.
using CopyDone = std::function<void(Status)>;

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

  // Returns once every accepted write has completed (its `done` has run); the first failure
  // since the last Flush, if any.
  virtual Status Flush() = 0;
};

}  // namespace gpulazy::client
