#include "lazy-server/image/image_source.h"

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
  for (const KfdProcessImage& process : checkpoint.processes()) {
    for (const auto& [gpu_id, pages] : process.pages_by_gpu) {
      // A GPU whose content BOs are all empty may have no pages file; there is nothing to read.
      if (pages.payload_length == 0) continue;
      GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenInDir(dir, pages.name));
      source->pages_fds_.emplace(pages.name, std::move(fd));
    }
  }
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
  auto fd = pages_fds_.find(file);
  if (fd == pages_fds_.end()) return Internal("{}: pages file {} is not open", dir_.string(), file);
  if (buffer.size() < c->stored_length())
    return InvalidArgument("{}: BO {} chunk {} has {} stored bytes, the buffer holds {}",
                           dir_.string(), bo, chunk, c->stored_length(), buffer.size());
  const std::span<uint8_t> bytes = buffer.first(c->stored_length());
  GPULAZY_RETURN_IF_ERROR(ReadExactAt(fd->second.get(), c->stored_offset(), bytes, file));
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
    range.offset = kFileHeaderSize + c->stored_offset();
    return range;
  }
  const std::string& file = manifest_.bos(static_cast<int>(bo)).source_file();
  auto fd = pages_fds_.find(file);
  if (fd == pages_fds_.end()) return Internal("{}: pages file {} is not open", dir_.string(), file);
  range.fd = fd->second.get();
  range.offset = c->stored_offset();
  return range;
}

}  // namespace gpulazy::image
