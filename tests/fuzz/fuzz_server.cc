// libFuzzer harness: the page server's connection and session state machine (lazy-server/
// server/session.cc and what it drives) against a hostile client.
//
// One gpulazy-server runs in this process for the harness's life (Unix socket and loopback TCP,
// two images of the tiny seed checkpoint: "raw" served from its CRIU pages files, "lazy"
// converted). Each input is a script (server_script.h) of actions on up to four connections:
// Hello with any versions, joins with right and wrong secrets (demand connections, lanes, the
// files connection), OpenImage with good and bad names, requests with any ranges, priorities
// and flags, Credit of any size, Have, stats, Goodbye, junk bytes, half-closes and resets.
//
// Checks, besides the sanitizers:
//   - every frame the server sends decodes within the client's limits;
//   - an OpenImage is accepted only for "raw" and "lazy" (or a string naming one of them), as
//     the image it names, and a join only for a session this input opened, with its secret;
//   - every ChunkData names a chunk of its session's image, has the raw length the image says,
//     decodes and passes its own checksum, and holds exactly the checkpoint's bytes (read
//     straight from the CRIU pages files, not through the server's code);
//   - a session's bulk connections never carry more chunk bytes than its stream connection
//     granted in Credit (by-reference chunks count their stored length, as the protocol says);
//   - the stream (stream_all: ChunkData with request id 0; the harness never gives a request
//     that id) sends each chunk of a session once at most, on each bulk connection in the
//     order docs/protocol.md promises (the "lazy" image carries a profile: its hot set at
//     PREFETCH, then the rest of its order, then table order at BACKGROUND), and nothing on a
//     connection after that connection's StreamDone;
//   - at the end of the script every connection answers a stats request or closes, in time
//     (5 s when fuzzing);
//   - after every input a fresh client still gets a correct chunk.
#include <arpa/inet.h>
#include <google/protobuf/stubs/logging.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/io.h"
#include "lazy-server/image/lazy_image.h"
#include "lazy-server/server/server.h"
#include "proto/criu_file.h"
#include "proto/frame.h"
#include "tests/fuzz/fuzz_support.h"
#include "tests/fuzz/server_script.h"

namespace {

namespace fs = std::filesystem;
using namespace gpulazy;
using namespace gpulazy::fuzz::server_script;
using Clock = std::chrono::steady_clock;

// Longer than any answer takes even under sanitizers on a loaded 2-core machine. Fuzzing: shorter
// than scripts/fuzz.sh's -timeout, so a hang is reported with what hung; the corpus replay
// (GPULAZY_FUZZ_TARGET is defined) shares CI's cores with other tests, and waits longer.
#ifdef GPULAZY_FUZZ_TARGET
constexpr auto kSilenceLimit = std::chrono::seconds(30);
#else
constexpr auto kSilenceLimit = std::chrono::seconds(5);
#endif
constexpr uint64_t kBarrierId = uint64_t{1} << 62;
constexpr uint64_t kOpenIdBase = uint64_t{1} << 61;

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "fuzz_server: %s\n", what.c_str());
  std::abort();
}

class ScriptReader {
 public:
  explicit ScriptReader(std::span<const uint8_t> bytes) : bytes_(bytes) {}
  bool done() const { return pos_ >= bytes_.size(); }
  uint8_t U8() { return pos_ < bytes_.size() ? bytes_[pos_++] : 0; }
  uint32_t U32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i)
      v |= uint32_t{U8()} << (8 * i);
    return v;
  }
  uint64_t U64() {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i)
      v |= uint64_t{U8()} << (8 * i);
    return v;
  }
  std::string String() {
    // Mostly short; a length byte from kLongString up is 248-263 bytes, across the 256 at which
    // the server cuts names it quotes.
    const uint8_t b = U8();
    const size_t length = b < kLongString ? b % 32 : 248 + (b - kLongString);
    std::string s;
    for (size_t i = 0; i < length; ++i)
      s.push_back(static_cast<char>(U8()));
    return s;
  }
  uint32_t Small() {
    const uint8_t b = U8();
    return b < kSmallLimit ? b % 32 : U32();
  }

 private:
  std::span<const uint8_t> bytes_;
  size_t pos_ = 0;
};

// One image as the server's table lists it, with every BO's bytes read from the pages files,
// and where each chunk stands in the stream's order.
struct ImageOracle {
  uint32_t chunk_size = 0;
  std::vector<wire::BoInfo> bos;
  std::vector<std::vector<uint8_t>> contents;  // by table index
  std::vector<uint32_t> first_flat;            // by table index: its chunk 0's flat index
  std::vector<uint32_t> stream_position;       // by flat index
  uint32_t hot_count = 0;                      // positions under it are the hot set
};

// The order docs/protocol.md gives stream_all, from the profile the harness wrote (not the
// server's plan): the profile's entries, then every other chunk in table order.
void PlanStream(ImageOracle& image, const manifest::AccessProfile& profile) {
  uint32_t flat = 0;
  for (const wire::BoInfo& bo : image.bos) {
    image.first_flat.push_back(flat);
    flat += bo.chunk_count();
  }
  constexpr uint32_t kUnplanned = std::numeric_limits<uint32_t>::max();
  image.stream_position.assign(flat, kUnplanned);
  uint32_t next = 0;
  for (const manifest::ChunkRef& ref : profile.order())
    image.stream_position[image.first_flat[ref.bo()] + ref.chunk()] = next++;
  image.hot_count = profile.hot_count();
  for (uint32_t& position : image.stream_position)
    if (position == kUnplanned) position = next++;
}

// A profile for the tiny lazy image: every third chunk from the end backwards, its first three
// the hot set, so the stream's order differs from table order in both of its parts.
manifest::AccessProfile TinyProfile(const manifest::Manifest& manifest) {
  std::vector<manifest::ChunkRef> chunks;
  for (int bo = 0; bo < manifest.bos_size(); ++bo)
    for (int chunk = 0; chunk < manifest.bos(bo).chunks_size(); ++chunk) {
      manifest::ChunkRef ref;
      ref.set_bo(static_cast<uint32_t>(bo));
      ref.set_chunk(static_cast<uint32_t>(chunk));
      chunks.push_back(ref);
    }
  manifest::AccessProfile profile;
  for (size_t i = chunks.size(); i >= 3; i -= 3)
    *profile.add_order() = chunks[i - 1];
  profile.set_hot_count(3);
  profile.set_source("fuzz harness");
  return profile;
}

std::map<std::pair<uint32_t, uint32_t>, std::vector<uint8_t>> ReadCriuContents(
    const fs::path& dir) {
  Result<image::CriuCheckpoint> checkpoint = image::CriuCheckpoint::Open(dir);
  if (!checkpoint.ok()) Die("seed checkpoint: " + checkpoint.status().ToString());
  std::map<std::pair<uint32_t, uint32_t>, std::vector<uint8_t>> out;
  for (const image::ContentBo& bo : checkpoint->content_bos()) {
    std::vector<uint8_t> bytes(bo.size);
    if (bo.size > 0) {
      Result<UniqueFd> fd = OpenForRead(dir / bo.pages_file);
      Status read = fd.ok() ? ReadExactAt(fd->get(), criu_format::kHeaderSize + bo.pages_offset,
                                          bytes, bo.pages_file)
                            : fd.status();
      if (!read.ok()) Die("seed checkpoint: " + read.ToString());
    }
    out[{bo.process_id, bo.bo_index}] = std::move(bytes);
  }
  return out;
}

struct SessionState {
  const ImageOracle* image = nullptr;
  std::vector<bool> streamed;  // by flat index: sent by the stream
  std::string secret;
  uint64_t granted = 0;  // Credit sent on its stream connection, saturating
  uint64_t charged = 0;  // chunk bytes its bulk connections carried
};

uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  return a > std::numeric_limits<uint64_t>::max() - b ? std::numeric_limits<uint64_t>::max()
                                                      : a + b;
}

struct Slot {
  enum class Role { kNone, kStream, kDemand, kLane, kFiles };
  UniqueFd fd;
  Role role = Role::kNone;
  bool hello_sent = false;
  bool write_closed = false;  // shut down by us, or a send failed
  bool garbled = false;       // we sent bytes that are not whole frames
  bool eof = false;
  std::string name;                // for messages
  uint64_t join_id = 0;            // the session a joining Hello named
  bool join_secret_right = false;  // and whether it carried that session's secret
  bool session_known = false;      // session_id is set: opened here or joined
  uint64_t session_id = 0;
  struct Open {
    int choice = -1;  // kImageNames index (kImageString: a string)
    std::string name;
  };
  std::map<uint64_t, Open> opens;     // OpenImage requests sent, by request id
  uint64_t pending_credit = 0;        // granted before this slot's session existed
  uint64_t table_left = 0;            // version 2: table bytes still to come in ImageTablePart
  int64_t last_stream_position = -1;  // of the stream's chunks this connection carried
  bool stream_done = false;           // this connection got its StreamDone
  std::vector<uint8_t> inbox;
  uint64_t bytes_received = 0;
};

class Harness {
 public:
  Harness() {
    spdlog::set_level(spdlog::level::off);
    // Protobuf logs every invalid UTF-8 string it serializes or parses; scripts send many.
    google::protobuf::SetLogHandler(nullptr);
    const fs::path dir = fuzz::ScratchDir() / "server";
    const fs::path root = dir / "images";
    fs::create_directories(root);
    for (const char* name : {"raw", "lazy"}) {
      Status made = fuzz::MakeTinyCheckpoint(root / name, std::string(name) == "lazy");
      if (!made.ok()) Die("seed checkpoint: " + made.ToString());
    }
    Result<image::LazyImage> lazy = image::LazyImage::Open(root / "lazy");
    if (!lazy.ok()) Die("seed lazy image: " + lazy.status().ToString());
    manifest::Manifest with_profile = lazy->manifest();
    *with_profile.mutable_profile() = TinyProfile(with_profile);
    if (Status written = image::WriteManifest(root / "lazy", with_profile); !written.ok())
      Die("seed lazy image's profile: " + written.ToString());
    server::ServerConfig config;
    config.image_roots = {root};
    config.listen = {*net::Endpoint::Parse("unix:" + (dir / "s.sock").string()),
                     *net::Endpoint::Parse("tcp:127.0.0.1:0")};
    config.insecure_tcp = true;
    config.io_threads = 2;
    config.demand_io_threads = 1;
    config.disk_threads = 2;
    config.demand_threads = 1;
    config.raw_chunk_size = fuzz::kTinyChunkSize;
    // Small limits, so short scripts reach them.
    config.max_lanes = 2;
    config.max_demand = 16;
    config.max_queued = 64;
    config.stream_window = 2;
    config.demand_window = 2;
    config.chunk_buffers = 4;
    config.shutdown_grace = std::chrono::milliseconds(200);
    config.handle_signals = false;
    server_ = std::make_unique<server::Server>(config);
    if (Status listening = server_->Listen(); !listening.ok())
      Die("server: " + listening.ToString());
    runner_ = std::thread([this] { server_->Run(); });
    for (const net::Endpoint& endpoint : server_->bound()) {
      if (endpoint.kind == net::Endpoint::Kind::kUnix) unix_path_ = endpoint.path;
      if (endpoint.kind == net::Endpoint::Kind::kTcp) tcp_port_ = endpoint.port;
    }
    raw_ = LoadOracle("raw", root / "raw");
    lazy_ = LoadOracle("lazy", root / "lazy");
    PlanStream(raw_, {});
    PlanStream(lazy_, with_profile.profile());
    checking_ = true;
  }
  ~Harness() {
    server_->Stop();
    runner_.join();
  }
  Harness(const Harness&) = delete;
  Harness& operator=(const Harness&) = delete;

  void RunScript(std::span<const uint8_t> input) {
    std::array<Slot, kSlots> slots;
    for (uint32_t i = 0; i < kSlots; ++i)
      slots[i].name = "connection " + std::to_string(i);
    sessions_.clear();
    seen_ = {};
    ScriptReader script(input);
    while (!script.done())
      Step(script, slots);
    for (Slot& slot : slots)
      Finish(slot);
    for (Slot& slot : slots)
      slot.fd.reset();
    const Seen script_seen = seen_;
    Probe();
    // GPULAZY_FUZZ_VERBOSE=1: what each input reached, to see that a seed does what it says.
    if (verbose_)
      std::fprintf(stderr,
                   "fuzz_server: %zu sessions, %u chunks checked (%u by reference, %u in the "
                   "stream's order), %u errors, %u hello replies, %u image files, %u stream ends\n",
                   sessions_.size() - 1, script_seen.chunks, script_seen.by_reference,
                   script_seen.stream_ordered, script_seen.errors, script_seen.hello_replies,
                   script_seen.image_files, script_seen.stream_done);
  }

 private:
  ImageOracle LoadOracle(const std::string& name, const fs::path& dir) {
    ImageOracle oracle;
    Slot slot;
    slot.name = "set-up client of " + name;
    Connect(slot, /*tcp=*/false);
    SendHello(slot, 1, 1, 0, 0, {}, {});
    Frame reply = ReadUntil(slot, [](const wire::Header& h) { return h.has_hello_reply(); });
    wire::Header open;
    open.set_request_id(1);
    open.mutable_open_image()->set_image(name);
    Send(slot, open);
    reply = ReadUntil(slot, [](const wire::Header& h) { return h.has_open_image_reply(); });
    const wire::OpenImageReply& table = reply.header.open_image_reply();
    oracle.chunk_size = table.chunk_size();
    const auto bytes = ReadCriuContents(dir);
    for (const wire::BoInfo& bo : table.bos()) {
      auto it = bytes.find({bo.process_id(), bo.bo_index()});
      if (it == bytes.end() || it->second.size() != bo.size())
        Die(name + ": a BO of the table is not in the checkpoint");
      oracle.bos.push_back(bo);
      oracle.contents.push_back(it->second);
    }
    if (oracle.bos.empty() || oracle.chunk_size != fuzz::kTinyChunkSize)
      Die(name + ": unexpected image table");
    return oracle;
  }

  struct Frame {
    wire::Header header;
    std::vector<uint8_t> payload;
  };

  // --- sending ---

  void Connect(Slot& slot, bool tcp) {
    const std::string name = slot.name;
    slot = Slot{};
    slot.name = name;
    int fd = ::socket(tcp ? AF_INET : AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) Die("socket failed");
    slot.fd.reset(fd);
    sockaddr_storage address{};
    socklen_t address_length;
    if (tcp) {
      auto* in = reinterpret_cast<sockaddr_in*>(&address);
      in->sin_family = AF_INET;
      in->sin_port = htons(tcp_port_);
      in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      address_length = sizeof(sockaddr_in);
      int one = 1;
      ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    } else {
      auto* un = reinterpret_cast<sockaddr_un*>(&address);
      un->sun_family = AF_UNIX;
      if (unix_path_.size() >= sizeof un->sun_path) Die("socket path too long");
      std::copy(unix_path_.begin(), unix_path_.end(), un->sun_path);
      address_length = sizeof(sockaddr_un);
    }
    // libFuzzer's timer signal may interrupt a connect: ask again until it says connected (a
    // TCP connect goes on in the background meanwhile: EALREADY, then EISCONN).
    int rc;
    while ((rc = ::connect(fd, reinterpret_cast<sockaddr*>(&address), address_length)) != 0 &&
           (errno == EINTR || errno == EALREADY)) {
      pollfd pfd{fd, POLLOUT, 0};
      ::poll(&pfd, 1, 10);
    }
    if (rc != 0 && errno == EISCONN) rc = 0;
    if (rc != 0) Die(slot.name + ": connect failed: " + std::strerror(errno));
  }

  void SendBytes(Slot& slot, std::span<const uint8_t> bytes) {
    if (!slot.fd.valid() || slot.write_closed) return;
    while (!bytes.empty()) {
      ssize_t n = ::send(slot.fd.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {  // the server closed or reset: nothing more reaches it
        slot.write_closed = true;
        return;
      }
      bytes = bytes.subspan(static_cast<size_t>(n));
    }
  }

  void Send(Slot& slot, const wire::Header& header) {
    Result<std::string> head = EncodeFrameHead(header, 0, FrameLimits{});
    if (!head.ok()) return;  // a header past the limits: nothing a client could send
    if (trace_ && checking_)
      std::fprintf(stderr, "fuzz_server: %s -> %s\n", slot.name.c_str(),
                   header.ShortDebugString().substr(0, 160).c_str());
    SendBytes(slot, std::span(reinterpret_cast<const uint8_t*>(head->data()), head->size()));
  }

  void SendHello(Slot& slot, uint32_t min_version, uint32_t max_version, uint64_t join_id,
                 uint8_t flags, const std::string& secret, const std::string& token) {
    wire::Header header;
    header.set_request_id(1000);
    wire::Hello* hello = header.mutable_hello();
    hello->set_min_version(min_version);
    hello->set_max_version(max_version);
    hello->set_client_name("fuzz");
    hello->set_join_session(join_id);
    hello->set_join_secret(secret);
    hello->set_want_files(flags & kHelloWantFiles);
    hello->set_want_chunk_table(flags & kHelloChunkTable);
    hello->set_join_as_lane(flags & kHelloLane);
    hello->set_token(token);
    if (!slot.hello_sent) {
      // The server takes the first frame as the Hello and ignores later ones; what role it gives
      // the connection follows from this one (session.cc, HandleHello).
      slot.hello_sent = true;
      const bool join = join_id != 0 || !secret.empty();
      if (!join) {
        slot.role =
            (flags & (kHelloWantFiles | kHelloLane)) ? Slot::Role::kNone : Slot::Role::kStream;
      } else {
        slot.role = (flags & kHelloWantFiles) ? Slot::Role::kFiles
                    : (flags & kHelloLane)    ? Slot::Role::kLane
                                              : Slot::Role::kDemand;
        slot.join_id = join_id;
        auto it = sessions_.find(join_id);
        slot.join_secret_right = it != sessions_.end() && it->second.secret == secret;
      }
    }
    Send(slot, header);
  }

  void Step(ScriptReader& script, std::array<Slot, kSlots>& slots) {
    const uint8_t op = script.U8() % kOpCount;
    Slot& slot = slots[script.U8() % kSlots];
    wire::Header header;
    header.set_request_id(script.U8());
    if (op != kConnect && !slot.fd.valid()) return;
    switch (op) {
      case kConnect:
        Connect(slot, script.U8() & 1);
        break;
      case kHello: {
        const uint32_t min_version = script.U8() % 4;
        const uint32_t max_version = script.U8() % 4;
        const uint8_t flags = script.U8();
        const Slot& source = slots[script.U8() % kSlots];
        script.String();  // the client name: not interesting enough to vary
        uint64_t join_id = 0;
        std::string secret;
        if (flags & kHelloJoin) {
          join_id = (flags & kHelloRandomId) ? script.U64()
                    : source.session_known   ? source.session_id
                                             : 0;
          if (flags & kHelloRightSecret) {
            auto it = sessions_.find(join_id);
            if (it != sessions_.end()) secret = it->second.secret;
          } else {
            secret = script.String();
          }
        }
        const std::string token = (flags & kHelloToken) ? script.String() : std::string();
        SendHello(slot, min_version, max_version, join_id, flags, secret, token);
        break;
      }
      case kOpenImage: {
        const int choice = script.U8() % (kImageNameCount + 1);
        const std::string name = choice == kImageString ? script.String() : kImageNames[choice];
        header.mutable_open_image()->set_image(name);
        // Its own id, so that the reply (which may come after more OpenImages) names the request.
        header.set_request_id(kOpenIdBase + next_open_id_++);
        slot.opens[header.request_id()] = {choice, name};
        Send(slot, header);
        break;
      }
      case kRequest: {
        wire::Request* request = header.mutable_request();
        request->set_priority(static_cast<wire::Priority>(script.U8() % 4));
        const uint8_t flags = script.U8();
        request->set_stream_all(flags & kRequestStreamAll);
        // Id 0 marks the stream's own chunks (ChunkData echoes the request's id): a request's
        // chunks must be told apart from them.
        if (!request->stream_all() && header.request_id() == 0) header.set_request_id(256);
        request->set_by_reference(flags & kRequestByReference);
        for (int n = script.U8() % 4; n > 0; --n) {
          wire::ChunkRange* range = request->add_ranges();
          range->set_bo(script.U8());
          range->set_first_chunk(script.Small());
          range->set_chunk_count(script.Small());
        }
        Send(slot, header);
        break;
      }
      case kCredit: {
        const uint8_t kind = script.U8() % 4;
        const uint64_t bytes = kind == kCreditZero    ? 0
                               : kind == kCreditPages ? (uint64_t{script.U8()} + 1) * 4096
                               : kind == kCreditAny   ? script.U64()
                                                      : std::numeric_limits<uint64_t>::max();
        header.mutable_credit()->set_bytes(bytes);
        if (slot.role == Slot::Role::kStream && !slot.write_closed) {
          if (slot.session_known) {
            SessionState& session = sessions_[slot.session_id];
            session.granted = SaturatingAdd(session.granted, bytes);
          } else {
            slot.pending_credit = SaturatingAdd(slot.pending_credit, bytes);
          }
        }
        Send(slot, header);
        break;
      }
      case kHave:
        for (int n = script.U8() % 4; n > 0; --n) {
          wire::ChunkRange* range = header.mutable_have()->add_ranges();
          range->set_bo(script.U8());
          range->set_first_chunk(script.Small());
          range->set_chunk_count(script.Small());
        }
        if (!header.has_have()) header.mutable_have();
        Send(slot, header);
        break;
      case kStats:
        header.mutable_stats_request();
        Send(slot, header);
        break;
      case kGoodbye:
        header.mutable_goodbye();
        Send(slot, header);
        break;
      case kJunk: {
        std::vector<uint8_t> junk(script.U8() % 32 + 1);
        for (uint8_t& b : junk)
          b = script.U8();
        SendBytes(slot, junk);
        slot.garbled = true;
        break;
      }
      case kShutWrite:
        ::shutdown(slot.fd.get(), SHUT_WR);
        slot.write_closed = true;
        break;
      case kClose:
        slot.fd.reset();
        break;
      case kDrain: {
        // Until the connection has been quiet for 1-4 ms (a stream's chunks come closer together
        // than that), or ended.
        const int quiet_ms = script.U8() % 4 + 1;
        const auto give_up = Clock::now() + kSilenceLimit;
        uint64_t before;
        do {
          before = slot.bytes_received;
        } while (Receive(slot, quiet_ms) && slot.bytes_received != before &&
                 Clock::now() < give_up);
        break;
      }
      case kSync:
        if (slot.write_closed || slot.garbled) {
          Receive(slot, 0);
        } else {
          Sync(slot);
        }
        break;
      case kPrefix: {
        std::array<uint8_t, 8> prefix{};
        const uint32_t header_length = script.U32();
        const uint32_t payload_length = script.U32();
        for (int i = 0; i < 4; ++i) {
          prefix[i] = static_cast<uint8_t>(header_length >> (8 * i));
          prefix[4 + i] = static_cast<uint8_t>(payload_length >> (8 * i));
        }
        SendBytes(slot, prefix);
        slot.garbled = true;
        break;
      }
    }
  }

  // --- receiving and checking ---

  // Reads what has arrived within `wait_ms` and checks every whole frame in it. Returns false once
  // the connection has ended.
  bool Receive(Slot& slot, int wait_ms, const std::function<bool(const wire::Header&)>& stop = {},
               bool* stopped = nullptr) {
    if (!slot.fd.valid() || slot.eof) return false;
    pollfd pfd{slot.fd.get(), POLLIN, 0};
    // Frames left behind by an earlier stop are checked without waiting.
    const bool readable = ::poll(&pfd, 1, slot.inbox.empty() ? wait_ms : 0) > 0;
    std::array<uint8_t, 256 * 1024> buffer;
    while (readable) {
      ssize_t n = ::recv(slot.fd.get(), buffer.data(), buffer.size(), MSG_DONTWAIT);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
      if (n <= 0) {  // end of stream, or reset
        slot.eof = true;
        break;
      }
      slot.inbox.insert(slot.inbox.end(), buffer.begin(), buffer.begin() + n);
      slot.bytes_received += static_cast<uint64_t>(n);
      if (static_cast<size_t>(n) < buffer.size()) break;
    }
    size_t used = 0;
    while (true) {
      std::span<const uint8_t> rest(slot.inbox.data() + used, slot.inbox.size() - used);
      Result<std::optional<DecodedFrame>> frame = TryDecodeFrame(rest, FrameLimits{});
      if (!frame.ok())
        Die(slot.name + ": the server sent a bad frame: " + frame.status().ToString());
      if (!frame->has_value()) break;
      used += (*frame)->frame_size;
      Frame copy{(*frame)->header, {(*frame)->payload.begin(), (*frame)->payload.end()}};
      Check(slot, copy);
      if (stop && stop(copy.header) && stopped != nullptr) {
        *stopped = true;
        break;
      }
    }
    slot.inbox.erase(slot.inbox.begin(), slot.inbox.begin() + static_cast<long>(used));
    return !slot.eof || (stopped != nullptr && *stopped);
  }

  // Reads until a frame satisfies `stop` (returned) or dies after kSilenceLimit.
  Frame ReadUntil(Slot& slot, const std::function<bool(const wire::Header&)>& stop) {
    Frame found;
    const auto deadline = Clock::now() + kSilenceLimit;
    bool stopped = false;
    auto keep = [&](const wire::Header& h) {
      if (!stop(h)) return false;
      found.header = h;
      return true;
    };
    while (!stopped) {
      if (Clock::now() > deadline) Die(slot.name + ": no answer in time");
      if (!Receive(slot, 50, keep, &stopped) && !stopped)
        Die(slot.name + ": closed before the answer the harness waited for");
    }
    return found;
  }

  void Check(Slot& slot, const Frame& frame) {
    if (!checking_) return;  // the set-up reads the tables the checks compare against
    const wire::Header& h = frame.header;
    if (trace_)
      std::fprintf(stderr, "fuzz_server: %s <- %s\n", slot.name.c_str(),
                   h.ShortDebugString().substr(0, 160).c_str());
    seen_.errors += h.has_error();
    seen_.hello_replies += h.has_hello_reply();
    seen_.image_files += h.has_image_files();
    seen_.stream_done += h.has_stream_done();
    if (slot.table_left > 0) {
      if (h.has_image_table_part()) {
        slot.table_left -= std::min<uint64_t>(slot.table_left, frame.payload.size());
        return;
      }
      slot.table_left = 0;  // an Error may end the table (the client's checks are its own tests)
    }
    if (h.has_hello_reply() &&
        (slot.role == Slot::Role::kDemand || slot.role == Slot::Role::kLane)) {
      if (!sessions_.count(slot.join_id) || !slot.join_secret_right)
        Die(slot.name + ": the server let a connection join session " +
            std::to_string(slot.join_id) + " without that session's secret");
      slot.session_known = true;
      slot.session_id = slot.join_id;
    }
    if (h.has_image_files() && (slot.role != Slot::Role::kFiles || !slot.join_secret_right ||
                                !sessions_.count(slot.join_id)))
      Die(slot.name + ": image files went to a connection that did not join with the secret");
    if (h.has_open_image_reply()) CheckOpened(slot, frame);
    if (h.has_chunk()) CheckChunk(slot, frame);
    if (h.has_stream_done()) slot.stream_done = true;
  }

  void CheckOpened(Slot& slot, const Frame& frame) {
    const wire::OpenImageReply& reply = frame.header.open_image_reply();
    if (slot.role != Slot::Role::kStream)
      Die(slot.name + ": OpenImage accepted on a connection that is not a stream connection");
    const ImageOracle* image = reply.lazy_image() ? &lazy_ : &raw_;
    auto open = slot.opens.find(frame.header.request_id());
    if (open == slot.opens.end()) Die(slot.name + ": an OpenImageReply to no OpenImage");
    const auto [choice, name] = open->second;
    if (choice != 0 && choice != 1 && choice != kImageString)
      Die(slot.name + ": the server opened an image for '" + name + "'");
    if ((choice == 0 && image != &raw_) || (choice == 1 && image != &lazy_))
      Die(slot.name + ": '" + name + "' opened the other image");
    if (reply.chunk_size() != image->chunk_size) Die(slot.name + ": wrong chunk size");
    if (reply.bos_size() != 0) {
      if (static_cast<size_t>(reply.bos_size()) != image->bos.size())
        Die(slot.name + ": the reply's BO table differs from the image's");
      for (int i = 0; i < reply.bos_size(); ++i)
        if (reply.bos(i).chunk_count() != image->bos[i].chunk_count() ||
            reply.bos(i).size() != image->bos[i].size())
          Die(slot.name + ": the reply's BO table differs from the image's");
    }
    slot.table_left =
        reply.table_bytes() > frame.payload.size() ? reply.table_bytes() - frame.payload.size() : 0;
    if (sessions_.count(reply.session()))
      Die(slot.name + ": session id " + std::to_string(reply.session()) + " given out twice");
    SessionState& session = sessions_[reply.session()];
    session.image = image;
    session.streamed.assign(image->stream_position.size(), false);
    session.secret = reply.session_secret();
    session.granted = slot.pending_credit;
    slot.pending_credit = 0;
    slot.session_known = true;
    slot.session_id = reply.session();
  }

  void CheckChunk(Slot& slot, const Frame& frame) {
    const wire::ChunkData& data = frame.header.chunk();
    const std::string what =
        slot.name + ": BO " + std::to_string(data.bo()) + " chunk " + std::to_string(data.chunk());
    if (!slot.session_known) Die(what + " on a connection without a session");
    SessionState& session = sessions_[slot.session_id];
    const ImageOracle& image = *session.image;
    if (data.bo() >= image.bos.size() || data.chunk() >= image.bos[data.bo()].chunk_count())
      Die(what + ": not a chunk of the image");
    const std::vector<uint8_t>& bo = image.contents[data.bo()];
    const uint64_t offset = uint64_t{data.chunk()} * image.chunk_size;
    const uint64_t length = std::min<uint64_t>(image.chunk_size, bo.size() - offset);
    if (data.raw_length() != length) Die(what + ": wrong raw length");
    uint64_t stored = frame.payload.size();
    ++seen_.chunks;
    seen_.by_reference += data.has_in_file();
    if (data.has_in_file()) {
      if (!frame.payload.empty()) Die(what + ": a by-reference chunk carries a payload");
      stored = data.in_file().length();
      if (stored > FrameLimits{}.max_payload) Die(what + ": stored length past the frame limit");
    } else {
      manifest::Chunk chunk;
      chunk.set_codec(data.codec());
      chunk.set_raw_length(data.raw_length());
      chunk.set_stored_length(static_cast<uint32_t>(frame.payload.size()));
      chunk.set_checksum(data.checksum());
      std::vector<uint8_t> raw(data.raw_length());
      if (Status decoded = image::DecodeChunk(chunk, frame.payload, raw, what); !decoded.ok())
        Die(what + ": " + decoded.ToString());
      if (!std::equal(raw.begin(), raw.end(), bo.begin() + static_cast<long>(offset)))
        Die(what + ": the bytes differ from the checkpoint's");
    }
    const bool bulk = slot.role == Slot::Role::kStream || slot.role == Slot::Role::kLane;
    if (bulk && frame.header.request_id() == 0) CheckStreamOrder(slot, session, data, what);
    if (bulk) {
      session.charged += stored;
      if (session.charged > session.granted)
        Die(what + ": session " + std::to_string(slot.session_id) + " was sent " +
            std::to_string(session.charged) + " bytes against " + std::to_string(session.granted) +
            " of credit");
    }
  }

  void CheckStreamOrder(Slot& slot, SessionState& session, const wire::ChunkData& data,
                        const std::string& what) {
    const ImageOracle& image = *session.image;
    const uint32_t flat = image.first_flat[data.bo()] + data.chunk();
    const uint32_t position = image.stream_position[flat];
    if (slot.stream_done) Die(what + ": sent by the stream after this connection's StreamDone");
    if (session.streamed[flat]) Die(what + ": sent twice by the session's stream");
    ++seen_.stream_ordered;
    session.streamed[flat] = true;
    if (position <= slot.last_stream_position)
      Die(what + ": the stream's chunk at position " + std::to_string(position) +
          " of its order came after position " + std::to_string(slot.last_stream_position));
    slot.last_stream_position = position;
    const wire::Priority expected =
        position < image.hot_count ? wire::PRIORITY_PREFETCH : wire::PRIORITY_BACKGROUND;
    if (data.priority() != expected)
      Die(what + ": the stream sent it at priority " + wire::Priority_Name(data.priority()) +
          ", not " + wire::Priority_Name(expected));
  }

  // A stats request, then everything up to its answer: frames are handled in order, so the answer
  // comes after the server's answer to whatever was sent before it. Or the connection ends.
  void Sync(Slot& slot) {
    wire::Header barrier;
    barrier.set_request_id(kBarrierId);
    barrier.mutable_stats_request();
    Send(slot, barrier);
    const auto deadline = Clock::now() + kSilenceLimit;
    bool answered = false;
    auto is_answer = [](const wire::Header& h) {
      return (h.has_stats_reply() && h.request_id() == kBarrierId) ||
             (h.has_error() && h.error().in_reply_to() == kBarrierId);
    };
    while (!answered && Receive(slot, 50, is_answer, &answered)) {
      if (Clock::now() > deadline) Die(slot.name + ": no answer to a stats request in time");
    }
  }

  // The end of a script: every connection still open answers or ends.
  void Finish(Slot& slot) {
    if (!slot.fd.valid() || slot.eof) return;
    if (!slot.write_closed && !slot.garbled) return Sync(slot);
    // A half frame (junk, a bare prefix) would swallow a request: end the stream instead, and
    // the server must close.
    ::shutdown(slot.fd.get(), SHUT_WR);
    const auto deadline = Clock::now() + kSilenceLimit;
    while (Receive(slot, 50)) {
      if (Clock::now() > deadline) Die(slot.name + ": still open long after its end of stream");
    }
  }

  // A well-behaved client after the script: the server must still serve it, correctly.
  void Probe() {
    Slot slot;
    slot.name = "probe after the script";
    Connect(slot, /*tcp=*/probes_ % 2 == 1);
    SendHello(slot, 1, 2, 0, 0, {}, {});
    ReadUntil(slot, [](const wire::Header& h) { return h.has_hello_reply(); });
    wire::Header open;
    open.set_request_id(kOpenIdBase);
    open.mutable_open_image()->set_image("lazy");
    slot.opens[kOpenIdBase] = {1, "lazy"};
    Send(slot, open);
    ReadUntil(slot, [](const wire::Header& h) { return h.has_open_image_reply(); });
    wire::Header credit;
    credit.mutable_credit()->set_bytes(1 << 20);
    sessions_[slot.session_id].granted = 1 << 20;
    Send(slot, credit);
    wire::Header request;
    request.set_request_id(7);
    wire::ChunkRange* range = request.mutable_request()->add_ranges();
    range->set_bo(static_cast<uint32_t>(probes_++ % lazy_.bos.size()));
    range->set_first_chunk(0);
    range->set_chunk_count(1);
    Send(slot, request);
    ReadUntil(slot, [](const wire::Header& h) {
      if (h.has_error()) Die("probe after the script: " + h.error().message());
      return h.has_chunk();
    });
  }

  std::unique_ptr<server::Server> server_;
  std::thread runner_;
  std::string unix_path_;
  uint16_t tcp_port_ = 0;
  ImageOracle raw_;
  ImageOracle lazy_;
  std::map<uint64_t, SessionState> sessions_;  // this script's, by id
  uint64_t probes_ = 0;
  uint64_t next_open_id_ = 1;
  bool checking_ = false;
  const bool verbose_ = std::getenv("GPULAZY_FUZZ_VERBOSE") != nullptr;
  const bool trace_ = verbose_ && std::string(std::getenv("GPULAZY_FUZZ_VERBOSE")) == "2";
  struct Seen {
    uint32_t chunks = 0, by_reference = 0, stream_ordered = 0, errors = 0, hello_replies = 0,
             image_files = 0, stream_done = 0;
  } seen_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Harness harness;
  harness.RunScript(std::span(data, size));
  return 0;
}
