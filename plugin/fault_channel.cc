#include "plugin/fault_channel.h"

#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "plugin/fault/gpulazy_fault.h"

namespace gpulazy::plugin {

FaultChannel::FaultChannel(std::filesystem::path path, Resolver resolver)
    : path_(std::move(path)), resolver_(std::move(resolver)) {}

FaultChannel::~FaultChannel() {
  Stop();
}

Status FaultChannel::Start() {
  sockaddr_un addr{};
  if (path_.string().size() >= sizeof(addr.sun_path))
    return InvalidArgument("fault socket path {} too long", path_.string());
  int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoError(errno, "socket");
  listener_.reset(fd);
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, path_.c_str());
  ::unlink(path_.c_str());
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0)
    return ErrnoError(errno, "bind fault socket {}", path_.string());
  if (::listen(fd, 64) != 0) return ErrnoError(errno, "listen {}", path_.string());
  int wake = ::eventfd(0, EFD_CLOEXEC);
  if (wake < 0) return ErrnoError(errno, "eventfd");
  wake_.reset(wake);
  acceptor_ = std::thread([this] { AcceptLoop(); });
  spdlog::info("gpulazy: fault channel on {}", path_.string());
  return Status::Ok();
}

void FaultChannel::Stop() {
  if (stopping_.exchange(true)) return;
  if (wake_.valid()) {
    uint64_t one = 1;
    (void)!::write(wake_.get(), &one, sizeof(one));
  }
  if (acceptor_.joinable()) acceptor_.join();
  {
    std::lock_guard lock(mutex_);
    for (int fd : clients_)
      ::shutdown(fd, SHUT_RDWR);
  }
  for (std::thread& t : threads_)
    t.join();
  threads_.clear();
  if (listener_.valid()) ::unlink(path_.c_str());
}

void FaultChannel::AcceptLoop() {
  for (;;) {
    pollfd fds[2] = {{listener_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents != 0) return;
    int client = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    std::lock_guard lock(mutex_);
    clients_.push_back(client);
    threads_.emplace_back([this, client] { Serve(client); });
  }
}

void FaultChannel::Serve(int fd) {
  UniqueFd owned(fd);
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return;
  for (;;) {
    gpulazy_fault_request req{};
    size_t got = 0;
    while (got < sizeof(req)) {
      ssize_t n = ::read(fd, reinterpret_cast<char*>(&req) + got, sizeof(req) - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) goto done;
      got += static_cast<size_t>(n);
    }
    {
      gpulazy_fault_reply reply{};
      if (req.magic != GPULAZY_FAULT_MAGIC) {
        reply.status = -EPROTO;
      } else {
        Status s = resolver_(static_cast<uint32_t>(cred.pid), req.va, req.len);
        if (!s.ok())
          spdlog::warn("gpulazy: ensure({:#x}, {}) for pid {}: {}", req.va, req.len, cred.pid,
                       s.ToString());
        reply.status = s.ToNegativeErrno();
      }
      if (::send(fd, &reply, sizeof(reply), MSG_NOSIGNAL) != sizeof(reply)) break;
    }
  }
done:
  std::lock_guard lock(mutex_);
  std::erase(clients_, fd);
}

}  // namespace gpulazy::plugin
