#include "plugin/coordinator.h"

#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "lazy-server/server/server.h"
#include "plugin/criu_host.h"
#include "plugin/handoff.h"

namespace gpulazy::plugin {
namespace fs = std::filesystem;
namespace {

// Threads started while this lives inherit a mask that blocks every asynchronous signal, so
// process-directed signals (SIGCHLD of a restored task, SIGTERM) reach CRIU's own thread and
// its handlers run where CRIU expects them. Synchronous signals stay deliverable.
class BlockSignalsForNewThreads {
 public:
  BlockSignalsForNewThreads() {
    sigset_t all;
    ::sigfillset(&all);
    for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGTRAP, SIGABRT, SIGSYS})
      ::sigdelset(&all, sig);
    ::pthread_sigmask(SIG_BLOCK, &all, &saved_);
  }
  ~BlockSignalsForNewThreads() { ::pthread_sigmask(SIG_SETMASK, &saved_, nullptr); }
  BlockSignalsForNewThreads(const BlockSignalsForNewThreads&) = delete;
  BlockSignalsForNewThreads& operator=(const BlockSignalsForNewThreads&) = delete;

 private:
  sigset_t saved_{};
};

}  // namespace

RestoreCoordinator::RestoreCoordinator(PluginConfig config, fs::path image_dir, UniqueFd handoff,
                                       KfdProvider& kfd, EngineFactory engines)
    : config_(std::move(config)),
      image_dir_(std::move(image_dir)),
      handoff_(std::move(handoff)),
      kfd_(kfd),
      make_engine_(std::move(engines)) {}

RestoreCoordinator::~RestoreCoordinator() {
  (void)Finish(false);
}

Status RestoreCoordinator::StartServer() {
  // No server given: serve the local image directory from this process.
  char tmpl[] = "/tmp/gpulazy-plugin-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return ErrnoError(errno, "mkdtemp");
  server_dir_ = tmpl;
  server::ServerConfig sc;
  sc.image_roots = {image_dir_.parent_path()};
  GPULAZY_ASSIGN_OR_RETURN(net::Endpoint ep,
                           net::Endpoint::Parse("unix:" + (server_dir_ / "s").string()));
  sc.listen = {ep};
  sc.io_threads = 1;
  // A fault's demand chunk must not queue behind the bulk writes on that one network thread;
  // one restore has one demand connection, which one loop serves whatever the CPUs.
  sc.demand_io_threads = 1;
  sc.disk_threads = 2;
  // The restored program runs beside this server: its bulk reads yield the CPU to it.
  sc.background_nice = config_.background_nice;
  sc.server_name = "gpulazy-plugin";
  sc.handle_signals = false;  // CRIU's SIGTERM/SIGINT handlers are not ours to replace
  server_ = std::make_unique<server::Server>(sc);
  GPULAZY_RETURN_IF_ERROR(server_->Listen().Context("in-process page server"));
  server_thread_ = std::thread([this] {
    // Nothing may escape a thread of CRIU's master: that would end the restore of every task.
    try {
      (void)server_->Run();
    } catch (const std::exception& e) {
      spdlog::error("gpulazy: in-process page server stopped: {}", e.what());
    }
  });
  config_.server = ep.ToString();
  if (config_.image.empty()) config_.image = image_dir_.filename().string();
  spdlog::info("gpulazy: serving {} in-process on {}", image_dir_.string(), config_.server);
  return Status::Ok();
}

Status RestoreCoordinator::Start() {
  BlockSignalsForNewThreads block;  // the server's, the session's, ours
  int wake = ::eventfd(0, EFD_CLOEXEC);
  if (wake < 0) return ErrnoError(errno, "eventfd");
  wake_.reset(wake);
  // The receiver starts only once the session (and session_index_) is set up: tasks may hand
  // their BOs over before or while POST_FORKING runs, and their records wait in the socket.
  if (config_.mode == Mode::kEager) {  // tasks copy their own contents
    receiver_ = std::thread([this] { ReceiveLoopCatching(); });
    return Status::Ok();
  }

  if (config_.server.empty()) GPULAZY_RETURN_IF_ERROR(StartServer());
  if (config_.image.empty()) config_.image = image_dir_.filename().string();
  GPULAZY_RETURN_IF_ERROR(CheckServerTransport(config_).Context(
      fmt::format("{} restore: page server {}", ModeName(config_.mode), config_.server)));
  client::SessionOptions options;
  options.endpoint = config_.server;
  options.image = config_.image;
  options.token = config_.token;
  options.tls = config_.tls;
  options.insecure_tcp = config_.insecure_tcp;
  options.window_bytes = config_.window_bytes;
  options.background_nice = config_.background_nice;
  options.lanes = config_.lanes;
  options.client_name = "gpulazy-plugin";
  session_ = std::make_unique<client::RestoreSession>(options, router_);
  Status started = session_->Start();
  if (!started.ok())
    return started.Context(fmt::format("{} restore: page server {} image {}",
                                       ModeName(config_.mode), config_.server, config_.image));
  const auto& bos = session_->bos();
  for (uint32_t i = 0; i < bos.size(); ++i)
    session_index_[{bos[i].process_id, bos[i].bo_index}] = i;
  spdlog::info(
      "gpulazy: {} restore of {} ({} BOs) from {}; asks for {} bulk connections where "
      "chunks cross the socket",
      ModeName(config_.mode), config_.image, bos.size(), config_.server,
      client::LanesFor(options.lanes));
  if (config_.mode == Mode::kLazy) {
    fs::path path = config_.fault_socket;
    if (path.empty()) path = fs::path("/tmp") / fmt::format("gpulazy-fault-{}.sock", ::getpid());
    faults_ = std::make_unique<FaultChannel>(
        path, [this](uint32_t pid, uint64_t va, uint64_t len) { return Ensure(pid, va, len); });
    GPULAZY_RETURN_IF_ERROR(faults_->Start());
  }
  receiver_ = std::thread([this] { ReceiveLoopCatching(); });
  return Status::Ok();
}

void RestoreCoordinator::ReceiveLoopCatching() {
  // An exception (no memory, no thread for an engine's reaper) must not escape into CRIU's
  // master: it fails the restore of the tasks not resumed yet, as a handoff error does.
  try {
    ReceiveLoop();
  } catch (const std::exception& e) {
    spdlog::error("gpulazy: handoff receiver stopped: {}", e.what());
    std::lock_guard lock(mutex_);
    if (handoff_error_.ok()) handoff_error_ = Internal("handoff receiver stopped: {}", e.what());
  }
}

void RestoreCoordinator::ReceiveLoop() {
  bool handoff_open = true;
  for (;;) {
    // The handoff socket, the stop signal, and the pidfd of every task still alive.
    std::vector<pollfd> fds = {{wake_.get(), POLLIN, 0},
                               {handoff_open ? handoff_.get() : -1, POLLIN, 0}};
    std::vector<uint32_t> watched;
    {
      std::lock_guard lock(mutex_);
      for (const auto& [pid, task] : tasks_) {
        if (task.dead || !task.pidfd.valid()) continue;
        fds.push_back({task.pidfd.get(), POLLIN, 0});
        watched.push_back(pid);
      }
    }
    if (::poll(fds.data(), fds.size(), -1) < 0) {
      if (errno == EINTR) continue;
      spdlog::error("gpulazy: handoff receiver: poll: {}", std::strerror(errno));
      return;
    }
    if (fds[0].revents != 0) return;
    if (fds[1].revents != 0) {
      std::lock_guard lock(receive_mutex_);
      Result<HandoffRecord> record = ReceiveHandoff(handoff_.get(), true);
      if (record.ok()) {
        Status absorbed = Absorb(std::move(*record));
        if (!absorbed.ok()) {
          spdlog::error("gpulazy: {}", absorbed.ToString());
          std::lock_guard l(mutex_);
          if (handoff_error_.ok()) handoff_error_ = absorbed;
        }
      } else if (record.status().code() != Code::kTimeout) {
        std::lock_guard l(mutex_);
        if (handoff_error_.ok()) handoff_error_ = record.status();
        // EOF: every task's end is closed. Keep watching the tasks that handed over.
        if (record.status().code() == Code::kUnavailable) handoff_open = false;
      }
    }
    for (size_t i = 0; i < watched.size(); ++i)
      if (fds[i + 2].revents != 0) OnTaskDied(watched[i]);
  }
}

Status RestoreCoordinator::Absorb(HandoffRecord record) {
  // The kernel's view of the sender is the pid CRIU's master passes to RESUME_DEVICES_LATE.
  if (record.sender_pid != 0) record.pid = record.sender_pid;
  bool dead = false;
  {
    std::lock_guard lock(mutex_);
    Task& task = tasks_[record.pid];
    task.file_id = record.file_id;
    if (record.last) task.complete = true;
    if (record.pidfd.valid()) task.pidfd = std::move(record.pidfd);
    dead = task.dead;
  }
  // Records of a task already seen dead: Router::Bind closes the dmabufs of dropped BOs.
  if (dead) spdlog::debug("gpulazy: record of pid {} arrived after its death", record.pid);
  for (HandedBo& bo : record.bos) {
    if (!session_) continue;  // eager: the task copied it; the fd just closes
    auto it = session_index_.find({record.file_id, bo.bo_index});
    if (it == session_index_.end())
      return Corrupt("task {} (amdgpu-kfd-{}.img) handed over BO {} the image does not serve",
                     record.pid, record.file_id, bo.bo_index);
    DeviceEngine* engine;
    {
      std::lock_guard lock(mutex_);
      auto& slot = engines_[bo.local_gpu_id];
      if (!slot) {
        BlockSignalsForNewThreads block;  // an SDMA engine starts its reaper thread
        auto made = make_engine_(bo.local_gpu_id);
        if (!made.ok())
          return made.status().Context(fmt::format("engine for gpu {:#x}", bo.local_gpu_id));
        slot = std::move(*made);
      }
      engine = slot.get();
      tasks_[record.pid].bos.push_back(it->second);
    }
    GPULAZY_RETURN_IF_ERROR(router_.Bind(it->second, engine, std::move(bo.dmabuf), bo.size)
                                .Context(fmt::format("task {} BO {}", record.pid, bo.bo_index)));
  }
  return Status::Ok();
}

Status RestoreCoordinator::DrainPending() {
  // A task's records were sent before its RESTORE_EXT_FILE returned, so by RESUME_DEVICES_LATE
  // they sit in the socket: read what is there now instead of racing the receiver thread.
  std::lock_guard lock(receive_mutex_);
  for (;;) {
    Result<HandoffRecord> record = ReceiveHandoff(handoff_.get(), true);
    if (!record.ok()) {
      if (record.status().code() == Code::kTimeout || record.status().code() == Code::kUnavailable)
        return Status::Ok();
      return record.status();
    }
    Status absorbed = Absorb(std::move(*record));
    if (!absorbed.ok()) {
      // Recorded as the receiver thread does: the record may be another task's than the one
      // resuming, and its BOs after the failure were never bound.
      std::lock_guard l(mutex_);
      if (handoff_error_.ok()) handoff_error_ = absorbed;
      return absorbed;
    }
  }
}

bool RestoreCoordinator::Died(uint32_t pid) {
  {
    std::lock_guard lock(mutex_);
    auto it = tasks_.find(pid);
    if (it == tasks_.end()) return false;
    if (it->second.dead) return true;
    if (!it->second.pidfd.valid()) return false;
    pollfd p{it->second.pidfd.get(), POLLIN, 0};
    if (::poll(&p, 1, 0) <= 0) return false;
  }
  OnTaskDied(pid);  // the receiver thread may not have seen it yet
  return true;
}

void RestoreCoordinator::OnTaskDied(uint32_t pid) {
  uint32_t file_id = 0;
  bool resumed = false;
  {
    std::lock_guard lock(mutex_);
    auto it = tasks_.find(pid);
    if (it == tasks_.end() || it->second.dead) return;
    it->second.dead = true;
    it->second.pidfd.reset();
    file_id = it->second.file_id;
    resumed = it->second.resumed;
  }
  if (!session_) {  // eager: its contents were copied by the task itself
    if (!resumed) spdlog::error("gpulazy: {}", DeathError(pid, file_id).message());
    return;
  }
  // Every BO of its image, handed over or not: chunks of BOs it never handed over would
  // otherwise stay parked forever and hold the credit window shut for the other tasks.
  std::vector<uint32_t> bos;
  for (const auto& [key, index] : session_index_)
    if (key.first == file_id) bos.push_back(index);
  uint64_t total = 0;
  uint64_t resident = 0;
  const uint64_t chunk = std::max<uint64_t>(session_->chunk_size(), 1);
  for (uint32_t bo : bos) {
    const uint64_t size = session_->bos()[bo].size;
    total += size;
    for (uint64_t off = 0; off < size; off += chunk) {
      const uint64_t len = std::min(chunk, size - off);
      if (session_->IsResident(bo, off, len)) resident += len;
    }
  }
  const size_t discarded = router_.Drop(bos);
  // The server skips what is not on its way yet; copies already sent are dropped on arrival.
  Status abandoned = session_->Abandon(bos);
  if (!abandoned.ok())
    spdlog::warn("gpulazy: pid {}: its BOs stay in the stream: {}", pid, abandoned.message());
  if (resumed) {
    spdlog::info(
        "gpulazy: pid {} (amdgpu-kfd-{}.img) exited; {} of its {} bytes were resident, the rest "
        "is no longer fetched",
        pid, file_id, resident, total);
  } else {
    spdlog::error(
        "gpulazy: {}: {} of its {} bytes were resident; its {} BOs are no longer fetched ({} "
        "parked chunks discarded)",
        DeathError(pid, file_id).message(), resident, total, bos.size(), discarded);
  }
}

Status RestoreCoordinator::DeathError(uint32_t pid, uint32_t file_id) const {
  return Aborted("pid {} (amdgpu-kfd-{}.img) died during restore", pid, file_id);
}

Status RestoreCoordinator::ResumeTask(uint32_t pid) {
  GPULAZY_RETURN_IF_ERROR(DrainPending());
  uint32_t file_id = 0;
  bool complete = false;
  std::vector<uint32_t> task_bos;
  {
    std::lock_guard lock(mutex_);
    if (!handoff_error_.ok()) return handoff_error_;
    auto it = tasks_.find(pid);
    if (it == tasks_.end()) return NotFound("pid {} handed over no KFD state", pid);
    file_id = it->second.file_id;
    complete = it->second.complete;
    task_bos = it->second.bos;
  }
  if (Died(pid)) return DeathError(pid, file_id);
  if (!complete)
    return Aborted("pid {} (amdgpu-kfd-{}.img) did not finish handing over its BOs", pid, file_id);
  if (session_) {
    auto timeout = config_.resume_timeout;
    if (config_.mode == Mode::kParallel) {
      // Ensure() asks for what is missing at demand priority: this task's BOs jump the queue.
      // Should the task die meanwhile, its BOs are dropped, count as resident, and this ends.
      for (uint32_t bo : task_bos) {
        Status s = session_->Ensure(bo, 0, session_->bos()[bo].size, timeout);
        if (!s.ok()) return s.Context(fmt::format("pid {}: waiting for BO {}", pid, bo));
      }
    } else {
      Status s = session_->WaitHotSet(timeout);
      if (!s.ok())
        return s.Context(
            fmt::format("pid {}: lazy restore refuses to resume without the hot set", pid));
    }
  }
  if (Died(pid)) return DeathError(pid, file_id);
  if (!master_kfd_) {
    Result<std::unique_ptr<Kfd>> opened = kfd_.Open();
    if (!opened.ok())
      return OursFailed(opened.status().Context("RESUME of pid " + std::to_string(pid)));
    master_kfd_ = std::move(*opened);
  }
  kfd_ioctl_criu_args args{};
  args.op = KFD_CRIU_OP_RESUME;
  args.pid = pid;
  int rc = master_kfd_->CriuOp(args);
  if (rc != 0) return ErrnoError(-rc, "KFD CRIU_OP RESUME for pid {}", pid);
  {
    std::lock_guard lock(mutex_);
    tasks_[pid].resumed = true;
  }
  spdlog::info("gpulazy: pid {} resumed ({} mode)", pid, ModeName(config_.mode));
  return Status::Ok();
}

Status RestoreCoordinator::Ensure(uint32_t pid, uint64_t va, uint64_t len) {
  if (len == 0 || va + len < va)
    return InvalidArgument("pid {}: ensure of [{:#x}, +{}) is not a range", pid, va, len);
  std::vector<uint32_t> bos;
  {
    std::lock_guard lock(mutex_);
    auto it = tasks_.find(pid);
    if (it == tasks_.end()) return NotFound("pid {} has no GPU state here", pid);
    bos = it->second.bos;
  }
  // Bytes of the range outside every BO are not ours to provide; a range with none inside a
  // BO is a caller's mistake worth an error.
  uint64_t covered = 0;
  for (uint32_t bo : bos) {
    const client::BoEntry& e = session_->bos()[bo];
    uint64_t begin = std::max(va, e.gpu_va);
    uint64_t end = std::min(va + len, e.gpu_va + e.size);
    if (begin >= end) continue;
    if (!session_->IsResident(bo, begin - e.gpu_va, end - begin))
      spdlog::info("gpulazy: fault channel: pid {} waits for [{:#x}, +{}) of BO {}", pid, begin,
                   end - begin, bo);
    GPULAZY_RETURN_IF_ERROR(
        session_->Ensure(bo, begin - e.gpu_va, end - begin, config_.resume_timeout));
    covered += end - begin;
  }
  if (covered == 0) return NotFound("pid {}: no BO at [{:#x}, +{})", pid, va, len);
  return Status::Ok();
}

Status RestoreCoordinator::Finish(bool success) {
  if (finished_) return Status::Ok();
  finished_ = true;
  Status result;
  if (success && session_) {
    // A task that is gone by now needs none of its chunks: do not wait for them (the receiver
    // may not have seen its pidfd yet).
    std::vector<uint32_t> pids;
    {
      std::lock_guard lock(mutex_);
      for (const auto& [pid, task] : tasks_)
        pids.push_back(pid);
    }
    for (uint32_t pid : pids)
      (void)Died(pid);
    // A hand-over that failed left BOs unbound, whose chunks stay parked: the restore can never
    // complete, so the wait ends at such an error, one that came before it or during it.
    constexpr auto kHandoffCheck = std::chrono::milliseconds(200);
    for (;;) {
      {
        std::lock_guard lock(mutex_);
        if (!handoff_error_.ok()) {
          result = handoff_error_;
          break;
        }
      }
      result = session_->WaitComplete(kHandoffCheck);
      if (result.code() != Code::kTimeout) break;
      // A session that failed as the slice ended (or with a time-out of its own, which it
      // answers at once): its failure, not the slice's.
      if (Status failed = session_->status(); !failed.ok()) {
        result = failed;
        break;
      }
    }
    if (result.ok()) result = router_.Flush();
    if (result.ok()) {
      const client::Progress p = session_->progress();
      spdlog::info(
          "gpulazy: restore of {} done: {} of {} bytes resident, {} received ({} of them "
          "duplicates), {} of exited tasks not fetched",
          config_.image, p.resident_bytes, p.total_bytes, p.received_bytes, p.duplicate_bytes,
          p.abandoned_bytes);
    }
    Status handoff;
    {
      std::lock_guard lock(mutex_);
      handoff = handoff_error_;
    }
    if (result.ok() && !handoff.ok()) result = handoff;
  }
  // Cancelled before the fault channel stops: its connection threads may wait in Ensure (up to
  // the resume timeout) for chunks that now never come, and Stop joins them.
  if (session_) session_->Cancel();
  if (faults_) faults_->Stop();
  // The receiver uses the session (Absorb binds BOs, a task's death drops them): it ends
  // first. It never waits for the session, so this join is prompt.
  if (wake_.valid()) {
    uint64_t one = 1;
    (void)!::write(wake_.get(), &one, sizeof(one));
  }
  if (receiver_.joinable()) receiver_.join();
  router_.FailParked(Aborted("restore abandoned"));
  session_.reset();  // joins the session's I/O thread and flushes the router
  {
    std::lock_guard lock(mutex_);
    engines_.clear();
  }
  if (server_) {
    server_->Stop();
    if (server_thread_.joinable()) server_thread_.join();
    server_.reset();
    std::error_code ec;
    fs::remove_all(server_dir_, ec);
  }
  return result;
}

}  // namespace gpulazy::plugin
