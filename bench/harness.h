// bench/: gpulazy-bench, which measures gpulazy against ceilings taken in the same run.
//
// harness: what every benchmark needs — a synthetic image on disk and warm in the page cache,
// a real gpulazy-server child process, measurement in a forked child (so each case's peak RSS
// is its own), a discarding copy engine, and the machine's description for the report.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "lazy-server/child/server_child.h"
#include "page-client/copy_engine.h"
#include "page-client/host_engine.h"
#include "proto/status.h"

namespace CLI {
class App;
}

namespace gpulazy::bench {

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point start);

struct CommonOptions {
  std::filesystem::path work_dir = "/tmp";  // images and sockets go in a fresh folder here
  std::filesystem::path bin_dir;            // where gpulazy-server lives
  bool json = false;
  std::vector<std::string> server_args;  // more gpulazy-server options (--server-arg, repeatable)
};

// --background-nice for a subcommand: added to the nice value of the restore's background threads,
// client (SessionOptions::background_nice) and server (its --background-nice).
void AddBackgroundNiceOption(CLI::App& command, int& value);
// The server's options for that: --background-nice `nice`, then `more` (--server-arg), so an
// explicit --server-arg=--background-nice=N wins.
std::vector<std::string> ServerArgsWithBackgroundNice(int nice,
                                                      const std::vector<std::string>& more);

// --window-per-connection SIZE for a subcommand (SessionOptions::window_per_connection_bytes).
void AddWindowPerConnectionOption(CLI::App& command, std::string& value);

// --batch-wakeups / --no-batch-wakeups for a subcommand (SessionOptions::batch_tcp_wakeups).
void AddBatchWakeupsOption(CLI::App& command, bool& value);

// --fresh-pages for a subcommand whose sessions use the host engine: how destination pages that
// do not exist yet are written (HostEngineOptions::write_fresh_pages and
// fresh_pages_with_several_writers). `value` takes the name; ParseFreshPages reads it.
void AddFreshPagesOption(CLI::App& command, std::string& value);
void ParseFreshPages(const std::string& value, bool* write_fresh_pages,
                     client::HostEngineOptions::FreshPages* with_several_writers);
// The --fresh-pages name of those settings, for the JSON.
std::string FreshPagesName(bool write_fresh_pages,
                           client::HostEngineOptions::FreshPages with_several_writers);

// A fresh directory, removed with everything in it on destruction.
class WorkDir {
 public:
  static Result<WorkDir> Create(const std::filesystem::path& parent);
  WorkDir(WorkDir&& other) noexcept;
  WorkDir& operator=(WorkDir&&) = delete;
  ~WorkDir();
  const std::filesystem::path& path() const { return path_; }

 private:
  WorkDir() = default;
  std::filesystem::path path_;
};

// Synthesizes a CRIU checkpoint of `bytes` content bytes (one process, `bos_per_process` BOs on
// `gpus` GPUs) under root/name and reads it once so it is in the page cache. Returns the image
// directory.
Result<std::filesystem::path> MakeWarmImage(const std::filesystem::path& root,
                                            const std::string& name, uint64_t bytes, uint32_t gpus,
                                            uint64_t seed, uint32_t bos_per_process = 16);
// Paths of the checkpoint's pages files.
Result<std::vector<std::filesystem::path>> PagesFiles(const std::filesystem::path& image_dir);

// Writes back every file under `dir` and drops its pages from the page cache
// (POSIX_FADV_DONTNEED), so the next reader reads from the disk: a cold start.
Status EvictFromPageCache(const std::filesystem::path& dir);
// Bytes of the files under `dir` in the page cache now (mincore over a mapping of each; the
// mapping faults nothing in).
Result<uint64_t> CachedBytes(const std::filesystem::path& dir);

using server::ServerChild;
// bin_dir/gpulazy-server as a child process (server::ServerChild), serving `root` on a Unix
// socket and on tcp 127.0.0.1:0, logging warnings and errors into run_dir/server.log.
Result<ServerChild> StartServer(const std::filesystem::path& bin_dir,
                                const std::filesystem::path& root,
                                const std::filesystem::path& run_dir,
                                const std::vector<std::string>& extra_args = {});

// Runs `measure` in a forked child and returns the JSON it produced, with the child's peak RSS
// added as "peak_rss_bytes". Call only while this process has a single thread.
Result<nlohmann::json> RunInChild(const std::function<Result<nlohmann::json>()>& measure);

// Accepts every write and drops the bytes: measures the pipeline up to the engine without the
// cost (or memory) of a destination.
class DiscardEngine : public client::CopyEngine {
 public:
  std::string_view name() const override { return "discard"; }
  Status AddDestination(uint32_t bo, uint64_t size) override { return Status::Ok(); }
  Status Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw,
               client::CopyDone done) override {
    done(Status::Ok());
    return Status::Ok();
  }
  Status Flush() override { return Status::Ok(); }
};

// Where the CPU went while a case ran: the whole machine's busy share (/proc/stat), the
// CPU-seconds of this process (every thread) and of a server process. Tells a pipeline that
// waits from one that has no CPU left.
class CpuMeter {
 public:
  explicit CpuMeter(pid_t server = -1);  // starts counting
  // cpu_busy: share of all CPUs' time not idle (steal included, also reported as cpu_steal);
  // client_cpu_s: this process; server_cpu_s: the server's, when one was given;
  // client_voluntary_switches: how often this process's threads slept (waiting for data, a
  // lock, the disk). With by_thread, also each process's CPU-seconds per thread name
  // ("client_cpu_gl_stream_s", "server_cpu_gl_disk_s": the names gpulazy gives its threads,
  // '-' as '_'), summed over the threads of a name, which tells whose thread the time is.
  nlohmann::json Read(bool by_thread = false) const;

  // CPU-seconds per thread name of the live threads of `pid` (/proc/PID/task/*/schedstat, in
  // nanoseconds; threads that ended are not in it).
  static std::map<std::string, double> ThreadSecondsByName(pid_t pid);

 private:
  struct MachineTicks {
    uint64_t total = 0, busy = 0, steal = 0;
  };
  static MachineTicks ReadMachine();
  static double SelfSeconds();
  static uint64_t SelfVoluntarySwitches();
  static std::optional<double> ProcessSeconds(pid_t pid);  // nullopt: not readable
  pid_t server_;
  MachineTicks machine_;
  double self_s_;
  uint64_t self_switches_;
  std::optional<double> server_s_;
  std::map<std::string, double> self_threads_;
  std::map<std::string, double> server_threads_;
};

// Warnings and errors only, on stderr: results go to stdout (one JSON object per line with
// --json), and the library's logs would interleave with them there, spdlog's default.
void LogWarningsToStderr();

// CPU model, cores, memory and kernel, for the report.
nlohmann::json MachineDescription();

// One case's result: a table row on a terminal, one JSON line with --json.
void Emit(const CommonOptions& options, const nlohmann::json& result,
          const std::vector<std::string>& columns);

double Percentile(std::vector<double> samples, double fraction);

// The file readers' time between chunks (Progress::file_read_s and file_engine_s are their time
// inside installs, summed over them): `readers` x the run's `wall_s`, less `busy_s`; never
// negative, 0 when no reader ran.
double ReadersIdleSeconds(uint32_t readers, double wall_s, double busy_s);

}  // namespace gpulazy::bench
