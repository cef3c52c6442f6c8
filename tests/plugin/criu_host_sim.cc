// gpulazy_criu_host_sim: a stand-in for CRIU's restore that dlopens the real gpulazy_plugin.so
// and drives it in CRIU's order (design.md 6) with real forked processes as restored tasks:
//
//   master: dlopen, check CR_PLUGIN_DESC, init(RESTORE), fork the task tree
//   tasks:  RESTORE_EXT_FILE(id), UPDATE_VMA_MAP for their BOs, then wait to be checked
//   master: POST_FORKING, RESUME_DEVICES_LATE(pid) per task, exit(RESTORE, ret)
//   tasks:  compare every restored BO (the fake KFD's memfds) with the checkpoint's pages files
//
// It deliberately links none of our libraries: the plugin carries its own copy of the generated
// protobuf code registered into the shared libprotobuf, and a second copy in the host would
// register the same .proto files twice (a fatal error in libprotobuf). What the tasks compare
// against comes from an --expect file the test writes (plain text, one BO per line).
//
// The host exports CRIU's plugin-facing functions (the plugin resolves them with
// dlsym(RTLD_DEFAULT); the executable is linked with -rdynamic). Output: one line per hook call
// and a final "sim: ok" or "sim: FAIL <why>"; exit status 0 only on ok. Every wait is bounded.
//
// Always checked: the plugin leaves CRIU's signal dispositions alone (the host installs its own
// SIGTERM/SIGINT/SIGCHLD handlers first and compares after POST_FORKING and after exit), and
// every thread it starts blocks asynchronous signals, so they reach CRIU's own thread.
//
// --dump ID instead drives a dump: init(DUMP), DUMP_EXT_FILE on a file that is no KFD (must
// pass, -ENOTSUP) and on a fake KFD file with CRIU file id ID (must succeed), exit(DUMP, 0);
// the images land in --images.
//
// Optional restore scenarios:
//   --stop-pid PID   SIGSTOP that process (a gpulazy-server) right after POST_FORKING, so the
//                    stream is known to be incomplete, and SIGCONT it at the scenario's point.
//   --kill N         SIGKILL task N (index in --task order, not the root) once every task has
//                    handed its BOs over, and wait until it is dead. Then --on-death:
//                      continue: RESUME_DEVICES_LATE the dead task first (must fail), SIGCONT,
//                                resume the others, whose contents must still be byte-exact;
//                      abort:    as CRIU does on a restored task's SIGCHLD: exit(RESTORE, -1)
//                                at once, which must return (no RESUME_DEVICES_LATE);
//                      after-resume: (lazy) kill it only after every task resumed, while the
//                                server is still stopped; exit(RESTORE, 0) and the others'
//                                contents must be as usual.
//   --render F:R     the task restoring KFD file F also has render-node file R: it calls
//                    RESTORE_EXT_FILE(R) too, before its KFD file with --render-first 1, else
//                    after. The answer must be an fd of a render node that the task keeps (as
//                    CRIU installs it), the same open file UPDATE_VMA_MAP hands out for the
//                    render node's BOs, whose contents must match --expect-drm (lines
//                    "R handle size va mmap_offset pages_path"; contents after the 8-byte
//                    header) through the fake DRM's memfds (its drm-<pid> log, kfd.h).
//   --fault-check    lazy mode: after resume and before exit, each task asks the fault channel
//                    (libgpulazy_fault) for the last page of its last BO, checks those bytes,
//                    and the error cases (a range outside every BO, a zero length); after exit
//                    it checks that the closed channel answers with an error.
#include <dirent.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "plugin/criu_abi.h"
#include "plugin/fault/gpulazy_fault.h"
#include "tests/support/fake_drm_log.h"

namespace {

constexpr int kTaskTimeoutS = 120;  // a task never outlives this, whatever the master does
constexpr int kMasterTimeoutS = 150;
constexpr int kReportTimeoutMs = 90'000;

struct ExpectedBo {
  uint32_t file_id = 0;
  uint32_t bo_index = 0;
  uint64_t size = 0;
  uint64_t mmap_offset = 0;
  std::string pages_path;
  uint64_t pages_offset = 0;  // absolute, header included
  uint64_t gpu_va = 0;
};

struct ExpectedRenderBo {
  int render_id = 0;
  uint32_t handle = 0;
  uint64_t size = 0;
  uint64_t gpu_va = 0;
  uint64_t mmap_offset = 0;
  std::string pages_path;
};

struct Task {
  int file_id = 0;           // 0: a task without GPU state
  int render_id = 0;         // --render: its render-node file, 0 for none
  int report[2] = {-1, -1};  // task -> master
  int go[2] = {-1, -1};      // master -> task
  pid_t pid = -1;
};

int g_image_dir_fd = -1;
std::vector<int> g_fdstore;
std::vector<std::string> g_claimed;
int g_kill_index = -1;  // --kill
bool g_fault_check = false;
bool g_render_first = false;
std::vector<ExpectedRenderBo> g_expected_drm;

// CRIU's master has its own handlers; the plugin must leave them as they are.
constexpr int kWatchedSignals[] = {SIGTERM, SIGINT, SIGCHLD};
void HostSignalHandler(int) {}

void InstallHostHandlers() {
  for (int sig : kWatchedSignals) {
    struct sigaction sa {};
    sa.sa_handler = HostSignalHandler;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    ::sigaction(sig, &sa, nullptr);
  }
}

// "" when every watched signal still has the host's handler.
std::string HandlersChanged() {
  std::string changed;
  for (int sig : kWatchedSignals) {
    struct sigaction now {};
    ::sigaction(sig, nullptr, &now);
    if (now.sa_handler != HostSignalHandler) changed += " " + std::string(strsignal(sig));
  }
  return changed;
}

// Threads of this process other than the main one that do not block SIGTERM, SIGINT and
// SIGCHLD ("" when none).
std::string ThreadsTakingSignals() {
  const uint64_t want = (1ull << (SIGTERM - 1)) | (1ull << (SIGINT - 1)) | (1ull << (SIGCHLD - 1));
  std::string bad;
  DIR* d = ::opendir("/proc/self/task");
  if (d == nullptr) return "cannot list /proc/self/task";
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.' || std::atoi(e->d_name) == ::getpid()) continue;
    std::ifstream status(std::string("/proc/self/task/") + e->d_name + "/status");
    std::string line;
    while (std::getline(status, line)) {
      if (line.rfind("SigBlk:", 0) != 0) continue;
      uint64_t blocked = std::strtoull(line.c_str() + 7, nullptr, 16);
      if ((blocked & want) != want) bad += std::string(" ") + e->d_name;
    }
  }
  ::closedir(d);
  return bad;
}

void Say(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stdout, fmt, ap);
  va_end(ap);
  std::fputc('\n', stdout);
  std::fflush(stdout);
}

bool WriteAll(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    ssize_t w = ::write(fd, c, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    c += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// Reads exactly n bytes within timeout_ms; false on EOF, error or timeout.
bool ReadAll(int fd, void* p, size_t n, int timeout_ms) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    pollfd pfd{fd, POLLIN, 0};
    int r = ::poll(&pfd, 1, timeout_ms);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    ssize_t got = ::read(fd, c, n);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    c += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

bool ReadFileAt(int fd, uint64_t off, std::vector<uint8_t>& buf) {
  size_t done = 0;
  while (done < buf.size()) {
    ssize_t r = ::pread(fd, buf.data() + done, buf.size() - done, static_cast<off_t>(off + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    done += static_cast<size_t>(r);
  }
  return true;
}

}  // namespace

// ---- what CRIU exports to plugins (criu_abi.h) ----
extern "C" {
__attribute__((visibility("default"))) int criu_get_image_dir(void) {
  return g_image_dir_fd;
}
__attribute__((visibility("default"))) bool check_and_remove_inventory_plugin(const char* name,
                                                                              size_t len) {
  g_claimed.emplace_back(name, len);
  return true;
}
// CRIU's fdstore keeps fds in the master for restored tasks, which lose inherited fds; here a
// task inherits the table by fork and gets a fresh dup, as from CRIU's store.
__attribute__((visibility("default"))) int fdstore_add(int fd) {
  int copy = ::fcntl(fd, F_DUPFD_CLOEXEC, 100);
  if (copy < 0) return -1;
  g_fdstore.push_back(copy);
  return static_cast<int>(g_fdstore.size()) - 1;
}
__attribute__((visibility("default"))) int fdstore_get(int id) {
  if (id < 0 || static_cast<size_t>(id) >= g_fdstore.size()) return -1;
  return ::fcntl(g_fdstore[static_cast<size_t>(id)], F_DUPFD_CLOEXEC, 0);
}
}

namespace {

gpulazy_criu_plugin_desc* g_desc = nullptr;

// When the tasks restore their files relative to POST_FORKING. CRIU runs POST_FORKING once the
// tree is forked and only then lets tasks restore files; the others check that the plugin does
// not depend on that.
enum class Order { kCriu, kTasksFirst, kConcurrent };
Order g_order = Order::kCriu;

template <typename F>
F Hook(int index) {
  return reinterpret_cast<F>(g_desc->hooks[index]);
}

// The fake KFD's BOs are memfds named gpulazy-bo-<bo index> (kfd_fake.cc); the restored task
// holds them through its KFD object. Map bo index -> fd.
std::map<uint32_t, int> FindBoMemfds() {
  std::map<uint32_t, int> out;
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) return out;
  const std::string prefix = "/memfd:gpulazy-bo-";
  while (dirent* e = ::readdir(d)) {
    char target[256];
    std::string link = std::string("/proc/self/fd/") + e->d_name;
    ssize_t n = ::readlink(link.c_str(), target, sizeof(target) - 1);
    if (n <= 0) continue;
    std::string t(target, static_cast<size_t>(n));
    if (t.rfind(prefix, 0) != 0) continue;
    out[static_cast<uint32_t>(std::strtoul(t.c_str() + prefix.size(), nullptr, 10))] =
        std::atoi(e->d_name);
  }
  ::closedir(d);
  return out;
}

// Compares this task's BOs with the pages files; "" when every byte matches.
std::string CheckContents(const std::vector<ExpectedBo>& expected, int file_id) {
  std::map<uint32_t, int> memfds = FindBoMemfds();
  size_t mine = 0;
  std::vector<uint8_t> want, got;
  for (const ExpectedBo& bo : expected) {
    if (static_cast<int>(bo.file_id) != file_id) continue;
    ++mine;
    auto it = memfds.find(bo.bo_index);
    if (it == memfds.end()) return "BO " + std::to_string(bo.bo_index) + ": no restored memfd";
    int pages = ::open(bo.pages_path.c_str(), O_RDONLY | O_CLOEXEC);
    if (pages < 0) return "cannot open " + bo.pages_path;
    want.resize(bo.size);
    got.resize(bo.size);
    bool read = ReadFileAt(pages, bo.pages_offset, want) && ReadFileAt(it->second, 0, got);
    ::close(pages);
    if (!read) return "BO " + std::to_string(bo.bo_index) + ": short read";
    if (want != got) {
      size_t at = 0;
      while (at < want.size() && want[at] == got[at])
        ++at;
      return "BO " + std::to_string(bo.bo_index) + " differs at byte " + std::to_string(at);
    }
  }
  if (mine != memfds.size())
    return std::to_string(memfds.size()) + " BO memfds but " + std::to_string(mine) + " expected";
  return "";
}

// --fault-check, in a task after its resume: the last page of its last BO through the fault
// channel, then the error cases. `conn` stays open for the after-exit check. "" when all held.
// With `server_held` (the server is still SIGSTOPped, so the page cannot have arrived) the
// first ensure must time out (the test sets a short resume timeout) rather than answer early.
std::string FaultCheck(const std::vector<ExpectedBo>& expected, int file_id, int report_fd,
                       bool server_held, int& conn) {
  const ExpectedBo* last = nullptr;
  uint64_t end_of_all = 0;
  for (const ExpectedBo& bo : expected) {
    end_of_all = std::max(end_of_all, bo.gpu_va + bo.size);
    if (static_cast<int>(bo.file_id) == file_id) last = &bo;
  }
  if (last == nullptr) return "no BO to fault on";
  const char* path = std::getenv("GPULAZY_FAULT_SOCKET");
  conn = gpulazy_fault_connect(path);
  if (conn < 0) return std::string("fault channel connect: ") + std::strerror(-conn);
  const uint64_t len = 4096;
  const uint64_t off = last->size - len;
  int rc = 0;
  if (server_held && (rc = gpulazy_ensure(conn, last->gpu_va + off, len)) != -ETIMEDOUT)
    return "ensure with the server stopped = " + std::to_string(rc) + ", not -ETIMEDOUT";
  const char ensuring = 'e';  // the master lets the server go on now
  if (!WriteAll(report_fd, &ensuring, 1)) return "report pipe";
  rc = gpulazy_ensure(conn, last->gpu_va + off, len);
  if (rc != 0) return "ensure(last page) = " + std::to_string(rc);
  // Resident means resident: the bytes must be there the moment ensure returns.
  std::map<uint32_t, int> memfds = FindBoMemfds();
  auto it = memfds.find(last->bo_index);
  if (it == memfds.end()) return "no memfd for the faulted BO";
  std::vector<uint8_t> want(len), got(len);
  int pages = ::open(last->pages_path.c_str(), O_RDONLY | O_CLOEXEC);
  if (pages < 0) return "cannot open " + last->pages_path;
  bool read = ReadFileAt(pages, last->pages_offset + off, want) && ReadFileAt(it->second, off, got);
  ::close(pages);
  if (!read) return "short read after ensure";
  if (want != got) return "BO " + std::to_string(last->bo_index) + ": wrong bytes after ensure";
  rc = gpulazy_ensure(conn, end_of_all + (1ull << 30), len);
  if (rc != -ENOENT) return "ensure(outside every BO) = " + std::to_string(rc);
  rc = gpulazy_ensure(conn, last->gpu_va, 0);
  if (rc != -EINVAL) return "ensure(length 0) = " + std::to_string(rc);
  rc = gpulazy_ensure(conn, ~0ull - 100, len);
  if (rc != -EINVAL) return "ensure(range wrapping around) = " + std::to_string(rc);
  Say("task %d: fault channel: last page of BO %u byte-exact after ensure; errors as expected",
      ::getpid(), last->bo_index);
  return "";
}

// After the master's exit the fault channel is gone: a held connection and a new one fail.
std::string ClosedChannelCheck(const ExpectedBo& any, int conn) {
  int rc = gpulazy_ensure(conn, any.gpu_va, 4096);
  gpulazy_fault_close(conn);
  if (rc != -ECONNRESET && rc != -EPIPE)
    return "ensure on the closed channel = " + std::to_string(rc);
  int again = gpulazy_fault_connect(std::getenv("GPULAZY_FAULT_SOCKET"));
  if (again >= 0) {
    gpulazy_fault_close(again);
    return "the fault channel still accepts connections after exit";
  }
  return "";
}

// UPDATE_VMA_MAP as CRIU calls it in the restored task, against what the fake KFD's RESTORE
// returned (its restored-<pid> file: "va old_offset restored_offset" per BO). "" when right.
std::string CheckVmaMaps(const std::vector<ExpectedBo>& expected, int file_id) {
  auto update = Hook<gpulazy_update_vma_map_t>(GPULAZY_HOOK_UPDATE_VMA_MAP);
  const char* kfd_state = std::getenv("GPULAZY_FAKE_KFD");
  std::ifstream restored(std::string(kfd_state ? kfd_state : "") + "/restored-" +
                         std::to_string(::getpid()));
  std::map<std::pair<uint64_t, uint64_t>, uint64_t> driver;  // (va, old) -> restored offset
  uint64_t va = 0, old_offset = 0, new_offset = 0;
  while (restored >> std::hex >> va >> old_offset >> new_offset)
    driver[{va, old_offset}] = new_offset;
  for (const ExpectedBo& bo : expected) {
    if (static_cast<int>(bo.file_id) != file_id) continue;
    const std::string which = "BO " + std::to_string(bo.bo_index);
    auto it = driver.find({bo.gpu_va, bo.mmap_offset});
    if (it == driver.end()) return which + ": the fake KFD did not restore it";
    // Through the render node: CRIU gets the driver's new offset and a render node fd to mmap.
    uint64_t pgoff = 0;
    int fd = -1;
    int rc = update("/dev/dri/renderD128", bo.gpu_va, bo.mmap_offset, &pgoff, &fd);
    if (rc != 1 || pgoff != it->second || fd < 0)
      return which + ": UPDATE_VMA_MAP(renderD) = " + std::to_string(rc);
    char target[256] = {};
    ssize_t n =
        ::readlink(("/proc/self/fd/" + std::to_string(fd)).c_str(), target, sizeof(target) - 1);
    ::close(fd);  // CRIU closes it after the mmap
    if (n <= 0 || std::strstr(target, "renderD") == nullptr)
      return which + ": UPDATE_VMA_MAP gave an fd that is no render node";
    // Through /dev/kfd (a doubled slash as CRIU sometimes has it): no fd, CRIU opens the path.
    pgoff = 0;
    fd = 7;
    rc = update("//dev/kfd", bo.gpu_va, bo.mmap_offset, &pgoff, &fd);
    if (rc != 1 || pgoff != it->second || fd != -1)
      return which + ": UPDATE_VMA_MAP(/dev/kfd) = " + std::to_string(rc);
    // A device mapping that is no BO stays as it is; a foreign file is another plugin's.
    if ((rc = update("/dev/kfd", bo.gpu_va + 4096, bo.mmap_offset, &pgoff, &fd)) != 0)
      return which + ": UPDATE_VMA_MAP(no such BO) = " + std::to_string(rc);
    if ((rc = update("/dev/zero", bo.gpu_va, bo.mmap_offset, &pgoff, &fd)) != -ENOTSUP)
      return which + ": UPDATE_VMA_MAP(/dev/zero) = " + std::to_string(rc);
  }
  return "";
}

// Two fds share one open file description exactly when a seek on one moves the other.
bool SameOpenFile(int a, int b) {
  const off_t mark = 4321;
  if (::lseek(a, mark, SEEK_SET) != mark) return false;
  bool same = ::lseek(b, 0, SEEK_CUR) == mark;
  (void)::lseek(a, 0, SEEK_SET);
  return same;
}

std::string FdTarget(int fd) {
  char target[512] = {};
  ssize_t n =
      ::readlink(("/proc/self/fd/" + std::to_string(fd)).c_str(), target, sizeof(target) - 1);
  return n > 0 ? std::string(target, static_cast<size_t>(n)) : std::string();
}

// The fake DRM's live BOs in this process, handle -> memfd (its drm-<pid> log, kfd.h).
std::map<uint32_t, int> FakeDrmBos() {
  const char* kfd_state = std::getenv("GPULAZY_FAKE_KFD");
  return gpulazy::testing::FakeDrmBos(std::string(kfd_state ? kfd_state : "") + "/drm-" +
                                      std::to_string(::getpid()));
}

// --render: what RESTORE_EXT_FILE answered for the render node, checked. "" when right.
std::string CheckRenderNode(int render_id, int render_fd) {
  if (render_fd < 0)
    return "RESTORE_EXT_FILE(render " + std::to_string(render_id) +
           ") = " + std::to_string(render_fd);
  const std::string target = FdTarget(render_fd);
  if (target.find("/renderD") == std::string::npos)
    return "the render node's fd is " + target + ", no render node";
  auto update = Hook<gpulazy_update_vma_map_t>(GPULAZY_HOOK_UPDATE_VMA_MAP);
  std::map<uint32_t, int> memfds = FakeDrmBos();
  size_t mine = 0;
  for (const ExpectedRenderBo& bo : g_expected_drm) {
    if (bo.render_id != render_id) continue;
    ++mine;
    const std::string which = "render BO " + std::to_string(bo.handle);
    uint64_t pgoff = 0;
    int fd = -1;
    int rc = update("/dev/dri/renderD128", bo.gpu_va, bo.mmap_offset, &pgoff, &fd);
    if (rc != 1 || fd < 0) return which + ": UPDATE_VMA_MAP(renderD) = " + std::to_string(rc);
    const bool same = SameOpenFile(render_fd, fd);
    ::close(fd);
    if (!same) return which + ": UPDATE_VMA_MAP's fd is not the file RESTORE_EXT_FILE gave";
    auto it = memfds.find(bo.handle);
    if (it == memfds.end()) return which + ": no BO under its checkpointed handle";
    std::vector<uint8_t> want(bo.size), got(bo.size);
    int pages = ::open(bo.pages_path.c_str(), O_RDONLY | O_CLOEXEC);
    if (pages < 0) return "cannot open " + bo.pages_path;
    bool read = ReadFileAt(pages, 8, want) && ReadFileAt(it->second, 0, got);
    ::close(pages);
    if (!read) return which + ": short read";
    if (want != got) return which + ": contents differ from " + bo.pages_path;
  }
  if (mine == 0) return "no render BOs expected for render file " + std::to_string(render_id);
  Say("task %d: render node %d: %s, %zu BOs byte-exact, one open file with UPDATE_VMA_MAP's",
      ::getpid(), render_id, target.c_str(), mine);
  return "";
}

struct Report {
  int32_t pid = 0;
  int32_t rc = 0;  // RESTORE_EXT_FILE's answer (or, for a plain task, 0 when its hooks said no)
};

// One restored task: what CRIU's restorer runs of ours in it. Returns the exit status.
int TaskMain(Task& task, const std::vector<ExpectedBo>& expected) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  ::alarm(kTaskTimeoutS);
  Report report{static_cast<int32_t>(::getpid()), 0};
  auto restore = Hook<gpulazy_restore_ext_file_t>(GPULAZY_HOOK_RESTORE_EXT_FILE);
  auto update = Hook<gpulazy_update_vma_map_t>(GPULAZY_HOOK_UPDATE_VMA_MAP);
  bool retry = false;
  if (g_order == Order::kCriu) {
    char stage = 0;
    if (!ReadAll(task.go[0], &stage, 1, kTaskTimeoutS * 1000) || stage != 's') return 2;
  }
  int render_fd = -1;  // as CRIU would have installed it, kept to the end
  if (task.file_id > 0) {
    if (task.render_id > 0 && g_render_first) render_fd = restore(task.render_id, &retry);
    report.rc = restore(task.file_id, &retry);
    if (task.render_id > 0 && !g_render_first) render_fd = restore(task.render_id, &retry);
    std::string why;
    if (report.rc >= 0) {
      why = CheckVmaMaps(expected, task.file_id);
      if (why.empty() && task.render_id > 0) why = CheckRenderNode(task.render_id, render_fd);
      if (!why.empty()) report.rc = -EPROTO;
    }
    if (!why.empty()) Say("task %d: %s", report.pid, why.c_str());
  } else {
    // Nothing of ours in this task: every hook must pass (-ENOTSUP).
    int file = restore(4242, &retry);
    uint64_t pgoff = 0;
    int fd = -1;
    int vma = update("/dev/zero", 0, 0, &pgoff, &fd);
    Say("task %d (no GPU): RESTORE_EXT_FILE = %d, UPDATE_VMA_MAP = %d", report.pid, file, vma);
    report.rc = (file == -ENOTSUP && vma == -ENOTSUP) ? 0 : -EPROTO;
  }
  if (!WriteAll(task.report[1], &report, sizeof(report))) return 3;
  char go = 0;
  int fault_conn = -1;
  std::string why;
  if (g_fault_check && task.file_id > 0) {
    // 'E': the server is still stopped; 'e': it runs.
    if (!ReadAll(task.go[0], &go, 1, kTaskTimeoutS * 1000) || (go != 'e' && go != 'E')) return 2;
    why = FaultCheck(expected, task.file_id, task.report[1], go == 'E', fault_conn);
    if (!why.empty()) Say("task %d: %s", report.pid, why.c_str());
    char verdict = why.empty() ? 1 : 0;
    if (!WriteAll(task.report[1], &verdict, 1)) return 3;
  }
  if (!ReadAll(task.go[0], &go, 1, kTaskTimeoutS * 1000) || go != 'c') return 2;
  if (why.empty() && fault_conn >= 0) {
    for (const ExpectedBo& bo : expected)
      if (static_cast<int>(bo.file_id) == task.file_id) {
        why = ClosedChannelCheck(bo, fault_conn);
        break;
      }
  }
  if (why.empty() && task.file_id > 0) why = CheckContents(expected, task.file_id);
  if (why.empty() && task.render_id > 0 &&
      FdTarget(render_fd).find("/renderD") == std::string::npos)
    why = "the render node's fd did not last until the end";
  if (!why.empty()) Say("task %d: %s", report.pid, why.c_str());
  char verdict = why.empty() ? 1 : 0;
  (void)WriteAll(task.report[1], &verdict, 1);
  return verdict ? 0 : 1;
}

bool ParseExpect(const std::string& path, std::vector<ExpectedBo>& out) {
  std::ifstream in(path);
  if (!in) return false;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    std::istringstream s(line);
    ExpectedBo bo;
    if (!(s >> bo.file_id >> bo.bo_index >> bo.size >> bo.mmap_offset >> bo.pages_path >>
          bo.pages_offset >> bo.gpu_va))
      return false;
    out.push_back(bo);
  }
  return true;
}

int Fail(const char* fmt, ...) {
  std::fputs("sim: FAIL ", stdout);
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stdout, fmt, ap);
  va_end(ap);
  std::fputc('\n', stdout);
  std::fflush(stdout);
  return 1;
}

// --dump: what CRIU's dump runs of ours for one KFD file.
int DumpMain(int dump_id) {
  int rc = g_desc->init(GPULAZY_CRIU_STAGE_DUMP);
  Say("init(DUMP) = %d", rc);
  if (rc != 0) return Fail("init(DUMP) = %d", rc);
  auto dump = Hook<gpulazy_dump_ext_file_t>(GPULAZY_HOOK_DUMP_EXT_FILE);
  int other = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  rc = dump(other, dump_id + 1);
  ::close(other);
  Say("DUMP_EXT_FILE(/dev/null) = %d", rc);
  if (rc != -ENOTSUP) return Fail("DUMP_EXT_FILE of a file that is not ours = %d", rc);
  // The fake KFD recognises its files by this memfd name (kfd_fake.cc).
  int kfd = ::memfd_create("gpulazy-fake-kfd", MFD_CLOEXEC);
  rc = dump(kfd, dump_id);
  ::close(kfd);
  Say("DUMP_EXT_FILE(kfd, %d) = %d", dump_id, rc);
  g_desc->exit(GPULAZY_CRIU_STAGE_DUMP, rc);
  Say("exit(DUMP, %d)", rc);
  if (rc != 0) return Fail("DUMP_EXT_FILE = %d", rc);
  if (std::string changed = HandlersChanged(); !changed.empty())
    return Fail("the plugin changed the host's handlers of%s", changed.c_str());
  Say("sim: ok");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ::alarm(kMasterTimeoutS);
  std::string plugin, images, expect_path, expect_drm_path;
  std::vector<std::string> renders;
  std::vector<Task> tasks;
  int dump_id = 0;
  pid_t stop_pid = -1;
  bool abort_on_death = false;
  bool kill_after_resume = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--plugin")
      plugin = value;
    else if (flag == "--images")
      images = value;
    else if (flag == "--order")
      g_order = value == "tasks-first"  ? Order::kTasksFirst
                : value == "concurrent" ? Order::kConcurrent
                                        : Order::kCriu;
    else if (flag == "--expect")
      expect_path = value;
    else if (flag == "--task")
      tasks.push_back(Task{value == "none" ? 0 : std::atoi(value.c_str())});
    else if (flag == "--dump")
      dump_id = std::atoi(value.c_str());
    else if (flag == "--stop-pid")
      stop_pid = std::atoi(value.c_str());
    else if (flag == "--kill")
      g_kill_index = std::atoi(value.c_str());
    else if (flag == "--on-death" && (value == "continue" || value == "abort"))
      abort_on_death = value == "abort";
    else if (flag == "--on-death" && value == "after-resume")
      kill_after_resume = true;
    else if (flag == "--fault-check" && (value == "1" || value == "0"))
      g_fault_check = value == "1";
    else if (flag == "--render-first" && (value == "1" || value == "0"))
      g_render_first = value == "1";
    else if (flag == "--render")
      renders.push_back(value);
    else if (flag == "--expect-drm")
      expect_drm_path = value;
    else
      return Fail("unknown flag %s", flag.c_str());
  }
  for (const std::string& r : renders) {
    int file = 0, render = 0;
    if (std::sscanf(r.c_str(), "%d:%d", &file, &render) != 2 || render <= 0)
      return Fail("--render takes KFD_FILE:RENDER_FILE, not %s", r.c_str());
    bool found = false;
    for (Task& t : tasks)
      if (t.file_id == file) {
        t.render_id = render;
        found = true;
      }
    if (!found) return Fail("--render %s: no task restores KFD file %d", r.c_str(), file);
  }
  if (!expect_drm_path.empty()) {
    std::ifstream in(expect_drm_path);
    ExpectedRenderBo bo;
    while (in >> bo.render_id >> bo.handle >> bo.size >> bo.gpu_va >> bo.mmap_offset >>
           bo.pages_path)
      g_expected_drm.push_back(bo);
    if (g_expected_drm.empty()) return Fail("cannot parse %s", expect_drm_path.c_str());
  }
  if (plugin.empty() || images.empty() || (tasks.empty() && dump_id <= 0))
    return Fail("usage: --plugin SO --images DIR [--expect FILE] --task ID|none ... | --dump ID");
  if (g_kill_index == 0 || g_kill_index >= static_cast<int>(tasks.size()))
    return Fail("--kill takes the index of a task other than the root");
  InstallHostHandlers();
  std::vector<ExpectedBo> expected;
  if (!expect_path.empty() && !ParseExpect(expect_path, expected))
    return Fail("cannot parse %s", expect_path.c_str());

  // ---- load and check the descriptor as CRIU does ----
  void* so = ::dlopen(plugin.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (so == nullptr) return Fail("dlopen: %s", ::dlerror());
  g_desc = static_cast<gpulazy_criu_plugin_desc*>(::dlsym(so, "CR_PLUGIN_DESC"));
  if (g_desc == nullptr) return Fail("no CR_PLUGIN_DESC");
  Say("desc: name=%s version=%#x max_hooks=%u", g_desc->name, g_desc->version, g_desc->max_hooks);
  if (std::strcmp(g_desc->name, "gpulazy_plugin") != 0 || g_desc->version != 0x200 ||
      g_desc->max_hooks != GPULAZY_HOOK_COUNT_CRIU_4_2)
    return Fail("unexpected descriptor");
  // criu-dev NULLs the slots between the plugin's max_hooks and its own count.
  for (int h = static_cast<int>(g_desc->max_hooks); h < GPULAZY_HOOK_COUNT_CRIU_DEV; ++h)
    g_desc->hooks[h] = nullptr;
  for (int h : {GPULAZY_HOOK_RESTORE_EXT_FILE, GPULAZY_HOOK_UPDATE_VMA_MAP,
                GPULAZY_HOOK_RESUME_DEVICES_LATE, GPULAZY_HOOK_POST_FORKING})
    if (g_desc->hooks[h] == nullptr) return Fail("hook %d missing", h);

  g_image_dir_fd = ::open(images.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (g_image_dir_fd < 0) return Fail("open %s: %s", images.c_str(), std::strerror(errno));
  if (dump_id > 0) return DumpMain(dump_id);

  int rc = g_desc->init(GPULAZY_CRIU_STAGE_RESTORE);
  Say("init(RESTORE) = %d", rc);
  if (rc != 0) return Fail("init(RESTORE) = %d", rc);

  // ---- fork the tree: the first task is the root, the others its children (as CRIU's root
  // task forks its children before any of them restores files) ----
  for (Task& t : tasks)
    if (::pipe2(t.report, O_CLOEXEC) != 0 || ::pipe2(t.go, O_CLOEXEC) != 0)
      return Fail("pipe: %s", std::strerror(errno));
  std::fflush(stdout);
  pid_t root = ::fork();
  if (root < 0) return Fail("fork: %s", std::strerror(errno));
  if (root == 0) {
    for (size_t i = 1; i < tasks.size(); ++i)
      if (::fork() == 0) ::_exit(TaskMain(tasks[i], expected));
    int worst = TaskMain(tasks[0], expected);
    int status = 0;
    while (::wait(&status) > 0) {  // bounded: the children's alarms
      if (g_kill_index > 0 && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) continue;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) worst = worst ? worst : 1;
    }
    ::_exit(worst);
  }

  auto post_forking = Hook<gpulazy_void_hook_t>(GPULAZY_HOOK_POST_FORKING);
  auto resume = Hook<gpulazy_pid_hook_t>(GPULAZY_HOOK_RESUME_DEVICES_LATE);
  bool continued = false;
  auto continue_server = [&] {
    if (stop_pid <= 0 || continued) return;
    ::kill(stop_pid, SIGCONT);
    continued = true;
    Say("server continued");
  };
  // Tell every task to stop (failure) or check, then tear down like CRIU.
  auto finish = [&](int ret, const std::string& why) {
    continue_server();
    char quit = 'q';
    for (Task& t : tasks)
      (void)WriteAll(t.go[1], &quit, 1);
    g_desc->exit(GPULAZY_CRIU_STAGE_RESTORE, ret);
    int status = 0;
    (void)::waitpid(root, &status, 0);
    return Fail("%s", why.c_str());
  };

  auto collect = [&]() -> int {
    for (Task& t : tasks) {
      Report r;
      if (!ReadAll(t.report[0], &r, sizeof(r), kReportTimeoutMs))
        return finish(-ETIMEDOUT, "a task never reported");
      t.pid = r.pid;
      Say("task %d: RESTORE_EXT_FILE(%d) = %d", r.pid, t.file_id, r.rc);
      if (r.rc < 0)
        return finish(r.rc, "task " + std::to_string(r.pid) +
                                " failed its restore hooks: " + std::to_string(r.rc));
    }
    return 0;
  };
  if (g_order == Order::kTasksFirst && collect() != 0) return 1;
  rc = post_forking();
  Say("POST_FORKING = %d", rc);
  if (rc != 0) return finish(rc, "POST_FORKING = " + std::to_string(rc));
  if (stop_pid > 0) {
    ::kill(stop_pid, SIGSTOP);
    Say("server stopped");
  }
  if (g_order == Order::kCriu) {
    char stage = 's';
    for (Task& t : tasks)
      (void)WriteAll(t.go[1], &stage, 1);
  }
  if (g_order != Order::kTasksFirst && collect() != 0) return 1;

  if (std::string changed = HandlersChanged(); !changed.empty())
    return finish(-EPERM, "the plugin changed the host's handlers of" + changed);
  if (std::string bad = ThreadsTakingSignals(); !bad.empty())
    return finish(-EPERM, "plugin threads not blocking SIGTERM/SIGINT/SIGCHLD:" + bad);
  Say("signals: host handlers untouched; plugin threads block them");

  const char* mode = std::getenv("GPULAZY_MODE");
  const bool lazy = mode != nullptr && std::strcmp(mode, "lazy") == 0;
  if (g_fault_check && !lazy) return finish(-EINVAL, "--fault-check needs GPULAZY_MODE=lazy");

  pid_t victim = -1;
  // SIGKILLs the --kill task and waits until it is dead; "" or why it could not.
  auto kill_victim = [&]() -> std::string {
    Task& v = tasks[static_cast<size_t>(g_kill_index)];
    int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, v.pid, 0));
    if (pidfd < 0) return "pidfd_open of the task to kill";
    ::kill(v.pid, SIGKILL);
    pollfd p{pidfd, POLLIN, 0};
    const bool dead = ::poll(&p, 1, kReportTimeoutMs) == 1;
    ::close(pidfd);
    if (!dead) return "the killed task did not die";
    victim = v.pid;
    Say("task %d: killed", victim);
    return "";
  };
  if (g_kill_index > 0 && !kill_after_resume) {
    // Killed while the master still streams (the server is stopped).
    if (std::string why = kill_victim(); !why.empty()) return finish(-EPROTO, why);
    if (abort_on_death) {
      // CRIU's SIGCHLD handler aborts the restore: no RESUME_DEVICES_LATE, exit with an error.
      const auto start = std::chrono::steady_clock::now();
      g_desc->exit(GPULAZY_CRIU_STAGE_RESTORE, -1);
      const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                          std::chrono::steady_clock::now() - start)
                          .count();
      Say("exit(RESTORE, -1) returned after %lld ms", static_cast<long long>(ms));
      continue_server();
      char quit = 'q';
      for (Task& t : tasks)
        (void)WriteAll(t.go[1], &quit, 1);
      int status = 0;
      (void)::waitpid(root, &status, 0);
      if (std::string changed = HandlersChanged(); !changed.empty())
        return Fail("exit changed the host's handlers of%s", changed.c_str());
      Say("sim: ok");
      return 0;
    }
    rc = resume(victim);
    Say("RESUME_DEVICES_LATE(%d) = %d (killed task)", victim, rc);
    if (rc == 0 || rc == -ENOTSUP)
      return finish(-EPROTO, "RESUME_DEVICES_LATE of a dead task = " + std::to_string(rc));
  }
  // Lazy resumes without the stream (no hot set here); the fault check and a death after
  // resume need it stopped.
  if (!(lazy && (g_fault_check || kill_after_resume))) continue_server();

  char check = 'c';
  for (Task& t : tasks) {
    if (t.pid == victim) continue;
    rc = resume(t.pid);
    Say("RESUME_DEVICES_LATE(%d) = %d", t.pid, rc);
    const int want = t.file_id > 0 ? 0 : -ENOTSUP;
    if (rc != want)
      return finish(rc,
                    "RESUME_DEVICES_LATE(" + std::to_string(t.pid) + ") = " + std::to_string(rc));
    // Eager and parallel promise a task's contents by its resume; lazy only by exit.
    if (!lazy) (void)WriteAll(t.go[1], &check, 1);
  }
  if (g_kill_index > 0 && kill_after_resume) {
    // The program exits while its BOs still stream (lazy): its own business, no failure.
    if (std::string why = kill_victim(); !why.empty()) return finish(-EPROTO, why);
  }
  if (g_fault_check) {
    for (Task& t : tasks) {
      if (t.pid == victim || t.file_id == 0) continue;
      char step = stop_pid > 0 && !continued ? 'E' : 'e';
      (void)WriteAll(t.go[1], &step, 1);
      char ensuring = 0;
      if (!ReadAll(t.report[0], &ensuring, 1, kReportTimeoutMs) || ensuring != 'e')
        return finish(-EPROTO, "task " + std::to_string(t.pid) + " did not reach its ensure");
      continue_server();
      char verdict = 0;
      if (!ReadAll(t.report[0], &verdict, 1, kReportTimeoutMs) || verdict != 1)
        return finish(-EPROTO, "task " + std::to_string(t.pid) + " failed the fault check");
    }
  }
  continue_server();
  g_desc->exit(GPULAZY_CRIU_STAGE_RESTORE, 0);
  Say("exit(RESTORE, 0)");
  if (std::string changed = HandlersChanged(); !changed.empty())
    return finish(-EPERM, "exit changed the host's handlers of" + changed);
  if (lazy)
    for (Task& t : tasks)
      if (t.pid != victim) (void)WriteAll(t.go[1], &check, 1);

  std::string bad;
  for (Task& t : tasks) {
    if (t.pid == victim) continue;
    char verdict = 0;
    if (!ReadAll(t.report[0], &verdict, 1, kReportTimeoutMs) || verdict != 1)
      bad += " " + std::to_string(t.pid);
  }
  int status = 0;
  (void)::waitpid(root, &status, 0);
  if (!bad.empty()) return Fail("contents wrong in task(s)%s", bad.c_str());
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return Fail("a task exited badly");
  std::string claimed;
  for (const std::string& c : g_claimed)
    claimed += " " + c;
  Say("claimed:%s", claimed.c_str());
  Say("sim: ok");
  return 0;
}
