// ImageSource: what the page server serves, whatever the image's format. A lazy image serves
// its stored chunks as they are; a plain CRIU checkpoint is served as raw chunks cut from its
// pages files, described by a manifest built in memory (codec RAW, stored_offset = offset in
// the BO's pages file, checksum computed when the chunk is read).
// Thread-safety: immutable after Open; ReadChunk may be called from any thread.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lazy-server/image/criu_checkpoint.h"
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
  // For a CRIU checkpoint: built in memory; checksums are 0 until read.
  const manifest::Manifest& manifest() const { return manifest_; }
  uint32_t chunk_size() const { return manifest_.chunk_size(); }
  // Reads one chunk. bo and chunk are untrusted: out of range is kOutOfRange.
  Result<StoredChunk> ReadChunk(uint32_t bo, uint32_t chunk) const;
  // The files chunks are stored in: the lazy image's chunk file, or a CRIU checkpoint's pages
  // files (sorted by name). A chunk's DiskRange::file indexes this list.
  struct StoredFile {
    std::string name;  // inside dir()
    UniqueFd fd;
    uint64_t size = 0;  // when opened
  };
  const std::vector<StoredFile>& files() const { return files_; }
  // Where a chunk's stored bytes sit on disk (read-ahead hints, clients that read them).
  using DiskRange = image::DiskRange;
  Result<DiskRange> LocateChunk(uint32_t bo, uint32_t chunk) const;
  // A chunk's description with in_file set and no bytes read: for a reader that holds files()
  // (the page server's clients on the same host). A plain CRIU checkpoint has no checksum to
  // give (has_checksum false); a lazy image gives its manifest's.
  Result<StoredChunk> LocateStoredChunk(uint32_t bo, uint32_t chunk) const;
  // Opens files()[index] again, read-only and beneath dir(), as a new open file description
  // (nothing done to it reaches ours), and checks it is still the very file we hold: a file
  // replaced since Open is kCorrupt.
  Result<UniqueFd> ReopenFile(uint32_t index) const;

 private:
  // The index in files_ of the file with this name; the manifest names only files we opened.
  Result<const StoredFile*> FileNamed(const std::string& name) const;

  std::filesystem::path dir_;
  manifest::Manifest manifest_;
  std::optional<LazyImage> lazy_;
  std::vector<StoredFile> files_;  // raw serving: the pages files by name
};

}  // namespace gpulazy::image
