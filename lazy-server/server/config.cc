#include "lazy-server/server/config.h"

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <iostream>
#include <limits>

#include "lazy-server/image/lazy_image.h"
#include "proto/size.h"

namespace gpulazy::server {
namespace {

std::chrono::milliseconds Seconds(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(std::llround(seconds * 1000.0)));
}

Result<uint32_t> ParseSize32(const std::string& text, const char* option) {
  Result<uint64_t> value = ParseSize(text);
  if (!value.ok()) return InvalidArgument("{}: {}", option, value.status().message());
  if (*value > std::numeric_limits<uint32_t>::max())
    return InvalidArgument("{}: {} is too large", option, text);
  return static_cast<uint32_t>(*value);
}

}  // namespace

ParsedCommandLine ParseCommandLine(int argc, char** argv) {
  ServerConfig config;
  CLI::App app{"gpulazy-server: serves CRIU amdgpu checkpoints and lazy images to page clients"};
  app.set_config("--config", "", "read options from a TOML or INI file");

  std::vector<std::string> roots;
  std::vector<std::string> listen;
  std::string max_frame = std::to_string(config.max_frame);
  std::string raw_chunk_size = std::to_string(config.raw_chunk_size);
  double hello_timeout = 10, idle_timeout = 600, shutdown_grace = 5, stats_interval = 0;
  std::string ready_file;

  app.add_option("--images", roots, "image root directory (repeatable)")->required();
  app.add_option("--listen", listen, "unix:PATH or tcp:HOST:PORT (repeatable)")->required();
  app.add_option("--threads", config.io_threads, "network threads")->capture_default_str();
  app.add_option("--disk-threads", config.disk_threads, "disk read threads")->capture_default_str();
  app.add_option("--log-level", config.log_level, "trace, debug, info, warn, error or off")
      ->capture_default_str();
  app.add_option("--token", config.token, "bearer token clients must present in Hello");
  app.add_option("--max-sessions", config.max_sessions, "open sessions at most")
      ->capture_default_str();
  app.add_option("--max-connections", config.max_connections, "open connections at most")
      ->capture_default_str();
  app.add_option("--max-frame", max_frame, "largest frame payload sent or accepted (e.g. 4M)")
      ->capture_default_str();
  app.add_option("--max-demand", config.max_demand, "outstanding demand chunks per session")
      ->capture_default_str();
  app.add_option("--stream-window", config.stream_window,
                 "chunks in flight per stream connection (small keeps demand latency low)")
      ->capture_default_str();
  app.add_option("--demand-window", config.demand_window, "chunks in flight per demand connection")
      ->capture_default_str();
  app.add_option("--read-ahead", config.read_ahead, "chunks hinted to the kernel ahead of reads")
      ->capture_default_str();
  app.add_option("--raw-chunk-size", raw_chunk_size,
                 "chunk size for plain CRIU checkpoints (power of two, 4K..4M)")
      ->capture_default_str();
  app.add_option("--max-cached-images", config.max_cached_images, "opened images kept cached")
      ->capture_default_str();
  app.add_option("--hello-timeout", hello_timeout, "seconds a new connection has to send Hello")
      ->capture_default_str();
  app.add_option("--idle-timeout", idle_timeout,
                 "seconds without traffic before a connection is closed (0: never)")
      ->capture_default_str();
  app.add_option("--shutdown-grace", shutdown_grace,
                 "seconds in-flight writes may take after SIGTERM")
      ->capture_default_str();
  app.add_option("--stats-interval", stats_interval, "seconds between stats log lines (0: off)")
      ->capture_default_str();
  app.add_option("--ready-file", ready_file, "write the bound endpoints here once listening");
  app.add_option("--server-name", config.server_name, "name sent in HelloReply")
      ->capture_default_str();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return ParsedCommandLine{std::nullopt, app.exit(e)};
  }

  auto fail = [](const Status& status) {
    std::cerr << "gpulazy-server: " << status.message() << "\n";
    return ParsedCommandLine{std::nullopt, 2};
  };
  for (const std::string& root : roots)
    config.image_roots.emplace_back(root);
  for (const std::string& text : listen) {
    Result<net::Endpoint> endpoint = net::Endpoint::Parse(text);
    if (!endpoint.ok()) return fail(endpoint.status());
    config.listen.push_back(*endpoint);
  }
  Result<uint32_t> frame = ParseSize32(max_frame, "--max-frame");
  if (!frame.ok()) return fail(frame.status());
  config.max_frame = *frame;
  Result<uint32_t> chunk = ParseSize32(raw_chunk_size, "--raw-chunk-size");
  if (!chunk.ok()) return fail(chunk.status());
  config.raw_chunk_size = *chunk;
  for (double s : {hello_timeout, idle_timeout, shutdown_grace, stats_interval}) {
    if (!(s >= 0 && s < 1e7)) return fail(InvalidArgument("timeouts must be 0..1e7 seconds"));
  }
  config.hello_timeout = Seconds(hello_timeout);
  config.idle_timeout = Seconds(idle_timeout);
  config.shutdown_grace = Seconds(shutdown_grace);
  config.stats_interval = Seconds(stats_interval);
  config.ready_file = ready_file;
  Status valid = ValidateConfig(config);
  if (!valid.ok()) return fail(valid);
  return ParsedCommandLine{std::move(config), 0};
}

Status ValidateConfig(const ServerConfig& config) {
  if (config.image_roots.empty()) return InvalidArgument("--images: at least one root is needed");
  if (config.listen.empty()) return InvalidArgument("--listen: at least one endpoint is needed");
  if (config.io_threads < 1 || config.io_threads > 256)
    return InvalidArgument("--threads must be 1..256, not {}", config.io_threads);
  if (config.disk_threads < 1 || config.disk_threads > 256)
    return InvalidArgument("--disk-threads must be 1..256, not {}", config.disk_threads);
  if (config.max_sessions < 1) return InvalidArgument("--max-sessions must be at least 1");
  if (config.max_connections < 1) return InvalidArgument("--max-connections must be at least 1");
  if (config.max_frame < image::kMinChunkSize)
    return InvalidArgument("--max-frame must be at least {} bytes", image::kMinChunkSize);
  if (config.max_demand < 1) return InvalidArgument("--max-demand must be at least 1");
  if (config.stream_window < 1 || config.stream_window > 1024)
    return InvalidArgument("--stream-window must be 1..1024");
  if (config.demand_window < 1 || config.demand_window > 1024)
    return InvalidArgument("--demand-window must be 1..1024");
  if (config.read_ahead > 1024) return InvalidArgument("--read-ahead must be 0..1024");
  const uint32_t c = config.raw_chunk_size;
  if (c < image::kMinChunkSize || c > image::kMaxChunkSize || (c & (c - 1)) != 0)
    return InvalidArgument("--raw-chunk-size must be a power of two in [{}, {}], not {}",
                           image::kMinChunkSize, image::kMaxChunkSize, c);
  if (config.log_level != "trace" && config.log_level != "debug" && config.log_level != "info" &&
      config.log_level != "warn" && config.log_level != "error" && config.log_level != "off")
    return InvalidArgument("--log-level '{}' is not one of trace, debug, info, warn, error, off",
                           config.log_level);
  return Status::Ok();
}

}  // namespace gpulazy::server
