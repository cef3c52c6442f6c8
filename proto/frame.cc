#include "proto/frame.h"

#include <fmt/format.h>

#include "proto/endian.h"

namespace gpulazy {

std::optional<std::string_view> ForeignProtocol(std::span<const uint8_t> first_bytes) {
  // A TLS record: content type, then major version 3 and a minor version up to TLS 1.3's
  // record version (RFC 8446 section 5.1).
  if (first_bytes.size() >= 3 && first_bytes[1] == 0x03 && first_bytes[2] <= 0x04) {
    switch (first_bytes[0]) {
      case 0x16:
        return "a TLS handshake";
      case 0x15:
        return "a TLS alert";
      case 0x14:
      case 0x17:
        return "TLS records";
      default:
        break;
    }
  }
  const std::string_view text(reinterpret_cast<const char*>(first_bytes.data()),
                              first_bytes.size());
  struct Opening {
    std::string_view bytes;
    std::string_view protocol;
  };
  static constexpr Opening kOpenings[] = {
      {"GET ", "an HTTP request"},     {"POST ", "an HTTP request"},
      {"HEAD ", "an HTTP request"},    {"PUT ", "an HTTP request"},
      {"DELETE ", "an HTTP request"},  {"OPTIONS ", "an HTTP request"},
      {"PATCH ", "an HTTP request"},   {"CONNECT ", "an HTTP request"},
      {"PRI * ", "an HTTP/2 preface"}, {"HTTP/", "an HTTP response"},
      {"SSH-", "an SSH banner"},
  };
  for (const Opening& opening : kOpenings)
    if (text.starts_with(opening.bytes)) return opening.protocol;
  return std::nullopt;
}

namespace {

// " (the bytes are ..., not a gpulazy frame)" when they are recognizably something else.
std::string ForeignHint(std::span<const uint8_t> prefix) {
  std::optional<std::string_view> protocol = ForeignProtocol(prefix);
  if (!protocol) return {};
  return fmt::format(" (the bytes look like {}, not a gpulazy frame)", *protocol);
}

}  // namespace

Result<FramePrefix> DecodeFramePrefix(std::span<const uint8_t> prefix, const FrameLimits& limits) {
  if (prefix.size() < kFramePrefixSize)
    return Corrupt("frame prefix is {} bytes, needs {}", prefix.size(), kFramePrefixSize);
  FramePrefix out{LoadLe32(prefix.data()), LoadLe32(prefix.data() + 4)};
  if (out.header_length == 0) return Corrupt("frame has an empty header{}", ForeignHint(prefix));
  if (out.header_length > limits.max_header)
    return ResourceExhausted("frame header of {} bytes exceeds the limit of {}{}",
                             out.header_length, limits.max_header, ForeignHint(prefix));
  if (out.payload_length > limits.max_payload)
    return ResourceExhausted("frame payload of {} bytes exceeds the limit of {}{}",
                             out.payload_length, limits.max_payload, ForeignHint(prefix));
  return out;
}

Result<wire::Header> DecodeFrameHeader(std::span<const uint8_t> bytes) {
  wire::Header header;
  if (bytes.size() > static_cast<size_t>(INT32_MAX) ||
      !header.ParseFromArray(bytes.data(), static_cast<int>(bytes.size())))
    return Corrupt("frame header of {} bytes is not a valid protobuf message", bytes.size());
  if (header.body_case() == wire::Header::BODY_NOT_SET)
    return Corrupt("frame header carries no known message");
  return header;
}

Result<std::string> EncodeFrameHead(const wire::Header& header, uint32_t payload_length,
                                    const FrameLimits& limits) {
  size_t header_length = header.ByteSizeLong();
  if (header_length == 0 || header_length > limits.max_header)
    return ResourceExhausted("frame header of {} bytes is outside 1..{}", header_length,
                             limits.max_header);
  if (payload_length > limits.max_payload)
    return ResourceExhausted("frame payload of {} bytes exceeds the limit of {}", payload_length,
                             limits.max_payload);
  std::string out(kFramePrefixSize + header_length, '\0');
  auto* p = reinterpret_cast<uint8_t*>(out.data());
  StoreLe32(p, static_cast<uint32_t>(header_length));
  StoreLe32(p + 4, payload_length);
  if (!header.SerializeToArray(p + kFramePrefixSize, static_cast<int>(header_length)))
    return Internal("could not serialize a frame header");
  return out;
}

Result<std::optional<DecodedFrame>> TryDecodeFrame(std::span<const uint8_t> buffer,
                                                   const FrameLimits& limits) {
  if (buffer.size() < kFramePrefixSize) return std::optional<DecodedFrame>();
  GPULAZY_ASSIGN_OR_RETURN(FramePrefix prefix, DecodeFramePrefix(buffer, limits));
  const size_t total = kFramePrefixSize + size_t{prefix.header_length} + prefix.payload_length;
  if (buffer.size() < total) return std::optional<DecodedFrame>();
  GPULAZY_ASSIGN_OR_RETURN(wire::Header header, DecodeFrameHeader(buffer.subspan(
                                                    kFramePrefixSize, prefix.header_length)));
  DecodedFrame frame;
  frame.header = std::move(header);
  frame.payload = buffer.subspan(kFramePrefixSize + prefix.header_length, prefix.payload_length);
  frame.frame_size = total;
  return std::optional<DecodedFrame>(std::move(frame));
}

}  // namespace gpulazy
