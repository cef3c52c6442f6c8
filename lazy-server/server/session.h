// Session and Connection: one client restoring one image (docs/protocol.md).
//
// A Connection is one socket. Its life is one readable coroutine (Run: Hello, then requests
// until the peer leaves or breaks the protocol) plus a writer coroutine that sends control
// frames first, then chunks as the Dispatcher delivers them, and a watchdog for the Hello,
// idle and linger deadlines. Everything of a Connection runs on its own strand.
//
// A Session is created by OpenImage on a stream connection and lives as long as that
// connection; a demand connection joins it with the session secret. Chunks read from disk
// arrive on a disk thread (ChunkSink) and are posted to the strand of the connection they are
// for.
//
// Thread-safety: Connection methods other than Shutdown() and Post*() run on its strand.
// Session guards its connection pointers and latency samples with a mutex; counters are atomic.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "lazy-server/server/access.h"
#include "lazy-server/server/context.h"
#include "lazy-server/server/dispatcher.h"
#include "lazy-server/server/image_store.h"
#include "lazy-server/server/placement.h"
#include "page-client/net/frame_stream.h"
#include "page-client/net/stream.h"
#include "proto/recent_values.h"
#include "proto/wire.pb.h"

namespace gpulazy::server {

class Connection;

struct SessionStats {
  std::atomic<uint64_t> bytes_sent{0};          // payload bytes on the wire
  std::atomic<uint64_t> bytes_by_reference{0};  // stored bytes the client read from its files
  std::atomic<uint64_t> bytes_sendfile{0};      // of bytes_sent: sent from the files by sendfile
  std::atomic<uint64_t> bytes_placed{0};        // raw bytes written into the client's memory by us
  std::array<std::atomic<uint64_t>, 3> chunks_sent{};  // by wire::Priority
  std::atomic<uint64_t> errors_sent{0};
  std::atomic<uint64_t> stream_done{0};
};

class Session : public ChunkSink, public std::enable_shared_from_this<Session> {
 public:
  Session(ServerContext& ctx, SessionId id, std::string secret,
          std::shared_ptr<const OpenedImage> image);

  SessionId id() const { return id_; }
  const std::string& secret() const { return secret_; }
  const OpenedImage& image() const { return *image_; }
  SessionStats& stats() { return stats_; }
  Clock::time_point opened_at() const { return opened_at_; }

  void SetStream(const std::shared_ptr<Connection>& connection);
  // Makes `connection` the demand connection; the previous one (if any) is shut down.
  // kAborted once the session closed (it may close while a demand connection moves threads):
  // nothing would ever tell that connection to go.
  Status AttachDemand(const std::shared_ptr<Connection>& connection);
  void DetachDemand(const Connection* connection);
  // Adds `connection` as one more bulk lane (Hello.join_as_lane). Returns its lane number
  // (1..max_lanes), and the stream's end when StreamDone went out before it joined (the lane
  // then owes the client one at once: every bulk connection carries one, docs/protocol.md);
  // kResourceExhausted past max_lanes, kAborted once the session closed.
  struct LaneJoin {
    uint32_t lane = 0;
    std::optional<StreamDoneInfo> done;
  };
  Result<LaneJoin> AddLane(const std::shared_ptr<Connection>& connection, uint32_t max_lanes);
  // Everything stream_all scheduled has been written: StreamDone on every bulk connection, each
  // after its own last chunk, so the client knows no chunk is still on its way on any of them.
  void BroadcastStreamDone(const StreamDoneInfo& info);
  // The stream connection or a lane (`by`) ended: unregisters the session and closes its other
  // connections (a session does not outlive any of its bulk connections).
  void Close(const Connection* by = nullptr);

  // The image files were handed to the client (a files connection): it may ask by_reference.
  void MarkFilesPassed() { files_passed_.store(true); }
  bool files_passed() const { return files_passed_.load(); }

  // A demand chunk sent: `queued` from reading its request to starting its frame's write
  // (scheduling, the page-cache probe or disk read, and waiting for the connection's turn on a
  // network thread), `write` for writing the frame into the socket.
  void RecordDemandLatency(Clock::duration queued, Clock::duration write);
  struct Latency {
    uint64_t count = 0;
    double p50_us = 0;  // request read -> frame written
    double p99_us = 0;
    double max_us = 0;
    double queued_p50_us = 0;  // request read -> write started
    double queued_p99_us = 0;
    double write_p50_us = 0;  // write started -> frame written
    double write_p99_us = 0;
  };
  Latency DemandLatency() const;

  // Placement (PlaceInto): a destination per BO the client handed over, accepted by the backend
  // and opened on a disk thread afterwards, one BO at a time while the stream runs: first the
  // BOs chunks already wait for, then in the order handed over. A chunk whose BO is still being
  // opened waits for it; one whose BO failed to open goes as bytes.
  struct PlacementTargetEntry {
    uint32_t bo = 0;
    std::string handle;
    uint64_t size = 0;
    std::unique_ptr<AcceptedTarget> accepted;
  };
  // Adds them all or none (a BO that has one already is kInvalidArgument) and starts opening.
  Status AddPlacementTargets(std::vector<PlacementTargetEntry> entries);
  // The client is done with its destinations (its stream connection ended): no chunk is placed
  // from now on, and `released` runs once (on any thread, maybe inside this call) when no
  // placement of the session is in flight or waiting for its BO's destination, none is being
  // opened, and the session has let go of every destination (a cuda one is then unmapped).
  void ReleasePlacement(std::function<void()> released);
  bool HasPlacementTarget(uint32_t bo) const;
  size_t placement_targets() const;

  // ChunkSink
  const image::ImageSource& source() const override { return *image_->source; }
  void OnChunkRead(const WorkItem& item, Result<LoadedChunk> chunk) override;
  bool SendsFromFiles(const WorkItem& item) const override;
  // Each chunk is placed at most once per session: a second request for one already placed is
  // answered at once, one for a chunk on its way waits for that placement, and after a failed
  // one the chunk only goes as bytes. A client may change a chunk as soon as it is told it is
  // there, so a late second copy must never land on top.
  Status PlaceChunk(const WorkItem& item, const image::DiskRange& from,
                    std::optional<uint64_t> checksum, PlacementDone done) override;

 private:
  ServerContext& ctx_;
  const SessionId id_;
  const std::string secret_;
  const std::shared_ptr<const OpenedImage> image_;
  const Clock::time_point opened_at_;
  SessionStats stats_;
  std::atomic<bool> files_passed_{false};
  mutable std::mutex mu_;
  std::weak_ptr<Connection> stream_;
  std::weak_ptr<Connection> demand_;
  std::vector<std::weak_ptr<Connection>> lanes_;  // lane n at lanes_[n - 1]
  std::optional<StreamDoneInfo> stream_done_;     // broadcast already (BroadcastStreamDone)
  // The connection a chunk for `item` goes to (mu_ held).
  std::shared_ptr<Connection> TargetLocked(const WorkItem& item) const;
  struct LatencySample {
    uint32_t queued_us = 0;
    uint32_t write_us = 0;
  };
  static constexpr size_t kLatencySamples = 4096;
  RecentValues<LatencySample> latency_us_{kLatencySamples};
  uint64_t latency_count_ = 0;
  bool closed_ = false;

  enum class PlaceState : uint8_t { kNone, kInFlight, kPlaced, kFailed };
  // Called once a chunk's placement finished: records it and runs everyone who waited on it.
  void FinishPlacement(uint64_t flat, const Status& status, const PlacementDone& done);
  // A chunk marked kInFlight, on its way to the backend (or waiting for its BO's open).
  struct PendingPlacement {
    uint64_t flat = 0;
    image::DiskRange from;
    std::optional<uint64_t> checksum;
    uint64_t offset = 0;  // in the BO
    PlacementDone done;
  };
  // A destination held by a thread that is calling the backend's Place with it. A backend may
  // finish inside Place and run `done` there, which can complete the release (the last
  // placement in flight): the release must also wait until these references are gone, or the
  // client would see the connection close while a disk thread still holds its destination.
  // Made under placement_mu_ (counted in place_calls_); destroyed outside it, where it drops
  // the reference, then uncounts and finishes a release that waited for it.
  class PlaceCall {
   public:
    PlaceCall(Session& session, PlacementTargetRef target);
    ~PlaceCall();
    PlaceCall(const PlaceCall&) = delete;
    PlaceCall& operator=(const PlaceCall&) = delete;
    const PlacementTargetRef& target() const { return target_; }

   private:
    Session& session_;
    PlacementTargetRef target_;
  };
  // Queues it with the backend; when that fails, it (and whoever waits on it) goes as bytes.
  Status SubmitPlacement(const PlacementTargetRef& target, const PendingPlacement& placement);
  // On a disk thread, while BOs wait to be opened (one runs at a time per session).
  void OpenDestinations();
  // Lets go of every destination and runs the release's callback once ReleasePlacement's
  // conditions hold; nothing otherwise.
  void FinishReleaseIfDone();
  enum class DestinationState : uint8_t { kNone, kOpening, kOpen, kFailed };
  struct Destination {
    DestinationState state = DestinationState::kNone;
    uint64_t size = 0;                         // what the client said it holds
    std::unique_ptr<AcceptedTarget> accepted;  // kOpening, until the opener takes it
    PlacementTargetRef target;                 // kOpen
    std::vector<PendingPlacement> waiting;     // kOpening: placements waiting for the open
  };
  mutable std::mutex placement_mu_;
  std::vector<Destination> destinations_;  // by BO, once there are any
  std::deque<uint32_t> to_open_;           // accepted BOs the opener has not taken, next first
  bool opener_running_ = false;
  std::vector<PlaceState> place_state_;  // by flat chunk index, once there are targets
  std::unordered_map<uint64_t, std::vector<PlacementDone>> place_waiting_;
  uint64_t placements_in_flight_ = 0;  // kInFlight chunks (queued or waiting for an open)
  bool opening_ = false;               // the opener is inside AcceptedTarget::Open
  uint64_t place_calls_ = 0;           // PlaceCalls alive
  bool placement_released_ = false;
  std::function<void()> on_released_;  // until the release is done
};

class Connection : public std::enable_shared_from_this<Connection> {
 public:
  // kFiles: a connection that joined only to fetch the image files; it closes after them.
  // kLane: one more bulk connection of a session: it only receives stream chunks.
  enum class Role { kNew, kStream, kDemand, kFiles, kLane };

  // `identity`: what the listener learned of the peer (SO_PEERCRED on Unix sockets); a TLS
  // client certificate's name is added after the handshake.
  Connection(ServerContext& ctx, net::Stream stream, uint64_t id, std::string peer,
             PeerIdentity identity);
  ~Connection();

  uint64_t id() const { return id_; }
  // Its payloads may go out by sendfile: a plain socket (TLS encrypts in user space).
  bool can_send_from_files() const { return !socket_.is_tls(); }
  // Spawns Run on the connection's strand. refuse_code != 0: answer that error and close.
  void Start(wire::ErrorCode refuse_code = wire::ERROR_NONE, std::string refuse_message = {});
  // Any thread: stop reading, finish the write in flight, send ERROR_SHUTTING_DOWN, close.
  void Shutdown(wire::ErrorCode code, std::string message);
  // Any thread: a chunk (or its read error) for this connection.
  void PostChunk(WorkItem item, Result<LoadedChunk> chunk);
  // Any thread: a control frame (StreamDone, ...).
  void PostControl(wire::Header header);
  // Any thread: replies (control frames) queued for the client and not yet being written.
  uint64_t queued_reply_frames() const { return queued_reply_frames_.load(); }
  uint64_t queued_reply_bytes() const { return queued_reply_bytes_.load(); }

  // The reader pauses while this many control frames wait for the writer: a client that sends
  // requests but never reads replies cannot grow the queue without bound.
  static constexpr size_t kMaxQueuedControl = 64;
  // Replies wait in the control queue until the client reads them, and a request of a few
  // bytes can ask for a reply thousands of times larger (StatsRequest): frames alone do not
  // bound the bytes. Past this many queued bytes the client is not reading its replies: it is
  // cut off (ERROR_LIMIT) instead of growing the server without bound.
  static constexpr size_t kMaxQueuedControlBytes = 1u << 20;

 private:
  using Awaitable = net::Awaitable<void>;
  Awaitable Run();
  // On a TLS listener, before the handshake: true when the peer's first bytes are no TLS
  // handshake, in which case it has been answered (a plain gpulazy client gets an Error frame
  // in plain text saying this listener speaks TLS) and the connection closed.
  net::Awaitable<bool> RefusedAsNotTls();
  // After the last frame is written: half-close and discard input until the peer closes or a
  // short deadline passes, since closing with unread input resets the connection, which can
  // destroy that frame before the peer reads it. `below_tls`: the raw socket's input (no
  // handshake took place), else what the stream decodes.
  net::Awaitable<void> LingerBeforeClose(bool below_tls);
  Awaitable ReadLoop();
  Awaitable WriteLoop();
  Awaitable Watchdog();
  net::Awaitable<void> HandleHello(const wire::Header& frame);
  net::Awaitable<void> HandleFrame(const wire::Header& frame);
  net::Awaitable<void> HandleOpenImage(const wire::Header& frame);
  // Opens the destinations a PlaceInto hands over (on a disk thread) and gives them to the
  // session, all or none.
  net::Awaitable<void> HandlePlaceInto(const wire::Header& frame);
  // After the reader of a stream connection with placement destinations ended: waits for the
  // session's placements to end (Session::ReleasePlacement) before the connection closes.
  net::Awaitable<void> ReleasePlacement();
  // Asks `session` to end its placements and waits until it has let go of every destination, this
  // connection closes, or `deadline` passes: true once released.
  net::Awaitable<bool> AwaitPlacementRelease(Session& session, Clock::time_point deadline);
  // OpenImage.supersedes_session: ends session `id` (when `secret` is its own) and waits until
  // it has let go of its destinations, at most kSupersedeTimeout. Ok when there is no such
  // session any more.
  net::Awaitable<Status> AwaitSuperseded(SessionId id, const std::string& secret);
  // Copies in flight take milliseconds; a session still placing after this is stuck (a hung
  // device), and the new session is refused rather than run beside it. Under the client's
  // OpenImage timeout (10 s by default), so that it reads why.
  static constexpr std::chrono::seconds kSupersedeTimeout{5};
  // A demand connection whose Hello was accepted moves onto the demand network threads
  // (--demand-network-threads): its socket goes to a successor Connection with the same id,
  // which sends `reply` and serves the connection from then on; this one ends without a word.
  // False when it stays here: no demand threads, TLS (its state cannot change event loops), or
  // shutting down.
  bool MoveToDemandThreads(const wire::Header& reply);
  // Answers a files connection (Hello want_files): ImageFiles with the descriptors attached
  // (true), or an error saying why not (false, and the connection is closing).
  bool SendImageFiles(uint64_t request_id);
  // With want_chunk_table (version 2), after the files: ChunkTable and its pieces, built on a
  // disk thread.
  net::Awaitable<void> SendChunkTable(uint64_t request_id);
  // Runs `work` on a disk thread (the dispatcher's pool) and resumes on this strand with its
  // result.
  template <typename T, typename Work>
  net::Awaitable<T> OnDiskThread(Work work);
  void HandleRequest(const wire::Header& frame);
  void SendStatsReply(uint64_t request_id);
  // Hands the stream's end to the session, which sends StreamDone on each bulk connection.
  void SendStreamDone(const StreamDoneInfo& info);
  // StreamDone on this connection.
  void EnqueueStreamDone(const StreamDoneInfo& info);

  // A reply frame; `payload` (with `payload_bytes`, a piece of it) rides along when set: the
  // image table of protocol version 2, shared with every session of the image.
  struct ControlFrame {
    wire::Header header;
    std::shared_ptr<const std::string> payload;
    std::string_view payload_bytes;  // within *payload
  };
  void Enqueue(wire::Header header, std::shared_ptr<const std::string> payload = nullptr,
               std::string_view payload_bytes = {});
  // Version 2's tables: `header` (an OpenImageReply or a ChunkTable) with the first piece of
  // `table` as its payload, then ImageTablePart frames with the rest, each piece at most the
  // frame payload limit.
  void EnqueueWithTable(wire::Header header, const std::shared_ptr<const std::string>& table);
  // control_ changed: publish its size for stats and raise the server's high-water marks.
  void NoteControlQueue();
  // The client lets replies pile up past kMaxQueuedControlBytes: drop them, queue one
  // ERROR_LIMIT, stop reading and close after the shutdown grace.
  void DropUnreadReplies();
  void SendError(wire::ErrorCode code, std::string message, uint64_t in_reply_to);
  // Frame-level error: answer, then close after the answer is written.
  void Fail(wire::ErrorCode code, std::string message, uint64_t in_reply_to = 0);
  void DeliverChunk(WorkItem item, Result<LoadedChunk> chunk);
  struct ReadyChunk {
    WorkItem item;
    LoadedChunk chunk;  // its pooled buffer goes back when this is destroyed (written/dropped)
  };
  Awaitable WriteChunk(ReadyChunk& ready);
  // The ready chunk to write next: a demand chunk first, else the stream's next in pick order.
  std::deque<ReadyChunk>::iterator NextSendable();
  // A stream chunk was written or dropped: later ones may go.
  void MarkStreamSeq(const WorkItem& item);
  void Wake();
  void Touch();
  void BeginWrite();
  void EndWrite();
  void SetDeadline(Clock::time_point deadline);
  void Close(std::string_view why);
  std::string Tag() const;  // "conn 7 (session 3, image 'x')" for logs

  ServerContext& ctx_;
  net::Stream socket_;  // plain or TLS
  const uint64_t id_;
  const std::string peer_;
  PeerIdentity identity_;
  ImageGrant grant_;  // which images this peer may open and see in stats (set at Hello)
  Role role_ = Role::kNew;
  uint32_t version_ = 0;                            // the protocol version agreed in Hello
  wire::ErrorCode refuse_code_ = wire::ERROR_NONE;  // set: answer this and close
  std::string refuse_message_;
  std::shared_ptr<Session> session_;

  std::deque<ControlFrame> control_;
  // Serialized size of control_'s headers. An image table's payload is left out: it is sent once
  // per stream connection, in answer to its one OpenImage, and shared, not copied; so is a chunk
  // table's (one per files connection, shared through OpenedImage::chunk_table).
  size_t control_bytes_ = 0;
  std::deque<ReadyChunk> chunks_;
  uint64_t next_stream_seq_ = 0;
  std::set<uint64_t> stream_seq_done_;     // finished out of order (demand chunks)
  boost::asio::steady_timer wake_;         // writer waits on it; cancel() wakes it
  boost::asio::steady_timer writer_exit_;  // Run waits on it for the writer to finish
  boost::asio::steady_timer watchdog_;
  Clock::time_point deadline_;
  // Set while a frame is being written: a client that stops reading stalls the write, and the
  // watchdog drops it when this passes (--write-timeout), so nothing piles up for it.
  Clock::time_point write_deadline_ = Clock::time_point::max();
  std::atomic<uint64_t> queued_reply_frames_{0};  // control_.size(), for other threads
  std::atomic<uint64_t> queued_reply_bytes_{0};   // control_bytes_, for other threads
  boost::asio::steady_timer reader_resume_;
  boost::asio::steady_timer release_wait_;  // AwaitPlacementRelease waits on it
  bool reader_paused_ = false;
  bool transport_ready_ = false;  // TLS handshake done (at once for plain): the writer may write
  bool draining_ = false;         // no more requests: flush control frames, then close
  bool writer_done_ = false;
  bool closed_ = false;
  // Its socket went to successor_ (MoveToDemandThreads): Close only ends this object, and a
  // Shutdown goes to the successor.
  bool moved_away_ = false;
  // The demand loop this connection was moved to (its count of connections drops with it).
  ServerContext::DemandLoop* demand_loop_ = nullptr;
  std::weak_ptr<Connection> successor_;
  uint64_t pending_credit_ = 0;  // Credit that arrived before OpenImage's session existed
  std::optional<StreamDoneInfo> lane_done_;  // a lane that joined after StreamDone went out
  std::vector<uint8_t> payload_;             // read buffer for client payloads (unused but bounded)
};

}  // namespace gpulazy::server
