// ServerChild: gpulazy-server run as a child process of gpulazy-bench or a test, serving one
// image root on a Unix socket and on tcp:127.0.0.1:0 (plain TCP: loopback only), its output in a
// log file. Start returns once the server's ready file names both endpoints, so the ports the
// kernel picked are known.
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
  std::vector<std::string> extra_args;  // appended: a repeated option overrides ours
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

  const std::string& unix_endpoint() const { return unix_endpoint_; }  // "unix:PATH"
  const std::string& tcp_endpoint() const { return tcp_endpoint_; }    // "tcp:127.0.0.1:PORT"
  pid_t pid() const { return pid_; }  // -1 once it has been waited for
  const std::filesystem::path& log_path() const { return log_; }
  // Where a server started with `options` writes its log, also when Start failed.
  static std::filesystem::path LogPath(const ServerChildOptions& options);

 private:
  ServerChild() = default;
  pid_t pid_ = -1;
  std::string unix_endpoint_;
  std::string tcp_endpoint_;
  std::filesystem::path log_;
};

}  // namespace gpulazy::server
