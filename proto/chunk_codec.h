// Decoding one chunk's stored bytes (docs/image-format.md, "Chunk codecs"): CODEC_RAW stored
// bytes are the raw bytes, CODEC_LZ4 one LZ4 block, CODEC_ZERO nothing. The result is checked
// against the chunk's XXH3-64 checksum; nothing is written past `raw`. Used by the image library
// (verify, ReadRawChunk) and by the page client before bytes reach a copy engine.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>

#include "proto/manifest.pb.h"
#include "proto/status.h"

namespace gpulazy {

// raw.size() is the chunk's raw length. `stored` may alias `raw` for CODEC_RAW (checked in
// place, no copy). kCorrupt names `what` (image, BO, chunk) and says what was wrong.
Status DecodeChunkBytes(manifest::Codec codec, uint64_t checksum, std::span<const uint8_t> stored,
                        std::span<uint8_t> raw, std::string_view what);

// A CODEC_ZERO chunk of raw_length bytes claims `checksum`: kCorrupt naming `what` unless it is
// that of as many zeros (ZeroChecksum64; no bytes are hashed).
Status CheckZeroChunk(uint64_t checksum, uint64_t raw_length, std::string_view what);

}  // namespace gpulazy
