#include "lazy-server/server/warm.h"

#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <vector>

#include "lazy-server/server/placement.h"

namespace gpulazy::server {

namespace {

// A window at a time: the check for shutdown comes often, and no mapping of a whole image is
// held at once.
constexpr uint64_t kWindowBytes = 64u << 20;

Status PreadIntoPageCache(int fd, uint64_t from, uint64_t size,
                          const std::function<bool()>& keep_going) {
  std::vector<uint8_t> scratch(1u << 20);
  for (uint64_t at = from; at < size;) {
    if (at % kWindowBytes == 0 && !keep_going()) return Aborted("stopped at byte {}", at);
    const size_t want = static_cast<size_t>(std::min<uint64_t>(scratch.size(), size - at));
    const ssize_t got = ::pread(fd, scratch.data(), want, static_cast<off_t>(at));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) return ErrnoError(errno, "reading at byte {}", at);
    if (got == 0) return IoError("the file ends at byte {}, not {}", at, size);
    at += static_cast<uint64_t>(got);
  }
  return Status::Ok();
}

}  // namespace

Status ReadIntoPageCache(int fd, uint64_t size, const std::function<bool()>& keep_going) {
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  uint64_t at = 0;
  while (at < size) {
    if (!keep_going()) return Aborted("stopped at byte {}", at);
    const uint64_t length = std::min(kWindowBytes, size - at);
    const size_t mapped = static_cast<size_t>((length + page - 1) / page * page);
    void* map = ::mmap(nullptr, mapped, PROT_READ, MAP_SHARED, fd, static_cast<off_t>(at));
    if (map == MAP_FAILED) return PreadIntoPageCache(fd, at, size, keep_going);
    const int populated = ::madvise(map, static_cast<size_t>(length), MADV_POPULATE_READ);
    const int error = errno;
    ::munmap(map, mapped);
    if (populated == 0) {
      at += length;
    } else if (error != EINTR) {
      // EINVAL: a kernel before 5.14; EFAULT or EIO: the file shrank or a read failed, which
      // pread then reports with its reason.
      return PreadIntoPageCache(fd, at, size, keep_going);
    }
  }
  return Status::Ok();
}

void WarmImages(ServerContext& ctx) {
  const auto keep_going = [&ctx] { return !ctx.shutting_down.load(); };
  uint64_t warmed_bytes = 0;  // of the images warmed whole
  for (const std::string& name : ctx.config.warm) {
    if (!keep_going()) return;
    const auto started = std::chrono::steady_clock::now();
    Result<std::shared_ptr<const OpenedImage>> image = ctx.store.Open(name);
    Status warmed = image.status();
    uint64_t files = 0;
    uint64_t bytes = 0;
    if (image.ok()) {
      for (const image::ImageSource::StoredFile& file : (*image)->source->files()) {
        warmed = ReadIntoPageCache(file.fd.get(), file.size, keep_going);
        // An empty file holds no chunk to place (and cannot be registered).
        if (warmed.ok() && ctx.placement && file.size > 0)
          warmed = ctx.placement->Prepare(file.fd.get(), file.name);
        if (!warmed.ok()) {
          warmed = warmed.Context(file.name);
          break;
        }
        ++files;
        bytes += file.size;
      }
    }
    ctx.totals.warm_files.fetch_add(files);
    ctx.totals.warm_bytes.fetch_add(bytes);
    if (!warmed.ok()) {
      if (warmed.code() == Code::kAborted && !keep_going()) return;  // shutting down: not a fault
      ctx.totals.warm_failures.fetch_add(1);
      spdlog::warn("--warm {}: {}; its restores start cold", name, warmed.ToString());
      continue;
    }
    ctx.totals.warm_images.fetch_add(1);
    warmed_bytes += bytes;
    // Registrations nothing uses are let go least recently used first when a later one needs
    // the room: the images warmed first would be cold again.
    if (ctx.placement && ctx.placement->kind() == "cuda" &&
        warmed_bytes > ctx.config.placement_pin_budget)
      spdlog::warn(
          "--warm {}: the images warmed so far hold {} bytes, more than --placement-pin-budget "
          "{}: registrations of those warmed before it may have been let go",
          name, warmed_bytes, ctx.config.placement_pin_budget);
    spdlog::info("--warm {}: {} files, {} bytes in the page cache{} in {:.3f} s", name, files,
                 bytes,
                 ctx.placement ? fmt::format(", prepared for {} placement", ctx.placement->kind())
                               : std::string(),
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
  }
}

}  // namespace gpulazy::server
