// Unit tests of the synthetic checkpoint generator: determinism, exact sizes, BO kinds and
// layout, content kinds, sparse zero pools, and that CriuCheckpoint::Open accepts the result.
#include "lazy-server/image/synth.h"

#include <gtest/gtest.h>
#include <lz4.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <set>

#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/io.h"
#include "proto/checksum.h"
#include "proto/criu_file.h"
#include "tests/support/files.h"
#include "tests/support/temp_dir.h"

namespace gpulazy::image {
namespace {

namespace cf = criu_format;

using ::gpulazy::testing::TempDir;

std::string ReadFile(const std::filesystem::path& path) {
  return ::gpulazy::testing::ReadWholeFile(path);
}

SynthOptions Options(const std::filesystem::path& out, uint64_t bytes, uint32_t gpus = 2,
                     uint32_t bos = 16, uint32_t processes = 1, uint64_t seed = 1) {
  SynthOptions options;
  options.out = out;
  options.total_bytes = bytes;
  options.gpus = gpus;
  options.bos = bos;
  options.processes = processes;
  options.seed = seed;
  return options;
}

// The raw bytes of one content BO, read from its pages file.
std::vector<uint8_t> ReadBo(const CriuCheckpoint& checkpoint, const ContentBo& bo) {
  std::vector<uint8_t> bytes(bo.size);
  auto fd = OpenForRead(checkpoint.dir() / bo.pages_file);
  EXPECT_TRUE(fd.ok()) << fd.status().ToString();
  if (!fd.ok()) return bytes;
  Status status = ReadExactAt(fd->get(), cf::kHeaderSize + bo.pages_offset, bytes,
                              checkpoint.dir() / bo.pages_file);
  EXPECT_TRUE(status.ok()) << status.ToString();
  return bytes;
}

// LZ4 compressed size / raw size of a sample of the bytes.
double Lz4Ratio(std::span<const uint8_t> bytes) {
  size_t n = std::min<size_t>(bytes.size(), 1 << 20);
  std::vector<char> out(LZ4_compressBound(static_cast<int>(n)));
  int stored = LZ4_compress_default(reinterpret_cast<const char*>(bytes.data()), out.data(),
                                    static_cast<int>(n), static_cast<int>(out.size()));
  return static_cast<double>(stored) / static_cast<double>(n);
}

TEST(SynthTest, SameSeedGivesIdenticalFilesAndOtherSeedsDiffer) {
  TempDir a, b, c;
  auto ra = SynthesizeCheckpoint(Options(a.path(), 16 << 20, 2, 16, 2, 42));
  auto rb = SynthesizeCheckpoint(Options(b.path(), 16 << 20, 2, 16, 2, 42));
  auto rc = SynthesizeCheckpoint(Options(c.path(), 16 << 20, 2, 16, 2, 43));
  ASSERT_TRUE(ra.ok()) << ra.status().ToString();
  ASSERT_TRUE(rb.ok()) << rb.status().ToString();
  ASSERT_TRUE(rc.ok()) << rc.status().ToString();
  ASSERT_EQ(ra->files, rb->files);
  for (const auto& name : ra->files)
    EXPECT_EQ(ReadFile(a.path() / name), ReadFile(b.path() / name)) << name;
  bool any_differs = false;
  for (const auto& name : ra->files)
    if (!std::filesystem::exists(c.path() / name) ||
        ReadFile(a.path() / name) != ReadFile(c.path() / name))
      any_differs = true;
  EXPECT_TRUE(any_differs);
}

TEST(SynthTest, ContentBytesSumExactlyToTotal) {
  struct Case {
    uint64_t bytes;
    uint32_t gpus, bos, processes;
  };
  for (const Case& c :
       {Case{8 << 20, 1, 1, 1}, Case{12345 * 4096ull, 3, 7, 2}, Case{64 << 20, 8, 40, 3},
        Case{13 * 4096ull, 2, 16, 1}, Case{(5 << 20) + 4096, 4, 3, 5}}) {
    TempDir dir;
    auto report = SynthesizeCheckpoint(Options(dir.path(), c.bytes, c.gpus, c.bos, c.processes));
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    EXPECT_EQ(report->content_bytes, c.bytes);
    uint64_t by_gpu = 0;
    for (const auto& [gpu, bytes] : report->bytes_by_gpu)
      by_gpu += bytes;
    EXPECT_EQ(by_gpu, c.bytes);

    auto checkpoint = CriuCheckpoint::Open(dir.path());
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
    EXPECT_EQ(checkpoint->content_bytes(), c.bytes);
    ASSERT_EQ(checkpoint->processes().size(), c.processes);
    for (const auto& process : checkpoint->processes())
      EXPECT_EQ(process.message.bos_size(), static_cast<int>(c.bos));
  }
}

TEST(SynthTest, HasEveryBoKindAndOnlyVramAndGttHaveContents) {
  TempDir dir;
  auto report = SynthesizeCheckpoint(Options(dir.path(), 32 << 20, 2, 16, 1));
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  EXPECT_GT(report->vram_bos, 0u);
  EXPECT_GT(report->gtt_bos, 0u);
  EXPECT_GT(report->userptr_bos, 0u);
  EXPECT_GT(report->doorbell_bos, 0u);
  EXPECT_EQ(report->vram_bos + report->gtt_bos + report->userptr_bos + report->doorbell_bos, 16u);

  auto checkpoint = CriuCheckpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  std::map<uint32_t, int> by_flag;
  for (const auto& bo : checkpoint->processes()[0].message.bos())
    for (uint32_t flag : {cf::kAllocVram, cf::kAllocGtt, cf::kAllocUserptr, cf::kAllocDoorbell})
      if (bo.alloc_flags() & flag) ++by_flag[flag];
  EXPECT_EQ(by_flag[cf::kAllocVram], static_cast<int>(report->vram_bos));
  EXPECT_EQ(by_flag[cf::kAllocGtt], static_cast<int>(report->gtt_bos));
  EXPECT_EQ(by_flag[cf::kAllocUserptr], static_cast<int>(report->userptr_bos));
  EXPECT_EQ(by_flag[cf::kAllocDoorbell], static_cast<int>(report->doorbell_bos));
  EXPECT_EQ(checkpoint->content_bos().size(), report->vram_bos + report->gtt_bos);
  for (const auto& bo : checkpoint->content_bos())
    EXPECT_TRUE(cf::HasContents(bo.alloc_flags)) << "BO " << bo.bo_index;
}

TEST(SynthTest, BoTableLooksReal) {
  TempDir dir;
  auto report = SynthesizeCheckpoint(Options(dir.path(), 256 << 20, 4, 40, 2));
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  auto checkpoint = CriuCheckpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();

  std::set<uint32_t> pids;
  for (const auto& process : checkpoint->processes()) {
    const auto& m = process.message;
    pids.insert(m.pid());
    EXPECT_FALSE(m.driver_private().empty());
    EXPECT_GT(m.object_count(), 0u);
    // Devices: distinct non-zero gpu ids and node ids, AMD MI-class, links to every other GPU.
    ASSERT_EQ(m.devices_size(), 4);
    std::set<uint32_t> gpu_ids, node_ids;
    for (const auto& d : m.devices()) {
      gpu_ids.insert(d.gpu_id());
      node_ids.insert(d.node_id());
      EXPECT_NE(d.gpu_id(), 0u);
      EXPECT_LE(d.gpu_id(), 0xffffu);
      EXPECT_EQ(d.vendor_id(), 0x1002u);
      EXPECT_GT(d.vram_size(), 0u);
      EXPECT_GT(d.num_sdma_engines(), 0u);
      EXPECT_EQ(d.io_links_count(), static_cast<uint32_t>(d.links_size()));
      EXPECT_EQ(d.links_size(), 4);  // PCIe to a CPU + XGMI to the 3 other GPUs
    }
    EXPECT_EQ(gpu_ids.size(), 4u);
    EXPECT_EQ(node_ids.size(), 4u);

    // BOs: whole pages, VAs aligned and disjoint, handles unique per GPU, sizes uneven.
    std::vector<std::pair<uint64_t, uint64_t>> ranges;
    std::set<std::pair<uint32_t, uint32_t>> handles;
    bool some_not_2mib = false;
    uint64_t largest = 0, smallest = UINT64_MAX;
    for (const auto& bo : m.bos()) {
      EXPECT_EQ(bo.size() % 4096, 0u);
      EXPECT_EQ(bo.gpu_va() % 4096, 0u);
      if (bo.size() >= (2u << 20) && !(bo.alloc_flags() & cf::kAllocUserptr)) {
        EXPECT_EQ(bo.gpu_va() % (2u << 20), 0u);
      }
      EXPECT_TRUE(gpu_ids.contains(bo.gpu_id()));
      EXPECT_TRUE(handles.emplace(bo.gpu_id(), bo.handle()).second);
      ranges.emplace_back(bo.gpu_va(), bo.size());
      if (cf::HasContents(bo.alloc_flags())) {
        some_not_2mib |= bo.size() % (2u << 20) != 0;
        largest = std::max<uint64_t>(largest, bo.size());
        smallest = std::min<uint64_t>(smallest, bo.size());
      }
    }
    std::sort(ranges.begin(), ranges.end());
    for (size_t i = 1; i < ranges.size(); ++i)
      EXPECT_LE(ranges[i - 1].first + ranges[i - 1].second, ranges[i].first) << "BO VAs overlap";
    EXPECT_TRUE(some_not_2mib);
    EXPECT_GE(largest, 8u << 20);
    EXPECT_LE(smallest, 64u << 10);
  }
  EXPECT_EQ(pids.size(), 2u);
}

TEST(SynthTest, MultipleProcessesGetTheirOwnImages) {
  TempDir dir;
  auto report = SynthesizeCheckpoint(Options(dir.path(), 24 << 20, 3, 12, 3));
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  for (uint32_t id = 1; id <= 3; ++id) {
    EXPECT_TRUE(std::filesystem::exists(dir.path() / cf::KfdImageName(id))) << id;
    for (uint32_t gpu : report->gpu_ids)
      EXPECT_TRUE(std::filesystem::exists(dir.path() / cf::PagesImageName(id, gpu))) << id;
  }
  auto checkpoint = CriuCheckpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  ASSERT_EQ(checkpoint->processes().size(), 3u);
  for (uint32_t i = 0; i < 3; ++i) {
    EXPECT_EQ(checkpoint->processes()[i].file_id, i + 1);
    EXPECT_EQ(checkpoint->processes()[i].pages_by_gpu.size(), 3u);
  }
}

TEST(SynthTest, ZeroPoolsAreZeroAndSparseOnDisk) {
  TempDir dir;
  auto report = SynthesizeCheckpoint(Options(dir.path(), 64 << 20, 2, 24, 1, 3));
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  const uint64_t zero_bytes = report->bytes_by_content[SynthContent::kZero];
  ASSERT_GT(zero_bytes, 4u << 20);

  auto checkpoint = CriuCheckpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  uint64_t all_zero_bytes = 0;
  for (const auto& bo : checkpoint->content_bos()) {
    std::vector<uint8_t> bytes = ReadBo(*checkpoint, bo);
    if (IsAllZero(bytes)) all_zero_bytes += bo.size;
  }
  EXPECT_GE(all_zero_bytes, zero_bytes);

  // The pages files occupy less disk than their length by at least most of the zero pools.
  uint64_t length = 0, allocated = 0;
  for (const auto& name : report->files) {
    struct stat st {};
    ASSERT_EQ(::stat((dir.path() / name).c_str(), &st), 0);
    length += static_cast<uint64_t>(st.st_size);
    allocated += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  EXPECT_LT(allocated, length - zero_bytes / 2)
      << "length " << length << ", allocated " << allocated << ", zero pools " << zero_bytes;
}

TEST(SynthTest, ContentKindsArePresentAndLookTheirPart) {
  TempDir dir;
  auto report = SynthesizeCheckpoint(Options(dir.path(), 48 << 20, 2, 16, 2, 5));
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  for (SynthContent kind :
       {SynthContent::kWeights, SynthContent::kZero, SynthContent::kCompressible,
        SynthContent::kDuplicate, SynthContent::kPartialZero})
    EXPECT_GT(report->bos_by_content[kind], 0u) << SynthContentName(kind);

  auto checkpoint = CriuCheckpoint::Open(dir.path());
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  bool incompressible = false, compressible = false, zero_tail = false;
  std::map<Digest128, int> first_pages;  // digest of a BO's first 64 KiB -> how many BOs
  for (const auto& bo : checkpoint->content_bos()) {
    std::vector<uint8_t> bytes = ReadBo(*checkpoint, bo);
    if (IsAllZero(bytes)) continue;
    double ratio = Lz4Ratio(bytes);
    incompressible |= ratio > 0.99;
    compressible |= ratio < 0.5;
    const size_t half = bytes.size() / 2 / 4096 * 4096;
    zero_tail |= half > 0 && IsAllZero(std::span(bytes).subspan(bytes.size() - 4096)) &&
                 !IsAllZero(std::span(bytes).first(4096));
    if (bytes.size() >= (64u << 10)) ++first_pages[ContentDigest(std::span(bytes).first(64 << 10))];
  }
  EXPECT_TRUE(incompressible);
  EXPECT_TRUE(compressible);
  EXPECT_TRUE(zero_tail);
  bool duplicated = false;
  for (const auto& [digest, count] : first_pages)
    duplicated |= count > 1;
  EXPECT_TRUE(duplicated) << "no two BOs share contents";
}

TEST(SynthTest, RejectsBadOptionsNamingTheOption) {
  TempDir dir;
  struct Case {
    SynthOptions options;
    const char* needle;
  };
  std::vector<Case> cases = {
      {Options(dir.path(), 8 << 20, 0), "--gpus"},
      {Options(dir.path(), 8 << 20, 65), "--gpus"},
      {Options(dir.path(), 8 << 20, 2, 0), "--bos"},
      {Options(dir.path(), 8 << 20, 2, 16, 0), "--processes"},
      {Options(dir.path(), (8 << 20) + 1), "--size"},
      {Options(dir.path(), 4096, 2, 16), "--size"},
      {Options(dir.path(), 0), "--size"},
      {Options("", 8 << 20), "--out"},
  };
  for (const auto& c : cases) {
    auto report = SynthesizeCheckpoint(c.options);
    ASSERT_FALSE(report.ok()) << c.needle;
    EXPECT_EQ(report.status().code(), Code::kInvalidArgument);
    EXPECT_NE(report.status().message().find(c.needle), std::string::npos)
        << report.status().message();
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(SynthTest, RefusesADirectoryThatHoldsACheckpoint) {
  TempDir dir;
  ASSERT_TRUE(SynthesizeCheckpoint(Options(dir.path(), 1 << 20, 1, 4)).ok());
  auto again = SynthesizeCheckpoint(Options(dir.path(), 1 << 20, 1, 4));
  ASSERT_FALSE(again.ok());
  EXPECT_NE(again.status().message().find("already holds a checkpoint"), std::string::npos)
      << again.status().message();
}

}  // namespace
}  // namespace gpulazy::image
