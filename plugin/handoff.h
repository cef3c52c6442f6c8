// Handoff: how a restored task gives CRIU's master its BO table and dmabuf fds (design.md 3),
// so contents are copied from the master instead of inside RESTORE_EXT_FILE. One SOCK_SEQPACKET
// socketpair made by the master at init(RESTORE); the task's end travels to the task through
// CRIU's fdstore (CRIU closes inherited fds in restored tasks). Each record is self-contained:
// a header naming the task and the KFD image, up to kMaxFdsPerRecord BOs, their fds as
// SCM_RIGHTS; the last record of a task carries kLast. The first record also carries a pidfd of
// the task, so the master notices when the task dies without racing pid reuse. With SO_PASSCRED
// on the master's end, the kernel stamps every record with the sender's pid as the master sees
// it (CRIU's RESUME_DEVICES_LATE passes that pid, not the task's own, inside a pid namespace).
// Records of different tasks may interleave; the receiver assembles them per (pid, file id).
// Thread-safety: free functions; one receiver.
#pragma once

#include <cstdint>
#include <vector>

#include "lazy-server/image/io.h"
#include "proto/status.h"

namespace gpulazy::plugin {

inline constexpr uint32_t kHandoffMagic = 0x474c4842;  // "BHLG"
inline constexpr uint32_t kMaxFdsPerRecord = 64;

struct HandedBo {
  uint32_t bo_index = 0;      // index in the amdgpu-kfd-<id>.img BO table
  uint32_t local_gpu_id = 0;  // the GPU it was restored on
  uint64_t size = 0;
  UniqueFd dmabuf;
};

struct HandoffRecord {
  uint32_t pid = 0;         // as the task sees itself (getpid)
  uint32_t sender_pid = 0;  // from SCM_CREDENTIALS, as the receiver sees it; 0 without
  uint32_t file_id = 0;
  bool last = false;
  std::vector<HandedBo> bos;
  UniqueFd pidfd;  // the task's pidfd, in its first record; invalid otherwise
};

// Sends a task's whole table as one or more records, `pidfd` (or -1) with the first. Does not
// take the fds.
Status SendHandoff(int socket, uint32_t pid, uint32_t file_id, const std::vector<HandedBo>& bos,
                   int pidfd = -1);
// Lets the kernel stamp records arriving on `socket` with their sender's pid (SO_PASSCRED).
Status EnableSenderCredentials(int socket);
// Receives one record; kUnavailable on EOF, kTimeout when nothing is there (nonblocking).
Result<HandoffRecord> ReceiveHandoff(int socket, bool nonblocking);

}  // namespace gpulazy::plugin
