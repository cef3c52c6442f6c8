#include "lazy-server/image/image_source.h"

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <thread>

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

// ReadChunkInto writes exactly the stored bytes into the caller's buffer, leaves the rest of
// it alone, and refuses a buffer that is too short, in both formats.
TEST(ImageSourceTest, ReadChunkIntoFillsOnlyTheStoredBytes) {
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
    const ImageSource& s = **source;
    const manifest::Manifest& m = s.manifest();
    for (int b = 0; b < m.bos_size(); ++b) {
      for (int c = 0; c < m.bos(b).chunks_size(); ++c) {
        const auto bo = static_cast<uint32_t>(b);
        const auto chunk = static_cast<uint32_t>(c);
        auto expected = s.ReadChunk(bo, chunk);
        ASSERT_TRUE(expected.ok());
        auto length = s.StoredLength(bo, chunk);
        ASSERT_TRUE(length.ok());
        EXPECT_EQ(*length, expected->bytes.size());
        std::vector<uint8_t> buffer(2 * kChunk, 0xa5);  // poisoned, larger than any chunk
        auto info = s.ReadChunkInto(bo, chunk, buffer);
        ASSERT_TRUE(info.ok()) << info.status().ToString();
        EXPECT_EQ(info->stored_length, expected->bytes.size());
        EXPECT_EQ(info->codec, expected->codec);
        EXPECT_EQ(info->raw_length, expected->raw_length);
        EXPECT_EQ(info->checksum, expected->checksum);
        EXPECT_TRUE(std::equal(expected->bytes.begin(), expected->bytes.end(), buffer.begin()));
        EXPECT_TRUE(std::all_of(buffer.begin() + info->stored_length, buffer.end(),
                                [](uint8_t v) { return v == 0xa5; }))
            << "BO " << b << " chunk " << c << " wrote past its stored bytes";
        if (info->stored_length > 0) {
          auto short_read =
              s.ReadChunkInto(bo, chunk, std::span<uint8_t>(buffer).first(info->stored_length - 1));
          EXPECT_EQ(short_read.status().code(), Code::kInvalidArgument);
        }
      }
    }
    EXPECT_EQ(s.ReadChunkInto(4, 0, {}).status().code(), Code::kOutOfRange);
  }
}

// A CRIU checkpoint records no checksums: the first read of a chunk hashes it, later reads (any
// session sharing the source) reuse the hash, which equals a fresh hash of the bytes.
TEST(ImageSourceTest, CriuChecksumsAreComputedOncePerChunk) {
  TempDir dir;
  WriteSample(dir.path());
  auto source = ImageSource::Open(dir.path(), kChunk);
  ASSERT_TRUE(source.ok());
  const ImageSource& s = **source;
  EXPECT_EQ(s.checksums_computed(), 0u);
  std::vector<uint8_t> buffer(kChunk);
  auto first = s.ReadChunkInto(0, 1, buffer);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->checksum, Checksum64(std::span<const uint8_t>(buffer).first(kChunk)));
  EXPECT_EQ(s.checksums_computed(), 1u);
  std::fill(buffer.begin(), buffer.end(), uint8_t{0});
  auto again = s.ReadChunkInto(0, 1, buffer);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->checksum, first->checksum);
  EXPECT_EQ(s.checksums_computed(), 1u) << "the second read of a chunk hashed it again";
  // The bytes are still read (only the hash is skipped).
  EXPECT_EQ(Checksum64(std::span<const uint8_t>(buffer).first(kChunk)), first->checksum);
  // Another chunk is hashed on its own first read; ReadChunk goes through the same cache.
  auto other = s.ReadChunk(1, 0);
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(other->checksum, Checksum64(other->bytes));
  EXPECT_EQ(s.checksums_computed(), 2u);
  EXPECT_TRUE(s.ReadChunk(0, 1).ok());
  EXPECT_EQ(s.checksums_computed(), 2u);

  // Threads reading every chunk at once all see the fresh hash; each chunk is hashed at least
  // once and (racing first reads aside) not once per read.
  const manifest::Manifest& m = s.manifest();
  std::vector<std::thread> threads;
  std::atomic<int> bad{0};
  constexpr int kThreads = 4;
  constexpr int kRounds = 8;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int round = 0; round < kRounds; ++round) {
        for (int b = 0; b < m.bos_size(); ++b) {
          for (int c = 0; c < m.bos(b).chunks_size(); ++c) {
            auto chunk = s.ReadChunk(static_cast<uint32_t>(b), static_cast<uint32_t>(c));
            if (!chunk.ok() || chunk->checksum != Checksum64(chunk->bytes)) ++bad;
          }
        }
      }
    });
  }
  for (std::thread& t : threads)
    t.join();
  EXPECT_EQ(bad.load(), 0);
  uint64_t chunks = 0;
  for (const manifest::Bo& bo : m.bos())
    chunks += static_cast<uint64_t>(bo.chunks_size());
  EXPECT_GE(s.checksums_computed(), chunks);
  EXPECT_LE(s.checksums_computed(), chunks + kThreads * chunks);  // not kThreads * kRounds * ...
}

TEST(ImageSourceTest, LocatedCriuChunksCarryAChecksumOnlyOnceOneWasComputed) {
  TempDir dir;
  WriteSample(dir.path());
  auto source = ImageSource::Open(dir.path(), kChunk);
  ASSERT_TRUE(source.ok());
  const ImageSource& s = **source;
  auto before = s.LocateStoredChunk(0, 2);
  ASSERT_TRUE(before.ok()) << before.status().ToString();
  ASSERT_TRUE(before->in_file.has_value());
  EXPECT_FALSE(before->has_checksum) << "locating must not read (or hash) the bytes";
  EXPECT_TRUE(before->bytes.empty());
  EXPECT_EQ(s.checksums_computed(), 0u);
  // The located range is the chunk's bytes in the named file.
  const ImageSource::StoredFile& file = s.files().at(before->in_file->file);
  std::vector<uint8_t> at_range(before->in_file->length);
  ASSERT_TRUE(ReadExactAt(file.fd.get(), before->in_file->offset, at_range, file.name).ok());
  auto read = s.ReadChunk(0, 2);
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(at_range, read->bytes);
  auto after = s.LocateStoredChunk(0, 2);
  ASSERT_TRUE(after.ok());
  EXPECT_TRUE(after->has_checksum);
  EXPECT_EQ(after->checksum, Checksum64(at_range));
  EXPECT_EQ(s.checksums_computed(), 1u);
}

// Whether a chunk's bytes are in the page cache decides if the server may send them straight
// from the file: a wrong "yes" would stall a network thread on the disk, a wrong "no" only
// costs a copy. Bytes just read are cached; ranges past the file never are; bytes the kernel
// dropped (POSIX_FADV_DONTNEED on a clean file) are not.
TEST(ImageSourceTest, InPageCacheTellsCachedRangesFromOthers) {
  TempDir dir;
  WriteSample(dir.path());
  auto source = ImageSource::Open(dir.path(), kChunk);
  ASSERT_TRUE(source.ok());
  const ImageSource& s = **source;
  auto range = s.LocateChunk(0, 1);
  ASSERT_TRUE(range.ok()) << range.status().ToString();
  ASSERT_TRUE(s.ReadChunk(0, 1).ok());
  EXPECT_TRUE(s.InPageCache(*range)) << "a chunk just read is in the page cache";

  ImageSource::DiskRange past = *range;
  past.offset = s.files().at(past.file).size;  // starts at the end of the file
  EXPECT_FALSE(s.InPageCache(past));
  ImageSource::DiskRange empty = *range;
  empty.length = 0;
  EXPECT_FALSE(s.InPageCache(empty));
  ImageSource::DiskRange no_file = *range;
  no_file.file = static_cast<uint32_t>(s.files().size());
  EXPECT_FALSE(s.InPageCache(no_file));

  // Clean pages of a disk file can be dropped; tmpfs pages are the file itself and stay.
  const int fd = s.files().at(range->file).fd.get();
  struct statfs fs {};
  ASSERT_EQ(::fstatfs(fd, &fs), 0);
  if (fs.f_type != TMPFS_MAGIC) {
    ASSERT_EQ(::fdatasync(fd), 0);
    ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
    EXPECT_FALSE(s.InPageCache(*range)) << "dropped from the page cache, still reported cached";
    ASSERT_TRUE(s.ReadChunk(0, 1).ok());
    EXPECT_TRUE(s.InPageCache(*range)) << "read again: cached again";
  }
  EXPECT_FALSE(PageCacheProbe().Cached(0, 1)) << "an empty probe knows of nothing cached";
}

TEST(ImageSourceTest, LazyImagesUseRecordedChecksums) {
  TempDir dir;
  WriteSample(dir.path());
  auto checkpoint = CriuCheckpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok());
  ConvertOptions options;
  options.chunk_size = kChunk;
  ASSERT_TRUE(ConvertToLazyImage(*checkpoint, options).ok());
  auto source = ImageSource::Open(dir.path());
  ASSERT_TRUE(source.ok());
  ASSERT_TRUE((*source)->is_lazy());
  auto chunk = (*source)->ReadChunk(0, 0);
  ASSERT_TRUE(chunk.ok());
  EXPECT_EQ(chunk->checksum, (*source)->manifest().bos(0).chunks(0).checksum());
  EXPECT_EQ((*source)->checksums_computed(), 0u);
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
