// gpulazy-bench, run at small sizes: each subcommand's JSON has the fields the benchmark notes
// are read from, with values that can be true (a benchmark that reports nonsense fails here
// instead of in a results table).
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <pthread.h>
#include <spdlog/spdlog.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "bench/harness.h"
#include "proto/checksum_variants.h"
#include "tests/support/process.h"
#include "tests/support/temp_dir.h"

namespace gpulazy {
namespace {

// Runs gpulazy-bench with `args`; returns its JSON lines (stderr is left to the test log).
std::vector<nlohmann::json> RunBench(const std::string& args) {
  const std::string command = std::string(GPULAZY_BIN_DIR) + "/gpulazy-bench --bin-dir " +
                              GPULAZY_BIN_DIR + " --json " + args;
  const testing::CommandRun run = testing::RunCommand(command, 240, testing::Stderr::kToTestLog);
  EXPECT_EQ(run.exit_code, 0) << command << "\n" << run.out;
  const std::string& out = run.out;
  std::vector<nlohmann::json> lines;
  size_t at = 0;
  while (at < out.size()) {
    size_t end = out.find('\n', at);
    if (end == std::string::npos) end = out.size();
    if (end > at) {
      nlohmann::json line = nlohmann::json::parse(out.substr(at, end - at), nullptr, false);
      EXPECT_FALSE(line.is_discarded()) << "not JSON: " << out.substr(at, end - at);
      if (!line.is_discarded()) lines.push_back(std::move(line));
    }
    at = end + 1;
  }
  return lines;
}

// Every XXH3 build the CPU runs, both cases each, against a read pass; exactly one selected,
// the one Checksum64 uses.
TEST(BenchSmoke, ChecksumReportsEveryRunnableBuild) {
  const std::vector<nlohmann::json> lines = RunBench("checksum --memory 4M --rounds 1");
  std::set<std::string> expected;
  for (const checksum_internal::Xxh3Variant* v : checksum_internal::AvailableXxh3Variants())
    expected.insert(std::string(v->name));
  ASSERT_EQ(lines.size(), 2 * expected.size());
  std::set<std::string> seen;
  std::set<std::string> selected;
  for (const nlohmann::json& line : lines) {
    SCOPED_TRACE(line.dump());
    EXPECT_EQ(line.at("bench"), "checksum");
    const std::string variant = line.at("variant");
    seen.insert(variant);
    if (line.at("selected").get<bool>()) selected.insert(variant);
    EXPECT_GT(line.at("throughput_Bps").get<double>(), 0);
    EXPECT_GT(line.at("ceiling_Bps").get<double>(), 0);
    EXPECT_NEAR(line.at("ratio").get<double>(),
                line.at("throughput_Bps").get<double>() / line.at("ceiling_Bps").get<double>(),
                1e-9);
  }
  EXPECT_EQ(seen, expected);
  EXPECT_EQ(selected, std::set<std::string>{std::string(checksum_internal::SelectedXxh3().name)});
}

// The maps lookups, both ways, each answer checked by the bench itself (it fails on a wrong one).
TEST(BenchSmoke, MapsLookupsReportBothWays) {
  const std::vector<nlohmann::json> lines = RunBench("maps --mappings 200 --lookups 50");
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[0].at("lookup"), "query");
  EXPECT_EQ(lines[1].at("lookup"), "text");
  for (const nlohmann::json& line : lines) {
    SCOPED_TRACE(line.dump());
    EXPECT_EQ(line.at("bench"), "maps");
    EXPECT_GE(line.at("mappings").get<uint64_t>(), 400u) << "200 pages and their gaps";
    EXPECT_GT(line.at("floor_s").get<double>(), 0);
    if (!line.at("supported").get<bool>()) continue;  // no PROCMAP_QUERY before Linux 6.11
    EXPECT_EQ(line.at("lookups").get<uint64_t>(), line.at("lookup") == "query" ? 50u : 5u);
    EXPECT_GT(line.at("p50_s").get<double>(), 0);
    EXPECT_GE(line.at("p99_s").get<double>(), line.at("p50_s").get<double>());
  }
  EXPECT_TRUE(lines[1].at("supported").get<bool>()) << "the text is read on every kernel";
}

// One small stream: verified byte for byte, and where the CPU went, in range.
TEST(BenchSmoke, StreamReportsItsCpuUse) {
  testing::TempDir work;
  const std::vector<nlohmann::json> lines = RunBench(
      "--work-dir " + work.path().string() + " stream --size 32M --sessions 1 --transport unix");
  ASSERT_EQ(lines.size(), 1u);
  const nlohmann::json& line = lines[0];
  SCOPED_TRACE(line.dump());
  EXPECT_TRUE(line.at("verified").get<bool>());
  EXPECT_GT(line.at("throughput_Bps").get<double>(), 0);
  // Shares of the machine's time: -1 when /proc/stat had not moved on (a few milliseconds of
  // a small ceiling may pass inside one clock tick), else a share.
  for (const char* share : {"cpu_busy", "cpu_steal", "ceiling_cpu_busy"}) {
    const double value = line.at(share).get<double>();
    EXPECT_TRUE(value == -1 || (value >= 0 && value <= 1)) << share << " " << value;
  }
  // The client received 32 MiB and checked it: it used CPU. The server's count is in clock
  // ticks and may round to 0 for so little.
  EXPECT_GT(line.at("client_cpu_s").get<double>(), 0);
  EXPECT_GT(line.at("ceiling_cpu_s").get<double>(), 0);
  EXPECT_GE(line.at("server_cpu_s").get<double>(), 0);
  EXPECT_GE(line.at("stream_wait_s").get<double>(), 0);
  EXPECT_GE(line.at("stream_chunk_s").get<double>(), 0);
  // Through the socket no chunk is read from the image files.
  EXPECT_EQ(line.at("file_read_s").get<double>(), 0);
  EXPECT_EQ(line.at("file_engine_s").get<double>(), 0);
  EXPECT_EQ(line.at("file_gate_wait_s").get<double>(), 0);
  EXPECT_EQ(line.at("file_idle_s").get<double>(), 0);
}

// By reference the file readers' time is reported: reading (and verifying) and engine calls.
TEST(BenchSmoke, StreamByReferenceReportsItsReadersTime) {
  testing::TempDir work;
  const std::vector<nlohmann::json> lines =
      RunBench("--work-dir " + work.path().string() +
               " stream --size 32M --sessions 1 --transport unix-files");
  ASSERT_EQ(lines.size(), 1u);
  const nlohmann::json& line = lines[0];
  SCOPED_TRACE(line.dump());
  EXPECT_TRUE(line.at("verified").get<bool>());
  EXPECT_GT(line.at("file_read_s").get<double>(), 0);
  EXPECT_GT(line.at("file_engine_s").get<double>(), 0);
  // The gate's waits are part of the engine time (the host engine takes concurrent calls, so
  // its gate is open and they are near 0).
  EXPECT_LE(line.at("file_gate_wait_s").get<double>(), line.at("file_engine_s").get<double>());
  // The rest of the readers' wall time: under all of it (they did read), never negative.
  const double idle = line.at("file_idle_s").get<double>();
  const double readers_wall = 4 * line.at("seconds").get<double>();  // --file-readers default
  EXPECT_GE(idle, 0);
  EXPECT_LT(idle, readers_wall);
}

// A small demand run: the client's latencies beside the server's own share of them (request
// read -> reply written), taken from the server's stats for the loaded session.
TEST(BenchSmoke, DemandReportsTheServersShare) {
  testing::TempDir work;
  const std::vector<nlohmann::json> lines =
      RunBench("--work-dir " + work.path().string() +
               " demand --size 512M --requests 10 --transport unix --background-nice 3");
  ASSERT_EQ(lines.size(), 1u);
  const nlohmann::json& line = lines[0];
  SCOPED_TRACE(line.dump());
  EXPECT_EQ(line.at("bench"), "demand");
  EXPECT_EQ(line.at("background_nice"), 3);
  // Ten Ensures take a few milliseconds; 512 MiB take far longer to stream on any machine here,
  // so the session is still open for its stats. Each Ensure of a missing chunk asks the server.
  ASSERT_GT(line.at("server_demand_count").get<uint64_t>(), 0u);
  const double p50 = line.at("server_demand_p50_s").get<double>();
  const double p99 = line.at("server_demand_p99_s").get<double>();
  const double max = line.at("server_demand_max_s").get<double>();
  EXPECT_LE(p50, p99);
  EXPECT_LE(p99, max);
  // Seconds, not microseconds: one 2 MiB chunk's time in a server is well under 10 s.
  EXPECT_LT(max, 10.0);
  // Its two parts, request -> write and the write, each within the whole.
  EXPECT_LE(line.at("server_demand_queued_p99_s").get<double>(), max);
  EXPECT_LE(line.at("server_demand_write_p99_s").get<double>(), max);
  // The client's stages: the samples that came back on the demand connection are timed, each
  // stage no longer than the slowest whole sample, and the slowest samples are listed.
  for (const char* which : {"client", "lone_client"}) {
    const nlohmann::json& client = line.at(which);
    ASSERT_GT(client.at("timed_samples").get<uint64_t>(), 0u) << which;
    for (const char* stage : {"handoff", "to_head", "receive", "install", "wake"}) {
      const nlohmann::json& s = client.at("stages").at(stage);
      EXPECT_LE(s.at("p50_s").get<double>(), s.at("p99_s").get<double>()) << which << stage;
      EXPECT_LE(s.at("max_s").get<double>(), client.at("slowest").at(0).at("total_s").get<double>())
          << which << stage;
    }
    // Each slow sample says where among the samples it lies and when it was called, on the clock
    // the test reads too (steady_clock), within this run.
    const double now =
        std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    for (const nlohmann::json& slow : client.at("slowest")) {
      EXPECT_LT(slow.at("sample_index").get<uint64_t>(), 50u) << which;
      const double called_at = slow.at("called_at_s").get<double>();
      EXPECT_LT(called_at, now) << which;
      EXPECT_GT(called_at, now - 600) << which;
    }
  }
  // The lone Ensure drew chunks of its own (a tenth of 256 here, so fewer than 50).
  EXPECT_GT(line.at("lone_samples").get<uint64_t>(), 0u);
}

// Whether `path` lies on a filesystem whose files live in memory (nothing to evict them to).
bool InMemoryFilesystem(const std::filesystem::path& path) {
  struct statfs fs {};
  EXPECT_EQ(statfs(path.c_str(), &fs), 0) << path;
  return fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC;
}

// The page-cache helpers behind `restore --cold`: a file read is cached, and after eviction its
// pages are gone from the cache (the next reader goes to the disk).
TEST(BenchSmoke, EvictionDropsAnImagesFilesFromThePageCache) {
  testing::TempDir work;
  if (InMemoryFilesystem(work.path()))
    GTEST_SKIP() << "a tmpfs or ramfs: its files are the page cache";
  const std::filesystem::path dir = work.path() / "image";
  std::filesystem::create_directories(dir / "sub");
  for (const char* name : {"a", "sub/b"}) {
    std::ofstream out(dir / name, std::ios::binary);
    const std::string bytes(1 << 20, 'x');
    out << bytes;
  }
  auto cached = bench::CachedBytes(dir);
  ASSERT_TRUE(cached.ok()) << cached.status().ToString();
  EXPECT_GE(*cached, uint64_t{1} << 20) << "just written, so cached";
  ASSERT_TRUE(bench::EvictFromPageCache(dir).ok());
  cached = bench::CachedBytes(dir);
  ASSERT_TRUE(cached.ok());
  EXPECT_LT(*cached, uint64_t{256} << 10) << "after eviction, of 2 MiB";
}

// `restore --cold`: each mode starts with the image out of the page cache, says so, and still
// restores byte-exact.
TEST(BenchSmoke, RestoreColdSaysHowColdEachModeStarted) {
  testing::TempDir work;
  if (InMemoryFilesystem(work.path()))
    GTEST_SKIP() << "a tmpfs or ramfs: its files are the page cache";
  const std::vector<nlohmann::json> lines =
      RunBench("--work-dir " + work.path().string() +
               " restore --size 16M --modes eager,lazy-profiled --tokens 1 --startup-ms 0 --cold");
  ASSERT_EQ(lines.size(), 2u);
  for (const nlohmann::json& line : lines) {
    SCOPED_TRACE(line.dump());
    EXPECT_TRUE(line.at("cold").get<bool>());
    EXPECT_TRUE(line.at("checksum_ok").get<bool>());
    EXPECT_LT(line.at("image_cached_bytes_at_start").get<uint64_t>(), uint64_t{4} << 20);
  }
}

// Several sessions at once, each on its own image: their samples pooled, each listed with its own.
TEST(BenchSmoke, DemandWithSeveralSessionsPoolsTheirSamples) {
  testing::TempDir work;
  const std::vector<nlohmann::json> lines =
      RunBench("--work-dir " + work.path().string() +
               " demand --size 256M --requests 8 --sessions 2 --lanes 1 --transport tcp");
  ASSERT_EQ(lines.size(), 1u);
  const nlohmann::json& line = lines[0];
  SCOPED_TRACE(line.dump());
  EXPECT_EQ(line.at("sessions"), 2);
  const nlohmann::json& per_session = line.at("per_session");
  ASSERT_EQ(per_session.size(), 2u);
  EXPECT_NE(per_session[0].at("image"), per_session[1].at("image"));
  uint64_t samples = 0;
  double slowest = 0;
  for (const nlohmann::json& one : per_session) {
    EXPECT_FALSE(one.contains("latencies_s"));
    samples += one.at("samples").get<uint64_t>();
    slowest = std::max(slowest, one.at("max_s").get<double>());
  }
  EXPECT_GT(samples, 0u);
  EXPECT_EQ(line.at("samples").get<uint64_t>(), samples);
  EXPECT_DOUBLE_EQ(line.at("max_s").get<double>(), slowest);
  EXPECT_LE(line.at("p50_s").get<double>(), line.at("p99_s").get<double>());
}

// The benchmarks' stdout carries their results (JSON lines with --json): a library warning
// logged during a run goes to stderr, and below-warning logs nowhere.
TEST(BenchSmoke, LogsGoToStderrSoStdoutStaysResultsOnly) {
  bench::LogWarningsToStderr();
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  spdlog::info("progress nobody asked for");
  spdlog::warn("a warning from the library");
  spdlog::default_logger()->flush();
  const std::string out = ::testing::internal::GetCapturedStdout();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(out, "");
  EXPECT_NE(err.find("a warning from the library"), std::string::npos) << err;
  EXPECT_EQ(err.find("progress nobody asked for"), std::string::npos) << err;
}

// A --work-dir that does not exist yet is made (its scratch folder inside is removed after the
// run); one that cannot be made is an error that names it.
TEST(BenchSmoke, WorkDirIsMadeWhenMissingAndRefusedWhenItCannotBe) {
  testing::TempDir work;
  const std::filesystem::path nested = work.path() / "not" / "yet";
  const std::vector<nlohmann::json> lines =
      RunBench("--work-dir " + nested.string() + " stream --size 8M --sessions 1 --transport unix");
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_TRUE(lines[0].at("verified").get<bool>());
  ASSERT_TRUE(std::filesystem::is_directory(nested));
  EXPECT_TRUE(std::filesystem::is_empty(nested));

  const std::filesystem::path file = work.path() / "a-file";
  { std::ofstream(file) << "not a directory"; }
  const std::string command = std::string(GPULAZY_BIN_DIR) + "/gpulazy-bench --work-dir " +
                              (file / "below").string() + " stream --size 8M --sessions 1";
  const testing::CommandRun run = testing::RunCommand(command, 60);
  EXPECT_NE(run.exit_code, 0) << run.out;
  EXPECT_NE(run.out.find("creating the work directory " + (file / "below").string()),
            std::string::npos)
      << run.out;
}

// The meter's per-thread readings name whose thread spent the time: a thread named like
// gpulazy's that burns CPU shows under its name ('-' as '_'), one that sleeps barely at all.
TEST(BenchSmoke, CpuMeterSplitsAProcessesTimeByThreadName) {
  const bench::CpuMeter meter(::getpid());
  auto spin = [](const char* name, bool burn) {
    return std::thread([name, burn] {
      ::pthread_setname_np(::pthread_self(), name);
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
      volatile uint64_t sink = 0;
      while (std::chrono::steady_clock::now() < until) {
        if (burn)
          sink = sink + 1;
        else
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    });
  };
  std::thread burner = spin("gl-test-burn", true);
  std::thread sleeper = spin("gl-test-sleep", false);
  // Read while both still run: the readings cover live threads only.
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  const nlohmann::json read = meter.Read(/*by_thread=*/true);
  const nlohmann::json plain = meter.Read();
  burner.join();
  sleeper.join();
  ASSERT_TRUE(read.contains("client_cpu_gl_test_burn_s")) << read.dump();
  ASSERT_TRUE(read.contains("server_cpu_gl_test_burn_s")) << read.dump();  // the same process
  ASSERT_TRUE(read.contains("client_cpu_gl_test_sleep_s")) << read.dump();
  const double burned = read["client_cpu_gl_test_burn_s"].get<double>();
  EXPECT_GT(burned, 0.02) << read.dump();  // on a loaded 2-core VM it may get a fraction
  EXPECT_LE(burned, read["client_cpu_s"].get<double>() + 0.02) << read.dump();
  EXPECT_LT(read["client_cpu_gl_test_sleep_s"].get<double>(), burned) << read.dump();
  EXPECT_FALSE(plain.contains("client_cpu_gl_test_burn_s")) << plain.dump();  // only when asked
}

}  // namespace
}  // namespace gpulazy
