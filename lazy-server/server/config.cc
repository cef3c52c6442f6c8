#include "lazy-server/server/config.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <limits>

#include "lazy-server/image/lazy_image.h"
#include "lazy-server/server/image_store.h"
#include "page-client/net/stream.h"
#include "page-client/net/threads.h"
#include "proto/size.h"
#include "proto/utf8.h"

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

uint32_t DefaultNetworkThreads() {
  return std::clamp(net::UsableCpus() / 4, 2u, 4u);
}

uint32_t DefaultDemandNetworkThreads() {
  return std::clamp(net::UsableCpus() / 8, 1u, 2u);
}

Result<ImageAccessRule> ImageAccessRule::Parse(std::string_view text) {
  const size_t equals = text.find('=');
  if (equals == std::string_view::npos)
    return InvalidArgument("--image-access '{}': expected PRINCIPAL=PREFIX[,PREFIX...]", text);
  ImageAccessRule rule;
  rule.principal = std::string(text.substr(0, equals));
  auto numeric = [](std::string_view digits) {
    uint32_t value = 0;
    auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value);
    return !digits.empty() && ec == std::errc() && end == digits.data() + digits.size();
  };
  const std::string_view principal = rule.principal;
  const bool known = principal == "*" ||
                     (principal.starts_with("uid:") && numeric(principal.substr(4))) ||
                     (principal.starts_with("gid:") && numeric(principal.substr(4))) ||
                     (principal.starts_with("cn:") && principal.size() > 3);
  if (!known)
    return InvalidArgument("--image-access '{}': principal must be *, uid:N, gid:N or cn:NAME",
                           text);
  std::string_view rest = text.substr(equals + 1);
  while (!rest.empty()) {
    const size_t comma = rest.find(',');
    std::string prefix(rest.substr(0, comma));
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    while (prefix.size() > 1 && prefix.back() == '/')
      prefix.pop_back();
    if (prefix != "*" && !ImageStore::ValidateName(prefix).ok())
      return InvalidArgument("--image-access '{}': '{}' is not a relative image path", text,
                             prefix);
    rule.prefixes.push_back(std::move(prefix));
  }
  if (rule.prefixes.empty())
    return InvalidArgument("--image-access '{}': no image prefixes after '='", text);
  return rule;
}

Result<std::vector<ImageAccessRule>> ReadImageAccessFile(const std::string& path) {
  // Whoever may write it may grant themselves any image.
  GPULAZY_ASSIGN_OR_RETURN(
      std::string text, ReadGuardedFile(path, {.kind = "image-access file",
                                               .refused_mode = S_IWGRP | S_IWOTH,
                                               .refused_because = "may be written by other users",
                                               .fix = "chmod go-w it",
                                               .max_bytes = 1 << 20}));
  std::vector<ImageAccessRule> rules;
  for (const NumberedLine& line : SplitLines(text)) {
    const size_t first = line.text.find_first_not_of(" \t");
    if (first == std::string_view::npos || line.text[first] == '#') continue;
    const size_t last = line.text.find_last_not_of(" \t");
    Result<ImageAccessRule> rule =
        ImageAccessRule::Parse(line.text.substr(first, last - first + 1));
    if (!rule.ok())
      return rule.status().Context(fmt::format("image-access file {} line {}", path, line.number));
    rules.push_back(std::move(*rule));
  }
  return rules;
}

ParsedCommandLine ParseCommandLine(int argc, char** argv) {
  ServerConfig config;
  CLI::App app{"gpulazy-server: serves CRIU amdgpu checkpoints and lazy images to page clients"};
  app.set_config("--config", "", "read options from a TOML or INI file");

  std::vector<std::string> roots;
  std::vector<std::string> listen;
  std::string max_frame = std::to_string(config.max_frame);
  std::string raw_chunk_size = std::to_string(config.raw_chunk_size);
  std::string pin_budget = std::to_string(config.placement_pin_budget);
  double hello_timeout = 10, idle_timeout = 600, shutdown_grace = 5, stats_interval = 0;
  std::string ready_file;
  std::string token_file;
  double write_timeout = 30;
  std::vector<std::string> image_access;
  std::string image_access_file;

  app.add_option("--images", roots, "image root directory (repeatable)")->required();
  app.add_option("--listen", listen, "unix:PATH or tcp:HOST:PORT (repeatable)")->required();
  app.add_option("--threads", config.io_threads,
                 "network threads (default: one per four usable CPUs, 2 to 4)")
      ->capture_default_str();
  app.add_option("--demand-network-threads", config.demand_io_threads,
                 "network threads for demand connections only, each its own event loop "
                 "(default: one per eight usable CPUs, 1 to 2; 0: they share --threads)")
      ->capture_default_str();
  app.add_option("--disk-threads", config.disk_threads,
                 "threads reading prefetch/background chunks")
      ->capture_default_str();
  app.add_option("--demand-threads", config.demand_threads,
                 "threads reading demand chunks only (never behind background reads)")
      ->capture_default_str();
  app.add_option("--background-nice", config.background_nice,
                 "added to the nice value of the threads reading prefetch/background chunks "
                 "(0..19; demand reads and the network keep the server's priority)")
      ->capture_default_str();
  app.add_option("--chunk-buffers", config.chunk_buffers, "idle chunk read buffers kept for reuse")
      ->capture_default_str();
  app.add_option("--log-level", config.log_level, "trace, debug, info, warn, error or off")
      ->capture_default_str();
  // No --token: a secret on the command line is readable by every user through /proc.
  app.add_option("--token-file", token_file,
                 "file holding the bearer tokens clients may present, one per line (not readable "
                 "by others; SIGHUP reads it again)");
  app.add_option("--tls-cert", config.tls.cert_file,
                 "PEM certificate chain: TLS on tcp: listeners");
  app.add_option("--tls-key", config.tls.key_file, "PEM private key of --tls-cert");
  app.add_option("--tls-client-ca", config.tls.client_ca_file,
                 "PEM CA certificates: clients must present a certificate it signed (mutual TLS)");
  bool check_only = false;
  app.add_flag(
      "--check", check_only,
      "load the TLS, token, image-access and image-root files as the server would, print what it "
      "would use, and exit (0: all load), without binding or serving");
  app.add_flag("--insecure-tcp", config.insecure_tcp,
               "allow tcp: listeners without TLS (pages and tokens cross the network in clear)");
  app.add_option("--allow-uid", config.allow_uid,
                 "Unix peers with this uid may connect (repeatable; default: ours and root)");
  app.add_option("--allow-gid", config.allow_gid,
                 "Unix peers with this primary gid may connect (repeatable)");
  app.add_option("--image-access", image_access,
                 "PRINCIPAL=PREFIX[,PREFIX...]: who may open which images (repeatable; principals "
                 "*, uid:N, gid:N, cn:NAME; none given: everyone sees every image)");
  app.add_option("--image-access-file", image_access_file,
                 "file of more --image-access rules, one a line (not writable by others; "
                 "SIGHUP reads it again; given, a client no rule names sees no image)");
  app.add_flag("--pass-files,!--no-pass-files", config.pass_files,
               "hand image files to Unix-socket clients that ask, so they read chunks themselves "
               "(default on; --no-pass-files: every byte travels through the socket)");
  app.add_flag("--sendfile,!--no-sendfile", config.send_from_files,
               "send cached chunks straight from the image files to plain sockets (sendfile; "
               "default on; --no-sendfile: read every chunk into a buffer first)");
  app.add_option("--placement", config.placement,
                 "write chunks straight into Unix-socket clients' memory when they hand over "
                 "destinations: memfd (host memory) or cuda (device memory, CUDA builds); "
                 "default off")
      ->check(CLI::IsMember({"", "memfd", "cuda"}));
  app.add_option("--placement-device", config.placement_device, "--placement cuda: the GPU")
      ->capture_default_str();
  app.add_option("--placement-pin-budget", pin_budget,
                 "--placement cuda: image page cache kept registered for DMA at once (e.g. 16G)")
      ->capture_default_str();
  app.add_flag("--placement-blocking-sync,!--no-placement-blocking-sync",
               config.placement_blocking_sync,
               "--placement cuda: the placer's completion thread sleeps until each copy is done "
               "instead of spinning on it (default off)");
  app.add_option("--warm", config.warm,
                 "IMAGE: once listening, read the image's files into the page cache and, with "
                 "--placement cuda, register them for DMA, so its first restore waits for "
                 "neither (repeatable; one disk thread does it, image after image)");
  app.add_option("--max-sessions", config.max_sessions, "open sessions at most")
      ->capture_default_str();
  app.add_option("--max-connections", config.max_connections, "open connections at most")
      ->capture_default_str();
  app.add_option("--max-frame", max_frame, "largest frame payload sent or accepted (e.g. 4M)")
      ->capture_default_str();
  app.add_option("--max-demand", config.max_demand, "outstanding demand chunks per session")
      ->capture_default_str();
  app.add_option("--max-queued", config.max_queued,
                 "explicit prefetch/background chunks queued per session; past it a Request "
                 "gets ERROR_LIMIT")
      ->capture_default_str();
  app.add_option("--stream-window", config.stream_window,
                 "chunks in flight per stream connection (small keeps demand latency low)")
      ->capture_default_str();
  app.add_option("--demand-window", config.demand_window, "chunks in flight per demand connection")
      ->capture_default_str();
  app.add_option("--max-lanes", config.max_lanes,
                 "bulk connections a session may add to its stream connection (0: none)")
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
  app.add_option("--write-timeout", write_timeout,
                 "seconds one frame's write may take before a client that stopped reading is "
                 "dropped (0: never)")
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
  // Placed into device memory, a plain checkpoint streams at 0.91-0.95 of the pinned rate in
  // 4 MiB chunks where 2 MiB ones reach 0.88-0.92 (a cost per copy; docs/benchmarks.md,
  // "Session 42"): the default there, unless set or unless frames cannot carry it.
  static_assert(kPlacedRawChunkSize <= image::kMaxChunkSize);
  if (app.count("--raw-chunk-size") == 0 && config.placement == "cuda" &&
      config.max_frame >= kPlacedRawChunkSize)
    config.raw_chunk_size = kPlacedRawChunkSize;
  Result<uint64_t> budget = ParseSize(pin_budget);
  if (!budget.ok()) return fail(budget.status().Context("--placement-pin-budget"));
  config.placement_pin_budget = *budget;
  for (const std::string& text : image_access) {
    Result<ImageAccessRule> rule = ImageAccessRule::Parse(text);
    if (!rule.ok()) return fail(rule.status());
    config.image_access.push_back(std::move(*rule));
  }
  if (!image_access_file.empty()) {
    Result<std::vector<ImageAccessRule>> rules = ReadImageAccessFile(image_access_file);
    if (!rules.ok()) return fail(rules.status().Context("--image-access-file"));
    config.image_access_file_rules = std::move(*rules);
    config.image_access_file = image_access_file;
  }
  if (!token_file.empty()) {
    Result<std::vector<std::string>> tokens = net::ReadTokenListFile(token_file);
    if (!tokens.ok()) return fail(tokens.status().Context("--token-file"));
    config.tokens = std::move(*tokens);
    config.token_file = token_file;
  }
  for (double s : {hello_timeout, idle_timeout, write_timeout, shutdown_grace, stats_interval}) {
    if (!(s >= 0 && s < 1e7)) return fail(InvalidArgument("timeouts must be 0..1e7 seconds"));
  }
  config.hello_timeout = Seconds(hello_timeout);
  config.idle_timeout = Seconds(idle_timeout);
  config.write_timeout = Seconds(write_timeout);
  config.shutdown_grace = Seconds(shutdown_grace);
  config.stats_interval = Seconds(stats_interval);
  config.ready_file = ready_file;
  Status valid = ValidateConfig(config);
  if (!valid.ok()) return fail(valid);
  return ParsedCommandLine{std::move(config), 0, check_only};
}

const char* ListenerMode(const ServerConfig& config, const net::Endpoint& endpoint) {
  if (endpoint.kind == net::Endpoint::Kind::kUnix) return "Unix socket, peer credentials checked";
  if (!config.tls.enabled()) return "plain TCP";
  return config.tls.client_ca_file.empty() ? "TLS" : "TLS, client certificates required";
}

int CheckConfiguration(const ServerConfig& config, std::ostream& out, std::ostream& errors) {
  int problems = 0;
  auto problem = [&](const std::string& text) {
    errors << "gpulazy-server --check: " << text << "\n";
    ++problems;
  };
  for (const std::filesystem::path& root : config.image_roots) {
    std::error_code ec;
    if (std::filesystem::is_directory(root, ec))
      out << "image root " << root.string() << "\n";
    else
      problem(fmt::format("image root {} is not a directory{}", root.string(),
                          ec ? ": " + ec.message() : std::string()));
  }
  for (const net::Endpoint& endpoint : config.listen)
    out << "listen " << endpoint.ToString() << " (" << ListenerMode(config, endpoint) << ")\n";
  if (config.tls.enabled()) {
    Result<std::shared_ptr<net::TlsContext>> tls = net::MakeServerTlsContext(config.tls);
    if (!tls.ok()) {
      problem(tls.status().message());
    } else {
      const net::CertificateSummary summary = net::SummarizeCertificate(**tls);
      out << "TLS certificate " << config.tls.cert_file << " (" << summary.ToString() << ")\n";
      if (summary.expired)
        problem(fmt::format("TLS certificate {} has expired: clients will refuse it",
                            config.tls.cert_file));
      if (!config.tls.client_ca_file.empty())
        out << "TLS client CA " << config.tls.client_ca_file << "\n";
    }
  }
  // ParseCommandLine has read the token file already (a bad one stops it there).
  if (!config.token_file.empty())
    out << "token file " << config.token_file << ": " << config.tokens.size()
        << (config.tokens.size() == 1 ? " token" : " tokens") << "\n";
  // So has the image-access file.
  if (!config.image_access_file.empty())
    out << "image-access file " << config.image_access_file << ": "
        << config.image_access_file_rules.size()
        << (config.image_access_file_rules.size() == 1 ? " rule" : " rules") << "\n";
  if (problems == 0) out << "configuration ok\n";
  return problems == 0 ? 0 : 2;
}

Status ValidateConfig(const ServerConfig& config) {
  if (config.image_roots.empty()) return InvalidArgument("--images: at least one root is needed");
  if (config.listen.empty()) return InvalidArgument("--listen: at least one endpoint is needed");
  if (config.io_threads < 1 || config.io_threads > 256)
    return InvalidArgument("--threads must be 1..256, not {}", config.io_threads);
  if (config.demand_io_threads > 64)
    return InvalidArgument("--demand-network-threads must be 0..64, not {}",
                           config.demand_io_threads);
  if (config.disk_threads < 1 || config.disk_threads > 256)
    return InvalidArgument("--disk-threads must be 1..256, not {}", config.disk_threads);
  if (config.demand_threads < 1 || config.demand_threads > 256)
    return InvalidArgument("--demand-threads must be 1..256, not {}", config.demand_threads);
  if (config.chunk_buffers > 4096)
    return InvalidArgument("--chunk-buffers must be 0..4096, not {}", config.chunk_buffers);
  const bool has_tcp = std::any_of(config.listen.begin(), config.listen.end(), [](const auto& e) {
    return e.kind == net::Endpoint::Kind::kTcp;
  });
  if (config.tls.enabled() != !config.tls.key_file.empty())
    return InvalidArgument("--tls-cert and --tls-key go together");
  if (!config.tls.client_ca_file.empty() && !config.tls.enabled())
    return InvalidArgument("--tls-client-ca needs --tls-cert and --tls-key");
  if (has_tcp && !config.tls.enabled() && !config.insecure_tcp)
    return InvalidArgument(
        "tcp: listeners need TLS (--tls-cert and --tls-key) or an explicit --insecure-tcp");
  if (config.max_sessions < 1) return InvalidArgument("--max-sessions must be at least 1");
  if (config.max_connections < 1) return InvalidArgument("--max-connections must be at least 1");
  if (config.max_frame < image::kMinChunkSize)
    return InvalidArgument("--max-frame must be at least {} bytes", image::kMinChunkSize);
  if (config.max_demand < 1) return InvalidArgument("--max-demand must be at least 1");
  if (config.max_queued < 1 || config.max_queued > (1u << 20))
    return InvalidArgument("--max-queued must be 1..{}, not {}", 1u << 20, config.max_queued);
  if (config.stream_window < 1 || config.stream_window > 1024)
    return InvalidArgument("--stream-window must be 1..1024");
  if (config.demand_window < 1 || config.demand_window > 1024)
    return InvalidArgument("--demand-window must be 1..1024");
  if (config.max_lanes > 64) return InvalidArgument("--max-lanes must be 0..64");
  if (config.read_ahead > 1024) return InvalidArgument("--read-ahead must be 0..1024");
  if (config.background_nice < 0 || config.background_nice > 19)
    return InvalidArgument("--background-nice must be 0..19, not {}", config.background_nice);
  const uint32_t c = config.raw_chunk_size;
  if (c < image::kMinChunkSize || c > image::kMaxChunkSize || (c & (c - 1)) != 0)
    return InvalidArgument("--raw-chunk-size must be a power of two in [{}, {}], not {}",
                           image::kMinChunkSize, image::kMaxChunkSize, c);
  for (const std::string& name : config.warm)
    if (Status valid = ImageStore::ValidateName(name); !valid.ok())
      return valid.Context(fmt::format("--warm '{}'", name));
  if (config.placement_device < 0 || config.placement_device > 1024)
    return InvalidArgument("--placement-device must be 0..1024, not {}", config.placement_device);
  if (!IsValidUtf8(config.server_name))
    return InvalidArgument("--server-name must be valid UTF-8 (clients could not parse it)");
  if (config.log_level != "trace" && config.log_level != "debug" && config.log_level != "info" &&
      config.log_level != "warn" && config.log_level != "error" && config.log_level != "off")
    return InvalidArgument("--log-level '{}' is not one of trace, debug, info, warn, error, off",
                           config.log_level);
  return Status::Ok();
}

}  // namespace gpulazy::server
