// Reading and writing protocol frames (proto/frame.h) on a connected stream socket, as
// coroutines for the server and client event loops and as blocking calls for tools and tests.
// Every length read from the socket is checked against FrameLimits before anything is
// allocated. A socket is used by one reader and one writer at a time (a strand or a single
// io_context thread per connection serializes them).
//
// The frame functions are templates over the stream, instantiated for net::Stream (plain or
// TLS, what servers and clients use) and the bare net::Socket (tests and tools speaking to a
// Unix socket or an --insecure-tcp server); the framing exists once.
#pragma once

#include <span>
#include <vector>

#include "page-client/net/asio.h"
#include "page-client/net/endpoint.h"
#include "page-client/net/stream.h"
#include "proto/frame.h"
#include "proto/status.h"
#include "proto/wire.pb.h"

namespace gpulazy::net {

// A frame whose header has been read and whose payload (payload_length bytes, already checked
// against the limits) is still in the socket: the caller decides where it lands.
struct FrameHead {
  wire::Header header;
  uint32_t payload_length = 0;
};
// Reads a frame's prefix and header only. Errors as ReadFrame.
template <typename AsyncStream>
Awaitable<Result<FrameHead>> ReadFrameHead(AsyncStream& socket, const FrameLimits& limits);
// Reads exactly into.size() payload bytes (after ReadFrameHead). A close is kCorrupt
// ("truncated frame").
template <typename AsyncStream>
Awaitable<Status> ReadPayload(AsyncStream& socket, std::span<uint8_t> into);

// Batches a plain TCP stream's wake-ups while one payload is read. Without it the kernel wakes
// the reader at every arriving segment (64 KiB on loopback), and each wake-up costs an event-loop
// turn and a short recv. With it (SO_RCVLOWAT) the reader is woken once the bytes its read needs
// are queued. Not used on Unix sockets, whose poll ignores the mark, nor on TLS: the kernel cannot
// count the plaintext OpenSSL already holds, so a mark could wait for bytes that never come. The
// mark is never above what the current read still needs, so the bytes of a frame always wake
// the reader; the destructor lowers it to 1 before the next frame head is read.
class PayloadWatermark {
 public:
  // `enabled` false: never sets the mark (for comparison).
  explicit PayloadWatermark(Stream& stream, bool enabled = true);
  ~PayloadWatermark();
  PayloadWatermark(const PayloadWatermark&) = delete;
  PayloadWatermark& operator=(const PayloadWatermark&) = delete;
  // The read about to start needs `bytes` more; the mark becomes that, at most kMaxBytes.
  void Expect(size_t bytes);
  bool active() const { return stream_ != nullptr; }
  static constexpr size_t kMaxBytes = 256u << 10;

 private:
  void Set(int bytes);
  Stream* stream_ = nullptr;  // null: not a plain TCP stream
  int mark_ = 1;
};
// ReadPayload with the stream's wake-ups batched by `mark`.
Awaitable<Status> ReadPayload(Stream& stream, std::span<uint8_t> into, PayloadWatermark& mark);

// Reads one frame; the payload lands in *payload (resized, capacity reused between calls).
// A clean close before a frame starts is kUnavailable("connection closed"); a close inside a
// frame is kCorrupt("truncated frame").
template <typename AsyncStream>
Awaitable<Result<wire::Header>> ReadFrame(AsyncStream& socket, const FrameLimits& limits,
                                          std::vector<uint8_t>* payload);
// Writes header + payload with one gathered write.
template <typename AsyncStream>
Awaitable<Status> WriteFrame(AsyncStream& socket, const wire::Header& header,
                             std::span<const uint8_t> payload, const FrameLimits& limits);
// Writes a frame whose `length` payload bytes the kernel takes from `fd` at `offset`
// (sendfile): they go from the page cache to the socket without entering this process, which
// saves the read into a buffer and the copy into the socket. Plain streams only: TLS encrypts
// in user space (kUnsupported). A file that ends before offset + length is kCorrupt, with the
// frame cut short: the caller must close the connection (the peer sees a truncated frame,
// never wrong bytes). If the bytes are not in the page cache the call blocks on the disk, so
// callers send from files whose range they know to be cached.
Awaitable<Status> WriteFrameFromFile(Stream& stream, const wire::Header& header, int fd,
                                     uint64_t offset, uint32_t length, const FrameLimits& limits);
// Plain connection, no TLS and no policy: Connect(endpoint, transport) in stream.h is what
// clients use.
Awaitable<Result<Socket>> Connect(const Endpoint& endpoint);

template <typename SyncStream>
Result<wire::Header> ReadFrameBlocking(SyncStream& socket, const FrameLimits& limits,
                                       std::vector<uint8_t>* payload);
template <typename SyncStream>
Status WriteFrameBlocking(SyncStream& socket, const wire::Header& header,
                          std::span<const uint8_t> payload, const FrameLimits& limits);
Result<Socket> ConnectBlocking(boost::asio::io_context& io, const Endpoint& endpoint);

// Sets TCP_NODELAY on TCP sockets (frames are small and latency matters) and asks for socket
// buffers of kSocketBufferBytes both ways (Unix and TCP), so a 2 MiB chunk crosses in a few
// wakeups instead of dozens. Best effort: the kernel caps them (net.core.[rw]mem_max).
inline constexpr int kSocketBufferBytes = 4 << 20;
void TuneSocket(Socket& socket);
// As root (CRIU's master is), gives the socket kSocketBufferBytes both ways past
// net.core.[rw]mem_max, which many hosts keep at their 208 KiB default; otherwise a no-op. Only
// for a trusted peer: the caps are the administrator's bound on the kernel memory that
// connections may park (the server forces them once a peer's Hello is accepted).
void ForceSocketBuffers(Socket& socket);

}  // namespace gpulazy::net
