// Passing open files over a Unix stream socket (SCM_RIGHTS), for the page server's local data
// plane (docs/protocol.md, "Image files"): the server sends one frame with the image's files
// attached, the client reads chunks from them itself.
//
// Every descriptor received is owned at once (UniqueFd), so none leaks whatever the frame says;
// more descriptors than asked for, or truncated control data, is kCorrupt.
//
// Thread-safety: free functions; one caller per socket at a time.
#pragma once

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

// Sends `bytes` in one sendmsg with `fds` attached to the first byte, without waiting: the
// socket must be a connected Unix stream socket with room for all of `bytes` (a small frame on a
// connection that has nothing else queued). A short or refused send is an error.
Status SendWithFds(int socket, std::span<const uint8_t> bytes, std::span<const int> fds);

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
