// gpulazy-bench: measures gpulazy against ceilings taken in the same run. Each subcommand
// prints a table row per case, or with --json one JSON object per case (docs/benchmarks.md).
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <iostream>

#include "bench/checksum_bench.h"
#include "bench/demand_bench.h"
#include "bench/maps_bench.h"
#include "bench/restore_bench.h"  // issue 4: restore modes
#include "bench/stream_bench.h"
#include "lazy-server/image/io.h"
#include "proto/size.h"

namespace {

int Fail(const gpulazy::Status& status) {
  std::cerr << "gpulazy-bench: " << status.message() << '\n';
  return 1;
}

// --lanes: bulk connections per session when the bytes cross the socket
// (client::SessionOptions::lanes); `what` says what they carry in this benchmark.
void AddLanesOption(CLI::App& command, uint32_t& value, const std::string& what) {
  command
      .add_option(
          "--lanes", value,
          "unix, tcp: bulk connections " + what + " (0: one per two CPUs, 1-8; 1 below 8 CPUs)")
      ->capture_default_str()
      ->check(CLI::Range(0, 16));
}

int Run(int argc, char** argv) {
  using namespace gpulazy;
  CLI::App app{"gpulazy-bench: throughput and latency against same-run ceilings"};
  app.require_subcommand(1);
  bench::CommonOptions common;
  common.bin_dir = GPULAZY_DEFAULT_BIN_DIR;
  std::string work_dir = common.work_dir.string(), bin_dir = common.bin_dir.string();
  app.add_flag("--json", common.json, "one JSON object per measured case");
  app.add_option("--work-dir", work_dir, "where images and sockets are made")
      ->capture_default_str();
  app.add_option("--bin-dir", bin_dir, "where gpulazy-server is")->capture_default_str();
  app.add_option("--server-arg", common.server_args,
                 "one more gpulazy-server option (repeatable; e.g. --server-arg=--stream-window=8)")
      ->allow_extra_args(false);

  bench::StreamOptions stream;
  std::string stream_size = "1G", stream_window = "16M",
              stream_window_per_connection =
                  std::to_string(client::kBulkWindowPerConnection >> 20) + "M",
              stream_populate = std::to_string(stream.populate_ahead >> 20) + "M";
  CLI::App* stream_cmd =
      app.add_subcommand("stream", "streaming throughput vs raw page-cache reads");
  stream_cmd->add_option("--size", stream_size, "image content bytes")->capture_default_str();
  stream_cmd->add_option("--sessions", stream.sessions, "concurrent sessions (list: 1,8)")
      ->delimiter(',');
  stream_cmd
      ->add_option("--transport", stream.transports,
                   "unix (bytes through the socket), unix-files (client reads the passed "
                   "image files), tcp (list)")
      ->delimiter(',');
  stream_cmd->add_option("--engine", stream.engine, "host or discard")->capture_default_str();
  stream_cmd->add_option("--window", stream_window, "client credit window")->capture_default_str();
  bench::AddWindowPerConnectionOption(*stream_cmd, stream_window_per_connection);
  stream_cmd
      ->add_option("--file-readers", stream.file_readers,
                   "unix-files: client reader threads per session (and ceiling threads)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  AddLanesOption(*stream_cmd, stream.lanes,
                 "per session, each with a receiving thread (and ceiling threads)");
  stream_cmd
      ->add_option("--populate-ahead", stream_populate,
                   "host engine: fault destination pages in this far ahead of the writes on a "
                   "helper thread, the memfd ceiling likewise (0: off)")
      ->capture_default_str();
  stream_cmd
      ->add_option("--populate-nice", stream.populate_nice,
                   "added to the nice value of that helper thread")
      ->capture_default_str()
      ->check(CLI::Range(0, 19));
  std::string stream_fresh_pages = "write";
  bench::AddFreshPagesOption(*stream_cmd, stream_fresh_pages);
  bench::AddBatchWakeupsOption(*stream_cmd, stream.batch_tcp_wakeups);

  bench::DemandOptions demand;
  std::string demand_size = "2G", demand_window = "16M", demand_window_per_connection = "0";
  CLI::App* demand_cmd =
      app.add_subcommand("demand", "demand latency under a saturating background stream");
  demand_cmd->add_option("--size", demand_size, "image content bytes")->capture_default_str();
  demand_cmd->add_option("--requests", demand.requests, "demand requests per session")
      ->capture_default_str();
  demand_cmd
      ->add_option("--sessions", demand.sessions,
                   "sessions measured at once, each on an image of --size, each streaming")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  demand_cmd
      ->add_option("--transport", demand.transport,
                   "unix (payloads through the socket), unix-files (by reference) or tcp")
      ->capture_default_str();
  demand_cmd->add_option("--window", demand_window, "client credit window")->capture_default_str();
  bench::AddWindowPerConnectionOption(*demand_cmd, demand_window_per_connection);
  AddLanesOption(*demand_cmd, demand.lanes, "of the session whose stream saturates the link");
  bench::AddBackgroundNiceOption(*demand_cmd, demand.background_nice);
  std::string demand_fresh_pages = "write";
  bench::AddFreshPagesOption(*demand_cmd, demand_fresh_pages);
  bench::AddBatchWakeupsOption(*demand_cmd, demand.batch_tcp_wakeups);
  demand_cmd->add_flag("--prepare-waited,!--no-prepare-waited", demand.prepare_waited_ranges,
                       "host engine: the thread that waits in Ensure faults in its chunks' pages "
                       "during the round trip (default on)");

  bench::ChecksumOptions checksum;
  std::string checksum_memory = "1G";
  CLI::App* checksum_cmd = app.add_subcommand(
      "checksum", "XXH3 entry points hashing 256 KiB slices vs one plain read pass");
  checksum_cmd->add_option("--memory", checksum_memory, "bytes hashed from memory")
      ->capture_default_str();
  checksum_cmd->add_option("--rounds", checksum.rounds, "best of")
      ->capture_default_str()
      ->check(CLI::Range(1, 100));

  bench::MapsOptions maps;
  CLI::App* maps_cmd = app.add_subcommand(
      "maps", "the uffd pager's lookup of one address in a program's maps: ioctl vs text");
  maps_cmd->add_option("--mappings", maps.mappings, "one-page mappings made apart")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000));
  maps_cmd->add_option("--lookups", maps.lookups, "lookups by the ioctl (a tenth by the text)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000));

  // --- restore (issue 4): restore modes side by side; see bench/restore_bench.h ---
  bench::RestoreOptions restore;
  std::string restore_size, restore_chunk;
  CLI::App* restore_cmd = bench::AddRestoreCommand(app, restore, restore_size, restore_chunk);
  // --- end restore ---

  CLI11_PARSE(app, argc, argv);
  bench::LogWarningsToStderr();
  // Every restore keeps a descriptor per BO (host engine memfds).
  gpulazy::Result<uint64_t> fds = gpulazy::RaiseOpenFileLimit();
  if (!fds.ok()) spdlog::warn("{}", fds.status().ToString());
  common.work_dir = work_dir;
  common.bin_dir = bin_dir;

  // --- restore (issue 4) ---
  if (restore_cmd->parsed()) {
    auto size = ParseSize(restore_size);
    if (!size.ok()) return Fail(size.status());
    restore.size = *size;
    if (!restore_chunk.empty()) {
      auto chunk = ParseSize(restore_chunk);
      if (!chunk.ok()) return Fail(chunk.status());
      restore.chunk_size = static_cast<uint32_t>(*chunk);
    }
    Status status = bench::RunRestoreBench(common, restore);
    return status.ok() ? 0 : Fail(status);
  }
  // --- end restore ---
  if (maps_cmd->parsed()) {
    Status status = bench::RunMapsBench(common, maps);
    return status.ok() ? 0 : Fail(status);
  }
  if (checksum_cmd->parsed()) {
    auto memory = ParseSize(checksum_memory);
    if (!memory.ok()) return Fail(memory.status());
    checksum.memory_bytes = *memory;
    Status status = bench::RunChecksumBench(common, checksum);
    return status.ok() ? 0 : Fail(status);
  }
  if (stream_cmd->parsed()) {
    auto size = ParseSize(stream_size);
    auto window = ParseSize(stream_window);
    auto per_connection = ParseSize(stream_window_per_connection);
    auto populate = ParseSize(stream_populate);
    if (!size.ok()) return Fail(size.status());
    if (!window.ok()) return Fail(window.status());
    if (!per_connection.ok()) return Fail(per_connection.status());
    if (!populate.ok()) return Fail(populate.status());
    stream.size = *size;
    stream.window = *window;
    stream.window_per_connection = *per_connection;
    stream.populate_ahead = *populate;
    bench::ParseFreshPages(stream_fresh_pages, &stream.write_fresh_pages,
                           &stream.fresh_pages_with_several_writers);
    if (stream.engine != "host" && stream.engine != "discard")
      return Fail(InvalidArgument("--engine {}: use host or discard", stream.engine));
    Status status = bench::RunStreamBench(common, stream);
    return status.ok() ? 0 : Fail(status);
  }
  auto size = ParseSize(demand_size);
  auto window = ParseSize(demand_window);
  auto per_connection = ParseSize(demand_window_per_connection);
  if (!size.ok()) return Fail(size.status());
  if (!window.ok()) return Fail(window.status());
  if (!per_connection.ok()) return Fail(per_connection.status());
  demand.size = *size;
  demand.window = *window;
  demand.window_per_connection = *per_connection;
  bench::ParseFreshPages(demand_fresh_pages, &demand.write_fresh_pages,
                         &demand.fresh_pages_with_several_writers);
  Status status = bench::RunDemandBench(common, demand);
  return status.ok() ? 0 : Fail(status);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "gpulazy-bench: " << e.what() << '\n';
    return 1;
  }
}
