#include "bench/stream_bench.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <memory>
#include <thread>

#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/io.h"
#include "page-client/host_engine.h"
#include "page-client/restore_session.h"

namespace gpulazy::bench {
namespace fs = std::filesystem;

namespace {

// Reads every pages file of the image into memory, as each of `readers` threads: into a fresh
// mapping of the image's size when `into_fresh_memory` (what the host engine must do too), else
// into one reused buffer.
Result<nlohmann::json> MeasureCeiling(const std::vector<fs::path>& files, uint64_t total,
                                      uint32_t readers, bool into_fresh_memory) {
  std::vector<Status> statuses(readers);
  auto start = Clock::now();
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < readers; ++r) {
    threads.emplace_back([&, r] {
      void* memory = nullptr;
      const size_t length = into_fresh_memory ? total : (8u << 20);
      memory = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (memory == MAP_FAILED) {
        statuses[r] = ErrnoError(errno, "mmap {} bytes", length);
        return;
      }
      auto* dest = static_cast<uint8_t*>(memory);
      uint64_t at = 0;
      for (const fs::path& file : files) {
        Result<UniqueFd> fd = OpenForRead(file);
        if (!fd.ok()) {
          statuses[r] = fd.status();
          break;
        }
        uint64_t offset = 8;  // past the CRIU header, like the served bytes
        while (true) {
          size_t want = 8u << 20;
          uint8_t* target = into_fresh_memory ? dest + at : dest;
          if (into_fresh_memory) want = std::min<uint64_t>(want, total - at);
          if (want == 0) break;
          ssize_t n = pread(fd->get(), target, want, static_cast<off_t>(offset));
          if (n < 0) {
            statuses[r] = ErrnoError(errno, "reading {}", file.string());
            break;
          }
          if (n == 0) break;
          offset += static_cast<uint64_t>(n);
          at += static_cast<uint64_t>(n);
        }
      }
      munmap(memory, length);
    });
  }
  for (std::thread& t : threads)
    t.join();
  double seconds = SecondsSince(start);
  for (const Status& s : statuses)
    GPULAZY_RETURN_IF_ERROR(s);
  return nlohmann::json{{"seconds", seconds},
                        {"bytes", total * readers},
                        {"throughput_Bps", static_cast<double>(total * readers) / seconds}};
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
                                       const StreamOptions& options) {
  std::vector<std::unique_ptr<client::CopyEngine>> engines;
  std::vector<std::unique_ptr<client::RestoreSession>> clients;
  for (uint32_t s = 0; s < sessions; ++s) {
    if (options.engine == "host")
      engines.push_back(std::make_unique<client::HostCopyEngine>());
    else
      engines.push_back(std::make_unique<DiscardEngine>());
    client::SessionOptions session;
    session.endpoint = endpoint;
    session.insecure_tcp = true;  // the harness's loopback server runs --insecure-tcp
    session.image = image_dir.filename().string();
    session.window_bytes = options.window;
    session.client_name = fmt::format("bench-{}", s);
    session.read_files = read_files;
    clients.push_back(std::make_unique<client::RestoreSession>(session, *engines.back()));
  }
  auto start = Clock::now();
  for (auto& c : clients)
    GPULAZY_RETURN_IF_ERROR(c->Start());
  uint64_t bytes = 0;
  for (auto& c : clients) {
    GPULAZY_RETURN_IF_ERROR(c->WaitComplete(std::chrono::minutes(10)));
    bytes += c->progress().total_bytes;
  }
  double seconds = SecondsSince(start);
  bool verified = false;
  if (options.engine == "host") {
    GPULAZY_RETURN_IF_ERROR(VerifyAgainstSource(
        image_dir, *clients[0], static_cast<const client::HostCopyEngine&>(*engines[0])));
    verified = true;
  }
  return nlohmann::json{{"seconds", seconds},
                        {"bytes", bytes},
                        {"throughput_Bps", static_cast<double>(bytes) / seconds},
                        {"verified", verified}};
}

}  // namespace

Status RunStreamBench(const CommonOptions& common, const StreamOptions& options) {
  GPULAZY_ASSIGN_OR_RETURN(WorkDir work, WorkDir::Create(common.work_dir));
  const fs::path root = work.path() / "images";
  fs::create_directories(root);
  GPULAZY_ASSIGN_OR_RETURN(fs::path image_dir, MakeWarmImage(root, "ckpt", options.size, 2, 7));
  GPULAZY_ASSIGN_OR_RETURN(std::vector<fs::path> files, PagesFiles(image_dir));
  GPULAZY_ASSIGN_OR_RETURN(ServerChild server, ServerChild::Start(common.bin_dir, root, work.path(),
                                                                  common.server_args));

  for (const std::string& transport : options.transports) {
    // unix: every byte through the socket; unix-files: the client reads the image files the
    // server passes (chunks by reference, docs/protocol.md "Image files").
    if (transport != "unix" && transport != "unix-files" && transport != "tcp")
      return InvalidArgument("--transport {}: use unix, unix-files or tcp", transport);
    const bool read_files = transport == "unix-files";
    const std::string& endpoint =
        transport == "tcp" ? server.tcp_endpoint() : server.unix_endpoint();
    for (uint32_t sessions : options.sessions) {
      GPULAZY_ASSIGN_OR_RETURN(nlohmann::json ceiling, RunInChild([&] {
                                 return MeasureCeiling(files, options.size, sessions,
                                                       options.engine == "host");
                               }));
      GPULAZY_ASSIGN_OR_RETURN(nlohmann::json pipeline, RunInChild([&] {
                                 return MeasurePipeline(image_dir, endpoint, read_files, sessions,
                                                        options);
                               }));
      const double throughput = pipeline["throughput_Bps"].get<double>();
      const double ceiling_Bps = ceiling["throughput_Bps"].get<double>();
      nlohmann::json result = {{"bench", "stream"},
                               {"server_args", common.server_args},
                               {"transport", transport},
                               {"sessions", sessions},
                               {"engine", options.engine},
                               {"size_bytes", options.size},
                               {"window_bytes", options.window},
                               {"seconds", pipeline["seconds"]},
                               {"throughput_Bps", throughput},
                               {"ceiling_Bps", ceiling_Bps},
                               {"ratio", throughput / ceiling_Bps},
                               {"peak_rss_bytes", pipeline["peak_rss_bytes"]},
                               {"ceiling_peak_rss_bytes", ceiling["peak_rss_bytes"]},
                               {"verified", pipeline["verified"]},
                               {"machine", MachineDescription()}};
      Emit(common, result,
           {"bench", "transport", "sessions", "engine", "throughput_Bps", "ceiling_Bps", "ratio",
            "peak_rss_bytes", "verified"});
    }
  }
  return Status::Ok();
}

}  // namespace gpulazy::bench
