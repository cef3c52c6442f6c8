#include "bench/harness.h"

#include <fcntl.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string_view>
#include <thread>
#include <tuple>

#include "lazy-server/image/io.h"
#include "lazy-server/image/synth.h"
#include "page-client/net/stderr_log.h"

namespace gpulazy::bench {
namespace fs = std::filesystem;

namespace {
using FreshPages = client::HostEngineOptions::FreshPages;
// --fresh-pages names: write_fresh_pages, then what several writers do.
constexpr std::array<std::tuple<std::string_view, bool, FreshPages>, 4> kFreshPages{{
    {"write", true, FreshPages::kMap},  // the default: pwrite while one thread writes
    {"write-one-per-bo", true, FreshPages::kOnePerBo},
    {"write-always", true, FreshPages::kWrite},
    {"map", false, FreshPages::kMap},
}};
}  // namespace

void AddFreshPagesOption(CLI::App& command, std::string& value) {
  std::vector<std::string> names;
  names.reserve(kFreshPages.size());
  for (const auto& [name, write, several] : kFreshPages)
    names.emplace_back(name);
  command
      .add_option("--fresh-pages", value,
                  "host engine: destination pages that do not exist yet are written through the "
                  "memfd while one thread writes, through the mapping with several (write); "
                  "with several, one pwrite per BO at a time (write-one-per-bo) or all "
                  "(write-always); always through the mapping (map)")
      ->capture_default_str()
      ->check(CLI::IsMember(names));
}

void ParseFreshPages(const std::string& value, bool* write_fresh_pages,
                     FreshPages* with_several_writers) {
  for (const auto& [name, write, several] : kFreshPages) {
    if (name != value) continue;
    *write_fresh_pages = write;
    *with_several_writers = several;
  }
}

std::string FreshPagesName(bool write_fresh_pages, FreshPages with_several_writers) {
  for (const auto& [name, write, several] : kFreshPages)
    if (write == write_fresh_pages && (!write || several == with_several_writers))
      return std::string(name);
  return "?";
}

void AddWindowPerConnectionOption(CLI::App& command, std::string& value) {
  command
      .add_option("--window-per-connection", value,
                  "with lanes, the credit window is at least this much per bulk connection "
                  "(0: --window alone)")
      ->capture_default_str();
}

void AddBatchWakeupsOption(CLI::App& command, bool& value) {
  command.add_flag("--batch-wakeups,!--no-batch-wakeups", value,
                   "tcp: wake a receiving thread once a payload read's bytes have arrived "
                   "(SO_RCVLOWAT), not at each segment (default on)");
}

void AddBackgroundNiceOption(CLI::App& command, int& value) {
  command
      .add_option("--background-nice", value,
                  "added to the nice value of background restore threads, client and server")
      ->capture_default_str()
      ->check(CLI::Range(0, 19));
}

std::vector<std::string> ServerArgsWithBackgroundNice(int nice,
                                                      const std::vector<std::string>& more) {
  std::vector<std::string> args = {"--background-nice", std::to_string(nice)};
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void LogWarningsToStderr() {
  net::LogToStderr(spdlog::level::warn);
}

Result<WorkDir> WorkDir::Create(const fs::path& parent) {
  // A --work-dir that does not exist yet is made, as `mkdir -p` would.
  std::error_code ec;
  fs::create_directories(parent, ec);
  if (ec) return ErrnoError(ec.value(), "creating the work directory {}", parent.string());
  std::string templ = (parent / "gpulazy-bench.XXXXXX").string();
  if (mkdtemp(templ.data()) == nullptr) return ErrnoError(errno, "mkdtemp {}", templ);
  WorkDir dir;
  dir.path_ = templ;
  return dir;
}

WorkDir::WorkDir(WorkDir&& other) noexcept : path_(std::move(other.path_)) {
  other.path_.clear();
}

WorkDir::~WorkDir() {
  if (path_.empty()) return;
  std::error_code ignored;
  fs::remove_all(path_, ignored);
}

Result<std::vector<fs::path>> PagesFiles(const fs::path& image_dir) {
  std::vector<fs::path> files;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(image_dir, ec)) {
    std::string name = entry.path().filename().string();
    if (name.starts_with("amdgpu-pages-")) files.push_back(entry.path());
  }
  if (ec) return IoError("listing {}: {}", image_dir.string(), ec.message());
  std::sort(files.begin(), files.end());
  return files;
}

Result<fs::path> MakeWarmImage(const fs::path& root, const std::string& name, uint64_t bytes,
                               uint32_t gpus, uint64_t seed, uint32_t bos_per_process) {
  image::SynthOptions synth;
  synth.out = root / name;
  synth.gpus = gpus;
  synth.bos = bos_per_process;
  synth.total_bytes = bytes;
  synth.seed = seed;
  GPULAZY_RETURN_IF_ERROR(image::SynthesizeCheckpoint(synth).status());
  GPULAZY_ASSIGN_OR_RETURN(std::vector<fs::path> files, PagesFiles(synth.out));
  std::vector<uint8_t> buffer(8u << 20);
  for (const fs::path& file : files) {
    GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(file));
    while (true) {
      ssize_t n = read(fd.get(), buffer.data(), buffer.size());
      if (n < 0) return ErrnoError(errno, "reading {}", file.string());
      if (n == 0) break;
    }
  }
  return synth.out;
}

namespace {

// Regular files under `dir`, every level.
Result<std::vector<fs::path>> FilesUnder(const fs::path& dir) {
  std::error_code error;
  std::vector<fs::path> files;
  for (fs::recursive_directory_iterator it(dir, error), end; !error && it != end;
       it.increment(error))
    if (it->is_regular_file(error)) files.push_back(it->path());
  if (error) return IoError("listing {}: {}", dir.string(), error.message());
  return files;
}

}  // namespace

Status EvictFromPageCache(const fs::path& dir) {
  GPULAZY_ASSIGN_OR_RETURN(std::vector<fs::path> files, FilesUnder(dir));
  for (const fs::path& file : files) {
    GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(file));
    // Dirty pages are not dropped: write them back first (fdatasync works on a read-only fd).
    if (fdatasync(fd.get()) != 0) return ErrnoError(errno, "fdatasync {}", file.string());
    if (const int rc = posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED); rc != 0)
      return ErrnoError(rc, "posix_fadvise(DONTNEED) {}", file.string());
  }
  return Status::Ok();
}

Result<uint64_t> CachedBytes(const fs::path& dir) {
  GPULAZY_ASSIGN_OR_RETURN(std::vector<fs::path> files, FilesUnder(dir));
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  uint64_t cached = 0;
  std::vector<unsigned char> resident;
  for (const fs::path& file : files) {
    GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(file));
    GPULAZY_ASSIGN_OR_RETURN(uint64_t size, FileSize(fd.get(), file));
    if (size == 0) continue;
    void* mapped = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd.get(), 0);
    if (mapped == MAP_FAILED) return ErrnoError(errno, "mmap {}", file.string());
    resident.assign((size + page - 1) / page, 0);
    const int rc = mincore(mapped, size, resident.data());
    const int error = errno;
    munmap(mapped, size);
    if (rc != 0) return ErrnoError(error, "mincore {}", file.string());
    for (const unsigned char r : resident)
      if ((r & 1) != 0) cached += page;
  }
  return cached;
}

Result<ServerChild> StartServer(const fs::path& bin_dir, const fs::path& root,
                                const fs::path& run_dir,
                                const std::vector<std::string>& extra_args) {
  server::ServerChildOptions options;
  options.binary = bin_dir / "gpulazy-server";
  options.root = root;
  options.run_dir = run_dir;
  options.extra_args = extra_args;
  Result<ServerChild> child = ServerChild::Start(options);
  if (!child.ok() && child.status().code() == Code::kNotFound)
    return child.status().Context("pass --bin-dir");
  return child;
}

Result<nlohmann::json> RunInChild(const std::function<Result<nlohmann::json>()>& measure) {
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) return ErrnoError(errno, "pipe");
  UniqueFd read_end(pipe_fds[0]);
  UniqueFd write_end(pipe_fds[1]);
  pid_t pid = fork();
  if (pid < 0) return ErrnoError(errno, "fork");
  if (pid == 0) {
    read_end.reset();
    Result<nlohmann::json> result = measure();
    nlohmann::json out =
        result.ok() ? *result : nlohmann::json{{"error", result.status().ToString()}};
    std::string text = out.dump();
    size_t off = 0;
    while (off < text.size()) {
      ssize_t n = write(write_end.get(), text.data() + off, text.size() - off);
      if (n <= 0) _exit(3);
      off += static_cast<size_t>(n);
    }
    _exit(result.ok() ? 0 : 1);
  }
  write_end.reset();
  std::string text;
  char buffer[4096];
  while (true) {
    ssize_t n = read(read_end.get(), buffer, sizeof buffer);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buffer, static_cast<size_t>(n));
  }
  int status = 0;
  struct rusage usage {};
  if (wait4(pid, &status, 0, &usage) != pid) return ErrnoError(errno, "wait4");
  if (text.empty()) return Internal("benchmark child exited with status {} and no result", status);
  nlohmann::json result = nlohmann::json::parse(text, nullptr, false);
  if (result.is_discarded()) return Internal("benchmark child wrote unreadable JSON");
  if (result.contains("error")) return Internal("{}", result["error"].get<std::string>());
  result["peak_rss_bytes"] = static_cast<uint64_t>(usage.ru_maxrss) * 1024;  // ru_maxrss is KiB
  return result;
}

CpuMeter::CpuMeter(pid_t server)
    : server_(server),
      machine_(ReadMachine()),
      self_s_(SelfSeconds()),
      self_switches_(SelfVoluntarySwitches()),
      server_s_(server > 0 ? ProcessSeconds(server) : std::nullopt),
      self_threads_(ThreadSecondsByName(::getpid())),
      server_threads_(server > 0 ? ThreadSecondsByName(server) : std::map<std::string, double>{}) {}

std::map<std::string, double> CpuMeter::ThreadSecondsByName(pid_t pid) {
  std::map<std::string, double> by_name;
  std::error_code error;
  const std::filesystem::path tasks = fmt::format("/proc/{}/task", pid);
  for (const auto& task : std::filesystem::directory_iterator(tasks, error)) {
    std::ifstream comm(task.path() / "comm");
    std::ifstream schedstat(task.path() / "schedstat");  // "on-CPU-ns wait-ns timeslices"
    std::string name;
    uint64_t on_cpu_ns = 0;
    // A thread that ended while we read is skipped.
    if (!std::getline(comm, name) || !(schedstat >> on_cpu_ns)) continue;
    std::replace(name.begin(), name.end(), '-', '_');
    std::replace(name.begin(), name.end(), ' ', '_');
    by_name[name] += static_cast<double>(on_cpu_ns) / 1e9;
  }
  return by_name;
}

CpuMeter::MachineTicks CpuMeter::ReadMachine() {
  // "cpu  user nice system idle iowait irq softirq steal ..." (proc(5)).
  std::ifstream stat("/proc/stat");
  std::string label;
  uint64_t user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  stat >> label >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
  MachineTicks ticks;
  if (!stat || label != "cpu") return ticks;
  // Busy from the counters that only grow: idle and iowait are each rounded to ticks, so their
  // sum can step back by one when time moves from one to the other.
  ticks.busy = user + nice + system + irq + softirq + steal;
  ticks.total = ticks.busy + idle + iowait;
  ticks.steal = steal;
  return ticks;
}

double CpuMeter::SelfSeconds() {
  rusage usage{};
  if (::getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  auto seconds = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec / 1e6; };
  return seconds(usage.ru_utime) + seconds(usage.ru_stime);
}

std::optional<double> CpuMeter::ProcessSeconds(pid_t pid) {
  // Fields 14 and 15 of /proc/PID/stat (utime, stime, in clock ticks) follow the command name,
  // which may contain spaces: count from its closing parenthesis.
  std::ifstream file(fmt::format("/proc/{}/stat", pid));
  std::string line;
  if (!std::getline(file, line)) return std::nullopt;
  const size_t close = line.rfind(')');
  if (close == std::string::npos || close + 2 > line.size()) return std::nullopt;
  std::istringstream fields(line.substr(close + 2));
  std::string field;
  uint64_t utime = 0, stime = 0;
  int index = 3;
  for (; index <= 15 && fields >> field; ++index) {
    if (index == 14) utime = std::strtoull(field.c_str(), nullptr, 10);
    if (index == 15) stime = std::strtoull(field.c_str(), nullptr, 10);
  }
  if (index <= 15) return std::nullopt;  // fewer fields than proc(5) promises
  return static_cast<double>(utime + stime) / static_cast<double>(::sysconf(_SC_CLK_TCK));
}

uint64_t CpuMeter::SelfVoluntarySwitches() {
  rusage usage{};
  if (::getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  return static_cast<uint64_t>(usage.ru_nvcsw);
}

nlohmann::json CpuMeter::Read(bool by_thread) const {
  const MachineTicks now = ReadMachine();
  nlohmann::json out;
  // Both reads worked (a failed one reads as all zeros) and time passed.
  if (machine_.total > 0 && now.total > machine_.total) {
    const uint64_t total = now.total - machine_.total;
    out["cpu_busy"] = std::min(1.0, static_cast<double>(now.busy - machine_.busy) / total);
    out["cpu_steal"] = static_cast<double>(now.steal - machine_.steal) / total;
  }
  out["client_cpu_s"] = SelfSeconds() - self_s_;
  out["client_voluntary_switches"] = SelfVoluntarySwitches() - self_switches_;
  // Only where the server could be read both times (it may have gone meanwhile).
  if (const std::optional<double> now_s = server_ > 0 ? ProcessSeconds(server_) : std::nullopt;
      now_s && server_s_)
    out["server_cpu_s"] = *now_s - *server_s_;
  if (by_thread) {
    // A name's threads then against now; a thread started meanwhile counts from 0.
    auto add = [&out](std::string_view process, const std::map<std::string, double>& before,
                      const std::map<std::string, double>& now) {
      for (const auto& [name, seconds] : now) {
        const auto then = before.find(name);
        out[fmt::format("{}_cpu_{}_s", process, name)] =
            std::max(0.0, seconds - (then == before.end() ? 0.0 : then->second));
      }
    };
    add("client", self_threads_, ThreadSecondsByName(::getpid()));
    if (server_ > 0) add("server", server_threads_, ThreadSecondsByName(server_));
  }
  return out;
}

nlohmann::json MachineDescription() {
  nlohmann::json machine;
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.starts_with("model name")) {
      machine["cpu"] = line.substr(line.find(':') + 2);
      break;
    }
  }
  machine["cores"] = std::thread::hardware_concurrency();
  machine["memory_bytes"] =
      static_cast<uint64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  struct utsname uts {};
  if (uname(&uts) == 0) machine["kernel"] = std::string(uts.release);
  return machine;
}

void Emit(const CommonOptions& options, const nlohmann::json& result,
          const std::vector<std::string>& columns) {
  if (options.json) {
    std::cout << result.dump() << std::endl;
    return;
  }
  std::ostringstream row;
  for (const std::string& column : columns) {
    if (!result.contains(column)) continue;
    const nlohmann::json& value = result[column];
    row << column << '=';
    if (value.is_number_float()) {
      double v = value.get<double>();
      if (column.ends_with("_Bps"))
        row << fmt::format("{:.2f}GB/s", v / 1e9);
      else if (column.ends_with("_s"))
        row << fmt::format("{:.3f}ms", v * 1e3);
      else
        row << fmt::format("{:.3f}", v);
    } else if (value.is_string()) {
      row << value.get<std::string>();
    } else {
      row << value.dump();
    }
    row << "  ";
  }
  std::cout << row.str() << std::endl;
}

double ReadersIdleSeconds(uint32_t readers, double wall_s, double busy_s) {
  return readers == 0 ? 0.0 : std::max(0.0, readers * wall_s - busy_s);
}

double Percentile(std::vector<double> samples, double fraction) {
  if (samples.empty()) return 0;
  std::sort(samples.begin(), samples.end());
  double rank = fraction * static_cast<double>(samples.size() - 1);
  size_t lo = static_cast<size_t>(std::floor(rank));
  size_t hi = std::min(lo + 1, samples.size() - 1);
  double weight = rank - static_cast<double>(lo);
  return samples[lo] * (1 - weight) + samples[hi] * weight;
}

}  // namespace gpulazy::bench
