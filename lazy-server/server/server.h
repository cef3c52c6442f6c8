// Server: the gpulazy-server process: listeners (Unix and TCP), the network threads, signal
// handling and graceful shutdown. Connections and sessions live in session.h; scheduling in
// scheduler.h and dispatcher.h.
//
// Shutdown (SIGTERM, SIGINT or Stop(); the signals only with config.handle_signals): stop
// accepting, remove Unix socket files, tell every connection to finish the write in flight,
// send ERROR_SHUTTING_DOWN and close (each within --shutdown-grace); Run() returns 0 once all
// are closed.
//
// Thread-safety: Listen and Run from one thread; Stop from any thread.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "lazy-server/server/config.h"
#include "lazy-server/server/context.h"
#include "page-client/net/asio.h"
#include "page-client/net/endpoint.h"

namespace gpulazy::server {

class Server {
 public:
  explicit Server(const ServerConfig& config);
  // With a placement backend of the embedder's own making instead of config.placement's.
  Server(const ServerConfig& config, std::unique_ptr<PlacementBackend> placement);
  ~Server();

  // Loads the TLS certificate and key (when configured), binds every --listen endpoint, then
  // writes --ready-file and logs "listening on ...".
  Status Listen();
  // The endpoints actually bound (a tcp port 0 replaced by the real port).
  const std::vector<net::Endpoint>& bound() const { return bound_; }
  // Serves until shutdown; returns the process exit code.
  int Run();
  void Stop();

 private:
  using Acceptor = boost::asio::basic_socket_acceptor<boost::asio::generic::stream_protocol>;
  struct Listener {
    std::unique_ptr<Acceptor> acceptor;
    net::Endpoint endpoint;                // as bound
    std::shared_ptr<net::TlsContext> tls;  // set: connections speak TLS
  };
  Result<Listener> Bind(const net::Endpoint& endpoint);
  boost::asio::awaitable<void> AcceptLoop(Listener& listener);
  boost::asio::awaitable<void> StatsLoop();
  void BeginShutdown(std::string_view why);
  Status WriteReadyFile() const;
  // SIGHUP (with config.handle_signals): reads the TLS certificate, key and client CA files, the
  // token file and the image-access file again and puts them in place for connections accepted
  // from then on; open connections keep what they were accepted with. All or nothing: when a
  // file fails to load, the error names it and the credentials and rules in place stay. On the
  // strand.
  Status ReloadCredentials();
  void AwaitReloadSignal();

  // First member, so destroyed last: handlers still queued in io_ when it is destroyed may
  // hold connections, which refer to the context.
  std::unique_ptr<ServerContext> ctx_;
  boost::asio::io_context io_;
  // --demand-network-threads, one loop and one thread each: plain demand connections move to
  // one after their Hello (Connection::MoveToDemandThreads). After io_, so destroyed before it.
  std::vector<std::unique_ptr<boost::asio::io_context>> demand_ios_;
  // Listeners, signals and the stats timer are touched only on this strand.
  boost::asio::strand<boost::asio::io_context::executor_type> strand_;
  std::vector<Listener> listeners_;
  std::vector<net::Endpoint> bound_;
  std::shared_ptr<net::TlsContext> tls_;  // loaded by Listen when --tls-cert is set
  std::vector<std::string> unix_paths_;   // removed at shutdown
  // Only with config.handle_signals: even an empty signal_set registers Asio's process-wide
  // signal state.
  std::optional<boost::asio::signal_set> signals_;
  std::optional<boost::asio::signal_set> reload_signals_;  // SIGHUP
  boost::asio::steady_timer stats_timer_;
};

}  // namespace gpulazy::server
