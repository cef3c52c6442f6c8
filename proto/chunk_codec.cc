#include "proto/chunk_codec.h"

#include <lz4.h>

#include <climits>
#include <cstring>

#include "proto/checksum.h"

namespace gpulazy {

Status CheckZeroChunk(uint64_t checksum, uint64_t raw_length, std::string_view what) {
  if (const uint64_t zero_sum = ZeroChecksum64(raw_length); zero_sum != checksum)
    return Corrupt("{}: checksum mismatch (a zero chunk hashes to {:016x}, expected {:016x})", what,
                   zero_sum, checksum);
  return Status::Ok();
}

Status DecodeChunkBytes(manifest::Codec codec, uint64_t checksum, std::span<const uint8_t> stored,
                        std::span<uint8_t> raw, std::string_view what) {
  switch (codec) {
    case manifest::CODEC_ZERO:
      if (!stored.empty())
        return Corrupt("{}: zero chunk arrived with {} stored bytes", what, stored.size());
      // An empty span may have a null data(); memset's pointer must not be null even for 0.
      if (!raw.empty()) std::memset(raw.data(), 0, raw.size());
      // The bytes are known: so is their checksum (no pass over them).
      return CheckZeroChunk(checksum, raw.size(), what);
    case manifest::CODEC_RAW:
      if (stored.size() != raw.size())
        return Corrupt("{}: raw chunk of {} stored bytes, raw length is {}", what, stored.size(),
                       raw.size());
      if (!raw.empty() && stored.data() != raw.data())
        std::memcpy(raw.data(), stored.data(), raw.size());
      break;
    case manifest::CODEC_LZ4: {
      if (stored.empty() || stored.size() > static_cast<size_t>(INT_MAX) ||
          raw.size() > static_cast<size_t>(INT_MAX))
        return Corrupt("{}: LZ4 chunk of {} stored bytes for {} raw bytes", what, stored.size(),
                       raw.size());
      // LZ4_decompress_safe never writes past the capacity it is given, whatever the input.
      int n = LZ4_decompress_safe(reinterpret_cast<const char*>(stored.data()),
                                  reinterpret_cast<char*>(raw.data()),
                                  static_cast<int>(stored.size()), static_cast<int>(raw.size()));
      if (n < 0)
        return Corrupt("{}: LZ4 block is malformed or decodes past {} bytes", what, raw.size());
      if (static_cast<size_t>(n) != raw.size())
        return Corrupt("{}: LZ4 block decodes to {} bytes, raw length is {}", what, n, raw.size());
      break;
    }
    default:
      return Corrupt("{}: unknown codec {}", what, static_cast<int>(codec));
  }
  uint64_t sum = Checksum64(raw);
  if (sum != checksum)
    return Corrupt("{}: checksum mismatch (bytes hash to {:016x}, expected {:016x})", what, sum,
                   checksum);
  return Status::Ok();
}

}  // namespace gpulazy
