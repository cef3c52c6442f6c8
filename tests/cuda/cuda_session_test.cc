// RestoreSession over a socket (the in-process fake server, no image files) into the CUDA engine
// on a real GPU: chunks received into the engine's pinned slots unhashed and checked on the GPU
// (CudaEngineOptions::verify_on_device), a bad copy found there fetched again, a persistent one
// failing loudly. Skipped where no CUDA device exists (CI compiles it only).
#include <gtest/gtest.h>

#include <chrono>
#include <map>
#include <memory>
#include <vector>

#include "page-client/cuda/cuda_engine.h"
#include "page-client/restore_session.h"
#include "tests/client/fake_server.h"

namespace gpulazy::client {
namespace {

using gpulazy::testing::ChunkKey;
using gpulazy::testing::FakeImage;
using gpulazy::testing::FakeServer;
using gpulazy::testing::FakeServerOptions;
using namespace std::chrono_literals;

class CudaSessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device here";
  }
};

// Two BOs of 64 KiB chunks (the GPU check takes chunks over 240 bytes), every chunk RAW so each is
// received into a lent slot, behind a server corrupting the copies `corrupt` names.
struct CudaRestore {
  explicit CudaRestore(std::map<ChunkKey, int> corrupt)
      : server(image, FakeServerOptions::RawChunks(std::move(corrupt))), engine([] {
          Result<std::unique_ptr<CudaCopyEngine>> made = CudaCopyEngine::Create({});
          EXPECT_TRUE(made.ok()) << made.status().ToString();
          return made.ok() ? std::move(*made) : nullptr;
        }()) {}
  RestoreSession& Session() {
    SessionOptions options;
    options.endpoint = server.endpoint();
    options.image = "test-image";
    options.handshake_timeout = 5s;
    session = std::make_unique<RestoreSession>(options, *engine);
    return *session;
  }
  FakeImage image = FakeImage::Make({24 * 65536, 10 * 65536 + 1000}, 65536, 29);
  FakeServer server;
  std::unique_ptr<CudaCopyEngine> engine;
  std::unique_ptr<RestoreSession> session;  // destroyed first: it holds writes in the engine
};

TEST_F(CudaSessionTest, SocketChunksAreCheckedOnTheGpuAndABadCopyIsFetchedAgain) {
  CudaRestore r({{{1, 2}, 1}});
  ASSERT_NE(r.engine, nullptr);
  RestoreSession& session = r.Session();
  ASSERT_TRUE(session.Start().ok());
  ASSERT_TRUE(session.WaitComplete(30s).ok()) << session.status().ToString();
  for (uint32_t bo = 0; bo < r.image.bos.size(); ++bo) {
    std::vector<uint8_t> back(r.image.bos[bo].size());
    ASSERT_TRUE(r.engine->CopyToHost(bo, 0, back).ok());
    EXPECT_EQ(back, r.image.bos[bo]) << "BO " << bo;
  }
  EXPECT_GT(r.engine->chunks_verified_on_device(), 0u);
  EXPECT_EQ(session.progress().refetches, 1u);
}

TEST_F(CudaSessionTest, PersistentCorruptionFailsLoudlyAndNeverReachesTheBo) {
  CudaRestore r({{{0, 3}, 100}});
  ASSERT_NE(r.engine, nullptr);
  RestoreSession& session = r.Session();
  ASSERT_TRUE(session.Start().ok());
  Status status = session.WaitComplete(30s);
  EXPECT_EQ(status.code(), Code::kCorrupt) << status.ToString();
  EXPECT_NE(status.message().find("chunk 3"), std::string::npos) << status.message();
  EXPECT_FALSE(session.IsResident(0, 3 * 65536, 65536));
  // Every copy the server sent was the good bytes with one byte flipped (fake_server.cc): the BO
  // holds neither that nor the good bytes, which never came.
  const std::vector<uint8_t> good(r.image.bos[0].begin() + 3 * 65536,
                                  r.image.bos[0].begin() + 4 * 65536);
  std::vector<uint8_t> bad_copy = good;
  bad_copy[good.size() / 2] ^= 0x5a;
  std::vector<uint8_t> back(good.size());
  ASSERT_TRUE(r.engine->CopyToHost(0, 3 * 65536, back).ok());
  EXPECT_NE(back, bad_copy) << "a bad copy reached the BO";
  EXPECT_NE(back, good);
}

}  // namespace
}  // namespace gpulazy::client
