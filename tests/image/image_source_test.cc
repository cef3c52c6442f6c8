#include "lazy-server/image/image_source.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include "proto/checksum.h"
#include "proto/criu_file.h"
#include "proto/file_header.h"
#include "tests/image/test_util.h"

namespace gpulazy::image {
namespace {

using criu_format::kAllocGtt;
using criu_format::kAllocVram;
using testing::TempDir;

constexpr uint32_t kGpuA = 0xc0de;
constexpr uint32_t kGpuB = 0x1a2b;
constexpr uint32_t kChunk = 4096;

void WriteSample(const std::filesystem::path& dir) {
  testing::WriteCheckpoint(
      dir, 3, {kGpuA, kGpuB},
      {{kGpuA, 3 * kChunk + 10, kAllocVram, testing::RandomBytes(3 * kChunk + 10, 1)},
       {kGpuB, 2 * kChunk, kAllocGtt, testing::CompressibleBytes(2 * kChunk, 2)},
       {kGpuA, kChunk + 1, kAllocVram, {}}});
  testing::WriteCheckpoint(dir, 8, {kGpuA},
                           {{kGpuA, 5000, kAllocVram, testing::RandomBytes(5000, 3)}});
}

// All raw bytes of a source, chunk by chunk, decoded with the per-read checksum.
std::vector<std::vector<uint8_t>> ReadAllRaw(const ImageSource& source) {
  std::vector<std::vector<uint8_t>> chunks;
  const manifest::Manifest& m = source.manifest();
  for (int b = 0; b < m.bos_size(); ++b) {
    for (int c = 0; c < m.bos(b).chunks_size(); ++c) {
      auto stored = source.ReadChunk(static_cast<uint32_t>(b), static_cast<uint32_t>(c));
      EXPECT_TRUE(stored.ok()) << stored.status().ToString();
      if (!stored.ok()) return {};
      manifest::Chunk chunk;
      chunk.set_codec(stored->codec);
      chunk.set_raw_length(stored->raw_length);
      chunk.set_checksum(stored->checksum);
      std::vector<uint8_t> raw(stored->raw_length);
      Status s = DecodeChunk(chunk, stored->bytes, raw, "test");
      EXPECT_TRUE(s.ok()) << s.ToString();
      chunks.push_back(std::move(raw));
    }
  }
  return chunks;
}

TEST(ImageSourceTest, BothFormatsServeIdenticalRawBytes) {
  TempDir dir;
  WriteSample(dir.path());
  auto criu = ImageSource::Open(dir.path(), kChunk);
  ASSERT_TRUE(criu.ok()) << criu.status().ToString();
  EXPECT_FALSE((*criu)->is_lazy());
  EXPECT_EQ((*criu)->chunk_size(), kChunk);
  auto raw_chunks = ReadAllRaw(**criu);
  ASSERT_EQ(raw_chunks.size(), 4u + 2 + 2 + 2);

  auto checkpoint = CriuCheckpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok());
  ConvertOptions options;
  options.chunk_size = kChunk;
  ASSERT_TRUE(ConvertToLazyImage(*checkpoint, options).ok());
  auto lazy = ImageSource::Open(dir.path(), kChunk);
  ASSERT_TRUE(lazy.ok()) << lazy.status().ToString();
  EXPECT_TRUE((*lazy)->is_lazy());
  EXPECT_EQ(ReadAllRaw(**lazy), raw_chunks);

  // The in-memory manifest describes the same BOs as the converted one.
  const manifest::Manifest& a = (*criu)->manifest();
  const manifest::Manifest& b = (*lazy)->manifest();
  ASSERT_EQ(a.bos_size(), b.bos_size());
  for (int i = 0; i < a.bos_size(); ++i) {
    EXPECT_EQ(a.bos(i).process_id(), b.bos(i).process_id());
    EXPECT_EQ(a.bos(i).bo_index(), b.bos(i).bo_index());
    EXPECT_EQ(a.bos(i).size(), b.bos(i).size());
    EXPECT_EQ(a.bos(i).source_file(), b.bos(i).source_file());
    EXPECT_EQ(a.bos(i).source_offset(), b.bos(i).source_offset());
    EXPECT_EQ(a.bos(i).chunks_size(), b.bos(i).chunks_size());
  }
  EXPECT_EQ(a.devices_size(), b.devices_size());
}

TEST(ImageSourceTest, CriuChunksAreAbsoluteFileRanges) {
  TempDir dir;
  WriteSample(dir.path());
  auto source = ImageSource::Open(dir.path(), kChunk);
  ASSERT_TRUE(source.ok());
  const manifest::Manifest& m = (*source)->manifest();
  // BO 2 of process 3 is GPU A's second content BO: it starts after BO 0 in the pages file.
  const manifest::Bo& bo = m.bos(2);
  EXPECT_EQ(bo.source_file(), "amdgpu-pages-3-c0de.img");
  EXPECT_EQ(bo.source_offset(), 3 * kChunk + 10);
  ASSERT_EQ(bo.chunks_size(), 2);
  EXPECT_EQ(bo.chunks(1).stored_offset(), 8 + bo.source_offset() + kChunk);
  EXPECT_EQ(bo.chunks(1).stored_length(), 1u);
  EXPECT_EQ(bo.chunks(1).raw_length(), 1u);
  EXPECT_EQ(bo.chunks(1).codec(), manifest::CODEC_RAW);

  auto where = (*source)->LocateChunk(0, 3);
  ASSERT_TRUE(where.ok());
  EXPECT_EQ(where->offset, 8 + 3 * kChunk);
  EXPECT_EQ(where->length, 10u);
  std::vector<uint8_t> direct(10);
  ASSERT_EQ(::pread(where->fd, direct.data(), 10, static_cast<off_t>(where->offset)), 10);
  auto chunk = (*source)->ReadChunk(0, 3);
  ASSERT_TRUE(chunk.ok());
  EXPECT_EQ(chunk->bytes, direct);
  EXPECT_EQ(chunk->checksum, Checksum64(direct));
  auto expected = testing::RandomBytes(3 * kChunk + 10, 1);
  EXPECT_TRUE(std::equal(direct.begin(), direct.end(), expected.end() - 10));
}

TEST(ImageSourceTest, LazyLocateChunkPointsIntoChunkFile) {
  TempDir dir;
  WriteSample(dir.path());
  auto checkpoint = CriuCheckpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok());
  ConvertOptions options;
  options.chunk_size = kChunk;
  ASSERT_TRUE(ConvertToLazyImage(*checkpoint, options).ok());
  auto source = ImageSource::Open(dir.path());
  ASSERT_TRUE(source.ok());
  auto where = (*source)->LocateChunk(1, 1);
  ASSERT_TRUE(where.ok());
  auto chunk = (*source)->ReadChunk(1, 1);
  ASSERT_TRUE(chunk.ok());
  EXPECT_EQ(chunk->codec, manifest::CODEC_LZ4);
  ASSERT_EQ(where->length, chunk->bytes.size());
  std::vector<uint8_t> direct(where->length);
  ASSERT_EQ(::pread(where->fd, direct.data(), direct.size(), static_cast<off_t>(where->offset)),
            static_cast<ssize_t>(direct.size()));
  EXPECT_EQ(direct, chunk->bytes);
  EXPECT_GE(where->offset, kFileHeaderSize);
}

TEST(ImageSourceTest, OutOfRangeInBothFormats) {
  TempDir dir;
  WriteSample(dir.path());
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) {
      auto checkpoint = CriuCheckpoint::Open(dir.path());
      ASSERT_TRUE(checkpoint.ok());
      ConvertOptions options;
      options.chunk_size = kChunk;
      ASSERT_TRUE(ConvertToLazyImage(*checkpoint, options).ok());
    }
    auto source = ImageSource::Open(dir.path(), kChunk);
    ASSERT_TRUE(source.ok());
    EXPECT_EQ((*source)->is_lazy(), pass == 1);
    const ImageSource& s = **source;
    EXPECT_EQ(s.ReadChunk(4, 0).status().code(), Code::kOutOfRange);
    EXPECT_EQ(s.ReadChunk(UINT32_MAX, 0).status().code(), Code::kOutOfRange);
    EXPECT_EQ(s.ReadChunk(0, 4).status().code(), Code::kOutOfRange);
    EXPECT_EQ(s.ReadChunk(3, UINT32_MAX).status().code(), Code::kOutOfRange);
    EXPECT_EQ(s.LocateChunk(4, 0).status().code(), Code::kOutOfRange);
    EXPECT_EQ(s.LocateChunk(1, 2).status().code(), Code::kOutOfRange);
    EXPECT_TRUE(s.ReadChunk(3, 1).ok());
  }
}

TEST(ImageSourceTest, RejectsBadRawChunkSize) {
  TempDir dir;
  WriteSample(dir.path());
  EXPECT_EQ(ImageSource::Open(dir.path(), 1000).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(ImageSource::Open(dir.path(), 0).status().code(), Code::kInvalidArgument);
}

TEST(ImageSourceTest, CorruptLazyImageIsNotSilentlyServedRaw) {
  TempDir dir;
  WriteSample(dir.path());
  auto checkpoint = CriuCheckpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok());
  ASSERT_TRUE(ConvertToLazyImage(*checkpoint, ConvertOptions{}).ok());
  testing::FlipByte(dir / kManifestFileName, 0);
  EXPECT_EQ(ImageSource::Open(dir.path()).status().code(), Code::kCorrupt);
}

TEST(ImageSourceTest, NotACheckpoint) {
  TempDir dir;
  EXPECT_EQ(ImageSource::Open(dir.path()).status().code(), Code::kNotFound);
}

}  // namespace
}  // namespace gpulazy::image
