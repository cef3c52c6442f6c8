// FaultChannel: the coordinator's end of the fault channel (fault/gpulazy_fault.h). Listens on
// a Unix socket; each connection gets a thread that answers ensure(va, len) requests by calling
// the resolver with the caller's pid (SO_PEERCRED) and replying once it returns.
// Thread-safety: Start/Stop from one thread.
#pragma once

#include <atomic>
#include <filesystem>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "lazy-server/image/io.h"
#include "proto/status.h"

namespace gpulazy::plugin {

class FaultChannel {
 public:
  using Resolver = std::function<Status(uint32_t pid, uint64_t va, uint64_t len)>;
  FaultChannel(std::filesystem::path path, Resolver resolver);
  ~FaultChannel();
  Status Start();
  void Stop();
  const std::filesystem::path& path() const { return path_; }

 private:
  void AcceptLoop();
  void Serve(int fd);

  std::filesystem::path path_;
  Resolver resolver_;
  UniqueFd listener_;
  UniqueFd wake_;  // eventfd that ends the accept loop
  std::thread acceptor_;
  std::mutex mutex_;
  std::vector<int> clients_;  // owned by their threads; shut down by Stop
  std::vector<std::thread> threads_;
  std::atomic<bool> stopping_{false};
};

}  // namespace gpulazy::plugin
