// CudaCopyEngine against a real GPU. Skipped where no CUDA device exists (CI compiles it only).
#include "page-client/cuda/cuda_engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <numeric>
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
// back to the ring (with 2 slots, a leaked one would hang the next ReceiveTarget).
TEST_F(CudaEngineTest, ReceiveTargetsFromSeveralThreadsLandByteExact) {
  CudaEngineOptions options;
  options.staging_slots = 2;
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
