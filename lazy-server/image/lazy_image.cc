#include "lazy-server/image/lazy_image.h"

#include <fcntl.h>
#include <lz4.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>
#include <map>
#include <set>
#include <unordered_map>

#include "proto/checksum.h"
#include "proto/chunk_codec.h"
#include "proto/criu_file.h"
#include "proto/file_header.h"

namespace gpulazy::image {
namespace {

// Source bytes are read in blocks this large: few syscalls, bounded memory for any image size.
// A multiple of every legal chunk size, so chunks never straddle two blocks.
constexpr size_t kReadBlockSize = 8u << 20;
static_assert(kReadBlockSize % kMaxChunkSize == 0);
// Stored bytes are gathered into writes of about this size.
constexpr size_t kWriteBufferSize = 8u << 20;
constexpr const char* kCreatedBy = "gpulazy-image";

bool IsValidChunkSize(uint64_t size) {
  return size >= kMinChunkSize && size <= kMaxChunkSize && (size & (size - 1)) == 0;
}

uint64_t ChunkCount(uint64_t size, uint64_t chunk_size) {
  // Not (size + cs - 1) / cs: that overflows for sizes near 2^64.
  return size / chunk_size + (size % chunk_size != 0 ? 1 : 0);
}

uint32_t ChunkRawLength(uint64_t bo_size, uint64_t chunk_size, uint64_t index) {
  uint64_t begin = index * chunk_size;
  return static_cast<uint32_t>(std::min(chunk_size, bo_size - begin));
}

// File names in a manifest are untrusted: only a bare name inside the image directory is
// accepted, never a path that could climb out of it.
bool IsBareFileName(std::string_view name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string_view::npos &&
         name.find('\0') == std::string_view::npos;
}

std::string BoName(const manifest::Bo& bo, size_t index) {
  return fmt::format("BO {} (process {}, bo index {}, gpu {:#x})", index, bo.process_id(),
                     bo.bo_index(), bo.gpu_id());
}

// Checks every claim the manifest makes against itself and against the chunk file's payload
// size. `what` names the manifest in errors.
Status ValidateManifest(const manifest::Manifest& m, uint64_t chunk_payload_bytes,
                        std::string_view what) {
  if (m.format_version() != 1)
    return Unsupported("{}: manifest format version {} (this build reads version 1)", what,
                       m.format_version());
  if (!IsValidChunkSize(m.chunk_size()))
    return Corrupt("{}: chunk size {} is not a power of two in [{}, {}]", what, m.chunk_size(),
                   kMinChunkSize, kMaxChunkSize);
  if (!IsBareFileName(m.chunk_file()))
    return Corrupt("{}: chunk file name '{}' is not a plain file name", what, m.chunk_file());
  if (m.chunk_file_bytes() != chunk_payload_bytes)
    return Corrupt("{}: manifest says {} holds {} bytes but it holds {}", what, m.chunk_file(),
                   m.chunk_file_bytes(), chunk_payload_bytes);
  const uint64_t cs = m.chunk_size();
  for (int b = 0; b < m.bos_size(); ++b) {
    const manifest::Bo& bo = m.bos(b);
    if (!IsBareFileName(bo.source_file()))
      return Corrupt("{}: {}: source file '{}' is not a plain file name", what, BoName(bo, b),
                     bo.source_file());
    if (bo.size() > UINT64_MAX - criu_format::kHeaderSize ||
        bo.source_offset() > UINT64_MAX - criu_format::kHeaderSize - bo.size())
      return Corrupt("{}: {}: source range of {} bytes at {} overflows 64 bits", what,
                     BoName(bo, b), bo.size(), bo.source_offset());
    uint64_t expected = ChunkCount(bo.size(), cs);
    if (static_cast<uint64_t>(bo.chunks_size()) != expected)
      return Corrupt("{}: {}: {} chunks listed but {} bytes in {}-byte chunks needs {}", what,
                     BoName(bo, b), bo.chunks_size(), bo.size(), cs, expected);
    for (int c = 0; c < bo.chunks_size(); ++c) {
      const manifest::Chunk& chunk = bo.chunks(c);
      uint32_t raw = ChunkRawLength(bo.size(), cs, static_cast<uint64_t>(c));
      if (chunk.raw_length() != raw)
        return Corrupt("{}: {} chunk {}: raw length {} but the BO's size gives {}", what,
                       BoName(bo, b), c, chunk.raw_length(), raw);
      if (chunk.digest().size() != 16)
        return Corrupt("{}: {} chunk {}: digest of {} bytes (want 16)", what, BoName(bo, b), c,
                       chunk.digest().size());
      switch (chunk.codec()) {
        case manifest::CODEC_ZERO:
          if (chunk.stored_length() != 0)
            return Corrupt("{}: {} chunk {}: zero chunk with {} stored bytes", what, BoName(bo, b),
                           c, chunk.stored_length());
          continue;  // nothing stored, so no range to check
        case manifest::CODEC_RAW:
          if (chunk.stored_length() != raw)
            return Corrupt("{}: {} chunk {}: raw chunk stores {} bytes, raw length is {}", what,
                           BoName(bo, b), c, chunk.stored_length(), raw);
          break;
        case manifest::CODEC_LZ4:
          if (chunk.stored_length() == 0 ||
              chunk.stored_length() >
                  static_cast<uint32_t>(LZ4_compressBound(static_cast<int>(raw))))
            return Corrupt("{}: {} chunk {}: LZ4 chunk of {} stored bytes cannot hold {} raw bytes",
                           what, BoName(bo, b), c, chunk.stored_length(), raw);
          break;
        default:
          return Corrupt("{}: {} chunk {}: unknown codec {}", what, BoName(bo, b), c,
                         static_cast<int>(chunk.codec()));
      }
      if (chunk.stored_offset() > chunk_payload_bytes ||
          chunk.stored_length() > chunk_payload_bytes - chunk.stored_offset())
        return Corrupt("{}: {} chunk {}: stored range [{}, +{}) passes the end of {} ({} bytes)",
                       what, BoName(bo, b), c, chunk.stored_offset(), chunk.stored_length(),
                       m.chunk_file(), chunk_payload_bytes);
    }
  }
  const manifest::AccessProfile& profile = m.profile();
  for (int i = 0; i < profile.order_size(); ++i) {
    const manifest::ChunkRef& ref = profile.order(i);
    if (ref.bo() >= static_cast<uint32_t>(m.bos_size()) ||
        ref.chunk() >= static_cast<uint32_t>(m.bos(static_cast<int>(ref.bo())).chunks_size()))
      return Corrupt("{}: profile entry {} names BO {} chunk {}, which does not exist", what, i,
                     ref.bo(), ref.chunk());
  }
  if (profile.hot_count() > static_cast<uint32_t>(profile.order_size()))
    return Corrupt("{}: profile hot set of {} chunks is longer than its order of {}", what,
                   profile.hot_count(), profile.order_size());
  return Status::Ok();
}

// Opens a chunk file and checks its header against its size; returns the payload length.
Result<uint64_t> ReadChunkFileHeader(int fd, const std::string& name) {
  GPULAZY_ASSIGN_OR_RETURN(uint64_t size, FileSize(fd, name));
  if (size < kFileHeaderSize)
    return Corrupt("{}: {} bytes is shorter than the {}-byte gpulazy header", name, size,
                   kFileHeaderSize);
  uint8_t bytes[kFileHeaderSize];
  GPULAZY_RETURN_IF_ERROR(ReadExactAt(fd, 0, bytes, name));
  GPULAZY_ASSIGN_OR_RETURN(FileHeader header, DecodeFileHeader(bytes, kChunkFileMagic, name));
  if (header.payload_length != size - kFileHeaderSize)
    return Corrupt("{}: header says {} bytes but the file holds {} after the header", name,
                   header.payload_length, size - kFileHeaderSize);
  return header.payload_length;
}

// A file written under a temporary name in the target's directory and renamed on Commit; an
// uncommitted one is removed, so a failed conversion leaves nothing half-written behind.
class TempFile {
 public:
  static Result<TempFile> Create(const std::filesystem::path& target) {
    std::string tmpl = target.string() + ".tmp.XXXXXX";
    std::vector<char> name(tmpl.begin(), tmpl.end());
    name.push_back('\0');
    int fd = ::mkostemp(name.data(), O_CLOEXEC);
    if (fd < 0) return ErrnoError(errno, "create temporary for {}", target.string());
    TempFile file;
    file.fd_.reset(fd);
    file.target_ = target;
    file.path_ = name.data();
    if (::fchmod(fd, 0644) != 0) return ErrnoError(errno, "chmod {}", file.path_.string());
    return file;
  }
  TempFile() = default;
  TempFile(TempFile&& other) noexcept
      : fd_(std::move(other.fd_)),
        target_(std::move(other.target_)),
        path_(std::exchange(other.path_, {})) {}
  TempFile& operator=(TempFile&&) = delete;
  ~TempFile() {
    fd_.reset();
    if (!path_.empty()) ::unlink(path_.c_str());
  }

  int fd() const { return fd_.get(); }
  const std::filesystem::path& path() const { return path_; }

  Status Commit() {
    if (::fsync(fd_.get()) != 0) return ErrnoError(errno, "fsync {}", path_.string());
    if (::close(fd_.release()) != 0) return ErrnoError(errno, "close {}", path_.string());
    if (::rename(path_.c_str(), target_.c_str()) != 0)
      return ErrnoError(errno, "rename {} to {}", path_.string(), target_.string());
    path_.clear();
    return Status::Ok();
  }

 private:
  UniqueFd fd_;
  std::filesystem::path target_;
  std::filesystem::path path_;
};

// Hands out one BO's bytes chunk by chunk, reading its source file in large blocks.
class BoChunkReader {
 public:
  BoChunkReader(int fd, std::string name, uint64_t file_offset, uint64_t size, uint32_t chunk_size,
                std::vector<uint8_t>* block)
      : fd_(fd),
        name_(std::move(name)),
        file_offset_(file_offset),
        size_(size),
        chunk_size_(chunk_size),
        block_(block) {}

  // The next chunk's bytes; valid until the following call.
  Result<std::span<const uint8_t>> Next() {
    if (block_pos_ == block_len_) {
      uint64_t left = size_ - consumed_;
      block_len_ = static_cast<size_t>(std::min<uint64_t>(left, block_->size()));
      block_pos_ = 0;
      GPULAZY_RETURN_IF_ERROR(ReadExactAt(fd_, file_offset_ + consumed_,
                                          std::span<uint8_t>(block_->data(), block_len_), name_));
      consumed_ += block_len_;
    }
    size_t n = std::min<size_t>(chunk_size_, block_len_ - block_pos_);
    std::span<const uint8_t> chunk(block_->data() + block_pos_, n);
    block_pos_ += n;
    return chunk;
  }

 private:
  int fd_;
  std::string name_;
  uint64_t file_offset_;
  uint64_t size_;
  uint32_t chunk_size_;
  std::vector<uint8_t>* block_;
  uint64_t consumed_ = 0;
  size_t block_pos_ = 0;
  size_t block_len_ = 0;
};

// Appends stored chunk bytes to the chunk file, past its header, in large writes.
class StoredWriter {
 public:
  StoredWriter(int fd, std::filesystem::path path) : fd_(fd), path_(std::move(path)) {
    buffer_.reserve(kWriteBufferSize);
  }
  uint64_t size() const { return flushed_ + buffer_.size(); }
  Status Append(std::span<const uint8_t> bytes) {
    if (buffer_.size() + bytes.size() > kWriteBufferSize) GPULAZY_RETURN_IF_ERROR(Flush());
    buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
    return Status::Ok();
  }
  Status Flush() {
    GPULAZY_RETURN_IF_ERROR(WriteAllAt(fd_, kFileHeaderSize + flushed_, buffer_, path_));
    flushed_ += buffer_.size();
    buffer_.clear();
    return Status::Ok();
  }

 private:
  int fd_;
  std::filesystem::path path_;
  std::vector<uint8_t> buffer_;
  uint64_t flushed_ = 0;
};

struct DedupKey {
  Digest128 digest;
  uint32_t raw_length;
  bool operator==(const DedupKey&) const = default;
};
struct DedupKeyHash {
  size_t operator()(const DedupKey& key) const {
    uint64_t h;
    std::memcpy(&h, key.digest.data(), sizeof h);  // already a strong hash
    return static_cast<size_t>(h ^ key.raw_length);
  }
};
struct StoredRef {
  manifest::Codec codec;
  uint64_t offset;
  uint32_t length;
};

// One fd per source pages file, opened on first use.
Result<int> SourceFd(std::map<std::string, UniqueFd>* fds, const std::filesystem::path& dir,
                     const std::string& name) {
  auto it = fds->find(name);
  if (it == fds->end()) {
    GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenInDir(dir, name));
    it = fds->emplace(name, std::move(fd)).first;
  }
  return it->second.get();
}

Result<std::vector<uint8_t>> EncodeManifest(const manifest::Manifest& m) {
  size_t payload = m.ByteSizeLong();
  if (payload > kMaxManifestBytes)
    return ResourceExhausted("manifest of {} bytes is larger than the {}-byte limit", payload,
                             kMaxManifestBytes);
  std::vector<uint8_t> bytes(kFileHeaderSize + payload);
  if (!m.SerializeToArray(bytes.data() + kFileHeaderSize, static_cast<int>(payload)))
    return Internal("manifest serialization failed");
  FileHeader header;
  header.magic = kManifestMagic;
  header.payload_length = payload;
  header.payload_checksum =
      Checksum64(std::span<const uint8_t>(bytes).subspan(kFileHeaderSize, payload));
  auto head = EncodeFileHeader(header);
  std::memcpy(bytes.data(), head.data(), head.size());
  return bytes;
}

}  // namespace

// --- Conversion ------------------------------------------------------------------------------

Result<ConvertStats> ConvertToLazyImage(const CriuCheckpoint& checkpoint,
                                        const ConvertOptions& options) {
  if (!IsValidChunkSize(options.chunk_size))
    return InvalidArgument("chunk size {} is not a power of two in [{}, {}]", options.chunk_size,
                           kMinChunkSize, kMaxChunkSize);
  const std::filesystem::path& dir = checkpoint.dir();
  const uint32_t cs = options.chunk_size;

  manifest::Manifest m;
  m.set_format_version(1);
  m.set_chunk_size(cs);
  m.set_chunk_file(kChunkFileName);
  m.set_created_unix_s(static_cast<uint64_t>(std::time(nullptr)));
  m.set_created_by(kCreatedBy);
  DescribeDevices(checkpoint, &m);

  GPULAZY_ASSIGN_OR_RETURN(TempFile chunk_file, TempFile::Create(dir / kChunkFileName));
  StoredWriter writer(chunk_file.fd(), chunk_file.path());
  ConvertStats stats;
  std::unordered_map<DedupKey, StoredRef, DedupKeyHash> stored_by_content;
  std::map<std::string, UniqueFd> sources;
  std::vector<uint8_t> block(kReadBlockSize);
  // Room for a compressed chunk only when it is strictly smaller than the raw one: LZ4 gives up
  // (returns 0) when the output does not fit, which is exactly "not worth it".
  std::vector<uint8_t> compressed(kMaxChunkSize);

  for (const ContentBo& content : checkpoint.content_bos()) {
    manifest::Bo* bo = m.add_bos();
    DescribeContentBo(content, bo);
    if (content.size == 0) continue;

    GPULAZY_ASSIGN_OR_RETURN(int fd, SourceFd(&sources, dir, content.pages_file));
    BoChunkReader reader(fd, content.pages_file, criu_format::kHeaderSize + content.pages_offset,
                         content.size, cs, &block);
    const uint64_t count = ChunkCount(content.size, cs);
    for (uint64_t i = 0; i < count; ++i) {
      GPULAZY_ASSIGN_OR_RETURN(std::span<const uint8_t> raw, reader.Next());
      manifest::Chunk* chunk = bo->add_chunks();
      chunk->set_raw_length(static_cast<uint32_t>(raw.size()));
      chunk->set_checksum(Checksum64(raw));
      Digest128 digest = ContentDigest(raw);
      chunk->set_digest(digest.data(), digest.size());
      ++stats.chunks;
      stats.raw_bytes += raw.size();

      if (IsAllZero(raw)) {
        chunk->set_codec(manifest::CODEC_ZERO);
        ++stats.zero_chunks;
        continue;
      }
      DedupKey key{digest, static_cast<uint32_t>(raw.size())};
      if (options.deduplicate) {
        auto found = stored_by_content.find(key);
        if (found != stored_by_content.end()) {
          chunk->set_codec(found->second.codec);
          chunk->set_stored_offset(found->second.offset);
          chunk->set_stored_length(found->second.length);
          ++stats.deduplicated_chunks;
          continue;
        }
      }
      StoredRef ref{manifest::CODEC_RAW, writer.size(), static_cast<uint32_t>(raw.size())};
      std::span<const uint8_t> stored = raw;
      if (options.compress) {
        int n = LZ4_compress_default(
            reinterpret_cast<const char*>(raw.data()), reinterpret_cast<char*>(compressed.data()),
            static_cast<int>(raw.size()), static_cast<int>(raw.size()) - 1);
        if (n > 0) {
          ref.codec = manifest::CODEC_LZ4;
          ref.length = static_cast<uint32_t>(n);
          stored = std::span<const uint8_t>(compressed.data(), static_cast<size_t>(n));
        }
      }
      GPULAZY_RETURN_IF_ERROR(writer.Append(stored));
      if (ref.codec == manifest::CODEC_LZ4)
        ++stats.lz4_chunks;
      else
        ++stats.raw_chunks;
      chunk->set_codec(ref.codec);
      chunk->set_stored_offset(ref.offset);
      chunk->set_stored_length(ref.length);
      if (options.deduplicate) stored_by_content.emplace(key, ref);
    }
  }
  GPULAZY_RETURN_IF_ERROR(writer.Flush());
  stats.stored_bytes = writer.size();
  m.set_chunk_file_bytes(stats.stored_bytes);

  FileHeader header;
  header.magic = kChunkFileMagic;
  header.payload_length = stats.stored_bytes;
  header.payload_checksum = 0;  // per-chunk checksums cover the payload
  auto head = EncodeFileHeader(header);
  GPULAZY_RETURN_IF_ERROR(WriteAllAt(chunk_file.fd(), 0, head, chunk_file.path()));

  // Check our own output the way a reader will before it replaces anything.
  GPULAZY_RETURN_IF_ERROR(ValidateManifest(m, stats.stored_bytes, kManifestFileName));
  GPULAZY_ASSIGN_OR_RETURN(std::vector<uint8_t> manifest_bytes, EncodeManifest(m));

  // An older manifest must not outlive the chunk file it describes: remove it first, so a crash
  // between the two renames leaves a plain CRIU checkpoint rather than a mismatched pair.
  const std::filesystem::path manifest_path = dir / kManifestFileName;
  if (::unlink(manifest_path.c_str()) != 0 && errno != ENOENT)
    return ErrnoError(errno, "remove old {}", manifest_path.string());
  GPULAZY_RETURN_IF_ERROR(chunk_file.Commit());
  GPULAZY_RETURN_IF_ERROR(WriteFileAtomically(manifest_path, manifest_bytes));
  return stats;
}

// --- Decoding --------------------------------------------------------------------------------

void DescribeDevices(const CriuCheckpoint& checkpoint, manifest::Manifest* manifest) {
  for (const KfdProcessImage& process : checkpoint.processes()) {
    for (const auto& [gpu_id, pages] : process.pages_by_gpu) {
      manifest::Device* device = manifest->add_devices();
      device->set_process_id(process.file_id);
      device->set_gpu_id(gpu_id);
      device->set_content_bytes(pages.payload_length);
    }
  }
}

void DescribeContentBo(const ContentBo& content, manifest::Bo* bo) {
  bo->set_process_id(content.process_id);
  bo->set_bo_index(content.bo_index);
  bo->set_gpu_id(content.gpu_id);
  bo->set_gpu_va(content.gpu_va);
  bo->set_size(content.size);
  bo->set_alloc_flags(content.alloc_flags);
  bo->set_source_file(content.pages_file);
  bo->set_source_offset(content.pages_offset);
}

Status DecodeChunk(const manifest::Chunk& chunk, std::span<const uint8_t> stored,
                   std::span<uint8_t> raw, std::string_view what) {
  if (raw.size() != chunk.raw_length())
    return InvalidArgument("{}: output buffer of {} bytes for a chunk of {} raw bytes", what,
                           raw.size(), chunk.raw_length());
  return DecodeChunkBytes(chunk.codec(), chunk.checksum(), stored, raw, what);
}

// --- LazyImage -------------------------------------------------------------------------------

bool LazyImage::Exists(const std::filesystem::path& dir) {
  std::error_code ec;
  return std::filesystem::exists(dir / kManifestFileName, ec);
}

Result<LazyImage> LazyImage::Open(const std::filesystem::path& dir) {
  const std::string name = kManifestFileName;
  GPULAZY_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes,
                           ReadWholeFileInDir(dir, name, kMaxManifestBytes + kFileHeaderSize));
  GPULAZY_ASSIGN_OR_RETURN(FileHeader header, DecodeFileHeader(bytes, kManifestMagic, name));
  const uint64_t payload_size = bytes.size() - kFileHeaderSize;
  if (header.payload_length != payload_size)
    return Corrupt("{}: header says {} bytes but the file holds {} after the header", name,
                   header.payload_length, payload_size);
  std::span<const uint8_t> payload = std::span<const uint8_t>(bytes).subspan(kFileHeaderSize);
  uint64_t sum = Checksum64(payload);
  if (sum != header.payload_checksum)
    return Corrupt("{}: checksum {:016x} of the manifest, header says {:016x}", name, sum,
                   header.payload_checksum);
  LazyImage image;
  image.dir_ = dir;
  if (!image.manifest_.ParseFromArray(payload.data(), static_cast<int>(payload.size())))
    return Corrupt("{}: payload is not a valid manifest message", name);
  if (!IsBareFileName(image.manifest_.chunk_file()))
    return Corrupt("{}: chunk file name '{}' is not a plain file name", name,
                   image.manifest_.chunk_file());
  const std::string chunk_name = image.manifest_.chunk_file();
  GPULAZY_ASSIGN_OR_RETURN(image.chunk_fd_, OpenInDir(dir, chunk_name));
  GPULAZY_ASSIGN_OR_RETURN(uint64_t chunk_payload,
                           ReadChunkFileHeader(image.chunk_fd_.get(), chunk_name));
  GPULAZY_RETURN_IF_ERROR(ValidateManifest(image.manifest_, chunk_payload, name));
  return image;
}

Result<const manifest::Chunk*> LazyImage::FindChunk(uint32_t bo, uint32_t chunk) const {
  if (bo >= static_cast<uint32_t>(manifest_.bos_size()))
    return OutOfRange("{}: BO {} does not exist (image has {})", dir_.string(), bo,
                      manifest_.bos_size());
  const manifest::Bo& b = manifest_.bos(static_cast<int>(bo));
  if (chunk >= static_cast<uint32_t>(b.chunks_size()))
    return OutOfRange("{}: BO {} has no chunk {} (it has {})", dir_.string(), bo, chunk,
                      b.chunks_size());
  return &b.chunks(static_cast<int>(chunk));
}

Result<uint32_t> LazyImage::ReadStoredChunkInto(uint32_t bo, uint32_t chunk,
                                                std::span<uint8_t> out) const {
  GPULAZY_ASSIGN_OR_RETURN(const manifest::Chunk* c, FindChunk(bo, chunk));
  if (c->codec() == manifest::CODEC_ZERO || c->stored_length() == 0) return 0u;
  if (out.size() < c->stored_length())
    return InvalidArgument("{}: BO {} chunk {} has {} stored bytes, the buffer holds {}",
                           dir_.string(), bo, chunk, c->stored_length(), out.size());
  GPULAZY_RETURN_IF_ERROR(ReadExactAt(chunk_fd_.get(), kFileHeaderSize + c->stored_offset(),
                                      out.first(c->stored_length()), manifest_.chunk_file()));
  return c->stored_length();
}

Status LazyImage::ReadStoredChunk(uint32_t bo, uint32_t chunk, std::vector<uint8_t>* out) const {
  GPULAZY_ASSIGN_OR_RETURN(const manifest::Chunk* c, FindChunk(bo, chunk));
  out->resize(c->codec() == manifest::CODEC_ZERO ? 0 : c->stored_length());
  return ReadStoredChunkInto(bo, chunk, *out).status();
}

Status LazyImage::ReadRawChunk(uint32_t bo, uint32_t chunk, std::span<uint8_t> out) const {
  std::vector<uint8_t> stored;
  GPULAZY_RETURN_IF_ERROR(ReadStoredChunk(bo, chunk, &stored));
  const manifest::Bo& b = manifest_.bos(static_cast<int>(bo));
  return DecodeChunk(b.chunks(static_cast<int>(chunk)), stored, out,
                     fmt::format("{}: {} chunk {}", dir_.string(), BoName(b, bo), chunk));
}

Status WriteManifest(const std::filesystem::path& dir, const manifest::Manifest& manifest) {
  if (!IsBareFileName(manifest.chunk_file()))
    return InvalidArgument("manifest chunk file name '{}' is not a plain file name",
                           manifest.chunk_file());
  GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(dir / manifest.chunk_file()));
  GPULAZY_ASSIGN_OR_RETURN(uint64_t chunk_payload,
                           ReadChunkFileHeader(fd.get(), manifest.chunk_file()));
  GPULAZY_RETURN_IF_ERROR(ValidateManifest(manifest, chunk_payload, kManifestFileName));
  GPULAZY_ASSIGN_OR_RETURN(std::vector<uint8_t> bytes, EncodeManifest(manifest));
  return WriteFileAtomically(dir / kManifestFileName, bytes);
}

// --- Verification ----------------------------------------------------------------------------

Result<VerifyReport> VerifyLazyImage(const CriuCheckpoint& checkpoint, const LazyImage& lazy) {
  VerifyReport report;
  const manifest::Manifest& m = lazy.manifest();
  const uint32_t cs = m.chunk_size();

  std::map<std::pair<uint32_t, uint32_t>, const ContentBo*> source_bos;
  for (const ContentBo& bo : checkpoint.content_bos())
    source_bos[{bo.process_id, bo.bo_index}] = &bo;
  std::set<std::pair<uint32_t, uint32_t>> seen;

  std::map<std::string, UniqueFd> sources;
  std::vector<uint8_t> block(kReadBlockSize);
  std::vector<uint8_t> decoded(cs);
  for (int b = 0; b < m.bos_size(); ++b) {
    const manifest::Bo& bo = m.bos(b);
    const std::string name = BoName(bo, b);
    auto found = source_bos.find({bo.process_id(), bo.bo_index()});
    if (found == source_bos.end()) {
      report.mismatches.push_back(
          fmt::format("{}: no such BO with contents in the CRIU checkpoint", name));
      continue;
    }
    seen.insert(found->first);
    const ContentBo& source = *found->second;
    if (source.gpu_id != bo.gpu_id() || source.size != bo.size() ||
        source.pages_file != bo.source_file() || source.pages_offset != bo.source_offset()) {
      report.mismatches.push_back(fmt::format(
          "{}: manifest places it at {}+{} ({} bytes, gpu {:#x}) but the checkpoint has "
          "{}+{} ({} bytes, gpu {:#x})",
          name, bo.source_file(), bo.source_offset(), bo.size(), bo.gpu_id(), source.pages_file,
          source.pages_offset, source.size, source.gpu_id));
      continue;
    }
    if (bo.size() == 0) continue;
    GPULAZY_ASSIGN_OR_RETURN(int fd, SourceFd(&sources, checkpoint.dir(), source.pages_file));
    BoChunkReader reader(fd, source.pages_file, criu_format::kHeaderSize + source.pages_offset,
                         source.size, cs, &block);
    for (int c = 0; c < bo.chunks_size(); ++c) {
      const manifest::Chunk& chunk = bo.chunks(c);
      GPULAZY_ASSIGN_OR_RETURN(std::span<const uint8_t> raw, reader.Next());
      ++report.chunks_checked;
      report.bytes_checked += raw.size();
      uint64_t source_sum = Checksum64(raw);
      if (source_sum != chunk.checksum())
        report.mismatches.push_back(fmt::format(
            "{} chunk {}: source bytes in {} have checksum {:016x}, manifest says {:016x}", name, c,
            source.pages_file, source_sum, chunk.checksum()));
      std::span<uint8_t> out(decoded.data(), chunk.raw_length());
      Status status = lazy.ReadRawChunk(static_cast<uint32_t>(b), static_cast<uint32_t>(c), out);
      if (!status.ok()) {
        report.mismatches.push_back(fmt::format("{} chunk {}: {}", name, c, status.message()));
        continue;
      }
      if (out.size() != raw.size() || std::memcmp(out.data(), raw.data(), raw.size()) != 0) {
        size_t at = 0;
        while (at < raw.size() && at < out.size() && out[at] == raw[at])
          ++at;
        report.mismatches.push_back(
            fmt::format("{} chunk {}: decoded bytes differ from {} at chunk byte {}", name, c,
                        source.pages_file, at));
      }
    }
  }
  for (const auto& [key, bo] : source_bos) {
    if (!seen.contains(key))
      report.mismatches.push_back(
          fmt::format("process {} bo index {} (gpu {:#x}, {} bytes): missing from the manifest",
                      key.first, key.second, bo->gpu_id, bo->size));
  }
  return report;
}

}  // namespace gpulazy::image
