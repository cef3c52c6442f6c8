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

struct StoredChunk {
  manifest::Codec codec = manifest::CODEC_RAW;
  uint32_t raw_length = 0;
  uint64_t checksum = 0;       // XXH3-64 of the raw bytes
  std::vector<uint8_t> bytes;  // stored bytes: raw, one LZ4 block, or empty for CODEC_ZERO
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
  // Where a chunk's stored bytes sit on disk, for read-ahead hints (fd, offset, length).
  struct DiskRange {
    int fd = -1;
    uint64_t offset = 0;
    uint64_t length = 0;
  };
  Result<DiskRange> LocateChunk(uint32_t bo, uint32_t chunk) const;

 private:
  std::filesystem::path dir_;
  manifest::Manifest manifest_;
  std::optional<LazyImage> lazy_;
  std::map<std::string, UniqueFd> pages_fds_;  // CRIU pages files by name (raw serving)
};

}  // namespace gpulazy::image
