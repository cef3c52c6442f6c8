// ImageStore: maps untrusted image names from the network to checkpoint directories below the
// configured roots, and caches opened images so sessions of the same image share one
// ImageSource (its manifest, its open fds) and one ImageLayout.
//
// Confinement: a name must be relative, non-empty, free of NUL and of ".." components; the
// resolved directory (all symlinks followed) must still lie below the root. Every refusal is
// kNotFound with a message that names neither the roots nor the reason a path was refused
// (logs say more).
//
// Thread-safety: all methods may be called from any thread (one mutex guards the cache).
#pragma once

#include <cstdint>
#include <filesystem>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "lazy-server/image/image_source.h"
#include "lazy-server/server/scheduler.h"
#include "proto/status.h"

namespace gpulazy::server {

struct OpenedImage {
  std::string name;           // as the client named it
  std::filesystem::path dir;  // resolved, canonical
  std::shared_ptr<const image::ImageSource> source;
  std::shared_ptr<const ImageLayout> layout;
};

class ImageStore {
 public:
  ImageStore(const std::vector<std::filesystem::path>& roots, uint32_t raw_chunk_size,
             size_t max_cached);

  // Syntactic check of a name from the network (no disk access).
  static Status ValidateName(std::string_view name);
  // The canonical directory of `name` below the first root that has it.
  Result<std::filesystem::path> Resolve(std::string_view name) const;
  // Resolves and opens (or reuses a cached, unchanged) image. Slow on a cache miss: call it
  // off the network threads.
  Result<std::shared_ptr<const OpenedImage>> Open(std::string_view name);

  size_t cached() const;

 private:
  struct Entry {
    std::filesystem::path dir;
    std::string stamp;  // changes when the image is rewritten (converted, re-profiled)
    std::shared_ptr<const OpenedImage> image;
  };
  std::vector<std::filesystem::path> roots_;  // canonical
  uint32_t raw_chunk_size_;
  size_t max_cached_;
  mutable std::mutex mu_;
  std::list<Entry> cache_;  // most recently used first
};

}  // namespace gpulazy::server
