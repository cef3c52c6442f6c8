// End-to-end tests against a real gpulazy-server process: `gpulazy-client fetch` reproduces
// every CRIU pages file byte for byte (raw and lazy images, multi-GPU, multi-process, over
// unix and tcp), and a RestoreSession survives its server being SIGKILLed mid-restore and
// restarted on the same socket. Every wait is bounded.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/lazy_image.h"
#include "lazy-server/image/synth.h"
#include "page-client/host_engine.h"
#include "page-client/restore_session.h"
#include "tests/server/test_support.h"
#include "tests/support/files.h"
#include "tests/support/process.h"
#include "tests/support/sanitizers.h"

namespace gpulazy {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using ::gpulazy::testing::PagesFiles;
using server::testing::BoKey;
using server::testing::LoadCriuContents;
using server::testing::ServerProcess;
using server::testing::TempDir;

::gpulazy::testing::CommandRun RunClient(const std::string& args) {
  return ::gpulazy::testing::RunCommand(GPULAZY_BIN_DIR "/gpulazy-client " + args);
}

void Synthesize(const fs::path& out, uint64_t total_bytes, uint64_t seed) {
  image::SynthOptions options;
  options.out = out;
  options.gpus = 3;
  options.processes = 2;
  options.bos = 12;
  options.total_bytes = total_bytes;
  options.seed = seed;
  Result<image::SynthReport> report = image::SynthesizeCheckpoint(options);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
}

// 1. `fetch` against a real server: raw CRIU and lazy image, over unix and tcp. Eight fetches
// of 32 MiB; under a sanitizer 8 MiB each, whose lazy image still holds raw, LZ4, all-zero and
// deduplicated chunks (44 of 256 KiB), so every path still runs.
TEST(E2eFetch, ByteIdenticalPagesFilesRawAndLazyOverUnixAndTcp) {
  TempDir root;
  TempDir run_dir;
  const fs::path raw = root.path() / "raw";
  const fs::path lazy = root.path() / "lazy";
  const uint64_t image_bytes = ::gpulazy::testing::SanitizerScaled(32ull << 20);
  ASSERT_NO_FATAL_FAILURE(Synthesize(raw, image_bytes, 11));
  ASSERT_NO_FATAL_FAILURE(Synthesize(lazy, image_bytes, 12));
  const auto raw_files = PagesFiles(raw);
  const auto lazy_files = PagesFiles(lazy);
  // 2 processes x 3 GPUs.
  ASSERT_EQ(raw_files.size(), 6u);
  ASSERT_EQ(lazy_files.size(), 6u);
  {
    Result<image::CriuCheckpoint> checkpoint = image::CriuCheckpoint::Open(lazy);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status().ToString();
    image::ConvertOptions convert;
    convert.chunk_size = 256 * 1024;
    auto stats = image::ConvertToLazyImage(checkpoint.value(), convert);
    ASSERT_TRUE(stats.ok()) << stats.status().ToString();
    ASSERT_TRUE(image::LazyImage::Exists(lazy));
  }

  // Over unix the client reads chunks from the image files the server passes (by reference);
  // --no-read-files and tcp take every byte through the socket, tcp on the stream connection and
  // three lanes; a server with --no-pass-files refuses the files and the client falls back to the
  // socket by itself.
  struct Mode {
    std::string name;
    bool pass_files;  // server side
    bool tcp;
    std::string client_args;
    bool expect_files;  // the client's JSON says it read the files
    int lanes = 0;      // lanes the client's JSON reports
  };
  // Through the socket without --lanes the client opens client::LanesFor(0) connections (one
  // below 8 CPUs, eight on 16), the server taking at most its default --max-lanes, 7, beside
  // the stream connection; reading the files, none.
  const int default_lanes = static_cast<int>(std::min(client::LanesFor(0) - 1, 7u));
  const std::vector<Mode> modes = {
      {"unix, by reference", true, false, "", true},
      {"unix, --no-read-files", true, false, " --no-read-files", false, default_lanes},
      {"tcp, 4 bulk connections", true, true, " --lanes 4", false, 3},
      {"unix, server --no-pass-files", false, false, "", false, default_lanes},
  };
  int n = 0;
  for (const Mode& mode : modes) {
    std::vector<std::string> server_args;
    if (!mode.pass_files) server_args.push_back("--no-pass-files");
    const fs::path server_dir = run_dir.path() / ("server" + std::to_string(n));
    fs::create_directories(server_dir);
    ServerProcess server(server_dir, root.path(), server_args);
    ASSERT_TRUE(server.ready()) << server.Log();
    const net::Endpoint& endpoint = mode.tcp ? server.tcp_endpoint() : server.unix_endpoint();
    for (const auto& [name, source] :
         {std::pair{std::string("raw"), &raw_files}, std::pair{std::string("lazy"), &lazy_files}}) {
      SCOPED_TRACE(mode.name + " " + name);
      const fs::path out = run_dir.path() / ("out" + std::to_string(n++));
      const auto run =
          RunClient("fetch --server " + endpoint.ToString() + " --image " + name + " --out " +
                    out.string() + " --json --insecure" + mode.client_args);
      ASSERT_EQ(run.exit_code, 0) << run.out << "\n" << server.Log();
      EXPECT_NE(run.out.find(mode.expect_files ? "\"read_files\": true" : "\"read_files\": false"),
                std::string::npos)
          << run.out;
      EXPECT_NE(run.out.find("\"lanes\": " + std::to_string(mode.lanes)), std::string::npos)
          << run.out;
      const auto fetched = PagesFiles(out);
      ASSERT_EQ(fetched.size(), source->size());
      for (const auto& [file, bytes] : *source) {
        auto it = fetched.find(file);
        ASSERT_NE(it, fetched.end()) << file << " not fetched";
        ASSERT_EQ(it->second.size(), bytes.size()) << file;
        EXPECT_TRUE(it->second == bytes) << file << " differs";
      }
    }
    EXPECT_EQ(server.Terminate(), 0) << server.Log();
  }
}

// 2. RestoreSession survives a SIGKILLed server restarted on the same unix socket.
TEST(E2eRestore, ReconnectsAfterServerKilledAndRestarted) {
  TempDir root;
  TempDir run_dir;
  const fs::path img = root.path() / "img";
  ASSERT_NO_FATAL_FAILURE(Synthesize(img, 96ull << 20, 21));
  auto expected = LoadCriuContents(img);
  ASSERT_TRUE(expected.ok()) << expected.status().ToString();

  auto server = std::make_unique<ServerProcess>(run_dir.path(), root.path());
  ASSERT_TRUE(server->ready()) << server->Log();
  const std::string endpoint = server->unix_endpoint().ToString();

  client::HostCopyEngine engine;
  client::SessionOptions options;
  options.endpoint = endpoint;
  options.image = "img";
  options.window_bytes = 1u << 20;
  // By reference too: a small window keeps most chunks unsent when the server dies (with a
  // large one every file range is out within milliseconds and no reconnect is needed).
  options.file_window_bytes = 1u << 20;
  options.reconnect.max_attempts = 50;
  options.reconnect.initial_backoff = 20ms;
  options.reconnect.max_backoff = 200ms;
  options.reconnect.deadline = 20000ms;
  client::RestoreSession session(options, engine);
  ASSERT_TRUE(session.Start().ok()) << server->Log();

  // Kill the server once some bytes are resident but the restore is not done.
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  bool killed = false;
  while (std::chrono::steady_clock::now() < deadline) {
    const client::Progress p = session.progress();
    ASSERT_FALSE(p.complete) << "restore finished before the server could be killed";
    if (p.resident_bytes > 0) {
      ASSERT_EQ(::kill(server->pid(), SIGKILL), 0);
      killed = true;
      break;
    }
    std::this_thread::sleep_for(100us);
  }
  ASSERT_TRUE(killed) << "no bytes resident within 10 s";
  const uint64_t resident_at_kill = session.progress().resident_bytes;
  // Terminate() reaps the killed process, so the destructor has nothing left to do.
  EXPECT_EQ(server->Terminate(5s), -1);
  ASSERT_EQ(server->pid(), -1);
  server.reset();
  EXPECT_LT(resident_at_kill, session.progress().total_bytes);

  // Restart on the same dir: same socket path (stale socket file left by the kill).
  std::this_thread::sleep_for(100ms);
  fs::remove(run_dir.path() / "ready");
  server = std::make_unique<ServerProcess>(run_dir.path(), root.path());
  ASSERT_TRUE(server->ready()) << server->Log();
  ASSERT_EQ(server->unix_endpoint().ToString(), endpoint);

  const Status done = session.WaitComplete(20s);
  ASSERT_TRUE(done.ok()) << done.ToString() << "\nstatus: " << session.status().ToString() << "\n"
                         << server->Log();
  const client::Progress p = session.progress();
  EXPECT_TRUE(p.complete);
  EXPECT_GE(p.reconnects, 1u);
  EXPECT_EQ(p.resident_bytes, p.total_bytes);

  const auto& bos = session.bos();
  ASSERT_EQ(bos.size(), expected->size());
  for (uint32_t i = 0; i < bos.size(); ++i) {
    SCOPED_TRACE("bo " + std::to_string(i));
    auto it = expected->find(BoKey{bos[i].process_id, bos[i].bo_index});
    ASSERT_NE(it, expected->end());
    Result<std::span<uint8_t>> mapping = engine.Mapping(i);
    ASSERT_TRUE(mapping.ok()) << mapping.status().ToString();
    ASSERT_EQ(mapping->size(), it->second.size());
    ASSERT_EQ(bos[i].size, it->second.size());
    EXPECT_TRUE(std::equal(mapping->begin(), mapping->end(), it->second.begin()))
        << "BO contents differ";
  }
  EXPECT_EQ(server->Terminate(), 0) << server->Log();
}

}  // namespace
}  // namespace gpulazy
