// CudaCopyEngine against a real GPU. Skipped where no CUDA device exists (CI compiles it only).
#include "page-client/cuda/cuda_engine.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <numeric>
#include <optional>
#include <random>
#include <thread>

namespace gpulazy::client {
namespace {

class CudaEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device here";
  }
};

TEST_F(CudaEngineTest, WritesLandByteExactThroughMoreWritesThanSlots) {
  CudaEngineOptions options;
  options.staging_slots = 3;  // fewer slots than writes: Write must wait for the reaper
  options.slot_bytes = 64 << 10;
  options.streams = 2;
  auto engine = CudaCopyEngine::Create(options);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const uint64_t size = 40 * (64 << 10) + 123;  // a short last write
  ASSERT_TRUE((*engine)->AddDestination(0, size).ok());
  std::vector<uint8_t> source(size);
  std::mt19937 random(7);
  for (uint8_t& b : source)
    b = static_cast<uint8_t>(random());
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
  std::vector<uint8_t> source(size);
  std::mt19937 random(11);
  for (uint8_t& b : source)
    b = static_cast<uint8_t>(random());
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
  std::vector<uint8_t> source(size);
  std::mt19937 random(11);
  for (uint8_t& b : source)
    b = static_cast<uint8_t>(random());
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
  std::vector<uint8_t> source(size);
  std::mt19937 random(11);
  for (uint8_t& b : source)
    b = static_cast<uint8_t>(random());
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

}  // namespace
}  // namespace gpulazy::client
