#include "page-client/restore_session.h"

#include <sched.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "page-client/chunk_codec.h"
#include "page-client/engine_gate.h"
#include "page-client/file_chunks.h"
#include "page-client/net/asio.h"
#include "page-client/net/endpoint.h"
#include "page-client/net/frame_stream.h"
#include "page-client/net/threads.h"
#include "page-client/residency.h"
#include "page-client/server_connection.h"
#include "proto/checksum.h"
#include "proto/chunk_codec.h"
#include "proto/recent_values.h"
#include "proto/utf8.h"

namespace gpulazy::client {
namespace asio = boost::asio;
using Clock = std::chrono::steady_clock;

namespace {

// Bounds on what an OpenImageReply / HelloReply may make us allocate.
constexpr uint32_t kMaxAcceptedPayload = 64u << 20;
constexpr size_t kMaxBos = 1u << 20;
constexpr size_t kMaxSecretBytes = 1024;
// Lanes a session opens at most, whatever its options and the server say (threads each).
constexpr uint32_t kMaxLanes = 15;
constexpr size_t kMaxSpareBuffers = 64;
// A serialized ChunkLocations entry is at most about 30 bytes: images whose table could pass
// the client's table limit do without one.
constexpr uint64_t kChunkTableBytesPerChunk = 32;
// How long the end of a placed restore (complete, cancelled, failed) waits for the server to end
// its placements and close: they take milliseconds; the destructor waits 2 s for the stream
// thread in all.
constexpr std::chrono::milliseconds kPlacementReleaseGrace{1500};

wire::ChunkRange ToRange(const ChunkRun& run) {
  wire::ChunkRange range;
  range.set_bo(run.bo);
  range.set_first_chunk(run.first);
  range.set_chunk_count(run.count);
  return range;
}

BoEntry ToEntry(const wire::BoInfo& info) {
  return BoEntry{info.process_id(), info.bo_index(),    info.gpu_id(),     info.gpu_va(),
                 info.size(),       info.alloc_flags(), info.chunk_count()};
}

bool SameBo(const BoEntry& a, const BoEntry& b) {
  return a.process_id == b.process_id && a.bo_index == b.bo_index && a.gpu_id == b.gpu_id &&
         a.size == b.size && a.chunk_count == b.chunk_count;
}

// A chunk on the demand connection is one someone waits for: its engine calls go first.
Urgency UrgencyOf(bool on_stream) {
  return on_stream ? Urgency::kBackground : Urgency::kUrgent;
}

}  // namespace

// Threads, and who owns what. Two io_contexts, each run by one thread:
//
// - The stream thread runs io_: Main (connect, back-off, reconnect), the stream connection's
//   reader and writer, and credit. It owns link_, backoff_timer_ and everything in a Link.
// - The demand thread runs demand_io_, only when options_.demand_connection: the demand
//   connection's handshake, reader and writer, the demand queue and the in-flight count. It owns
//   demand_link_, demand_queue_, demand_in_flight_ and everything in a DemandLink. Without a
//   demand connection, demand requests travel on the stream connection and that bookkeeping
//   runs on the stream thread instead (OnDemandThread posts to io_).
// - One thread reaches the other's state only by posting to its io_context. A Link and its
//   DemandLink know each other only by weak_ptr, so a handler queued on one io_context never
//   keeps alive an object bound to the other (demand_io_ is destroyed first; see the members).
// - mutex_ guards what both threads and the callers share: residency (and with it the landing
//   claim, taken in the same critical section as the duplicate check, so of two copies of a chunk
//   arriving on both connections at once exactly one is received and the other is dropped: no
//   chunk is applied twice), the counters, failure_ and the lifecycle flags.
// - engine_gate_ serializes the engine calls of all threads (CopyEngine: one caller at a
//   time; open for an engine with ConcurrentCalls, and not taken for the commits, releases and
//   Writes of one with ConcurrentCommits: commit_gate_). It is held around the call only, never
//   across a socket read. A thread installing a chunk someone waits for (the demand thread)
//   enters it urgently, ahead of the readers (engine_gate.h). Engine completions (OnWritten)
//   may run inside an engine call and take mutex_ and buffers_mutex_, never engine_gate_; so
//   the lock order is engine_gate_, then mutex_ or buffers_mutex_.
// - buffers_mutex_ guards the pool of spare staging buffers.
// - With image files passed (read_files on a Unix endpoint), a chunk that arrives by reference
//   is claimed by the thread that read its ChunkData frame and installed on a reader thread
//   (readers_), or, for the demand connection, on the demand thread itself: the read from the
//   file, verification and engine calls under engine_gate_. Stream chunks wait for a reader
//   in queued_reads_ (queued_mutex_, taken before mutex_, under no other lock); a chunk Ensure
//   waits for is read on the demand thread instead, whether it was queued before Ensure asked
//   (Expedite) or arrives after (QueueRead). With the image's chunk table, a chunk Ensure asks
//   for is claimed and read by the thread that called Ensure (demand_on_caller), or by the
//   demand thread otherwise; the server is asked only for what the table does not place.
//   Whatever the reader must hand back (a bad copy's credit and re-request) it posts to io_.

struct DemandLink;
struct LaneLink;

// The stream half of one connection generation: the stream socket and its writer. Shared by
// the coroutines serving it; dies with the last of them. Stream thread only.
struct Link : std::enable_shared_from_this<Link> {
  Link(net::Stream stream_socket, FrameLimits frame_limits)
      : stream(std::move(stream_socket)), limits(frame_limits), stream_writer(stream, limits) {}

  void Close() {
    if (closed) return;
    closed = true;
    stream_writer.Close();
    boost::system::error_code ignored;
    stream.close(ignored);
    CloseDemand();
    CloseLanes();
  }
  void Fail(Status status) {
    if (error.ok()) error = std::move(status);
    // A drain under way (Abort) ends at the server's close or when its grace runs out: a failure
    // elsewhere (the demand connection's) must not cut it short while the server may still be
    // writing into our memory.
    if (aborting) return;
    Close();
  }
  // The connection is going away but the chunks already in our receive buffer are good: stop
  // sending (a live server sees EOF and closes) and let the stream reader drain them to EOF.
  // `grace` bounds the drain should the server not close.
  void Abort(Status status, std::chrono::milliseconds grace) {
    if (error.ok()) error = std::move(status);
    if (closed || aborting) return;
    aborting = true;
    stream_writer.Close();
    boost::system::error_code ignored;
    stream.shutdown(net::Socket::shutdown_send, ignored);
    CloseDemand();
    CloseLanes();
    auto timer = std::make_shared<boost::asio::steady_timer>(stream.get_executor(), grace);
    timer->async_wait([this_link = weak_from_this(), timer](boost::system::error_code) {
      if (auto link = this_link.lock()) link->Close();
    });
  }
  // The demand half is the demand thread's: ask it to close there.
  void CloseDemand();
  // Each lane is its thread's: ask each to close there.
  void CloseLanes();

  net::Stream stream;
  FrameLimits limits;
  FrameWriter stream_writer;
  // Set once by RunAttempt after the demand connection joined; empty without one.
  std::weak_ptr<DemandLink> demand;
  boost::asio::any_io_executor demand_executor;
  // The image files the server passed for this connection's session: chunks arrive by
  // reference and are read from them. Null: chunks travel through the socket.
  std::shared_ptr<const ImageFileSet> files;
  // Lanes of this generation, each owned by its lane thread (registered on the stream thread
  // once joined).
  std::vector<std::pair<boost::asio::any_io_executor, std::weak_ptr<LaneLink>>> lanes;
  // StreamDone comes on every bulk connection, each after its own last chunk: the stream has
  // ended once it came on the stream connection and on every lane that joined (or is joining:
  // a lane refused or failing to connect is taken off). Stream thread.
  uint32_t bulk_connections = 1;
  uint32_t stream_done_marks = 0;
  // Granted to the server and not yet used by it: the stream thread adds, the thread receiving a
  // chunk (stream or lane) takes.
  std::atomic<uint64_t> credit_outstanding{0};
  // Credit of installed chunks not yet sent back (any thread adds; the stream thread takes it
  // all): completions that land while one return is queued ride along with it, so a stream of
  // small chunks sends one Credit frame per wake-up of the stream thread, not one per chunk.
  std::atomic<uint64_t> credit_to_return{0};
  bool closed = false;
  bool aborting = false;
  bool complete = false;  // closed because every chunk is resident
  // The server places chunks into our memory on this generation's session (PlaceInto taken).
  bool placing = false;
  Status error;  // the first transport error; retrying may help
};

// The demand half of one connection generation: the demand socket and its writer. Demand
// thread only.
struct DemandLink {
  DemandLink(net::Stream demand_socket, FrameLimits frame_limits, std::weak_ptr<Link> stream_link,
             std::shared_ptr<const ImageFileSet> image_files)
      : socket(std::move(demand_socket)),
        limits(frame_limits),
        writer(socket, limits),
        link(std::move(stream_link)),
        files(std::move(image_files)) {}

  void Close() {
    if (closed) return;
    closed = true;
    writer.Close();
    boost::system::error_code ignored;
    socket.close(ignored);
  }

  net::Stream socket;
  FrameLimits limits;
  FrameWriter writer;
  std::weak_ptr<Link> link;  // its stream half, to abort when this connection breaks
  std::shared_ptr<const ImageFileSet> files;  // as Link::files (the same set)
  bool closed = false;
};

// One more bulk connection of a connection generation (Hello.join_as_lane): it only receives
// stream chunks. Its lane thread only.
struct LaneLink {
  LaneLink(net::Stream lane_socket, FrameLimits frame_limits, std::weak_ptr<Link> stream_link)
      : socket(std::move(lane_socket)), limits(frame_limits), link(std::move(stream_link)) {}

  void Close() {
    if (closed) return;
    closed = true;
    boost::system::error_code ignored;
    socket.close(ignored);
  }

  net::Stream socket;
  FrameLimits limits;
  std::weak_ptr<Link> link;  // its stream half: credit, and to abort when this lane breaks
  bool closed = false;
};

void Link::CloseDemand() {
  if (demand.expired()) return;
  boost::asio::post(demand_executor, [weak = demand] {
    if (auto link = weak.lock()) link->Close();
  });
}

void Link::CloseLanes() {
  for (const auto& lane : lanes)
    boost::asio::post(lane.first, [weak = lane.second] {
      if (auto lane_link = weak.lock()) lane_link->Close();
    });
}

class RestoreSession::Impl {
 public:
  Impl(SessionOptions options, CopyEngine& engine)
      : options_(std::move(options)),
        engine_(engine),
        engine_gate_(!engine.ConcurrentCalls()),
        backoff_timer_(io_) {}
  ~Impl();

  Status Start();
  // Lowers the calling (background) thread's priority by options_.background_nice.
  void BackgroundPriority() const;
  Status Ensure(uint32_t bo, uint64_t offset, uint64_t length,
                std::optional<std::chrono::milliseconds> timeout);
  Status WaitHotSet(std::optional<std::chrono::milliseconds> timeout);
  Status WaitComplete(std::optional<std::chrono::milliseconds> timeout);
  Status AbandonedError(uint32_t bo, uint64_t offset, uint64_t length) const;
  bool IsResident(uint32_t bo, uint64_t offset, uint64_t length) const;
  Status Abandon(std::span<const uint32_t> bos);
  Progress progress() const;
  std::vector<DemandChunkTiming> demand_timings() const;
  Status status() const;
  void Cancel();

  // Immutable once Start has succeeded.
  std::vector<BoEntry> bos_;
  uint32_t chunk_size_ = 0;
  manifest::AccessProfile profile_;
  bool lazy_image_ = false;

 private:
  using ChunkId = std::pair<uint32_t, uint32_t>;  // BO, chunk

  // Stream thread.
  asio::awaitable<void> Main();
  asio::awaitable<Status> RunAttempt(bool first);
  asio::awaitable<Status> ReadStream(std::shared_ptr<Link> link);
  asio::awaitable<void> RunWriter(std::shared_ptr<Link> link);
  // Joins this attempt's demand connection beside its stream (JoinDemand on the demand thread)
  // and hands it to `link`; a join that fails aborts the stream half, to reconnect both.
  asio::awaitable<void> AttachDemand(std::shared_ptr<Link> link, wire::Hello join,
                                     FrameLimits limits, std::shared_ptr<const ImageFileSet> files);
  void ReturnCredit(const std::shared_ptr<Link>& link, uint64_t bytes);
  // Any thread: credit back to the server, at once on the stream thread, else posted there
  // (returns that land meanwhile ride along).
  void GiveBackCredit(const std::shared_ptr<Link>& link, uint64_t bytes);
  // StreamDone came on one more bulk connection (or a lane is off): once on all of them, asks
  // for anything the server never sent.
  void NoteStreamEnd(const std::shared_ptr<Link>& link);
  // Lanes asked for (options_.lanes less the stream connection), at most kMaxLanes.
  uint32_t WantedLanes() const { return std::min(LanesFor(options_.lanes) - 1, kMaxLanes); }
  // Lanes: starts `count` lane threads (once; the stream thread) and has each join `link`'s
  // session as a lane on its own thread.
  void StartLanes(const std::shared_ptr<Link>& link, const wire::Hello& join, FrameLimits limits,
                  uint32_t count);
  // `thread` is lane_threads_[index], looked up by the caller (the stream thread): a later
  // StartLanes may grow that vector while this runs on the lane's thread.
  struct LaneThread;
  asio::awaitable<void> RunLane(size_t index, LaneThread* thread, std::weak_ptr<Link> link,
                                wire::Hello join, FrameLimits limits);
  asio::awaitable<void> ReadLane(std::shared_ptr<LaneLink> lane);
  // The lane broke: close it and abort its stream half (which reconnects them all).
  void LoseLane(const std::shared_ptr<LaneLink>& lane, Status why);
  // Demand thread: connects and joins the session `join` names, installs the new DemandLink
  // and starts serving it. Returns it (weakly) to RunAttempt, or why it could not.
  asio::awaitable<std::pair<Status, std::weak_ptr<DemandLink>>> JoinDemand(
      std::weak_ptr<Link> link, wire::Hello join, FrameLimits limits,
      std::shared_ptr<const ImageFileSet> files);
  asio::awaitable<void> ReadDemand(std::shared_ptr<DemandLink> link);
  asio::awaitable<void> RunDemandWriter(std::shared_ptr<DemandLink> link);
  // The demand connection broke: close it and abort its stream half (which reconnects both).
  // `drain`: let the stream reader drain what it has received (Abort) rather than close now.
  void LoseDemand(const std::shared_ptr<DemandLink>& link, Status why, bool drain = true);
  // Demand bookkeeping: the demand thread (or the stream thread without a demand connection).
  void RestartDemand();  // a new connection: re-send every demand still pending
  // Asks for `chunks`, marked demanded (mutex_ held) by a caller that then read demand_epoch_
  // (under mutex_, in that critical section or a later one), unless a RestartDemand since took
  // its snapshot: that snapshot holds them and asked for them already.
  void QueueDemand(const std::vector<ChunkId>& chunks, uint64_t epoch);
  uint64_t DemandEpoch();
  // With a chunk table: claims and reads each chunk from the passed files on this thread;
  // returns those it cannot (no table, not located) for the server.
  std::vector<ChunkId> ReadLocally(const std::vector<ChunkId>& chunks);
  // Claims chunk `id` (mutex_ held) for a read from `files` where the chunk table places it;
  // nullopt when the table does not place it or the chunk is held already.
  std::optional<FileChunk> ClaimLocatedLocked(const ImageFileSet& files, ChunkId id);
  void PumpDemand();
  template <typename F>
  void OnDemandThread(F&& f);

  Status AdoptImage(const wire::OpenImageReply& reply, uint32_t max_payload);
  Status CheckSameImage(const wire::OpenImageReply& reply) const;
  // Reads a ChunkData frame's payload (its header already read) and installs the chunk: a RAW
  // chunk the engine lets us place goes straight into its destination and is verified there;
  // anything else is read into `payload` and goes through InstallChunk. `link` is the stream
  // half for a chunk on the stream connection (its credit), null on the demand connection;
  // `limits` and `files` are the connection's (files null when none were passed). A chunk by
  // reference goes to ReceiveByReference. *transport is set when the error is the connection's
  // (retrying may help), else the error is fatal. Runs on the thread that reads `socket`.
  asio::awaitable<Status> ReceiveChunk(const std::shared_ptr<Link>& link, net::Stream& socket,
                                       const FrameLimits& limits,
                                       const std::shared_ptr<const ImageFileSet>& files,
                                       const wire::Header& header, uint32_t payload_length,
                                       std::vector<uint8_t>& payload, bool on_stream,
                                       bool* transport);
  // The engine's destinations as PlaceInto frames for the server's offer: every BO's, on the
  // offer's kind of memory and device, or an error saying why not (no placement then).
  Result<std::vector<wire::Header>> PlacementFrames(const wire::PlacementOffer& offer);
  // A ChunkData frame with placed: the server wrote the chunk into our destination. Claims it and
  // marks it resident. Errors are the server's (fatal).
  Status ReceivePlaced(const std::shared_ptr<Link>& link, const wire::ChunkData& data,
                       uint32_t payload_length, bool on_stream, const DemandChunkTiming* timing);
  // A ChunkData frame with in_file: checks where it points, claims the chunk and hands it to a
  // reader thread. Errors are the server's (fatal).
  Status ReceiveByReference(const std::shared_ptr<Link>& link, const FrameLimits& limits,
                            const std::shared_ptr<const ImageFileSet>& files,
                            const wire::ChunkData& data, uint32_t payload_length, bool on_stream);
  // Reads the claimed chunk from the passed file into the engine: on a reader thread, or on
  // the demand thread (kUrgent) for a chunk someone waits for.
  void ReadByReference(const std::shared_ptr<Link>& link, const FileChunk& chunk, bool on_stream,
                       Urgency urgency);
  // Background chunks by reference wait here for a reader, oldest first. A chunk someone is
  // waiting for (Ensure marked it waited) never waits there: it is read at once on the demand
  // thread instead of after everything queued before it (with a large window that queue holds
  // thousands of chunks): QueueRead hands it over if it is waited for when it arrives, Expedite
  // takes it out if it was queued before.
  struct PendingRead {
    std::shared_ptr<Link> link;
    std::shared_ptr<const ImageFileSet> files;  // keeps the descriptor open
    FileChunk chunk;
  };
  void QueueRead(PendingRead read);                         // stream thread
  std::optional<PendingRead> TakeQueuedLocked(ChunkId id);  // queued_mutex_ held
  void ReadNextQueued();                              // a reader's turn: the oldest still queued
  void Expedite(const std::vector<ChunkId>& chunks);  // on the demand thread
  // Checks a chunk's header against the table and the credit, counts it, and claims the chunk
  // (landing) unless it is already held. *duplicate: already held; its bytes must be dropped
  // (the caller returns the credit). A claimed chunk must be installed or Unclaim'ed.
  Status AcceptChunk(const std::shared_ptr<Link>& link, const wire::ChunkData& data,
                     uint64_t wire_bytes, bool on_stream, bool* duplicate);
  void Unclaim(uint32_t bo, uint32_t chunk);
  // A claimed chunk whose payload is in `payload`: decode, verify, hand to Write.
  // `timing`: a timed demand chunk's record so far (decoding and verifying count as hashing).
  Status InstallChunk(const std::shared_ptr<Link>& link, const wire::ChunkData& data,
                      std::vector<uint8_t>& payload, bool on_stream,
                      DemandChunkTiming* timing = nullptr);
  // A claimed CODEC_ZERO chunk with no payload, for an engine that WritesZeros: checked against
  // the zero bytes' checksum, then zeroed by the engine (a bad checksum is a bad copy).
  Status InstallZeros(const std::shared_ptr<Link>& link, const wire::ChunkData& data,
                      bool on_stream, DemandChunkTiming* timing);
  // Runs `call` (an engine write, given a copy of `timing` for its done) inside the engine gate
  // at the chunk's urgency; an error names the chunk (`what`) and the engine.
  template <typename EngineCall>
  Status CallEngine(bool on_stream, DemandChunkTiming* timing, std::string_view what,
                    EngineCall&& call);
  // A chunk's bad copies so far, and the demand epoch read when it was marked demanded.
  struct BadCopies {
    uint32_t count = 0;
    uint64_t demand_epoch = 0;
  };
  // A landing chunk whose copy failed verification: back to missing, counted, and marked
  // demanded, and the demand epoch read, all under one lock. Done in separate steps, the
  // stream's end could see the chunk missing and unrequested in between and demand it a second
  // time; and an epoch read later could be that of a demand connection whose restart already
  // asked for the chunk. Either extra copy could land after a second bad one had failed the
  // restore.
  BadCopies UnclaimBadCopy(uint32_t bo, uint32_t chunk);
  // After UnclaimBadCopy: re-request once, or fail for good (returned).
  Status BadCopy(const std::shared_ptr<Link>& link, uint32_t bo, uint32_t chunk,
                 uint64_t wire_bytes, bool on_stream, const Status& why, BadCopies bad_copies);
  // Any thread (the engine decides where completions run). `timing`: a timed demand chunk's
  // record so far, completed and kept once the chunk is resident.
  void OnWritten(const Status& status, const std::shared_ptr<Link>& link, ChunkId id,
                 const std::shared_ptr<std::vector<uint8_t>>& staging, uint64_t credit,
                 const DemandChunkTiming* timing = nullptr);
  // Demand thread: a timing record for a chunk arriving on the demand connection now, if the
  // request that asked for it was timed (demand_asked_).
  std::optional<DemandChunkTiming> StartDemandTiming(ChunkId id);
  void KeepDemandTiming(DemandChunkTiming timing);
  Status HandleErrorFrame(const wire::Error& error, std::string_view connection);
  void Fail(const Status& status);
  // On the stream thread, for a Cancel, a Fail or completion: ends `link`, and where the server
  // places chunks, only once it has let go of our memory (or after a grace): the stream reader
  // then drains to the server's close.
  void EndLink(Link& link, const Status& why);
  bool Failed() const;
  std::string What(uint32_t bo, uint32_t chunk) const;
  std::shared_ptr<std::vector<uint8_t>> TakeBuffer();
  void ReturnBuffer(std::vector<uint8_t> buffer);
  // Waits (lock held) until done() or the session failed or `timeout` past `since` (the
  // caller's start) passed.
  template <typename Done>
  Status WaitFor(std::unique_lock<std::mutex>& lock, Done done,
                 std::optional<std::chrono::milliseconds> timeout, std::string_view what,
                 Clock::time_point since = Clock::now());

  // Immutable once Start has begun (endpoint_, transport_) or the image is open (hot_chunks_).
  SessionOptions options_;
  CopyEngine& engine_;
  net::Endpoint endpoint_;
  net::ClientTransport transport_;
  std::vector<ChunkId> hot_chunks_;

  mutable std::mutex mutex_;  // guards everything below up to the engine section
  std::condition_variable cv_;
  ResidencyMap residency_;
  Status failure_;
  bool started_ = false;
  bool opened_ = false;
  bool finished_ = false;         // Main has returned
  bool demand_finished_ = false;  // the demand thread's loop has returned
  Progress counters_;
  // The latest passed image files that came with a chunk table (options_.local_demand): Ensure
  // reads the chunks it waits for from them itself when options_.demand_on_caller.
  std::shared_ptr<const ImageFileSet> demand_files_;
  // The stream reader's time split (Progress::stream_wait_s / stream_chunk_s), kept out of
  // mutex_: added once per frame by the one thread that reads the stream.
  std::atomic<uint64_t> stream_wait_ns_{0};
  std::atomic<uint64_t> stream_chunk_ns_{0};
  // Progress::file_read_s / file_engine_s: every thread that installs by-reference chunks.
  FileReadTimes file_times_;
  // Chunks installed by reference with no checksum to verify (Progress::unchecked_chunks).
  std::atomic<uint64_t> unchecked_chunks_{0};
  // Zero chunks read by reference that the engine zeroed (Progress::zero_filled_*).
  std::atomic<uint64_t> file_zero_chunks_{0};
  std::atomic<uint64_t> file_zero_bytes_{0};
  std::atomic<bool> cancelled_{false};

  // The latest demand timings (a ring of RestoreSession::kDemandTimings); a leaf lock.
  mutable std::mutex timings_mutex_;
  RecentValues<DemandChunkTiming> demand_timings_{RestoreSession::kDemandTimings};

  EngineGate engine_gate_;  // held around every engine_ call, and only there
  // The gate for the calls that hand back a filled buffer (commits, releases, Write): none for an
  // engine that takes them from several threads at once (CopyEngine::ConcurrentCommits), so one
  // thread's slow commit (a kernel launch) does not hold the other's ReceiveTarget.
  EngineGate* const commit_gate_ = engine_.ConcurrentCommits() ? nullptr : &engine_gate_;
  ChunkBufferPool file_buffers_{kMaxSpareBuffers};  // staging for encoded chunks read by reference

  std::mutex buffers_mutex_;
  std::vector<std::vector<uint8_t>> spare_buffers_;  // guarded by buffers_mutex_

  std::atomic<uint64_t> next_request_id_{1};  // both connections number their requests

  // Stream thread only. io_ first: it outlives the objects bound to it, and it must outlive
  // demand_io_, whose queued handlers may own the stream thread's suspended coroutines.
  asio::io_context io_;
  asio::steady_timer backoff_timer_;
  std::shared_ptr<Link> link_;
  bool attempt_opened_ = false;
  // The last session opened (stream thread): a reconnect's OpenImage names it.
  std::optional<EarlierSession> earlier_session_;
  uint64_t window_ = 0;

  // Demand thread only (with a demand connection; otherwise the stream thread's).
  asio::io_context demand_io_;
  // Keeps demand_io_ running between connections; Main drops it when the session ends.
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> demand_work_;
  std::shared_ptr<DemandLink> demand_link_;
  std::deque<ChunkId> demand_queue_;
  uint32_t demand_in_flight_ = 0;  // demand chunks asked for and not yet received
  // When each chunk asked for on the demand connection was asked, until its reply arrives.
  std::map<ChunkId, Clock::time_point> demand_asked_;
  // RestartDemand's snapshots so far (guarded by mutex_): a demand posted before the latest
  // snapshot was taken is in it, and sending it again would fetch its chunks twice.
  uint64_t demand_epoch_ = 0;

  // Lane threads, each running its io_context: made by the stream thread when a connection
  // first has lanes, never removed before the destructor. `current` is its thread's.
  struct LaneThread {
    asio::io_context io;
    std::optional<asio::executor_work_guard<asio::io_context::executor_type>> work;
    std::shared_ptr<LaneLink> current;
    std::thread thread;
  };
  std::vector<std::unique_ptr<LaneThread>> lane_threads_;
  std::atomic<uint32_t> lanes_joined_{0};  // Progress::lanes
  // The current connection's server places chunks (PlaceInto accepted): requests ask for it.
  std::atomic<bool> placing_{false};
  std::atomic<uint64_t> lane_bytes_{0};  // Progress::lane_bytes

  std::thread thread_;         // runs io_
  std::thread demand_thread_;  // runs demand_io_
  // Reader threads for chunks by reference (read_files on a Unix endpoint); joined after the
  // two above and before the final engine Flush.
  std::optional<asio::thread_pool> readers_;
  uint32_t file_reader_count_ = 0;  // readers_' threads: set by Start with readers_
  std::mutex queued_mutex_;         // guards queued_reads_, queued_order_; taken before mutex_
  std::map<ChunkId, PendingRead> queued_reads_;
  std::deque<ChunkId> queued_order_;  // may name chunks Expedite took (skipped)
};

// ---- public surface ----

RestoreSession::Impl::~Impl() {
  Cancel();
  if (thread_.joinable()) {
    // Give the coroutines a moment to unwind on their own; a peer that never answers a connect
    // must not hold the destructor, so stop the loops after that.
    {
      std::unique_lock lock(mutex_);
      cv_.wait_for(lock, std::chrono::seconds(2),
                   [&] { return finished_ && (demand_finished_ || !demand_thread_.joinable()); });
    }
    io_.stop();
    demand_io_.stop();
    thread_.join();
    if (demand_thread_.joinable()) demand_thread_.join();
  }
  // Made by the stream thread, which has ended: the vector is ours now.
  for (const std::unique_ptr<LaneThread>& lane : lane_threads_) {
    lane->io.stop();
    if (lane->thread.joinable()) lane->thread.join();
  }
  if (readers_) readers_->join();
  // Engine callbacks hold our staging buffers and call OnWritten; let them all run first.
  if (started_) {
    std::lock_guard engine_lock(engine_gate_);
    (void)engine_.Flush();
  }
}

Status RestoreSession::Impl::Start() {
  {
    std::lock_guard lock(mutex_);
    if (started_) return InvalidArgument("RestoreSession::Start called twice");
  }
  GPULAZY_ASSIGN_OR_RETURN(endpoint_, net::Endpoint::Parse(options_.endpoint));
  if (options_.image.empty()) return InvalidArgument("no image name given");
  // Certificates are loaded once; every reconnect reuses them.
  GPULAZY_ASSIGN_OR_RETURN(transport_,
                           net::ClientTransport::Make(options_.tls, options_.insecure_tcp));
  if (options_.background_nice < 0 || options_.background_nice > 19)
    return InvalidArgument("background_nice must be 0..19, not {}", options_.background_nice);
  if (options_.read_files && endpoint_.kind == net::Endpoint::Kind::kUnix) {
    file_reader_count_ = WritersFor(options_.file_readers, engine_);
    readers_.emplace(file_reader_count_);
    net::RunOnEachPoolThread(*readers_, file_reader_count_, [this] {
      net::NameThisThread("gl-file-reader");
      BackgroundPriority();
    });
  }
  {
    std::lock_guard lock(mutex_);
    started_ = true;
  }
  asio::co_spawn(io_, Main(), asio::detached);
  if (options_.demand_connection) {
    demand_work_.emplace(demand_io_.get_executor());
    demand_thread_ = std::thread([this] {
      net::NameThisThread("gl-demand");
      demand_io_.run();
      {
        std::lock_guard lock(mutex_);
        demand_finished_ = true;
      }
      cv_.notify_all();
    });
  }
  thread_ = std::thread([this] {
    net::NameThisThread("gl-stream");
    BackgroundPriority();
    io_.run();
  });
  std::unique_lock lock(mutex_);
  cv_.wait(lock, [&] { return opened_ || !failure_.ok(); });
  // Opened is success, even if the restore failed in the moment before this thread woke (a fast
  // host can fetch two bad copies of a chunk by then): that failure is the restore's, reported
  // by WaitComplete, Ensure and status(), so what Start returns does not depend on timing.
  return opened_ ? Status::Ok() : failure_;
}

void RestoreSession::Impl::BackgroundPriority() const {
  // Best effort: a thread that cannot be made nicer still does its work.
  Status lowered = net::LowerThisThreadPriority(options_.background_nice);
  if (!lowered.ok())
    spdlog::warn("image {}: background thread keeps its priority: {}", options_.image,
                 lowered.message());
}

Status RestoreSession::Impl::status() const {
  std::lock_guard lock(mutex_);
  return failure_;
}

bool RestoreSession::Impl::Failed() const {
  std::lock_guard lock(mutex_);
  return !failure_.ok();
}

template <typename F>
void RestoreSession::Impl::OnDemandThread(F&& f) {
  if (options_.demand_connection)
    asio::post(demand_io_, std::forward<F>(f));
  else
    asio::post(io_, std::forward<F>(f));
}

void RestoreSession::Impl::Fail(const Status& status) {
  {
    std::lock_guard lock(mutex_);
    if (!failure_.ok()) return;
    failure_ = status;
  }
  spdlog::error("restore of image {}: {}", options_.image, status.ToString());
  cv_.notify_all();
  asio::post(io_, [this, status] {
    if (link_) EndLink(*link_, status);
    backoff_timer_.cancel();
  });
  if (options_.demand_connection) {
    asio::post(demand_io_, [this] {
      if (demand_link_) demand_link_->Close();
    });
  }
}

void RestoreSession::Impl::EndLink(Link& link, const Status& why) {
  if (link.placing) {
    // The server writes into our memory: it closes the connection only once its placements have
    // ended and it let go of our destinations (docs/protocol.md, "Placement", 5). Until that
    // close the engine must not free them, so half-close and drain to it (bounded).
    link.Abort(why, std::min(options_.handshake_timeout, kPlacementReleaseGrace));
  } else {
    link.Close();
  }
}

void RestoreSession::Impl::Cancel() {
  cancelled_ = true;
  bool started;
  {
    std::lock_guard lock(mutex_);
    started = started_;
    if (failure_.ok() && !(opened_ && residency_.complete()))
      failure_ = Aborted("restore of image {} cancelled", options_.image);
  }
  cv_.notify_all();
  if (started) {
    asio::post(io_, [this] {
      if (link_) EndLink(*link_, Aborted("restore of image {} cancelled", options_.image));
      backoff_timer_.cancel();
    });
    if (options_.demand_connection) {
      asio::post(demand_io_, [this] {
        if (demand_link_) demand_link_->Close();
      });
    }
  }
}

template <typename Done>
Status RestoreSession::Impl::WaitFor(std::unique_lock<std::mutex>& lock, Done done,
                                     std::optional<std::chrono::milliseconds> timeout,
                                     std::string_view what, Clock::time_point since) {
  auto stop = [&] { return done() || !failure_.ok(); };
  if (timeout) {
    if (!cv_.wait_until(lock, since + *timeout, stop))
      return TimedOut("image {}: {} not resident after {} ms", options_.image, what,
                      timeout->count());
  } else {
    cv_.wait(lock, stop);
  }
  if (done()) return Status::Ok();
  return failure_;
}

Status RestoreSession::Impl::Ensure(uint32_t bo, uint64_t offset, uint64_t length,
                                    std::optional<std::chrono::milliseconds> timeout) {
  const Clock::time_point called = Clock::now();
  std::unique_lock lock(mutex_);
  if (!opened_) return InvalidArgument("Ensure on a session that has not started");
  if (bo >= residency_.bo_count())
    return OutOfRange("image {}: BO {} out of range ({} BOs)", options_.image, bo,
                      residency_.bo_count());
  if (length == 0) return Status::Ok();
  Result<ChunkRun> covering = residency_.Covering(bo, offset, length);
  if (!covering.ok()) return covering.status().Context(fmt::format("image {}", options_.image));
  const ChunkRun run = *covering;
  std::vector<ChunkId> wanted;
  std::vector<ChunkId> landing;  // claimed, maybe still queued for a file reader
  // Checked before any chunk is marked: a chunk marked demanded here must also be asked for.
  for (uint32_t i = 0; i < run.count; ++i)
    if (residency_.abandoned(bo, run.first + i)) return AbandonedError(bo, offset, length);
  for (uint32_t i = 0; i < run.count; ++i) {
    uint32_t chunk = run.first + i;
    if (residency_.resident(bo, chunk)) continue;
    // From now on it goes ahead of background chunks wherever it is claimed (QueueRead), and
    // its landing wakes us.
    residency_.set_waited(bo, chunk);
    if (residency_.held(bo, chunk)) {
      if (readers_) landing.emplace_back(bo, chunk);
      continue;
    }
    if (residency_.demanded(bo, chunk)) continue;
    residency_.set_demanded(bo, chunk);
    wanted.emplace_back(bo, chunk);
  }
  // With the chunk table, what the files hold is read right here: handing it to the demand
  // thread would put one more thread wake-up on a fault's path (docs/benchmarks.md, session 12).
  std::vector<FileChunk> read_here;
  struct AskedChunk {
    ChunkId id;
    uint64_t length = 0;
  };
  std::vector<AskedChunk> asked;  // of the server, on the demand thread
  std::shared_ptr<const ImageFileSet> files;
  if (!wanted.empty()) {
    counters_.demand_chunks += wanted.size();
    if (options_.demand_on_caller && demand_files_) {
      files = demand_files_;
      std::erase_if(wanted, [&](const ChunkId& id) {
        std::optional<FileChunk> c = ClaimLocatedLocked(*files, id);
        if (c) read_here.push_back(*c);
        return c.has_value();
      });
    }
    for (const ChunkId& id : wanted)
      asked.push_back(AskedChunk{id, residency_.ChunkLength(id.first, id.second)});
    if (!wanted.empty())
      OnDemandThread([this, wanted = std::move(wanted), epoch = demand_epoch_] {
        QueueDemand(wanted, epoch);
      });
  }
  if (!landing.empty()) OnDemandThread([this, landing = std::move(landing)] { Expedite(landing); });
  if (!read_here.empty() || !asked.empty()) {
    // Not under mutex_: the install takes engine_gate_, which comes first in the lock order.
    lock.unlock();
    for (const FileChunk& c : read_here)
      ReadByReference(nullptr, c, /*on_stream=*/false, Urgency::kUrgent);
    // Idle until the server's answer arrives: ready the destination meanwhile (CopyEngine::
    // PrepareDestination), so its pages are not allocated on the receive's path. The demand
    // thread just woken may have been queued on this CPU: let it send the request first.
    // Within the caller's timeout: a large range's pages are prepared only while it would wait.
    if (!asked.empty()) sched_yield();
    const std::optional<Clock::time_point> deadline =
        timeout ? std::optional(called + *timeout) : std::nullopt;
    for (const auto& [id, chunk_length] : asked) {
      if (deadline && Clock::now() >= *deadline) break;
      engine_.PrepareDestination(id.first, uint64_t{id.second} * chunk_size_, chunk_length);
    }
    lock.lock();
  }
  // Chunks become resident in any order; remember how far the prefix is known to be resident.
  // A chunk abandoned meanwhile (Abandon) ends the wait too.
  uint32_t next = run.first;
  bool abandoned = false;
  auto done = [&] {
    while (next < run.first + run.count && residency_.resident(bo, next))
      ++next;
    for (uint32_t chunk = next; chunk < run.first + run.count && !abandoned; ++chunk)
      abandoned = residency_.abandoned(bo, chunk);
    return abandoned || next == run.first + run.count;
  };
  Status waited = WaitFor(lock, done, timeout,
                          fmt::format("BO {} range [{}, +{})", bo, offset, length), called);
  if (waited.ok() && abandoned) return AbandonedError(bo, offset, length);
  return waited;
}

Status RestoreSession::Impl::AbandonedError(uint32_t bo, uint64_t offset, uint64_t length) const {
  return Aborted("image {}: BO {} range [{}, +{}) was abandoned: it is no longer fetched",
                 options_.image, bo, offset, length);
}

Status RestoreSession::Impl::Abandon(std::span<const uint32_t> bos) {
  std::vector<ChunkRun> runs;
  bool complete = false;
  {
    std::lock_guard lock(mutex_);
    if (!opened_) return InvalidArgument("Abandon on a session that has not started");
    for (uint32_t bo : bos)
      if (bo >= residency_.bo_count())
        return OutOfRange("image {}: cannot abandon BO {}: the image has {} BOs", options_.image,
                          bo, residency_.bo_count());
    const bool was_complete = residency_.complete();
    for (uint32_t bo : bos)
      residency_.Abandon(bo, &runs);
    complete = !was_complete && residency_.complete();
  }
  if (runs.empty()) return Status::Ok();
  // Callers of Ensure waiting for these chunks, and WaitHotSet / WaitComplete, re-check.
  cv_.notify_all();
  uint64_t chunks = 0;
  for (const ChunkRun& run : runs)
    chunks += run.count;
  spdlog::info("image {}: {} BO(s) abandoned, {} chunk(s) no longer fetched{}", options_.image,
               bos.size(), chunks, complete ? "; every other chunk is resident" : "");
  // The connection is the stream thread's. Without one now (reconnecting), the next one's Have
  // covers these chunks: they count as held.
  asio::post(io_, [this, runs = std::move(runs), complete] {
    if (!link_) return;
    if (complete) {
      link_->complete = true;
      EndLink(*link_, Status::Ok());
      return;
    }
    for (wire::Header& have : HaveFrames(runs))
      link_->stream_writer.Send(std::move(have));
  });
  return Status::Ok();
}

Status RestoreSession::Impl::WaitHotSet(std::optional<std::chrono::milliseconds> timeout) {
  std::unique_lock lock(mutex_);
  if (!opened_) return InvalidArgument("WaitHotSet on a session that has not started");
  size_t next = 0;
  auto done = [&] {
    while (next < hot_chunks_.size() &&
           residency_.settled(hot_chunks_[next].first, hot_chunks_[next].second))
      ++next;
    return next == hot_chunks_.size();
  };
  return WaitFor(lock, done, timeout, "the hot set");
}

Status RestoreSession::Impl::WaitComplete(std::optional<std::chrono::milliseconds> timeout) {
  std::unique_lock lock(mutex_);
  if (!opened_) return InvalidArgument("WaitComplete on a session that has not started");
  return WaitFor(
      lock, [&] { return residency_.complete(); }, timeout, "the whole image");
}

bool RestoreSession::Impl::IsResident(uint32_t bo, uint64_t offset, uint64_t length) const {
  std::lock_guard lock(mutex_);
  if (!opened_ || bo >= residency_.bo_count()) return false;
  if (length == 0) return true;
  Result<ChunkRun> run = residency_.Covering(bo, offset, length);
  return run.ok() && residency_.AllResident(*run);
}

Progress RestoreSession::Impl::progress() const {
  std::lock_guard lock(mutex_);
  Progress p = counters_;
  p.stream_wait_s = static_cast<double>(stream_wait_ns_.load(std::memory_order_relaxed)) / 1e9;
  p.stream_chunk_s = static_cast<double>(stream_chunk_ns_.load(std::memory_order_relaxed)) / 1e9;
  p.unchecked_chunks = unchecked_chunks_.load(std::memory_order_relaxed);
  p.zero_filled_chunks += file_zero_chunks_.load(std::memory_order_relaxed);
  p.zero_filled_bytes += file_zero_bytes_.load(std::memory_order_relaxed);
  p.lanes = lanes_joined_.load(std::memory_order_relaxed);
  p.lane_bytes = lane_bytes_.load(std::memory_order_relaxed);
  p.file_read_s = file_times_.read_s();
  p.file_engine_s = file_times_.engine_s();
  p.file_gate_wait_s = file_times_.gate_wait_s();
  p.total_bytes = residency_.total_bytes();
  p.total_chunks = residency_.total_chunks();
  p.resident_bytes = residency_.resident_bytes();
  p.resident_chunks = residency_.resident_chunks();
  p.abandoned_chunks = residency_.abandoned_chunks();
  p.abandoned_bytes = residency_.abandoned_bytes();
  p.hot_chunks = hot_chunks_.size();
  p.hot_resident_chunks = 0;
  for (const ChunkId& id : hot_chunks_)
    if (residency_.resident(id.first, id.second)) ++p.hot_resident_chunks;
  p.complete = opened_ && residency_.complete();
  return p;
}

std::string RestoreSession::Impl::What(uint32_t bo, uint32_t chunk) const {
  if (bo < bos_.size()) {
    const BoEntry& e = bos_[bo];
    return fmt::format("image {}, BO {} (process {}, bo_index {}, gpu {:04x}), chunk {}",
                       options_.image, bo, e.process_id, e.bo_index, e.gpu_id, chunk);
  }
  return fmt::format("image {}, BO {}, chunk {}", options_.image, bo, chunk);
}

// ---- the stream thread ----

asio::awaitable<void> RestoreSession::Impl::Main() {
  try {
    auto resident_chunks = [this] {
      std::lock_guard lock(mutex_);
      return residency_.resident_chunks();
    };
    Clock::time_point attempt_began = Clock::now();
    uint64_t resident_before = 0;
    Status status = co_await RunAttempt(/*first=*/true);
    uint32_t attempts = 0;
    Clock::time_point lost_at;
    for (;;) {
      // A connection that opened the image and then brought chunks in, or held for a while, was
      // a working one: counting starts again. One that breaks the same way each time it opens
      // (a server that drops it at once, a frame we cannot send) counts as a failed attempt, so
      // the session gives up with that reason instead of reconnecting forever.
      if (attempt_opened_ && (resident_chunks() > resident_before ||
                              Clock::now() - attempt_began >= options_.reconnect.max_backoff))
        attempts = 0;
      attempt_opened_ = false;
      {
        std::lock_guard lock(mutex_);
        if (!opened_ && failure_.ok()) failure_ = status;  // Start reports it
        if (!failure_.ok() || residency_.complete()) break;
      }
      if (status.ok()) break;
      if (attempts == 0) lost_at = Clock::now();
      ++attempts;
      const ReconnectPolicy& policy = options_.reconnect;
      if (attempts > policy.max_attempts || Clock::now() - lost_at > policy.deadline) {
        Fail(
            Unavailable("image {}: lost the connection to {} and gave up after {} reconnect "
                        "attempt(s): {}",
                        options_.image, endpoint_.ToString(), attempts - 1, status.ToString()));
        break;
      }
      auto delay = std::min(policy.max_backoff,
                            policy.initial_backoff * (int64_t{1} << std::min(attempts - 1, 20u)));
      spdlog::warn("image {}: connection to {} lost ({}); reconnect attempt {} in {} ms",
                   options_.image, endpoint_.ToString(), status.ToString(), attempts,
                   delay.count());
      backoff_timer_.expires_after(delay);
      boost::system::error_code ec;
      co_await backoff_timer_.async_wait(asio::redirect_error(asio::use_awaitable, ec));
      if (cancelled_ || Failed()) break;
      attempt_began = Clock::now();
      resident_before = resident_chunks();
      status = co_await RunAttempt(/*first=*/false);
    }
  } catch (const std::exception& e) {
    Fail(Internal("image {}: restore loop failed: {}", options_.image, e.what()));
  }
  if (link_) link_->Close();
  link_.reset();
  for (const std::unique_ptr<LaneThread>& lane : lane_threads_)
    asio::post(lane->io, [lane = lane.get()] {
      if (lane->current) lane->current->Close();
      lane->current.reset();
      lane->work.reset();
    });
  if (options_.demand_connection) {
    // Let the demand thread's loop end once its coroutines have unwound.
    asio::post(demand_io_, [this] {
      if (demand_link_) demand_link_->Close();
      demand_link_.reset();
      demand_work_.reset();
    });
  }
  Status flushed;
  {
    std::lock_guard engine_lock(engine_gate_);
    flushed = engine_.Flush();
  }
  if (!flushed.ok()) Fail(flushed.Context(fmt::format("flushing the {} engine", engine_.name())));
  {
    std::lock_guard lock(mutex_);
    if (!opened_ && failure_.ok()) failure_ = Internal("restore ended before the image opened");
    finished_ = true;
  }
  cv_.notify_all();
}

Status RestoreSession::Impl::AdoptImage(const wire::OpenImageReply& reply, uint32_t max_payload) {
  const std::string& image = options_.image;
  if (reply.chunk_size() == 0 || reply.chunk_size() > max_payload)
    return Corrupt("image {}: server announced chunk size {} (max payload {})", image,
                   reply.chunk_size(), max_payload);
  if (static_cast<size_t>(reply.bos_size()) > kMaxBos)
    return Corrupt("image {}: server lists {} BOs (limit {})", image, reply.bos_size(), kMaxBos);
  std::vector<BoEntry> bos;
  std::vector<uint64_t> sizes;
  for (const wire::BoInfo& info : reply.bos()) {
    BoEntry entry = ToEntry(info);
    if (entry.chunk_count != ResidencyMap::ChunkCountFor(entry.size, reply.chunk_size()))
      return Corrupt("image {}: BO {} has {} bytes but {} chunks of {} bytes", image, bos.size(),
                     entry.size, entry.chunk_count, reply.chunk_size());
    sizes.push_back(entry.size);
    bos.push_back(entry);
  }
  GPULAZY_ASSIGN_OR_RETURN(ResidencyMap residency, ResidencyMap::Create(reply.chunk_size(), sizes));
  std::vector<ChunkId> hot;
  const manifest::AccessProfile& profile = reply.profile();
  size_t hot_count = std::min<size_t>(profile.hot_count(), profile.order_size());
  for (size_t i = 0; i < hot_count; ++i) {
    const manifest::ChunkRef& ref = profile.order(static_cast<int>(i));
    Status valid = residency.CheckChunk(ref.bo(), ref.chunk());
    if (!valid.ok())
      return valid.Context(fmt::format("image {}: access profile entry {}", image, i));
    hot.emplace_back(ref.bo(), ref.chunk());
    residency.set_hot(ref.bo(), ref.chunk());
  }
  // Destinations before anything streams: the engine must have somewhere to put the bytes.
  std::lock_guard engine_lock(engine_gate_);
  // The writers we plan, before the chunk size, so that an engine sizes its staging to them: the
  // file readers, or one thread per bulk connection when the bytes come through the socket (as
  // many as asked for). Each connection says again what it ended up with (RunAttempt).
  engine_.ExpectWriters(readers_ ? file_reader_count_ : 1 + WantedLanes());
  if (Status expected = engine_.ExpectChunkBytes(reply.chunk_size()); !expected.ok())
    return expected.Context(fmt::format("image {}: preparing the {} engine for {}-byte chunks",
                                        image, engine_.name(), reply.chunk_size()));
  for (uint32_t bo = 0; bo < bos.size(); ++bo) {
    Status created = engine_.AddDestination(bo, bos[bo].size);
    if (!created.ok())
      return created.Context(fmt::format("image {}: creating the {} engine's destination for BO {}",
                                         image, engine_.name(), bo));
  }
  bos_ = std::move(bos);
  chunk_size_ = reply.chunk_size();
  profile_ = profile;
  lazy_image_ = reply.lazy_image();
  hot_chunks_ = std::move(hot);
  {
    std::lock_guard lock(mutex_);
    residency_ = std::move(residency);
    opened_ = true;
  }
  cv_.notify_all();
  return Status::Ok();
}

Status RestoreSession::Impl::CheckSameImage(const wire::OpenImageReply& reply) const {
  bool same =
      reply.chunk_size() == chunk_size_ && static_cast<size_t>(reply.bos_size()) == bos_.size();
  for (size_t i = 0; same && i < bos_.size(); ++i)
    same = SameBo(ToEntry(reply.bos(static_cast<int>(i))), bos_[i]);
  if (!same)
    return Corrupt(
        "image {}: after reconnecting, {} serves a different image ({} BOs, chunk size "
        "{}; we restored {} BOs, chunk size {}); refusing to mix their contents",
        options_.image, endpoint_.ToString(), reply.bos_size(), reply.chunk_size(), bos_.size(),
        chunk_size_);
  return Status::Ok();
}

asio::awaitable<Status> RestoreSession::Impl::RunAttempt(bool first) {
  // Fatal problems go through Fail (no retry); a returned error means "retry may help".
  wire::Hello hello;
  hello.set_min_version(kMinProtocolVersion);
  hello.set_max_version(kProtocolVersion);
  hello.set_client_name(ToValidUtf8(options_.client_name));
  hello.set_token(options_.token);
  bool refused = false;
  Result<Handshake> stream =
      co_await ConnectAndHello(endpoint_, transport_, hello, options_.handshake_timeout, &refused);
  if (!stream.ok()) {
    if (refused) Fail(stream.status());
    co_return stream.status();
  }
  FrameLimits limits;
  uint32_t announced = stream->reply.max_payload();
  limits.max_payload =
      std::min(announced == 0 ? limits.max_payload : announced, kMaxAcceptedPayload);
  window_ = std::max<uint64_t>(options_.window_bytes, limits.max_payload);
  if (options_.window_bytes < limits.max_payload && first)
    spdlog::info("image {}: window raised from {} to the server's max payload {} bytes",
                 options_.image, options_.window_bytes, limits.max_payload);

  Result<wire::OpenImageReply> reply =
      co_await OpenImage(stream->socket, options_.image, stream->reply.version(), limits,
                         options_.handshake_timeout, &refused, earlier_session_);
  if (!reply.ok()) {
    if (refused) Fail(reply.status());
    co_return reply.status();
  }
  if (reply->session_secret().size() > kMaxSecretBytes) {
    Fail(Corrupt("image {}: session secret of {} bytes", options_.image,
                 reply->session_secret().size()));
    co_return Status::Ok();
  }
  // The next attempt's new session supersedes this one: its server-side copies into our memory
  // end before that one begins, however this connection ends.
  earlier_session_ = EarlierSession{reply->session(), reply->session_secret()};
  Status table = first ? AdoptImage(*reply, limits.max_payload) : CheckSameImage(*reply);
  if (!table.ok()) {
    Fail(table);
    co_return table;
  }
  if (first) {
    spdlog::info("image {}: opened on {}: {} BOs, chunk size {}, hot set {} chunks, session {}",
                 options_.image, endpoint_.ToString(), bos_.size(), chunk_size_, hot_chunks_.size(),
                 reply->session());
  }
  {
    std::lock_guard lock(mutex_);
    if (residency_.complete()) co_return Status::Ok();  // nothing (left) to stream
  }

  // Placement first: a server that writes the chunks into our destinations needs no files,
  // and chunks read from files beside it could land on a chunk it is placing.
  bool placing = false;
  if (options_.accept_placement && stream->reply.has_placement() &&
      endpoint_.kind == net::Endpoint::Kind::kUnix) {
    Result<std::vector<wire::Header>> frames = PlacementFrames(stream->reply.placement());
    if (frames.ok()) {
      bool placement_refused = false;
      Status handed = co_await PlaceInto(stream->socket, std::move(*frames), limits,
                                         options_.handshake_timeout, &placement_refused);
      if (handed.ok()) {
        placing = true;
        std::lock_guard lock(mutex_);
        if (counters_.placement_answered_at == Clock::time_point{})
          counters_.placement_answered_at = Clock::now();
      }
      if (handed.ok()) {
        if (first)
          spdlog::info("image {}: the server places the chunks into the {} engine's memory",
                       options_.image, engine_.name());
      } else if (placement_refused) {
        if (first) spdlog::info("image {}: no placement: {}", options_.image, handed.message());
      } else {
        co_return handed;
      }
    } else if (first) {
      spdlog::info("image {}: no placement: {}", options_.image, frames.status().message());
    }
  }
  placing_.store(placing);

  wire::Hello join = hello;
  join.set_join_session(reply->session());
  join.set_join_secret(reply->session_secret());
  std::shared_ptr<const ImageFileSet> files;
  if (placing) {
    std::lock_guard lock(mutex_);
    demand_files_ = nullptr;
  }
  if (readers_ && !placing) {
    // With a chunk table a chunk someone waits for is read from the files at once, without a
    // round trip to the server (protocol version 2; not for tables larger than a client takes).
    uint64_t total_chunks;
    {
      std::lock_guard lock(mutex_);
      total_chunks = residency_.total_chunks();
    }
    std::optional<ChunkTableShape> shape;
    if (options_.local_demand && stream->reply.version() >= 2 &&
        total_chunks * kChunkTableBytesPerChunk <= kDefaultMaxImageTableBytes) {
      shape.emplace();
      for (const BoEntry& bo : bos_)
        shape->bo_sizes.push_back(bo.size);
      shape->chunk_size = chunk_size_;
      shape->lazy_image = lazy_image_;
      shape->max_payload = limits.max_payload;
    }
    Result<std::shared_ptr<const ImageFileSet>> fetched = co_await FetchImageFiles(
        endpoint_, join, options_.handshake_timeout, shape ? &*shape : nullptr);
    if (fetched.ok()) {
      files = *fetched;
      engine_.ExpectWriters(file_reader_count_);
      if (first)
        spdlog::info("image {}: reading chunks from {} passed image file(s) on {} threads{}",
                     options_.image, files->files.size(), file_reader_count_,
                     files->chunk_table.empty() ? "" : "; chunks waited for are read at once");
    } else if (fetched.status().code() == Code::kInvalidArgument) {
      // The server will not pass files (--no-pass-files, TLS, an older server): the socket
      // carries the chunks, one receiving thread per bulk connection (told to the engine with
      // the lanes, below), not the readers announced.
      if (first) spdlog::info("image {}: {}", options_.image, fetched.status().message());
    } else {
      co_return fetched.status().Context("fetching the image files");
    }
  }

  auto link = std::make_shared<Link>(std::move(stream->socket), limits);
  link->files = files;
  link->placing = placing;
  if (files && !files->chunk_table.empty()) {
    std::lock_guard lock(mutex_);
    demand_files_ = files;
  }
  // A Cancel or Fail while we connected closed link_, not this one.
  if (cancelled_ || Failed()) {
    const Status ended = Aborted("image {}: session ended while connecting", options_.image);
    EndLink(*link, ended);  // where the server took our destinations, to its close
    if (!link->closed) (void)co_await ReadStream(link);
    link->Close();
    co_return ended;
  }
  // Lanes when the chunks travel through the socket: several threads receive them.
  lanes_joined_.store(0);
  const uint32_t lanes = files ? 0 : std::min(WantedLanes(), stream->reply.max_lanes());
  if (!files) {
    // Each lane's thread receives into the engine as the stream thread does. The host engine,
    // told of several writers before (file readers announced), gets back what pays off for one
    // (its populate helper) when there is one.
    engine_.ExpectWriters(1 + lanes);
    if (lanes > 0) {
      wire::Hello lane_join = join;
      lane_join.set_join_as_lane(true);
      StartLanes(link, lane_join, limits, lanes);
    }
  }
  std::vector<ChunkRun> held;
  {
    std::lock_guard lock(mutex_);
    held = residency_.HeldRuns();
    if (!first) ++counters_.reconnects;
    counters_.reading_files = files != nullptr;
    counters_.placing = placing;
  }
  for (wire::Header& have : HaveFrames(held))
    link->stream_writer.Send(std::move(have));
  // By reference the credit bounds the file ranges queued for the readers (no payload buffers),
  // so it may be larger; too small a window starves the readers (docs/benchmarks.md). Through
  // the socket, a session that only streams keeps a few chunks in flight on every connection.
  // Placed chunks take no memory here either: their credit bounds the server's work in flight.
  const uint64_t window =
      files || placing ? std::max(window_, options_.file_window_bytes)
                       : SocketWindow(window_, options_.window_per_connection_bytes, 1 + lanes);
  wire::Header credit;
  credit.mutable_credit()->set_bytes(window);
  link->credit_outstanding.store(window);
  link->stream_writer.Send(std::move(credit));
  if (options_.stream_all) {
    wire::Header stream_all;
    stream_all.set_request_id(next_request_id_++);
    stream_all.mutable_request()->set_stream_all(true);
    stream_all.mutable_request()->set_priority(wire::PRIORITY_BACKGROUND);
    stream_all.mutable_request()->set_by_reference(link->files != nullptr);
    stream_all.mutable_request()->set_placed(placing);
    link->stream_writer.Send(std::move(stream_all));
  }
  {
    std::lock_guard lock(mutex_);
    if (counters_.stream_requested_at == Clock::time_point{})
      counters_.stream_requested_at = Clock::now();
  }

  link_ = link;
  attempt_opened_ = true;
  // Without a demand connection the demand bookkeeping is ours, and requests follow the Have.
  if (!options_.demand_connection) RestartDemand();
  if (!first)
    spdlog::info("image {}: reconnected to {}; told it we hold {} run(s)", options_.image,
                 endpoint_.ToString(), held.size());

  asio::co_spawn(io_, RunWriter(link), asio::detached);
  // The demand connection joins while the stream's first chunks come: asked for first, they do
  // not wait for its handshake (a round trip and a connection; docs/client.md, "Reconnect
  // semantics"). An attempt ends only once its join did, so no join outlives its connection.
  auto demand_joined =
      std::make_shared<asio::steady_timer>(io_, asio::steady_timer::time_point::max());
  // Expiring at once wakes a wait under way and lets a later one through.
  auto joined = [demand_joined] {
    demand_joined->expires_at(asio::steady_timer::time_point::min());
  };
  if (options_.demand_connection)
    asio::co_spawn(io_, AttachDemand(link, join, limits, files),
                   [joined](const std::exception_ptr&) { joined(); });
  else
    joined();
  Status status = co_await ReadStream(link);
  spdlog::debug("image {}: stream reader ended: {}", options_.image, status.ToString());
  if (link->placing && !link->closed) {
    // A failure the reader met itself (an engine write, a bad chunk) ends the restore, but the
    // server may still be writing into our memory: as on Cancel, read on to its close (EndLink),
    // so the engine is not freed under a placement in flight.
    if (Status failure = this->status(); !failure.ok()) {
      EndLink(*link, failure);
      if (!link->closed) (void)co_await ReadStream(link);
    }
  }
  link->Close();
  boost::system::error_code ignored;
  co_await demand_joined->async_wait(asio::redirect_error(asio::use_awaitable, ignored));
  if (link_ == link) link_.reset();
  if (link->complete) co_return Status::Ok();
  if (!link->error.ok()) co_return link->error;
  co_return status.ok() ? Unavailable("stream connection closed") : status;
}

asio::awaitable<void> RestoreSession::Impl::AttachDemand(
    std::shared_ptr<Link> link, wire::Hello join, FrameLimits limits,
    std::shared_ptr<const ImageFileSet> files) {
  try {
    // The demand socket is made, joined and served on the demand thread; only a weak_ptr to it
    // comes back here.
    auto [joined, demand] = co_await asio::co_spawn(
        demand_io_, JoinDemand(link, std::move(join), limits, std::move(files)),
        asio::use_awaitable);
    if (!joined.ok()) {
      // As a broken demand connection: the stream half drains what it has and reconnects both.
      link->Abort(joined, options_.handshake_timeout);
      co_return;
    }
    link->demand = std::move(demand);
    link->demand_executor = demand_io_.get_executor();
    // The stream ended (complete, broken, cancelled) while the demand connection joined: its
    // Close could not reach the demand half then.
    if (link->closed || link->aborting) link->CloseDemand();
  } catch (const std::exception& e) {
    link->Fail(Internal("joining the demand connection: {}", e.what()));
  }
}

asio::awaitable<void> RestoreSession::Impl::RunWriter(std::shared_ptr<Link> link) {
  try {
    Status status = co_await link->stream_writer.Run();
    if (!status.ok()) link->Abort(status, options_.handshake_timeout);
  } catch (const std::exception& e) {
    link->Fail(Internal("frame writer: {}", e.what()));
  }
}

asio::awaitable<Status> RestoreSession::Impl::ReadStream(std::shared_ptr<Link> link) {
  std::vector<uint8_t> payload;
  try {
    auto nanoseconds_since = [](std::chrono::steady_clock::time_point start) {
      return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                       std::chrono::steady_clock::now() - start)
                                       .count());
    };
    for (;;) {
      const auto waiting = std::chrono::steady_clock::now();
      Result<net::FrameHead> head = co_await net::ReadFrameHead(link->stream, link->limits);
      stream_wait_ns_.fetch_add(nanoseconds_since(waiting), std::memory_order_relaxed);
      if (!head.ok()) co_return link->complete ? Status::Ok() : head.status();
      if (link->closed) co_return Status::Ok();
      wire::Header* header = &head->header;
      if (header->body_case() != wire::Header::kChunk) {
        // Only ChunkData carries a payload (docs/protocol.md); read and drop any other's.
        payload.resize(head->payload_length);
        Status read = co_await net::ReadPayload(link->stream, payload);
        if (!read.ok()) co_return link->complete ? Status::Ok() : read;
        // Ending (Abort): what ends the drain is the server's close (it may say goodbye first,
        // when another connection of the session went), not a frame.
        if (link->aborting) continue;
      }
      switch (header->body_case()) {
        case wire::Header::kChunk: {
          if (link->aborting && Failed()) {
            // Draining after the restore failed: nothing more is installed (an engine that
            // failed a write would fail again and end the drain); only the server's close counts.
            payload.resize(head->payload_length);
            Status read = co_await net::ReadPayload(link->stream, payload);
            if (!read.ok()) co_return read;
            break;
          }
          bool transport = false;
          const auto receiving = std::chrono::steady_clock::now();
          Status handled =
              co_await ReceiveChunk(link, link->stream, link->limits, link->files, *header,
                                    head->payload_length, payload, /*on_stream=*/true, &transport);
          stream_chunk_ns_.fetch_add(nanoseconds_since(receiving), std::memory_order_relaxed);
          if (!handled.ok()) {
            if (transport) co_return link->complete ? Status::Ok() : handled;
            Fail(handled);
            co_return handled;
          }
          // Without a demand connection, demand chunks arrive here: room for the next ones.
          if (!options_.demand_connection) PumpDemand();
          break;
        }
        case wire::Header::kStreamDone:
          spdlog::info("image {}: stream done ({} chunks, {} bytes sent by the server)",
                       options_.image, header->stream_done().chunks(),
                       header->stream_done().bytes());
          ++link->stream_done_marks;
          NoteStreamEnd(link);
          break;
        case wire::Header::kError: {
          Status error = HandleErrorFrame(header->error(), "stream connection");
          if (!error.ok()) co_return error;
          break;
        }
        case wire::Header::kGoodbye:
          co_return Unavailable("server said goodbye on the stream connection");
        default:
          spdlog::debug("image {}: ignoring frame body {} on the stream connection", options_.image,
                        static_cast<int>(header->body_case()));
      }
    }
  } catch (const std::exception& e) {
    Status status = Internal("image {}: stream reader: {}", options_.image, e.what());
    Fail(status);
    co_return status;
  }
}

// ---- lanes ----

void RestoreSession::Impl::NoteStreamEnd(const std::shared_ptr<Link>& link) {
  // bulk_connections is at least 1 (the stream connection's own StreamDone).
  if (link->stream_done_marks < link->bulk_connections) return;
  std::vector<ChunkRun> missed;
  {
    std::lock_guard lock(mutex_);
    missed = residency_.UnrequestedRuns();
  }
  // A server that skipped chunks would leave us waiting forever: ask for them.
  if (missed.empty()) return;
  spdlog::warn("image {}: stream ended with {} run(s) never sent; demanding them", options_.image,
               missed.size());
  std::vector<ChunkId> chunks;
  for (const ChunkRun& run : missed)
    for (uint32_t i = 0; i < run.count; ++i)
      chunks.emplace_back(run.bo, run.first + i);
  uint64_t epoch = 0;
  {
    std::lock_guard lock(mutex_);
    for (const ChunkId& id : chunks)
      residency_.set_demanded(id.first, id.second);
    epoch = demand_epoch_;
  }
  OnDemandThread([this, chunks = std::move(chunks), epoch] { QueueDemand(chunks, epoch); });
}

void RestoreSession::Impl::StartLanes(const std::shared_ptr<Link>& link, const wire::Hello& join,
                                      FrameLimits limits, uint32_t count) {
  while (lane_threads_.size() < count) {
    auto lane = std::make_unique<LaneThread>();
    lane->work.emplace(lane->io.get_executor());
    lane->thread = std::thread([this, lane = lane.get(), index = lane_threads_.size()] {
      net::NameThisThread(fmt::format("gl-lane-{}", index + 1));
      BackgroundPriority();
      lane->io.run();
    });
    lane_threads_.push_back(std::move(lane));
  }
  link->bulk_connections = 1 + count;
  for (uint32_t i = 0; i < count; ++i)
    asio::co_spawn(lane_threads_[i]->io, RunLane(i, lane_threads_[i].get(), link, join, limits),
                   asio::detached);
}

asio::awaitable<void> RestoreSession::Impl::RunLane(size_t index, LaneThread* lane_thread,
                                                    std::weak_ptr<Link> link, wire::Hello join,
                                                    FrameLimits limits) {
  // Without this lane the stream still ends: StreamDone is no longer awaited on it.
  auto take_off = [this, link] {
    asio::post(io_, [this, link] {
      auto stream_link = link.lock();
      if (!stream_link || stream_link->closed) return;
      --stream_link->bulk_connections;
      NoteStreamEnd(stream_link);
    });
  };
  try {
    bool refused = false;
    Result<Handshake> joined =
        co_await ConnectAndHello(endpoint_, transport_, join, options_.handshake_timeout, &refused);
    if (!joined.ok()) {
      // The other connections carry the stream without it.
      spdlog::warn("image {}: lane {} not joined: {}", options_.image, index + 1,
                   joined.status().ToString());
      take_off();
      co_return;
    }
    auto lane = std::make_shared<LaneLink>(std::move(joined->socket), limits, link);
    // An earlier generation's lane on this thread is closed by its own Link (CloseLanes, or
    // below when it joined after that Link closed), never here: its join may finish after this
    // generation's lane joined.
    LaneThread& thread = *lane_thread;
    thread.current = lane;
    asio::post(io_, [this, link, weak = std::weak_ptr<LaneLink>(lane),
                     executor = thread.io.get_executor()] {
      auto stream_link = link.lock();
      if (!stream_link || stream_link->closed) {
        asio::post(executor, [weak] {
          if (auto lane = weak.lock()) lane->Close();
        });
        return;
      }
      stream_link->lanes.emplace_back(executor, weak);
      // Progress::lanes: the current connection's lanes.
      if (stream_link == link_)
        lanes_joined_.store(static_cast<uint32_t>(stream_link->lanes.size()),
                            std::memory_order_relaxed);
    });
    co_await ReadLane(std::move(lane));
  } catch (const std::exception& e) {
    Fail(Internal("image {}: lane {}: {}", options_.image, index + 1, e.what()));
  }
}

asio::awaitable<void> RestoreSession::Impl::ReadLane(std::shared_ptr<LaneLink> lane) {
  std::vector<uint8_t> payload;
  for (;;) {
    Result<net::FrameHead> head = co_await net::ReadFrameHead(lane->socket, lane->limits);
    if (lane->closed) co_return;
    if (!head.ok()) {
      LoseLane(lane, head.status().Context("lane"));
      co_return;
    }
    std::shared_ptr<Link> link = lane->link.lock();
    if (!link) co_return;
    const wire::Header& header = head->header;
    if (header.has_chunk()) {
      bool transport = false;
      Status handled =
          co_await ReceiveChunk(link, lane->socket, lane->limits, nullptr, header,
                                head->payload_length, payload, /*on_stream=*/true, &transport);
      if (!handled.ok()) {
        if (transport)
          LoseLane(lane, handled.Context("lane"));
        else
          Fail(handled);
        co_return;
      }
      lane_bytes_.fetch_add(head->payload_length, std::memory_order_relaxed);
      continue;
    }
    payload.resize(head->payload_length);
    if (Status read = co_await net::ReadPayload(lane->socket, payload); !read.ok()) {
      LoseLane(lane, read.Context("lane"));
      co_return;
    }
    if (header.has_stream_done()) {
      asio::post(io_, [this, link] {
        ++link->stream_done_marks;
        NoteStreamEnd(link);
      });
    } else if (header.has_error()) {
      Status error = HandleErrorFrame(header.error(), "lane");
      if (!error.ok()) {
        LoseLane(lane, error);
        co_return;
      }
    } else if (header.has_goodbye()) {
      LoseLane(lane, Unavailable("server said goodbye on a lane"));
      co_return;
    }
  }
}

void RestoreSession::Impl::LoseLane(const std::shared_ptr<LaneLink>& lane, Status why) {
  if (lane->closed) return;
  lane->Close();
  // A session does not outlive any of its bulk connections: reconnect them all. What the
  // stream connection has received is good, so let its reader drain it first.
  asio::post(io_, [stream = lane->link, why = std::move(why),
                   grace = options_.handshake_timeout]() mutable {
    if (auto stream_link = stream.lock()) stream_link->Abort(std::move(why), grace);
  });
}

// ---- the demand thread ----

asio::awaitable<std::pair<Status, std::weak_ptr<DemandLink>>> RestoreSession::Impl::JoinDemand(
    std::weak_ptr<Link> link, wire::Hello join, FrameLimits limits,
    std::shared_ptr<const ImageFileSet> files) {
  bool refused = false;
  Result<Handshake> demand =
      co_await ConnectAndHello(endpoint_, transport_, join, options_.handshake_timeout, &refused);
  if (!demand.ok())
    co_return std::pair{demand.status().Context("opening the demand connection"),
                        std::weak_ptr<DemandLink>()};
  auto demand_link =
      std::make_shared<DemandLink>(std::move(demand->socket), limits, link, std::move(files));
  if (cancelled_ || Failed()) {
    demand_link->Close();
    co_return std::pair{
        Aborted("image {}: session ended while joining the demand connection", options_.image),
        std::weak_ptr<DemandLink>()};
  }
  if (demand_link_) demand_link_->Close();  // the previous generation's, if still open
  demand_link_ = demand_link;
  RestartDemand();
  asio::co_spawn(demand_io_, RunDemandWriter(demand_link), asio::detached);
  asio::co_spawn(demand_io_, ReadDemand(demand_link), asio::detached);
  co_return std::pair{Status::Ok(), std::weak_ptr<DemandLink>(demand_link)};
}

void RestoreSession::Impl::LoseDemand(const std::shared_ptr<DemandLink>& link, Status why,
                                      bool drain) {
  if (link->closed) return;  // we closed it: its stream half is going away already
  link->Close();
  asio::post(io_, [stream = link->link, why = std::move(why), drain,
                   grace = options_.handshake_timeout]() mutable {
    auto stream_link = stream.lock();
    if (!stream_link) return;
    if (drain)
      stream_link->Abort(std::move(why), grace);
    else
      stream_link->Fail(std::move(why));
  });
}

asio::awaitable<void> RestoreSession::Impl::RunDemandWriter(std::shared_ptr<DemandLink> link) {
  try {
    Status status = co_await link->writer.Run();
    if (!status.ok()) LoseDemand(link, status.Context("demand connection"));
  } catch (const std::exception& e) {
    LoseDemand(link, Internal("demand frame writer: {}", e.what()), /*drain=*/false);
  }
}

asio::awaitable<void> RestoreSession::Impl::ReadDemand(std::shared_ptr<DemandLink> link) {
  std::vector<uint8_t> payload;
  try {
    for (;;) {
      Result<net::FrameHead> head = co_await net::ReadFrameHead(link->socket, link->limits);
      if (!head.ok()) {
        LoseDemand(link, head.status().Context("demand connection"));
        co_return;
      }
      if (link->closed) co_return;
      const wire::Header* header = &head->header;
      if (header->has_chunk()) {
        bool transport = false;
        Status handled =
            co_await ReceiveChunk(nullptr, link->socket, link->limits, link->files, *header,
                                  head->payload_length, payload, /*on_stream=*/false, &transport);
        if (!handled.ok()) {
          if (transport) {
            LoseDemand(link, handled.Context("demand connection"));
          } else {
            Fail(handled);
          }
          co_return;
        }
        PumpDemand();  // one fewer in flight: room for the next queued demand
        continue;
      }
      payload.resize(head->payload_length);
      if (Status read = co_await net::ReadPayload(link->socket, payload); !read.ok()) {
        LoseDemand(link, read.Context("demand connection"));
        co_return;
      }
      if (header->has_error()) {
        Status error = HandleErrorFrame(header->error(), "demand connection");
        if (!error.ok()) {
          LoseDemand(link, error, /*drain=*/false);
          co_return;
        }
      } else if (header->has_goodbye()) {
        LoseDemand(link, Unavailable("server said goodbye on the demand connection"));
        co_return;
      }
    }
  } catch (const std::exception& e) {
    Fail(Internal("image {}: demand reader: {}", options_.image, e.what()));
  }
}

void RestoreSession::Impl::RestartDemand() {
  std::vector<ChunkRun> pending;
  {
    std::lock_guard lock(mutex_);
    pending = residency_.PendingDemandRuns();
    ++demand_epoch_;
  }
  // Whatever the last connection had in flight is gone with it; everything demanded and not
  // held is asked for again (in the snapshot above, so a demand queued meanwhile is not lost).
  demand_in_flight_ = 0;
  demand_queue_.clear();
  std::vector<ChunkId> chunks;
  for (const ChunkRun& run : pending)
    for (uint32_t i = 0; i < run.count; ++i)
      chunks.emplace_back(run.bo, run.first + i);
  chunks = ReadLocally(chunks);
  demand_queue_.assign(chunks.begin(), chunks.end());
  if (!pending.empty())
    spdlog::info("image {}: asking for {} pending demand run(s) on the new connection",
                 options_.image, pending.size());
  PumpDemand();
}

void RestoreSession::Impl::QueueDemand(const std::vector<ChunkId>& chunks, uint64_t epoch) {
  // Posted before RestartDemand ran on this thread but after the chunks were marked: they were
  // in its snapshot and are asked for (or read) already.
  if (epoch != DemandEpoch()) return;
  std::vector<ChunkId> rest = ReadLocally(chunks);
  demand_queue_.insert(demand_queue_.end(), rest.begin(), rest.end());
  PumpDemand();
}

uint64_t RestoreSession::Impl::DemandEpoch() {
  std::lock_guard lock(mutex_);
  return demand_epoch_;
}

std::vector<RestoreSession::Impl::ChunkId> RestoreSession::Impl::ReadLocally(
    const std::vector<ChunkId>& chunks) {
  // The current connection's files (the previous ones stay open while it reconnects).
  const std::shared_ptr<const ImageFileSet> files =
      options_.demand_connection ? (demand_link_ ? demand_link_->files : nullptr)
                                 : (link_ ? link_->files : nullptr);
  if (!files || files->chunk_table.empty()) return chunks;
  std::vector<ChunkId> rest;
  for (const ChunkId& id : chunks) {
    if (files->Locate(id.first, id.second) == nullptr) {
      rest.push_back(id);
      continue;
    }
    std::optional<FileChunk> c;
    {
      std::lock_guard lock(mutex_);
      c = ClaimLocatedLocked(*files, id);
    }
    // Not claimed: held, by a connection or reader whose landing wakes the waiter (a queued one
    // is expedited by Ensure), or resident.
    if (!c) continue;
    // Read here: this thread has nothing else to do meanwhile, and `files` stays open.
    ReadByReference(nullptr, *c, /*on_stream=*/false, Urgency::kUrgent);
  }
  return rest;
}

std::optional<FileChunk> RestoreSession::Impl::ClaimLocatedLocked(const ImageFileSet& files,
                                                                  ChunkId id) {
  const ImageFileSet::Location* where = files.Locate(id.first, id.second);
  if (where == nullptr || !residency_.MarkLanding(id.first, id.second)) return std::nullopt;
  ++counters_.local_demand_chunks;
  FileChunk c;
  c.bo = id.first;
  c.chunk = id.second;
  c.dest_offset = uint64_t{id.second} * chunk_size_;
  c.raw_length = residency_.ChunkLength(id.first, id.second);
  c.codec = where->codec;
  c.checksum = where->checksum;
  c.fd = files.files[where->file].fd.get();
  c.file_offset = where->offset;
  c.stored_length = where->stored_length;
  return c;
}

void RestoreSession::Impl::PumpDemand() {
  // The next connection re-sends pending demands (RestartDemand).
  FrameWriter* out = nullptr;
  bool by_reference = false;
  if (options_.demand_connection) {
    if (!demand_link_ || demand_link_->closed) return;
    out = &demand_link_->writer;
    by_reference = demand_link_->files != nullptr;
  } else {
    if (!link_ || link_->closed || link_->aborting) return;
    out = &link_->stream_writer;
    by_reference = link_->files != nullptr;
  }
  std::vector<ChunkRun> runs;
  while (!demand_queue_.empty() && demand_in_flight_ < options_.max_demand_in_flight) {
    ChunkId id = demand_queue_.front();
    demand_queue_.pop_front();
    {
      std::lock_guard lock(mutex_);
      if (residency_.held(id.first, id.second)) continue;
    }
    if (!runs.empty() && runs.back().bo == id.first &&
        runs.back().first + runs.back().count == id.second)
      ++runs.back().count;
    else
      runs.push_back(ChunkRun{id.first, id.second, 1});
    ++demand_in_flight_;
  }
  if (runs.empty()) return;
  wire::Header header;
  header.set_request_id(next_request_id_++);
  header.mutable_request()->set_priority(wire::PRIORITY_DEMAND);
  header.mutable_request()->set_by_reference(by_reference);
  header.mutable_request()->set_placed(placing_.load());
  for (const ChunkRun& run : runs)
    *header.mutable_request()->add_ranges() = ToRange(run);
  if (options_.demand_connection) {
    // A reply the server never sends (the connection was lost) leaves an entry behind until the
    // chunk is asked again; the bound keeps such leftovers from piling up.
    if (demand_asked_.size() > 4 * size_t{options_.max_demand_in_flight} + 1024)
      demand_asked_.clear();
    const Clock::time_point now = Clock::now();
    for (const ChunkRun& run : runs)
      for (uint32_t i = 0; i < run.count; ++i)
        demand_asked_[ChunkId{run.bo, run.first + i}] = now;
  }
  out->Send(std::move(header));
}

std::optional<DemandChunkTiming> RestoreSession::Impl::StartDemandTiming(ChunkId id) {
  const Clock::time_point head = Clock::now();
  auto asked = demand_asked_.find(id);
  if (asked == demand_asked_.end()) return std::nullopt;
  DemandChunkTiming timing;
  timing.bo = id.first;
  timing.chunk = id.second;
  timing.asked = asked->second;
  timing.head = head;
  demand_asked_.erase(asked);
  return timing;
}

void RestoreSession::Impl::KeepDemandTiming(DemandChunkTiming timing) {
  std::lock_guard lock(timings_mutex_);
  demand_timings_.Add(timing);
}

std::vector<DemandChunkTiming> RestoreSession::Impl::demand_timings() const {
  std::lock_guard lock(timings_mutex_);
  return demand_timings_.OldestFirst();
}

// ---- either reader thread ----

Status RestoreSession::Impl::HandleErrorFrame(const wire::Error& error,
                                              std::string_view connection) {
  Status status = ErrorFrameStatus(error, fmt::format("image {}, {}", options_.image, connection));
  // Shutting down: the server is going away, reconnecting is the cure. Anything else in the
  // middle of a restore means we and the server disagree; retrying would repeat it.
  if (IsRetryableServerError(error)) return status;
  Fail(status);
  return status;
}

std::shared_ptr<std::vector<uint8_t>> RestoreSession::Impl::TakeBuffer() {
  auto buffer = std::make_shared<std::vector<uint8_t>>();
  std::lock_guard lock(buffers_mutex_);
  if (!spare_buffers_.empty()) {
    buffer->swap(spare_buffers_.back());
    spare_buffers_.pop_back();
  }
  return buffer;
}

void RestoreSession::Impl::ReturnBuffer(std::vector<uint8_t> buffer) {
  std::lock_guard lock(buffers_mutex_);
  if (spare_buffers_.size() < kMaxSpareBuffers) spare_buffers_.push_back(std::move(buffer));
}

Status RestoreSession::Impl::AcceptChunk(const std::shared_ptr<Link>& link,
                                         const wire::ChunkData& data, uint64_t wire_bytes,
                                         bool on_stream, bool* duplicate) {
  const uint32_t bo = data.bo();
  const uint32_t chunk = data.chunk();
  if (on_stream) {
    // Lanes take from the same credit on their own threads.
    uint64_t left = link->credit_outstanding.load();
    do {
      if (wire_bytes > left)
        return Corrupt(
            "image {}: server sent a {}-byte chunk with {} bytes of credit left "
            "(flow control violated)",
            options_.image, wire_bytes, left);
    } while (!link->credit_outstanding.compare_exchange_weak(left, left - wire_bytes));
  }
  // The in-flight count belongs to the connection the demand requests went out on (and to the
  // thread serving it): the demand connection, or the stream connection when there is none. The
  // server sends demand chunks on the stream connection, never on a lane.
  if (data.priority() == wire::PRIORITY_DEMAND && on_stream != options_.demand_connection &&
      (!on_stream || io_.get_executor().running_in_this_thread()) && demand_in_flight_ > 0)
    --demand_in_flight_;
  std::lock_guard lock(mutex_);
  Status valid = residency_.CheckChunk(bo, chunk);
  if (!valid.ok())
    return valid.Context(fmt::format("image {}: server sent a chunk", options_.image));
  if (data.raw_length() != residency_.ChunkLength(bo, chunk))
    return Corrupt("{}: server says {} raw bytes, the BO table says {}", What(bo, chunk),
                   data.raw_length(), residency_.ChunkLength(bo, chunk));
  counters_.received_bytes += wire_bytes;
  // Claim it in the same critical section as the check: a copy arriving on the other
  // connection meanwhile is then a duplicate, so the two threads never both receive a chunk
  // (into the same destination range) and it is never applied twice.
  *duplicate = !residency_.MarkLanding(bo, chunk);
  if (*duplicate) {
    ++counters_.duplicates;
    counters_.duplicate_bytes += wire_bytes;
  }
  return Status::Ok();
}

void RestoreSession::Impl::Unclaim(uint32_t bo, uint32_t chunk) {
  uint64_t epoch = 0;
  {
    std::lock_guard lock(mutex_);
    residency_.ClearLanding(bo, chunk);
    // Ending: nothing is asked for again (a chunk read locally would be claimed, refused and
    // unclaimed again, round and round, until the session goes).
    if (cancelled_ || !failure_.ok()) return;
    // Someone waits for it (Ensure asked for it, or found it claimed and waits for it to land).
    // A reconnect's Have and demand restart that ran while it was claimed (a lane held it
    // across the reconnect, in an engine call) counted it as held: nothing would ask for it
    // again before the new stream ends. Marked demanded, with the epoch of this unclaiming, as
    // in UnclaimBadCopy: a restart that snapshots it after this moves the epoch past it, so it
    // is asked for once.
    if (residency_.held(bo, chunk) ||
        !(residency_.demanded(bo, chunk) || residency_.waited(bo, chunk)))
      return;
    residency_.set_demanded(bo, chunk);
    epoch = demand_epoch_;
  }
  OnDemandThread([this, id = ChunkId{bo, chunk}, epoch] { QueueDemand({id}, epoch); });
}

asio::awaitable<Status> RestoreSession::Impl::ReceiveChunk(
    const std::shared_ptr<Link>& link, net::Stream& socket, const FrameLimits& limits,
    const std::shared_ptr<const ImageFileSet>& files, const wire::Header& header,
    uint32_t payload_length, std::vector<uint8_t>& payload, bool on_stream, bool* transport) {
  const wire::ChunkData& data = header.chunk();
  const uint32_t bo = data.bo();
  const uint32_t chunk = data.chunk();
  *transport = false;
  const Urgency urgency = UrgencyOf(on_stream);
  // Only the demand thread reads the demand connection and owns demand_asked_.
  std::optional<DemandChunkTiming> timing;
  if (!on_stream && options_.demand_connection) timing = StartDemandTiming(ChunkId{bo, chunk});
  if (data.has_in_file())
    co_return ReceiveByReference(link, limits, files, data, payload_length, on_stream);
  if (data.placed())
    co_return ReceivePlaced(link, data, payload_length, on_stream, timing ? &*timing : nullptr);
  std::chrono::nanoseconds* gate_wait = timing ? &timing->gate_wait : nullptr;
  net::PayloadWatermark watermark(socket, options_.batch_tcp_wakeups);
  bool duplicate = false;
  Status accepted = AcceptChunk(link, data, payload_length, on_stream, &duplicate);
  if (!accepted.ok()) co_return accepted;
  if (duplicate) {
    payload.resize(payload_length);
    Status read = co_await net::ReadPayload(socket, payload, watermark);
    if (!read.ok()) {
      *transport = true;
      co_return read;
    }
    if (on_stream) GiveBackCredit(link, payload_length);
    co_return Status::Ok();
  }

  // A zero chunk for an engine that zeroes memory itself: nothing to receive or copy.
  if (data.codec() == manifest::CODEC_ZERO && payload_length == 0 && engine_.WritesZeros()) {
    if (timing) timing->received = Clock::now();
    co_return InstallZeros(link, data, on_stream, timing ? &*timing : nullptr);
  }

  // Claimed. Only a RAW chunk whose payload is exactly its raw bytes can land in place; the
  // engine decides whether its memory may hold unverified bytes of a chunk that is not resident.
  std::optional<std::span<uint8_t>> target;
  const uint64_t offset = uint64_t{chunk} * chunk_size_;
  if (data.codec() == manifest::CODEC_RAW && payload_length > 0 &&
      payload_length == data.raw_length()) {
    EngineHold engine_hold(engine_gate_, urgency, gate_wait);
    target = engine_.ReceiveTarget(bo, offset, payload_length);
    if (target && target->size() != payload_length) {
      engine_.ReleaseReceived(bo, offset, payload_length);
      target.reset();
    }
  }
  if (!target) {
    payload.resize(payload_length);
    Status read = co_await net::ReadPayload(socket, payload, watermark);
    if (!read.ok()) {
      Unclaim(bo, chunk);
      *transport = true;
      co_return read;
    }
    if (timing) timing->received = Clock::now();
    co_return InstallChunk(link, data, payload, on_stream, timing ? &*timing : nullptr);
  }

  // An engine that checks chunks itself (the CUDA engine, on the GPU) gets the bytes unhashed,
  // as the file readers give it theirs: this thread then only copies from the socket, and a bad
  // copy comes back as a kCorrupt completion (OnWritten), never installed.
  const bool engine_verifies = engine_.VerifiesChunks(payload_length);
  // Otherwise the checksum is computed slice by slice right after each slice lands, while it is
  // still in the cache: one pass over memory for copy and verification together.
  const size_t slice_bytes = engine_verifies ? target->size() : kChecksumSliceBytes;
  Checksum64Stream hash;
  Status status;
  for (size_t done = 0; status.ok() && done < target->size();) {
    const std::span<uint8_t> slice =
        target->subspan(done, std::min(slice_bytes, target->size() - done));
    status = co_await net::ReadPayload(socket, slice, watermark);
    if (!status.ok()) {
      *transport = true;
      break;
    }
    if (!engine_verifies) {
      const Clock::time_point hashing = timing ? Clock::now() : Clock::time_point{};
      hash.Update(slice);
      if (timing) timing->hashing += Clock::now() - hashing;
    }
    done += slice.size();
  }
  if (timing) timing->received = Clock::now();
  if (!status.ok() || (!engine_verifies && hash.Digest() != data.checksum())) {
    // Unverified bytes never stay behind: zero the range, then the chunk is missing again.
    std::memset(target->data(), 0, target->size());
    {
      EngineHold engine_hold(commit_gate_, urgency);
      engine_.ReleaseReceived(bo, offset, payload_length);
    }
    if (!status.ok()) {
      Unclaim(bo, chunk);
      co_return status;
    }
    const BadCopies bad_copies = UnclaimBadCopy(bo, chunk);
    co_return BadCopy(link, bo, chunk, payload_length, on_stream,
                      Corrupt("{}: checksum mismatch (received in place)", What(bo, chunk)),
                      bad_copies);
  }
  Status committed;
  {
    EngineHold engine_hold(commit_gate_, urgency, gate_wait);
    CopyDone done = [this, link, id = ChunkId{bo, chunk},
                     credit = on_stream ? uint64_t{payload_length} : 0,
                     timing](const Status& written) {
      OnWritten(written, link, id, nullptr, credit, timing ? &*timing : nullptr);
    };
    committed =
        engine_verifies
            ? engine_.CommitUnverified(bo, offset, payload_length, data.checksum(), std::move(done))
            : engine_.CommitReceived(bo, offset, payload_length, std::move(done));
  }
  if (!committed.ok())
    co_return committed.Context(fmt::format("{}: {} engine", What(bo, chunk), engine_.name()));
  co_return Status::Ok();
}

Result<std::vector<wire::Header>> RestoreSession::Impl::PlacementFrames(
    const wire::PlacementOffer& offer) {
  std::vector<wire::Header> frames;
  std::lock_guard engine_lock(engine_gate_);
  for (uint32_t bo = 0; bo < bos_.size(); ++bo) {
    std::optional<CopyEngine::PlacementExport> exported = engine_.ExportDestination(bo);
    if (!exported)
      return Unsupported("the {} engine cannot hand over BO {}'s memory", engine_.name(), bo);
    if (exported->kind != offer.kind() || exported->device != offer.device())
      return Unsupported("the server places into {} memory{}, the {} engine's is {}{}",
                         ToValidUtf8(offer.kind()), offer.device().empty() ? "" : " of its GPU",
                         engine_.name(), exported->kind,
                         exported->device.empty() ? "" : " on another GPU");
    if (bo % kMaxTargetsPerPlaceInto == 0) {
      wire::PlaceInto* place = frames.emplace_back().mutable_place_into();
      place->set_kind(exported->kind);
      place->set_device(exported->device);
    }
    wire::PlacementTarget* target = frames.back().mutable_place_into()->add_targets();
    target->set_bo(bo);
    target->set_handle(std::move(exported->handle));
    target->set_size(exported->size);
  }
  return frames;
}

Status RestoreSession::Impl::ReceivePlaced(const std::shared_ptr<Link>& link,
                                           const wire::ChunkData& data, uint32_t payload_length,
                                           bool on_stream, const DemandChunkTiming* timing) {
  const uint32_t bo = data.bo();
  const uint32_t chunk = data.chunk();
  // The server's word that the bytes are in our memory: only after we handed it destinations,
  // and never with bytes besides.
  if (!placing_.load())
    return Corrupt("image {}: server placed BO {} chunk {}, but was given no destinations",
                   options_.image, bo, chunk);
  if (payload_length != 0)
    return Corrupt("image {}: placed BO {} chunk {} carries a {}-byte payload", options_.image, bo,
                   chunk, payload_length);
  if (data.no_checksum() && lazy_image_)
    return Corrupt("image {}: BO {} chunk {} of a lazy image was placed unchecked", options_.image,
                   bo, chunk);
  bool duplicate = false;
  GPULAZY_RETURN_IF_ERROR(AcceptChunk(link, data, data.raw_length(), on_stream, &duplicate));
  if (duplicate) {
    if (on_stream) GiveBackCredit(link, data.raw_length());
    return Status::Ok();
  }
  {
    std::lock_guard lock(mutex_);
    ++counters_.placed_chunks;
    counters_.placed_bytes += data.raw_length();
  }
  if (data.no_checksum()) unchecked_chunks_.fetch_add(1, std::memory_order_relaxed);
  OnWritten(Status::Ok(), link, ChunkId{bo, chunk}, nullptr, on_stream ? data.raw_length() : 0,
            timing);
  return Status::Ok();
}

Status RestoreSession::Impl::ReceiveByReference(const std::shared_ptr<Link>& link,
                                                const FrameLimits& limits,
                                                const std::shared_ptr<const ImageFileSet>& files,
                                                const wire::ChunkData& data,
                                                uint32_t payload_length, bool on_stream) {
  const uint32_t bo = data.bo();
  const uint32_t chunk = data.chunk();
  const wire::FileRange& where = data.in_file();
  // Everything here comes from the server: a bad reference is its bug, never ours to follow.
  if (payload_length != 0)
    return Corrupt("image {}: BO {} chunk {} by reference carries a {}-byte payload",
                   options_.image, bo, chunk, payload_length);
  if (!files || !readers_)
    return Corrupt("image {}: server sent BO {} chunk {} by reference; we hold no image files",
                   options_.image, bo, chunk);
  if (where.file() >= files->files.size())
    return Corrupt("image {}: BO {} chunk {} is in file {}; the server passed {}", options_.image,
                   bo, chunk, where.file(), files->files.size());
  const ImageFileSet::File& file = files->files[where.file()];
  if (where.offset() > file.size || where.length() > file.size - where.offset())
    return Corrupt("image {}: BO {} chunk {} at [{}, +{}) lies past the end of {} ({} bytes)",
                   options_.image, bo, chunk, where.offset(), where.length(), file.name, file.size);
  if (where.length() > limits.max_payload)
    return Corrupt("image {}: BO {} chunk {} has {} stored bytes (limit {})", options_.image, bo,
                   chunk, where.length(), limits.max_payload);
  if (data.no_checksum() && lazy_image_)
    return Corrupt("image {}: BO {} chunk {} of a lazy image comes without its checksum",
                   options_.image, bo, chunk);
  bool duplicate = false;
  GPULAZY_RETURN_IF_ERROR(AcceptChunk(link, data, where.length(), on_stream, &duplicate));
  if (duplicate) {
    if (on_stream) GiveBackCredit(link, where.length());
    return Status::Ok();
  }
  // Claimed (AcceptChunk marked it landing): the reader installs it or unclaims it.
  FileChunk c;
  c.bo = bo;
  c.chunk = chunk;
  c.dest_offset = uint64_t{chunk} * chunk_size_;
  c.raw_length = data.raw_length();
  c.codec = data.codec();
  if (!data.no_checksum()) c.checksum = data.checksum();
  c.fd = file.fd.get();
  c.file_offset = where.offset();
  c.stored_length = where.length();
  // A demand chunk is read here, on the demand thread, which has nothing else to do meanwhile:
  // posted, it would queue behind the background chunks the readers already hold (FIFO).
  if (!on_stream) {
    ReadByReference(link, c, on_stream, Urgency::kUrgent);
    return Status::Ok();
  }
  QueueRead(PendingRead{link, files, c});
  return Status::Ok();
}

void RestoreSession::Impl::QueueRead(PendingRead read) {
  const ChunkId id{read.chunk.bo, read.chunk.chunk};
  {
    std::lock_guard lock(queued_mutex_);
    bool waited;
    {
      std::lock_guard state_lock(mutex_);
      waited = residency_.waited(id.first, id.second);
    }
    // Not waited for: queued. Ensure marks a chunk waited before it looks for it here
    // (Expedite), and both look under queued_mutex_, so a chunk Ensure wants is either read at
    // once below or found in the queue by Expedite; it never waits behind the queue.
    if (!waited) {
      queued_order_.push_back(id);
      queued_reads_.insert_or_assign(id, std::move(read));
      // One turn per queued chunk; a turn whose chunk was expedited finds the next or nothing.
      asio::post(*readers_, [this] { ReadNextQueued(); });
      return;
    }
  }
  OnDemandThread([this, read = std::move(read)] {
    ReadByReference(read.link, read.chunk, /*on_stream=*/true, Urgency::kUrgent);
  });
}

void RestoreSession::Impl::ReadNextQueued() {
  std::optional<PendingRead> read;
  {
    std::lock_guard lock(queued_mutex_);
    while (!read && !queued_order_.empty()) {
      read = TakeQueuedLocked(queued_order_.front());
      queued_order_.pop_front();
    }
  }
  if (read) ReadByReference(read->link, read->chunk, /*on_stream=*/true, Urgency::kBackground);
}

std::optional<RestoreSession::Impl::PendingRead> RestoreSession::Impl::TakeQueuedLocked(
    ChunkId id) {
  auto found = queued_reads_.find(id);
  if (found == queued_reads_.end()) return std::nullopt;
  PendingRead read = std::move(found->second);
  queued_reads_.erase(found);
  return read;
}

void RestoreSession::Impl::Expedite(const std::vector<ChunkId>& chunks) {
  for (const ChunkId& id : chunks) {
    std::optional<PendingRead> read;
    {
      std::lock_guard lock(queued_mutex_);
      read = TakeQueuedLocked(id);
    }
    // Not queued: being read already, or claimed and not queued yet (QueueRead will see that
    // it is waited for and hand it here).
    if (read) ReadByReference(read->link, read->chunk, /*on_stream=*/true, Urgency::kUrgent);
  }
}

void RestoreSession::Impl::ReadByReference(const std::shared_ptr<Link>& link, const FileChunk& c,
                                           bool on_stream, Urgency urgency) {
  const ChunkId id{c.bo, c.chunk};
  if (cancelled_ || Failed()) {
    Unclaim(c.bo, c.chunk);
    return;
  }
  std::vector<uint8_t> scratch;  // encoded chunks only
  const uint64_t credit = on_stream ? c.stored_length : 0;
  Status installed = InstallFileChunk(
      engine_, engine_gate_, urgency, c, file_buffers_, scratch, What(c.bo, c.chunk),
      [this, link, id, credit, unchecked = !c.checksum,
       zeroed = EngineZeroesChunk(engine_, c) ? c.raw_length : 0](const Status& status) {
        // Counted before OnWritten marks the chunk resident: whoever sees the restore complete
        // sees every unchecked install counted.
        if (status.ok() && unchecked) unchecked_chunks_.fetch_add(1, std::memory_order_relaxed);
        if (status.ok() && zeroed > 0) {
          file_zero_chunks_.fetch_add(1, std::memory_order_relaxed);
          file_zero_bytes_.fetch_add(zeroed, std::memory_order_relaxed);
        }
        OnWritten(status, link, id, nullptr, credit);
      },
      /*bytes_read=*/nullptr, &file_times_);
  if (installed.ok()) return;
  if (installed.code() != Code::kCorrupt) {
    Unclaim(c.bo, c.chunk);
    Fail(installed);
    return;
  }
  // Bad bytes in the file: ask the server again (a second bad copy fails the restore). Credit
  // is the stream thread's, so the rest runs there.
  const BadCopies bad_copies = UnclaimBadCopy(c.bo, c.chunk);
  asio::post(io_, [this, link, c, on_stream, installed, bad_copies] {
    Status bad = BadCopy(link, c.bo, c.chunk, c.stored_length, on_stream, installed, bad_copies);
    if (!bad.ok()) Fail(bad);
  });
}

RestoreSession::Impl::BadCopies RestoreSession::Impl::UnclaimBadCopy(uint32_t bo, uint32_t chunk) {
  std::lock_guard lock(mutex_);
  residency_.ClearLanding(bo, chunk);
  BadCopies bad;
  bad.count = residency_.CountBadCopy(bo, chunk);
  if (bad.count < 2) ++counters_.refetches;
  // Also after the second bad copy: nothing may ask for the chunk again once it failed the
  // restore.
  residency_.set_demanded(bo, chunk);
  // With the marking, as QueueDemand needs: a demand connection's restart that snapshots the
  // chunk also moves the epoch past this one, so the chunk is asked for once.
  bad.demand_epoch = demand_epoch_;
  return bad;
}

Status RestoreSession::Impl::BadCopy(const std::shared_ptr<Link>& link, uint32_t bo, uint32_t chunk,
                                     uint64_t wire_bytes, bool on_stream, const Status& why,
                                     BadCopies bad_copies) {
  if (on_stream) GiveBackCredit(link, wire_bytes);
  if (bad_copies.count >= 2)
    return Corrupt("{}: second copy is bad too, not installing it: {}", What(bo, chunk),
                   why.message());
  spdlog::warn("{}; fetching it again", why.message());
  OnDemandThread([this, id = ChunkId{bo, chunk}, epoch = bad_copies.demand_epoch] {
    QueueDemand({id}, epoch);
  });
  return Status::Ok();
}

Status RestoreSession::Impl::InstallChunk(const std::shared_ptr<Link>& link,
                                          const wire::ChunkData& data,
                                          std::vector<uint8_t>& payload, bool on_stream,
                                          DemandChunkTiming* timing) {
  const uint32_t bo = data.bo();
  const uint32_t chunk = data.chunk();
  const uint64_t wire_bytes = payload.size();
  auto staging = TakeBuffer();
  Status decoded;
  std::string what = What(bo, chunk);
  const Clock::time_point decoding = timing ? Clock::now() : Clock::time_point{};
  if (data.codec() == manifest::CODEC_RAW) {
    // The payload becomes the staging buffer; the reader gets a spare one for its next frame.
    staging->swap(payload);
    decoded = DecodeChunkPayload(data, *staging, staging.get(), what);
  } else {
    decoded = DecodeChunkPayload(data, payload, staging.get(), what);
  }
  if (timing) timing->hashing += Clock::now() - decoding;
  if (!decoded.ok()) {
    ReturnBuffer(std::move(*staging));
    const BadCopies bad_copies = UnclaimBadCopy(bo, chunk);
    return BadCopy(link, bo, chunk, wire_bytes, on_stream, decoded, bad_copies);
  }

  std::span<const uint8_t> raw(*staging);
  // Credit goes back only once the engine has the bytes, so what we hold stays in the window.
  return CallEngine(on_stream, timing, what, [&](const std::optional<DemandChunkTiming>& timed) {
    return engine_.Write(bo, uint64_t{chunk} * chunk_size_, raw,
                         [this, link, id = ChunkId{bo, chunk}, staging,
                          credit = on_stream ? wire_bytes : 0, timed](const Status& status) {
                           OnWritten(status, link, id, staging, credit, timed ? &*timed : nullptr);
                         });
  });
}

Status RestoreSession::Impl::InstallZeros(const std::shared_ptr<Link>& link,
                                          const wire::ChunkData& data, bool on_stream,
                                          DemandChunkTiming* timing) {
  const uint32_t bo = data.bo();
  const uint32_t chunk = data.chunk();
  // AcceptChunk checked raw_length against the BO table; the checksum must be that of as many
  // zeros, as when the bytes are decoded (a zero chunk carries no payload, so no credit).
  if (Status zeros = CheckZeroChunk(data.checksum(), data.raw_length(), What(bo, chunk));
      !zeros.ok()) {
    const BadCopies bad_copies = UnclaimBadCopy(bo, chunk);
    return BadCopy(link, bo, chunk, 0, on_stream, zeros, bad_copies);
  }
  {
    std::lock_guard lock(mutex_);
    ++counters_.zero_filled_chunks;
    counters_.zero_filled_bytes += data.raw_length();
  }
  return CallEngine(on_stream, timing, What(bo, chunk),
                    [&](const std::optional<DemandChunkTiming>& timed) {
                      return engine_.WriteZeros(
                          bo, uint64_t{chunk} * chunk_size_, data.raw_length(),
                          [this, link, id = ChunkId{bo, chunk}, timed](const Status& status) {
                            OnWritten(status, link, id, nullptr, 0, timed ? &*timed : nullptr);
                          });
                    });
}

template <typename EngineCall>
Status RestoreSession::Impl::CallEngine(bool on_stream, DemandChunkTiming* timing,
                                        std::string_view what, EngineCall&& call) {
  Status written;
  {
    EngineHold engine_hold(commit_gate_, UrgencyOf(on_stream),
                           timing ? &timing->gate_wait : nullptr);
    // Copied once the gate let it in, so that its wait is in the copy the engine's done gets.
    std::optional<DemandChunkTiming> timed;
    if (timing) timed = *timing;
    written = call(timed);
  }
  if (!written.ok()) return written.Context(fmt::format("{}: {} engine", what, engine_.name()));
  return Status::Ok();
}

void RestoreSession::Impl::OnWritten(const Status& status, const std::shared_ptr<Link>& link,
                                     ChunkId id,
                                     const std::shared_ptr<std::vector<uint8_t>>& staging,
                                     uint64_t credit, const DemandChunkTiming* timing) {
  // Any thread, possibly inside an engine call (engine_mutex_ held): never take engine_mutex_.
  if (status.code() == Code::kCorrupt) {
    // The engine verified the bytes itself (CommitUnverified) and they did not match: the same
    // as a mismatch found here, so ask again, and a second bad copy fails the restore.
    const BadCopies bad_copies = UnclaimBadCopy(id.first, id.second);
    if (staging) ReturnBuffer(std::move(*staging));
    asio::post(io_, [this, link, id, credit, status, bad_copies] {
      Status bad =
          BadCopy(link, id.first, id.second, credit, /*on_stream=*/credit > 0, status, bad_copies);
      if (!bad.ok()) Fail(bad);
    });
    return;
  }
  if (!status.ok()) {
    Fail(status.Context(
        fmt::format("{}: {} engine write", What(id.first, id.second), engine_.name())));
    return;
  }
  bool complete;
  bool wakes;
  uint64_t abandoned = 0;
  {
    std::lock_guard lock(mutex_);
    residency_.MarkResident(id.first, id.second);
    counters_.last_resident_at = Clock::now();
    if (counters_.first_resident_at == Clock::time_point{})
      counters_.first_resident_at = counters_.last_resident_at;
    complete = residency_.complete();
    wakes = residency_.LandingWakes(id.first, id.second);
    if (complete) abandoned = residency_.abandoned_chunks();
  }
  if (timing) {
    DemandChunkTiming kept = *timing;
    kept.resident = Clock::now();
    KeepDemandTiming(kept);
  }
  // Only a chunk someone waits for ends a wait: waking every waiter for each of a 4 KiB
  // stream's 100,000s of chunks a second kept them contending for mutex_ with the installs.
  if (wakes) cv_.notify_all();
  if (staging) ReturnBuffer(std::move(*staging));
  if (complete) {
    spdlog::info("image {}: every chunk is resident{}", options_.image,
                 abandoned == 0 ? "" : fmt::format(" but the {} abandoned", abandoned));
  }
  const bool post_credit =
      credit > 0 && link->credit_to_return.fetch_add(credit, std::memory_order_acq_rel) == 0;
  if (!post_credit && !complete) return;
  // Credit and the connection are the stream thread's. `link` is the stream half the chunk came
  // on (null for a demand-connection chunk); completion closes whichever link is current.
  asio::post(io_, [this, link, post_credit, complete] {
    if (post_credit)
      ReturnCredit(link, link->credit_to_return.exchange(0, std::memory_order_acq_rel));
    if (complete && link_) {
      link_->complete = true;
      EndLink(*link_, Status::Ok());
    }
  });
}

void RestoreSession::Impl::GiveBackCredit(const std::shared_ptr<Link>& link, uint64_t bytes) {
  if (bytes == 0) return;
  if (io_.get_executor().running_in_this_thread()) {
    ReturnCredit(link, bytes);
    return;
  }
  if (link->credit_to_return.fetch_add(bytes, std::memory_order_acq_rel) == 0)
    asio::post(io_, [this, link] {
      ReturnCredit(link, link->credit_to_return.exchange(0, std::memory_order_acq_rel));
    });
}

void RestoreSession::Impl::ReturnCredit(const std::shared_ptr<Link>& link, uint64_t bytes) {
  if (link->closed || bytes == 0) return;
  link->credit_outstanding.fetch_add(bytes);
  wire::Header header;
  header.mutable_credit()->set_bytes(bytes);
  link->stream_writer.Send(std::move(header));
}

// ---- RestoreSession forwards to Impl ----

uint64_t SocketWindow(uint64_t window_bytes, uint64_t per_connection_bytes, uint32_t connections) {
  if (per_connection_bytes == 0) return window_bytes;
  // Saturating: options come from users and configuration files.
  const uint64_t wanted = per_connection_bytes > UINT64_MAX / connections
                              ? UINT64_MAX
                              : per_connection_bytes * connections;
  return std::max(window_bytes, wanted);
}

uint32_t LanesFor(uint32_t asked) {
  if (asked != 0) return asked;
  const uint32_t cpus = net::UsableCpus();
  return cpus < 8 ? 1 : std::min(cpus / 2, 8u);
}

RestoreSession::RestoreSession(SessionOptions options, CopyEngine& engine)
    : impl_(std::make_unique<Impl>(std::move(options), engine)) {}
RestoreSession::~RestoreSession() = default;
Status RestoreSession::Start() {
  return impl_->Start();
}
const std::vector<BoEntry>& RestoreSession::bos() const {
  return impl_->bos_;
}
uint32_t RestoreSession::chunk_size() const {
  return impl_->chunk_size_;
}
const manifest::AccessProfile& RestoreSession::profile() const {
  return impl_->profile_;
}
bool RestoreSession::lazy_image() const {
  return impl_->lazy_image_;
}
Status RestoreSession::Ensure(uint32_t bo, uint64_t offset, uint64_t length,
                              std::optional<std::chrono::milliseconds> timeout) {
  return impl_->Ensure(bo, offset, length, timeout);
}
Status RestoreSession::WaitHotSet(std::optional<std::chrono::milliseconds> timeout) {
  return impl_->WaitHotSet(timeout);
}
Status RestoreSession::WaitComplete(std::optional<std::chrono::milliseconds> timeout) {
  return impl_->WaitComplete(timeout);
}
bool RestoreSession::IsResident(uint32_t bo, uint64_t offset, uint64_t length) const {
  return impl_->IsResident(bo, offset, length);
}
Status RestoreSession::Abandon(std::span<const uint32_t> bos) {
  return impl_->Abandon(bos);
}
std::vector<DemandChunkTiming> RestoreSession::demand_timings() const {
  return impl_->demand_timings();
}
Progress RestoreSession::progress() const {
  return impl_->progress();
}
Status RestoreSession::status() const {
  return impl_->status();
}
void RestoreSession::Cancel() {
  impl_->Cancel();
}

}  // namespace gpulazy::client
