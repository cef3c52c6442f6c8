// Helpers for the page-server tests: temporary directories, a real gpulazy-server process
// started on a temp Unix socket and an ephemeral TCP port (via --ready-file), and a small
// frame-level client built on the blocking net:: helpers. Every read has a deadline, so no
// test can hang.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "lazy-server/child/server_child.h"
#include "lazy-server/image/io.h"
#include "page-client/net/endpoint.h"
#include "page-client/net/frame_stream.h"
#include "proto/manifest.pb.h"
#include "proto/status.h"
#include "proto/wire.pb.h"
#include "tests/support/temp_dir.h"

namespace gpulazy::server::testing {

using namespace std::chrono_literals;

using ::gpulazy::testing::TempDir;

class ServerProcess {
 public:
  // Starts build/bin/gpulazy-server with --images root, a Unix socket and tcp:127.0.0.1:0 in
  // `dir`, plus extra arguments; waits for the ready file.
  ServerProcess(const std::filesystem::path& dir, const std::filesystem::path& root,
                std::vector<std::string> extra_args = {});
  ~ServerProcess();  // SIGKILL
  bool ready() const { return child_.has_value(); }
  const net::Endpoint& unix_endpoint() const { return unix_; }
  const net::Endpoint& tcp_endpoint() const { return tcp_; }
  std::filesystem::path socket_path() const { return unix_.path; }
  pid_t pid() const { return child_ ? child_->pid() : -1; }
  // SIGTERM, then waits up to `timeout`; returns the exit status (or -1 on timeout / signal).
  int Terminate(std::chrono::milliseconds timeout = 10s);
  std::string Log() const;
  // True once the log shows any of `texts`. The server logs what it did after the effect a
  // client sees (a closed connection, a reply), so a test that just saw the effect polls.
  bool LogShows(std::initializer_list<std::string_view> texts,
                std::chrono::milliseconds timeout = 5s) const;

 private:
  std::optional<ServerChild> child_;
  std::filesystem::path log_;
  net::Endpoint unix_;
  net::Endpoint tcp_;
};

struct Frame {
  wire::Header header;
  std::vector<uint8_t> payload;
};

class TestClient {
 public:
  explicit TestClient(const net::Endpoint& endpoint);
  // A Unix socket connected to the server already (by another process, say).
  explicit TestClient(UniqueFd connected_unix_socket);
  bool connected() const { return socket_.is_open(); }

  Status Send(const wire::Header& header);
  Status SendRaw(std::span<const uint8_t> bytes);
  // Half-closes: the server sees end of stream, replies can still be read.
  Status CloseWrite();
  // Next frame, or kTimeout after `timeout` with nothing to read.
  Result<Frame> Read(std::chrono::milliseconds timeout = 10s);
  // True when the server closed the connection (EOF / reset) within `timeout`.
  bool WaitClosed(std::chrono::milliseconds timeout = 5s);

  // Request/response helpers; each fails the Result on an unexpected frame.
  // Offers protocol versions 1..max_version; the version the server picks is kept for Open.
  Result<wire::HelloReply> Hello(uint64_t join_session = 0, std::string join_secret = {},
                                 std::string token = {}, uint32_t max_version = 1);
  // Hello's two halves, for a client that sends more before the reply (pipelining).
  Status SendHello(uint64_t join_session = 0, std::string join_secret = {}, std::string token = {},
                   uint32_t max_version = 1);
  Result<wire::HelloReply> ReadHelloReply();
  // Joins session `session` as one more bulk lane (Hello.join_as_lane).
  Result<wire::HelloReply> JoinAsLane(uint64_t session, std::string secret);
  // With version 2 also reads the image table's frames and returns the reply with bos and
  // profile filled in from it, as version 1 sends them.
  Result<wire::OpenImageReply> Open(const std::string& image, uint64_t request_id = 1);
  // Frames the last version-2 Open read its table from (the reply included).
  int table_frames() const { return table_frames_; }
  Status Credit(uint64_t bytes);
  Status StreamAll(uint64_t request_id = 2);
  Status Request(wire::Priority priority, uint32_t bo, uint32_t first, uint32_t count,
                 uint64_t request_id);
  // Reads until an Error frame arrives (skipping chunks); returns it.
  Result<wire::Error> ReadError(std::chrono::milliseconds timeout = 10s);
  Result<std::string> Stats(uint64_t request_id = 99);

 private:
  boost::asio::io_context io_;
  net::Socket socket_;
  uint32_t version_ = 1;
  int table_frames_ = 0;
};

// A synthetic checkpoint for server tests (SynthesizeCheckpoint on 2 GPUs), converted to a lazy
// image with `lazy_chunk`-byte chunks when `lazy`.
struct TestImage {
  uint64_t bytes = 0;
  uint64_t seed = 1;
  bool lazy = false;
  uint32_t bos = 6;  // per process
  uint32_t processes = 1;
  uint32_t lazy_chunk = 64 * 1024;
};
Status MakeTestImage(const std::filesystem::path& dir, const TestImage& image);

// The raw bytes of every BO of a checkpoint, keyed by (process_id, bo_index), read straight
// from the CRIU pages files.
using BoKey = std::pair<uint32_t, uint32_t>;
Result<std::map<BoKey, std::vector<uint8_t>>> LoadCriuContents(const std::filesystem::path& dir);

// Decodes a ChunkData frame's payload to raw bytes and verifies its checksum.
Result<std::vector<uint8_t>> DecodeChunkFrame(const Frame& frame);

// Receives a whole stream: returns chunks in arrival order until StreamDone, returning credit
// as chunks are consumed (window bytes).
struct Received {
  std::vector<Frame> chunks;
  wire::StreamDone done;
};
Result<Received> ReceiveStream(TestClient& client, uint64_t window,
                               std::chrono::milliseconds timeout = 30s);

// Checks every chunk of the image arrived exactly once and matches the CRIU bytes.
Status VerifyStream(const wire::OpenImageReply& reply, const std::vector<Frame>& chunks,
                    const std::map<BoKey, std::vector<uint8_t>>& expected);

// A fresh client: Hello, OpenImage, stream everything with `window` bytes of credit, and
// VerifyStream against `expected`.
Status StreamWholeImage(const net::Endpoint& endpoint, const std::string& image,
                        const std::map<BoKey, std::vector<uint8_t>>& expected, uint64_t window);

}  // namespace gpulazy::server::testing
