// An in-process page server for the client tests: speaks docs/protocol.md over a Unix socket
// with blocking threads, serves an image from memory, and injects faults (corrupt copies,
// dropped connections, restarts, a different image after a reconnect). Records what the client
// sent (Have, demand requests, credit) so tests can check the client's side of the protocol.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "proto/manifest.pb.h"
#include "proto/wire.pb.h"

namespace gpulazy::testing {

using ChunkKey = std::pair<uint32_t, uint32_t>;  // BO, chunk

struct FakeImage {
  uint32_t chunk_size = 4096;
  std::vector<std::vector<uint8_t>> bos;  // contents; BO i has process 1, bo_index i, gpu 0xc0de
  manifest::AccessProfile profile;
  // Random contents, with every third chunk all zeros (so CODEC_ZERO gets exercised).
  static FakeImage Make(const std::vector<uint64_t>& sizes, uint32_t chunk_size, uint32_t seed);
  // Three BOs in 4 KiB chunks: several chunks, a partial last chunk, a single small chunk; a
  // hot set of two chunks (BO 1 chunk 3, BO 2 chunk 0).
  static FakeImage Small();
  uint32_t ChunkCount(uint32_t bo) const;
  uint64_t TotalChunks() const;
};

struct FakeServerOptions {
  std::string image_name = "test-image";
  uint32_t max_payload = 4 * 1024 * 1024 + 64 * 1024;
  bool mixed_codecs = true;  // LZ4 for odd chunks, ZERO for zero chunks, RAW otherwise
  // Copies of these chunks to send corrupted (one byte flipped, checksum of the good bytes).
  std::map<ChunkKey, int> corrupt_copies;
  // Copies of these zero chunks to send as CODEC_ZERO with a wrong checksum.
  std::map<ChunkKey, int> bad_zero_checksums;
  // Close the stream connection after this many stream chunks in total (once; -1: never).
  int drop_after_chunks = -1;
  // Close every stream connection right after its OpenImageReply (a server that fails the same
  // way each time).
  bool drop_every_stream_after_open = false;
  // Restart (close everything, refuse connections for restart_downtime_ms) instead of a plain drop.
  bool restart_on_drop = false;
  int restart_downtime_ms = 150;
  // After the first session, announce BO 0 one chunk larger (a different image).
  bool different_image_after_first = false;
  // Hold stream_all chunks until Resume() (demand still flows).
  bool paused = false;
  // With paused: hold the replies to demand requests too (the requests are still recorded).
  bool hold_demand = false;
  // Lanes a session may add (HelloReply.max_lanes): background chunks are dealt round-robin over
  // the stream connection and the lanes present, StreamDone goes on each (stream connection
  // first, so a client acting on it alone would miss chunks still in the lanes' sockets).
  uint32_t max_lanes = 0;
  // Close a lane (and with it, as the real server does, its session) after it carried this many
  // chunks (once; -1: never).
  int drop_lane_after_chunks = -1;
  // Hold each lane's HelloReply until its session's stream connection has sent StreamDone: the
  // lanes join a stream that has ended, and (as from the real server) hear its end on joining.
  bool lanes_join_after_stream_done = false;
  // The same for the demand connection's HelloReply: a client that waits for its demand
  // connection before asking for the stream never gets either.
  bool demand_joins_after_stream_done = false;
  // Hold every demand connection's HelloReply until AdmitDemandJoins().
  bool hold_demand_joins = false;
  // The highest protocol version spoken. 2 (when the client offers it) sends the image table as
  // payload after OpenImageReply, in pieces of at most table_piece bytes.
  uint32_t version = 1;
  uint32_t table_piece = 64 * 1024;
  // A version-2 table gone wrong, for the client's checks of what it is sent.
  enum class TableFault {
    kNone,
    kAnnouncesTooMuch,   // table_bytes of 1 TiB, then nothing
    kPieceOverruns,      // table_bytes 10 short of what the pieces carry
    kGarbage,            // bytes that do not parse as an ImageTable
    kBosInHeader,        // the reply lists the BOs in its header as well
    kOtherFrameBetween,  // a StreamDone where the next table part belongs
    kEmptyPart,          // an empty ImageTablePart while bytes are missing
  };
  TableFault table_fault = TableFault::kNone;

  // Every chunk RAW (so a client that receives in place gets each one into the engine's memory),
  // corrupting the copies `corrupt` names.
  static FakeServerOptions RawChunks(std::map<ChunkKey, int> corrupt = {}) {
    FakeServerOptions options;
    options.mixed_codecs = false;
    options.corrupt_copies = std::move(corrupt);
    return options;
  }
};

class FakeServer {
 public:
  FakeServer(FakeImage image, FakeServerOptions options);
  ~FakeServer();

  std::string endpoint() const { return "unix:" + path_; }
  void Resume();
  // paused again (with hold_demand: demand replies wait for Resume too).
  void Pause();
  // Lets held demand connections (hold_demand_joins) join, now and from now on.
  void AdmitDemandJoins();
  // Shuts every open connection down at once (sessions end; new connections are still taken),
  // from outside the threads serving them: a write blocked on a client that stopped reading
  // fails too.
  void DropAllConnections() { CloseAll(); }

  // Observations (thread-safe).
  int sessions() const;
  std::vector<std::vector<wire::ChunkRange>> haves() const;  // per session, in order
  std::vector<wire::Request> demand_requests() const;        // from the demand connections
  std::vector<std::set<ChunkKey>> stream_sent() const;       // per session
  uint64_t lane_chunks_sent() const;                         // of those, on lanes (all sessions)
  // Lanes registered, all sessions: the client counts a lane once its HelloReply came, which is
  // written before the lane is registered for chunks.
  uint64_t lanes_joined() const;
  uint64_t max_outstanding_credit() const;  // max of granted minus sent, over all sessions
  bool credit_violated() const;             // ever asked to send past credit (never happens)

 private:
  struct StreamState;
  void Listen();
  void AcceptLoop();
  void Serve(int fd);
  void ServeStream(int fd, const wire::Hello& hello);
  void ServeDemand(int fd, const wire::Hello& hello, const wire::Header& reply);
  void ServeLane(int fd, const wire::Hello& hello, const wire::Header& reply);
  // mutex_ held: whether hello names a live session with its secret; if not, tells the client.
  bool JoinsLiveSessionLocked(int fd, const wire::Hello& hello);
  // The OpenImageReply as version 1 (table in the header) or 2 (table as payload frames, with
  // options_.table_fault applied).
  bool SendOpenImageReply(int fd, wire::Header reply, bool version2);
  // `before_write` runs with the payload size before the frame is written: credit must be
  // accounted for before the client can see the chunk (and return its credit).
  void SendChunk(int fd, uint32_t bo, uint32_t chunk, wire::Priority priority, uint64_t request_id,
                 uint64_t* payload_bytes,
                 const std::function<void(uint64_t)>& before_write = nullptr);
  void CloseAll();

  FakeImage image_;
  FakeServerOptions options_;
  std::string dir_;
  std::string path_;

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  bool stopping_ = false;
  bool refusing_ = false;
  int listen_fd_ = -1;
  std::set<int> open_fds_;
  std::vector<std::thread> threads_;
  std::thread acceptor_;
  int sessions_ = 0;
  int stream_chunks_sent_ = 0;
  bool dropped_ = false;
  std::map<uint64_t, std::pair<std::string, int>> live_sessions_;  // id -> secret, demand fd
  std::map<uint64_t, std::vector<int>> lanes_;                     // id -> lane fds, in join order
  std::map<uint64_t, uint64_t> stream_done_chunks_;  // id -> StreamDone.chunks, once it went out
  uint64_t lane_chunks_sent_ = 0;
  uint64_t lanes_joined_ = 0;
  bool lane_dropped_ = false;
  std::vector<std::vector<wire::ChunkRange>> haves_;
  std::vector<wire::Request> demand_requests_;
  std::vector<std::set<ChunkKey>> stream_sent_;
  uint64_t max_outstanding_ = 0;
  bool credit_violated_ = false;
};

}  // namespace gpulazy::testing
