// gpulazy-client fetch against the in-process fake server: the pages file it writes holds the
// header and every BO's bytes in bo_index order; --json reports the restore; errors exit non-zero.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>

#include "tests/client/fake_server.h"
#include "tests/support/files.h"
#include "tests/support/process.h"

namespace gpulazy::client {
namespace {

using gpulazy::testing::FakeImage;
using gpulazy::testing::FakeServer;

using ClientRun = ::gpulazy::testing::CommandRun;

ClientRun RunClient(const std::string& args) {
  return ::gpulazy::testing::RunCommand(GPULAZY_BIN_DIR "/gpulazy-client " + args);
}

class FetchCli : public ::testing::Test {
 protected:
  void SetUp() override {
    char templ[] = "/tmp/gpulazy-fetch-XXXXXX";
    dir_ = ::mkdtemp(templ);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
};

TEST_F(FetchCli, WritesByteExactPagesFiles) {
  FakeImage image = FakeImage::Make({64 * 1024, 40960, 4096}, 4096, 3);
  FakeServer server(image, {});
  ClientRun run = RunClient("fetch --server " + server.endpoint() + " --image test-image --out " +
                            dir_.string() + " --json --window 1M");
  ASSERT_EQ(run.exit_code, 0) << run.out;
  nlohmann::json summary = nlohmann::json::parse(run.out);
  uint64_t total = 64 * 1024 + 40960 + 4096;
  EXPECT_EQ(summary["bytes"].get<uint64_t>(), total);
  EXPECT_EQ(summary["chunks"].get<uint64_t>(), image.TotalChunks());
  EXPECT_EQ(summary["reconnects"].get<uint64_t>(), 0u);

  ASSERT_TRUE(std::filesystem::exists(dir_ / "amdgpu-pages-1-c0de.img"));
  const std::vector<uint8_t> bytes =
      ::gpulazy::testing::ReadFileBytes(dir_ / "amdgpu-pages-1-c0de.img");
  ASSERT_EQ(bytes.size(), 8 + total);
  uint64_t header = 0;
  for (int i = 7; i >= 0; --i)
    header = (header << 8) | bytes[i];
  EXPECT_EQ(header, total);
  std::vector<uint8_t> expected;
  for (const std::vector<uint8_t>& bo : image.bos)
    expected.insert(expected.end(), bo.begin(), bo.end());
  EXPECT_TRUE(std::equal(expected.begin(), expected.end(), bytes.begin() + 8));
}

TEST_F(FetchCli, FailsClearlyOnAnUnknownImage) {
  FakeImage image = FakeImage::Make({4096}, 4096, 3);
  FakeServer server(image, {});
  ClientRun run =
      RunClient("fetch --server " + server.endpoint() + " --image nope --out " + dir_.string());
  EXPECT_EQ(run.exit_code, 1) << run.out;
  EXPECT_NE(run.out.find("no image named 'nope'"), std::string::npos) << run.out;
  EXPECT_FALSE(std::filesystem::exists(dir_ / "amdgpu-pages-1-c0de.img"));
}

TEST_F(FetchCli, RejectsABadEndpoint) {
  ClientRun run = RunClient("fetch --server bogus --image x --out " + dir_.string());
  EXPECT_EQ(run.exit_code, 1) << run.out;
  EXPECT_NE(run.out.find("must start with unix: or tcp:"), std::string::npos) << run.out;
}

}  // namespace
}  // namespace gpulazy::client
