#include "lazy-server/image/lazy_image.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <lz4.h>

#include <functional>

#include "proto/checksum.h"
#include "proto/criu_file.h"
#include "proto/endian.h"
#include "proto/file_header.h"
#include "tests/image/test_util.h"

namespace gpulazy::image {
namespace {

using criu_format::kAllocGtt;
using criu_format::kAllocUserptr;
using criu_format::kAllocVram;
using testing::BoSpec;
using ::testing::HasSubstr;
using testing::TempDir;

constexpr uint32_t kGpuA = 0xc0de;
constexpr uint32_t kGpuB = 0x1a2b;

// Reads a BO's raw bytes straight from its CRIU pages file.
std::vector<uint8_t> SourceBytes(const CriuCheckpoint& checkpoint, const ContentBo& bo) {
  return testing::ReadRange(checkpoint.dir() / bo.pages_file, 8 + bo.pages_offset,
                            static_cast<size_t>(bo.size));
}

CriuCheckpoint OpenCheckpoint(const std::filesystem::path& dir) {
  auto checkpoint = CriuCheckpoint::Open(dir);
  EXPECT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  return std::move(checkpoint).value();
}

LazyImage OpenLazy(const std::filesystem::path& dir) {
  auto lazy = LazyImage::Open(dir);
  EXPECT_TRUE(lazy.ok()) << lazy.status().ToString();
  return std::move(lazy).value();
}

// Every chunk, decoded, equals the source bytes; the BO reassembled equals the source BO.
void ExpectByteExact(const CriuCheckpoint& checkpoint, const LazyImage& lazy) {
  const manifest::Manifest& m = lazy.manifest();
  ASSERT_EQ(static_cast<size_t>(m.bos_size()), checkpoint.content_bos().size());
  for (int b = 0; b < m.bos_size(); ++b) {
    const ContentBo& source = checkpoint.content_bos()[static_cast<size_t>(b)];
    std::vector<uint8_t> expected = SourceBytes(checkpoint, source);
    std::vector<uint8_t> rebuilt;
    for (int c = 0; c < m.bos(b).chunks_size(); ++c) {
      std::vector<uint8_t> raw(m.bos(b).chunks(c).raw_length());
      Status s = lazy.ReadRawChunk(static_cast<uint32_t>(b), static_cast<uint32_t>(c), raw);
      ASSERT_TRUE(s.ok()) << s.ToString();
      rebuilt.insert(rebuilt.end(), raw.begin(), raw.end());
    }
    EXPECT_EQ(rebuilt, expected) << "BO " << b;
  }
}

// --- Conversion ----------------------------------------------------------------------------

class ConvertTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(ConvertTest, ByteExactAfterDecode) {
  const uint32_t cs = GetParam();
  TempDir dir;
  const size_t random_size = 3 * cs + 123;
  const size_t compressible_size = 2 * cs + 700;  // a tail LZ4 can still shrink
  const size_t zero_size = 2 * cs + 1;
  testing::WriteCheckpoint(
      dir.path(), 4, {kGpuA, kGpuB},
      {{kGpuA, random_size, kAllocVram, testing::RandomBytes(random_size, 1)},
       {kGpuB, compressible_size, kAllocGtt, testing::CompressibleBytes(compressible_size, 3)},
       {kGpuA, 4096, kAllocUserptr, {}},
       {kGpuA, zero_size, kAllocVram, {}},
       {kGpuA, 0, kAllocVram, {}},
       {kGpuB, 1, kAllocVram, {0x42}}});
  CriuCheckpoint checkpoint = OpenCheckpoint(dir.path());
  ConvertOptions options;
  options.chunk_size = cs;
  auto stats = ConvertToLazyImage(checkpoint, options);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_EQ(stats->raw_bytes, random_size + compressible_size + zero_size + 1);
  EXPECT_EQ(stats->chunks, 4u + 3 + 3 + 1);
  EXPECT_EQ(stats->zero_chunks, 3u);
  EXPECT_EQ(stats->raw_chunks, 4u + 1);  // random data, and the 1-byte BO
  EXPECT_EQ(stats->lz4_chunks, 3u);      // compressible data
  EXPECT_EQ(stats->deduplicated_chunks, 0u);
  EXPECT_LT(stats->stored_bytes, stats->raw_bytes);

  LazyImage lazy = OpenLazy(dir.path());
  ExpectByteExact(checkpoint, lazy);
  const manifest::Manifest& m = lazy.manifest();
  EXPECT_EQ(m.chunk_size(), cs);
  EXPECT_EQ(m.chunk_file_bytes(), stats->stored_bytes);
  ASSERT_EQ(m.bos_size(), 5);
  EXPECT_EQ(m.bos(0).chunks(3).raw_length(), 123u);
  EXPECT_EQ(m.bos(2).chunks(2).raw_length(), 1u);
  EXPECT_EQ(m.bos(3).chunks_size(), 0);  // zero-length BO
  for (const auto& chunk : m.bos(2).chunks()) {
    EXPECT_EQ(chunk.codec(), manifest::CODEC_ZERO);
    EXPECT_EQ(chunk.stored_length(), 0u);
  }
  for (const auto& chunk : m.bos(0).chunks()) {
    EXPECT_EQ(chunk.codec(), manifest::CODEC_RAW);
    EXPECT_EQ(chunk.stored_length(), chunk.raw_length());
  }
  for (const auto& chunk : m.bos(1).chunks()) {
    EXPECT_EQ(chunk.codec(), manifest::CODEC_LZ4);
    EXPECT_LT(chunk.stored_length(), chunk.raw_length());
  }

  auto report = VerifyLazyImage(checkpoint, lazy);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_TRUE(report->ok()) << ::testing::PrintToString(report->mismatches);
  EXPECT_EQ(report->chunks_checked, stats->chunks);
  EXPECT_EQ(report->bytes_checked, stats->raw_bytes);
}
INSTANTIATE_TEST_SUITE_P(ChunkSizes, ConvertTest, ::testing::Values(4096u, 2u << 20),
                         [](const auto& info) { return std::to_string(info.param); });

TEST(ConvertTest, WritesDocumentedHeadersAndFields) {
  TempDir dir;
  testing::WriteCheckpoint(dir.path(), 2, {kGpuA},
                           {{kGpuA, 10000, kAllocVram, testing::RandomBytes(10000, 9)}});
  CriuCheckpoint checkpoint = OpenCheckpoint(dir.path());
  ConvertOptions options;
  options.chunk_size = 4096;
  ASSERT_TRUE(ConvertToLazyImage(checkpoint, options).ok());

  std::string chunks = testing::ReadFile(dir / kChunkFileName);
  ASSERT_GE(chunks.size(), kFileHeaderSize);
  EXPECT_EQ(chunks.substr(0, 8), "GPLZCHNK");
  auto* c = reinterpret_cast<const uint8_t*>(chunks.data());
  EXPECT_EQ(LoadLe32(c + 8), 1u);
  EXPECT_EQ(LoadLe32(c + 12), 0u);
  EXPECT_EQ(LoadLe64(c + 16), chunks.size() - kFileHeaderSize);
  EXPECT_EQ(LoadLe64(c + 24), 0u);

  std::string bytes = testing::ReadFile(dir / kManifestFileName);
  auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  EXPECT_EQ(bytes.substr(0, 8), "GPLZMANI");
  EXPECT_EQ(LoadLe32(p + 8), 1u);
  EXPECT_EQ(LoadLe64(p + 16), bytes.size() - kFileHeaderSize);
  std::string payload = bytes.substr(kFileHeaderSize);
  EXPECT_EQ(LoadLe64(p + 24), Checksum64(AsBytes(payload)));
  manifest::Manifest m;
  ASSERT_TRUE(m.ParseFromString(payload));
  EXPECT_EQ(m.format_version(), 1u);
  EXPECT_EQ(m.chunk_file(), "gpulazy-chunks.img");
  EXPECT_EQ(m.created_by(), "gpulazy-image");
  EXPECT_GT(m.created_unix_s(), 1'600'000'000u);
  ASSERT_EQ(m.devices_size(), 1);
  EXPECT_EQ(m.devices(0).gpu_id(), kGpuA);
  EXPECT_EQ(m.devices(0).content_bytes(), 10000u);
  ASSERT_EQ(m.bos_size(), 1);
  EXPECT_EQ(m.bos(0).source_file(), "amdgpu-pages-2-c0de.img");
  EXPECT_EQ(m.bos(0).source_offset(), 0u);
  EXPECT_EQ(m.bos(0).process_id(), 2u);
  const manifest::Chunk& first = m.bos(0).chunks(0);
  auto raw = testing::RandomBytes(10000, 9);
  std::span<const uint8_t> chunk0(raw.data(), 4096);
  EXPECT_EQ(first.checksum(), Checksum64(chunk0));
  Digest128 digest = ContentDigest(chunk0);
  EXPECT_EQ(first.digest(), std::string(digest.begin(), digest.end()));
  // Raw stored bytes sit at header + stored_offset.
  EXPECT_EQ(chunks.substr(kFileHeaderSize + first.stored_offset(), 4096),
            std::string(chunk0.begin(), chunk0.end()));
  // No temporaries left.
  for (const auto& entry : std::filesystem::directory_iterator(dir.path()))
    EXPECT_EQ(entry.path().filename().string().find(".tmp"), std::string::npos);
}

TEST(ConvertTest, DeduplicationSharesStoredBytes) {
  TempDir dir;
  auto data = testing::RandomBytes(4 * 4096, 5);
  // BO 1 repeats BO 0; BO 2 holds one of BO 0's chunks twice.
  std::vector<uint8_t> twice(data.begin() + 4096, data.begin() + 8192);
  twice.insert(twice.end(), twice.begin(), twice.end());
  std::vector<BoSpec> bos = {{kGpuA, data.size(), kAllocVram, data},
                             {kGpuB, data.size(), kAllocVram, data},
                             {kGpuA, twice.size(), kAllocGtt, twice}};
  testing::WriteCheckpoint(dir.path(), 1, {kGpuA, kGpuB}, bos);
  CriuCheckpoint checkpoint = OpenCheckpoint(dir.path());
  ConvertOptions options;
  options.chunk_size = 4096;
  auto stats = ConvertToLazyImage(checkpoint, options);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->deduplicated_chunks, 6u);
  EXPECT_EQ(stats->stored_bytes, data.size());
  LazyImage lazy = OpenLazy(dir.path());
  const manifest::Manifest& m = lazy.manifest();
  for (int c = 0; c < 4; ++c) {
    EXPECT_EQ(m.bos(1).chunks(c).stored_offset(), m.bos(0).chunks(c).stored_offset());
    EXPECT_EQ(m.bos(1).chunks(c).stored_length(), m.bos(0).chunks(c).stored_length());
  }
  EXPECT_EQ(m.bos(2).chunks(0).stored_offset(), m.bos(0).chunks(1).stored_offset());
  EXPECT_EQ(m.bos(2).chunks(1).stored_offset(), m.bos(0).chunks(1).stored_offset());
  ExpectByteExact(checkpoint, lazy);

  options.deduplicate = false;
  auto plain = ConvertToLazyImage(checkpoint, options);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->deduplicated_chunks, 0u);
  EXPECT_EQ(plain->stored_bytes, 3 * data.size() - 2 * 4096);
  ExpectByteExact(checkpoint, OpenLazy(dir.path()));
}

TEST(ConvertTest, Lz4OnlyWhenSmaller) {
  TempDir dir;
  auto comp = testing::CompressibleBytes(8192, 1);
  testing::WriteCheckpoint(
      dir.path(), 1, {kGpuA},
      {{kGpuA, 8192, kAllocVram, comp}, {kGpuA, 8192, kAllocVram, testing::RandomBytes(8192, 2)}});
  CriuCheckpoint checkpoint = OpenCheckpoint(dir.path());
  ConvertOptions options;
  options.chunk_size = 4096;
  auto stats = ConvertToLazyImage(checkpoint, options);
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(stats->lz4_chunks, 2u);
  EXPECT_EQ(stats->raw_chunks, 2u);  // random data does not shrink: kept raw
  {
    LazyImage lazy = OpenLazy(dir.path());
    uint64_t stored = 0;
    for (const auto& bo : lazy.manifest().bos())
      for (const auto& chunk : bo.chunks())
        stored += chunk.stored_length();
    EXPECT_EQ(stored, stats->stored_bytes);
    EXPECT_LT(stats->stored_bytes, 8192u + 8192u / 2);
  }
  options.compress = false;
  auto raw = ConvertToLazyImage(checkpoint, options);
  ASSERT_TRUE(raw.ok());
  EXPECT_EQ(raw->lz4_chunks, 0u);
  EXPECT_EQ(raw->raw_chunks, 4u);
  EXPECT_EQ(raw->stored_bytes, 16384u);
  ExpectByteExact(checkpoint, OpenLazy(dir.path()));
}

TEST(ConvertTest, RejectsBadChunkSizes) {
  TempDir dir;
  testing::WriteCheckpoint(dir.path(), 1, {kGpuA},
                           {{kGpuA, 10, kAllocVram, testing::RandomBytes(10, 1)}});
  CriuCheckpoint checkpoint = OpenCheckpoint(dir.path());
  for (uint32_t cs : {0u, 2048u, 5000u, 8u << 20}) {
    ConvertOptions options;
    options.chunk_size = cs;
    EXPECT_EQ(ConvertToLazyImage(checkpoint, options).status().code(), Code::kInvalidArgument)
        << cs;
  }
  EXPECT_FALSE(LazyImage::Exists(dir.path()));
}

// --- Verification --------------------------------------------------------------------------

struct Converted {
  TempDir dir;
  CriuCheckpoint checkpoint;
};

std::unique_ptr<Converted> MakeConverted(bool compress = true) {
  auto out = std::make_unique<Converted>();
  testing::WriteCheckpoint(out->dir.path(), 6, {kGpuA},
                           {{kGpuA, 5 * 4096, kAllocVram, testing::RandomBytes(5 * 4096, 11)},
                            {kGpuA, 3 * 4096, kAllocGtt, testing::CompressibleBytes(3 * 4096, 2)}});
  out->checkpoint = OpenCheckpoint(out->dir.path());
  ConvertOptions options;
  options.chunk_size = 4096;
  options.compress = compress;
  EXPECT_TRUE(ConvertToLazyImage(out->checkpoint, options).ok());
  return out;
}

TEST(VerifyTest, CatchesFlippedByteInChunkFile) {
  auto image = MakeConverted();
  const manifest::Chunk chunk = OpenLazy(image->dir.path()).manifest().bos(0).chunks(3);
  testing::FlipByte(image->dir / kChunkFileName, kFileHeaderSize + chunk.stored_offset() + 100);
  LazyImage lazy = OpenLazy(image->dir.path());  // the manifest is fine; the chunk is not
  std::vector<uint8_t> raw(4096);
  EXPECT_EQ(lazy.ReadRawChunk(0, 3, raw).code(), Code::kCorrupt);
  EXPECT_TRUE(lazy.ReadRawChunk(0, 2, raw).ok());
  auto report = VerifyLazyImage(image->checkpoint, lazy);
  ASSERT_TRUE(report.ok());
  ASSERT_EQ(report->mismatches.size(), 1u) << ::testing::PrintToString(report->mismatches);
  EXPECT_THAT(report->mismatches[0], HasSubstr("process 6"));
  EXPECT_THAT(report->mismatches[0], HasSubstr("bo index 0"));
  EXPECT_THAT(report->mismatches[0], HasSubstr("gpu 0xc0de"));
  EXPECT_THAT(report->mismatches[0], HasSubstr("chunk 3"));
}

TEST(VerifyTest, CatchesFlippedByteInLz4Chunk) {
  auto image = MakeConverted();
  const manifest::Chunk chunk = OpenLazy(image->dir.path()).manifest().bos(1).chunks(1);
  ASSERT_EQ(chunk.codec(), manifest::CODEC_LZ4);
  testing::FlipByte(image->dir / kChunkFileName,
                    kFileHeaderSize + chunk.stored_offset() + chunk.stored_length() / 2);
  auto report = VerifyLazyImage(image->checkpoint, OpenLazy(image->dir.path()));
  ASSERT_TRUE(report.ok());
  ASSERT_EQ(report->mismatches.size(), 1u);
  EXPECT_THAT(report->mismatches[0], HasSubstr("bo index 1"));
  EXPECT_THAT(report->mismatches[0], HasSubstr("chunk 1"));
}

TEST(VerifyTest, CatchesFlippedByteInSourcePagesFile) {
  auto image = MakeConverted();
  // BO 0 chunk 4 starts at 8 + 4 * 4096 in the pages file.
  testing::FlipByte(image->dir / "amdgpu-pages-6-c0de.img", 8 + 4 * 4096 + 7);
  auto report = VerifyLazyImage(image->checkpoint, OpenLazy(image->dir.path()));
  ASSERT_TRUE(report.ok());
  ASSERT_FALSE(report->ok());
  EXPECT_THAT(report->mismatches[0], HasSubstr("chunk 4"));
  EXPECT_THAT(report->mismatches[0], HasSubstr("amdgpu-pages-6-c0de.img"));
}

TEST(VerifyTest, CleanImageVerifies) {
  auto image = MakeConverted(false);
  auto report = VerifyLazyImage(image->checkpoint, OpenLazy(image->dir.path()));
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(report->ok());
  EXPECT_EQ(report->chunks_checked, 8u);
}

// --- Corrupt manifests ---------------------------------------------------------------------

// Rewrites the manifest bypassing WriteManifest's validation, with a correct header checksum,
// so only LazyImage::Open stands between the bad manifest and a reader.
void RewriteManifestRaw(const std::filesystem::path& dir,
                        const std::function<void(manifest::Manifest*)>& mutate) {
  std::string bytes = testing::ReadFile(dir / kManifestFileName);
  manifest::Manifest m;
  ASSERT_TRUE(m.ParseFromString(bytes.substr(kFileHeaderSize)));
  mutate(&m);
  std::string payload = m.SerializeAsString();
  FileHeader header;
  header.magic = kManifestMagic;
  header.payload_length = payload.size();
  header.payload_checksum = Checksum64(AsBytes(payload));
  auto head = EncodeFileHeader(header);
  testing::WriteFile(dir / kManifestFileName, std::string(head.begin(), head.end()) + payload);
}

Status OpenAfter(const std::function<void(manifest::Manifest*)>& mutate) {
  auto image = MakeConverted();
  RewriteManifestRaw(image->dir.path(), mutate);
  return LazyImage::Open(image->dir.path()).status();
}

TEST(ManifestTest, UnchangedRewriteStillOpens) {
  EXPECT_TRUE(OpenAfter([](manifest::Manifest*) {}).ok());
}

TEST(ManifestTest, BadMagic) {
  auto image = MakeConverted();
  testing::FlipByte(image->dir / kManifestFileName, 0);
  Status s = LazyImage::Open(image->dir.path()).status();
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("magic"));
}

TEST(ManifestTest, BadChecksum) {
  auto image = MakeConverted();
  testing::FlipByte(image->dir / kManifestFileName, kFileHeaderSize + 5);
  Status s = LazyImage::Open(image->dir.path()).status();
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("checksum"));
}

TEST(ManifestTest, HeaderVersionTwo) {
  auto image = MakeConverted();
  std::string bytes = testing::ReadFile(image->dir / kManifestFileName);
  bytes[8] = 2;
  testing::WriteFile(image->dir / kManifestFileName, bytes);
  EXPECT_EQ(LazyImage::Open(image->dir.path()).status().code(), Code::kUnsupported);
}

TEST(ManifestTest, TruncatedManifest) {
  auto image = MakeConverted();
  std::string bytes = testing::ReadFile(image->dir / kManifestFileName);
  testing::WriteFile(image->dir / kManifestFileName, bytes.substr(0, bytes.size() - 3));
  Status s = LazyImage::Open(image->dir.path()).status();
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("header says"));
}

TEST(ManifestTest, FormatVersionTwo) {
  Status s = OpenAfter([](manifest::Manifest* m) { m->set_format_version(2); });
  EXPECT_EQ(s.code(), Code::kUnsupported);
  EXPECT_THAT(s.message(), HasSubstr("version 2"));
}

TEST(ManifestTest, ChunkRangePastEndOfChunkFile) {
  Status s = OpenAfter([](manifest::Manifest* m) {
    m->mutable_bos(0)->mutable_chunks(4)->set_stored_offset(m->chunk_file_bytes() - 100);
  });
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("chunk 4"));
  EXPECT_THAT(s.message(), HasSubstr("passes the end"));
}

TEST(ManifestTest, ChunkRangeOverflowingSixtyFourBits) {
  Status s = OpenAfter([](manifest::Manifest* m) {
    m->mutable_bos(0)->mutable_chunks(0)->set_stored_offset(UINT64_MAX - 10);
  });
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("passes the end"));
}

TEST(ManifestTest, AbsurdChunkCount) {
  Status s = OpenAfter([](manifest::Manifest* m) { m->mutable_bos(0)->set_size(1ull << 60); });
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("needs 281474976710656"));
  s = OpenAfter([](manifest::Manifest* m) { m->mutable_bos(0)->set_size(UINT64_MAX); });
  EXPECT_EQ(s.code(), Code::kCorrupt);
}

TEST(ManifestTest, WrongRawLength) {
  Status s = OpenAfter(
      [](manifest::Manifest* m) { m->mutable_bos(0)->mutable_chunks(1)->set_raw_length(4095); });
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("raw length 4095"));
}

TEST(ManifestTest, BadChunkSize) {
  for (uint32_t cs : {0u, 3000u, 2048u, 8u << 20}) {
    Status s = OpenAfter([cs](manifest::Manifest* m) { m->set_chunk_size(cs); });
    EXPECT_EQ(s.code(), Code::kCorrupt) << cs;
    EXPECT_THAT(s.message(), HasSubstr("chunk size"));
  }
}

TEST(ManifestTest, ChunkFileBytesMismatch) {
  Status s =
      OpenAfter([](manifest::Manifest* m) { m->set_chunk_file_bytes(m->chunk_file_bytes() + 1); });
  EXPECT_EQ(s.code(), Code::kCorrupt);
}

TEST(ManifestTest, ChunkFileNameEscapingDirectory) {
  Status s = OpenAfter([](manifest::Manifest* m) { m->set_chunk_file("../gpulazy-chunks.img"); });
  EXPECT_EQ(s.code(), Code::kCorrupt);
  s = OpenAfter([](manifest::Manifest* m) { m->mutable_bos(1)->set_source_file("/etc/passwd"); });
  EXPECT_EQ(s.code(), Code::kCorrupt);
}

TEST(ManifestTest, RawChunkWithWrongStoredLength) {
  Status s = OpenAfter(
      [](manifest::Manifest* m) { m->mutable_bos(0)->mutable_chunks(0)->set_stored_length(100); });
  EXPECT_EQ(s.code(), Code::kCorrupt);
}

TEST(ManifestTest, Lz4ChunkLargerThanCompressBound) {
  Status s = OpenAfter([](manifest::Manifest* m) {
    auto* chunk = m->mutable_bos(1)->mutable_chunks(0);
    chunk->set_stored_offset(0);
    chunk->set_stored_length(static_cast<uint32_t>(LZ4_compressBound(4096)) + 1);
  });
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("LZ4"));
}

TEST(ManifestTest, ZeroChunkWithStoredBytes) {
  Status s = OpenAfter([](manifest::Manifest* m) {
    auto* chunk = m->mutable_bos(0)->mutable_chunks(0);
    chunk->set_codec(manifest::CODEC_ZERO);
  });
  EXPECT_EQ(s.code(), Code::kCorrupt);
}

TEST(ManifestTest, UnknownCodec) {
  Status s = OpenAfter([](manifest::Manifest* m) {
    m->mutable_bos(0)->mutable_chunks(0)->set_codec(static_cast<manifest::Codec>(7));
  });
  EXPECT_EQ(s.code(), Code::kCorrupt);
}

TEST(ManifestTest, ShortDigest) {
  Status s = OpenAfter(
      [](manifest::Manifest* m) { m->mutable_bos(0)->mutable_chunks(0)->set_digest("short"); });
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("digest"));
}

TEST(ManifestTest, ProfileOutOfRange) {
  Status s = OpenAfter([](manifest::Manifest* m) {
    auto* ref = m->mutable_profile()->add_order();
    ref->set_bo(0);
    ref->set_chunk(5);  // BO 0 has chunks 0..4
  });
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("profile"));
  s = OpenAfter([](manifest::Manifest* m) { m->mutable_profile()->add_order()->set_bo(2); });
  EXPECT_EQ(s.code(), Code::kCorrupt);
  s = OpenAfter([](manifest::Manifest* m) {
    m->mutable_profile()->add_order();
    m->mutable_profile()->set_hot_count(2);
  });
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("hot set"));
}

TEST(ManifestTest, ChunkFileWithBadHeader) {
  auto image = MakeConverted();
  std::string bytes = testing::ReadFile(image->dir / kChunkFileName);
  testing::WriteFile(image->dir / kChunkFileName, bytes.substr(0, bytes.size() - 1));
  Status s = LazyImage::Open(image->dir.path()).status();
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr(kChunkFileName));
  testing::FlipByte(image->dir / kChunkFileName, 1);
  EXPECT_THAT(LazyImage::Open(image->dir.path()).status().message(), HasSubstr("magic"));
}

TEST(ManifestTest, WriteManifestValidatesAndPersistsProfile) {
  auto image = MakeConverted();
  manifest::Manifest m = OpenLazy(image->dir.path()).manifest();
  manifest::Manifest bad = m;
  bad.mutable_profile()->set_hot_count(1);
  EXPECT_EQ(WriteManifest(image->dir.path(), bad).code(), Code::kCorrupt);
  EXPECT_TRUE(LazyImage::Open(image->dir.path()).ok());  // the old one is untouched

  auto* ref = m.mutable_profile()->add_order();
  ref->set_bo(1);
  ref->set_chunk(2);
  m.mutable_profile()->add_order();  // BO 0 chunk 0
  m.mutable_profile()->set_hot_count(1);
  m.mutable_profile()->set_source("recorded");
  ASSERT_TRUE(WriteManifest(image->dir.path(), m).ok());
  LazyImage lazy = OpenLazy(image->dir.path());
  ASSERT_EQ(lazy.manifest().profile().order_size(), 2);
  EXPECT_EQ(lazy.manifest().profile().order(0).chunk(), 2u);
  EXPECT_EQ(lazy.manifest().profile().hot_count(), 1u);
  EXPECT_EQ(lazy.manifest().profile().source(), "recorded");
}

// --- Reading chunks ------------------------------------------------------------------------

TEST(LazyImageTest, OutOfRangeBoAndChunk) {
  auto image = MakeConverted();
  LazyImage lazy = OpenLazy(image->dir.path());
  std::vector<uint8_t> stored;
  std::vector<uint8_t> raw(4096);
  EXPECT_EQ(lazy.ReadStoredChunk(2, 0, &stored).code(), Code::kOutOfRange);
  EXPECT_EQ(lazy.ReadStoredChunk(UINT32_MAX, 0, &stored).code(), Code::kOutOfRange);
  EXPECT_EQ(lazy.ReadStoredChunk(0, 5, &stored).code(), Code::kOutOfRange);
  EXPECT_EQ(lazy.ReadStoredChunk(1, UINT32_MAX, &stored).code(), Code::kOutOfRange);
  EXPECT_EQ(lazy.ReadRawChunk(0, 5, raw).code(), Code::kOutOfRange);
  EXPECT_EQ(lazy.ReadRawChunk(7, 0, raw).code(), Code::kOutOfRange);
  // A raw buffer of the wrong size is refused, not overrun.
  std::vector<uint8_t> small(100);
  EXPECT_EQ(lazy.ReadRawChunk(0, 0, small).code(), Code::kInvalidArgument);
}

TEST(LazyImageTest, MissingManifestIsNotFound) {
  TempDir dir;
  EXPECT_FALSE(LazyImage::Exists(dir.path()));
  EXPECT_EQ(LazyImage::Open(dir.path()).status().code(), Code::kNotFound);
}

// --- DecodeChunk ---------------------------------------------------------------------------

struct Encoded {
  std::vector<uint8_t> raw;
  std::vector<uint8_t> stored;
  manifest::Chunk chunk;
};

Encoded EncodeLz4(size_t n) {
  Encoded e;
  e.raw = testing::CompressibleBytes(n, 4);
  e.stored.resize(static_cast<size_t>(LZ4_compressBound(static_cast<int>(n))));
  int m = LZ4_compress_default(reinterpret_cast<const char*>(e.raw.data()),
                               reinterpret_cast<char*>(e.stored.data()), static_cast<int>(n),
                               static_cast<int>(e.stored.size()));
  EXPECT_GT(m, 0);
  e.stored.resize(static_cast<size_t>(m));
  e.chunk.set_codec(manifest::CODEC_LZ4);
  e.chunk.set_raw_length(static_cast<uint32_t>(n));
  e.chunk.set_stored_length(static_cast<uint32_t>(m));
  e.chunk.set_checksum(Checksum64(e.raw));
  return e;
}

TEST(DecodeChunkTest, DecodesLz4) {
  Encoded e = EncodeLz4(4096);
  std::vector<uint8_t> out(4096);
  ASSERT_TRUE(DecodeChunk(e.chunk, e.stored, out, "t").ok());
  EXPECT_EQ(out, e.raw);
}

TEST(DecodeChunkTest, Lz4ClaimingFewerBytesDoesNotOverrun) {
  Encoded e = EncodeLz4(4096);
  e.chunk.set_raw_length(1000);
  // The output span is 1000 bytes inside a larger buffer; the rest must stay untouched.
  std::vector<uint8_t> buffer(8192, 0xAA);
  std::span<uint8_t> out(buffer.data(), 1000);
  Status s = DecodeChunk(e.chunk, e.stored, out, "BO 3 chunk 7");
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("BO 3 chunk 7"));
  for (size_t i = 1000; i < buffer.size(); ++i)
    ASSERT_EQ(buffer[i], 0xAA) << i;
}

TEST(DecodeChunkTest, Lz4ClaimingMoreBytesIsCorrupt) {
  Encoded e = EncodeLz4(4096);
  e.chunk.set_raw_length(8192);
  std::vector<uint8_t> out(8192);
  Status s = DecodeChunk(e.chunk, e.stored, out, "t");
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("decodes to 4096"));
}

TEST(DecodeChunkTest, GarbageLz4IsCorrupt) {
  manifest::Chunk chunk;
  chunk.set_codec(manifest::CODEC_LZ4);
  chunk.set_raw_length(4096);
  std::vector<uint8_t> garbage = {0xff, 0xff, 0xff, 0xff, 0x00, 0x01, 0x02};
  std::vector<uint8_t> buffer(8192, 0xAA);
  EXPECT_EQ(DecodeChunk(chunk, garbage, std::span<uint8_t>(buffer.data(), 4096), "t").code(),
            Code::kCorrupt);
  for (size_t i = 4096; i < buffer.size(); ++i)
    ASSERT_EQ(buffer[i], 0xAA) << i;
  EXPECT_EQ(DecodeChunk(chunk, {}, std::span<uint8_t>(buffer.data(), 4096), "t").code(),
            Code::kCorrupt);
}

TEST(DecodeChunkTest, RawWithWrongStoredSize) {
  auto raw = testing::RandomBytes(100, 1);
  manifest::Chunk chunk;
  chunk.set_codec(manifest::CODEC_RAW);
  chunk.set_raw_length(101);
  chunk.set_checksum(Checksum64(raw));
  std::vector<uint8_t> out(101);
  EXPECT_EQ(DecodeChunk(chunk, raw, out, "t").code(), Code::kCorrupt);
  chunk.set_raw_length(100);
  out.resize(100);
  EXPECT_TRUE(DecodeChunk(chunk, raw, out, "t").ok());
  EXPECT_EQ(out, raw);
}

TEST(DecodeChunkTest, ZeroWithStoredBytes) {
  manifest::Chunk chunk;
  chunk.set_codec(manifest::CODEC_ZERO);
  chunk.set_raw_length(64);
  std::vector<uint8_t> zeros(64, 0);
  chunk.set_checksum(Checksum64(zeros));
  std::vector<uint8_t> out(64, 0xAA);
  EXPECT_EQ(DecodeChunk(chunk, zeros, out, "t").code(), Code::kCorrupt);
  ASSERT_TRUE(DecodeChunk(chunk, {}, out, "t").ok());
  EXPECT_EQ(out, zeros);
}

TEST(DecodeChunkTest, ChecksumMismatch) {
  auto raw = testing::RandomBytes(100, 1);
  manifest::Chunk chunk;
  chunk.set_codec(manifest::CODEC_RAW);
  chunk.set_raw_length(100);
  chunk.set_checksum(Checksum64(raw) ^ 1);
  std::vector<uint8_t> out(100);
  Status s = DecodeChunk(chunk, raw, out, "t");
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("checksum"));
}

TEST(DecodeChunkTest, OutputSizeMustMatchRawLength) {
  auto raw = testing::RandomBytes(100, 1);
  manifest::Chunk chunk;
  chunk.set_codec(manifest::CODEC_RAW);
  chunk.set_raw_length(100);
  chunk.set_checksum(Checksum64(raw));
  std::vector<uint8_t> out(99);
  EXPECT_EQ(DecodeChunk(chunk, raw, out, "t").code(), Code::kInvalidArgument);
}

TEST(DecodeChunkTest, UnknownCodec) {
  manifest::Chunk chunk;
  chunk.set_codec(static_cast<manifest::Codec>(9));
  chunk.set_raw_length(0);
  EXPECT_EQ(DecodeChunk(chunk, {}, {}, "t").code(), Code::kCorrupt);
}

}  // namespace
}  // namespace gpulazy::image
