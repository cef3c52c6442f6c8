// libFuzzer harness: the page server's connection and session state machine (lazy-server/
// server/session.cc and what it drives) against a hostile client.
//
// One gpulazy-server runs in this process for the harness's life (Unix socket and loopback TCP,
// two images of the tiny seed checkpoint: "raw" served from its CRIU pages files, "lazy"
// converted). With GPULAZY_FUZZ_TLS=1 in the environment its TCP listener speaks TLS (a
// certificate the harness makes at start): TCP connections do the handshake and carry the same
// scripts inside TLS, may skip it (plain text to the TLS listener: the server's peek at the
// first bytes), and may send junk under TLS (a corrupt record). Each input is a script
// (server_script.h) of actions on up to four connections: Hello with any versions, joins with right
// and wrong secrets (demand connections, lanes, the files connection), OpenImage with good and bad
// names, requests with any ranges, priorities and flags, Credit of any size, Have, stats, Goodbye,
// junk bytes, half-closes and resets, and PlaceInto (the server places into memfds, as `--placement
// memfd`; the client is this process, so the server takes the harness's own memfds with
// pidfd_getfd) with any kind, device, BOs, sizes and handles: memfds the harness made of the right,
// a short or a larger size, sealed ones, a pipe, any descriptor number, any bytes; and requests
// with `placed`.
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
//   - HelloReply offers memfd placement on the Unix socket and nothing over TCP; a PlaceInto is
//     accepted exactly when it is well-formed: on a stream connection over the Unix socket,
//     after OpenImage, of kind "memfd" and no device, every BO in range and named once (in the
//     frame and in the session), each size at least its BO's, each handle 4 bytes naming a
//     descriptor of this process that is one of the harness's memfds (by inode: the server's
//     own copy of one counts, the process being one), unsealed and holding the size; its
//     reply counts every destination the session holds;
//   - a ChunkData flagged placed carries no bytes, is RAW, is checked (a lazy image's), and
//     names a BO with an accepted destination, whose memfd then holds exactly the checkpoint's
//     bytes of the chunk (not checked for a memfd given to BOs of different bytes); credit
//     counts its raw length. A RAW chunk answering only placed requests, of a BO that had its
//     destination when they were sent, comes placed (no placement fails here). After junk on a
//     connection that is or may become a stream connection (the junk may hold a PlaceInto the
//     harness never sent) placed chunks and replies the harness cannot account for pass, and no
//     memfd's bytes are checked;
//   - at the end of the script every connection answers a stats request or closes, in time
//     (5 s when fuzzing); then the server lets go of every memfd it took, and each memfd holds,
//     chunk by chunk, nothing or the checkpoint's bytes of the BO it was given for (nothing at
//     all if it was never accepted, nothing past the BO);
//   - after every input a fresh client still gets a correct chunk (every second one over TCP,
//     and so over TLS in TLS mode).
#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <google/protobuf/stubs/logging.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <poll.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
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
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/io.h"
#include "lazy-server/image/lazy_image.h"
#include "lazy-server/server/server.h"
#include "proto/criu_file.h"
#include "proto/endian.h"
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
constexpr uint64_t kPlaceIdBase = uint64_t{1} << 60;
// The name of the harness's memfds: how /proc/self/fd tells them (and the server's copies of
// them) from any other descriptor.
constexpr const char* kMemfdName = "gpulazy-fuzz";

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

// A memfd the harness made for a PlaceInto target, open until the script ends.
struct HarnessMemfd {
  UniqueFd fd;
  uint64_t size = 0;
  bool sealed = false;  // F_SEAL_WRITE
  dev_t dev = 0;
  ino_t ino = 0;
  // The bytes of the BO it is an accepted destination of (any session's); `mixed` once it is
  // one of BOs whose bytes differ, when what it holds is not checked.
  const std::vector<uint8_t>* expected = nullptr;
  bool mixed = false;
};

struct SessionState {
  const ImageOracle* image = nullptr;
  std::map<uint32_t, HarnessMemfd*> destinations;  // by BO: accepted by a PlaceIntoReply
  // Requests with ranges, by where their chunks go (true: the demand connection, else the
  // stream connection and its lanes) and request id: whether every one sent with that id was
  // placed (and not by_reference), and the BOs that had destinations when each was sent.
  struct Asked {
    bool placed_only = true;
    std::set<uint32_t> destined;
  };
  std::map<std::pair<bool, uint64_t>, Asked> asked;
  std::vector<bool> streamed;  // by flat index: sent by the stream
  std::string secret;
  uint64_t granted = 0;  // Credit sent on its stream connection, saturating
  uint64_t charged = 0;  // chunk bytes its bulk connections carried
};

uint64_t SaturatingAdd(uint64_t a, uint64_t b) {
  return a > std::numeric_limits<uint64_t>::max() - b ? std::numeric_limits<uint64_t>::max()
                                                      : a + b;
}

struct SslFree {
  void operator()(SSL* ssl) const { SSL_free(ssl); }
};

struct Slot {
  enum class Role { kNone, kStream, kDemand, kLane, kFiles };
  UniqueFd fd;
  std::unique_ptr<SSL, SslFree> ssl;  // a connection that did the TLS handshake (non-blocking)
  Role role = Role::kNone;
  bool tcp = false;
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
  std::map<uint64_t, Open> opens;              // OpenImage requests sent, by request id
  std::map<uint64_t, wire::PlaceInto> places;  // PlaceInto sent and not answered, by request id
  uint64_t pending_credit = 0;                 // granted before this slot's session existed
  uint64_t table_left = 0;            // version 2: table bytes still to come in ImageTablePart
  int64_t last_stream_position = -1;  // of the stream's chunks this connection carried
  bool stream_done = false;           // this connection got its StreamDone
  std::vector<uint8_t> inbox;
  uint64_t bytes_received = 0;
};

// A self-signed certificate and its key, as PEM files, for the TLS listener. The harness's client
// does not verify it: the server's handling of what comes over TLS is under test, not its
// identity (tests/server/security_test.cc tests that).
void MakeSelfSignedCertificate(const fs::path& cert_path, const fs::path& key_path) {
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(EVP_EC_gen("P-256"), EVP_PKEY_free);
  std::unique_ptr<X509, decltype(&X509_free)> cert(X509_new(), X509_free);
  if (!key || !cert) Die("making a TLS key failed");
  X509_set_version(cert.get(), 2);
  ASN1_INTEGER_set(X509_get_serialNumber(cert.get()), 1);
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), -3600);
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), 365L * 24 * 3600);
  X509_set_pubkey(cert.get(), key.get());
  X509_NAME* name = X509_get_subject_name(cert.get());
  X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>("localhost"), -1, -1, 0);
  X509_set_issuer_name(cert.get(), name);
  if (X509_sign(cert.get(), key.get(), EVP_sha256()) == 0) Die("signing the certificate failed");
  auto write = [](const fs::path& path, const std::function<bool(FILE*)>& writer) {
    std::unique_ptr<FILE, decltype(&std::fclose)> file(std::fopen(path.c_str(), "w"), std::fclose);
    if (!file || !writer(file.get())) Die("writing " + path.string() + " failed");
  };
  write(cert_path, [&](FILE* file) { return PEM_write_X509(file, cert.get()) == 1; });
  write(key_path, [&](FILE* file) {
    return PEM_write_PrivateKey(file, key.get(), nullptr, nullptr, 0, nullptr, nullptr) == 1;
  });
}

class Harness {
 public:
  Harness() {
    // GPULAZY_FUZZ_SERVER_LOG=1: the server's own log (debug), to see why it did what it did.
    spdlog::set_level(std::getenv("GPULAZY_FUZZ_SERVER_LOG") != nullptr ? spdlog::level::debug
                                                                        : spdlog::level::off);
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
    if (tls_) {
      // SSL_write on a connection the server closed raises SIGPIPE (plain sends pass
      // MSG_NOSIGNAL).
      ::signal(SIGPIPE, SIG_IGN);
      config.tls.cert_file = (dir / "cert.pem").string();
      config.tls.key_file = (dir / "key.pem").string();
      MakeSelfSignedCertificate(config.tls.cert_file, config.tls.key_file);
      client_tls_.reset(SSL_CTX_new(TLS_client_method()));
      if (!client_tls_) Die("SSL_CTX_new failed");
      SSL_CTX_set_verify(client_tls_.get(), SSL_VERIFY_NONE, nullptr);
    }
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
    // Past every wait of the harness: a connection the server keeps until this deadline (one it
    // should have closed at once) is a hang the harness reports, in the replay as in fuzzing.
    config.hello_timeout = 2 * std::chrono::duration_cast<std::chrono::milliseconds>(kSilenceLimit);
    config.handle_signals = false;
    // The client is this process: the server takes the harness's memfds with pidfd_getfd.
    config.placement = "memfd";
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
    if (CountMemfds() != 0) Die("memfds of the harness's name before the first script");
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
    placement_uncertain_ = false;
    seen_ = {};
    ScriptReader script(input);
    while (!script.done())
      Step(script, slots);
    for (Slot& slot : slots)
      Finish(slot);
    for (Slot& slot : slots) {
      slot.ssl.reset();
      slot.fd.reset();
    }
    if (!memfds_.empty()) {
      AwaitDestinationsReleased();
      if (!placement_uncertain_) CheckDestinationBytes();
    }
    memfds_.clear();
    pipe_read_.reset();
    pipe_write_.reset();
    const Seen script_seen = seen_;
    Probe();
    // GPULAZY_FUZZ_VERBOSE=1: what each input reached, to see that a seed does what it says.
    if (verbose_)
      std::fprintf(stderr,
                   "fuzz_server: %zu sessions, %u chunks checked (%u by reference, %u in the "
                   "stream's order), %u errors, %u hello replies, %u image files, %u stream ends, "
                   "PlaceInto %u accepted %u refused, %u chunks placed (%u checked in the memfd), "
                   "%u TLS handshakes\n",
                   sessions_.size() - 1, script_seen.chunks, script_seen.by_reference,
                   script_seen.stream_ordered, script_seen.errors, script_seen.hello_replies,
                   script_seen.image_files, script_seen.stream_done, script_seen.places_accepted,
                   script_seen.places_refused, script_seen.placed, script_seen.placed_checked,
                   script_seen.tls_handshakes);
  }

 private:
  ImageOracle LoadOracle(const std::string& name, const fs::path& dir) {
    ImageOracle oracle;
    Slot slot;
    slot.name = "set-up client of " + name;
    Connect(slot, /*transport=*/0);
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

  // `transport`: kConnect's byte (kConnectTcp, kConnectNoHandshake).
  void Connect(Slot& slot, uint8_t transport) {
    const bool tcp = transport & kConnectTcp;
    const std::string name = slot.name;
    slot = Slot{};
    slot.name = name;
    slot.tcp = tcp;
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
    if (tls_ && tcp && !(transport & kConnectNoHandshake)) Handshake(slot);
    if (trace_ && checking_)
      std::fprintf(stderr, "fuzz_server: %s: %s%s\n", slot.name.c_str(), tcp ? "TCP" : "Unix",
                   slot.ssl ? ", TLS" : (tls_ && tcp ? ", plain text to TLS" : ""));
  }

  // TLS mode: the client's handshake on a fresh TCP connection, which stays non-blocking after
  // it (Receive and SendBytes poll). A server that ends the connection instead (a limit it
  // reached, say) leaves the slot ended; the probe after the script catches a server that does
  // not do handshakes at all.
  void Handshake(Slot& slot) {
    const int fd = slot.fd.get();
    if (::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK) != 0) Die("fcntl failed");
    slot.ssl.reset(SSL_new(client_tls_.get()));
    if (!slot.ssl || SSL_set_fd(slot.ssl.get(), fd) != 1) Die("SSL_new failed");
    const auto deadline = Clock::now() + kSilenceLimit;
    while (true) {
      ERR_clear_error();
      const int rc = SSL_connect(slot.ssl.get());
      if (rc == 1) {
        ++seen_.tls_handshakes;
        return;
      }
      const int error = SSL_get_error(slot.ssl.get(), rc);
      if (error != SSL_ERROR_WANT_READ && error != SSL_ERROR_WANT_WRITE) {
        slot.eof = true;
        slot.write_closed = true;
        return;
      }
      if (Clock::now() > deadline) Die(slot.name + ": no TLS handshake in time");
      pollfd pfd{fd, static_cast<short>(error == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT), 0};
      ::poll(&pfd, 1, 50);
    }
  }

  // Bytes straight onto the socket: under TLS, if the connection did a handshake.
  void SendRaw(Slot& slot, std::span<const uint8_t> bytes) {
    while (!bytes.empty()) {
      ssize_t n = ::send(slot.fd.get(), bytes.data(), bytes.size(), MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {  // a TLS connection's socket
        pollfd pfd{slot.fd.get(), POLLOUT, 0};
        ::poll(&pfd, 1, 50);
        continue;
      }
      if (n <= 0) {  // the server closed or reset: nothing more reaches it
        slot.write_closed = true;
        return;
      }
      bytes = bytes.subspan(static_cast<size_t>(n));
    }
  }

  // Ends the writing half: a TLS connection sends its close_notify first.
  void ShutWrite(Slot& slot) {
    if (slot.ssl && !slot.write_closed) {
      ERR_clear_error();
      SSL_shutdown(slot.ssl.get());
    }
    ::shutdown(slot.fd.get(), SHUT_WR);
    slot.write_closed = true;
  }

  void SendBytes(Slot& slot, std::span<const uint8_t> bytes) {
    if (!slot.fd.valid() || slot.write_closed) return;
    if (!slot.ssl) return SendRaw(slot, bytes);
    while (!bytes.empty()) {
      ERR_clear_error();
      const int n = SSL_write(slot.ssl.get(), bytes.data(),
                              static_cast<int>(std::min<size_t>(bytes.size(), 1 << 20)));
      if (n > 0) {
        bytes = bytes.subspan(static_cast<size_t>(n));
        continue;
      }
      const int error = SSL_get_error(slot.ssl.get(), n);
      if (error != SSL_ERROR_WANT_READ && error != SSL_ERROR_WANT_WRITE) {
        slot.write_closed = true;  // the server closed, reset or sent an alert
        return;
      }
      pollfd pfd{slot.fd.get(), static_cast<short>(error == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT),
                 0};
      ::poll(&pfd, 1, 50);
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
    // Frames are traced as they are sent; the other actions here.
    constexpr std::array<const char*, kOpCount> kNames = {
        "connect",           "",      "",      "",       "", "", "", "", "junk",
        "shutdown(SHUT_WR)", "close", "drain", "prefix", "", ""};
    if (trace_ && checking_ && kNames[op][0] != '\0')
      std::fprintf(stderr, "fuzz_server: %s: %s\n", slot.name.c_str(), kNames[op]);
    switch (op) {
      case kConnect:
        Connect(slot, script.U8());
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
        request->set_placed(flags & kRequestPlaced);
        for (int n = script.U8() % 4; n > 0; --n) {
          wire::ChunkRange* range = request->add_ranges();
          range->set_bo(script.U8());
          range->set_first_chunk(script.Small());
          range->set_chunk_count(script.Small());
        }
        if (!request->stream_all() && slot.session_known) {
          SessionState& session = sessions_[slot.session_id];
          std::set<uint32_t> destined;
          for (const auto& [bo, memfd] : session.destinations)
            destined.insert(bo);
          const auto key = std::make_pair(slot.role == Slot::Role::kDemand, header.request_id());
          auto [it, first] = session.asked.try_emplace(key);
          it->second.placed_only &= request->placed() && !request->by_reference();
          if (first) {
            it->second.destined = std::move(destined);
          } else {
            std::erase_if(it->second.destined, [&](uint32_t bo) { return !destined.count(bo); });
          }
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
        const uint8_t length = script.U8();
        std::vector<uint8_t> junk((length & kJunkLengthMask) + 1);
        for (uint8_t& b : junk)
          b = script.U8();
        if (slot.ssl && (length & kJunkBelowTls)) {
          if (!slot.write_closed) SendRaw(slot, junk);
        } else {
          SendBytes(slot, junk);
        }
        Garble(slot);
        break;
      }
      case kShutWrite:
        ShutWrite(slot);
        break;
      case kClose:
        slot.ssl.reset();
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
      case kPlaceInto:
        PlaceInto(script, slot, header);
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
        Garble(slot);
        break;
      }
    }
  }

  // kPlaceInto: builds the frame from the script, sends it and reads the slot until the answer,
  // so that the harness knows the session's destinations before it reads any connection that
  // might carry a chunk placed into one (the server adds them before it answers). Not sent on a
  // slot that sent a partial frame (its answer might never come) or cannot write.
  void PlaceInto(ScriptReader& script, Slot& slot, wire::Header& header) {
    wire::PlaceInto* place = header.mutable_place_into();
    // The choice bytes first, then their operands (as for each target).
    const uint8_t kind = script.U8() % kPlaceKindCount;
    const uint8_t device = script.U8() % kPlaceDeviceCount;
    const int targets = script.U8() % (kMaxPlaceTargets + 1);
    place->set_kind(kind == kPlaceKindMemfd    ? std::string("memfd")
                    : kind == kPlaceKindCuda   ? std::string("cuda")
                    : kind == kPlaceKindString ? script.String()
                                               : std::string());
    if (device == kPlaceDeviceUuid) {
      std::string uuid;
      for (int i = 0; i < 16; ++i)
        uuid.push_back(static_cast<char>(script.U8()));
      place->set_device(uuid);
    } else if (device == kPlaceDeviceString) {
      place->set_device(script.String());
    }
    // The BO table of the slot's image if the harness has seen it open, else "raw"'s (both
    // images are the one checkpoint).
    const ImageOracle& image = slot.session_known ? *sessions_[slot.session_id].image : raw_;
    const uint32_t bo_count = static_cast<uint32_t>(image.bos.size());
    uint32_t previous_bo = 0;
    for (int n = targets; n > 0; --n) {
      const uint8_t bo_byte = script.U8();
      const uint8_t size_choice = script.U8() % 4;
      const uint8_t handle_choice = script.U8() % kHandleCount;
      uint32_t bo = 0;
      switch (bo_byte & 3) {
        case kPlaceBoValid:
          bo = (bo_byte >> 2) % bo_count;
          break;
        case kPlaceBoPastEnd:
          bo = bo_count + (bo_byte >> 2);
          break;
        case kPlaceBoRepeat:
          bo = previous_bo;
          break;
        default:
          bo = script.U32();
      }
      previous_bo = bo;
      const uint64_t bo_size = bo < bo_count ? image.bos[bo].size() : 4096;
      uint64_t size = bo_size;
      if (size_choice == kPlaceSizeShort && bo_size > 0) size = bo_size - 1;
      if (size_choice == kPlaceSizeLarger) size = bo_size + 4096;
      if (size_choice == kPlaceSizeAny) size = script.U64();
      std::string handle;
      switch (handle_choice) {
        case kHandleMemfd:
          handle = Descriptor(NewMemfd(bo_size, false));
          break;
        case kHandleShortMemfd:
          handle = Descriptor(NewMemfd(bo_size > 0 ? bo_size - 1 : 0, false));
          break;
        case kHandleLargerMemfd:
          handle = Descriptor(NewMemfd(bo_size + 4096, false));
          break;
        case kHandleSealedMemfd:
          handle = Descriptor(NewMemfd(bo_size, true));
          break;
        case kHandleLastMemfd:
          handle =
              Descriptor(memfds_.empty() ? NewMemfd(bo_size, false) : memfds_.back()->fd.get());
          break;
        case kHandlePipe:
          handle = Descriptor(PipeEnd());
          break;
        case kHandleNumber:
          handle = Descriptor(static_cast<int>(script.U32()));
          break;
        default:
          handle = script.String();
      }
      wire::PlacementTarget* target = place->add_targets();
      target->set_bo(bo);
      target->set_size(size);
      target->set_handle(handle);
    }
    if (slot.garbled || slot.write_closed) return;
    const uint64_t rid = kPlaceIdBase + next_place_id_++;
    header.set_request_id(rid);
    slot.places[rid] = *place;
    Send(slot, header);
    const auto deadline = Clock::now() + kSilenceLimit;
    bool answered = false;
    auto is_answer = [rid](const wire::Header& h) {
      return (h.has_place_into_reply() && h.request_id() == rid) ||
             (h.has_error() && h.error().in_reply_to() == rid);
    };
    while (!answered && Receive(slot, 50, is_answer, &answered)) {
      if (Clock::now() > deadline) Die(slot.name + ": no answer to a PlaceInto in time");
    }
  }

  // Bytes that are not whole frames: the server may still find frames in them, by chance or by
  // the fuzzer's design. On a connection that is or may become a stream connection those could
  // be a PlaceInto the harness never sent, accepted, and the server could place into a memfd
  // the harness does not know is a destination: from then on a placed chunk or a PlaceIntoReply
  // the harness cannot account for is let pass, and no memfd's bytes are checked.
  void Garble(Slot& slot) {
    slot.garbled = true;
    if (slot.role == Slot::Role::kStream || !slot.hello_sent) placement_uncertain_ = true;
  }

  static std::string Descriptor(int fd) {
    std::string handle(4, '\0');
    StoreLe32(reinterpret_cast<uint8_t*>(handle.data()), static_cast<uint32_t>(fd));
    return handle;
  }

  // A new memfd of `size` bytes (zeros), kept until the script ends; past kMaxScriptMemfds the
  // last one instead.
  int NewMemfd(uint64_t size, bool sealed) {
    if (memfds_.size() >= kMaxScriptMemfds) return memfds_.back()->fd.get();
    auto memfd = std::make_unique<HarnessMemfd>();
    memfd->fd.reset(::memfd_create(kMemfdName, MFD_CLOEXEC | MFD_ALLOW_SEALING));
    if (!memfd->fd.valid()) Die(std::string("memfd_create failed: ") + std::strerror(errno));
    if (::ftruncate(memfd->fd.get(), static_cast<off_t>(size)) != 0)
      Die(std::string("ftruncate of a memfd failed: ") + std::strerror(errno));
    if (sealed && ::fcntl(memfd->fd.get(), F_ADD_SEALS, F_SEAL_WRITE) != 0)
      Die(std::string("sealing a memfd failed: ") + std::strerror(errno));
    struct stat st {};
    if (::fstat(memfd->fd.get(), &st) != 0) Die("fstat of a memfd failed");
    memfd->size = size;
    memfd->sealed = sealed;
    memfd->dev = st.st_dev;
    memfd->ino = st.st_ino;
    memfds_.push_back(std::move(memfd));
    return memfds_.back()->fd.get();
  }

  int PipeEnd() {
    if (!pipe_read_.valid()) {
      int ends[2];
      if (::pipe2(ends, O_CLOEXEC) != 0) Die("pipe2 failed");
      pipe_read_.reset(ends[0]);
      pipe_write_.reset(ends[1]);
    }
    return pipe_read_.get();
  }

  // The harness's memfd that descriptor `number` of this process is now (by inode: the server's
  // copy of one is that one), or null.
  HarnessMemfd* ResolveMemfd(uint32_t number) const {
    struct stat st {};
    if (number > static_cast<uint32_t>(INT32_MAX) || ::fstat(static_cast<int>(number), &st) != 0)
      return nullptr;
    for (const auto& memfd : memfds_)
      if (memfd->dev == st.st_dev && memfd->ino == st.st_ino) return memfd.get();
    return nullptr;
  }

  // Descriptors of this process that are the harness's memfds or copies of them.
  static size_t CountMemfds() {
    DIR* dir = ::opendir("/proc/self/fd");
    if (dir == nullptr) Die("cannot list /proc/self/fd");
    const std::string prefix = std::string("/memfd:") + kMemfdName;
    size_t count = 0;
    while (const dirent* entry = ::readdir(dir)) {
      char target[256];
      const ssize_t n = ::readlinkat(::dirfd(dir), entry->d_name, target, sizeof target - 1);
      if (n > 0 && std::string_view(target, static_cast<size_t>(n)).starts_with(prefix)) ++count;
    }
    ::closedir(dir);
    return count;
  }

  // After the script's connections closed, their sessions end and the server closes its copies
  // of the harness's memfds (a placement in flight holds one a moment longer).
  void AwaitDestinationsReleased() {
    const auto deadline = Clock::now() + kSilenceLimit;
    size_t count;
    while ((count = CountMemfds()) > memfds_.size()) {
      if (Clock::now() > deadline)
        Die("the server still holds " + std::to_string(count - memfds_.size()) +
            " of the client's memfds after every connection closed");
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  // Once nothing can write into them: what the server placed is the checkpoint's, chunk by
  // chunk, and nothing else was written.
  void CheckDestinationBytes() {
    for (size_t i = 0; i < memfds_.size(); ++i) {
      const HarnessMemfd& memfd = *memfds_[i];
      if (memfd.mixed) continue;
      const std::string what = "memfd " + std::to_string(i) + " of the script";
      std::vector<uint8_t> bytes(memfd.size);
      if (!bytes.empty() && !ReadExactAt(memfd.fd.get(), 0, bytes, what).ok())
        Die(what + ": cannot read it back");
      const std::vector<uint8_t> none;
      const std::vector<uint8_t>& expected = memfd.expected ? *memfd.expected : none;
      if (expected.size() > bytes.size()) Die(what + ": smaller than the BO it was accepted for");
      auto zero = [](auto begin, auto end) {
        return std::all_of(begin, end, [](uint8_t b) { return b == 0; });
      };
      for (uint64_t at = 0; at < expected.size(); at += raw_.chunk_size) {
        const uint64_t end = std::min<uint64_t>(at + raw_.chunk_size, expected.size());
        const auto b = bytes.begin() + static_cast<long>(at);
        const auto e = bytes.begin() + static_cast<long>(end);
        if (!zero(b, e) && !std::equal(b, e, expected.begin() + static_cast<long>(at)))
          Die(what + ": the chunk at " + std::to_string(at) +
              " holds neither nothing nor the checkpoint's bytes");
      }
      if (!zero(bytes.begin() + static_cast<long>(expected.size()), bytes.end()))
        Die(what + (memfd.expected ? ": written past its BO" : ": written, never accepted"));
    }
  }

  // Why the server must refuse `place` from `slot` now; empty when it must accept it, with the
  // memfd of each target in `resolved`.
  std::string PlaceProblem(const Slot& slot, const wire::PlaceInto& place,
                           std::vector<HarnessMemfd*>* resolved) {
    if (slot.tcp) return "over TCP";
    if (slot.role != Slot::Role::kStream) return "not on a stream connection";
    if (!slot.session_known) return "before an OpenImage was accepted";
    if (place.kind() != "memfd") return "of kind '" + place.kind() + "'";
    if (!place.device().empty()) return "with a device";
    const SessionState& session = sessions_.at(slot.session_id);
    const ImageOracle& image = *session.image;
    std::set<uint32_t> named;
    for (const wire::PlacementTarget& target : place.targets()) {
      const std::string bo = "BO " + std::to_string(target.bo());
      if (target.bo() >= image.bos.size()) return bo + " out of range";
      if (!named.insert(target.bo()).second || session.destinations.count(target.bo()))
        return bo + " named twice";
      if (target.size() < image.bos[target.bo()].size()) return bo + ": size short of the BO";
      if (target.handle().size() != 4)
        return bo + ": a handle of " + std::to_string(target.handle().size()) + " bytes";
      const uint32_t number = LoadLe32(reinterpret_cast<const uint8_t*>(target.handle().data()));
      HarnessMemfd* memfd = ResolveMemfd(number);
      if (memfd == nullptr) return bo + ": descriptor " + std::to_string(number) + " is no memfd";
      if (memfd->sealed) return bo + ": a sealed memfd";
      if (memfd->size < target.size()) return bo + ": a memfd smaller than the size";
      resolved->push_back(memfd);
    }
    return {};
  }

  void CheckPlaceAnswer(Slot& slot, const wire::Header& h) {
    const uint64_t rid = h.has_error() ? h.error().in_reply_to() : h.request_id();
    auto it = slot.places.find(rid);
    if (it == slot.places.end()) {
      if (h.has_place_into_reply() && !placement_uncertain_)
        Die(slot.name + ": a PlaceIntoReply to no PlaceInto");
      return;  // an Error to something else
    }
    const wire::PlaceInto place = std::move(it->second);
    slot.places.erase(it);
    std::vector<HarnessMemfd*> resolved;
    const std::string problem = PlaceProblem(slot, place, &resolved);
    if (h.has_error()) {
      ++seen_.places_refused;
      if (problem.empty())
        Die(slot.name + ": a well-formed PlaceInto was refused: " + h.error().message());
      return;
    }
    ++seen_.places_accepted;
    if (!problem.empty()) Die(slot.name + ": a PlaceInto was accepted " + problem);
    SessionState& session = sessions_[slot.session_id];
    for (int i = 0; i < place.targets_size(); ++i) {
      const uint32_t bo = place.targets(i).bo();
      HarnessMemfd* memfd = resolved[static_cast<size_t>(i)];
      session.destinations[bo] = memfd;
      const std::vector<uint8_t>& bytes = session.image->contents[bo];
      if (memfd->expected == nullptr) memfd->expected = &bytes;
      if (*memfd->expected != bytes) memfd->mixed = true;
    }
    if (h.place_into_reply().targets() != session.destinations.size())
      Die(slot.name + ": PlaceIntoReply counts " + std::to_string(h.place_into_reply().targets()) +
          " destinations, the session holds " + std::to_string(session.destinations.size()));
  }

  // --- receiving and checking ---

  // Reads what has arrived within `wait_ms` and checks every whole frame in it. Returns false once
  // the connection has ended.
  bool Receive(Slot& slot, int wait_ms, const std::function<bool(const wire::Header&)>& stop = {},
               bool* stopped = nullptr) {
    if (!slot.fd.valid() || slot.eof) return false;
    pollfd pfd{slot.fd.get(), POLLIN, 0};
    // Frames left behind by an earlier stop are checked without waiting.
    // (A TLS connection may hold decrypted bytes OpenSSL has not handed out yet.)
    const bool readable = (slot.ssl && SSL_pending(slot.ssl.get()) > 0) ||
                          ::poll(&pfd, 1, slot.inbox.empty() ? wait_ms : 0) > 0;
    std::array<uint8_t, 256 * 1024> buffer;
    if (readable && slot.ssl) ReceiveTls(slot, buffer);
    while (readable && !slot.ssl) {
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

  // What a TLS connection has ready, up to one buffer's worth (TLS records are at most 16 KiB).
  void ReceiveTls(Slot& slot, std::span<uint8_t> buffer) {
    size_t received = 0;
    while (received < buffer.size()) {
      ERR_clear_error();
      const int n = SSL_read(slot.ssl.get(), buffer.data(),
                             static_cast<int>(std::min<size_t>(buffer.size() - received, 1 << 20)));
      if (n > 0) {
        slot.inbox.insert(slot.inbox.end(), buffer.begin(), buffer.begin() + n);
        slot.bytes_received += static_cast<uint64_t>(n);
        received += static_cast<size_t>(n);
        continue;
      }
      const int error = SSL_get_error(slot.ssl.get(), n);
      if (error == SSL_ERROR_WANT_READ || error == SSL_ERROR_WANT_WRITE) return;
      slot.eof = true;  // close_notify, end of stream, reset, or an alert
      return;
    }
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
    if (h.has_hello_reply()) {
      const bool offered = h.hello_reply().has_placement();
      if (offered == slot.tcp)
        Die(slot.name + (offered ? ": placement offered over TCP" : ": no placement offered"));
      if (offered && (h.hello_reply().placement().kind() != "memfd" ||
                      !h.hello_reply().placement().device().empty()))
        Die(slot.name + ": placement offered of another kind than memfd");
    }
    if (h.has_place_into_reply() || h.has_error()) CheckPlaceAnswer(slot, h);
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
    if (data.placed()) {
      ++seen_.placed;
      if (!frame.payload.empty() || data.has_in_file()) Die(what + ": placed, and bytes besides");
      if (data.codec() != manifest::CODEC_RAW) Die(what + ": placed, but not stored RAW");
      if (session.image == &lazy_ && data.no_checksum())
        Die(what + ": a lazy image's chunk placed unchecked");
      auto destination = session.destinations.find(data.bo());
      if (destination == session.destinations.end() && !placement_uncertain_)
        Die(what + ": placed, but its BO has no destination the server accepted");
      stored = data.raw_length();  // what credit counts for a placed chunk
      if (destination != session.destinations.end() && !destination->second->mixed &&
          !placement_uncertain_) {
        const HarnessMemfd& memfd = *destination->second;
        std::vector<uint8_t> placed(length);
        if (!ReadExactAt(memfd.fd.get(), offset, placed, what).ok())
          Die(what + ": cannot read its destination");
        if (!std::equal(placed.begin(), placed.end(), bo.begin() + static_cast<long>(offset)))
          Die(what + ": placed, but its destination holds other bytes than the checkpoint's");
        ++seen_.placed_checked;
      }
    } else if (data.has_in_file()) {
      if (!frame.payload.empty()) Die(what + ": a by-reference chunk carries a payload");
      stored = data.in_file().length();
      if (stored > FrameLimits{}.max_payload) Die(what + ": stored length past the frame limit");
    } else {
      // A RAW chunk as bytes in reply to placed requests only, of a BO that had its destination
      // before: the server places every such chunk (no placement fails here: the bytes are
      // right and the memfds writable), or answers once the placement in flight is done.
      auto asked = session.asked.find(
          std::make_pair(slot.role == Slot::Role::kDemand, frame.header.request_id()));
      if (frame.header.request_id() != 0 && data.codec() == manifest::CODEC_RAW &&
          asked != session.asked.end() && asked->second.placed_only &&
          asked->second.destined.count(data.bo()))
        Die(what + ": asked for placed into its destination, but sent as bytes");
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
    ShutWrite(slot);
    const auto deadline = Clock::now() + kSilenceLimit;
    while (Receive(slot, 50)) {
      if (Clock::now() > deadline) Die(slot.name + ": still open long after its end of stream");
    }
  }

  // A well-behaved client after the script: the server must still serve it, correctly.
  void Probe() {
    Slot slot;
    slot.name = "probe after the script";
    Connect(slot, probes_ % 2 == 1 ? kConnectTcp : 0);
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

  struct SslCtxFree {
    void operator()(SSL_CTX* context) const { SSL_CTX_free(context); }
  };
  const bool tls_ = std::getenv("GPULAZY_FUZZ_TLS") != nullptr &&
                    std::string(std::getenv("GPULAZY_FUZZ_TLS")) == "1";
  std::unique_ptr<SSL_CTX, SslCtxFree> client_tls_;  // TLS mode: the harness's client side
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
  std::vector<std::unique_ptr<HarnessMemfd>> memfds_;  // this script's
  UniqueFd pipe_read_;
  UniqueFd pipe_write_;
  uint64_t next_place_id_ = 1;
  bool placement_uncertain_ = false;  // this script's; see Garble
  struct Seen {
    uint32_t chunks = 0, by_reference = 0, stream_ordered = 0, errors = 0, hello_replies = 0,
             image_files = 0, stream_done = 0, places_accepted = 0, places_refused = 0, placed = 0,
             placed_checked = 0, tls_handshakes = 0;
  } seen_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Harness harness;
  harness.RunScript(std::span(data, size));
  return 0;
}
