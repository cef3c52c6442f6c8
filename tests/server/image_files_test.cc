// The local data plane against a real gpulazy-server (docs/protocol.md, "Image files"): a files
// connection receives the image's files as descriptors; by-reference requests are answered
// with chunk locations whose bytes, read from those descriptors, are the checkpoint's; and
// every misuse is refused with an error naming why (want_files without a session, over TCP, with
// the server's --no-pass-files, by_reference before the files were passed).
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/io.h"
#include "lazy-server/image/lazy_image.h"
#include "lazy-server/image/synth.h"
#include "page-client/host_engine.h"
#include "page-client/local_restore.h"
#include "page-client/net/fd_passing.h"
#include "page-client/restore_session.h"
#include "page-client/server_connection.h"
#include "tests/client/forwarding_engine.h"
#include "tests/client/verifying_engine.h"
#include "tests/server/checkpoint_bytes.h"
#include "tests/server/test_support.h"
#include "tests/support/threads.h"

namespace gpulazy::server::testing {
namespace {
namespace fs = std::filesystem;
using namespace std::chrono_literals;

Status MakeImage(const fs::path& dir, uint64_t bytes, uint64_t seed, bool lazy) {
  return MakeTestImage(
      dir, {.bytes = bytes, .seed = seed, .lazy = lazy, .processes = 2, .lazy_chunk = 128 * 1024});
}

// FetchImageFiles, run to completion on its own io_context.
Result<std::shared_ptr<const client::ImageFileSet>> Fetch(
    const net::Endpoint& endpoint, uint64_t session, std::string secret,
    const client::ChunkTableShape* shape = nullptr) {
  boost::asio::io_context io;
  wire::Hello join;
  join.set_min_version(kProtocolVersion);
  join.set_max_version(kProtocolVersion);
  join.set_join_session(session);
  join.set_join_secret(std::move(secret));
  std::optional<Result<std::shared_ptr<const client::ImageFileSet>>> result;
  boost::asio::co_spawn(
      io,
      [&]() -> net::Awaitable<void> {
        result.emplace(co_await client::FetchImageFiles(endpoint, join, 5000ms, shape));
      },
      boost::asio::detached);
  io.run();
  if (!result) return Internal("FetchImageFiles did not finish");
  return std::move(*result);
}

// What a client expects a chunk table of the image `reply` opened to look like.
client::ChunkTableShape ShapeOf(const wire::OpenImageReply& reply) {
  client::ChunkTableShape shape;
  for (const wire::BoInfo& bo : reply.bos())
    shape.bo_sizes.push_back(bo.size());
  shape.chunk_size = reply.chunk_size();
  shape.lazy_image = reply.lazy_image();
  shape.max_payload = 1u << 20;  // the fixture server's --max-frame
  return shape;
}

class ImageFilesTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<TempDir>();
    const fs::path root = dir_->path() / "images";
    fs::create_directories(root);
    ASSERT_TRUE(MakeImage(root / "raw", 3ull << 20, 31, false).ok());
    ASSERT_TRUE(MakeImage(root / "lazy", 3ull << 20, 32, true).ok());
    for (const char* name : {"raw", "lazy"}) {
      auto contents = LoadCriuContents(root / name);
      ASSERT_TRUE(contents.ok()) << contents.status().ToString();
      expected_[name] = std::move(*contents);
    }
    server_ = std::make_unique<ServerProcess>(
        dir_->path(), root,
        std::vector<std::string>{"--raw-chunk-size", "256K", "--max-frame", "1M"});
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

  // Every BO the session restored into `host` is byte for byte the checkpoint's `image`.
  static void ExpectCheckpointBytes(const client::RestoreSession& session,
                                    const client::HostCopyEngine& host, const std::string& image) {
    ExpectRestoredBytes(session, host, expected_[image]);
  }

  static std::map<std::string, std::map<BoKey, std::vector<uint8_t>>> expected_;
  static std::unique_ptr<TempDir> dir_;
  static std::unique_ptr<ServerProcess> server_;
};
std::map<std::string, std::map<BoKey, std::vector<uint8_t>>> ImageFilesTest::expected_;
std::unique_ptr<TempDir> ImageFilesTest::dir_;
std::unique_ptr<ServerProcess> ImageFilesTest::server_;

TEST_F(ImageFilesTest, ByReferenceChunksReadFromThePassedFilesAreTheCheckpointsBytes) {
  for (const std::string name : {"raw", "lazy"}) {
    SCOPED_TRACE(name);
    TestClient client(server_->unix_endpoint());
    ASSERT_TRUE(client.Hello().ok());
    Result<wire::OpenImageReply> reply = client.Open(name);
    ASSERT_TRUE(reply.ok()) << reply.status().ToString();
    Result<std::shared_ptr<const client::ImageFileSet>> files =
        Fetch(server_->unix_endpoint(), reply->session(), reply->session_secret());
    ASSERT_TRUE(files.ok()) << files.status().ToString();
    // A lazy image stores every chunk in one file; the raw one in a pages file per process/GPU.
    EXPECT_EQ((*files)->files.size(), name == "lazy" ? 1u : 4u);

    // Credit for the whole image: no credit needs returning while we collect the stream.
    ASSERT_TRUE(client.Credit(1ull << 30).ok());
    wire::Header stream_all;
    stream_all.set_request_id(2);
    stream_all.mutable_request()->set_stream_all(true);
    stream_all.mutable_request()->set_by_reference(true);
    ASSERT_TRUE(client.Send(stream_all).ok());
    std::vector<Frame> chunks;
    for (;;) {
      Result<Frame> frame = client.Read(10s);
      ASSERT_TRUE(frame.ok()) << frame.status().ToString();
      if (frame->header.has_stream_done()) break;
      ASSERT_TRUE(frame->header.has_chunk()) << frame->header.DebugString();
      wire::ChunkData& data = *frame->header.mutable_chunk();
      ASSERT_TRUE(data.has_in_file());
      ASSERT_TRUE(frame->payload.empty());
      // A lazy image has recorded checksums; a plain CRIU checkpoint has them only for chunks
      // the server has read (and hashed) before. A checksum given is checked below.
      if (name == "lazy") {
        EXPECT_FALSE(data.no_checksum());
      }
      const wire::FileRange& where = data.in_file();
      ASSERT_LT(where.file(), (*files)->files.size());
      frame->payload.resize(where.length());
      ASSERT_TRUE(ReadExactAt((*files)->files[where.file()].fd.get(), where.offset(),
                              frame->payload, "passed file")
                      .ok());
      // As a payload for DecodeChunkFrame, which checks the lazy image's recorded checksum.
      if (data.no_checksum())
        data.set_checksum(XXH3_64bits(frame->payload.data(), frame->payload.size()));
      data.clear_in_file();
      chunks.push_back(std::move(*frame));
    }
    Status verified = VerifyStream(*reply, chunks, expected_[name]);
    EXPECT_TRUE(verified.ok()) << verified.ToString();
  }
}

// The window a RestoreSession grants: its file window while it reads the passed files (the
// credit then bounds queued file ranges, not payload memory), its plain window otherwise.
TEST_F(ImageFilesTest, SessionReadingFilesGrantsItsFileWindow) {
  for (const bool read_files : {true, false}) {
    SCOPED_TRACE(read_files ? "reading files" : "through the socket");
    client::HostCopyEngine engine;
    client::SessionOptions options;
    options.endpoint = server_->unix_endpoint().ToString();
    options.image = "raw";
    options.window_bytes = 8u << 20;
    options.file_window_bytes = 96u << 20;
    options.read_files = read_files;
    options.stream_all = false;  // nothing is sent, so the server's credit stays as granted
    client::RestoreSession session(options, engine);
    ASSERT_TRUE(session.Start().ok());
    const uint64_t want = read_files ? options.file_window_bytes : options.window_bytes;
    TestClient observer(server_->unix_endpoint());
    ASSERT_TRUE(observer.Hello().ok());
    uint64_t credit = 0;
    for (int attempt = 0; attempt < 500 && credit != want; ++attempt) {
      Result<std::string> text = observer.Stats(100 + attempt);
      ASSERT_TRUE(text.ok()) << text.status().ToString();
      const nlohmann::json doc = nlohmann::json::parse(*text);
      for (const nlohmann::json& j : doc["sessions"])
        if (j["image"] == "raw" && j.contains("credit")) credit = j["credit"].get<uint64_t>();
      if (credit != want) std::this_thread::sleep_for(10ms);
    }
    EXPECT_EQ(credit, want);
    EXPECT_EQ(session.progress().reading_files, read_files);
  }
}

// Reading the passed files, several reader threads write into the engine at once: the host
// engine's populate helper (a thread named gl-populate) is stopped; through the socket the one
// receiving thread keeps it.
TEST_F(ImageFilesTest, ReadingFilesStopsTheHostEnginesPopulateHelper) {
  // The helper names itself once it runs: wait for the count rather than read it once.
  auto helpers_become = [](size_t want) {
    return gpulazy::testing::NiceOfThreadsNamedAwaiting("gl-populate", want).size();
  };
  for (const bool read_files : {true, false}) {
    SCOPED_TRACE(read_files ? "reading files" : "through the socket");
    client::HostCopyEngine engine;
    ASSERT_EQ(helpers_become(1), 1u);
    client::SessionOptions options;
    options.endpoint = server_->unix_endpoint().ToString();
    options.image = "raw";
    options.read_files = read_files;
    options.file_readers = 2;
    // One receiving thread through the socket, whatever the CPUs (LanesFor opens eight on 16).
    options.lanes = 1;
    options.stream_all = false;
    client::RestoreSession session(options, engine);
    ASSERT_TRUE(session.Start().ok());
    // The files arrive after Start returns: wait until the session reads them (or, through the
    // socket, a while: it never will), then count the helpers.
    for (int i = 0; i < 200 && session.progress().reading_files != read_files; ++i)
      std::this_thread::sleep_for(10ms);
    EXPECT_EQ(session.progress().reading_files, read_files);
    const size_t want = read_files ? 0 : 1;
    EXPECT_EQ(helpers_become(want), want);
  }
}

// A session names the threads it plans to write with to the engine before its chunk size, when
// an engine that stages writes sizes its buffers (the CUDA engine: four slots a writer): its
// file readers when it will read the files, else one per bulk connection (lanes).
TEST_F(ImageFilesTest, SessionAnnouncesItsWritersBeforeItsChunkSize) {
  for (const bool read_files : {true, false}) {
    SCOPED_TRACE(read_files ? "reading files" : "through the socket");
    client::WritersAtChunkSizeEngine engine;
    client::SessionOptions options;
    options.endpoint = server_->unix_endpoint().ToString();
    options.image = "raw";
    options.read_files = read_files;
    options.file_readers = 6;
    options.lanes = 3;
    client::RestoreSession session(options, engine);
    ASSERT_TRUE(session.Start().ok());
    ASSERT_TRUE(session.WaitComplete(30s).ok());
    EXPECT_EQ(engine.writers_at_chunk_size(), read_files ? 6u : 3u);
  }
}

// Left to the engine (file_readers = 0, the default), the session starts as many file readers
// as the engine prefers, or kDefaultWriters when it has no preference.
TEST_F(ImageFilesTest, SessionStartsAsManyFileReadersAsTheEnginePrefers) {
  for (const uint32_t preferred : {0u, 5u}) {
    SCOPED_TRACE(fmt::format("engine prefers {}", preferred));
    const size_t want = preferred != 0 ? preferred : client::kDefaultWriters;
    client::WritersAtChunkSizeEngine engine(preferred);
    client::SessionOptions options;
    options.endpoint = server_->unix_endpoint().ToString();
    options.image = "raw";
    options.stream_all = false;  // the session stays open, its readers alive
    client::RestoreSession session(options, engine);
    ASSERT_TRUE(session.Start().ok());
    EXPECT_EQ(gpulazy::testing::NiceOfThreadsNamed("gl-file-reader").size(), want);
    EXPECT_EQ(engine.writers_at_chunk_size(), want);
  }
}

// Background work runs nicer: the session's stream thread and file readers by background_nice,
// its demand thread (serving faults) at the caller's priority.
TEST_F(ImageFilesTest, SessionBackgroundThreadsRunNicerThanItsDemandThread) {
  using gpulazy::testing::NiceOfThreadsNamed;
  const int base = gpulazy::testing::ListThreads().at(static_cast<pid_t>(::gettid())).nice;
  ASSERT_LE(base, 19 - 5);
  client::HostCopyEngine engine;
  client::SessionOptions options;
  options.endpoint = server_->unix_endpoint().ToString();
  options.image = "raw";
  options.file_readers = 2;
  options.background_nice = 5;
  options.stream_all = false;  // the session stays open, its threads alive
  client::RestoreSession session(options, engine);
  ASSERT_TRUE(session.Start().ok());
  EXPECT_EQ(NiceOfThreadsNamed("gl-stream"), std::vector<int>{base + 5});
  EXPECT_EQ(NiceOfThreadsNamed("gl-file-reader"), (std::vector<int>{base + 5, base + 5}));
  // The demand thread may not have run yet when Start returns (it joins later).
  EXPECT_EQ(gpulazy::testing::NiceOfThreadsNamedAwaiting("gl-demand", 1), std::vector<int>{base});
  EXPECT_EQ(gpulazy::testing::ListThreads().at(static_cast<pid_t>(::gettid())).nice, base);

  client::SessionOptions bad = options;
  bad.background_nice = 20;
  client::RestoreSession refused(bad, engine);
  EXPECT_EQ(refused.Start().code(), Code::kInvalidArgument);
}

// A host engine whose file readers take 100 ms a chunk (inside the engine call, as a slow
// device copy would), and which records the thread that installed each chunk.
class SlowReadersEngine : public client::ForwardingHostEngine {
 public:
  // Not in place: every chunk comes through Write, where the reader is seen and held.
  SlowReadersEngine() : ForwardingHostEngine({.receive_in_place = false}) {}
  std::string_view name() const override { return "slow-readers"; }
  Status Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw,
               client::CopyDone done) override {
    char thread[16] = {};
    ::pthread_getname_np(::pthread_self(), thread, sizeof thread);
    {
      std::lock_guard lock(mu_);
      installed_by_[{bo, offset}] = thread;
    }
    if (std::string_view(thread) == "gl-file-reader") std::this_thread::sleep_for(100ms);
    return host_.Write(bo, offset, raw, std::move(done));
  }
  // The name of the thread that installed the chunk at `offset` of `bo` ("" if none did).
  std::string InstalledBy(uint32_t bo, uint64_t offset) const {
    std::lock_guard lock(mu_);
    auto found = installed_by_.find({bo, offset});
    return found == installed_by_.end() ? std::string() : found->second;
  }
  // Chunks that reached Write so far.
  size_t writes() const {
    std::lock_guard lock(mu_);
    return installed_by_.size();
  }

 private:
  mutable std::mutex mu_;
  std::map<std::pair<uint32_t, uint64_t>, std::string> installed_by_;
};

// A session on the fixture's "raw" image with one file reader (so its queue drains slowly).
client::SessionOptions OneReaderOptions(const net::Endpoint& endpoint) {
  client::SessionOptions options;
  options.endpoint = endpoint.ToString();
  options.image = "raw";
  options.file_readers = 1;
  return options;
}

// The image's last chunk: the last one the stream sends (table order, no profile).
struct LastChunk {
  uint32_t bo = 0;
  uint64_t last_byte = 0;  // offset of the BO's last byte
  uint64_t offset = 0;     // the chunk's offset in the BO
};
LastChunk LastChunkOf(const client::RestoreSession& session) {
  LastChunk last;
  last.bo = static_cast<uint32_t>(session.bos().size() - 1);
  last.last_byte = session.bos()[last.bo].size - 1;
  last.offset = last.last_byte / session.chunk_size() * session.chunk_size();
  return last;
}

// Waits until the stream has filled the session's window (the readers' queue is full).
void WaitForFullWindow(const client::RestoreSession& session, uint64_t window) {
  for (int i = 0; i < 1000 && session.progress().received_bytes < window; ++i)
    std::this_thread::sleep_for(5ms);
}

// A chunk that waits in the file readers' queue when someone needs it is read at once on the
// demand thread, not after the chunks queued before it: with one reader at 100 ms a chunk, a
// file reader would reach the last chunk only after the whole queue. Ensure must not ask the
// server again (the chunk was already on its way).
TEST_F(ImageFilesTest, EnsureOfAQueuedChunkReadsItAheadOfTheQueue) {
  SlowReadersEngine engine;
  client::RestoreSession session(OneReaderOptions(server_->unix_endpoint()), engine);
  ASSERT_TRUE(session.Start().ok());
  const client::Progress start = session.progress();
  ASSERT_GE(start.total_chunks, 8u);
  // Every chunk's reference has arrived (the window holds the whole image): all are queued.
  WaitForFullWindow(session, start.total_bytes);
  ASSERT_EQ(session.progress().received_bytes, start.total_bytes);
  const LastChunk last = LastChunkOf(session);
  ASSERT_TRUE(session.Ensure(last.bo, last.last_byte, 1, 30s).ok());
  const client::Progress at_ensure = session.progress();
  EXPECT_EQ(engine.InstalledBy(last.bo, last.offset), "gl-demand")
      << "the chunk was left in the readers' queue";
  EXPECT_EQ(at_ensure.demand_chunks, 0u) << "a queued chunk was asked for again";
  ASSERT_TRUE(session.WaitComplete(60s).ok());
  EXPECT_EQ(session.progress().resident_chunks, start.total_chunks);
  ExpectCheckpointBytes(session, engine.host(), "raw");
}

// A session closed while its readers' queue is full reads no more of it: the readers unclaim what
// is still queued (one reader at 100 ms a chunk holds back most of the image), at most the chunk
// a reader had taken still lands, and nothing reaches the engine after the destructor returned.
TEST_F(ImageFilesTest, SessionClosedWithChunksQueuedReadsNoMoreOfThem) {
  SlowReadersEngine engine;
  uint64_t total_chunks = 0;
  size_t writes_at_close = 0;
  {
    client::RestoreSession session(OneReaderOptions(server_->unix_endpoint()), engine);
    ASSERT_TRUE(session.Start().ok());
    const client::Progress start = session.progress();
    total_chunks = start.total_chunks;
    ASSERT_GE(total_chunks, 8u);
    WaitForFullWindow(session, start.total_bytes);
    ASSERT_EQ(session.progress().received_bytes, start.total_bytes);
    writes_at_close = engine.writes();
    ASSERT_LT(writes_at_close + 4, total_chunks) << "the queue drained before the test closed it";
  }
  const size_t writes_after = engine.writes();
  // The chunk a reader held when the session closed may still have reached the engine.
  EXPECT_LE(writes_after, writes_at_close + 1);
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(engine.writes(), writes_after) << "a write after the session was gone";
}

// A chunk someone waits for that arrives by reference after Ensure asked is read at once, not
// queued behind the background chunks the readers already hold. Without a demand connection the
// demand copy arrives on the stream connection, as a background chunk claimed after Ensure
// would, and the readers' queue is full (file window 2 MiB of 3 MiB): it must be installed by
// the thread that received it, never by a file reader in queue order.
TEST_F(ImageFilesTest, ChunkWaitedForBeforeItArrivesSkipsTheReadersQueue) {
  SlowReadersEngine engine;
  client::SessionOptions options = OneReaderOptions(server_->unix_endpoint());
  options.demand_connection = false;
  options.local_demand = false;    // the demand copy must come from the server
  options.window_bytes = 1 << 20;  // the fixture server's --max-frame
  options.file_window_bytes = 2 << 20;
  client::RestoreSession session(options, engine);
  ASSERT_TRUE(session.Start().ok());
  const client::Progress start = session.progress();
  ASSERT_GT(start.total_bytes, options.file_window_bytes);
  WaitForFullWindow(session, options.file_window_bytes);
  const LastChunk last = LastChunkOf(session);
  ASSERT_FALSE(session.IsResident(last.bo, last.last_byte, 1));
  ASSERT_TRUE(session.Ensure(last.bo, last.last_byte, 1, 30s).ok());
  EXPECT_EQ(session.progress().demand_chunks, 1u);
  EXPECT_EQ(engine.InstalledBy(last.bo, last.offset), "gl-stream")
      << "the chunk waited in the readers' queue";
  ASSERT_TRUE(session.WaitComplete(60s).ok());
  ExpectCheckpointBytes(session, engine.host(), "raw");
}

// The chunk table (Hello want_chunk_table, protocol version 2) locates every chunk of the image
// in the passed files: read from there and decoded, each is the checkpoint's bytes, and a lazy
// image's chunks carry their recorded checksums.
TEST_F(ImageFilesTest, ChunkTableLocatesEveryChunkInThePassedFiles) {
  for (const std::string name : {"raw", "lazy"}) {
    SCOPED_TRACE(name);
    TestClient client(server_->unix_endpoint());
    ASSERT_TRUE(client.Hello(0, {}, {}, /*max_version=*/2).ok());
    Result<wire::OpenImageReply> reply = client.Open(name);
    ASSERT_TRUE(reply.ok()) << reply.status().ToString();
    const client::ChunkTableShape shape = ShapeOf(*reply);
    Result<std::shared_ptr<const client::ImageFileSet>> files =
        Fetch(server_->unix_endpoint(), reply->session(), reply->session_secret(), &shape);
    ASSERT_TRUE(files.ok()) << files.status().ToString();
    const client::ImageFileSet& set = **files;
    ASSERT_FALSE(set.chunk_table.empty());
    std::vector<Frame> chunks;
    for (uint32_t bo = 0; bo < static_cast<uint32_t>(reply->bos_size()); ++bo) {
      const uint32_t count = reply->bos(static_cast<int>(bo)).chunk_count();
      EXPECT_EQ(set.Locate(bo, count), nullptr) << "located past BO " << bo << "'s last chunk";
      for (uint32_t chunk = 0; chunk < count; ++chunk) {
        const client::ImageFileSet::Location* where = set.Locate(bo, chunk);
        ASSERT_NE(where, nullptr) << "BO " << bo << " chunk " << chunk;
        if (name == "lazy") {
          EXPECT_TRUE(where->checksum.has_value());
        }
        Frame frame;
        frame.payload.resize(where->stored_length);
        ASSERT_TRUE(ReadExactAt(set.files[where->file].fd.get(), where->offset, frame.payload,
                                "passed file")
                        .ok());
        wire::ChunkData* data = frame.header.mutable_chunk();
        data->set_bo(bo);
        data->set_chunk(chunk);
        data->set_codec(where->codec);
        data->set_raw_length(static_cast<uint32_t>(std::min<uint64_t>(
            reply->chunk_size(),
            reply->bos(static_cast<int>(bo)).size() - uint64_t{chunk} * reply->chunk_size())));
        // Checked by VerifyStream against the decoded bytes; a plain checkpoint's unread chunks
        // have none yet, so the bytes themselves are the check.
        data->set_checksum(
            where->checksum.value_or(XXH3_64bits(frame.payload.data(), frame.payload.size())));
        chunks.push_back(std::move(frame));
      }
    }
    EXPECT_EQ(chunks.size(), set.chunk_table.size());
    Status verified = VerifyStream(*reply, chunks, expected_[name]);
    EXPECT_TRUE(verified.ok()) << verified.ToString();
  }
}

// The chunk table is built once per opened image and shared: files connections asking for it
// again (a client's reconnects, or one holding many connections open without reading) cost no
// new build and no new copy.
TEST_F(ImageFilesTest, TheChunkTableIsBuiltOncePerImage) {
  TestClient client(server_->unix_endpoint());
  ASSERT_TRUE(client.Hello(0, {}, {}, /*max_version=*/2).ok());
  Result<wire::OpenImageReply> reply = client.Open("lazy");
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  const client::ChunkTableShape shape = ShapeOf(*reply);
  auto built = [&] {
    Result<std::string> stats = client.Stats();
    EXPECT_TRUE(stats.ok()) << stats.status().ToString();
    return stats.ok()
               ? nlohmann::json::parse(*stats)["server"]["chunk_tables_built"].get<uint64_t>()
               : uint64_t{0};
  };
  const uint64_t before = built();
  size_t first_size = 0;
  for (int i = 0; i < 3; ++i) {
    Result<std::shared_ptr<const client::ImageFileSet>> files =
        Fetch(server_->unix_endpoint(), reply->session(), reply->session_secret(), &shape);
    ASSERT_TRUE(files.ok()) << files.status().ToString();
    ASSERT_FALSE((*files)->chunk_table.empty());
    if (i == 0) first_size = (*files)->chunk_table.size();
    EXPECT_EQ((*files)->chunk_table.size(), first_size);
  }
  // An earlier test may have built this image's table already: then none here.
  EXPECT_LE(built() - before, 1u);
  EXPECT_GE(built(), 1u);
}

// With the chunk table a chunk Ensure waits for is read from the passed files by the session
// itself: it comes even while the server is stopped (SIGSTOP), and the server is never asked.
// Without it (local_demand off) the server answers, as before.
TEST_F(ImageFilesTest, EnsureReadsFromTheFilesWithoutAskingTheServer) {
  for (const std::string name : {"raw", "lazy"}) {
    SCOPED_TRACE(name);
    client::HostCopyEngine engine;
    client::SessionOptions options = OneReaderOptions(server_->unix_endpoint());
    options.image = name;
    options.stream_all = false;  // only Ensure brings chunks in
    client::RestoreSession session(options, engine);
    ASSERT_TRUE(session.Start().ok());
    for (int i = 0; i < 500 && !session.progress().reading_files; ++i)
      std::this_thread::sleep_for(10ms);
    ASSERT_TRUE(session.progress().reading_files);
    ASSERT_EQ(::kill(server_->pid(), SIGSTOP), 0);
    struct Continue {
      pid_t pid;
      ~Continue() { ::kill(pid, SIGCONT); }
    } resume{server_->pid()};
    uint64_t ensured = 0;
    for (uint32_t bo = 0; bo < session.bos().size(); ++bo) {
      const uint64_t size = session.bos()[bo].size;
      Status status =
          session.Ensure(bo, size / 3, std::min<uint64_t>(size - size / 3, 300000), 10s);
      ASSERT_TRUE(status.ok()) << "BO " << bo << ": " << status.ToString();
      ++ensured;
    }
    const client::Progress p = session.progress();
    EXPECT_GE(p.demand_chunks, ensured);
    EXPECT_EQ(p.local_demand_chunks, p.demand_chunks);
    for (uint32_t bo = 0; bo < session.bos().size(); ++bo) {
      const client::BoEntry& entry = session.bos()[bo];
      const auto& want = expected_[name].at(BoKey{entry.process_id, entry.bo_index});
      Result<std::span<uint8_t>> got = engine.Mapping(bo);
      ASSERT_TRUE(got.ok());
      const uint64_t from = entry.size / 3;
      const uint64_t length = std::min<uint64_t>(entry.size - from, 300000);
      EXPECT_TRUE(std::equal(got->begin() + static_cast<ptrdiff_t>(from),
                             got->begin() + static_cast<ptrdiff_t>(from + length),
                             want.begin() + static_cast<ptrdiff_t>(from)))
          << "BO " << bo;
    }
  }
  // The server's way, for comparison: nothing read locally, and every byte right.
  client::HostCopyEngine engine;
  client::SessionOptions options = OneReaderOptions(server_->unix_endpoint());
  options.stream_all = false;
  options.local_demand = false;
  client::RestoreSession session(options, engine);
  ASSERT_TRUE(session.Start().ok());
  ASSERT_TRUE(session.Ensure(0, 0, session.bos()[0].size, 30s).ok());
  EXPECT_GT(session.progress().demand_chunks, 0u);
  EXPECT_EQ(session.progress().local_demand_chunks, 0u);
  Result<std::span<uint8_t>> got = engine.Mapping(0);
  ASSERT_TRUE(got.ok());
  const auto& want =
      expected_["raw"].at(BoKey{session.bos()[0].process_id, session.bos()[0].bo_index});
  EXPECT_TRUE(std::ranges::equal(*got, want));
}

// With the chunk table, the thread that calls Ensure reads and installs the chunks it waits for
// itself (demand_on_caller): a fault's chunk does not wait for the demand thread to wake. Several
// callers at once each install their own chunks, byte for byte the checkpoint's. With
// demand_on_caller off, the demand thread does it.
TEST_F(ImageFilesTest, EnsureInstallsOnTheCallersThread) {
  for (const bool on_caller : {true, false}) {
    SCOPED_TRACE(on_caller ? "demand_on_caller" : "demand thread");
    SlowReadersEngine engine;
    client::SessionOptions options = OneReaderOptions(server_->unix_endpoint());
    options.stream_all = false;  // only Ensure brings chunks in
    options.demand_on_caller = on_caller;
    client::RestoreSession session(options, engine);
    ASSERT_TRUE(session.Start().ok());
    for (int i = 0; i < 500 && !session.progress().reading_files; ++i)
      std::this_thread::sleep_for(10ms);
    ASSERT_TRUE(session.progress().reading_files);
    const uint32_t bos = static_cast<uint32_t>(session.bos().size());
    ASSERT_GE(bos, 2u);
    std::vector<Status> results(bos);
    std::vector<std::thread> callers;
    for (uint32_t bo = 0; bo < bos; ++bo) {
      callers.emplace_back([&, bo] {
        ::pthread_setname_np(::pthread_self(), ("caller-" + std::to_string(bo)).c_str());
        results[bo] = session.Ensure(bo, 0, session.bos()[bo].size, 30s);
      });
    }
    for (std::thread& caller : callers)
      caller.join();
    for (uint32_t bo = 0; bo < bos; ++bo) {
      ASSERT_TRUE(results[bo].ok()) << "BO " << bo << ": " << results[bo].ToString();
      const std::string want_thread = on_caller ? "caller-" + std::to_string(bo) : "gl-demand";
      for (uint64_t offset = 0; offset < session.bos()[bo].size; offset += session.chunk_size())
        EXPECT_EQ(engine.InstalledBy(bo, offset), want_thread) << "BO " << bo << " at " << offset;
    }
    const client::Progress p = session.progress();
    EXPECT_EQ(p.local_demand_chunks, p.demand_chunks);
    EXPECT_EQ(p.resident_chunks, p.total_chunks);
    ExpectCheckpointBytes(session, engine.host(), "raw");
  }
}

// By reference into an engine that verifies chunks itself (as the CUDA engine does on the GPU):
// the readers hand it the lazy image's chunks unhashed; a chunk it finds bad is asked for again
// and read again from the passed files, and a second bad copy fails the restore, naming the
// chunk, with nothing of it left in the destination.
//
// The bad copy must be counted (and the chunk marked as asked for) before the engine's
// completion returns, not later on the stream thread: in between, the stream's end saw the
// chunk as never requested and demanded it once more, and that third copy landed after the
// second bad one had failed the restore. The engine's hook looks right after the completion,
// before the stream thread could have caught up, so the old order fails here every time
// rather than only under TSan's timing.
TEST_F(ImageFilesTest, ChunksTheEngineFindsBadAreFetchedAgainOnceThenFailLoudly) {
  for (const int spoil_times : {1, 2}) {
    SCOPED_TRACE(fmt::format("the engine spoils a chunk {} times", spoil_times));
    client::VerifyingHostEngine engine(spoil_times);
    client::SessionOptions options;
    options.endpoint = server_->unix_endpoint().ToString();
    options.image = "lazy";
    std::optional<client::RestoreSession> session_storage;
    client::RestoreSession& session = session_storage.emplace(options, engine);
    std::mutex seen_mu;
    std::vector<uint64_t> refetches_seen;  // Progress::refetches right after each bad copy
    engine.set_after_mismatch([&] {
      const uint64_t refetches = session.progress().refetches;
      std::lock_guard lock(seen_mu);
      refetches_seen.push_back(refetches);
    });
    // On a fast host both bad copies can come and fail the restore before Start returns; Start
    // still reports only the opening.
    const Status started = session.Start();
    ASSERT_TRUE(started.ok()) << started.ToString();
    const Status done = session.WaitComplete(30s);
    EXPECT_TRUE(session.progress().reading_files);
    EXPECT_GE(engine.unverified_commits(), 2u);
    EXPECT_EQ(engine.mismatches(), static_cast<uint64_t>(spoil_times));
    EXPECT_EQ(session.progress().refetches, 1u);
    EXPECT_EQ(session.progress().unchecked_chunks, 0u);
    if (spoil_times == 1) {
      ASSERT_TRUE(done.ok()) << done.ToString();
      EXPECT_EQ(engine.victim_commits(), 2u);
      {
        std::lock_guard lock(seen_mu);
        EXPECT_EQ(refetches_seen, (std::vector<uint64_t>{1}));
      }
      EXPECT_GT(engine.unverified_commits(), 8u);
      ExpectCheckpointBytes(session, engine.host(), "lazy");
      continue;
    }
    ASSERT_EQ(done.code(), Code::kCorrupt) << done.ToString();
    EXPECT_NE(done.message().find("second copy is bad too"), std::string::npos) << done.message();
    const auto [bo, offset] = engine.victim().value();
    EXPECT_FALSE(session.IsResident(bo, offset, 1));
    const uint32_t chunk_size = session.chunk_size();
    session_storage.reset();  // waits for the session's threads and the engine's writes
    // Two copies and no third, even counting what was in flight when the restore failed.
    EXPECT_EQ(engine.victim_commits(), 2u);
    {
      std::lock_guard lock(seen_mu);
      EXPECT_EQ(refetches_seen, (std::vector<uint64_t>{1, 1}));
    }
    Result<std::span<uint8_t>> mapping = engine.host().Mapping(bo);
    ASSERT_TRUE(mapping.ok());
    const uint64_t end = std::min<uint64_t>(mapping->size(), offset + chunk_size);
    for (uint64_t i = offset; i < end; ++i)
      ASSERT_EQ((*mapping)[i], 0) << "unverified byte left at " << i;
  }
}

// Progress::file_read_s and file_engine_s split the time of the threads that install chunks by
// reference: the engine's 2 ms per chunk lands in file_engine_s, the reads in file_read_s, and
// together they fit in the wall time of the threads that may install. Through the socket no chunk
// is read from a file, so both stay 0.
TEST_F(ImageFilesTest, ProgressSplitsTheFileReadersTime) {
  for (const bool read_files : {true, false}) {
    SCOPED_TRACE(read_files ? "by reference" : "through the socket");
    client::SlowReceiveEngine engine(2ms);
    client::SessionOptions options;
    options.endpoint = server_->unix_endpoint().ToString();
    options.image = "raw";
    options.read_files = read_files;
    options.file_readers = 2;
    client::RestoreSession session(options, engine);
    const auto start = std::chrono::steady_clock::now();
    ASSERT_TRUE(session.Start().ok());
    const Status done = session.WaitComplete(30s);
    // Progress first, then the clock: a reader adds its last lap after its chunk completes,
    // which may be after WaitComplete returns, and a lap counted must lie inside the time
    // measured.
    const client::Progress p = session.progress();
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_TRUE(done.ok()) << done.ToString();
    ExpectCheckpointBytes(session, engine.host(), "raw");
    ASSERT_EQ(p.reading_files, read_files);
    if (!read_files) {
      EXPECT_EQ(p.file_read_s, 0.0);
      EXPECT_EQ(p.file_engine_s, 0.0);
      continue;
    }
    EXPECT_GE(p.file_engine_s, 0.002 * static_cast<double>(p.total_chunks));
    EXPECT_GT(p.file_read_s, 0.0);
    // The two readers, and the demand thread should the stream's end ask for a chunk again:
    // nothing calls Ensure here.
    EXPECT_LE(p.file_read_s + p.file_engine_s, 3 * elapsed);
  }
}

// A CRIU checkpoint records no checksums: by reference, a chunk comes with one only if the
// server has read (and hashed) it before. Progress::unchecked_chunks says how many were
// installed unverified: all of them from a server that has read nothing, none once a session
// through the socket has made it read every chunk, and never any of a lazy image's.
TEST_F(ImageFilesTest, ProgressCountsChunksInstalledWithoutAChecksum) {
  TempDir sockets;
  ServerProcess fresh(sockets.path(), dir_->path() / "images",
                      {"--raw-chunk-size", "256K", "--max-frame", "1M"});
  ASSERT_TRUE(fresh.ready()) << fresh.Log();
  auto restore = [&](const std::string& image, bool read_files) {
    client::HostCopyEngine engine;
    client::SessionOptions options;
    options.endpoint = fresh.unix_endpoint().ToString();
    options.image = image;
    options.read_files = read_files;
    client::RestoreSession session(options, engine);
    EXPECT_TRUE(session.Start().ok());
    const Status done = session.WaitComplete(30s);
    EXPECT_TRUE(done.ok()) << done.ToString();
    EXPECT_EQ(session.progress().reading_files, read_files);
    ExpectCheckpointBytes(session, engine, image);
    return session.progress();
  };
  const client::Progress first = restore("raw", true);
  EXPECT_EQ(first.unchecked_chunks, first.total_chunks);
  EXPECT_EQ(restore("raw", false).unchecked_chunks, 0u);  // through the socket: the server hashes
  EXPECT_EQ(restore("raw", true).unchecked_chunks, 0u);   // now it knows every checksum
  EXPECT_EQ(restore("lazy", true).unchecked_chunks, 0u);
  EXPECT_EQ(fresh.Terminate(), 0) << fresh.Log();
}

// Zero chunks the engine zeroes itself are counted whichever way they came: a by-reference
// restore reads nothing for them, as a socket one receives nothing.
TEST_F(ImageFilesTest, ProgressCountsZeroChunksTheEngineZeroedEitherWay) {
  std::map<bool, client::Progress> by_files;
  for (const bool read_files : {true, false}) {
    SCOPED_TRACE(read_files);
    client::HostCopyEngine engine;
    client::SessionOptions options;
    options.endpoint = server_->unix_endpoint().ToString();
    options.image = "lazy";
    options.read_files = read_files;
    client::RestoreSession session(options, engine);
    ASSERT_TRUE(session.Start().ok());
    const Status done = session.WaitComplete(30s);
    ASSERT_TRUE(done.ok()) << done.ToString();
    ASSERT_EQ(session.progress().reading_files, read_files);
    ExpectCheckpointBytes(session, engine, "lazy");
    by_files[read_files] = session.progress();
  }
  EXPECT_GT(by_files[false].zero_filled_chunks, 0u) << "the test image has no zero chunk";
  EXPECT_EQ(by_files[true].zero_filled_chunks, by_files[false].zero_filled_chunks);
  EXPECT_EQ(by_files[true].zero_filled_bytes, by_files[false].zero_filled_bytes);
  // And with no server at all.
  client::HostCopyEngine engine;
  client::LocalRestore local({.image_dir = dir_->path() / "images" / "lazy"}, engine);
  ASSERT_TRUE(local.Start().ok());
  ASSERT_TRUE(local.WaitComplete(30s).ok()) << local.status().ToString();
  EXPECT_EQ(local.progress().zero_filled_chunks, by_files[false].zero_filled_chunks);
  EXPECT_EQ(local.progress().zero_filled_bytes, by_files[false].zero_filled_bytes);
}

TEST_F(ImageFilesTest, MisuseIsRefusedWithAReason) {
  // want_files without a session to join.
  {
    TestClient client(server_->unix_endpoint());
    wire::Header hello;
    hello.mutable_hello()->set_min_version(kProtocolVersion);
    hello.mutable_hello()->set_max_version(kProtocolVersion);
    hello.mutable_hello()->set_want_files(true);
    ASSERT_TRUE(client.Send(hello).ok());
    Result<wire::Error> error = client.ReadError(5s);
    ASSERT_TRUE(error.ok()) << error.status().ToString();
    EXPECT_EQ(error->code(), wire::ERROR_BAD_REQUEST);
    EXPECT_NE(error->message().find("join_session"), std::string::npos) << error->message();
    EXPECT_TRUE(client.WaitClosed(5s));
  }
  TestClient stream(server_->unix_endpoint());
  ASSERT_TRUE(stream.Hello().ok());
  Result<wire::OpenImageReply> reply = stream.Open("raw");
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  // by_reference before the files were passed: refused, the connection stays.
  {
    wire::Header request;
    request.set_request_id(5);
    request.mutable_request()->set_stream_all(true);
    request.mutable_request()->set_by_reference(true);
    ASSERT_TRUE(stream.Send(request).ok());
    Result<wire::Error> error = stream.ReadError(5s);
    ASSERT_TRUE(error.ok()) << error.status().ToString();
    EXPECT_EQ(error->code(), wire::ERROR_BAD_REQUEST);
    EXPECT_EQ(error->in_reply_to(), 5u);
    EXPECT_NE(error->message().find("image files first"), std::string::npos) << error->message();
    EXPECT_TRUE(stream.Stats(6).ok());
  }
  // Over TCP no descriptor can travel: refused by name.
  {
    Result<std::shared_ptr<const client::ImageFileSet>> files =
        Fetch(server_->tcp_endpoint(), reply->session(), reply->session_secret());
    ASSERT_FALSE(files.ok());
    EXPECT_EQ(files.status().code(), Code::kInvalidArgument) << files.status().ToString();
    EXPECT_NE(files.status().message().find("only over Unix sockets"), std::string::npos)
        << files.status().ToString();
  }
  // A wrong secret gets nothing.
  {
    Result<std::shared_ptr<const client::ImageFileSet>> files =
        Fetch(server_->unix_endpoint(), reply->session(), "not the secret");
    ASSERT_FALSE(files.ok());
    EXPECT_EQ(files.status().code(), Code::kNotFound) << files.status().ToString();
  }
}

// The server's bulk disk threads run --background-nice nicer; its demand-lane and network
// threads keep the server's priority.
TEST(ServerThreads, BulkDiskThreadsRunNicer) {
  using gpulazy::testing::NiceOfThreadsNamed;
  TempDir dir;
  const fs::path root = dir.path() / "images";
  fs::create_directories(root);
  const int base = gpulazy::testing::ListThreads().at(static_cast<pid_t>(::gettid())).nice;
  ASSERT_LE(base, 19 - 6);
  ServerProcess server(
      dir.path(), root,
      {"--background-nice", "6", "--disk-threads", "3", "--demand-threads", "2", "--threads", "2"});
  ASSERT_TRUE(server.ready()) << server.Log();
  // The network threads start once the server runs, which may be just after it says ready.
  for (int i = 0; i < 500 && NiceOfThreadsNamed("gl-net", server.pid()).empty(); ++i)
    std::this_thread::sleep_for(10ms);
  EXPECT_EQ(NiceOfThreadsNamed("gl-disk", server.pid()),
            (std::vector<int>{base + 6, base + 6, base + 6}));
  EXPECT_EQ(NiceOfThreadsNamed("gl-demand-disk", server.pid()), (std::vector<int>{base, base}));
  EXPECT_EQ(NiceOfThreadsNamed("gl-net", server.pid()), std::vector<int>{base});
  EXPECT_EQ(server.Terminate(), 0) << server.Log();
}

TEST(ImageFilesOff, ServerWithNoPassFilesRefusesThem) {
  TempDir dir;
  const fs::path root = dir.path() / "images";
  fs::create_directories(root);
  ASSERT_TRUE(MakeImage(root / "raw", 1ull << 20, 33, false).ok());
  ServerProcess server(dir.path(), root, {"--no-pass-files"});
  ASSERT_TRUE(server.ready()) << server.Log();
  TestClient stream(server.unix_endpoint());
  ASSERT_TRUE(stream.Hello().ok());
  Result<wire::OpenImageReply> reply = stream.Open("raw");
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  Result<std::shared_ptr<const client::ImageFileSet>> files =
      Fetch(server.unix_endpoint(), reply->session(), reply->session_secret());
  ASSERT_FALSE(files.ok());
  EXPECT_EQ(files.status().code(), Code::kInvalidArgument) << files.status().ToString();
  EXPECT_NE(files.status().message().find("--no-pass-files"), std::string::npos)
      << files.status().ToString();
  EXPECT_EQ(server.Terminate(), 0) << server.Log();
}

// The descriptor plumbing itself, on a socket pair: descriptors arrive in order and owned; more
// than asked for, or a payload, is refused.
TEST(FdPassing, FrameWithDescriptorsRoundTripsAndRefusesExcess) {
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair), 0);
  boost::asio::io_context io;
  net::Socket reader(io, boost::asio::generic::stream_protocol(AF_UNIX, SOCK_STREAM), pair[0]);
  UniqueFd writer(pair[1]);
  TempDir dir;
  std::vector<UniqueFd> files;
  std::vector<int> raw;
  for (int i = 0; i < 3; ++i) {
    const fs::path path = dir.path() / ("f" + std::to_string(i));
    ASSERT_TRUE(
        WriteFileAtomically(path, std::vector<uint8_t>(size_t(i + 1), uint8_t('a' + i))).ok());
    Result<UniqueFd> fd = OpenForRead(path);
    ASSERT_TRUE(fd.ok());
    raw.push_back(fd->get());
    files.push_back(std::move(*fd));
  }
  auto read_one = [&](size_t max_fds) {
    std::optional<Result<net::FrameWithFds>> result;
    boost::asio::co_spawn(
        io,
        [&]() -> net::Awaitable<void> {
          result.emplace(co_await net::ReadFrameWithFds(reader, FrameLimits{}, max_fds));
        },
        boost::asio::detached);
    io.restart();
    io.run();
    return std::move(*result);
  };
  wire::Header header;
  header.mutable_image_files()->add_files()->set_name("x");
  ASSERT_TRUE(net::SendFrameWithFds(writer.get(), header, raw, FrameLimits{}).ok());
  Result<net::FrameWithFds> got = read_one(3);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->fds.size(), 3u);
  EXPECT_TRUE(got->header.has_image_files());
  for (int i = 0; i < 3; ++i) {
    std::vector<uint8_t> bytes(size_t(i + 1));
    ASSERT_TRUE(ReadExactAt(got->fds[size_t(i)].get(), 0, bytes, "passed").ok());
    EXPECT_EQ(bytes, std::vector<uint8_t>(size_t(i + 1), uint8_t('a' + i)));
  }
  // Three descriptors where two were expected: refused, and none is leaked.
  ASSERT_TRUE(net::SendFrameWithFds(writer.get(), header, raw, FrameLimits{}).ok());
  Result<net::FrameWithFds> excess = read_one(2);
  ASSERT_FALSE(excess.ok());
  EXPECT_EQ(excess.status().code(), Code::kCorrupt) << excess.status().ToString();
}

// The message-level calls the uffd handover and the plugin's hand-off use, on a seqpacket
// socket: a blocking round trip, nothing pending, a message longer than the buffer.
TEST(FdPassing, SeqpacketMessagesRoundTripAndTruncationIsRefused) {
  int pair[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair), 0);
  UniqueFd a(pair[0]);
  UniqueFd b(pair[1]);
  TempDir dir;
  ASSERT_TRUE(WriteFileAtomically(dir.path() / "f", std::vector<uint8_t>{'z'}).ok());
  Result<UniqueFd> file = OpenForRead(dir.path() / "f");
  ASSERT_TRUE(file.ok());
  const int raw = file->get();
  const std::vector<uint8_t> message = {1, 2, 3, 4, 5, 6, 7, 8};

  std::vector<UniqueFd> fds;
  std::vector<uint8_t> into(16);
  Result<std::optional<size_t>> nothing = net::ReceiveWithFds(b.get(), into, 1, &fds);
  ASSERT_TRUE(nothing.ok()) << nothing.status().ToString();
  EXPECT_FALSE(nothing->has_value()) << "nothing was pending";

  ASSERT_TRUE(net::SendWithFds(a.get(), message, std::span(&raw, 1), net::Blocking::kYes).ok());
  Result<std::optional<size_t>> got =
      net::ReceiveWithFds(b.get(), into, 1, &fds, net::Blocking::kYes);
  ASSERT_TRUE(got.ok()) << got.status().ToString();
  ASSERT_EQ(got->value_or(0), message.size());
  EXPECT_TRUE(std::equal(message.begin(), message.end(), into.begin()));
  ASSERT_EQ(fds.size(), 1u);
  std::vector<uint8_t> byte(1);
  ASSERT_TRUE(ReadExactAt(fds[0].get(), 0, byte, "passed").ok());
  EXPECT_EQ(byte[0], 'z');

  // Eight bytes into a four-byte buffer: the rest of the message would be lost, so refused.
  fds.clear();
  ASSERT_TRUE(net::SendWithFds(a.get(), message, {}, net::Blocking::kYes).ok());
  std::vector<uint8_t> small(4);
  Result<std::optional<size_t>> truncated =
      net::ReceiveWithFds(b.get(), small, 1, &fds, net::Blocking::kYes);
  ASSERT_FALSE(truncated.ok());
  EXPECT_EQ(truncated.status().code(), Code::kCorrupt) << truncated.status().ToString();

  // The peer gone: 0 bytes.
  a.reset();
  Result<std::optional<size_t>> closed =
      net::ReceiveWithFds(b.get(), into, 1, &fds, net::Blocking::kYes);
  ASSERT_TRUE(closed.ok()) << closed.status().ToString();
  EXPECT_EQ(closed->value_or(99), 0u);
}

}  // namespace
}  // namespace gpulazy::server::testing
