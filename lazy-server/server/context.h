// ServerContext: what every connection of one server shares: the configuration, the image
// store, the dispatcher, the registries of open sessions and connections, and the counters
// behind StatsReply. Owned by Server; outlives every connection.
// Thread-safety: counters are atomics; the registries have their own mutex.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "lazy-server/server/access.h"
#include "lazy-server/server/config.h"
#include "lazy-server/server/dispatcher.h"
#include "lazy-server/server/image_store.h"
#include "lazy-server/server/placement.h"
#include "proto/frame.h"

namespace boost::asio {
class io_context;
}

namespace gpulazy::server {

class Session;
class Connection;

struct ServerTotals {
  std::atomic<uint64_t> connections_accepted{0};
  std::atomic<uint64_t> connections_open{0};
  std::atomic<uint64_t> connections_refused{0};
  std::atomic<uint64_t> sessions_opened{0};
  std::atomic<uint64_t> sessions_open{0};
  std::atomic<uint64_t> bytes_sent{0};
  std::atomic<uint64_t> bytes_sendfile{0};  // of bytes_sent: by sendfile from the image files
  std::array<std::atomic<uint64_t>, 3> chunks_sent{};  // by wire::Priority
  std::atomic<uint64_t> errors_sent{0};
  std::atomic<uint64_t> frames_received{0};
  std::atomic<uint64_t> chunk_tables_built{0};  // once per opened image that was asked for one
  // Demand connections moved onto the demand network threads after their Hello.
  std::atomic<uint64_t> demand_connections_moved{0};
  // The most replies (control frames) and reply bytes ever queued for one connection, and how
  // many clients were cut off for not reading theirs (Connection's reply limits).
  std::atomic<uint64_t> reply_frames_queued_peak{0};
  std::atomic<uint64_t> reply_bytes_queued_peak{0};
  std::atomic<uint64_t> reply_cutoffs{0};
  // SIGHUP: credentials and the image-access file read again and put in place, or refused (the
  // old ones kept).
  std::atomic<uint64_t> credential_reloads{0};
  std::atomic<uint64_t> credential_reload_failures{0};
  // Placement: chunks that waited for their BO's destination to open, and destinations that
  // did not open after PlaceInto accepted them (their BOs' chunks went as bytes).
  std::atomic<uint64_t> placements_deferred{0};
  std::atomic<uint64_t> destination_open_failures{0};
  // Reconnected sessions' OpenImage naming an earlier session (protocol.md, Placement, 6): the
  // earlier ones ended and let go of their destinations first, and those refused (a wrong secret,
  // or still placing after kSupersedeTimeout).
  std::atomic<uint64_t> sessions_superseded{0};
  std::atomic<uint64_t> supersede_refusals{0};
  // --warm: images made ready, and those that could not be (not found, unreadable, refused by
  // the placement backend: their restores simply start cold); their files and bytes.
  std::atomic<uint64_t> warm_images{0};
  std::atomic<uint64_t> warm_failures{0};
  std::atomic<uint64_t> warm_files{0};
  std::atomic<uint64_t> warm_bytes{0};
};

struct ServerContext {
  explicit ServerContext(const ServerConfig& config);

  const ServerConfig config;
  const FrameLimits limits;  // what we accept and send
  ImageStore store;
  Dispatcher dispatcher;
  // Set by Server::Listen when config.placement names a backend; read-only once serving.
  // Declared after the dispatcher: destroyed first, after Server has flushed it.
  std::unique_ptr<PlacementBackend> placement;
  ServerTotals totals;
  std::atomic<bool> shutting_down{false};
  // The event loops of --demand-network-threads, one thread each (the loops are owned by
  // Server; none when 0). A demand connection moves to the one with the fewest demand
  // connections and stays there: one connection's reads and writes stay on one thread, and
  // several sessions' demand spreads over them.
  struct DemandLoop {
    boost::asio::io_context* io = nullptr;
    std::atomic<uint32_t> connections{0};
  };
  std::deque<DemandLoop> demand_loops;  // a deque: the atomics never move
  // The loop with the fewest demand connections, counted as holding one more (in one step, so
  // connections moving at the same instant spread). Null when there are none. Whoever claims
  // gives the count back (Connection's destructor, or on a failed move).
  DemandLoop* ClaimLeastBusyDemandLoop();

  // Sessions by id (demand connections join through it) and open connections (shutdown).
  std::shared_ptr<Session> FindSession(SessionId id) const;
  bool AddSession(const std::shared_ptr<Session>& session);  // false past max_sessions
  void RemoveSession(SessionId id);
  std::vector<std::shared_ptr<Session>> Sessions() const;
  // Sessions handed destinations (PlaceInto) that have not let go of them yet, open or closed:
  // a reconnecting client's new session waits for its old one (OpenImage.supersedes_session).
  void AddPlacingSession(const std::shared_ptr<Session>& session);
  void RemovePlacingSession(SessionId id);
  // The session `id` names while it is open or still placing; null once neither.
  std::shared_ptr<Session> FindSessionToSupersede(SessionId id) const;
  void AddConnection(uint64_t id, const std::shared_ptr<Connection>& connection);
  void RemoveConnection(uint64_t id);
  std::vector<std::shared_ptr<Connection>> Connections() const;  // oldest first (by id)
  uint64_t NextConnectionId() { return next_connection_id_.fetch_add(1) + 1; }
  SessionId NextSessionId() { return next_session_id_.fetch_add(1) + 1; }

  // The StatsReply document (docs/server.md lists its fields). When it would exceed max_bytes,
  // only the asking session (own) is listed in full. Sessions of images outside `visible` are
  // left out (a client learns nothing of images it may not open).
  std::string StatsJson(std::optional<SessionId> own, size_t max_bytes,
                        const ImageGrant& visible = std::nullopt) const;
  const Clock::time_point started = Clock::now();

  // The bearer tokens a Hello may carry (none: no token needed). They start as config.tokens
  // and are replaced when the server reads its token file again (SIGHUP): a connection checks
  // those in place when its Hello arrives.
  std::shared_ptr<const std::vector<std::string>> Tokens() const;
  void SetTokens(std::vector<std::string> tokens);
  // Whether `token` is one of them (or none are needed), in time independent of which.
  bool TokenAccepted(std::string_view token) const;
  // The image-access rules in force: the configuration's, with its --image-access-file's rules
  // replaced when the server reads that file again (SIGHUP). A connection takes its grant from
  // those in place when its Hello arrives.
  std::shared_ptr<const ImageAccessPolicy> AccessPolicy() const;
  void SetImageAccessFileRules(const std::vector<ImageAccessRule>& file_rules);

 private:
  mutable std::mutex token_mu_;  // tokens_ and access_policy_
  std::shared_ptr<const std::vector<std::string>> tokens_;
  std::shared_ptr<const ImageAccessPolicy> access_policy_;
  mutable std::mutex mu_;
  std::mutex demand_loop_mu_;  // ClaimLeastBusyDemandLoop's pick and count, as one step
  std::map<SessionId, std::weak_ptr<Session>> sessions_;
  std::map<SessionId, std::weak_ptr<Session>> placing_sessions_;
  std::map<uint64_t, std::weak_ptr<Connection>> connections_;
  std::atomic<uint64_t> next_connection_id_{0};
  std::atomic<uint64_t> next_session_id_{0};
};

}  // namespace gpulazy::server
