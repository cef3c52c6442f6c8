// LocalRestore: restores an image's BO contents straight from an image directory on this host,
// with no page server and no socket in between (docs/client.md, "Local restore"). It is what a
// restore on the machine that holds the checkpoint wants: several reader threads pread chunks
// from the page cache (into the engine's own buffers when it lends them: the host engine's
// memfds, the CUDA engine's pinned staging slots), in the same priority order as the server
// (demand, then the profile's order, then table order), and the engine copies them to the
// device while the next ones are read.
//
// Verification: a converted lazy image carries an XXH3-64 checksum per chunk; every chunk is
// checked against it before the engine may install it (a mismatch is re-read once, then the
// restore fails naming the image, BO and chunk). A plain CRIU checkpoint records no checksums,
// so its bytes are installed as read, exactly as CRIU itself does.
//
// Thread-safety: Start and the destructor from one thread; Ensure, Wait*, IsResident,
// progress, status and Cancel from any thread after Start returned.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <vector>

#include "page-client/copy_engine.h"
#include "page-client/restore_session.h"
#include "proto/status.h"

namespace gpulazy::client {

struct LocalRestoreOptions {
  std::filesystem::path image_dir;  // a lazy image or a CRIU checkpoint directory
  // Reader threads; 0 leaves the count to the engine (WritersFor in copy_engine.h).
  uint32_t readers = 0;
  // Chunk size used to cut a plain CRIU checkpoint (a lazy image has its own).
  uint32_t raw_chunk_size = 2u << 20;
};

class LocalRestore {
 public:
  LocalRestore(LocalRestoreOptions options, CopyEngine& engine);
  // Cancels what is still running and waits for the readers and the engine's writes.
  ~LocalRestore();
  LocalRestore(const LocalRestore&) = delete;
  LocalRestore& operator=(const LocalRestore&) = delete;

  // Opens the image, creates one engine destination per BO and starts the readers. Call once.
  Status Start();

  // Valid after Start succeeded: the image's BOs in table order (the index is the engine's BO).
  const std::vector<BoEntry>& bos() const;
  uint32_t chunk_size() const;
  // The reader threads started (LocalRestoreOptions::readers, resolved).
  uint32_t readers() const;

  // As RestoreSession: blocks until the range is resident, reading its missing chunks first.
  Status Ensure(uint32_t bo, uint64_t offset, uint64_t length,
                std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  Status WaitHotSet(std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  Status WaitComplete(std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  bool IsResident(uint32_t bo, uint64_t offset, uint64_t length) const;
  Progress progress() const;
  Status status() const;
  void Cancel();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gpulazy::client
