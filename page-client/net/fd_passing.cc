#include "page-client/net/fd_passing.h"

#include <sys/socket.h>

#include <cerrno>
#include <cstring>

namespace gpulazy::net {
namespace asio = boost::asio;

Status SendWithFds(int socket, std::span<const uint8_t> bytes, std::span<const int> fds,
                   Blocking blocking) {
  if (bytes.empty()) return InvalidArgument("descriptors must travel with at least one byte");
  if (fds.size() > kMaxPassedFds)
    return OutOfRange("{} descriptors in one message (the kernel takes {})", fds.size(),
                      kMaxPassedFds);
  iovec iov{const_cast<uint8_t*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<uint8_t> control(CMSG_SPACE(sizeof(int) * fds.size()));
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(cmsg), fds.data(), sizeof(int) * fds.size());
  }
  ssize_t n;
  do {
    n = ::sendmsg(socket, &msg, MSG_NOSIGNAL | (blocking == Blocking::kNo ? MSG_DONTWAIT : 0));
  } while (n < 0 && errno == EINTR);
  if (n < 0)
    return ErrnoError(errno, "sendmsg of {} bytes with {} descriptors", bytes.size(), fds.size());
  if (static_cast<size_t>(n) != bytes.size())
    return Unavailable("sendmsg sent {} of {} bytes", n, bytes.size());
  return Status::Ok();
}

Status SendFrameWithFds(int socket, const wire::Header& header, std::span<const int> fds,
                        const FrameLimits& limits) {
  GPULAZY_ASSIGN_OR_RETURN(std::string frame, EncodeFrameHead(header, 0, limits));
  return SendWithFds(socket,
                     std::span(reinterpret_cast<const uint8_t*>(frame.data()), frame.size()), fds);
}

Result<std::optional<size_t>> ReceiveWithFds(int socket, std::span<uint8_t> into, size_t max_fds,
                                             std::vector<UniqueFd>* fds, Blocking blocking,
                                             std::optional<pid_t>* sender_pid) {
  iovec iov{into.data(), into.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  // Room for credentials whoever asked for them: a socket with SO_PASSCRED on gets them with
  // every message, and without the room the descriptors' control data would be cut.
  std::vector<uint8_t> control(CMSG_SPACE(sizeof(int) * std::max<size_t>(max_fds, 1)) +
                               CMSG_SPACE(sizeof(ucred)));
  if (sender_pid != nullptr) sender_pid->reset();
  msg.msg_control = control.data();
  msg.msg_controllen = control.size();
  ssize_t n;
  do {
    n = ::recvmsg(socket, &msg, MSG_CMSG_CLOEXEC | (blocking == Blocking::kNo ? MSG_DONTWAIT : 0));
  } while (n < 0 && errno == EINTR);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return std::optional<size_t>();
  if (n < 0) return ErrnoError(errno, "recvmsg");
  for (cmsghdr* cmsg = CMSG_FIRSTHDR(&msg); cmsg != nullptr; cmsg = CMSG_NXTHDR(&msg, cmsg)) {
    if (cmsg->cmsg_level == SOL_SOCKET && cmsg->cmsg_type == SCM_CREDENTIALS &&
        cmsg->cmsg_len >= CMSG_LEN(sizeof(ucred))) {
      ucred sender{};
      std::memcpy(&sender, CMSG_DATA(cmsg), sizeof sender);
      if (sender_pid != nullptr && sender.pid > 0) *sender_pid = sender.pid;
      continue;
    }
    if (cmsg->cmsg_level != SOL_SOCKET || cmsg->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (cmsg->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int raw;
      std::memcpy(&raw, CMSG_DATA(cmsg) + i * sizeof(int), sizeof raw);
      fds->emplace_back(raw);
    }
  }
  // The kernel closes descriptors that did not fit; the message's promise is broken either way.
  if ((msg.msg_flags & MSG_CTRUNC) != 0)
    return Corrupt("more descriptors than the {} expected (control data truncated)", max_fds);
  if ((msg.msg_flags & MSG_TRUNC) != 0)
    return Corrupt("a message longer than the {} bytes expected (truncated)", into.size());
  if (fds->size() > max_fds)
    return Corrupt("{} descriptors received, at most {} expected", fds->size(), max_fds);
  return std::optional<size_t>(static_cast<size_t>(n));
}

Awaitable<Result<FrameWithFds>> ReadFrameWithFds(Socket& socket, const FrameLimits& limits,
                                                 size_t max_fds) {
  FrameWithFds out;
  std::vector<uint8_t> bytes(kFramePrefixSize);
  size_t got = 0;
  std::optional<FramePrefix> prefix;
  while (true) {
    if (got == bytes.size()) {
      if (prefix) break;
      Result<FramePrefix> decoded_prefix = DecodeFramePrefix(bytes, limits);
      if (!decoded_prefix.ok()) co_return decoded_prefix.status();
      const FramePrefix decoded = *decoded_prefix;
      if (decoded.payload_length != 0)
        co_return Corrupt("a frame with descriptors carries a {}-byte payload",
                          decoded.payload_length);
      prefix = decoded;
      bytes.resize(kFramePrefixSize + decoded.header_length);
      continue;
    }
    boost::system::error_code ec;
    co_await socket.async_wait(Socket::wait_read, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) co_return Unavailable("waiting for the image files: {}", ec.message());
    Result<std::optional<size_t>> n =
        ReceiveWithFds(socket.native_handle(), std::span(bytes).subspan(got), max_fds, &out.fds);
    if (!n.ok()) co_return n.status();
    if (!n->has_value()) continue;  // woken without data
    if (**n == 0)
      co_return Unavailable("connection closed after {} bytes of a frame with descriptors", got);
    got += **n;
  }
  Result<wire::Header> header = DecodeFrameHeader(std::span(bytes).subspan(kFramePrefixSize));
  if (!header.ok()) co_return header.status();
  out.header = std::move(header).value();
  co_return std::move(out);
}

}  // namespace gpulazy::net
