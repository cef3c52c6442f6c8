// LocalRestore: restoring straight from an image directory (no server), into the host engine,
// checked byte for byte against the checkpoint's pages files.
#include "page-client/local_restore.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <thread>

#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/io.h"
#include "lazy-server/image/lazy_image.h"
#include "lazy-server/image/synth.h"
#include "page-client/host_engine.h"
#include "proto/file_header.h"
#include "tests/client/forwarding_engine.h"
#include "tests/client/verifying_engine.h"
#include "tests/server/test_support.h"
#include "tests/support/temp_dir.h"
#include "tests/support/threads.h"

namespace gpulazy::client {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

void Synthesize(const fs::path& out, uint64_t total_bytes, uint64_t seed) {
  image::SynthOptions options;
  options.out = out;
  options.gpus = 2;
  options.processes = 2;
  options.bos = 10;
  options.total_bytes = total_bytes;
  options.seed = seed;
  Result<image::SynthReport> report = image::SynthesizeCheckpoint(options);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
}

void Convert(const fs::path& dir) {
  Result<image::CriuCheckpoint> checkpoint = image::CriuCheckpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  image::ConvertOptions convert;
  convert.chunk_size = 256 * 1024;
  auto stats = image::ConvertToLazyImage(checkpoint.value(), convert);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
}

// 256 KiB chunks stored RAW (received into the engine's memory), none shared.
void ConvertUncompressed(const fs::path& dir) {
  Result<image::CriuCheckpoint> checkpoint = image::CriuCheckpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
  image::ConvertOptions convert;
  convert.chunk_size = 256 * 1024;
  convert.compress = false;
  convert.deduplicate = false;
  auto stats = image::ConvertToLazyImage(checkpoint.value(), convert);
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
}

// Nothing of a chunk that failed verification is left: its 256 KiB at `offset` of the BO are 0.
void ExpectChunkZeroed(const HostCopyEngine& engine, uint32_t bo, uint64_t offset) {
  Result<std::span<uint8_t>> mapping = engine.Mapping(bo);
  ASSERT_TRUE(mapping.ok());
  const uint64_t end = std::min<uint64_t>(mapping->size(), offset + 256 * 1024);
  for (uint64_t i = offset; i < end; ++i)
    ASSERT_EQ((*mapping)[i], 0) << "unverified byte left at " << i;
}

void ExpectRestored(const LocalRestore& restore, const HostCopyEngine& engine,
                    const fs::path& dir) {
  auto loaded = server::testing::LoadCriuContents(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const auto& expected = *loaded;
  ASSERT_EQ(restore.bos().size(), expected.size());
  for (uint32_t i = 0; i < restore.bos().size(); ++i) {
    const BoEntry& entry = restore.bos()[i];
    auto it = expected.find({entry.process_id, entry.bo_index});
    ASSERT_NE(it, expected.end()) << "BO " << i;
    Result<std::span<uint8_t>> mapping = engine.Mapping(i);
    ASSERT_TRUE(mapping.ok());
    ASSERT_EQ(mapping->size(), it->second.size());
    EXPECT_EQ(std::memcmp(mapping->data(), it->second.data(), it->second.size()), 0)
        << "BO " << i << " differs";
  }
}

TEST(LocalRestore, RestoresCheckpointAndLazyImageByteExact) {
  TempDir root;
  for (bool lazy : {false, true}) {
    SCOPED_TRACE(lazy ? "lazy image" : "CRIU checkpoint");
    const fs::path dir = root.path() / (lazy ? "lazy" : "raw");
    ASSERT_NO_FATAL_FAILURE(Synthesize(dir, 24ull << 20, lazy ? 5 : 6));
    if (lazy) {
      ASSERT_NO_FATAL_FAILURE(Convert(dir));
    }
    for (uint32_t readers : {1u, 4u}) {
      HostCopyEngine engine;
      LocalRestoreOptions options;
      options.image_dir = dir;
      options.readers = readers;
      options.raw_chunk_size = 512 * 1024;
      LocalRestore restore(options, engine);
      ASSERT_TRUE(restore.Start().ok());
      Status done = restore.WaitComplete(std::chrono::seconds(120));
      ASSERT_TRUE(done.ok()) << done.ToString();
      const Progress progress = restore.progress();
      EXPECT_TRUE(progress.complete);
      EXPECT_EQ(progress.resident_bytes, 24ull << 20);
      ASSERT_NO_FATAL_FAILURE(ExpectRestored(restore, engine, dir));
    }
  }
}

// An engine that zeroes memory itself (CopyEngine::WritesZeros, as the CUDA engine does on the
// GPU) is handed a lazy image's zero chunks as ranges, with nothing read for them; it zeroes
// them through the host engine's Write, so the byte check covers them.
TEST(LocalRestore, ZeroChunksOfALazyImageGoToAnEngineThatZeroesAsRanges) {
  class ZeroingEngine : public ForwardingHostEngine {
   public:
    std::string_view name() const override { return "zeroing-host"; }
    bool WritesZeros() const override { return true; }
    Status WriteZeros(uint32_t bo, uint64_t offset, uint64_t length, CopyDone done) override {
      zeroed_bytes_ += length;
      const std::vector<uint8_t> zeros(length);
      return host_.Write(bo, offset, zeros, std::move(done));  // completes inside
    }
    uint64_t zeroed_bytes() const { return zeroed_bytes_.load(); }

   private:
    std::atomic<uint64_t> zeroed_bytes_{0};
  };
  TempDir root;
  const fs::path dir = root.path() / "lazy";
  ASSERT_NO_FATAL_FAILURE(Synthesize(dir, 24ull << 20, 5));
  ASSERT_NO_FATAL_FAILURE(Convert(dir));
  ZeroingEngine engine;
  LocalRestoreOptions options;
  options.image_dir = dir;
  options.readers = 2;
  LocalRestore restore(options, engine);
  ASSERT_TRUE(restore.Start().ok());
  Status done = restore.WaitComplete(std::chrono::seconds(120));
  ASSERT_TRUE(done.ok()) << done.ToString();
  ASSERT_NO_FATAL_FAILURE(ExpectRestored(restore, engine.host(), dir));
  // The synthetic job's KV-cache pools are zeros: whole chunks of them were never read.
  EXPECT_GE(engine.zeroed_bytes(), 256u * 1024);
  EXPECT_EQ(engine.zeroed_bytes() % 4096, 0u);
}

// Progress::file_read_s and file_engine_s: an engine that takes 2 ms in every ReceiveTarget puts
// at least 2 ms per chunk into file_engine_s; reading puts some time into file_read_s; both fit
// in the readers' wall time.
TEST(LocalRestore, ProgressSplitsTheReadersTime) {
  TempDir root;
  const fs::path dir = root.path() / "raw";
  ASSERT_NO_FATAL_FAILURE(Synthesize(dir, 8ull << 20, 9));
  SlowReceiveEngine engine(std::chrono::milliseconds(2));
  LocalRestoreOptions options;
  options.image_dir = dir;
  options.readers = 2;
  options.raw_chunk_size = 256 * 1024;
  LocalRestore restore(options, engine);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(restore.Start().ok());
  const Status done = restore.WaitComplete(std::chrono::seconds(60));
  // Progress first, then the clock: a reader still adds its last lap after WaitComplete returns
  // (the host engine completes a chunk inside the engine call), and a lap counted must lie
  // inside the time measured. Only the two readers install chunks here (no Ensure callers).
  const Progress p = restore.progress();
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_TRUE(done.ok()) << done.ToString();
  EXPECT_GE(p.file_engine_s, 0.002 * static_cast<double>(p.total_chunks));
  EXPECT_GT(p.file_read_s, 0.0);
  EXPECT_LE(p.file_read_s + p.file_engine_s, 2 * elapsed);
}

// The host engine, with the restore's readers held at their first engine call until Release:
// a test can then make its Ensures while the image is surely not resident yet.
class HeldReadersEngine : public ForwardingHostEngine {
 public:
  std::string_view name() const override { return "held-readers"; }
  Status Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw, CopyDone done) override {
    WaitIfReader();
    return host_.Write(bo, offset, raw, std::move(done));
  }
  std::optional<std::span<uint8_t>> ReceiveTarget(uint32_t bo, uint64_t offset,
                                                  uint64_t length) override {
    WaitIfReader();
    return host_.ReceiveTarget(bo, offset, length);
  }

  void Release() {
    std::lock_guard lock(mu_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  void WaitIfReader() {
    char thread[16] = {};
    ::pthread_getname_np(::pthread_self(), thread, sizeof thread);
    if (std::string_view(thread) != "gl-local-reader") return;
    std::unique_lock lock(mu_);
    // Bounded: a test that never releases still ends (and fails on what it checks).
    cv_.wait_for(lock, std::chrono::seconds(60), [&] { return released_; });
  }

  std::mutex mu_;
  std::condition_variable cv_;
  bool released_ = false;
};

TEST(LocalRestore, EnsureFromSeveralThreadsGetsTheRightBytes) {
  TempDir root;
  const fs::path dir = root.path() / "img";
  ASSERT_NO_FATAL_FAILURE(Synthesize(dir, 32ull << 20, 9));
  ASSERT_NO_FATAL_FAILURE(Convert(dir));
  auto loaded = server::testing::LoadCriuContents(dir);
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  const auto& expected = *loaded;
  // The readers wait until an Ensure found a chunk to demand: left to run, they finished the
  // whole image before any Ensure in half the runs on the 2-core VM, leaving nothing to demand.
  HeldReadersEngine engine;
  LocalRestoreOptions options;
  options.image_dir = dir;
  options.readers = 2;
  LocalRestore restore(options, engine);
  ASSERT_TRUE(restore.Start().ok());
  const auto& bos = restore.bos();
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (uint32_t t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      // Last BOs first: the opposite of the background order, so Ensure must jump the queue.
      for (uint32_t k = 0; k < bos.size(); ++k) {
        const uint32_t bo = static_cast<uint32_t>(bos.size()) - 1 - ((k + t) % bos.size());
        if (bos[bo].size == 0) continue;
        const uint64_t offset = (bos[bo].size / 3) & ~uint64_t{4095};
        const uint64_t length = std::min<uint64_t>(8192, bos[bo].size - offset);
        Status s = restore.Ensure(bo, offset, length, std::chrono::seconds(120));
        if (!s.ok()) {
          ++failures;
          continue;
        }
        auto it = expected.find({bos[bo].process_id, bos[bo].bo_index});
        Result<std::span<uint8_t>> mapping = engine.host().Mapping(bo);
        if (it == expected.end() || !mapping.ok() ||
            std::memcmp(mapping->data() + offset, it->second.data() + offset, length) != 0)
          ++failures;
      }
    });
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (restore.progress().demand_chunks == 0 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  engine.Release();
  for (std::thread& t : threads)
    t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_GT(restore.progress().demand_chunks, 0u);
  // Its readers are named (top -H, profiles): one per reader, alive until the restore is
  // destroyed (each names itself as it starts).
  size_t named = 0;
  for (int i = 0; i < 200 && named < 2;
       ++i, std::this_thread::sleep_for(std::chrono::milliseconds(10)))
    named = gpulazy::testing::NiceOfThreadsNamed("gl-local-reader").size();
  EXPECT_EQ(named, 2u);
  // Two readers fault their own pages in: the host engine's populate helper was stopped.
  EXPECT_TRUE(gpulazy::testing::NiceOfThreadsNamed("gl-populate").empty());
  ASSERT_TRUE(restore.WaitComplete(std::chrono::seconds(120)).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectRestored(restore, engine.host(), dir));
}

// A flipped byte in a lazy image's stored chunk: read again once, then the restore fails naming
// the BO and chunk, and nothing of the bad chunk is left in the destination.
TEST(LocalRestore, CorruptChunkFailsLoudlyAndInstallsNothing) {
  TempDir root;
  const fs::path dir = root.path() / "img";
  ASSERT_NO_FATAL_FAILURE(Synthesize(dir, 8ull << 20, 3));
  ASSERT_NO_FATAL_FAILURE(ConvertUncompressed(dir));
  Result<image::LazyImage> lazy = image::LazyImage::Open(dir);
  ASSERT_TRUE(lazy.ok()) << lazy.status().ToString();
  // The first RAW chunk with contents.
  uint32_t victim_bo = 0, victim_chunk = 0;
  uint64_t victim_offset = 0;
  bool found = false;
  for (int b = 0; b < lazy->manifest().bos_size() && !found; ++b)
    for (int c = 0; c < lazy->manifest().bos(b).chunks_size() && !found; ++c) {
      const manifest::Chunk& chunk = lazy->manifest().bos(b).chunks(c);
      if (chunk.codec() == manifest::CODEC_RAW && chunk.stored_length() > 100) {
        victim_bo = static_cast<uint32_t>(b);
        victim_chunk = static_cast<uint32_t>(c);
        victim_offset = kFileHeaderSize + chunk.stored_offset() + 100;
        found = true;
      }
    }
  ASSERT_TRUE(found);
  {
    const fs::path chunk_file = dir / lazy->manifest().chunk_file();
    UniqueFd fd(::open(chunk_file.c_str(), O_RDWR | O_CLOEXEC));
    ASSERT_GE(fd.get(), 0) << chunk_file;
    uint8_t byte = 0;
    ASSERT_EQ(::pread(fd.get(), &byte, 1, static_cast<off_t>(victim_offset)), 1);
    byte ^= 0x40;
    ASSERT_EQ(::pwrite(fd.get(), &byte, 1, static_cast<off_t>(victim_offset)), 1);
  }
  HostCopyEngine engine;
  LocalRestoreOptions options;
  options.image_dir = dir;
  options.readers = 2;
  LocalRestore restore(options, engine);
  ASSERT_TRUE(restore.Start().ok());
  Status done = restore.WaitComplete(std::chrono::seconds(60));
  ASSERT_FALSE(done.ok());
  EXPECT_EQ(done.code(), Code::kCorrupt) << done.ToString();
  EXPECT_NE(done.message().find(dir.string()), std::string::npos) << done.message();
  EXPECT_NE(done.message().find(fmt::format("BO {} chunk {}", victim_bo, victim_chunk)),
            std::string::npos)
      << done.message();
  EXPECT_EQ(restore.progress().refetches, 1u);
  const uint64_t chunk_bytes = 256 * 1024;
  EXPECT_FALSE(restore.IsResident(victim_bo, victim_chunk * chunk_bytes, 1));
  ASSERT_NO_FATAL_FAILURE(ExpectChunkZeroed(engine, victim_bo, victim_chunk * chunk_bytes));
}

// An engine that verifies chunks itself (as the CUDA engine does on the GPU) gets them unhashed
// with their checksums; a chunk it finds bad is read again once, and a second bad copy fails
// the restore naming the chunk, with nothing of it left in the destination.
TEST(LocalRestore, ChunksTheEngineFindsBadAreReadAgainOnceThenFailLoudly) {
  TempDir root;
  const fs::path dir = root.path() / "img";
  ASSERT_NO_FATAL_FAILURE(Synthesize(dir, 8ull << 20, 13));
  ASSERT_NO_FATAL_FAILURE(ConvertUncompressed(dir));
  Result<image::LazyImage> lazy = image::LazyImage::Open(dir);
  ASSERT_TRUE(lazy.ok()) << lazy.status().ToString();
  uint64_t raw_chunks = 0;
  for (const manifest::Bo& bo : lazy->manifest().bos())
    for (const manifest::Chunk& chunk : bo.chunks())
      raw_chunks += chunk.codec() == manifest::CODEC_RAW && chunk.raw_length() > 240 ? 1 : 0;
  ASSERT_GT(raw_chunks, 8u);
  for (const int spoil_times : {0, 1, 2}) {
    SCOPED_TRACE(fmt::format("the engine spoils a chunk {} times", spoil_times));
    VerifyingHostEngine engine(spoil_times);
    LocalRestoreOptions options;
    options.image_dir = dir;
    options.readers = 3;
    LocalRestore restore(options, engine);
    ASSERT_TRUE(restore.Start().ok());
    Status done = restore.WaitComplete(std::chrono::seconds(60));
    // The engine, not the readers, verified: every RAW chunk, or those up to the failure.
    EXPECT_GE(engine.unverified_commits(), spoil_times < 2 ? raw_chunks + spoil_times : 2u);
    EXPECT_EQ(engine.mismatches(), static_cast<uint64_t>(spoil_times));
    EXPECT_EQ(restore.progress().refetches, spoil_times > 0 ? 1u : 0u);
    if (spoil_times < 2) {
      ASSERT_TRUE(done.ok()) << done.ToString();
      ASSERT_NO_FATAL_FAILURE(ExpectRestored(restore, engine.host(), dir));
      continue;
    }
    ASSERT_FALSE(done.ok());
    EXPECT_EQ(done.code(), Code::kCorrupt) << done.ToString();
    const auto [bo, offset] = engine.victim().value();
    const uint64_t chunk_bytes = 256 * 1024;
    EXPECT_NE(done.message().find(fmt::format("BO {} chunk {}", bo, offset / chunk_bytes)),
              std::string::npos)
        << done.message();
    EXPECT_FALSE(restore.IsResident(bo, offset, 1));
    ASSERT_NO_FATAL_FAILURE(ExpectChunkZeroed(engine.host(), bo, offset));
  }
}

TEST(LocalRestore, MissingImageFailsAtStart) {
  TempDir root;
  HostCopyEngine engine;
  LocalRestoreOptions options;
  options.image_dir = root.path() / "nothing-here";
  LocalRestore restore(options, engine);
  Status s = restore.Start();
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("nothing-here"), std::string::npos) << s.message();
}

// The host engine with staging that holds chunks of at most `limit` bytes, as a CUDA engine
// whose slot size was fixed: it says so when told the image's chunk size.
class LimitedStagingEngine : public HostCopyEngine {
 public:
  explicit LimitedStagingEngine(uint32_t limit) : limit_(limit) {}
  Status ExpectChunkBytes(uint32_t max_bytes) override {
    told.push_back(max_bytes);
    return max_bytes > limit_ ? InvalidArgument("slots of {} bytes", limit_) : Status::Ok();
  }
  std::vector<uint32_t> told;

 private:
  uint32_t limit_;
};

TEST(LocalRestore, TellsTheEngineTheChunkSizeAndFailsAtStartWhenItCannotStageIt) {
  TempDir root;
  const fs::path dir = root.path() / "img";
  ASSERT_NO_FATAL_FAILURE(Synthesize(dir, 8ull << 20, 12));
  for (uint32_t limit : {512u << 10, 256u << 10}) {
    SCOPED_TRACE(limit);
    LimitedStagingEngine engine(limit);
    LocalRestoreOptions options;
    options.image_dir = dir;
    options.raw_chunk_size = 512 * 1024;
    LocalRestore restore(options, engine);
    Status started = restore.Start();
    EXPECT_EQ(engine.told, std::vector<uint32_t>{512u << 10});
    if (limit >= options.raw_chunk_size) {
      ASSERT_TRUE(started.ok()) << started.ToString();
      ASSERT_TRUE(restore.WaitComplete(std::chrono::seconds(60)).ok());
      ASSERT_NO_FATAL_FAILURE(ExpectRestored(restore, engine, dir));
    } else {
      EXPECT_EQ(started.code(), Code::kInvalidArgument) << started.ToString();
      EXPECT_NE(started.message().find("slots of 262144 bytes"), std::string::npos)
          << started.message();
    }
  }
}

// An engine that stages writes sizes its buffers when it hears the chunk size (the CUDA engine:
// four slots a reader), so the restore names its readers first.
TEST(LocalRestore, AnnouncesItsReadersBeforeItsChunkSize) {
  TempDir root;
  const fs::path dir = root.path() / "img";
  ASSERT_NO_FATAL_FAILURE(Synthesize(dir, 4ull << 20, 14));
  WritersAtChunkSizeEngine engine;
  LocalRestoreOptions options;
  options.image_dir = dir;
  options.readers = 7;
  LocalRestore restore(options, engine);
  ASSERT_TRUE(restore.Start().ok());
  EXPECT_EQ(engine.writers_at_chunk_size(), 7u);
  ASSERT_TRUE(restore.WaitComplete(std::chrono::seconds(60)).ok());
  ASSERT_NO_FATAL_FAILURE(ExpectRestored(restore, engine.host(), dir));
}

// Left to the engine (readers = 0, the default), the reader count is the engine's preference,
// or kDefaultWriters when it has none; a count asked for wins over a preference.
TEST(LocalRestore, ReadersLeftToTheEngineAreAsManyAsItPrefers) {
  TempDir root;
  const fs::path dir = root.path() / "img";
  ASSERT_NO_FATAL_FAILURE(Synthesize(dir, 4ull << 20, 15));
  struct Case {
    uint32_t asked, preferred, started;
  };
  for (const Case& c : {Case{0, 7, 7}, Case{0, 0, kDefaultWriters}, Case{3, 7, 3}}) {
    SCOPED_TRACE(fmt::format("asked {}, engine prefers {}", c.asked, c.preferred));
    WritersAtChunkSizeEngine engine(c.preferred);
    LocalRestoreOptions options;
    options.image_dir = dir;
    options.readers = c.asked;
    LocalRestore restore(options, engine);
    ASSERT_TRUE(restore.Start().ok());
    EXPECT_EQ(restore.readers(), c.started);
    EXPECT_EQ(engine.writers_at_chunk_size(), c.started);
    ASSERT_TRUE(restore.WaitComplete(std::chrono::seconds(60)).ok());
    ASSERT_NO_FATAL_FAILURE(ExpectRestored(restore, engine.host(), dir));
  }
}

// An engine that takes concurrent calls gets them: its first ReceiveTarget waits (up to 5 s) for
// another reader's to begin, which a gate around the calls would never let happen.
TEST(LocalRestore, AnEngineTakingConcurrentCallsGetsThemConcurrently) {
  class OverlapEngine : public ForwardingHostEngine {
   public:
    std::string_view name() const override { return "overlap"; }
    bool ConcurrentCalls() const override { return true; }
    std::optional<std::span<uint8_t>> ReceiveTarget(uint32_t bo, uint64_t offset,
                                                    uint64_t length) override {
      std::unique_lock lock(mutex_);
      ++inside_;
      if (inside_ > 1) overlapped_ = true;
      changed_.notify_all();
      if (!first_done_) {
        first_done_ = true;
        changed_.wait_for(lock, std::chrono::seconds(5), [&] { return overlapped_; });
      }
      --inside_;
      lock.unlock();
      return ForwardingHostEngine::ReceiveTarget(bo, offset, length);
    }
    bool overlapped() const {
      std::lock_guard lock(mutex_);
      return overlapped_;
    }

   private:
    mutable std::mutex mutex_;
    std::condition_variable changed_;
    int inside_ = 0;
    bool first_done_ = false;
    bool overlapped_ = false;
  };
  TempDir root;
  const fs::path dir = root.path() / "img";
  ASSERT_NO_FATAL_FAILURE(Synthesize(dir, 4ull << 20, 16));
  OverlapEngine engine;
  LocalRestoreOptions options;
  options.image_dir = dir;
  options.readers = 4;
  LocalRestore restore(options, engine);
  ASSERT_TRUE(restore.Start().ok());
  ASSERT_TRUE(restore.WaitComplete(std::chrono::seconds(60)).ok());
  EXPECT_TRUE(engine.overlapped()) << "the readers' engine calls were serialized";
  ASSERT_NO_FATAL_FAILURE(ExpectRestored(restore, engine.host(), dir));
}

}  // namespace
}  // namespace gpulazy::client
