#include "proto/frame.h"

#include "proto/endian.h"

namespace gpulazy {

Result<FramePrefix> DecodeFramePrefix(std::span<const uint8_t> prefix, const FrameLimits& limits) {
  if (prefix.size() < kFramePrefixSize)
    return Corrupt("frame prefix is {} bytes, needs {}", prefix.size(), kFramePrefixSize);
  FramePrefix out{LoadLe32(prefix.data()), LoadLe32(prefix.data() + 4)};
  if (out.header_length == 0) return Corrupt("frame has an empty header");
  if (out.header_length > limits.max_header)
    return ResourceExhausted("frame header of {} bytes exceeds the limit of {}", out.header_length,
                             limits.max_header);
  if (out.payload_length > limits.max_payload)
    return ResourceExhausted("frame payload of {} bytes exceeds the limit of {}",
                             out.payload_length, limits.max_payload);
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
