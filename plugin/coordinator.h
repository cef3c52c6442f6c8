// RestoreCoordinator: the master's side of a restore (design.md 3). Started at POST_FORKING:
// receives the BO tables and dmabuf fds the restored tasks hand over, streams the image from
// gpulazy-server (or from an in-process server over the local image directory) into one
// DeviceEngine per GPU, answers the fault channel, and at RESUME_DEVICES_LATE waits per mode
// (parallel: all of the task's BOs, pre-empting the stream; lazy: the hot set) before
// CRIU_OP RESUME. Finish() (plugin exit) waits for completion on success, cancels otherwise,
// and joins every thread.
//
// A task that dies (its pidfd, handed over with its BOs, becomes readable): the coordinator
// abandons every BO of its KFD image (RestoreSession::Abandon: the server skips their chunks;
// parked and later-arriving ones are discarded, the dmabufs released), so the other tasks'
// contents and the session complete without fetching the dead task's. Before its
// resume that is a failed restore of that task: RESUME_DEVICES_LATE for it answers kAborted
// naming it (upstream CRIU aborts the whole restore on a task's SIGCHLD anyway and then calls
// exit with an error, which must not hang). After its resume (lazy mode) it is the program's
// own exit: its remaining BOs are dropped and nothing fails.
// Thread-safety: Start, ResumeTask and Finish from CRIU's master thread; internal threads
// (receiver, session I/O, engines, fault channel) are joined by Finish.
#pragma once

#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>

#include "page-client/restore_session.h"
#include "plugin/config.h"
#include "plugin/device_engine.h"
#include "plugin/fault_channel.h"
#include "plugin/handoff.h"
#include "plugin/kfd.h"
#include "plugin/router.h"

namespace gpulazy::server {
class Server;
}

namespace gpulazy::plugin {

class RestoreCoordinator {
 public:
  RestoreCoordinator(PluginConfig config, std::filesystem::path image_dir, UniqueFd handoff,
                     KfdProvider& kfd, EngineFactory engines);
  ~RestoreCoordinator();

  Status Start();
  // kNotFound when `pid` handed over no KFD state (the hook then answers -ENOTSUP).
  Status ResumeTask(uint32_t pid);
  Status Finish(bool success);

 private:
  struct Task {
    uint32_t file_id = 0;
    bool complete = false;
    bool resumed = false;
    bool dead = false;
    std::vector<uint32_t> bos;  // session BO indices
    UniqueFd pidfd;             // readable once the task has exited
  };
  Status StartServer();
  void ReceiveLoop();
  void ReceiveLoopCatching();  // the receiver thread's body: ReceiveLoop, exceptions caught
  Status Absorb(HandoffRecord record);  // caller holds receive_mutex_
  Status DrainPending();
  Status Ensure(uint32_t pid, uint64_t va, uint64_t len);
  // True when `pid` has died (noticed now or earlier); drops its BOs the first time.
  bool Died(uint32_t pid);
  void OnTaskDied(uint32_t pid);
  Status DeathError(uint32_t pid, uint32_t file_id) const;
  PluginConfig config_;
  std::filesystem::path image_dir_;
  UniqueFd handoff_;
  UniqueFd wake_;
  KfdProvider& kfd_;
  EngineFactory make_engine_;

  std::unique_ptr<server::Server> server_;
  std::thread server_thread_;
  std::filesystem::path server_dir_;

  Router router_{false};
  std::unique_ptr<client::RestoreSession> session_;
  std::map<std::pair<uint32_t, uint32_t>, uint32_t> session_index_;  // (file id, bo_index)

  std::mutex receive_mutex_;  // one reader of the handoff socket at a time
  std::mutex mutex_;          // tasks_, engines_, handoff_error_
  std::map<uint32_t, Task> tasks_;
  std::map<uint32_t, std::unique_ptr<DeviceEngine>> engines_;  // by local gpu id
  Status handoff_error_;
  std::thread receiver_;
  std::unique_ptr<Kfd> master_kfd_;
  std::unique_ptr<FaultChannel> faults_;
  bool finished_ = false;
};

}  // namespace gpulazy::plugin
