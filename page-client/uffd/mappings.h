// The mappings of a process's address space, as /proc/PID/maps lists them. Pager::UnregisterAll
// reads them where the kernel refuses to unregister a range (a BO the program unmapped, or a file
// of its own mapped over part of one), so it unregisters what is mapped there instead of probing
// the range page by page, and at its end for second mappings of BO memfds. The pager looks up one
// address (MappingAt, by the kernel's PROCMAP_QUERY where it has it) where a length-0 mremap
// went and at a fault in no known range.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

#include "proto/status.h"

namespace gpulazy::uffd {

struct MappedRange {
  uint64_t start = 0;
  uint64_t end = 0;  // exclusive
};

// One mapping as a maps line describes it: the range, and what it maps.
struct MappingDetails {
  MappedRange range;
  bool shared = false;       // 's' in the permissions: a shared mapping
  uint64_t file_offset = 0;  // of `range.start` in the file mapped (0 for anonymous memory)
  dev_t device = 0;          // of the file mapped, as stat(2) has it (makedev(major, minor))
  uint64_t inode = 0;        // of the file mapped; 0 for anonymous memory
};

// The mappings listed in `maps` (the text of a /proc/PID/maps) that overlap [from, to), clipped
// to it, in address order. A line that does not parse is kCorrupt: the caller must not act on a
// partial view.
Result<std::vector<MappedRange>> ParseMappingsIn(std::string_view maps, uint64_t from, uint64_t to);

// The same for the live process `pid`. kNotFound when it has no maps to read (it exited, or
// only its main thread has), an errno error when they cannot be read (another user's process,
// /proc not mounted).
Result<std::vector<MappedRange>> MappingsIn(pid_t pid, uint64_t from, uint64_t to);

// The mapping of `maps` (a /proc/PID/maps text) that holds `address`, with its details; nullopt
// where nothing is mapped there. Lines before it that do not parse are kCorrupt.
Result<std::optional<MappingDetails>> ParseMappingAt(std::string_view maps, uint64_t address);

// How MappingAt asks the kernel. The PROCMAP_QUERY ioctl on the maps file (Linux 6.11+) answers
// for one address from the process's VMA tree; the text lists every mapping, which the kernel
// prints under the process's mmap lock and the caller parses, at a cost that grows with the
// process. kQueryOrText reads the text only where the kernel lacks or refuses the ioctl; kQuery
// fails then (kUnsupported where it lacks it).
enum class MapsLookup { kQueryOrText, kQuery, kText };

// The same for the live process `pid`: errors as MappingsIn, and kUnsupported (no ioctl) or
// another refusal of the ioctl with kQuery (kQueryOrText reads the text then).
Result<std::optional<MappingDetails>> MappingAt(pid_t pid, uint64_t address,
                                                MapsLookup lookup = MapsLookup::kQueryOrText);

// Every mapping of the live process `pid`, with its details, in address order (errors as
// MappingsIn).
Result<std::vector<MappingDetails>> AllMappings(pid_t pid);

// The mappings of `mappings` (in address order, as the two above return them) that overlap
// [from, to), clipped to it.
std::vector<MappedRange> ClipMappings(const std::vector<MappedRange>& mappings, uint64_t from,
                                      uint64_t to);

}  // namespace gpulazy::uffd
