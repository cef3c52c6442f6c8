// A chunk corrupted on disk, end to end against a real gpulazy-server (docs/hostile-input.md,
// "Corrupt a chunk on disk"):
//   - lazy image, one byte flipped in a RAW and in an LZ4 chunk's stored bytes: the client
//     detects the mismatch, fetches the chunk once more, then fails naming image, BO and chunk;
//     a recording engine proves no byte that differs from the checkpoint ever reached it;
//   - `gpulazy-client fetch` of such an image exits non-zero with that message and leaves no
//     pages file (nor a temporary) in its output directory;
//   - plain CRIU image, one byte flipped in a pages file: served as it is on disk, because its
//     checksums are computed from the disk at read time (the documented limit,
//     docs/image-format.md); a converted image notices, since `gpulazy-image verify` checks the
//     pages files against the checksums recorded at conversion.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/lazy_image.h"
#include "lazy-server/image/synth.h"
#include "page-client/host_engine.h"
#include "page-client/restore_session.h"
#include "proto/file_header.h"
#include "tests/server/test_support.h"
#include "tests/support/process.h"

namespace gpulazy {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using server::testing::BoKey;
using server::testing::LoadCriuContents;
using server::testing::ServerProcess;
using server::testing::TempDir;

constexpr uint32_t kChunk = 64 * 1024;

void Synthesize(const fs::path& out, uint64_t seed) {
  image::SynthOptions options;
  options.out = out;
  options.gpus = 2;
  options.bos = 10;
  options.total_bytes = 8ull << 20;
  options.seed = seed;
  Result<image::SynthReport> report = image::SynthesizeCheckpoint(options);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
}

void Convert(const fs::path& dir) {
  Result<image::CriuCheckpoint> checkpoint = image::CriuCheckpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  image::ConvertOptions convert;
  convert.chunk_size = kChunk;
  // One stored copy per chunk, so the flipped byte belongs to exactly one chunk.
  convert.deduplicate = false;
  auto stats = image::ConvertToLazyImage(*checkpoint, convert);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
}

void FlipByte(const fs::path& file, uint64_t offset) {
  std::fstream io(file, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(io.good()) << file;
  io.seekg(static_cast<std::streamoff>(offset));
  char byte = 0;
  io.read(&byte, 1);
  byte = static_cast<char>(byte ^ 0x01);
  io.seekp(static_cast<std::streamoff>(offset));
  io.write(&byte, 1);
  ASSERT_TRUE(io.good()) << "flipping byte " << offset << " of " << file;
}

struct Target {
  uint32_t bo = 0;
  uint32_t chunk = 0;
};

// Flips a byte in the middle of the stored bytes of the first chunk with `codec`.
std::optional<Target> CorruptStoredChunk(const fs::path& dir, manifest::Codec codec) {
  Result<image::LazyImage> lazy = image::LazyImage::Open(dir);
  EXPECT_TRUE(lazy.ok()) << lazy.status().ToString();
  if (!lazy.ok()) return std::nullopt;
  const manifest::Manifest& m = lazy->manifest();
  for (int b = 0; b < m.bos_size(); ++b) {
    for (int c = 0; c < m.bos(b).chunks_size(); ++c) {
      const manifest::Chunk& chunk = m.bos(b).chunks(c);
      if (chunk.codec() != codec || chunk.stored_length() < 16) continue;
      FlipByte(dir / m.chunk_file(),
               kFileHeaderSize + chunk.stored_offset() + chunk.stored_length() / 2);
      return Target{static_cast<uint32_t>(b), static_cast<uint32_t>(c)};
    }
  }
  return std::nullopt;
}

// Records every write and compares its bytes with the checkpoint's before passing it on. It
// offers no ReceiveTarget, so every chunk reaches it through Write, after verification.
// `table` is the image's BO table in the order the server lists it (the manifest's).
class RecordingEngine : public client::CopyEngine {
 public:
  RecordingEngine(const std::map<BoKey, std::vector<uint8_t>>& source, std::vector<BoKey> table)
      : source_(source), table_(std::move(table)) {}

  std::string_view name() const override { return "recording"; }
  Status AddDestination(uint32_t bo, uint64_t size) override {
    return host_.AddDestination(bo, size);
  }
  Status Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw,
               client::CopyDone done) override {
    {
      std::lock_guard lock(mutex_);
      written_.push_back({bo, static_cast<uint32_t>(offset / kChunk)});
      if (bo >= table_.size() || !MatchesSource(table_[bo], offset, raw)) ++bad_writes_;
    }
    return host_.Write(bo, offset, raw, std::move(done));
  }
  Status Flush() override { return host_.Flush(); }

  int bad_writes() const {
    std::lock_guard lock(mutex_);
    return bad_writes_;
  }
  int writes_of(uint32_t bo, uint32_t chunk) const {
    std::lock_guard lock(mutex_);
    int n = 0;
    for (const Target& t : written_)
      n += t.bo == bo && t.chunk == chunk ? 1 : 0;
    return n;
  }
  size_t writes() const {
    std::lock_guard lock(mutex_);
    return written_.size();
  }

 private:
  bool MatchesSource(const BoKey& bo, uint64_t offset, std::span<const uint8_t> raw) const {
    auto it = source_.find(bo);
    return it != source_.end() && offset + raw.size() <= it->second.size() &&
           std::equal(raw.begin(), raw.end(), it->second.begin() + static_cast<long>(offset));
  }

  const std::map<BoKey, std::vector<uint8_t>>& source_;
  const std::vector<BoKey> table_;
  client::HostCopyEngine host_;
  mutable std::mutex mutex_;
  std::vector<Target> written_;
  int bad_writes_ = 0;
};

::gpulazy::testing::CommandRun RunClient(const std::string& args) {
  return ::gpulazy::testing::RunCommand(GPULAZY_BIN_DIR "/gpulazy-client " + args);
}

class CorruptChunkTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ::alarm(120);
    root_ = dir_.path() / "images";
    fs::create_directories(root_);
  }
  void TearDown() override { ::alarm(0); }

  // Restores `image` into a RecordingEngine; expects a loud failure naming `target`.
  void ExpectDetected(const std::string& image, Target target,
                      const std::map<BoKey, std::vector<uint8_t>>& source,
                      const ServerProcess& server) {
    Result<image::LazyImage> lazy = image::LazyImage::Open(root_ / image);
    ASSERT_TRUE(lazy.ok()) << lazy.status().ToString();
    std::vector<BoKey> table;
    for (const manifest::Bo& bo : lazy->manifest().bos())
      table.emplace_back(bo.process_id(), bo.bo_index());
    RecordingEngine engine(source, std::move(table));
    client::SessionOptions options;
    options.endpoint = server.unix_endpoint().ToString();
    options.image = image;
    options.window_bytes = 1u << 20;
    options.handshake_timeout = 10s;
    client::RestoreSession session(options, engine);
    ASSERT_TRUE(session.Start().ok()) << server.Log();
    const Status done = session.WaitComplete(60s);
    ASSERT_EQ(done.code(), Code::kCorrupt) << done.ToString();
    const std::string where = "image " + image + ", BO " + std::to_string(target.bo) + " (";
    EXPECT_NE(done.message().find(where), std::string::npos) << done.message();
    EXPECT_NE(done.message().find("chunk " + std::to_string(target.chunk) + ":"), std::string::npos)
        << done.message();
    EXPECT_NE(done.message().find("second copy is bad too"), std::string::npos) << done.message();
    EXPECT_GE(session.progress().refetches, 1u);
    EXPECT_FALSE(session.IsResident(target.bo, uint64_t{target.chunk} * kChunk, 1));
    EXPECT_EQ(engine.writes_of(target.bo, target.chunk), 0);
    EXPECT_EQ(engine.bad_writes(), 0) << "corrupt bytes reached the engine";
    std::cerr << image << ": failed as expected after " << engine.writes()
              << " good writes: " << done.message() << "\n";
  }

  TempDir dir_;
  TempDir run_dir_;
  fs::path root_;
};

TEST_F(CorruptChunkTest, LazyImageFlippedByteIsDetectedRefetchedAndFailsLoudly) {
  std::map<std::string, Target> targets;
  std::map<std::string, std::map<BoKey, std::vector<uint8_t>>> sources;
  for (auto [name, codec] :
       {std::pair{"flip-raw", manifest::CODEC_RAW}, std::pair{"flip-lz4", manifest::CODEC_LZ4}}) {
    ASSERT_NO_FATAL_FAILURE(Synthesize(root_ / name, 31));
    ASSERT_NO_FATAL_FAILURE(Convert(root_ / name));
    auto source = LoadCriuContents(root_ / name);
    ASSERT_TRUE(source.ok()) << source.status().ToString();
    sources[name] = std::move(*source);
    std::optional<Target> target = CorruptStoredChunk(root_ / name, codec);
    ASSERT_TRUE(target.has_value()) << name << ": the image has no chunk of that codec";
    targets[name] = *target;
  }
  ServerProcess server(run_dir_.path(), root_);
  ASSERT_TRUE(server.ready()) << server.Log();
  for (const auto& [name, target] : targets) {
    SCOPED_TRACE(name);
    ExpectDetected(name, target, sources[name], server);
  }

  // The CLI: non-zero exit, the same message, nothing in the output that looks restored.
  const fs::path out = run_dir_.path() / "fetched";
  const Target target = targets["flip-raw"];
  const auto run = RunClient("fetch --server " + server.unix_endpoint().ToString() +
                             " --image flip-raw --out " + out.string());
  EXPECT_NE(run.exit_code, 0) << run.out;
  EXPECT_NE(run.out.find("image flip-raw, BO " + std::to_string(target.bo) + " ("),
            std::string::npos)
      << run.out;
  EXPECT_NE(run.out.find("chunk " + std::to_string(target.chunk) + ":"), std::string::npos)
      << run.out;
  std::string left;
  if (fs::exists(out))
    for (const fs::directory_entry& entry : fs::directory_iterator(out))
      left += entry.path().filename().string() + " ";
  EXPECT_TRUE(left.empty()) << "fetch left files behind: " << left;
  EXPECT_EQ(server.Terminate(), 0) << server.Log();
}

TEST_F(CorruptChunkTest, RawCriuImageIsServedAsOnDiskAndConversionKeepsTheEvidence) {
  const fs::path raw = root_ / "raw";
  const fs::path converted = root_ / "converted";
  ASSERT_NO_FATAL_FAILURE(Synthesize(raw, 32));
  ASSERT_NO_FATAL_FAILURE(Synthesize(converted, 32));
  ASSERT_NO_FATAL_FAILURE(Convert(converted));
  auto source = LoadCriuContents(raw);
  ASSERT_TRUE(source.ok());
  Result<image::CriuCheckpoint> checkpoint = image::CriuCheckpoint::Open(raw);
  ASSERT_TRUE(checkpoint.ok());
  // The middle byte of the largest content BO, in both copies of the checkpoint.
  const image::ContentBo* victim = &checkpoint->content_bos().front();
  for (const image::ContentBo& bo : checkpoint->content_bos())
    if (bo.size > victim->size) victim = &bo;
  const uint64_t at = 8 + victim->pages_offset + victim->size / 2;
  ASSERT_NO_FATAL_FAILURE(FlipByte(raw / victim->pages_file, at));
  ASSERT_NO_FATAL_FAILURE(FlipByte(converted / victim->pages_file, at));

  ServerProcess server(run_dir_.path(), root_);
  ASSERT_TRUE(server.ready()) << server.Log();
  // Raw: the flipped byte is what the disk says, and its checksum is computed from it.
  client::HostCopyEngine engine;
  client::SessionOptions options;
  options.endpoint = server.unix_endpoint().ToString();
  options.image = "raw";
  client::RestoreSession session(options, engine);
  ASSERT_TRUE(session.Start().ok());
  ASSERT_TRUE(session.WaitComplete(60s).ok()) << session.status().ToString();
  const std::vector<client::BoEntry>& bos = session.bos();
  for (uint32_t i = 0; i < bos.size(); ++i) {
    if (bos[i].process_id != victim->process_id || bos[i].bo_index != victim->bo_index) continue;
    Result<std::span<uint8_t>> mapping = engine.Mapping(i);
    ASSERT_TRUE(mapping.ok());
    const std::vector<uint8_t>& original = source->at({victim->process_id, victim->bo_index});
    EXPECT_EQ((*mapping)[victim->size / 2], original[victim->size / 2] ^ 0x01)
        << "a raw image is served exactly as it is on disk";
  }
  // Converted: the server serves the chunk file (untouched), and verify names the bad chunk.
  Result<image::CriuCheckpoint> damaged = image::CriuCheckpoint::Open(converted);
  ASSERT_TRUE(damaged.ok());
  Result<image::LazyImage> lazy = image::LazyImage::Open(converted);
  ASSERT_TRUE(lazy.ok());
  Result<image::VerifyReport> report = image::VerifyLazyImage(*damaged, *lazy);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
  // Two findings, both about that chunk: its source checksum and its decoded bytes.
  ASSERT_FALSE(report->ok());
  const std::string chunk = "chunk " + std::to_string((victim->size / 2) / kChunk) + ":";
  const std::string bo = "bo index " + std::to_string(victim->bo_index) + ",";
  for (const std::string& mismatch : report->mismatches) {
    EXPECT_NE(mismatch.find(chunk), std::string::npos) << mismatch;
    EXPECT_NE(mismatch.find(bo), std::string::npos) << mismatch;
  }
  EXPECT_EQ(server.Terminate(), 0) << server.Log();
}

}  // namespace
}  // namespace gpulazy
