#include "page-client/server_connection.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <memory>

#include "page-client/net/fd_passing.h"

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

net::Awaitable<Result<std::shared_ptr<const ImageFileSet>>> FetchImageFiles(
    const net::Endpoint& endpoint, wire::Hello join, std::chrono::milliseconds timeout) {
  const std::string where = fmt::format("image files from {}", endpoint.ToString());
  Result<net::Socket> connected = co_await net::Connect(endpoint);
  if (!connected.ok()) co_return connected.status().Context(where);
  net::Stream stream(std::move(connected).value());
  HandshakeDeadline deadline(co_await asio::this_coro::executor, &stream, timeout);
  FrameLimits limits;
  join.set_want_files(true);
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
  co_return std::shared_ptr<const ImageFileSet>(std::move(set));
}

net::Awaitable<Result<wire::OpenImageReply>> OpenImage(net::Stream& socket,
                                                       const std::string& image, uint32_t version,
                                                       const FrameLimits& limits,
                                                       std::chrono::milliseconds timeout,
                                                       bool* refused, uint64_t max_table_bytes) {
  *refused = false;
  HandshakeDeadline deadline(co_await asio::this_coro::executor, &socket, timeout);
  wire::Header header;
  header.mutable_open_image()->set_image(image);
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
  Result<ImageTableAssembler> table =
      ImageTableAssembler::Begin(opened.table_bytes(), max_table_bytes);
  if (!table.ok()) co_return table.status().Context(fmt::format("opening image {}", image));
  Status added = table->Add(payload, /*continuation=*/false);
  while (added.ok() && !table->complete()) {
    reply = co_await net::ReadFrame(socket, limits, &payload);
    if (!reply.ok()) {
      if (!socket.is_open())
        co_return TimedOut(
            "opening image {}: image table incomplete after {} ms ({} bytes missing)", image,
            timeout.count(), table->missing());
      co_return reply.status().Context(fmt::format("opening image {}: reading its table", image));
    }
    if (reply->has_error()) {
      *refused = !IsRetryableServerError(reply->error());
      co_return ErrorFrameStatus(reply->error(), fmt::format("opening image {}", image));
    }
    if (!reply->has_image_table_part())
      co_return Corrupt("opening image {}: expected ImageTablePart, got header body {}", image,
                        static_cast<int>(reply->body_case()));
    added = table->Add(payload, /*continuation=*/true);
  }
  if (!added.ok()) co_return added.Context(fmt::format("opening image {}", image));
  Result<wire::ImageTable> parsed = table->Finish();
  if (!parsed.ok()) co_return parsed.status().Context(fmt::format("opening image {}", image));
  opened.mutable_bos()->Swap(parsed->mutable_bos());
  opened.mutable_profile()->Swap(parsed->mutable_profile());
  co_return opened;
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

}  // namespace gpulazy::client
