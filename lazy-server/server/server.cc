#include "lazy-server/server/server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <openssl/crypto.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <system_error>

#include "lazy-server/image/io.h"
#include "lazy-server/server/access.h"
#include "lazy-server/server/session.h"
#include "lazy-server/server/warm.h"
#include "page-client/net/threads.h"
#include "proto/checksum.h"

namespace gpulazy::server {
namespace asio = boost::asio;
using boost::system::error_code;
using GenericEndpoint = asio::generic::stream_protocol::endpoint;

namespace {

std::string PeerName(const net::Socket& socket) {
  error_code ec;
  GenericEndpoint peer = socket.remote_endpoint(ec);
  if (ec) return "unknown peer";
  const sockaddr* sa = peer.data();
  char text[INET6_ADDRSTRLEN] = {};
  if (sa->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(sa);
    ::inet_ntop(AF_INET, &in->sin_addr, text, sizeof(text));
    return fmt::format("{}:{}", text, ntohs(in->sin_port));
  }
  if (sa->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const sockaddr_in6*>(sa);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof(text));
    return fmt::format("[{}]:{}", text, ntohs(in6->sin6_port));
  }
  return "unix";
}

}  // namespace

Server::Server(const ServerConfig& config)
    : ctx_(std::make_unique<ServerContext>(config)),
      io_(static_cast<int>(config.io_threads)),
      strand_(asio::make_strand(io_)),
      stats_timer_(strand_) {
  // OpenSSL's one-time set-up (its config file, the first thread's error state) runs here, on
  // the thread that makes the server, not on the first network thread to hash a secret: OpenSSL
  // 3.0 never frees the error state of the thread that ran it, which leaked when that network
  // thread ended (LeakSanitizer at exit of a process that embeds the server and stops it).
  OPENSSL_init_crypto(OPENSSL_INIT_LOAD_CONFIG, nullptr);
  if (config.handle_signals) {
    signals_.emplace(strand_, SIGTERM, SIGINT);
    reload_signals_.emplace(strand_, SIGHUP);
  }
  for (uint32_t i = 0; i < config.demand_io_threads; ++i) {
    // Concurrency hint 1: one thread runs each loop (posting from others stays safe).
    demand_ios_.push_back(std::make_unique<asio::io_context>(1));
    ctx_->demand_loops.emplace_back().io = demand_ios_.back().get();
  }
}

Server::Server(const ServerConfig& config, std::unique_ptr<PlacementBackend> placement)
    : Server(config) {
  ctx_->placement = std::move(placement);
}

Server::~Server() {
  listeners_.clear();
  // Placements in flight hand their chunks to the dispatcher (a fallback read): finish them first.
  if (ctx_->placement) ctx_->placement->Flush();
  ctx_->dispatcher.Stop();  // no disk thread posts into io_ while it is destroyed
  if (ctx_->placement) ctx_->placement->Flush();  // queued by a destination's opening
}

Result<Server::Listener> Server::Bind(const net::Endpoint& endpoint) {
  Listener listener;
  listener.acceptor = std::make_unique<Acceptor>(strand_);
  listener.endpoint = endpoint;
  error_code ec;
  GenericEndpoint generic;
  if (endpoint.kind == net::Endpoint::Kind::kUnix) {
    struct stat st {};
    if (::lstat(endpoint.path.c_str(), &st) == 0) {
      if (!S_ISSOCK(st.st_mode))
        return InvalidArgument("{}: exists and is not a socket; not replacing it",
                               endpoint.ToString());
      // A socket file nobody answers on is left over from a crash; a live one is in use.
      asio::io_context probe_io;
      net::Socket probe(probe_io);
      probe.connect(GenericEndpoint(asio::local::stream_protocol::endpoint(endpoint.path)), ec);
      if (!ec) return Unavailable("{}: another server is listening there", endpoint.ToString());
      ::unlink(endpoint.path.c_str());
    }
    generic = GenericEndpoint(asio::local::stream_protocol::endpoint(endpoint.path));
  } else {
    asio::ip::tcp::resolver resolver(io_);
    auto results = resolver.resolve(
        endpoint.host, std::to_string(endpoint.port),
        asio::ip::resolver_base::passive | asio::ip::resolver_base::numeric_service, ec);
    if (ec || results.empty())
      return Unavailable("{}: cannot resolve: {}", endpoint.ToString(), ec.message());
    generic = GenericEndpoint(results.begin()->endpoint());
  }
  Acceptor& acceptor = *listener.acceptor;
  acceptor.open(generic.protocol(), ec);
  if (ec) return IoError("{}: socket: {}", endpoint.ToString(), ec.message());
  if (endpoint.kind == net::Endpoint::Kind::kTcp)
    acceptor.set_option(asio::socket_base::reuse_address(true), ec);
  acceptor.bind(generic, ec);
  if (ec) return IoError("{}: bind: {}", endpoint.ToString(), ec.message());
  acceptor.listen(asio::socket_base::max_listen_connections, ec);
  if (ec) return IoError("{}: listen: {}", endpoint.ToString(), ec.message());
  if (endpoint.kind == net::Endpoint::Kind::kUnix) {
    unix_paths_.push_back(endpoint.path);
  } else {
    GenericEndpoint local = acceptor.local_endpoint(ec);
    if (!ec) {
      const sockaddr* sa = local.data();
      if (sa->sa_family == AF_INET)
        listener.endpoint.port = ntohs(reinterpret_cast<const sockaddr_in*>(sa)->sin_port);
      else if (sa->sa_family == AF_INET6)
        listener.endpoint.port = ntohs(reinterpret_cast<const sockaddr_in6*>(sa)->sin6_port);
    }
  }
  return listener;
}

Status Server::Listen() {
  const ServerConfig& config = ctx_->config;
  if (!config.placement.empty() && !ctx_->placement) {
    PlacementOptions options;
    options.kind = config.placement;
    options.device = config.placement_device;
    options.pin_budget_bytes = config.placement_pin_budget;
    options.blocking_sync = config.placement_blocking_sync;
    options.largest_chunk = std::min(config.max_frame, std::max(config.raw_chunk_size, 4u << 20));
    Result<std::unique_ptr<PlacementBackend>> placement = CreatePlacement(options);
    if (!placement.ok()) return placement.status().Context("--placement");
    ctx_->placement = std::move(*placement);
    spdlog::info("placement: {} (chunks go straight into the memory of clients that ask)",
                 config.placement);
    if (ctx_->placement->kind() == "memfd" && !KernelHasPeerPidfd())
      spdlog::warn(
          "placement: this kernel has no SO_PEERPIDFD (Linux 6.5+): a client's memfds are taken "
          "through its pid, which another process may reuse once the client exits "
          "(docs/security.md, \"Placement\")");
  }
  ctx_->dispatcher.SetPlacedSourcesResident(ctx_->placement && ctx_->placement->SourcesResident());
  if (config.tls.enabled()) {
    GPULAZY_ASSIGN_OR_RETURN(tls_, net::MakeServerTlsContext(config.tls));
    spdlog::info("TLS certificate {} ({})", config.tls.cert_file,
                 net::SummarizeCertificate(*tls_).ToString());
  }
  for (const net::Endpoint& endpoint : config.listen) {
    GPULAZY_ASSIGN_OR_RETURN(Listener listener, Bind(endpoint));
    if (endpoint.kind == net::Endpoint::Kind::kTcp) {
      listener.tls = tls_;
      if (!tls_)
        spdlog::warn(
            "{}: plain TCP (--insecure-tcp): GPU memory and tokens cross the network "
            "unencrypted and unauthenticated",
            listener.endpoint.ToString());
    }
    bound_.push_back(listener.endpoint);
    listeners_.push_back(std::move(listener));
  }
  for (const Listener& listener : listeners_)
    spdlog::info("listening on {} ({})", listener.endpoint.ToString(),
                 ListenerMode(config, listener.endpoint));
  if (!ctx_->config.ready_file.empty()) GPULAZY_RETURN_IF_ERROR(WriteReadyFile());
  return Status::Ok();
}

Status Server::WriteReadyFile() const {
  std::string text;
  for (const net::Endpoint& endpoint : bound_)
    text += endpoint.ToString() + "\n";
  // Atomic, so a test polling for the file never reads half of it.
  return WriteFileAtomically(ctx_->config.ready_file, AsBytes(text));
}

asio::awaitable<void> Server::AcceptLoop(Listener& listener) {
  const std::string where = listener.endpoint.ToString();
  while (!ctx_->shutting_down) {
    error_code ec;
    asio::any_io_executor strand = asio::make_strand(io_);
    net::Socket socket = co_await listener.acceptor->async_accept(
        strand, asio::redirect_error(asio::use_awaitable, ec));
    if (ec) {
      if (ec == asio::error::operation_aborted || ctx_->shutting_down) break;
      spdlog::warn("{}: accept failed: {}", where, ec.message());
      // Out of fds or similar: back off instead of spinning.
      asio::steady_timer pause(strand_, std::chrono::milliseconds(100));
      co_await pause.async_wait(asio::redirect_error(asio::use_awaitable, ec));
      continue;
    }
    if (ctx_->shutting_down) break;
    net::TuneSocket(socket);
    std::string peer = PeerName(socket);
    const uint64_t id = ctx_->NextConnectionId();
    PeerIdentity identity;
    std::string refusal;
    if (listener.endpoint.kind == net::Endpoint::Kind::kUnix) {
      Result<PeerIdentity> credentials = UnixPeerIdentity(socket.native_handle());
      if (credentials.ok()) identity = *credentials;
      if (!credentials.ok() || !UnixPeerAllowed(ctx_->config, identity)) {
        refusal = credentials.ok() ? fmt::format("peer uid {} gid {} is not allowed to connect",
                                                 *identity.uid, *identity.gid)
                                   : credentials.status().message();
      }
    }
    net::Stream stream =
        listener.tls ? net::Stream(std::move(socket), listener.tls, net::Stream::Side::kServer)
                     : net::Stream(std::move(socket));
    auto connection = std::make_shared<Connection>(*ctx_, std::move(stream), id, peer, identity);
    if (!refusal.empty()) {
      ctx_->totals.connections_refused.fetch_add(1);
      spdlog::warn("{}: refusing connection {} ({}): {} (--allow-uid / --allow-gid)", where, id,
                   identity.ToString(), refusal);
      connection->Start(wire::ERROR_UNAUTHENTICATED, refusal);
      continue;
    }
    if (ctx_->totals.connections_open.load() >= ctx_->config.max_connections) {
      ctx_->totals.connections_refused.fetch_add(1);
      spdlog::warn("{}: refusing connection {} from {}: {} connections open", where, id, peer,
                   ctx_->totals.connections_open.load());
      connection->Start(wire::ERROR_LIMIT, "too many connections");
      continue;
    }
    connection->Start();
  }
}

asio::awaitable<void> Server::StatsLoop() {
  while (!ctx_->shutting_down) {
    error_code ec;
    stats_timer_.expires_after(ctx_->config.stats_interval);
    co_await stats_timer_.async_wait(asio::redirect_error(asio::use_awaitable, ec));
    if (ec || ctx_->shutting_down) break;
    spdlog::info("stats: {}", ctx_->StatsJson(std::nullopt, SIZE_MAX));
  }
}

void Server::BeginShutdown(std::string_view why) {
  if (ctx_->shutting_down.exchange(true)) return;
  spdlog::info("shutting down ({}): {} sessions, {} connections open", why,
               ctx_->totals.sessions_open.load(), ctx_->totals.connections_open.load());
  error_code ec;
  for (Listener& listener : listeners_)
    listener.acceptor->close(ec);
  for (const std::string& path : unix_paths_)
    ::unlink(path.c_str());
  unix_paths_.clear();
  if (signals_) signals_->cancel(ec);
  if (reload_signals_) reload_signals_->cancel(ec);
  stats_timer_.cancel();
  // Newest first: a demand connection, a lane or a files connection is newer than the stream
  // connection whose session it joined, so it hears why before that session's close could
  // send it a plain Goodbye (both are posted to its strand, in this order).
  std::vector<std::shared_ptr<Connection>> connections = ctx_->Connections();
  for (auto it = connections.rbegin(); it != connections.rend(); ++it)
    (*it)->Shutdown(wire::ERROR_SHUTTING_DOWN, "server is shutting down");
}

Status Server::ReloadCredentials() {
  const ServerConfig& config = ctx_->config;
  // Everything is read before anything changes, so a bad file leaves all as it was.
  auto failed = [&](const Status& status, std::string_view reading) {
    ctx_->totals.credential_reload_failures.fetch_add(1);
    return status.Context(reading);
  };
  std::shared_ptr<net::TlsContext> tls = tls_;
  if (config.tls.enabled()) {
    Result<std::shared_ptr<net::TlsContext>> loaded = net::MakeServerTlsContext(config.tls);
    if (!loaded.ok()) return failed(loaded.status(), "reloading the TLS credentials");
    tls = std::move(*loaded);
  }
  std::optional<std::vector<std::string>> tokens;
  if (!config.token_file.empty()) {
    Result<std::vector<std::string>> read = net::ReadTokenListFile(config.token_file);
    if (!read.ok()) return failed(read.status(), "reloading --token-file");
    tokens = std::move(*read);
  }
  std::optional<std::vector<ImageAccessRule>> access_rules;
  if (!config.image_access_file.empty()) {
    Result<std::vector<ImageAccessRule>> read = ReadImageAccessFile(config.image_access_file);
    if (!read.ok()) return failed(read.status(), "reloading --image-access-file");
    access_rules = std::move(*read);
  }
  tls_ = tls;
  for (Listener& listener : listeners_)
    if (listener.tls) listener.tls = tls;
  const size_t token_count = tokens ? tokens->size() : 0;
  if (tokens) ctx_->SetTokens(std::move(*tokens));
  if (access_rules) ctx_->SetImageAccessFileRules(*access_rules);
  ctx_->totals.credential_reloads.fetch_add(1);
  std::string what;
  if (config.tls.enabled())
    what = fmt::format("TLS certificate {} ({})", config.tls.cert_file,
                       net::SummarizeCertificate(*tls).ToString());
  if (token_count > 0)
    what += fmt::format("{}token file {} ({} token{})", what.empty() ? "" : ", ", config.token_file,
                        token_count, token_count == 1 ? "" : "s");
  if (access_rules)
    what += fmt::format("{}image-access file {} ({} rule{})", what.empty() ? "" : ", ",
                        config.image_access_file, access_rules->size(),
                        access_rules->size() == 1 ? "" : "s");
  spdlog::info("credentials reloaded: {}", what.empty() ? "none configured" : what);
  return Status::Ok();
}

void Server::AwaitReloadSignal() {
  if (!reload_signals_) return;
  reload_signals_->async_wait(asio::bind_executor(strand_, [this](const error_code& ec, int) {
    if (ec || ctx_->shutting_down) return;
    Status reloaded = ReloadCredentials();
    if (!reloaded.ok())
      spdlog::error("SIGHUP: {}; the credentials and access rules in place stay",
                    reloaded.message());
    AwaitReloadSignal();
  }));
}

void Server::Stop() {
  asio::post(strand_, [this] { BeginShutdown("stop requested"); });
}

int Server::Run() {
  if (signals_)
    signals_->async_wait(asio::bind_executor(strand_, [this](const error_code& ec, int signal) {
      if (!ec) BeginShutdown(signal == SIGTERM ? "SIGTERM" : "SIGINT");
    }));
  AwaitReloadSignal();
  for (Listener& listener : listeners_)
    asio::co_spawn(strand_, AcceptLoop(listener), asio::detached);
  if (ctx_->config.stats_interval.count() > 0) asio::co_spawn(strand_, StatsLoop(), asio::detached);
  // On a bulk disk thread, the others serving restores meanwhile (an image asked for before it
  // is warm is served as it is: cold). Joined with the pool at shutdown.
  if (!ctx_->config.warm.empty())
    asio::post(ctx_->dispatcher.pool(), [ctx = ctx_.get()] { WarmImages(*ctx); });

  std::atomic<int> exit_code = 0;
  auto stop_loops = [&] {
    io_.stop();
    for (const std::unique_ptr<asio::io_context>& io : demand_ios_)
      io->stop();
  };
  auto run = [&](asio::io_context& io) {
    try {
      io.run();
    } catch (const std::exception& e) {
      spdlog::critical("network thread failed: {}", e.what());
      exit_code = 1;
      stop_loops();
    }
  };
  spdlog::info("threads: {} network, {} demand network, {} bulk disk, {} demand disk",
               ctx_->config.io_threads, ctx_->config.demand_io_threads, ctx_->config.disk_threads,
               ctx_->config.demand_threads);
  // The demand loops have no acceptor to keep them running between demand connections.
  std::vector<asio::executor_work_guard<asio::io_context::executor_type>> demand_work;
  for (const std::unique_ptr<asio::io_context>& io : demand_ios_)
    demand_work.emplace_back(io->get_executor());
  std::vector<std::thread> threads;
  std::vector<std::thread> demand_threads;
  try {
    for (uint32_t i = 1; i < ctx_->config.io_threads; ++i)
      threads.emplace_back([&] {
        net::NameThisThread("gl-net");  // not the calling thread: that would rename the process
        run(io_);
      });
    for (const std::unique_ptr<asio::io_context>& io : demand_ios_)
      demand_threads.emplace_back([&run, &io = *io] {
        net::NameThisThread("gl-demand-net");
        run(io);
      });
  } catch (const std::system_error& e) {
    // Out of threads (RLIMIT_NPROC, a cgroup's pids.max): stop what started and say so,
    // rather than std::terminate on a joinable thread.
    spdlog::critical("cannot start the server's threads: {}", e.what());
    exit_code = 1;
    stop_loops();
  }
  if (exit_code == 0) run(io_);
  for (std::thread& thread : threads)
    thread.join();
  // io_ ran out of work: the listeners are closed and its connections gone. The demand
  // connections were told to shut down with the others; let their loop end when they have.
  demand_work.clear();
  for (std::thread& thread : demand_threads)
    thread.join();
  if (ctx_->placement) ctx_->placement->Flush();
  ctx_->dispatcher.Stop();
  // A session's destinations open on the disk threads, and queue the placements that waited
  // for them: those too.
  if (ctx_->placement) ctx_->placement->Flush();
  for (const std::string& path : unix_paths_)
    ::unlink(path.c_str());
  spdlog::info("stopped: {} bytes sent in {} sessions", ctx_->totals.bytes_sent.load(),
               ctx_->totals.sessions_opened.load());
  return exit_code.load();
}

}  // namespace gpulazy::server
