// Shared by the libFuzzer harnesses (tests/fuzz/fuzz_*.cc), their corpus replay tests and the
// seed-corpus generator (make_corpus.cc): a process-wide scratch directory and the tiny,
// deterministic checkpoint every image harness starts from. docs/hostile-input.md describes
// each harness's input format.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "proto/status.h"

namespace gpulazy::fuzz {

// A directory under /dev/shm (else /tmp) for the life of the process, removed at exit. Harnesses
// run one input at a time, so one directory per process is enough.
const std::filesystem::path& ScratchDir();

// Replaces `path` with exactly `bytes` (created 0644). Aborts on failure: a harness that cannot
// write its input would report nothing useful.
void WriteFileOrDie(const std::filesystem::path& path, std::span<const uint8_t> bytes);

// Synthesizes the seed checkpoint into `dir`: 1 GPU, 6 BOs, 64 KiB of contents, seed 1. Same
// bytes on every run (synth is a pure function of its options). With `lazy`, converts it to a
// lazy image of 4 KiB chunks too.
Status MakeTinyCheckpoint(const std::filesystem::path& dir, bool lazy);

inline constexpr uint32_t kTinyChunkSize = 4096;

}  // namespace gpulazy::fuzz
