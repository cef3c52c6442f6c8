// libFuzzer harness: the lazy image's manifest parser and everything LazyImage::Open and the
// server do with what it accepts (lazy-server/image/lazy_image.h, image_source.h, the
// scheduler's ImageLayout).
//
// Input: one mode byte, then the rest R.
//   mode bit 0 clear: R is the manifest payload (a manifest::Manifest message); the harness
//                     writes the 32-byte gpulazy header with the right length and XXH3, so the
//                     fuzzer explores the message rather than the checksum;
//   mode bit 0 set:   R is the whole gpulazy-manifest.img, header included.
// The image directory also holds the chunk file of the tiny seed image (fuzz_support.h), which
// the seed manifests describe.
// Checks, besides the sanitizers: an accepted manifest upholds what Open promises (chunk counts
// and raw lengths match BO sizes, stored ranges lie inside the chunk file), so reading and
// decoding any chunk of it fails cleanly or yields exactly raw_length bytes, and the server's
// ImageLayout built from it is consistent.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "lazy-server/image/image_source.h"
#include "lazy-server/image/lazy_image.h"
#include "lazy-server/server/scheduler.h"
#include "proto/checksum.h"
#include "proto/file_header.h"
#include "tests/fuzz/fuzz_support.h"

namespace {

namespace fs = std::filesystem;
using namespace gpulazy;

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "fuzz_manifest: %s\n", what);
  std::abort();
}

// Decoding every chunk of a big fuzzed image would make single inputs slow; these many are
// enough to reach every code path.
constexpr int kMaxChunksRead = 64;

const fs::path& ImageDir() {
  static const fs::path dir = [] {
    fs::path d = fuzz::ScratchDir() / "image";
    Status made = fuzz::MakeTinyCheckpoint(d, /*lazy=*/true);
    if (!made.ok()) {
      std::fprintf(stderr, "fuzz_manifest: %s\n", made.ToString().c_str());
      std::abort();
    }
    return d;
  }();
  return dir;
}

void CheckAccepted(const image::LazyImage& lazy) {
  const manifest::Manifest& m = lazy.manifest();
  const uint64_t cs = m.chunk_size();
  int read = 0;
  std::vector<uint8_t> raw;
  for (int b = 0; b < m.bos_size(); ++b) {
    const manifest::Bo& bo = m.bos(b);
    uint64_t covered = 0;
    for (int c = 0; c < bo.chunks_size(); ++c) {
      const manifest::Chunk& chunk = bo.chunks(c);
      if (chunk.raw_length() == 0 || chunk.raw_length() > cs) Die("accepted a bad raw length");
      covered += chunk.raw_length();
      if (read++ >= kMaxChunksRead) continue;
      raw.assign(chunk.raw_length(), 0xa5);
      Status status = lazy.ReadRawChunk(static_cast<uint32_t>(b), static_cast<uint32_t>(c), raw);
      if (status.ok() && Checksum64(raw) != chunk.checksum()) Die("Ok chunk fails its checksum");
    }
    if (covered != bo.size()) Die("accepted chunks that do not cover their BO");
  }
  // Out-of-range reads are refused, never served.
  std::vector<uint8_t> stored;
  if (lazy.ReadStoredChunk(static_cast<uint32_t>(m.bos_size()), 0, &stored).ok())
    Die("read a BO past the table");

  const server::ImageLayout layout = server::ImageLayout::FromManifest(m, /*lazy=*/true);
  if (layout.bo_count() != static_cast<uint32_t>(m.bos_size())) Die("layout lost BOs");
  uint64_t chunks = 0;
  for (const manifest::Bo& bo : m.bos())
    chunks += static_cast<uint64_t>(bo.chunks_size());
  if (layout.total_chunks() != chunks || layout.plan().size() != chunks)
    Die("layout plan does not list every chunk once");
  if (layout.hot_end() > layout.plan().size()) Die("hot set past the plan");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const fs::path& dir = ImageDir();
  const uint8_t mode = data[0];
  std::span<const uint8_t> rest(data + 1, size - 1);
  const size_t header_size = (mode & 1) == 0 ? kFileHeaderSize : 0;
  std::vector<uint8_t> file(header_size + rest.size());
  if (header_size != 0) {
    FileHeader header;
    header.magic = kManifestMagic;
    header.payload_length = rest.size();
    header.payload_checksum = Checksum64(rest);
    const auto head = EncodeFileHeader(header);
    std::copy(head.begin(), head.end(), file.begin());
  }
  std::copy(rest.begin(), rest.end(), file.begin() + static_cast<std::ptrdiff_t>(header_size));
  fuzz::WriteFileOrDie(dir / image::kManifestFileName, file);

  Result<image::LazyImage> lazy = image::LazyImage::Open(dir);
  if (!lazy.ok()) {
    if (lazy.status().message().empty()) Die("an error without a message");
    return 0;
  }
  CheckAccepted(*lazy);
  // The server opens the same directory through ImageSource: it must agree.
  auto source = image::ImageSource::Open(dir);
  if (!source.ok() || !(*source)->is_lazy()) Die("ImageSource refuses what LazyImage accepts");
  for (int b = 0; b < lazy->manifest().bos_size() && b < 4; ++b) {
    if (lazy->manifest().bos(b).chunks_size() == 0) continue;
    Result<image::StoredChunk> chunk = (*source)->ReadChunk(static_cast<uint32_t>(b), 0);
    if (chunk.ok() && chunk->bytes.size() != lazy->manifest().bos(b).chunks(0).stored_length())
      Die("stored chunk of another length than the manifest says");
  }
  return 0;
}
