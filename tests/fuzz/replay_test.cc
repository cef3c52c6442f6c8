// Runs every committed input of one fuzz target's corpus (tests/fuzz/corpus/<target>/) through
// its harness in the ordinary (GCC, and sanitizer) builds, so seed inputs and the reproducers
// of fixed crashes are checked by every CI run, not only by scripts/fuzz.sh. A harness reports
// a broken property by aborting, which fails the test.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <vector>

#include "tests/support/files.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

namespace fs = std::filesystem;

// The suite is named per target (FrameFuzzCorpus, ...), so ctest tells the four apart.
TEST(GPULAZY_FUZZ_SUITE, EveryInputPasses) {
  const fs::path corpus = fs::path(GPULAZY_SOURCE_DIR) / "tests/fuzz/corpus" / GPULAZY_FUZZ_TARGET;
  std::vector<fs::path> inputs;
  for (const fs::directory_entry& entry : fs::directory_iterator(corpus))
    if (entry.is_regular_file()) inputs.push_back(entry.path());
  std::sort(inputs.begin(), inputs.end());
  ASSERT_GE(inputs.size(), 4u) << "seed corpus missing under " << corpus;
  for (const fs::path& input : inputs) {
    SCOPED_TRACE(input.filename().string());
    const std::vector<uint8_t> bytes = ::gpulazy::testing::ReadFileBytes(input);
    EXPECT_EQ(LLVMFuzzerTestOneInput(bytes.data(), bytes.size()), 0);
  }
}

}  // namespace
