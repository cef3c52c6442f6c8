// gpulazy-cuda-bench: streaming into NVIDIA device memory (issue 6), each case beside the
// pinned cudaMemcpy host-to-device rate measured in the same run:
//   ceiling   pinned host buffer -> device, cudaMemcpy, the copy engine's upper bound
//   pipeline  gpulazy-server -> RestoreSession -> CudaCopyEngine, from the page cache, verified
//             byte for byte against the pages files afterwards
//   local     LocalRestore -> CudaCopyEngine: reader threads pread the pages files straight
//             into pinned staging slots (no server, no socket), verified the same way
//   upstream  CRIU amdgpu-style loop: one staging buffer; read a chunk from the pages file,
//             copy it, wait, read the next (no server)
// and, with --experiment place, the page server's route of session 38 as gpulazy code: a
// DevicePlacer registers the pages files once and places every chunk, checked on the GPU, into
// device memory another process exported (gpulazy-ipc-exporter), with no CPU copy; not yet
// reachable through gpulazy-server's protocol;
// and, with --experiment layers, a restored "model" whose layers are BOs in device memory:
// time to the first layer's kernel result and to full residency, eager / parallel / lazy, through
// the server (over its Unix socket, reading the image files it passes: `server`; over TCP, every
// byte on the socket as for a remote server: `tcp`) and locally, beside the upstream-style loop.
#include <cuda_runtime.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstring>
#include <iostream>
#include <map>
#include <thread>

#include "bench/cuda_layers.h"
#include "bench/harness.h"
#include "lazy-server/gpu/device_placer.h"
#include "lazy-server/gpu/ipc_exporter.h"
#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/image_source.h"
#include "lazy-server/image/io.h"
#include "lazy-server/image/lazy_image.h"
#include "lazy-server/image/synth.h"
#include "lazy-server/server/config.h"
#include "lazy-server/server/warm.h"
#include "page-client/cuda/cuda_engine.h"
#include "page-client/local_restore.h"
#include "page-client/restore_session.h"
#include "page-client/server_connection.h"
#include "proto/checksum.h"
#include "proto/size.h"

namespace gpulazy::bench {
namespace {
namespace fs = std::filesystem;

Status Check(cudaError_t e, std::string_view what) {
  if (e == cudaSuccess) return Status::Ok();
  return Unavailable("{}: {}", what, cudaGetErrorString(e));
}

nlohmann::json DeviceDescription() {
  nlohmann::json device;
  cudaDeviceProp props{};
  if (cudaGetDeviceProperties(&props, 0) == cudaSuccess) device["gpu"] = props.name;
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  device["cuda_driver_api"] = driver;
  device["cuda_runtime"] = runtime;
  return device;
}

// Pinned host -> device with cudaMemcpy, `bytes` in total through a 64 MiB buffer.
Result<double> MeasurePinnedCeiling(uint64_t bytes) {
  const size_t buffer_bytes = 64u << 20;
  void* host = nullptr;
  void* device = nullptr;
  GPULAZY_RETURN_IF_ERROR(Check(cudaMallocHost(&host, buffer_bytes), "cudaMallocHost"));
  GPULAZY_RETURN_IF_ERROR(Check(cudaMalloc(&device, buffer_bytes), "cudaMalloc"));
  std::memset(host, 0x5a, buffer_bytes);
  GPULAZY_RETURN_IF_ERROR(
      Check(cudaMemcpy(device, host, buffer_bytes, cudaMemcpyHostToDevice), "warm-up copy"));
  auto start = Clock::now();
  uint64_t done = 0;
  while (done < bytes) {
    size_t n = static_cast<size_t>(std::min<uint64_t>(buffer_bytes, bytes - done));
    GPULAZY_RETURN_IF_ERROR(
        Check(cudaMemcpy(device, host, n, cudaMemcpyHostToDevice), "ceiling copy"));
    done += n;
  }
  double seconds = SecondsSince(start);
  cudaFree(device);
  cudaFreeHost(host);
  return static_cast<double>(bytes) / seconds;
}

// Upstream-style: one staging buffer, read a chunk, copy it synchronously, repeat.
Result<double> MeasureUpstreamLoop(const fs::path& image_dir, uint32_t chunk_bytes) {
  GPULAZY_ASSIGN_OR_RETURN(image::CriuCheckpoint checkpoint,
                           image::CriuCheckpoint::Open(image_dir));
  void* staging = nullptr;
  GPULAZY_RETURN_IF_ERROR(Check(cudaMallocHost(&staging, chunk_bytes), "cudaMallocHost"));
  std::vector<void*> buffers;
  uint64_t total = 0;
  auto start = Clock::now();
  for (const image::ContentBo& bo : checkpoint.content_bos()) {
    void* device = nullptr;
    GPULAZY_RETURN_IF_ERROR(
        Check(cudaMalloc(&device, std::max<uint64_t>(bo.size, 1)), "cudaMalloc"));
    buffers.push_back(device);
    GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(image_dir / bo.pages_file));
    for (uint64_t at = 0; at < bo.size; at += chunk_bytes) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(chunk_bytes, bo.size - at));
      GPULAZY_RETURN_IF_ERROR(ReadExactAt(fd.get(), 8 + bo.pages_offset + at,
                                          {static_cast<uint8_t*>(staging), n},
                                          image_dir / bo.pages_file));
      GPULAZY_RETURN_IF_ERROR(
          Check(cudaMemcpy(static_cast<uint8_t*>(device) + at, staging, n, cudaMemcpyHostToDevice),
                "upstream copy"));
    }
    total += bo.size;
  }
  double seconds = SecondsSince(start);
  for (void* b : buffers)
    cudaFree(b);
  cudaFreeHost(staging);
  return static_cast<double>(total) / seconds;
}

struct PipelineResult {
  double throughput_Bps = 0;
  double seconds = 0;
  double setup_s = 0;  // of `seconds`: until Start returned (connect, open, device allocations)
  bool verified = false;
  uint32_t slot_bytes = 0;  // the staging slots the engine used
  uint32_t staging_slots = 0;
  uint64_t chunks_verified_on_device = 0;
  // Installed by reference with no checksum (a CRIU checkpoint's chunks the server has not read
  // yet): what "verified by the client" does not cover.
  uint64_t unchecked_chunks = 0;
  // Named numbers reported as they are (medians over the runs): the CpuMeter over the timed
  // part (cpu_busy, client_cpu_s, server_cpu_s, and each by thread name), the file readers' time
  // (AddReaderReadings) and the engine's staging-ring stats (AddEngineReadings).
  std::map<std::string, double> readings;
};

// The file readers' time split (Progress::file_read_s, file_engine_s with its file_gate_wait_s),
// summed over readers, and what is left of their wall time (`readers` x the restore's `seconds`; 0
// readers: none ran): their time between chunks, waiting for the next or for a CPU, the session's
// setup included.
void AddReaderReadings(const client::Progress& progress, uint32_t readers, double seconds,
                       std::map<std::string, double>& into) {
  into["file_read_s"] = progress.file_read_s;
  into["file_engine_s"] = progress.file_engine_s;
  into["file_gate_wait_s"] = progress.file_gate_wait_s;
  into["file_idle_s"] =
      ReadersIdleSeconds(readers, seconds, progress.file_read_s + progress.file_engine_s);
}

// The engine's CudaEngineStats as JSON fields: readers waiting for slots (DMA behind) against the
// copy queue standing empty (readers behind), over the whole restore.
void AddEngineReadings(const client::CudaCopyEngine& engine, std::map<std::string, double>& into) {
  const client::CudaEngineStats stats = engine.stats();
  into["slot_waits"] = static_cast<double>(stats.slot_waits);
  into["slot_wait_s"] = stats.slot_wait_s;
  into["copy_queue_empty_s"] = stats.copy_queue_empty_s;
}

// The chunk size the benchmark's server cuts its raw images into, as the server's own command
// line makes it from the --server-arg options (its default depends on --placement).
Result<uint32_t> ServedChunkBytes(const std::vector<std::string>& server_args) {
  std::vector<std::string> args = {"gpulazy-server", "--images", "/", "--listen", "unix:/unused"};
  args.insert(args.end(), server_args.begin(), server_args.end());
  std::vector<char*> argv;
  argv.reserve(args.size());
  for (std::string& arg : args)
    argv.push_back(arg.data());
  const server::ParsedCommandLine parsed =
      server::ParseCommandLine(static_cast<int>(argv.size()), argv.data());
  if (!parsed.config)
    return InvalidArgument("the --server-arg options are not the server's (said above)");
  return parsed.config->raw_chunk_size;
}

// Converts the stream's checkpoint into a lazy image beside it, every chunk stored as it is
// (no LZ4, no sharing): each carries a checksum and none needs decoding, so every one can be
// placed and checked on the GPU. Reads the chunk file once, so the run starts from page cache.
Status ConvertForStream(const fs::path& image_dir, uint32_t chunk_bytes) {
  GPULAZY_ASSIGN_OR_RETURN(image::CriuCheckpoint checkpoint,
                           image::CriuCheckpoint::Open(image_dir));
  image::ConvertOptions options;
  options.chunk_size = chunk_bytes;
  options.compress = false;
  options.deduplicate = false;
  GPULAZY_RETURN_IF_ERROR(image::ConvertToLazyImage(checkpoint, options).status());
  GPULAZY_ASSIGN_OR_RETURN(std::shared_ptr<const image::ImageSource> source,
                           image::ImageSource::Open(image_dir));
  for (const image::ImageSource::StoredFile& file : source->files())
    GPULAZY_RETURN_IF_ERROR(server::ReadIntoPageCache(file.fd.get(), file.size, [] {
                              return true;
                            }).Context(file.name));
  return Status::Ok();
}

// Byte-for-byte check of every BO in device memory against the checkpoint's pages files.
Status VerifyDevice(const fs::path& image_dir, const std::vector<client::BoEntry>& bos,
                    const client::CudaCopyEngine& engine) {
  GPULAZY_ASSIGN_OR_RETURN(image::CriuCheckpoint checkpoint,
                           image::CriuCheckpoint::Open(image_dir));
  std::map<std::pair<uint32_t, uint32_t>, const image::ContentBo*> by_key;
  for (const image::ContentBo& bo : checkpoint.content_bos())
    by_key[{bo.process_id, bo.bo_index}] = &bo;
  std::vector<uint8_t> expected, actual;
  for (uint32_t i = 0; i < bos.size(); ++i) {
    auto found = by_key.find({bos[i].process_id, bos[i].bo_index});
    if (found == by_key.end()) return Corrupt("BO {} missing from the source", i);
    const image::ContentBo& source = *found->second;
    expected.resize(source.size);
    actual.resize(source.size);
    GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(image_dir / source.pages_file));
    GPULAZY_RETURN_IF_ERROR(
        ReadExactAt(fd.get(), 8 + source.pages_offset, expected, image_dir / source.pages_file));
    GPULAZY_RETURN_IF_ERROR(engine.CopyToHost(i, 0, actual));
    if (std::memcmp(expected.data(), actual.data(), source.size) != 0)
      return Corrupt("BO {} in device memory differs from the source", i);
  }
  return Status::Ok();
}

std::map<std::string, double> CpuReadings(const CpuMeter& meter) {
  const nlohmann::json read = meter.Read(/*by_thread=*/true);  // held: items() refers into it
  std::map<std::string, double> readings;
  for (const auto& [field, value] : read.items())
    readings[field] = value.get<double>();
  return readings;
}

// The server's placement counters (its stats' server.placement; docs/server.md, "Stats"), or
// none when it places nothing or does not answer: the readings are diagnostics, not the result.
std::map<std::string, double> ServerPlacementCounters(const std::string& endpoint_text) {
  std::map<std::string, double> counters;
  Result<net::Endpoint> endpoint = net::Endpoint::Parse(endpoint_text);
  Result<net::ClientTransport> transport =
      net::ClientTransport::Make({}, /*allow_insecure_tcp=*/true);
  if (!endpoint.ok() || !transport.ok()) return counters;
  Result<std::string> text = client::FetchServerStats(*endpoint, *transport, "", "bench-stats");
  if (!text.ok()) return counters;
  const nlohmann::json stats = nlohmann::json::parse(*text, nullptr, false);
  if (stats.is_discarded() || !stats.contains("server") || !stats["server"].is_object() ||
      !stats["server"].contains("placement") || !stats["server"]["placement"].is_object())
    return counters;
  for (const auto& [field, value] : stats["server"]["placement"].items())
    if (value.is_number()) counters[field] = value.get<double>();
  return counters;
}

// What the server's placer did during one run, from its counters before and after: how long it
// had placements in flight, how many of its slots were busy on average meanwhile, how long
// callers waited for a slot and its callbacks took, and how long opening the destinations took
// (seconds). A counter missing from a CUDA placer's stats is an error, not a silent 0.
Status AddPlacerReadings(const std::map<std::string, double>& before,
                         const std::map<std::string, double>& after,
                         std::map<std::string, double>& into) {
  if (!after.contains("active_ns")) return Status::Ok();  // not a CUDA placer: nothing to read
  std::vector<std::string> missing;
  auto delta = [&](const char* field) {
    auto a = after.find(field);
    auto b = before.find(field);
    if (a == after.end()) {
      missing.emplace_back(field);
      return 0.0;
    }
    return a->second - (b == before.end() ? 0.0 : b->second);
  };
  const double active_s = delta("active_ns") / 1e9;
  into["placer_active_s"] = active_s;
  into["placer_slots_busy_mean"] = active_s > 0 ? delta("slot_busy_ns") / 1e9 / active_s : 0;
  into["placer_slot_wait_s"] = delta("slot_wait_ns") / 1e9;
  into["placer_done_s"] = delta("done_ns") / 1e9;
  // Chunks the server's placer checked against their checksum (on the GPU) before installing
  // them: in a placed run the client's engine checks none itself (chunks_verified_on_device 0).
  into["placer_verified_chunks"] = delta("verified_chunks");
  into["placer_registrations"] = delta("registrations");
  into["placer_budget_refusals"] = delta("budget_refusals");
  into["placer_opens"] = delta("opens");
  into["placer_open_s"] = delta("open_ns") / 1e9;
  into["placer_deferred_chunks"] = delta("placements_deferred");
  into["placer_open_failures"] = delta("destination_open_failures");
  if (!missing.empty())
    return Internal("the server's placement stats lack {}", fmt::join(missing, ", "));
  return Status::Ok();
}

// read_files: the client reads the image files the server passes, on `readers` threads
// (chunks by reference); otherwise every byte crosses the Unix socket.
Result<PipelineResult> MeasurePipeline(const fs::path& image_dir, const std::string& endpoint,
                                       uint64_t window, uint64_t file_window,
                                       const client::CudaEngineOptions& engine_options,
                                       uint32_t served_chunk_bytes, bool read_files,
                                       uint32_t readers, uint32_t lanes, pid_t server) {
  GPULAZY_ASSIGN_OR_RETURN(std::unique_ptr<client::CudaCopyEngine> engine,
                           client::CudaCopyEngine::Create(engine_options));
  // The staging ring is made outside the timed stream, as with slots of a fixed size (made in
  // Create): this measures streaming; the layers experiment times the ring as resume. Sized as
  // the session would size it: to the file readers it plans.
  engine->ExpectWriters(read_files ? readers : client::LanesFor(lanes));
  GPULAZY_RETURN_IF_ERROR(engine->ExpectChunkBytes(served_chunk_bytes));
  client::SessionOptions options;
  options.endpoint = endpoint;
  options.insecure_tcp = true;  // the harness's loopback server runs --insecure-tcp
  options.image = image_dir.filename().string();
  options.window_bytes = window;
  options.file_window_bytes = file_window;
  options.client_name = "cuda-bench";
  options.read_files = read_files;
  options.file_readers = readers;
  options.lanes = lanes;
  PipelineResult result;
  const std::map<std::string, double> placer_before = ServerPlacementCounters(endpoint);
  {
    client::RestoreSession session(options, *engine);
    const CpuMeter cpu(server);
    auto start = Clock::now();
    GPULAZY_RETURN_IF_ERROR(session.Start());
    result.setup_s = SecondsSince(start);
    GPULAZY_RETURN_IF_ERROR(session.WaitComplete(std::chrono::minutes(10)));
    const auto finished = Clock::now();
    result.seconds = std::chrono::duration<double>(finished - start).count();
    result.readings = CpuReadings(cpu);
    result.throughput_Bps = static_cast<double>(session.progress().total_bytes) / result.seconds;
    result.unchecked_chunks = session.progress().unchecked_chunks;
    // Chunks the server placed itself (gpulazy-server --placement cuda; the client accepts an
    // offer by default): 0 when every byte came through the socket or the files.
    result.readings["placed_chunks"] = static_cast<double>(session.progress().placed_chunks);
    // Zero chunks the engine zeroed on the GPU (a lazy image's CODEC_ZERO chunks): their bytes
    // never crossed the bus, so the bytes that did are timed apart (data_ratio).
    const uint64_t zero_bytes = session.progress().zero_filled_bytes;
    result.readings["zero_filled_chunks"] =
        static_cast<double>(session.progress().zero_filled_chunks);
    result.readings["zero_filled_bytes"] = static_cast<double>(zero_bytes);
    result.readings["data_throughput_Bps"] =
        static_cast<double>(session.progress().total_bytes - zero_bytes) / result.seconds;
    // The run in three: until the first chunk was resident (start-up: the handshake, PlaceInto,
    // the first request), from it to the last, and from the last to the end (the tail).
    const client::Progress ends = session.progress();
    if (ends.first_resident_at != Clock::time_point{}) {
      result.readings["first_chunk_s"] =
          std::chrono::duration<double>(ends.first_resident_at - start).count();
      result.readings["chunks_s"] =
          std::chrono::duration<double>(ends.last_resident_at - ends.first_resident_at).count();
      result.readings["tail_s"] =
          std::chrono::duration<double>(finished - ends.last_resident_at).count();
    }
    if (ends.placement_answered_at != Clock::time_point{})
      result.readings["placement_answered_s"] =
          std::chrono::duration<double>(ends.placement_answered_at - start).count();
    if (ends.stream_requested_at != Clock::time_point{})
      result.readings["stream_requested_s"] =
          std::chrono::duration<double>(ends.stream_requested_at - start).count();
    AddReaderReadings(session.progress(), read_files ? readers : 0, result.seconds,
                      result.readings);

    GPULAZY_RETURN_IF_ERROR(
        AddPlacerReadings(placer_before, ServerPlacementCounters(endpoint), result.readings));

    GPULAZY_RETURN_IF_ERROR(VerifyDevice(image_dir, session.bos(), *engine));
    result.verified = true;
  }
  result.slot_bytes = engine->slot_bytes();
  result.staging_slots = engine->staging_slots();
  result.chunks_verified_on_device = engine->chunks_verified_on_device();
  AddEngineReadings(*engine, result.readings);
  return result;
}

// LocalRestore straight into device memory: readers pread into the engine's pinned slots.
Result<PipelineResult> MeasureLocal(const fs::path& image_dir, uint32_t readers,
                                    const client::CudaEngineOptions& engine_options,
                                    uint32_t chunk_bytes) {
  GPULAZY_ASSIGN_OR_RETURN(std::unique_ptr<client::CudaCopyEngine> engine,
                           client::CudaCopyEngine::Create(engine_options));
  engine->ExpectWriters(readers);  // untimed, as above, and sized as LocalRestore would
  GPULAZY_RETURN_IF_ERROR(engine->ExpectChunkBytes(chunk_bytes));
  client::LocalRestoreOptions options;
  options.image_dir = image_dir;
  options.readers = readers;
  options.raw_chunk_size = chunk_bytes;
  PipelineResult result;
  client::LocalRestore restore(options, *engine);
  const CpuMeter cpu;
  auto start = Clock::now();
  GPULAZY_RETURN_IF_ERROR(restore.Start());
  result.setup_s = SecondsSince(start);
  GPULAZY_RETURN_IF_ERROR(restore.WaitComplete(std::chrono::minutes(10)));
  result.seconds = SecondsSince(start);
  result.readings = CpuReadings(cpu);
  result.throughput_Bps = static_cast<double>(restore.progress().total_bytes) / result.seconds;
  AddReaderReadings(restore.progress(), readers, result.seconds, result.readings);
  GPULAZY_RETURN_IF_ERROR(VerifyDevice(image_dir, restore.bos(), *engine));
  result.verified = true;
  result.slot_bytes = engine->slot_bytes();
  result.staging_slots = engine->staging_slots();
  result.chunks_verified_on_device = engine->chunks_verified_on_device();
  AddEngineReadings(*engine, result.readings);
  return result;
}

// ---- The layer workload -------------------------------------------------------------------

struct LayerOptions {
  uint32_t readers = 0;  // 0: the engine's default (CudaCopyEngine::DefaultWriters, one per CPU)
  // staging_slots 0: the engine's default, four per reader; slot_bytes 0: the engine sizes its
  // slots to the image's chunks (2 MiB here), as any restore's does.
  client::CudaEngineOptions engine;
  uint64_t window = 64u << 20;
  uint64_t file_window = client::SessionOptions{}.file_window_bytes;
  uint32_t startup_ms = 20;
  uint32_t lanes = 0;  // bulk connections when the bytes cross the socket (SessionOptions::lanes)
};

// Expected kernel result per layer, keyed by (process, BO index), from the pages files.
Result<std::map<std::pair<uint32_t, uint32_t>, uint64_t>> ExpectedLayerSums(
    const fs::path& image_dir) {
  GPULAZY_ASSIGN_OR_RETURN(image::CriuCheckpoint checkpoint,
                           image::CriuCheckpoint::Open(image_dir));
  std::map<std::pair<uint32_t, uint32_t>, uint64_t> sums;
  std::vector<uint8_t> buffer(64u << 20);
  for (const image::ContentBo& bo : checkpoint.content_bos()) {
    GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(image_dir / bo.pages_file));
    uint64_t sum = 0;
    for (uint64_t at = 0; at < bo.size; at += buffer.size()) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(buffer.size(), bo.size - at));
      GPULAZY_RETURN_IF_ERROR(ReadExactAt(fd.get(), 8 + bo.pages_offset + at, {buffer.data(), n},
                                          image_dir / bo.pages_file));
      sum += HostLayerSum({buffer.data(), n});
    }
    sums[{bo.process_id, bo.bo_index}] = sum;
  }
  return sums;
}

struct LayerTimes {
  // Where the resume goes: the engine made (streams, pinned slots), the layer kernel's scratch,
  // and the restore's Start (connect and open, or open the image; device memory for every BO).
  double engine_s = 0;
  double kernel_s = 0;
  double start_s = 0;
  double resume_s = 0;
  double first_result_s = 0;
  double all_layers_s = 0;
  double full_s = 0;
  bool results_ok = true;
  uint64_t demand_chunks = 0;
  uint64_t bytes = 0;
  uint32_t slot_bytes = 0;  // the staging slots the engine used (0: the upstream loop's own)
  uint32_t staging_slots = 0;
};

// One mode through a restore R (RestoreSession or LocalRestore): the program resumes (at once,
// or after the whole copy), does `startup_ms` of its own start-up, then runs its layers in
// order; in lazy mode each layer is ensured resident just before its kernel launches.
template <typename Restore>
Result<LayerTimes> RunLayerMode(Restore& restore, client::CudaCopyEngine& engine,
                                const std::string& mode, const LayerOptions& options,
                                const std::map<std::pair<uint32_t, uint32_t>, uint64_t>& expected,
                                Clock::time_point start) {
  LayerTimes times;
  times.engine_s = SecondsSince(start);
  GPULAZY_ASSIGN_OR_RETURN(LayerKernel kernel, LayerKernel::Create());
  times.kernel_s = SecondsSince(start) - times.engine_s;
  GPULAZY_RETURN_IF_ERROR(restore.Start());
  times.start_s = SecondsSince(start) - times.engine_s - times.kernel_s;
  times.slot_bytes = engine.slot_bytes();
  times.staging_slots = engine.staging_slots();
  if (mode == "eager") {
    GPULAZY_RETURN_IF_ERROR(restore.WaitComplete(std::chrono::minutes(10)));
    times.full_s = SecondsSince(start);
  }
  times.resume_s = SecondsSince(start);
  std::this_thread::sleep_for(std::chrono::milliseconds(options.startup_ms));
  if (mode == "parallel") {
    GPULAZY_RETURN_IF_ERROR(restore.WaitComplete(std::chrono::minutes(10)));
    times.full_s = SecondsSince(start);
  }
  const std::vector<client::BoEntry>& bos = restore.bos();
  for (uint32_t layer = 0; layer < bos.size(); ++layer) {
    if (mode == "lazy")
      GPULAZY_RETURN_IF_ERROR(
          restore.Ensure(layer, 0, bos[layer].size, std::chrono::milliseconds(600000)));
    GPULAZY_ASSIGN_OR_RETURN(uint64_t sum,
                             kernel.Run(engine.DevicePointer(layer), bos[layer].size));
    if (layer == 0) times.first_result_s = SecondsSince(start);
    auto want = expected.find({bos[layer].process_id, bos[layer].bo_index});
    if (want == expected.end() || want->second != sum) times.results_ok = false;
  }
  times.all_layers_s = SecondsSince(start);
  if (mode == "lazy") {
    GPULAZY_RETURN_IF_ERROR(restore.WaitComplete(std::chrono::minutes(10)));
    times.full_s = SecondsSince(start);
  }
  times.demand_chunks = restore.progress().demand_chunks;
  times.bytes = restore.progress().total_bytes;
  return times;
}

Result<LayerTimes> RunLayerCase(const fs::path& image_dir, const std::string& endpoint,
                                const std::string& path, const std::string& mode,
                                const LayerOptions& options,
                                const std::map<std::pair<uint32_t, uint32_t>, uint64_t>& expected) {
  const auto start = Clock::now();
  GPULAZY_ASSIGN_OR_RETURN(std::unique_ptr<client::CudaCopyEngine> engine,
                           client::CudaCopyEngine::Create(options.engine));
  if (path == "server" || path == "tcp") {
    client::SessionOptions session_options;
    session_options.endpoint = endpoint;
    session_options.image = image_dir.filename().string();
    session_options.window_bytes = options.window;
    session_options.file_window_bytes = options.file_window;
    session_options.client_name = "cuda-bench-layers";
    session_options.insecure_tcp = true;  // the harness's loopback server runs --insecure-tcp
    session_options.file_readers = options.readers;
    session_options.lanes = options.lanes;
    client::RestoreSession session(session_options, *engine);
    return RunLayerMode(session, *engine, mode, options, expected, start);
  }
  client::LocalRestoreOptions local_options;
  local_options.image_dir = image_dir;
  local_options.readers = options.readers;
  client::LocalRestore restore(local_options, *engine);
  return RunLayerMode(restore, *engine, mode, options, expected, start);
}

// The upstream-style baseline for the workload: copy everything with one staging buffer, then
// run the layers.
Result<LayerTimes> RunUpstreamLayers(
    const fs::path& image_dir, const LayerOptions& options,
    const std::map<std::pair<uint32_t, uint32_t>, uint64_t>& expected) {
  const auto start = Clock::now();
  GPULAZY_ASSIGN_OR_RETURN(image::CriuCheckpoint checkpoint,
                           image::CriuCheckpoint::Open(image_dir));
  const uint32_t chunk_bytes = 2u << 20;
  void* staging = nullptr;
  GPULAZY_RETURN_IF_ERROR(Check(cudaMallocHost(&staging, chunk_bytes), "cudaMallocHost"));
  std::vector<std::pair<void*, const image::ContentBo*>> layers;
  LayerTimes times;
  Status status;
  for (const image::ContentBo& bo : checkpoint.content_bos()) {
    void* device = nullptr;
    status = Check(cudaMalloc(&device, std::max<uint64_t>(bo.size, 1)), "cudaMalloc");
    if (!status.ok()) break;
    layers.emplace_back(device, &bo);
    Result<UniqueFd> fd = OpenForRead(image_dir / bo.pages_file);
    if (!fd.ok()) {
      status = fd.status();
      break;
    }
    for (uint64_t at = 0; status.ok() && at < bo.size; at += chunk_bytes) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(chunk_bytes, bo.size - at));
      status = ReadExactAt(fd->get(), 8 + bo.pages_offset + at, {static_cast<uint8_t*>(staging), n},
                           image_dir / bo.pages_file);
      if (status.ok())
        status = Check(
            cudaMemcpy(static_cast<uint8_t*>(device) + at, staging, n, cudaMemcpyHostToDevice),
            "upstream copy");
    }
    times.bytes += bo.size;
    if (!status.ok()) break;
  }
  if (status.ok()) {
    times.full_s = times.resume_s = SecondsSince(start);
    std::this_thread::sleep_for(std::chrono::milliseconds(options.startup_ms));
    Result<LayerKernel> kernel = LayerKernel::Create();
    if (!kernel.ok()) status = kernel.status();
    for (size_t i = 0; status.ok() && i < layers.size(); ++i) {
      Result<uint64_t> sum = kernel->Run(layers[i].first, layers[i].second->size);
      if (!sum.ok()) {
        status = sum.status();
        break;
      }
      if (i == 0) times.first_result_s = SecondsSince(start);
      auto want = expected.find({layers[i].second->process_id, layers[i].second->bo_index});
      if (want == expected.end() || want->second != *sum) times.results_ok = false;
    }
    times.all_layers_s = SecondsSince(start);
  }
  for (auto& layer : layers)
    cudaFree(layer.first);
  cudaFreeHost(staging);
  if (!status.ok()) return status;
  return times;
}

// One pass of the placement case: every chunk of every pages file placed once, checked on the
// GPU against its XXH3 (computed beforehand, as a lazy image's manifest carries them), into one
// destination exported by a second process; then the whole destination read back and compared.
struct PlacementRun {
  double register_s = 0;  // registering the files this pass (0 once the placer has them)
  double place_s = 0;
  uint64_t bytes = 0;
  uint64_t failed = 0;  // placements that did not complete Ok
  bool verified = false;
};

struct PagesFile {
  fs::path path;
  UniqueFd fd;
  uint64_t size = 0;
  // Where it goes in the destination: chunk-aligned, as a BO's chunks are in a BO (the verify
  // kernel installs 16 bytes at a time only into aligned memory).
  uint64_t destination_offset = 0;
  std::vector<uint64_t> checksums;  // per chunk
};

Result<std::vector<PagesFile>> ChecksummedPagesFiles(const fs::path& image_dir, uint32_t chunk) {
  GPULAZY_ASSIGN_OR_RETURN(std::vector<fs::path> paths, PagesFiles(image_dir));
  std::vector<PagesFile> files;
  std::vector<uint8_t> buffer(chunk);
  uint64_t end = 0;
  for (const fs::path& path : paths) {
    PagesFile file;
    file.path = path;
    GPULAZY_ASSIGN_OR_RETURN(file.fd, OpenForRead(path));
    GPULAZY_ASSIGN_OR_RETURN(file.size, FileSize(file.fd.get(), path));
    file.destination_offset = (end + chunk - 1) / chunk * chunk;
    end = file.destination_offset + file.size;
    for (uint64_t at = 0; at < file.size; at += chunk) {
      const size_t length = static_cast<size_t>(std::min<uint64_t>(chunk, file.size - at));
      GPULAZY_RETURN_IF_ERROR(ReadExactAt(file.fd.get(), at, {buffer.data(), length}, path));
      file.checksums.push_back(Checksum64({buffer.data(), length}));
    }
    files.push_back(std::move(file));
  }
  return files;
}

Result<PlacementRun> MeasurePlacement(server::gpu::DevicePlacer& placer,
                                      const std::vector<PagesFile>& files,
                                      const server::gpu::DestinationRef& destination,
                                      uint32_t chunk) {
  PlacementRun run;
  const auto start = std::chrono::steady_clock::now();
  std::vector<server::gpu::SourceRef> sources;
  for (const PagesFile& file : files) {
    GPULAZY_ASSIGN_OR_RETURN(server::gpu::SourceRef source,
                             placer.RegisterFile(file.fd.get(), file.path.string()));
    sources.push_back(std::move(source));
  }
  const auto registered = std::chrono::steady_clock::now();
  run.register_s = std::chrono::duration<double>(registered - start).count();
  std::atomic<uint64_t> failed{0};
  for (size_t f = 0; f < files.size(); ++f)
    for (size_t c = 0; c < files[f].checksums.size(); ++c) {
      const uint64_t at = c * chunk;
      const auto length = static_cast<uint32_t>(std::min<uint64_t>(chunk, files[f].size - at));
      GPULAZY_RETURN_IF_ERROR(placer.Place(sources[f], at, length, files[f].checksums[c],
                                           destination, files[f].destination_offset + at,
                                           [&failed](const Status& s) {
                                             if (!s.ok()) failed.fetch_add(1);
                                           }));
      run.bytes += length;
    }
  placer.Flush();
  run.place_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - registered).count();
  run.failed = failed.load();
  // Byte for byte, 64 MiB at a time.
  run.verified = run.failed == 0;
  std::vector<uint8_t> landed(64u << 20), want(64u << 20);
  for (const PagesFile& file : files)
    for (uint64_t at = 0; at < file.size && run.verified; at += want.size()) {
      const size_t length = static_cast<size_t>(std::min<uint64_t>(want.size(), file.size - at));
      GPULAZY_RETURN_IF_ERROR(
          placer.ReadBack(destination, file.destination_offset + at, {landed.data(), length}));
      GPULAZY_RETURN_IF_ERROR(ReadExactAt(file.fd.get(), at, {want.data(), length}, file.path));
      run.verified = std::memcmp(landed.data(), want.data(), length) == 0;
    }
  return run;
}

Status RunPlacementCase(const CommonOptions& common, const fs::path& image_dir, uint64_t size,
                        uint32_t repeat, uint32_t chunk, uint32_t streams) {
  GPULAZY_ASSIGN_OR_RETURN(std::vector<PagesFile> files, ChecksummedPagesFiles(image_dir, chunk));
  const uint64_t total = files.empty() ? 0 : files.back().destination_offset + files.back().size;
  server::gpu::PlacerOptions options;
  options.pin_budget_bytes = total + (uint64_t{64} << 20);
  options.slot_bytes = chunk;
  options.streams = streams;
  GPULAZY_ASSIGN_OR_RETURN(std::unique_ptr<server::gpu::DevicePlacer> placer,
                           server::gpu::DevicePlacer::Create(options));
  GPULAZY_ASSIGN_OR_RETURN(
      std::unique_ptr<server::gpu::IpcExporterProcess> exporter,
      server::gpu::IpcExporterProcess::Start(common.bin_dir / "gpulazy-ipc-exporter", total));
  GPULAZY_ASSIGN_OR_RETURN(server::gpu::DestinationRef destination,
                           placer->OpenDestination(exporter->handle(), total));
  for (uint32_t r = 0; r < repeat; ++r) {
    GPULAZY_ASSIGN_OR_RETURN(double ceiling, MeasurePinnedCeiling(size));
    GPULAZY_ASSIGN_OR_RETURN(PlacementRun run,
                             MeasurePlacement(*placer, files, destination, chunk));
    const double bps = static_cast<double>(run.bytes) / run.place_s;
    const server::gpu::PlacerStats stats = placer->stats();
    Emit(common,
         {{"bench", "cuda-place"},
          {"case", "device_placer"},
          {"run", r},
          {"size_bytes", run.bytes},
          {"files", files.size()},
          {"chunk_bytes", chunk},
          {"slots", options.slots},
          {"streams", streams},
          {"register_s", run.register_s},
          {"place_s", run.place_s},
          {"throughput_Bps", bps},
          {"ceiling_Bps", ceiling},
          {"ratio", bps / ceiling},
          {"failed_chunks", run.failed},
          {"verified", run.verified},
          {"pinned_bytes", stats.pinned_bytes},
          {"device", DeviceDescription()},
          {"machine", MachineDescription()}},
         {"case", "run", "register_s", "throughput_Bps", "ceiling_Bps", "ratio", "verified"});
    if (!run.verified)
      return Corrupt("placement run {}: the device memory does not hold the image", r);
  }
  return Status::Ok();
}

int Run(int argc, char** argv) {
  CLI::App app{"gpulazy-cuda-bench: restoring into NVIDIA device memory vs cudaMemcpy"};
  CommonOptions common;
  common.bin_dir = GPULAZY_DEFAULT_BIN_DIR;
  std::string work_dir = "/tmp", bin_dir = common.bin_dir.string(), size_text = "4G",
              window_text = "64M",
              file_window_text =
                  std::to_string(client::SessionOptions{}.file_window_bytes >> 20) + "M";
  std::vector<std::string> experiments = {"stream", "layers"};
  std::vector<std::string> layer_sizes = {"3100M", "16G"};
  // The stream experiment's cases beside the ceiling (all by default; fewer for profiling).
  std::vector<std::string> cases = {"unix", "unix-files", "local", "upstream"};
  uint32_t repeat = 3, layer_count = 36;
  std::string local_chunk_text = "2M";
  LayerOptions layer_options;
  app.add_flag("--json", common.json, "one JSON object per case");
  app.add_option("--work-dir", work_dir, "where the image and sockets go")->capture_default_str();
  app.add_option("--bin-dir", bin_dir, "where gpulazy-server is")->capture_default_str();
  app.add_option("--server-arg", common.server_args,
                 "one more gpulazy-server option (repeatable; e.g. --server-arg=--stream-window=8)")
      ->allow_extra_args(false);
  app.add_option("--experiment", experiments, "stream, layers, place")->delimiter(',');
  app.add_option("--size", size_text, "stream: image content bytes")->capture_default_str();
  std::string stream_image = "criu";
  app.add_option("--stream-image", stream_image,
                 "stream: criu (a plain checkpoint: no checksums) or lazy (converted, every chunk "
                 "stored raw in the served chunk size with its checksum, so a placing server "
                 "checks each on the GPU)")
      ->check(CLI::IsMember({"criu", "lazy"}))
      ->capture_default_str();
  app.add_option(
         "--cases", cases,
         "stream: unix, tcp, unix-files, local, upstream (the ceiling always; unix-files gets "
         "checksums to verify only after unix made the server read the image: see "
         "unchecked_chunks)")
      ->delimiter(',')
      ->check(CLI::IsMember({"unix", "tcp", "unix-files", "local", "upstream"}))
      ->capture_default_str();
  app.add_option("--window", window_text, "client credit window")->capture_default_str();
  app.add_option("--file-window", file_window_text, "client credit window by reference")
      ->capture_default_str();
  app.add_option("--slots", layer_options.engine.staging_slots,
                 "pinned staging slots (0: the engine's default, four per reader)")
      ->capture_default_str();
  std::string slot_bytes_text = "0";  // CudaEngineOptions::slot_bytes
  app.add_option("--slot-bytes", slot_bytes_text,
                 "bytes per staging slot (at least the image's chunk size; 0: that size)")
      ->capture_default_str();
  app.add_option("--streams", layer_options.engine.streams, "copy streams")->capture_default_str();
  app.add_option("--lanes", layer_options.lanes,
                 "bulk connections per session when the bytes cross the socket (unix, tcp; 0: "
                 "one per two CPUs, 1-8; 1 below 8 CPUs)")
      ->capture_default_str();
  app.add_option("--readers", layer_options.readers,
                 "reader threads of the restores (0: the engine's default, one per CPU)")
      ->capture_default_str();
  app.add_option("--local-chunk", local_chunk_text, "stream: local restore chunk size (<= 4M)")
      ->capture_default_str();
  app.add_option("--repeat", repeat, "stream: runs per case (median reported)")
      ->capture_default_str();
  app.add_option("--layer-sizes", layer_sizes, "layers: model sizes")->delimiter(',');
  app.add_option("--layers", layer_count, "layers: BOs of the model")->capture_default_str();
  std::vector<std::string> layer_paths = {"server", "local"};
  app.add_option("--layer-paths", layer_paths,
                 "layers: server (Unix socket, image files passed), tcp (every byte on the "
                 "socket, as from a remote server), local")
      ->delimiter(',')
      ->check(CLI::IsMember({"server", "tcp", "local"}))
      ->capture_default_str();
  std::vector<std::string> layer_modes = {"eager", "parallel", "lazy"};
  app.add_option("--layer-modes", layer_modes,
                 "layers: the modes, in this order on each path (the first restore of an image "
                 "through a placing server also registers its files)")
      ->delimiter(',')
      ->check(CLI::IsMember({"eager", "parallel", "lazy"}))
      ->capture_default_str();
  app.add_option("--startup-ms", layer_options.startup_ms, "layers: the program's own start-up")
      ->capture_default_str();
  app.add_flag("--blocking-sync", layer_options.engine.blocking_sync,
               "the engine's reaper sleeps until a copy completes instead of spinning on it");
  app.add_flag("--verify-on-device,!--no-verify-on-device", layer_options.engine.verify_on_device,
               "the engine verifies chunks with checksums on the GPU (the default), not the "
               "readers on the CPU")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  LogWarningsToStderr();
  common.work_dir = work_dir;
  common.bin_dir = bin_dir;
  auto fail = [](const Status& s) {
    std::cerr << "gpulazy-cuda-bench: " << s.message() << '\n';
    return 1;
  };
  Result<uint64_t> size = ParseSize(size_text);
  Result<uint64_t> window = ParseSize(window_text);
  if (!size.ok()) return fail(size.status());
  if (!window.ok()) return fail(window.status());
  Result<uint64_t> file_window = ParseSize(file_window_text);
  if (!file_window.ok()) return fail(file_window.status());
  Result<uint64_t> local_chunk = ParseSize(local_chunk_text);
  if (!local_chunk.ok()) return fail(local_chunk.status());
  layer_options.window = *window;
  layer_options.file_window = *file_window;
  Result<uint64_t> slot_bytes = ParseSize(slot_bytes_text);
  if (!slot_bytes.ok()) return fail(slot_bytes.status());
  if (*slot_bytes > (4u << 20))
    return fail(InvalidArgument("--slot-bytes must be 0..4M, not {}", *slot_bytes));
  layer_options.engine.slot_bytes = static_cast<uint32_t>(*slot_bytes);
  // Resolved here so that every case runs, and the JSON reports, the same count.
  if (layer_options.readers == 0) layer_options.readers = client::CudaCopyEngine::DefaultWriters();
  auto wants = [&](const char* name) {
    return std::find(experiments.begin(), experiments.end(), name) != experiments.end();
  };
  auto runs_case = [&](const char* name) {
    return std::find(cases.begin(), cases.end(), name) != cases.end();
  };

  Result<WorkDir> work = WorkDir::Create(common.work_dir);
  if (!work.ok()) return fail(work.status());
  const fs::path root = work->path() / "images";
  fs::create_directories(root);
  Result<ServerChild> server = StartServer(common.bin_dir, root, work->path(), common.server_args);
  if (!server.ok()) return fail(server.status());
  Result<uint32_t> served = ServedChunkBytes(common.server_args);
  if (!served.ok()) return fail(served.status());
  const uint32_t served_chunk_bytes = *served;

  if (wants("stream")) {
    Result<fs::path> image_dir = MakeWarmImage(root, "ckpt", *size, 2, 5);
    if (!image_dir.ok()) return fail(image_dir.status());
    if (stream_image == "lazy") {
      if (Status converted = ConvertForStream(*image_dir, served_chunk_bytes); !converted.ok())
        return fail(converted);
    }
    std::vector<double> ceiling, pipeline, pipeline_tcp, by_reference, local, upstream;
    std::map<std::string, std::vector<double>> setup;
    // Case -> reading (PipelineResult::readings) -> one value per run (medians reported).
    std::map<std::string, std::map<std::string, std::vector<double>>> readings;
    auto note_readings = [&](const std::string& name,
                             const std::map<std::string, double>& reading) {
      for (const auto& [field, value] : reading)
        readings[name][field].push_back(value);
    };
    std::map<std::string, uint64_t> device_verified;  // chunks the GPU verified, last run
    std::map<std::string, uint64_t> unchecked;        // chunks with no checksum, last run
    bool verified = true, verified_tcp = true, local_verified = true, by_reference_verified = true;
    uint32_t slot_bytes_used = 0;  // what the engines used (the option may say 0: the image's)
    uint32_t slots_used = 0;       // likewise (0: four per reader)
    for (uint32_t r = 0; r < repeat; ++r) {
      Result<double> c = MeasurePinnedCeiling(*size);
      if (!c.ok()) return fail(c.status());
      ceiling.push_back(*c);
      // Through the server: every byte through the socket, or by reference.
      auto run_pipeline = [&](bool by_ref, const char* name, std::vector<double>& samples,
                              bool& checked, bool tcp = false) -> Status {
        GPULAZY_ASSIGN_OR_RETURN(
            PipelineResult p,
            MeasurePipeline(*image_dir, tcp ? server->tcp_endpoint() : server->unix_endpoint(),
                            *window, *file_window, layer_options.engine, served_chunk_bytes, by_ref,
                            layer_options.readers, layer_options.lanes, server->pid()));
        samples.push_back(p.throughput_Bps);
        setup[name].push_back(p.setup_s);
        note_readings(name, p.readings);
        slot_bytes_used = p.slot_bytes;
        slots_used = p.staging_slots;
        device_verified[name] = p.chunks_verified_on_device;
        unchecked[name] = p.unchecked_chunks;
        checked = checked && p.verified;
        return Status::Ok();
      };
      if (runs_case("unix")) {
        Status s = run_pipeline(false, "gpulazy_pipeline_unix", pipeline, verified);
        if (!s.ok()) return fail(s);
      }
      if (runs_case("tcp")) {
        Status s = run_pipeline(false, "gpulazy_pipeline_tcp", pipeline_tcp, verified_tcp, true);
        if (!s.ok()) return fail(s);
      }
      if (runs_case("unix-files")) {
        Status s =
            run_pipeline(true, "gpulazy_pipeline_unix_files", by_reference, by_reference_verified);
        if (!s.ok()) return fail(s);
      }
      if (runs_case("local")) {
        Result<PipelineResult> l =
            MeasureLocal(*image_dir, layer_options.readers, layer_options.engine,
                         static_cast<uint32_t>(*local_chunk));
        if (!l.ok()) return fail(l.status());
        local.push_back(l->throughput_Bps);
        setup["gpulazy_local_direct"].push_back(l->setup_s);
        note_readings("gpulazy_local_direct", l->readings);
        slot_bytes_used = l->slot_bytes;
        slots_used = l->staging_slots;
        device_verified["gpulazy_local_direct"] = l->chunks_verified_on_device;
        local_verified = local_verified && l->verified;
      }
      if (runs_case("upstream")) {
        Result<double> u = MeasureUpstreamLoop(*image_dir, 2u << 20);
        if (!u.ok()) return fail(u.status());
        upstream.push_back(*u);
      }
    }
    const double ceiling_Bps = Percentile(ceiling, 0.5);
    auto emit = [&](const std::string& name, const std::vector<double>& samples, bool checked) {
      if (samples.empty()) return;  // a case not asked for
      const double median = Percentile(samples, 0.5);
      nlohmann::json result = {
          {"bench", "cuda-stream"},
          {"case", name},
          {"server_args", common.server_args},
          {"stream_image", stream_image},
          {"size_bytes", *size},
          {"window_bytes", *window},
          {"file_window_bytes", *file_window},
          {"slots", slots_used},
          {"slot_bytes", slot_bytes_used},
          {"streams", layer_options.engine.streams},
          {"readers", layer_options.readers},
          {"lanes", client::LanesFor(layer_options.lanes)},
          {"local_chunk_bytes", *local_chunk},
          {"runs", samples.size()},
          {"throughput_Bps", median},
          {"ceiling_Bps", ceiling_Bps},
          {"ratio", median / ceiling_Bps},
          {"verified", checked},
          {"verify_on_device", layer_options.engine.verify_on_device},
          {"blocking_sync", layer_options.engine.blocking_sync},
          {"chunks_verified_on_device", device_verified[name]},
          {"unchecked_chunks", unchecked[name]},
          {"setup_s", setup.contains(name) ? Percentile(setup[name], 0.5) : 0.0},
          {"device", DeviceDescription()},
          {"machine", MachineDescription()}};
      for (auto& [field, values] : readings[name])
        result[field] = Percentile(values, 0.5);
      // The bytes that crossed the bus against the same ceiling: with zero chunks zeroed on the
      // GPU, `ratio` counts bytes that never had to move.
      if (result.contains("data_throughput_Bps"))
        result["data_ratio"] = result["data_throughput_Bps"].get<double>() / ceiling_Bps;
      Emit(common, result,
           {"case", "throughput_Bps", "ceiling_Bps", "ratio", "data_ratio", "setup_s", "verified",
            "unchecked_chunks"});
    };
    emit("ceiling_pinned_cudaMemcpy", ceiling, false);
    emit("gpulazy_pipeline_unix", pipeline, verified);
    emit("gpulazy_pipeline_tcp", pipeline_tcp, verified_tcp);
    emit("gpulazy_pipeline_unix_files", by_reference, by_reference_verified);
    // `verified` compares the device's bytes after the run; a by-reference chunk with no
    // checksum was still installed without the readers' check, which is a different (cheaper)
    // stream than the verified one issue 6 measures. Say so where a reader of the table sees it.
    if (uint64_t n = unchecked["gpulazy_pipeline_unix_files"]; n > 0)
      spdlog::warn(
          "unix-files installed {} chunks with no checksum to check: the server knows a CRIU "
          "checkpoint's checksums only once it has read the chunks itself; put unix before "
          "unix-files in --cases to time a checked stream",
          n);
    emit("gpulazy_local_direct", local, local_verified);
    emit("upstream_style_loop", upstream, false);
    std::error_code ignored;
    fs::remove_all(*image_dir, ignored);
  }

  if (wants("place")) {
    Result<fs::path> image_dir = MakeWarmImage(root, "placed", *size, 2, 7);
    if (!image_dir.ok()) return fail(image_dir.status());
    const uint32_t chunk =
        layer_options.engine.slot_bytes != 0 ? layer_options.engine.slot_bytes : served_chunk_bytes;
    Status placed =
        RunPlacementCase(common, *image_dir, *size, repeat, chunk, layer_options.engine.streams);
    std::error_code ignored;
    fs::remove_all(*image_dir, ignored);
    if (!placed.ok()) return fail(placed);
  }

  if (wants("layers")) {
    for (const std::string& text : layer_sizes) {
      Result<uint64_t> model_bytes = ParseSize(text);
      if (!model_bytes.ok()) return fail(model_bytes.status());
      const uint64_t bytes = *model_bytes & ~(image::kSynthPageSize - 1);
      const std::string name = "model-" + text;
      // A model-like checkpoint: one process on one GPU, `layer_count` BOs of mixed contents.
      Result<fs::path> image_dir = MakeWarmImage(root, name, bytes, 1, 31, layer_count);
      if (!image_dir.ok()) return fail(image_dir.status());
      auto expected = ExpectedLayerSums(*image_dir);
      if (!expected.ok()) return fail(expected.status());
      Result<double> ceiling = MeasurePinnedCeiling(bytes);
      if (!ceiling.ok()) return fail(ceiling.status());
      auto emit = [&](const std::string& path, const std::string& mode, const LayerTimes& t) {
        nlohmann::json result = {
            {"bench", "cuda-layers"},
            {"path", path},
            {"lanes", path == "tcp" ? client::LanesFor(layer_options.lanes) : 0},
            {"mode", mode},
            {"size_bytes", bytes},
            {"layers", layer_count},
            {"startup_ms", layer_options.startup_ms},
            {"slots", t.staging_slots},
            {"slot_bytes", t.slot_bytes},
            // The upstream loop reads on its one thread; the server path
            // uses its readers only where the server passes the files (not
            // over TCP: there the readers are the connections' threads).
            {"readers", path == "upstream-loop" ? 1u
                        : path == "tcp"         ? 0u
                                                : layer_options.readers},
            {"time_to_resume_s", t.resume_s},
            {"resume_engine_s", t.engine_s},
            {"resume_kernel_s", t.kernel_s},
            {"resume_start_s", t.start_s},
            {"time_to_first_result_s", t.first_result_s},
            {"time_to_all_layers_s", t.all_layers_s},
            {"time_to_full_s", t.full_s},
            {"demand_chunks", t.demand_chunks},
            {"bytes", t.bytes},
            {"results_ok", t.results_ok},
            {"verify_on_device", layer_options.engine.verify_on_device},
            {"blocking_sync", layer_options.engine.blocking_sync},
            {"ceiling_Bps", *ceiling},
            {"ceiling_copy_s", static_cast<double>(bytes) / *ceiling},
            {"device", DeviceDescription()},
            {"machine", MachineDescription()}};
        Emit(common, result,
             {"path", "mode", "size_bytes", "time_to_resume_s", "time_to_first_result_s",
              "time_to_full_s", "results_ok"});
      };
      Result<LayerTimes> upstream = RunUpstreamLayers(*image_dir, layer_options, *expected);
      if (!upstream.ok()) return fail(upstream.status());
      emit("upstream-loop", "eager", *upstream);
      for (const std::string& path : layer_paths) {
        const std::string& endpoint =
            path == "tcp" ? server->tcp_endpoint() : server->unix_endpoint();
        for (const std::string& mode : layer_modes) {
          Result<LayerTimes> t =
              RunLayerCase(*image_dir, endpoint, path, mode, layer_options, *expected);
          if (!t.ok()) return fail(t.status());
          emit(path, mode, *t);
        }
      }
      std::error_code ignored;
      fs::remove_all(*image_dir, ignored);
    }
  }
  return 0;
}

}  // namespace
}  // namespace gpulazy::bench

int main(int argc, char** argv) {
  try {
    return gpulazy::bench::Run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "gpulazy-cuda-bench: " << e.what() << '\n';
    return 1;
  }
}
