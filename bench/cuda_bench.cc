// gpulazy-cuda-bench: streaming into NVIDIA device memory (issue 6), each case beside the
// pinned cudaMemcpy host-to-device rate measured in the same run:
//   ceiling   pinned host buffer -> device, cudaMemcpy, the copy engine's upper bound
//   pipeline  gpulazy-server -> RestoreSession -> CudaCopyEngine, from the page cache, verified
//             byte for byte against the pages files afterwards
//   upstream  CRIU amdgpu-style loop: one staging buffer; read a chunk from the pages file,
//             copy it, wait, read the next (no server)
#include <cuda_runtime.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstring>
#include <iostream>
#include <map>

#include "bench/harness.h"
#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/io.h"
#include "page-client/cuda/cuda_engine.h"
#include "page-client/restore_session.h"
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
  bool verified = false;
};

Result<PipelineResult> MeasurePipeline(const fs::path& image_dir, const std::string& endpoint,
                                       uint64_t window, uint32_t slots, uint32_t streams) {
  client::CudaEngineOptions engine_options;
  engine_options.staging_slots = slots;
  engine_options.streams = streams;
  GPULAZY_ASSIGN_OR_RETURN(std::unique_ptr<client::CudaCopyEngine> engine,
                           client::CudaCopyEngine::Create(engine_options));
  client::SessionOptions options;
  options.endpoint = endpoint;
  options.insecure_tcp = true;  // the harness's loopback server runs --insecure-tcp
  options.image = image_dir.filename().string();
  options.window_bytes = window;
  options.client_name = "cuda-bench";
  PipelineResult result;
  {
    client::RestoreSession session(options, *engine);
    auto start = Clock::now();
    GPULAZY_RETURN_IF_ERROR(session.Start());
    GPULAZY_RETURN_IF_ERROR(session.WaitComplete(std::chrono::minutes(10)));
    result.seconds = SecondsSince(start);
    result.throughput_Bps = static_cast<double>(session.progress().total_bytes) / result.seconds;

    // Byte-for-byte against the source.
    GPULAZY_ASSIGN_OR_RETURN(image::CriuCheckpoint checkpoint,
                             image::CriuCheckpoint::Open(image_dir));
    std::map<std::pair<uint32_t, uint32_t>, const image::ContentBo*> by_key;
    for (const image::ContentBo& bo : checkpoint.content_bos())
      by_key[{bo.process_id, bo.bo_index}] = &bo;
    std::vector<uint8_t> expected, actual;
    for (uint32_t i = 0; i < session.bos().size(); ++i) {
      const client::BoEntry& entry = session.bos()[i];
      auto found = by_key.find({entry.process_id, entry.bo_index});
      if (found == by_key.end()) return Corrupt("BO {} missing from the source", i);
      const image::ContentBo& source = *found->second;
      expected.resize(source.size);
      actual.resize(source.size);
      GPULAZY_ASSIGN_OR_RETURN(UniqueFd fd, OpenForRead(image_dir / source.pages_file));
      GPULAZY_RETURN_IF_ERROR(
          ReadExactAt(fd.get(), 8 + source.pages_offset, expected, image_dir / source.pages_file));
      GPULAZY_RETURN_IF_ERROR(engine->CopyToHost(i, 0, actual));
      if (std::memcmp(expected.data(), actual.data(), source.size) != 0)
        return Corrupt("BO {} in device memory differs from the source", i);
    }
    result.verified = true;
  }
  return result;
}

int Run(int argc, char** argv) {
  CLI::App app{"gpulazy-cuda-bench: streaming into NVIDIA device memory vs cudaMemcpy"};
  CommonOptions common;
  common.bin_dir = GPULAZY_DEFAULT_BIN_DIR;
  std::string work_dir = "/tmp", bin_dir = common.bin_dir.string(), size_text = "4G",
              window_text = "64M";
  uint32_t slots = 16, streams = 4, repeat = 3;
  app.add_flag("--json", common.json, "one JSON object per case");
  app.add_option("--work-dir", work_dir, "where the image and sockets go")->capture_default_str();
  app.add_option("--bin-dir", bin_dir, "where gpulazy-server is")->capture_default_str();
  app.add_option("--size", size_text, "image content bytes")->capture_default_str();
  app.add_option("--window", window_text, "client credit window")->capture_default_str();
  app.add_option("--slots", slots, "pinned staging slots")->capture_default_str();
  app.add_option("--streams", streams, "copy streams")->capture_default_str();
  app.add_option("--repeat", repeat, "runs per case (median reported)")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::warn);
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

  Result<WorkDir> work = WorkDir::Create(common.work_dir);
  if (!work.ok()) return fail(work.status());
  const fs::path root = work->path() / "images";
  fs::create_directories(root);
  Result<fs::path> image_dir = MakeWarmImage(root, "ckpt", *size, 2, 5);
  if (!image_dir.ok()) return fail(image_dir.status());
  Result<ServerChild> server = ServerChild::Start(common.bin_dir, root, work->path());
  if (!server.ok()) return fail(server.status());

  std::vector<double> ceiling, pipeline, upstream;
  bool verified = true;
  for (uint32_t r = 0; r < repeat; ++r) {
    Result<double> c = MeasurePinnedCeiling(*size);
    if (!c.ok()) return fail(c.status());
    ceiling.push_back(*c);
    Result<PipelineResult> p =
        MeasurePipeline(*image_dir, server->unix_endpoint(), *window, slots, streams);
    if (!p.ok()) return fail(p.status());
    pipeline.push_back(p->throughput_Bps);
    verified = verified && p->verified;
    Result<double> u = MeasureUpstreamLoop(*image_dir, 2u << 20);
    if (!u.ok()) return fail(u.status());
    upstream.push_back(*u);
  }
  const double ceiling_Bps = Percentile(ceiling, 0.5);
  auto emit = [&](const std::string& name, const std::vector<double>& samples, bool checked) {
    const double median = Percentile(samples, 0.5);
    nlohmann::json result = {{"bench", "cuda-stream"},
                             {"case", name},
                             {"size_bytes", *size},
                             {"window_bytes", *window},
                             {"slots", slots},
                             {"streams", streams},
                             {"runs", samples.size()},
                             {"throughput_Bps", median},
                             {"ceiling_Bps", ceiling_Bps},
                             {"ratio", median / ceiling_Bps},
                             {"verified", checked},
                             {"device", DeviceDescription()},
                             {"machine", MachineDescription()}};
    Emit(common, result, {"case", "throughput_Bps", "ceiling_Bps", "ratio", "verified"});
  };
  emit("ceiling_pinned_cudaMemcpy", ceiling, false);
  emit("gpulazy_pipeline_unix", pipeline, verified);
  emit("upstream_style_loop", upstream, false);
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
