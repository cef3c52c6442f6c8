// ParseCommandLine: defaults, overrides and refusals of the server's options.
#include "lazy-server/server/config.h"

#include <gtest/gtest.h>
#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

namespace gpulazy::server {
namespace {

ParsedCommandLine Parse(std::vector<std::string> args) {
  args.insert(args.begin(), {"gpulazy-server", "--images", "/tmp", "--listen", "unix:/tmp/x.sock"});
  std::vector<char*> argv;
  for (std::string& a : args)
    argv.push_back(a.data());
  return ParseCommandLine(static_cast<int>(argv.size()), argv.data());
}

TEST(ServerCommandLine, ThreadCountsDefaultAndOverride) {
  ParsedCommandLine defaults = Parse({});
  ASSERT_TRUE(defaults.config.has_value());
  // Network threads: one per four usable CPUs, 2 to 4; demand network threads one per eight,
  // 1 to 2.
  cpu_set_t allowed;
  ASSERT_EQ(sched_getaffinity(0, sizeof(allowed), &allowed), 0);
  const uint32_t cpus = static_cast<uint32_t>(CPU_COUNT(&allowed));
  EXPECT_EQ(defaults.config->io_threads, std::clamp(cpus / 4, 2u, 4u));
  EXPECT_EQ(defaults.config->disk_threads, 4u);
  EXPECT_EQ(defaults.config->demand_threads, 2u);
  EXPECT_EQ(defaults.config->demand_io_threads, std::clamp(cpus / 8, 1u, 2u));
  ParsedCommandLine set = Parse({"--threads", "5", "--disk-threads", "3", "--demand-threads", "1",
                                 "--demand-network-threads", "0"});
  ASSERT_TRUE(set.config.has_value());
  EXPECT_EQ(set.config->io_threads, 5u);
  EXPECT_EQ(set.config->disk_threads, 3u);
  EXPECT_EQ(set.config->demand_threads, 1u);
  EXPECT_EQ(set.config->demand_io_threads, 0u);
}

TEST(ServerCommandLine, RefusesThreadCountsOutOfRange) {
  for (const char* option : {"--threads", "--disk-threads", "--demand-threads"}) {
    for (const char* value : {"0", "257"}) {
      ParsedCommandLine parsed = Parse({option, value});
      EXPECT_FALSE(parsed.config.has_value()) << option << " " << value;
      EXPECT_NE(parsed.exit_code, 0) << option << " " << value;
    }
  }
  ParsedCommandLine parsed = Parse({"--demand-network-threads", "65"});
  EXPECT_FALSE(parsed.config.has_value());
  EXPECT_NE(parsed.exit_code, 0);
}

TEST(ServerCommandLine, MaxLanesDefaultOverrideAndLimit) {
  ParsedCommandLine defaults = Parse({});
  ASSERT_TRUE(defaults.config.has_value());
  EXPECT_EQ(defaults.config->max_lanes, 7u);
  for (const char* value : {"0", "64"}) {
    ParsedCommandLine set = Parse({"--max-lanes", value});
    ASSERT_TRUE(set.config.has_value()) << value;
    EXPECT_EQ(set.config->max_lanes, static_cast<uint32_t>(std::stoul(value)));
  }
  ParsedCommandLine refused = Parse({"--max-lanes", "65"});
  EXPECT_FALSE(refused.config.has_value());
  EXPECT_NE(refused.exit_code, 0);
}

TEST(ServerCommandLine, RawChunksAreFourMiBWhenPlacingIntoDeviceMemoryUnlessSet) {
  EXPECT_EQ(Parse({}).config->raw_chunk_size, 2u << 20);
  EXPECT_EQ(Parse({"--placement", "memfd"}).config->raw_chunk_size, 2u << 20);
  EXPECT_EQ(Parse({"--placement", "cuda"}).config->raw_chunk_size, kPlacedRawChunkSize);
  EXPECT_EQ(Parse({"--placement", "cuda", "--raw-chunk-size", "2M"}).config->raw_chunk_size,
            2u << 20);
  // Frames too small for 4 MiB keep the plain default.
  EXPECT_EQ(Parse({"--placement", "cuda", "--max-frame", "3M"}).config->raw_chunk_size, 2u << 20);
  // A size set in the config file is set too.
  const std::string file = ::testing::TempDir() + "/gpulazy-config-test.toml";
  { std::ofstream(file) << "raw-chunk-size = \"1M\"\nplacement = \"cuda\"\n"; }
  ParsedCommandLine from_file = Parse({"--config", file});
  ASSERT_TRUE(from_file.config.has_value());
  EXPECT_EQ(from_file.config->placement, "cuda");
  EXPECT_EQ(from_file.config->raw_chunk_size, 1u << 20);
  std::remove(file.c_str());
}

TEST(ServerCommandLine, PlacementBlockingSyncIsOffUnlessAsked) {
  EXPECT_FALSE(Parse({}).config->placement_blocking_sync);
  EXPECT_TRUE(
      Parse({"--placement", "cuda", "--placement-blocking-sync"}).config->placement_blocking_sync);
  EXPECT_FALSE(Parse({"--placement-blocking-sync", "--no-placement-blocking-sync"})
                   .config->placement_blocking_sync);
}

TEST(ServerCommandLine, WarmTakesImageNamesAndRefusesOnesNoClientCouldUse) {
  ParsedCommandLine defaults = Parse({});
  ASSERT_TRUE(defaults.config.has_value());
  EXPECT_TRUE(defaults.config->warm.empty());
  ParsedCommandLine set = Parse({"--warm", "models/llama", "--warm", "b"});
  ASSERT_TRUE(set.config.has_value());
  EXPECT_EQ(set.config->warm, (std::vector<std::string>{"models/llama", "b"}));
  for (const char* name : {"../outside", "/etc", ""}) {
    ParsedCommandLine refused = Parse({"--warm", name});
    EXPECT_FALSE(refused.config.has_value()) << name;
    EXPECT_NE(refused.exit_code, 0) << name;
  }
}

}  // namespace
}  // namespace gpulazy::server
