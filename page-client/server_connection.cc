#include "page-client/server_connection.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <optional>

#include "page-client/net/fd_passing.h"
#include "proto/utf8.h"

namespace gpulazy::client {
namespace asio = boost::asio;

Status ErrorFrameStatus(const wire::Error& error, std::string_view what) {
  std::string_view code = wire::ErrorCode_Name(error.code());
  std::string message = fmt::format("{}: server says {}: {}", what, code, error.message());
  switch (error.code()) {
    case wire::ERROR_NOT_FOUND:
      return Status(Code::kNotFound, message);
    case wire::ERROR_UNAUTHENTICATED:
      return Status(Code::kPermissionDenied, message);
    case wire::ERROR_UNSUPPORTED_VERSION:
      return Status(Code::kUnsupported, message);
    case wire::ERROR_OUT_OF_RANGE:
      return Status(Code::kOutOfRange, message);
    case wire::ERROR_CORRUPT:
      return Status(Code::kCorrupt, message);
    case wire::ERROR_IO:
      return Status(Code::kIoError, message);
    case wire::ERROR_LIMIT:
      return Status(Code::kResourceExhausted, message);
    case wire::ERROR_SHUTTING_DOWN:
      return Status(Code::kUnavailable, message);
    case wire::ERROR_BAD_REQUEST:
      return Status(Code::kInvalidArgument, message);
    default:
      return Status(Code::kInternal, message);
  }
}

bool IsRetryableServerError(const wire::Error& error) {
  return error.code() == wire::ERROR_SHUTTING_DOWN;
}

namespace {

// Closes the socket if the guarded exchange outlives its deadline. The shared flag keeps a
// timer handler that was already queued from touching a socket the exchange has moved on with.
class HandshakeDeadline {
 public:
  HandshakeDeadline(const asio::any_io_executor& executor, net::Stream* socket,
                    std::chrono::milliseconds timeout)
      : timer_(std::make_shared<asio::steady_timer>(executor, timeout)),
        finished_(std::make_shared<bool>(false)) {
    timer_->async_wait(
        [timer = timer_, finished = finished_, socket](boost::system::error_code ec) {
          if (ec || *finished) return;
          boost::system::error_code ignored;
          socket->close(ignored);
        });
  }
  ~HandshakeDeadline() {
    *finished_ = true;
    boost::system::error_code ignored;
    timer_->cancel(ignored);  // the non-throwing overload: destructors must not throw
  }
  HandshakeDeadline(const HandshakeDeadline&) = delete;
  HandshakeDeadline& operator=(const HandshakeDeadline&) = delete;

 private:
  std::shared_ptr<asio::steady_timer> timer_;
  std::shared_ptr<bool> finished_;
};

}  // namespace

net::Awaitable<Result<Handshake>> ConnectAndHello(const net::Endpoint& endpoint,
                                                  const net::ClientTransport& transport,
                                                  const wire::Hello& hello,
                                                  std::chrono::milliseconds timeout,
                                                  bool* refused) {
  *refused = false;
  auto executor = co_await asio::this_coro::executor;
  // The connect itself is bounded by the OS (Unix sockets answer at once; TCP by its SYN
  // retries); the deadline starts once there is a socket to close.
  Result<net::Stream> connected = co_await net::Connect(endpoint, transport);
  if (!connected.ok()) {
    *refused = connected.status().code() == Code::kPermissionDenied;
    co_return connected.status();
  }
  Handshake handshake{std::move(connected).value(), {}};
  net::TuneSocket(handshake.socket.socket());
  net::ForceSocketBuffers(handshake.socket.socket());  // our own connection to our server
  HandshakeDeadline deadline(executor, &handshake.socket, timeout);
  Status tls = co_await handshake.socket.Handshake();
  if (!tls.ok()) {
    if (!handshake.socket.is_open())
      co_return TimedOut("{}: no TLS handshake within {} ms", endpoint.ToString(), timeout.count());
    // A refused certificate stays refused; a connection dropped mid-handshake may recover.
    *refused = tls.code() == Code::kPermissionDenied;
    co_return tls.Context(endpoint.ToString());
  }

  FrameLimits limits;
  wire::Header header;
  *header.mutable_hello() = hello;
  Status sent = co_await net::WriteFrame(handshake.socket, header, {}, limits);
  if (!sent.ok()) co_return sent.Context(fmt::format("sending Hello to {}", endpoint.ToString()));
  std::vector<uint8_t> payload;
  Result<wire::Header> reply = co_await net::ReadFrame(handshake.socket, limits, &payload);
  if (!reply.ok()) {
    if (!handshake.socket.is_open())
      co_return TimedOut("{}: no HelloReply within {} ms", endpoint.ToString(), timeout.count());
    // A TLS alert here is the server refusing our certificate (TLS 1.3 checks it after the
    // client has finished its side of the handshake).
    *refused = reply.status().code() == Code::kPermissionDenied;
    co_return reply.status().Context(
        fmt::format("waiting for HelloReply from {}", endpoint.ToString()));
  }
  if (reply->has_error()) {
    *refused = !IsRetryableServerError(reply->error());
    co_return ErrorFrameStatus(reply->error(), fmt::format("Hello to {}", endpoint.ToString()));
  }
  if (!reply->has_hello_reply())
    co_return Corrupt("{}: expected HelloReply, got header body {}", endpoint.ToString(),
                      static_cast<int>(reply->body_case()));
  const uint32_t version = reply->hello_reply().version();
  if (version < std::max(hello.min_version(), kMinProtocolVersion) ||
      version > std::min(hello.max_version(), kProtocolVersion))
    co_return Unsupported("{}: server chose protocol version {}, we offered {}..{}",
                          endpoint.ToString(), version, hello.min_version(), hello.max_version());
  handshake.reply = reply->hello_reply();
  co_return std::move(handshake);
}

namespace {

// What a passed descriptor must be before we read chunks from it.
Status CheckPassedFile(const ImageFileSet::File& file) {
  struct stat st {};
  if (::fstat(file.fd.get(), &st) != 0) return ErrnoError(errno, "fstat of {}", file.name);
  if (!S_ISREG(st.st_mode)) return Corrupt("{} is not a regular file", file.name);
  if (static_cast<uint64_t>(st.st_size) != file.size)
    return Corrupt("{} has {} bytes, the server said {}", file.name, st.st_size, file.size);
  const int flags = ::fcntl(file.fd.get(), F_GETFL);
  if (flags < 0) return ErrnoError(errno, "F_GETFL of {}", file.name);
  // We only read; a writable descriptor to a checkpoint is one slip away from corrupting it.
  if ((flags & O_ACCMODE) != O_RDONLY) return Corrupt("{} was passed writable", file.name);
  return Status::Ok();
}

}  // namespace

const ImageFileSet::Location* ImageFileSet::Locate(uint32_t bo, uint32_t chunk) const {
  if (bo >= first_chunk.size()) return nullptr;
  const uint64_t index = first_chunk[bo] + chunk;
  const uint64_t end = bo + 1 < first_chunk.size() ? first_chunk[bo + 1] : chunk_table.size();
  return index < end ? &chunk_table[index] : nullptr;
}

Status AdoptChunkTable(const wire::ChunkLocations& table, const ChunkTableShape& shape,
                       ImageFileSet* set) {
  if (shape.chunk_size == 0) return InvalidArgument("chunk table for a chunk size of 0");
  std::vector<uint64_t> first_chunk;
  uint64_t total = 0;
  for (uint64_t size : shape.bo_sizes) {
    first_chunk.push_back(total);
    total += ResidencyMap::ChunkCountFor(size, shape.chunk_size);
  }
  const auto n = static_cast<int>(std::min<uint64_t>(total, INT32_MAX));
  if (total > INT32_MAX || table.file_size() != n || table.offset_size() != n ||
      table.stored_length_size() != n || table.codec_size() != n || table.checksum_size() != n ||
      table.has_checksum_size() != n)
    return Corrupt("chunk table lists {}/{}/{}/{}/{}/{} entries for {} chunks", table.file_size(),
                   table.offset_size(), table.stored_length_size(), table.codec_size(),
                   table.checksum_size(), table.has_checksum_size(), total);
  std::vector<ImageFileSet::Location> locations;
  locations.reserve(total);
  for (size_t bo = 0; bo < shape.bo_sizes.size(); ++bo) {
    const uint64_t end = bo + 1 < first_chunk.size() ? first_chunk[bo + 1] : total;
    for (uint64_t i = first_chunk[bo]; i < end; ++i) {
      const int at = static_cast<int>(i);
      const uint64_t chunk = i - first_chunk[bo];
      const uint64_t raw =
          std::min<uint64_t>(shape.chunk_size, shape.bo_sizes[bo] - chunk * shape.chunk_size);
      ImageFileSet::Location where;
      where.file = table.file(at);
      where.offset = table.offset(at);
      where.stored_length = table.stored_length(at);
      where.codec = table.codec(at);
      if (table.has_checksum(at)) where.checksum = table.checksum(at);
      const std::string what = fmt::format("chunk table: BO {} chunk {}", bo, chunk);
      if (where.file >= set->files.size())
        return Corrupt("{} is in file {}; {} were passed", what, where.file, set->files.size());
      const ImageFileSet::File& file = set->files[where.file];
      if (where.offset > file.size || where.stored_length > file.size - where.offset)
        return Corrupt("{} at [{}, +{}) lies past the end of {} ({} bytes)", what, where.offset,
                       where.stored_length, file.name, file.size);
      if (where.stored_length > shape.max_payload)
        return Corrupt("{} stores {} bytes (limit {})", what, where.stored_length,
                       shape.max_payload);
      const bool fits = (where.codec == manifest::CODEC_RAW && where.stored_length == raw) ||
                        (where.codec == manifest::CODEC_ZERO && where.stored_length == 0) ||
                        (where.codec == manifest::CODEC_LZ4 && where.stored_length > 0);
      if (!fits)
        return Corrupt("{}: codec {} with {} stored bytes for {} raw bytes", what,
                       static_cast<int>(where.codec), where.stored_length, raw);
      if (shape.lazy_image && !where.checksum)
        return Corrupt("{} of a lazy image comes without its checksum", what);
      locations.push_back(where);
    }
  }
  set->chunk_table = std::move(locations);
  set->first_chunk = std::move(first_chunk);
  return Status::Ok();
}

namespace {

// The rest of a version-2 table after the frame that announced it (`announced` bytes, the first
// of them in `payload`): ImageTablePart frames until every byte is there, parsed as Message.
// An Error frame instead is the server's word (*server_error is set to it); `what` prefixes
// every message.
template <typename Message>
net::Awaitable<Result<Message>> ReadTable(net::Stream& socket, const FrameLimits& limits,
                                          uint64_t announced, uint64_t max_bytes,
                                          std::vector<uint8_t>& payload,
                                          std::chrono::milliseconds timeout,
                                          const std::string& what,
                                          std::optional<wire::Error>* server_error) {
  Result<TableAssembler> table = TableAssembler::Begin(announced, max_bytes);
  if (!table.ok()) co_return table.status().Context(what);
  Status added = table->Add(payload, /*continuation=*/false);
  while (added.ok() && !table->complete()) {
    Result<wire::Header> part = co_await net::ReadFrame(socket, limits, &payload);
    if (!part.ok()) {
      if (!socket.is_open())
        co_return TimedOut("{}: table incomplete after {} ms ({} bytes missing)", what,
                           timeout.count(), table->missing());
      co_return part.status().Context(fmt::format("{}: reading its table", what));
    }
    if (part->has_error()) {
      *server_error = part->error();
      co_return ErrorFrameStatus(part->error(), what);
    }
    if (!part->has_image_table_part())
      co_return Corrupt("{}: expected ImageTablePart, got header body {}", what,
                        static_cast<int>(part->body_case()));
    added = table->Add(payload, /*continuation=*/true);
  }
  if (!added.ok()) co_return added.Context(what);
  Result<Message> parsed = table->template FinishAs<Message>();
  if (!parsed.ok()) co_return parsed.status().Context(what);
  co_return std::move(parsed).value();
}

}  // namespace

net::Awaitable<Result<std::shared_ptr<const ImageFileSet>>> FetchImageFiles(
    const net::Endpoint& endpoint, wire::Hello join, std::chrono::milliseconds timeout,
    const ChunkTableShape* shape) {
  const std::string where = fmt::format("image files from {}", endpoint.ToString());
  Result<net::Socket> connected = co_await net::Connect(endpoint);
  if (!connected.ok()) co_return connected.status().Context(where);
  net::Stream stream(std::move(connected).value());
  HandshakeDeadline deadline(co_await asio::this_coro::executor, &stream, timeout);
  FrameLimits limits;
  join.set_want_files(true);
  join.set_want_chunk_table(shape != nullptr);
  if (shape != nullptr) limits.max_payload = std::max(limits.max_payload, shape->max_payload);
  wire::Header hello;
  *hello.mutable_hello() = std::move(join);
  Status sent = co_await net::WriteFrame(stream, hello, {}, limits);
  if (!sent.ok()) co_return sent.Context(where);
  Result<net::FrameWithFds> reply =
      co_await net::ReadFrameWithFds(stream.socket(), limits, net::kMaxPassedFds);
  if (!reply.ok()) {
    if (!stream.is_open()) co_return TimedOut("{}: no answer within {} ms", where, timeout.count());
    co_return reply.status().Context(where);
  }
  if (reply->header.has_error()) co_return ErrorFrameStatus(reply->header.error(), where);
  // A server that predates want_files ignores it and takes us for a demand connection.
  if (reply->header.has_hello_reply())
    co_return InvalidArgument("{}: the server does not pass image files", where);
  if (!reply->header.has_image_files())
    co_return Corrupt("{}: expected ImageFiles, got header body {}", where,
                      static_cast<int>(reply->header.body_case()));
  const wire::ImageFiles& listed = reply->header.image_files();
  if (static_cast<size_t>(listed.files_size()) != reply->fds.size())
    co_return Corrupt("{}: {} files listed, {} descriptors attached", where, listed.files_size(),
                      reply->fds.size());
  auto set = std::make_shared<ImageFileSet>();
  for (int i = 0; i < listed.files_size(); ++i) {
    ImageFileSet::File file;
    file.name = listed.files(i).name().substr(0, 256);
    file.fd = std::move(reply->fds[static_cast<size_t>(i)]);
    file.size = listed.files(i).size();
    Status valid = CheckPassedFile(file);
    if (!valid.ok()) co_return valid.Context(where);
    set->files.push_back(std::move(file));
  }
  if (shape == nullptr) co_return std::shared_ptr<const ImageFileSet>(std::move(set));

  // The chunk table: a ChunkTable frame and its pieces, as an image table travels.
  std::vector<uint8_t> payload;
  Result<wire::Header> head = co_await net::ReadFrame(stream, limits, &payload);
  if (!head.ok()) {
    if (!stream.is_open())
      co_return TimedOut("{}: no chunk table within {} ms", where, timeout.count());
    if (head.status().code() == Code::kUnavailable) {
      // Closed after the files: a server that keeps no chunk table for us.
      spdlog::info("{}: no chunk table; chunks waited for are asked of the server", where);
      co_return std::shared_ptr<const ImageFileSet>(std::move(set));
    }
    co_return head.status().Context(where);
  }
  if (head->has_error()) {
    // The files came; only the table did not: faults go to the server, as without one.
    spdlog::warn("{}: {}", where, ErrorFrameStatus(head->error(), "chunk table").ToString());
    co_return std::shared_ptr<const ImageFileSet>(std::move(set));
  }
  if (!head->has_chunk_table())
    co_return Corrupt("{}: expected ChunkTable, got header body {}", where,
                      static_cast<int>(head->body_case()));
  std::optional<wire::Error> server_error;
  Result<wire::ChunkLocations> locations = co_await ReadTable<wire::ChunkLocations>(
      stream, limits, head->chunk_table().table_bytes(), kDefaultMaxImageTableBytes, payload,
      timeout, where, &server_error);
  if (server_error) {
    spdlog::warn("{}: {}", where, locations.status().ToString());
    co_return std::shared_ptr<const ImageFileSet>(std::move(set));
  }
  if (!locations.ok()) co_return locations.status();
  Status adopted = AdoptChunkTable(*locations, *shape, set.get());
  if (!adopted.ok()) co_return adopted.Context(where);
  co_return std::shared_ptr<const ImageFileSet>(std::move(set));
}

net::Awaitable<Result<wire::OpenImageReply>> OpenImage(
    net::Stream& socket, const std::string& image, uint32_t version, const FrameLimits& limits,
    std::chrono::milliseconds timeout, bool* refused,
    const std::optional<EarlierSession>& supersedes, uint64_t max_table_bytes) {
  *refused = false;
  if (!IsValidUtf8(image)) {
    *refused = true;  // no server could parse it: a protobuf string must be UTF-8
    co_return InvalidArgument("image name '{}' is not valid UTF-8", ToValidUtf8(image));
  }
  HandshakeDeadline deadline(co_await asio::this_coro::executor, &socket, timeout);
  wire::Header header;
  header.mutable_open_image()->set_image(image);
  if (supersedes) {
    header.mutable_open_image()->set_supersedes_session(supersedes->id);
    header.mutable_open_image()->set_supersedes_secret(supersedes->secret);
  }
  Status sent = co_await net::WriteFrame(socket, header, {}, limits);
  if (!sent.ok()) co_return sent.Context(fmt::format("opening image {}", image));
  std::vector<uint8_t> payload;
  Result<wire::Header> reply = co_await net::ReadFrame(socket, limits, &payload);
  if (!reply.ok()) {
    if (!socket.is_open())
      co_return TimedOut("opening image {}: no reply within {} ms", image, timeout.count());
    co_return reply.status().Context(fmt::format("opening image {}", image));
  }
  if (reply->has_error()) {
    *refused = !IsRetryableServerError(reply->error());
    co_return ErrorFrameStatus(reply->error(), fmt::format("opening image {}", image));
  }
  if (!reply->has_open_image_reply())
    co_return Corrupt("opening image {}: expected OpenImageReply, got header body {}", image,
                      static_cast<int>(reply->body_case()));
  wire::OpenImageReply opened = std::move(*reply->mutable_open_image_reply());
  if (version < 2) {
    if (!payload.empty())
      co_return Corrupt("opening image {}: a version 1 OpenImageReply with a payload", image);
    co_return opened;
  }
  // Version 2: the BO table and the hot set follow as payload (docs/protocol.md, OpenImage).
  if (opened.bos_size() != 0 || opened.has_profile())
    co_return Corrupt("opening image {}: a version 2 OpenImageReply lists its table in the header",
                      image);
  std::optional<wire::Error> server_error;
  Result<wire::ImageTable> parsed = co_await ReadTable<wire::ImageTable>(
      socket, limits, opened.table_bytes(), max_table_bytes, payload, timeout,
      fmt::format("opening image {}", image), &server_error);
  if (server_error) *refused = !IsRetryableServerError(*server_error);
  if (!parsed.ok()) co_return parsed.status();
  opened.mutable_bos()->Swap(parsed->mutable_bos());
  opened.mutable_profile()->Swap(parsed->mutable_profile());
  co_return opened;
}

net::Awaitable<Status> PlaceInto(net::Stream& socket, std::vector<wire::Header> frames,
                                 const FrameLimits& limits, std::chrono::milliseconds timeout,
                                 bool* refused) {
  *refused = false;
  HandshakeDeadline deadline(co_await asio::this_coro::executor, &socket, timeout);
  std::vector<uint8_t> payload;
  for (const wire::Header& frame : frames) {
    Status sent = co_await net::WriteFrame(socket, frame, {}, limits);
    if (!sent.ok()) co_return sent.Context("handing over destinations");
    Result<wire::Header> reply = co_await net::ReadFrame(socket, limits, &payload);
    if (!reply.ok()) {
      if (!socket.is_open())
        co_return TimedOut("handing over destinations: no reply within {} ms", timeout.count());
      co_return reply.status().Context("handing over destinations");
    }
    if (reply->has_error()) {
      *refused = !IsRetryableServerError(reply->error());
      co_return ErrorFrameStatus(reply->error(), "handing over destinations");
    }
    if (!reply->has_place_into_reply() || !payload.empty())
      co_return Corrupt("handing over destinations: expected PlaceIntoReply, got header body {}",
                        static_cast<int>(reply->body_case()));
  }
  co_return Status::Ok();
}

std::vector<wire::Header> HaveFrames(const std::vector<ChunkRun>& held,
                                     size_t max_ranges_per_frame) {
  std::vector<wire::Header> frames;
  const size_t per_frame = std::max<size_t>(1, max_ranges_per_frame);
  for (size_t i = 0; i < held.size(); ++i) {
    if (i % per_frame == 0) frames.emplace_back().mutable_have();
    wire::ChunkRange* range = frames.back().mutable_have()->add_ranges();
    range->set_bo(held[i].bo);
    range->set_first_chunk(held[i].first);
    range->set_chunk_count(held[i].count);
  }
  return frames;
}

FrameWriter::FrameWriter(net::Stream& socket, FrameLimits limits)
    : socket_(socket), limits_(limits), wakeup_(socket.get_executor()) {
  wakeup_.expires_at(asio::steady_timer::time_point::max());
}

void FrameWriter::Send(wire::Header header) {
  if (closed_) return;
  queue_.push_back(std::move(header));
  wakeup_.cancel();
}

void FrameWriter::Close() {
  closed_ = true;
  wakeup_.cancel();
}

net::Awaitable<Status> FrameWriter::Run() {
  for (;;) {
    while (!queue_.empty()) {
      // Pop before writing: a frame is never written twice, and Send may append meanwhile.
      wire::Header header = std::move(queue_.front());
      queue_.pop_front();
      Status status = co_await net::WriteFrame(socket_, header, {}, limits_);
      if (!status.ok()) co_return status;
    }
    if (closed_) co_return Status::Ok();
    boost::system::error_code ec;
    wakeup_.expires_at(asio::steady_timer::time_point::max());
    co_await wakeup_.async_wait(asio::redirect_error(asio::use_awaitable, ec));
  }
}

Result<std::string> FetchServerStats(const net::Endpoint& endpoint,
                                     const net::ClientTransport& transport,
                                     const std::string& token, const std::string& client_name) {
  boost::asio::io_context io;
  GPULAZY_ASSIGN_OR_RETURN(net::Stream socket, net::ConnectBlocking(io, endpoint, transport));
  FrameLimits limits;
  std::vector<uint8_t> payload;
  wire::Header hello;
  hello.mutable_hello()->set_min_version(kMinProtocolVersion);
  hello.mutable_hello()->set_max_version(kProtocolVersion);
  hello.mutable_hello()->set_client_name(ToValidUtf8(client_name));
  hello.mutable_hello()->set_token(token);
  GPULAZY_RETURN_IF_ERROR(net::WriteFrameBlocking(socket, hello, {}, limits));
  GPULAZY_ASSIGN_OR_RETURN(wire::Header reply, net::ReadFrameBlocking(socket, limits, &payload));
  if (reply.has_error())
    return Unavailable("Hello refused: {} ({})", reply.error().message(),
                       wire::ErrorCode_Name(reply.error().code()));
  if (!reply.has_hello_reply()) return Corrupt("expected HelloReply from {}", endpoint.ToString());
  wire::Header request;
  request.set_request_id(1);
  request.mutable_stats_request();
  GPULAZY_RETURN_IF_ERROR(net::WriteFrameBlocking(socket, request, {}, limits));
  GPULAZY_ASSIGN_OR_RETURN(reply, net::ReadFrameBlocking(socket, limits, &payload));
  if (reply.has_error())
    return Unavailable("stats refused: {} ({})", reply.error().message(),
                       wire::ErrorCode_Name(reply.error().code()));
  if (!reply.has_stats_reply()) return Corrupt("expected StatsReply from {}", endpoint.ToString());
  return reply.stats_reply().json();
}

}  // namespace gpulazy::client
