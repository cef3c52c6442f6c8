// ImageSource: what the page server serves, whatever the image's format. A lazy image serves
// its stored chunks as they are; a plain CRIU checkpoint is served as raw chunks cut from its
// pages files, described by a manifest built in memory (codec RAW, stored_offset = offset in
// the BO's pages file, checksum computed when the chunk is first read, then cached).
//
// Reading: ReadChunkInto reads into a buffer the caller owns and reuses (the server's pool of
// chunk buffers), so a read costs the copy from the page cache and nothing else: no zero-fill,
// no fresh pages to fault in. ReadChunk is the convenience form returning a new vector.
//
// Images are treated as immutable while opened: a CRIU checkpoint's checksums are cached per
// opened ImageSource, so rewriting its pages files under an open ImageSource would serve stale
// checksums (the client then refuses those chunks). Whoever caches ImageSources must reopen on
// change (the server's ImageStore does, by a stamp of the image's files).
//
// Thread-safety: immutable after Open apart from the checksum cache, which is lock-free (one
// atomic slot per chunk); every const method may be called from any thread concurrently.
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/io.h"
#include "lazy-server/image/lazy_image.h"
#include "proto/manifest.pb.h"
#include "proto/status.h"

namespace gpulazy::image {

// Where a chunk's stored bytes sit on disk.
struct DiskRange {
  int fd = -1;
  uint32_t file = 0;  // index into ImageSource::files()
  uint64_t offset = 0;
  uint64_t length = 0;
};

// What a read says about a chunk besides its stored bytes.
struct ChunkInfo {
  manifest::Codec codec = manifest::CODEC_RAW;
  uint32_t raw_length = 0;
  uint32_t stored_length = 0;  // stored bytes (0 for CODEC_ZERO)
  uint64_t checksum = 0;       // XXH3-64 of the raw bytes
};

struct StoredChunk {
  manifest::Codec codec = manifest::CODEC_RAW;
  uint32_t raw_length = 0;
  uint64_t checksum = 0;       // XXH3-64 of the raw bytes, when has_checksum
  bool has_checksum = true;    // false only for a located chunk of a plain CRIU checkpoint
  std::vector<uint8_t> bytes;  // stored bytes: raw, one LZ4 block, or empty for CODEC_ZERO
  // Set by LocateStoredChunk instead of bytes: the reader reads them from there itself.
  std::optional<DiskRange> in_file;
};

class ImageSource {
 public:
  // Opens dir as a lazy image when it has a manifest, else as a CRIU checkpoint.
  static Result<std::shared_ptr<const ImageSource>> Open(
      const std::filesystem::path& dir, uint32_t raw_chunk_size = kDefaultChunkSize);

  bool is_lazy() const { return lazy_.has_value(); }
  const std::filesystem::path& dir() const { return dir_; }
  // For a CRIU checkpoint: built in memory; its checksums stay 0 (ReadChunkInto reports them).
  const manifest::Manifest& manifest() const { return manifest_; }
  uint32_t chunk_size() const { return manifest_.chunk_size(); }

  // bo and chunk are untrusted in every method below: out of range is kOutOfRange.
  // How many stored bytes the chunk has: the buffer ReadChunkInto needs.
  Result<uint32_t> StoredLength(uint32_t bo, uint32_t chunk) const;
  // Reads the chunk's stored bytes into buffer[0, stored_length). Nothing past stored_length is
  // written and the buffer need not be initialized. A buffer shorter than the stored bytes is
  // kInvalidArgument. For a CRIU checkpoint the checksum is computed on the first read of the
  // chunk and cached for every later read (by any thread).
  Result<ChunkInfo> ReadChunkInto(uint32_t bo, uint32_t chunk, std::span<uint8_t> buffer) const;
  // ReadChunkInto a new vector of exactly the stored length.
  Result<StoredChunk> ReadChunk(uint32_t bo, uint32_t chunk) const;
  // How many chunk checksums this source has computed (CRIU checkpoints; 0 for lazy images,
  // whose checksums are recorded). For stats and tests of the cache.
  uint64_t checksums_computed() const {
    return checksums_computed_.load(std::memory_order_relaxed);
  }
  // The files chunks are stored in: the lazy image's chunk file, or a CRIU checkpoint's pages
  // files (sorted by name). A chunk's DiskRange::file indexes this list.
  struct StoredFile {
    std::string name;  // inside dir()
    UniqueFd fd;
    uint64_t size = 0;           // when opened
    PageCacheProbe cache_probe;  // of [0, size); probes nothing if the file could not be mapped
  };
  const std::vector<StoredFile>& files() const { return files_; }
  // Where a chunk's stored bytes sit on disk (read-ahead hints, clients that read them).
  using DiskRange = image::DiskRange;
  Result<DiskRange> LocateChunk(uint32_t bo, uint32_t chunk) const;
  // Every byte of `range` (from LocateChunk) is in the page cache right now: sending it straight
  // from the file will not wait for the disk. False when unknown (PageCacheProbe).
  bool InPageCache(const DiskRange& range) const;
  // A chunk's description with in_file set and no bytes read: for a reader that holds files()
  // (the page server's clients on the same host). A lazy image gives its manifest's checksum; a
  // CRIU checkpoint gives the cached one when a read has computed it, else none (has_checksum
  // false: hashing here would read the bytes the reference is meant to spare).
  Result<StoredChunk> LocateStoredChunk(uint32_t bo, uint32_t chunk) const;
  // Opens files()[index] again, read-only and beneath dir(), as a new open file description
  // (nothing done to it reaches ours), and checks it is still the very file we hold: a file
  // replaced since Open is kCorrupt.
  Result<UniqueFd> ReopenFile(uint32_t index) const;

 private:
  void MapCacheProbes();
  // The index in files_ of the file with this name; the manifest names only files we opened.
  Result<const StoredFile*> FileNamed(const std::string& name) const;

  std::filesystem::path dir_;
  manifest::Manifest manifest_;
  std::optional<LazyImage> lazy_;
  std::vector<StoredFile> files_;  // raw serving: the pages files by name

  // Checksum cache of a CRIU checkpoint, one slot per chunk (flat index). `known` is separate
  // because 0 is a valid XXH3 value. value is stored before known is released, so a reader that
  // acquires known == true sees the value; two threads hashing the same chunk at once store the
  // same value, which is harmless.
  struct ChecksumSlot {
    std::atomic<uint64_t> value{0};
    std::atomic<bool> known{false};
  };
  std::vector<uint64_t> first_flat_;           // flat index of each BO's chunk 0
  std::unique_ptr<ChecksumSlot[]> checksums_;  // empty for lazy images
  mutable std::atomic<uint64_t> checksums_computed_{0};
};

}  // namespace gpulazy::image
