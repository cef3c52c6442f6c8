// Two hosts on one machine (issue 7): gpulazy-server in one network namespace, `gpulazy-client
// fetch` in another, joined by a veth pair the test makes itself. The server's side of the link
// is slowed down (netem delay + loss where the kernel has sch_netem, else a tbf rate limit),
// and the link is cut and restored while the fetch runs. The fetch must finish and reproduce
// every pages file byte for byte.
//
// Needs root and iproute2 (`ip`, `tc`); skips, saying why, where namespaces cannot be made.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "lazy-server/image/synth.h"
#include "tests/support/temp_dir.h"

namespace gpulazy {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using testing::TempDir;

// Runs a shell command; returns its exit status (-1 if it did not exit normally).
int Shell(const std::string& command) {
  const int status = std::system((command + " >/dev/null 2>&1").c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::vector<uint8_t> ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(in), {});
}

std::map<std::string, std::vector<uint8_t>> PagesFiles(const fs::path& dir) {
  std::map<std::string, std::vector<uint8_t>> files;
  if (!fs::exists(dir)) return files;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("amdgpu-pages-", 0) == 0) files[name] = ReadFile(entry.path());
  }
  return files;
}

// Two namespaces joined by a veth pair; removed (with the pair) on destruction.
class TwoHosts {
 public:
  TwoHosts() {
    const std::string id = std::to_string(::getpid() % 100000);
    server_ns_ = "gpulazy-srv-" + id;
    client_ns_ = "gpulazy-cli-" + id;
    server_if_ = "gls" + id;
    client_if_ = "glc" + id;
    const std::vector<std::string> steps = {
        "ip netns add " + server_ns_,
        "ip netns add " + client_ns_,
        "ip link add " + server_if_ + " type veth peer name " + client_if_,
        "ip link set " + server_if_ + " netns " + server_ns_,
        "ip link set " + client_if_ + " netns " + client_ns_,
        "ip -n " + server_ns_ + " addr add " + kServerIp + "/30 dev " + server_if_,
        "ip -n " + client_ns_ + " addr add " + kClientIp + "/30 dev " + client_if_,
        "ip -n " + server_ns_ + " link set lo up",
        "ip -n " + client_ns_ + " link set lo up",
        "ip -n " + server_ns_ + " link set " + server_if_ + " up",
        "ip -n " + client_ns_ + " link set " + client_if_ + " up",
    };
    for (const std::string& step : steps) {
      if (Shell(step) != 0) {
        error_ = "could not run: " + step;
        return;
      }
    }
    ok_ = true;
  }
  ~TwoHosts() {
    Shell("ip netns del " + server_ns_);
    Shell("ip netns del " + client_ns_);
  }
  bool ok() const { return ok_; }
  const std::string& error() const { return error_; }
  std::string InServer(const std::string& command) const {
    return "ip netns exec " + server_ns_ + " " + command;
  }
  std::string InClient(const std::string& command) const {
    return "ip netns exec " + client_ns_ + " " + command;
  }
  // Impairs the server's egress (the direction the pages flow). Returns what was applied.
  std::string Impair() const {
    const std::string dev = "ip netns exec " + server_ns_ + " tc qdisc add dev " + server_if_;
    if (Shell(dev + " root netem delay 10ms 5ms loss 1% rate 400mbit") == 0)
      return "netem delay 10ms +-5ms, loss 1%, rate 400mbit";
    if (Shell(dev + " root tbf rate 400mbit burst 256kb latency 50ms") == 0)
      return "tbf rate 400mbit (sch_netem is not available in this kernel)";
    return "none (neither netem nor tbf is available)";
  }
  bool SetLink(bool up) const {
    return Shell("ip -n " + client_ns_ + " link set " + client_if_ + (up ? " up" : " down")) == 0;
  }

  static constexpr const char* kServerIp = "10.203.7.1";
  static constexpr const char* kClientIp = "10.203.7.2";

 private:
  bool ok_ = false;
  std::string error_;
  std::string server_ns_, client_ns_, server_if_, client_if_;
};

TEST(TwoHosts, FetchSurvivesImpairedLinkAndACutByteExact) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root for network namespaces";
  if (Shell("command -v ip") != 0) GTEST_SKIP() << "needs iproute2 (ip, tc)";
  TwoHosts hosts;
  if (!hosts.ok()) GTEST_SKIP() << "network namespaces unavailable: " << hosts.error();

  TempDir root;
  TempDir run;
  const fs::path img = root.path() / "img";
  image::SynthOptions synth;
  synth.out = img;
  synth.gpus = 2;
  synth.processes = 2;
  synth.bos = 8;
  synth.total_bytes = 48ull << 20;
  synth.seed = 77;
  ASSERT_TRUE(image::SynthesizeCheckpoint(synth).ok());
  const auto source = PagesFiles(img);
  ASSERT_FALSE(source.empty());
  const std::string impairment = hosts.Impair();

  const std::string bin = GPULAZY_BIN_DIR;
  const fs::path ready = run.path() / "ready";
  const fs::path server_log = run.path() / "server.log";
  const std::string listen = std::string("tcp:") + TwoHosts::kServerIp + ":7741";
  const pid_t server = ::fork();
  ASSERT_GE(server, 0);
  if (server == 0) {
    const std::string command = hosts.InServer(
        bin + "/gpulazy-server --images " + root.path().string() + " --listen " + listen +
        " --insecure-tcp --ready-file " + ready.string() + " >" + server_log.string() + " 2>&1");
    ::execl("/bin/sh", "sh", "-c", ("exec " + command).c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  for (int i = 0; i < 200 && !fs::exists(ready); ++i)
    std::this_thread::sleep_for(50ms);
  auto log = [&] {
    std::ifstream in(server_log);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  ASSERT_TRUE(fs::exists(ready)) << log();

  // The fetch, in the client namespace; `timeout` keeps a hung client from hanging the suite.
  const fs::path out = run.path() / "out";
  const fs::path client_out = run.path() / "client.out";
  const std::string fetch = hosts.InClient(
      "timeout 180 " + bin + "/gpulazy-client fetch --insecure --json --server " + listen +
      " --image img --out " + out.string() + " >" + client_out.string() + " 2>&1");
  const auto start = std::chrono::steady_clock::now();
  int fetch_status = -1;
  std::thread client([&] {
    const int status = std::system(fetch.c_str());
    fetch_status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  });

  // Cut the link for 3 s once the fetch is under way, then restore it.
  std::this_thread::sleep_for(500ms);
  const bool cut = hosts.SetLink(false);
  std::this_thread::sleep_for(3s);
  const bool restored = hosts.SetLink(true);
  client.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ::kill(server, SIGTERM);
  int status = 0;
  ::waitpid(server, &status, 0);

  std::ifstream summary_in(client_out);
  const std::string summary(std::istreambuf_iterator<char>(summary_in), {});
  EXPECT_TRUE(cut);
  EXPECT_TRUE(restored);
  ASSERT_EQ(fetch_status, 0) << summary << "\n" << log();
  const auto fetched = PagesFiles(out);
  ASSERT_EQ(fetched.size(), source.size());
  for (const auto& [name, bytes] : source) {
    auto it = fetched.find(name);
    ASSERT_NE(it, fetched.end()) << name;
    EXPECT_TRUE(it->second == bytes) << name << " differs";
  }
  std::printf(
      "two hosts: %llu MiB over veth with %s and a 3 s link cut: byte-exact in %.1f s; "
      "client summary: %s\n",
      static_cast<unsigned long long>(synth.total_bytes >> 20), impairment.c_str(), seconds,
      summary.c_str());
}

}  // namespace
}  // namespace gpulazy
