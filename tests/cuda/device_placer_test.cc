// DevicePlacer against a real GPU, placing into device memory a second process exported
// (gpulazy-ipc-exporter). Skipped where no CUDA device exists (CI compiles it only).
#include "lazy-server/gpu/device_placer.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "lazy-server/gpu/ipc_exporter.h"
#include "page-client/cuda/cuda_engine.h"
#include "proto/checksum.h"

namespace gpulazy::server::gpu {
namespace {

constexpr uint32_t kChunk = 256u << 10;

std::vector<uint8_t> RandomBytes(size_t length, uint32_t seed) {
  std::vector<uint8_t> bytes(length);
  std::mt19937 random(seed);
  for (uint8_t& b : bytes)
    b = static_cast<uint8_t>(random());
  return bytes;
}

// A file of the given bytes, open read-only, removed at the end.
class TempFile {
 public:
  explicit TempFile(const std::vector<uint8_t>& bytes) {
    char path[] = "/tmp/gpulazy-placer-XXXXXX";
    const int fd = ::mkstemp(path);
    EXPECT_GE(fd, 0);
    path_ = path;
    EXPECT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
    ::close(fd);
    fd_ = ::open(path, O_RDONLY | O_CLOEXEC);
    EXPECT_GE(fd_, 0);
  }
  ~TempFile() {
    ::close(fd_);
    ::unlink(path_.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

// The restoring process's stand-in: zeroed device memory exported by IPC handle. Where a copied
// build's executables are (a lent GPU host's bundle): GPULAZY_IPC_EXPORTER names the exporter,
// or GPULAZY_TEST_BIN_DIR its folder, as for the other tests' gpulazy-server.
std::string ExporterPath() {
  if (const char* path = std::getenv("GPULAZY_IPC_EXPORTER")) return path;
  if (const char* bin_dir = std::getenv("GPULAZY_TEST_BIN_DIR"))
    return (std::filesystem::path(bin_dir) / "gpulazy-ipc-exporter").string();
  return GPULAZY_IPC_EXPORTER;
}

std::unique_ptr<IpcExporterProcess> Exporter(uint64_t size) {
  auto exporter = IpcExporterProcess::Start(ExporterPath(), size);
  EXPECT_TRUE(exporter.ok()) << exporter.status().ToString();
  return exporter.ok() ? std::move(*exporter) : nullptr;
}

class DevicePlacerTest : public ::testing::Test {
 protected:
  static constexpr uint32_t kSlots = 4;

  void SetUp() override {
    if (!client::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device here";
  }

  static std::unique_ptr<DevicePlacer> Placer(uint64_t pin_budget, bool blocking_sync = false) {
    PlacerOptions options;
    options.pin_budget_bytes = pin_budget;
    options.blocking_sync = blocking_sync;
    options.slot_bytes = kChunk;
    options.slots = kSlots;
    options.streams = 2;
    auto placer = DevicePlacer::Create(options);
    EXPECT_TRUE(placer.ok()) << placer.status().ToString();
    return placer.ok() ? std::move(*placer) : nullptr;
  }
};

// Results of `done`, by destination offset.
struct Outcomes {
  std::mutex mu;
  std::map<uint64_t, Status> by_offset;
  PlaceDone For(uint64_t offset) {
    return [this, offset](Status s) {
      std::lock_guard lock(mu);
      by_offset[offset] = std::move(s);
    };
  }
};

// With the completion thread sleeping on each copy (PlacerOptions::blocking_sync) every chunk
// still lands, checked, and every `done` runs once.
TEST_F(DevicePlacerTest, BlockingSyncPlacesEveryChunkByteExact) {
  constexpr size_t kChunks = 40;
  const std::vector<uint8_t> bytes = RandomBytes(kChunks * kChunk, 7);
  TempFile file(bytes);
  auto exporter = Exporter(bytes.size());
  ASSERT_NE(exporter, nullptr);
  auto placer = Placer(64u << 20, /*blocking_sync=*/true);
  ASSERT_NE(placer, nullptr);
  Result<SourceRef> source = placer->RegisterFile(file.fd(), file.path());
  ASSERT_TRUE(source.ok()) << source.status().ToString();
  Result<DestinationRef> destination = placer->OpenDestination(exporter->handle(), bytes.size());
  ASSERT_TRUE(destination.ok()) << destination.status().ToString();
  Outcomes outcomes;
  for (size_t i = 0; i < kChunks; ++i) {
    const uint64_t at = i * kChunk;
    ASSERT_TRUE(placer
                    ->Place(*source, at, kChunk, Checksum64({bytes.data() + at, kChunk}),
                            *destination, at, outcomes.For(at))
                    .ok());
  }
  placer->Flush();
  ASSERT_EQ(outcomes.by_offset.size(), kChunks);
  for (const auto& [at, status] : outcomes.by_offset)
    EXPECT_TRUE(status.ok()) << at << ": " << status.ToString();
  std::vector<uint8_t> landed(bytes.size());
  ASSERT_TRUE(placer->ReadBack(*destination, 0, landed).ok());
  EXPECT_EQ(landed, bytes);
  EXPECT_EQ(placer->stats().placed_chunks, kChunks);
}

TEST_F(DevicePlacerTest, PlacesCheckedChunksByteExactAndNeverInstallsOneThatFailsItsCheck) {
  constexpr size_t kChunks = 24;  // more than the four slots: slots are reused
  const std::vector<uint8_t> bytes = RandomBytes(kChunks * kChunk, 1);
  TempFile file(bytes);
  auto exporter = Exporter(bytes.size());
  ASSERT_NE(exporter, nullptr);
  auto placer = Placer(64u << 20);
  ASSERT_NE(placer, nullptr);
  Result<SourceRef> source = placer->RegisterFile(file.fd(), file.path());
  ASSERT_TRUE(source.ok()) << source.status().ToString();
  Result<DestinationRef> destination = placer->OpenDestination(exporter->handle(), bytes.size());
  ASSERT_TRUE(destination.ok()) << destination.status().ToString();

  // Chunks in reverse, each to its own place; chunk 5's checksum is off by one bit.
  Outcomes outcomes;
  for (size_t i = kChunks; i-- > 0;) {
    const uint64_t at = i * kChunk;
    uint64_t checksum = Checksum64({bytes.data() + at, kChunk});
    if (i == 5) checksum ^= 1;
    const Status placed =
        placer->Place(*source, at, kChunk, checksum, *destination, at, outcomes.For(at));
    ASSERT_TRUE(placed.ok()) << "chunk " << i << ": " << placed.ToString();
  }
  placer->Flush();
  ASSERT_EQ(outcomes.by_offset.size(), kChunks);
  for (const auto& [at, status] : outcomes.by_offset) {
    if (at == 5 * kChunk)
      EXPECT_EQ(status.code(), Code::kCorrupt) << status.ToString();
    else
      EXPECT_TRUE(status.ok()) << at << ": " << status.ToString();
  }
  std::vector<uint8_t> landed(bytes.size());
  ASSERT_TRUE(placer->ReadBack(*destination, 0, landed).ok());
  for (size_t i = 0; i < kChunks; ++i) {
    const bool refused = i == 5;
    const std::vector<uint8_t> want =
        refused
            ? std::vector<uint8_t>(kChunk, 0)
            : std::vector<uint8_t>(bytes.begin() + i * kChunk, bytes.begin() + (i + 1) * kChunk);
    EXPECT_EQ(std::memcmp(landed.data() + i * kChunk, want.data(), kChunk), 0)
        << "chunk " << i << (refused ? " (refused: must stay zero)" : "");
  }
  const PlacerStats stats = placer->stats();
  EXPECT_EQ(stats.placed_chunks, kChunks - 1);
  EXPECT_EQ(stats.verified_chunks, kChunks - 1);  // every placed chunk had its checksum
  EXPECT_EQ(stats.mismatches, 1u);
  EXPECT_EQ(stats.placed_bytes, (kChunks - 1) * kChunk);
  // The time accounts hold together: some slot is busy whenever the placer is active, never more
  // than all of them, and a slot stays busy through its callback.
  EXPECT_GT(stats.active_ns, 0u);
  EXPECT_GE(stats.slot_busy_ns, stats.active_ns);
  EXPECT_LE(stats.slot_busy_ns, uint64_t{kSlots} * stats.active_ns);
  EXPECT_LE(stats.done_ns, stats.slot_busy_ns);
}

TEST_F(DevicePlacerTest, ChunksWithoutChecksumAndShortChunksLand) {
  const std::vector<uint8_t> bytes = RandomBytes(2 * kChunk + 100, 2);
  TempFile file(bytes);
  auto exporter = Exporter(bytes.size());
  ASSERT_NE(exporter, nullptr);
  auto placer = Placer(16u << 20);
  ASSERT_NE(placer, nullptr);
  Result<SourceRef> source = placer->RegisterFile(file.fd(), file.path());
  ASSERT_TRUE(source.ok()) << source.status().ToString();
  Result<DestinationRef> destination = placer->OpenDestination(exporter->handle(), bytes.size());
  ASSERT_TRUE(destination.ok()) << destination.status().ToString();
  Outcomes outcomes;
  // No checksum (a plain CRIU checkpoint's), then a 100-byte tail, too short for the kernel,
  // checked on the CPU: once right, once wrong (into an offset that must stay zero).
  for (uint64_t at : {uint64_t{0}, uint64_t{kChunk}})
    ASSERT_TRUE(
        placer->Place(*source, at, kChunk, std::nullopt, *destination, at, outcomes.For(at)).ok());
  const uint64_t tail = Checksum64({bytes.data() + 2 * kChunk, 100});
  ASSERT_TRUE(placer
                  ->Place(*source, 2 * kChunk, 100, tail, *destination, 2 * kChunk,
                          outcomes.For(2 * kChunk))
                  .ok());
  ASSERT_TRUE(
      placer->Place(*source, 2 * kChunk, 100, tail ^ 2, *destination, 0, outcomes.For(1)).ok());
  placer->Flush();
  EXPECT_TRUE(outcomes.by_offset[0].ok()) << outcomes.by_offset[0].ToString();
  EXPECT_TRUE(outcomes.by_offset[kChunk].ok()) << outcomes.by_offset[kChunk].ToString();
  EXPECT_TRUE(outcomes.by_offset[2 * kChunk].ok()) << outcomes.by_offset[2 * kChunk].ToString();
  EXPECT_EQ(outcomes.by_offset[1].code(), Code::kCorrupt);
  std::vector<uint8_t> landed(bytes.size());
  ASSERT_TRUE(placer->ReadBack(*destination, 0, landed).ok());
  EXPECT_EQ(landed, bytes);  // the refused tail did not overwrite the start
  // Three placed; only the tail had a checksum to check (on the CPU).
  EXPECT_EQ(placer->stats().placed_chunks, 3u);
  EXPECT_EQ(placer->stats().verified_chunks, 1u);
}

TEST_F(DevicePlacerTest, RefusesRangesOutsideTheFileOrTheDestinationAndOversizedClaims) {
  const std::vector<uint8_t> bytes = RandomBytes(4 * kChunk, 3);
  TempFile file(bytes);
  auto exporter = Exporter(2 * kChunk);
  ASSERT_NE(exporter, nullptr);
  auto placer = Placer(16u << 20);
  ASSERT_NE(placer, nullptr);
  Result<SourceRef> source = placer->RegisterFile(file.fd(), file.path());
  ASSERT_TRUE(source.ok()) << source.status().ToString();

  // The client claims more than the allocation its handle opens.
  Result<DestinationRef> oversized = placer->OpenDestination(exporter->handle(), 64u << 20);
  EXPECT_EQ(oversized.status().code(), Code::kInvalidArgument) << oversized.status().ToString();
  // A handle that names nothing.
  IpcHandle garbage{};
  garbage.fill(0x5a);
  EXPECT_FALSE(placer->OpenDestination(garbage, kChunk).ok());

  Result<DestinationRef> destination = placer->OpenDestination(exporter->handle(), 2 * kChunk);
  ASSERT_TRUE(destination.ok()) << destination.status().ToString();
  std::atomic<int> calls{0};
  const auto counted = [&](Status) { ++calls; };
  const uint64_t sum = Checksum64({bytes.data(), kChunk});
  EXPECT_EQ(placer->Place(*source, 4 * kChunk - 10, kChunk, sum, *destination, 0, counted).code(),
            Code::kOutOfRange);
  EXPECT_EQ(placer->Place(*source, UINT64_MAX - 5, kChunk, sum, *destination, 0, counted).code(),
            Code::kOutOfRange);
  EXPECT_EQ(placer->Place(*source, 0, kChunk, sum, *destination, 2 * kChunk - 1, counted).code(),
            Code::kOutOfRange);
  EXPECT_EQ(placer->Place(*source, 0, kChunk, sum, *destination, UINT64_MAX, counted).code(),
            Code::kOutOfRange);
  EXPECT_EQ(placer->Place(*source, 0, 2 * kChunk, sum, *destination, 0, counted).code(),
            Code::kInvalidArgument);  // larger than a slot
  EXPECT_EQ(placer->Place(*source, 0, 0, sum, *destination, 0, counted).code(),
            Code::kInvalidArgument);
  placer->Flush();
  EXPECT_EQ(calls.load(), 0);  // a refused placement never completes
  std::vector<uint8_t> landed(2 * kChunk);
  ASSERT_TRUE(placer->ReadBack(*destination, 0, landed).ok());
  EXPECT_EQ(landed, std::vector<uint8_t>(2 * kChunk, 0));
}

TEST_F(DevicePlacerTest, RegistrationsAreCachedAndLetGoLeastRecentlyUsedWithinTheBudget) {
  const std::vector<uint8_t> a_bytes = RandomBytes(3 << 20, 4);
  const std::vector<uint8_t> b_bytes = RandomBytes(3 << 20, 5);
  TempFile a(a_bytes);
  TempFile b(b_bytes);
  auto placer = Placer(4u << 20);  // one of the two files at a time
  ASSERT_NE(placer, nullptr);

  Result<SourceRef> first = placer->RegisterFile(a.fd(), a.path());
  ASSERT_TRUE(first.ok()) << first.status().ToString();
  Result<SourceRef> again = placer->RegisterFile(a.fd(), a.path());
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(first->get(), again->get());
  EXPECT_EQ(placer->stats().registrations, 1u);
  EXPECT_EQ(placer->stats().pinned_bytes, 3u << 20);

  // A is still in use: B does not fit beside it, and A stays.
  Result<SourceRef> refused = placer->RegisterFile(b.fd(), b.path());
  EXPECT_EQ(refused.status().code(), Code::kResourceExhausted) << refused.status().ToString();
  EXPECT_EQ(placer->stats().evictions, 0u);
  EXPECT_EQ(placer->stats().budget_refusals, 1u);

  // Once nothing uses A, B takes its place.
  *first = nullptr;
  *again = nullptr;
  Result<SourceRef> second = placer->RegisterFile(b.fd(), b.path());
  ASSERT_TRUE(second.ok()) << second.status().ToString();
  EXPECT_EQ(placer->stats().evictions, 1u);
  EXPECT_EQ(placer->stats().pinned_bytes, 3u << 20);

  // Larger than the whole budget, and not a regular file.
  TempFile big(RandomBytes(5 << 20, 6));
  EXPECT_EQ(placer->RegisterFile(big.fd(), big.path()).status().code(), Code::kResourceExhausted);
  EXPECT_EQ(placer->RegisterFile(big.fd(), big.path()).status().code(), Code::kResourceExhausted);
  EXPECT_EQ(placer->stats().budget_refusals, 3u);  // every refusal, each chunk of a file asks
  EXPECT_EQ(placer->stats().registrations, 2u);
  const int null_device = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  EXPECT_EQ(placer->RegisterFile(null_device, "/dev/null").status().code(), Code::kInvalidArgument);
  ::close(null_device);
}

}  // namespace
}  // namespace gpulazy::server::gpu
