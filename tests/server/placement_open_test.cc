// Destinations open while the stream runs (docs/protocol.md, "Placement"): a server embedded
// here with the memfd backend behind a gate that holds or fails each destination's opening, so
// every step is seen: PlaceInto is answered before any destination is open; a chunk whose BO is
// not open yet waits for it, and the first BO a chunk waits for opens next; a destination that
// fails to open leaves its BO's chunks to come as bytes; a session that closes while its
// destinations open opens no more of them; a client that leaves while placements are in flight
// returns only once the server let go of its destinations. Each restore ends byte-exact.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <span>
#include <thread>
#include <vector>

#include "lazy-server/server/server.h"
#include "page-client/host_engine.h"
#include "page-client/restore_session.h"
#include "tests/server/checkpoint_bytes.h"
#include "tests/server/test_support.h"
#include "tests/support/unix_relay.h"

namespace gpulazy::server::testing {
namespace {
namespace fs = std::filesystem;
using namespace std::chrono_literals;
using ::gpulazy::testing::UnixRelay;

// The memfd backend, with each destination's opening held at a gate or failed. The client
// hands its BOs over in order in one frame, so the n-th accepted destination is BO n.
class GatedPlacement final : public PlacementBackend {
 public:
  struct Gate {
    std::mutex mu;
    std::condition_variable changed;
    bool held = false;
    std::set<uint32_t> failing;   // BOs whose opening fails
    std::vector<uint32_t> opens;  // BOs in the order their opening began
    uint32_t accepted = 0;
    bool places_held = false;  // each placement waits here (on its disk thread) until let go
    uint32_t places_to_hold = UINT32_MAX;  // ... as long as this many more may be held
    uint32_t places_waiting = 0;
    uint32_t places_finished = 0;  // placements whose copy and `done` have run
    std::vector<std::weak_ptr<const PlacementTarget>> opened;  // every destination opened
  };

  explicit GatedPlacement(std::shared_ptr<Gate> gate)
      : inner_(CreateMemfdPlacement()), gate_(std::move(gate)) {}

  std::string_view kind() const override { return inner_->kind(); }
  std::string device() const override { return inner_->device(); }
  Result<std::unique_ptr<AcceptedTarget>> Accept(std::string_view handle, uint64_t size,
                                                 const PeerIdentity& peer) override {
    GPULAZY_ASSIGN_OR_RETURN(std::unique_ptr<AcceptedTarget> accepted,
                             inner_->Accept(handle, size, peer));
    std::lock_guard lock(gate_->mu);
    return std::unique_ptr<AcceptedTarget>(
        std::make_unique<Gated>(std::move(accepted), gate_, gate_->accepted++));
  }
  Status Place(const image::DiskRange& from, std::string_view file_name,
               std::optional<uint64_t> checksum, const PlacementTargetRef& target,
               uint64_t target_offset, PlacementDone done) override {
    {
      std::unique_lock lock(gate_->mu);
      if (gate_->places_held && gate_->places_to_hold > 0) {
        --gate_->places_to_hold;
        ++gate_->places_waiting;
        gate_->changed.notify_all();
        gate_->changed.wait(lock, [&] { return !gate_->places_held; });
        --gate_->places_waiting;
      }
    }
    Status placed = inner_->Place(from, file_name, checksum, target, target_offset,
                                  [this, done = std::move(done)](Status status) {
                                    done(std::move(status));
                                    std::lock_guard lock(gate_->mu);
                                    ++gate_->places_finished;
                                  });
    return placed;
  }
  Status Prepare(int fd, std::string_view file_name) override {
    return inner_->Prepare(fd, file_name);
  }
  void Flush() override { inner_->Flush(); }
  std::vector<std::pair<std::string, uint64_t>> Counters() const override {
    return inner_->Counters();
  }

 private:
  class Gated final : public AcceptedTarget {
   public:
    Gated(std::unique_ptr<AcceptedTarget> inner, std::shared_ptr<Gate> gate, uint32_t bo)
        : inner_(std::move(inner)), gate_(std::move(gate)), bo_(bo) {}
    Result<PlacementTargetRef> Open() override {
      std::unique_lock lock(gate_->mu);
      gate_->opens.push_back(bo_);
      gate_->changed.notify_all();
      gate_->changed.wait(lock, [&] { return !gate_->held; });
      if (gate_->failing.contains(bo_)) return Unavailable("the test fails BO {}'s opening", bo_);
      lock.unlock();
      Result<PlacementTargetRef> opened = inner_->Open();
      if (opened.ok()) {
        lock.lock();
        gate_->opened.push_back(*opened);
      }
      return opened;
    }

   private:
    std::unique_ptr<AcceptedTarget> inner_;
    std::shared_ptr<Gate> gate_;
    uint32_t bo_;
  };

  std::unique_ptr<PlacementBackend> inner_;
  std::shared_ptr<Gate> gate_;
};

class PlacementOpenTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<TempDir>();
    ASSERT_TRUE(MakeTestImage(dir_->path() / "images" / "raw",
                              {.bytes = 3ull << 20, .seed = 43, .processes = 2})
                    .ok());
    auto contents = LoadCriuContents(dir_->path() / "images" / "raw");
    ASSERT_TRUE(contents.ok()) << contents.status().ToString();
    expected_ = std::move(*contents);
  }
  static void TearDownTestSuite() { dir_.reset(); }

  void SetUp() override {
    ::alarm(120);
    gate_ = std::make_shared<GatedPlacement::Gate>();
    ServerConfig config;
    config.image_roots = {dir_->path() / "images"};
    auto endpoint = net::Endpoint::Parse("unix:" + (dir_->path() / "s.sock").string());
    ASSERT_TRUE(endpoint.ok());
    config.listen = {*endpoint};
    config.io_threads = 2;
    config.disk_threads = 2;
    config.raw_chunk_size = 256 << 10;
    config.handle_signals = false;
    config.max_demand = max_demand_;  // a fixture may lower it
    server_ = std::make_unique<Server>(config, std::make_unique<GatedPlacement>(gate_));
    ASSERT_TRUE(server_->Listen().ok());
    runner_ = std::thread([this] { EXPECT_EQ(server_->Run(), 0); });
  }
  void TearDown() override {
    Release();  // a disk thread held at the gate would keep Stop waiting
    LetPlacementsGo();
    server_->Stop();
    runner_.join();
    server_.reset();
    ::alarm(0);
  }

  client::SessionOptions Options() const {
    client::SessionOptions options;
    options.endpoint = server_->bound().front().ToString();
    options.image = "raw";
    options.reconnect.max_attempts = 0;
    return options;
  }

  void Hold() {
    std::lock_guard lock(gate_->mu);
    gate_->held = true;
  }
  void Release() {
    std::lock_guard lock(gate_->mu);
    gate_->held = false;
    gate_->changed.notify_all();
  }
  void HoldPlacements() {
    std::lock_guard lock(gate_->mu);
    gate_->places_held = true;
  }
  void LetPlacementsGo() {
    std::lock_guard lock(gate_->mu);
    gate_->places_held = false;
    gate_->changed.notify_all();
  }
  // `session` failed (`why`) while one placement is held at the gate: destroying it must wait
  // until the server let go of its destinations, so not before that placement goes on.
  void ExpectDestructionWaitsForTheHeldPlacement(std::unique_ptr<client::RestoreSession>& session,
                                                 const Status& why) {
    {
      std::lock_guard lock(gate_->mu);
      ASSERT_EQ(gate_->places_waiting, 1u) << "the held placement must still be in flight";
    }
    std::atomic<bool> destroyed{false};
    std::thread ending([&] {
      session.reset();
      destroyed.store(true);
    });
    std::this_thread::sleep_for(300ms);
    const bool destroyed_early = destroyed.load();
    LetPlacementsGo();
    ending.join();
    EXPECT_FALSE(destroyed_early)
        << "the failed session was destroyed (so its engine's memory may be freed) while the "
           "server still had a placement into it in flight: "
        << why.ToString();
  }
  // Waits until a placement waits at the gate; false after 20 s.
  bool PlacementHeld() {
    std::unique_lock lock(gate_->mu);
    return gate_->changed.wait_for(lock, 20s, [&] { return gate_->places_waiting > 0; });
  }

  // Waits until `count` openings have begun; false after 20 s.
  bool OpensBegun(size_t count) {
    std::unique_lock lock(gate_->mu);
    return gate_->changed.wait_for(lock, 20s, [&] { return gate_->opens.size() >= count; });
  }
  std::vector<uint32_t> Opens() {
    std::lock_guard lock(gate_->mu);
    return gate_->opens;
  }

  // server.placement's and server's counter `name`, polled until `done` holds it (20 s).
  uint64_t ServerCounter(const char* section, const char* name,
                         const std::function<bool(uint64_t)>& done) {
    uint64_t value = 0;
    for (auto deadline = std::chrono::steady_clock::now() + 20s;
         std::chrono::steady_clock::now() < deadline;) {
      TestClient client(server_->bound().front());
      if (client.Hello().ok()) {
        Result<std::string> text = client.Stats();
        if (text.ok()) {
          const nlohmann::json doc = nlohmann::json::parse(*text);
          const nlohmann::json& counters =
              section[0] != '\0' ? doc["server"][section] : doc["server"];
          value = counters.value(name, uint64_t{0});
          if (done(value)) return value;
        }
      }
      std::this_thread::sleep_for(5ms);
    }
    return value;
  }

  // Streams the whole image into `engine` and checks it is the checkpoint's bytes.
  void RestoreWhole(client::RestoreSession& session, const client::HostCopyEngine& engine) {
    ASSERT_TRUE(session.Start().ok());
    Status complete = session.WaitComplete(60s);
    ASSERT_TRUE(complete.ok()) << complete.ToString();
    ExpectRestoredBytes(session, engine, expected_);
  }

  static std::unique_ptr<TempDir> dir_;
  static std::map<BoKey, std::vector<uint8_t>> expected_;
  std::shared_ptr<GatedPlacement::Gate> gate_;
  uint32_t max_demand_ = 256;
  std::unique_ptr<Server> server_;
  std::thread runner_;
};
std::unique_ptr<TempDir> PlacementOpenTest::dir_;
std::map<BoKey, std::vector<uint8_t>> PlacementOpenTest::expected_;

TEST_F(PlacementOpenTest, ChunksWaitForTheirBOAndTheFirstWaitedForOpensNext) {
  Hold();
  client::HostCopyEngine engine;
  client::SessionOptions options = Options();
  options.stream_all = false;  // only the faults below ask for chunks
  client::RestoreSession session(options, engine);
  // PlaceInto answered, though no destination is open: the first one's opening is held.
  ASSERT_TRUE(session.Start().ok());
  ASSERT_TRUE(OpensBegun(1));
  const uint32_t bos = static_cast<uint32_t>(session.bos().size());
  ASSERT_GE(bos, 4u);
  // A fault in the last BO waits for its destination, which then opens next; so does one in
  // BO 2, after it, and both before BO 1, which no chunk waits for.
  const uint32_t last = bos - 1;
  Status ensured_last, ensured_2;
  std::thread fault_last([&] { ensured_last = session.Ensure(last, 0, 4096, 20s); });
  EXPECT_EQ(ServerCounter("placement", "placements_deferred", [](uint64_t n) { return n >= 1; }),
            1u);
  std::thread fault_2([&] { ensured_2 = session.Ensure(2, 0, 4096, 20s); });
  EXPECT_EQ(ServerCounter("placement", "placements_deferred", [](uint64_t n) { return n >= 2; }),
            2u);
  EXPECT_EQ(session.progress().placed_chunks, 0u);
  Release();
  fault_last.join();
  fault_2.join();
  ASSERT_TRUE(ensured_last.ok()) << ensured_last.ToString();
  ASSERT_TRUE(ensured_2.ok()) << ensured_2.ToString();
  for (uint32_t bo : {last, 2u}) {
    SCOPED_TRACE(bo);
    auto want = expected_.find(BoKey{session.bos()[bo].process_id, session.bos()[bo].bo_index});
    ASSERT_NE(want, expected_.end());
    Result<std::span<uint8_t>> got = engine.Mapping(bo);
    ASSERT_TRUE(got.ok());
    const size_t length = std::min<size_t>(session.chunk_size(), want->second.size());
    EXPECT_TRUE(std::equal(got->begin(), got->begin() + static_cast<ptrdiff_t>(length),
                           want->second.begin()));
  }
  EXPECT_TRUE(session.progress().placing);
  EXPECT_EQ(session.progress().placed_chunks, 2u);
  EXPECT_EQ(engine.bytes_written(), 0u);
  // Every destination opens in the end, waited for or not.
  ASSERT_TRUE(OpensBegun(bos));
  std::vector<uint32_t> order{0, last, 2, 1};
  for (uint32_t bo = 3; bo < last; ++bo)
    order.push_back(bo);
  EXPECT_EQ(Opens(), order);
}

TEST_F(PlacementOpenTest, DestinationThatDoesNotOpenHasItsBOsChunksSentAsBytes) {
  {
    std::lock_guard lock(gate_->mu);
    gate_->failing = {1};
  }
  client::HostCopyEngine engine;
  client::RestoreSession session(Options(), engine);
  ASSERT_NO_FATAL_FAILURE(RestoreWhole(session, engine));
  const client::Progress progress = session.progress();
  const uint64_t bo1_chunks =
      (session.bos()[1].size + session.chunk_size() - 1) / session.chunk_size();
  EXPECT_EQ(progress.placed_chunks, progress.total_chunks - bo1_chunks);
  EXPECT_EQ(engine.bytes_written(), session.bos()[1].size);  // BO 1's bytes, through the client
  EXPECT_EQ(
      ServerCounter("placement", "destination_open_failures", [](uint64_t n) { return n >= 1; }),
      1u);
}

TEST_F(PlacementOpenTest, SessionClosedWhileItsDestinationsOpenOpensNoMore) {
  Hold();
  {
    client::HostCopyEngine engine;
    client::RestoreSession session(Options(), engine);
    ASSERT_TRUE(session.Start().ok());
    ASSERT_TRUE(OpensBegun(1));
  }  // the client leaves with BO 0's opening held (and waits its grace for the server's close)
  EXPECT_EQ(ServerCounter("", "sessions_open", [](uint64_t n) { return n == 0; }), 0u);
  Release();
  // The server goes on serving: a restore after it is byte-exact, all placed.
  client::HostCopyEngine engine;
  client::RestoreSession session(Options(), engine);
  ASSERT_NO_FATAL_FAILURE(RestoreWhole(session, engine));
  EXPECT_EQ(session.progress().placed_chunks, session.progress().total_chunks);
  // The first session's opener stopped after the opening it was in: of its BOs only BO 0 was
  // opened; the second session opened all of its own.
  const std::vector<uint32_t> opens = Opens();
  ASSERT_EQ(opens.size(), 1 + session.bos().size());
  EXPECT_EQ(opens.front(), 0u);
}

// A client that ends its restore while the server is still writing into its memory (a Cancel,
// a failure, the session destroyed) may free that memory once the session is gone: the server
// ends the session's placements and lets go of its destinations before it closes the stream
// connection, and the client waits for that close (docs/protocol.md, "Placement", 5).
TEST_F(PlacementOpenTest, DestroyingASessionWaitsUntilTheServerLetsGoOfItsDestinations) {
  HoldPlacements();
  auto engine = std::make_unique<client::HostCopyEngine>();
  auto session = std::make_unique<client::RestoreSession>(Options(), *engine);
  ASSERT_TRUE(session->Start().ok());
  ASSERT_TRUE(PlacementHeld());
  std::atomic<bool> destroyed{false};
  uint32_t finished_when_destroyed = 0;
  size_t live_destinations_when_destroyed = 0;
  std::thread ending([&] {
    session.reset();
    std::lock_guard lock(gate_->mu);
    finished_when_destroyed = gate_->places_finished;
    live_destinations_when_destroyed =
        static_cast<size_t>(std::count_if(gate_->opened.begin(), gate_->opened.end(),
                                          [](const auto& weak) { return !weak.expired(); }));
    destroyed.store(true);
  });
  // The placements on their disk threads hold the session's end.
  std::this_thread::sleep_for(300ms);
  EXPECT_FALSE(destroyed.load()) << "the session ended with placements in flight";
  uint32_t held = 0;
  {
    std::lock_guard lock(gate_->mu);
    held = gate_->places_waiting;
    EXPECT_FALSE(gate_->opened.empty());
  }
  EXPECT_GT(held, 0u);
  LetPlacementsGo();
  ending.join();
  EXPECT_GE(finished_when_destroyed, held);  // each one held had finished
  EXPECT_EQ(live_destinations_when_destroyed, 0u);
  engine.reset();  // now the memory may go
  // The server goes on serving: another restore is byte-exact.
  client::HostCopyEngine next_engine;
  client::RestoreSession next(Options(), next_engine);
  ASSERT_NO_FATAL_FAILURE(RestoreWhole(next, next_engine));
}

// A connection that breaks at once (no half-close, no drain to the server's close) gives the
// client no word that the server's copies into its memory have ended. The session it opens when
// it reconnects names the one before (OpenImage.supersedes_session), and the server opens it only
// once that one has let go of its destinations: no copy of the broken session lands on a chunk
// the new one has handed to the program (docs/protocol.md, "Placement", 6). Both when the server
// saw the break and when it has not yet.
class SupersedeTest : public PlacementOpenTest, public ::testing::WithParamInterface<bool> {};

TEST_P(SupersedeTest, AReconnectedSessionBeginsOnlyOnceTheBrokenOnesCopiesEnded) {
  const bool server_notices = GetParam();
  UnixRelay relay(dir_->path() / "relay.sock", dir_->path() / "s.sock");
  {
    std::lock_guard lock(gate_->mu);
    gate_->places_held = true;
    gate_->places_to_hold = 1;  // one copy in flight; the other disk thread stays free
  }
  client::HostCopyEngine engine;
  client::SessionOptions options = Options();
  options.endpoint = "unix:" + (dir_->path() / "relay.sock").string();
  options.reconnect.max_attempts = 20;
  options.reconnect.initial_backoff = 10ms;
  options.reconnect.max_backoff = 50ms;
  client::RestoreSession session(options, engine);
  ASSERT_TRUE(session.Start().ok());
  ASSERT_TRUE(PlacementHeld());
  const size_t connections_before = relay.connections();
  relay.Cut(server_notices);
  // The client reconnects through the relay; its new session waits for the held copy.
  for (auto deadline = std::chrono::steady_clock::now() + 20s;
       relay.connections() == connections_before && std::chrono::steady_clock::now() < deadline;)
    std::this_thread::sleep_for(5ms);
  ASSERT_GT(relay.connections(), connections_before) << "the client did not reconnect";
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(ServerCounter("", "sessions_opened", [](uint64_t) { return true; }), 1u)
      << "a new session opened while the broken one's copy was in flight";
  LetPlacementsGo();
  Status complete = session.WaitComplete(60s);
  ASSERT_TRUE(complete.ok()) << complete.ToString();
  ExpectRestoredBytes(session, engine, expected_);
  EXPECT_GE(session.progress().reconnects, 1u);
  EXPECT_EQ(ServerCounter("", "sessions_opened", [](uint64_t n) { return n >= 2; }), 2u);
  // The broken session still held a copy in flight, so the new one ended it, seen or not.
  EXPECT_EQ(ServerCounter("placement", "sessions_superseded", [](uint64_t n) { return n >= 1; }),
            1u);
  EXPECT_EQ(ServerCounter("placement", "supersede_refusals", [](uint64_t) { return true; }), 0u);
}

INSTANTIATE_TEST_SUITE_P(ServerSawTheBreak, SupersedeTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "ServerSawIt" : "ServerDidNot";
                         });

// Only the client that had a session may end it: a wrong secret is refused and the session goes
// on.
TEST_F(PlacementOpenTest, SupersedingASessionNeedsItsSecret) {
  TestClient owner(server_->bound().front());
  ASSERT_TRUE(owner.Hello().ok());
  Result<wire::OpenImageReply> opened = owner.Open("raw");
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();

  TestClient intruder(server_->bound().front());
  ASSERT_TRUE(intruder.Hello().ok());
  wire::Header header;
  header.set_request_id(1);
  header.mutable_open_image()->set_image("raw");
  header.mutable_open_image()->set_supersedes_session(opened->session());
  header.mutable_open_image()->set_supersedes_secret("not the secret");
  ASSERT_TRUE(intruder.Send(header).ok());
  Result<wire::Error> refused = intruder.ReadError();
  ASSERT_TRUE(refused.ok()) << refused.status().ToString();
  EXPECT_EQ(refused->code(), wire::ERROR_UNAUTHENTICATED);
  EXPECT_NE(refused->message().find("wrong secret"), std::string::npos) << refused->message();
  EXPECT_EQ(ServerCounter("placement", "supersede_refusals", [](uint64_t n) { return n >= 1; }),
            1u);
  EXPECT_EQ(ServerCounter("placement", "sessions_superseded", [](uint64_t) { return true; }), 0u);

  // The owner's session still serves: its stream arrives whole.
  Result<Received> received = ReceiveStream(owner, 64u << 20);
  ASSERT_TRUE(received.ok()) << received.status().ToString();
  EXPECT_TRUE(VerifyStream(*opened, received->chunks, expected_).ok());
}

// A host engine whose writes into the BOs `failing` fail (a device error), taking every chunk
// through Write (no receive in place), so the failure is met by the stream reader itself. A
// failing write first waits for `before_failing` (the test: until a placement is in flight).
class FailingWriteEngine final : public client::HostCopyEngine {
 public:
  FailingWriteEngine(std::set<uint32_t> failing, std::function<void()> before_failing)
      : failing_(std::move(failing)), before_failing_(std::move(before_failing)) {}
  std::optional<std::span<uint8_t>> ReceiveTarget(uint32_t, uint64_t, uint64_t) override {
    return std::nullopt;
  }
  Status Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw,
               client::CopyDone done) override {
    if (failing_.contains(bo)) {
      before_failing_();
      return Internal("test: the device refuses writes into BO {}", bo);
    }
    return HostCopyEngine::Write(bo, offset, raw, std::move(done));
  }

 private:
  const std::set<uint32_t> failing_;
  std::function<void()> before_failing_;
};

// The same guarantee as DestroyingASessionWaitsUntilTheServerLetsGoOfItsDestinations, for a
// restore that failed (docs/client.md, "Reconnect semantics": "the end of a restore
// (complete, cancelled, failed, or the session destroyed) ... reads on to the server's close").
// The failure here is found by the stream reader (an engine write of a chunk that came as bytes:
// the destinations of BOs 0 and 1 do not open). Until session 61 the reader returned it and the
// attempt closed the connection at once, so the drain that Fail asked for never happened; and a
// drain that installed what it read would end at BO 1's write, which fails too.
TEST_F(PlacementOpenTest, AFailedRestoreAlsoWaitsUntilTheServerLetsGoOfItsDestinations) {
  {
    std::lock_guard lock(gate_->mu);
    gate_->failing = {0, 1};    // their chunks come as bytes, through the client's engine
    gate_->places_held = true;  // and one placement (of a later BO) waits at the gate
    gate_->places_to_hold = 1;
  }
  // Their writes fail once a placement is in flight (held at the gate).
  auto engine = std::make_unique<FailingWriteEngine>(std::set<uint32_t>{0, 1},
                                                     [this] { (void)PlacementHeld(); });
  auto session = std::make_unique<client::RestoreSession>(Options(), *engine);
  ASSERT_TRUE(session->Start().ok());
  ASSERT_TRUE(PlacementHeld());
  // The restore fails on BO 0's first chunk while the held placement is still in flight.
  Status failed = session->WaitComplete(20s);
  ASSERT_FALSE(failed.ok());
  ASSERT_NE(failed.code(), Code::kTimeout) << failed.ToString();
  ExpectDestructionWaitsForTheHeldPlacement(session, failed);
  engine.reset();
}

// The same, for a failure the server reports on the demand connection (an Error frame
// that retrying cannot cure: here ERROR_LIMIT, a demand of more chunks than the server takes;
// ERROR_IO for a chunk it cannot read goes the same way). Until session 61 the demand reader's
// failure (a drain) was followed by closing the stream connection at once, cutting it short.
class PlacementWithASmallDemandLimit : public PlacementOpenTest {
 protected:
  PlacementWithASmallDemandLimit() { max_demand_ = 1; }
};

TEST_F(PlacementWithASmallDemandLimit, AFailureOnTheDemandConnectionAlsoWaitsForTheServersClose) {
  {
    std::lock_guard lock(gate_->mu);
    gate_->places_held = true;  // the stream's first placement waits at the gate
    gate_->places_to_hold = 1;
  }
  auto engine = std::make_unique<client::HostCopyEngine>();
  auto session = std::make_unique<client::RestoreSession>(Options(), *engine);
  ASSERT_TRUE(session->Start().ok());
  ASSERT_TRUE(PlacementHeld());
  const uint32_t last = static_cast<uint32_t>(session->bos().size()) - 1;
  ASSERT_GE(session->bos()[last].size, 2ull * session->chunk_size());
  // Two chunks in one demand request: the server (max_demand 1) refuses it with ERROR_LIMIT.
  Status ensured = session->Ensure(last, 0, 2ull * session->chunk_size(), 20s);
  ASSERT_FALSE(ensured.ok());
  ASSERT_EQ(ensured.code(), Code::kResourceExhausted) << ensured.ToString();
  ExpectDestructionWaitsForTheHeldPlacement(session, ensured);
  engine.reset();
}

}  // namespace
}  // namespace gpulazy::server::testing
