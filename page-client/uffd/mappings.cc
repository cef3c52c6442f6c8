#include "page-client/uffd/mappings.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <string>

#include "lazy-server/image/io.h"

namespace gpulazy::uffd {
namespace {

// A process with a million mappings lists about 100 MiB; past that the text is not a maps file.
constexpr size_t kMaxMapsBytes = size_t{256} << 20;

bool ParseHex(std::string_view text, uint64_t* value) {
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), *value, 16);
  return error == std::errc() && end == text.data() + text.size() && !text.empty();
}

}  // namespace

Result<std::vector<MappedRange>> ParseMappingsIn(std::string_view maps, uint64_t from,
                                                 uint64_t to) {
  std::vector<MappedRange> found;
  size_t line_number = 0;
  uint64_t previous_end = 0;
  while (!maps.empty()) {
    const size_t newline = maps.find('\n');
    const std::string_view line = maps.substr(0, newline);
    maps.remove_prefix(newline == std::string_view::npos ? maps.size() : newline + 1);
    ++line_number;
    if (line.empty()) continue;
    // "start-end perms offset dev inode [path]": only the range matters here.
    const std::string_view range = line.substr(0, line.find(' '));
    const size_t dash = range.find('-');
    MappedRange mapping;
    if (dash == std::string_view::npos || !ParseHex(range.substr(0, dash), &mapping.start) ||
        !ParseHex(range.substr(dash + 1), &mapping.end) || mapping.end <= mapping.start)
      return Corrupt("maps line {}: no address range in \"{}\"", line_number,
                     line.substr(0, std::min<size_t>(line.size(), 80)));
    if (mapping.start < previous_end)
      return Corrupt("maps line {}: mappings out of address order", line_number);
    previous_end = mapping.end;
    if (mapping.end <= from || mapping.start >= to) continue;
    found.push_back({std::max(mapping.start, from), std::min(mapping.end, to)});
  }
  return found;
}

Result<std::vector<MappedRange>> MappingsIn(pid_t pid, uint64_t from, uint64_t to) {
  const std::string path = "/proc/" + std::to_string(pid) + "/maps";
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    if (errno == ENOENT || errno == ESRCH) return NotFound("{}: the process is gone", path);
    return ErrnoError(errno, "open {}", path);
  }
  // One pass of reads: the kernel builds the text as it is read, under the process's mmap lock,
  // so a mapping that changes while this reads may show either way (the caller copes).
  std::string text;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = ::read(fd.get(), buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoError(errno, "read {}", path);
    if (n == 0) break;
    if (text.size() + static_cast<size_t>(n) > kMaxMapsBytes)
      return OutOfRange("{}: longer than {} bytes", path, kMaxMapsBytes);
    text.append(buffer, static_cast<size_t>(n));
  }
  // An exited process's maps read empty, and so do those of one whose main thread has exited
  // while others run on: nothing would be found anywhere, which is not the same as "nothing
  // mapped here".
  if (text.empty()) return NotFound("{}: empty (the process or its main thread has exited)", path);
  Result<std::vector<MappedRange>> mappings = ParseMappingsIn(text, from, to);
  if (!mappings.ok()) return mappings.status().Context(path);
  return mappings;
}

std::vector<MappedRange> ClipMappings(const std::vector<MappedRange>& mappings, uint64_t from,
                                      uint64_t to) {
  std::vector<MappedRange> found;
  auto it = std::upper_bound(mappings.begin(), mappings.end(), from,
                             [](uint64_t at, const MappedRange& m) { return at < m.end; });
  for (; it != mappings.end() && it->start < to; ++it)
    found.push_back({std::max(it->start, from), std::min(it->end, to)});
  return found;
}

}  // namespace gpulazy::uffd
