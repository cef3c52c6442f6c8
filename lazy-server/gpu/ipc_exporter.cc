#include "lazy-server/gpu/ipc_exporter.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>

namespace gpulazy::server::gpu {

Result<std::unique_ptr<IpcExporterProcess>> IpcExporterProcess::Start(
    const std::filesystem::path& executable, uint64_t size) {
  // Made before fork: the child of a threaded process may not allocate before exec.
  const std::string path = executable.string();
  const std::string size_arg = std::to_string(size);
  int to_child[2];
  int from_child[2];
  if (::pipe2(to_child, O_CLOEXEC) != 0) return ErrnoError(errno, "starting {}: pipe", path);
  if (::pipe2(from_child, O_CLOEXEC) != 0) {
    const int saved = errno;
    ::close(to_child[0]);
    ::close(to_child[1]);
    return ErrnoError(saved, "starting {}: pipe", path);
  }
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(to_child[0], 0);
    ::dup2(from_child[1], 1);
    ::execl(path.c_str(), path.c_str(), size_arg.c_str(), nullptr);
    ::_exit(127);
  }
  ::close(to_child[0]);
  ::close(from_child[1]);
  if (pid < 0) {
    const int saved = errno;
    ::close(to_child[1]);
    ::close(from_child[0]);
    return ErrnoError(saved, "starting {}: fork", path);
  }
  std::unique_ptr<IpcExporterProcess> process(new IpcExporterProcess(pid, to_child[1], size));
  std::string line;
  pollfd ready{from_child[0], POLLIN, 0};
  char c = 0;
  while (line.size() < 2 * kIpcHandleBytes && ::poll(&ready, 1, 30'000) == 1 &&
         ::read(from_child[0], &c, 1) == 1)
    line.push_back(c);
  ::close(from_child[0]);
  if (line.size() != 2 * kIpcHandleBytes)
    return Unavailable("{} printed no IPC handle for {} bytes (see its standard error)", path,
                       size);
  for (size_t i = 0; i < kIpcHandleBytes; ++i) {
    const std::string pair = line.substr(2 * i, 2);
    char* end = nullptr;
    process->handle_[i] = static_cast<uint8_t>(std::strtoul(pair.c_str(), &end, 16));
    if (end != pair.c_str() + 2) return Internal("{} printed a handle that is not hex", path);
  }
  return process;
}

IpcExporterProcess::~IpcExporterProcess() {
  ::close(stdin_);
  ::waitpid(pid_, nullptr, 0);
}

}  // namespace gpulazy::server::gpu
