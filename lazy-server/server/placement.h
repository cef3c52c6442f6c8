// Placement: the page server writes a session's chunks into the client's memory itself instead
// of sending their bytes (docs/protocol.md, "Placement"). The client hands over one destination
// per BO (PlaceInto); a placed chunk is answered by a ChunkData that says so and carries nothing.
// On a GPU host this takes the restoring process's CPU out of the data path: the server keeps
// the image's page cache registered for DMA and copies each chunk straight into device memory
// (lazy-server/gpu/, "cuda"). The host backend here ("memfd") does the same for host memory
// (the client's memfds, taken from its process with pidfd_getfd): it saves nothing over reading
// by reference, but it is the same protocol with no GPU, so the whole path is tested everywhere,
// and it is how an AMD BO's dmabuf would come to the server.
//
// Trust: handles, sizes and offsets come from a client and are checked; a destination is taken
// only from the peer process the socket's credentials name (never one the client names).
// Thread-safety: every method from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "lazy-server/image/image_source.h"
#include "lazy-server/server/access.h"
#include "proto/status.h"

namespace gpulazy::server {

// A client's destination as a backend opened it; let go with the last reference (a placement
// in flight holds one).
class PlacementTarget {
 public:
  virtual ~PlacementTarget() = default;
  virtual uint64_t size() const = 0;
};
using PlacementTargetRef = std::shared_ptr<const PlacementTarget>;

// A destination taken from the client and checked (PlacementBackend::Accept), not yet ready.
// Opening it is the costly part: a CUDA IPC handle's allocation is mapped into the server's
// context, on an H200 6-9 ms a GiB for an allocation that is not whole 2 MiB pages (under a
// millisecond for one that is; docs/benchmarks.md, "Session 41"), so a session opens its
// destinations one by one while its stream runs, and a chunk waits only for its own BO's.
class AcceptedTarget {
 public:
  virtual ~AcceptedTarget() = default;
  // Once. An error leaves the BO's chunks to go as bytes.
  virtual Result<PlacementTargetRef> Open() = 0;
};

// Runs once per queued placement, on any thread (also inside Place): Ok once the bytes are in
// the destination; kCorrupt when they did not hash to the checksum (nothing was written);
// another error when the copy failed.
using PlacementDone = std::function<void(Status)>;

class PlacementBackend {
 public:
  virtual ~PlacementBackend() = default;
  // PlacementOffer.kind: "memfd" or "cuda".
  virtual std::string_view kind() const = 0;
  // PlacementOffer.device: a GPU's UUID; empty for host memory.
  virtual std::string device() const = 0;
  // Takes the destination `handle` names (the kind's encoding, wire.proto PlacementTarget) from
  // the process of `peer` and checks what can be checked at once; it must hold at least `size`
  // bytes. Cheap: PlaceInto is answered after it, with its refusal as the reason.
  virtual Result<std::unique_ptr<AcceptedTarget>> Accept(std::string_view handle, uint64_t size,
                                                         const PeerIdentity& peer) = 0;
  // Queues the bytes of `from` (a RAW chunk's stored bytes in an image file, `file_name` for
  // messages) for [target_offset, + from.length) of `target`. With a checksum (XXH3-64) nothing
  // reaches the destination unless the bytes match it. An error return: nothing was queued and
  // `done` never runs.
  virtual Status Place(const image::DiskRange& from, std::string_view file_name,
                       std::optional<uint64_t> checksum, const PlacementTargetRef& target,
                       uint64_t target_offset, PlacementDone done) = 0;
  // Makes an image file (open as `fd`, `file_name` for messages) ready before its first chunk is
  // placed: cuda registers its page cache for DMA (within the pin budget, and kept while the
  // budget allows), which the first placement from it would otherwise wait for; memfd has
  // nothing to do. Slow: call it off the network threads.
  virtual Status Prepare(int fd, std::string_view file_name) = 0;
  // Returns once every queued placement's `done` has run.
  virtual void Flush() = 0;
  // Whether Place copies from memory the backend keeps resident (cuda: the registered page
  // cache), so that nothing is read from the file and no read-ahead serves it.
  virtual bool SourcesResident() const { return false; }
  // For StatsReply: what the backend did, by name ("placed_bytes", ...).
  virtual std::vector<std::pair<std::string, uint64_t>> Counters() const = 0;
};

struct PlacementOptions {
  std::string kind;  // "memfd" or "cuda"
  int device = 0;    // cuda: the GPU
  // cuda: page cache the server may keep registered for DMA at once (PlacerOptions).
  uint64_t pin_budget_bytes = 16ull << 30;
  uint32_t largest_chunk = 2u << 20;  // cuda: staging slots this large; larger chunks go as bytes
  bool blocking_sync = false;         // cuda: PlacerOptions::blocking_sync
};

// The backend `options.kind` names. "cuda" only in a build with GPULAZY_WITH_CUDA (kUnsupported
// otherwise) and on a host whose GPU it can use.
Result<std::unique_ptr<PlacementBackend>> CreatePlacement(const PlacementOptions& options);
// The host backend: destinations are memfds of the peer process, taken with pidfd_getfd (the
// server must be allowed to ptrace the client: same user, or CAP_SYS_PTRACE).
std::unique_ptr<PlacementBackend> CreateMemfdPlacement();

}  // namespace gpulazy::server
