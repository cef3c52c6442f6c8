#include "lazy-server/image/criu_checkpoint.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include "lazy-server/image/image_source.h"
#include "proto/criu_file.h"
#include "tests/image/test_util.h"

namespace gpulazy::image {
namespace {

using criu_format::kAllocDoorbell;
using criu_format::kAllocGtt;
using criu_format::kAllocUserptr;
using criu_format::kAllocVram;
using testing::BoSpec;
using testing::HandBo;
using testing::HandDevice;
using testing::HandProcess;
using ::testing::HasSubstr;
using ::testing::Not;
using testing::PbWriter;
using testing::TempDir;
using testing::WithCriuHeader;
using testing::WriteCheckpoint;
using testing::WriteFile;

constexpr uint32_t kGpuA = 0xc0de;
constexpr uint32_t kGpuB = 0x1a2b;

std::string PagesBytes(const std::vector<std::vector<uint8_t>>& bos) {
  std::string payload;
  for (const auto& bo : bos)
    payload.append(bo.begin(), bo.end());
  return WithCriuHeader(payload);
}

// --- CRIU wire compatibility, against bytes built field by field -----------------------------

TEST(CriuCheckpointTest, ReadsHandBuiltImageWithCriuFieldNumbers) {
  TempDir dir;
  std::vector<PbWriter> bos = {
      HandBo(0x1000'0000, 4096, kAllocVram, kGpuA, 11),
      HandBo(0x2000'0000, 8192, kAllocUserptr, kGpuA, 12),
      HandBo(0x3000'0000, 100, kAllocGtt, kGpuB, 13),
      HandBo(0x4000'0000, 4096, kAllocDoorbell, kGpuA, 14),
      HandBo(0x5000'0000, 10, kAllocVram | criu_format::kAllocWritable, kGpuA, 15),
  };
  WriteFile(dir / "amdgpu-kfd-3.img",
            WithCriuHeader(HandProcess({HandDevice(kGpuA), HandDevice(kGpuB, 200)}, bos).str()));
  auto a0 = testing::RandomBytes(4096, 1);
  auto a4 = testing::RandomBytes(10, 2);
  auto b2 = testing::RandomBytes(100, 3);
  WriteFile(dir / "amdgpu-pages-3-c0de.img", PagesBytes({a0, a4}));
  WriteFile(dir / "amdgpu-pages-3-1a2b.img", PagesBytes({b2}));

  auto checkpoint = CriuCheckpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  ASSERT_EQ(checkpoint->processes().size(), 1u);
  const KfdProcessImage& image = checkpoint->processes()[0];
  EXPECT_EQ(image.file_id, 3u);
  EXPECT_EQ(image.file_name, "amdgpu-kfd-3.img");
  const criu::KfdProcess& m = image.message;
  EXPECT_EQ(m.pid(), 4242u);
  EXPECT_EQ(m.gpu_count(), 2u);
  EXPECT_EQ(m.cpu_count(), 16u);
  EXPECT_EQ(m.bo_count(), 5u);
  EXPECT_EQ(m.object_count(), 3u);
  EXPECT_EQ(m.shared_mem_size(), 1ull << 33);
  EXPECT_EQ(m.shared_mem_magic(), 0x43524955u);
  EXPECT_EQ(m.driver_private(), std::string("driver-private\0blob", 19));
  ASSERT_EQ(m.devices_size(), 2);
  const criu::KfdDevice& d = m.devices(1);
  EXPECT_EQ(d.node_id(), 201u);
  EXPECT_EQ(d.gpu_id(), kGpuB);
  EXPECT_EQ(d.simd_count(), 204u);
  EXPECT_EQ(d.drm_render_minor(), 221u);
  EXPECT_EQ(d.hive_id(), 0x1234'5678'9abc'def0ull);
  EXPECT_EQ(d.num_sdma_engines(), 223u);
  EXPECT_EQ(d.vram_public(), 230u);
  EXPECT_EQ(d.vram_size(), 17ull << 30);
  ASSERT_EQ(d.links_size(), 1);
  EXPECT_EQ(d.links(0).link_type(), 2u);
  EXPECT_EQ(d.links(0).peer_node_id(), 7u);
  ASSERT_EQ(m.bos_size(), 5);
  EXPECT_EQ(m.bos(4).gpu_va(), 0x5000'0000u);
  EXPECT_EQ(m.bos(4).size(), 10u);
  EXPECT_EQ(m.bos(4).mmap_offset(), 0x5000'0000u ^ 0xffff);
  EXPECT_EQ(m.bos(4).alloc_flags(), kAllocVram | criu_format::kAllocWritable);
  EXPECT_EQ(m.bos(4).gpu_id(), kGpuA);
  EXPECT_EQ(m.bos(4).handle(), 15u);

  // USERPTR and DOORBELL BOs have no pages; the VRAM BO after them follows the first one.
  const auto& content = checkpoint->content_bos();
  ASSERT_EQ(content.size(), 3u);
  EXPECT_EQ(content[0].bo_index, 0u);
  EXPECT_EQ(content[0].pages_file, "amdgpu-pages-3-c0de.img");
  EXPECT_EQ(content[0].pages_offset, 0u);
  EXPECT_EQ(content[1].bo_index, 2u);
  EXPECT_EQ(content[1].pages_file, "amdgpu-pages-3-1a2b.img");
  EXPECT_EQ(content[1].pages_offset, 0u);
  EXPECT_EQ(content[2].bo_index, 4u);
  EXPECT_EQ(content[2].process_id, 3u);
  EXPECT_EQ(content[2].gpu_va, 0x5000'0000u);
  EXPECT_EQ(content[2].pages_offset, 4096u);
  EXPECT_EQ(checkpoint->content_bytes(), 4096u + 10 + 100);
  EXPECT_EQ(image.pages_by_gpu.at(kGpuA).payload_length, 4106u);
  EXPECT_EQ(image.pages_by_gpu.at(kGpuB).payload_length, 100u);

  // The bytes at the derived offset are BO 4's.
  auto source = ImageSource::Open(dir.path(), 4096);
  ASSERT_TRUE(source.ok()) << source.status().ToString();
  auto chunk = (*source)->ReadChunk(2, 0);
  ASSERT_TRUE(chunk.ok());
  EXPECT_EQ(chunk->bytes, a4);
}

TEST(CriuCheckpointTest, WriterProducesCriuBytes) {
  // Serializing the parsed hand-built message must give back the very same bytes: our field
  // numbers, types and order match CRIU's.
  TempDir dir;
  std::string payload =
      HandProcess({HandDevice(kGpuA)}, {HandBo(0x1000, 4096, kAllocVram, kGpuA, 1)}).str();
  criu::KfdProcess process;
  ASSERT_TRUE(process.ParseFromString(payload));
  ASSERT_TRUE(WriteKfdImage(dir.path(), 9, process).ok());
  EXPECT_EQ(testing::ReadFile(dir / "amdgpu-kfd-9.img"), WithCriuHeader(payload));
}

TEST(CriuCheckpointTest, WriterRefusesIncompleteMessage) {
  TempDir dir;
  criu::KfdProcess process;
  process.set_pid(1);
  Status s = WriteKfdImage(dir.path(), 1, process);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(dir / "amdgpu-kfd-1.img"));
}

// --- Round trips ---------------------------------------------------------------------------

TEST(CriuCheckpointTest, RoundTripSeveralProcessesInNumericOrder) {
  TempDir dir;
  WriteCheckpoint(dir.path(), 10, {kGpuA},
                  {{kGpuA, 5000, kAllocVram, testing::RandomBytes(5000, 4)}});
  WriteCheckpoint(dir.path(), 2, {kGpuA, kGpuB},
                  {{kGpuB, 300, kAllocGtt, testing::RandomBytes(300, 5)},
                   {kGpuA, 700, kAllocVram, testing::RandomBytes(700, 6)},
                   {kGpuB, 50, kAllocVram, testing::RandomBytes(50, 7)}});
  auto checkpoint = CriuCheckpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  ASSERT_EQ(checkpoint->processes().size(), 2u);
  EXPECT_EQ(checkpoint->processes()[0].file_id, 2u);  // not "10" < "2" as strings
  EXPECT_EQ(checkpoint->processes()[1].file_id, 10u);
  const auto& bos = checkpoint->content_bos();
  ASSERT_EQ(bos.size(), 4u);
  EXPECT_EQ(bos[0].process_id, 2u);
  EXPECT_EQ(bos[0].pages_file, "amdgpu-pages-2-1a2b.img");
  EXPECT_EQ(bos[2].pages_file, "amdgpu-pages-2-1a2b.img");
  EXPECT_EQ(bos[2].pages_offset, 300u);
  EXPECT_EQ(bos[1].pages_offset, 0u);
  EXPECT_EQ(bos[3].process_id, 10u);
  EXPECT_EQ(checkpoint->content_bytes(), 6050u);
  // No temporaries left behind by the writers.
  for (const auto& entry : std::filesystem::directory_iterator(dir.path()))
    EXPECT_THAT(entry.path().filename().string(), Not(HasSubstr(".tmp"))) << entry.path();
}

TEST(CriuCheckpointTest, IgnoresUnrelatedFiles) {
  TempDir dir;
  WriteCheckpoint(dir.path(), 1, {kGpuA}, {{kGpuA, 64, kAllocVram, testing::RandomBytes(64, 1)}});
  WriteFile(dir / "amdgpu-renderD-1.img", "xx");
  WriteFile(dir / "notes.txt", "hello");
  WriteFile(dir / "amdgpu-kfd-1.img.tmp.abcdef", "partial");
  WriteFile(dir / "pages-1.img", "");
  auto checkpoint = CriuCheckpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_EQ(checkpoint->processes().size(), 1u);
}

class BadKfdNameTest : public ::testing::TestWithParam<std::string> {};
TEST_P(BadKfdNameTest, Rejected) {
  TempDir dir;
  WriteCheckpoint(dir.path(), 1, {kGpuA}, {{kGpuA, 64, kAllocVram, testing::RandomBytes(64, 1)}});
  WriteFile(dir / GetParam(), "whatever");
  auto checkpoint = CriuCheckpoint::Open(dir.path());
  ASSERT_FALSE(checkpoint.ok());
  EXPECT_EQ(checkpoint.status().code(), Code::kCorrupt);
  EXPECT_THAT(checkpoint.status().message(), HasSubstr(GetParam()));
  EXPECT_THAT(checkpoint.status().message(), HasSubstr("not a CRIU file id"));
}
INSTANTIATE_TEST_SUITE_P(Names, BadKfdNameTest,
                         ::testing::Values("amdgpu-kfd-abc.img", "amdgpu-kfd-007.img",
                                           "amdgpu-kfd-4294967296.img",
                                           "amdgpu-kfd-99999999999999999999.img", "amdgpu-kfd-.img",
                                           "amdgpu-kfd--1.img", "amdgpu-kfd-1x.img"));

TEST(CriuCheckpointTest, LargestFileIdAccepted) {
  TempDir dir;
  WriteCheckpoint(dir.path(), UINT32_MAX, {kGpuA},
                  {{kGpuA, 8, kAllocVram, testing::RandomBytes(8, 1)}});
  auto checkpoint = CriuCheckpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_EQ(checkpoint->processes()[0].file_id, UINT32_MAX);
}

TEST(CriuCheckpointTest, EmptyOrMissingDirectoryIsNotFound) {
  TempDir dir;
  EXPECT_EQ(CriuCheckpoint::Open(dir.path()).status().code(), Code::kNotFound);
  EXPECT_EQ(CriuCheckpoint::Open(dir / "nope").status().code(), Code::kNotFound);
}

// --- Broken KFD images ---------------------------------------------------------------------

Status OpenWithKfdBytes(const std::string& bytes) {
  TempDir dir;
  WriteFile(dir / "amdgpu-kfd-5.img", bytes);
  return CriuCheckpoint::Open(dir.path()).status();
}

std::string ValidPayload() {
  return HandProcess({HandDevice(kGpuA)}, {HandBo(0x1000, 0, kAllocVram, kGpuA, 1)}).str();
}

TEST(CriuCheckpointTest, ValidPayloadHelperIsValid) {
  EXPECT_TRUE(OpenWithKfdBytes(WithCriuHeader(ValidPayload())).ok());
}

TEST(CriuCheckpointTest, ShorterThanHeaderIsCorrupt) {
  Status s = OpenWithKfdBytes("\x05\x00\x00");
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("amdgpu-kfd-5.img"));
  EXPECT_THAT(s.message(), HasSubstr("shorter than"));
}

TEST(CriuCheckpointTest, TruncatedPayloadIsCorrupt) {
  std::string payload = ValidPayload();
  std::string bytes = WithCriuHeader(payload).substr(0, 8 + payload.size() / 2);
  Status s = OpenWithKfdBytes(bytes);
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr(fmt::format("header says {} bytes", payload.size())));
}

TEST(CriuCheckpointTest, HeaderSmallerThanPayloadIsCorrupt) {
  std::string payload = ValidPayload();
  Status s = OpenWithKfdBytes(WithCriuHeader(payload, payload.size() - 1));
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("header says"));
}

TEST(CriuCheckpointTest, HugeHeaderIsCorrupt) {
  Status s = OpenWithKfdBytes(WithCriuHeader(ValidPayload(), UINT64_MAX));
  EXPECT_EQ(s.code(), Code::kCorrupt);
}

TEST(CriuCheckpointTest, OversizedFileRefusedBeforeReading) {
  TempDir dir;
  std::filesystem::path path = dir / "amdgpu-kfd-5.img";
  WriteFile(path, "");
  std::filesystem::resize_file(path, 65ull << 20);  // sparse
  Status s = CriuCheckpoint::Open(dir.path()).status();
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("larger than"));
}

TEST(CriuCheckpointTest, GarbageProtobufIsCorrupt) {
  std::string garbage = "\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01\x02\x03";
  Status s = OpenWithKfdBytes(WithCriuHeader(garbage));
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("amdgpu-kfd-5.img"));
}

TEST(CriuCheckpointTest, MissingRequiredFieldIsCorrupt) {
  Status s = OpenWithKfdBytes(
      WithCriuHeader(HandProcess({HandDevice(kGpuA)}, {}, -1, /*with_magic=*/false).str()));
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("shared_mem_magic"));
}

TEST(CriuCheckpointTest, DeviceMissingRequiredFieldIsCorrupt) {
  Status s = OpenWithKfdBytes(
      WithCriuHeader(HandProcess({HandDevice(kGpuA, 100, /*skip=*/31)}, {}).str()));
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("vram_size"));
}

TEST(CriuCheckpointTest, NumOfBosMismatchIsCorrupt) {
  Status s = OpenWithKfdBytes(WithCriuHeader(HandProcess({HandDevice(kGpuA)},
                                                         {HandBo(0x1000, 0, kAllocVram, kGpuA, 1),
                                                          HandBo(0x2000, 0, kAllocVram, kGpuA, 2)},
                                                         /*num_of_bos=*/3)
                                                 .str()));
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("num_of_bos says 3"));
}

TEST(CriuCheckpointTest, BoOnUnknownGpuIsCorrupt) {
  Status s = OpenWithKfdBytes(WithCriuHeader(
      HandProcess({HandDevice(kGpuA)}, {HandBo(0x1000, 0, kAllocUserptr, 0xbeef, 1)}).str()));
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("0xbeef"));
}

TEST(CriuCheckpointTest, DuplicateGpuIdIsCorrupt) {
  Status s = OpenWithKfdBytes(
      WithCriuHeader(HandProcess({HandDevice(kGpuA), HandDevice(kGpuA)}, {}).str()));
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("twice"));
}

TEST(CriuCheckpointTest, BoSizesOverflowingSixtyFourBitsAreCorrupt) {
  Status s = OpenWithKfdBytes(WithCriuHeader(
      HandProcess({HandDevice(kGpuA)}, {HandBo(0x1000, UINT64_MAX - 100, kAllocVram, kGpuA, 1),
                                        HandBo(0x2000, 200, kAllocVram, kGpuA, 2)})
          .str()));
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("overflows"));
}

// --- Pages files ---------------------------------------------------------------------------

TEST(CriuCheckpointTest, PagesHeaderShorterThanBoTableNamesBoth) {
  TempDir dir;
  WriteFile(dir / "amdgpu-kfd-3.img",
            WithCriuHeader(
                HandProcess({HandDevice(kGpuA)}, {HandBo(0x1000, 2u << 20, kAllocVram, kGpuA, 1)})
                    .str()));
  WriteFile(dir / "amdgpu-pages-3-c0de.img", WithCriuHeader(std::string(1u << 20, 'x')));
  Status s = CriuCheckpoint::Open(dir.path()).status();
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(),
              HasSubstr("amdgpu-pages-3-c0de.img: header says 1048576 bytes but BO table needs "
                        "2097152"));
}

TEST(CriuCheckpointTest, BoTableOverrunningPagesFileIsCorrupt) {
  // The header agrees with the BO table, but the file holds fewer bytes than it claims.
  TempDir dir;
  WriteFile(
      dir / "amdgpu-kfd-3.img",
      WithCriuHeader(HandProcess({HandDevice(kGpuA)}, {HandBo(0x1000, 4096, kAllocVram, kGpuA, 1),
                                                       HandBo(0x2000, 4096, kAllocGtt, kGpuA, 2)})
                         .str()));
  WriteFile(dir / "amdgpu-pages-3-c0de.img", WithCriuHeader(std::string(6000, 'x'), 8192));
  Status s = CriuCheckpoint::Open(dir.path()).status();
  EXPECT_EQ(s.code(), Code::kCorrupt);
  EXPECT_THAT(s.message(), HasSubstr("amdgpu-pages-3-c0de.img"));
  EXPECT_THAT(s.message(), HasSubstr("holds 6000"));
}

TEST(CriuCheckpointTest, PagesFileLongerThanHeaderIsCorrupt) {
  TempDir dir;
  WriteFile(
      dir / "amdgpu-kfd-3.img",
      WithCriuHeader(
          HandProcess({HandDevice(kGpuA)}, {HandBo(0x1000, 4096, kAllocVram, kGpuA, 1)}).str()));
  WriteFile(dir / "amdgpu-pages-3-c0de.img", WithCriuHeader(std::string(4097, 'x'), 4096));
  EXPECT_EQ(CriuCheckpoint::Open(dir.path()).status().code(), Code::kCorrupt);
}

TEST(CriuCheckpointTest, PagesFileShorterThanItsHeaderIsCorrupt) {
  TempDir dir;
  WriteFile(
      dir / "amdgpu-kfd-3.img",
      WithCriuHeader(
          HandProcess({HandDevice(kGpuA)}, {HandBo(0x1000, 4096, kAllocVram, kGpuA, 1)}).str()));
  WriteFile(dir / "amdgpu-pages-3-c0de.img", "abc");
  EXPECT_EQ(CriuCheckpoint::Open(dir.path()).status().code(), Code::kCorrupt);
}

TEST(CriuCheckpointTest, MissingPagesFileIsNotFound) {
  TempDir dir;
  WriteFile(
      dir / "amdgpu-kfd-3.img",
      WithCriuHeader(
          HandProcess({HandDevice(kGpuA)}, {HandBo(0x1000, 4096, kAllocVram, kGpuA, 1)}).str()));
  Status s = CriuCheckpoint::Open(dir.path()).status();
  EXPECT_EQ(s.code(), Code::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("amdgpu-pages-3-c0de.img"));
}

TEST(CriuCheckpointTest, ZeroLengthBosNeedNoPagesFile) {
  TempDir dir;
  WriteFile(dir / "amdgpu-kfd-3.img",
            WithCriuHeader(HandProcess({HandDevice(kGpuA), HandDevice(kGpuB)},
                                       {HandBo(0x1000, 0, kAllocVram, kGpuA, 1),
                                        HandBo(0x2000, 0, kAllocGtt, kGpuB, 2)})
                               .str()));
  // GPU B's empty pages file exists with header 0; GPU A's is absent. Both are fine.
  WriteFile(dir / "amdgpu-pages-3-1a2b.img", WithCriuHeader(""));
  auto checkpoint = CriuCheckpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  EXPECT_EQ(checkpoint->content_bos().size(), 2u);
  EXPECT_EQ(checkpoint->content_bytes(), 0u);
  auto source = ImageSource::Open(dir.path(), 4096);
  ASSERT_TRUE(source.ok()) << source.status().ToString();
  EXPECT_EQ((*source)->manifest().bos(0).chunks_size(), 0);
  EXPECT_EQ((*source)->ReadChunk(0, 0).status().code(), Code::kOutOfRange);
}

TEST(CriuCheckpointTest, ZeroLengthPagesFileWithNonZeroHeaderIsCorrupt) {
  TempDir dir;
  WriteFile(dir / "amdgpu-kfd-3.img",
            WithCriuHeader(
                HandProcess({HandDevice(kGpuA)}, {HandBo(0x1000, 0, kAllocVram, kGpuA, 1)}).str()));
  WriteFile(dir / "amdgpu-pages-3-c0de.img", WithCriuHeader("abcd"));
  EXPECT_EQ(CriuCheckpoint::Open(dir.path()).status().code(), Code::kCorrupt);
}

TEST(CriuCheckpointTest, ZeroLengthBoBetweenOthersKeepsOffsets) {
  TempDir dir;
  auto a = testing::RandomBytes(100, 1);
  auto c = testing::RandomBytes(50, 2);
  WriteCheckpoint(
      dir.path(), 1, {kGpuA},
      {{kGpuA, 100, kAllocVram, a}, {kGpuA, 0, kAllocVram, {}}, {kGpuA, 50, kAllocGtt, c}});
  auto checkpoint = CriuCheckpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  ASSERT_EQ(checkpoint->content_bos().size(), 3u);
  EXPECT_EQ(checkpoint->content_bos()[1].pages_offset, 100u);
  EXPECT_EQ(checkpoint->content_bos()[2].pages_offset, 100u);
}

TEST(CriuCheckpointTest, OffsetsPastFourGiBInSparseFiles) {
  TempDir dir;
  constexpr uint64_t kGiB = 1ull << 30;
  std::vector<uint8_t> marker = testing::RandomBytes(4096, 77);
  {
    ASSERT_TRUE(WriteKfdImage(dir.path(), 1,
                              testing::MakeProcess({kGpuA}, {{kGpuA, 3 * kGiB, kAllocVram, {}},
                                                             {kGpuA, 2 * kGiB, kAllocVram, {}}}))
                    .ok());
    auto writer = PagesFileWriter::Create(dir.path(), 1, kGpuA, 5 * kGiB);
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE(writer->AppendZeros(3 * kGiB).ok());
    ASSERT_TRUE(writer->Append(marker).ok());
    ASSERT_TRUE(writer->AppendZeros(2 * kGiB - 2 * marker.size()).ok());
    ASSERT_TRUE(writer->Append(marker).ok());
    ASSERT_TRUE(writer->Finish().ok());
  }
  struct stat st;
  ASSERT_EQ(::stat((dir / "amdgpu-pages-1-c0de.img").c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), 8 + 5 * kGiB);
  EXPECT_LT(static_cast<uint64_t>(st.st_blocks) * 512, 1ull << 20);  // really sparse

  auto checkpoint = CriuCheckpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  ASSERT_EQ(checkpoint->content_bos().size(), 2u);
  EXPECT_EQ(checkpoint->content_bos()[1].pages_offset, 3 * kGiB);
  EXPECT_EQ(checkpoint->content_bytes(), 5 * kGiB);

  auto source = ImageSource::Open(dir.path(), 4096);
  ASSERT_TRUE(source.ok()) << source.status().ToString();
  const auto& bo = (*source)->manifest().bos(1);
  EXPECT_EQ(bo.source_offset(), 3 * kGiB);
  ASSERT_EQ(bo.chunks_size(), static_cast<int>(2 * kGiB / 4096));
  auto first = (*source)->ReadChunk(1, 0);
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  EXPECT_EQ(first->bytes, marker);
  auto last = (*source)->ReadChunk(1, static_cast<uint32_t>(bo.chunks_size() - 1));
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(last->bytes, marker);
  auto zero = (*source)->ReadChunk(0, 1000);
  ASSERT_TRUE(zero.ok());
  EXPECT_EQ(zero->bytes, std::vector<uint8_t>(4096, 0));
  auto where = (*source)->LocateChunk(1, 0);
  ASSERT_TRUE(where.ok());
  EXPECT_EQ(where->offset, 8 + 3 * kGiB);
}

// --- PagesFileWriter -----------------------------------------------------------------------

TEST(PagesFileWriterTest, RefusesToPassExpectedLength) {
  TempDir dir;
  auto writer = PagesFileWriter::Create(dir.path(), 1, kGpuA, 100);
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE(writer->Append(testing::RandomBytes(60, 1)).ok());
  EXPECT_EQ(writer->Append(testing::RandomBytes(41, 1)).code(), Code::kInvalidArgument);
  EXPECT_EQ(writer->AppendZeros(41).code(), Code::kInvalidArgument);
  EXPECT_EQ(writer->AppendZeros(UINT64_MAX).code(), Code::kInvalidArgument);
  EXPECT_EQ(writer->written(), 60u);
}

TEST(PagesFileWriterTest, ShortTotalLeavesNoFile) {
  TempDir dir;
  {
    auto writer = PagesFileWriter::Create(dir.path(), 1, kGpuA, 100);
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE(writer->Append(testing::RandomBytes(99, 1)).ok());
    Status s = writer->Finish();
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("99 bytes written but 100 expected"));
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(PagesFileWriterTest, WritesHeaderAndBytes) {
  TempDir dir;
  auto data = testing::RandomBytes(10, 1);
  auto writer = PagesFileWriter::Create(dir.path(), 7, 0xab, 30);
  ASSERT_TRUE(writer.ok());
  ASSERT_TRUE(writer->Append(data).ok());
  ASSERT_TRUE(writer->AppendZeros(10).ok());
  ASSERT_TRUE(writer->Append(data).ok());
  ASSERT_TRUE(writer->Finish().ok());
  EXPECT_EQ(writer->Finish().code(), Code::kInvalidArgument);  // only once
  std::string expected(data.begin(), data.end());
  expected += std::string(10, '\0');
  expected.append(data.begin(), data.end());
  EXPECT_EQ(testing::ReadFile(dir / "amdgpu-pages-7-00ab.img"), WithCriuHeader(expected));
}

}  // namespace
}  // namespace gpulazy::image
