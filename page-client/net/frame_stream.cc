#include "page-client/net/frame_stream.h"

#include <pthread.h>
#include <sys/sendfile.h>
#include <sys/socket.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <csignal>
#include <limits>
#include <string>

namespace gpulazy::net {
namespace asio = boost::asio;
using boost::system::error_code;

namespace {

Status SocketError(const error_code& ec, std::string_view what) {
  // A TLS peer that closes without close_notify truncates the stream: to us, a close.
  if (ec == asio::error::eof || ec == asio::error::connection_reset ||
      ec == asio::error::broken_pipe || ec == asio::error::connection_aborted ||
      ec == asio::ssl::error::stream_truncated)
    return Unavailable("{}: connection closed by peer ({})", what, ec.message());
  if (ec == asio::error::operation_aborted) return Aborted("{}: cancelled", what);
  // A Unix socket file that is missing is a server not (yet, or no longer) listening.
  if (ec == asio::error::connection_refused || ec == asio::error::host_unreachable ||
      ec == boost::system::errc::no_such_file_or_directory ||
      ec == asio::error::network_unreachable || ec == asio::error::not_found)
    return Unavailable("{}: {}", what, ec.message());
  if (ec == asio::error::timed_out) return TimedOut("{}: {}", what, ec.message());
  // A TLS alert mid-stream (the server refusing our certificate after a TLS 1.3 handshake).
  if (ec.category() == asio::error::get_ssl_category())
    return PermissionDenied("{}: TLS: {}", what, ec.message());
  return IoError("{}: {}", what, ec.message());
}

// Where a read failed decides the message: before a frame starts a close is ordinary; inside
// one it means the peer sent a truncated frame.
Status ReadError(const error_code& ec, bool inside_frame) {
  if (inside_frame && (ec == asio::error::eof || ec == asio::ssl::error::stream_truncated))
    return Corrupt("truncated frame: connection closed in the middle of a frame");
  return SocketError(ec, "reading a frame");
}

template <typename Header>
Result<wire::Header> ParseHeader(const Header& bytes) {
  return DecodeFrameHeader(std::span<const uint8_t>(bytes.data(), bytes.size()));
}

// sendfile has no MSG_NOSIGNAL: a peer gone mid-send raises SIGPIPE, which kills a process
// that has not ignored it (a server embedded in CRIU must leave CRIU's signals alone). So the
// signal is blocked on this thread around the call, and one it raised is taken back before the
// mask is restored; the call's EPIPE says what happened.
ssize_t SendfileWithoutSigpipe(int socket, int fd, off_t* offset, size_t length) {
  sigset_t pipe_only;
  sigemptyset(&pipe_only);
  sigaddset(&pipe_only, SIGPIPE);
  sigset_t old_mask;
  pthread_sigmask(SIG_BLOCK, &pipe_only, &old_mask);
  sigset_t pending;
  sigpending(&pending);
  const bool was_pending = sigismember(&pending, SIGPIPE) == 1;
  const ssize_t sent = ::sendfile(socket, fd, offset, length);
  const int error = errno;
  if (sent < 0 && error == EPIPE && !was_pending) {
    const timespec no_wait{};
    while (sigtimedwait(&pipe_only, nullptr, &no_wait) < 0 && errno == EINTR) {
    }
  }
  pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
  errno = error;
  return sent;
}

}  // namespace

template <typename AsyncStream>
Awaitable<Result<FrameHead>> ReadFrameHead(AsyncStream& socket, const FrameLimits& limits) {
  std::array<uint8_t, kFramePrefixSize> prefix_bytes;
  error_code ec;
  size_t got = co_await asio::async_read(socket, asio::buffer(prefix_bytes),
                                         asio::redirect_error(asio::use_awaitable, ec));
  if (ec) co_return ReadError(ec, got > 0);
  Result<FramePrefix> prefix = DecodeFramePrefix(prefix_bytes, limits);
  if (!prefix.ok()) co_return prefix.status();

  std::vector<uint8_t> header_bytes(prefix->header_length);
  co_await asio::async_read(socket, asio::buffer(header_bytes),
                            asio::redirect_error(asio::use_awaitable, ec));
  if (ec) co_return ReadError(ec, true);
  Result<wire::Header> header = ParseHeader(header_bytes);
  if (!header.ok()) co_return header.status();
  co_return FrameHead{std::move(*header), prefix->payload_length};
}

template <typename AsyncStream>
Awaitable<Status> ReadPayload(AsyncStream& socket, std::span<uint8_t> into) {
  if (into.empty()) co_return Status::Ok();
  error_code ec;
  co_await asio::async_read(socket, asio::buffer(into.data(), into.size()),
                            asio::redirect_error(asio::use_awaitable, ec));
  if (ec) co_return ReadError(ec, true);
  co_return Status::Ok();
}

PayloadWatermark::PayloadWatermark(Stream& stream, bool enabled) {
  if (enabled && stream.is_plain_tcp()) stream_ = &stream;
}

PayloadWatermark::~PayloadWatermark() {
  if (stream_ != nullptr && mark_ != 1) Set(1);
}

void PayloadWatermark::Expect(size_t bytes) {
  if (stream_ == nullptr) return;
  const int mark = static_cast<int>(std::clamp<size_t>(bytes, 1, kMaxBytes));
  if (mark != mark_) Set(mark);
}

void PayloadWatermark::Set(int bytes) {
  // A closed socket's descriptor number may belong to another file by now.
  if (!stream_->is_open()) return;
  // Best effort: if the kernel refuses, the reader is woken per segment as without the mark.
  if (::setsockopt(stream_->socket().native_handle(), SOL_SOCKET, SO_RCVLOWAT, &bytes,
                   sizeof bytes) == 0)
    mark_ = bytes;
}

Awaitable<Status> ReadPayload(Stream& stream, std::span<uint8_t> into, PayloadWatermark& mark) {
  if (!mark.active()) co_return co_await ReadPayload(stream, into);
  while (!into.empty()) {
    mark.Expect(into.size());
    error_code ec;
    const size_t got = co_await stream.async_read_some(
        asio::buffer(into.data(), into.size()), asio::redirect_error(asio::use_awaitable, ec));
    if (ec) co_return ReadError(ec, true);
    into = into.subspan(got);
  }
  co_return Status::Ok();
}

template <typename AsyncStream>
Awaitable<Result<wire::Header>> ReadFrame(AsyncStream& socket, const FrameLimits& limits,
                                          std::vector<uint8_t>* payload) {
  Result<FrameHead> head = co_await ReadFrameHead(socket, limits);
  if (!head.ok()) co_return head.status();
  payload->resize(head->payload_length);
  Status read = co_await ReadPayload(socket, *payload);
  if (!read.ok()) co_return read;
  co_return std::move(head->header);
}

template <typename AsyncStream>
Awaitable<Status> WriteFrame(AsyncStream& socket, const wire::Header& header,
                             std::span<const uint8_t> payload, const FrameLimits& limits) {
  Result<std::string> head = EncodeFrameHead(header, static_cast<uint32_t>(payload.size()), limits);
  if (!head.ok()) co_return head.status();
  if (payload.size() > limits.max_payload)
    co_return ResourceExhausted("payload of {} bytes exceeds {}", payload.size(),
                                limits.max_payload);
  std::array<asio::const_buffer, 2> buffers{asio::buffer(*head),
                                            asio::buffer(payload.data(), payload.size())};
  error_code ec;
  co_await asio::async_write(socket, buffers, asio::redirect_error(asio::use_awaitable, ec));
  if (ec) co_return SocketError(ec, "writing a frame");
  co_return Status::Ok();
}

Awaitable<Status> WriteFrameFromFile(Stream& stream, const wire::Header& header, int fd,
                                     uint64_t offset, uint32_t length, const FrameLimits& limits) {
  if (stream.is_tls())
    co_return Unsupported(
        "sending a frame from a file: the stream is TLS (encrypted in user "
        "space, so its bytes must pass through us)");
  if (length > limits.max_payload)
    co_return ResourceExhausted("payload of {} bytes exceeds {}", length, limits.max_payload);
  if (offset > static_cast<uint64_t>(std::numeric_limits<off_t>::max()) - length)
    co_return OutOfRange("file range [{}, +{}) does not fit an off_t", offset, length);
  Result<std::string> head = EncodeFrameHead(header, length, limits);
  if (!head.ok()) co_return head.status();
  Socket& socket = stream.socket();
  error_code ec;
  // MSG_MORE: on TCP the header waits for the payload instead of leaving as its own segment.
  for (size_t done = 0; done < head->size();) {
    done += co_await socket.async_send(asio::buffer(*head) + done, MSG_MORE,
                                       asio::redirect_error(asio::use_awaitable, ec));
    if (ec) co_return SocketError(ec, "writing a frame header");
  }
  // sendfile must not block the event loop on a full socket: EAGAIN waits for writability.
  // Set once per socket (the flag stays), not once per frame.
  if (!socket.native_non_blocking()) {
    socket.native_non_blocking(true, ec);
    if (ec) co_return SocketError(ec, "making the socket non-blocking for sendfile");
  }
  auto at = static_cast<off_t>(offset);
  uint64_t left = length;
  while (left > 0) {
    const ssize_t sent = SendfileWithoutSigpipe(socket.native_handle(), fd, &at, left);
    if (sent > 0) {
      left -= static_cast<uint64_t>(sent);
      continue;
    }
    if (sent == 0)
      co_return Corrupt(
          "sending a frame from a file: the file ends at offset {}, {} bytes short "
          "of the frame's payload (file shrank?)",
          at, left);
    const int error = errno;
    if (error == EINTR) continue;
    if (error == EAGAIN) {
      co_await socket.async_wait(Socket::wait_write, asio::redirect_error(asio::use_awaitable, ec));
      if (ec) co_return SocketError(ec, "waiting to send a frame's payload");
      continue;
    }
    co_return SocketError(error_code(error, boost::system::system_category()),
                          "sending a frame's payload from a file");
  }
  co_return Status::Ok();
}

void TuneSocket(Socket& socket) {
  if (!socket.is_open()) return;
  error_code ignored;
  socket.set_option(asio::socket_base::send_buffer_size(kSocketBufferBytes), ignored);
  socket.set_option(asio::socket_base::receive_buffer_size(kSocketBufferBytes), ignored);
  int family = socket.local_endpoint(ignored).protocol().family();
  if (family == AF_INET || family == AF_INET6)
    socket.set_option(asio::ip::tcp::no_delay(true), ignored);
}

void ForceSocketBuffers(Socket& socket) {
  if (!socket.is_open()) return;
  const int bytes = kSocketBufferBytes;
  // EPERM without CAP_NET_ADMIN: the buffers stay as TuneSocket left them.
  (void)::setsockopt(socket.native_handle(), SOL_SOCKET, SO_SNDBUFFORCE, &bytes, sizeof bytes);
  (void)::setsockopt(socket.native_handle(), SOL_SOCKET, SO_RCVBUFFORCE, &bytes, sizeof bytes);
}

Awaitable<Result<Socket>> Connect(const Endpoint& endpoint) {
  auto executor = co_await asio::this_coro::executor;
  Socket socket(executor);
  error_code ec;
  if (endpoint.kind == Endpoint::Kind::kUnix) {
    asio::local::stream_protocol::endpoint unix_endpoint(endpoint.path);
    co_await socket.async_connect(asio::generic::stream_protocol::endpoint(unix_endpoint),
                                  asio::redirect_error(asio::use_awaitable, ec));
    if (ec) co_return SocketError(ec, fmt::format("connecting to {}", endpoint.ToString()));
    co_return std::move(socket);
  }
  asio::ip::tcp::resolver resolver(executor);
  auto results = co_await resolver.async_resolve(endpoint.host, std::to_string(endpoint.port),
                                                 asio::redirect_error(asio::use_awaitable, ec));
  if (ec) co_return SocketError(ec, fmt::format("resolving {}", endpoint.ToString()));
  for (const auto& entry : results) {
    Socket attempt(executor);
    co_await attempt.async_connect(asio::generic::stream_protocol::endpoint(entry.endpoint()),
                                   asio::redirect_error(asio::use_awaitable, ec));
    if (!ec) {
      TuneSocket(attempt);
      co_return std::move(attempt);
    }
  }
  co_return SocketError(ec ? ec : asio::error::host_not_found,
                        fmt::format("connecting to {}", endpoint.ToString()));
}

template <typename SyncStream>
Result<wire::Header> ReadFrameBlocking(SyncStream& socket, const FrameLimits& limits,
                                       std::vector<uint8_t>* payload) {
  std::array<uint8_t, kFramePrefixSize> prefix_bytes;
  error_code ec;
  size_t got = asio::read(socket, asio::buffer(prefix_bytes), ec);
  if (ec) return ReadError(ec, got > 0);
  GPULAZY_ASSIGN_OR_RETURN(FramePrefix prefix, DecodeFramePrefix(prefix_bytes, limits));
  std::vector<uint8_t> header_bytes(prefix.header_length);
  asio::read(socket, asio::buffer(header_bytes), ec);
  if (ec) return ReadError(ec, true);
  GPULAZY_ASSIGN_OR_RETURN(wire::Header header, ParseHeader(header_bytes));
  payload->resize(prefix.payload_length);
  if (prefix.payload_length > 0) {
    asio::read(socket, asio::buffer(*payload), ec);
    if (ec) return ReadError(ec, true);
  }
  return header;
}

template <typename SyncStream>
Status WriteFrameBlocking(SyncStream& socket, const wire::Header& header,
                          std::span<const uint8_t> payload, const FrameLimits& limits) {
  GPULAZY_ASSIGN_OR_RETURN(std::string head,
                           EncodeFrameHead(header, static_cast<uint32_t>(payload.size()), limits));
  std::array<asio::const_buffer, 2> buffers{asio::buffer(head),
                                            asio::buffer(payload.data(), payload.size())};
  error_code ec;
  asio::write(socket, buffers, ec);
  if (ec) return SocketError(ec, "writing a frame");
  return Status::Ok();
}

// The two stream types frames travel on (frame_stream.h).
template Awaitable<Result<FrameHead>> ReadFrameHead(Socket&, const FrameLimits&);
template Awaitable<Status> ReadPayload(Socket&, std::span<uint8_t>);
template Awaitable<Result<wire::Header>> ReadFrame(Socket&, const FrameLimits&,
                                                   std::vector<uint8_t>*);
template Awaitable<Status> WriteFrame(Socket&, const wire::Header&, std::span<const uint8_t>,
                                      const FrameLimits&);
template Result<wire::Header> ReadFrameBlocking(Socket&, const FrameLimits&, std::vector<uint8_t>*);
template Status WriteFrameBlocking(Socket&, const wire::Header&, std::span<const uint8_t>,
                                   const FrameLimits&);
template Awaitable<Result<FrameHead>> ReadFrameHead(Stream&, const FrameLimits&);
template Awaitable<Status> ReadPayload(Stream&, std::span<uint8_t>);
template Awaitable<Result<wire::Header>> ReadFrame(Stream&, const FrameLimits&,
                                                   std::vector<uint8_t>*);
template Awaitable<Status> WriteFrame(Stream&, const wire::Header&, std::span<const uint8_t>,
                                      const FrameLimits&);
template Result<wire::Header> ReadFrameBlocking(Stream&, const FrameLimits&, std::vector<uint8_t>*);
template Status WriteFrameBlocking(Stream&, const wire::Header&, std::span<const uint8_t>,
                                   const FrameLimits&);

Result<Socket> ConnectBlocking(asio::io_context& io, const Endpoint& endpoint) {
  Socket socket(io);
  error_code ec;
  if (endpoint.kind == Endpoint::Kind::kUnix) {
    socket.connect(asio::generic::stream_protocol::endpoint(
                       asio::local::stream_protocol::endpoint(endpoint.path)),
                   ec);
    if (ec) return SocketError(ec, fmt::format("connecting to {}", endpoint.ToString()));
    return socket;
  }
  asio::ip::tcp::resolver resolver(io);
  auto results = resolver.resolve(endpoint.host, std::to_string(endpoint.port), ec);
  if (ec) return SocketError(ec, fmt::format("resolving {}", endpoint.ToString()));
  for (const auto& entry : results) {
    Socket attempt(io);
    attempt.connect(asio::generic::stream_protocol::endpoint(entry.endpoint()), ec);
    if (!ec) {
      TuneSocket(attempt);
      return attempt;
    }
  }
  return SocketError(ec ? ec : asio::error::host_not_found,
                     fmt::format("connecting to {}", endpoint.ToString()));
}

}  // namespace gpulazy::net
