// The 32-byte header at the start of every file gpulazy itself writes (the lazy-image manifest
// and chunk file). All integers little-endian:
//   0  magic[8]          "GPLZMANI" (manifest) or "GPLZCHNK" (chunk data)
//   8  u32 version       format version; readers refuse versions they do not know
//   12 u32 flags         must be 0 in version 1
//   16 u64 payload_len   bytes that follow the header
//   24 u64 payload_xxh3  XXH3-64 of the payload, or 0 where per-chunk checksums cover it
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string_view>

#include "proto/status.h"

namespace gpulazy {

inline constexpr size_t kFileHeaderSize = 32;
inline constexpr uint32_t kFileFormatVersion = 1;
inline constexpr std::string_view kManifestMagic = "GPLZMANI";
inline constexpr std::string_view kChunkFileMagic = "GPLZCHNK";

struct FileHeader {
  std::string_view magic;  // one of the constants above
  uint32_t version = kFileFormatVersion;
  uint64_t payload_length = 0;
  uint64_t payload_checksum = 0;
};

std::array<uint8_t, kFileHeaderSize> EncodeFileHeader(const FileHeader& header);
// Checks magic (must equal expected_magic), version and flags. `what` names the file in errors.
Result<FileHeader> DecodeFileHeader(std::span<const uint8_t> bytes, std::string_view expected_magic,
                                    std::string_view what);

}  // namespace gpulazy
