#include "lazy-server/server/access.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "proto/utf8.h"

namespace gpulazy::server {

std::string PeerIdentity::ToString() const {
  std::string text;
  if (uid) text += fmt::format("uid {} ", *uid);
  if (gid) text += fmt::format("gid {} ", *gid);
  if (pid) text += fmt::format("pid {} ", *pid);
  if (!common_name.empty()) text += fmt::format("cn '{}' ", CutUtf8(common_name, 128));
  if (text.empty()) return "anonymous";
  text.pop_back();
  return text;
}

namespace {
// Debian 12's headers predate it (Linux 6.5).
#ifdef SO_PEERPIDFD
constexpr int kSoPeerPidfd = SO_PEERPIDFD;
#else
constexpr int kSoPeerPidfd = 77;
#endif
}  // namespace

Result<PeerIdentity> UnixPeerIdentity(int fd) {
  struct ucred credentials {};
  socklen_t length = sizeof(credentials);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &credentials, &length) != 0)
    return ErrnoError(errno, "SO_PEERCRED");
  PeerIdentity peer;
  peer.uid = credentials.uid;
  peer.gid = credentials.gid;
  peer.pid = credentials.pid;
  int pidfd = -1;
  length = sizeof(pidfd);
  if (::getsockopt(fd, SOL_SOCKET, kSoPeerPidfd, &pidfd, &length) == 0 && pidfd >= 0)
    peer.pidfd = std::make_shared<const UniqueFd>(pidfd);
  // Otherwise (ENOPROTOOPT before Linux 6.5; ESRCH once the peer exited) the pid alone.
  return peer;
}

bool KernelHasPeerPidfd() {
  int pair[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) return false;
  const UniqueFd first(pair[0]), second(pair[1]);
  int pidfd = -1;
  socklen_t length = sizeof(pidfd);
  if (::getsockopt(first.get(), SOL_SOCKET, kSoPeerPidfd, &pidfd, &length) != 0 || pidfd < 0)
    return false;
  ::close(pidfd);
  return true;
}

bool UnixPeerAllowed(const ServerConfig& config, const PeerIdentity& peer) {
  if (!peer.uid || !peer.gid) return false;
  auto contains = [](const std::vector<uint32_t>& list, uint32_t id) {
    return std::find(list.begin(), list.end(), id) != list.end();
  };
  if (config.allow_uid.empty() && config.allow_gid.empty())
    return *peer.uid == ::geteuid() || *peer.uid == 0;
  return contains(config.allow_uid, *peer.uid) || contains(config.allow_gid, *peer.gid);
}

ImageAccessPolicy ImageAccessPolicy::For(const ServerConfig& config,
                                         const std::vector<ImageAccessRule>& file_rules) {
  ImageAccessPolicy policy;
  policy.rules = config.image_access;
  policy.rules.insert(policy.rules.end(), file_rules.begin(), file_rules.end());
  policy.restricted = !config.image_access.empty() || !config.image_access_file.empty();
  return policy;
}

ImageGrant GrantFor(const ImageAccessPolicy& policy, const PeerIdentity& peer) {
  if (!policy.restricted) return std::nullopt;
  const std::vector<ImageAccessRule>& rules = policy.rules;
  std::vector<std::string> principals = {"*"};
  if (peer.uid) principals.push_back(fmt::format("uid:{}", *peer.uid));
  if (peer.gid) principals.push_back(fmt::format("gid:{}", *peer.gid));
  if (!peer.common_name.empty()) principals.push_back("cn:" + peer.common_name);
  std::vector<std::string> prefixes;
  for (const ImageAccessRule& rule : rules) {
    if (std::find(principals.begin(), principals.end(), rule.principal) == principals.end())
      continue;
    prefixes.insert(prefixes.end(), rule.prefixes.begin(), rule.prefixes.end());
  }
  return prefixes;
}

bool MayOpen(const ImageGrant& grant, std::string_view relative) {
  if (!grant) return true;
  return std::any_of(grant->begin(), grant->end(), [&](const std::string& prefix) {
    if (prefix == "*") return true;
    if (!relative.starts_with(prefix)) return false;
    return relative.size() == prefix.size() || relative[prefix.size()] == '/';
  });
}

}  // namespace gpulazy::server
