// server/: the page server daemon gpulazy-server (docs/server.md, docs/protocol.md).
//
// Scheduler: which chunk the server reads from disk next. Pure logic, no sockets, no threads,
// no clock of its own (callers pass the time), so tests drive it directly.
//
// Per session it keeps the chunks to send in priority order: demand (for the demand
// connection, then for the stream connection) > explicit prefetch > the stream_all plan's hot
// set > explicit background > the rest of the stream_all plan (profile order, then table
// order). Across sessions, Next() serves sessions round-robin, so one big restore cannot
// starve another. A session's stream output is gated by its credit (the client's window) and by
// a small number of chunks in flight, so a later demand request never waits behind megabytes
// of queued background bytes.
//
// Thread-safety: none; the owner (server::Dispatcher) serializes calls with a mutex.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "proto/manifest.pb.h"
#include "proto/status.h"
#include "proto/wire.pb.h"

namespace gpulazy::server {

using SessionId = uint64_t;
using Clock = std::chrono::steady_clock;

// The chunk geometry of one image, shared by all sessions of that image.
class ImageLayout {
 public:
  // lazy: payloads are the stored lengths (0 for CODEC_ZERO); else the raw lengths.
  static ImageLayout FromManifest(const manifest::Manifest& manifest, bool lazy);

  uint32_t bo_count() const { return static_cast<uint32_t>(chunk_counts_.size()); }
  uint32_t chunk_count(uint32_t bo) const { return chunk_counts_[bo]; }
  uint64_t total_chunks() const { return payload_lengths_.size(); }
  // Flat index of (bo, chunk); both must be in range.
  uint64_t FlatIndex(uint32_t bo, uint32_t chunk) const { return first_flat_[bo] + chunk; }
  uint32_t payload_length(uint32_t bo, uint32_t chunk) const {
    return payload_lengths_[FlatIndex(bo, chunk)];
  }
  uint32_t max_payload() const { return max_payload_; }
  bool Contains(uint32_t bo, uint32_t chunk) const {
    return bo < chunk_counts_.size() && chunk < chunk_counts_[bo];
  }
  // Checks a range from the network: BO and chunks in range, at least one chunk.
  Status CheckRange(const wire::ChunkRange& range) const;
  // The stream_all order: the profile's valid entries (deduplicated), then every other chunk
  // in table order. Entries before hot_end() are the hot set.
  const std::vector<manifest::ChunkRef>& plan() const { return plan_; }
  size_t hot_end() const { return hot_end_; }

 private:
  std::vector<uint32_t> chunk_counts_;
  std::vector<uint64_t> first_flat_;
  std::vector<uint32_t> payload_lengths_;
  std::vector<manifest::ChunkRef> plan_;
  size_t hot_end_ = 0;
  uint32_t max_payload_ = 0;
};

// Where a chunk goes once read.
enum class Output : uint8_t { kStream, kDemand };

// How a chunk reaches the client: its bytes on the wire, where the client reads them itself
// (by reference), or written into the client's memory by the server (placed).
enum class Delivery : uint8_t { kBytes, kByReference, kPlaced };

struct WorkItem {
  SessionId session = 0;
  uint32_t bo = 0;
  uint32_t chunk = 0;
  wire::Priority priority = wire::PRIORITY_BACKGROUND;
  Output output = Output::kStream;
  uint64_t request_id = 0;  // 0 for stream_all chunks
  // Demand output only: the id of the demand connection that asked. Its answer goes to that
  // connection or nowhere: a newer one replacing it has its own request ids, and the client
  // asks again there for what it still lacks.
  uint64_t asked_on = 0;
  bool from_stream_all = false;  // counts towards StreamDone
  uint32_t reserved_credit = 0;  // credit taken when picked (stream output only)
  // Stream output only: which of the session's bulk connections carries it (0: the stream
  // connection, 1..: its lanes, in the order they joined), and its pick order there. Each
  // connection sends its non-demand chunks in this order, so parallel disk reads never put a
  // background chunk before a hot one on any of them.
  uint32_t lane = 0;
  uint64_t stream_seq = 0;
  Clock::time_point received{};  // when the request arrived (demand latency)
  // The client reads the stored bytes itself from the image files it was handed: send where
  // they are, not the bytes (docs/protocol.md, "Image files").
  bool by_reference = false;
  // The server writes the chunk into the session's destination itself (server/placement.h)
  // and tells the client so; what it cannot place goes as bytes.
  bool placed = false;
};

struct SchedulerLimits {
  uint32_t stream_in_flight = 4;  // chunks picked but not yet written, per bulk connection
  uint32_t demand_in_flight = 8;  // the same for the demand connection
  uint32_t max_demand = 256;      // demand chunks queued + in flight per session
  uint64_t max_queued = 4096;     // explicit prefetch/background chunks queued per session
};

struct StreamDoneInfo {
  uint64_t chunks = 0;
  uint64_t bytes = 0;
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerLimits limits = {}) : limits_(limits) {}

  void AddSession(SessionId id, std::shared_ptr<const ImageLayout> layout);
  void RemoveSession(SessionId id);
  bool HasSession(SessionId id) const { return sessions_.contains(id); }

  // Marks chunks as held by the client: stream_all skips them. All-or-nothing.
  Status Have(SessionId id, const google::protobuf::RepeatedPtrField<wire::ChunkRange>& ranges);
  // Starts streaming every chunk not in Have, its items delivered as `delivery` says. Once per
  // session: a
  // second is InvalidArgument (it would send again what is in flight or sent, and walk the
  // whole plan under the dispatcher's lock for each small request).
  Status StreamAll(SessionId id, Delivery delivery = Delivery::kBytes);
  // Queues exactly these chunks (again, if sent before). A chunk picked for a request is not
  // sent again by stream_all in this session while it is in flight or once it was written (a
  // demanded chunk ahead of the plan's cursor would otherwise cross the wire twice). One
  // dropped unwritten (its connection closed, its read failed) is streamed only if the plan
  // has not passed it yet; the requester asks again. All-or-nothing: an out-of-range
  // range is kOutOfRange, past a limit kResourceExhausted, and nothing is queued.
  Status Enqueue(SessionId id, wire::Priority priority, Output output, uint64_t request_id,
                 const google::protobuf::RepeatedPtrField<wire::ChunkRange>& ranges,
                 Clock::time_point now, Delivery delivery = Delivery::kBytes,
                 uint64_t asked_on = 0);
  // The session now has `count` bulk connections (its stream connection and count - 1 lanes):
  // its later stream picks are dealt round-robin over them. Never shrinks (a lane that goes
  // away ends its session).
  void SetLanes(SessionId id, uint32_t count);
  // Grants stream credit (saturating).
  void AddCredit(SessionId id, uint64_t bytes);
  // Takes extra credit for a chunk whose payload turned out larger than reserved.
  bool TakeCredit(SessionId id, uint64_t bytes);

  // Which items a pick may return. The Dispatcher reads demand items in a lane of their own
  // (kDemandOnly) so they never queue behind background reads, and fills the bulk lane with
  // the rest (kNoDemand).
  enum class Pick : uint8_t {
    kAny,         // the session's best item, demand first
    kDemandOnly,  // demand items only (either output)
    kNoDemand,    // prefetch and background only; never overtakes a demand item that waits for
                  // stream credit on the same output
  };
  // The next chunk to read, round-robin over sessions with eligible work; takes the session's
  // in-flight slot and credit. nullopt: nothing can go now. kDemandOnly keeps its own
  // round-robin cursor, so demand picks do not shift the fairness of the other picks.
  std::optional<WorkItem> Next(Pick pick = Pick::kAny);
  // The chunks the session will most likely pick next (read-ahead hints).
  std::vector<manifest::ChunkRef> Upcoming(SessionId id, size_t count) const;
  // A picked item is finished: written (sent_payload = bytes written) or dropped (nullopt;
  // its credit comes back).
  void Done(const WorkItem& item, std::optional<uint32_t> sent_payload);
  // Forgets the queued demand chunks the demand connection `asked_on` asked for (it closed, or a
  // newer one replaced it), so they neither count against --max-demand nor go elsewhere.
  void DropDemandAskedOn(SessionId id, uint64_t asked_on);
  // When the session's stream_all has sent everything: its totals, once.
  std::optional<StreamDoneInfo> TakeStreamDone(SessionId id);

  struct SessionCounters {
    uint64_t credit = 0;
    uint64_t queued = 0;  // explicit queue entries plus the stream_all plan's remainder
    uint32_t stream_in_flight = 0;
    uint32_t demand_outstanding = 0;
  };
  std::optional<SessionCounters> Counters(SessionId id) const;

 private:
  struct SessionState {
    std::shared_ptr<const ImageLayout> layout;
    // Per chunk: stream_all need not send it (named by Have, or written for a request).
    std::vector<bool> have;
    // Request picks in flight, by flat chunk index (as few as the in-flight limits allow):
    // stream_all skips them too, and sends one dropped unwritten if it has not passed it.
    std::unordered_map<uint64_t, uint32_t> requests_in_flight;
    std::deque<WorkItem> demand_to_demand;
    std::deque<WorkItem> demand_to_stream;
    std::deque<WorkItem> prefetch;
    std::deque<WorkItem> background;
    // stream_all
    bool streaming = false;
    bool stream_all_taken = false;  // StreamAll was called (streaming ends at StreamDone)
    Delivery stream_delivery = Delivery::kBytes;
    size_t cursor = 0;
    uint64_t stream_in_flight_all = 0;
    uint64_t stream_sent_chunks = 0;
    uint64_t stream_sent_bytes = 0;
    uint64_t credit = 0;
    std::vector<uint64_t> lane_seq = std::vector<uint64_t>(1, 0);  // next pick order, per lane
    uint32_t lane_cursor = 0;  // the lane the next non-demand stream pick goes to
    uint32_t stream_in_flight = 0;
    uint32_t demand_in_flight = 0;
    uint32_t demand_outstanding = 0;
  };

  // Whether stream_all has no need to send the chunk: the client holds it, or a request's copy
  // is on its way or was sent.
  static bool Settled(const SessionState& s, uint32_t bo, uint32_t chunk);
  // Advances the plan cursor past settled chunks.
  static void SkipHeld(SessionState& s);
  // A request's item was picked, or finished (sent_payload: written).
  static void NoteRequestPicked(SessionState& s, const WorkItem& item);
  static void NoteRequestDone(SessionState& s, const WorkItem& item, bool written);
  // The session's best eligible item of the kind `pick` allows, popped; nullopt when nothing
  // may go.
  std::optional<WorkItem> PickFrom(SessionId id, SessionState& s, Pick pick);
  // Pops the queue's front for the stream output if the window and credit allow.
  std::optional<WorkItem> TakeQueued(SessionState& s, std::deque<WorkItem>& queue);
  bool StreamMayTake(const SessionState& s, uint32_t payload) const;
  // Picks the bulk connection of a stream item and numbers it there. Demand chunks keep to the
  // stream connection, where the client counts what it asked for.
  static void AssignLane(SessionState& s, WorkItem& item);

  SchedulerLimits limits_;
  std::map<SessionId, SessionState> sessions_;
  SessionId last_served_ = 0;         // round-robin cursor (kAny, kNoDemand)
  SessionId last_demand_served_ = 0;  // round-robin cursor (kDemandOnly)
};

}  // namespace gpulazy::server
