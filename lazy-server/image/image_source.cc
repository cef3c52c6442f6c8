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
  // 8-byte header); checksums are filled in by ReadChunk, since nothing recorded them.
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

Result<StoredChunk> ImageSource::ReadChunk(uint32_t bo, uint32_t chunk) const {
  GPULAZY_ASSIGN_OR_RETURN(const manifest::Chunk* c, FindChunk(manifest_, dir_, bo, chunk));
  StoredChunk out;
  out.codec = c->codec();
  out.raw_length = c->raw_length();
  if (lazy_) {
    GPULAZY_RETURN_IF_ERROR(lazy_->ReadStoredChunk(bo, chunk, &out.bytes));
    out.checksum = c->checksum();
    return out;
  }
  const std::string& file = manifest_.bos(static_cast<int>(bo)).source_file();
  auto fd = pages_fds_.find(file);
  if (fd == pages_fds_.end()) return Internal("{}: pages file {} is not open", dir_.string(), file);
  out.bytes.resize(c->stored_length());
  GPULAZY_RETURN_IF_ERROR(ReadExactAt(fd->second.get(), c->stored_offset(), out.bytes, file));
  out.checksum = Checksum64(out.bytes);
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
