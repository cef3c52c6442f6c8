// Integration tests of gpulazy-server: a real server process on a temp Unix socket and on
// 127.0.0.1 port 0, driven by a frame-level test client (tests/server/test_support.h).
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>
#include <tuple>

#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/lazy_image.h"
#include "lazy-server/image/synth.h"
#include "proto/endian.h"
#include "tests/server/test_support.h"

namespace gpulazy::server::testing {
namespace {
namespace fs = std::filesystem;

constexpr uint32_t kChunk = 64 * 1024;
constexpr uint64_t kBigWindow = 1ull << 30;

Status MakeImage(const fs::path& dir, uint64_t bytes, uint64_t seed, bool lazy) {
  return MakeTestImage(
      dir, {.bytes = bytes, .seed = seed, .lazy = lazy, .bos = 8, .lazy_chunk = kChunk});
}

// Shared by the tests: images under one root and one server.
class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<TempDir>();
    const fs::path root = dir_->path() / "images";
    fs::create_directories(root / "sub");
    ASSERT_TRUE(MakeImage(root / "raw", 8ull << 20, 1, false).ok());
    ASSERT_TRUE(MakeImage(root / "sub" / "lazy", 8ull << 20, 2, true).ok());
    ASSERT_TRUE(MakeImage(root / "big", 48ull << 20, 3, false).ok());
    ASSERT_TRUE(MakeImage(root / "hot", 4ull << 20, 4, true).ok());
    // A profile for "hot": a few chunks from the end of the table are the hot set.
    Result<image::LazyImage> hot = image::LazyImage::Open(root / "hot");
    ASSERT_TRUE(hot.ok()) << hot.status().ToString();
    manifest::Manifest m = hot->manifest();
    manifest::AccessProfile* profile = m.mutable_profile();
    profile->Clear();
    const int last = m.bos_size() - 1;
    for (int bo = last; bo >= 0 && profile->order_size() < 6; --bo) {
      if (m.bos(bo).chunks_size() == 0) continue;
      manifest::ChunkRef* ref = profile->add_order();
      ref->set_bo(static_cast<uint32_t>(bo));
      ref->set_chunk(static_cast<uint32_t>(m.bos(bo).chunks_size() - 1));
    }
    profile->set_hot_count(4);
    profile->set_source("test");
    ASSERT_TRUE(image::WriteManifest(root / "hot", m).ok());
    for (const char* name : {"raw", "sub/lazy", "big", "hot"}) {
      auto contents = LoadCriuContents(root / name);
      ASSERT_TRUE(contents.ok()) << contents.status().ToString();
      expected_[name] = std::move(*contents);
    }
    server_ = std::make_unique<ServerProcess>(
        dir_->path(), root,
        std::vector<std::string>{"--raw-chunk-size", "64K", "--hello-timeout", "3",
                                 "--disk-threads", "2", "--threads", "2"});
    ASSERT_TRUE(server_->ready()) << server_->Log();
  }
  static void TearDownTestSuite() {
    // A clean exit after the suite's traffic: sanitizer builds report leaks and errors here.
    if (server_ != nullptr && server_->ready()) {
      const int status = server_->Terminate(15s);
      EXPECT_EQ(status, 0) << server_->Log().substr(0, 20000);
    }
    server_.reset();
    dir_.reset();
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    ASSERT_TRUE(server_->ready());
    ::alarm(120);  // no test may hang
  }
  void TearDown() override {
    ::alarm(0);
    if (HasFailure()) std::cerr << server_->Log().substr(0, 20000);
  }

  static std::map<std::string, std::map<BoKey, std::vector<uint8_t>>> expected_;
  static std::unique_ptr<TempDir> dir_;
  static std::unique_ptr<ServerProcess> server_;
};
std::map<std::string, std::map<BoKey, std::vector<uint8_t>>> ServerTest::expected_;
std::unique_ptr<TempDir> ServerTest::dir_;
std::unique_ptr<ServerProcess> ServerTest::server_;

// Opens `image`, streams it all and checks every byte.
void StreamAndVerify(const net::Endpoint& endpoint, const std::string& image,
                     const std::map<BoKey, std::vector<uint8_t>>& expected, uint64_t window,
                     bool want_lazy) {
  TestClient client(endpoint);
  ASSERT_TRUE(client.connected());
  Result<wire::HelloReply> hello = client.Hello();
  ASSERT_TRUE(hello.ok()) << hello.status().ToString();
  EXPECT_EQ(hello->version(), 1u);
  Result<wire::OpenImageReply> reply = client.Open(image);
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  EXPECT_EQ(reply->lazy_image(), want_lazy);
  EXPECT_EQ(reply->session_secret().size(), 16u);
  Result<Received> received = ReceiveStream(client, window);
  ASSERT_TRUE(received.ok()) << received.status().ToString();
  Status verified = VerifyStream(*reply, received->chunks, expected);
  EXPECT_TRUE(verified.ok()) << verified.ToString();
  EXPECT_EQ(received->done.chunks(), received->chunks.size());
  uint64_t bytes = 0;
  for (const Frame& f : received->chunks)
    bytes += f.payload.size();
  EXPECT_EQ(received->done.bytes(), bytes);
}

TEST_F(ServerTest, StreamsRawCriuImageOverUnix) {
  StreamAndVerify(server_->unix_endpoint(), "raw", expected_["raw"], 4 * kChunk, false);
}

TEST_F(ServerTest, StreamsLazyImageOverTcp) {
  StreamAndVerify(server_->tcp_endpoint(), "sub/lazy", expected_["sub/lazy"], 16 * kChunk, true);
}

TEST_F(ServerTest, HotSetStreamsFirstInProfileOrder) {
  TestClient client(server_->unix_endpoint());
  ASSERT_TRUE(client.Hello().ok());
  Result<wire::OpenImageReply> reply = client.Open("hot");
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  const manifest::AccessProfile& profile = reply->profile();
  ASSERT_EQ(profile.hot_count(), 4u);
  ASSERT_EQ(profile.order_size(), 6);
  Result<Received> received = ReceiveStream(client, kBigWindow);
  ASSERT_TRUE(received.ok()) << received.status().ToString();
  ASSERT_GE(received->chunks.size(), 6u);
  for (int i = 0; i < 6; ++i) {
    const wire::ChunkData& chunk = received->chunks[i].header.chunk();
    EXPECT_EQ(chunk.bo(), profile.order(i).bo()) << i;
    EXPECT_EQ(chunk.chunk(), profile.order(i).chunk()) << i;
    EXPECT_EQ(chunk.priority(), i < 4 ? wire::PRIORITY_PREFETCH : wire::PRIORITY_BACKGROUND) << i;
  }
  for (size_t i = 4; i < received->chunks.size(); ++i)
    EXPECT_EQ(received->chunks[i].header.chunk().priority(), wire::PRIORITY_BACKGROUND);
  EXPECT_TRUE(VerifyStream(*reply, received->chunks, expected_["hot"]).ok());
}

TEST_F(ServerTest, CreditIsRespected) {
  TestClient client(server_->unix_endpoint());
  ASSERT_TRUE(client.Hello().ok());
  Result<wire::OpenImageReply> reply = client.Open("raw");
  ASSERT_TRUE(reply.ok());
  ASSERT_TRUE(client.StreamAll().ok());
  // No credit: nothing comes.
  EXPECT_EQ(client.Read(300ms).status().code(), Code::kTimeout);
  uint64_t granted = 3 * kChunk;
  ASSERT_TRUE(client.Credit(3 * kChunk).ok());
  uint64_t received = 0;
  size_t chunks = 0;
  // Reads what a Credit let through: the first frame may be slow on a loaded machine (a long
  // wait), after it a short quiet gap means nothing more comes.
  auto drain = [&] {
    for (bool first_frame = true;; first_frame = false) {
      Result<Frame> frame = client.Read(first_frame ? 10s : 400ms);
      if (!frame.ok()) return frame.status().code() == Code::kTimeout;
      if (frame->header.has_stream_done()) return true;
      if (!frame->header.has_chunk()) return false;
      received += frame->payload.size();
      ++chunks;
      if (received > granted) return false;
    }
  };
  ASSERT_TRUE(drain());
  EXPECT_GE(chunks, 1u);
  EXPECT_LE(received, granted);
  const size_t first = chunks;
  granted += 10 * kChunk;
  ASSERT_TRUE(client.Credit(10 * kChunk).ok());
  ASSERT_TRUE(drain());
  EXPECT_GT(chunks, first);  // more credit, more chunks
  EXPECT_LE(received, granted);
}

TEST_F(ServerTest, DemandConnectionIsAnsweredAheadOfBackground) {
  TestClient stream(server_->unix_endpoint());
  ASSERT_TRUE(stream.Hello().ok());
  Result<wire::OpenImageReply> reply = stream.Open("big");
  ASSERT_TRUE(reply.ok());
  uint64_t total_chunks = 0;
  for (const wire::BoInfo& bo : reply->bos())
    total_chunks += bo.chunk_count();
  ASSERT_GT(total_chunks, 500u);
  // A huge window and nobody reading the stream: the server queues background data until
  // the socket buffers are full.
  ASSERT_TRUE(stream.Credit(kBigWindow).ok());
  ASSERT_TRUE(stream.StreamAll().ok());
  std::this_thread::sleep_for(200ms);

  TestClient demand(server_->unix_endpoint());
  ASSERT_TRUE(demand.Hello(reply->session(), reply->session_secret()).ok());
  const uint32_t bo = static_cast<uint32_t>(reply->bos_size() - 1);
  const uint32_t chunk = reply->bos(static_cast<int>(bo)).chunk_count() - 1;
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(demand.Request(wire::PRIORITY_DEMAND, bo, chunk, 1, 77).ok());
  Result<Frame> answer = demand.Read(5s);
  const auto latency = std::chrono::steady_clock::now() - start;
  ASSERT_TRUE(answer.ok()) << answer.status().ToString();
  ASSERT_TRUE(answer->header.has_chunk());
  EXPECT_EQ(answer->header.request_id(), 77u);
  EXPECT_EQ(answer->header.chunk().bo(), bo);
  EXPECT_EQ(answer->header.chunk().chunk(), chunk);
  EXPECT_EQ(answer->header.chunk().priority(), wire::PRIORITY_DEMAND);
  EXPECT_LT(latency, 2s);
  std::cerr << "demand latency with a full stream: "
            << std::chrono::duration_cast<std::chrono::microseconds>(latency).count() << " us\n";

  // The stream was nowhere near done when the demand answer came.
  Result<std::string> stats = demand.Stats();
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  nlohmann::json doc = nlohmann::json::parse(*stats);
  uint64_t background = 0;
  for (const auto& session : doc["sessions"])
    if (session["session"] == reply->session())
      background = session["chunks_sent"]["background"].get<uint64_t>();
  EXPECT_LT(background, total_chunks / 2) << *stats;
  // It was read in the demand lane, not the bulk lane the stream uses.
  EXPECT_GE(doc["server"]["disk"]["demand_reads"].get<uint64_t>(), 1u) << *stats;

  // The stream still completes, and leaves out the chunk the demand connection carried (it
  // was far ahead of the stream): with the demand's copy, every chunk came once.
  std::vector<Frame> chunks;
  uint64_t stream_done_chunks = 0;
  while (true) {
    Result<Frame> frame = stream.Read(10s);
    ASSERT_TRUE(frame.ok()) << frame.status().ToString();
    if (frame->header.has_stream_done()) {
      stream_done_chunks = frame->header.stream_done().chunks();
      break;
    }
    if (frame->header.has_chunk()) chunks.push_back(std::move(*frame));
  }
  EXPECT_EQ(chunks.size(), total_chunks - 1);
  EXPECT_EQ(stream_done_chunks, chunks.size());
  chunks.push_back(std::move(*answer));
  Status every_chunk_once = VerifyStream(*reply, chunks, expected_["big"]);
  EXPECT_TRUE(every_chunk_once.ok()) << every_chunk_once.ToString();
}

TEST_F(ServerTest, DemandOnTheStreamConnectionJumpsTheQueue) {
  TestClient client(server_->unix_endpoint());
  ASSERT_TRUE(client.Hello().ok());
  Result<wire::OpenImageReply> reply = client.Open("big");
  ASSERT_TRUE(reply.ok());
  constexpr uint64_t kWindowChunks = 16;
  ASSERT_TRUE(client.Credit(kWindowChunks * kChunk).ok());
  ASSERT_TRUE(client.StreamAll().ok());
  for (int i = 0; i < 10; ++i) {
    Result<Frame> frame = client.Read();
    ASSERT_TRUE(frame.ok() && frame->header.has_chunk());
    ASSERT_TRUE(client.Credit(frame->payload.size()).ok());
  }
  const uint32_t bo = static_cast<uint32_t>(reply->bos_size() - 1);
  const uint32_t chunk = reply->bos(static_cast<int>(bo)).chunk_count() - 1;
  ASSERT_TRUE(client.Request(wire::PRIORITY_DEMAND, bo, chunk, 1, 55).ok());
  // Credit keeps coming back while we wait: a demand on the stream connection takes stream
  // credit too, so a client that stopped returning it could leave the demand waiting forever
  // (the window all picked before the server reads the Request). What goes ahead of it stays
  // bounded however late the disk threads are: the server reads the Request after every Credit
  // sent before it, when the chunks not yet read here hold at most the window; from then on the
  // demand is the stream's next pick, and chunks picked after it (with the credit returned
  // meanwhile) are written in stream order, behind it.
  size_t before = 0;
  uint64_t bytes_before = 0;
  while (true) {
    Result<Frame> frame = client.Read();
    ASSERT_TRUE(frame.ok()) << frame.status().ToString();
    ASSERT_TRUE(frame->header.has_chunk());
    ASSERT_TRUE(client.Credit(frame->payload.size()).ok());
    if (frame->header.request_id() == 55) {
      EXPECT_EQ(frame->header.chunk().priority(), wire::PRIORITY_DEMAND);
      break;
    }
    ++before;
    bytes_before += frame->payload.size();
  }
  // At most the window's bytes were ahead of it; in chunks, the window plus a few short ones
  // (a BO's last chunk may be smaller than kChunk).
  EXPECT_LE(bytes_before, kWindowChunks * kChunk);
  EXPECT_LE(before, kWindowChunks + 8);
}

TEST_F(ServerTest, RequestErrorsKeepTheConnection) {
  TestClient client(server_->tcp_endpoint());
  ASSERT_TRUE(client.Hello().ok());
  for (const char* bad : {"nope", "../images/raw", "/etc", "sub/../raw", "raw/../../x", ""}) {
    Result<wire::OpenImageReply> reply = client.Open(bad, 5);
    ASSERT_FALSE(reply.ok()) << bad;
    EXPECT_NE(reply.status().message().find("ERROR_NOT_FOUND"), std::string::npos)
        << bad << ": " << reply.status().message();
    EXPECT_EQ(reply.status().message().find(dir_->path().string()), std::string::npos)
        << "the root leaked: " << reply.status().message();
  }
  Result<wire::OpenImageReply> reply = client.Open("raw", 6);
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  // Out-of-range BO and chunk.
  ASSERT_TRUE(client.Request(wire::PRIORITY_PREFETCH, 9999, 0, 1, 7).ok());
  Result<wire::Error> error = client.ReadError();
  ASSERT_TRUE(error.ok());
  EXPECT_EQ(error->code(), wire::ERROR_OUT_OF_RANGE);
  EXPECT_EQ(error->in_reply_to(), 7u);
  ASSERT_TRUE(client.Request(wire::PRIORITY_PREFETCH, 0, 0xfffffff0u, 0x20, 8).ok());
  error = client.ReadError();
  ASSERT_TRUE(error.ok());
  EXPECT_EQ(error->code(), wire::ERROR_OUT_OF_RANGE);
  EXPECT_EQ(error->in_reply_to(), 8u);
  // A second OpenImage is a request-level error too.
  Result<wire::OpenImageReply> again = client.Open("raw", 9);
  EXPECT_FALSE(again.ok());
  // Still serving: a good request is answered.
  ASSERT_TRUE(client.Credit(kBigWindow).ok());
  ASSERT_TRUE(client.Request(wire::PRIORITY_PREFETCH, 0, 0, 1, 10).ok());
  Result<Frame> frame = client.Read();
  ASSERT_TRUE(frame.ok());
  ASSERT_TRUE(frame->header.has_chunk());
  EXPECT_EQ(frame->header.request_id(), 10u);
  EXPECT_EQ(frame->header.chunk().priority(), wire::PRIORITY_PREFETCH);
}

// Each bad client gets its error and is closed while a good client streams undisturbed.
TEST_F(ServerTest, FrameErrorsCloseOnlyTheBadConnection) {
  std::atomic<bool> good_ok{false};
  std::thread good([&] {
    StreamAndVerify(server_->tcp_endpoint(), "sub/lazy", expected_["sub/lazy"], 8 * kChunk, true);
    good_ok = !::testing::Test::HasFailure();
  });

  auto expect_error_then_close = [](TestClient& client, wire::ErrorCode code) {
    Result<wire::Error> error = client.ReadError(5s);
    ASSERT_TRUE(error.ok()) << error.status().ToString();
    EXPECT_EQ(error->code(), code) << error->message();
    EXPECT_TRUE(client.WaitClosed(5s));
  };
  {  // a prefix claiming a 1 GiB payload
    TestClient client(server_->unix_endpoint());
    ASSERT_TRUE(client.Hello().ok());
    uint8_t prefix[8];
    StoreLe32(prefix, 4);
    StoreLe32(prefix + 4, 1u << 30);
    ASSERT_TRUE(client.SendRaw(prefix).ok());
    expect_error_then_close(client, wire::ERROR_LIMIT);
  }
  {  // a header that is not protobuf
    TestClient client(server_->unix_endpoint());
    ASSERT_TRUE(client.Hello().ok());
    std::vector<uint8_t> frame(8 + 12, 0xff);
    StoreLe32(frame.data(), 12);
    StoreLe32(frame.data() + 4, 0);
    ASSERT_TRUE(client.SendRaw(frame).ok());
    expect_error_then_close(client, wire::ERROR_BAD_REQUEST);
  }
  {  // an empty header
    TestClient client(server_->tcp_endpoint());
    uint8_t prefix[8] = {0};
    ASSERT_TRUE(client.SendRaw(prefix).ok());
    expect_error_then_close(client, wire::ERROR_BAD_REQUEST);
  }
  {  // no Hello first
    TestClient client(server_->unix_endpoint());
    wire::Header header;
    header.mutable_open_image()->set_image("raw");
    ASSERT_TRUE(client.Send(header).ok());
    expect_error_then_close(client, wire::ERROR_BAD_REQUEST);
  }
  {  // a version the server does not speak
    TestClient client(server_->unix_endpoint());
    wire::Header header;
    header.mutable_hello()->set_min_version(kProtocolVersion + 1);
    header.mutable_hello()->set_max_version(kProtocolVersion + 4);
    ASSERT_TRUE(client.Send(header).ok());
    expect_error_then_close(client, wire::ERROR_UNSUPPORTED_VERSION);
  }
  {  // joining a session with a wrong secret
    TestClient client(server_->unix_endpoint());
    wire::Header header;
    header.mutable_hello()->set_min_version(1);
    header.mutable_hello()->set_max_version(1);
    header.mutable_hello()->set_join_session(1);
    header.mutable_hello()->set_join_secret("0123456789abcdef");
    ASSERT_TRUE(client.Send(header).ok());
    expect_error_then_close(client, wire::ERROR_NOT_FOUND);
  }
  {  // silent: closed after the Hello timeout (3 s in this suite), not before
    TestClient client(server_->unix_endpoint());
    const auto start = std::chrono::steady_clock::now();
    EXPECT_TRUE(client.WaitClosed(10s));
    EXPECT_GE(std::chrono::steady_clock::now() - start, 2s);
  }
  good.join();
  EXPECT_TRUE(good_ok);
}

// The bytes_sent and bytes_sendfile of `session` in a stats reply.
// The client's stats reply, parsed ({} when the request failed, which is reported).
nlohmann::json StatsOf(TestClient& client) {
  Result<std::string> stats = client.Stats();
  EXPECT_TRUE(stats.ok()) << stats.status().ToString();
  return nlohmann::json::parse(stats.ok() ? *stats : "{}");
}

std::pair<uint64_t, uint64_t> SentAndSendfile(TestClient& client, uint64_t session) {
  const nlohmann::json doc = StatsOf(client);
  for (const auto& s : doc["sessions"])
    if (s["session"] == session)
      return {s["bytes_sent"].get<uint64_t>(), s["bytes_sendfile"].get<uint64_t>()};
  ADD_FAILURE() << "session " << session << " not in the stats: " << doc.dump();
  return {0, 0};
}

// Sessions of one plain CRIU image share its source: each chunk is hashed once, however many
// sessions read it, and the cached checksums are the right ones (VerifyStream checks each
// chunk's checksum against its bytes). Once hashed (and cached, just read) a chunk leaves by
// sendfile: the later rounds send bytes from the file.
TEST_F(ServerTest, CriuChecksumsAreHashedOnceAcrossSessions) {
  auto checksums_computed = [&](TestClient& client, const std::string& image) {
    const nlohmann::json doc = StatsOf(client);
    uint64_t computed = 0;
    for (const auto& session : doc["sessions"])
      if (session["image"] == image)
        computed = std::max(computed, session["image_checksums_computed"].get<uint64_t>());
    return computed;
  };
  for (int round = 0; round < 3; ++round) {
    TestClient client(server_->unix_endpoint());
    ASSERT_TRUE(client.Hello().ok());
    Result<wire::OpenImageReply> reply = client.Open("raw");
    ASSERT_TRUE(reply.ok()) << reply.status().ToString();
    ASSERT_FALSE(reply->lazy_image());
    uint64_t total_chunks = 0;
    for (const wire::BoInfo& bo : reply->bos())
      total_chunks += bo.chunk_count();
    Result<Received> received = ReceiveStream(client, 8 * kChunk);
    ASSERT_TRUE(received.ok()) << received.status().ToString();
    ASSERT_EQ(received->chunks.size(), total_chunks);
    Status verified = VerifyStream(*reply, received->chunks, expected_["raw"]);
    EXPECT_TRUE(verified.ok()) << verified.ToString();
    // Earlier tests may have read "raw" already; either way never more than once per chunk.
    EXPECT_EQ(checksums_computed(client, "raw"), total_chunks) << "round " << round;
    if (round > 0) {
      auto [sent, sendfile] = SentAndSendfile(client, reply->session());
      EXPECT_GT(sendfile, 0u) << "round " << round << ": hashed, cached chunks went by buffer";
      EXPECT_LE(sendfile, sent);
    }
  }
}

// A lazy image's checksums are in its manifest and its chunk file was just written (cached):
// every stored byte goes from the file to the socket by sendfile, over Unix and TCP alike, and
// arrives byte-exact (VerifyStream checks every chunk against the source).
TEST_F(ServerTest, CachedChunksGoBySendfileOverUnixAndTcp) {
  for (const net::Endpoint& endpoint : {server_->unix_endpoint(), server_->tcp_endpoint()}) {
    SCOPED_TRACE(endpoint.ToString());
    TestClient client(endpoint);
    ASSERT_TRUE(client.Hello().ok());
    Result<wire::OpenImageReply> reply = client.Open("sub/lazy");
    ASSERT_TRUE(reply.ok()) << reply.status().ToString();
    Result<Received> received = ReceiveStream(client, kBigWindow);
    ASSERT_TRUE(received.ok()) << received.status().ToString();
    Status verified = VerifyStream(*reply, received->chunks, expected_["sub/lazy"]);
    EXPECT_TRUE(verified.ok()) << verified.ToString();
    auto [sent, sendfile] = SentAndSendfile(client, reply->session());
    EXPECT_GT(sent, 0u);
    EXPECT_EQ(sendfile, sent) << "cached chunks with known checksums went through a buffer";
  }
}

// Its own server: --no-sendfile reads every chunk into a buffer and sends it from there, and
// the reads go through a few reused buffers.
TEST(ServerSendfileTest, NoSendfileSendsEveryByteFromBuffers) {
  ::alarm(120);
  TempDir dir;
  const fs::path root = dir.path() / "images";
  fs::create_directories(root);
  ASSERT_TRUE(MakeImage(root / "img", 2ull << 20, 6, true).ok());
  auto expected = LoadCriuContents(root / "img");
  ASSERT_TRUE(expected.ok()) << expected.status().ToString();
  ServerProcess server(dir.path(), root, {"--no-sendfile", "--disk-threads", "2"});
  ASSERT_TRUE(server.ready()) << server.Log();
  auto buffers = [](TestClient& client) {
    const nlohmann::json doc = StatsOf(client);
    return std::pair{doc["server"]["disk"]["buffers"]["allocated"].get<uint64_t>(),
                     doc["server"]["disk"]["buffers"]["reused"].get<uint64_t>()};
  };
  uint64_t chunks_read = 0;
  for (int round = 0; round < 3; ++round) {
    TestClient client(server.tcp_endpoint());
    ASSERT_TRUE(client.Hello().ok());
    Result<wire::OpenImageReply> reply = client.Open("img");
    ASSERT_TRUE(reply.ok()) << reply.status().ToString();
    Result<Received> received = ReceiveStream(client, kBigWindow);
    ASSERT_TRUE(received.ok()) << received.status().ToString();
    Status verified = VerifyStream(*reply, received->chunks, *expected);
    EXPECT_TRUE(verified.ok()) << verified.ToString();
    for (const Frame& f : received->chunks)
      if (!f.payload.empty()) ++chunks_read;  // zero chunks are not read
    auto [sent, sendfile] = SentAndSendfile(client, reply->session());
    EXPECT_GT(sent, 0u);
    EXPECT_EQ(sendfile, 0u);
    if (round == 2) {
      // Every chunk went through a buffer: a handful in flight at a time, the rest reused.
      auto [allocated, reused] = buffers(client);
      EXPECT_LT(allocated, chunks_read / 4);
      EXPECT_GE(reused, chunks_read - chunks_read / 4);
    }
  }
  EXPECT_EQ(server.Terminate(10s), 0) << server.Log();
  ::alarm(0);
}

TEST_F(ServerTest, SixteenConcurrentClients) {
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int i = 0; i < 16; ++i) {
    threads.emplace_back([&, i] {
      const bool lazy = i % 2 == 1;
      const std::string image = lazy ? "sub/lazy" : "raw";
      const net::Endpoint& endpoint =
          (i / 2) % 2 == 0 ? server_->unix_endpoint() : server_->tcp_endpoint();
      TestClient client(endpoint);
      if (!client.connected() || !client.Hello().ok()) return;
      Result<wire::OpenImageReply> reply = client.Open(image);
      if (!reply.ok()) return;
      Result<Received> received = ReceiveStream(client, 8 * kChunk);
      if (!received.ok()) {
        ADD_FAILURE() << "client " << i << ": " << received.status().ToString();
        return;
      }
      Status verified = VerifyStream(*reply, received->chunks, expected_[image]);
      if (!verified.ok()) {
        ADD_FAILURE() << "client " << i << ": " << verified.ToString();
        return;
      }
      ++ok;
    });
  }
  for (std::thread& t : threads)
    t.join();
  EXPECT_EQ(ok.load(), 16);
}

TEST_F(ServerTest, StatsReportTheSession) {
  TestClient client(server_->unix_endpoint());
  ASSERT_TRUE(client.Hello().ok());
  Result<wire::OpenImageReply> reply = client.Open("sub/lazy");
  ASSERT_TRUE(reply.ok());
  Result<Received> received = ReceiveStream(client, kBigWindow);
  ASSERT_TRUE(received.ok());
  ASSERT_TRUE(client.Request(wire::PRIORITY_DEMAND, 0, 0, 2, 31).ok());
  for (int i = 0; i < 2; ++i) {
    Result<Frame> frame = client.Read();
    ASSERT_TRUE(frame.ok() && frame->header.has_chunk());
  }
  uint64_t bytes = 0;
  for (const Frame& f : received->chunks)
    bytes += f.payload.size();
  Result<std::string> stats = client.Stats();
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  nlohmann::json doc = nlohmann::json::parse(*stats);
  ASSERT_TRUE(doc.contains("server"));
  EXPECT_GE(doc["server"]["sessions_open"].get<uint64_t>(), 1u);
  EXPECT_EQ(doc["own_session"].get<uint64_t>(), reply->session());
  bool found = false;
  for (const auto& session : doc["sessions"]) {
    if (session["session"] != reply->session()) continue;
    found = true;
    EXPECT_EQ(session["image"], "sub/lazy");
    EXPECT_GE(session["bytes_sent"].get<uint64_t>(), bytes);
    const auto& chunks = session["chunks_sent"];
    EXPECT_EQ(chunks["background"].get<uint64_t>() + chunks["prefetch"].get<uint64_t>(),
              received->chunks.size());
    EXPECT_EQ(chunks["demand"].get<uint64_t>(), 2u);
    EXPECT_EQ(session["demand_latency_us"]["count"].get<uint64_t>(), 2u);
    const auto& latency = session["demand_latency_us"];
    EXPECT_GE(latency["p99"].get<double>(), latency["p50"].get<double>());
    // Its two parts, each no longer than the longest whole.
    EXPECT_LE(latency["queued_p50"].get<double>(), latency["queued_p99"].get<double>());
    EXPECT_LE(latency["write_p50"].get<double>(), latency["write_p99"].get<double>());
    EXPECT_LE(latency["queued_p99"].get<double>(), latency["max"].get<double>());
    EXPECT_LE(latency["write_p99"].get<double>(), latency["max"].get<double>());
  }
  EXPECT_TRUE(found) << *stats;
}

// Its own server: SIGTERM while a client streams.
TEST(ServerShutdownTest, SigtermExitsCleanlyAndRemovesTheSocket) {
  ::alarm(120);
  TempDir dir;
  const fs::path root = dir.path() / "images";
  fs::create_directories(root);
  ASSERT_TRUE(MakeImage(root / "img", 4ull << 20, 9, false).ok());
  // A grace well above the exit time allowed below, so waiting it out cannot pass.
  ServerProcess server(dir.path(), root, {"--raw-chunk-size", "64K", "--shutdown-grace", "10"});
  ASSERT_TRUE(server.ready()) << server.Log();
  TestClient client(server.unix_endpoint());
  ASSERT_TRUE(client.Hello().ok());
  ASSERT_TRUE(client.Open("img").ok());
  // Little enough credit that the chunks sent fit in the socket buffer: no write is stuck
  // when SIGTERM comes (a stuck one would only end at --shutdown-grace, without the error).
  ASSERT_TRUE(client.Credit(2 * kChunk).ok());
  ASSERT_TRUE(client.StreamAll().ok());
  Result<Frame> first = client.Read();
  ASSERT_TRUE(first.ok() && first->header.has_chunk());
  std::this_thread::sleep_for(100ms);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(server.Terminate(15s), 0) << server.Log();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);  // not the 10 s grace
  EXPECT_FALSE(fs::exists(server.socket_path()));
  // The client hears why, then the connection ends.
  bool saw_shutdown = false;
  while (true) {
    Result<Frame> frame = client.Read(2s);
    if (!frame.ok()) break;
    if (frame->header.has_error() && frame->header.error().code() == wire::ERROR_SHUTTING_DOWN)
      saw_shutdown = true;
  }
  EXPECT_TRUE(saw_shutdown);
  ::alarm(0);
}

// How many of the server's threads are named `name` (/proc/PID/task/*/comm).
int ThreadsNamed(pid_t pid, std::string_view name) {
  int count = 0;
  std::error_code ec;
  for (const fs::directory_entry& task :
       fs::directory_iterator(fs::path("/proc") / std::to_string(pid) / "task", ec)) {
    std::ifstream comm(task.path() / "comm");
    std::string line;
    if (std::getline(comm, line) && line == name) ++count;
  }
  return count;
}

// `read()` until it returns `want` or 5 s passed; the last reading.
template <typename T, typename Read>
T ReadUntil(Read read, T want) {
  T got = read();
  for (const auto until = std::chrono::steady_clock::now() + 5s;
       got != want && std::chrono::steady_clock::now() < until; got = read())
    std::this_thread::sleep_for(10ms);
  return got;
}

// --demand-network-threads N: a demand connection on a plain socket moves onto the N demand
// network threads after its Hello (0: it stays on the shared ones). Either way its demand
// chunks arrive intact over Unix and TCP, the connection counts once, and a SIGTERM reaches
// it: the server exits without waiting out the grace and the client hears why.
class DemandNetworkThreadsTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(DemandNetworkThreadsTest, DemandConnectionsAreServedAndShutDown) {
  ::alarm(120);
  const uint32_t threads = GetParam();
  TempDir dir;
  const fs::path root = dir.path() / "images";
  ASSERT_TRUE(MakeImage(root / "img", 8ull << 20, 21, false).ok());
  auto expected = LoadCriuContents(root / "img");
  ASSERT_TRUE(expected.ok()) << expected.status().ToString();
  // A grace well above the exit time allowed below, so waiting it out cannot pass.
  ServerProcess server(dir.path(), root,
                       {"--raw-chunk-size", "64K", "--shutdown-grace", "10",
                        "--demand-network-threads", std::to_string(threads)});
  ASSERT_TRUE(server.ready()) << server.Log();

  std::vector<std::unique_ptr<TestClient>> clients;  // stream, demand per transport
  uint64_t request_id = 100;
  for (const net::Endpoint& endpoint : {server.unix_endpoint(), server.tcp_endpoint()}) {
    SCOPED_TRACE(endpoint.ToString());
    auto& stream = clients.emplace_back(std::make_unique<TestClient>(endpoint));
    ASSERT_TRUE(stream->Hello().ok());
    Result<wire::OpenImageReply> reply = stream->Open("img");
    ASSERT_TRUE(reply.ok()) << reply.status().ToString();
    auto& demand = clients.emplace_back(std::make_unique<TestClient>(endpoint));
    // The Hello and the first request in one go, before the HelloReply: the request must not
    // be lost when the socket changes threads after the Hello.
    ASSERT_TRUE(
        demand->SendHello(reply->session(), reply->session_secret(), {}, kProtocolVersion).ok());
    // Several requests, so the moved connection serves more than its first frame.
    for (uint32_t bo = 0; bo < 3; ++bo) {
      const uint32_t chunk = reply->bos(static_cast<int>(bo)).chunk_count() - 1;
      ASSERT_TRUE(demand->Request(wire::PRIORITY_DEMAND, bo, chunk, 1, ++request_id).ok());
      if (bo == 0) {
        Result<wire::HelloReply> hello_reply = demand->ReadHelloReply();
        ASSERT_TRUE(hello_reply.ok()) << hello_reply.status().ToString();
      }
      Result<Frame> answer = demand->Read(5s);
      ASSERT_TRUE(answer.ok()) << answer.status().ToString();
      ASSERT_TRUE(answer->header.has_chunk());
      EXPECT_EQ(answer->header.request_id(), request_id);
      EXPECT_EQ(answer->header.chunk().bo(), bo);
      EXPECT_EQ(answer->header.chunk().chunk(), chunk);
      Result<std::vector<uint8_t>> raw = DecodeChunkFrame(*answer);
      ASSERT_TRUE(raw.ok()) << raw.status().ToString();
      const wire::BoInfo& info = reply->bos(static_cast<int>(bo));
      const std::vector<uint8_t>& bytes = expected->at({info.process_id(), info.bo_index()});
      const uint64_t offset = uint64_t{chunk} * reply->chunk_size();
      ASSERT_LE(offset + raw->size(), bytes.size());
      EXPECT_TRUE(std::equal(raw->begin(), raw->end(), bytes.begin() + static_cast<long>(offset)))
          << "BO " << bo << " chunk " << chunk;
    }
  }
  // The server names its threads as they start, after it wrote the ready file: wait for them.
  EXPECT_EQ(ReadUntil([&] { return ThreadsNamed(server.pid(), "gl-demand-net"); },
                      static_cast<int>(threads)),
            static_cast<int>(threads));
  Result<std::string> stats = clients[1]->Stats();
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  const nlohmann::json doc = nlohmann::json::parse(*stats)["server"];
  EXPECT_EQ(doc["demand_connections_moved"].get<uint64_t>(), threads > 0 ? 2u : 0u) << *stats;
  EXPECT_EQ(doc["connections_open"].get<uint64_t>(), 4u) << *stats;
  EXPECT_EQ(doc["connections_accepted"].get<uint64_t>(), 4u) << *stats;
  // One loop per demand network thread, each connection on the least busy: two connections on
  // two threads take one each.
  const std::vector<uint64_t> per_loop = doc["demand_loop_connections"];
  const std::vector<std::vector<uint64_t>> expected_per_loop = {{}, {2}, {1, 1}};
  EXPECT_EQ(per_loop, expected_per_loop.at(threads)) << *stats;
  // A third session's demand connection counts while it lives and not after it closed.
  auto moved_now = [&]() -> uint64_t {
    Result<std::string> now = clients[1]->Stats(++request_id);
    if (!now.ok()) return ~0ull;
    const nlohmann::json parsed = nlohmann::json::parse(*now);
    uint64_t sum = 0;
    for (uint64_t n : parsed["server"]["demand_loop_connections"])
      sum += n;
    return sum;
  };
  {
    TestClient stream(server.unix_endpoint());
    ASSERT_TRUE(stream.Hello().ok());
    Result<wire::OpenImageReply> third = stream.Open("img");
    ASSERT_TRUE(third.ok()) << third.status().ToString();
    TestClient demand(server.unix_endpoint());
    ASSERT_TRUE(demand.Hello(third->session(), third->session_secret()).ok());
    EXPECT_EQ(moved_now(), threads > 0 ? 3u : 0u);
  }
  EXPECT_EQ(ReadUntil(moved_now, uint64_t{threads > 0 ? 2u : 0u}), threads > 0 ? 2u : 0u);

  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(server.Terminate(15s), 0) << server.Log();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);  // not the 10 s grace
  // Each demand connection hears ERROR_SHUTTING_DOWN from the server's shutdown, which reaches
  // a moved connection only through the server's registry, before the Goodbye its session's
  // close would send (the server tells the newer connections first).
  for (size_t i = 1; i < clients.size(); i += 2) {
    Result<Frame> frame = clients[i]->Read(2s);
    ASSERT_TRUE(frame.ok()) << "demand connection " << i / 2 << ": " << frame.status().ToString();
    EXPECT_TRUE(frame->header.has_error() &&
                frame->header.error().code() == wire::ERROR_SHUTTING_DOWN)
        << "demand connection " << i / 2 << ": " << frame->header.ShortDebugString();
    EXPECT_TRUE(clients[i]->WaitClosed(1s));
  }
  ::alarm(0);
}

INSTANTIATE_TEST_SUITE_P(Threads, DemandNetworkThreadsTest, ::testing::Values(0u, 1u, 2u));

// Its own server: token, session and demand limits.
// One session's stream over its stream connection and two lanes (one of them over TCP): every
// chunk once across the three, some on each, each connection's chunks in the session's pick
// order (table order for an image without profile), StreamDone on each after its chunks.
TEST_F(ServerTest, LanesCarryOneSessionsStreamEachInPickOrder) {
  TestClient stream(server_->unix_endpoint());
  Result<wire::HelloReply> hello = stream.Hello();
  ASSERT_TRUE(hello.ok()) << hello.status().ToString();
  EXPECT_EQ(hello->max_lanes(), 7u);  // the default --max-lanes
  Result<wire::OpenImageReply> reply = stream.Open("raw");
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  TestClient lane_unix(server_->unix_endpoint());
  TestClient lane_tcp(server_->tcp_endpoint());
  for (TestClient* lane : {&lane_unix, &lane_tcp}) {
    Result<wire::HelloReply> joined = lane->JoinAsLane(reply->session(), reply->session_secret());
    ASSERT_TRUE(joined.ok()) << joined.status().ToString();
  }
  ASSERT_TRUE(stream.Credit(kBigWindow).ok());
  ASSERT_TRUE(stream.StreamAll().ok());

  struct Carried {
    std::vector<Frame> chunks;
    bool done = false;
    Status status;
  };
  std::array<Carried, 3> carried;
  std::array<TestClient*, 3> connections{&stream, &lane_unix, &lane_tcp};
  std::vector<std::thread> readers;
  for (size_t i = 0; i < connections.size(); ++i)
    readers.emplace_back([&, i] {
      for (;;) {
        Result<Frame> frame = connections[i]->Read(20s);
        if (!frame.ok()) {
          carried[i].status = frame.status();
          return;
        }
        if (frame->header.has_stream_done()) {
          carried[i].done = true;
          return;
        }
        if (frame->header.has_chunk()) carried[i].chunks.push_back(std::move(*frame));
      }
    });
  for (std::thread& reader : readers)
    reader.join();
  std::vector<Frame> all;
  // Flat position of a chunk in table order.
  std::vector<uint64_t> first_flat;
  uint64_t flat = 0;
  for (const wire::BoInfo& bo : reply->bos()) {
    first_flat.push_back(flat);
    flat += bo.chunk_count();
  }
  for (size_t i = 0; i < carried.size(); ++i) {
    EXPECT_TRUE(carried[i].status.ok())
        << "connection " << i << ": " << carried[i].status.ToString();
    EXPECT_TRUE(carried[i].done) << "connection " << i << " had no StreamDone";
    EXPECT_GT(carried[i].chunks.size(), 0u) << "connection " << i << " carried nothing";
    uint64_t last = 0;
    for (size_t k = 0; k < carried[i].chunks.size(); ++k) {
      const wire::ChunkData& data = carried[i].chunks[k].header.chunk();
      const uint64_t at = first_flat.at(data.bo()) + data.chunk();
      if (k > 0) {
        EXPECT_GT(at, last) << "connection " << i << ", chunk " << k;
      }
      last = at;
    }
    for (Frame& frame : carried[i].chunks)
      all.push_back(std::move(frame));
  }
  Status verified = VerifyStream(*reply, all, expected_["raw"]);
  EXPECT_TRUE(verified.ok()) << verified.ToString();
}

// Lanes the server refuses, what a lane may not do, and a lane whose end ends the session.
TEST(ServerLimitsTest, LaneJoinsAndLaneLimits) {
  ::alarm(120);
  TempDir dir;
  const fs::path root = dir.path() / "images";
  fs::create_directories(root);
  ASSERT_TRUE(MakeImage(root / "img", 2ull << 20, 6, false).ok());
  ServerProcess server(dir.path(), root, {"--raw-chunk-size", "64K", "--max-lanes", "1"});
  ASSERT_TRUE(server.ready()) << server.Log();
  TestClient stream(server.unix_endpoint());
  Result<wire::HelloReply> hello = stream.Hello();
  ASSERT_TRUE(hello.ok()) << hello.status().ToString();
  EXPECT_EQ(hello->max_lanes(), 1u);
  Result<wire::OpenImageReply> reply = stream.Open("img");
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  auto refused = [&](uint64_t session, const std::string& secret, const char* code) {
    TestClient lane(server.unix_endpoint());
    Result<wire::HelloReply> joined = lane.JoinAsLane(session, secret);
    ASSERT_FALSE(joined.ok());
    EXPECT_NE(joined.status().message().find(code), std::string::npos)
        << joined.status().ToString();
    EXPECT_TRUE(lane.WaitClosed());
  };
  refused(0, "", "ERROR_BAD_REQUEST");  // a lane of no session
  refused(reply->session(), "wrong", "ERROR_NOT_FOUND");
  TestClient lane(server.unix_endpoint());
  ASSERT_TRUE(lane.JoinAsLane(reply->session(), reply->session_secret()).ok());
  refused(reply->session(), reply->session_secret(), "ERROR_LIMIT");  // past --max-lanes 1
  // Requests belong on the stream connection; the lane stays open.
  ASSERT_TRUE(lane.Request(wire::PRIORITY_DEMAND, 0, 0, 1, 7).ok());
  Result<wire::Error> error = lane.ReadError();
  ASSERT_TRUE(error.ok()) << error.status().ToString();
  EXPECT_EQ(error->code(), wire::ERROR_BAD_REQUEST);
  EXPECT_EQ(error->in_reply_to(), 7u);
  // The lane goes: so does its session, and the stream connection hears Goodbye.
  ASSERT_TRUE(lane.CloseWrite().ok());
  EXPECT_TRUE(lane.WaitClosed());
  Result<Frame> bye = stream.Read(5s);
  ASSERT_TRUE(bye.ok()) << bye.status().ToString();
  EXPECT_TRUE(bye->header.has_goodbye());
  EXPECT_TRUE(stream.WaitClosed());
  EXPECT_EQ(server.Terminate(10s), 0) << server.Log();
  ::alarm(0);
}

TEST(ServerLimitsTest, TokenSessionAndDemandLimits) {
  ::alarm(120);
  TempDir dir;
  const fs::path root = dir.path() / "images";
  fs::create_directories(root);
  ASSERT_TRUE(MakeImage(root / "img", 2ull << 20, 5, false).ok());
  const fs::path token = dir.path() / "token";
  std::ofstream(token) << "s3cret\n";  // the newline is not part of the token
  fs::permissions(token, fs::perms::owner_read | fs::perms::owner_write);
  ServerProcess server(dir.path(), root,
                       {"--raw-chunk-size", "64K", "--token-file", token.string(), "--max-sessions",
                        "1", "--max-demand", "4"});
  ASSERT_TRUE(server.ready()) << server.Log();
  {
    TestClient client(server.unix_endpoint());
    Result<wire::HelloReply> hello = client.Hello(0, {}, "wrong");
    ASSERT_FALSE(hello.ok());
    EXPECT_NE(hello.status().message().find("ERROR_UNAUTHENTICATED"), std::string::npos);
    EXPECT_TRUE(client.WaitClosed());
  }
  auto first = std::make_unique<TestClient>(server.unix_endpoint());
  ASSERT_TRUE(first->Hello(0, {}, "s3cret").ok());
  Result<wire::OpenImageReply> reply = first->Open("img");
  ASSERT_TRUE(reply.ok()) << reply.status().ToString();
  {
    TestClient second(server.tcp_endpoint());
    ASSERT_TRUE(second.Hello(0, {}, "s3cret").ok());
    Result<wire::OpenImageReply> refused = second.Open("img");
    ASSERT_FALSE(refused.ok());
    EXPECT_NE(refused.status().message().find("ERROR_LIMIT"), std::string::npos);
  }
  TestClient demand(server.unix_endpoint());
  ASSERT_TRUE(demand.Hello(reply->session(), reply->session_secret(), "s3cret").ok());
  ASSERT_TRUE(demand.Request(wire::PRIORITY_DEMAND, 0, 0, 5, 3).ok());  // over --max-demand
  Result<wire::Error> error = demand.ReadError();
  ASSERT_TRUE(error.ok()) << error.status().ToString();
  EXPECT_EQ(error->code(), wire::ERROR_LIMIT);
  EXPECT_EQ(error->in_reply_to(), 3u);
  ASSERT_TRUE(demand.Request(wire::PRIORITY_DEMAND, 0, 0, 4, 4).ok());
  for (int i = 0; i < 4; ++i) {
    Result<Frame> frame = demand.Read();
    ASSERT_TRUE(frame.ok() && frame->header.has_chunk());
    EXPECT_EQ(frame->header.request_id(), 4u);
  }
  // The stream connection closing ends the session: the demand connection hears Goodbye.
  first.reset();
  Result<Frame> bye = demand.Read(5s);
  ASSERT_TRUE(bye.ok()) << bye.status().ToString();
  EXPECT_TRUE(bye->header.has_goodbye());
  EXPECT_TRUE(demand.WaitClosed());
  EXPECT_EQ(server.Terminate(10s), 0) << server.Log();
  ::alarm(0);
}

// A demand connection replaced by a newer one (docs/protocol.md, "Credit"): what it asked for and
// was not sent is dropped, not sent to its successor (whose request ids those are not), and does
// not count against --max-demand when the client asks again there.
TEST(ServerLimitsTest, AReplacedDemandConnectionsQueueGoesNowhere) {
  ::alarm(120);
  TempDir dir;
  const fs::path root = dir.path() / "images";
  fs::create_directories(root);
  // 2 MiB chunks: one fills the old connection's socket buffers, so its write stalls while the
  // rest of its requests wait queued.
  ASSERT_TRUE(MakeTestImage(root / "img", {.bytes = 48ull << 20, .seed = 9, .lazy = false}).ok());
  constexpr uint32_t kMaxDemand = 16;
  ServerProcess server(dir.path(), root,
                       {"--raw-chunk-size", "2M", "--max-demand", std::to_string(kMaxDemand),
                        "--demand-window", "1", "--shutdown-grace", "1", "--write-timeout", "0"});
  ASSERT_TRUE(server.ready()) << server.Log();
  TestClient stream(server.unix_endpoint());
  ASSERT_TRUE(stream.Hello().ok());
  Result<wire::OpenImageReply> opened = stream.Open("img");
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  struct Range {
    uint32_t bo, count;
  };
  std::vector<Range> ranges;
  uint32_t left = kMaxDemand;
  for (int bo = 0; bo < opened->bos_size() && left > 0; ++bo) {
    const uint32_t n = std::min(left, opened->bos(bo).chunk_count());
    if (n > 0) ranges.push_back({static_cast<uint32_t>(bo), n});
    left -= n;
  }
  ASSERT_EQ(left, 0u);
  auto ask_all = [&](TestClient& client, uint64_t first_id) {
    uint64_t id = first_id;
    for (const Range& range : ranges)
      ASSERT_TRUE(client.Request(wire::PRIORITY_DEMAND, range.bo, 0, range.count, id++).ok());
  };

  TestClient old_demand(server.unix_endpoint());
  ASSERT_TRUE(old_demand.Hello(opened->session(), opened->session_secret()).ok());
  ask_all(old_demand, 100);
  std::this_thread::sleep_for(500ms);  // its first chunk's write stalls; the rest wait queued
  TestClient new_demand(server.unix_endpoint());
  ASSERT_TRUE(new_demand.Hello(opened->session(), opened->session_secret()).ok());
  // The old connection hears Goodbye and is closed (reading it lets its stalled write end).
  EXPECT_TRUE(old_demand.WaitClosed(10s));

  ask_all(new_demand, 200);
  int answered = 0;
  while (answered < static_cast<int>(kMaxDemand)) {
    Result<Frame> frame = new_demand.Read(10s);
    ASSERT_TRUE(frame.ok()) << frame.status().ToString() << " after " << answered << " chunks";
    ASSERT_FALSE(frame->header.has_error())
        << "asking again was refused: " << frame->header.error().message();
    ASSERT_TRUE(frame->header.has_chunk());
    ASSERT_GE(frame->header.request_id(), 200u)
        << "a chunk the replaced connection asked for: " << frame->header.request_id();
    ++answered;
  }
  // Nothing more: none of the replaced connection's requests is answered late.
  Result<Frame> late = new_demand.Read(1s);
  EXPECT_FALSE(late.ok()) << "a late frame, request id " << late->header.request_id();
  EXPECT_EQ(server.Terminate(10s), 0) << server.Log();
  ::alarm(0);
}

}  // namespace
}  // namespace gpulazy::server::testing
