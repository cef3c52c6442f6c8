#include "lazy-server/image/criu_checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <optional>
#include <set>
#include <string_view>
#include <system_error>

#include "proto/criu_file.h"

namespace gpulazy::image {
namespace {

constexpr std::string_view kKfdPrefix = "amdgpu-kfd-";
constexpr std::string_view kImgSuffix = ".img";
// A KFD image holds BO and device tables plus the driver blob: kilobytes to a few megabytes.
// Anything far larger is not an image we should load into memory.
constexpr uint64_t kMaxKfdImageBytes = 64ull << 20;

// CRIU names files by the decimal file id it printed with %d/%u: no sign, no leading zeros.
// Accepting "007" would let two names map to one id, so it is refused, not normalised.
std::optional<uint32_t> ParseFileId(std::string_view digits) {
  if (digits.empty() || digits.size() > 10) return std::nullopt;
  if (digits.size() > 1 && digits[0] == '0') return std::nullopt;
  uint64_t value = 0;
  for (char c : digits) {
    if (c < '0' || c > '9') return std::nullopt;
    value = value * 10 + static_cast<uint64_t>(c - '0');
  }
  if (value > UINT32_MAX) return std::nullopt;
  return static_cast<uint32_t>(value);
}

bool CheckedAdd(uint64_t a, uint64_t b, uint64_t* out) {
  return !__builtin_add_overflow(a, b, out);
}

struct KfdFile {
  uint32_t id;
  std::string name;
};

Result<std::vector<KfdFile>> ListKfdImages(const std::filesystem::path& dir) {
  std::error_code ec;
  std::filesystem::directory_iterator it(dir, ec);
  if (ec) {
    if (ec == std::errc::no_such_file_or_directory)
      return NotFound("checkpoint directory {} does not exist", dir.string());
    return IoError("list {}: {}", dir.string(), ec.message());
  }
  std::vector<KfdFile> files;
  for (; it != std::filesystem::directory_iterator(); it.increment(ec)) {
    if (ec) return IoError("list {}: {}", dir.string(), ec.message());
    std::string name = it->path().filename().string();
    std::string_view view = name;
    if (!view.starts_with(kKfdPrefix) || !view.ends_with(kImgSuffix)) continue;
    std::string_view digits =
        view.substr(kKfdPrefix.size(), view.size() - kKfdPrefix.size() - kImgSuffix.size());
    std::optional<uint32_t> id = ParseFileId(digits);
    if (!id)
      return Corrupt("{}: '{}' is not a CRIU file id (decimal, no leading zeros, at most {})", name,
                     digits, UINT32_MAX);
    files.push_back({*id, std::move(name)});
  }
  if (ec) return IoError("list {}: {}", dir.string(), ec.message());
  std::sort(files.begin(), files.end(),
            [](const KfdFile& a, const KfdFile& b) { return a.id < b.id; });
  return files;
}

Result<criu::KfdProcess> ReadKfdImage(const std::filesystem::path& dir, const std::string& name) {
  const std::filesystem::path path = dir / name;
  GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenInDir(dir, name));
  GPULAZY_ASSIGN_OR_RETURN(uint64_t size, FileSize(fd.get(), path));
  if (size < criu_format::kHeaderSize)
    return Corrupt("{}: {} bytes is shorter than the {}-byte CRIU image header", name, size,
                   criu_format::kHeaderSize);
  if (size > kMaxKfdImageBytes)
    return Corrupt("{}: {} bytes is larger than any KFD image (limit {})", name, size,
                   kMaxKfdImageBytes);
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  GPULAZY_RETURN_IF_ERROR(ReadExactAt(fd.get(), 0, bytes, name));
  uint64_t header = criu_format::DecodeHeader(bytes.data());
  uint64_t payload = size - criu_format::kHeaderSize;
  if (header != payload)
    return Corrupt("{}: header says {} bytes but the file holds {} after the header", name, header,
                   payload);
  return criu_format::ParseKfdProcess(
      std::span<const uint8_t>(bytes).subspan(criu_format::kHeaderSize), name);
}

// Checks a pages file against the sum of its GPU's BO sizes. A GPU whose content BOs are all
// empty may have no pages file at all.
Status CheckPagesFile(const std::filesystem::path& dir, const PagesFile& pages) {
  Result<UniqueFd> opened = OpenInDir(dir, pages.name);
  if (!opened.ok()) {
    if (opened.status().code() == Code::kNotFound) {
      if (pages.payload_length == 0) return Status::Ok();
      return NotFound("{}: missing, but the BO table needs {} bytes of GPU {:#x} contents",
                      pages.name, pages.payload_length, pages.gpu_id);
    }
    return opened.status();
  }
  UniqueFd fd = std::move(*opened);
  GPULAZY_ASSIGN_OR_RETURN(uint64_t size, FileSize(fd.get(), pages.name));
  if (size < criu_format::kHeaderSize)
    return Corrupt("{}: {} bytes is shorter than the {}-byte CRIU image header", pages.name, size,
                   criu_format::kHeaderSize);
  uint8_t header_bytes[criu_format::kHeaderSize];
  GPULAZY_RETURN_IF_ERROR(ReadExactAt(fd.get(), 0, header_bytes, pages.name));
  uint64_t header = criu_format::DecodeHeader(header_bytes);
  if (header != pages.payload_length)
    return Corrupt("{}: header says {} bytes but BO table needs {}", pages.name, header,
                   pages.payload_length);
  if (size - criu_format::kHeaderSize != header)
    return Corrupt("{}: header says {} bytes but the file holds {} after the header", pages.name,
                   header, size - criu_format::kHeaderSize);
  return Status::Ok();
}

}  // namespace

Result<CriuCheckpoint> CriuCheckpoint::Open(const std::filesystem::path& dir) {
  GPULAZY_ASSIGN_OR_RETURN(std::vector<KfdFile> files, ListKfdImages(dir));
  if (files.empty())
    return NotFound("{}: no amdgpu-kfd-<id>.img files; not a CRIU amdgpu checkpoint", dir.string());

  CriuCheckpoint checkpoint;
  checkpoint.dir_ = dir;
  for (KfdFile& file : files) {
    KfdProcessImage image;
    image.file_id = file.id;
    image.file_name = file.name;
    GPULAZY_ASSIGN_OR_RETURN(image.message, ReadKfdImage(dir, file.name));

    std::set<uint32_t> gpu_ids;
    for (const criu::KfdDevice& device : image.message.devices()) {
      // Pages files are named by gpu_id, so two devices with one id could not both have one.
      if (!gpu_ids.insert(device.gpu_id()).second)
        return Corrupt("{}: device table lists gpu_id {:#x} twice", file.name, device.gpu_id());
    }

    // Each GPU's pages file holds its VRAM/GTT BOs back to back in BO-table order, so a BO's
    // offset is the running total of the earlier qualifying BOs' sizes on that GPU.
    std::vector<ContentBo> bos;
    for (int i = 0; i < image.message.bos_size(); ++i) {
      const criu::KfdBo& bo = image.message.bos(i);
      if (!gpu_ids.contains(bo.gpu_id()))
        return Corrupt("{}: BO {} is on gpu_id {:#x}, which is not in the device table", file.name,
                       i, bo.gpu_id());
      if (!criu_format::HasContents(bo.alloc_flags())) continue;
      auto [it, inserted] = image.pages_by_gpu.try_emplace(bo.gpu_id());
      PagesFile& pages = it->second;
      if (inserted) {
        pages.name = criu_format::PagesImageName(file.id, bo.gpu_id());
        pages.gpu_id = bo.gpu_id();
      }
      ContentBo content;
      content.process_id = file.id;
      content.bo_index = static_cast<uint32_t>(i);
      content.gpu_id = bo.gpu_id();
      content.gpu_va = bo.gpu_va();
      content.size = bo.size();
      content.alloc_flags = bo.alloc_flags();
      content.pages_file = pages.name;
      content.pages_offset = pages.payload_length;
      if (!CheckedAdd(pages.payload_length, bo.size(), &pages.payload_length) ||
          pages.payload_length > UINT64_MAX - criu_format::kHeaderSize)
        return Corrupt("{}: BO {} of {} bytes overflows the 64-bit size of {}", file.name, i,
                       bo.size(), pages.name);
      bos.push_back(std::move(content));
    }

    for (const auto& [gpu_id, pages] : image.pages_by_gpu) {
      GPULAZY_RETURN_IF_ERROR(CheckPagesFile(dir, pages));
      if (!CheckedAdd(checkpoint.content_bytes_, pages.payload_length, &checkpoint.content_bytes_))
        return Corrupt("{}: total content size overflows 64 bits", dir.string());
    }
    checkpoint.content_bos_.insert(checkpoint.content_bos_.end(),
                                   std::make_move_iterator(bos.begin()),
                                   std::make_move_iterator(bos.end()));
    checkpoint.processes_.push_back(std::move(image));
  }
  return checkpoint;
}

Status WriteKfdImage(const std::filesystem::path& dir, uint32_t file_id,
                     const criu::KfdProcess& process) {
  const std::string name = criu_format::KfdImageName(file_id);
  // A writer that produced an image Open refuses would only move the error to restore time.
  if (!process.IsInitialized())
    return InvalidArgument("{}: message lacks required fields: {}", name,
                           process.InitializationErrorString());
  size_t payload = process.ByteSizeLong();
  if (payload > kMaxKfdImageBytes - criu_format::kHeaderSize)
    return InvalidArgument("{}: {} bytes is larger than the KFD image limit", name, payload);
  std::vector<uint8_t> bytes(criu_format::kHeaderSize + payload);
  criu_format::EncodeHeader(payload, bytes.data());
  if (!process.SerializeToArray(bytes.data() + criu_format::kHeaderSize, static_cast<int>(payload)))
    return Internal("{}: protobuf serialization failed", name);
  return WriteFileAtomically(dir / name, bytes).Context(name);
}

// --- PagesFileWriter -------------------------------------------------------------------------

PagesFileWriter::PagesFileWriter(PagesFileWriter&& other) noexcept
    : path_(std::move(other.path_)),
      tmp_path_(std::move(other.tmp_path_)),
      fd_(std::move(other.fd_)),
      expected_length_(other.expected_length_),
      written_(other.written_) {
  other.tmp_path_.clear();
}

PagesFileWriter& PagesFileWriter::operator=(PagesFileWriter&& other) noexcept {
  if (this != &other) {
    Abandon();
    path_ = std::move(other.path_);
    tmp_path_ = std::move(other.tmp_path_);
    fd_ = std::move(other.fd_);
    expected_length_ = other.expected_length_;
    written_ = other.written_;
    other.tmp_path_.clear();
  }
  return *this;
}

PagesFileWriter::~PagesFileWriter() {
  Abandon();
}

void PagesFileWriter::Abandon() {
  // An unfinished writer leaves nothing behind: the temporary never got the real name.
  fd_.reset();
  if (!tmp_path_.empty()) ::unlink(tmp_path_.c_str());
  tmp_path_.clear();
}

Result<PagesFileWriter> PagesFileWriter::Create(const std::filesystem::path& dir, uint32_t file_id,
                                                uint32_t gpu_id, uint64_t expected_length) {
  if (expected_length > static_cast<uint64_t>(INT64_MAX) - criu_format::kHeaderSize)
    return InvalidArgument("pages file of {} bytes is larger than any file", expected_length);
  PagesFileWriter writer;
  writer.path_ = dir / criu_format::PagesImageName(file_id, gpu_id);
  writer.expected_length_ = expected_length;
  std::string tmp_template = writer.path_.string() + ".tmp.XXXXXX";
  std::vector<char> tmp_name(tmp_template.begin(), tmp_template.end());
  tmp_name.push_back('\0');
  int fd = ::mkostemp(tmp_name.data(), O_CLOEXEC);
  if (fd < 0) return ErrnoError(errno, "create temporary for {}", writer.path_.string());
  writer.fd_.reset(fd);
  writer.tmp_path_ = tmp_name.data();
  if (::fchmod(fd, 0644) != 0) return ErrnoError(errno, "chmod {}", writer.tmp_path_.string());
  // Room for the header, written last by Finish once the total is known to be right.
  if (::ftruncate(fd, criu_format::kHeaderSize) != 0)
    return ErrnoError(errno, "truncate {}", writer.tmp_path_.string());
  return writer;
}

Status PagesFileWriter::CheckRoom(uint64_t length) const {
  if (!fd_.valid()) return InvalidArgument("{}: writer is finished", path_.filename().string());
  if (length > expected_length_ - written_)
    return InvalidArgument("{}: appending {} bytes at {} passes the expected {} bytes",
                           path_.filename().string(), length, written_, expected_length_);
  return Status::Ok();
}

Status PagesFileWriter::Append(std::span<const uint8_t> bytes) {
  GPULAZY_RETURN_IF_ERROR(CheckRoom(bytes.size()));
  GPULAZY_RETURN_IF_ERROR(
      WriteAllAt(fd_.get(), criu_format::kHeaderSize + written_, bytes, tmp_path_));
  written_ += bytes.size();
  return Status::Ok();
}

Status PagesFileWriter::AppendZeros(uint64_t length) {
  GPULAZY_RETURN_IF_ERROR(CheckRoom(length));
  // Growing the file leaves a hole: the filesystem reads it back as zeros without storing them,
  // so multi-GiB test images cost no disk. Later Appends pwrite past the hole.
  uint64_t new_size = criu_format::kHeaderSize + written_ + length;
  if (::ftruncate(fd_.get(), static_cast<off_t>(new_size)) != 0)
    return ErrnoError(errno, "extend {} to {} bytes", tmp_path_.string(), new_size);
  written_ += length;
  return Status::Ok();
}

Status PagesFileWriter::Finish() {
  const std::string name = path_.filename().string();
  if (!fd_.valid()) return InvalidArgument("{}: writer is already finished", name);
  if (written_ != expected_length_)
    return InvalidArgument("{}: {} bytes written but {} expected", name, written_,
                           expected_length_);
  uint8_t header[criu_format::kHeaderSize];
  criu_format::EncodeHeader(written_, header);
  GPULAZY_RETURN_IF_ERROR(WriteAllAt(fd_.get(), 0, header, tmp_path_));
  if (::fsync(fd_.get()) != 0) return ErrnoError(errno, "fsync {}", tmp_path_.string());
  if (::close(fd_.release()) != 0) return ErrnoError(errno, "close {}", tmp_path_.string());
  if (::rename(tmp_path_.c_str(), path_.c_str()) != 0)
    return ErrnoError(errno, "rename {} to {}", tmp_path_.string(), path_.string());
  tmp_path_.clear();
  return Status::Ok();
}

}  // namespace gpulazy::image
