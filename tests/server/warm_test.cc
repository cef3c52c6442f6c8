// --warm: images made ready once the server listens (lazy-server/server/warm.h). The page
// cache part is checked with mincore after the file's pages were dropped; the server part by
// its stats, with an image that cannot be warmed beside two that can.
#include "lazy-server/server/warm.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "lazy-server/image/image_source.h"
#include "lazy-server/image/io.h"
#include "page-client/host_engine.h"
#include "page-client/restore_session.h"
#include "tests/server/checkpoint_bytes.h"
#include "tests/server/test_support.h"

namespace gpulazy::server::testing {
namespace {

namespace fs = std::filesystem;

// Pages of `fd`'s first `size` bytes in the page cache now.
size_t ResidentPages(int fd, uint64_t size) {
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (map == MAP_FAILED) return 0;
  std::vector<unsigned char> resident((size + page - 1) / page);
  size_t count = 0;
  if (::mincore(map, size, resident.data()) == 0)
    for (unsigned char r : resident)
      count += r & 1;
  ::munmap(map, size);
  return count;
}

// A file of `size` bytes written and synced, its pages then dropped from the page cache (clean
// pages of an ext4 or xfs file go; a file system that keeps them cannot show the read).
UniqueFd ColdFile(const fs::path& path, uint64_t size) {
  UniqueFd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
  std::vector<uint8_t> block(1u << 20, 0x5a);
  for (uint64_t at = 0; at < size; at += block.size())
    EXPECT_EQ(::pwrite(fd.get(), block.data(), std::min<uint64_t>(block.size(), size - at),
                       static_cast<off_t>(at)),
              static_cast<ssize_t>(std::min<uint64_t>(block.size(), size - at)));
  EXPECT_EQ(::fsync(fd.get()), 0);
  EXPECT_EQ(::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED), 0);
  return fd;
}

TEST(ReadIntoPageCache, ReadsEveryPageOfTheFileAcrossWindows) {
  TempDir dir;
  const uint64_t size = (130u << 20) + 4096 + 17;  // three windows, the last one short
  UniqueFd fd = ColdFile(dir.path() / "pages.img", size);
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const size_t pages = (size + page - 1) / page;
  if (ResidentPages(fd.get(), size) > pages / 2)
    GTEST_SKIP() << "this file system keeps dropped pages cached: cannot observe the read";
  ASSERT_TRUE(ReadIntoPageCache(fd.get(), size, [] { return true; }).ok());
  // Every page was read, but the kernel may reclaim a few before mincore looks (a CI run saw 16
  // of 33282 gone): a read that skipped a window (thousands of pages) still fails this by far.
  EXPECT_GE(ResidentPages(fd.get(), size), pages - pages / 100) << "of " << pages;
}

TEST(ReadIntoPageCache, StopsWhenToldAndReportsAFileShorterThanSaid) {
  TempDir dir;
  const uint64_t size = 70u << 20;
  UniqueFd fd = ColdFile(dir.path() / "pages.img", size);
  int windows = 0;
  Status stopped = ReadIntoPageCache(fd.get(), size, [&] { return windows++ < 1; });
  EXPECT_EQ(stopped.code(), Code::kAborted) << stopped.ToString();
  EXPECT_EQ(windows, 2);  // asked before each window: read the first, stopped before the second
  // A file that ends before the size it was opened with: an error, not a hang or a crash.
  Status short_file = ReadIntoPageCache(fd.get(), size + (8u << 20), [] { return true; });
  EXPECT_FALSE(short_file.ok());
  EXPECT_NE(short_file.ToString().find(std::to_string(size)), std::string::npos)
      << short_file.ToString();
}

nlohmann::json Stats(const ServerProcess& server) {
  TestClient client(server.unix_endpoint());
  EXPECT_TRUE(client.Hello().ok());
  Result<std::string> stats = client.Stats();
  EXPECT_TRUE(stats.ok()) << stats.status().ToString();
  return nlohmann::json::parse(stats.ok() ? *stats : "{}");
}

// Polls the server's stats until no image is left to warm.
nlohmann::json WarmedStats(const ServerProcess& server) {
  nlohmann::json stats;
  for (int i = 0; i < 500; ++i) {
    stats = Stats(server);
    if (stats["server"].contains("warm") && stats["server"]["warm"]["pending"] == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return stats;
}

void ExpectWarmed(const std::vector<std::string>& placement) {
  TempDir dir;
  const fs::path root = dir.path() / "images";
  TestImage shape;
  shape.bytes = 6u << 20;
  ASSERT_TRUE(MakeTestImage(root / "a", shape).ok());
  shape.lazy = true;
  shape.seed = 2;
  ASSERT_TRUE(MakeTestImage(root / "b", shape).ok());
  uint64_t files = 0;
  uint64_t bytes = 0;
  for (const char* name : {"a", "b"}) {
    auto source = image::ImageSource::Open(root / name);
    ASSERT_TRUE(source.ok()) << source.status().ToString();
    for (const auto& file : (*source)->files()) {
      ++files;
      bytes += file.size;
    }
  }
  std::vector<std::string> args = {"--warm", "a", "--warm", "no/such/image", "--warm", "b"};
  args.insert(args.end(), placement.begin(), placement.end());
  ServerProcess server(dir.path(), root, args);
  ASSERT_TRUE(server.ready()) << server.Log();
  const nlohmann::json stats = WarmedStats(server);
  const nlohmann::json& warm = stats["server"]["warm"];
  EXPECT_EQ(warm["pending"], 0) << stats.dump();
  EXPECT_EQ(warm["images"], 2) << stats.dump();
  EXPECT_EQ(warm["failures"], 1) << stats.dump();
  EXPECT_EQ(warm["files"], files) << stats.dump();
  EXPECT_EQ(warm["bytes"], bytes) << stats.dump();
  EXPECT_TRUE(server.LogShows({"--warm no/such/image"})) << server.Log();

  // A warmed image restores as any other.
  auto expected = LoadCriuContents(root / "a");
  ASSERT_TRUE(expected.ok());
  client::HostCopyEngine engine;
  client::SessionOptions options;
  options.endpoint = server.unix_endpoint().ToString();
  options.image = "a";
  options.reconnect.max_attempts = 0;
  client::RestoreSession session(options, engine);
  ASSERT_TRUE(session.Start().ok());
  ASSERT_TRUE(session.WaitComplete(30s).ok());
  ExpectRestoredBytes(session, engine, *expected);
  EXPECT_EQ(server.Terminate(), 0) << server.Log();
}

TEST(Warm, ImagesAreWarmedOnceListeningAndOneMissingIsReportedNotFatal) {
  ExpectWarmed({});
}

TEST(Warm, WithPlacementTheSameAndTheRestoreIsPlaced) {
  ExpectWarmed({"--placement", "memfd"});
}

TEST(Warm, ServerWithoutWarmReportsNoWarmStats) {
  TempDir dir;
  const fs::path root = dir.path() / "images";
  ASSERT_TRUE(MakeTestImage(root / "a", TestImage{.bytes = 1u << 20}).ok());
  ServerProcess server(dir.path(), root);
  ASSERT_TRUE(server.ready()) << server.Log();
  EXPECT_FALSE(Stats(server)["server"].contains("warm"));
}

}  // namespace
}  // namespace gpulazy::server::testing
