// Reply backpressure (docs/hostile-input.md, "Replies a client does not read"): the server
// queues at most Connection::kMaxQueuedControl replies (64) and kMaxQueuedControlBytes (1 MiB)
// of replies per connection. Each limit has a test here that fails without it:
//
// - frames: a client sends thousands of StatsRequests and reads nothing. The server stops
//   reading its requests once 64 replies wait (the stats a second connection asks for show
//   64 queued and no more frames received), serves other clients meanwhile, and when the
//   client finally reads, every reply is there, intact and in order. Without the frame limit
//   the server would read on, queue past 1 MiB and cut the client off.
// - bytes: with 60 sessions open each StatsReply is over 16 KiB, so 64 of them would be more
//   than 1 MiB. A client that floods StatsRequests without reading is cut off (ERROR_LIMIT,
//   "does not read its replies") before its queue passes 1 MiB; the server's high-water mark
//   of queued reply bytes says it never held more.
//
// The figures come from the server's own StatsReply ("reply_queue", docs/server.md).
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "lazy-server/image/synth.h"
#include "tests/server/test_support.h"

namespace gpulazy::server::testing {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

std::vector<uint8_t> StatsFlood(int requests) {
  std::vector<uint8_t> flood;
  for (int i = 0; i < requests; ++i) {
    wire::Header header;
    header.set_request_id(static_cast<uint64_t>(i) + 1);
    header.mutable_stats_request();
    const std::string bytes = header.SerializeAsString();
    const auto length = static_cast<uint32_t>(bytes.size());
    for (int shift = 0; shift < 32; shift += 8)  // little-endian header length, no payload
      flood.push_back(static_cast<uint8_t>(length >> shift));
    flood.insert(flood.end(), 4, 0);
    flood.insert(flood.end(), bytes.begin(), bytes.end());
  }
  return flood;
}

class ReplyBackpressureTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ::alarm(120);  // no test may hang
    image::SynthOptions options;
    options.out = root_ / "img";
    options.gpus = 1;
    options.bos = 4;
    options.total_bytes = 2ull << 20;
    options.seed = 5;
    ASSERT_TRUE(image::SynthesizeCheckpoint(options).ok());
    auto contents = LoadCriuContents(root_ / "img");
    ASSERT_TRUE(contents.ok()) << contents.status().ToString();
    expected_ = std::move(*contents);
    // The default write timeout (30 s): the slow client below reads long before it. A client cut
    // off for not reading gets --shutdown-grace to read what it was sent before the socket
    // closes; 30 s, since parsing 400 large replies takes a sanitizer build several seconds.
    server_ = std::make_unique<ServerProcess>(dir_.path(), root_,
                                              std::vector<std::string>{"--shutdown-grace", "30"});
    ASSERT_TRUE(server_->ready()) << server_->Log();
    observer_ = std::make_unique<TestClient>(server_->unix_endpoint());
    ASSERT_TRUE(observer_->Hello().ok());
  }
  void TearDown() override {
    if (server_ && server_->ready()) {
      // A clean exit (LeakSanitizer checks the server here in sanitizer builds).
      EXPECT_EQ(server_->Terminate(40s), 0);
    }
    ::alarm(0);
    if (HasFailure() && server_) std::cerr << server_->Log().substr(0, 20000);
  }

  // The server's StatsReply document, asked for on the observer connection.
  Json Stats() {
    Result<std::string> text = observer_->Stats(++observer_requests_);
    EXPECT_TRUE(text.ok()) << text.status().ToString();
    return text.ok() ? Json::parse(*text) : Json::object();
  }
  static uint64_t Queue(const Json& stats, const char* field) {
    return stats["server"]["reply_queue"][field].get<uint64_t>();
  }
  // Polls the stats until `done` holds (true) or 60 s pass (false). Not too often: each
  // StatsReply costs the server as much as one of the slow client's, and under ASan the server
  // needs seconds to build the ~9 MB of large replies that fill its socket buffer and queue.
  template <typename Predicate>
  bool WaitForStats(Predicate done, Json* last) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (std::chrono::steady_clock::now() < deadline) {
      *last = Stats();
      if (done(*last)) return true;
      std::this_thread::sleep_for(100ms);
    }
    return false;
  }
  // Another client streams the whole image byte-exact; returns how long it took.
  double ServeAnotherClient() {
    const auto start = std::chrono::steady_clock::now();
    Status status = StreamWholeImage(server_->unix_endpoint(), "img", expected_, 1ull << 30);
    EXPECT_TRUE(status.ok()) << status.ToString();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }

  TempDir dir_;
  fs::path root_ = dir_.path() / "images";
  std::map<BoKey, std::vector<uint8_t>> expected_;
  std::unique_ptr<ServerProcess> server_;
  std::unique_ptr<TestClient> observer_;
  uint64_t observer_requests_ = 0;
};

TEST_F(ReplyBackpressureTest, FrameLimitStopsReadingThenEveryReplyArrivesIntact) {
  TestClient slow(server_->unix_endpoint());
  ASSERT_TRUE(slow.Hello().ok());
  // The server's socket buffer (4 MiB asked, kSocketBufferBytes) takes about 6600 of these
  // half-KiB replies before a write blocks and replies start to queue (Linux 6.18). The requests
  // left unread after that must come to more than the 1 MiB byte limit (checked below): then only
  // the frame limit, which stops the server reading requests, keeps every reply of this client.
  // (Each request costs the server a JSON document, slow under ASan: no more than needed.)
  constexpr int kRequests = 10000;
  const size_t reply_bytes = Stats().dump().size();
  ASSERT_TRUE(slow.SendRaw(StatsFlood(kRequests)).ok());

  // Paused for good, not only for a moment: the queue can reach the limit while one write is
  // slow and the socket buffer still has room (a loaded 16-core host read another 1000 requests
  // after such a moment). Between two samples the server must have received only the
  // observer's stats request.
  Json stats;
  uint64_t previous_received = 0;
  ASSERT_TRUE(WaitForStats(
      [&previous_received](const Json& s) {
        const uint64_t now = s["server"]["frames_received"].get<uint64_t>();
        const bool still = now == previous_received + 1;
        previous_received = now;
        return still && Queue(s, "frames_max_now") >= Queue(s, "frames_limit");
      },
      &stats))
      << stats.dump();
  const uint64_t frames_limit = Queue(stats, "frames_limit");
  const uint64_t bytes_limit = Queue(stats, "bytes_limit");
  EXPECT_EQ(frames_limit, 64u);
  EXPECT_EQ(bytes_limit, 1u << 20);
  // The reader is paused: over half a second the server receives only the observer's request.
  const uint64_t received = stats["server"]["frames_received"].get<uint64_t>();
  ASSERT_LT(received, static_cast<uint64_t>(kRequests)) << "the socket buffer took every reply";
  ASSERT_GT((kRequests - received) * reply_bytes, bytes_limit)
      << "too few requests left unread to pass the byte limit: raise kRequests";
  std::this_thread::sleep_for(500ms);
  stats = Stats();
  EXPECT_EQ(stats["server"]["frames_received"].get<uint64_t>(), received + 1)
      << "the server kept reading requests of a client with 64 unread replies";
  EXPECT_EQ(Queue(stats, "frames_max_now"), frames_limit);
  EXPECT_LE(Queue(stats, "frames_peak"), frames_limit);
  EXPECT_LE(Queue(stats, "bytes_peak"), bytes_limit);
  EXPECT_EQ(Queue(stats, "cutoffs"), 0u);

  // Meanwhile another client is served, byte-exact and promptly.
  const double other_s = ServeAnotherClient();
  EXPECT_LT(other_s, 10.0);

  // Now the slow client reads: every reply, in order, each a whole StatsReply document.
  const auto start = std::chrono::steady_clock::now();
  for (int i = 1; i <= kRequests; ++i) {
    Result<Frame> frame = slow.Read(10s);
    ASSERT_TRUE(frame.ok()) << "reply " << i << ": " << frame.status().ToString();
    ASSERT_TRUE(frame->header.has_stats_reply()) << frame->header.ShortDebugString();
    ASSERT_EQ(frame->header.request_id(), static_cast<uint64_t>(i));
    const Json reply = Json::parse(frame->header.stats_reply().json(), nullptr, false);
    ASSERT_FALSE(reply.is_discarded()) << "reply " << i << " is not whole JSON";
    ASSERT_TRUE(reply.contains("server"));
  }
  const double read_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats = Stats();
  EXPECT_LE(Queue(stats, "frames_peak"), frames_limit);
  EXPECT_LE(Queue(stats, "bytes_peak"), bytes_limit);
  EXPECT_EQ(Queue(stats, "cutoffs"), 0u);
  std::printf(
      "reply backpressure (frames): %d requests unread; the server paused after reading %llu "
      "frames; queue held at %llu frames (peak %llu bytes); another client served in %.2f s "
      "meanwhile; then all %d replies read intact in %.2f s\n",
      kRequests, static_cast<unsigned long long>(received),
      static_cast<unsigned long long>(frames_limit),
      static_cast<unsigned long long>(Queue(stats, "bytes_peak")), other_s, kRequests, read_s);
}

TEST_F(ReplyBackpressureTest, ByteLimitCutsOffAClientWhoseLargeRepliesPileUp) {
  // 60 idle sessions (of the 64 allowed) make every StatsReply list 60 sessions: over 16 KiB
  // each, so 64 of them are over 1 MiB.
  std::vector<std::unique_ptr<TestClient>> sessions;
  for (int i = 0; i < 60; ++i) {
    sessions.push_back(std::make_unique<TestClient>(server_->unix_endpoint()));
    ASSERT_TRUE(sessions.back()->Hello().ok());
    ASSERT_TRUE(sessions.back()->Open("img").ok());
  }
  Json stats = Stats();
  const uint64_t frames_limit = Queue(stats, "frames_limit");
  const uint64_t bytes_limit = Queue(stats, "bytes_limit");
  const size_t reply_bytes = stats.dump().size();
  // Without the byte limit, 64 queued replies would be more than 1 MiB.
  ASSERT_GT(reply_bytes * frames_limit, bytes_limit) << reply_bytes << " bytes per reply";

  TestClient slow(server_->unix_endpoint());
  ASSERT_TRUE(slow.Hello().ok());
  // The socket buffer takes a few hundred of these replies before they queue at all.
  constexpr int kRequests = 2000;
  ASSERT_TRUE(slow.SendRaw(StatsFlood(kRequests)).ok());
  ASSERT_TRUE(WaitForStats([](const Json& s) { return Queue(s, "cutoffs") >= 1; }, &stats))
      << stats.dump();
  EXPECT_LE(Queue(stats, "bytes_peak"), bytes_limit);
  EXPECT_LT(Queue(stats, "frames_peak"), frames_limit) << "the frame limit came first";

  // The client gets the replies the socket already held, intact and in order, then the error.
  int replies = 0;
  std::optional<wire::Error> error;
  while (!error) {
    Result<Frame> frame = slow.Read(10s);
    ASSERT_TRUE(frame.ok()) << "after " << replies << " replies: " << frame.status().ToString();
    if (frame->header.has_error()) {
      error = frame->header.error();
      break;
    }
    ASSERT_TRUE(frame->header.has_stats_reply()) << frame->header.ShortDebugString();
    ASSERT_EQ(frame->header.request_id(), static_cast<uint64_t>(replies) + 1);
    ASSERT_FALSE(Json::parse(frame->header.stats_reply().json(), nullptr, false).is_discarded());
    ++replies;
  }
  EXPECT_EQ(error->code(), wire::ERROR_LIMIT) << error->message();
  EXPECT_NE(error->message().find("does not read its replies"), std::string::npos)
      << error->message();
  EXPECT_TRUE(slow.WaitClosed(10s));
  EXPECT_LT(replies, kRequests);

  const double other_s = ServeAnotherClient();
  stats = Stats();
  EXPECT_LE(Queue(stats, "bytes_peak"), bytes_limit);
  std::printf(
      "reply backpressure (bytes): %zu-byte replies, %d requests unread: cut off with "
      "ERROR_LIMIT after %d replies; queued peak %llu bytes in %llu frames (limits %llu, "
      "%llu); another client served in %.2f s\n",
      reply_bytes, kRequests, replies, static_cast<unsigned long long>(Queue(stats, "bytes_peak")),
      static_cast<unsigned long long>(Queue(stats, "frames_peak")),
      static_cast<unsigned long long>(bytes_limit), static_cast<unsigned long long>(frames_limit),
      other_s);
}

}  // namespace
}  // namespace gpulazy::server::testing
