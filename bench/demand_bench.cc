#include "bench/demand_bench.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <iterator>
#include <map>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <utility>

#include "page-client/host_engine.h"
#include "page-client/net/frame_stream.h"
#include "page-client/restore_session.h"
#include "page-client/server_connection.h"

namespace gpulazy::bench {
namespace fs = std::filesystem;

namespace {

struct ChunkId {
  uint32_t bo;
  uint32_t chunk;
};

// Each measurement samples its own chunks. The server learns a CRIU chunk's checksum when it
// first reads it, and sends a chunk whose checksum it knows straight from the page cache
// (sendfile) without reading and hashing it on a disk thread: a chunk one measurement fetched
// would take that shorter path in the next. The loaded samples are chunks the stream has not
// reached, which the server has never read, so the lone measurements must fetch never-read
// chunks too, or the baseline times a shorter path than the samples it is compared with
// (before session 20 the lone Ensure drew the frame-level measurement's chunks).
enum class Phase { kLoneFrame, kLoneEnsure, kLoaded };

Phase PhaseOf(ChunkId id, uint64_t seed) {
  // splitmix64 of the chunk's position: a fixed tenth of the chunks for each lone measurement.
  uint64_t x = seed ^ ((uint64_t{id.bo} << 32) | id.chunk);
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  x ^= x >> 31;
  switch (x % 10) {
    case 0:
      return Phase::kLoneFrame;
    case 1:
      return Phase::kLoneEnsure;
    default:
      return Phase::kLoaded;
  }
}

// Full-size chunks of the image, from its BO table, that `phase` samples.
std::vector<ChunkId> FullChunks(const std::vector<client::BoEntry>& bos, uint32_t chunk_size,
                                Phase phase, uint64_t seed) {
  std::vector<ChunkId> chunks;
  for (uint32_t b = 0; b < bos.size(); ++b)
    for (uint32_t c = 0; c < bos[b].chunk_count; ++c)
      if ((uint64_t{c} + 1) * chunk_size <= bos[b].size && PhaseOf({b, c}, seed) == phase)
        chunks.push_back({b, c});
  return chunks;
}

// Time to fetch one chunk at the frame level with nothing else going on: Hello + OpenImage on a
// stream connection that never asks to stream, then demand requests one at a time on the demand
// connection. Neither verified nor installed: the wire and the server alone (kept for
// comparison with earlier runs; the baseline is MeasureLoneEnsure).
Result<nlohmann::json> MeasureLoneChunk(const std::string& endpoint_text, const std::string& image,
                                        uint32_t samples, uint64_t seed) {
  GPULAZY_ASSIGN_OR_RETURN(net::Endpoint endpoint, net::Endpoint::Parse(endpoint_text));
  boost::asio::io_context io;
  FrameLimits limits;
  std::vector<uint8_t> payload;
  auto expect = [&](net::Socket& socket, wire::Header::BodyCase body) -> Result<wire::Header> {
    GPULAZY_ASSIGN_OR_RETURN(wire::Header reply, net::ReadFrameBlocking(socket, limits, &payload));
    if (reply.body_case() == wire::Header::kError)
      return Unavailable("server: {}", reply.error().message());
    if (reply.body_case() != body) return Internal("unexpected frame {}", int(reply.body_case()));
    return reply;
  };
  GPULAZY_ASSIGN_OR_RETURN(net::Socket stream, net::ConnectBlocking(io, endpoint));
  wire::Header hello;
  // Version 1: this frame-level client reads the BO table from the reply's header, where the
  // bench's image (a few BOs) fits; version 2 would send it as payload frames.
  hello.mutable_hello()->set_min_version(kMinProtocolVersion);
  hello.mutable_hello()->set_max_version(kMinProtocolVersion);
  hello.mutable_hello()->set_client_name("bench-lone");
  GPULAZY_RETURN_IF_ERROR(net::WriteFrameBlocking(stream, hello, {}, limits));
  GPULAZY_RETURN_IF_ERROR(expect(stream, wire::Header::kHelloReply).status());
  wire::Header open;
  open.set_request_id(1);
  open.mutable_open_image()->set_image(image);
  GPULAZY_RETURN_IF_ERROR(net::WriteFrameBlocking(stream, open, {}, limits));
  GPULAZY_ASSIGN_OR_RETURN(wire::Header opened, expect(stream, wire::Header::kOpenImageReply));
  const wire::OpenImageReply& reply = opened.open_image_reply();

  GPULAZY_ASSIGN_OR_RETURN(net::Socket demand, net::ConnectBlocking(io, endpoint));
  wire::Header join = hello;
  join.mutable_hello()->set_join_session(reply.session());
  join.mutable_hello()->set_join_secret(reply.session_secret());
  GPULAZY_RETURN_IF_ERROR(net::WriteFrameBlocking(demand, join, {}, limits));
  GPULAZY_RETURN_IF_ERROR(expect(demand, wire::Header::kHelloReply).status());

  std::vector<client::BoEntry> bos;
  for (const wire::BoInfo& info : reply.bos()) {
    client::BoEntry entry;
    entry.size = info.size();
    entry.chunk_count = info.chunk_count();
    bos.push_back(entry);
  }
  std::vector<ChunkId> chunks = FullChunks(bos, reply.chunk_size(), Phase::kLoneFrame, seed);
  if (chunks.empty()) return InvalidArgument("image has too few full-size chunks");
  // Each chunk once while they last: a repeat would be served from the page cache.
  std::mt19937_64 random(seed);
  std::shuffle(chunks.begin(), chunks.end(), random);
  std::vector<double> latencies;
  for (uint32_t i = 0; i < samples; ++i) {
    ChunkId id = chunks[i % chunks.size()];
    wire::Header request;
    request.set_request_id(100 + i);
    request.mutable_request()->set_priority(wire::PRIORITY_DEMAND);
    wire::ChunkRange* range = request.mutable_request()->add_ranges();
    range->set_bo(id.bo);
    range->set_first_chunk(id.chunk);
    range->set_chunk_count(1);
    auto start = Clock::now();
    GPULAZY_RETURN_IF_ERROR(net::WriteFrameBlocking(demand, request, {}, limits));
    GPULAZY_RETURN_IF_ERROR(expect(demand, wire::Header::kChunk).status());
    latencies.push_back(SecondsSince(start));
  }
  return nlohmann::json{{"lone_chunk_frame_s", Percentile(latencies, 0.5)},
                        {"lone_chunk_frame_p99_s", Percentile(latencies, 0.99)},
                        {"chunk_size", reply.chunk_size()}};
}

client::HostEngineOptions EngineOptions(const DemandOptions& options) {
  client::HostEngineOptions engine;
  engine.write_fresh_pages = options.write_fresh_pages;
  engine.fresh_pages_with_several_writers = options.fresh_pages_with_several_writers;
  engine.prepare_waited_ranges = options.prepare_waited_ranges;
  return engine;
}

// The sessions both measurements open: the benchmark's endpoint, window and data plane.
client::SessionOptions BenchSession(const std::string& endpoint, const std::string& image,
                                    const DemandOptions& options, std::string client_name) {
  client::SessionOptions session_options;
  session_options.endpoint = endpoint;
  session_options.insecure_tcp = true;  // the harness's loopback server runs --insecure-tcp
  session_options.image = image;
  session_options.window_bytes = options.window;
  session_options.window_per_connection_bytes = options.window_per_connection;
  session_options.client_name = std::move(client_name);
  session_options.read_files = options.transport == "unix-files";
  session_options.lanes = options.lanes;
  session_options.background_nice = options.background_nice;
  session_options.batch_tcp_wakeups = options.batch_tcp_wakeups;
  return session_options;
}

// One sample: the chunk and when Ensure was called and returned.
struct Sample {
  ChunkId id;
  Clock::time_point called;
  Clock::time_point returned;
};

double Seconds(Clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

std::vector<double> Latencies(const std::vector<Sample>& samples) {
  std::vector<double> latencies;
  latencies.reserve(samples.size());
  for (const Sample& sample : samples)
    latencies.push_back(Seconds(sample.returned - sample.called));
  return latencies;
}

// The server's demand latency fields (its stats' demand_latency_us), reported in seconds as
// server_demand_<field>_s.
constexpr const char* kServerDemandFields[] = {"p50",        "p99",       "max",      "queued_p50",
                                               "queued_p99", "write_p50", "write_p99"};

std::string ServerDemandKey(std::string_view field) {
  return fmt::format("server_demand_{}_s", field);
}

// The client's side of the samples, stage by stage, from the session's demand timings
// (client::DemandChunkTiming): Ensure's hand-off to the demand thread, the request's way to the
// server and back to the reply's first frame head (the server's share is in there), the payload's
// receive (hashing included), the install, and waking the caller. Per stage p50/p99/max over the
// samples the session timed, and the stages of the slowest 1 % (at least 3) one by one, so a
// tail can be told apart from a slow median; each with when it was called (steady clock) and its
// place among the samples, so slow samples at a phase's start show as such.
nlohmann::json ClientStages(const std::vector<Sample>& samples,
                            const std::vector<client::DemandChunkTiming>& timings) {
  static constexpr const char* kStages[] = {"handoff",   "to_head", "receive", "hashing",
                                            "gate_wait", "install", "wake"};
  constexpr size_t kStageCount = std::size(kStages);
  std::map<std::pair<uint32_t, uint32_t>, const client::DemandChunkTiming*> by_chunk;
  for (const client::DemandChunkTiming& t : timings)
    by_chunk[{t.bo, t.chunk}] = &t;
  struct Split {
    double total;
    std::array<double, kStageCount> stage;
    double called_at;  // steady clock (CLOCK_MONOTONIC on Linux), to line up with other probes
    size_t index;      // the sample's place among this measurement's samples, from 0
  };
  std::vector<Split> splits;
  for (size_t index = 0; index < samples.size(); ++index) {
    const Sample& sample = samples[index];
    auto found = by_chunk.find({sample.id.bo, sample.id.chunk});
    if (found == by_chunk.end()) continue;  // came on the stream first, or by reference
    const client::DemandChunkTiming& t = *found->second;
    // A timing from before this Ensure was called is another request's (not expected: a chunk
    // is demanded once); skip rather than mix it in.
    if (t.asked < sample.called || t.resident > sample.returned) continue;
    splits.push_back({Seconds(sample.returned - sample.called),
                      {Seconds(t.asked - sample.called), Seconds(t.head - t.asked),
                       Seconds(t.received - t.head), Seconds(t.hashing), Seconds(t.gate_wait),
                       Seconds(t.resident - t.received), Seconds(sample.returned - t.resident)},
                      Seconds(sample.called.time_since_epoch()),
                      index});
  }
  nlohmann::json stages = nlohmann::json::object();
  for (size_t i = 0; i < kStageCount; ++i) {
    std::vector<double> values;
    values.reserve(splits.size());
    for (const Split& split : splits)
      values.push_back(split.stage[i]);
    stages[kStages[i]] = {{"p50_s", Percentile(values, 0.5)},
                          {"p99_s", Percentile(values, 0.99)},
                          {"max_s", values.empty() ? 0.0 : Percentile(values, 1.0)}};
  }
  std::sort(splits.begin(), splits.end(),
            [](const Split& a, const Split& b) { return a.total > b.total; });
  nlohmann::json slowest = nlohmann::json::array();
  for (size_t n = 0; n < std::min(splits.size(), std::max<size_t>(3, splits.size() / 100)); ++n) {
    nlohmann::json one = {{"total_s", splits[n].total},
                          {"called_at_s", splits[n].called_at},
                          {"sample_index", splits[n].index}};
    for (size_t i = 0; i < kStageCount; ++i)
      one[std::string(kStages[i]) + "_s"] = splits[n].stage[i];
    slowest.push_back(std::move(one));
  }
  return {{"timed_samples", splits.size()}, {"stages", stages}, {"slowest", slowest}};
}

// Time to fetch one chunk alone, the same operation as a loaded sample: Ensure (demand request,
// receive, verify, install into fresh memory) on a session that streams nothing in the
// background (SessionOptions::stream_all = false), one chunk at a time.
Result<nlohmann::json> MeasureLoneEnsure(const std::string& endpoint, const std::string& image,
                                         uint32_t samples, const DemandOptions& options) {
  client::HostCopyEngine engine(EngineOptions(options));
  client::SessionOptions session_options = BenchSession(endpoint, image, options, "bench-lone");
  session_options.stream_all = false;
  client::RestoreSession session(session_options, engine);
  GPULAZY_RETURN_IF_ERROR(session.Start());
  std::vector<ChunkId> chunks =
      FullChunks(session.bos(), session.chunk_size(), Phase::kLoneEnsure, options.seed);
  if (chunks.empty()) return InvalidArgument("image has too few full-size chunks");
  std::mt19937_64 random(options.seed);
  std::vector<Sample> timed;
  uint32_t skipped = 0;
  while (timed.size() < samples) {
    ChunkId id = chunks[random() % chunks.size()];
    const uint64_t offset = uint64_t{id.chunk} * session.chunk_size();
    if (session.IsResident(id.bo, offset, session.chunk_size())) {
      if (++skipped > 100000) break;
      continue;
    }
    auto asked = Clock::now();
    GPULAZY_RETURN_IF_ERROR(
        session.Ensure(id.bo, offset, session.chunk_size(), std::chrono::seconds(30)));
    timed.push_back({id, asked, Clock::now()});
  }
  if (timed.empty()) return Internal("no lone Ensure sample taken");
  const std::vector<double> latencies = Latencies(timed);
  return nlohmann::json{{"lone_samples", latencies.size()},
                        {"lone_chunk_s", Percentile(latencies, 0.5)},
                        {"lone_chunk_p99_s", Percentile(latencies, 0.99)},
                        {"lone_client", ClientStages(timed, session.demand_timings())}};
}

// The server's own view of one session's demand chunks (request read -> reply written into the
// socket), from its stats: the part of a sample's latency spent in the server, the rest being
// the wire, the client's receive, verification and install. The open session with the most
// demand chunks is the loaded one (the lone measurements' sessions have closed by then).
Result<nlohmann::json> ServerDemandLatency(const std::string& endpoint_text) {
  GPULAZY_ASSIGN_OR_RETURN(net::Endpoint endpoint, net::Endpoint::Parse(endpoint_text));
  GPULAZY_ASSIGN_OR_RETURN(net::ClientTransport transport,
                           net::ClientTransport::Make({}, /*allow_insecure_tcp=*/true));
  GPULAZY_ASSIGN_OR_RETURN(std::string text,
                           client::FetchServerStats(endpoint, transport, "", "bench-stats"));
  nlohmann::json stats = nlohmann::json::parse(text, nullptr, false);
  if (stats.is_discarded() || !stats.contains("sessions"))
    return Corrupt("server stats are not the expected JSON: {}", text.substr(0, 200));
  // Stats come from the server: missing fields read as none rather than trusted.
  auto demand_latency = [](const nlohmann::json& session) {
    return session.is_object() ? session.value("demand_latency_us", nlohmann::json::object())
                               : nlohmann::json::object();
  };
  nlohmann::json latency;
  uint64_t most = 0;
  for (const nlohmann::json& session : stats["sessions"]) {
    nlohmann::json candidate = demand_latency(session);
    const uint64_t count = candidate.value("count", uint64_t{0});
    if (latency.is_null() || count > most) {
      latency = std::move(candidate);
      most = count;
    }
  }
  if (latency.is_null()) return NotFound("server stats list no session");
  auto seconds = [&](const char* field) { return latency.value(field, 0.0) / 1e6; };
  nlohmann::json result{{"server_demand_count", most}};
  for (const char* field : kServerDemandFields)
    result[ServerDemandKey(field)] = seconds(field);
  return result;
}

// Demand latency under a saturating background stream: Ensure() on random chunks that are not
// resident yet; only samples taken while the stream was still running count.
Result<nlohmann::json> MeasureLoaded(const std::string& endpoint, const std::string& image,
                                     const DemandOptions& options) {
  client::HostCopyEngine engine(EngineOptions(options));
  client::RestoreSession session(BenchSession(endpoint, image, options, "bench-demand"), engine);
  auto start = Clock::now();
  GPULAZY_RETURN_IF_ERROR(session.Start());
  std::vector<ChunkId> chunks =
      FullChunks(session.bos(), session.chunk_size(), Phase::kLoaded, options.seed);
  if (chunks.empty()) return InvalidArgument("image has too few full-size chunks");
  std::mt19937_64 random(options.seed);
  std::vector<Sample> samples;
  // The server lists a session only while it is open, and a session whose stream completes may
  // close before the loop below notices: its stats are taken every kStatsEvery samples (between
  // samples, outside their timing) and once more at the end, and the last that saw demand
  // chunks is reported.
  constexpr size_t kStatsEvery = 25;
  nlohmann::json server_side = {{"server_demand_count", 0}};
  for (const char* field : kServerDemandFields)
    server_side[ServerDemandKey(field)] = nullptr;
  auto take_server_stats = [&] {
    Result<nlohmann::json> now = ServerDemandLatency(endpoint);
    if (now.ok() && (*now)["server_demand_count"].get<uint64_t>() > 0) server_side = *now;
  };
  uint32_t skipped = 0;
  while (samples.size() < options.requests && !session.progress().complete) {
    ChunkId id = chunks[random() % chunks.size()];
    const uint64_t offset = uint64_t{id.chunk} * session.chunk_size();
    if (session.IsResident(id.bo, offset, session.chunk_size())) {
      if (++skipped > 100000) break;
      continue;
    }
    auto asked = Clock::now();
    GPULAZY_RETURN_IF_ERROR(
        session.Ensure(id.bo, offset, session.chunk_size(), std::chrono::seconds(30)));
    const Clock::time_point returned = Clock::now();
    if (!session.progress().complete) samples.push_back({id, asked, returned});
    if (samples.size() % kStatsEvery == 0) take_server_stats();
  }
  client::Progress during = session.progress();
  double stream_seconds_so_far = SecondsSince(start);
  take_server_stats();
  GPULAZY_RETURN_IF_ERROR(session.WaitComplete(std::chrono::minutes(10)));
  double total_seconds = SecondsSince(start);
  const std::vector<double> latencies = Latencies(samples);
  nlohmann::json result{
      {"image", image},
      {"latencies_s", latencies},  // pooled across sessions, then dropped from the output
      {"samples", latencies.size()},
      {"p50_s", Percentile(latencies, 0.5)},
      {"p99_s", Percentile(latencies, 0.99)},
      {"max_s", latencies.empty() ? 0.0 : Percentile(latencies, 1.0)},
      {"background_Bps_during", static_cast<double>(during.received_bytes) / stream_seconds_so_far},
      {"time_to_full_s", total_seconds},
      {"demand_chunks", session.progress().demand_chunks},
      {"client", ClientStages(samples, session.demand_timings())}};
  result.update(server_side);
  return result;
}

// MeasureLoaded on `images.size()` sessions at once, one thread each, started together. p50/p99
// over all their samples; background_Bps_during summed; each session's own figures (and its
// client stages) under per_session; the top-level client stages are the first session's, the
// server's figures those of the session with the most demand chunks (ServerDemandLatency).
Result<nlohmann::json> MeasureLoadedSessions(const std::string& endpoint,
                                             const std::vector<std::string>& images,
                                             const DemandOptions& options) {
  if (images.size() == 1) return MeasureLoaded(endpoint, images[0], options);
  std::vector<Result<nlohmann::json>> results(images.size(), Internal("not measured"));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < images.size(); ++i)
    threads.emplace_back([&, i] {
      DemandOptions own = options;
      own.seed = options.seed + i;  // each session samples its own random order
      results[i] = MeasureLoaded(endpoint, images[i], own);
    });
  for (std::thread& thread : threads)
    thread.join();
  std::vector<double> pooled;
  double background = 0;
  uint64_t demand_chunks = 0;
  double time_to_full = 0;
  nlohmann::json per_session = nlohmann::json::array();
  for (Result<nlohmann::json>& result : results) {
    if (!result.ok()) return result.status();
    for (double latency : (*result)["latencies_s"])
      pooled.push_back(latency);
    background += (*result)["background_Bps_during"].get<double>();
    demand_chunks += (*result)["demand_chunks"].get<uint64_t>();
    time_to_full = std::max(time_to_full, (*result)["time_to_full_s"].get<double>());
    nlohmann::json own = *result;
    own.erase("latencies_s");
    per_session.push_back(std::move(own));
  }
  nlohmann::json combined = per_session[0];
  combined["samples"] = pooled.size();
  combined["p50_s"] = Percentile(pooled, 0.5);
  combined["p99_s"] = Percentile(pooled, 0.99);
  combined["max_s"] = pooled.empty() ? 0.0 : Percentile(pooled, 1.0);
  combined["background_Bps_during"] = background;
  combined["demand_chunks"] = demand_chunks;
  combined["time_to_full_s"] = time_to_full;
  combined["per_session"] = std::move(per_session);
  return combined;
}

}  // namespace

Status RunDemandBench(const CommonOptions& common, const DemandOptions& options) {
  if (options.transport != "unix" && options.transport != "unix-files" &&
      options.transport != "tcp")
    return InvalidArgument("--transport {}: use unix, unix-files or tcp", options.transport);
  GPULAZY_ASSIGN_OR_RETURN(WorkDir work, WorkDir::Create(common.work_dir));
  const fs::path root = work.path() / "images";
  fs::create_directories(root);
  if (options.sessions < 1 || options.sessions > 64)
    return InvalidArgument("--sessions {}: use 1 to 64", options.sessions);
  // An image per session: a chunk another session's stream read would reach the server's
  // shorter path (see Phase), and the samples must fetch never-read chunks like the baseline.
  std::vector<std::string> images;
  for (uint32_t i = 0; i < options.sessions; ++i) {
    GPULAZY_ASSIGN_OR_RETURN(
        fs::path dir, MakeWarmImage(root, i == 0 ? std::string("ckpt") : fmt::format("ckpt-{}", i),
                                    options.size, 2, 11 + i));
    images.push_back(dir.filename().string());
  }
  GPULAZY_ASSIGN_OR_RETURN(
      ServerChild server,
      StartServer(common.bin_dir, root, work.path(),
                  ServerArgsWithBackgroundNice(options.background_nice, common.server_args)));
  const std::string& endpoint =
      options.transport == "tcp" ? server.tcp_endpoint() : server.unix_endpoint();
  const std::string& image = images[0];  // the lone measurements' image

  GPULAZY_ASSIGN_OR_RETURN(nlohmann::json lone_frame, RunInChild([&] {
                             return MeasureLoneChunk(endpoint, image, 50, options.seed);
                           }));
  GPULAZY_ASSIGN_OR_RETURN(nlohmann::json lone, RunInChild([&] {
                             return MeasureLoneEnsure(endpoint, image, 50, options);
                           }));
  GPULAZY_ASSIGN_OR_RETURN(nlohmann::json loaded, RunInChild([&] {
                             return MeasureLoadedSessions(endpoint, images, options);
                           }));
  const double lone_s = lone["lone_chunk_s"].get<double>();
  const double lone_frame_s = lone_frame["lone_chunk_frame_s"].get<double>();
  const double p99_s = loaded["p99_s"].get<double>();
  const std::string fresh_pages =
      FreshPagesName(options.write_fresh_pages, options.fresh_pages_with_several_writers);
  nlohmann::json result = {{"bench", "demand"},
                           {"server_args", common.server_args},
                           {"transport", options.transport},
                           {"sessions", options.sessions},
                           {"lanes", client::LanesFor(options.lanes)},
                           {"background_nice", options.background_nice},
                           {"size_bytes", options.size},
                           {"window_bytes", options.window},
                           {"window_per_connection_bytes", options.window_per_connection},
                           {"fresh_pages", fresh_pages},
                           {"prepare_waited", options.prepare_waited_ranges},
                           {"batch_wakeups", options.batch_tcp_wakeups},
                           {"chunk_size", lone_frame["chunk_size"]},
                           {"samples", loaded["samples"]},
                           {"p50_s", loaded["p50_s"]},
                           {"p99_s", p99_s},
                           {"max_s", loaded["max_s"]},
                           {"lone_samples", lone["lone_samples"]},
                           {"lone_chunk_s", lone_s},
                           {"lone_chunk_p99_s", lone["lone_chunk_p99_s"]},
                           {"p99_over_lone", lone_s > 0 ? p99_s / lone_s : 0.0},
                           {"lone_chunk_frame_s", lone_frame_s},
                           {"lone_chunk_frame_p99_s", lone_frame["lone_chunk_frame_p99_s"]},
                           {"p99_over_lone_frame", lone_frame_s > 0 ? p99_s / lone_frame_s : 0.0},
                           {"background_Bps_during", loaded["background_Bps_during"]},
                           {"demand_chunks", loaded["demand_chunks"]},
                           {"server_demand_count", loaded["server_demand_count"]},
                           {"client", loaded["client"]},
                           {"lone_client", lone["lone_client"]},
                           {"time_to_full_s", loaded["time_to_full_s"]},
                           {"per_session", loaded.value("per_session", nlohmann::json::array())},
                           {"machine", MachineDescription()}};
  for (const char* field : kServerDemandFields)
    result[ServerDemandKey(field)] = loaded[ServerDemandKey(field)];
  Emit(common, result,
       {"bench", "transport", "sessions", "samples", "p50_s", "p99_s", "lone_chunk_s",
        "p99_over_lone", "server_demand_p99_s", "lone_chunk_frame_s", "background_Bps_during"});
  return Status::Ok();
}

}  // namespace gpulazy::bench
