#include "bench/stream_bench.h"

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <thread>

#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/io.h"
#include "page-client/host_engine.h"
#include "page-client/populate_ahead.h"
#include "page-client/restore_session.h"

namespace gpulazy::bench {
namespace fs = std::filesystem;

namespace {

// Where the ceiling's copies go.
enum class CeilingMemory {
  kReused,     // one reused buffer per thread (the discard engine keeps nothing either)
  kMemfd,      // fresh shared memfd memory, as the host engine's destinations (MemfdRegion)
  kAnonymous,  // fresh private anonymous memory: cheaper pages than the engine may use
};

// Reads every pages file of the image into memory once per session, each session's copy by
// `threads_per_session` threads (8 MiB blocks dealt round-robin), into `memory`. One thread per
// session is the socket path's shape (one connection); by reference a session reads on its file
// readers, so its ceiling gets as many threads. Into memfd memory with `populate_ahead` > 0,
// each session also gets the engine's populate-ahead thread, fed by its readers as the engine's
// is fed by the session: the same helper on both sides of the ratio.
Result<nlohmann::json> MeasureCeiling(const std::vector<fs::path>& files, uint64_t total,
                                      uint32_t sessions, uint32_t threads_per_session,
                                      CeilingMemory memory_kind, uint64_t populate_ahead,
                                      int populate_nice) {
  const bool into_fresh_memory = memory_kind != CeilingMemory::kReused;
  constexpr uint64_t kBlock = 8u << 20;
  // The blocks of the concatenated pages files (past each file's 8-byte CRIU header, like the
  // served bytes), with their offset in the session's copy.
  struct Block {
    size_t file;
    uint64_t offset;
    uint64_t length;
    uint64_t at;
  };
  std::vector<Block> blocks;
  std::vector<UniqueFd> fds;
  uint64_t at = 0;
  for (const fs::path& file : files) {
    GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(file));
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) return ErrnoError(errno, "stat {}", file.string());
    const uint64_t end = std::min<uint64_t>(static_cast<uint64_t>(st.st_size), 8 + total - at);
    for (uint64_t offset = 8; offset < end; offset += kBlock) {
      const uint64_t length = std::min(kBlock, end - offset);
      blocks.push_back({fds.size(), offset, length, at});
      at += length;
    }
    fds.push_back(std::move(fd));
  }
  const uint64_t per_session = at;
  std::vector<void*> copies(sessions, nullptr);
  std::vector<client::MemfdRegion> memfds;
  std::vector<std::unique_ptr<client::PopulateAhead>> populaters;
  const size_t copy_length = into_fresh_memory ? std::max<uint64_t>(per_session, 1) : kBlock;
  const uint32_t threads = sessions * threads_per_session;
  std::vector<Status> statuses(threads);
  const CpuMeter cpu;
  auto start = Clock::now();
  std::vector<std::thread> workers;
  for (uint32_t s = 0; s < sessions; ++s) {
    if (memory_kind == CeilingMemory::kMemfd) {
      // Created inside the timed part, as the pipeline's engine creates its destinations.
      GPULAZY_ASSIGN_OR_RETURN(client::MemfdRegion region,
                               client::MemfdRegion::Create("ceiling", copy_length));
      copies[s] = region.bytes().data();
      populaters.push_back(std::make_unique<client::PopulateAhead>(populate_ahead, populate_nice));
      populaters.back()->AddRegion(0, region.bytes());
      memfds.push_back(std::move(region));
      continue;
    }
    void* memory =
        mmap(nullptr, copy_length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (memory == MAP_FAILED) return ErrnoError(errno, "mmap {} bytes", copy_length);
    copies[s] = memory;
  }
  for (uint32_t t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      const uint32_t session = t / threads_per_session;
      std::vector<uint8_t> scratch(into_fresh_memory ? 0 : kBlock);
      for (size_t b = t % threads_per_session; b < blocks.size(); b += threads_per_session) {
        const Block& block = blocks[b];
        uint8_t* target =
            into_fresh_memory ? static_cast<uint8_t*>(copies[session]) + block.at : scratch.data();
        if (!populaters.empty()) populaters[session]->WritingAt(0, block.at, block.length);
        Status read = ReadExactAt(fds[block.file].get(), block.offset,
                                  {target, static_cast<size_t>(block.length)}, files[block.file]);
        if (!read.ok()) {
          statuses[t] = read;
          return;
        }
      }
    });
  }
  for (std::thread& worker : workers)
    worker.join();
  const double seconds = SecondsSince(start);
  const nlohmann::json cpu_used = cpu.Read();
  populaters.clear();  // before the memory they populate goes
  if (memory_kind != CeilingMemory::kMemfd)
    for (void* memory : copies)
      munmap(memory, copy_length);
  memfds.clear();
  for (const Status& s : statuses)
    GPULAZY_RETURN_IF_ERROR(s);
  const uint64_t bytes = per_session * sessions;
  nlohmann::json result{{"seconds", seconds},
                        {"bytes", bytes},
                        {"threads_per_session", threads_per_session},
                        {"throughput_Bps", static_cast<double>(bytes) / seconds}};
  result.update(cpu_used);
  return result;
}

// Compares every BO a host engine holds with the source pages files.
Status VerifyAgainstSource(const fs::path& image_dir, const client::RestoreSession& session,
                           const client::HostCopyEngine& engine) {
  GPULAZY_ASSIGN_OR_RETURN(image::CriuCheckpoint checkpoint,
                           image::CriuCheckpoint::Open(image_dir));
  std::map<std::pair<uint32_t, uint32_t>, const image::ContentBo*> by_key;
  for (const image::ContentBo& bo : checkpoint.content_bos())
    by_key[{bo.process_id, bo.bo_index}] = &bo;
  std::vector<uint8_t> expected;
  for (uint32_t i = 0; i < session.bos().size(); ++i) {
    const client::BoEntry& entry = session.bos()[i];
    auto found = by_key.find({entry.process_id, entry.bo_index});
    if (found == by_key.end()) return Corrupt("BO {} is not in the source checkpoint", i);
    const image::ContentBo& source = *found->second;
    GPULAZY_ASSIGN_OR_RETURN(std::span<uint8_t> restored, engine.Mapping(i));
    if (restored.size() != source.size) return Corrupt("BO {} has the wrong size", i);
    GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(image_dir / source.pages_file));
    expected.resize(source.size);
    GPULAZY_RETURN_IF_ERROR(
        ReadExactAt(fd.get(), 8 + source.pages_offset, expected, image_dir / source.pages_file));
    if (std::memcmp(expected.data(), restored.data(), source.size) != 0)
      return Corrupt("BO {} differs from the source after restore", i);
  }
  return Status::Ok();
}

Result<nlohmann::json> MeasurePipeline(const fs::path& image_dir, const std::string& endpoint,
                                       bool read_files, uint32_t sessions,
                                       const StreamOptions& options, pid_t server_pid) {
  std::vector<std::unique_ptr<client::CopyEngine>> engines;
  std::vector<std::unique_ptr<client::RestoreSession>> clients;
  for (uint32_t s = 0; s < sessions; ++s) {
    if (options.engine == "host")
      engines.push_back(std::make_unique<client::HostCopyEngine>(client::HostEngineOptions{
          .populate_ahead_bytes = options.populate_ahead,
          .populate_nice = options.populate_nice,
          .write_fresh_pages = options.write_fresh_pages,
          .fresh_pages_with_several_writers = options.fresh_pages_with_several_writers}));
    else
      engines.push_back(std::make_unique<DiscardEngine>());
    client::SessionOptions session;
    session.endpoint = endpoint;
    session.insecure_tcp = true;  // the harness's loopback server runs --insecure-tcp
    session.image = image_dir.filename().string();
    session.window_bytes = options.window;
    session.window_per_connection_bytes = options.window_per_connection;
    session.client_name = fmt::format("bench-{}", s);
    session.read_files = read_files;
    session.file_readers = options.file_readers;
    session.lanes = options.lanes;
    session.batch_tcp_wakeups = options.batch_tcp_wakeups;
    clients.push_back(std::make_unique<client::RestoreSession>(session, *engines.back()));
  }
  const CpuMeter cpu(server_pid);
  auto start = Clock::now();
  for (auto& c : clients)
    GPULAZY_RETURN_IF_ERROR(c->Start());
  uint64_t bytes = 0;
  double wait_s = 0;
  double chunk_s = 0;
  double file_read_s = 0;
  double file_engine_s = 0;
  double file_gate_wait_s = 0;
  uint64_t lanes_joined = 0;
  for (auto& c : clients) {
    GPULAZY_RETURN_IF_ERROR(c->WaitComplete(std::chrono::minutes(10)));
    const client::Progress progress = c->progress();
    bytes += progress.total_bytes;
    wait_s += progress.stream_wait_s;
    chunk_s += progress.stream_chunk_s;
    file_read_s += progress.file_read_s;
    file_engine_s += progress.file_engine_s;
    file_gate_wait_s += progress.file_gate_wait_s;
    lanes_joined += progress.lanes;
  }
  double seconds = SecondsSince(start);
  const nlohmann::json cpu_used = cpu.Read();
  bool verified = false;
  if (options.engine == "host") {
    GPULAZY_RETURN_IF_ERROR(VerifyAgainstSource(
        image_dir, *clients[0], static_cast<const client::HostCopyEngine&>(*engines[0])));
    verified = true;
  }
  // Per session, against the run's wall time.
  const double file_idle_s = ReadersIdleSeconds(read_files ? options.file_readers : 0, seconds,
                                                (file_read_s + file_engine_s) / sessions);
  nlohmann::json result{{"seconds", seconds},
                        {"bytes", bytes},
                        {"throughput_Bps", static_cast<double>(bytes) / seconds},
                        {"stream_wait_s", wait_s / sessions},
                        {"stream_chunk_s", chunk_s / sessions},
                        {"file_read_s", file_read_s / sessions},
                        {"file_engine_s", file_engine_s / sessions},
                        {"file_gate_wait_s", file_gate_wait_s / sessions},
                        {"file_idle_s", file_idle_s},
                        {"lanes_joined", lanes_joined / sessions},  // per session
                        {"verified", verified}};
  result.update(cpu_used);
  return result;
}

}  // namespace

Status RunStreamBench(const CommonOptions& common, const StreamOptions& options) {
  GPULAZY_ASSIGN_OR_RETURN(WorkDir work, WorkDir::Create(common.work_dir));
  const fs::path root = work.path() / "images";
  fs::create_directories(root);
  GPULAZY_ASSIGN_OR_RETURN(fs::path image_dir, MakeWarmImage(root, "ckpt", options.size, 2, 7));
  GPULAZY_ASSIGN_OR_RETURN(std::vector<fs::path> files, PagesFiles(image_dir));
  GPULAZY_ASSIGN_OR_RETURN(ServerChild server,
                           StartServer(common.bin_dir, root, work.path(), common.server_args));

  // Untimed: one restore of the image first, so every case meets a server that has served it
  // before (its CRIU checksums computed and cached, as for a converted lazy image from the
  // start) instead of only the first case paying for the hashing.
  {
    StreamOptions warm = options;
    warm.engine = "discard";
    GPULAZY_RETURN_IF_ERROR(RunInChild([&] {
                              return MeasurePipeline(image_dir, server.unix_endpoint(), false, 1,
                                                     warm, server.pid());
                            }).status());
  }
  for (const std::string& transport : options.transports) {
    // unix: every byte through the socket; unix-files: the client reads the image files the
    // server passes (chunks by reference, docs/protocol.md "Image files").
    if (transport != "unix" && transport != "unix-files" && transport != "tcp")
      return InvalidArgument("--transport {}: use unix, unix-files or tcp", transport);
    const bool read_files = transport == "unix-files";
    const std::string& endpoint =
        transport == "tcp" ? server.tcp_endpoint() : server.unix_endpoint();
    for (uint32_t sessions : options.sessions) {
      // Like for like: by reference a session reads on its file readers, through the socket on
      // one thread per bulk connection (lanes), and its ceiling reads with as many.
      const uint32_t lanes = read_files ? 0 : client::LanesFor(options.lanes);
      const uint32_t ceiling_threads = read_files ? options.file_readers : lanes;
      // Like for like in memory too: the host engine's destinations are memfds, whose fresh
      // pages cost more than anonymous ones; the anonymous ceiling is reported beside it.
      const bool host = options.engine == "host";
      // A session reading files writes with several readers, and the host engine then stops
      // its populate helper (CopyEngine::ExpectWriters): so does the ceiling.
      const uint64_t populate_ahead = host && !read_files ? options.populate_ahead : 0;
      GPULAZY_ASSIGN_OR_RETURN(nlohmann::json ceiling, RunInChild([&] {
                                 return MeasureCeiling(
                                     files, options.size, sessions, ceiling_threads,
                                     host ? CeilingMemory::kMemfd : CeilingMemory::kReused,
                                     populate_ahead, options.populate_nice);
                               }));
      std::optional<double> anonymous_Bps;
      if (host) {
        GPULAZY_ASSIGN_OR_RETURN(nlohmann::json anonymous, RunInChild([&] {
                                   return MeasureCeiling(files, options.size, sessions,
                                                         ceiling_threads, CeilingMemory::kAnonymous,
                                                         0, 0);
                                 }));
        anonymous_Bps = anonymous["throughput_Bps"].get<double>();
      }
      GPULAZY_ASSIGN_OR_RETURN(nlohmann::json pipeline, RunInChild([&] {
                                 return MeasurePipeline(image_dir, endpoint, read_files, sessions,
                                                        options, server.pid());
                               }));
      const double throughput = pipeline["throughput_Bps"].get<double>();
      const double ceiling_Bps = ceiling["throughput_Bps"].get<double>();
      const std::string fresh_pages =
          FreshPagesName(options.write_fresh_pages, options.fresh_pages_with_several_writers);
      nlohmann::json result = {{"bench", "stream"},
                               {"server_args", common.server_args},
                               {"transport", transport},
                               {"sessions", sessions},
                               {"engine", options.engine},
                               {"size_bytes", options.size},
                               {"window_bytes", options.window},
                               {"window_per_connection_bytes", options.window_per_connection},
                               {"seconds", pipeline["seconds"]},
                               {"throughput_Bps", throughput},
                               {"ceiling_Bps", ceiling_Bps},
                               {"ceiling_threads_per_session", ceiling_threads},
                               {"lanes", lanes},
                               {"lanes_joined", pipeline["lanes_joined"]},
                               {"ratio", throughput / ceiling_Bps},
                               {"ceiling_memory", host ? "memfd" : "reused"},
                               {"populate_ahead_bytes", populate_ahead},
                               {"populate_nice", options.populate_nice},
                               {"fresh_pages", fresh_pages},
                               {"batch_wakeups", options.batch_tcp_wakeups},
                               {"client_voluntary_switches", pipeline["client_voluntary_switches"]},
                               {"peak_rss_bytes", pipeline["peak_rss_bytes"]},
                               // Per session, averaged: the stream reader waiting for the next
                               // frame vs inside chunk frames (client::Progress).
                               {"stream_wait_s", pipeline["stream_wait_s"]},
                               {"stream_chunk_s", pipeline["stream_chunk_s"]},
                               // Per session, averaged, summed over its file readers (by
                               // reference; 0 otherwise): reading and verifying chunks, and
                               // engine calls with their waits, the gate's among them
                               // (client::Progress).
                               {"file_read_s", pipeline["file_read_s"]},
                               {"file_engine_s", pipeline["file_engine_s"]},
                               {"file_gate_wait_s", pipeline["file_gate_wait_s"]},
                               {"file_idle_s", pipeline["file_idle_s"]},
                               // Where the CPU went (harness.h CpuMeter): a pipeline short of its
                               // ceiling with the machine busy has no CPU left; one with idle
                               // CPUs waits on something.
                               {"cpu_busy", pipeline.value("cpu_busy", -1.0)},
                               {"cpu_steal", pipeline.value("cpu_steal", -1.0)},
                               {"client_cpu_s", pipeline["client_cpu_s"]},
                               {"server_cpu_s", pipeline.value("server_cpu_s", -1.0)},
                               {"ceiling_cpu_busy", ceiling.value("cpu_busy", -1.0)},
                               {"ceiling_cpu_s", ceiling["client_cpu_s"]},
                               {"ceiling_peak_rss_bytes", ceiling["peak_rss_bytes"]},
                               {"verified", pipeline["verified"]},
                               {"machine", MachineDescription()}};
      if (anonymous_Bps) {
        result["ceiling_anonymous_Bps"] = *anonymous_Bps;
        result["ratio_anonymous"] = throughput / *anonymous_Bps;
      }
      Emit(common, result,
           {"bench", "transport", "sessions", "engine", "throughput_Bps", "ceiling_Bps", "ratio",
            "peak_rss_bytes", "verified"});
    }
  }
  return Status::Ok();
}

}  // namespace gpulazy::bench
