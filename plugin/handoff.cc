#include "plugin/handoff.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "page-client/net/fd_passing.h"

namespace gpulazy::plugin {
namespace {

struct WireHeader {
  uint32_t magic;
  uint32_t pid;
  uint32_t file_id;
  uint32_t flags;  // kFlagLast, kFlagPidfd
  uint32_t count;
  uint32_t pad;
};
struct WireBo {
  uint32_t bo_index;
  uint32_t local_gpu_id;
  uint64_t size;
};
constexpr uint32_t kFlagLast = 1u;   // the last record of this task
constexpr uint32_t kFlagPidfd = 2u;  // one more fd than BOs: the task's pidfd, last
constexpr size_t kMaxRecord = sizeof(WireHeader) + kMaxFdsPerRecord * sizeof(WireBo);
constexpr size_t kMaxFds = kMaxFdsPerRecord + 1;

Status SendRecord(int socket, const WireHeader& header, const std::vector<WireBo>& bos,
                  const std::vector<int>& fds) {
  std::vector<uint8_t> bytes(sizeof(header) + bos.size() * sizeof(WireBo));
  std::memcpy(bytes.data(), &header, sizeof(header));
  if (!bos.empty())
    std::memcpy(bytes.data() + sizeof(header), bos.data(), bos.size() * sizeof(WireBo));
  Status sent = net::SendWithFds(socket, bytes, fds, net::Blocking::kYes);
  if (!sent.ok()) return sent.Context("sending the BO table to CRIU's master");
  return Status::Ok();
}

}  // namespace

Status SendHandoff(int socket, uint32_t pid, uint32_t file_id, const std::vector<HandedBo>& bos,
                   int pidfd) {
  size_t i = 0;
  do {
    size_t n = std::min<size_t>(kMaxFdsPerRecord, bos.size() - i);
    uint32_t flags = i + n == bos.size() ? kFlagLast : 0u;
    if (i == 0 && pidfd >= 0) flags |= kFlagPidfd;
    WireHeader h{kHandoffMagic, pid, file_id, flags, static_cast<uint32_t>(n), 0};
    std::vector<WireBo> wire;
    std::vector<int> fds;
    for (size_t k = i; k < i + n; ++k) {
      wire.push_back({bos[k].bo_index, bos[k].local_gpu_id, bos[k].size});
      fds.push_back(bos[k].dmabuf.get());
    }
    if ((flags & kFlagPidfd) != 0) fds.push_back(pidfd);
    GPULAZY_RETURN_IF_ERROR(SendRecord(socket, h, wire, fds));
    i += n;
  } while (i < bos.size());
  return Status::Ok();
}

Result<HandoffRecord> ReceiveHandoff(int socket, bool nonblocking) {
  std::vector<uint8_t> bytes(kMaxRecord + 1);
  iovec iov{bytes.data(), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<uint8_t> control(CMSG_SPACE(sizeof(int) * kMaxFds) + CMSG_SPACE(sizeof(ucred)));
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  ssize_t n;
  do {
    n = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC | (nonblocking ? MSG_DONTWAIT : 0));
  } while (n < 0 && errno == EINTR);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return TimedOut("no handoff pending");
  if (n < 0) return ErrnoError(errno, "receiving a handoff record");
  if (n == 0) return Unavailable("handoff socket closed");
  // Take ownership of every fd first, so none leaks whatever the record says.
  std::vector<UniqueFd> fds;
  uint32_t sender_pid = 0;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS &&
        c->cmsg_len >= CMSG_LEN(sizeof(ucred))) {
      ucred cred{};
      std::memcpy(&cred, CMSG_DATA(c), sizeof(cred));
      sender_pid = static_cast<uint32_t>(cred.pid);
      continue;
    }
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t k = 0; k < count; ++k) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + k * sizeof(int), sizeof(int));
      fds.emplace_back(fd);
    }
  }
  if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) return Corrupt("handoff record truncated");
  WireHeader h{};
  if (static_cast<size_t>(n) < sizeof(h)) return Corrupt("handoff record of {} bytes", n);
  std::memcpy(&h, bytes.data(), sizeof(h));
  const size_t want_fds = h.count + ((h.flags & kFlagPidfd) != 0 ? 1u : 0u);
  if (h.magic != kHandoffMagic || h.count > kMaxFdsPerRecord ||
      static_cast<size_t>(n) != sizeof(h) + h.count * sizeof(WireBo) || fds.size() != want_fds)
    return Corrupt("malformed handoff record ({} bytes, {} BOs, {} fds)", n, h.count, fds.size());
  HandoffRecord r;
  r.pid = h.pid;
  r.sender_pid = sender_pid;
  r.file_id = h.file_id;
  r.last = (h.flags & kFlagLast) != 0;
  if ((h.flags & kFlagPidfd) != 0) r.pidfd = std::move(fds.back());
  for (uint32_t k = 0; k < h.count; ++k) {
    WireBo w{};
    std::memcpy(&w, bytes.data() + sizeof(h) + k * sizeof(WireBo), sizeof(w));
    r.bos.push_back(HandedBo{w.bo_index, w.local_gpu_id, w.size, std::move(fds[k])});
  }
  return r;
}

Status EnableSenderCredentials(int socket) {
  int on = 1;
  if (::setsockopt(socket, SOL_SOCKET, SO_PASSCRED, &on, sizeof(on)) != 0)
    return ErrnoError(errno, "SO_PASSCRED on the handoff socket");
  return Status::Ok();
}

}  // namespace gpulazy::plugin
