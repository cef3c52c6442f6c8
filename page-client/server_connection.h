// One connection to gpulazy-server as the client sees it: connecting with a handshake deadline,
// Hello / OpenImage exchanges, mapping the server's Error frames to Status, and a FrameWriter
// that serializes the frames several coroutines want to send on one socket.
// Thread-safety: everything here runs on the owning io_context's single thread.
#pragma once

#include <chrono>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lazy-server/image/io.h"
#include "page-client/net/asio.h"
#include "page-client/net/endpoint.h"
#include "page-client/net/frame_stream.h"
#include "page-client/net/stream.h"
#include "page-client/residency.h"
#include "proto/image_table.h"
#include "proto/status.h"
#include "proto/wire.pb.h"

namespace gpulazy::client {

// The Status a server Error frame stands for; `what` says which exchange it answered.
Status ErrorFrameStatus(const wire::Error& error, std::string_view what);
// True when the error means "try again later" (the server is shutting down).
bool IsRetryableServerError(const wire::Error& error);

struct Handshake {
  net::Stream socket;  // plain or TLS
  wire::HelloReply reply;
};

// Connects (TLS handshake included, over `transport`) and exchanges Hello/HelloReply; the whole
// exchange must finish within `timeout` (the socket is closed when it does not, so a silent peer
// cannot hang us). *refused is set when retrying will not help: the server answered with an
// Error frame that says so, a certificate was refused, or plain TCP is not allowed.
net::Awaitable<Result<Handshake>> ConnectAndHello(const net::Endpoint& endpoint,
                                                  const net::ClientTransport& transport,
                                                  const wire::Hello& hello,
                                                  std::chrono::milliseconds timeout, bool* refused);

// A session the client had before it reconnected (OpenImageReply's session and secret).
struct EarlierSession {
  uint64_t id = 0;
  std::string secret;
};

// Sends OpenImage and reads its reply within `timeout`; *refused as for ConnectAndHello. With
// protocol `version` 2 the reply's BO table and hot set arrive as payload frames after it; they
// are read (at most `max_table_bytes` of them) and returned in the reply's bos and profile, as
// version 1 carries them. With `supersedes` the server answers only once that session has let
// go of the memory it was handed (docs/protocol.md, "Placement", 6).
net::Awaitable<Result<wire::OpenImageReply>> OpenImage(
    net::Stream& socket, const std::string& image, uint32_t version, const FrameLimits& limits,
    std::chrono::milliseconds timeout, bool* refused,
    const std::optional<EarlierSession>& supersedes = std::nullopt,
    uint64_t max_table_bytes = kDefaultMaxImageTableBytes);

// Hands a session's destinations to the server (docs/protocol.md, "Placement"): sends each
// PlaceInto frame of `frames` on the stream connection, right after OpenImage, and reads its
// PlaceIntoReply, all within `timeout`. *refused: the server answered one with an Error (it
// keeps what earlier frames handed over, but the client must not ask for placed chunks).
net::Awaitable<Status> PlaceInto(net::Stream& socket, std::vector<wire::Header> frames,
                                 const FrameLimits& limits, std::chrono::milliseconds timeout,
                                 bool* refused);

// Asks the server for its statistics (docs/server.md, "Stats") on a connection of its own:
// Hello with `token` (empty: none), then StatsRequest; returns the reply's JSON text. Blocking,
// for tools and benchmarks rather than a restore's io_context.
Result<std::string> FetchServerStats(const net::Endpoint& endpoint,
                                     const net::ClientTransport& transport,
                                     const std::string& token, const std::string& client_name);

// Ranges per Have frame: 2048 ranges of at most 20 serialized bytes each stay well inside the
// 64 KiB frame header, whatever the image's BO count.
inline constexpr size_t kMaxRangesPerHave = 2048;
// After a reconnect, the Have frames that tell the server which runs we hold: as many frames as
// the runs need, none when there are none.
std::vector<wire::Header> HaveFrames(const std::vector<ChunkRun>& held,
                                     size_t max_ranges_per_frame = kMaxRangesPerHave);

// The files a server passed for a session (docs/protocol.md, "Image files"): regular files,
// read-only, each as large as the server said. Immutable; shared by the readers using it.
// With a chunk table (want_chunk_table), also where each chunk of the image is stored in them,
// checked against the files and the image's BO table (ChunkTableShape) before it is kept.
struct ImageFileSet {
  struct File {
    std::string name;  // for messages only
    UniqueFd fd;
    uint64_t size = 0;
  };
  struct Location {
    uint64_t offset = 0;
    uint32_t stored_length = 0;
    uint32_t file = 0;                 // index into files
    std::optional<uint64_t> checksum;  // XXH3-64 of the raw bytes, where the server knows it
    manifest::Codec codec = manifest::CODEC_RAW;
  };
  std::vector<File> files;
  std::vector<Location> chunk_table;  // in table order; empty: the server sent none
  std::vector<uint64_t> first_chunk;  // per BO: the index of its chunk 0 in chunk_table

  // Where chunk `chunk` of BO `bo` is stored; nullptr without a table or out of range.
  const Location* Locate(uint32_t bo, uint32_t chunk) const;
};

// What a chunk table must fit: the image's BO table as the session adopted it.
struct ChunkTableShape {
  std::vector<uint64_t> bo_sizes;
  uint32_t chunk_size = 0;
  bool lazy_image = false;   // every chunk carries its manifest checksum
  uint32_t max_payload = 0;  // no chunk stores more bytes
};

// Checks a server's ChunkLocations against the passed files and `shape` and returns its entries
// (filling set->chunk_table and first_chunk). Every entry is untrusted: a file index past the
// list, a range past its file, a stored length over max_payload or unlike its codec, an unknown
// codec, a lazy image's chunk without checksum, or lists of the wrong length are kCorrupt.
Status AdoptChunkTable(const wire::ChunkLocations& table, const ChunkTableShape& shape,
                       ImageFileSet* set);

// Opens a files connection to `endpoint` (a Unix socket), joins the session named in `join`
// (join_session, join_secret; want_files is set here) and receives its image files, within
// `timeout`. A server that will not pass files answers with an Error: kInvalidArgument. With
// `shape` it asks for the chunk table too (want_chunk_table, protocol version 2) and keeps it
// once AdoptChunkTable accepts it; a server that closes after the files sends none.
net::Awaitable<Result<std::shared_ptr<const ImageFileSet>>> FetchImageFiles(
    const net::Endpoint& endpoint, wire::Hello join, std::chrono::milliseconds timeout,
    const ChunkTableShape* shape = nullptr);

// Queues payload-less frames (Credit, Have, Request, Goodbye) and writes them in order from one
// coroutine, so a socket never has two writes in flight.
class FrameWriter {
 public:
  FrameWriter(net::Stream& socket, FrameLimits limits);
  void Send(wire::Header header);
  // Writes until Close() (after draining what was queued) or a write error.
  net::Awaitable<Status> Run();
  void Close();

 private:
  net::Stream& socket_;
  FrameLimits limits_;
  std::deque<wire::Header> queue_;
  boost::asio::steady_timer wakeup_;
  bool closed_ = false;
};

}  // namespace gpulazy::client
