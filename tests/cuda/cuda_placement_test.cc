// `gpulazy-server --placement cuda` with a RestoreSession on the CUDA engine: the engine hands
// over its BOs' device buffers (CUDA IPC handles), the server places every chunk there from its
// registered page cache, checked on the GPU, and the buffers read back byte for byte as the
// checkpoint. Skipped where no CUDA device exists (CI compiles it only).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "page-client/cuda/cuda_engine.h"
#include "page-client/restore_session.h"
#include "tests/server/placed_reconnect.h"
#include "tests/server/test_support.h"

namespace gpulazy::server::testing {
namespace {
namespace fs = std::filesystem;
using namespace std::chrono_literals;

// Every BO of the restore, copied back from the engine's device memory, is the checkpoint's.
void ExpectDeviceBytes(const client::RestoreSession& session, const client::CudaCopyEngine& engine,
                       const std::map<BoKey, std::vector<uint8_t>>& expected) {
  for (uint32_t i = 0; i < session.bos().size(); ++i) {
    auto want = expected.find(BoKey{session.bos()[i].process_id, session.bos()[i].bo_index});
    ASSERT_NE(want, expected.end());
    std::vector<uint8_t> got(want->second.size());
    ASSERT_TRUE(engine.CopyToHost(i, 0, got).ok());
    EXPECT_EQ(got, want->second) << "BO " << i;
  }
}

TEST(CudaPlacementTest, ServerPlacesEveryChunkIntoTheEnginesBuffersByteExact) {
  if (!client::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device here";
  TempDir dir;
  const fs::path root = dir.path() / "images";
  fs::create_directories(root);
  TestImage lazy{
      .bytes = 24ull << 20, .seed = 51, .lazy = true, .processes = 2, .lazy_chunk = 1u << 20};
  ASSERT_TRUE(MakeTestImage(root / "raw", {.bytes = 24ull << 20, .seed = 52, .processes = 2}).ok());
  ASSERT_TRUE(MakeTestImage(root / "lazy", lazy).ok());
  ServerProcess server(
      dir.path(), root,
      {"--raw-chunk-size", "2M", "--placement", "cuda", "--placement-pin-budget", "1G"});
  ASSERT_TRUE(server.ready()) << server.Log();
  for (const std::string name : {"raw", "lazy"}) {
    SCOPED_TRACE(name);
    auto expected = LoadCriuContents(root / name);
    ASSERT_TRUE(expected.ok()) << expected.status().ToString();
    Result<std::unique_ptr<client::CudaCopyEngine>> engine = client::CudaCopyEngine::Create({});
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    client::SessionOptions options;
    options.endpoint = server.unix_endpoint().ToString();
    options.image = name;
    options.reconnect.max_attempts = 0;
    client::RestoreSession session(options, **engine);
    ASSERT_TRUE(session.Start().ok());
    Status complete = session.WaitComplete(60s);
    ASSERT_TRUE(complete.ok()) << complete.ToString() << server.Log().substr(0, 20000);
    const client::Progress progress = session.progress();
    EXPECT_TRUE(progress.placing);
    EXPECT_GT(progress.placed_chunks, 0u);
    if (name == "raw") {
      EXPECT_EQ(progress.placed_bytes, progress.total_bytes);
    }
    ExpectDeviceBytes(session, **engine, *expected);
  }
  EXPECT_EQ(server.Terminate(), 0) << server.Log().substr(0, 20000);
}

nlohmann::json PlacementStats(const ServerProcess& server) {
  TestClient client(server.unix_endpoint());
  EXPECT_TRUE(client.Hello().ok());
  Result<std::string> stats = client.Stats();
  EXPECT_TRUE(stats.ok()) << stats.status().ToString();
  return nlohmann::json::parse(stats.ok() ? *stats : "{}")["server"];
}

// --warm registers the image's files before any client asks: the restore then registers none,
// and an image whose pages files are each larger than the budget is refused (counted), not
// fatal, and lets go of nothing registered before it.
TEST(CudaPlacementTest, WarmRegistersTheImageBeforeItsFirstRestore) {
  if (!client::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device here";
  TempDir dir;
  const fs::path root = dir.path() / "images";
  fs::create_directories(root);
  ASSERT_TRUE(MakeTestImage(root / "raw", {.bytes = 24ull << 20, .seed = 53, .processes = 2}).ok());
  // Two pages files (one per GPU), each well over the budget.
  ASSERT_TRUE(MakeTestImage(root / "big", {.bytes = 400ull << 20, .seed = 54}).ok());
  ServerProcess server(dir.path(), root,
                       {"--raw-chunk-size", "2M", "--placement", "cuda", "--placement-pin-budget",
                        "64M", "--warm", "raw", "--warm", "big"});
  ASSERT_TRUE(server.ready()) << server.Log();
  nlohmann::json stats;
  for (int i = 0; i < 1000; ++i) {
    stats = PlacementStats(server);
    if (stats["warm"]["pending"] == 0) break;
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(stats["warm"]["pending"], 0) << stats.dump();
  EXPECT_EQ(stats["warm"]["images"], 1) << stats.dump();
  EXPECT_EQ(stats["warm"]["failures"], 1) << stats.dump();  // big's pages file: over 64M
  EXPECT_EQ(stats["placement"]["evictions"], 0) << stats.dump();
  EXPECT_GE(stats["placement"]["budget_refusals"].get<uint64_t>(), 1u) << stats.dump();
  const uint64_t registered = stats["placement"]["registrations"].get<uint64_t>();
  EXPECT_GE(registered, 2u) << stats.dump();  // raw's two processes' pages files at least

  auto expected = LoadCriuContents(root / "raw");
  ASSERT_TRUE(expected.ok()) << expected.status().ToString();
  Result<std::unique_ptr<client::CudaCopyEngine>> engine = client::CudaCopyEngine::Create({});
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  client::SessionOptions options;
  options.endpoint = server.unix_endpoint().ToString();
  options.image = "raw";
  options.reconnect.max_attempts = 0;
  client::RestoreSession session(options, **engine);
  ASSERT_TRUE(session.Start().ok());
  ASSERT_TRUE(session.WaitComplete(60s).ok()) << server.Log().substr(0, 20000);
  EXPECT_EQ(session.progress().placed_bytes, session.progress().total_bytes);
  ExpectDeviceBytes(session, **engine, *expected);
  EXPECT_EQ(PlacementStats(server)["placement"]["registrations"], registered);
  EXPECT_EQ(server.Terminate(), 0) << server.Log().substr(0, 20000);
}

// Restores ended while the server still copies into their device buffers, each engine freeing
// its buffers right after: the server ends its copies and closes the IPC mappings before the
// session is gone (docs/protocol.md, "Placement", 5), and goes on serving byte-exact.
TEST(CudaPlacementTest, SessionsEndedMidStreamLetGoOfTheirBuffersFirst) {
  if (!client::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device here";
  TempDir dir;
  const fs::path root = dir.path() / "images";
  fs::create_directories(root);
  ASSERT_TRUE(
      MakeTestImage(root / "raw", {.bytes = 512ull << 20, .seed = 55, .processes = 2}).ok());
  ServerProcess server(
      dir.path(), root,
      {"--raw-chunk-size", "2M", "--placement", "cuda", "--placement-pin-budget", "2G"});
  ASSERT_TRUE(server.ready()) << server.Log();
  client::SessionOptions options;
  options.endpoint = server.unix_endpoint().ToString();
  options.image = "raw";
  options.reconnect.max_attempts = 0;
  for (int round = 0; round < 4; ++round) {
    SCOPED_TRACE(round);
    Result<std::unique_ptr<client::CudaCopyEngine>> engine = client::CudaCopyEngine::Create({});
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    auto session = std::make_unique<client::RestoreSession>(options, **engine);
    ASSERT_TRUE(session->Start().ok());
    for (int i = 0; i < 5000 && session->progress().placed_chunks == 0; ++i)
      std::this_thread::sleep_for(1ms);
    EXPECT_GT(session->progress().placed_chunks, 0u);
    if (round % 2 == 0) session->Cancel();  // half the rounds cancel before they go
    session.reset();                        // mid-stream
    engine->reset();                        // frees the device buffers the server had open
  }
  auto expected = LoadCriuContents(root / "raw");
  ASSERT_TRUE(expected.ok()) << expected.status().ToString();
  Result<std::unique_ptr<client::CudaCopyEngine>> engine = client::CudaCopyEngine::Create({});
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  client::RestoreSession session(options, **engine);
  ASSERT_TRUE(session.Start().ok());
  Status complete = session.WaitComplete(60s);
  ASSERT_TRUE(complete.ok()) << complete.ToString() << server.Log().substr(0, 20000);
  ExpectDeviceBytes(session, **engine, *expected);
  EXPECT_EQ(server.Terminate(), 0) << server.Log().substr(0, 20000);
  // No mapping failed to close.
  const std::string log = server.Log();
  EXPECT_EQ(log.find("closing a destination"), std::string::npos) << log.substr(0, 20000);
}

// Every connection breaks at once, mid-stream, while the server copies into the engine's device
// buffers: the client reconnects and its new session names the broken one, which the server ends
// (closing every IPC mapping it opened) before it opens the new session's handles to the same
// buffers again (docs/protocol.md, "Placement", 6). Whether the server noticed the break or not,
// the restore finishes byte-exact on the device and no mapping failed to close.
class CudaSupersedeTest : public ::testing::TestWithParam<bool> {};

TEST_P(CudaSupersedeTest, AReconnectedSessionPlacesIntoTheSameBuffersByteExact) {
  if (!client::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device here";
  TempDir dir;
  const fs::path root = dir.path() / "images";
  fs::create_directories(root);
  ASSERT_TRUE(MakeTestImage(root / "raw", {.bytes = 1ull << 30, .seed = 56, .processes = 2}).ok());
  auto expected = LoadCriuContents(root / "raw");
  ASSERT_TRUE(expected.ok()) << expected.status().ToString();
  ServerProcess server(
      dir.path(), root,
      {"--raw-chunk-size", "2M", "--placement", "cuda", "--placement-pin-budget", "4G"});
  ASSERT_TRUE(server.ready()) << server.Log();
  gpulazy::testing::UnixRelay relay(dir.path() / "relay.sock", server.socket_path());
  Result<std::unique_ptr<client::CudaCopyEngine>> engine = client::CudaCopyEngine::Create({});
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  client::RestoreSession session(CutSessionOptions(dir.path() / "relay.sock", "raw"), **engine);
  ASSERT_TRUE(session.Start().ok());
  CutMidStreamAndFinish(session, relay, server, GetParam());
  if (HasFatalFailure()) return;
  ExpectDeviceBytes(session, **engine, *expected);
}

INSTANTIATE_TEST_SUITE_P(ServerSawTheBreak, CudaSupersedeTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "ServerSawIt" : "ServerDidNot";
                         });

}  // namespace
}  // namespace gpulazy::server::testing
