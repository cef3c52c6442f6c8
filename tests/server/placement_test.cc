// Placement against a real gpulazy-server --placement memfd (docs/protocol.md, "Placement"): the
// server writes the chunks into the client's memfds itself and says so; a restore that lets it
// ends byte-exact with the chunks placed, on the stream and on demand; a chunk that fails the
// server's check is never placed (it goes as bytes, which the client checks too); and every
// misuse of PlaceInto is refused with an error naming why.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/sched.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "lazy-server/image/image_source.h"
#include "lazy-server/image/io.h"
#include "page-client/host_engine.h"
#include "page-client/net/fd_passing.h"
#include "page-client/restore_session.h"
#include "proto/endian.h"
#include "tests/server/checkpoint_bytes.h"
#include "tests/server/placed_reconnect.h"
#include "tests/server/test_support.h"
#include "tests/support/process.h"

namespace gpulazy::server::testing {
namespace {
namespace fs = std::filesystem;
using namespace std::chrono_literals;

class PlacementTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<TempDir>();
    const fs::path root = dir_->path() / "images";
    fs::create_directories(root);
    const TestImage shape{.bytes = 3ull << 20, .seed = 41, .processes = 2, .lazy_chunk = 128 << 10};
    TestImage raw = shape;
    TestImage lazy = shape;
    lazy.lazy = true;
    ASSERT_TRUE(MakeTestImage(root / "raw", raw).ok());
    ASSERT_TRUE(MakeTestImage(root / "lazy", lazy).ok());
    ASSERT_TRUE(MakeTestImage(root / "corrupt", lazy).ok());
    for (const char* name : {"raw", "lazy"}) {
      auto contents = LoadCriuContents(root / name);
      ASSERT_TRUE(contents.ok()) << contents.status().ToString();
      expected_[name] = std::move(*contents);
    }
    CorruptOneRawChunk(root / "corrupt");
    server_ = std::make_unique<ServerProcess>(
        dir_->path(), root,
        std::vector<std::string>{"--raw-chunk-size", "256K", "--max-frame", "1M", "--placement",
                                 "memfd"});
    ASSERT_TRUE(server_->ready()) << server_->Log();
  }
  static void TearDownTestSuite() {
    if (server_ != nullptr && server_->ready()) {
      EXPECT_EQ(server_->Terminate(), 0) << server_->Log();
    }
    server_.reset();
    dir_.reset();
  }
  void SetUp() override { ::alarm(120); }
  void TearDown() override {
    ::alarm(0);
    if (HasFailure()) std::cerr << server_->Log().substr(0, 20000);
  }

  // Flips one byte of the first chunk the lazy image stores RAW, so that chunk fails its check.
  static void CorruptOneRawChunk(const fs::path& dir) {
    auto source = image::ImageSource::Open(dir);
    ASSERT_TRUE(source.ok()) << source.status().ToString();
    const manifest::Manifest& manifest = (*source)->manifest();
    for (int bo = 0; bo < manifest.bos_size(); ++bo) {
      const uint64_t chunks =
          (manifest.bos(bo).size() + manifest.chunk_size() - 1) / manifest.chunk_size();
      for (uint32_t chunk = 0; chunk < chunks; ++chunk) {
        auto stored = (*source)->LocateStoredChunk(static_cast<uint32_t>(bo), chunk);
        ASSERT_TRUE(stored.ok());
        if (stored->codec != manifest::CODEC_RAW || !stored->in_file) continue;
        const fs::path file = dir / (*source)->files()[stored->in_file->file].name;
        const int fd = ::open(file.c_str(), O_RDWR);
        ASSERT_GE(fd, 0);
        uint8_t byte = 0;
        const off_t at = static_cast<off_t>(stored->in_file->offset + stored->raw_length / 2);
        ASSERT_EQ(::pread(fd, &byte, 1, at), 1);
        byte ^= 0x5a;
        ASSERT_EQ(::pwrite(fd, &byte, 1, at), 1);
        ::close(fd);
        corrupt_bo_ = static_cast<uint32_t>(bo);
        corrupt_chunk_ = chunk;
        return;
      }
    }
    FAIL() << "the lazy test image stores no chunk RAW";
  }

  struct PlacementCounters {
    uint64_t placed_chunks = 0;
    uint64_t verified_chunks = 0;
  };
  // server.placement's counters, from a stats request of a connection of its own.
  static std::optional<PlacementCounters> ServerPlacementCounters() {
    TestClient client(server_->unix_endpoint());
    if (!client.Hello().ok()) return std::nullopt;
    Result<std::string> text = client.Stats();
    if (!text.ok()) return std::nullopt;
    const nlohmann::json placement = nlohmann::json::parse(*text)["server"]["placement"];
    return PlacementCounters{placement.value("placed_chunks", uint64_t{0}),
                             placement.value("verified_chunks", uint64_t{0})};
  }

  static client::SessionOptions Options(const std::string& image) {
    client::SessionOptions options;
    options.endpoint = server_->unix_endpoint().ToString();
    options.image = image;
    options.reconnect.max_attempts = 0;
    return options;
  }

  static void ExpectCheckpointBytes(const client::RestoreSession& session,
                                    const client::HostCopyEngine& host, const std::string& image) {
    ExpectRestoredBytes(session, host, expected_[image]);
  }

  // A stream connection with `image` open, for the refusal tests.
  static std::unique_ptr<TestClient> Opened(const net::Endpoint& endpoint,
                                            const std::string& image) {
    auto client = std::make_unique<TestClient>(endpoint);
    EXPECT_TRUE(client->Hello().ok());
    EXPECT_TRUE(client->Open(image).ok());
    return client;
  }

  static wire::Header PlaceIntoFrame(uint32_t bo, int fd, uint64_t size,
                                     const std::string& kind = "memfd") {
    wire::Header header;
    header.set_request_id(7);
    wire::PlaceInto* place = header.mutable_place_into();
    place->set_kind(kind);
    wire::PlacementTarget* target = place->add_targets();
    target->set_bo(bo);
    std::string handle(4, '\0');
    StoreLe32(reinterpret_cast<uint8_t*>(handle.data()), static_cast<uint32_t>(fd));
    target->set_handle(handle);
    target->set_size(size);
    return header;
  }

  static std::map<std::string, std::map<BoKey, std::vector<uint8_t>>> expected_;
  static std::unique_ptr<TempDir> dir_;
  static std::unique_ptr<ServerProcess> server_;
  static uint32_t corrupt_bo_;
  static uint32_t corrupt_chunk_;
};
std::map<std::string, std::map<BoKey, std::vector<uint8_t>>> PlacementTest::expected_;
std::unique_ptr<TempDir> PlacementTest::dir_;
std::unique_ptr<ServerProcess> PlacementTest::server_;
uint32_t PlacementTest::corrupt_bo_ = 0;
uint32_t PlacementTest::corrupt_chunk_ = 0;

TEST_F(PlacementTest, PlacedRestoreIsTheCheckpointsBytes) {
  for (const std::string name : {"raw", "lazy"}) {
    SCOPED_TRACE(name);
    const std::optional<PlacementCounters> before = ServerPlacementCounters();
    ASSERT_TRUE(before.has_value());
    client::HostCopyEngine engine;
    client::RestoreSession session(Options(name), engine);
    const auto started = std::chrono::steady_clock::now();
    ASSERT_TRUE(session.Start().ok());
    Status complete = session.WaitComplete(60s);
    const auto completed = std::chrono::steady_clock::now();
    ASSERT_TRUE(complete.ok()) << complete.ToString();
    ExpectCheckpointBytes(session, engine, name);
    const client::Progress progress = session.progress();
    // The run's first and last resident chunk lie within it (the bench splits runs by them).
    EXPECT_LE(started, progress.first_resident_at);
    EXPECT_LE(progress.first_resident_at, progress.last_resident_at);
    EXPECT_LE(progress.last_resident_at, completed);
    EXPECT_LT(progress.first_resident_at, progress.last_resident_at);
    // Start-up in order: PlaceInto answered, then the stream asked for, then its first chunk.
    EXPECT_LE(started, progress.placement_answered_at);
    EXPECT_LE(progress.placement_answered_at, progress.stream_requested_at);
    EXPECT_LE(progress.stream_requested_at, progress.first_resident_at);
    EXPECT_TRUE(progress.placing);
    EXPECT_FALSE(progress.reading_files);
    // A plain checkpoint stores every chunk RAW: all are placed. A lazy image's compressed and
    // zero chunks come as bytes; the RAW ones are placed.
    EXPECT_GT(progress.placed_chunks, 0u);
    if (name == "raw") {
      EXPECT_EQ(progress.placed_chunks, progress.total_chunks);
      EXPECT_EQ(progress.placed_bytes, progress.total_bytes);
      EXPECT_EQ(engine.bytes_written(), 0u);  // the engine never saw a byte
    }
    // The server counts what it placed, and which of those it checked first: a lazy image records
    // every chunk's checksum; a plain checkpoint's are known only once the server hashed a chunk.
    const std::optional<PlacementCounters> after = ServerPlacementCounters();
    ASSERT_TRUE(after.has_value());
    EXPECT_EQ(after->placed_chunks - before->placed_chunks, progress.placed_chunks);
    if (name == "lazy")
      EXPECT_EQ(after->verified_chunks - before->verified_chunks, progress.placed_chunks);
    else
      EXPECT_LE(after->verified_chunks - before->verified_chunks, progress.placed_chunks);
  }
}

// A client that declines the offer streams the bytes itself; its start-up has no PlaceInto.
TEST_F(PlacementTest, DecliningClientStreamsWithNoPlacementAnswer) {
  client::HostCopyEngine engine;
  client::SessionOptions options = Options("raw");
  options.accept_placement = false;
  client::RestoreSession session(options, engine);
  const auto started = std::chrono::steady_clock::now();
  ASSERT_TRUE(session.Start().ok());
  Status complete = session.WaitComplete(60s);
  ASSERT_TRUE(complete.ok()) << complete.ToString();
  ExpectCheckpointBytes(session, engine, "raw");
  const client::Progress progress = session.progress();
  EXPECT_FALSE(progress.placing);
  EXPECT_EQ(progress.placed_chunks, 0u);
  EXPECT_EQ(progress.placement_answered_at, std::chrono::steady_clock::time_point{});
  EXPECT_LE(started, progress.stream_requested_at);
  EXPECT_LE(progress.stream_requested_at, progress.first_resident_at);
}

TEST_F(PlacementTest, EnsurePlacesTheChunkItWaitsFor) {
  client::HostCopyEngine engine;
  client::SessionOptions options = Options("raw");
  options.stream_all = false;
  client::RestoreSession session(options, engine);
  ASSERT_TRUE(session.Start().ok());
  // The largest BO, and a chunk of it past its first.
  uint32_t bo = 0;
  for (uint32_t i = 0; i < session.bos().size(); ++i)
    if (session.bos()[i].size > session.bos()[bo].size) bo = i;
  const uint64_t offset = uint64_t{session.chunk_size()};
  ASSERT_GE(session.bos()[bo].size, offset + session.chunk_size());
  Status ensured = session.Ensure(bo, offset, 4096, 20s);
  ASSERT_TRUE(ensured.ok()) << ensured.ToString();
  EXPECT_TRUE(session.IsResident(bo, offset, 4096));
  EXPECT_EQ(session.progress().placed_chunks, 1u);
  auto want =
      expected_["raw"].find(BoKey{session.bos()[bo].process_id, session.bos()[bo].bo_index});
  ASSERT_NE(want, expected_["raw"].end());
  Result<std::span<uint8_t>> got = engine.Mapping(bo);
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(std::equal(got->begin() + static_cast<ptrdiff_t>(offset),
                         got->begin() + static_cast<ptrdiff_t>(offset + session.chunk_size()),
                         want->second.begin() + static_cast<ptrdiff_t>(offset)));
}

// The server's check refuses the flipped chunk, so it goes as bytes; the client's own check
// refuses those too, asks again and fails loudly. The destination never holds the bad bytes.
TEST_F(PlacementTest, ChunkFailingTheServersCheckIsNeverPlaced) {
  client::HostCopyEngine engine;
  client::RestoreSession session(Options("corrupt"), engine);
  ASSERT_TRUE(session.Start().ok());
  Status complete = session.WaitComplete(60s);
  ASSERT_FALSE(complete.ok());
  EXPECT_EQ(complete.code(), Code::kCorrupt) << complete.ToString();
  EXPECT_FALSE(session.IsResident(corrupt_bo_, uint64_t{corrupt_chunk_} * session.chunk_size(), 1));
  Result<std::span<uint8_t>> got = engine.Mapping(corrupt_bo_);
  ASSERT_TRUE(got.ok());
  const auto chunk = got->subspan(uint64_t{corrupt_chunk_} * session.chunk_size(),
                                  std::min<uint64_t>(session.chunk_size(), got->size()));
  EXPECT_TRUE(std::ranges::all_of(chunk, [](uint8_t b) { return b == 0; }));
  EXPECT_TRUE(server_->LogShows({"not placed"})) << "no fallback to bytes was logged";
}

// A placed demand request for a chunk that the page cache holds, its checksum known (a lazy
// image's), is placed like any other. The server sends such chunks of an ordinary demand request
// from the page cache straight from its network thread (sendfile); a placed one must not go that
// way: the chunk may be being placed at that moment, and once the client has the bytes it may
// change them, so the placement must not land afterwards (docs/protocol.md, "Placement", 4).
// Found by the server fuzz harness (docs/hostile-input.md): its seed
// place-on-the-wrong-connections got the chunks it asked placed as bytes.
TEST_F(PlacementTest, PlacedDemandForACachedChunkIsPlaced) {
  auto source = image::ImageSource::Open(dir_->path() / "images" / "lazy");
  ASSERT_TRUE(source.ok()) << source.status().ToString();
  const manifest::Manifest& manifest = (*source)->manifest();
  // The first chunk stored RAW, read here once so that the page cache holds it.
  std::optional<uint32_t> bo;
  uint32_t chunk = 0;
  std::vector<uint8_t> stored;
  for (int b = 0; b < manifest.bos_size() && !bo; ++b) {
    for (int c = 0; c < manifest.bos(b).chunks_size(); ++c) {
      auto located =
          (*source)->LocateStoredChunk(static_cast<uint32_t>(b), static_cast<uint32_t>(c));
      ASSERT_TRUE(located.ok()) << located.status().ToString();
      if (located->codec != manifest::CODEC_RAW || !located->in_file) continue;
      stored.resize(located->in_file->length);
      ASSERT_TRUE(
          ReadExactAt(located->in_file->fd, located->in_file->offset, stored, "chunk").ok());
      bo = static_cast<uint32_t>(b);
      chunk = static_cast<uint32_t>(c);
      break;
    }
  }
  ASSERT_TRUE(bo.has_value()) << "the lazy test image stores no chunk RAW";
  const uint64_t size = manifest.bos(static_cast<int>(*bo)).size();
  const UniqueFd memfd_owner(::memfd_create("placement-test", MFD_CLOEXEC));
  const int memfd = memfd_owner.get();
  ASSERT_GE(memfd, 0);
  ASSERT_EQ(::ftruncate(memfd, static_cast<off_t>(size)), 0);

  auto client = Opened(server_->unix_endpoint(), "lazy");
  ASSERT_TRUE(client->Send(PlaceIntoFrame(*bo, memfd, size)).ok());
  Result<Frame> placed_into = client->Read();
  ASSERT_TRUE(placed_into.ok()) << placed_into.status().ToString();
  ASSERT_TRUE(placed_into->header.has_place_into_reply()) << placed_into->header.ShortDebugString();
  ASSERT_TRUE(client->Credit(64 << 20).ok());
  wire::Header request;
  request.set_request_id(5);
  request.mutable_request()->set_priority(wire::PRIORITY_DEMAND);
  request.mutable_request()->set_placed(true);
  wire::ChunkRange* range = request.mutable_request()->add_ranges();
  range->set_bo(*bo);
  range->set_first_chunk(chunk);
  range->set_chunk_count(1);
  ASSERT_TRUE(client->Send(request).ok());
  Result<Frame> reply = client->Read();
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  ASSERT_TRUE(reply->header.has_chunk()) << reply->header.ShortDebugString();
  EXPECT_TRUE(reply->header.chunk().placed())
      << "sent as bytes: " << reply->header.ShortDebugString();
  EXPECT_TRUE(reply->payload.empty());
  std::vector<uint8_t> in_place(stored.size());
  ASSERT_TRUE(ReadExactAt(memfd, uint64_t{chunk} * manifest.chunk_size(), in_place, "memfd").ok());
  EXPECT_TRUE(in_place == stored) << "the destination holds other bytes than the chunk's";
}

// --placement cuda on a host that cannot place into a GPU (a build without CUDA, or no usable
// device or driver, as on the development VM): the server refuses to start and says why,
// rather than serving without the placement it was asked for.
TEST(PlacementStartup, CudaPlacementWithoutAUsableGpuRefusesToStart) {
  if (fs::exists("/dev/nvidiactl")) GTEST_SKIP() << "a GPU may be usable here";
  TempDir dir;
  const std::string command =
      std::string(GPULAZY_BIN_DIR) + "/gpulazy-server --images " + dir.path().string() +
      " --listen unix:" + (dir.path() / "s.sock").string() + " --placement cuda";
  const ::gpulazy::testing::CommandRun run = ::gpulazy::testing::RunCommand(command, 30);
  EXPECT_NE(run.exit_code, 0) << run.out;
  EXPECT_NE(run.out.find("--placement"), std::string::npos) << run.out;
  EXPECT_FALSE(fs::exists(dir.path() / "s.sock")) << run.out;
}

TEST_F(PlacementTest, OfferedOnUnixSocketsOnly) {
  TestClient unix_client(server_->unix_endpoint());
  Result<wire::HelloReply> over_unix = unix_client.Hello();
  ASSERT_TRUE(over_unix.ok());
  EXPECT_EQ(over_unix->placement().kind(), "memfd");
  auto tcp = Opened(server_->tcp_endpoint(), "raw");
  ASSERT_TRUE(tcp->Send(PlaceIntoFrame(0, 0, 1)).ok());
  Result<wire::Error> error = tcp->ReadError();
  ASSERT_TRUE(error.ok());
  EXPECT_NE(error->message().find("Unix sockets"), std::string::npos) << error->message();
}

TEST_F(PlacementTest, MisusedPlaceIntoIsRefusedWithItsReason) {
  const int memfd = ::memfd_create("placement-test", MFD_CLOEXEC);
  ASSERT_GE(memfd, 0);
  ASSERT_EQ(::ftruncate(memfd, 1 << 20), 0);
  const int not_memfd = ::open("/proc/self/exe", O_RDONLY | O_CLOEXEC);
  ASSERT_GE(not_memfd, 0);
  const int sealed = ::memfd_create("placement-sealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(sealed, 0);
  ASSERT_EQ(::ftruncate(sealed, 1 << 20), 0);
  ASSERT_EQ(::fcntl(sealed, F_ADD_SEALS, F_SEAL_WRITE), 0);
  struct Case {
    const char* what;
    wire::Header frame;
    const char* reason;
  };
  std::vector<Case> cases = {
      {"wrong kind", PlaceIntoFrame(0, memfd, 1 << 20, "cuda"), "places into memfd memory"},
      {"BO out of range", PlaceIntoFrame(1000, memfd, 1 << 20), "not in the image"},
      {"too small for the BO", PlaceIntoFrame(0, memfd, 1), "holds 1 bytes"},
      {"not a memfd", PlaceIntoFrame(0, not_memfd, 1ull << 30), "not a memfd"},
      {"claims more than it holds", PlaceIntoFrame(0, memfd, 1ull << 40), "not the"},
      {"no such descriptor", PlaceIntoFrame(0, 100000, 1ull << 20), "pidfd_getfd"},
      {"sealed against writing", PlaceIntoFrame(0, sealed, 1ull << 20), "sealed against writing"},
  };
  // One more destination than a frame may carry: refused for its count, before the repeated BO.
  wire::Header too_many = PlaceIntoFrame(0, memfd, 1 << 20);
  const wire::PlacementTarget first = too_many.place_into().targets(0);
  for (size_t i = 0; i < kMaxTargetsPerPlaceInto; ++i)
    *too_many.mutable_place_into()->add_targets() = first;
  ASSERT_EQ(static_cast<size_t>(too_many.place_into().targets_size()), kMaxTargetsPerPlaceInto + 1);
  cases.push_back({"too many destinations in a frame", too_many, "at most 256"});
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    auto client = Opened(server_->unix_endpoint(), "raw");
    ASSERT_TRUE(client->Send(c.frame).ok());
    Result<wire::Error> error = client->ReadError();
    ASSERT_TRUE(error.ok()) << error.status().ToString();
    EXPECT_NE(error->message().find(c.reason), std::string::npos) << error->message();
    EXPECT_EQ(error->code(), wire::ERROR_BAD_REQUEST) << error->message();
  }
  {
    SCOPED_TRACE("placed before PlaceInto");
    auto client = Opened(server_->unix_endpoint(), "raw");
    wire::Header request;
    request.set_request_id(3);
    request.mutable_request()->set_stream_all(true);
    request.mutable_request()->set_placed(true);
    ASSERT_TRUE(client->Send(request).ok());
    Result<wire::Error> error = client->ReadError();
    ASSERT_TRUE(error.ok());
    EXPECT_NE(error->message().find("PlaceInto"), std::string::npos) << error->message();
  }
  {
    SCOPED_TRACE("before OpenImage");
    TestClient client(server_->unix_endpoint());
    ASSERT_TRUE(client.Hello().ok());
    ASSERT_TRUE(client.Send(PlaceIntoFrame(0, memfd, 1 << 20)).ok());
    Result<wire::Error> error = client.ReadError();
    ASSERT_TRUE(error.ok());
    EXPECT_NE(error->message().find("after OpenImage"), std::string::npos) << error->message();
  }
  ::close(memfd);
  ::close(not_memfd);
  ::close(sealed);
}

// A memfd destination is taken from the process that connected, through the pidfd the kernel
// gave for it then (SO_PEERPIDFD), not by its pid: once a client exits, a new process may get
// its number, and the server (allowed to ptrace it) would take that process's descriptor. Here a
// child connects, hands us the socket and exits; a second child is made with its pid (clone3's
// set_tid, as CRIU restores pids) and holds a memfd at the number the PlaceInto names.
TEST_F(PlacementTest, DestinationsComeOnlyFromTheProcessThatConnected) {
  {
    int pair[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
    int pidfd = -1;
    socklen_t length = sizeof(pidfd);
    const bool has_peer_pidfd =
        ::getsockopt(pair[0], SOL_SOCKET, 77 /* SO_PEERPIDFD */, &pidfd, &length) == 0;
    if (pidfd >= 0) ::close(pidfd);
    ::close(pair[0]);
    ::close(pair[1]);
    if (!has_peer_pidfd) GTEST_SKIP() << "no SO_PEERPIDFD (Linux 6.5): the server uses the pid";
  }
  const int memfd = ::memfd_create("placement-victim", MFD_CLOEXEC);
  ASSERT_GE(memfd, 0);
  ASSERT_EQ(::ftruncate(memfd, 1 << 20), 0);
  int handoff[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, handoff), 0);
  // Everything the first child needs is ready before the fork: it only makes system calls.
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  const std::string path = server_->unix_endpoint().path;
  ASSERT_LT(path.size(), sizeof(address.sun_path));
  std::memcpy(address.sun_path, path.data(), path.size());
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  char byte = 'x';
  iovec iov{&byte, 1};
  msghdr message{};
  message.msg_iov = &iov;
  message.msg_iovlen = 1;
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  cmsghdr* header = CMSG_FIRSTHDR(&message);
  header->cmsg_level = SOL_SOCKET;
  header->cmsg_type = SCM_RIGHTS;
  header->cmsg_len = CMSG_LEN(sizeof(int));
  const pid_t client = ::fork();
  ASSERT_GE(client, 0);
  if (client == 0) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0 || ::connect(fd, reinterpret_cast<const sockaddr*>(&address), sizeof(address)) != 0)
      ::_exit(1);
    std::memcpy(CMSG_DATA(header), &fd, sizeof(fd));
    ::_exit(::sendmsg(handoff[1], &message, 0) == 1 ? 0 : 2);
  }
  ::close(handoff[1]);
  int status = 0;
  ASSERT_EQ(::waitpid(client, &status, 0), client);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  std::array<uint8_t, 1> got{};
  std::vector<UniqueFd> received;
  Result<std::optional<size_t>> handed =
      net::ReceiveWithFds(handoff[0], got, 1, &received, net::Blocking::kYes);
  ::close(handoff[0]);
  ASSERT_TRUE(handed.ok()) << handed.status().ToString();
  ASSERT_EQ(received.size(), 1u);
  TestClient connected(std::move(received.front()));

  // The exited client's pid, taken by a process that holds a memfd at the number named below.
  int hold[2];
  ASSERT_EQ(::pipe2(hold, O_CLOEXEC), 0);
  pid_t reused_pid = client;
  clone_args args{};
  args.exit_signal = SIGCHLD;
  args.set_tid = reinterpret_cast<uint64_t>(&reused_pid);
  args.set_tid_size = 1;
  const long reuser = ::syscall(SYS_clone3, &args, sizeof(args));
  if (reuser == 0) {
    ::close(hold[1]);
    char wait_byte;
    (void)::read(hold[0], &wait_byte, 1);  // until the test closes its end
    ::_exit(0);
  }
  const int clone_error = errno;
  ::close(hold[0]);
  if (reuser < 0) {
    ::close(hold[1]);
    ::close(memfd);
    GTEST_SKIP() << "cannot make a process with a chosen pid here (clone3 set_tid: "
                 << std::strerror(clone_error) << ")";
  }
  ASSERT_EQ(reuser, client);

  ASSERT_TRUE(connected.Hello().ok());
  ASSERT_TRUE(connected.Open("raw").ok());
  ASSERT_TRUE(connected.Send(PlaceIntoFrame(0, memfd, 1 << 20)).ok());
  Result<Frame> answer = connected.Read();
  ::close(hold[1]);
  ASSERT_EQ(::waitpid(static_cast<pid_t>(reuser), &status, 0), reuser);
  ::close(memfd);
  ASSERT_TRUE(answer.ok()) << answer.status().ToString();
  ASSERT_TRUE(answer->header.has_error())
      << "the server took a destination from the process that reused the client's pid";
  EXPECT_NE(answer->header.error().message().find("the client's process has exited"),
            std::string::npos)
      << answer->header.error().message();
}

// The host twin of CudaSupersedeTest: every connection cut mid-stream while the server places
// into the client's memfds, whether the server sees the break or not. The client reconnects and
// the restore ends byte-exact with every chunk placed.
class PlacedReconnectTest : public ::testing::TestWithParam<bool> {};

TEST_P(PlacedReconnectTest, AReconnectedSessionPlacesIntoTheSameMemfdsByteExact) {
  TempDir dir;
  const fs::path root = dir.path() / "images";
  fs::create_directories(root);
  ASSERT_TRUE(
      MakeTestImage(root / "raw", {.bytes = 256ull << 20, .seed = 57, .processes = 2}).ok());
  auto expected = LoadCriuContents(root / "raw");
  ASSERT_TRUE(expected.ok()) << expected.status().ToString();
  ServerProcess server(dir.path(), root, {"--raw-chunk-size", "256K", "--placement", "memfd"});
  ASSERT_TRUE(server.ready()) << server.Log();
  gpulazy::testing::UnixRelay relay(dir.path() / "relay.sock", server.socket_path());
  client::HostCopyEngine engine;
  client::RestoreSession session(CutSessionOptions(dir.path() / "relay.sock", "raw"), engine);
  ASSERT_TRUE(session.Start().ok());
  CutMidStreamAndFinish(session, relay, server, GetParam());
  if (HasFatalFailure()) return;
  ExpectRestoredBytes(session, engine, *expected);
}

INSTANTIATE_TEST_SUITE_P(ServerSawTheBreak, PlacedReconnectTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "ServerSawIt" : "ServerDidNot";
                         });

}  // namespace
}  // namespace gpulazy::server::testing
