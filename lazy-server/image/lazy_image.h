// gpulazy's lazy image (docs/image-format.md): gpulazy-manifest.img (header + Manifest) and
// gpulazy-chunks.img (header + stored chunks) beside the CRIU files of one checkpoint.
// Chunks are independently decodable; the server sends stored bytes as they are.
// Thread-safety: LazyImage is immutable after Open; its reads use pread and may run concurrently.
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/io.h"
#include "proto/manifest.pb.h"
#include "proto/status.h"

namespace gpulazy::image {

inline constexpr const char* kManifestFileName = "gpulazy-manifest.img";
inline constexpr const char* kChunkFileName = "gpulazy-chunks.img";
inline constexpr uint32_t kDefaultChunkSize = 2u << 20;
inline constexpr uint32_t kMinChunkSize = 4096;
inline constexpr uint32_t kMaxChunkSize = 4u << 20;
inline constexpr uint64_t kMaxManifestBytes = 256ull << 20;

struct ConvertOptions {
  uint32_t chunk_size = kDefaultChunkSize;  // power of two in [kMinChunkSize, kMaxChunkSize]
  bool compress = true;                     // LZ4 a chunk only when that makes it smaller
  bool deduplicate = true;                  // chunks with equal digests share stored bytes
};

struct ConvertStats {
  uint64_t chunks = 0;
  uint64_t raw_chunks = 0;
  uint64_t lz4_chunks = 0;
  uint64_t zero_chunks = 0;
  uint64_t deduplicated_chunks = 0;
  uint64_t raw_bytes = 0;     // sum of the BOs' sizes
  uint64_t stored_bytes = 0;  // bytes in the chunk file past its header
};

// Converts a CRIU checkpoint into a lazy image in the same directory. Writes both files under
// temporary names and renames them (chunk file first), so a crash leaves no half image.
Result<ConvertStats> ConvertToLazyImage(const CriuCheckpoint& checkpoint,
                                        const ConvertOptions& options);

// Adds one manifest Device per (process, GPU with contents) of the checkpoint.
void DescribeDevices(const CriuCheckpoint& checkpoint, manifest::Manifest* manifest);
// Fills a manifest BO entry (everything but its chunk table) from a CRIU content BO.
void DescribeContentBo(const ContentBo& content, manifest::Bo* bo);

// Decodes one chunk's stored bytes into raw (raw.size() must equal chunk.raw_length()) and
// verifies the checksum. Never writes past raw. Errors say what was wrong; `what` names the
// chunk ("image x, BO 3, chunk 7").
Status DecodeChunk(const manifest::Chunk& chunk, std::span<const uint8_t> stored,
                   std::span<uint8_t> raw, std::string_view what);

class LazyImage {
 public:
  static bool Exists(const std::filesystem::path& dir);
  // Reads and validates the manifest: header checksum, version, chunk size, every BO's chunk
  // count and raw lengths against its size, every stored range inside the chunk file.
  static Result<LazyImage> Open(const std::filesystem::path& dir);

  const std::filesystem::path& dir() const { return dir_; }
  const manifest::Manifest& manifest() const { return manifest_; }
  // The chunk's stored bytes (empty for CODEC_ZERO).
  Status ReadStoredChunk(uint32_t bo, uint32_t chunk, std::vector<uint8_t>* out) const;
  // The same into out[0, stored_length) of a caller-owned buffer (not initialized, not written
  // past the stored length); a shorter buffer is kInvalidArgument. Returns the stored length.
  Result<uint32_t> ReadStoredChunkInto(uint32_t bo, uint32_t chunk, std::span<uint8_t> out) const;
  // The chunk's raw bytes, decoded and checksum-verified.
  Status ReadRawChunk(uint32_t bo, uint32_t chunk, std::span<uint8_t> out) const;
  // The open chunk file (its stored bytes start at kFileHeaderSize), for read-ahead hints.
  int chunk_fd() const { return chunk_fd_.get(); }

 private:
  // The manifest entry of (bo, chunk); out of range is kOutOfRange.
  Result<const manifest::Chunk*> FindChunk(uint32_t bo, uint32_t chunk) const;

  std::filesystem::path dir_;
  manifest::Manifest manifest_;
  UniqueFd chunk_fd_;
};

// Rewrites the manifest (e.g. with a new access profile), atomically. Validates it first.
Status WriteManifest(const std::filesystem::path& dir, const manifest::Manifest& manifest);

struct VerifyReport {
  uint64_t chunks_checked = 0;
  uint64_t bytes_checked = 0;
  std::vector<std::string> mismatches;  // one line per bad chunk, naming BO and chunk
  bool ok() const { return mismatches.empty(); }
};
// Decodes every chunk of the lazy image and compares it, by checksum and byte for byte, with
// the CRIU source bytes; also recomputes the checksum of the source bytes.
Result<VerifyReport> VerifyLazyImage(const CriuCheckpoint& checkpoint, const LazyImage& lazy);

}  // namespace gpulazy::image
