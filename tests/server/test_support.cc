#include "tests/server/test_support.h"

#include <poll.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <thread>

#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/io.h"
#include "lazy-server/image/lazy_image.h"
#include "lazy-server/image/synth.h"
#include "proto/criu_file.h"
#include "proto/image_table.h"

namespace gpulazy::server::testing {
namespace fs = std::filesystem;
namespace asio = boost::asio;

ServerProcess::ServerProcess(const fs::path& dir, const fs::path& root,
                             std::vector<std::string> extra_args) {
  ServerChildOptions options;
  // GPULAZY_TEST_BIN_DIR: where a copied build's executables are (a lent GPU host's bundle).
  const char* bin_dir = std::getenv("GPULAZY_TEST_BIN_DIR");
  options.binary = fs::path(bin_dir != nullptr ? bin_dir : GPULAZY_BIN_DIR) / "gpulazy-server";
  options.root = root;
  options.run_dir = dir;
  options.log_level = "debug";
  options.extra_args = std::move(extra_args);
  options.ready_timeout = 30s;  // sanitizer builds start slowly
  log_ = ServerChild::LogPath(options);
  Result<ServerChild> child = ServerChild::Start(options);
  if (!child.ok()) return;
  Result<net::Endpoint> unix_endpoint = net::Endpoint::Parse(child->unix_endpoint());
  Result<net::Endpoint> tcp_endpoint = net::Endpoint::Parse(child->tcp_endpoint());
  if (!unix_endpoint.ok() || !tcp_endpoint.ok()) return;  // the child goes with `child`
  unix_ = *unix_endpoint;
  tcp_ = *tcp_endpoint;
  child_.emplace(std::move(*child));
}

ServerProcess::~ServerProcess() {
  if (child_) child_->Kill();  // fast: tests that care how it stops call Terminate
}

int ServerProcess::Terminate(std::chrono::milliseconds timeout) {
  return child_ ? child_->Terminate(timeout) : -1;
}

std::string ServerProcess::Log() const {
  std::ifstream in(log_);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

bool ServerProcess::LogShows(std::initializer_list<std::string_view> texts,
                             std::chrono::milliseconds timeout) const {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const std::string log = Log();
    for (std::string_view text : texts)
      if (log.find(text) != std::string::npos) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(10ms);
  }
}

// ---------------------------------------------------------------------------------------------

namespace {
const FrameLimits kClientLimits{64 * 1024, 8 * 1024 * 1024};

Status Unexpected(const wire::Header& header, std::string_view wanted) {
  if (header.has_error())
    return Status(Code::kInternal, fmt::format("wanted {}, got error {}: {}", wanted,
                                               wire::ErrorCode_Name(header.error().code()),
                                               header.error().message()));
  return Internal("wanted {}, got body {}", wanted, int(header.body_case()));
}
}  // namespace

TestClient::TestClient(const net::Endpoint& endpoint) : socket_(io_) {
  Result<net::Socket> socket = net::ConnectBlocking(io_, endpoint);
  if (socket.ok()) socket_ = std::move(*socket);
}

TestClient::TestClient(UniqueFd connected_unix_socket) : socket_(io_) {
  socket_.assign(boost::asio::generic::stream_protocol(AF_UNIX, SOCK_STREAM),
                 connected_unix_socket.release());
}

Status TestClient::Send(const wire::Header& header) {
  return net::WriteFrameBlocking(socket_, header, {}, kClientLimits);
}

Status TestClient::SendRaw(std::span<const uint8_t> bytes) {
  boost::system::error_code ec;
  asio::write(socket_, asio::buffer(bytes.data(), bytes.size()), ec);
  if (ec) return IoError("send: {}", ec.message());
  return Status::Ok();
}

Status TestClient::CloseWrite() {
  boost::system::error_code ec;
  socket_.shutdown(asio::socket_base::shutdown_send, ec);
  if (ec) return IoError("shutdown: {}", ec.message());
  return Status::Ok();
}

Result<Frame> TestClient::Read(std::chrono::milliseconds timeout) {
  pollfd pfd{socket_.native_handle(), POLLIN, 0};
  int ready = ::poll(&pfd, 1, static_cast<int>(timeout.count()));
  if (ready == 0) return TimedOut("no frame within {} ms", timeout.count());
  if (ready < 0) return IoError("poll failed");
  Frame frame;
  GPULAZY_ASSIGN_OR_RETURN(frame.header,
                           net::ReadFrameBlocking(socket_, kClientLimits, &frame.payload));
  return frame;
}

bool TestClient::WaitClosed(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::array<uint8_t, 65536> buffer;
  while (true) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd pfd{socket_.native_handle(), POLLIN, 0};
    if (::poll(&pfd, 1, static_cast<int>(left.count())) <= 0) return false;
    ssize_t n = ::recv(socket_.native_handle(), buffer.data(), buffer.size(), 0);
    if (n <= 0) return true;
  }
}

Result<wire::HelloReply> TestClient::Hello(uint64_t join_session, std::string join_secret,
                                           std::string token, uint32_t max_version) {
  GPULAZY_RETURN_IF_ERROR(
      SendHello(join_session, std::move(join_secret), std::move(token), max_version));
  return ReadHelloReply();
}

Status TestClient::SendHello(uint64_t join_session, std::string join_secret, std::string token,
                             uint32_t max_version) {
  wire::Header header;
  header.set_request_id(1000);
  wire::Hello* hello = header.mutable_hello();
  hello->set_min_version(1);
  hello->set_max_version(max_version);
  hello->set_client_name("server-test");
  hello->set_join_session(join_session);
  hello->set_join_secret(std::move(join_secret));
  hello->set_token(std::move(token));
  return Send(header);
}

Result<wire::HelloReply> TestClient::ReadHelloReply() {
  GPULAZY_ASSIGN_OR_RETURN(Frame frame, Read());
  if (!frame.header.has_hello_reply()) return Unexpected(frame.header, "HelloReply");
  version_ = frame.header.hello_reply().version();
  return frame.header.hello_reply();
}

Result<wire::HelloReply> TestClient::JoinAsLane(uint64_t session, std::string secret) {
  wire::Header header;
  header.set_request_id(1001);
  wire::Hello* hello = header.mutable_hello();
  hello->set_min_version(1);
  hello->set_max_version(2);
  hello->set_client_name("server-test-lane");
  hello->set_join_session(session);
  hello->set_join_secret(std::move(secret));
  hello->set_join_as_lane(true);
  GPULAZY_RETURN_IF_ERROR(Send(header));
  GPULAZY_ASSIGN_OR_RETURN(Frame frame, Read());
  if (!frame.header.has_hello_reply()) return Unexpected(frame.header, "HelloReply");
  return frame.header.hello_reply();
}

Result<wire::OpenImageReply> TestClient::Open(const std::string& image, uint64_t request_id) {
  wire::Header header;
  header.set_request_id(request_id);
  header.mutable_open_image()->set_image(image);
  GPULAZY_RETURN_IF_ERROR(Send(header));
  GPULAZY_ASSIGN_OR_RETURN(Frame frame, Read());
  if (!frame.header.has_open_image_reply()) return Unexpected(frame.header, "OpenImageReply");
  wire::OpenImageReply reply = frame.header.open_image_reply();
  if (version_ < 2) return reply;
  GPULAZY_ASSIGN_OR_RETURN(TableAssembler table, TableAssembler::Begin(reply.table_bytes()));
  GPULAZY_RETURN_IF_ERROR(table.Add(frame.payload, false));
  table_frames_ = 1;
  while (!table.complete()) {
    GPULAZY_ASSIGN_OR_RETURN(frame, Read());
    if (!frame.header.has_image_table_part()) return Unexpected(frame.header, "ImageTablePart");
    if (frame.header.request_id() != request_id)
      return Internal("table part answers request {}, not {}", frame.header.request_id(),
                      request_id);
    GPULAZY_RETURN_IF_ERROR(table.Add(frame.payload, true));
    ++table_frames_;
  }
  GPULAZY_ASSIGN_OR_RETURN(wire::ImageTable parsed, table.Finish());
  *reply.mutable_bos() = parsed.bos();
  *reply.mutable_profile() = parsed.profile();
  return reply;
}

Status TestClient::Credit(uint64_t bytes) {
  wire::Header header;
  header.mutable_credit()->set_bytes(bytes);
  return Send(header);
}

Status TestClient::StreamAll(uint64_t request_id) {
  wire::Header header;
  header.set_request_id(request_id);
  header.mutable_request()->set_stream_all(true);
  return Send(header);
}

Status TestClient::Request(wire::Priority priority, uint32_t bo, uint32_t first, uint32_t count,
                           uint64_t request_id) {
  wire::Header header;
  header.set_request_id(request_id);
  wire::Request* request = header.mutable_request();
  request->set_priority(priority);
  wire::ChunkRange* range = request->add_ranges();
  range->set_bo(bo);
  range->set_first_chunk(first);
  range->set_chunk_count(count);
  return Send(header);
}

Result<wire::Error> TestClient::ReadError(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    GPULAZY_ASSIGN_OR_RETURN(Frame frame, Read(timeout));
    if (frame.header.has_error()) return frame.header.error();
    if (!frame.header.has_chunk()) return Unexpected(frame.header, "Error");
  }
  return TimedOut("no Error frame");
}

Result<std::string> TestClient::Stats(uint64_t request_id) {
  wire::Header header;
  header.set_request_id(request_id);
  header.mutable_stats_request();
  GPULAZY_RETURN_IF_ERROR(Send(header));
  while (true) {
    GPULAZY_ASSIGN_OR_RETURN(Frame frame, Read());
    if (frame.header.has_stats_reply()) return frame.header.stats_reply().json();
    if (!frame.header.has_chunk() && !frame.header.has_stream_done())
      return Unexpected(frame.header, "StatsReply");
  }
}

// ---------------------------------------------------------------------------------------------

Status MakeTestImage(const std::filesystem::path& dir, const TestImage& image) {
  image::SynthOptions options;
  options.out = dir;
  options.gpus = 2;
  options.processes = image.processes;
  options.bos = image.bos;
  options.total_bytes = image.bytes;
  options.seed = image.seed;
  GPULAZY_RETURN_IF_ERROR(image::SynthesizeCheckpoint(options).status());
  if (!image.lazy) return Status::Ok();
  GPULAZY_ASSIGN_OR_RETURN(image::CriuCheckpoint checkpoint, image::CriuCheckpoint::Open(dir));
  image::ConvertOptions convert;
  convert.chunk_size = image.lazy_chunk;
  return image::ConvertToLazyImage(checkpoint, convert).status();
}

Result<std::map<BoKey, std::vector<uint8_t>>> LoadCriuContents(const fs::path& dir) {
  GPULAZY_ASSIGN_OR_RETURN(image::CriuCheckpoint checkpoint, image::CriuCheckpoint::Open(dir));
  std::map<BoKey, std::vector<uint8_t>> out;
  for (const image::ContentBo& bo : checkpoint.content_bos()) {
    std::vector<uint8_t> bytes(bo.size);
    if (bo.size > 0) {
      GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(dir / bo.pages_file));
      GPULAZY_RETURN_IF_ERROR(
          ReadExactAt(fd.get(), criu_format::kHeaderSize + bo.pages_offset, bytes, bo.pages_file));
    }
    out[{bo.process_id, bo.bo_index}] = std::move(bytes);
  }
  return out;
}

Result<std::vector<uint8_t>> DecodeChunkFrame(const Frame& frame) {
  const wire::ChunkData& data = frame.header.chunk();
  manifest::Chunk chunk;
  chunk.set_codec(data.codec());
  chunk.set_raw_length(data.raw_length());
  chunk.set_stored_length(static_cast<uint32_t>(frame.payload.size()));
  chunk.set_checksum(data.checksum());
  std::vector<uint8_t> raw(data.raw_length());
  GPULAZY_RETURN_IF_ERROR(image::DecodeChunk(
      chunk, frame.payload, raw, fmt::format("BO {} chunk {}", data.bo(), data.chunk())));
  return raw;
}

Result<Received> ReceiveStream(TestClient& client, uint64_t window,
                               std::chrono::milliseconds timeout) {
  GPULAZY_RETURN_IF_ERROR(client.Credit(window));
  GPULAZY_RETURN_IF_ERROR(client.StreamAll());
  Received out;
  uint64_t granted = window;
  uint64_t received = 0;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    GPULAZY_ASSIGN_OR_RETURN(Frame frame, client.Read());
    if (frame.header.has_stream_done()) {
      out.done = frame.header.stream_done();
      return out;
    }
    if (frame.header.has_error()) return Unexpected(frame.header, "ChunkData");
    if (!frame.header.has_chunk()) continue;
    received += frame.payload.size();
    if (received > granted)
      return Internal("server sent {} payload bytes with only {} granted", received, granted);
    const uint64_t size = frame.payload.size();
    out.chunks.push_back(std::move(frame));
    if (size > 0) {
      GPULAZY_RETURN_IF_ERROR(client.Credit(size));
      granted += size;
    }
  }
  return TimedOut("stream not done within {} ms", timeout.count());
}

Status VerifyStream(const wire::OpenImageReply& reply, const std::vector<Frame>& chunks,
                    const std::map<BoKey, std::vector<uint8_t>>& expected) {
  std::vector<std::vector<bool>> seen;
  for (const wire::BoInfo& bo : reply.bos())
    seen.emplace_back(bo.chunk_count(), false);
  for (const Frame& frame : chunks) {
    const wire::ChunkData& data = frame.header.chunk();
    if (data.bo() >= seen.size() || data.chunk() >= seen[data.bo()].size())
      return OutOfRange("chunk BO {} chunk {} out of range", data.bo(), data.chunk());
    if (seen[data.bo()][data.chunk()])
      return Corrupt("BO {} chunk {} received twice", data.bo(), data.chunk());
    seen[data.bo()][data.chunk()] = true;
    GPULAZY_ASSIGN_OR_RETURN(std::vector<uint8_t> raw, DecodeChunkFrame(frame));
    const wire::BoInfo& bo = reply.bos(static_cast<int>(data.bo()));
    auto it = expected.find({bo.process_id(), bo.bo_index()});
    if (it == expected.end()) return NotFound("BO {} not in the CRIU image", data.bo());
    const uint64_t offset = uint64_t{data.chunk()} * reply.chunk_size();
    if (offset + raw.size() > it->second.size() ||
        !std::equal(raw.begin(), raw.end(), it->second.begin() + static_cast<long>(offset)))
      return Corrupt("BO {} chunk {} differs from the CRIU bytes", data.bo(), data.chunk());
  }
  for (size_t bo = 0; bo < seen.size(); ++bo)
    for (size_t c = 0; c < seen[bo].size(); ++c)
      if (!seen[bo][c]) return NotFound("BO {} chunk {} never arrived", bo, c);
  return Status::Ok();
}

Status StreamWholeImage(const net::Endpoint& endpoint, const std::string& image,
                        const std::map<BoKey, std::vector<uint8_t>>& expected, uint64_t window) {
  TestClient client(endpoint);
  if (!client.connected()) return Unavailable("cannot connect to {}", endpoint.ToString());
  GPULAZY_RETURN_IF_ERROR(client.Hello().status());
  GPULAZY_ASSIGN_OR_RETURN(wire::OpenImageReply reply, client.Open(image));
  GPULAZY_ASSIGN_OR_RETURN(Received received, ReceiveStream(client, window));
  GPULAZY_RETURN_IF_ERROR(VerifyStream(reply, received.chunks, expected));
  if (received.done.chunks() != received.chunks.size())
    return Internal("StreamDone counts {} chunks, {} arrived", received.done.chunks(),
                    received.chunks.size());
  return Status::Ok();
}

}  // namespace gpulazy::server::testing
