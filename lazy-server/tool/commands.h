// gpulazy-image's commands (synth, info, convert, verify, profile) as functions of their
// parsed arguments and an output stream, so tests call them without a process. main.cc only
// parses the command line and maps a Status to an exit code.
// Thread-safety: none needed; each call works on its own directory.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "lazy-server/image/lazy_image.h"
#include "lazy-server/image/synth.h"
#include "proto/manifest.pb.h"
#include "proto/status.h"

namespace gpulazy::tool {

// --- argument helpers (their errors are usage errors: exit code 2)

// "--chunk-size 1M": a size with K/M/G suffix, a power of two within the lazy image's limits.
Result<uint32_t> ParseChunkSize(std::string_view text);

// --- synth

Status RunSynth(const image::SynthOptions& options, std::ostream& out);

// --- info

struct DeviceInfo {
  uint32_t gpu_id = 0;
  uint32_t node_id = 0;
  uint32_t device_id = 0;
  uint64_t vram_bytes = 0;
};

struct ProcessInfo {
  uint32_t file_id = 0;
  std::string file_name;
  uint32_t pid = 0;
  std::vector<DeviceInfo> devices;
  std::map<std::string, uint32_t> bos_by_kind;  // vram, gtt, userptr, doorbell, mmio, other
  uint32_t bo_count = 0;
  uint64_t content_bytes = 0;
};

struct LazyInfo {
  uint32_t chunk_size = 0;
  uint64_t chunks = 0;
  std::map<std::string, uint64_t> chunks_by_codec;  // raw, lz4, zero
  uint64_t raw_bytes = 0;
  uint64_t stored_bytes = 0;     // the chunk file's payload
  uint64_t dedup_chunks = 0;     // chunks sharing stored bytes with an earlier chunk
  double zero_ratio = 0;         // zero chunks / chunks
  double compression_ratio = 0;  // stored / raw (lower is better)
  bool profile_present = false;
  uint64_t profile_entries = 0;
  uint32_t hot_count = 0;
  std::string profile_source;
};

struct InfoData {
  std::filesystem::path dir;
  std::vector<ProcessInfo> processes;
  std::map<std::string, uint32_t> bos_by_kind;  // over all processes
  uint32_t bo_count = 0;
  uint64_t content_bytes = 0;
  std::map<uint32_t, uint64_t> bytes_by_gpu;  // gpu_id -> content bytes over all processes
  std::optional<LazyInfo> lazy;
};

Result<InfoData> CollectInfo(const std::filesystem::path& dir);
nlohmann::json InfoToJson(const InfoData& info);
std::string InfoToText(const InfoData& info);
Status RunInfo(const std::filesystem::path& dir, bool json, std::ostream& out);

// --- convert / verify

Status RunConvert(const std::filesystem::path& dir, const image::ConvertOptions& options,
                  std::ostream& out);
// Prints one line when the image is fine; otherwise one line per mismatch to `err` and a
// kCorrupt status.
Status RunVerify(const std::filesystem::path& dir, std::ostream& out, std::ostream& err);

// --- profile

// Parses an access order: one "bo chunk" pair per line; '#' starts a comment; blank lines are
// ignored. Checks every pair against the manifest (in range, no duplicates). hot_count
// defaults to the whole order and must not exceed it. `what` names the file in errors.
Result<manifest::AccessProfile> ParseAccessOrder(std::string_view text,
                                                 const manifest::Manifest& manifest,
                                                 std::optional<uint32_t> hot_count,
                                                 std::string_view what);
// Prints a profile in the format ParseAccessOrder reads (header lines are comments).
std::string FormatAccessProfile(const manifest::AccessProfile& profile);

Status RunProfileSet(const std::filesystem::path& dir, const std::filesystem::path& order_file,
                     std::optional<uint32_t> hot_count, std::ostream& out);
Status RunProfileShow(const std::filesystem::path& dir, std::ostream& out);

}  // namespace gpulazy::tool
