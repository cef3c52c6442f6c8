// gpulazy-client: restore an image's GPU memory from gpulazy-server into host memory and write it
// out as CRIU pages files (fetch), or print the server's statistics (stats).
#include <spdlog/spdlog.h>

#include <CLI/CLI.hpp>
#include <iostream>
#include <string>

#include "lazy-server/image/io.h"
#include "page-client/cli/commands.h"
#include "page-client/net/stderr_log.h"
#include "proto/size.h"

// Options shared by every subcommand that talks to a server (docs/security.md). No --token: a
// secret on the command line is readable by every user through /proc.
static void AddSecurityOptions(CLI::App& cmd, std::string* token_file,
                               gpulazy::net::TlsClientOptions* tls, bool* insecure) {
  cmd.add_option("--token-file", *token_file,
                 "file holding the server's bearer token (not readable by others)");
  cmd.add_option("--tls-ca", tls->ca_file, "PEM CA certificates: TLS for tcp: servers");
  cmd.add_option("--tls-cert", tls->cert_file, "PEM client certificate (mutual TLS)");
  cmd.add_option("--tls-key", tls->key_file, "PEM private key of --tls-cert");
  cmd.add_option("--tls-server-name", tls->server_name,
                 "name or address the server certificate must carry (default: the host of "
                 "--server)");
  cmd.add_flag("--insecure", *insecure,
               "allow plain tcp: without TLS (pages and the token cross the network in clear)");
}

static int Run(int argc, char** argv) {
  using namespace gpulazy::client::cli;
  CLI::App app{"gpulazy-client: lazy GPU-memory restore client"};
  app.require_subcommand(1);
  std::string log_level = "warn";
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error, off")
      ->capture_default_str();

  FetchOptions fetch;
  std::string window = "16M";
  std::string window_per_connection = std::to_string(fetch.window_per_connection_bytes >> 20) + "M";
  std::string file_window = "256M";
  bool no_demand = false;
  bool no_read_files = false;
  CLI::App* fetch_cmd =
      app.add_subcommand("fetch", "restore an image's BO contents and write CRIU pages files");
  fetch_cmd->add_option("--server", fetch.server, "unix:PATH or tcp:HOST:PORT")->required();
  fetch_cmd->add_option("--image", fetch.image, "image name on the server")->required();
  fetch_cmd->add_option("--out", fetch.out_dir, "directory for amdgpu-pages-*.img")->required();
  fetch_cmd->add_option("--window", window, "flow-control window (e.g. 16M)")
      ->capture_default_str();
  fetch_cmd
      ->add_option("--window-per-connection", window_per_connection,
                   "with lanes, the window is at least this much per bulk connection (0: "
                   "--window alone)")
      ->capture_default_str();
  fetch_cmd
      ->add_option("--file-window", file_window,
                   "flow-control window while reading passed image files (queued reads, no "
                   "payload buffers)")
      ->capture_default_str();
  fetch_cmd->add_flag("--no-demand-connection", no_demand, "send everything on one connection");
  fetch_cmd->add_flag("--no-read-files", no_read_files,
                      "over a Unix socket, take every byte through the socket instead of reading "
                      "the image files the server passes");
  fetch_cmd
      ->add_option("--file-readers", fetch.file_readers,
                   "threads reading chunks from passed image files (0: the copy engine's "
                   "preference, 4 for the host engine)")
      ->capture_default_str();
  fetch_cmd
      ->add_option(
          "--lanes", fetch.lanes,
          "bulk connections when the bytes travel through the socket (tcp, "
          "--no-read-files), each received by a thread (0: one per two CPUs, 1-8; 1 below 8 CPUs)")
      ->capture_default_str()
      ->check(CLI::Range(0, 16));
  fetch_cmd->add_flag("--json", fetch.json, "print a JSON summary on stdout");
  AddSecurityOptions(*fetch_cmd, &fetch.token_file, &fetch.tls, &fetch.insecure);

  StatsOptions stats;
  CLI::App* stats_cmd = app.add_subcommand("stats", "print the server's statistics (JSON)");
  stats_cmd->add_option("--server", stats.server, "unix:PATH or tcp:HOST:PORT")->required();
  AddSecurityOptions(*stats_cmd, &stats.token_file, &stats.tls, &stats.insecure);

  CLI11_PARSE(app, argc, argv);
  gpulazy::net::LogToStderr(spdlog::level::from_str(log_level));

  if (*fetch_cmd) {
    // Each size option, or the message naming the option that is wrong.
    const auto parse_size = [](const std::string& text, const char* option, uint64_t* out) {
      gpulazy::Result<uint64_t> bytes = gpulazy::ParseSize(text);
      if (!bytes.ok())
        fmt::print(stderr, "gpulazy-client fetch: {}: {}\n", option, bytes.status().message());
      else
        *out = *bytes;
      return bytes.ok();
    };
    if (!parse_size(window, "--window", &fetch.window_bytes) ||
        !parse_size(window_per_connection, "--window-per-connection",
                    &fetch.window_per_connection_bytes) ||
        !parse_size(file_window, "--file-window", &fetch.file_window_bytes))
      return 2;
    fetch.demand_connection = !no_demand;
    fetch.read_files = !no_read_files;
    // The host engine holds a descriptor per BO; best effort, the engine says so if it runs out.
    gpulazy::Result<uint64_t> fds = gpulazy::RaiseOpenFileLimit();
    if (!fds.ok()) spdlog::warn("{}", fds.status().ToString());
    return RunFetch(fetch);
  }
  return RunStats(stats);
}

int main(int argc, char** argv) {
  // Nothing may escape main: an exception becomes a message and exit status 1.
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "gpulazy-client: " << e.what() << '\n';
    return 1;
  }
}
