// The server embedded in another program's process (the CRIU plugin serves images inside
// CRIU): with handle_signals off it must leave the host's SIGTERM/SIGINT handlers alone while
// it listens, serves and stops. The control case shows the check can fail: with signals on,
// the handlers are replaced.
#include <gtest/gtest.h>
#include <signal.h>

#include <thread>

#include "lazy-server/server/server.h"
#include "tests/server/test_support.h"

namespace gpulazy::server {
namespace {
namespace fs = std::filesystem;
using testing::TempDir;
using testing::TestClient;

void HostHandler(int) {}

void InstallHostHandlers() {
  for (int sig : {SIGTERM, SIGINT}) {
    struct sigaction sa {};
    sa.sa_handler = HostHandler;
    sigemptyset(&sa.sa_mask);
    ASSERT_EQ(::sigaction(sig, &sa, nullptr), 0);
  }
}

bool HostHandlersInPlace() {
  for (int sig : {SIGTERM, SIGINT}) {
    struct sigaction now {};
    if (::sigaction(sig, nullptr, &now) != 0 || now.sa_handler != HostHandler) return false;
  }
  return true;
}

ServerConfig EmbeddedConfig(const fs::path& dir, bool handle_signals) {
  ServerConfig config;
  config.image_roots = {dir};
  auto endpoint = net::Endpoint::Parse("unix:" + (dir / "s.sock").string());
  EXPECT_TRUE(endpoint.ok());
  config.listen = {*endpoint};
  config.io_threads = 1;
  config.disk_threads = 1;
  config.handle_signals = handle_signals;
  return config;
}

TEST(ServerEmbeddingTest, WithoutSignalHandlingTheHostsHandlersStay) {
  ASSERT_NO_FATAL_FAILURE(InstallHostHandlers());
  TempDir dir;
  {
    Server server(EmbeddedConfig(dir.path(), /*handle_signals=*/false));
    EXPECT_TRUE(HostHandlersInPlace());
    ASSERT_TRUE(server.Listen().ok());
    std::thread runner([&] { EXPECT_EQ(server.Run(), 0); });
    // A served Hello proves Run has set everything up.
    TestClient client(server.bound().front());
    EXPECT_TRUE(client.Hello().ok());
    EXPECT_TRUE(HostHandlersInPlace());
    server.Stop();
    runner.join();
    EXPECT_TRUE(HostHandlersInPlace());
  }
  EXPECT_TRUE(HostHandlersInPlace());
}

TEST(ServerEmbeddingTest, ControlWithSignalHandlingTheHandlersAreReplaced) {
  ASSERT_NO_FATAL_FAILURE(InstallHostHandlers());
  TempDir dir;
  {
    Server server(EmbeddedConfig(dir.path(), /*handle_signals=*/true));
    EXPECT_FALSE(HostHandlersInPlace());
  }
  // Asio does not put the previous handlers back: what the option exists to avoid.
  EXPECT_FALSE(HostHandlersInPlace());
  ASSERT_NO_FATAL_FAILURE(InstallHostHandlers());
}

}  // namespace
}  // namespace gpulazy::server
