// Turning a ChunkData frame's payload into verified raw bytes (docs/protocol.md, ChunkData):
// CODEC_RAW payloads are the raw bytes, CODEC_LZ4 one LZ4 block, CODEC_ZERO nothing. Every
// result is checked against the frame's XXH3-64 checksum before anyone may install it.
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "proto/status.h"
#include "proto/wire.pb.h"

namespace gpulazy::client {

// Decodes `payload` per chunk.codec() into *raw (resized to chunk.raw_length()) and verifies
// the checksum. kCorrupt names `what` (image, BO, chunk) and says what was wrong. For CODEC_RAW
// the caller may pass the payload vector itself as `raw` (it is checked in place, no copy).
Status DecodeChunkPayload(const wire::ChunkData& chunk, std::span<const uint8_t> payload,
                          std::vector<uint8_t>* raw, std::string_view what);

}  // namespace gpulazy::client
