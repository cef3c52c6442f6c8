// Installing chunks read straight from image files this process holds: a local image
// (LocalRestore) or the files a page server passed to a session (RestoreSession's by-reference
// mode, docs/protocol.md "Image files"). One chunk is read from the page cache into the engine's
// own buffer when it lends one (the host engine's memory, the CUDA engine's pinned slots), else
// into a buffer of ours, verified, and handed to the engine.
//
// Verification: a chunk with a checksum is checked before the engine may install it, and bytes
// that fail are zeroed in a lent buffer, so nothing unverified lingers. An engine that verifies
// chunks itself (CopyEngine::VerifiesChunks: the CUDA engine, on the GPU) gets a lent buffer's
// raw bytes unhashed with the checksum they must match, and reports a mismatch through `done`
// (kCorrupt) instead. A plain CRIU checkpoint records no checksums: its bytes are installed as
// read, as CRIU itself does.
//
// Thread-safety: InstallFileChunk may run on several threads at once; every engine call it makes
// goes through `gate` (at `urgency`), which the caller shares with its other engine calls.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "page-client/copy_engine.h"
#include "page-client/engine_gate.h"
#include "proto/manifest.pb.h"
#include "proto/status.h"

namespace gpulazy::client {

struct FileChunk {
  uint32_t bo = 0;
  uint32_t chunk = 0;
  uint64_t dest_offset = 0;  // in the BO
  uint32_t raw_length = 0;
  manifest::Codec codec = manifest::CODEC_RAW;
  std::optional<uint64_t> checksum;  // XXH3-64 of the raw bytes; nullopt: nothing recorded
  int fd = -1;                       // the file holding the stored bytes
  uint64_t file_offset = 0;
  uint32_t stored_length = 0;
};

// Buffers of ours for chunks the engine lends no memory for (decoded or not RAW), reused.
class ChunkBufferPool {
 public:
  explicit ChunkBufferPool(size_t max_spare) : max_spare_(max_spare) {}
  std::shared_ptr<std::vector<uint8_t>> Take(size_t length);
  void Return(std::shared_ptr<std::vector<uint8_t>> buffer);

 private:
  const size_t max_spare_;
  std::mutex mu_;
  std::vector<std::shared_ptr<std::vector<uint8_t>>> spare_;
};

// Where the threads that install file chunks spend their time inside InstallFileChunk, summed
// over chunks and threads: reading the stored bytes (verifying and decoding them, and taking a
// buffer of ours when the engine lends none), and engine calls, with their waits at the gate and
// for engine memory (a free CUDA staging slot), and any `done` an engine runs inside the call
// (the host engine's). The rest of those threads' time is outside InstallFileChunk: the caller's
// per-chunk work, waiting for chunks, waiting for a CPU (docs/client.md, Progress::file_read_s).
// gate_wait_ns is the part of engine_ns spent waiting to enter the engine gate: the engine's
// own time is the rest.
struct FileReadTimes {
  std::atomic<uint64_t> read_ns{0};
  std::atomic<uint64_t> engine_ns{0};
  std::atomic<uint64_t> gate_wait_ns{0};

  double read_s() const {
    return static_cast<double>(read_ns.load(std::memory_order_relaxed)) / 1e9;
  }
  double engine_s() const {
    return static_cast<double>(engine_ns.load(std::memory_order_relaxed)) / 1e9;
  }
  double gate_wait_s() const {
    return static_cast<double>(gate_wait_ns.load(std::memory_order_relaxed)) / 1e9;
  }
};

// A zero chunk with nothing stored, which the engine zeroes itself (CopyEngine::WritesZeros):
// InstallFileChunk reads nothing for it and checks its checksum against the zeros.
bool EngineZeroesChunk(const CopyEngine& engine, const FileChunk& c);

// Reads, verifies and hands `c` to the engine; `done` then runs exactly once, as for
// CopyEngine::Write. An error return means the engine never got the chunk (`done` will not
// run) and no unverified byte is left in engine memory: kCorrupt for bytes that failed
// verification (reading again may help), anything else for the file or the engine. `what`
// names the chunk in messages. *bytes_read (when not null) counts what was read from the file.
// `done` may also report kCorrupt, when the engine verified the bytes itself: the caller then
// treats the chunk as it treats a kCorrupt return (missing; read again).
// kUrgent: someone is blocked on this chunk; its engine calls go ahead of background ones.
// `times` (when not null) gets this call's time added.
Status InstallFileChunk(CopyEngine& engine, EngineGate& gate, Urgency urgency, const FileChunk& c,
                        ChunkBufferPool& buffers, std::vector<uint8_t>& scratch,
                        const std::string& what, CopyDone done, uint64_t* bytes_read,
                        FileReadTimes* times = nullptr);

}  // namespace gpulazy::client
