#include "lazy-server/tool/commands.h"

#include <fmt/format.h>

#include <bit>
#include <charconv>
#include <chrono>
#include <set>
#include <utility>

#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/io.h"
#include "proto/criu_file.h"
#include "proto/size.h"

namespace gpulazy::tool {
namespace {

namespace cf = criu_format;

constexpr uint64_t kMaxOrderFileBytes = 64ull << 20;

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::string BoKindName(uint32_t flags) {
  if (flags & cf::kAllocVram) return "vram";
  if (flags & cf::kAllocGtt) return "gtt";
  if (flags & cf::kAllocUserptr) return "userptr";
  if (flags & cf::kAllocDoorbell) return "doorbell";
  if (flags & cf::kAllocMmioRemap) return "mmio";
  return "other";
}

std::string GpuHex(uint32_t gpu_id) {
  return fmt::format("{:04x}", gpu_id);
}

std::string KindSummary(const std::map<std::string, uint32_t>& kinds) {
  std::string text;
  for (const char* kind : {"vram", "gtt", "userptr", "doorbell", "mmio", "other"}) {
    auto it = kinds.find(kind);
    if (it == kinds.end() || it->second == 0) continue;
    std::string upper = kind;
    for (char& c : upper)
      c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    text += fmt::format("{}{} {}", text.empty() ? "" : ", ", it->second, upper);
  }
  return text;
}

uint32_t KindCount(const std::map<std::string, uint32_t>& kinds, const std::string& kind) {
  auto it = kinds.find(kind);
  return it == kinds.end() ? 0 : it->second;
}

Status CheckDirectory(const std::filesystem::path& dir) {
  std::error_code ec;
  if (!std::filesystem::exists(dir, ec))
    return NotFound("{}: no such checkpoint directory", dir.string());
  if (!std::filesystem::is_directory(dir, ec))
    return InvalidArgument("{}: not a directory", dir.string());
  return Status::Ok();
}

Result<image::LazyImage> OpenLazy(const std::filesystem::path& dir) {
  if (!image::LazyImage::Exists(dir))
    return NotFound("{}: no lazy image ({} is missing); run `gpulazy-image convert {}` first",
                    dir.string(), image::kManifestFileName, dir.string());
  return image::LazyImage::Open(dir);
}

// Parses one unsigned decimal field of an order-file line.
bool ParseU32(std::string_view text, uint32_t* value) {
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), *value);
  return ec == std::errc() && ptr == text.data() + text.size();
}

std::vector<std::string_view> SplitWords(std::string_view line) {
  std::vector<std::string_view> words;
  size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r'))
      ++i;
    size_t start = i;
    while (i < line.size() && line[i] != ' ' && line[i] != '\t' && line[i] != '\r')
      ++i;
    if (i > start) words.push_back(line.substr(start, i - start));
  }
  return words;
}

}  // namespace

Result<uint32_t> ParseChunkSize(std::string_view text) {
  GPULAZY_ASSIGN_OR_RETURN(uint64_t size, ParseSize(text));
  if (size < image::kMinChunkSize || size > image::kMaxChunkSize || !std::has_single_bit(size))
    return InvalidArgument("--chunk-size {} must be a power of two from {} to {}", text,
                           FormatSize(image::kMinChunkSize), FormatSize(image::kMaxChunkSize));
  return static_cast<uint32_t>(size);
}

// ---------------------------------------------------------------------------------- synth

Status RunSynth(const image::SynthOptions& options, std::ostream& out) {
  auto start = std::chrono::steady_clock::now();
  GPULAZY_ASSIGN_OR_RETURN(image::SynthReport report, image::SynthesizeCheckpoint(options));
  const double seconds = SecondsSince(start);
  out << fmt::format(
      "synth {}: {} process(es) x {} BOs on {} GPU(s), {} of contents (seed {}) in {:.1f} s\n",
      options.out.string(), options.processes, options.bos, options.gpus,
      FormatSize(report.content_bytes), options.seed, seconds);
  out << fmt::format("  BOs: {} VRAM, {} GTT, {} USERPTR, {} DOORBELL\n", report.vram_bos,
                     report.gtt_bos, report.userptr_bos, report.doorbell_bos);
  out << "  contents:";
  for (const auto& [content, bytes] : report.bytes_by_content)
    out << fmt::format(" {} {} ({} BOs);", image::SynthContentName(content), FormatSize(bytes),
                       report.bos_by_content[content]);
  out << "\n  per GPU:";
  for (const auto& [gpu, bytes] : report.bytes_by_gpu)
    out << fmt::format(" {} {};", GpuHex(gpu), FormatSize(bytes));
  out << fmt::format("\n  {} files:", report.files.size());
  for (const auto& file : report.files)
    out << ' ' << file;
  out << '\n';
  return Status::Ok();
}

// ----------------------------------------------------------------------------------- info

Result<InfoData> CollectInfo(const std::filesystem::path& dir) {
  GPULAZY_RETURN_IF_ERROR(CheckDirectory(dir));
  GPULAZY_ASSIGN_OR_RETURN(image::CriuCheckpoint checkpoint, image::CriuCheckpoint::Open(dir));
  InfoData info;
  info.dir = dir;
  for (const auto& image : checkpoint.processes()) {
    ProcessInfo process;
    process.file_id = image.file_id;
    process.file_name = image.file_name;
    process.pid = image.message.pid();
    for (const auto& device : image.message.devices())
      process.devices.push_back(
          {device.gpu_id(), device.node_id(), device.device_id(), device.vram_size()});
    for (const auto& bo : image.message.bos()) {
      std::string kind = BoKindName(bo.alloc_flags());
      ++process.bos_by_kind[kind];
      ++info.bos_by_kind[kind];
      ++process.bo_count;
      if (cf::HasContents(bo.alloc_flags())) {
        process.content_bytes += bo.size();
        info.bytes_by_gpu[bo.gpu_id()] += bo.size();
      }
    }
    info.bo_count += process.bo_count;
    info.content_bytes += process.content_bytes;
    info.processes.push_back(std::move(process));
  }

  if (!image::LazyImage::Exists(dir)) return info;
  GPULAZY_ASSIGN_OR_RETURN(image::LazyImage lazy, image::LazyImage::Open(dir));
  const manifest::Manifest& m = lazy.manifest();
  LazyInfo li;
  li.chunk_size = m.chunk_size();
  li.stored_bytes = m.chunk_file_bytes();
  for (const char* codec : {"raw", "lz4", "zero"})
    li.chunks_by_codec[codec] = 0;
  std::set<std::pair<uint64_t, uint32_t>> stored_ranges;
  for (const auto& bo : m.bos()) {
    li.raw_bytes += bo.size();
    for (const auto& chunk : bo.chunks()) {
      ++li.chunks;
      switch (chunk.codec()) {
        case manifest::CODEC_RAW:
          ++li.chunks_by_codec["raw"];
          break;
        case manifest::CODEC_LZ4:
          ++li.chunks_by_codec["lz4"];
          break;
        case manifest::CODEC_ZERO:
          ++li.chunks_by_codec["zero"];
          continue;  // stores nothing, so it shares nothing
        default:
          ++li.chunks_by_codec["unknown"];
          break;
      }
      if (!stored_ranges.emplace(chunk.stored_offset(), chunk.stored_length()).second)
        ++li.dedup_chunks;
    }
  }
  if (li.chunks > 0)
    li.zero_ratio =
        static_cast<double>(li.chunks_by_codec["zero"]) / static_cast<double>(li.chunks);
  if (li.raw_bytes > 0)
    li.compression_ratio = static_cast<double>(li.stored_bytes) / static_cast<double>(li.raw_bytes);
  li.profile_present = m.profile().order_size() > 0;
  li.profile_entries = static_cast<uint64_t>(m.profile().order_size());
  li.hot_count = m.profile().hot_count();
  li.profile_source = m.profile().source();
  info.lazy = std::move(li);
  return info;
}

nlohmann::json InfoToJson(const InfoData& info) {
  nlohmann::json j;
  j["dir"] = info.dir.string();
  j["bo_count"] = info.bo_count;
  j["content_bytes"] = info.content_bytes;
  j["bos_by_kind"] = info.bos_by_kind;
  nlohmann::json per_gpu = nlohmann::json::object();
  for (const auto& [gpu, bytes] : info.bytes_by_gpu)
    per_gpu[GpuHex(gpu)] = bytes;
  j["bytes_per_gpu"] = per_gpu;
  j["processes"] = nlohmann::json::array();
  for (const auto& p : info.processes) {
    nlohmann::json jp;
    jp["file_id"] = p.file_id;
    jp["file"] = p.file_name;
    jp["pid"] = p.pid;
    jp["bo_count"] = p.bo_count;
    jp["bos_by_kind"] = p.bos_by_kind;
    jp["content_bytes"] = p.content_bytes;
    jp["devices"] = nlohmann::json::array();
    for (const auto& d : p.devices)
      jp["devices"].push_back({{"gpu_id", d.gpu_id},
                               {"gpu_id_hex", GpuHex(d.gpu_id)},
                               {"node_id", d.node_id},
                               {"device_id", d.device_id},
                               {"device_id_hex", fmt::format("{:#06x}", d.device_id)},
                               {"vram_bytes", d.vram_bytes}});
    j["processes"].push_back(std::move(jp));
  }
  if (!info.lazy) {
    j["lazy"] = nullptr;
    return j;
  }
  const LazyInfo& l = *info.lazy;
  j["lazy"] = {{"chunk_size", l.chunk_size},
               {"chunks", l.chunks},
               {"chunks_by_codec", l.chunks_by_codec},
               {"raw_bytes", l.raw_bytes},
               {"stored_bytes", l.stored_bytes},
               {"zero_ratio", l.zero_ratio},
               {"compression_ratio", l.compression_ratio},
               {"dedup_chunks", l.dedup_chunks},
               {"profile",
                {{"present", l.profile_present},
                 {"entries", l.profile_entries},
                 {"hot_count", l.hot_count},
                 {"source", l.profile_source}}}};
  return j;
}

std::string InfoToText(const InfoData& info) {
  std::string s;
  s += fmt::format("checkpoint {}: {} process(es), {} BOs ({}), {} of contents\n",
                   info.dir.string(), info.processes.size(), info.bo_count,
                   KindSummary(info.bos_by_kind), FormatSize(info.content_bytes));
  s += fmt::format("\n  {:<20} {:>7} {:>5} {:>5} {:>4} {:>8} {:>9} {:>12}\n", "process", "pid",
                   "BOs", "VRAM", "GTT", "USERPTR", "DOORBELL", "contents");
  for (const auto& p : info.processes)
    s += fmt::format("  {:<20} {:>7} {:>5} {:>5} {:>4} {:>8} {:>9} {:>12}\n", p.file_name, p.pid,
                     p.bo_count, KindCount(p.bos_by_kind, "vram"), KindCount(p.bos_by_kind, "gtt"),
                     KindCount(p.bos_by_kind, "userptr"), KindCount(p.bos_by_kind, "doorbell"),
                     FormatSize(p.content_bytes));
  s += fmt::format("\n  {:<8} {:>6} {:>5} {:>8} {:>11}\n", "process", "gpu", "node", "device",
                   "VRAM");
  for (const auto& p : info.processes)
    for (const auto& d : p.devices) {
      s += fmt::format("  {:<8} {:>6} {:>5} {:>8} {:>11}\n", p.file_id, GpuHex(d.gpu_id), d.node_id,
                       fmt::format("{:#06x}", d.device_id), FormatSize(d.vram_bytes));
    }
  s += "\n  contents per GPU (all processes):";
  for (const auto& [gpu, bytes] : info.bytes_by_gpu)
    s += fmt::format(" {} {};", GpuHex(gpu), FormatSize(bytes));
  s += "\n\n";
  if (!info.lazy) {
    s += fmt::format("lazy image: none (run `gpulazy-image convert {}`)\n", info.dir.string());
    return s;
  }
  const LazyInfo& l = *info.lazy;
  auto codec = [&](const char* name) {
    auto it = l.chunks_by_codec.find(name);
    return it == l.chunks_by_codec.end() ? uint64_t{0} : it->second;
  };
  s += fmt::format("lazy image: chunk size {}, {} chunks ({} raw, {} lz4, {} zero; {:.1f}% zero)\n",
                   FormatSize(l.chunk_size), l.chunks, codec("raw"), codec("lz4"), codec("zero"),
                   100.0 * l.zero_ratio);
  s += fmt::format("  raw {} -> stored {} (stored/raw {:.3f}), {} chunks deduplicated\n",
                   FormatSize(l.raw_bytes), FormatSize(l.stored_bytes), l.compression_ratio,
                   l.dedup_chunks);
  if (l.profile_present)
    s += fmt::format("  profile: {} chunks in order, hot set {} chunks (source: {})\n",
                     l.profile_entries, l.hot_count,
                     l.profile_source.empty() ? "unknown" : l.profile_source);
  else
    s += "  profile: none (chunks stream in table order)\n";
  return s;
}

Status RunInfo(const std::filesystem::path& dir, bool json, std::ostream& out) {
  GPULAZY_ASSIGN_OR_RETURN(InfoData info, CollectInfo(dir));
  if (json)
    out << InfoToJson(info).dump(2) << '\n';
  else
    out << InfoToText(info);
  return Status::Ok();
}

// -------------------------------------------------------------------------- convert / verify

Status RunConvert(const std::filesystem::path& dir, const image::ConvertOptions& options,
                  std::ostream& out) {
  GPULAZY_RETURN_IF_ERROR(CheckDirectory(dir));
  GPULAZY_ASSIGN_OR_RETURN(image::CriuCheckpoint checkpoint, image::CriuCheckpoint::Open(dir));
  auto start = std::chrono::steady_clock::now();
  GPULAZY_ASSIGN_OR_RETURN(image::ConvertStats stats,
                           image::ConvertToLazyImage(checkpoint, options));
  const double seconds = SecondsSince(start);
  const double ratio = stats.raw_bytes == 0 ? 0.0
                                            : static_cast<double>(stats.stored_bytes) /
                                                  static_cast<double>(stats.raw_bytes);
  out << fmt::format(
      "convert {}: {} chunks of {} ({} stored raw, {} stored lz4, {} zero, {} deduplicated); {} -> "
      "{} "
      "stored "
      "(stored/raw {:.3f}) in {:.1f} s ({}/s)\n",
      dir.string(), stats.chunks, FormatSize(options.chunk_size), stats.raw_chunks,
      stats.lz4_chunks, stats.zero_chunks, stats.deduplicated_chunks, FormatSize(stats.raw_bytes),
      FormatSize(stats.stored_bytes), ratio, seconds,
      FormatSize(seconds > 0 ? static_cast<uint64_t>(static_cast<double>(stats.raw_bytes) / seconds)
                             : stats.raw_bytes));
  return Status::Ok();
}

Status RunVerify(const std::filesystem::path& dir, std::ostream& out, std::ostream& err) {
  GPULAZY_RETURN_IF_ERROR(CheckDirectory(dir));
  GPULAZY_ASSIGN_OR_RETURN(image::CriuCheckpoint checkpoint, image::CriuCheckpoint::Open(dir));
  GPULAZY_ASSIGN_OR_RETURN(image::LazyImage lazy, OpenLazy(dir));
  GPULAZY_ASSIGN_OR_RETURN(image::VerifyReport report, image::VerifyLazyImage(checkpoint, lazy));
  if (!report.ok()) {
    for (const auto& mismatch : report.mismatches)
      err << "mismatch: " << mismatch << '\n';
    return Corrupt("{}: {} of {} chunks do not match the CRIU checkpoint", dir.string(),
                   report.mismatches.size(), report.chunks_checked);
  }
  out << fmt::format("verify {}: ok, {} chunks, {} checked against the CRIU checkpoint\n",
                     dir.string(), report.chunks_checked, FormatSize(report.bytes_checked));
  return Status::Ok();
}

// -------------------------------------------------------------------------------- profile

Result<manifest::AccessProfile> ParseAccessOrder(std::string_view text,
                                                 const manifest::Manifest& manifest,
                                                 std::optional<uint32_t> hot_count,
                                                 std::string_view what) {
  manifest::AccessProfile profile;
  std::map<std::pair<uint32_t, uint32_t>, uint64_t> seen;  // pair -> line it first appeared on
  uint64_t line_number = 0;
  while (!text.empty()) {
    size_t end = text.find('\n');
    std::string_view line = text.substr(0, end);
    text = end == std::string_view::npos ? std::string_view{} : text.substr(end + 1);
    ++line_number;
    if (size_t hash = line.find('#'); hash != std::string_view::npos) line = line.substr(0, hash);
    std::vector<std::string_view> words = SplitWords(line);
    if (words.empty()) continue;
    uint32_t bo = 0, chunk = 0;
    if (words.size() != 2 || !ParseU32(words[0], &bo) || !ParseU32(words[1], &chunk))
      return InvalidArgument("{}:{}: expected 'bo chunk' (two unsigned integers), got '{}'", what,
                             line_number, line);
    if (bo >= static_cast<uint32_t>(manifest.bos_size()))
      return OutOfRange("{}:{}: BO {} is out of range (the image has {} BOs)", what, line_number,
                        bo, manifest.bos_size());
    const int chunks = manifest.bos(static_cast<int>(bo)).chunks_size();
    if (chunk >= static_cast<uint32_t>(chunks))
      return OutOfRange("{}:{}: chunk {} of BO {} is out of range (BO {} has {} chunks)", what,
                        line_number, chunk, bo, bo, chunks);
    auto [it, inserted] = seen.emplace(std::make_pair(bo, chunk), line_number);
    if (!inserted)
      return InvalidArgument("{}:{}: BO {} chunk {} is listed twice (first on line {})", what,
                             line_number, bo, chunk, it->second);
    auto* ref = profile.add_order();
    ref->set_bo(bo);
    ref->set_chunk(chunk);
  }
  if (profile.order_size() == 0) return InvalidArgument("{}: no 'bo chunk' entries", what);
  const uint32_t entries = static_cast<uint32_t>(profile.order_size());
  if (hot_count && *hot_count > entries)
    return InvalidArgument("--hot {} exceeds the {} entries of {}", *hot_count, entries, what);
  profile.set_hot_count(hot_count.value_or(entries));
  return profile;
}

std::string FormatAccessProfile(const manifest::AccessProfile& profile) {
  std::string s = fmt::format("# gpulazy access profile: {} chunks, hot set {}, source: {}\n",
                              profile.order_size(), profile.hot_count(),
                              profile.source().empty() ? "unknown" : profile.source());
  s += "# bo chunk\n";
  for (int i = 0; i < profile.order_size(); ++i) {
    if (static_cast<uint32_t>(i) == profile.hot_count() && i > 0) s += "# end of hot set\n";
    s += fmt::format("{} {}\n", profile.order(i).bo(), profile.order(i).chunk());
  }
  return s;
}

Status RunProfileSet(const std::filesystem::path& dir, const std::filesystem::path& order_file,
                     std::optional<uint32_t> hot_count, std::ostream& out) {
  GPULAZY_RETURN_IF_ERROR(CheckDirectory(dir));
  GPULAZY_ASSIGN_OR_RETURN(image::LazyImage lazy, OpenLazy(dir));
  auto bytes = ReadWholeFile(order_file, kMaxOrderFileBytes);
  if (!bytes.ok()) return bytes.status().Context(fmt::format("reading {}", order_file.string()));
  std::string_view text(reinterpret_cast<const char*>(bytes->data()), bytes->size());
  GPULAZY_ASSIGN_OR_RETURN(manifest::AccessProfile profile,
                           ParseAccessOrder(text, lazy.manifest(), hot_count, order_file.string()));
  profile.set_source(fmt::format("order file {}", order_file.filename().string()));

  uint64_t hot_bytes = 0;
  for (uint32_t i = 0; i < profile.hot_count(); ++i) {
    const auto& ref = profile.order(static_cast<int>(i));
    hot_bytes += lazy.manifest()
                     .bos(static_cast<int>(ref.bo()))
                     .chunks(static_cast<int>(ref.chunk()))
                     .raw_length();
  }
  manifest::Manifest updated = lazy.manifest();
  *updated.mutable_profile() = profile;
  GPULAZY_RETURN_IF_ERROR(image::WriteManifest(dir, updated));
  out << fmt::format("profile {}: {} chunks in order, hot set {} chunks ({}), written to {}\n",
                     dir.string(), profile.order_size(), profile.hot_count(), FormatSize(hot_bytes),
                     image::kManifestFileName);
  return Status::Ok();
}

Status RunProfileShow(const std::filesystem::path& dir, std::ostream& out) {
  GPULAZY_RETURN_IF_ERROR(CheckDirectory(dir));
  GPULAZY_ASSIGN_OR_RETURN(image::LazyImage lazy, OpenLazy(dir));
  const auto& profile = lazy.manifest().profile();
  if (profile.order_size() == 0) {
    out << "# no access profile; chunks stream in table order\n";
    return Status::Ok();
  }
  out << FormatAccessProfile(profile);
  return Status::Ok();
}

}  // namespace gpulazy::tool
