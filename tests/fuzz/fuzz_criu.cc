// libFuzzer harness: the CRIU amdgpu image parser (proto/criu_file.h) and CriuCheckpoint::Open
// (lazy-server/image/criu_checkpoint.h), then what the server and the image tool do with a
// checkpoint it accepts: serve it raw (ImageSource) and convert it to a lazy image.
//
// Input: one mode byte, then the rest R.
//   mode bit 0 clear: R is the criu_kfd message; the harness writes CRIU's 8-byte length
//                     header in front of it. Set: R is the whole amdgpu-kfd-1.img.
//   mode bit 1 set:   the harness also writes the pages files the BO table asks for, of exactly
//                     the right length (when the message parses and the total is small), so
//                     the fuzzer reaches the layout and serving code, not just the size checks.
// The same R is also handed to ParseRenderNode.
// Checks, besides the sanitizers: an accepted checkpoint's content BOs tile each pages file
// exactly, every raw chunk served is the bytes at its place in the file, and converting it
// yields a lazy image that verifies against it.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <system_error>
#include <vector>

#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/image_source.h"
#include "lazy-server/image/io.h"
#include "lazy-server/image/lazy_image.h"
#include "proto/criu_file.h"
#include "tests/fuzz/fuzz_support.h"

namespace {

namespace fs = std::filesystem;
using namespace gpulazy;

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "fuzz_criu: %s\n", what);
  std::abort();
}

// Pages files are written only below this total (sparse beyond the written bytes), and only a
// checkpoint this small is converted: single inputs stay fast.
constexpr uint64_t kMaxPagesBytes = 64ull << 20;
constexpr uint64_t kMaxConvertBytes = 256ull << 10;
constexpr uint32_t kChunkSize = 4096;
constexpr int kMaxChunksRead = 64;

// Deterministic, half incompressible and half runs, so conversion sees RAW, LZ4 and ZERO chunks.
uint8_t PatternByte(uint64_t offset) {
  if ((offset / kChunkSize) % 3 == 2) return 0;
  if ((offset / kChunkSize) % 3 == 1) return static_cast<uint8_t>(offset / 64);
  uint64_t x = offset * 0x9e3779b97f4a7c15ull;
  x ^= x >> 29;
  return static_cast<uint8_t>(x >> 17);
}

void WritePagesFiles(const fs::path& dir, const criu::KfdProcess& process) {
  std::map<uint32_t, uint64_t> bytes_by_gpu;
  uint64_t total = 0;
  for (const criu::KfdBo& bo : process.bos()) {
    if (!criu_format::HasContents(bo.alloc_flags())) continue;
    if (bo.size() > kMaxPagesBytes || total + bo.size() > kMaxPagesBytes) return;
    bytes_by_gpu[bo.gpu_id()] += bo.size();
    total += bo.size();
  }
  for (const auto& [gpu_id, bytes] : bytes_by_gpu) {
    const fs::path path = dir / criu_format::PagesImageName(1, gpu_id);
    UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd.valid()) Die("cannot create a pages file");
    uint8_t header[criu_format::kHeaderSize];
    criu_format::EncodeHeader(bytes, header);
    std::vector<uint8_t> head(header, header + sizeof header);
    // Real bytes only where conversion will read them; the rest stays a hole (zeros).
    const uint64_t written = std::min<uint64_t>(bytes, kMaxConvertBytes);
    for (uint64_t i = 0; i < written; ++i)
      head.push_back(PatternByte(i));
    if (!WriteAllAt(fd.get(), 0, head, path).ok()) Die("cannot write a pages file");
    if (::ftruncate(fd.get(), static_cast<off_t>(criu_format::kHeaderSize + bytes)) != 0)
      Die("cannot size a pages file");
  }
}

void CheckAccepted(const fs::path& dir, const image::CriuCheckpoint& checkpoint) {
  // Content BOs tile each pages file: in table order, each starts where the last one ended.
  std::map<std::string, uint64_t> next_offset;
  for (const image::ContentBo& bo : checkpoint.content_bos()) {
    uint64_t& next = next_offset[bo.pages_file];
    if (bo.pages_offset != next) Die("content BOs do not tile their pages file");
    next += bo.size;
  }
  for (const image::KfdProcessImage& process : checkpoint.processes())
    for (const auto& [gpu, pages] : process.pages_by_gpu)
      if (next_offset[pages.name] != pages.payload_length) Die("pages file length disagrees");

  auto source = image::ImageSource::Open(dir, kChunkSize);
  if (!source.ok()) {
    if (source.status().message().empty()) Die("an error without a message");
    return;
  }
  const manifest::Manifest& m = (*source)->manifest();
  int read = 0;
  for (int b = 0; b < m.bos_size() && read < kMaxChunksRead; ++b) {
    const manifest::Bo& bo = m.bos(b);
    for (int c = 0; c < bo.chunks_size() && read < kMaxChunksRead; ++c, ++read) {
      Result<image::StoredChunk> chunk =
          (*source)->ReadChunk(static_cast<uint32_t>(b), static_cast<uint32_t>(c));
      if (!chunk.ok()) Die("an accepted checkpoint's chunk cannot be read");
      const uint64_t at = bo.source_offset() + uint64_t{static_cast<uint32_t>(c)} * kChunkSize;
      for (size_t i = 0; i < chunk->bytes.size(); i += 509) {
        const uint8_t want = at + i < kMaxConvertBytes ? PatternByte(at + i) : 0;
        if (chunk->bytes[i] != want) Die("a raw chunk is not the bytes at its place");
      }
    }
  }

  if (checkpoint.content_bytes() > kMaxConvertBytes) return;
  image::ConvertOptions convert;
  convert.chunk_size = kChunkSize;
  Result<image::ConvertStats> converted = image::ConvertToLazyImage(checkpoint, convert);
  if (!converted.ok()) Die("an accepted checkpoint does not convert");
  Result<image::LazyImage> lazy = image::LazyImage::Open(dir);
  if (!lazy.ok()) Die("a converted image does not open");
  Result<image::VerifyReport> report = image::VerifyLazyImage(checkpoint, *lazy);
  if (!report.ok() || !report->ok()) Die("a converted image does not verify");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  std::span<const uint8_t> rest(data + 1, size - 1);
  (void)criu_format::ParseRenderNode(rest, "fuzz");

  const fs::path dir = fuzz::ScratchDir() / "ckpt";
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directory(dir, ec);
  if (ec) Die("cannot make the checkpoint directory");
  const size_t header = (mode & 1) == 0 ? criu_format::kHeaderSize : 0;
  std::vector<uint8_t> file(header + rest.size());
  if (header != 0) criu_format::EncodeHeader(rest.size(), file.data());
  std::copy(rest.begin(), rest.end(), file.begin() + static_cast<std::ptrdiff_t>(header));
  fuzz::WriteFileOrDie(dir / criu_format::KfdImageName(1), file);
  if ((mode & 2) != 0) {
    std::span<const uint8_t> message =
        (mode & 1) == 0 ? rest : rest.subspan(std::min(rest.size(), criu_format::kHeaderSize));
    Result<criu::KfdProcess> process = criu_format::ParseKfdProcess(message, "fuzz");
    if (process.ok()) WritePagesFiles(dir, *process);
  }

  Result<image::CriuCheckpoint> checkpoint = image::CriuCheckpoint::Open(dir);
  if (!checkpoint.ok()) {
    if (checkpoint.status().message().empty()) Die("an error without a message");
    return 0;
  }
  CheckAccepted(dir, *checkpoint);
  return 0;
}
