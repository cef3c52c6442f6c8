// ServerChild: gpulazy-server run as a child process of gpulazy-bench or a test, serving one
// image root, by default on a Unix socket and on tcp:127.0.0.1:0 (plain TCP: loopback only), its
// output in a log file. Start returns once the server's ready file names every endpoint, so the
// ports the kernel picked are known.
// Thread-safety: none; one owner.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "proto/status.h"

namespace gpulazy::server {

struct ServerChildOptions {
  std::filesystem::path binary;   // the gpulazy-server executable
  std::filesystem::path root;     // --images
  std::filesystem::path run_dir;  // server.sock, server.ready and server.log go here
  std::string log_level = "warn";
  // Where to listen instead of the defaults (which also allow plain TCP: --insecure-tcp); plain
  // TCP elsewhere needs --insecure-tcp or TLS options in extra_args.
  std::vector<std::string> listen;
  // Appended. The server refuses a second --log-level or --ready-file (set log_level instead);
  // a second --images or --listen adds a root or an endpoint (use `listen` for endpoints).
  std::vector<std::string> extra_args;
  // Runs the server through this command (found on PATH), e.g. {"ip", "netns", "exec", NS}: it
  // must exec the server in place, so that pid() is the server's.
  std::vector<std::string> launcher;
  std::chrono::milliseconds ready_timeout{20000};
};

class ServerChild {
 public:
  // kNotFound when the binary is not executable, kUnavailable when the server exits before it
  // is ready (its log says why), kTimeout when it is not ready in time (it is killed then).
  static Result<ServerChild> Start(const ServerChildOptions& options);
  ServerChild(ServerChild&& other) noexcept;
  ServerChild& operator=(ServerChild&&) = delete;
  ServerChild(const ServerChild&) = delete;
  ~ServerChild();  // Terminate(5 s), then SIGKILL if it lingers

  // SIGTERM, then waits up to `timeout`: the exit status, or -1 when it did not exit in time
  // (still running) or died of a signal.
  int Terminate(std::chrono::milliseconds timeout);
  // SIGKILL, and waits for it.
  void Kill();

  // The first of each kind the ready file names (empty if none): "unix:PATH", "tcp:HOST:PORT".
  const std::string& unix_endpoint() const { return unix_endpoint_; }
  const std::string& tcp_endpoint() const { return tcp_endpoint_; }
  const std::vector<std::string>& endpoints() const { return endpoints_; }  // as listened on
  pid_t pid() const { return pid_; }  // -1 once it has been waited for
  const std::filesystem::path& log_path() const { return log_; }
  // Where a server started with `options` writes its log, also when Start failed.
  static std::filesystem::path LogPath(const ServerChildOptions& options);

 private:
  ServerChild() = default;
  pid_t pid_ = -1;
  std::string unix_endpoint_;
  std::string tcp_endpoint_;
  std::vector<std::string> endpoints_;
  std::filesystem::path log_;
};

}  // namespace gpulazy::server
