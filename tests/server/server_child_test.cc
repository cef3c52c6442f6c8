// ServerChild (lazy-server/child/): gpulazy-server as a child process, on the endpoints it is
// given, through a launcher, and failing with the server's own reason when it cannot start.
#include "lazy-server/child/server_child.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <vector>

#include "tests/server/test_support.h"
#include "tests/support/files.h"

namespace gpulazy::server::testing {
namespace {
namespace fs = std::filesystem;
using namespace std::chrono_literals;

ServerChildOptions Options(const TempDir& dir) {
  ServerChildOptions options;
  options.binary = fs::path(GPULAZY_BIN_DIR) / "gpulazy-server";
  options.root = dir.path();
  options.run_dir = dir.path();
  options.ready_timeout = 30s;
  return options;
}

TEST(ServerChildTest, ListensWhereToldThroughALauncherThatExecsInPlace) {
  TempDir dir;
  ServerChildOptions options = Options(dir);
  const std::string socket = "unix:" + (dir.path() / "only.sock").string();
  options.listen = {socket};
  // env (found on PATH) sets a variable and execs the server in place.
  options.launcher = {"env", "GPULAZY_LAUNCHED_BY=env"};
  Result<ServerChild> child = ServerChild::Start(options);
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  EXPECT_EQ(child->endpoints(), std::vector<std::string>{socket});
  EXPECT_EQ(child->unix_endpoint(), socket);
  EXPECT_TRUE(child->tcp_endpoint().empty());  // no default TCP listener beside it
  // pid() is the server itself, not the launcher.
  const fs::path proc = "/proc/" + std::to_string(child->pid());
  EXPECT_EQ(fs::read_symlink(proc / "exe"), fs::canonical(options.binary));
  // ...and it came through the launcher: its environment has what env set.
  const std::string environ = gpulazy::testing::ReadWholeFile(proc / "environ");
  EXPECT_NE(environ.find(std::string("GPULAZY_LAUNCHED_BY=env\0", 24)), std::string::npos);
  EXPECT_EQ(child->Terminate(20s), 0);
  EXPECT_EQ(child->pid(), -1);
}

TEST(ServerChildTest, TheDefaultsAreAUnixSocketAndLoopbackTcp) {
  TempDir dir;
  Result<ServerChild> child = ServerChild::Start(Options(dir));
  ASSERT_TRUE(child.ok()) << child.status().ToString();
  EXPECT_EQ(child->unix_endpoint(), "unix:" + (dir.path() / "server.sock").string());
  EXPECT_TRUE(child->tcp_endpoint().starts_with("tcp:127.0.0.1:")) << child->tcp_endpoint();
  EXPECT_EQ(child->endpoints().size(), 2u);
}

TEST(ServerChildTest, AServerThatCannotStartFailsAtOnceWithItsReasonInTheLog) {
  TempDir dir;
  ServerChildOptions options = Options(dir);
  options.extra_args = {"--log-level", "debug"};  // a second --log-level: refused by the server
  Result<ServerChild> child = ServerChild::Start(options);
  ASSERT_FALSE(child.ok());
  EXPECT_EQ(child.status().code(), Code::kUnavailable) << child.status().ToString();
  EXPECT_NE(gpulazy::testing::ReadWholeFile(ServerChild::LogPath(options)).find("--log-level"),
            std::string::npos);

  options.extra_args.clear();
  options.binary = dir.path() / "no-such-server";
  EXPECT_EQ(ServerChild::Start(options).status().code(), Code::kNotFound);
}

}  // namespace
}  // namespace gpulazy::server::testing
