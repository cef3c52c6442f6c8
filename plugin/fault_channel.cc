#include "plugin/fault_channel.h"

#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <system_error>

#include "plugin/fault/gpulazy_fault.h"

namespace gpulazy::plugin {

FaultChannel::FaultChannel(std::filesystem::path path, Resolver resolver, size_t max_connections)
    : path_(std::move(path)),
      resolver_(std::move(resolver)),
      max_connections_(std::max<size_t>(1, max_connections)) {}

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
  acceptor_ = std::thread([this] {
    // As for the connection threads: nothing may escape into CRIU's master. Without an
    // acceptor the socket is closed and removed, so that new callers are refused (and those
    // waiting in its backlog reset) rather than left waiting for an answer that cannot come.
    try {
      AcceptLoop();
    } catch (const std::exception& e) {
      spdlog::error("gpulazy: fault channel: no longer accepting: {}", e.what());
      ::unlink(path_.c_str());
      listener_.reset();
    }
  });
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
    for (Client& client : clients_)
      if (!client.done) ::shutdown(client.fd, SHUT_RDWR);
  }
  // No new clients after the acceptor's end: the list only shrinks here.
  for (Client& client : clients_)
    if (client.thread.joinable()) client.thread.join();
  std::lock_guard lock(mutex_);
  clients_.clear();
  if (listener_.valid()) ::unlink(path_.c_str());
}

size_t FaultChannel::threads() const {
  std::lock_guard lock(mutex_);
  return clients_.size();
}

void FaultChannel::ReapLocked() {
  for (auto it = clients_.begin(); it != clients_.end();) {
    if (!it->done) {
      ++it;
      continue;
    }
    // done is set as the thread's last step: the join returns at once.
    if (it->thread.joinable()) it->thread.join();
    it = clients_.erase(it);
  }
}

void FaultChannel::AcceptLoop() {
  int backoff_ms = -1;  // after an accept error: wait this long (or for Stop) before the next
  for (;;) {
    pollfd fds[2] = {{listener_.get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    // While backing off only Stop is waited for, at most backoff_ms.
    const int ready = backoff_ms < 0 ? ::poll(fds, 2, -1) : ::poll(&fds[1], 1, backoff_ms);
    if (ready < 0) {
      if (errno == EINTR) continue;
      spdlog::error("gpulazy: fault channel: poll: {}", std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;  // Stop
    backoff_ms = -1;
    UniqueFd client(::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!client.valid()) {
      if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) continue;
      // Out of descriptors or memory: the pending connection stays queued and the listener
      // readable, so waiting for poll again would spin. Retry in a while.
      spdlog::warn("gpulazy: fault channel: accept: {}; retrying in 100 ms", std::strerror(errno));
      backoff_ms = 100;
      continue;
    }
    std::lock_guard lock(mutex_);
    ReapLocked();
    if (clients_.size() >= max_connections_) {
      // Closed by `client`: the caller's ensure fails instead of waiting. Logged once a thousand.
      if (refused_.fetch_add(1) % 1000 == 0)
        spdlog::warn("gpulazy: fault channel: {} connections open already; refusing more",
                     clients_.size());
      continue;
    }
    Client& entry = clients_.emplace_back();
    entry.fd = client.get();
    try {
      entry.thread = std::thread([this, &entry] { ServeCatching(&entry); });
      (void)client.release();  // the thread owns it now
    } catch (const std::system_error& e) {
      spdlog::error("gpulazy: fault channel: no thread for a connection: {}", e.what());
      clients_.pop_back();
    }
  }
}

void FaultChannel::ServeCatching(Client* client) {
  // Nothing may escape a thread of CRIU's master (a resolver out of memory, say): the
  // connection ends, the caller's ensure fails, the restore goes on.
  try {
    Serve(client->fd);
  } catch (const std::exception& e) {
    spdlog::error("gpulazy: fault channel: a connection ended on: {}", e.what());
  }
  // Closed and marked done in one step: Stop shuts down the fds of clients not done, and a
  // number closed outside the lock could meanwhile belong to another file of CRIU's.
  std::lock_guard lock(mutex_);
  ::close(client->fd);
  client->done = true;
}

void FaultChannel::Serve(int fd) {
  ucred cred{};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return;
  for (;;) {
    gpulazy_fault_request req{};
    size_t got = 0;
    while (got < sizeof(req)) {
      ssize_t n = ::read(fd, reinterpret_cast<char*>(&req) + got, sizeof(req) - got);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;
      got += static_cast<size_t>(n);
    }
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
    if (::send(fd, &reply, sizeof(reply), MSG_NOSIGNAL) != sizeof(reply)) return;
  }
}

}  // namespace gpulazy::plugin
