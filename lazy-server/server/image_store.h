// ImageStore: maps untrusted image names from the network to checkpoint directories below the
// configured roots, and caches opened images so sessions of the same image share one
// ImageSource (its manifest, its open fds) and one ImageLayout.
//
// Confinement: a name must be relative, non-empty, free of NUL and of ".." components, and is
// resolved with openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS) from an fd of the root, so a
// symlink that leads out of the root is refused by the kernel; the image library then opens
// every file of the image beneath the image directory the same way (image/io.h OpenInDir).
// Visibility: a grant (access.h) limits which resolved paths a client may open. Every refusal
// is kNotFound with a message that names neither the roots nor the reason a path was refused,
// and is the same for "forbidden" and "missing" (logs say more).
//
// Thread-safety: all methods may be called from any thread (one mutex guards the cache).
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "lazy-server/image/image_source.h"
#include "lazy-server/image/io.h"
#include "lazy-server/server/access.h"
#include "lazy-server/server/scheduler.h"
#include "proto/status.h"

namespace gpulazy::server {

struct OpenedImage {
  std::string name;           // as the client named it
  std::filesystem::path dir;  // resolved, canonical
  std::string relative;       // dir below its root (what grants are checked against)
  std::shared_ptr<const image::ImageSource> source;
  std::shared_ptr<const ImageLayout> layout;
  // The serialized wire::ImageTable that protocol version 2 sends after OpenImageReply, built
  // once per opened image and shared by its sessions' replies.
  std::shared_ptr<const std::string> table;
  // The serialized wire::ChunkLocations a files connection may ask for (docs/protocol.md, "The
  // chunk table"): built by the first that asks, on a disk thread, and shared by the rest, so
  // that connections asking for it cost one copy per image, not one each. A table that lacks
  // checksums (a plain checkpoint's chunks not hashed yet) is built afresh for a connection
  // asking a second or more after it, to carry the checksums learnt since.
  struct ChunkTableCache {
    std::mutex mu;
    std::shared_ptr<const std::string> table;
    bool every_checksum = false;
    std::chrono::steady_clock::time_point built;
  };
  std::shared_ptr<ChunkTableCache> chunk_table = std::make_shared<ChunkTableCache>();
};

// `message` with each occurrence of an image's directory replaced by the name the client used
// for it, so errors never say where the roots are. Each occurrence once, left to right, also when
// the name contains the directory (root `/`, or symlinks back into the root).
std::string NameInsteadOfDir(std::string message, std::string_view dir, std::string_view name);

class ImageStore {
 public:
  ImageStore(const std::vector<std::filesystem::path>& roots, uint32_t raw_chunk_size,
             size_t max_cached);

  // Syntactic check of a name from the network (no disk access).
  static Status ValidateName(std::string_view name);
  struct Resolved {
    std::filesystem::path dir;  // canonical
    std::string relative;       // below its root: what grants are checked against
  };
  // The directory of `name` below the first root that has it.
  Result<Resolved> Resolve(std::string_view name) const;
  // Resolves and opens (or reuses a cached, unchanged) image the grant allows. Slow on a cache
  // miss: call it off the network threads.
  Result<std::shared_ptr<const OpenedImage>> Open(std::string_view name,
                                                  const ImageGrant& grant = std::nullopt);

  size_t cached() const;

 private:
  struct Entry {
    std::filesystem::path dir;
    // Changes when the image is rewritten: converted, re-profiled, files renamed into place,
    // added, removed, or rewritten in place (mtime, size). Then the image is opened afresh, so
    // its ImageSource never serves checksums cached for older bytes (docs/server.md).
    std::string stamp;
    std::shared_ptr<const OpenedImage> image;
  };
  struct Root {
    std::filesystem::path path;  // canonical
    UniqueFd fd;                 // O_PATH: names are resolved beneath it
  };
  std::vector<Root> roots_;
  uint32_t raw_chunk_size_;
  size_t max_cached_;
  mutable std::mutex mu_;
  std::list<Entry> cache_;  // most recently used first
};

}  // namespace gpulazy::server
