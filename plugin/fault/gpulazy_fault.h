/* gpulazy fault channel, client side: a small C library for code that runs in a restored
 * process (a kernel-launch interposer, a framework's loader) and must make sure a GPU virtual
 * address range is resident before the GPU touches it (design.md 3, fault source 2).
 *
 *   int fd = gpulazy_fault_connect(getenv("GPULAZY_FAULT_SOCKET"));
 *   int rc = gpulazy_ensure(fd, va, len);  // 0 once resident, -errno otherwise
 *   gpulazy_fault_close(fd);
 *
 * Wire format (native endian, one Unix stream connection): request {u32 magic 0x464c4747,
 * u32 reserved, u64 va, u64 len}; reply {i32 status (0 or -errno), u32 reserved}. The
 * coordinator identifies the caller by SO_PEERCRED, so a process can only ask for its own BOs.
 * Thread-safety: one connection per thread. */
#ifndef GPULAZY_FAULT_H
#define GPULAZY_FAULT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GPULAZY_FAULT_MAGIC 0x464c4747u

struct gpulazy_fault_request {
  uint32_t magic;
  uint32_t reserved;
  uint64_t va;
  uint64_t len;
};

struct gpulazy_fault_reply {
  int32_t status;
  uint32_t reserved;
};

int gpulazy_fault_connect(const char* path);
int gpulazy_ensure(int fd, uint64_t va, uint64_t len);
void gpulazy_fault_close(int fd);

#ifdef __cplusplus
}
#endif

#endif
