// CudaCopyEngine against a real GPU. Skipped where no CUDA device exists (CI compiles it only).
#include "page-client/cuda/cuda_engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <numeric>
#include <random>

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

}  // namespace
}  // namespace gpulazy::client
