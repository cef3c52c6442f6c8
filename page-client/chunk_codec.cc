#include "page-client/chunk_codec.h"

#include "proto/chunk_codec.h"

namespace gpulazy::client {

Status DecodeChunkPayload(const wire::ChunkData& chunk, std::span<const uint8_t> payload,
                          std::vector<uint8_t>* raw, std::string_view what) {
  // A RAW payload handed in as *raw is checked in place; otherwise *raw gets the decoded bytes.
  const bool in_place = chunk.codec() == manifest::CODEC_RAW && raw->data() == payload.data() &&
                        raw->size() == payload.size();
  if (!in_place)
    raw->resize(chunk.raw_length());
  else if (payload.size() != chunk.raw_length())
    return Corrupt("{}: raw chunk carries {} bytes, header says {}", what, payload.size(),
                   chunk.raw_length());
  return DecodeChunkBytes(chunk.codec(), chunk.checksum(), payload, *raw, what);
}

}  // namespace gpulazy::client
