#include "bench/restore_bench.h"

#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <xxhash.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <fstream>
#include <iostream>
#include <map>
#include <numeric>
#include <thread>

#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/image_source.h"
#include "lazy-server/image/io.h"
#include "lazy-server/image/lazy_image.h"
#include "page-client/host_engine.h"
#include "page-client/restore_session.h"
#include "page-client/uffd/memory.h"
#include "page-client/uffd/pager.h"
#include "page-client/uffd/uffd_engine.h"
#include "page-client/uffd/userfaultfd.h"
#include "proto/size.h"

namespace gpulazy::bench {
namespace fs = std::filesystem;

namespace {

constexpr uint32_t kExperts = 8;  // a token reads 1 of 8 slices of every layer

// The slice of BO `bo` (size bytes) that token `token` reads: page aligned, 1/8 of the BO.
std::pair<uint64_t, uint64_t> TokenSlice(uint32_t token, uint32_t bo, uint64_t size) {
  const uint64_t page = uffd::PageSize();
  const uint64_t expert = (uint64_t{token} * 5 + uint64_t{bo} * 3) % kExperts;
  uint64_t begin = size * expert / kExperts / page * page;
  uint64_t end = size * (expert + 1) / kExperts / page * page;
  if (expert + 1 == kExperts) end = size;
  return {begin, end - begin};
}

uint64_t Combine(uint64_t hash, uint64_t value) {
  return XXH3_64bits_withSeed(&value, sizeof value, hash);
}

// One token of the workload: hash the slices in layer order. `memory(bo)` is the BO's bytes.
template <typename Memory>
uint64_t RunToken(uint32_t token, const std::vector<client::BoEntry>& bos, Memory memory,
                  uffd::AccessRecorder* recorder, uint32_t chunk_size) {
  uint64_t hash = token;
  for (uint32_t bo = 0; bo < bos.size(); ++bo) {
    auto [offset, length] = TokenSlice(token, bo, bos[bo].size);
    if (length == 0) continue;
    if (recorder != nullptr) recorder->NoteRange(bo, offset, length, chunk_size);
    std::span<const uint8_t> bytes = memory(bo).subspan(offset, length);
    hash = Combine(hash, XXH3_64bits(bytes.data(), bytes.size()));
  }
  return hash;
}

// The expected hash of `tokens` tokens, from the checkpoint's own files (not through gpulazy).
Result<uint64_t> ExpectedChecksum(const fs::path& image_dir,
                                  const std::vector<client::BoEntry>& bos, uint32_t tokens) {
  GPULAZY_ASSIGN_OR_RETURN(std::shared_ptr<const image::ImageSource> source,
                           image::ImageSource::Open(image_dir));
  std::map<std::pair<uint32_t, uint32_t>, const manifest::Bo*> by_id;
  for (const manifest::Bo& bo : source->manifest().bos())
    by_id[{bo.process_id(), bo.bo_index()}] = &bo;
  std::map<std::string, UniqueFd> files;
  uint64_t total = 0;
  std::vector<uint8_t> buffer;
  for (uint32_t token = 0; token < tokens; ++token) {
    uint64_t hash = token;
    for (uint32_t b = 0; b < bos.size(); ++b) {
      auto [offset, length] = TokenSlice(token, b, bos[b].size);
      if (length == 0) continue;
      auto it = by_id.find({bos[b].process_id, bos[b].bo_index});
      if (it == by_id.end()) return NotFound("BO {} not in the source image", b);
      const manifest::Bo& bo = *it->second;
      if (!files.contains(bo.source_file())) {
        GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(image_dir / bo.source_file()));
        files.emplace(bo.source_file(), std::move(fd));
      }
      buffer.resize(length);
      GPULAZY_RETURN_IF_ERROR(ReadExactAt(files.at(bo.source_file()).get(),
                                          8 + bo.source_offset() + offset, buffer,
                                          image_dir / bo.source_file()));
      hash = Combine(hash, XXH3_64bits(buffer.data(), buffer.size()));
    }
    total = Combine(total, hash);
  }
  return total;
}

struct ModeRun {
  std::string mode;
  std::string endpoint;
  fs::path image_dir;
  const RestoreOptions* options;
  bool record_profile = false;
};

// One mode, in a forked child (RunInChild): restore + workload, timed from "restore begins".
Result<nlohmann::json> MeasureMode(const ModeRun& run) {
  const RestoreOptions& options = *run.options;
  const bool lazy = run.mode.starts_with("lazy");
  const auto fill =
      options.fill_mode == "minor" ? uffd::FillMode::kMinorContinue : uffd::FillMode::kMissingCopy;
  client::SessionOptions session_options;
  session_options.endpoint = run.endpoint;
  session_options.insecure_tcp = true;  // the harness's loopback server runs --insecure-tcp
  session_options.image = "ckpt";
  session_options.client_name = "bench-restore-" + run.mode;
  session_options.read_files = options.read_files;
  session_options.local_demand = options.local_demand;
  session_options.demand_on_caller = options.demand_on_caller;
  session_options.background_nice = options.background_nice;
  if (options.file_window) session_options.file_window_bytes = *options.file_window;
  session_options.reconnect.deadline = std::chrono::milliseconds(20000);

  const auto start = Clock::now();
  std::optional<uffd::Userfaultfd> uffd;
  std::unique_ptr<client::CopyEngine> engine;
  if (lazy) {
    GPULAZY_ASSIGN_OR_RETURN(uffd::Userfaultfd created, uffd::Userfaultfd::Create(fill));
    uffd.emplace(std::move(created));
    engine = std::make_unique<uffd::UffdCopyEngine>(
        *uffd, uffd::UffdEngineOptions{.defer_zeros = options.defer_zeros});
  } else {
    engine = std::make_unique<client::HostCopyEngine>();
  }
  client::RestoreSession session(session_options, *engine);
  GPULAZY_RETURN_IF_ERROR(session.Start());
  const std::vector<client::BoEntry>& bos = session.bos();
  const uint32_t chunk_size = session.chunk_size();

  std::optional<uffd::RestoredMemory> memory;
  std::unique_ptr<uffd::Pager> pager;
  uffd::AccessRecorder recorder;
  recorder.Reset(bos);
  double resume_s = 0, full_s = 0;
  if (lazy) {
    std::vector<uint64_t> sizes;
    sizes.reserve(bos.size());
    for (const client::BoEntry& bo : bos)
      sizes.push_back(bo.size);
    GPULAZY_ASSIGN_OR_RETURN(uffd::RestoredMemory created,
                             uffd::RestoredMemory::Create(*uffd, sizes));
    memory.emplace(std::move(created));
    auto& uffd_engine = static_cast<uffd::UffdCopyEngine&>(*engine);
    for (const uffd::Region& region : memory->regions())
      GPULAZY_RETURN_IF_ERROR(uffd_engine.Bind(region, memory->memfd(region.bo)));
    uffd::PagerOptions pager_options;
    pager = std::make_unique<uffd::Pager>(*uffd, session, uffd_engine, memory->regions(),
                                          pager_options);
    GPULAZY_RETURN_IF_ERROR(pager->Start());
    resume_s = SecondsSince(start);
  } else if (run.mode == "eager") {
    GPULAZY_RETURN_IF_ERROR(session.WaitComplete(std::chrono::minutes(10)));
    resume_s = full_s = SecondsSince(start);
  } else {
    resume_s = SecondsSince(start);
  }

  // The program's own start-up (runtime init, tokenizer...), which needs no BO contents.
  std::this_thread::sleep_for(std::chrono::milliseconds(options.startup_ms));
  if (run.mode == "parallel") {
    GPULAZY_RETURN_IF_ERROR(session.WaitComplete(std::chrono::minutes(10)));
    full_s = SecondsSince(start);
  }

  auto host_memory = [&](uint32_t bo) -> std::span<const uint8_t> {
    return *static_cast<client::HostCopyEngine&>(*engine).Mapping(bo);
  };
  auto lazy_memory = [&](uint32_t bo) -> std::span<const uint8_t> { return memory->bytes(bo); };
  uint64_t checksum = 0;
  double first_s = 0;
  for (uint32_t token = 0; token < options.tokens; ++token) {
    uint64_t hash = lazy ? RunToken(token, bos, lazy_memory, &recorder, chunk_size)
                         : RunToken(token, bos, host_memory, nullptr, chunk_size);
    checksum = Combine(checksum, hash);
    if (token == 0) first_s = SecondsSince(start);
  }
  const size_t hot_count = recorder.size();

  if (lazy) {
    GPULAZY_RETURN_IF_ERROR(session.WaitComplete(std::chrono::minutes(10)));
    full_s = SecondsSince(start);
    GPULAZY_RETURN_IF_ERROR(pager->UnregisterAll());
    pager->Stop();
    GPULAZY_RETURN_IF_ERROR(pager->status());
  }
  const client::Progress progress = session.progress();
  uffd::PagerStats stats = pager ? pager->stats() : uffd::PagerStats{};
  GPULAZY_ASSIGN_OR_RETURN(uint64_t expected, ExpectedChecksum(run.image_dir, bos, options.tokens));

  nlohmann::json result{{"mode", run.mode},
                        {"size", options.size},
                        {"chunk_size", chunk_size},
                        {"fill", lazy ? uffd::FillModeName(fill) : "memcpy"},
                        {"read_files", options.read_files},
                        {"local_demand", options.local_demand},
                        {"demand_on_caller", options.demand_on_caller},
                        {"background_nice", options.background_nice},
                        {"file_window_bytes", session_options.file_window_bytes},
                        {"time_to_resume_s", resume_s},
                        {"time_to_first_result_s", first_s},
                        {"time_to_full_s", full_s},
                        {"faults", stats.faults},
                        {"demand_chunks", progress.demand_chunks},
                        {"fault_p50_s", Percentile(stats.latencies_s, 0.5)},
                        {"fault_p99_s", Percentile(stats.latencies_s, 0.99)},
                        {"bytes", progress.received_bytes},
                        {"duplicate_bytes", progress.duplicate_bytes},
                        {"checksum_ok", checksum == expected}};
  // Where in the run the tail lies: the slowest 1 % of faults (at most 100), in time order, as
  // [seconds after the pager started, latency in seconds].
  if (!stats.latencies_s.empty()) {
    std::vector<size_t> slowest(stats.latencies_s.size());
    std::iota(slowest.begin(), slowest.end(), size_t{0});
    const size_t keep = std::min<size_t>(100, slowest.size() / 100 + 1);
    std::partial_sort(
        slowest.begin(), slowest.begin() + static_cast<std::ptrdiff_t>(keep), slowest.end(),
        [&](size_t a, size_t b) { return stats.latencies_s[a] > stats.latencies_s[b]; });
    slowest.resize(keep);
    std::sort(slowest.begin(), slowest.end(),
              [&](size_t a, size_t b) { return stats.fault_at_s[a] < stats.fault_at_s[b]; });
    nlohmann::json slow = nlohmann::json::array();
    for (size_t i : slowest)
      slow.push_back({stats.fault_at_s[i], stats.latencies_s[i]});
    result["slowest_faults"] = slow;
  }
  if (run.record_profile) {
    nlohmann::json order = nlohmann::json::array();
    for (const uffd::ChunkRef& ref : recorder.order())
      order.push_back({ref.bo, ref.chunk});
    result["profile_order"] = order;
    result["profile_hot"] = hot_count;
  }
  return result;
}

// Writes the recorded order into the lazy image's manifest (session BO index = manifest BO
// index: the server lists a lazy image's BOs in manifest order).
Status WriteProfile(const fs::path& dir, const nlohmann::json& order, uint64_t hot) {
  GPULAZY_ASSIGN_OR_RETURN(image::LazyImage lazy, image::LazyImage::Open(dir));
  manifest::Manifest manifest = lazy.manifest();
  manifest::AccessProfile* profile = manifest.mutable_profile();
  profile->Clear();
  for (const nlohmann::json& ref : order) {
    manifest::ChunkRef* out = profile->add_order();
    out->set_bo(ref[0].get<uint32_t>());
    out->set_chunk(ref[1].get<uint32_t>());
  }
  profile->set_hot_count(static_cast<uint32_t>(hot));
  profile->set_source("recorded");
  return image::WriteManifest(dir, manifest);
}

// A hand-written SVG timeline: per mode, restore (until resume), run (until first result) and a
// marker at full residency.
void WriteSvg(const std::string& path, const std::vector<nlohmann::json>& rows) {
  double end = 0.001;
  for (const auto& row : rows)
    end = std::max(
        {end, row["time_to_full_s"].get<double>(), row["time_to_first_result_s"].get<double>()});
  const int left = 120, width = 600, row_h = 34, top = 30;
  auto x = [&](double s) { return left + s / end * width; };
  std::ofstream out(path);
  out << fmt::format(
      "<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{}' font-family='sans-serif' "
      "font-size='12'>\n",
      left + width + 40, top + row_h * static_cast<int>(rows.size()) + 50);
  out << "<text x='10' y='18'>restore timeline (s): grey = restoring, blue = resumed until first "
         "result, red tick = all resident</text>\n";
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& row = rows[i];
    const double y = top + static_cast<double>(i) * row_h;
    const double resume = row["time_to_resume_s"].get<double>();
    const double first = row["time_to_first_result_s"].get<double>();
    const double full = row["time_to_full_s"].get<double>();
    out << fmt::format("<text x='10' y='{}'>{}</text>\n", y + 16, row["mode"].get<std::string>());
    out << fmt::format("<rect x='{}' y='{}' width='{:.1f}' height='20' fill='#bbb'/>\n", x(0), y,
                       std::max(1.0, x(resume) - x(0)));
    out << fmt::format("<rect x='{:.1f}' y='{}' width='{:.1f}' height='20' fill='#4a7fd4'/>\n",
                       x(resume), y, std::max(1.0, x(first) - x(resume)));
    out << fmt::format("<rect x='{:.1f}' y='{}' width='3' height='26' fill='#d22'/>\n", x(full),
                       y - 3);
    out << fmt::format("<text x='{:.1f}' y='{}'>{:.3f}</text>\n", x(first) + 4, y + 15, first);
  }
  const double axis = top + static_cast<double>(rows.size()) * row_h + 10;
  out << fmt::format("<line x1='{}' y1='{}' x2='{}' y2='{}' stroke='black'/>\n", left, axis,
                     left + width, axis);
  for (int t = 0; t <= 4; ++t)
    out << fmt::format("<text x='{:.1f}' y='{}'>{:.2f}</text>\n", x(end * t / 4) - 10, axis + 16,
                       end * t / 4);
  out << "</svg>\n";
}

Status RunMechanisms(const CommonOptions& common, const RestoreOptions& options);

}  // namespace

Status RunRestoreBench(const CommonOptions& common, const RestoreOptions& options) {
  if (options.mechanisms) return RunMechanisms(common, options);
  for (const std::string& mode : options.modes)
    if (mode != "eager" && mode != "parallel" && mode != "lazy" && mode != "lazy-profiled")
      return InvalidArgument("--modes: unknown mode {}", mode);
  GPULAZY_ASSIGN_OR_RETURN(WorkDir work, WorkDir::Create(common.work_dir));
  const fs::path root = work.path() / "images";
  GPULAZY_ASSIGN_OR_RETURN(fs::path image_dir,
                           MakeWarmImage(root, "ckpt", options.size, 2, options.seed));
  const bool profiled =
      std::find(options.modes.begin(), options.modes.end(), "lazy-profiled") != options.modes.end();
  if (profiled || options.chunk_size != 0) {
    // A lazy image: the access profile lives in its manifest, and its chunk size is ours.
    GPULAZY_ASSIGN_OR_RETURN(image::CriuCheckpoint checkpoint,
                             image::CriuCheckpoint::Open(image_dir));
    image::ConvertOptions convert;
    if (options.chunk_size != 0) convert.chunk_size = options.chunk_size;
    GPULAZY_RETURN_IF_ERROR(image::ConvertToLazyImage(checkpoint, convert).status());
  }
  GPULAZY_ASSIGN_OR_RETURN(
      ServerChild server,
      StartServer(common.bin_dir, root, work.path(),
                  ServerArgsWithBackgroundNice(options.background_nice, common.server_args)));

  std::vector<std::string> modes = options.modes;
  const bool has_lazy = std::find(modes.begin(), modes.end(), "lazy") != modes.end();
  bool profile_written = false;
  std::vector<nlohmann::json> rows;
  auto run_mode = [&](const std::string& mode, bool record) -> Result<nlohmann::json> {
    ModeRun run{mode, server.unix_endpoint(), image_dir, &options, record};
    uint64_t cached = 0;
    if (options.cold) {
      GPULAZY_RETURN_IF_ERROR(EvictFromPageCache(image_dir));
      GPULAZY_ASSIGN_OR_RETURN(cached, CachedBytes(image_dir));
      if (cached > options.size / 4)
        spdlog::warn(
            "--cold: {} bytes of the image stay in the page cache after eviction (a "
            "tmpfs, or pages in use): not a cold start",
            cached);
    }
    GPULAZY_ASSIGN_OR_RETURN(nlohmann::json row, RunInChild([&] { return MeasureMode(run); }));
    row["cold"] = options.cold;
    // What was in the page cache anyway: a cold run shows how cold it was.
    if (options.cold) row["image_cached_bytes_at_start"] = cached;
    return row;
  };
  for (const std::string& mode : modes) {
    if (mode == "lazy-profiled" && !profile_written) {
      // No lazy run before this one: record a profile with one now (not reported).
      GPULAZY_ASSIGN_OR_RETURN(nlohmann::json recording, run_mode("lazy", true));
      GPULAZY_RETURN_IF_ERROR(WriteProfile(image_dir, recording["profile_order"],
                                           recording["profile_hot"].get<uint64_t>()));
      profile_written = true;
    }
    const bool record = mode == "lazy" && profiled && has_lazy;
    GPULAZY_ASSIGN_OR_RETURN(nlohmann::json row, run_mode(mode, record));
    if (record) {
      GPULAZY_RETURN_IF_ERROR(
          WriteProfile(image_dir, row["profile_order"], row["profile_hot"].get<uint64_t>()));
      profile_written = true;
      row["profile_chunks"] = row["profile_order"].size();
      row.erase("profile_order");
      row.erase("profile_hot");
    }
    Emit(common, row,
         {"mode", "time_to_resume_s", "time_to_first_result_s", "time_to_full_s", "faults",
          "fault_p50_s", "fault_p99_s", "bytes", "peak_rss_bytes", "checksum_ok"});
    rows.push_back(row);
  }
  if (!options.svg.empty()) WriteSvg(options.svg, rows);
  for (const auto& row : rows)
    if (!row["checksum_ok"].get<bool>())
      return Corrupt("mode {}: the workload's checksum differs from the source image's",
                     row["mode"].get<std::string>());
  return Status::Ok();
}

namespace {

// A registered region of `bytes` and, in MINOR mode, the pager's own mapping to fill it through.
struct MechanismTarget {
  uffd::Userfaultfd uffd;
  uffd::RestoredMemory memory;
  std::optional<uffd::Mapping> filler;
};

Result<MechanismTarget> MakeMechanismTarget(uffd::FillMode mode, bool anonymous, uint64_t bytes) {
  GPULAZY_ASSIGN_OR_RETURN(uffd::Userfaultfd uffd, uffd::Userfaultfd::Create(mode));
  GPULAZY_ASSIGN_OR_RETURN(uffd::RestoredMemory memory,
                           uffd::RestoredMemory::Create(uffd, {bytes}, anonymous));
  std::optional<uffd::Mapping> filler;
  if (mode == uffd::FillMode::kMinorContinue) {
    GPULAZY_ASSIGN_OR_RETURN(uffd::Mapping mapped, uffd::Mapping::Map(memory.memfd(0), bytes));
    filler.emplace(std::move(mapped));
  }
  return MechanismTarget{std::move(uffd), std::move(memory), std::move(filler)};
}

// MISSING + UFFDIO_COPY (anonymous and memfd) against MINOR + UFFDIO_CONTINUE (memfd): the cost
// of one 4 KiB fault served from memory by a pager thread, and of filling 2 MiB chunks with no
// fault pending (the background path). No server: this isolates the kernel mechanism.
Result<nlohmann::json> MeasureMechanism(uffd::FillMode mode, bool anonymous, uint64_t bytes) {
  const uint64_t page = uffd::PageSize();
  std::vector<uint8_t> source(bytes);
  for (size_t i = 0; i < source.size(); i += 8)
    source[i] = static_cast<uint8_t>(i >> 12);
  nlohmann::json result{
      {"mechanism", std::string(uffd::FillModeName(mode)) + (anonymous ? "/anon" : "/memfd")}};
  // (1) faults: a thread touches every page; the pager installs the page it faulted on.
  {
    GPULAZY_ASSIGN_OR_RETURN(MechanismTarget target, MakeMechanismTarget(mode, anonymous, bytes));
    uffd::Userfaultfd& uffd = target.uffd;
    uffd::RestoredMemory& memory = target.memory;
    std::optional<uffd::Mapping>& filler = target.filler;
    const uint64_t base = memory.regions()[0].addr;
    std::atomic<bool> done{false};
    std::thread pager([&] {
      uffd::FaultEvent events[64];
      while (!done.load()) {
        pollfd pfd{uffd.fd(), POLLIN, 0};
        if (poll(&pfd, 1, 50) <= 0) continue;
        Result<size_t> n = uffd.Read(events);
        if (!n.ok()) return;
        for (size_t i = 0; i < *n; ++i) {
          const uint64_t at = uffd::PageAlignDown(events[i].address);
          const uint64_t off = at - base;
          if (mode == uffd::FillMode::kMissingCopy) {
            (void)uffd.Copy(at, std::span<const uint8_t>(source).subspan(off, page));
          } else {
            std::memcpy(filler->data() + off, source.data() + off, page);
            (void)uffd.Continue(at, page);
          }
        }
      }
    });
    std::vector<double> latencies;
    const uint8_t* data = memory.bytes(0).data();
    uint64_t sum = 0;
    for (uint64_t off = 0; off < bytes; off += page) {
      auto t = Clock::now();
      sum += *reinterpret_cast<const volatile uint8_t*>(data + off);
      latencies.push_back(SecondsSince(t));
    }
    done.store(true);
    pager.join();
    result["fault_p50_s"] = Percentile(latencies, 0.5);
    result["fault_p99_s"] = Percentile(latencies, 0.99);
    result["faults"] = latencies.size();
    result["sum_ok"] = sum == [&] {
      uint64_t s = 0;
      for (uint64_t off = 0; off < bytes; off += page)
        s += source[off];
      return s;
    }();
  }
  // (2) fill: install everything in 2 MiB chunks, no fault pending.
  {
    GPULAZY_ASSIGN_OR_RETURN(MechanismTarget target, MakeMechanismTarget(mode, anonymous, bytes));
    uffd::Userfaultfd& uffd = target.uffd;
    uffd::RestoredMemory& memory = target.memory;
    std::optional<uffd::Mapping>& filler = target.filler;
    const uint64_t base = memory.regions()[0].addr;
    const uint64_t chunk = 2u << 20;
    auto t = Clock::now();
    for (uint64_t off = 0; off < bytes; off += chunk) {
      const uint64_t len = std::min(chunk, bytes - off);
      if (mode == uffd::FillMode::kMissingCopy) {
        GPULAZY_RETURN_IF_ERROR(
            uffd.Copy(base + off, std::span<const uint8_t>(source).subspan(off, len)).status());
      } else {
        std::memcpy(filler->data() + off, source.data() + off, len);
        GPULAZY_RETURN_IF_ERROR(uffd.Continue(base + off, len).status());
      }
    }
    const double seconds = SecondsSince(t);
    result["fill_Bps"] = static_cast<double>(bytes) / seconds;
    result["fill_ok"] = std::memcmp(memory.bytes(0).data(), source.data(), bytes) == 0;
  }
  return result;
}

Status RunMechanisms(const CommonOptions& common, const RestoreOptions& options) {
  const uint64_t bytes = std::min<uint64_t>(options.size, 256ull << 20);
  const std::pair<uffd::FillMode, bool> cases[] = {{uffd::FillMode::kMissingCopy, true},
                                                   {uffd::FillMode::kMissingCopy, false},
                                                   {uffd::FillMode::kMinorContinue, false}};
  for (const auto& [mode, anonymous] : cases) {
    GPULAZY_ASSIGN_OR_RETURN(nlohmann::json row,
                             RunInChild([&, mode = mode, anonymous = anonymous] {
                               return MeasureMechanism(mode, anonymous, bytes);
                             }));
    Emit(common, row,
         {"mechanism", "faults", "fault_p50_s", "fault_p99_s", "fill_Bps", "sum_ok", "fill_ok",
          "peak_rss_bytes"});
  }
  return Status::Ok();
}

}  // namespace

CLI::App* AddRestoreCommand(CLI::App& app, RestoreOptions& options, std::string& size_text,
                            std::string& chunk_text) {
  CLI::App* cmd = app.add_subcommand(
      "restore", "restore modes side by side: eager, parallel, lazy (userfaultfd), lazy-profiled");
  size_text = "512M";
  cmd->add_option("--size", size_text, "image content bytes")->capture_default_str();
  cmd->add_option("--modes", options.modes, "eager,parallel,lazy,lazy-profiled")->delimiter(',');
  cmd->add_option("--chunk-size", chunk_text, "lazy image chunk size (4K..4M; default 2M)");
  cmd->add_option("--startup-ms", options.startup_ms, "the program's own start-up work")
      ->capture_default_str();
  cmd->add_option("--tokens", options.tokens, "tokens the workload computes")
      ->capture_default_str();
  cmd->add_flag("--read-files,!--no-read-files", options.read_files,
                "read chunks from the image files the server passes (by reference)")
      ->capture_default_str();
  cmd->add_flag("--local-demand,!--no-local-demand", options.local_demand,
                "by reference: read a faulting chunk from the files (chunk table), not via the "
                "server")
      ->capture_default_str();
  cmd->add_flag("--demand-on-caller,!--no-demand-on-caller", options.demand_on_caller,
                "with --local-demand: the faulting thread's Ensure reads the chunk itself, not "
                "the session's demand thread")
      ->capture_default_str();
  cmd->add_option("--fill", options.fill_mode, "missing (UFFDIO_COPY) or minor (UFFDIO_CONTINUE)")
      ->capture_default_str();
  cmd->add_option_function<std::string>(
      "--file-window",
      [&options](const std::string& text) {
        Result<uint64_t> bytes = ParseSize(text);
        if (!bytes.ok()) throw CLI::ValidationError("--file-window", bytes.status().message());
        options.file_window = *bytes;
      },
      "credit window while reading passed image files (default: the client's)");
  AddBackgroundNiceOption(*cmd, options.background_nice);
  cmd->add_flag("--defer-zeros,!--no-defer-zeros", options.defer_zeros,
                "lazy modes, missing fill: zero chunks installed when first touched, not streamed "
                "into memory")
      ->capture_default_str();
  cmd->add_flag("--cold", options.cold,
                "drop the image's files from the page cache before each mode: every mode reads "
                "from the disk (a cold start)");
  cmd->add_option("--svg", options.svg, "write a timeline plot (SVG) here");
  cmd->add_flag("--mechanisms", options.mechanisms,
                "compare MISSING+COPY and MINOR+CONTINUE (no server)");
  return cmd;
}

}  // namespace gpulazy::bench
