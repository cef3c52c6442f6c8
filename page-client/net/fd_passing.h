// Passing open files over a Unix socket (SCM_RIGHTS): the one sendmsg/recvmsg wrapper of the
// project. The page server's local data plane (docs/protocol.md, "Image files") sends one frame
// with the image's files attached and the client reads chunks from them itself; the uffd
// handover and the plugin's BO hand-off send their own messages with it.
//
// Every descriptor received is owned at once (UniqueFd), so none leaks whatever the frame says;
// more descriptors than asked for, or truncated control data, is kCorrupt.
//
// Thread-safety: free functions; one caller per socket at a time.
#pragma once

#include <sys/types.h>

#include <optional>
#include <span>
#include <vector>

#include "lazy-server/image/io.h"
#include "page-client/net/stream.h"
#include "proto/frame.h"
#include "proto/status.h"
#include "proto/wire.pb.h"

namespace gpulazy::net {

// The kernel's limit on descriptors in one SCM_RIGHTS message (SCM_MAX_FD).
inline constexpr size_t kMaxPassedFds = 253;

// Whether a send or receive may block on the socket.
enum class Blocking { kNo, kYes };

// Sends `bytes` in one sendmsg with `fds` attached to the first byte (none: a plain send). With
// Blocking::kNo the socket must have room for all of `bytes` (a small frame on a connection that
// has nothing else queued). A short or refused send is an error.
Status SendWithFds(int socket, std::span<const uint8_t> bytes, std::span<const int> fds,
                   Blocking blocking = Blocking::kNo);

// One recvmsg of at most into.size() bytes, owning every descriptor that came with it
// (appended to *fds). Returns the bytes received: 0 when the peer closed, nullopt when
// Blocking::kNo and nothing is pending. More than max_fds descriptors, or truncated data or
// control data (a message longer than `into` on a datagram or seqpacket socket), is kCorrupt.
// `sender_pid`, when given, gets the sender's pid in this process's pid namespace where the
// message carried credentials (SCM_CREDENTIALS: the kernel stamps them when either end has
// SO_PASSCRED on at the send) and this socket has SO_PASSCRED on (else nullopt; 0, a sender
// outside this pid namespace, is nullopt too).
Result<std::optional<size_t>> ReceiveWithFds(int socket, std::span<uint8_t> into, size_t max_fds,
                                             std::vector<UniqueFd>* fds,
                                             Blocking blocking = Blocking::kNo,
                                             std::optional<pid_t>* sender_pid = nullptr);

// Encodes `header` as a payload-less frame and sends it with SendWithFds.
Status SendFrameWithFds(int socket, const wire::Header& header, std::span<const int> fds,
                        const FrameLimits& limits);

struct FrameWithFds {
  wire::Header header;
  std::vector<UniqueFd> fds;  // in the order the sender attached them
};

// Reads one payload-less frame from a Unix stream socket and the descriptors sent with it (at
// most max_fds). Reads no byte past the frame. A close before the frame is complete is
// kUnavailable; a payload, an oversized header or more than max_fds descriptors is kCorrupt.
// The caller bounds the wait (closing the socket ends it).
Awaitable<Result<FrameWithFds>> ReadFrameWithFds(Socket& socket, const FrameLimits& limits,
                                                 size_t max_fds);

}  // namespace gpulazy::net
