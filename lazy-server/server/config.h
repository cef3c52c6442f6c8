// ServerConfig: everything gpulazy-server can be told, from the command line or a config file
// (CLI11's TOML/INI support; see docs/server.md). Plain data; ParseCommandLine validates it.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "page-client/net/endpoint.h"
#include "page-client/net/stream.h"
#include "proto/frame.h"
#include "proto/status.h"

namespace gpulazy::server {

// `principal=prefix[,prefix...]`: peers that are `principal` may open images whose path below
// the root is a prefix or lies below one. Principals: `*` (everyone), `uid:N` and `gid:N` (Unix
// peers), `cn:NAME` (TLS client certificates). Prefix `*` is every image.
struct ImageAccessRule {
  std::string principal;
  std::vector<std::string> prefixes;
  static Result<ImageAccessRule> Parse(std::string_view text);
};

// --image-access-file: one rule a line in --image-access's syntax; blank lines and lines
// starting with '#' are skipped. Refused when group or others may write it (they could grant
// themselves any image) or when it is over 1 MiB. Errors name the file and the line.
Result<std::vector<ImageAccessRule>> ReadImageAccessFile(const std::string& path);

// The network threads for the CPUs this process may use: one per four, 2 to 4. On the lent
// 16-core hosts 4 (instead of 2) made eight concurrent sessions 8-15 % faster over TCP and Unix,
// and by reference into device memory no slower in three interleaved pairs, once demand
// connections had threads of their own (docs/benchmarks.md, session 28); 8 halved the
// by-reference stream (session 12) and 1 held eight TCP sessions to two thirds.
uint32_t DefaultNetworkThreads();
// The demand network threads (each its own event loop) for the CPUs this process may use: one
// per eight, 1 to 2. On the lent 16-core hosts, with eight sessions asking at once, two instead
// of one cut the demand p50 by a quarter (one session sees no difference: it stays on one loop);
// four were no better than two there, and more than 16 CPUs were never measured
// (docs/benchmarks.md, session 29).
uint32_t DefaultDemandNetworkThreads();

// --raw-chunk-size's default with --placement cuda: the largest chunk (image::kMaxChunkSize).
inline constexpr uint32_t kPlacedRawChunkSize = 4u << 20;

struct ServerConfig {
  std::vector<std::filesystem::path> image_roots;
  std::vector<net::Endpoint> listen;
  // Threads running the network event loop: DefaultNetworkThreads().
  uint32_t io_threads = DefaultNetworkThreads();
  // Threads for plain (non-TLS) demand connections only, each running an event loop of its own,
  // so a demand chunk's frame is written without waiting for a network thread busy with the
  // bulk stream's writes; a connection goes to the loop with the fewest. 0: demand connections
  // share the network threads. DefaultDemandNetworkThreads().
  uint32_t demand_io_threads = DefaultDemandNetworkThreads();
  uint32_t disk_threads = 4;    // threads reading prefetch/background chunks (and opening images)
  uint32_t demand_threads = 2;  // threads reading demand chunks only (the demand lane)
  // Added to the disk threads' nice value (0..19): on few cores demand reads and the network
  // threads get the CPU ahead of bulk reads.
  int background_nice = 0;
  // Idle chunk read buffers kept for reuse (each --max-frame bytes of address space, resident
  // only as far as chunks touched it); more chunks in flight allocate and free their own.
  uint32_t chunk_buffers = 32;
  std::string log_level = "info";
  // Security (docs/security.md).
  // Bearer tokens a Hello may carry, one of which it must when there are any (--token-file, one
  // per line); token_file is where they came from: SIGHUP reads it again.
  std::vector<std::string> tokens;
  std::string token_file;
  net::TlsServerOptions tls;        // TLS on every tcp: listener when tls.enabled()
  bool insecure_tcp = false;        // tcp: listeners without TLS are allowed (and warned about)
  std::vector<uint32_t> allow_uid;  // Unix peers allowed by uid; both empty: ours and root
  std::vector<uint32_t> allow_gid;  // Unix peers allowed by primary gid
  // --image-access rules, and the file with more (--image-access-file) and its rules as read at
  // start: SIGHUP reads it again. Neither given: every client sees every image.
  std::vector<ImageAccessRule> image_access;
  std::string image_access_file;
  std::vector<ImageAccessRule> image_access_file_rules;

  uint32_t max_sessions = 64;
  uint32_t max_connections = 256;
  uint32_t max_frame = FrameLimits{}.max_payload;  // largest payload sent or accepted
  uint32_t max_demand = 256;                       // outstanding demand chunks per session
  // Explicit prefetch/background chunks queued per session (each ~64 bytes of WorkItem). The
  // page client never queues any (stream_all walks the plan with a cursor); this is for callers
  // that ask for particular chunks early: 4096 is 8 GiB of 2 MiB chunks at once, 256 KiB of
  // queue per session, 16 MiB for 64 sessions. (It was 2^20: 64 MiB per session, 4 GiB for 64.)
  uint32_t max_queued = 4096;
  uint32_t stream_window = 4;  // chunks in flight per stream connection past the credit check
  uint32_t demand_window = 8;  // chunks in flight per demand connection
  // Bulk lanes a session may add to its stream connection, so that several client threads (and
  // network threads here) carry one restore: one connection's receiving thread bounds a remote
  // restore (docs/protocol.md, "Lanes"). Each counts against max_connections.
  uint32_t max_lanes = 7;
  uint32_t read_ahead = 4;  // chunks hinted to the kernel ahead of the scheduler
  // Chunk size when serving plain CRIU checkpoints. The command line makes it
  // kPlacedRawChunkSize with --placement cuda unless --raw-chunk-size is given.
  uint32_t raw_chunk_size = 2u << 20;
  uint32_t max_cached_images = 64;

  std::chrono::milliseconds hello_timeout{10'000};  // first frame must arrive by then
  std::chrono::milliseconds idle_timeout{600'000};  // no traffic either way; 0 = never
  std::chrono::milliseconds write_timeout{30'000};  // one frame's write may take this long
  std::chrono::milliseconds shutdown_grace{5'000};  // SIGTERM: in-flight writes may finish
  std::chrono::milliseconds stats_interval{0};      // 0 = no periodic stats log

  std::filesystem::path ready_file;  // written with the bound endpoints once listening
  std::string server_name = "gpulazy-server";
  // SIGTERM/SIGINT start a graceful shutdown. Off for a server embedded in someone else's
  // process (the CRIU plugin serves images inside CRIU, whose handlers must stay): only Stop()
  // ends it then, and the server installs no signal handler at all.
  bool handle_signals = true;
  // Clients on Unix sockets may ask for an image's files (SCM_RIGHTS) and read chunks from them
  // themselves, the server still choosing the order (docs/protocol.md, "Image files").
  bool pass_files = true;
  // Chunks whose stored bytes are in the page cache and whose checksum is known go from the
  // image file to a plain (not TLS) socket by sendfile: no copy through our buffers.
  bool send_from_files = true;
  // Write chunks into the clients' memory on this host instead of sending them, for sessions
  // that hand over destinations (docs/protocol.md, "Placement"): "" off, "memfd" host memory,
  // "cuda" device memory of GPU placement_device (CUDA builds).
  std::string placement;
  int placement_device = 0;
  // cuda: image page cache kept registered (pinned) for DMA at once.
  uint64_t placement_pin_budget = 16ull << 30;
  // cuda: the placer's completion thread sleeps on each copy instead of spinning.
  bool placement_blocking_sync = false;
  // Images (named as clients name them) made ready once the server listens, so their first
  // restore waits for neither: every file read into the page cache and, with placement,
  // prepared by the backend (cuda: registered for DMA within the pin budget).
  std::vector<std::string> warm;
};

// Parses argv (and --config FILE). On --help or a usage error, exit_code says how main should
// exit and the text is already printed; otherwise config is set.
struct ParsedCommandLine {
  std::optional<ServerConfig> config;
  int exit_code = 0;
  bool check_only = false;  // --check: CheckConfiguration, then exit
};
ParsedCommandLine ParseCommandLine(int argc, char** argv);

// How a listener of this configuration serves `endpoint`, for logs: "Unix socket, peer
// credentials checked", "plain TCP", "TLS" or "TLS, client certificates required".
const char* ListenerMode(const ServerConfig& config, const net::Endpoint& endpoint);

// --check: loads every file the configuration names as the server would (the TLS certificate,
// key and client CA, the token file, the image-access file, the image roots) without binding or
// serving, and writes what it would use to `out`, one line each, or each problem to `errors`. 0
// when everything loads and the certificate has not expired, else 2. For an operator about to start
// the server or send it SIGHUP.
int CheckConfiguration(const ServerConfig& config, std::ostream& out, std::ostream& errors);

// Checks ranges and consistency (threads >= 1, max_frame able to carry a chunk, ...).
Status ValidateConfig(const ServerConfig& config);

}  // namespace gpulazy::server
