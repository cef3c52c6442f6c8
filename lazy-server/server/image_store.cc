#include "lazy-server/server/image_store.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <system_error>
#include <vector>

#include "proto/image_table.h"
#include "proto/utf8.h"

namespace gpulazy::server {

std::string NameInsteadOfDir(std::string message, std::string_view dir, std::string_view name) {
  if (dir.empty()) return message;
  for (size_t pos = message.find(dir); pos != std::string::npos;
       pos = message.find(dir, pos + name.size())) {
    message.replace(pos, dir.size(), name);
  }
  return message;
}

namespace fs = std::filesystem;
namespace {

constexpr size_t kMaxNameLength = 4096;

Status NotFoundName(std::string_view name) {
  return NotFound("image '{}' not found", CutUtf8(name, 256));
}

constexpr size_t kMaxStampedFiles = 4096;

bool IsBeneath(const fs::path& path, const fs::path& root) {
  const std::string& p = path.native();
  const std::string& r = root.native();
  if (p.size() < r.size() || p.compare(0, r.size(), r) != 0) return false;
  return p.size() == r.size() || r.ends_with('/') || p[r.size()] == '/';
}

// Identity of an image's current contents: the directory and every file directly in it (device,
// inode, mtime, size). A conversion or a new profile renames its manifest into place; a
// checkpoint rewritten in place changes its pages files' mtime or size. Either way the image is
// opened afresh, so checksums cached for the old bytes are never served for new ones.
std::string Stamp(const fs::path& dir) {
  auto identity = [](const fs::path& p) -> std::string {
    struct stat st {};
    if (::lstat(p.c_str(), &st) != 0) return "-;";
    return fmt::format("{}:{}:{}.{}:{};", st.st_dev, st.st_ino, st.st_mtim.tv_sec,
                       st.st_mtim.tv_nsec, st.st_size);
  };
  std::string stamp = identity(dir);
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    // An image directory holds tens to hundreds of files; past this many the rest go unnoticed
    // rather than make every open slow.
    if (names.size() >= kMaxStampedFiles) break;
    names.push_back(it->path().filename().string());
  }
  std::sort(names.begin(), names.end());  // directory order is not stable across rewrites
  for (const std::string& name : names)
    stamp += name + "=" + identity(dir / name);
  return stamp;
}
}  // namespace

ImageStore::ImageStore(const std::vector<fs::path>& roots, uint32_t raw_chunk_size,
                       size_t max_cached)
    : raw_chunk_size_(raw_chunk_size), max_cached_(max_cached) {
  for (const fs::path& root : roots) {
    std::error_code ec;
    fs::path canonical = fs::canonical(root, ec);
    if (ec) {
      spdlog::warn("image root {} is not usable ({}); ignoring it", root.string(), ec.message());
      continue;
    }
    int fd = ::open(canonical.c_str(), O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) {
      spdlog::warn("image root {} cannot be opened ({}); ignoring it", root.string(),
                   std::strerror(errno));
      continue;
    }
    roots_.push_back(Root{std::move(canonical), UniqueFd(fd)});
  }
}

Status ImageStore::ValidateName(std::string_view name) {
  if (name.empty()) return NotFound("image name is empty");
  if (name.size() > kMaxNameLength) return NotFound("image name is too long");
  if (name.find('\0') != std::string_view::npos) return NotFoundName("<name with NUL>");
  if (name.front() == '/') return NotFoundName(name);
  size_t start = 0;
  while (start <= name.size()) {
    size_t end = name.find('/', start);
    if (end == std::string_view::npos) end = name.size();
    if (name.substr(start, end - start) == "..") return NotFoundName(name);
    start = end + 1;
  }
  return Status::Ok();
}

Result<ImageStore::Resolved> ImageStore::Resolve(std::string_view name) const {
  GPULAZY_RETURN_IF_ERROR(ValidateName(name));
  for (const Root& root : roots_) {
    // The kernel resolves the name beneath the root: an absolute symlink, or one whose ".."
    // climbs out of it, fails with EXDEV instead of being followed.
    Result<UniqueFd> dir =
        OpenBeneath(root.fd.get(), std::string(name), O_PATH | O_DIRECTORY, name);
    if (!dir.ok()) {
      if (dir.status().code() == Code::kPermissionDenied) {
        spdlog::warn("image '{}' resolves outside its root {}; refused", name.substr(0, 256),
                     root.path.string());
        return NotFoundName(name);
      }
      continue;  // not under this root (or not a directory): try the next
    }
    // Where it landed, for the cache, the grant check and the image library's file opens.
    std::error_code ec;
    fs::path resolved = fs::read_symlink(fmt::format("/proc/self/fd/{}", dir->get()), ec);
    if (ec || !IsBeneath(resolved, root.path)) {
      spdlog::warn("image '{}': cannot confirm it lies below {}; refused", name.substr(0, 256),
                   root.path.string());
      return NotFoundName(name);
    }
    std::string relative = resolved.lexically_relative(root.path).string();
    if (relative.empty()) relative = ".";
    return Resolved{std::move(resolved), std::move(relative)};
  }
  return NotFoundName(name);
}

Result<std::shared_ptr<const OpenedImage>> ImageStore::Open(std::string_view name,
                                                            const ImageGrant& grant) {
  GPULAZY_ASSIGN_OR_RETURN(Resolved resolved, Resolve(name));
  if (!MayOpen(grant, resolved.relative)) {
    spdlog::info("image '{}' ({} below its root) is outside the client's --image-access grant",
                 name.substr(0, 256), resolved.relative);
    return NotFoundName(name);  // word for word what a missing image gets
  }
  const fs::path dir = resolved.dir;
  const std::string stamp = Stamp(dir);
  {
    std::lock_guard lock(mu_);
    for (auto it = cache_.begin(); it != cache_.end(); ++it) {
      if (it->dir != dir) continue;
      if (it->stamp == stamp) {
        cache_.splice(cache_.begin(), cache_, it);
        return cache_.front().image;
      }
      cache_.erase(it);  // rewritten since: open afresh
      break;
    }
  }

  // Opened outside the lock: a slow open of one image must not block others. Two sessions
  // racing to open the same image both open it; the second insert wins, both work.
  Result<std::shared_ptr<const image::ImageSource>> source =
      image::ImageSource::Open(dir, raw_chunk_size_);
  if (!source.ok()) {
    spdlog::warn("image '{}' ({}): open failed: {}", name, dir.string(),
                 source.status().ToString());
    // The message may name files inside the image, never the root it lives in.
    return Status(source.status().code(),
                  NameInsteadOfDir(source.status().message(), dir.string(), name));
  }
  auto opened = std::make_shared<OpenedImage>();
  opened->name = std::string(name);
  opened->dir = dir;
  opened->relative = resolved.relative;
  opened->source = *source;
  opened->layout = std::make_shared<const ImageLayout>(
      ImageLayout::FromManifest((*source)->manifest(), (*source)->is_lazy()));
  opened->table = std::make_shared<const std::string>(
      MakeImageTable((*source)->manifest()).SerializeAsString());
  spdlog::info("image '{}': opened ({} image, {} BOs, {} chunks of {} bytes)", name,
               (*source)->is_lazy() ? "lazy" : "CRIU", opened->layout->bo_count(),
               opened->layout->total_chunks(), (*source)->chunk_size());

  std::lock_guard lock(mu_);
  for (auto it = cache_.begin(); it != cache_.end(); ++it) {
    if (it->dir == dir) {
      cache_.erase(it);
      break;
    }
  }
  cache_.push_front(Entry{dir, stamp, opened});
  while (cache_.size() > max_cached_)
    cache_.pop_back();  // sessions keep their own reference
  return std::shared_ptr<const OpenedImage>(opened);
}

size_t ImageStore::cached() const {
  std::lock_guard lock(mu_);
  return cache_.size();
}

}  // namespace gpulazy::server
