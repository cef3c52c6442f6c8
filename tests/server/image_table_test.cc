// Images with more BOs than a 64 KiB frame header can list, against a real gpulazy-server
// (protocol version 2's image table, docs/protocol.md "OpenImage"). The server runs with
// 64 KiB frames, so a table of a few hundred KiB takes several frames. A version-2 client gets
// every BO and every byte, raw and converted, through the socket and by reference; a version-1
// client is refused with a reason that names the way out.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "lazy-server/image/io.h"
#include "page-client/host_engine.h"
#include "page-client/restore_session.h"
#include "tests/server/test_support.h"
#include "tests/support/sanitizers.h"

namespace gpulazy::server::testing {
namespace {
namespace fs = std::filesystem;

constexpr uint32_t kBosPerProcess = 6000;
// Under a sanitizer, the least the synthesizer accepts for that many BOs (a page for each of the
// 4800 with contents): the test is about the table, not the bytes.
constexpr uint64_t kImageBytes = gpulazy::testing::SanitizerScaled(48ull << 20, 20ull << 20);

class ImageTableTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // The host engine keeps a memfd per BO: more than a default soft limit of 1024.
    Result<uint64_t> fds = RaiseOpenFileLimit();
    ASSERT_TRUE(fds.ok()) << fds.status().ToString();
    ASSERT_GT(*fds, 2u * kBosPerProcess) << "RLIMIT_NOFILE's hard limit is too low for this test";
    dir_ = std::make_unique<TempDir>();
    const fs::path root = dir_->path() / "images";
    fs::create_directories(root);
    ASSERT_TRUE(
        MakeTestImage(root / "many",
                      {.bytes = kImageBytes, .seed = 31, .bos = kBosPerProcess, .processes = 1})
            .ok());
    ASSERT_TRUE(MakeTestImage(root / "many-lazy", {.bytes = kImageBytes,
                                                   .seed = 32,
                                                   .lazy = true,
                                                   .bos = kBosPerProcess,
                                                   .processes = 1,
                                                   .lazy_chunk = 64 * 1024})
                    .ok());
    for (const char* name : {"many", "many-lazy"}) {
      auto contents = LoadCriuContents(root / name);
      ASSERT_TRUE(contents.ok()) << contents.status().ToString();
      expected_[name] = std::move(*contents);
    }
    server_ = std::make_unique<ServerProcess>(
        dir_->path(), root,
        std::vector<std::string>{"--raw-chunk-size", "64K", "--max-frame", "64K", "--threads", "2",
                                 "--disk-threads", "2"});
    ASSERT_TRUE(server_->ready()) << server_->Log();
  }
  static void TearDownTestSuite() {
    if (server_ != nullptr && server_->ready()) {
      EXPECT_EQ(server_->Terminate(15s), 0) << server_->Log().substr(0, 20000);
    }
    server_.reset();
    dir_.reset();
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    ASSERT_TRUE(server_->ready());
  }
  void TearDown() override {
    if (HasFailure()) std::cerr << server_->Log().substr(0, 20000);
  }

  static std::map<std::string, std::map<BoKey, std::vector<uint8_t>>> expected_;
  static std::unique_ptr<TempDir> dir_;
  static std::unique_ptr<ServerProcess> server_;
};
std::map<std::string, std::map<BoKey, std::vector<uint8_t>>> ImageTableTest::expected_;
std::unique_ptr<TempDir> ImageTableTest::dir_;
std::unique_ptr<ServerProcess> ImageTableTest::server_;

TEST_F(ImageTableTest, VersionTwoListsEveryBoAndStreamsEveryByte) {
  for (const std::string name : {"many", "many-lazy"}) {
    SCOPED_TRACE(name);
    TestClient client(server_->unix_endpoint());
    Result<wire::HelloReply> hello = client.Hello(0, {}, {}, /*max_version=*/2);
    ASSERT_TRUE(hello.ok()) << hello.status().ToString();
    EXPECT_EQ(hello->version(), 2u);
    Result<wire::OpenImageReply> reply = client.Open(name);
    ASSERT_TRUE(reply.ok()) << reply.status().ToString();
    EXPECT_GT(client.table_frames(), 2) << "a table of this size takes several 64 KiB frames";
    ASSERT_EQ(static_cast<size_t>(reply->bos_size()), expected_[name].size());
    for (const wire::BoInfo& bo : reply->bos()) {
      auto it = expected_[name].find(BoKey{bo.process_id(), bo.bo_index()});
      ASSERT_NE(it, expected_[name].end()) << "BO " << bo.bo_index();
      EXPECT_EQ(bo.size(), it->second.size());
    }
    Result<Received> received = ReceiveStream(client, 16ull << 20, 60s);
    ASSERT_TRUE(received.ok()) << received.status().ToString();
    Status verified = VerifyStream(*reply, received->chunks, expected_[name]);
    EXPECT_TRUE(verified.ok()) << verified.ToString();
  }
}

// Also the premise of this suite: listed in one header, the image's BOs do not fit.
TEST_F(ImageTableTest, VersionOneIsRefusedWithTheWayOut) {
  TestClient client(server_->unix_endpoint());
  Result<wire::HelloReply> hello = client.Hello();  // offers version 1 only
  ASSERT_TRUE(hello.ok()) << hello.status().ToString();
  EXPECT_EQ(hello->version(), 1u);
  wire::Header open;
  open.set_request_id(5);
  open.mutable_open_image()->set_image("many");
  ASSERT_TRUE(client.Send(open).ok());
  Result<wire::Error> error = client.ReadError(10s);
  ASSERT_TRUE(error.ok()) << error.status().ToString();
  EXPECT_EQ(error->code(), wire::ERROR_LIMIT);
  EXPECT_EQ(error->in_reply_to(), 5u);
  EXPECT_NE(error->message().find("version 2"), std::string::npos) << error->message();
  // A request-level error: the connection stays and the server keeps serving.
  Result<std::string> stats = client.Stats();
  EXPECT_TRUE(stats.ok()) << stats.status().ToString();
}

// The client library restores every byte of every BO, through the socket (Unix and TCP) and by
// reference (image files passed over Unix).
TEST_F(ImageTableTest, RestoreSessionRestoresEveryBo) {
  struct Case {
    const char* image;
    bool tcp;
    bool read_files;
  };
  for (const Case& c : {Case{"many", false, true}, Case{"many", true, false},
                        Case{"many-lazy", false, false}, Case{"many-lazy", false, true}}) {
    SCOPED_TRACE(std::string(c.image) + (c.tcp ? " tcp" : " unix") +
                 (c.read_files ? " by reference" : ""));
    client::HostCopyEngine engine;
    client::SessionOptions options;
    options.endpoint = (c.tcp ? server_->tcp_endpoint() : server_->unix_endpoint()).ToString();
    options.insecure_tcp = true;
    options.image = c.image;
    options.read_files = c.read_files;
    client::RestoreSession session(options, engine);
    Status started = session.Start();
    ASSERT_TRUE(started.ok()) << started.ToString();
    ASSERT_EQ(session.bos().size(), expected_[c.image].size());
    Status done = session.WaitComplete(60s);
    ASSERT_TRUE(done.ok()) << done.ToString();
    EXPECT_EQ(session.progress().reading_files, c.read_files);
    for (uint32_t i = 0; i < session.bos().size(); ++i) {
      const client::BoEntry& bo = session.bos()[i];
      auto want = expected_[c.image].find(BoKey{bo.process_id, bo.bo_index});
      ASSERT_NE(want, expected_[c.image].end());
      Result<std::span<uint8_t>> got = engine.Mapping(i);
      ASSERT_TRUE(got.ok()) << got.status().ToString();
      ASSERT_TRUE(std::ranges::equal(*got, want->second)) << "BO " << i;
    }
  }
}

}  // namespace
}  // namespace gpulazy::server::testing
