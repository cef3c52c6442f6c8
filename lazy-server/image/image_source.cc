#include "lazy-server/image/image_source.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <cerrno>
#include <utility>

#include "proto/checksum.h"
#include "proto/criu_file.h"
#include "proto/file_header.h"

namespace gpulazy::image {

Result<std::shared_ptr<const ImageSource>> ImageSource::Open(const std::filesystem::path& dir,
                                                             uint32_t raw_chunk_size) {
  auto source = std::make_shared<ImageSource>();
  source->dir_ = dir;
  if (LazyImage::Exists(dir)) {
    GPULAZY_ASSIGN_OR_RETURN(LazyImage lazy, LazyImage::Open(dir));
    source->manifest_ = lazy.manifest();
    // files() holds a duplicate of the descriptor the lazy image reads from: the same file, so
    // ReopenFile checks a client's copy against exactly what we serve.
    const std::string chunk_file = source->manifest_.chunk_file();
    UniqueFd fd(::fcntl(lazy.chunk_fd(), F_DUPFD_CLOEXEC, 0));
    if (!fd.valid()) return ErrnoError(errno, "{}: dup of {}", dir.string(), chunk_file);
    GPULAZY_ASSIGN_OR_RETURN(uint64_t size, FileSize(fd.get(), dir / chunk_file));
    source->files_.push_back(StoredFile{chunk_file, std::move(fd), size, PageCacheProbe{}});
    source->MapCacheProbes();
    source->lazy_.emplace(std::move(lazy));
    return std::shared_ptr<const ImageSource>(std::move(source));
  }

  if (raw_chunk_size < kMinChunkSize || raw_chunk_size > kMaxChunkSize ||
      (raw_chunk_size & (raw_chunk_size - 1)) != 0)
    return InvalidArgument("chunk size {} is not a power of two in [{}, {}]", raw_chunk_size,
                           kMinChunkSize, kMaxChunkSize);
  GPULAZY_ASSIGN_OR_RETURN(CriuCheckpoint checkpoint, CriuCheckpoint::Open(dir));
  // Describe the checkpoint as raw chunks cut straight from the pages files, so the server has
  // one code path for both formats. stored_offset is the absolute file offset (past CRIU's
  // 8-byte header); checksums are computed by ReadChunkInto (and cached), since nothing recorded
  // them.
  manifest::Manifest& m = source->manifest_;
  m.set_format_version(1);
  m.set_chunk_size(raw_chunk_size);
  DescribeDevices(checkpoint, &m);
  std::map<std::string, UniqueFd> pages_fds;  // sorted by name: files() order is stable
  for (const KfdProcessImage& process : checkpoint.processes()) {
    for (const auto& [gpu_id, pages] : process.pages_by_gpu) {
      // A GPU whose content BOs are all empty may have no pages file; there is nothing to read.
      if (pages.payload_length == 0) continue;
      GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenInDir(dir, pages.name));
      pages_fds.emplace(pages.name, std::move(fd));
    }
  }
  for (auto& [name, fd] : pages_fds) {
    GPULAZY_ASSIGN_OR_RETURN(uint64_t size, FileSize(fd.get(), dir / name));
    source->files_.push_back(StoredFile{name, std::move(fd), size, PageCacheProbe{}});
  }
  source->MapCacheProbes();
  const uint64_t cs = raw_chunk_size;
  for (const ContentBo& content : checkpoint.content_bos()) {
    manifest::Bo* bo = m.add_bos();
    DescribeContentBo(content, bo);
    // CriuCheckpoint::Open proved 8 + pages_offset + size fits in the pages file's real size.
    const uint64_t base = criu_format::kHeaderSize + content.pages_offset;
    for (uint64_t begin = 0; begin < content.size; begin += cs) {
      const uint32_t raw = static_cast<uint32_t>(std::min(cs, content.size - begin));
      manifest::Chunk* chunk = bo->add_chunks();
      chunk->set_codec(manifest::CODEC_RAW);
      chunk->set_stored_offset(base + begin);
      chunk->set_stored_length(raw);
      chunk->set_raw_length(raw);
    }
  }
  // The checksum cache: one slot per chunk, all unknown (value-initialized once, here).
  uint64_t flat = 0;
  source->first_flat_.reserve(static_cast<size_t>(m.bos_size()));
  for (const manifest::Bo& bo : m.bos()) {
    source->first_flat_.push_back(flat);
    flat += static_cast<uint64_t>(bo.chunks_size());
  }
  source->checksums_ = std::make_unique<ChecksumSlot[]>(flat);
  return std::shared_ptr<const ImageSource>(std::move(source));
}

namespace {

Result<const manifest::Chunk*> FindChunk(const manifest::Manifest& m,
                                         const std::filesystem::path& dir, uint32_t bo,
                                         uint32_t chunk) {
  if (bo >= static_cast<uint32_t>(m.bos_size()))
    return OutOfRange("{}: BO {} does not exist (image has {})", dir.string(), bo, m.bos_size());
  const manifest::Bo& b = m.bos(static_cast<int>(bo));
  if (chunk >= static_cast<uint32_t>(b.chunks_size()))
    return OutOfRange("{}: BO {} has no chunk {} (it has {})", dir.string(), bo, chunk,
                      b.chunks_size());
  return &b.chunks(static_cast<int>(chunk));
}

}  // namespace

Result<uint32_t> ImageSource::StoredLength(uint32_t bo, uint32_t chunk) const {
  GPULAZY_ASSIGN_OR_RETURN(const manifest::Chunk* c, FindChunk(manifest_, dir_, bo, chunk));
  return c->codec() == manifest::CODEC_ZERO ? 0u : c->stored_length();
}

Result<ChunkInfo> ImageSource::ReadChunkInto(uint32_t bo, uint32_t chunk,
                                             std::span<uint8_t> buffer) const {
  GPULAZY_ASSIGN_OR_RETURN(const manifest::Chunk* c, FindChunk(manifest_, dir_, bo, chunk));
  ChunkInfo info;
  info.codec = c->codec();
  info.raw_length = c->raw_length();
  if (lazy_) {
    GPULAZY_ASSIGN_OR_RETURN(info.stored_length, lazy_->ReadStoredChunkInto(bo, chunk, buffer));
    info.checksum = c->checksum();
    return info;
  }
  const std::string& file = manifest_.bos(static_cast<int>(bo)).source_file();
  GPULAZY_ASSIGN_OR_RETURN(const StoredFile* stored, FileNamed(file));
  if (buffer.size() < c->stored_length())
    return InvalidArgument("{}: BO {} chunk {} has {} stored bytes, the buffer holds {}",
                           dir_.string(), bo, chunk, c->stored_length(), buffer.size());
  const std::span<uint8_t> bytes = buffer.first(c->stored_length());
  GPULAZY_RETURN_IF_ERROR(ReadExactAt(stored->fd.get(), c->stored_offset(), bytes, file));
  info.stored_length = c->stored_length();
  // Nothing recorded a CRIU checkpoint's checksums: hash on the first read, reuse afterwards
  // (8 sessions of one image would otherwise hash every byte 8 times). The image is immutable
  // while opened (see the header), so the first hash stays right.
  ChecksumSlot& slot = checksums_[first_flat_[bo] + chunk];
  if (slot.known.load(std::memory_order_acquire)) {
    info.checksum = slot.value.load(std::memory_order_relaxed);
  } else {
    info.checksum = Checksum64(bytes);
    checksums_computed_.fetch_add(1, std::memory_order_relaxed);
    slot.value.store(info.checksum, std::memory_order_relaxed);
    slot.known.store(true, std::memory_order_release);
  }
  return info;
}

Result<StoredChunk> ImageSource::ReadChunk(uint32_t bo, uint32_t chunk) const {
  GPULAZY_ASSIGN_OR_RETURN(uint32_t length, StoredLength(bo, chunk));
  StoredChunk out;
  out.bytes.resize(length);
  GPULAZY_ASSIGN_OR_RETURN(ChunkInfo info, ReadChunkInto(bo, chunk, out.bytes));
  out.codec = info.codec;
  out.raw_length = info.raw_length;
  out.checksum = info.checksum;
  out.bytes.resize(info.stored_length);
  return out;
}

Result<ImageSource::DiskRange> ImageSource::LocateChunk(uint32_t bo, uint32_t chunk) const {
  GPULAZY_ASSIGN_OR_RETURN(const manifest::Chunk* c, FindChunk(manifest_, dir_, bo, chunk));
  DiskRange range;
  range.length = c->stored_length();
  if (lazy_) {
    range.fd = lazy_->chunk_fd();
    range.file = 0;
    range.offset = kFileHeaderSize + c->stored_offset();
    return range;
  }
  const std::string& file = manifest_.bos(static_cast<int>(bo)).source_file();
  GPULAZY_ASSIGN_OR_RETURN(const StoredFile* stored, FileNamed(file));
  range.fd = stored->fd.get();
  range.file = static_cast<uint32_t>(stored - files_.data());
  range.offset = c->stored_offset();
  return range;
}

bool ImageSource::InPageCache(const DiskRange& range) const {
  if (range.file >= files_.size()) return false;
  return files_[range.file].cache_probe.Cached(range.offset, range.length);
}

Result<StoredChunk> ImageSource::LocateStoredChunk(uint32_t bo, uint32_t chunk) const {
  GPULAZY_ASSIGN_OR_RETURN(const manifest::Chunk* c, FindChunk(manifest_, dir_, bo, chunk));
  GPULAZY_ASSIGN_OR_RETURN(DiskRange range, LocateChunk(bo, chunk));
  StoredChunk out;
  out.codec = c->codec();
  out.raw_length = c->raw_length();
  out.has_checksum = false;
  if (is_lazy()) {
    out.checksum = c->checksum();
    out.has_checksum = true;
  } else if (const ChecksumSlot& slot = checksums_[first_flat_[bo] + chunk];
             slot.known.load(std::memory_order_acquire)) {
    out.checksum = slot.value.load(std::memory_order_relaxed);
    out.has_checksum = true;
  }
  out.in_file = range;
  return out;
}

void ImageSource::MapCacheProbes() {
  // Best effort: a file we cannot map is simply never "cached", and is read into buffers.
  for (StoredFile& file : files_) {
    Result<PageCacheProbe> probe = PageCacheProbe::Map(file.fd.get(), file.size, dir_ / file.name);
    if (probe.ok()) file.cache_probe = std::move(*probe);
  }
}

Result<const ImageSource::StoredFile*> ImageSource::FileNamed(const std::string& name) const {
  // A handful of files (one per process and GPU): a scan beats a map here.
  for (const StoredFile& file : files_)
    if (file.name == name) return &file;
  return Internal("{}: pages file {} is not open", dir_.string(), name);
}

Result<UniqueFd> ImageSource::ReopenFile(uint32_t index) const {
  if (index >= files_.size())
    return OutOfRange("{}: no stored file {} (image has {})", dir_.string(), index, files_.size());
  const StoredFile& file = files_[index];
  GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenInDir(dir_, file.name));
  struct stat held {};
  struct stat opened {};
  if (::fstat(file.fd.get(), &held) != 0 || ::fstat(fd.get(), &opened) != 0)
    return ErrnoError(errno, "{}: fstat of {}", dir_.string(), file.name);
  if (held.st_dev != opened.st_dev || held.st_ino != opened.st_ino)
    return Corrupt("{}: {} was replaced after the image was opened", dir_.string(), file.name);
  return fd;
}

}  // namespace gpulazy::image
