// Protocol version 2's image table against the in-process FakeServer (docs/protocol.md,
// OpenImage): a table cut into many payload frames restores byte for byte; an image with more
// BOs than a frame header can list restores, and after a dropped connection its Have is spread
// over several frames; a table the server gets wrong fails Start with a reason, at once.
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "lazy-server/image/io.h"
#include "page-client/host_engine.h"
#include "page-client/restore_session.h"
#include "page-client/server_connection.h"
#include "proto/frame.h"
#include "tests/client/fake_server.h"

namespace gpulazy::client {
namespace {

using gpulazy::testing::FakeImage;
using gpulazy::testing::FakeServer;
using gpulazy::testing::FakeServerOptions;
using Fault = FakeServerOptions::TableFault;
using namespace std::chrono_literals;

SessionOptions TableTestOptions(const FakeServer& server) {
  SessionOptions options;
  options.endpoint = server.endpoint();
  options.image = "test-image";
  options.handshake_timeout = 5s;
  options.reconnect.initial_backoff = 10ms;
  options.reconnect.max_backoff = 100ms;
  options.reconnect.deadline = 20s;
  return options;
}

bool Matches(const HostCopyEngine& engine, const FakeImage& image) {
  for (uint32_t bo = 0; bo < image.bos.size(); ++bo) {
    Result<std::span<uint8_t>> mapping = engine.Mapping(bo);
    if (!mapping.ok() || !std::ranges::equal(*mapping, image.bos[bo])) return false;
  }
  return true;
}

// The host engine keeps one memfd per BO: an image of many BOs needs more descriptors than a
// default soft limit of 1024 allows.
void RaiseDescriptorLimit(uint64_t need) {
  Result<uint64_t> fds = RaiseOpenFileLimit();
  ASSERT_TRUE(fds.ok()) << fds.status().ToString();
  ASSERT_GT(*fds, need) << "RLIMIT_NOFILE's hard limit is too low for this test";
}

TEST(ImageTable, VersionTwoTableInManyPiecesRestoresByteExact) {
  FakeImage image = FakeImage::Small();
  FakeServerOptions server_options;
  server_options.version = 2;
  server_options.table_piece = 7;  // a frame per 7 table bytes
  FakeServer server(image, server_options);
  HostCopyEngine engine;
  RestoreSession session(TableTestOptions(server), engine);
  ASSERT_TRUE(session.Start().ok()) << session.status().ToString();
  ASSERT_EQ(session.bos().size(), 3u);
  EXPECT_EQ(session.bos()[1].size, 40000u);
  EXPECT_EQ(session.bos()[1].chunk_count, 10u);
  EXPECT_EQ(session.profile().hot_count(), 2u);
  ASSERT_EQ(session.profile().order_size(), 2);
  EXPECT_EQ(session.profile().order(0).bo(), 1u);
  ASSERT_TRUE(session.WaitHotSet(10s).ok());
  ASSERT_TRUE(session.WaitComplete(10s).ok()) << session.status().ToString();
  EXPECT_TRUE(Matches(engine, image));
}

// 12000 one-chunk BOs: a version-1 header could not list them, and the Have after the drop
// names over 9000 runs (one per BO held), more than one 64 KiB header holds.
TEST(ImageTable, ManyBosRestoreAndTheirHaveSpansSeveralFrames) {
  constexpr uint32_t kBos = 12000;
  ASSERT_NO_FATAL_FAILURE(RaiseDescriptorLimit(kBos + 100));
  FakeImage image = FakeImage::Make(std::vector<uint64_t>(kBos, 4096), 4096, 19);
  FakeServerOptions server_options;
  server_options.version = 2;
  server_options.drop_after_chunks = 10000;
  FakeServer server(image, server_options);
  HostCopyEngine engine;
  RestoreSession session(TableTestOptions(server), engine);
  ASSERT_TRUE(session.Start().ok()) << session.status().ToString();
  ASSERT_EQ(session.bos().size(), kBos);
  ASSERT_TRUE(session.WaitComplete(60s).ok()) << session.status().ToString();
  EXPECT_TRUE(Matches(engine, image));
  EXPECT_EQ(session.progress().reconnects, 1u);
  EXPECT_EQ(session.progress().duplicates, 0u);
  const std::vector<std::vector<wire::ChunkRange>> haves = server.haves();
  ASSERT_EQ(haves.size(), 2u);
  EXPECT_GT(haves[1].size(), 9000u) << "the drop came too early to need several Have frames";
  // Too many for one frame header: the client must have split them.
  wire::Header one;
  for (const wire::ChunkRange& range : haves[1])
    *one.mutable_have()->add_ranges() = range;
  EXPECT_GT(one.ByteSizeLong(), FrameLimits{}.max_header);
}

TEST(ImageTable, HaveFramesSplitRunsAndEachFitsAHeader) {
  std::vector<ChunkRun> runs;
  for (uint32_t i = 0; i < 5000; ++i)
    runs.push_back(ChunkRun{i * 3, 0xffffff00u + i % 7, 0xffffffffu});
  std::vector<wire::Header> frames = HaveFrames(runs);
  ASSERT_EQ(frames.size(), (runs.size() + kMaxRangesPerHave - 1) / kMaxRangesPerHave);
  size_t next = 0;
  for (const wire::Header& frame : frames) {
    ASSERT_TRUE(frame.has_have());
    EXPECT_LE(static_cast<size_t>(frame.have().ranges_size()), kMaxRangesPerHave);
    EXPECT_TRUE(EncodeFrameHead(frame, 0, FrameLimits{}).ok()) << frame.ByteSizeLong() << " bytes";
    for (const wire::ChunkRange& range : frame.have().ranges()) {
      ASSERT_LT(next, runs.size());
      EXPECT_EQ(range.bo(), runs[next].bo);
      EXPECT_EQ(range.first_chunk(), runs[next].first);
      EXPECT_EQ(range.chunk_count(), runs[next].count);
      ++next;
    }
  }
  EXPECT_EQ(next, runs.size());
  EXPECT_TRUE(HaveFrames({}).empty());
}

struct FaultCase {
  Fault fault;
  Code code;
  const char* says;
};

class ImageTableFault : public ::testing::TestWithParam<FaultCase> {};

TEST_P(ImageTableFault, StartFailsAtOnceWithTheReason) {
  FakeImage image = FakeImage::Small();
  FakeServerOptions server_options;
  server_options.version = 2;
  server_options.table_piece = 16;
  server_options.table_fault = GetParam().fault;
  FakeServer server(image, server_options);
  HostCopyEngine engine;
  RestoreSession session(TableTestOptions(server), engine);
  const auto start = std::chrono::steady_clock::now();
  Status status = session.Start();
  // Well inside the 5 s handshake deadline: nothing waits for bytes that will not come.
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), GetParam().code) << status.ToString();
  EXPECT_NE(status.message().find(GetParam().says), std::string::npos) << status.ToString();
  EXPECT_NE(status.message().find("opening image test-image"), std::string::npos)
      << status.ToString();
}

INSTANTIATE_TEST_SUITE_P(
    Faults, ImageTableFault,
    ::testing::Values(
        FaultCase{Fault::kAnnouncesTooMuch, Code::kResourceExhausted, "over the limit"},
        FaultCase{Fault::kPieceOverruns, Code::kCorrupt, "announced bytes missing"},
        FaultCase{Fault::kGarbage, Code::kCorrupt, "does not parse"},
        FaultCase{Fault::kBosInHeader, Code::kCorrupt, "in the header"},
        FaultCase{Fault::kOtherFrameBetween, Code::kCorrupt, "expected ImageTablePart"},
        FaultCase{Fault::kEmptyPart, Code::kCorrupt, "empty image table part"}));

// A server's chunk table (ChunkLocations) is checked against the passed files and the BO table
// before a byte is read through it.
struct ChunkTableCase {
  const char* name;
  std::function<void(wire::ChunkLocations&)> spoil;
  const char* says;
};

TEST(ChunkTable, EntriesAreCheckedAgainstTheFilesAndTheBoTable) {
  // Two BOs of 10000 and 4096 bytes in 4 KiB chunks: 3 + 1 chunks, in two files.
  ChunkTableShape shape;
  shape.bo_sizes = {10000, 4096};
  shape.chunk_size = 4096;
  shape.lazy_image = true;
  shape.max_payload = 8192;
  auto files = [] {
    ImageFileSet set;
    set.files.resize(2);
    set.files[0].name = "a";
    set.files[0].size = 20000;
    set.files[1].name = "b";
    set.files[1].size = 4096;
    return set;
  };
  wire::ChunkLocations good;
  auto add = [&](uint32_t file, uint64_t offset, uint32_t length, manifest::Codec codec) {
    good.add_file(file);
    good.add_offset(offset);
    good.add_stored_length(length);
    good.add_codec(codec);
    good.add_checksum(0x1234 + offset);
    good.add_has_checksum(true);
  };
  add(0, 0, 4096, manifest::CODEC_RAW);
  add(0, 4096, 100, manifest::CODEC_LZ4);
  add(0, 0, 0, manifest::CODEC_ZERO);
  add(1, 0, 4096, manifest::CODEC_RAW);
  {
    ImageFileSet set = files();
    ASSERT_TRUE(AdoptChunkTable(good, shape, &set).ok());
    ASSERT_EQ(set.chunk_table.size(), 4u);
    ASSERT_NE(set.Locate(0, 1), nullptr);
    EXPECT_EQ(set.Locate(0, 1)->codec, manifest::CODEC_LZ4);
    EXPECT_EQ(set.Locate(0, 1)->checksum, std::optional<uint64_t>(0x1234u + 4096));
    ASSERT_NE(set.Locate(1, 0), nullptr);
    EXPECT_EQ(set.Locate(1, 0)->file, 1u);
    EXPECT_EQ(set.Locate(0, 3), nullptr);  // BO 0 has 3 chunks
    EXPECT_EQ(set.Locate(1, 1), nullptr);
    EXPECT_EQ(set.Locate(2, 0), nullptr);
  }
  const std::vector<ChunkTableCase> cases = {
      {"file index past the list", [](auto& t) { t.set_file(3, 2); }, "2 were passed"},
      {"range past the file", [](auto& t) { t.set_offset(3, 1); }, "past the end of b"},
      {"offset past the file", [](auto& t) { t.set_offset(1, ~0ull); }, "past the end of a"},
      {"stored over the limit", [](auto& t) { t.set_stored_length(1, 9000); }, "limit 8192"},
      {"RAW shorter than raw", [](auto& t) { t.set_stored_length(0, 4000); }, "codec"},
      {"RAW of a short last chunk",
       [](auto& t) {
         t.set_stored_length(2, 4096);
         t.set_codec(2, manifest::CODEC_RAW);
       },
       "1808 raw bytes"},
      {"ZERO with bytes", [](auto& t) { t.set_stored_length(2, 10); }, "codec"},
      {"LZ4 with none", [](auto& t) { t.set_stored_length(1, 0); }, "codec"},
      {"unknown codec", [](auto& t) { t.set_codec(1, static_cast<manifest::Codec>(77)); },
       "codec 77"},
      {"lazy chunk without checksum", [](auto& t) { t.set_has_checksum(3, false); },
       "without its checksum"},
      {"a list short", [](auto& t) { t.mutable_checksum()->RemoveLast(); }, "for 4 chunks"},
      {"an entry too many",
       [](auto& t) {
         t.add_file(0);
         t.add_offset(0);
         t.add_stored_length(0);
         t.add_codec(manifest::CODEC_ZERO);
         t.add_checksum(0);
         t.add_has_checksum(true);
       },
       "for 4 chunks"},
  };
  for (const ChunkTableCase& c : cases) {
    SCOPED_TRACE(c.name);
    wire::ChunkLocations bad = good;
    c.spoil(bad);
    ImageFileSet set = files();
    Status status = AdoptChunkTable(bad, shape, &set);
    EXPECT_EQ(status.code(), Code::kCorrupt) << status.ToString();
    EXPECT_NE(status.message().find(c.says), std::string::npos) << status.ToString();
    EXPECT_TRUE(set.chunk_table.empty());
  }
}

// A server that speaks only version 1 still serves a client that offers 1..2.
TEST(ImageTable, VersionOneServerStillServes) {
  FakeImage image = FakeImage::Small();
  FakeServer server(image, {});  // version 1
  HostCopyEngine engine;
  RestoreSession session(TableTestOptions(server), engine);
  ASSERT_TRUE(session.Start().ok()) << session.status().ToString();
  EXPECT_EQ(session.profile().hot_count(), 2u);
  ASSERT_TRUE(session.WaitComplete(10s).ok()) << session.status().ToString();
  EXPECT_TRUE(Matches(engine, image));
}

}  // namespace
}  // namespace gpulazy::client
