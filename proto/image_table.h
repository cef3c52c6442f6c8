// The image table of protocol version 2: an image's BO table and hot set, serialized as a
// wire::ImageTable and carried as payload bytes after its OpenImageReply, so its size is bounded
// by what a client accepts, not by the 64 KiB frame header (docs/protocol.md, OpenImage).
// Pure codec, no sockets: the server builds and cuts it, the client assembles and parses it.
//
// Thread-safety: none needed; a TableAssembler belongs to one reader.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "proto/manifest.pb.h"
#include "proto/status.h"
#include "proto/wire.pb.h"

namespace gpulazy {

// Most table bytes a client accepts by default: at some 40 serialized bytes a BO, 64 MiB is
// about 1.5 million BOs (an estimate, not a measurement).
inline constexpr uint64_t kDefaultMaxImageTableBytes = 64ull << 20;

// The table a server announces for `manifest`: every BO, and the access profile with its order
// cut to the hot set (a client needs no more; the server keeps the full order for itself).
wire::ImageTable MakeImageTable(const manifest::Manifest& manifest);

// Collects the pieces of one version-2 table (the announcing frame's payload, then each
// ImageTablePart's: an OpenImageReply's image table or a ChunkTable) and parses them. Every length
// is the server's word and untrusted: a table over the limit is refused before anything is
// allocated for it, a piece past the announced length or an empty piece while bytes are missing is
// kCorrupt.
class TableAssembler {
 public:
  // `announced`: OpenImageReply.table_bytes or ChunkTable.table_bytes.
  static Result<TableAssembler> Begin(uint64_t announced,
                                      uint64_t limit = kDefaultMaxImageTableBytes);
  // The first piece comes with the announcing frame and may be empty (an empty table, or one the
  // server sends whole in ImageTablePart frames); a continuation piece may not.
  Status Add(std::span<const uint8_t> piece, bool continuation);
  bool complete() const { return bytes_.size() == announced_; }
  uint64_t missing() const { return announced_ - bytes_.size(); }
  // Parses the whole table; kCorrupt while bytes are missing or when they do not parse.
  Result<wire::ImageTable> Finish() const { return FinishAs<wire::ImageTable>(); }
  // The same for a table of another message (a ChunkTable's ChunkLocations).
  template <typename Message>
  Result<Message> FinishAs() const {
    if (!complete())
      return Corrupt("{} incomplete: {} of {} bytes", Message::descriptor()->name(), bytes_.size(),
                     announced_);
    Message table;
    if (!table.ParseFromString(bytes_))
      return Corrupt("{} of {} bytes does not parse", Message::descriptor()->name(), announced_);
    return table;
  }

 private:
  explicit TableAssembler(uint64_t announced) : announced_(announced) {}
  uint64_t announced_ = 0;
  std::string bytes_;
};

}  // namespace gpulazy
