// `gpulazy-client fetch`: RestoreSession + HostCopyEngine, then the BOs written back as CRIU
// amdgpu-pages-<id>-<gpu>.img files (header = total, BOs of one process and GPU in bo_index
// order), byte-identical to the checkpoint's own when the restore is right.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "lazy-server/image/criu_checkpoint.h"
#include "page-client/cli/commands.h"
#include "page-client/host_engine.h"
#include "page-client/restore_session.h"
#include "proto/size.h"

namespace gpulazy::client::cli {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

// Redraws one status line on stderr until stopped; only used when stderr is a terminal.
class ProgressBar {
 public:
  ProgressBar(const RestoreSession& session, Clock::time_point start)
      : session_(session), start_(start), thread_([this] { Loop(); }) {}
  ~ProgressBar() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
    Draw();
    fmt::print(stderr, "\n");
  }

 private:
  void Loop() {
    std::unique_lock lock(mutex_);
    while (!cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return stop_; }))
      Draw();
  }
  void Draw() const {
    Progress p = session_.progress();
    double fraction = p.total_bytes ? double(p.resident_bytes) / double(p.total_bytes) : 1.0;
    constexpr int kWidth = 30;
    int filled = static_cast<int>(fraction * kWidth);
    double seconds = Seconds(Clock::now() - start_);
    uint64_t rate = seconds > 0 ? static_cast<uint64_t>(double(p.resident_bytes) / seconds) : 0;
    fmt::print(stderr, "\r[{}{}] {:5.1f}%  {} / {}  {}/s  reconnects {}  refetches {}   ",
               std::string(filled, '#'), std::string(kWidth - filled, ' '), fraction * 100,
               FormatSize(p.resident_bytes), FormatSize(p.total_bytes), FormatSize(rate),
               p.reconnects, p.refetches);
  }

  const RestoreSession& session_;
  Clock::time_point start_;
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

struct PagesFile {
  uint32_t process_id = 0;
  uint32_t gpu_id = 0;
  std::vector<uint32_t> bos;  // session BO indices in bo_index order
  uint64_t bytes = 0;
};

Result<std::vector<std::string>> WritePagesFiles(const RestoreSession& session,
                                                 const HostCopyEngine& engine,
                                                 const std::filesystem::path& dir) {
  std::map<std::pair<uint32_t, uint32_t>, PagesFile> files;
  const std::vector<BoEntry>& bos = session.bos();
  for (uint32_t i = 0; i < bos.size(); ++i) {
    PagesFile& file = files[{bos[i].process_id, bos[i].gpu_id}];
    file.process_id = bos[i].process_id;
    file.gpu_id = bos[i].gpu_id;
    file.bos.push_back(i);
    file.bytes += bos[i].size;
  }
  std::vector<std::string> names;
  for (auto& [key, file] : files) {
    std::stable_sort(file.bos.begin(), file.bos.end(),
                     [&](uint32_t a, uint32_t b) { return bos[a].bo_index < bos[b].bo_index; });
    GPULAZY_ASSIGN_OR_RETURN(
        image::PagesFileWriter writer,
        image::PagesFileWriter::Create(dir, file.process_id, file.gpu_id, file.bytes));
    for (uint32_t bo : file.bos) {
      GPULAZY_ASSIGN_OR_RETURN(std::span<uint8_t> bytes, engine.Mapping(bo));
      GPULAZY_RETURN_IF_ERROR(writer.Append(bytes));
    }
    GPULAZY_RETURN_IF_ERROR(writer.Finish());
    names.push_back(fmt::format("amdgpu-pages-{}-{:04x}.img", file.process_id, file.gpu_id));
  }
  return names;
}

Status Fetch(const FetchOptions& options, nlohmann::json* summary) {
  std::error_code ec;
  std::filesystem::create_directories(options.out_dir, ec);
  if (ec) return IoError("creating {}: {}", options.out_dir, ec.message());

  HostCopyEngine engine;
  SessionOptions session_options;
  session_options.endpoint = options.server;
  session_options.image = options.image;
  session_options.window_bytes = options.window_bytes;
  session_options.window_per_connection_bytes = options.window_per_connection_bytes;
  session_options.file_window_bytes = options.file_window_bytes;
  session_options.demand_connection = options.demand_connection;
  session_options.read_files = options.read_files;
  session_options.file_readers = options.file_readers;
  session_options.lanes = options.lanes;
  if (!options.token_file.empty()) {
    GPULAZY_ASSIGN_OR_RETURN(session_options.token, net::ReadTokenFile(options.token_file));
  }
  session_options.tls = options.tls;
  session_options.insecure_tcp = options.insecure;
  RestoreSession session(session_options, engine);

  Clock::time_point start = Clock::now();
  GPULAZY_RETURN_IF_ERROR(session.Start());
  {
    std::optional<ProgressBar> bar;
    if (::isatty(STDERR_FILENO)) bar.emplace(session, start);
    GPULAZY_RETURN_IF_ERROR(session.WaitComplete());
  }
  double restore_seconds = Seconds(Clock::now() - start);
  Clock::time_point write_start = Clock::now();
  GPULAZY_ASSIGN_OR_RETURN(std::vector<std::string> files,
                           WritePagesFiles(session, engine, options.out_dir));
  Progress p = session.progress();
  *summary = {
      {"image", options.image},
      {"server", options.server},
      {"engine", std::string(engine.name())},
      {"bos", session.bos().size()},
      {"bytes", p.resident_bytes},
      {"chunks", p.resident_chunks},
      {"received_bytes", p.received_bytes},
      {"seconds", restore_seconds},
      {"throughput_bytes_per_s",
       restore_seconds > 0 ? double(p.resident_bytes) / restore_seconds : 0.0},
      {"write_seconds", Seconds(Clock::now() - write_start)},
      {"reconnects", p.reconnects},
      {"read_files", p.reading_files},
      {"lanes", p.lanes},
      {"lane_bytes", p.lane_bytes},
      {"refetches", p.refetches},
      {"duplicates", p.duplicates},
      {"duplicate_bytes", p.duplicate_bytes},
      {"demand_chunks", p.demand_chunks},
      {"files", files},
  };
  return Status::Ok();
}

}  // namespace

int RunFetch(const FetchOptions& options) {
  nlohmann::json summary;
  Status status = Fetch(options, &summary);
  if (!status.ok()) {
    fmt::print(stderr, "gpulazy-client fetch: {}\n", status.ToString());
    return 1;
  }
  if (options.json) fmt::print("{}\n", summary.dump(2));
  return 0;
}

}  // namespace gpulazy::client::cli
