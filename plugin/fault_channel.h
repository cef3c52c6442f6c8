// FaultChannel: the coordinator's end of the fault channel (fault/gpulazy_fault.h). Listens on
// a Unix socket; each connection gets a thread that answers ensure(va, len) requests by calling
// the resolver with the caller's pid (SO_PEERCRED) and replying once it returns.
//
// It runs in CRIU's master while the restored programs run, so nothing they do may take the
// master down: at most max_connections are served at once (the next is closed at once), a
// connection's thread is joined soon after it ends, a thread that cannot be made costs only
// that connection, and accept errors (EMFILE...) back off instead of spinning.
// Thread-safety: Start/Stop from one thread.
#pragma once

#include <atomic>
#include <filesystem>
#include <functional>
#include <list>
#include <mutex>
#include <thread>
#include <vector>

#include "lazy-server/image/io.h"
#include "proto/status.h"

namespace gpulazy::plugin {

class FaultChannel {
 public:
  using Resolver = std::function<Status(uint32_t pid, uint64_t va, uint64_t len)>;
  static constexpr size_t kDefaultMaxConnections = 1024;
  FaultChannel(std::filesystem::path path, Resolver resolver,
               size_t max_connections = kDefaultMaxConnections);
  ~FaultChannel();
  Status Start();
  void Stop();
  const std::filesystem::path& path() const { return path_; }
  // Connection threads not joined yet (serving, or ended since the last accept).
  size_t threads() const;
  uint64_t refused() const { return refused_.load(); }  // closed at once: over the limit

 private:
  struct Client {
    int fd = -1;  // owned by its thread; shut down by Stop
    std::thread thread;
    bool done = false;
  };
  void AcceptLoop();
  void Serve(int fd);                  // answers requests until the peer hangs up
  void ServeCatching(Client* client);  // a connection thread's body: Serve, then the close
  void ReapLocked();

  std::filesystem::path path_;
  Resolver resolver_;
  UniqueFd listener_;
  UniqueFd wake_;  // eventfd that ends the accept loop
  std::thread acceptor_;
  size_t max_connections_;
  mutable std::mutex mutex_;
  std::list<Client> clients_;  // a list: Serve holds a pointer to its entry
  std::atomic<uint64_t> refused_{0};
  std::atomic<bool> stopping_{false};
};

}  // namespace gpulazy::plugin
