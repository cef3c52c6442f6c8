#include "page-client/uffd/handover.h"

#include <errno.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <optional>
#include <span>
#include <vector>

#include "page-client/net/fd_passing.h"

namespace gpulazy::uffd {
namespace {

constexpr uint32_t kMagic = 0x46554c47;  // "GLUF"
// 2: Hello carries the fault scope. 3: and flags (kOwnerIsSender).
constexpr uint32_t kVersion = 3;
constexpr uint32_t kCompleteMagic = 0x454e4f44;  // "DONE"

struct HelloMsg {
  uint32_t magic;
  uint32_t version;
  uint32_t mode;
  uint32_t count;
  uint32_t scope;  // kScopeUnknown or 1 + FaultScope
  uint32_t flags;
};
// The sender made the userfaultfd and registered its own memory with it (it forwards none made
// elsewhere): the pid the kernel stamps on the Hello is the process whose memory it covers.
constexpr uint32_t kOwnerIsSender = 1;
constexpr uint32_t kScopeUnknown = 0;
struct RegionMsg {
  uint32_t bo;
  uint32_t reserved;
  uint64_t addr;
  uint64_t size;
};

Status SendMsg(int socket, const void* data, size_t length, int fd) {
  const std::span<const uint8_t> bytes(static_cast<const uint8_t*>(data), length);
  std::span<const int> fds;
  if (fd >= 0) fds = std::span<const int>(&fd, 1);
  Status sent = net::SendWithFds(socket, bytes, fds, net::Blocking::kYes);
  if (!sent.ok()) return sent.Context("handover");
  return Status::Ok();
}

// Receives one message of at most `capacity` bytes and at most one fd, with a deadline.
Result<size_t> RecvMsg(int socket, void* data, size_t capacity, UniqueFd* fd,
                       std::chrono::milliseconds timeout,
                       std::optional<pid_t>* sender_pid = nullptr) {
  pollfd pfd{socket, POLLIN, 0};
  int rc;
  do {
    rc = poll(&pfd, 1, static_cast<int>(timeout.count()));
  } while (rc < 0 && errno == EINTR);
  if (rc < 0) return ErrnoError(errno, "handover: poll");
  if (rc == 0) return TimedOut("handover: nothing received in {} ms", timeout.count());
  std::vector<UniqueFd> fds;
  Result<std::optional<size_t>> received =
      net::ReceiveWithFds(socket, std::span(static_cast<uint8_t*>(data), capacity),
                          /*max_fds=*/1, &fds, net::Blocking::kYes, sender_pid);
  if (!received.ok()) return received.status().Context("handover");
  if (!received->has_value() || **received == 0) return Unavailable("handover: peer hung up");
  if (fd != nullptr && !fds.empty()) *fd = UniqueFd(fds[0].release());
  return **received;
}

}  // namespace

Result<std::pair<UniqueFd, UniqueFd>> HandoverSocketPair() {
  int fds[2];
  if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds) != 0)
    return ErrnoError(errno, "socketpair");
  return std::pair<UniqueFd, UniqueFd>(UniqueFd(fds[0]), UniqueFd(fds[1]));
}

Status SendLayout(int socket, const std::vector<uint64_t>& sizes) {
  if (sizes.size() > kMaxHandoverRegions) return OutOfRange("handover: {} BOs", sizes.size());
  std::vector<uint64_t> message;
  message.push_back((uint64_t{kVersion} << 32) | kMagic);
  message.push_back(sizes.size());
  message.insert(message.end(), sizes.begin(), sizes.end());
  return SendMsg(socket, message.data(), message.size() * sizeof(uint64_t), -1);
}

Result<std::vector<uint64_t>> ReceiveLayout(int socket, std::chrono::milliseconds timeout) {
  std::vector<uint64_t> message(kMaxHandoverRegions + 2);
  GPULAZY_ASSIGN_OR_RETURN(size_t n, RecvMsg(socket, message.data(),
                                             message.size() * sizeof(uint64_t), nullptr, timeout));
  if (n < 16 || n % 8 != 0 || message[0] != ((uint64_t{kVersion} << 32) | kMagic))
    return Corrupt("handover: bad layout message ({} bytes)", n);
  if (message[1] != n / 8 - 2) return Corrupt("handover: layout says {} BOs", message[1]);
  return std::vector<uint64_t>(message.begin() + 2, message.begin() + static_cast<long>(n / 8));
}

Status SendHandover(int socket, const Userfaultfd& uffd, const std::vector<Region>& regions,
                    const std::vector<int>& memfds) {
  const bool minor = uffd.mode() == FillMode::kMinorContinue;
  if (minor && memfds.size() != regions.size())
    return InvalidArgument("handover: MINOR mode needs one memfd per region");
  if (!memfds.empty() && memfds.size() != regions.size())
    return InvalidArgument("handover: {} memfds for {} regions", memfds.size(), regions.size());
  const uint32_t scope = uffd.scope() ? 1 + static_cast<uint32_t>(*uffd.scope()) : kScopeUnknown;
  const bool own = uffd.owner() == ::getpid();
  HelloMsg hello{kMagic,
                 kVersion,
                 static_cast<uint32_t>(uffd.mode()),
                 static_cast<uint32_t>(regions.size()),
                 scope,
                 own ? kOwnerIsSender : 0};
  // With SO_PASSCRED on, the kernel stamps this process's pid on what it sends (explicit
  // SCM_CREDENTIALS would be refused where our uid or gid is not mapped in a user namespace):
  // the pager reads this process's mappings where it cannot unregister a range, and watches it
  // exit (Pager::UnregisterAll).
  const int on = 1, off = 0;
  if (own && setsockopt(socket, SOL_SOCKET, SO_PASSCRED, &on, sizeof on) != 0)
    return ErrnoError(errno, "handover: SO_PASSCRED");
  Status sent = SendMsg(socket, &hello, sizeof hello, uffd.fd());
  if (own) (void)setsockopt(socket, SOL_SOCKET, SO_PASSCRED, &off, sizeof off);
  GPULAZY_RETURN_IF_ERROR(sent);
  for (size_t i = 0; i < regions.size(); ++i) {
    RegionMsg region{regions[i].bo, 0, regions[i].addr, regions[i].size};
    // In MISSING mode too where there is one: the pager keeps there the bytes of a BO the
    // program unmaps before they arrive (UffdCopyEngine).
    GPULAZY_RETURN_IF_ERROR(
        SendMsg(socket, &region, sizeof region, memfds.empty() ? -1 : memfds[i]));
  }
  return Status::Ok();
}

Result<Handover> ReceiveHandover(int socket, std::chrono::milliseconds timeout) {
  HelloMsg hello{};
  UniqueFd uffd_fd;
  // The sender's pid as the kernel stamped it on the Hello; it names the process whose memory
  // the userfaultfd covers only where the sender says it made the userfaultfd itself.
  const int on = 1, off = 0;
  if (setsockopt(socket, SOL_SOCKET, SO_PASSCRED, &on, sizeof on) != 0)
    return ErrnoError(errno, "handover: SO_PASSCRED");
  std::optional<pid_t> sender;
  Result<size_t> received = RecvMsg(socket, &hello, sizeof hello, &uffd_fd, timeout, &sender);
  (void)setsockopt(socket, SOL_SOCKET, SO_PASSCRED, &off, sizeof off);
  GPULAZY_ASSIGN_OR_RETURN(size_t n, std::move(received));
  if (n != sizeof hello || hello.magic != kMagic || hello.version != kVersion)
    return Corrupt("handover: bad hello ({} bytes)", n);
  if (hello.mode > static_cast<uint32_t>(FillMode::kMinorContinue))
    return Corrupt("handover: unknown mode {}", hello.mode);
  if (hello.count > kMaxHandoverRegions) return Corrupt("handover: {} regions", hello.count);
  if (!uffd_fd.valid()) return Corrupt("handover: hello without a userfaultfd");
  if (hello.scope > 1 + static_cast<uint32_t>(FaultScope::kUserOnly))
    return Corrupt("handover: unknown fault scope {}", hello.scope);
  const auto mode = static_cast<FillMode>(hello.mode);
  std::optional<FaultScope> scope;
  if (hello.scope != kScopeUnknown) scope = static_cast<FaultScope>(hello.scope - 1);
  if ((hello.flags & ~kOwnerIsSender) != 0)
    return Corrupt("handover: unknown flags {:#x}", hello.flags);
  std::optional<pid_t> owner;
  UniqueFd owner_pidfd;
  if ((hello.flags & kOwnerIsSender) != 0 && sender) {
    owner = sender;
    // Opened while the sender still holds its end: its exit shows on this descriptor, with no
    // pid reused since in between (Userfaultfd::OwnerExited). glibc 2.36 declares pidfd_open
    // without C linkage for C++: the syscall.
    owner_pidfd = UniqueFd(static_cast<int>(::syscall(SYS_pidfd_open, *sender, 0)));
  }
  Handover handover{
      Userfaultfd::Adopt(std::move(uffd_fd), mode, scope, owner, std::move(owner_pidfd)), {}, {}};
  for (uint32_t i = 0; i < hello.count; ++i) {
    RegionMsg region{};
    UniqueFd memfd;
    GPULAZY_ASSIGN_OR_RETURN(size_t got, RecvMsg(socket, &region, sizeof region, &memfd, timeout));
    if (got != sizeof region) return Corrupt("handover: region message of {} bytes", got);
    if (region.addr % PageSize() != 0 || region.addr + region.size < region.addr)
      return Corrupt("handover: region {:#x} +{} is not a page-aligned range", region.addr,
                     region.size);
    if (mode == FillMode::kMinorContinue && !memfd.valid())
      return Corrupt("handover: MINOR-mode region of BO {} without its memfd", region.bo);
    handover.regions.push_back({region.bo, region.addr, region.size});
    handover.memfds.push_back(std::move(memfd));
  }
  return handover;
}

Status SendComplete(int socket) {
  uint32_t magic = kCompleteMagic;
  return SendMsg(socket, &magic, sizeof magic, -1);
}

Status WaitComplete(int socket, std::chrono::milliseconds timeout) {
  uint32_t magic = 0;
  GPULAZY_ASSIGN_OR_RETURN(size_t n, RecvMsg(socket, &magic, sizeof magic, nullptr, timeout));
  if (n != sizeof magic || magic != kCompleteMagic)
    return Corrupt("handover: bad complete message");
  return Status::Ok();
}

}  // namespace gpulazy::uffd
