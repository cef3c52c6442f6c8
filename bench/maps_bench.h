// `gpulazy-bench maps`: what the uffd pager's one-address lookup in a program's maps costs
// (uffd::MappingAt, at each length-0 mremap event and each fault in no known range), by the
// kernel's PROCMAP_QUERY ioctl and by reading and parsing the whole maps text, in a process
// with many mappings. The floor both pay, measured in the same run, is opening and closing the
// maps file.
#pragma once

#include <cstdint>

#include "bench/harness.h"

namespace gpulazy::bench {

struct MapsOptions {
  uint32_t mappings = 10000;  // one-page mappings made apart (each with a gap of its own)
  uint32_t lookups = 2000;    // per lookup kind; the text path does at most a tenth
};

Status RunMapsBench(const CommonOptions& common, const MapsOptions& options);

}  // namespace gpulazy::bench
