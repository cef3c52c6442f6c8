// RestoreSession: restores one image's BO contents from gpulazy-server into a CopyEngine
// (docs/client.md, docs/protocol.md). It opens the image, streams every chunk in the server's
// priority order under a bounded credit window, verifies each chunk's checksum before the
// engine sees it, tracks residency per chunk, serves Ensure() by jumping the queue on a
// separate demand connection, and survives dropped connections and restarted servers
// (reconnect with back-off, Have for what it holds, no chunk applied twice).
//
// Thread-safety: Start, and the destructor, from one thread; Ensure, Wait*, progress and
// Cancel from any thread at any time after Start returned. The session runs two internal
// threads: the stream thread (connecting and reconnecting, the stream connection's reader and
// writer, credit) and, with a demand connection, the demand thread (that connection's reader and
// writer, the demand queue), so a demand chunk is received and verified while the stream thread
// is busy with a background chunk. With image files passed (read_files), chunks that arrive by
// reference are read from the files on `file_readers` threads more. All decode, verify and hand
// chunks to the engine; the session serializes its engine calls (CopyEngine's
// one-caller-at-a-time contract), so an engine sees calls from several threads, never two at
// once. Which thread owns which state: restore_session.cc, above RestoreSession::Impl.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "page-client/copy_engine.h"
#include "page-client/net/stream.h"
#include "proto/manifest.pb.h"
#include "proto/status.h"

namespace gpulazy::client {

struct ReconnectPolicy {
  // Consecutive failed attempts before giving up; 0 never reconnects.
  uint32_t max_attempts = 10;
  std::chrono::milliseconds initial_backoff{50};  // doubled after each failed attempt
  std::chrono::milliseconds max_backoff{2000};
  // Give up when the connection has been lost for this long, whatever max_attempts says.
  std::chrono::milliseconds deadline{60000};
};

struct SessionOptions {
  std::string endpoint;  // "unix:PATH" or "tcp:HOST:PORT"
  std::string image;     // relative to one of the server's image roots
  // Most payload bytes the server may have sent that the client has not consumed. Raised to
  // the server's max_payload when smaller (the protocol needs one whole chunk to fit).
  uint64_t window_bytes = 16u << 20;
  // With lanes (below), the window is at least this much per bulk connection asked for, the
  // stream connection included, so that each keeps a few chunks in flight: eight connections
  // sharing 16 MiB have one 2 MiB chunk each and wait a credit round trip for every next one.
  // kBulkWindowPerConnection made one session's TCP stream a fifth to a third faster and eight
  // sessions' a tenth, but the stream then crowds demand chunks (their p99 rose by a fifth to a
  // half; docs/benchmarks.md, session 36): for sessions nobody waits on (a fetch, an eager
  // restore), not for lazy ones. 0 (the default): window_bytes alone.
  uint64_t window_per_connection_bytes = 0;
  // A second connection for demand requests, so they never queue behind background bytes. It
  // is served by its own thread.
  bool demand_connection = true;
  // Ask the server to stream every chunk in the background (Request{stream_all}). False: only
  // Ensure fetches; WaitHotSet / WaitComplete return once Ensure has brought those chunks in
  // (used to time a lone demand chunk with nothing else on the wire).
  bool stream_all = true;
  ReconnectPolicy reconnect;
  std::string client_name = "gpulazy-client";
  std::string token;  // bearer token, when the server wants one (net::ReadTokenFile)
  // TLS for tcp: endpoints (docs/security.md); without a CA file, tcp: is refused unless
  // insecure_tcp says plain TCP is acceptable. Unix endpoints ignore both.
  net::TlsClientOptions tls;
  bool insecure_tcp = false;
  std::chrono::milliseconds handshake_timeout{10000};  // Hello and OpenImage replies
  // Most demand chunks asked for and not yet received (the server refuses past its own limit).
  uint32_t max_demand_in_flight = 128;
  // On a Unix endpoint, ask the server for the image's files and read the chunks from them on
  // `file_readers` threads (docs/protocol.md, "Image files"): the server still picks the order,
  // but the bytes go from the page cache into the engine without crossing the socket. A server
  // that will not pass them is told nothing more: the chunks then travel through the socket.
  bool read_files = true;
  // 0 leaves the count to the engine (WritersFor in copy_engine.h).
  uint32_t file_readers = 0;
  // Bulk connections carrying the stream when its chunks travel through the socket (TCP, or a
  // server that does not pass its files), the stream connection included: the server deals
  // the stream's chunks over them and each is received by a thread of its own, so one thread's
  // copy from the socket does not bound the restore (docs/protocol.md, "Lanes"). At most what
  // the server allows (HelloReply.max_lanes + 1); 1 = the stream connection alone; 0 = LanesFor.
  uint32_t lanes = 0;
  // While reading files, also take the image's chunk table (where every chunk is stored) and
  // read a chunk Ensure waits for from the files at once instead of asking the server for it
  // (a round trip through two more threads). Protocol version 2.
  bool local_demand = true;
  // With local_demand: Ensure reads those chunks on the thread that called it, rather than
  // handing them to the session's demand thread (one thread wake-up fewer on a fault's path;
  // several callers read in parallel). Ensure's timeout does not cut such a read short, but
  // counts it.
  bool demand_on_caller = true;
  // The window while reading by reference (never below window_bytes). Its chunks arrive as
  // file ranges queued for the readers, not as payloads, so it bounds queued reads rather than
  // memory: 256 MiB keeps 16 readers fed where 64 MiB did not (docs/benchmarks.md).
  uint64_t file_window_bytes = 256u << 20;
  // Added to the nice value of the session's stream thread and file readers (the background
  // work; 0..19, 0 = same priority as the caller): the demand thread, the caller's threads and
  // a resumed program then get the CPU first where cores are few (docs/client.md).
  int background_nice = 0;
  // When the server offers placement (on a Unix socket, gpulazy-server --placement) and the
  // engine can hand its destinations over (CopyEngine::ExportDestination) on the same kind of
  // memory and device: let the server write the chunks there itself, and mark each resident
  // when told (docs/protocol.md, "Placement"). The image files are then not asked for. A
  // server that refuses the destinations is told nothing more: the chunks come as usual.
  bool accept_placement = true;
  // Over plain TCP, wake a receiving thread once a payload read's bytes have arrived rather
  // than at each segment (net::PayloadWatermark): fewer wake-ups and shorter reads per chunk.
  bool batch_tcp_wakeups = true;
};

// The bulk connections a session opens for `asked` (SessionOptions::lanes): `asked`, or for 0 one
// per two CPUs this process may use, at most 8, and 1 below 8 CPUs. Each brings a receiving
// thread here and a network thread's work on the server: on 16 CPUs eight made one restore 2-5
// times as fast as one, while on two cores the extra threads only compete with each other and the
// server (docs/benchmarks.md, "Session 25").
uint32_t LanesFor(uint32_t asked);
// The credit window of a session whose chunks travel through the socket on `connections` bulk
// connections (1 or more): window_bytes, raised to per_connection_bytes for each of them
// (SessionOptions::window_per_connection_bytes; 0 leaves window_bytes as it is).
uint64_t SocketWindow(uint64_t window_bytes, uint64_t per_connection_bytes, uint32_t connections);
// SessionOptions::window_per_connection_bytes for a session that only streams: four 2 MiB
// chunks in flight on each connection.
inline constexpr uint64_t kBulkWindowPerConnection = 8u << 20;

// A BO of the image, as the server's OpenImageReply lists it (index = position in bos()).
struct BoEntry {
  uint32_t process_id = 0;  // CRIU file id of the amdgpu-kfd-<id>.img it belongs to
  uint32_t bo_index = 0;    // index in that process's BO table
  uint32_t gpu_id = 0;
  uint64_t gpu_va = 0;
  uint64_t size = 0;
  uint32_t alloc_flags = 0;
  uint32_t chunk_count = 0;
};

struct Progress {
  uint64_t total_bytes = 0;
  uint64_t total_chunks = 0;
  uint64_t resident_bytes = 0;
  uint64_t resident_chunks = 0;
  uint64_t hot_chunks = 0;  // chunks in the profile's hot set
  uint64_t hot_resident_chunks = 0;
  // Chunks of abandoned BOs (RestoreSession::Abandon) that were not fetched, and their bytes.
  uint64_t abandoned_chunks = 0;
  uint64_t abandoned_bytes = 0;
  uint64_t received_bytes = 0;       // payload bytes off the wire, duplicates included
  uint64_t demand_chunks = 0;        // chunks asked for by Ensure
  uint64_t local_demand_chunks = 0;  // of those, read from the passed files without the server
  uint64_t refetches = 0;            // chunks asked for again after a bad copy
  // Chunks read by reference that came with no checksum, installed as read: a CRIU checkpoint
  // records none, and the server knows one only for chunks it has read itself (docs/client.md).
  uint64_t unchecked_chunks = 0;
  uint64_t duplicates = 0;       // copies of chunks already held, ignored
  uint64_t duplicate_bytes = 0;  // of received_bytes: the payload bytes of those copies
  uint64_t reconnects = 0;       // successful re-opens after a lost connection
  bool reading_files = false;    // the current connection passed the image files (by reference)
  bool placing = false;          // the current connection's server places chunks (placement)
  uint64_t placed_chunks = 0;    // chunks the server placed in our destinations
  uint64_t placed_bytes = 0;     // their raw bytes
  // Zero chunks (CODEC_ZERO) that the engine zeroed itself (CopyEngine::WritesZeros: on the GPU
  // for the CUDA engine) instead of being handed their bytes, off the connections or read by
  // reference; their checksums checked here.
  uint64_t zero_filled_chunks = 0;
  uint64_t zero_filled_bytes = 0;  // their raw bytes
  uint32_t lanes = 0;              // lanes joined to the current connection (besides the stream's)
  uint64_t lane_bytes = 0;         // of received_bytes: payload bytes that came on lanes
  // Where the stream connection's reading thread spent its time (wall time, other work of that
  // thread included): waiting for the next frame to start, and inside chunk frames (receiving
  // the payload, which may also wait for bytes, verifying it, handing it to the engine).
  // Waiting covers a server that is slow and a server held back by this client's credit
  // window (credit returns once the engine has the bytes), so it tells a slow stream's
  // reader-side work from everything else, not the server from the client outright.
  double stream_wait_s = 0;
  double stream_chunk_s = 0;
  // Where the threads that install chunks from image files (by reference: the file readers, and
  // the demand thread and Ensure callers for chunks they read themselves; LocalRestore: its
  // readers) spent their time, summed over those threads (FileReadTimes): reading the stored
  // bytes with their verification, and engine calls with their waits (the engine gate; the CUDA
  // engine's free staging slot). With no Ensure, the file readers' wall time less both is their
  // per-chunk work outside the install (queueing, locating), waiting for chunks and for a CPU.
  double file_read_s = 0;
  double file_engine_s = 0;
  // The part of file_engine_s spent waiting to enter the engine gate (EngineGate): with an
  // engine that takes one caller at a time, the readers' queue for it.
  double file_gate_wait_s = 0;
  // When the first and the latest chunk became resident (steady clock; the epoch until one has):
  // beside the time Start was called and the time the restore completed, they split a run into
  // its start-up, its stream and its tail.
  std::chrono::steady_clock::time_point first_resident_at{};
  std::chrono::steady_clock::time_point last_resident_at{};
  // The first connection's start-up, step by step (the epoch until reached): the server's answer
  // to PlaceInto (none when it does not place), and the stream asked for (credit and stream_all
  // sent, after the demand connection and the lanes' start).
  std::chrono::steady_clock::time_point placement_answered_at{};
  std::chrono::steady_clock::time_point stream_requested_at{};
  bool complete = false;  // every chunk is resident or abandoned
};

// One chunk Ensure asked the server for that came back on the demand connection, timed on the
// client (steady clock). With the server's own share from its stats (request read -> reply
// written into the socket), it shows where a demand request's time goes. Diagnostics and the
// demand benchmark (docs/client.md, "Demand timings").
struct DemandChunkTiming {
  using TimePoint = std::chrono::steady_clock::time_point;
  uint32_t bo = 0;
  uint32_t chunk = 0;
  TimePoint asked;     // the demand thread handed the request to the connection's writer
  TimePoint head;      // the reply's frame head had been read
  TimePoint received;  // the last payload byte was in (and hashed, when received in place)
  TimePoint resident;  // the engine had the chunk and it was marked resident (waiters wake next)
  // Hashing (and decoding a compressed chunk), wherever it fell: during the receive for a
  // chunk received in place, after `received` for one received into a staging buffer.
  std::chrono::nanoseconds hashing{0};
  std::chrono::nanoseconds gate_wait{0};  // of head -> resident, waiting to enter the engine gate
};

class RestoreSession {
 public:
  // How many DemandChunkTiming records a session keeps (the latest).
  static constexpr size_t kDemandTimings = 1024;

  RestoreSession(SessionOptions options, CopyEngine& engine);
  // Cancels what is still running and waits for the session's threads and the engine's writes.
  ~RestoreSession();
  RestoreSession(const RestoreSession&) = delete;
  RestoreSession& operator=(const RestoreSession&) = delete;

  // Connects, opens the image, creates one engine destination per BO and starts streaming.
  // Returns once the image is open (or why it could not be): the first connection is not
  // retried, so a wrong address or image name fails at once. Once the image is open it returns
  // Ok, also when the restore has failed since (bad copies of a chunk, say): WaitComplete,
  // Ensure and status() report that. Call once.
  Status Start();

  // Valid after Start succeeded; immutable for the session's life.
  const std::vector<BoEntry>& bos() const;
  uint32_t chunk_size() const;
  const manifest::AccessProfile& profile() const;
  bool lazy_image() const;

  // Blocks until [offset, offset + length) of `bo` is resident, asking the server for the
  // missing chunks at demand priority. Returns the session's error if it fails meanwhile,
  // kTimeout if `timeout` (from the call) passes first. While it waits, the calling thread
  // readies the destination of what it asked for (CopyEngine::PrepareDestination).
  Status Ensure(uint32_t bo, uint64_t offset, uint64_t length,
                std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  // Blocks until the profile's hot set (or, with an empty profile, nothing) is resident.
  Status WaitHotSet(std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  // Blocks until every chunk is resident, or abandoned.
  Status WaitComplete(std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  // Non-blocking: whether the range is resident now.
  bool IsResident(uint32_t bo, uint64_t offset, uint64_t length) const;
  // Nobody needs these BOs any more (the process they belong to has exited): their chunks that
  // are neither resident nor on their way are no longer fetched (the server is told, as a Have,
  // and skips them), copies of them still arriving are dropped, and WaitHotSet and
  // WaitComplete stop waiting for them. Ensure on such a chunk returns kAborted, a call
  // already waiting too. kOutOfRange, and nothing abandoned, when an index is past bos().
  // Idempotent.
  Status Abandon(std::span<const uint32_t> bos);

  Progress progress() const;
  // The latest kDemandTimings chunks received on the demand connection, in the order they
  // became resident. Chunks that came by reference or as duplicates, and demand chunks
  // without a demand connection, are not timed.
  std::vector<DemandChunkTiming> demand_timings() const;
  // The error that ended the session, Ok while it runs or after it completed.
  Status status() const;
  // Stops streaming; waiters return kAborted. Idempotent.
  void Cancel();

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gpulazy::client
