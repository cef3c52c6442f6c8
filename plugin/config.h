// PluginConfig: what the plugin is told, from a config file and environment variables (the
// environment wins). Every switch is listed here and in docs/criu.md, nowhere else.
//
//   file key          env var                   meaning
//   mode              GPULAZY_MODE              eager | parallel | lazy (default parallel)
//   server            GPULAZY_SERVER            unix:PATH or tcp:HOST:PORT; empty = serve the
//                                               image directory in-process
//   image             GPULAZY_IMAGE             image name on the server (default: the image
//                                               directory's base name)
//   token             GPULAZY_TOKEN             bearer token for the server (prefer token_file)
//   token_file        GPULAZY_TOKEN_FILE        file holding the token (not readable by others)
//   tls_ca            GPULAZY_TLS_CA            PEM CA for a tcp: server's certificate (TLS on)
//   tls_cert/tls_key  GPULAZY_TLS_CERT/_KEY     client certificate and key (mutual TLS)
//   tls_server_name   GPULAZY_TLS_SERVER_NAME   name the server certificate must carry
//   insecure_tcp      GPULAZY_INSECURE_TCP      1: plain tcp: without TLS is acceptable
//   engine            GPULAZY_ENGINE            auto | sdma | host (auto: sdma on a real KFD)
//   fake_kfd          GPULAZY_FAKE_KFD          state directory of the fake KFD (tests only)
//   topology          GPULAZY_TOPOLOGY          KFD topology root (default
//                                               /sys/class/kfd/kfd/topology)
//   dri_root          GPULAZY_DRI_ROOT          where render nodes are opened:
//                                               <dri_root>/renderD<minor> (default /dev/dri)
//   fault_socket      GPULAZY_FAULT_SOCKET      path of the fault channel (lazy mode)
//   window            GPULAZY_WINDOW            client credit window in bytes
//   background_nice   GPULAZY_BACKGROUND_NICE   parallel/lazy: added to the nice value of the
//                                               background restore threads (0..19, default
//                                               10; 0: same priority as the restored program)
//   lanes             GPULAZY_LANES             bulk connections per session where chunks cross
//                                               the socket (0..16; default 0: one per two CPUs,
//                                               at most 8; 1: the stream connection alone)
//   resume_timeout_ms GPULAZY_RESUME_TIMEOUT_MS most a RESUME_DEVICES_LATE waits for contents
//   check_*           GPULAZY_CHECK_*           topology checks (topology.h), 0 disables one
//   lazy_image        GPULAZY_LAZY_IMAGE        dump: also write the lazy image (0 | 1)
//   log_level         GPULAZY_LOG_LEVEL         spdlog level
// The file is GPULAZY_CONFIG, else /etc/gpulazy/plugin.conf when present: `key = value` lines,
// `#` comments.
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>

#include "page-client/net/stream.h"
#include "plugin/topology.h"
#include "proto/status.h"

namespace gpulazy::plugin {

enum class Mode { kEager, kParallel, kLazy };
enum class EngineKind { kAuto, kSdma, kHost };

std::string_view ModeName(Mode mode);

struct PluginConfig {
  Mode mode = Mode::kParallel;
  std::string server;
  std::string image;
  std::string token;
  net::TlsClientOptions tls;  // for tcp: servers (docs/security.md)
  bool insecure_tcp = false;
  EngineKind engine = EngineKind::kAuto;
  std::filesystem::path fake_kfd;
  std::filesystem::path topology_root = "/sys/class/kfd/kfd/topology";
  std::filesystem::path dri_root = "/dev/dri";
  std::filesystem::path fault_socket;
  uint64_t window_bytes = 16u << 20;
  int background_nice = 10;
  uint32_t lanes = 0;  // client::SessionOptions::lanes
  std::chrono::milliseconds resume_timeout{600'000};
  TopologyChecks checks;
  bool lazy_image = false;  // dump: convert the finished checkpoint into a lazy image too
  std::string log_level = "info";
};

// Reads the config file (if any) then the environment. `getenv` is injectable for tests.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;
Result<PluginConfig> LoadConfig(const EnvLookup& env);
Result<PluginConfig> LoadConfigFromProcess();

// A tcp: server needs TLS (tls_ca) or an explicit insecure_tcp. Checked before connecting, so the
// refusal names the plugin's settings (the client library's own message names gpulazy-client's
// command-line flags, which a CRIU user never sees).
Status CheckServerTransport(const PluginConfig& config);

}  // namespace gpulazy::plugin
