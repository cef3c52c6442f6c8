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
    source->files_.push_back(StoredFile{chunk_file, std::move(fd), size});
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
    source->files_.push_back(StoredFile{name, std::move(fd), size});
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
  GPULAZY_ASSIGN_OR_RETURN(const StoredFile* stored, FileNamed(file));
  out.bytes.resize(c->stored_length());
  GPULAZY_RETURN_IF_ERROR(ReadExactAt(stored->fd.get(), c->stored_offset(), out.bytes, file));
  out.checksum = Checksum64(out.bytes);
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

Result<StoredChunk> ImageSource::LocateStoredChunk(uint32_t bo, uint32_t chunk) const {
  GPULAZY_ASSIGN_OR_RETURN(const manifest::Chunk* c, FindChunk(manifest_, dir_, bo, chunk));
  GPULAZY_ASSIGN_OR_RETURN(DiskRange range, LocateChunk(bo, chunk));
  StoredChunk out;
  out.codec = c->codec();
  out.raw_length = c->raw_length();
  out.checksum = c->checksum();
  out.has_checksum = is_lazy();
  out.in_file = range;
  return out;
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
