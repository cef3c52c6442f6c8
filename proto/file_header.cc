#include "proto/file_header.h"

#include <algorithm>
#include <cstring>

#include "proto/endian.h"

namespace gpulazy {

std::array<uint8_t, kFileHeaderSize> EncodeFileHeader(const FileHeader& header) {
  std::array<uint8_t, kFileHeaderSize> out{};
  std::memcpy(out.data(), header.magic.data(), std::min<size_t>(8, header.magic.size()));
  StoreLe32(out.data() + 8, header.version);
  StoreLe32(out.data() + 12, 0);
  StoreLe64(out.data() + 16, header.payload_length);
  StoreLe64(out.data() + 24, header.payload_checksum);
  return out;
}

Result<FileHeader> DecodeFileHeader(std::span<const uint8_t> bytes, std::string_view expected_magic,
                                    std::string_view what) {
  if (bytes.size() < kFileHeaderSize)
    return Corrupt("{}: {} bytes is shorter than the {}-byte gpulazy header", what, bytes.size(),
                   kFileHeaderSize);
  std::string_view magic(reinterpret_cast<const char*>(bytes.data()), 8);
  if (magic != expected_magic)
    return Corrupt("{}: bad magic (expected '{}')", what, expected_magic);
  FileHeader header;
  header.magic = expected_magic;
  header.version = LoadLe32(bytes.data() + 8);
  uint32_t flags = LoadLe32(bytes.data() + 12);
  if (header.version != kFileFormatVersion)
    return Unsupported("{}: format version {} (this build reads version {})", what, header.version,
                       kFileFormatVersion);
  if (flags != 0) return Unsupported("{}: unknown header flags {:#x}", what, flags);
  header.payload_length = LoadLe64(bytes.data() + 16);
  header.payload_checksum = LoadLe64(bytes.data() + 24);
  return header;
}

}  // namespace gpulazy
