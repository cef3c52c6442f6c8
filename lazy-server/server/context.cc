#include "lazy-server/server/context.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "lazy-server/server/session.h"
#include "page-client/net/stream.h"

namespace gpulazy::server {

ServerContext::ServerContext(const ServerConfig& config_in)
    : config(config_in),
      limits(FrameLimits{FrameLimits{}.max_header, config_in.max_frame}),
      store(config_in.image_roots, config_in.raw_chunk_size, config_in.max_cached_images),
      dispatcher(DispatcherOptions{
          .limits = SchedulerLimits{config_in.stream_window, config_in.demand_window,
                                    config_in.max_demand, config_in.max_queued},
          .disk_threads = config_in.disk_threads,
          .demand_threads = config_in.demand_threads,
          .read_ahead = config_in.read_ahead,
          .background_nice = config_in.background_nice,
          // Every chunk the server may send fits a pooled buffer.
          .buffer_bytes = config_in.max_frame,
          .pooled_buffers = config_in.chunk_buffers}),
      tokens_(std::make_shared<const std::vector<std::string>>(config_in.tokens)),
      access_policy_(std::make_shared<const ImageAccessPolicy>(
          ImageAccessPolicy::For(config_in, config_in.image_access_file_rules))) {}

std::shared_ptr<const ImageAccessPolicy> ServerContext::AccessPolicy() const {
  std::lock_guard lock(token_mu_);
  return access_policy_;
}

void ServerContext::SetImageAccessFileRules(const std::vector<ImageAccessRule>& file_rules) {
  auto replacement =
      std::make_shared<const ImageAccessPolicy>(ImageAccessPolicy::For(config, file_rules));
  std::lock_guard lock(token_mu_);
  access_policy_ = std::move(replacement);
}

std::shared_ptr<const std::vector<std::string>> ServerContext::Tokens() const {
  std::lock_guard lock(token_mu_);
  return tokens_;
}

void ServerContext::SetTokens(std::vector<std::string> tokens) {
  auto replacement = std::make_shared<const std::vector<std::string>>(std::move(tokens));
  std::lock_guard lock(token_mu_);
  tokens_ = std::move(replacement);
}

bool ServerContext::TokenAccepted(std::string_view token) const {
  const std::shared_ptr<const std::vector<std::string>> tokens = Tokens();
  if (tokens->empty()) return true;
  // Every one compared, so the time does not tell which matched.
  bool accepted = false;
  for (const std::string& candidate : *tokens)
    accepted |= net::ConstantTimeEqual(token, candidate);
  return accepted;
}

std::shared_ptr<Session> ServerContext::FindSession(SessionId id) const {
  std::lock_guard lock(mu_);
  auto it = sessions_.find(id);
  return it == sessions_.end() ? nullptr : it->second.lock();
}

bool ServerContext::AddSession(const std::shared_ptr<Session>& session) {
  std::lock_guard lock(mu_);
  if (sessions_.size() >= config.max_sessions) return false;
  sessions_[session->id()] = session;
  return true;
}

void ServerContext::RemoveSession(SessionId id) {
  std::lock_guard lock(mu_);
  sessions_.erase(id);
}

void ServerContext::AddPlacingSession(const std::shared_ptr<Session>& session) {
  std::lock_guard lock(mu_);
  // A session that died without its release (a server shutting down) leaves an expired entry.
  std::erase_if(placing_sessions_, [](const auto& entry) { return entry.second.expired(); });
  placing_sessions_[session->id()] = session;
}

void ServerContext::RemovePlacingSession(SessionId id) {
  std::lock_guard lock(mu_);
  placing_sessions_.erase(id);
}

std::shared_ptr<Session> ServerContext::FindSessionToSupersede(SessionId id) const {
  std::lock_guard lock(mu_);
  for (const auto* registry : {&sessions_, &placing_sessions_}) {
    auto it = registry->find(id);
    if (it == registry->end()) continue;
    if (auto session = it->second.lock()) return session;
  }
  return nullptr;
}

std::vector<std::shared_ptr<Session>> ServerContext::Sessions() const {
  std::vector<std::shared_ptr<Session>> out;
  std::lock_guard lock(mu_);
  for (const auto& [id, weak] : sessions_)
    if (auto session = weak.lock()) out.push_back(std::move(session));
  return out;
}

ServerContext::DemandLoop* ServerContext::ClaimLeastBusyDemandLoop() {
  std::lock_guard lock(demand_loop_mu_);
  DemandLoop* least = nullptr;
  for (DemandLoop& loop : demand_loops)
    if (least == nullptr || loop.connections.load() < least->connections.load()) least = &loop;
  if (least != nullptr) least->connections.fetch_add(1);
  return least;
}

void ServerContext::AddConnection(uint64_t id, const std::shared_ptr<Connection>& connection) {
  std::lock_guard lock(mu_);
  connections_[id] = connection;
}

void ServerContext::RemoveConnection(uint64_t id) {
  std::lock_guard lock(mu_);
  connections_.erase(id);
}

std::vector<std::shared_ptr<Connection>> ServerContext::Connections() const {
  std::vector<std::shared_ptr<Connection>> out;
  std::lock_guard lock(mu_);
  for (const auto& [id, weak] : connections_)
    if (auto connection = weak.lock()) out.push_back(std::move(connection));
  return out;
}

namespace {

nlohmann::json ChunksByPriority(const std::array<std::atomic<uint64_t>, 3>& chunks) {
  return {{"demand", chunks[wire::PRIORITY_DEMAND].load()},
          {"prefetch", chunks[wire::PRIORITY_PREFETCH].load()},
          {"background", chunks[wire::PRIORITY_BACKGROUND].load()}};
}

nlohmann::json SessionJson(Session& session, const Dispatcher& dispatcher) {
  SessionStats& stats = session.stats();
  const Session::Latency latency = session.DemandLatency();
  nlohmann::json j = {
      {"session", session.id()},
      {"image", session.image().name},
      {"lazy_image", session.image().source->is_lazy()},
      // Of the image's source, shared by its sessions: a CRIU checkpoint's chunks hashed so far.
      {"image_checksums_computed", session.image().source->checksums_computed()},
      {"age_s", std::chrono::duration<double>(Clock::now() - session.opened_at()).count()},
      {"bytes_sent", stats.bytes_sent.load()},
      {"bytes_by_reference", stats.bytes_by_reference.load()},
      {"bytes_sendfile", stats.bytes_sendfile.load()},
      {"bytes_placed", stats.bytes_placed.load()},
      {"chunks_sent", ChunksByPriority(stats.chunks_sent)},
      {"errors_sent", stats.errors_sent.load()},
      {"stream_done", stats.stream_done.load()},
      {"demand_latency_us",
       {{"count", latency.count},
        {"p50", latency.p50_us},
        {"p99", latency.p99_us},
        {"max", latency.max_us},
        // The two parts: request read -> write started, and the write itself.
        {"queued_p50", latency.queued_p50_us},
        {"queued_p99", latency.queued_p99_us},
        {"write_p50", latency.write_p50_us},
        {"write_p99", latency.write_p99_us}}},
  };
  if (auto counters = dispatcher.Counters(session.id())) {
    j["credit"] = counters->credit;
    j["queued_chunks"] = counters->queued;
    j["stream_in_flight"] = counters->stream_in_flight;
    j["demand_outstanding"] = counters->demand_outstanding;
  }
  return j;
}

}  // namespace

std::string ServerContext::StatsJson(std::optional<SessionId> own, size_t max_bytes,
                                     const ImageGrant& visible) const {
  // Live demand connections on each demand network thread.
  nlohmann::json demand_loop_connections = nlohmann::json::array();
  for (const DemandLoop& loop : demand_loops)
    demand_loop_connections.push_back(loop.connections.load());
  nlohmann::json server = {
      {"name", config.server_name},
      {"uptime_s", std::chrono::duration<double>(Clock::now() - started).count()},
      {"connections_open", totals.connections_open.load()},
      {"connections_accepted", totals.connections_accepted.load()},
      {"connections_refused", totals.connections_refused.load()},
      {"credential_reloads", totals.credential_reloads.load()},
      {"credential_reload_failures", totals.credential_reload_failures.load()},
      {"sessions_open", totals.sessions_open.load()},
      {"sessions_opened", totals.sessions_opened.load()},
      {"bytes_sent", totals.bytes_sent.load()},
      {"bytes_sendfile", totals.bytes_sendfile.load()},
      {"chunks_sent", ChunksByPriority(totals.chunks_sent)},
      {"errors_sent", totals.errors_sent.load()},
      {"frames_received", totals.frames_received.load()},
      {"chunk_tables_built", totals.chunk_tables_built.load()},
      {"demand_connections_moved", totals.demand_connections_moved.load()},
      {"demand_loop_connections", demand_loop_connections},
      {"images_cached", store.cached()},
      {"shutting_down", shutting_down.load()},
  };
  uint64_t frames_now = 0;
  uint64_t bytes_now = 0;
  for (const std::shared_ptr<Connection>& connection : Connections()) {
    frames_now = std::max(frames_now, connection->queued_reply_frames());
    bytes_now = std::max(bytes_now, connection->queued_reply_bytes());
  }
  server["reply_queue"] = {
      {"frames_limit", Connection::kMaxQueuedControl},
      {"bytes_limit", Connection::kMaxQueuedControlBytes},
      {"frames_max_now", frames_now},
      {"bytes_max_now", bytes_now},
      {"frames_peak", totals.reply_frames_queued_peak.load()},
      {"bytes_peak", totals.reply_bytes_queued_peak.load()},
      {"cutoffs", totals.reply_cutoffs.load()},
  };
  if (!config.warm.empty()) {
    const uint64_t done = totals.warm_images.load() + totals.warm_failures.load();
    server["warm"] = {
        {"images", totals.warm_images.load()},
        {"failures", totals.warm_failures.load()},
        {"pending", config.warm.size() - std::min<uint64_t>(done, config.warm.size())},
        {"files", totals.warm_files.load()},
        {"bytes", totals.warm_bytes.load()}};
  }
  if (placement) {
    nlohmann::json counters = {{"kind", placement->kind()}};
    for (const auto& [name, value] : placement->Counters())
      counters[name] = value;
    counters["placements_deferred"] = totals.placements_deferred.load();
    counters["destination_open_failures"] = totals.destination_open_failures.load();
    counters["sessions_superseded"] = totals.sessions_superseded.load();
    counters["supersede_refusals"] = totals.supersede_refusals.load();
    server["placement"] = counters;
  }
  // The disk lanes and the chunk buffer pool (docs/server.md "Disk reads").
  const Dispatcher::LaneCounters lanes = dispatcher.lanes();
  const ChunkBufferPool::Counters buffers = dispatcher.buffers().counters();
  server["disk"] = {
      {"demand_reads", lanes.demand_reads},
      {"bulk_reads", lanes.bulk_reads},
      {"demand_in_flight", lanes.demand_in_flight},
      {"bulk_in_flight", lanes.bulk_in_flight},
      {"read_ahead_hints", lanes.read_ahead_hints},
      {"buffers",
       {{"allocated", buffers.allocated},
        {"reused", buffers.reused},
        {"freed", buffers.freed},
        {"idle", buffers.idle},
        {"out", buffers.out}}},
  };
  nlohmann::json sessions = nlohmann::json::array();
  nlohmann::json mine;
  for (const std::shared_ptr<Session>& session : Sessions()) {
    if (!MayOpen(visible, session->image().relative)) continue;
    nlohmann::json j = SessionJson(*session, dispatcher);
    if (own && session->id() == *own) mine = j;
    sessions.push_back(std::move(j));
  }
  nlohmann::json doc = {{"server", server}, {"sessions", sessions}};
  if (own) doc["own_session"] = *own;
  // Image paths come from the file system: any bytes that are not UTF-8 become U+FFFD, where
  // dump() would throw and a protobuf string field would not parse.
  constexpr auto kReplace = nlohmann::json::error_handler_t::replace;
  std::string text = doc.dump(-1, ' ', false, kReplace);
  if (text.size() <= max_bytes) return text;
  // Too many sessions for one frame header: the asking session and the totals only.
  doc["sessions"] = mine.is_null() ? nlohmann::json::array() : nlohmann::json::array({mine});
  doc["sessions_truncated"] = true;
  return doc.dump(-1, ' ', false, kReplace);
}

}  // namespace gpulazy::server
