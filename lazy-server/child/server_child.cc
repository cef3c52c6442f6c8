#include "lazy-server/child/server_child.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <thread>
#include <utility>

namespace gpulazy::server {
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

fs::path ServerChild::LogPath(const ServerChildOptions& options) {
  return options.run_dir / "server.log";
}

Result<ServerChild> ServerChild::Start(const ServerChildOptions& options) {
  if (::access(options.binary.c_str(), X_OK) != 0)
    return NotFound("{} is not an executable", options.binary.string());
  const fs::path ready = options.run_dir / "server.ready";
  const fs::path log = LogPath(options);
  std::error_code ignored;
  fs::remove(ready, ignored);  // a ready file of an earlier server must not count
  std::vector<std::string> args = options.launcher;
  args.insert(args.end(), {options.binary.string(), "--images", options.root.string()});
  if (options.listen.empty()) {
    args.insert(args.end(), {"--listen", "unix:" + (options.run_dir / "server.sock").string(),
                             "--listen", "tcp:127.0.0.1:0", "--insecure-tcp"});  // loopback only
  }
  for (const std::string& endpoint : options.listen)
    args.insert(args.end(), {"--listen", endpoint});
  const size_t endpoints = options.listen.empty() ? 2 : options.listen.size();
  args.insert(args.end(), {"--ready-file", ready.string(), "--log-level", options.log_level});
  args.insert(args.end(), options.extra_args.begin(), options.extra_args.end());
  std::vector<char*> argv;  // built before fork: the child only execs
  argv.reserve(args.size() + 1);
  for (std::string& arg : args)
    argv.push_back(arg.data());
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return ErrnoError(errno, "fork");
  if (pid == 0) {
    const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
      ::dup2(fd, STDOUT_FILENO);
      ::dup2(fd, STDERR_FILENO);
    }
    ::execvp(argv[0], argv.data());
    ::_exit(127);
  }
  ServerChild child;
  child.pid_ = pid;
  child.log_ = log;
  const auto deadline = Clock::now() + options.ready_timeout;
  while (Clock::now() < deadline) {
    std::ifstream in(ready);
    std::vector<std::string> lines;
    for (std::string line; std::getline(in, line);)
      if (!line.empty()) lines.push_back(line);
    if (lines.size() >= endpoints) {
      for (const std::string& line : lines) {
        if (line.starts_with("unix:") && child.unix_endpoint_.empty()) child.unix_endpoint_ = line;
        if (line.starts_with("tcp:") && child.tcp_endpoint_.empty()) child.tcp_endpoint_ = line;
      }
      child.endpoints_ = std::move(lines);
      return child;
    }
    if (::waitpid(pid, nullptr, WNOHANG) == pid) {
      child.pid_ = -1;
      return Unavailable("gpulazy-server exited before it was ready (see {})", log.string());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return TimedOut("gpulazy-server did not write {} within {} ms", ready.string(),
                  options.ready_timeout.count());
}

ServerChild::ServerChild(ServerChild&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)),
      unix_endpoint_(std::move(other.unix_endpoint_)),
      tcp_endpoint_(std::move(other.tcp_endpoint_)),
      endpoints_(std::move(other.endpoints_)),
      log_(std::move(other.log_)) {}

ServerChild::~ServerChild() {
  if (pid_ <= 0) return;
  if (Terminate(std::chrono::seconds(5)) < 0 && pid_ > 0) Kill();
}

int ServerChild::Terminate(std::chrono::milliseconds timeout) {
  if (pid_ <= 0) return -1;
  ::kill(pid_, SIGTERM);
  const auto deadline = Clock::now() + timeout;
  while (Clock::now() < deadline) {
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return -1;
}

void ServerChild::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

}  // namespace gpulazy::server
