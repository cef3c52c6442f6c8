// Security of gpulazy-server and gpulazy-client against real processes (docs/security.md): TLS
// with certificates the test makes with the openssl CLI (right CA, wrong CA, expired, other
// host, mutual TLS), bearer token files, plain TCP refused unless allowed, Unix peer
// credentials, image visibility, confinement beneath the image root, and the write timeout
// for a client that stops reading.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "lazy-server/image/synth.h"
#include "page-client/host_engine.h"
#include "page-client/net/stream.h"
#include "page-client/restore_session.h"
#include "proto/frame.h"
#include "tests/server/test_support.h"
#include "tests/support/files.h"
#include "tests/support/process.h"
#include "tests/support/test_pki.h"
#include "tests/support/unix_relay.h"

namespace gpulazy::server::testing {
namespace {

namespace fs = std::filesystem;

using ProcessRun = ::gpulazy::testing::CommandRun;
using ::gpulazy::testing::PagesFiles;

ProcessRun Shell(const std::string& command) {
  return ::gpulazy::testing::RunCommand(command, 120);
}

ProcessRun Client(const std::string& args) {
  return Shell(std::string(GPULAZY_BIN_DIR) + "/gpulazy-client " + args);
}

void WriteText(const fs::path& path, const std::string& text, fs::perms perms) {
  std::ofstream(path) << text;
  fs::permissions(path, perms);
}

// A small raw CRIU checkpoint: 1 process, 1 GPU, a few BOs.
void MakeCheckpoint(const fs::path& dir, uint64_t bytes, uint64_t seed) {
  image::SynthOptions options;
  options.out = dir;
  options.gpus = 1;
  options.processes = 1;
  options.bos = 4;
  options.total_bytes = bytes;
  options.seed = seed;
  Result<image::SynthReport> report = image::SynthesizeCheckpoint(options);
  ASSERT_TRUE(report.ok()) << report.status().ToString();
}

using Pki = ::gpulazy::testing::TestPki;

class SecurityTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = std::make_unique<TempDir>();
    fs::create_directories(dir_->path() / "images");
    MakeCheckpoint(dir_->path() / "images" / "ckpt", 4ull << 20, 7);
    pki_ = std::make_unique<Pki>(dir_->path());
  }
  static void TearDownTestSuite() {
    pki_.reset();
    dir_.reset();
  }
  void SetUp() override { ASSERT_TRUE(pki_->ok()) << pki_->log(); }

  static fs::path root() { return dir_->path() / "images"; }
  static const Pki& pki() { return *pki_; }

  // A server whose TCP listener speaks TLS with `cert`; extra arguments appended.
  std::unique_ptr<ServerProcess> TlsServer(const std::string& cert,
                                           std::vector<std::string> extra = {}) {
    std::vector<std::string> args = {"--tls-cert", pki().pem(cert), "--tls-key", pki().key(cert)};
    args.insert(args.end(), extra.begin(), extra.end());
    auto server = std::make_unique<ServerProcess>(run_.path(), root(), args);
    EXPECT_TRUE(server->ready()) << server->Log();
    return server;
  }

  // `fetch` of "ckpt" from `endpoint` with extra client arguments, into a fresh directory.
  ProcessRun Fetch(const net::Endpoint& endpoint, const std::string& args) {
    out_ = run_.path() / ("out" + std::to_string(fetches_++));
    return Client("fetch --server " + endpoint.ToString() + " --image ckpt --out " + out_.string() +
                  " " + args);
  }
  void ExpectFetchedBytesMatch() {
    const auto expected = PagesFiles(root() / "ckpt");
    const auto fetched = PagesFiles(out_);
    ASSERT_FALSE(expected.empty());
    ASSERT_EQ(fetched.size(), expected.size());
    for (const auto& [name, bytes] : expected) {
      auto it = fetched.find(name);
      ASSERT_NE(it, fetched.end()) << name;
      EXPECT_TRUE(it->second == bytes) << name << " differs";
    }
  }

  static std::unique_ptr<TempDir> dir_;
  static std::unique_ptr<Pki> pki_;
  TempDir run_;
  fs::path out_;
  int fetches_ = 0;
};

std::unique_ptr<TempDir> SecurityTest::dir_;
std::unique_ptr<Pki> SecurityTest::pki_;

TEST_F(SecurityTest, TlsFetchIsByteExact) {
  auto server = TlsServer("server");
  ProcessRun run = Fetch(server->tcp_endpoint(), "--tls-ca " + pki().pem("ca"));
  ASSERT_EQ(run.exit_code, 0) << run.out << server->Log();
  ExpectFetchedBytesMatch();
  EXPECT_TRUE(server->LogShows({"stream connection over TLS"})) << server->Log();
  // Stats over TLS too.
  ProcessRun stats = Client("stats --server " + server->tcp_endpoint().ToString() + " --tls-ca " +
                            pki().pem("ca"));
  ASSERT_EQ(stats.exit_code, 0) << stats.out;
  EXPECT_NE(stats.out.find("\"sessions_opened\":1"), std::string::npos) << stats.out;
  // A TLS stream's state cannot change event loops: its demand connection stays on the shared
  // network threads (--demand-network-threads serves plain sockets only) and still works.
  EXPECT_TRUE(server->LogShows({"demand connection over TLS"})) << server->Log();
  EXPECT_NE(stats.out.find("\"demand_connections_moved\":0"), std::string::npos) << stats.out;
}

TEST_F(SecurityTest, ServerCertificateFromAnotherCaIsRefused) {
  auto server = TlsServer("server");
  ProcessRun run = Fetch(server->tcp_endpoint(), "--tls-ca " + pki().pem("other-ca"));
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.out.find("server certificate refused"), std::string::npos) << run.out;
  // A plain client cannot talk to the TLS listener either.
  ProcessRun plain = Fetch(server->tcp_endpoint(), "--insecure");
  EXPECT_NE(plain.exit_code, 0) << plain.out;
}

TEST_F(SecurityTest, ExpiredServerCertificateIsRefused) {
  auto server = TlsServer("expired");
  ProcessRun run = Fetch(server->tcp_endpoint(), "--tls-ca " + pki().pem("ca"));
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.out.find("certificate has expired"), std::string::npos) << run.out;
}

TEST_F(SecurityTest, CertificateForAnotherHostIsRefusedUnlessNamed) {
  auto server = TlsServer("elsewhere");
  ProcessRun run = Fetch(server->tcp_endpoint(), "--tls-ca " + pki().pem("ca"));
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.out.find("mismatch"), std::string::npos) << run.out;
  ProcessRun named = Fetch(server->tcp_endpoint(),
                           "--tls-ca " + pki().pem("ca") + " --tls-server-name elsewhere.example");
  ASSERT_EQ(named.exit_code, 0) << named.out << server->Log();
  ExpectFetchedBytesMatch();
}

TEST_F(SecurityTest, MutualTlsNeedsAClientCertificateFromTheClientCa) {
  auto server = TlsServer("server", {"--tls-client-ca", pki().pem("ca")});
  const std::string ca = "--tls-ca " + pki().pem("ca");
  ProcessRun without = Fetch(server->tcp_endpoint(), ca);
  EXPECT_NE(without.exit_code, 0) << without.out;
  ProcessRun rogue = Fetch(server->tcp_endpoint(), ca + " --tls-cert " + pki().pem("rogue") +
                                                       " --tls-key " + pki().key("rogue"));
  EXPECT_NE(rogue.exit_code, 0) << rogue.out;
  ProcessRun with = Fetch(server->tcp_endpoint(), ca + " --tls-cert " + pki().pem("node7") +
                                                      " --tls-key " + pki().key("node7"));
  ASSERT_EQ(with.exit_code, 0) << with.out << server->Log();
  ExpectFetchedBytesMatch();
  EXPECT_TRUE(server->LogShows({"cn 'node7'"})) << server->Log();
}

TEST_F(SecurityTest, AClientOnTheOtherTransportIsToldWhichItReached) {
  auto tls_server = TlsServer("server");
  fs::create_directory(run_.path() / "plain");                // a socket and ready file of its own
  ServerProcess plain_server(run_.path() / "plain", root());  // plain TCP (--insecure-tcp)
  ASSERT_TRUE(plain_server.ready()) << plain_server.Log();

  // A plain client on the TLS listener is answered in plain text, and not retried.
  ProcessRun plain_to_tls = Fetch(tls_server->tcp_endpoint(), "--insecure");
  EXPECT_NE(plain_to_tls.exit_code, 0);
  EXPECT_NE(plain_to_tls.out.find("this listener speaks TLS: connect with a CA file"),
            std::string::npos)
      << plain_to_tls.out;
  EXPECT_TRUE(tls_server->LogShows({"a plain-text gpulazy client on a TLS listener"}))
      << tls_server->Log();

  // A TLS client on the plain listener hears no TLS and says what it probably reached.
  ProcessRun tls_to_plain = Fetch(plain_server.tcp_endpoint(), "--tls-ca " + pki().pem("ca"));
  EXPECT_NE(tls_to_plain.exit_code, 0);
  EXPECT_NE(tls_to_plain.out.find("its answer is not TLS"), std::string::npos) << tls_to_plain.out;
  EXPECT_NE(tls_to_plain.out.find("--insecure"), std::string::npos) << tls_to_plain.out;
  EXPECT_TRUE(plain_server.LogShows({"look like a TLS handshake, not a gpulazy frame"}))
      << plain_server.Log();

  // Both keep serving the clients that match them.
  ProcessRun tls = Fetch(tls_server->tcp_endpoint(), "--tls-ca " + pki().pem("ca"));
  ASSERT_EQ(tls.exit_code, 0) << tls.out << tls_server->Log();
  ExpectFetchedBytesMatch();
  ProcessRun plain = Fetch(plain_server.tcp_endpoint(), "--insecure");
  ASSERT_EQ(plain.exit_code, 0) << plain.out << plain_server.Log();
  ExpectFetchedBytesMatch();
}

// A plain gpulazy client whose first bytes reach the TLS listener in two pieces is still told, in
// its own framing, that the listener speaks TLS: the server waits a moment for a whole frame
// prefix before it judges the peer.
TEST_F(SecurityTest, APlainHelloCutInTwoOnTheTlsListenerIsAnsweredInItsOwnFraming) {
  auto server = TlsServer("server");
  wire::Header header;
  header.set_request_id(1);
  header.mutable_hello()->set_min_version(1);
  header.mutable_hello()->set_max_version(1);
  header.mutable_hello()->set_client_name("cut-in-two");
  Result<std::string> frame = EncodeFrameHead(header, 0, FrameLimits{});
  ASSERT_TRUE(frame.ok()) << frame.status().ToString();
  const std::span<const uint8_t> bytes(reinterpret_cast<const uint8_t*>(frame->data()),
                                       frame->size());
  TestClient client(server->tcp_endpoint());
  ASSERT_TRUE(client.SendRaw(bytes.first(3)).ok());
  std::this_thread::sleep_for(50ms);
  ASSERT_TRUE(client.SendRaw(bytes.subspan(3)).ok());
  Result<wire::Error> error = client.ReadError();
  ASSERT_TRUE(error.ok()) << error.status().ToString() << server->Log();
  EXPECT_EQ(error->code(), wire::ERROR_UNAUTHENTICATED);
  EXPECT_NE(error->message().find("this listener speaks TLS"), std::string::npos)
      << error->message();
  EXPECT_TRUE(server->LogShows({"a plain-text gpulazy client on a TLS listener"})) << server->Log();
}

// A TLS connection to `server`, handshake done, trusting the test CA.
Result<net::Stream> ConnectTls(boost::asio::io_context& io, const ServerProcess& server,
                               const Pki& pki) {
  net::TlsClientOptions options;
  options.ca_file = pki.pem("ca");
  GPULAZY_ASSIGN_OR_RETURN(net::ClientTransport transport,
                           net::ClientTransport::Make(options, false));
  return net::ConnectBlocking(io, server.tcp_endpoint(), transport);
}

// True when the server ends the connection (EOF, reset or a TLS error) within `timeout`; what
// it sends before that is read and dropped.
bool ServerEnds(net::Stream& stream, std::chrono::milliseconds timeout = 5s) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::array<uint8_t, 4096> discard;
  while (true) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left <= 0ms) return false;
    pollfd readable{stream.socket().native_handle(), POLLIN, 0};
    if (::poll(&readable, 1, static_cast<int>(left.count())) == 0) return false;
    boost::system::error_code ec;
    stream.read_some(boost::asio::buffer(discard), ec);
    if (ec) return true;
  }
}

TEST_F(SecurityTest, HostilePeersOfTheTlsListenerAreClosedWhileOthersAreServed) {
  ::alarm(120);
  auto server = TlsServer("server", {"--hello-timeout", "1"});

  // Another protocol: named in the log, closed at once.
  TestClient http(server->tcp_endpoint());
  const std::string_view get = "GET / HTTP/1.1\r\nHost: gpulazy\r\n\r\n";
  ASSERT_TRUE(http.SendRaw({reinterpret_cast<const uint8_t*>(get.data()), get.size()}).ok());
  EXPECT_TRUE(http.WaitClosed(5s));
  EXPECT_TRUE(server->LogShows({"an HTTP request on a TLS listener"})) << server->Log();

  // A connection that ends its side without a byte once the server waits for its first bytes
  // (a port probe): closed at once, not held until the Hello deadline. (Asio's reactor took the
  // empty peek as the socket read dry, so the handshake's read waited for readiness it had been
  // told of already, until the deadline.)
  TestClient probe(server->tcp_endpoint());
  std::this_thread::sleep_for(200ms);  // the server's peek is waiting by now
  const auto probe_ended = std::chrono::steady_clock::now();
  ASSERT_TRUE(probe.CloseWrite().ok());
  EXPECT_TRUE(probe.WaitClosed(5s));
  EXPECT_LT(std::chrono::steady_clock::now() - probe_ended, 500ms);

  // A ClientHello's record header and then silence: the Hello deadline ends the handshake.
  TestClient stalled(server->tcp_endpoint());
  const uint8_t record_head[6] = {0x16, 0x03, 0x01, 0x02, 0x00, 0x01};
  const auto stalled_at = std::chrono::steady_clock::now();
  ASSERT_TRUE(stalled.SendRaw(record_head).ok());
  EXPECT_TRUE(stalled.WaitClosed(10s));
  EXPECT_LT(std::chrono::steady_clock::now() - stalled_at, 8s);

  boost::asio::io_context io;
  {
    // After the handshake, bytes that are no valid record (a forged application-data record):
    // OpenSSL refuses them and the server drops the connection.
    Result<net::Stream> forged = ConnectTls(io, *server, pki());
    ASSERT_TRUE(forged.ok()) << forged.status().ToString();
    std::array<uint8_t, 5 + 32> record{0x17, 0x03, 0x03, 0x00, 32};
    for (size_t i = 5; i < record.size(); ++i)
      record[i] = static_cast<uint8_t>(i * 37);
    boost::system::error_code ec;
    boost::asio::write(forged->socket(), boost::asio::buffer(record), ec);
    ASSERT_FALSE(ec) << ec.message();
    EXPECT_TRUE(ServerEnds(*forged));
  }
  {
    // An oversized frame inside TLS is refused inside TLS, before anything is allocated.
    Result<net::Stream> oversized = ConnectTls(io, *server, pki());
    ASSERT_TRUE(oversized.ok()) << oversized.status().ToString();
    uint8_t prefix[8] = {0, 0, 0, 0x40, 0, 0, 0, 0};  // a 1 GiB header
    boost::system::error_code ec;
    boost::asio::write(*oversized, boost::asio::buffer(prefix), ec);
    ASSERT_FALSE(ec) << ec.message();
    std::vector<uint8_t> payload;
    Result<wire::Header> reply = net::ReadFrameBlocking(*oversized, FrameLimits{}, &payload);
    ASSERT_TRUE(reply.ok()) << reply.status().ToString();
    ASSERT_TRUE(reply->has_error());
    EXPECT_EQ(reply->error().code(), wire::ERROR_LIMIT);
    EXPECT_TRUE(ServerEnds(*oversized));
  }

  // None of them disturbed a real client.
  ProcessRun run = Fetch(server->tcp_endpoint(), "--tls-ca " + pki().pem("ca"));
  ASSERT_EQ(run.exit_code, 0) << run.out << server->Log();
  ExpectFetchedBytesMatch();
  ::alarm(0);
}

TEST_F(SecurityTest, TokenFilesAreCheckedAndMustNotBeWorldReadable) {
  const fs::path good = run_.path() / "token";
  const fs::path wrong = run_.path() / "wrong";
  const fs::path leaky = run_.path() / "leaky";
  WriteText(good, "s3cret-token\n", fs::perms::owner_read | fs::perms::owner_write);
  WriteText(wrong, "not-the-token\n", fs::perms::owner_read);
  WriteText(leaky, "s3cret-token\n", fs::perms::owner_read | fs::perms::others_read);

  ProcessRun refused = Shell(
      std::string(GPULAZY_BIN_DIR) + "/gpulazy-server --images " + root().string() +
      " --listen unix:" + (run_.path() / "x.sock").string() + " --token-file " + leaky.string());
  EXPECT_EQ(refused.exit_code, 2);
  EXPECT_NE(refused.out.find("accessible to other users"), std::string::npos) << refused.out;

  auto server = TlsServer("server", {"--token-file", good.string()});
  const std::string tls = "--tls-ca " + pki().pem("ca");
  ProcessRun none = Fetch(server->tcp_endpoint(), tls);
  EXPECT_NE(none.exit_code, 0);
  EXPECT_NE(none.out.find("ERROR_UNAUTHENTICATED"), std::string::npos) << none.out;
  ProcessRun bad = Fetch(server->tcp_endpoint(), tls + " --token-file " + wrong.string());
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.out.find("ERROR_UNAUTHENTICATED"), std::string::npos) << bad.out;
  ProcessRun leaked = Fetch(server->tcp_endpoint(), tls + " --token-file " + leaky.string());
  EXPECT_NE(leaked.exit_code, 0);
  EXPECT_NE(leaked.out.find("accessible to other users"), std::string::npos) << leaked.out;
  ProcessRun right = Fetch(server->unix_endpoint(), "--token-file " + good.string());
  ASSERT_EQ(right.exit_code, 0) << right.out << server->Log();
  ExpectFetchedBytesMatch();
}

TEST_F(SecurityTest, SighupReloadsTheCertificateAndTokensAndKeepsThemWhenAFileIsBad) {
  ::alarm(120);
  const fs::path cert = run_.path() / "live.pem";
  const fs::path key = run_.path() / "live.key";
  const fs::path tokens = run_.path() / "tokens";  // the server's
  const fs::path first = run_.path() / "first";    // clients'
  const fs::path second = run_.path() / "second";
  const auto owner_only = fs::perms::owner_read | fs::perms::owner_write;
  const auto replace = fs::copy_options::overwrite_existing;
  fs::copy_file(pki().pem("expired"), cert);
  fs::copy_file(pki().key("expired"), key);
  WriteText(tokens, "first-token\n", owner_only);
  WriteText(first, "first-token\n", owner_only);
  WriteText(second, "second-token\n", owner_only);
  ServerProcess server(
      run_.path(), root(),
      {"--tls-cert", cert.string(), "--tls-key", key.string(), "--token-file", tokens.string()});
  ASSERT_TRUE(server.ready()) << server.Log();
  const std::string ca = "--tls-ca " + pki().pem("ca");
  const auto reload = [&] { ASSERT_EQ(::kill(server.pid(), SIGHUP), 0); };
  const auto fetch_with = [&](const fs::path& token) {
    return Fetch(server.tcp_endpoint(), ca + " --token-file " + token.string());
  };

  // The certificate was let expire: clients refuse it, and the server's log said so at start.
  ProcessRun expired = fetch_with(first);
  EXPECT_NE(expired.exit_code, 0);
  EXPECT_NE(expired.out.find("certificate has expired"), std::string::npos) << expired.out;
  EXPECT_TRUE(server.LogShows({"/CN=localhost, EXPIRED"})) << server.Log();

  // Renewed in place, a second token beside the first, then SIGHUP: no restart, and clients
  // holding either token are served while they move to the new one.
  fs::copy_file(pki().pem("server"), cert, replace);
  fs::copy_file(pki().key("server"), key, replace);
  WriteText(tokens,
            "# rotating: first-token goes once every client has second-token\n"
            "first-token\n\nsecond-token\r\n",
            owner_only);
  reload();
  EXPECT_TRUE(server.LogShows({"credentials reloaded: TLS certificate"})) << server.Log();
  EXPECT_TRUE(server.LogShows({"(2 tokens)"})) << server.Log();
  for (const fs::path& token : {first, second}) {
    ProcessRun renewed = fetch_with(token);
    ASSERT_EQ(renewed.exit_code, 0) << token << ": " << renewed.out << server.Log();
    ExpectFetchedBytesMatch();
  }
  // The first token dropped: refused from the next reload on.
  WriteText(tokens, "second-token\n", owner_only);
  reload();
  EXPECT_TRUE(server.LogShows({"(1 token)"})) << server.Log();
  ProcessRun stale = fetch_with(first);
  EXPECT_NE(stale.exit_code, 0);
  EXPECT_NE(stale.out.find("ERROR_UNAUTHENTICATED"), std::string::npos) << stale.out;

  // Half a rotation (a key that is not the certificate's) is refused whole: the token file
  // changed with it is not taken either.
  fs::copy_file(pki().key("elsewhere"), key, replace);
  WriteText(tokens, "third-token\n", owner_only);
  reload();
  EXPECT_TRUE(server.LogShows({"the credentials and access rules in place stay"})) << server.Log();
  ProcessRun kept = fetch_with(second);
  ASSERT_EQ(kept.exit_code, 0) << kept.out << server.Log();
  ExpectFetchedBytesMatch();

  // So is a token file others may read, with the certificate's key back in place.
  fs::copy_file(pki().key("server"), key, replace);
  WriteText(tokens, "third-token\n", owner_only | fs::perms::others_read);
  reload();
  EXPECT_TRUE(server.LogShows({"accessible to other users (mode"})) << server.Log();
  ProcessRun stats = Client("stats --server " + server.tcp_endpoint().ToString() + " " + ca +
                            " --token-file " + second.string());
  ASSERT_EQ(stats.exit_code, 0) << stats.out << server.Log();
  EXPECT_NE(stats.out.find("\"credential_reloads\":2,"), std::string::npos) << stats.out;
  EXPECT_NE(stats.out.find("\"credential_reload_failures\":2,"), std::string::npos) << stats.out;
  ::alarm(0);
}

TEST_F(SecurityTest, CheckLoadsEveryFileWithoutServingAndNamesWhatFails) {
  const fs::path tokens = run_.path() / "tokens";
  WriteText(tokens, "one\ntwo\n", fs::perms::owner_read | fs::perms::owner_write);
  const fs::path access = run_.path() / "image-access";
  WriteText(access, "uid:0=ckpt\n", fs::perms::owner_read | fs::perms::owner_write);
  const fs::path socket = run_.path() / "check.sock";
  auto check = [&](const std::string& cert, const std::string& key, const std::string& more) {
    return Shell(std::string(GPULAZY_BIN_DIR) + "/gpulazy-server --check --images " +
                 root().string() + " --listen unix:" + socket.string() +
                 " --listen tcp:127.0.0.1:0 --tls-cert " + cert + " --tls-key " + key +
                 " --tls-client-ca " + pki().pem("ca") + " --token-file " + tokens.string() +
                 " --image-access-file " + access.string() + " " + more);
  };

  ProcessRun good = check(pki().pem("server"), pki().key("server"), "");
  EXPECT_EQ(good.exit_code, 0) << good.out;
  for (const std::string& line : std::vector<std::string>{
           "image root " + root().string(), "(TLS, client certificates required)",
           "TLS certificate " + pki().pem("server") + " (/CN=localhost, expires",
           "token file " + tokens.string() + ": 2 tokens",
           "image-access file " + access.string() + ": 1 rule", "configuration ok"})
    EXPECT_NE(good.out.find(line), std::string::npos) << line << " in\n" << good.out;
  EXPECT_FALSE(fs::exists(socket)) << "--check bound a listener";

  ProcessRun expired = check(pki().pem("expired"), pki().key("expired"), "");
  EXPECT_EQ(expired.exit_code, 2) << expired.out;
  EXPECT_NE(expired.out.find("has expired: clients will refuse it"), std::string::npos)
      << expired.out;
  ProcessRun mismatch = check(pki().pem("server"), pki().key("elsewhere"), "");
  EXPECT_EQ(mismatch.exit_code, 2) << mismatch.out;
  EXPECT_NE(mismatch.out.find("--tls-key " + pki().key("elsewhere")), std::string::npos)
      << mismatch.out;
  ProcessRun missing_root = check(pki().pem("server"), pki().key("server"),
                                  "--images " + (run_.path() / "gone").string());
  EXPECT_EQ(missing_root.exit_code, 2) << missing_root.out;
  EXPECT_NE(missing_root.out.find("gone is not a directory"), std::string::npos)
      << missing_root.out;
  EXPECT_EQ(missing_root.out.find("configuration ok"), std::string::npos) << missing_root.out;
}

TEST_F(SecurityTest, PlainTcpNeedsExplicitFlagsOnBothEnds) {
  ProcessRun server = Shell(std::string(GPULAZY_BIN_DIR) + "/gpulazy-server --images " +
                            root().string() + " --listen tcp:127.0.0.1:0");
  EXPECT_EQ(server.exit_code, 2);
  EXPECT_NE(server.out.find("--insecure-tcp"), std::string::npos) << server.out;

  ServerProcess insecure(run_.path(), root());  // test_support passes --insecure-tcp
  ASSERT_TRUE(insecure.ready()) << insecure.Log();
  EXPECT_NE(insecure.Log().find("plain TCP (--insecure-tcp)"), std::string::npos);
  ProcessRun refused = Fetch(insecure.tcp_endpoint(), "");
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.out.find("--insecure"), std::string::npos) << refused.out;
  EXPECT_EQ(insecure.Log().find("hello from"), std::string::npos) << "the client connected";
  ProcessRun allowed = Fetch(insecure.tcp_endpoint(), "--insecure");
  ASSERT_EQ(allowed.exit_code, 0) << allowed.out;
  ExpectFetchedBytesMatch();
}

// Forks a child that becomes `nobody` and says Hello on the Unix socket; the child's exit code
// is 0 when the server answered HelloReply, 1 when it refused with ERROR_UNAUTHENTICATED.
int HelloAsNobody(const ServerProcess& server) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(3);
    TestClient client(server.unix_endpoint());
    if (!client.connected()) ::_exit(4);
    Result<wire::HelloReply> hello = client.Hello();
    if (hello.ok()) ::_exit(0);
    ::_exit(hello.status().message().find("ERROR_UNAUTHENTICATED") != std::string::npos ? 1 : 5);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST_F(SecurityTest, UnixPeersAreCheckedAgainstTheAllowList) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to become another user";
  // The socket must be reachable by `nobody` for the server's check to be what refuses it.
  // Each server gets its own directory (and ready file).
  for (const char* sub : {"a", "b"})
    fs::create_directory(run_.path() / sub);
  fs::permissions(run_.path(), fs::perms::all);
  fs::permissions(run_.path() / "a", fs::perms::all);
  fs::permissions(run_.path() / "b", fs::perms::all);
  {
    ServerProcess server(run_.path() / "a", root());
    ASSERT_TRUE(server.ready()) << server.Log();
    fs::permissions(server.socket_path(), fs::perms::all);
    EXPECT_EQ(HelloAsNobody(server), 1) << server.Log();
    EXPECT_TRUE(server.LogShows({"peer uid 65534 gid 65534 is not allowed"})) << server.Log();
    TestClient root_client(server.unix_endpoint());  // we are root: allowed by default
    EXPECT_TRUE(root_client.Hello().ok());
  }
  ServerProcess server(run_.path() / "b", root(), {"--allow-uid", "65534"});
  ASSERT_TRUE(server.ready()) << server.Log();
  fs::permissions(server.socket_path(), fs::perms::all);
  EXPECT_EQ(HelloAsNobody(server), 0) << server.Log();
  TestClient root_client(server.unix_endpoint());  // an explicit list replaces the default
  EXPECT_FALSE(root_client.Hello().ok());
}

TEST(ImageVisibilityTest, ClientsSeeOnlyTheirImagesAndCannotTellForbiddenFromMissing) {
  ::alarm(120);
  TempDir dir;
  const fs::path root = dir.path() / "images";
  ASSERT_NO_FATAL_FAILURE(MakeCheckpoint(root / "teamA" / "img", 1ull << 20, 1));
  ASSERT_NO_FATAL_FAILURE(MakeCheckpoint(root / "teamB" / "img", 1ull << 20, 2));
  ASSERT_NO_FATAL_FAILURE(MakeCheckpoint(root / "shared" / "img", 1ull << 20, 3));
  // Inside the root, but leading into teamB: judged by where it lands.
  fs::create_directory_symlink("../teamB/img", root / "teamA" / "link");
  ServerProcess server(dir.path(), root,
                       {"--raw-chunk-size", "64K", "--image-access", "uid:0=teamA,shared",
                        "--image-access", "*=shared"});
  ASSERT_TRUE(server.ready()) << server.Log();
  ASSERT_EQ(::geteuid(), 0u) << "the rule above names uid 0";

  TestClient unix_client(server.unix_endpoint());  // uid 0: teamA and shared
  ASSERT_TRUE(unix_client.Hello().ok());
  ASSERT_TRUE(unix_client.Open("teamA/img").ok());
  TestClient tcp_client(server.tcp_endpoint());  // anonymous: shared only
  ASSERT_TRUE(tcp_client.Hello().ok());
  ASSERT_TRUE(tcp_client.Open("shared/img").ok());

  auto refusal = [&](const std::string& image) {
    TestClient client(server.unix_endpoint());
    EXPECT_TRUE(client.Hello().ok());
    Result<wire::OpenImageReply> reply = client.Open(image);
    EXPECT_FALSE(reply.ok()) << image;
    return reply.ok() ? std::string("opened") : reply.status().message();
  };
  const std::string forbidden = refusal("teamB/img");
  const std::string missing = refusal("teamB/nothing");
  EXPECT_NE(forbidden.find("ERROR_NOT_FOUND"), std::string::npos) << forbidden;
  // Word for word the same, apart from the name the client itself sent.
  std::string normalized = forbidden;
  for (size_t at; (at = normalized.find("teamB/img")) != std::string::npos;)
    normalized.replace(at, 9, "teamB/nothing");
  EXPECT_EQ(normalized, missing);
  EXPECT_NE(refusal("teamA/link").find("ERROR_NOT_FOUND"), std::string::npos);

  // Stats list only sessions of images the asker may open.
  Result<std::string> anonymous_stats = tcp_client.Stats();
  ASSERT_TRUE(anonymous_stats.ok()) << anonymous_stats.status().ToString();
  EXPECT_EQ(anonymous_stats->find("teamA"), std::string::npos) << *anonymous_stats;
  EXPECT_NE(anonymous_stats->find("shared/img"), std::string::npos) << *anonymous_stats;
  Result<std::string> root_stats = unix_client.Stats();
  ASSERT_TRUE(root_stats.ok());
  EXPECT_NE(root_stats->find("teamA/img"), std::string::npos) << *root_stats;
  EXPECT_NE(root_stats->find("shared/img"), std::string::npos) << *root_stats;
  ::alarm(0);
}

// --image-access-file is read again on SIGHUP: connections accepted from then on get the new
// grants, a connection accepted before keeps its own, a file others may write is refused whole
// (the rules in place stay), and a file emptied of rules hides every image.
TEST(ImageVisibilityTest, SighupReadsTheImageAccessFileAgain) {
  ::alarm(120);
  TempDir dir;
  const fs::path root = dir.path() / "images";
  ASSERT_NO_FATAL_FAILURE(MakeCheckpoint(root / "teamA" / "img", 1ull << 20, 1));
  ASSERT_NO_FATAL_FAILURE(MakeCheckpoint(root / "teamB" / "img", 1ull << 20, 2));
  ASSERT_EQ(::geteuid(), 0u) << "the rules below name uid 0";
  const fs::path rules = dir.path() / "image-access";
  const auto readable = fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                        fs::perms::others_read;
  WriteText(rules, "# who sees what\nuid:0=teamA\n", readable);
  ServerProcess server(dir.path(), root,
                       {"--raw-chunk-size", "64K", "--image-access-file", rules.string()});
  ASSERT_TRUE(server.ready()) << server.Log();
  const auto opens = [&](TestClient& client, const std::string& image) {
    return client.Open(image).ok();
  };
  const auto fresh_opens = [&](const std::string& image) {
    TestClient client(server.unix_endpoint());
    EXPECT_TRUE(client.Hello().ok());
    return opens(client, image);
  };
  const auto reload = [&] { ASSERT_EQ(::kill(server.pid(), SIGHUP), 0); };
  EXPECT_TRUE(fresh_opens("teamA/img"));
  EXPECT_FALSE(fresh_opens("teamB/img"));

  TestClient accepted_before(server.unix_endpoint());
  ASSERT_TRUE(accepted_before.Hello().ok());
  WriteText(rules, "uid:0=teamB\ncn:node7=teamA\n", readable);
  reload();
  ASSERT_TRUE(server.LogShows({"image-access file " + rules.string() + " (2 rules)"}))
      << server.Log();
  EXPECT_TRUE(fresh_opens("teamB/img"));
  EXPECT_FALSE(fresh_opens("teamA/img"));
  EXPECT_TRUE(opens(accepted_before, "teamA/img")) << "a connection keeps the grant of its Hello";

  // Others could grant themselves images through it: refused, the rules in place stay.
  WriteText(rules, "*=teamA,teamB\n", readable | fs::perms::others_write);
  reload();
  EXPECT_TRUE(server.LogShows({"may be written by other users", "access rules in place stay"}))
      << server.Log();
  EXPECT_TRUE(fresh_opens("teamB/img"));
  EXPECT_FALSE(fresh_opens("teamA/img"));

  // Emptied: nobody is granted anything (not: everyone sees everything).
  WriteText(rules, "# all access withdrawn\n", readable);
  reload();
  ASSERT_TRUE(server.LogShows({"(0 rules)"})) << server.Log();
  EXPECT_FALSE(fresh_opens("teamA/img"));
  EXPECT_FALSE(fresh_opens("teamB/img"));
  TestClient stats_client(server.unix_endpoint());
  ASSERT_TRUE(stats_client.Hello().ok());
  Result<std::string> stats = stats_client.Stats();
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_NE(stats->find("\"credential_reloads\":2,"), std::string::npos) << *stats;
  EXPECT_NE(stats->find("\"credential_reload_failures\":1,"), std::string::npos) << *stats;
  ::alarm(0);
}

// A reload that withdraws an image's grant: the session opened before it keeps streaming, but no
// new connection joins it (demand connection, lane, files connection), and a fresh open of it
// is refused as for a missing image. A connection keeps its Hello's grant; joining is a new one.
TEST(ImageVisibilityTest, AReloadThatWithdrawsAGrantStopsConnectionsJoiningOpenSessions) {
  ::alarm(120);
  TempDir dir;
  const fs::path root = dir.path() / "images";
  ASSERT_NO_FATAL_FAILURE(MakeCheckpoint(root / "teamA" / "img", 4ull << 20, 1));
  ASSERT_NO_FATAL_FAILURE(MakeCheckpoint(root / "teamB" / "img", 1ull << 20, 2));
  ASSERT_EQ(::geteuid(), 0u) << "the rules below name uid 0";
  const fs::path rules = dir.path() / "image-access";
  const auto readable = fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                        fs::perms::others_read;
  WriteText(rules, "uid:0=teamA,teamB\n", readable);
  ServerProcess server(dir.path(), root,
                       {"--raw-chunk-size", "64K", "--image-access-file", rules.string()});
  ASSERT_TRUE(server.ready()) << server.Log();

  TestClient stream(server.unix_endpoint());
  ASSERT_TRUE(stream.Hello().ok());
  Result<wire::OpenImageReply> opened = stream.Open("teamA/img");
  ASSERT_TRUE(opened.ok()) << opened.status().ToString();
  TestClient other(server.unix_endpoint());
  ASSERT_TRUE(other.Hello().ok());
  Result<wire::OpenImageReply> other_opened = other.Open("teamB/img");
  ASSERT_TRUE(other_opened.ok()) << other_opened.status().ToString();
  {
    TestClient demand(server.unix_endpoint());
    EXPECT_TRUE(demand.Hello(opened->session(), opened->session_secret()).ok())
        << "before the reload, joining works";
  }

  WriteText(rules, "uid:0=teamB\n", readable);
  ASSERT_EQ(::kill(server.pid(), SIGHUP), 0);
  ASSERT_TRUE(server.LogShows({"image-access file " + rules.string() + " (1 rule)"}))
      << server.Log();

  TestClient demand(server.unix_endpoint());
  Result<wire::HelloReply> refused = demand.Hello(opened->session(), opened->session_secret());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("unknown session or wrong secret"), std::string::npos)
      << refused.status().ToString();
  TestClient lane(server.unix_endpoint());
  EXPECT_FALSE(lane.JoinAsLane(opened->session(), opened->session_secret()).ok());
  EXPECT_TRUE(server.LogShows({"outside the client's --image-access grant"})) << server.Log();
  // A session whose image the new rules still grant is joined as before.
  TestClient other_demand(server.unix_endpoint());
  EXPECT_TRUE(other_demand.Hello(other_opened->session(), other_opened->session_secret()).ok());
  // The open session itself goes on to the end of its stream, byte-exact.
  Result<Received> received = ReceiveStream(stream, 1u << 20);
  ASSERT_TRUE(received.ok()) << received.status().ToString();
  Result<std::map<BoKey, std::vector<uint8_t>>> expected = LoadCriuContents(root / "teamA" / "img");
  ASSERT_TRUE(expected.ok()) << expected.status().ToString();
  Status verified = VerifyStream(*opened, received->chunks, *expected);
  EXPECT_TRUE(verified.ok()) << verified.ToString();
  TestClient reopen(server.unix_endpoint());
  ASSERT_TRUE(reopen.Hello().ok());
  EXPECT_FALSE(reopen.Open("teamA/img").ok());
  ::alarm(0);
}

// A restore that loses its connection after a reload withdrew its image's grant: its reconnection
// opens the image afresh under the rules now in place and is refused, so the restore fails at
// once with an error naming the image instead of retrying or finishing under the old grant.
TEST(ImageVisibilityTest, ARestoreReconnectingAfterItsGrantWasWithdrawnFails) {
  ::alarm(120);
  TempDir dir;
  const fs::path root = dir.path() / "images";
  ASSERT_NO_FATAL_FAILURE(MakeCheckpoint(root / "teamA" / "img", 4ull << 20, 1));
  ASSERT_EQ(::geteuid(), 0u) << "the rules below name uid 0";
  const fs::path rules = dir.path() / "image-access";
  const auto readable = fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                        fs::perms::others_read;
  WriteText(rules, "uid:0=teamA\n", readable);
  ServerProcess server(dir.path(), root,
                       {"--raw-chunk-size", "64K", "--image-access-file", rules.string()});
  ASSERT_TRUE(server.ready()) << server.Log();
  ::gpulazy::testing::UnixRelay relay(dir.path() / "relay.sock", server.socket_path());
  client::HostCopyEngine engine;
  client::SessionOptions options;
  options.endpoint = "unix:" + (dir.path() / "relay.sock").string();
  options.image = "teamA/img";
  options.stream_all = false;  // nothing lands unless asked for
  options.read_files = false;  // every byte through the connections the relay cuts
  options.reconnect.max_attempts = 20;
  options.reconnect.initial_backoff = 10ms;
  options.reconnect.max_backoff = 50ms;
  client::RestoreSession session(options, engine);
  ASSERT_TRUE(session.Start().ok());
  ASSERT_TRUE(session.Ensure(0, 0, session.chunk_size(), 10s).ok()) << session.status().ToString();

  WriteText(rules, "uid:0=teamB\n", readable);
  ASSERT_EQ(::kill(server.pid(), SIGHUP), 0);
  ASSERT_TRUE(server.LogShows({"image-access file " + rules.string() + " (1 rule)"}))
      << server.Log();
  relay.Cut(/*server_notices=*/true);
  const client::BoEntry& last = session.bos().back();
  const auto asked = std::chrono::steady_clock::now();
  Status ensured =
      session.Ensure(static_cast<uint32_t>(session.bos().size() - 1), last.size - 1, 1, 30s);
  EXPECT_LT(std::chrono::steady_clock::now() - asked, 20s) << "failed only at its deadline";
  ASSERT_FALSE(ensured.ok());
  EXPECT_EQ(session.status().code(), Code::kNotFound) << session.status().ToString();
  EXPECT_NE(session.status().message().find("teamA/img"), std::string::npos)
      << session.status().ToString();
  EXPECT_EQ(session.progress().reconnects, 0u);
  ::alarm(0);
}

TEST(ConfinementTest, EveryFileIsResolvedBeneathTheImageRoot) {
  ::alarm(120);
  TempDir dir;
  const fs::path root = dir.path() / "images";
  const fs::path outside = dir.path() / "outside";
  ASSERT_NO_FATAL_FAILURE(MakeCheckpoint(outside / "img", 1ull << 20, 4));
  ASSERT_NO_FATAL_FAILURE(MakeCheckpoint(root / "good", 1ull << 20, 5));
  // Image directories that are symlinks out of the root, absolute and relative.
  fs::create_directory_symlink(outside / "img", root / "abs-link");
  fs::create_directory_symlink("../outside/img", root / "rel-link");
  // A valid image whose every file is a symlink to the (identical) files outside the root:
  // served, it would be byte-perfect, so only confinement refuses it.
  fs::create_directory(root / "file-links");
  for (const fs::directory_entry& entry : fs::directory_iterator(outside / "img"))
    fs::create_symlink(entry.path(), root / "file-links" / entry.path().filename());
  // ... and one whose files link to a sibling inside the same image, which stays allowed.
  ASSERT_NO_FATAL_FAILURE(MakeCheckpoint(root / "inner-links", 1ull << 20, 6));
  for (const fs::directory_entry& entry : fs::directory_iterator(root / "inner-links")) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with("amdgpu-pages-")) continue;
    fs::rename(entry.path(), root / "inner-links" / ("real-" + name));
    fs::create_symlink("real-" + name, entry.path());
  }

  ServerProcess server(dir.path(), root, {"--raw-chunk-size", "64K"});
  ASSERT_TRUE(server.ready()) << server.Log();
  auto open = [&](const std::string& image) -> Status {
    TestClient client(server.unix_endpoint());
    Result<wire::HelloReply> hello = client.Hello();
    if (!hello.ok()) return hello.status();
    return client.Open(image).status();
  };
  EXPECT_TRUE(open("good").ok());
  EXPECT_TRUE(open("inner-links").ok()) << server.Log();
  for (const std::string& image : std::vector<std::string>{
           "abs-link", "rel-link", "file-links", "../outside/img", "good/../../outside/img",
           (outside / "img").string(), "/etc", "good/../good"}) {
    Status status = open(image);
    EXPECT_FALSE(status.ok()) << image;
    EXPECT_NE(status.message().find("ERROR_NOT_FOUND"), std::string::npos)
        << image << ": " << status.ToString();
    // Nothing says where the root is, or why (beyond echoing the name the client sent).
    EXPECT_EQ(status.message().find(root.string()), std::string::npos) << status.message();
    if (image.find(outside.string()) == std::string::npos) {
      EXPECT_EQ(status.message().find(outside.string()), std::string::npos) << status.message();
    }
  }
  EXPECT_NE(server.Log().find("resolves outside"), std::string::npos) << server.Log();
  ::alarm(0);
}

TEST(ServerLimitsTest, AClientThatStopsReadingIsDroppedAfterTheWriteTimeout) {
  ::alarm(120);
  TempDir dir;
  const fs::path root = dir.path() / "images";
  // Far more than the socket buffers on both ends hold (4 MiB each way at most).
  ASSERT_NO_FATAL_FAILURE(MakeCheckpoint(root / "big", 48ull << 20, 8));
  ServerProcess server(dir.path(), root,
                       {"--raw-chunk-size", "1M", "--write-timeout", "1", "--idle-timeout", "600"});
  ASSERT_TRUE(server.ready()) << server.Log();
  TestClient client(server.unix_endpoint());
  ASSERT_TRUE(client.Hello().ok());
  ASSERT_TRUE(client.Open("big").ok());
  ASSERT_TRUE(client.Credit(1ull << 40).ok());
  ASSERT_TRUE(client.StreamAll().ok());
  // We read nothing. The server's log line is the event; poll for it with a generous deadline.
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (server.Log().find("the client stopped reading") == std::string::npos &&
         std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(50ms);
  EXPECT_NE(server.Log().find("the client stopped reading"), std::string::npos) << server.Log();
  // What was in flight drains, then the connection is closed.
  EXPECT_TRUE(client.WaitClosed(30s));
  // The server closes the socket before it ends the session: poll for the count to drop.
  TestClient other(server.unix_endpoint());
  ASSERT_TRUE(other.Hello().ok());
  Result<std::string> stats = other.Stats();
  const auto closed_deadline = std::chrono::steady_clock::now() + 10s;
  while (stats.ok() && stats->find("\"sessions_open\":0") == std::string::npos &&
         std::chrono::steady_clock::now() < closed_deadline) {
    std::this_thread::sleep_for(20ms);
    stats = other.Stats();
  }
  ASSERT_TRUE(stats.ok()) << stats.status().ToString();
  EXPECT_NE(stats->find("\"sessions_open\":0"), std::string::npos) << *stats;
  ::alarm(0);
}

TEST(ServerLimitsTest, ConnectionsPastTheLimitAreRefused) {
  ::alarm(120);
  TempDir dir;
  const fs::path root = dir.path() / "images";
  fs::create_directories(root);
  ServerProcess server(dir.path(), root, {"--max-connections", "1"});
  ASSERT_TRUE(server.ready()) << server.Log();
  TestClient first(server.unix_endpoint());
  ASSERT_TRUE(first.Hello().ok());
  TestClient second(server.unix_endpoint());
  Result<Frame> refusal = second.Read();
  ASSERT_TRUE(refusal.ok()) << refusal.status().ToString();
  ASSERT_TRUE(refusal->header.has_error());
  EXPECT_EQ(refusal->header.error().code(), wire::ERROR_LIMIT);
  EXPECT_TRUE(second.WaitClosed());
  ::alarm(0);
}

TEST(ServerLimitsTest, IdleConnectionsAreClosed) {
  ::alarm(120);
  TempDir dir;
  const fs::path root = dir.path() / "images";
  fs::create_directories(root);
  ServerProcess server(dir.path(), root, {"--idle-timeout", "1"});
  ASSERT_TRUE(server.ready()) << server.Log();
  TestClient client(server.unix_endpoint());
  ASSERT_TRUE(client.Hello().ok());
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(client.WaitClosed(30s));
  EXPECT_NE(server.Log().find("idle for"), std::string::npos) << server.Log();
  // Well before the 10 s Hello timeout, which must not hold the idle deadline back.
  EXPECT_LT(std::chrono::steady_clock::now() - start, 8s);
  ::alarm(0);
}

}  // namespace
}  // namespace gpulazy::server::testing
