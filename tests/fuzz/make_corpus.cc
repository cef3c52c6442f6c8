// Writes the seed corpus of the fuzz targets (docs/hostile-input.md): small valid inputs made
// with the real encoders from the tiny seed checkpoint (fuzz_support.h), plus edge cases that
// sit right at a limit. Deterministic: rerunning it rewrites the same bytes.
// Usage: fuzz_make_corpus OUT_DIR   (OUT_DIR/<target>/<name> per input; the committed corpus
// is tests/fuzz/corpus)
#include <lz4.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/io.h"
#include "lazy-server/image/lazy_image.h"
#include "proto/checksum.h"
#include "proto/criu_file.h"
#include "proto/endian.h"
#include "proto/file_header.h"
#include "proto/frame.h"
#include "tests/fuzz/fuzz_support.h"
#include "tests/fuzz/server_script.h"

namespace {

namespace fs = std::filesystem;
using namespace gpulazy;
using Bytes = std::vector<uint8_t>;

class Corpus {
 public:
  explicit Corpus(fs::path root) : root_(std::move(root)) {}
  void Add(const std::string& target, const std::string& name, const Bytes& bytes) {
    fs::create_directories(root_ / target);
    fuzz::WriteFileOrDie(root_ / target / name, bytes);
    ++count_;
  }
  int count() const { return count_; }

 private:
  fs::path root_;
  int count_ = 0;
};

Bytes Concat(std::initializer_list<Bytes> parts) {
  Bytes out;
  for (const Bytes& part : parts)
    out.insert(out.end(), part.begin(), part.end());
  return out;
}

Bytes FromString(const std::string& s) {
  return Bytes(s.begin(), s.end());
}

Bytes Frame(const wire::Header& header, const Bytes& payload = {}) {
  Result<std::string> head =
      EncodeFrameHead(header, static_cast<uint32_t>(payload.size()), FrameLimits{});
  if (!head.ok()) {
    std::fprintf(stderr, "fuzz_make_corpus: %s\n", head.status().ToString().c_str());
    std::exit(1);
  }
  return Concat({FromString(*head), payload});
}

Bytes Prefix(uint32_t header_length, uint32_t payload_length) {
  Bytes out(8);
  StoreLe32(out.data(), header_length);
  StoreLe32(out.data() + 4, payload_length);
  return out;
}

void FrameCorpus(Corpus& corpus, const manifest::Manifest& m, const image::LazyImage& lazy) {
  wire::Header hello;
  hello.set_request_id(1);
  hello.mutable_hello()->set_min_version(1);
  hello.mutable_hello()->set_max_version(1);
  hello.mutable_hello()->set_client_name("fuzz");
  wire::Header open;
  open.set_request_id(2);
  open.mutable_open_image()->set_image("ckpt");
  wire::Header credit;
  credit.mutable_credit()->set_bytes(16u << 20);
  wire::Header stream;
  stream.set_request_id(3);
  stream.mutable_request()->set_stream_all(true);
  wire::Header demand;
  demand.set_request_id(4);
  demand.mutable_request()->set_priority(wire::PRIORITY_DEMAND);
  wire::ChunkRange* range = demand.mutable_request()->add_ranges();
  range->set_bo(1);
  range->set_first_chunk(2);
  range->set_chunk_count(3);
  wire::Header have;
  *have.mutable_have()->add_ranges() = *range;
  wire::Header stats;
  stats.mutable_stats_request();
  wire::Header bye;
  bye.mutable_goodbye();

  corpus.Add("frame", "hello", Frame(hello));
  corpus.Add("frame", "client-session",
             Concat({Frame(hello), Frame(open), Frame(credit), Frame(have), Frame(stream),
                     Frame(demand), Frame(stats), Frame(bye)}));

  // Server to client: replies and a chunk with its payload.
  wire::Header reply;
  wire::OpenImageReply* body = reply.mutable_open_image_reply();
  body->set_session(1);
  body->set_session_secret(std::string(16, 's'));
  body->set_chunk_size(m.chunk_size());
  body->set_lazy_image(true);
  for (const manifest::Bo& bo : m.bos()) {
    wire::BoInfo* info = body->add_bos();
    info->set_size(bo.size());
    info->set_chunk_count(static_cast<uint32_t>(bo.chunks_size()));
  }
  std::vector<uint8_t> stored;
  (void)lazy.ReadStoredChunk(0, 0, &stored);
  wire::Header chunk;
  chunk.set_request_id(4);
  wire::ChunkData* data = chunk.mutable_chunk();
  data->set_codec(m.bos(0).chunks(0).codec());
  data->set_raw_length(m.bos(0).chunks(0).raw_length());
  data->set_checksum(m.bos(0).chunks(0).checksum());
  data->set_priority(wire::PRIORITY_DEMAND);
  wire::Header done;
  done.mutable_stream_done()->set_chunks(1);
  wire::Header error;
  error.mutable_error()->set_code(wire::ERROR_OUT_OF_RANGE);
  error.mutable_error()->set_message("BO 9 out of range");
  corpus.Add("frame", "server-session", Concat({Frame(reply), Frame(chunk, stored), Frame(done)}));
  corpus.Add("frame", "error", Frame(error));

  // Version 2: the same reply with its table as payload, in a first piece and two parts.
  wire::ImageTable table;
  table.mutable_bos()->Swap(body->mutable_bos());
  const std::string table_bytes = table.SerializeAsString();
  body->set_table_bytes(table_bytes.size());
  const size_t third = table_bytes.size() / 3;
  auto piece = [&](size_t offset, size_t length) {
    return FromString(table_bytes.substr(offset, length));
  };
  wire::Header part;
  part.set_request_id(2);
  part.mutable_image_table_part();
  corpus.Add("frame", "server-table-v2",
             Concat({Frame(reply, piece(0, third)), Frame(part, piece(third, third)),
                     Frame(part, piece(2 * third, std::string::npos)), Frame(done)}));

  // Edges: at the limits, one byte past them, truncated, unknown and empty bodies.
  const FrameLimits limits;
  corpus.Add("frame", "edge-empty-header", Prefix(0, 0));
  corpus.Add("frame", "edge-header-past-limit", Prefix(limits.max_header + 1, 0));
  corpus.Add("frame", "edge-payload-past-limit", Prefix(4, limits.max_payload + 1));
  corpus.Add("frame", "edge-payload-at-limit-truncated",
             Concat({Prefix(2, limits.max_payload), {0xba, 0x01}}));  // Goodbye (field 22)
  Bytes full = Frame(chunk, stored);
  corpus.Add("frame", "edge-truncated-payload", Bytes(full.begin(), full.end() - 1));
  corpus.Add("frame", "edge-truncated-prefix", Bytes(full.begin(), full.begin() + 5));
  corpus.Add("frame", "edge-unknown-field",
             Concat({Prefix(3, 0), {0xf8, 0x07, 0x01}}));  // field 127, no known body
  corpus.Add("frame", "edge-tag-zero", Concat({Prefix(4, 0), {0xba, 0x01, 0x00, 0x00}}));
}

void ManifestCorpus(Corpus& corpus, manifest::Manifest m) {
  m.set_created_unix_s(0);  // the only field that changes between runs
  auto payload = [](const manifest::Manifest& message) {
    Bytes out{0};  // mode 0: the harness writes the header
    std::string bytes = message.SerializeAsString();
    out.insert(out.end(), bytes.begin(), bytes.end());
    return out;
  };
  corpus.Add("manifest", "tiny", payload(m));

  manifest::Manifest profiled = m;
  manifest::AccessProfile* profile = profiled.mutable_profile();
  for (int b = profiled.bos_size() - 1; b >= 0; --b) {
    if (profiled.bos(b).chunks_size() == 0) continue;
    manifest::ChunkRef* ref = profile->add_order();
    ref->set_bo(static_cast<uint32_t>(b));
    ref->set_chunk(0);
  }
  profile->set_hot_count(static_cast<uint32_t>(profile->order_size() / 2));
  corpus.Add("manifest", "profiled", payload(profiled));

  // Mode 1: the whole file, header and checksum included, as WriteManifest lays it out.
  const std::string message = m.SerializeAsString();
  FileHeader header;
  header.magic = kManifestMagic;
  header.payload_length = message.size();
  header.payload_checksum = Checksum64(AsBytes(message));
  const auto head = EncodeFileHeader(header);
  Bytes whole{1};
  whole.insert(whole.end(), head.begin(), head.end());
  whole.insert(whole.end(), message.begin(), message.end());
  corpus.Add("manifest", "whole-file", whole);

  manifest::Manifest edge = m;
  edge.set_chunk_size(image::kMaxChunkSize * 2);
  corpus.Add("manifest", "edge-chunk-size-past-limit", payload(edge));
  edge = m;
  edge.mutable_bos(0)->mutable_chunks(0)->set_stored_offset(m.chunk_file_bytes());
  corpus.Add("manifest", "edge-stored-past-end", payload(edge));
  edge = m;
  edge.mutable_bos(0)->set_source_file("../../etc/passwd");
  corpus.Add("manifest", "edge-source-escapes", payload(edge));
  edge = m;
  edge.mutable_profile()->add_order()->set_bo(static_cast<uint32_t>(m.bos_size()));
  corpus.Add("manifest", "edge-profile-past-table", payload(edge));
}

void CriuCorpus(Corpus& corpus, const fs::path& dir) {
  Result<image::CriuCheckpoint> checkpoint = image::CriuCheckpoint::Open(dir);
  if (!checkpoint.ok() || checkpoint->processes().empty()) {
    std::fprintf(stderr, "fuzz_make_corpus: tiny checkpoint does not open\n");
    std::exit(1);
  }
  const criu::KfdProcess& process = checkpoint->processes()[0].message;
  auto input = [](uint8_t mode, const criu::KfdProcess& message) {
    Bytes out{mode};
    std::string bytes = message.SerializeAsString();
    out.insert(out.end(), bytes.begin(), bytes.end());
    return out;
  };
  corpus.Add("criu", "tiny-without-pages", input(0, process));
  corpus.Add("criu", "tiny-with-pages", input(2, process));
  Bytes whole{3};
  Bytes header(criu_format::kHeaderSize);
  const std::string message = process.SerializeAsString();
  criu_format::EncodeHeader(message.size(), header.data());
  whole.insert(whole.end(), header.begin(), header.end());
  whole.insert(whole.end(), message.begin(), message.end());
  corpus.Add("criu", "whole-file-with-pages", whole);

  criu::KfdProcess edge = process;
  edge.set_bo_count(edge.bo_count() + 1);
  corpus.Add("criu", "edge-bo-count-lies", input(2, edge));
  edge = process;
  if (edge.devices_size() > 0) *edge.add_devices() = edge.devices(0);
  edge.set_gpu_count(static_cast<uint32_t>(edge.devices_size()));
  corpus.Add("criu", "edge-gpu-listed-twice", input(2, edge));
  edge = process;
  if (edge.bos_size() > 1) {
    edge.mutable_bos(0)->set_size(UINT64_MAX - 4095);
    edge.mutable_bos(0)->set_alloc_flags(criu_format::kAllocVram);
  }
  corpus.Add("criu", "edge-bo-size-overflows", input(2, edge));
  edge = process;
  if (edge.bos_size() > 0) edge.mutable_bos(0)->set_gpu_id(0xdead);
  corpus.Add("criu", "edge-bo-on-unknown-gpu", input(2, edge));
  corpus.Add("criu", "edge-empty", Bytes{0});
}

void ChunkCodecCorpus(Corpus& corpus) {
  auto input = [](manifest::Codec codec, uint32_t raw_length, const Bytes& stored) {
    Bytes out{static_cast<uint8_t>(codec), static_cast<uint8_t>(raw_length),
              static_cast<uint8_t>(raw_length >> 8), static_cast<uint8_t>(raw_length >> 16)};
    out.insert(out.end(), stored.begin(), stored.end());
    return out;
  };
  Bytes content(4096);
  for (size_t i = 0; i < content.size(); ++i)
    content[i] = static_cast<uint8_t>((i / 64) * 7);
  Bytes block(static_cast<size_t>(LZ4_compressBound(static_cast<int>(content.size()))));
  const int n = LZ4_compress_default(
      reinterpret_cast<const char*>(content.data()), reinterpret_cast<char*>(block.data()),
      static_cast<int>(content.size()), static_cast<int>(block.size()));
  block.resize(static_cast<size_t>(n));
  const uint32_t size = static_cast<uint32_t>(content.size());
  corpus.Add("chunk_codec", "raw", input(manifest::CODEC_RAW, size, content));
  corpus.Add("chunk_codec", "zero", input(manifest::CODEC_ZERO, size, {}));
  corpus.Add("chunk_codec", "lz4", input(manifest::CODEC_LZ4, size, block));
  corpus.Add("chunk_codec", "edge-lz4-decodes-to-more",
             input(manifest::CODEC_LZ4, size - 1, block));
  corpus.Add("chunk_codec", "edge-lz4-decodes-to-less",
             input(manifest::CODEC_LZ4, size + 1, block));
  corpus.Add("chunk_codec", "edge-lz4-truncated",
             input(manifest::CODEC_LZ4, size, Bytes(block.begin(), block.end() - 3)));
  corpus.Add("chunk_codec", "edge-raw-short", input(manifest::CODEC_RAW, size + 1, content));
  corpus.Add("chunk_codec", "edge-zero-with-bytes", input(manifest::CODEC_ZERO, 16, {1, 2, 3}));
  corpus.Add("chunk_codec", "edge-unknown-codec", input(static_cast<manifest::Codec>(3), 4, {0}));
  // Reproducers of bugs the fuzzers found (docs/hostile-input.md), kept here so a regenerated
  // corpus still has them.
  corpus.Add("chunk_codec", "crash-zero-codec-empty-raw", input(manifest::CODEC_ZERO, 0, {}));
}

// Scripts for the server harness (server_script.h): whole restores in each shape a client opens
// them (stream, lanes, a demand connection, files by reference, placed into memfds), then abuse.
// `m`: the tiny image's manifest, whose BO table the server lists.
void ServerCorpus(Corpus& corpus, const manifest::Manifest& m) {
  using namespace fuzz::server_script;
  const auto bo_count = static_cast<uint8_t>(m.bos_size());
  auto opened = [](uint8_t image, bool tcp) {
    ScriptWriter w;
    w.Connect(0, tcp).Hello(0, 2).Open(0, image).Sync(0);
    return w;
  };
  {
    ScriptWriter w = opened(0, false);
    w.Credit(0, 255).StreamAll(0, false).Drain(0, 3);
    corpus.Add("server", "stream-raw-unix", w.bytes());
  }
  {
    // One chunk's credit at a time: the server must stop after each.
    ScriptWriter w = opened(0, true);
    w.Credit(0, 0).StreamAll(0, false).Drain(0, 3).Credit(0, 0).Drain(0, 3).Credit(0, 1);
    w.Drain(0, 3);
    corpus.Add("server", "stream-raw-credit-by-the-page", w.bytes());
  }
  {
    ScriptWriter w = opened(1, true);
    w.Connect(1, true).Join(1, 0, kHelloLane).Sync(1).Credit(0, 255).StreamAll(0, false);
    w.Drain(1, 3).Drain(0, 3);
    corpus.Add("server", "stream-lazy-tcp-lane", w.bytes());
  }
  {
    ScriptWriter w = opened(1, false);
    w.Connect(1, false).Join(1, 0, 0).Sync(1).Ask(1, wire::PRIORITY_DEMAND, 0, 0, 2).Drain(1, 3);
    corpus.Add("server", "demand-connection", w.bytes());
  }
  {
    ScriptWriter w = opened(0, false);
    w.Connect(1, false).Join(1, 0, kHelloWantFiles | kHelloChunkTable).Sync(1);
    w.Credit(0, 16).StreamAll(0, true).Drain(0, 3);
    corpus.Add("server", "files-by-reference", w.bytes());
  }
  {
    ScriptWriter w = opened(1, false);
    w.Connect(1, false).Op(kHello, 1).Byte(1).Byte(2).Byte(kHelloJoin).Byte(0).String("seed");
    w.String("not the secret").Sync(1);
    corpus.Add("server", "wrong-secret", w.bytes());
  }
  {
    ScriptWriter w;
    w.Connect(0, false).Hello(0, 1);
    for (uint8_t name = 2; name < kImageNameCount; ++name)
      w.Open(0, name).Sync(0);
    w.Op(kOpenImage, 0).Byte(kImageString).String("./lazy").Sync(0);
    corpus.Add("server", "bad-image-names", w.bytes());
  }
  {
    // A name the server quotes in its error, cut at 256 bytes: inside the two-byte character.
    ScriptWriter w;
    w.Connect(0, false).Hello(0, 2);
    w.Op(kOpenImage, 0).Byte(kImageString).String(std::string(255, 'a') + "\u00e9/x").Sync(0);
    corpus.Add("server", "long-name-cut-in-a-character", w.bytes());
  }
  {
    ScriptWriter w = opened(1, false);
    w.Ask(0, wire::PRIORITY_BACKGROUND, 200, 0, 1).Ask(0, wire::PRIORITY_PREFETCH, 0, 31, 31);
    w.Op(kHave, 0).Byte(1).Byte(0).Byte(0xFF).U32(0xFFFFFFFF).Byte(5);
    w.Op(kCredit, 0).Byte(kCreditMax).Op(kCredit, 0).Byte(kCreditMax).StreamAll(0, false);
    w.StreamAll(0, false).Drain(0, 3);
    corpus.Add("server", "out-of-range-and-credit-overflow", w.bytes());
  }
  {
    ScriptWriter w = opened(0, true);
    w.Op(kJunk, 0).Byte(7).U64(0x0123456789ABCDEF);
    w.Connect(1, false).Op(kPrefix, 1).U32(0xFFFFFFF0).U32(16);
    corpus.Add("server", "junk-and-prefix", w.bytes());
  }
  {
    // For the TLS mode (GPULAZY_FUZZ_TLS=1; plain TCP otherwise): a Hello in plain text to the
    // TLS listener, a whole restore inside TLS next to a session whose TLS records junk under TLS
    // corrupts, and junk inside TLS.
    ScriptWriter w;
    w.ConnectWithoutHandshake(0).Hello(0, 2).Sync(0);
    w.Connect(1, true).Hello(1, 2).Open(1, 0).Sync(1);
    w.Connect(2, true).Hello(2, 2).Open(2, 1).Credit(2, 255).StreamAll(2, false);
    w.Op(kJunk, 1).Byte(kJunkBelowTls | 7).U64(0x0123456789ABCDEF).Drain(1, 3);
    w.Drain(2, 3).Sync(2);
    w.Connect(3, true).Hello(3, 2).Op(kJunk, 3).Byte(7).U64(0xFEDCBA9876543210).Drain(3, 3);
    corpus.Add("server", "tls-plain-text-junk-under-and-inside", w.bytes());
  }
  {
    // Found by the TLS mode (session 55): a TCP connection that ends its side without a byte
    // once the server waits for its first bytes was held until the Hello deadline (the fuzzer's
    // 5 s limit caught it; the replay waits longer). A restore on a second connection meanwhile.
    ScriptWriter w;
    w.ConnectWithoutHandshake(0).Connect(1, true).Hello(1, 2).Open(1, 0).Sync(1);
    w.Op(kShutWrite, 0).Credit(1, 255).StreamAll(1, false).Drain(1, 3);
    corpus.Add("server", "tls-a-connection-ends-before-its-first-byte", w.bytes());
  }
  // PlaceInto (the harness's server places into memfds): a good destination for each BO in
  // [first, end), kMaxPlaceTargets a frame.
  auto place_all = [](ScriptWriter& w, uint8_t slot, uint8_t first, uint8_t end) {
    while (first < end) {
      const auto n = static_cast<uint8_t>(std::min<int>(end - first, kMaxPlaceTargets));
      w.PlaceInto(slot, kPlaceKindMemfd, kPlaceDeviceNone, n);
      for (uint8_t i = 0; i < n; ++i)
        w.GoodTarget(static_cast<uint8_t>(first + i));
      first = static_cast<uint8_t>(first + n);
    }
  };
  {
    ScriptWriter w = opened(0, false);
    place_all(w, 0, 0, bo_count);
    w.Credit(0, 255).StreamAllPlaced(0).Drain(0, 3);
    corpus.Add("server", "place-memfd-stream-raw", w.bytes());
  }
  {
    // Destinations in two frames; the placed stream over a lane too, and a placed demand request.
    ScriptWriter w = opened(1, false);
    w.Connect(1, false).Join(1, 0, kHelloLane).Sync(1);
    w.Connect(2, false).Join(2, 0, 0).Sync(2);
    place_all(w, 0, 0, bo_count / 2);
    place_all(w, 0, bo_count / 2, bo_count);
    w.Credit(0, 255).StreamAllPlaced(0);
    w.Ask(2, wire::PRIORITY_DEMAND, 0, 0, 2, kRequestPlaced).Drain(2, 3).Drain(1, 3).Drain(0, 3);
    corpus.Add("server", "place-memfd-lazy-lane-and-demand", w.bytes());
  }
  {
    // One refusal each, then two good destinations and a placed stream: the other BOs as bytes.
    // The files connection first, so that placed with by_reference meets its own refusal.
    ScriptWriter w = opened(0, false);
    w.Connect(1, false).Join(1, 0, kHelloWantFiles).Sync(1);
    auto one = [&](uint8_t kind, uint8_t device) -> ScriptWriter& {
      return w.PlaceInto(0, kind, device, 1);
    };
    w.StreamAllPlaced(0);  // no destinations yet
    one(kPlaceKindCuda, kPlaceDeviceNone).GoodTarget(0);
    one(kPlaceKindMemfd, kPlaceDeviceUuid).U64(0x0123456789abcdef).U64(0xfedcba9876543210);
    w.GoodTarget(0);
    one(kPlaceKindString, kPlaceDeviceNone).String("memfd ").GoodTarget(0);
    one(kPlaceKindEmpty, kPlaceDeviceString).String("gpu0").GoodTarget(0);
    one(kPlaceKindMemfd, kPlaceDeviceNone).Target(kPlaceBoPastEnd, 0, kPlaceSizeBo, kHandleMemfd);
    one(kPlaceKindMemfd, kPlaceDeviceNone).Target(kPlaceBoAny, 0, kPlaceSizeBo, kHandleMemfd);
    w.U32(0xFFFFFFFF);
    w.PlaceInto(0, kPlaceKindMemfd, kPlaceDeviceNone, 2).GoodTarget(1);
    w.Target(kPlaceBoRepeat, 0, kPlaceSizeBo, kHandleMemfd);
    one(kPlaceKindMemfd, kPlaceDeviceNone).Target(kPlaceBoValid, 0, kPlaceSizeShort, kHandleMemfd);
    one(kPlaceKindMemfd, kPlaceDeviceNone).Target(kPlaceBoValid, 0, kPlaceSizeAny, kHandleMemfd);
    w.U64(UINT64_MAX);
    one(kPlaceKindMemfd, kPlaceDeviceNone).Target(kPlaceBoValid, 0, kPlaceSizeLarger, kHandleMemfd);
    one(kPlaceKindMemfd, kPlaceDeviceNone)
        .Target(kPlaceBoValid, 0, kPlaceSizeBo, kHandleShortMemfd);
    one(kPlaceKindMemfd, kPlaceDeviceNone)
        .Target(kPlaceBoValid, 0, kPlaceSizeBo, kHandleSealedMemfd);
    one(kPlaceKindMemfd, kPlaceDeviceNone).Target(kPlaceBoValid, 0, kPlaceSizeBo, kHandlePipe);
    for (uint32_t number : {0u, 1000u, 0x7FFFFFFFu, 0x80000000u, 0xFFFFFFFFu})
      one(kPlaceKindMemfd, kPlaceDeviceNone)
          .Target(kPlaceBoValid, 0, kPlaceSizeBo, kHandleNumber)
          .U32(number);
    for (const char* junk : {"", "abc", "12345"})
      one(kPlaceKindMemfd, kPlaceDeviceNone)
          .Target(kPlaceBoValid, 0, kPlaceSizeBo, kHandleBytes)
          .String(junk);
    one(kPlaceKindMemfd, kPlaceDeviceNone).GoodTarget(0);
    one(kPlaceKindMemfd, kPlaceDeviceNone).GoodTarget(0);  // BO 0 has its destination already
    w.Ask(0, wire::PRIORITY_PREFETCH, 0, 0, 1, kRequestPlaced | kRequestByReference);
    one(kPlaceKindMemfd, kPlaceDeviceNone)
        .Target(kPlaceBoValid, 1, kPlaceSizeLarger, kHandleLargerMemfd);
    w.PlaceInto(0, kPlaceKindMemfd, kPlaceDeviceNone, 0);  // none: answered with the count
    w.Credit(0, 255).StreamAllPlaced(0).Drain(0, 3);
    corpus.Add("server", "place-malformed", w.bytes());
  }
  {
    // PlaceInto before OpenImage, over TCP, on a demand connection and on a lane: refused; then
    // accepted on the stream connection, and a placed demand request.
    ScriptWriter w;
    w.Connect(0, false).Hello(0, 2);
    w.PlaceInto(0, kPlaceKindMemfd, kPlaceDeviceNone, 1).GoodTarget(0);
    w.Open(0, 0).Sync(0);
    w.Connect(1, true).Hello(1, 2).Open(1, 0).Sync(1);
    w.PlaceInto(1, kPlaceKindMemfd, kPlaceDeviceNone, 1).GoodTarget(0);
    w.Connect(2, false).Join(2, 0, 0).Sync(2);
    w.PlaceInto(2, kPlaceKindMemfd, kPlaceDeviceNone, 1).GoodTarget(0);
    w.Connect(3, false).Join(3, 0, kHelloLane).Sync(3);
    w.PlaceInto(3, kPlaceKindMemfd, kPlaceDeviceNone, 1).GoodTarget(0);
    w.PlaceInto(0, kPlaceKindMemfd, kPlaceDeviceNone, 1).GoodTarget(0);
    w.Ask(2, wire::PRIORITY_DEMAND, 0, 0, 3, kRequestPlaced).Drain(2, 3);
    corpus.Add("server", "place-on-the-wrong-connections", w.bytes());
  }
  {
    // Two BOs into one memfd (the larger BO's, a page larger): accepted; the server writes both
    // there, so the harness checks nothing of that memfd's bytes.
    uint8_t big = 0;
    uint8_t other = 1;
    if (m.bos_size() > 1 && m.bos(1).size() > m.bos(0).size()) std::swap(big, other);
    ScriptWriter w = opened(0, false);
    w.PlaceInto(0, kPlaceKindMemfd, kPlaceDeviceNone, 2);
    w.Target(kPlaceBoValid, big, kPlaceSizeBo, kHandleLargerMemfd);
    w.Target(kPlaceBoValid, other, kPlaceSizeBo, kHandleLastMemfd);
    w.Credit(0, 255).StreamAllPlaced(0).Drain(0, 3);
    corpus.Add("server", "place-two-bos-into-one-memfd", w.bytes());
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_make_corpus OUT_DIR\n");
    return 2;
  }
  Corpus corpus{fs::path(argv[1])};
  const fs::path dir = fuzz::ScratchDir() / "image";
  Status made = fuzz::MakeTinyCheckpoint(dir, /*lazy=*/true);
  if (!made.ok()) {
    std::fprintf(stderr, "fuzz_make_corpus: %s\n", made.ToString().c_str());
    return 1;
  }
  Result<image::LazyImage> lazy = image::LazyImage::Open(dir);
  if (!lazy.ok()) {
    std::fprintf(stderr, "fuzz_make_corpus: %s\n", lazy.status().ToString().c_str());
    return 1;
  }
  FrameCorpus(corpus, lazy->manifest(), *lazy);
  ManifestCorpus(corpus, lazy->manifest());
  CriuCorpus(corpus, dir);
  ChunkCodecCorpus(corpus);
  ServerCorpus(corpus, lazy->manifest());
  std::printf("fuzz_make_corpus: wrote %d inputs under %s\n", corpus.count(), argv[1]);
  return 0;
}
