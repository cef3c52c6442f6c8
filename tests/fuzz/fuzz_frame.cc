// libFuzzer harness: the frame decoder (proto/frame.h) and the socket frame reader the server
// and client run (page-client/net/frame_stream.h, ReadFrame).
//
// Input: the bytes a peer sends on a connection, any number of frames back to back.
// Checks, besides the sanitizers:
//   - TryDecodeFrame over the buffer and net::ReadFrame over a socketpair carrying the same
//     bytes agree: the same frames (header and payload), then the same kind of end (an error
//     of the same code; a truncated frame is kCorrupt; nothing left is a clean close);
//   - every decoded header re-encodes within the limits and decodes to the same message;
//   - a version-2 OpenImageReply and the ImageTablePart frames after it assemble as the client
//     does (proto/image_table.h): never past the announced length, and a table that parses
//     re-serializes.
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <vector>

#include "page-client/net/asio.h"
#include "page-client/net/frame_stream.h"
#include "proto/frame.h"
#include "proto/image_table.h"

namespace {

using gpulazy::Code;
using gpulazy::FrameLimits;
using gpulazy::Result;
using gpulazy::Status;

struct Decoded {
  std::string header;  // serialized
  std::vector<uint8_t> payload;
};

struct Outcome {
  std::vector<Decoded> frames;
  Code end = Code::kOk;  // kOk: ran out of bytes exactly at a frame boundary
  bool partial = false;  // bytes of an incomplete frame were left over
};

[[noreturn]] void Die(const char* what) {
  std::fprintf(stderr, "fuzz_frame: %s\n", what);
  std::abort();
}

Outcome DecodeBuffer(std::span<const uint8_t> bytes, const FrameLimits& limits) {
  Outcome out;
  while (true) {
    auto frame = gpulazy::TryDecodeFrame(bytes, limits);
    if (!frame.ok()) {
      out.end = frame.status().code();
      return out;
    }
    if (!frame->has_value()) {
      out.partial = !bytes.empty();
      return out;
    }
    const gpulazy::DecodedFrame& f = **frame;
    if (f.frame_size == 0 || f.frame_size > bytes.size()) Die("frame_size outside the buffer");
    out.frames.push_back({f.header.SerializeAsString(), {f.payload.begin(), f.payload.end()}});
    bytes = bytes.subspan(f.frame_size);
  }
}

gpulazy::net::Awaitable<void> ReadAll(gpulazy::net::Socket& socket, const FrameLimits& limits,
                                      Outcome* out) {
  std::vector<uint8_t> payload;
  while (true) {
    Result<gpulazy::wire::Header> header =
        co_await gpulazy::net::ReadFrame(socket, limits, &payload);
    if (!header.ok()) {
      out->end = header.status().code();
      co_return;
    }
    out->frames.push_back({header->SerializeAsString(), payload});
  }
}

Outcome DecodeSocket(std::span<const uint8_t> bytes, const FrameLimits& limits, size_t* sent) {
  namespace asio = boost::asio;
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) Die("socketpair");
  const int buffer = 1 << 20;
  ::setsockopt(fds[1], SOL_SOCKET, SO_SNDBUF, &buffer, sizeof buffer);
  // Whatever fits without blocking is the stream; the buffer decoder is given the same prefix.
  *sent = 0;
  while (*sent < bytes.size()) {
    ssize_t n = ::send(fds[1], bytes.data() + *sent, bytes.size() - *sent, MSG_DONTWAIT);
    if (n <= 0) break;
    *sent += static_cast<size_t>(n);
  }
  ::close(fds[1]);
  asio::io_context io;
  gpulazy::net::Socket socket(io, asio::generic::stream_protocol(AF_UNIX, SOCK_STREAM), fds[0]);
  Outcome out;
  asio::co_spawn(io, ReadAll(socket, limits, &out), [](const std::exception_ptr& e) {
    if (e) std::rethrow_exception(e);
  });
  io.run();
  return out;
}

// The client's assembly of a version-2 image table from the frames after an OpenImageReply.
void CheckImageTable(const std::vector<Decoded>& frames) {
  for (size_t i = 0; i < frames.size(); ++i) {
    gpulazy::wire::Header header;
    if (!header.ParseFromString(frames[i].header) || !header.has_open_image_reply()) continue;
    auto table = gpulazy::TableAssembler::Begin(header.open_image_reply().table_bytes());
    if (!table.ok()) return;
    Status added = table->Add(frames[i].payload, false);
    for (size_t j = i + 1; added.ok() && !table->complete() && j < frames.size(); ++j) {
      gpulazy::wire::Header part;
      if (!part.ParseFromString(frames[j].header) || !part.has_image_table_part()) return;
      const uint64_t missing = table->missing();
      added = table->Add(frames[j].payload, true);
      if (added.ok() && table->missing() != missing - frames[j].payload.size())
        Die("a table piece was not counted");
    }
    if (!added.ok() || !table->complete()) return;
    Result<gpulazy::wire::ImageTable> parsed = table->Finish();
    if (parsed.ok()) {
      gpulazy::wire::ImageTable again;
      if (!again.ParseFromString(parsed->SerializeAsString()))
        Die("a parsed table does not re-parse");
    }
    return;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const FrameLimits limits;  // the server's defaults
  std::span<const uint8_t> input(data, size);
  size_t sent = 0;
  const Outcome from_socket = DecodeSocket(input, limits, &sent);
  const Outcome from_buffer = DecodeBuffer(input.first(sent), limits);

  if (from_buffer.frames.size() != from_socket.frames.size()) Die("decoders disagree on frames");
  for (size_t i = 0; i < from_buffer.frames.size(); ++i) {
    if (from_buffer.frames[i].header != from_socket.frames[i].header) Die("headers differ");
    if (from_buffer.frames[i].payload != from_socket.frames[i].payload) Die("payloads differ");
  }
  if (from_buffer.end != Code::kOk) {
    if (from_socket.end != from_buffer.end) Die("decoders disagree on the error");
  } else if (from_buffer.partial) {
    // Half a frame, then end of stream: the reader calls that a truncated frame, unless the
    // header it already holds is itself malformed (also kCorrupt).
    if (from_socket.end != Code::kCorrupt) Die("truncated frame not reported as corrupt");
  } else if (from_socket.end != Code::kUnavailable) {
    Die("clean end of stream not reported as a closed connection");
  }

  CheckImageTable(from_buffer.frames);
  for (const Decoded& frame : from_buffer.frames) {
    gpulazy::wire::Header header;
    if (!header.ParseFromString(frame.header)) Die("a decoded header does not re-parse");
    Result<std::string> head =
        gpulazy::EncodeFrameHead(header, static_cast<uint32_t>(frame.payload.size()), limits);
    if (!head.ok()) continue;  // re-serialized larger than the limit: allowed, nothing to check
    std::string bytes = *head;
    bytes.append(frame.payload.begin(), frame.payload.end());
    auto again = gpulazy::TryDecodeFrame(
        {reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()}, limits);
    if (!again.ok() || !again->has_value()) Die("an encoded frame does not decode");
    if ((*again)->frame_size != bytes.size()) Die("re-decoded frame has another size");
    if ((*again)->header.SerializeAsString() != header.SerializeAsString())
      Die("re-decoded header differs");
  }
  return 0;
}
