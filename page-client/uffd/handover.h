// Handover of a restored process's userfaultfd to a pager in another process (as CRIU's
// lazy-pages daemon receives it), over a SOCK_SEQPACKET Unix socket with SCM_RIGHTS.
//
//   pager    -> restored : Layout   {magic, version, count, sizes[count]}    (BO sizes)
//   restored -> pager    : Hello    {magic, version, mode, count, scope}  + fd: uffd
//                                    + SCM_CREDENTIALS: its pid (Userfaultfd::owner)
//   restored -> pager    : Region   {bo, addr, size} x count       + fd: memfd (MINOR mode;
//                                    MISSING mode where the memory is memfds)
//   pager    -> restored : Complete {magic}  when every BO is resident and unregistered
//
// The restored process keeps its end open while it runs: a hang-up tells the pager it is gone.
// Every count and size read is checked; every receive has a deadline.
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

#include "page-client/uffd/memory.h"
#include "page-client/uffd/userfaultfd.h"
#include "proto/status.h"

namespace gpulazy::uffd {

inline constexpr uint32_t kMaxHandoverRegions = 65536;

// A connected SOCK_SEQPACKET pair (for a forked child); both ends close-on-exec.
Result<std::pair<UniqueFd, UniqueFd>> HandoverSocketPair();

Status SendLayout(int socket, const std::vector<uint64_t>& sizes);
Result<std::vector<uint64_t>> ReceiveLayout(int socket, std::chrono::milliseconds timeout);

// memfds: one per region (-1 for one that has none), or empty; MINOR mode needs them all.
Status SendHandover(int socket, const Userfaultfd& uffd, const std::vector<Region>& regions,
                    const std::vector<int>& memfds);

struct Handover {
  Userfaultfd uffd;
  std::vector<Region> regions;
  std::vector<UniqueFd> memfds;  // parallel to regions; invalid where none came (MISSING mode)
};
Result<Handover> ReceiveHandover(int socket, std::chrono::milliseconds timeout);

Status SendComplete(int socket);
// kOk once Complete arrived; kTimeout; kUnavailable when the pager hung up first.
Status WaitComplete(int socket, std::chrono::milliseconds timeout);

}  // namespace gpulazy::uffd
