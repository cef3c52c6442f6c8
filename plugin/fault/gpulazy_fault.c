/* See gpulazy_fault.h. */
#include "plugin/fault/gpulazy_fault.h"

#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

static int write_all(int fd, const void* p, size_t n) {
  const char* c = p;
  while (n > 0) {
    ssize_t w = send(fd, c, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -errno;
    c += w;
    n -= (size_t)w;
  }
  return 0;
}

static int read_all(int fd, void* p, size_t n) {
  char* c = p;
  while (n > 0) {
    ssize_t r = read(fd, c, n);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) return -ECONNRESET;
    if (r < 0) return -errno;
    c += r;
    n -= (size_t)r;
  }
  return 0;
}

int gpulazy_fault_connect(const char* path) {
  struct sockaddr_un addr;
  if (path == NULL || strlen(path) >= sizeof(addr.sun_path)) return -EINVAL;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -errno;
  memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  strcpy(addr.sun_path, path);
  if (connect(fd, (struct sockaddr*)&addr, sizeof(addr)) != 0) {
    int e = errno;
    close(fd);
    return -e;
  }
  return fd;
}

int gpulazy_ensure(int fd, uint64_t va, uint64_t len) {
  struct gpulazy_fault_request req = {GPULAZY_FAULT_MAGIC, 0, va, len};
  struct gpulazy_fault_reply reply;
  int rc = write_all(fd, &req, sizeof(req));
  if (rc != 0) return rc;
  rc = read_all(fd, &reply, sizeof(reply));
  return rc != 0 ? rc : reply.status;
}

void gpulazy_fault_close(int fd) {
  if (fd >= 0) close(fd);
}
