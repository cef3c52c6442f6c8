// Access: who is on the other end of a connection, whether a Unix peer may connect at all, and
// which images a peer may see (docs/security.md, "Image visibility").
// Plain data and pure functions; thread-safe.
#pragma once

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "lazy-server/image/io.h"
#include "lazy-server/server/config.h"

namespace gpulazy::server {

struct PeerIdentity {
  std::optional<uid_t> uid;  // Unix peers (SO_PEERCRED)
  std::optional<gid_t> gid;
  std::optional<pid_t> pid;
  // The peer's process itself (SO_PEERPIDFD, Linux 6.5), taken as it connected. Unlike `pid`,
  // which a new process may reuse once the peer exits, it never names another process: the
  // descriptors a client hands over (placement) are taken through it. Null on older kernels.
  std::shared_ptr<const UniqueFd> pidfd;
  std::string common_name;  // TCP peers with a verified TLS client certificate

  // "uid 1000 gid 1000 pid 42", "cn 'node7'", "anonymous": for logs.
  std::string ToString() const;
};

// Reads SO_PEERCRED (and SO_PEERPIDFD, where the kernel has it) of a connected Unix socket.
Result<PeerIdentity> UnixPeerIdentity(int fd);
// Whether this kernel gives a Unix socket's peer as a pidfd (SO_PEERPIDFD, Linux 6.5). Without
// it, memfd placement takes a client's destinations through its pid, which another process may
// reuse once the client exits: the server warns at start.
bool KernelHasPeerPidfd();

// Whether a Unix peer may connect: its uid is in allow_uid or its primary gid in allow_gid;
// with both lists empty, our own uid and root.
bool UnixPeerAllowed(const ServerConfig& config, const PeerIdentity& peer);

// The image-access rules in force: --image-access's and --image-access-file's. `restricted` once
// either is configured, so that a rules file emptied to take every grant away hides every image
// rather than showing them all.
struct ImageAccessPolicy {
  std::vector<ImageAccessRule> rules;
  bool restricted = false;
  // The configuration's rules, with `file_rules` as the file's (as read at start or on SIGHUP).
  static ImageAccessPolicy For(const ServerConfig& config,
                               const std::vector<ImageAccessRule>& file_rules);
};

// Image-name prefixes a peer may open; nullopt when the policy is not restricted (everything is
// visible). An empty list sees nothing.
using ImageGrant = std::optional<std::vector<std::string>>;
ImageGrant GrantFor(const ImageAccessPolicy& policy, const PeerIdentity& peer);
// `relative` is the image's resolved path below its root. A prefix matches itself and what lies
// below it, component-wise ("a/b" matches "a/b" and "a/b/c", not "a/bc").
bool MayOpen(const ImageGrant& grant, std::string_view relative);

}  // namespace gpulazy::server
