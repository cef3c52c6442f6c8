// CudaCopyEngine against a real GPU. Skipped where no CUDA device exists (CI compiles it only).
#include "page-client/cuda/cuda_engine.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <thread>

#include "proto/checksum.h"

namespace gpulazy::client {
namespace {

std::vector<uint8_t> RandomBytes(size_t length, uint32_t seed) {
  std::vector<uint8_t> bytes(length);
  std::mt19937 random(seed);
  for (uint8_t& b : bytes)
    b = static_cast<uint8_t>(random());
  return bytes;
}

class CudaEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device here";
  }
};

// Four 64 KiB staging slots on two streams, and BO 0 of `bo_bytes`: the engine of the tests
// whose `done` callbacks take their time. Null (with the failure recorded) if it cannot be made.
std::unique_ptr<CudaCopyEngine> FourSlotEngine(uint64_t bo_bytes) {
  CudaEngineOptions options;
  options.staging_slots = 4;
  options.slot_bytes = 64 << 10;
  options.streams = 2;
  auto engine = CudaCopyEngine::Create(options);
  EXPECT_TRUE(engine.ok()) << engine.status().ToString();
  if (!engine.ok()) return nullptr;
  const Status added = (*engine)->AddDestination(0, bo_bytes);
  EXPECT_TRUE(added.ok()) << added.ToString();
  if (!added.ok()) return nullptr;
  return std::move(*engine);
}

// A restore that leaves its reader count to the engine gets one reader per CPU the calling
// thread may run on, within [kMinDefaultWriters, kMaxDefaultWriters] (no device needed): measured
// best on the lent hosts.
TEST(CudaEngineDefaults, PreferredWritersAreOnePerAllowedCpu) {
  auto allowed_cpus = [] {
    cpu_set_t set;
    CPU_ZERO(&set);
    EXPECT_EQ(sched_getaffinity(0, sizeof(set), &set), 0);
    return static_cast<uint32_t>(CPU_COUNT(&set));
  };
  EXPECT_EQ(CudaCopyEngine::DefaultWriters(),
            std::clamp(allowed_cpus(), CudaCopyEngine::kMinDefaultWriters,
                       CudaCopyEngine::kMaxDefaultWriters));
  // Narrowed to one CPU (a container's share, say), the count follows the affinity, not the
  // machine: the floor of four.
  std::thread narrowed([&] {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(sched_getcpu(), &one);
    ASSERT_EQ(sched_setaffinity(0, sizeof(one), &one), 0);
    EXPECT_EQ(allowed_cpus(), 1u);
    EXPECT_EQ(CudaCopyEngine::DefaultWriters(), CudaCopyEngine::kMinDefaultWriters);
  });
  narrowed.join();
}

// Flush returns only after every `done` has returned, not once the copies are reaped: a
// RestoreSession is destroyed right after its Flush, and its callbacks own session state. Each
// callback here takes 20 ms, so a Flush that waited only for the copies would return while the
// last one still ran (seen as one completion short, under load, on the lent H200).
TEST_F(CudaEngineTest, FlushWaitsForTheLastCompletionToReturn) {
  constexpr int kWrites = 6;
  const uint64_t size = kWrites * (64 << 10);
  std::unique_ptr<CudaCopyEngine> engine = FourSlotEngine(size);
  ASSERT_NE(engine, nullptr);
  const std::vector<uint8_t> source = RandomBytes(size, 11);
  std::atomic<int> returned{0};
  for (int i = 0; i < kWrites; ++i) {
    const uint64_t at = uint64_t{64 << 10} * i;
    Status s = engine->Write(0, at, {source.data() + at, 64 << 10}, [&](Status st) {
      EXPECT_TRUE(st.ok()) << st.ToString();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      returned++;
    });
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  ASSERT_TRUE(engine->Flush().ok());
  EXPECT_EQ(returned.load(), kWrites);
}

// stats(): a writer that finds every slot in flight is counted and timed, and so is the copy
// queue standing empty between copies. The reaper frees a slot before it runs that slot's
// `done`, and the first `done` holds the reaper until the sixth write is being issued, then 20
// ms more: with 4 slots (the fifth write took the first one back), the sixth write waits about
// 20 ms for the second slot, however late the test thread gets there.
TEST_F(CudaEngineTest, StatsTimeSlotWaitsAndAnEmptyCopyQueue) {
  constexpr int kWrites = 7;
  const uint64_t size = kWrites * (64 << 10);
  std::unique_ptr<CudaCopyEngine> engine = FourSlotEngine(size);
  ASSERT_NE(engine, nullptr);
  const std::vector<uint8_t> source = RandomBytes(size, 12);
  CudaEngineStats before = engine->stats();
  EXPECT_EQ(before.slot_waits, 0u);
  EXPECT_EQ(before.slot_wait_s, 0.0);
  EXPECT_EQ(before.copy_queue_empty_s, 0.0);
  std::atomic<bool> sixth_issued{false};
  auto write = [&](int i) {
    const uint64_t at = uint64_t{64 << 10} * i;
    Status s = engine->Write(0, at, {source.data() + at, 64 << 10}, [&, i](Status st) {
      EXPECT_TRUE(st.ok()) << st.ToString();
      if (i != 0) return;
      // Bounded: a test that never gets there still ends (and fails on what it checks).
      for (int waited = 0; !sixth_issued.load() && waited < 10000; ++waited)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    });
    ASSERT_TRUE(s.ok()) << s.ToString();
  };
  for (int i = 0; i < kWrites - 1; ++i) {
    if (i == 5) sixth_issued.store(true);
    write(i);
  }
  ASSERT_TRUE(engine->Flush().ok());
  const CudaEngineStats waited = engine->stats();
  EXPECT_GE(waited.slot_waits, 1u);
  EXPECT_GE(waited.slot_wait_s, 0.015);
  // The queue empties at the last reap; 50 ms pass before the next copy.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  write(kWrites - 1);
  ASSERT_TRUE(engine->Flush().ok());
  const CudaEngineStats after = engine->stats();
  EXPECT_GE(after.copy_queue_empty_s - waited.copy_queue_empty_s, 0.05);
  EXPECT_LT(after.copy_queue_empty_s, 10.0);
  EXPECT_EQ(after.slot_waits, waited.slot_waits);  // a free slot costs no wait
}

// Both ways of waiting for a copy: spinning on its event (CUDA's default) and sleeping until
// the driver signals it (blocking_sync).
TEST_F(CudaEngineTest, WritesLandByteExactThroughMoreWritesThanSlots) {
  for (const bool blocking : {false, true}) {
    SCOPED_TRACE(blocking ? "blocking sync" : "spinning sync");
    CudaEngineOptions options;
    options.staging_slots = 3;  // fewer slots than writes: Write must wait for the reaper
    options.slot_bytes = 64 << 10;
    options.streams = 2;
    options.blocking_sync = blocking;
    auto engine = CudaCopyEngine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    const uint64_t size = 40 * (64 << 10) + 123;  // a short last write
    ASSERT_TRUE((*engine)->AddDestination(0, size).ok());
    const std::vector<uint8_t> source = RandomBytes(size, blocking ? 8 : 7);
    std::atomic<int> done{0};
    for (uint64_t at = 0; at < size; at += options.slot_bytes) {
      size_t n = std::min<uint64_t>(options.slot_bytes, size - at);
      Status s = (*engine)->Write(0, at, {source.data() + at, n}, [&](Status st) {
        EXPECT_TRUE(st.ok()) << st.ToString();
        done++;
      });
      ASSERT_TRUE(s.ok()) << s.ToString();
    }
    ASSERT_TRUE((*engine)->Flush().ok());
    EXPECT_EQ(done.load(), 41);
    EXPECT_EQ((*engine)->bytes_written(), size);
    std::vector<uint8_t> back(size);
    ASSERT_TRUE((*engine)->CopyToHost(0, 0, back).ok());
    EXPECT_EQ(back, source);
  }
}

// Slot size 0: the ring is made when the restore says its chunk size, and holds exactly that.
TEST_F(CudaEngineTest, SlotsAreSizedToTheChunksTheRestoreExpects) {
  CudaEngineOptions options;
  options.staging_slots = 4;
  options.streams = 2;
  auto engine = CudaCopyEngine::Create(options);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  constexpr uint32_t kChunk = 96 << 10;  // not a power of two: the slots still start page-aligned
  ASSERT_TRUE((*engine)->ExpectChunkBytes(kChunk).ok());
  const uint64_t size = 10 * kChunk;
  ASSERT_TRUE((*engine)->AddDestination(0, size).ok());
  const std::vector<uint8_t> source = RandomBytes(size, 11);
  for (uint64_t at = 0; at < size; at += kChunk) {
    Status s = (*engine)->Write(0, at, {source.data() + at, kChunk},
                                [](Status st) { EXPECT_TRUE(st.ok()) << st.ToString(); });
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  auto lent = (*engine)->ReceiveTarget(0, 0, kChunk);
  ASSERT_TRUE(lent.has_value());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(lent->data()) % 4096, 0u);
  (*engine)->ReleaseReceived(0, 0, kChunk);
  Status too_big = (*engine)->Write(0, 0, {source.data(), kChunk + 1}, [](Status) {});
  EXPECT_EQ(too_big.code(), Code::kInvalidArgument) << too_big.ToString();
  EXPECT_FALSE((*engine)->ReceiveTarget(0, 0, kChunk + 1).has_value());
  ASSERT_TRUE((*engine)->Flush().ok());
  std::vector<uint8_t> back(size);
  ASSERT_TRUE((*engine)->CopyToHost(0, 0, back).ok());
  EXPECT_EQ(back, source);
  // The ring is made: a later, larger chunk size is refused with the reason.
  Status later = (*engine)->ExpectChunkBytes(2 * kChunk);
  EXPECT_EQ(later.code(), Code::kInvalidArgument);
  EXPECT_NE(later.message().find("staging slots"), std::string::npos) << later.message();
}

// staging_slots 0: four slots a writer announced before the chunk size, within [16, 128]; a
// ring once made keeps its slots.
TEST_F(CudaEngineTest, RingSizedToTheWritersAnnouncedBeforeTheChunkSize) {
  struct Case {
    std::optional<uint32_t> writers;  // nullopt: none announced
    uint32_t slot_bytes;              // 0: sized to the chunk
    uint32_t want;
  };
  for (const Case& c : {Case{std::nullopt, 0, 16}, Case{2, 0, 16}, Case{8, 0, 32},
                        Case{16, 64 << 10, 64}, Case{1000, 0, 128}}) {
    SCOPED_TRACE(fmt::format("{} writers, slot_bytes {}", c.writers.value_or(0), c.slot_bytes));
    CudaEngineOptions options;
    options.slot_bytes = c.slot_bytes;
    auto engine = CudaCopyEngine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    EXPECT_EQ((*engine)->staging_slots(), 0u);  // not made before the writers can be known
    if (c.writers) (*engine)->ExpectWriters(*c.writers);
    ASSERT_TRUE((*engine)->ExpectChunkBytes(64 << 10).ok());
    EXPECT_EQ((*engine)->staging_slots(), c.want);
    (*engine)->ExpectWriters(4 * c.want);
    EXPECT_EQ((*engine)->staging_slots(), c.want);
    // Every slot but the one never lent can be lent, and all of them stage writes.
    ASSERT_TRUE((*engine)->AddDestination(0, uint64_t{c.want} << 16).ok());
    uint32_t lent = 0;
    while ((*engine)->ReceiveTarget(0, uint64_t{lent} << 16, 64 << 10))
      ++lent;
    EXPECT_EQ(lent, c.want - 1);
    for (uint32_t i = 0; i < lent; ++i)
      (*engine)->ReleaseReceived(0, uint64_t{i} << 16, 64 << 10);
    ASSERT_TRUE((*engine)->Flush().ok());
  }
}

// Slots over 2 MiB come fewer, holding the bytes as many 2 MiB slots would (at least 8): the
// ring is pinned inside the restore's resume.
TEST_F(CudaEngineTest, LargerSlotsComeFewerForTheSameRingBytes) {
  struct Case {
    uint32_t writers;
    uint32_t chunk;
    uint32_t want;
  };
  for (const Case& c : {Case{16, 2u << 20, 64}, Case{16, 4u << 20, 32}, Case{1, 4u << 20, 8},
                        Case{100, 4u << 20, 64}, Case{16, 1u << 20, 64}}) {
    SCOPED_TRACE(fmt::format("{} writers, {}-byte chunks", c.writers, c.chunk));
    auto engine = CudaCopyEngine::Create({});
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    (*engine)->ExpectWriters(c.writers);
    ASSERT_TRUE((*engine)->ExpectChunkBytes(c.chunk).ok());
    EXPECT_EQ((*engine)->staging_slots(), c.want);
    EXPECT_EQ((*engine)->slot_bytes(), c.chunk);
  }
}

TEST_F(CudaEngineTest, FixedSlotsRefuseLargerChunksAndUntoldRestoresGetFourMiB) {
  CudaEngineOptions fixed;
  fixed.staging_slots = 2;
  fixed.slot_bytes = 64 << 10;
  auto engine = CudaCopyEngine::Create(fixed);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  EXPECT_TRUE((*engine)->ExpectChunkBytes(32 << 10).ok());
  EXPECT_EQ((*engine)->ExpectChunkBytes(128 << 10).code(), Code::kInvalidArgument);
  EXPECT_EQ((*engine)->ExpectChunkBytes(0).code(), Code::kInvalidArgument);

  CudaEngineOptions open;
  open.staging_slots = 2;
  auto untold = CudaCopyEngine::Create(open);
  ASSERT_TRUE(untold.ok()) << untold.status().ToString();
  constexpr uint32_t kLargest = 4u << 20;
  // Sized automatically only up to the largest chunk a server sends: a server cannot make the
  // client pin more by announcing larger chunks.
  EXPECT_EQ((*untold)->ExpectChunkBytes(2 * kLargest).code(), Code::kInvalidArgument);
  EXPECT_EQ((*untold)->slot_bytes(), 0u);
  ASSERT_TRUE((*untold)->AddDestination(0, kLargest + 4096).ok());
  EXPECT_EQ((*untold)->slot_bytes(), kLargest);
  std::vector<uint8_t> source(kLargest, 0x5a);
  ASSERT_TRUE((*untold)->Write(0, 4096, source, [](Status) {}).ok());
  EXPECT_EQ((*untold)->Write(0, 0, {source.data(), 4096}, [](Status) {}).code(), Code::kOk);
  ASSERT_TRUE((*untold)->Flush().ok());
  std::vector<uint8_t> back(kLargest);
  ASSERT_TRUE((*untold)->CopyToHost(0, 4096, back).ok());
  EXPECT_EQ(back, source);
}

// Callers serialize their engine calls (the restore's engine gate) and may ask for a slot while
// others hold lent slots they can only commit under that same lock. With more such callers
// than slots every slot could be lent and the asker wait forever (seen: 16 readers, 8 slots).
// The engine keeps one slot it never lends, so this finishes, byte exact.
TEST_F(CudaEngineTest, LentSlotsNeverDeadlockCallersThatSerializeTheirCalls) {
  ::alarm(60);  // a deadlock fails the test instead of hanging the suite
  CudaEngineOptions options;
  options.staging_slots = 3;
  options.slot_bytes = 64 << 10;
  auto engine = CudaCopyEngine::Create(options);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  constexpr uint32_t kThreads = 8;
  constexpr uint32_t kChunksEach = 16;
  const uint64_t size = uint64_t{kThreads} * kChunksEach * options.slot_bytes;
  ASSERT_TRUE((*engine)->AddDestination(0, size).ok());
  const std::vector<uint8_t> source = RandomBytes(size, 11);
  {
    // Two of three lent: the last is never lent, and asking for it does not wait.
    auto a = (*engine)->ReceiveTarget(0, 0, options.slot_bytes);
    auto b = (*engine)->ReceiveTarget(0, options.slot_bytes, options.slot_bytes);
    ASSERT_TRUE(a && b);
    EXPECT_FALSE((*engine)->ReceiveTarget(0, 2 * options.slot_bytes, options.slot_bytes));
    (*engine)->ReleaseReceived(0, 0, options.slot_bytes);
    (*engine)->ReleaseReceived(0, options.slot_bytes, options.slot_bytes);
  }
  std::mutex gate;
  std::atomic<int> lent{0};
  std::vector<std::thread> threads;
  for (uint32_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<uint8_t> own(options.slot_bytes);
      for (uint32_t i = 0; i < kChunksEach; ++i) {
        const uint64_t at = (uint64_t{i} * kThreads + t) * options.slot_bytes;
        std::optional<std::span<uint8_t>> target;
        {
          std::lock_guard hold(gate);
          target = (*engine)->ReceiveTarget(0, at, options.slot_bytes);
        }
        std::span<uint8_t> into = target ? *target : std::span<uint8_t>(own);
        std::memcpy(into.data(), source.data() + at, into.size());
        std::this_thread::sleep_for(std::chrono::microseconds(200));  // a reader's pread
        std::lock_guard hold(gate);
        Status queued = target ? (*engine)->CommitReceived(0, at, into.size(), [](Status) {})
                               : (*engine)->Write(0, at, into, [](Status) {});
        EXPECT_TRUE(queued.ok()) << queued.ToString();
        if (target) lent++;
      }
    });
  }
  for (std::thread& thread : threads)
    thread.join();
  ::alarm(0);
  ASSERT_TRUE((*engine)->Flush().ok());
  EXPECT_GT(lent.load(), 0) << "no slot was ever lent";
  std::vector<uint8_t> back(size);
  ASSERT_TRUE((*engine)->CopyToHost(0, 0, back).ok());
  EXPECT_EQ(back, source);
}

TEST_F(CudaEngineTest, RejectsWritesOutsideTheBoWithoutCallingDone) {
  auto engine = CudaCopyEngine::Create({});
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  ASSERT_TRUE((*engine)->AddDestination(0, 4096).ok());
  std::vector<uint8_t> bytes(4096, 1);
  bool called = false;
  auto mark = [&](Status) { called = true; };
  EXPECT_EQ((*engine)->Write(0, 1, bytes, mark).code(), Code::kOutOfRange);
  EXPECT_EQ((*engine)->Write(0, UINT64_MAX, bytes, mark).code(), Code::kOutOfRange);
  EXPECT_EQ((*engine)->Write(1, 0, bytes, mark).code(), Code::kInvalidArgument);
  ASSERT_TRUE((*engine)->Flush().ok());
  EXPECT_FALSE(called);
}

// A zero chunk is zeroed on the GPU over whatever the range held, in order with the copies
// around it, within the BO and the chunk size only, and is counted as written.
TEST_F(CudaEngineTest, ZeroWritesClearTheirRangeOnTheGpuAndStayInTheBo) {
  auto engine = CudaCopyEngine::Create({});
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  ASSERT_TRUE((*engine)->ExpectChunkBytes(64 * 1024).ok());
  constexpr uint64_t kSize = 5 * 64 * 1024 + 4096;
  ASSERT_TRUE((*engine)->AddDestination(0, kSize).ok());
  std::vector<uint8_t> pattern(kSize);
  for (size_t i = 0; i < pattern.size(); ++i)
    pattern[i] = static_cast<uint8_t>(i * 7 + 1);
  std::atomic<int> completed{0};
  auto count = [&](const Status& s) {
    EXPECT_TRUE(s.ok()) << s.ToString();
    ++completed;
  };
  for (uint64_t offset = 0; offset < kSize; offset += 64 * 1024) {
    const uint64_t length = std::min<uint64_t>(64 * 1024, kSize - offset);
    ASSERT_TRUE(
        (*engine)->Write(0, offset, std::span(pattern).subspan(offset, length), count).ok());
  }
  // Chunks 1 and 3, and the short tail, zeroed after their bytes were copied in.
  ASSERT_TRUE((*engine)->WriteZeros(0, 64 * 1024, 64 * 1024, count).ok());
  ASSERT_TRUE((*engine)->WriteZeros(0, 3 * 64 * 1024, 64 * 1024, count).ok());
  ASSERT_TRUE((*engine)->WriteZeros(0, 5 * 64 * 1024, 4096, count).ok());
  bool called = false;
  auto mark = [&](Status) { called = true; };
  EXPECT_EQ((*engine)->WriteZeros(0, kSize - 4095, 4096, mark).code(), Code::kOutOfRange);
  EXPECT_EQ((*engine)->WriteZeros(0, UINT64_MAX, 1, mark).code(), Code::kOutOfRange);
  EXPECT_EQ((*engine)->WriteZeros(1, 0, 4096, mark).code(), Code::kInvalidArgument);
  EXPECT_EQ((*engine)->WriteZeros(0, 0, 128 * 1024, mark).code(), Code::kInvalidArgument);
  ASSERT_TRUE((*engine)->Flush().ok());
  EXPECT_FALSE(called);
  EXPECT_EQ(completed.load(), 6 + 3);
  std::vector<uint8_t> expected = pattern;
  for (uint64_t offset : {uint64_t{64 * 1024}, uint64_t{3 * 64 * 1024}})
    std::fill_n(expected.begin() + static_cast<std::ptrdiff_t>(offset), 64 * 1024, 0);
  std::fill(expected.begin() + 5 * 64 * 1024, expected.end(), 0);
  std::vector<uint8_t> back(kSize);
  ASSERT_TRUE((*engine)->CopyToHost(0, 0, back).ok());
  EXPECT_EQ(back, expected);
}

// A BO's device buffer is whole 2 MiB pages: a page server maps one of another size from its IPC
// handle in milliseconds a GiB, and holds its DMA back meanwhile (docs/benchmarks.md, "Session
// 41"). The BO's bounds stay its own size.
TEST_F(CudaEngineTest, BoBuffersAreWholeTwoMiBPagesAndWritesStayInTheBo) {
  using GetAddressRange = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  void* found = nullptr;
  cudaDriverEntryPointQueryResult query{};
  ASSERT_EQ(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &found, 12000,
                                             cudaEnableDefault, &query),
            cudaSuccess);
  ASSERT_EQ(query, cudaDriverEntryPointSuccess);
  const auto address_range = reinterpret_cast<GetAddressRange>(found);
  auto engine = CudaCopyEngine::Create({});
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  constexpr uint64_t kPage = 2ull << 20;
  const std::map<uint32_t, std::pair<uint64_t, uint64_t>> sizes = {
      {0, {0, kPage}}, {1, {4096, kPage}}, {2, {kPage, kPage}}, {3, {3 * kPage + 5, 4 * kPage}}};
  for (const auto& [bo, size] : sizes)
    ASSERT_TRUE((*engine)->AddDestination(bo, size.first).ok());
  for (const auto& [bo, size] : sizes) {
    SCOPED_TRACE(bo);
    const auto pointer = reinterpret_cast<CUdeviceptr>((*engine)->DevicePointer(bo));
    CUdeviceptr base = 0;
    size_t allocated = 0;
    ASSERT_EQ(address_range(&base, &allocated, pointer), CUDA_SUCCESS);
    EXPECT_EQ(base, pointer);
    EXPECT_EQ(allocated, size.second);
  }
  std::vector<uint8_t> bytes(2, 1);
  bool called = false;
  EXPECT_EQ((*engine)->Write(3, 3 * kPage + 4, bytes, [&](Status) { called = true; }).code(),
            Code::kOutOfRange);
  ASSERT_TRUE((*engine)->Flush().ok());
  EXPECT_FALSE(called);
}

// Lent staging slots: several threads fill slots in place and commit them; released slots go
// back to the ring (with 5 slots, a few leaked ones would hang a later ReceiveTarget).
TEST_F(CudaEngineTest, ReceiveTargetsFromSeveralThreadsLandByteExact) {
  CudaEngineOptions options;
  options.staging_slots = 5;  // one more than the threads: the engine never lends its last
  options.slot_bytes = 64 << 10;
  options.streams = 2;
  auto engine = CudaCopyEngine::Create(options);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const uint64_t chunks = 64, size = chunks * (64 << 10);
  ASSERT_TRUE((*engine)->AddDestination(0, size).ok());
  const std::vector<uint8_t> source = RandomBytes(size, 11);
  // Past the end, or larger than a slot: no slot is lent.
  EXPECT_FALSE((*engine)->ReceiveTarget(0, size - 10, 64 << 10).has_value());
  EXPECT_FALSE((*engine)->ReceiveTarget(0, 0, (64 << 10) + 1).has_value());
  EXPECT_FALSE((*engine)->ReceiveTarget(3, 0, 4096).has_value());
  std::atomic<int> done{0}, failures{0};
  std::vector<std::thread> threads;
  for (uint32_t t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (uint64_t c = t; c < chunks; c += 4) {
        const uint64_t at = c * (64 << 10);
        auto slot = (*engine)->ReceiveTarget(0, at, 64 << 10);
        if (!slot || slot->size() != (64u << 10)) {
          ++failures;
          continue;
        }
        if (c % 5 == 0) {
          // A receive that fails verification: released, then received again.
          std::memset(slot->data(), 0xee, slot->size());
          (*engine)->ReleaseReceived(0, at, 64 << 10);
          slot = (*engine)->ReceiveTarget(0, at, 64 << 10);
          if (!slot) {
            ++failures;
            continue;
          }
        }
        std::memcpy(slot->data(), source.data() + at, slot->size());
        Status s = (*engine)->CommitReceived(0, at, 64 << 10, [&](Status st) {
          if (!st.ok()) ++failures;
          ++done;
        });
        if (!s.ok()) ++failures;
      }
    });
  }
  for (std::thread& t : threads)
    t.join();
  ASSERT_TRUE((*engine)->Flush().ok());
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(done.load(), static_cast<int>(chunks));
  EXPECT_FALSE((*engine)->CommitReceived(0, 0, 64 << 10, [](Status) {}).ok())
      << "a commit without a lent slot must be refused";
  std::vector<uint8_t> back(size);
  ASSERT_TRUE((*engine)->CopyToHost(0, 0, back).ok());
  EXPECT_EQ(back, source);
}

// verify_on_device: the GPU hashes each committed chunk (XXH3-64 computed by the kernel must be
// libxxhash's, at lengths across XXH3's stripe and block edges) and installs only chunks that
// match; a mismatch completes with kCorrupt, leaves the BO's bytes as they were, and is not an
// engine failure (Flush stays Ok); the same chunk committed again with the right bytes lands.
TEST_F(CudaEngineTest, VerifiedCommitsInstallOnlyChunksThatHashRight) {
  CudaEngineOptions options;
  options.staging_slots = 6;
  options.streams = 3;
  options.verify_on_device = true;
  auto engine = CudaCopyEngine::Create(options);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  constexpr uint32_t kChunk = 2u << 20;
  ASSERT_TRUE((*engine)->ExpectChunkBytes(kChunk).ok());
  EXPECT_FALSE((*engine)->VerifiesChunks(240));  // XXH3's short paths stay on the CPU
  EXPECT_TRUE((*engine)->VerifiesChunks(241));
  const std::vector<uint32_t> lengths = {241,  1023,   1024,     1025,       1088,
                                         4159, 300001, 1u << 20, kChunk - 1, kChunk};
  const uint64_t size = uint64_t{kChunk} * lengths.size();
  ASSERT_TRUE((*engine)->AddDestination(0, size).ok());
  // The BO's bytes before: a pattern a bad copy must leave alone.
  const std::vector<uint8_t> pattern(kChunk, 0xA5);
  for (uint64_t at = 0; at < size; at += kChunk)
    ASSERT_TRUE((*engine)->Write(0, at, pattern, [](Status) {}).ok());
  ASSERT_TRUE((*engine)->Flush().ok());
  const std::vector<uint8_t> source = RandomBytes(size, 23);

  std::mutex mu;
  std::map<uint64_t, Status> outcome;  // by offset
  auto commit = [&](size_t i, bool spoil) {
    const uint64_t at = uint64_t{kChunk} * i;
    const std::span<const uint8_t> bytes(source.data() + at, lengths[i]);
    auto lent = (*engine)->ReceiveTarget(0, at, lengths[i]);
    ASSERT_TRUE(lent.has_value());
    std::memcpy(lent->data(), bytes.data(), bytes.size());
    const uint64_t checksum = Checksum64(bytes) ^ (spoil ? 1 : 0);
    Status s = (*engine)->CommitUnverified(0, at, lengths[i], checksum, [&, at](Status st) {
      std::lock_guard lock(mu);
      outcome[at] = st;
    });
    ASSERT_TRUE(s.ok()) << s.ToString();
  };
  for (size_t i = 0; i < lengths.size(); ++i)
    commit(i, /*spoil=*/i % 2 == 1);
  ASSERT_TRUE((*engine)->Flush().ok());
  std::vector<uint8_t> back(kChunk);
  for (size_t i = 0; i < lengths.size(); ++i) {
    SCOPED_TRACE(fmt::format("{} bytes", lengths[i]));
    const uint64_t at = uint64_t{kChunk} * i;
    ASSERT_TRUE(outcome.contains(at));
    ASSERT_TRUE((*engine)->CopyToHost(0, at, back).ok());
    if (i % 2 == 1) {
      EXPECT_EQ(outcome[at].code(), Code::kCorrupt) << outcome[at].ToString();
      EXPECT_EQ(back, pattern) << "a chunk that failed verification reached the BO";
    } else {
      EXPECT_TRUE(outcome[at].ok()) << outcome[at].ToString();
      EXPECT_EQ(std::memcmp(back.data(), source.data() + at, lengths[i]), 0);
      EXPECT_TRUE(
          std::all_of(back.begin() + lengths[i], back.end(), [](uint8_t b) { return b == 0xA5; }));
    }
  }
  EXPECT_EQ((*engine)->chunks_verified_on_device(), lengths.size() / 2);
  for (size_t i = 1; i < lengths.size(); i += 2)
    commit(i, /*spoil=*/false);
  ASSERT_TRUE((*engine)->Flush().ok());
  for (size_t i = 1; i < lengths.size(); i += 2) {
    const uint64_t at = uint64_t{kChunk} * i;
    EXPECT_TRUE(outcome[at].ok()) << outcome[at].ToString();
    ASSERT_TRUE((*engine)->CopyToHost(0, at, back).ok());
    EXPECT_EQ(std::memcmp(back.data(), source.data() + at, lengths[i]), 0) << lengths[i];
  }
  EXPECT_EQ((*engine)->chunks_verified_on_device(), lengths.size());
}

// Verified commits from several threads through fewer slots than chunks: every chunk lands
// byte-exact. An engine without verify_on_device refuses CommitUnverified and takes its slot
// back (the caller's next ReceiveTarget still gets one).
TEST_F(CudaEngineTest, VerifiedCommitsFromSeveralThreadsAndRefusalWithoutTheOption) {
  constexpr uint32_t kChunk = 1u << 20;
  constexpr uint32_t kThreads = 4, kPerThread = 12;
  {
    CudaEngineOptions options;
    options.staging_slots = 8;
    options.streams = 4;
    options.verify_on_device = true;
    auto engine = CudaCopyEngine::Create(options);
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    ASSERT_TRUE((*engine)->ExpectChunkBytes(kChunk).ok());
    const uint64_t size = uint64_t{kChunk} * kThreads * kPerThread;
    ASSERT_TRUE((*engine)->AddDestination(0, size).ok());
    const std::vector<uint8_t> source = RandomBytes(size, 5);
    std::atomic<int> good{0};
    // Lent under a lock and committed outside it, as the restores' file readers do with an
    // engine that takes concurrent commits (CopyEngine::ConcurrentCommits).
    EXPECT_TRUE((*engine)->ConcurrentCommits());
    std::mutex engine_calls;
    std::vector<std::thread> threads;
    for (uint32_t t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (uint32_t k = 0; k < kPerThread; ++k) {
          const uint64_t at = uint64_t{kChunk} * (k * kThreads + t);
          std::optional<std::span<uint8_t>> lent;
          {
            std::lock_guard lock(engine_calls);
            lent = (*engine)->ReceiveTarget(0, at, kChunk);
          }
          if (!lent) {  // every lendable slot was out: the Write path, as a restore would
            ASSERT_TRUE((*engine)
                            ->Write(0, at, {source.data() + at, kChunk},
                                    [&](Status st) { good += st.ok() ? 1 : 0; })
                            .ok());
            continue;
          }
          std::memcpy(lent->data(), source.data() + at, kChunk);
          const uint64_t checksum = Checksum64({source.data() + at, kChunk});
          ASSERT_TRUE((*engine)
                          ->CommitUnverified(0, at, kChunk, checksum,
                                             [&](Status st) { good += st.ok() ? 1 : 0; })
                          .ok());
        }
      });
    }
    for (std::thread& t : threads)
      t.join();
    ASSERT_TRUE((*engine)->Flush().ok());
    EXPECT_EQ(good.load(), static_cast<int>(kThreads * kPerThread));
    EXPECT_GT((*engine)->chunks_verified_on_device(), 0u);
    std::vector<uint8_t> back(size);
    ASSERT_TRUE((*engine)->CopyToHost(0, 0, back).ok());
    EXPECT_EQ(back, source);
  }
  CudaEngineOptions plain;
  plain.staging_slots = 2;
  plain.verify_on_device = false;
  auto engine = CudaCopyEngine::Create(plain);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  ASSERT_TRUE((*engine)->ExpectChunkBytes(kChunk).ok());
  ASSERT_TRUE((*engine)->AddDestination(0, kChunk).ok());
  EXPECT_FALSE((*engine)->VerifiesChunks(kChunk));
  for (int i = 0; i < 3; ++i) {  // more rounds than lendable slots: each refusal freed its slot
    auto lent = (*engine)->ReceiveTarget(0, 0, kChunk);
    ASSERT_TRUE(lent.has_value()) << "round " << i;
    Status refused = (*engine)->CommitUnverified(
        0, 0, kChunk, 0, [](Status) { ADD_FAILURE() << "done of a refused commit"; });
    EXPECT_EQ(refused.code(), Code::kUnsupported) << refused.ToString();
  }
  EXPECT_TRUE((*engine)->Flush().ok());
}

}  // namespace
}  // namespace gpulazy::client
