// Frames of the page-server protocol:
//   u32 header_length (LE) | u32 payload_length (LE) | wire::Header | payload
// The header is a small protobuf; the payload is raw chunk bytes. Both lengths are untrusted
// and checked against FrameLimits before any allocation. Pure functions, no sockets.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "proto/status.h"
#include "proto/wire.pb.h"

namespace gpulazy {

inline constexpr size_t kFramePrefixSize = 8;
// Versions this code speaks (docs/protocol.md): 2 carries an image's table as payload after
// OpenImageReply; 1 carries it in the reply's header.
inline constexpr uint32_t kMinProtocolVersion = 1;
inline constexpr uint32_t kProtocolVersion = 2;
// Destinations per PlaceInto frame (docs/protocol.md, "Placement"): 256 of at most ~90 serialized
// bytes (a 64-byte CUDA IPC handle) stay well inside the 64 KiB frame header. A server refuses
// a frame with more.
inline constexpr size_t kMaxTargetsPerPlaceInto = 256;

struct FrameLimits {
  uint32_t max_header = 64 * 1024;
  uint32_t max_payload = 4 * 1024 * 1024 + 64 * 1024;  // a 4 MiB chunk plus LZ4's worst case
};

struct FramePrefix {
  uint32_t header_length = 0;
  uint32_t payload_length = 0;
};

// Validates the 8-byte prefix: a header is present and neither length passes its limit. A
// refused prefix that looks like another protocol's opening says so in the message.
Result<FramePrefix> DecodeFramePrefix(std::span<const uint8_t> prefix, const FrameLimits& limits);
// Parses a header and checks it carries exactly one known body.
Result<wire::Header> DecodeFrameHeader(std::span<const uint8_t> bytes);
// Prefix and serialized header, ready to be followed on the wire by payload_length bytes.
Result<std::string> EncodeFrameHead(const wire::Header& header, uint32_t payload_length,
                                    const FrameLimits& limits);

// What a peer's first bytes look like when they are another protocol's: "a TLS handshake", "a
// TLS alert", "an HTTP request", "an HTTP response", "an SSH banner"; nullopt when unrecognized.
// For error messages only: a TLS client on a plain listener, or a plain client that a TLS
// server answers, otherwise gets a bare "frame header of 33620758 bytes exceeds the limit".
std::optional<std::string_view> ForeignProtocol(std::span<const uint8_t> first_bytes);

// A whole frame pulled out of a byte buffer (tests, fuzzing, and readers that buffer).
struct DecodedFrame {
  wire::Header header;
  std::span<const uint8_t> payload;  // points into the buffer handed to TryDecodeFrame
  size_t frame_size = 0;             // bytes consumed
};
// nullopt: the buffer holds only part of a frame so far. Error: the frame is malformed.
Result<std::optional<DecodedFrame>> TryDecodeFrame(std::span<const uint8_t> buffer,
                                                   const FrameLimits& limits);

}  // namespace gpulazy
