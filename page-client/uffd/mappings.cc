#include "page-client/uffd/mappings.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/ioctl.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <string>
#include <vector>

#include "lazy-server/image/io.h"

namespace gpulazy::uffd {
namespace {

// A process with a million mappings lists about 100 MiB; past that the text is not a maps file.
constexpr size_t kMaxMapsBytes = size_t{256} << 20;

// struct procmap_query of <linux/fs.h> (Linux 6.11), declared here because Debian 12's headers
// predate it; the layout is the kernel's ABI (its size is in the ioctl number).
struct ProcmapQuery {
  uint64_t size;           // in: sizeof(ProcmapQuery)
  uint64_t query_flags;    // in: 0 asks for the VMA covering query_addr only
  uint64_t query_addr;     // in
  uint64_t vma_start;      // out
  uint64_t vma_end;        // out
  uint64_t vma_flags;      // out: kProcmapVmaShared among others
  uint64_t vma_page_size;  // out
  uint64_t vma_offset;     // out: of vma_start in the file (0 for anonymous memory)
  uint64_t inode;          // out (0 for anonymous memory)
  uint32_t dev_major;      // out
  uint32_t dev_minor;      // out
  uint32_t vma_name_size;  // in/out: 0, no name wanted
  uint32_t build_id_size;  // in/out: 0, no build ID wanted
  uint64_t vma_name_addr;  // in
  uint64_t build_id_addr;  // in
};
static_assert(sizeof(ProcmapQuery) == 104, "struct procmap_query is 104 bytes");
constexpr unsigned long kProcmapQuery = _IOWR('f', 17, ProcmapQuery);
constexpr uint64_t kProcmapVmaShared = 0x08;

bool ParseNumber(std::string_view text, uint64_t* value, int base) {
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), *value, base);
  return error == std::errc() && end == text.data() + text.size() && !text.empty();
}
bool ParseHex(std::string_view text, uint64_t* value) {
  return ParseNumber(text, value, 16);
}
bool ParseDecimal(std::string_view text, uint64_t* value) {
  return ParseNumber(text, value, 10);
}

// Calls visit(range, line) for each mapping of `maps` in order, until it returns true. A line
// whose range does not parse, or out of address order, is kCorrupt: a caller must not act on a
// partial view.
template <typename Visit>
Status ForEachMapping(std::string_view maps, Visit visit) {
  size_t line_number = 0;
  uint64_t previous_end = 0;
  while (!maps.empty()) {
    const size_t newline = maps.find('\n');
    const std::string_view line = maps.substr(0, newline);
    maps.remove_prefix(newline == std::string_view::npos ? maps.size() : newline + 1);
    ++line_number;
    if (line.empty()) continue;
    // "start-end perms offset dev inode [path]"
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
    if (visit(mapping, line)) break;
  }
  return Status::Ok();
}

// The fields after the range: "perms offset major:minor inode".
Result<MappingDetails> ParseDetails(const MappedRange& range, std::string_view line) {
  std::vector<std::string_view> fields;
  while (fields.size() < 5) {
    const size_t start = line.find_first_not_of(' ');
    if (start == std::string_view::npos) break;
    line.remove_prefix(start);
    const size_t end = line.find(' ');
    fields.push_back(line.substr(0, end));
    line.remove_prefix(end == std::string_view::npos ? line.size() : end);
  }
  MappingDetails details;
  details.range = range;
  uint64_t major = 0;
  uint64_t minor = 0;
  const size_t colon = fields.size() == 5 ? fields[3].find(':') : std::string_view::npos;
  if (colon == std::string_view::npos || fields[1].size() != 4 ||
      !ParseHex(fields[2], &details.file_offset) || !ParseHex(fields[3].substr(0, colon), &major) ||
      !ParseHex(fields[3].substr(colon + 1), &minor) || !ParseDecimal(fields[4], &details.inode) ||
      major > 0xfff || minor > 0xfffff)
    return Corrupt("maps line for {:#x}-{:#x}: no permissions, offset, device and inode",
                   range.start, range.end);
  details.shared = fields[1][3] == 's';
  details.device = makedev(static_cast<unsigned>(major), static_cast<unsigned>(minor));
  return details;
}

std::string MapsPath(pid_t pid) {
  return "/proc/" + std::to_string(pid) + "/maps";
}

Result<UniqueFd> OpenMaps(pid_t pid) {
  const std::string path = MapsPath(pid);
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd.valid()) {
    if (errno == ENOENT || errno == ESRCH) return NotFound("{}: the process is gone", path);
    return ErrnoError(errno, "open {}", path);
  }
  return fd;
}

Result<std::string> ReadMaps(pid_t pid, const UniqueFd& fd) {
  const std::string path = MapsPath(pid);
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
  return text;
}

Result<std::string> ReadMaps(pid_t pid) {
  GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenMaps(pid));
  return ReadMaps(pid, fd);
}

// The VMA at `address` by PROCMAP_QUERY (nullopt where nothing is mapped there); kUnsupported
// where the kernel has no such ioctl.
Result<std::optional<MappingDetails>> QueryMappingAt(pid_t pid, const UniqueFd& fd,
                                                     uint64_t address) {
  ProcmapQuery query{};
  query.size = sizeof query;
  query.query_addr = address;
  int result = 0;
  do {
    result = ::ioctl(fd.get(), kProcmapQuery, &query);
  } while (result != 0 && errno == EINTR);
  const int error = result != 0 ? errno : 0;
  // ENOTTY: a kernel before 6.11. ENOENT: no VMA covers the address. ESRCH: the process has
  // exited, or its main thread had when the file was opened (the text then reads empty).
  if (error == ENOTTY)
    return Unsupported("{}: no PROCMAP_QUERY in this kernel (Linux 6.11+)", MapsPath(pid));
  if (error == ENOENT) return std::optional<MappingDetails>();
  if (error == ESRCH)
    return NotFound("{}: the process or its main thread has exited", MapsPath(pid));
  if (error != 0) return ErrnoError(error, "PROCMAP_QUERY for {:#x} on {}", address, MapsPath(pid));
  if (query.vma_start > address || query.vma_end <= address || query.dev_major > 0xfff ||
      query.dev_minor > 0xfffff)
    return Corrupt("PROCMAP_QUERY for {:#x} on {} answered [{:#x}, {:#x}) on device {}:{}", address,
                   MapsPath(pid), query.vma_start, query.vma_end, query.dev_major, query.dev_minor);
  MappingDetails details;
  details.range = {query.vma_start, query.vma_end};
  details.shared = (query.vma_flags & kProcmapVmaShared) != 0;
  details.file_offset = query.vma_offset;
  details.device = makedev(query.dev_major, query.dev_minor);
  details.inode = query.inode;
  return std::optional<MappingDetails>(details);
}

}  // namespace

Result<std::vector<MappedRange>> ParseMappingsIn(std::string_view maps, uint64_t from,
                                                 uint64_t to) {
  std::vector<MappedRange> all;
  GPULAZY_RETURN_IF_ERROR(ForEachMapping(maps, [&](const MappedRange& range, std::string_view) {
    all.push_back(range);
    return false;
  }));
  return ClipMappings(all, from, to);
}

Result<std::optional<MappingDetails>> ParseMappingAt(std::string_view maps, uint64_t address) {
  std::optional<MappingDetails> found;
  Status details;
  GPULAZY_RETURN_IF_ERROR(
      ForEachMapping(maps, [&](const MappedRange& range, std::string_view line) {
        if (range.end <= address) return false;
        if (range.start <= address) {
          Result<MappingDetails> parsed = ParseDetails(range, line);
          if (parsed.ok())
            found = *parsed;
          else
            details = parsed.status();
        }
        return true;  // at or past the address: nothing further holds it
      }));
  GPULAZY_RETURN_IF_ERROR(details);
  return found;
}

Result<std::vector<MappingDetails>> AllMappings(pid_t pid) {
  GPULAZY_ASSIGN_OR_RETURN(const std::string text, ReadMaps(pid));
  std::vector<MappingDetails> all;
  Status details;
  Status walked = ForEachMapping(text, [&](const MappedRange& range, std::string_view line) {
    Result<MappingDetails> parsed = ParseDetails(range, line);
    if (!parsed.ok()) {
      details = parsed.status();
      return true;
    }
    all.push_back(*parsed);
    return false;
  });
  if (walked.ok()) walked = details;
  if (!walked.ok()) return walked.Context(MapsPath(pid));
  return all;
}

Result<std::vector<MappedRange>> MappingsIn(pid_t pid, uint64_t from, uint64_t to) {
  GPULAZY_ASSIGN_OR_RETURN(const std::string text, ReadMaps(pid));
  Result<std::vector<MappedRange>> mappings = ParseMappingsIn(text, from, to);
  if (!mappings.ok()) return mappings.status().Context(MapsPath(pid));
  return mappings;
}

Result<std::optional<MappingDetails>> MappingAt(pid_t pid, uint64_t address, MapsLookup lookup) {
  GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenMaps(pid));
  // Set once the kernel says it has no such ioctl: later lookups go straight to the text.
  static std::atomic<bool> no_query{false};
  if (lookup == MapsLookup::kQuery || (lookup == MapsLookup::kQueryOrText && !no_query.load())) {
    Result<std::optional<MappingDetails>> queried = QueryMappingAt(pid, fd, address);
    if (queried.ok() || queried.status().code() == Code::kNotFound || lookup == MapsLookup::kQuery)
      return queried;
    // Any other refusal (a kernel without it, or a seccomp or LSM policy filtering ioctls): the
    // text says the same, more slowly.
    if (queried.status().code() == Code::kUnsupported) no_query.store(true);
    spdlog::debug("uffd mappings: {}; reading the text instead", queried.status().ToString());
  }
  GPULAZY_ASSIGN_OR_RETURN(const std::string text, ReadMaps(pid, fd));
  Result<std::optional<MappingDetails>> mapping = ParseMappingAt(text, address);
  if (!mapping.ok()) return mapping.status().Context(MapsPath(pid));
  return mapping;
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
