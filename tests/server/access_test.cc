// Unit tests of the security helpers: image grants (access.h), --image-access parsing, token
// files (net/stream.h) and keeping the roots' paths out of error messages (image_store.h).
#include "lazy-server/server/access.h"

#include <gtest/gtest.h>
#include <sys/utsname.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "lazy-server/server/config.h"
#include "lazy-server/server/image_store.h"
#include "page-client/net/stream.h"
#include "tests/support/temp_dir.h"

namespace gpulazy::server {
namespace {

namespace fs = std::filesystem;

TEST(NameInsteadOfDirTest, ErrorsNameTheImageAsTheClientDidNeverTheRoot) {
  EXPECT_EQ(NameInsteadOfDir("read /srv/img/ckpt/amdgpu-pages-1-c0de.img: EIO; "
                             "/srv/img/ckpt/amdgpu-kfd-1.img is fine",
                             "/srv/img/ckpt", "ckpt"),
            "read ckpt/amdgpu-pages-1-c0de.img: EIO; ckpt/amdgpu-kfd-1.img is fine");
  EXPECT_EQ(NameInsteadOfDir("no directory here", "/srv/img/ckpt", "ckpt"), "no directory here");
  EXPECT_EQ(NameInsteadOfDir("empty dir: /x", "", "ckpt"), "empty dir: /x");
}

// A name that contains its own resolved directory (root `/srv/img` holding symlinks `srv -> .`
// and `img -> .`: `./srv/img/x` resolves to /srv/img/x) is put in once per occurrence; searching
// again from the start looped forever on a disk thread, the message growing each round.
TEST(NameInsteadOfDirTest, ANameContainingTheDirectoryIsPutInOnce) {
  EXPECT_EQ(NameInsteadOfDir("open /srv/img/x/f and /srv/img/x/g", "/srv/img/x", "./srv/img/x"),
            "open ./srv/img/x/f and ./srv/img/x/g");
  EXPECT_EQ(NameInsteadOfDir("/a/a", "/a", "/a/a"), "/a/a/a/a");
}

TEST(ImageGrantTest, PrefixesMatchWholeComponents) {
  const ImageGrant grant = std::vector<std::string>{"teamA", "shared/models"};
  EXPECT_TRUE(MayOpen(grant, "teamA"));
  EXPECT_TRUE(MayOpen(grant, "teamA/job/ckpt"));
  EXPECT_TRUE(MayOpen(grant, "shared/models/x"));
  EXPECT_FALSE(MayOpen(grant, "teamA-old/ckpt"));
  EXPECT_FALSE(MayOpen(grant, "shared"));
  EXPECT_FALSE(MayOpen(grant, "teamB/ckpt"));
  EXPECT_TRUE(MayOpen(std::nullopt, "anything"));
  EXPECT_FALSE(MayOpen(std::vector<std::string>{}, "teamA"));
  EXPECT_TRUE(MayOpen(std::vector<std::string>{"*"}, "any/thing"));
}

TEST(ImageGrantTest, GrantIsTheUnionOfTheRulesNamingThePeer) {
  std::vector<ImageAccessRule> rules;
  for (const char* text : {"uid:1000=teamA", "gid:50=teamB,teamC", "cn:node7=shared", "*=public"}) {
    Result<ImageAccessRule> rule = ImageAccessRule::Parse(text);
    ASSERT_TRUE(rule.ok()) << rule.status().ToString();
    rules.push_back(*rule);
  }
  const ImageAccessPolicy policy{.rules = rules, .restricted = true};
  PeerIdentity unix_peer;
  unix_peer.uid = 1000;
  unix_peer.gid = 50;
  EXPECT_EQ(*GrantFor(policy, unix_peer),
            (std::vector<std::string>{"teamA", "teamB", "teamC", "public"}));
  PeerIdentity tls_peer;
  tls_peer.common_name = "node7";
  EXPECT_EQ(*GrantFor(policy, tls_peer), (std::vector<std::string>{"shared", "public"}));
  EXPECT_EQ(*GrantFor(policy, PeerIdentity{}), (std::vector<std::string>{"public"}));
  EXPECT_FALSE(GrantFor(ImageAccessPolicy{}, unix_peer).has_value());
}

// No rule anywhere: everything is visible. A rules file, even an empty one, restricts: emptying
// it takes every grant away instead of opening every image.
TEST(ImageGrantTest, AnImageAccessFileRestrictsEvenWhenItHoldsNoRule) {
  ServerConfig config;
  PeerIdentity peer;
  peer.uid = 1000;
  EXPECT_FALSE(GrantFor(ImageAccessPolicy::For(config, {}), peer).has_value());
  config.image_access_file = "/etc/gpulazy/image-access";
  const ImageGrant emptied = GrantFor(ImageAccessPolicy::For(config, {}), peer);
  ASSERT_TRUE(emptied.has_value());
  EXPECT_TRUE(emptied->empty());
  Result<ImageAccessRule> from_file = ImageAccessRule::Parse("uid:1000=teamA");
  Result<ImageAccessRule> from_flag = ImageAccessRule::Parse("*=shared");
  ASSERT_TRUE(from_file.ok() && from_flag.ok());
  config.image_access = {*from_flag};
  EXPECT_EQ(*GrantFor(ImageAccessPolicy::For(config, {*from_file}), peer),
            (std::vector<std::string>{"shared", "teamA"}));
}

TEST(ImageGrantTest, RulesAreParsedStrictly) {
  Result<ImageAccessRule> rule = ImageAccessRule::Parse("uid:7=a/b/,c");
  ASSERT_TRUE(rule.ok());
  EXPECT_EQ(rule->prefixes, (std::vector<std::string>{"a/b", "c"}));  // trailing '/' dropped
  for (const char* bad : {"uid:7", "user:7=a", "uid:x=a", "cn:=a", "uid:7=", "uid:7=../a",
                          "uid:7=/abs", "uid:7=a/../b"})
    EXPECT_FALSE(ImageAccessRule::Parse(bad).ok()) << bad;
}

// Token files written with the given mode in a directory of their own.
class TokenFileTest : public ::testing::Test {
 protected:
  std::string write(const std::string& name, const std::string& text, fs::perms perms) {
    const fs::path path = dir.path() / name;
    std::ofstream(path) << text;
    fs::permissions(path, perms);
    return path.string();
  }
  gpulazy::testing::TempDir dir;
  const fs::perms owner = fs::perms::owner_read | fs::perms::owner_write;
};

TEST_F(TokenFileTest, ReadOnceStrippedAndPrivate) {
  Result<std::string> crlf = net::ReadTokenFile(write("crlf", "abc def\r\n", owner));
  ASSERT_TRUE(crlf.ok()) << crlf.status().ToString();
  EXPECT_EQ(*crlf, "abc def");
  EXPECT_TRUE(net::ReadTokenFile(write("group", "t\n", owner | fs::perms::group_read)).ok());
  Result<std::string> world =
      net::ReadTokenFile(write("world", "t\n", owner | fs::perms::others_read));
  EXPECT_EQ(world.status().code(), Code::kPermissionDenied);
  EXPECT_NE(world.status().message().find("chmod o-rwx"), std::string::npos);
  EXPECT_FALSE(net::ReadTokenFile(write("empty", "\n\n", owner)).ok());
  EXPECT_FALSE(net::ReadTokenFile(write("huge", std::string(5000, 'x'), owner)).ok());
  EXPECT_FALSE(net::ReadTokenFile(dir.path().string()).ok());  // not a regular file
  EXPECT_EQ(net::ReadTokenFile((dir.path() / "missing").string()).status().code(), Code::kNotFound);
}

TEST_F(TokenFileTest, TheServersListHasOneTokenPerLineAndNamesNoneInItsErrors) {
  Result<std::vector<std::string>> two =
      net::ReadTokenListFile(write("two", "# old one goes on Friday\nold token\n\nnew\r\n", owner));
  ASSERT_TRUE(two.ok()) << two.status().ToString();
  EXPECT_EQ(*two, (std::vector<std::string>{"old token", "new"}));
  Result<std::vector<std::string>> last_line = net::ReadTokenListFile(write("last", "a\nb", owner));
  ASSERT_TRUE(last_line.ok());
  EXPECT_EQ(*last_line, (std::vector<std::string>{"a", "b"}));
  // What a client's file holds is a one-token list.
  Result<std::vector<std::string>> one = net::ReadTokenListFile(write("one", "abc def\r\n", owner));
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(*one, (std::vector<std::string>{"abc def"}));

  EXPECT_FALSE(net::ReadTokenListFile(write("comments", "# none yet\n\n", owner)).ok());
  Result<std::vector<std::string>> world =
      net::ReadTokenListFile(write("world", "t\n", owner | fs::perms::others_read));
  EXPECT_EQ(world.status().code(), Code::kPermissionDenied);
  const std::string secret(5000, 's');
  Result<std::vector<std::string>> long_line =
      net::ReadTokenListFile(write("long", "ok\n" + secret + "\n", owner));
  ASSERT_FALSE(long_line.ok());
  EXPECT_NE(long_line.status().message().find("line 2"), std::string::npos)
      << long_line.status().message();
  EXPECT_EQ(long_line.status().message().find("sss"), std::string::npos) << "quotes the token";
  EXPECT_FALSE(net::ReadTokenListFile(write("huge", std::string(70000, '\n'), owner)).ok());
}

TEST_F(TokenFileTest, ConstantTimeEqualCompares) {
  EXPECT_TRUE(net::ConstantTimeEqual("s3cret", "s3cret"));
  EXPECT_FALSE(net::ConstantTimeEqual("s3cret", "s3creT"));
  EXPECT_FALSE(net::ConstantTimeEqual("s3cret", "s3cret2"));
  EXPECT_FALSE(net::ConstantTimeEqual("", "x"));
  EXPECT_TRUE(net::ConstantTimeEqual("", ""));
}

TEST(ImageAccessFileTest, ReadsOneRuleALineAndNamesTheLineThatIsWrong) {
  gpulazy::testing::TempDir dir;
  const auto write = [&](const std::string& name, const std::string& text, fs::perms perms) {
    const fs::path path = dir.path() / name;
    std::ofstream(path) << text;
    fs::permissions(path, perms);
    return path.string();
  };
  const fs::perms owner = fs::perms::owner_read | fs::perms::owner_write;
  const fs::perms readable = owner | fs::perms::group_read | fs::perms::others_read;
  Result<std::vector<ImageAccessRule>> rules = ReadImageAccessFile(
      write("good", "# team A's jobs\n  uid:1000=teamA/jobs  \r\n\n\tcn:node7=shared,models\n",
            readable));
  ASSERT_TRUE(rules.ok()) << rules.status().ToString();
  ASSERT_EQ(rules->size(), 2u);
  EXPECT_EQ((*rules)[0].principal, "uid:1000");
  EXPECT_EQ((*rules)[0].prefixes, (std::vector<std::string>{"teamA/jobs"}));
  EXPECT_EQ((*rules)[1].prefixes, (std::vector<std::string>{"shared", "models"}));
  Result<std::vector<ImageAccessRule>> none =
      ReadImageAccessFile(write("empty", "# none\n", owner));
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());

  Result<std::vector<ImageAccessRule>> bad =
      ReadImageAccessFile(write("bad", "uid:1=a\n\nuid:2=../b\n", owner));
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("line 3"), std::string::npos) << bad.status().ToString();
  for (const fs::perms writable :
       {owner | fs::perms::group_write, owner | fs::perms::others_write}) {
    Result<std::vector<ImageAccessRule>> open =
        ReadImageAccessFile(write("open", "*=a\n", writable));
    ASSERT_FALSE(open.ok());
    EXPECT_EQ(open.status().code(), Code::kPermissionDenied) << open.status().ToString();
    EXPECT_NE(open.status().message().find("chmod go-w"), std::string::npos);
  }
  EXPECT_FALSE(ReadImageAccessFile((dir.path() / "missing").string()).ok());
  EXPECT_FALSE(ReadImageAccessFile(dir.path().string()).ok());  // a directory
  const std::string huge(2u << 20, '#');
  EXPECT_FALSE(ReadImageAccessFile(write("huge", huge, owner)).ok());
}

// The startup warning of memfd placement depends on this: true exactly on Linux 6.5 and later.
TEST(PeerPidfdTest, KnownExactlyWhereTheKernelHasIt) {
  struct utsname names {};
  ASSERT_EQ(::uname(&names), 0);
  unsigned major = 0, minor = 0;
  ASSERT_EQ(std::sscanf(names.release, "%u.%u", &major, &minor), 2) << names.release;
  EXPECT_EQ(KernelHasPeerPidfd(), major > 6 || (major == 6 && minor >= 5)) << names.release;
}

}  // namespace
}  // namespace gpulazy::server
