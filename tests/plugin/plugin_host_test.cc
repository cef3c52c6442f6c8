// The plugin-host test: runs gpulazy_criu_host_sim (criu_host_sim.cc), which dlopens the real
// gpulazy_plugin.so and drives it in CRIU's restore order with forked processes as restored
// tasks, against synthetic checkpoints, the fake KFD and the host engine. The simulator runs
// as a separate process: this binary links our protobuf code, and so does the plugin.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "lazy-server/child/server_child.h"
#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/io.h"
#include "lazy-server/image/lazy_image.h"
#include "lazy-server/image/synth.h"
#include "plugin/topology.h"
#include "proto/criu_file.h"
#include "tests/support/render_node_images.h"
#include "tests/support/temp_dir.h"
#include "tests/support/test_pki.h"

namespace gpulazy::plugin {
namespace {
namespace fs = std::filesystem;
using namespace std::chrono_literals;

struct Outcome {
  int exit_code = -1;  // -1: killed (timeout or signal)
  std::string output;
};

// Runs argv with exactly `env`, stdout and stderr into `log`; kills it after `timeout`.
pid_t Spawn(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env,
            const fs::path& log) {
  pid_t pid = ::fork();
  if (pid != 0) return pid;
  int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) {
    ::dup2(fd, 1);
    ::dup2(fd, 2);
  }
  std::vector<std::string> envs;
  for (const auto& [k, v] : env)
    envs.push_back(k + "=" + v);
  std::vector<char*> a, e;
  for (const std::string& s : argv)
    a.push_back(const_cast<char*>(s.c_str()));
  for (const std::string& s : envs)
    e.push_back(const_cast<char*>(s.c_str()));
  a.push_back(nullptr);
  e.push_back(nullptr);
  ::execve(a[0], a.data(), e.data());
  ::_exit(127);
}

int WaitBounded(pid_t pid, std::chrono::seconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(20ms);
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string Slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

class PluginHostTest : public ::testing::Test {
 protected:
  // A checkpoint of `processes` processes at dir/ckpt, a fake KFD at dir/kfd whose topology
  // matches it, and the --expect file the simulator's tasks compare against.
  // `where` defaults to the image directory; the dump test puts it where the fake KFD keeps
  // the "live" process state.
  void Make(uint32_t processes, uint64_t bytes_per_process = 4u << 20, fs::path where = {},
            uint32_t bos_per_process = 8) {
    if (where.empty()) where = images_;
    image::SynthOptions o;
    o.out = where;
    o.gpus = 2;
    o.bos = bos_per_process;
    o.total_bytes = processes * bytes_per_process;
    o.seed = 7;
    o.processes = processes;
    auto report = image::SynthesizeCheckpoint(o);
    ASSERT_TRUE(report.ok()) << report.status().ToString();
    auto cp = image::CriuCheckpoint::Open(where);
    ASSERT_TRUE(cp.ok()) << cp.status().ToString();
    const criu::KfdProcess& first = cp->processes().front().message;
    devices_.assign(first.devices().begin(), first.devices().end());
    ASSERT_TRUE(WriteFakeTopology(dir_ / "kfd" / "topology", devices_).ok());
    std::map<uint32_t, const criu::KfdProcess*> by_file;
    for (const auto& p : cp->processes())
      by_file[p.file_id] = &p.message;
    std::ofstream expect(dir_ / "expect");
    for (const image::ContentBo& bo : cp->content_bos())
      expect << bo.process_id << " " << bo.bo_index << " " << bo.size << " "
             << by_file.at(bo.process_id)->bos(static_cast<int>(bo.bo_index)).mmap_offset() << " "
             << (where / bo.pages_file).string() << " "
             << criu_format::kHeaderSize + bo.pages_offset << " "
             << by_file.at(bo.process_id)->bos(static_cast<int>(bo.bo_index)).gpu_va() << "\n";
    ASSERT_TRUE(expect.good());
    ASSERT_GT(cp->content_bos().size(), 0u);
  }

  Outcome Sim(const std::vector<std::string>& tasks, std::map<std::string, std::string> env,
              const std::string& order = "criu", const std::vector<std::string>& extra = {}) {
    std::ofstream(dir_ / "empty.conf").flush();  // no /etc/gpulazy/plugin.conf leaks in
    std::map<std::string, std::string> full = {
        {"PATH", "/usr/bin:/bin"},
        {"GPULAZY_CONFIG", (dir_ / "empty.conf").string()},
        {"GPULAZY_FAKE_KFD", (dir_ / "kfd").string()},
        {"GPULAZY_TOPOLOGY", (dir_ / "kfd" / "topology").string()},
        {"GPULAZY_FAULT_SOCKET", (dir_ / "fault.sock").string()},
        {"GPULAZY_RESUME_TIMEOUT_MS", "60000"},
    };
    for (auto& [k, v] : env)
      full[k] = v;
    std::vector<std::string> argv = {GPULAZY_CRIU_HOST_SIM,
                                     "--plugin",
                                     GPULAZY_PLUGIN_SO,
                                     "--images",
                                     images_.string(),
                                     "--order",
                                     order};
    if (fs::exists(dir_ / "expect")) {
      argv.push_back("--expect");
      argv.push_back((dir_ / "expect").string());
    }
    for (const std::string& t : tasks) {
      argv.push_back("--task");
      argv.push_back(t);
    }
    argv.insert(argv.end(), extra.begin(), extra.end());
    fs::path log = dir_ / "sim.log";
    Outcome out;
    out.exit_code = WaitBounded(Spawn(argv, full, log), 200s);
    out.output = Slurp(log);
    if (std::getenv("GPULAZY_SIM_LOG") != nullptr) std::cerr << out.output;  // debugging aid
    return out;
  }

  // A gpulazy-server process serving dir_ on a Unix socket; nothing (and a failure) when it
  // did not start.
  std::optional<server::ServerChild> StartServer() {
    return StartServerOn("unix:" + server_socket(), {});
  }
  // The same on `listen`, with extra arguments; *bound gets the first endpoint the server
  // reports in its ready file (the port it chose for tcp:HOST:0).
  std::optional<server::ServerChild> StartServerOn(const std::string& listen,
                                                   const std::vector<std::string>& extra,
                                                   std::string* bound = nullptr,
                                                   const std::string& log_level = "info") {
    server::ServerChildOptions options;
    options.binary = fs::path(GPULAZY_BIN_DIR) / "gpulazy-server";
    options.root = dir_.path();
    options.run_dir = dir_.path();
    options.log_level = log_level;  // "info", the server's default: tests look for its lines
    options.listen = {listen};
    options.extra_args = extra;
    options.ready_timeout = 30s;
    Result<server::ServerChild> child = server::ServerChild::Start(options);
    EXPECT_TRUE(child.ok()) << child.status().ToString() << "\n"
                            << Slurp(server::ServerChild::LogPath(options));
    if (!child.ok()) return std::nullopt;
    if (bound != nullptr) *bound = child->endpoints().front();
    return std::move(*child);
  }
  void StopServer(server::ServerChild& server) {
    ::kill(server.pid(), SIGCONT);  // in case a failing simulator left it stopped
    EXPECT_EQ(server.Terminate(20s), 0) << Slurp(server.log_path());
  }
  std::string server_socket() const { return (dir_ / "srv.sock").string(); }

  gpulazy::testing::TempDir dir_;
  fs::path images_ = dir_ / "ckpt";
  std::vector<criu::KfdDevice> devices_;
};

// ---- byte-exact contents: mode x {one process, a two-process tree} ----

struct Case {
  const char* mode;
  uint32_t processes;
  const char* order;  // the simulator's --order: when tasks restore files vs. POST_FORKING
};

class ContentsTest : public PluginHostTest, public ::testing::WithParamInterface<Case> {};

TEST_P(ContentsTest, BosMatchThePagesFiles) {
  ASSERT_NO_FATAL_FAILURE(Make(GetParam().processes));
  std::vector<std::string> tasks;
  for (uint32_t i = 1; i <= GetParam().processes; ++i)
    tasks.push_back(std::to_string(i));
  Outcome out = Sim(tasks, {{"GPULAZY_MODE", GetParam().mode}}, GetParam().order);
  EXPECT_EQ(out.exit_code, 0) << out.output;
  EXPECT_NE(out.output.find("sim: ok"), std::string::npos) << out.output;
  EXPECT_NE(out.output.find("claimed: amdgpu_plugin gpulazy_plugin"), std::string::npos)
      << out.output;
  // The in-process server runs inside the host: its handlers stay, our threads block signals.
  EXPECT_NE(out.output.find("signals: host handlers untouched"), std::string::npos) << out.output;
}

// ---- render-node files: a task with a KFD file and a render-node file (upstream format) ----

struct RenderCase {
  const char* mode;
  bool render_first;  // RESTORE_EXT_FILE for the render node before the task's KFD file
};

class RenderNodeHostTest : public PluginHostTest,
                           public ::testing::WithParamInterface<RenderCase> {};

TEST_P(RenderNodeHostTest, RenderNodeFdAndBosBesideByteExactKfdContents) {
  ASSERT_NO_FATAL_FAILURE(Make(2));
  const fs::path dri = dir_ / "dri";
  fs::create_directories(dri);
  for (const auto& d : devices_)
    std::ofstream(dri / ("renderD" + std::to_string(d.drm_render_minor()))) << "node\n";
  std::ofstream expect(dir_ / "expect-drm");
  for (uint32_t p = 1; p <= 2; ++p) {
    using gpulazy::testing::RenderBoSpec;
    const uint32_t id = 100 + p;
    const criu::RenderNode node = gpulazy::testing::MakeRenderNode(
        id, devices_[p - 1].gpu_id(), 200 + p,
        {RenderBoSpec{64 << 10, criu_format::kGemDomainVram, 7, 0x7f0000000000ull},
         RenderBoSpec{8 << 10, criu_format::kGemDomainGtt, 2, 0x7f0000100000ull},
         RenderBoSpec{4 << 10, 0x1 /* CPU: no contents */, 1, 0}});
    gpulazy::testing::WriteRenderNodeImages(images_, node, p);
    for (int i = 0; i < 2; ++i)
      expect << id << " " << node.bos(i).handle() << " " << node.bos(i).size() << " "
             << node.bos(i).gpu_va() << " " << node.bos(i).mmap_offset() << " "
             << (images_ / criu_format::DrmPagesImageName(id, 200 + p, static_cast<uint32_t>(i)))
                    .string()
             << "\n";
  }
  expect.close();
  Outcome out =
      Sim({"1", "2"}, {{"GPULAZY_MODE", GetParam().mode}, {"GPULAZY_DRI_ROOT", dri}}, "criu",
          {"--render", "1:101", "--render", "2:102", "--render-first",
           GetParam().render_first ? "1" : "0", "--expect-drm", (dir_ / "expect-drm").string()});
  EXPECT_EQ(out.exit_code, 0) << out.output;
  EXPECT_NE(out.output.find("sim: ok"), std::string::npos) << out.output;
  for (const char* node : {"render node 101: ", "render node 102: "})
    EXPECT_NE(out.output.find(node), std::string::npos) << node << "\n" << out.output;
  EXPECT_NE(out.output.find((dri / "renderD").string()), std::string::npos) << out.output;
}

INSTANTIATE_TEST_SUITE_P(Modes, RenderNodeHostTest,
                         ::testing::Values(RenderCase{"eager", false}, RenderCase{"eager", true},
                                           RenderCase{"parallel", false},
                                           RenderCase{"parallel", true}, RenderCase{"lazy", false},
                                           RenderCase{"lazy", true}),
                         [](const ::testing::TestParamInfo<RenderCase>& info) {
                           return std::string(info.param.mode) +
                                  (info.param.render_first ? "_RenderFirst" : "_KfdFirst");
                         });

// A render-node file whose GPU the checkpoint does not have fails in the task, naming it.
TEST_F(PluginHostTest, RenderNodeOfAnUnknownGpuFailsRestoreExtFile) {
  ASSERT_NO_FATAL_FAILURE(Make(1));
  gpulazy::testing::WriteRenderNodeImages(
      images_, gpulazy::testing::MakeRenderNode(101, 0xdead, 200, {{}}), 1);
  std::ofstream(dir_ / "expect-drm") << "101 1 4096 0 0 /nonexistent\n";
  Outcome out = Sim({"1"}, {{"GPULAZY_MODE", "parallel"}}, "criu",
                    {"--render", "1:101", "--expect-drm", (dir_ / "expect-drm").string()});
  EXPECT_NE(out.exit_code, 0) << out.output;
  EXPECT_NE(out.output.find("RESTORE_EXT_FILE(render 101) = -5"), std::string::npos) << out.output;
  EXPECT_NE(out.output.find("amdgpu-renderD-101.img: gpu 0xdead"), std::string::npos) << out.output;
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (const char* mode : {"eager", "parallel", "lazy"}) {
    cases.push_back({mode, 1, "criu"});
    for (const char* order : {"criu", "tasks-first", "concurrent"})
      cases.push_back({mode, 2, order});
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Modes, ContentsTest, ::testing::ValuesIn(AllCases()),
                         [](const auto& info) {
                           std::string name = std::string(info.param.mode) + "_" +
                                              std::to_string(info.param.processes) + "proc_" +
                                              info.param.order;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

// The same against a real gpulazy-server process instead of the in-process one.
class RealServerTest : public PluginHostTest, public ::testing::WithParamInterface<const char*> {};

TEST_P(RealServerTest, TreeRestoresFromGpulazyServer) {
  ASSERT_NO_FATAL_FAILURE(Make(2));
  auto server = StartServer();
  ASSERT_TRUE(server);
  Outcome out = Sim({"1", "2"},
                    {{"GPULAZY_MODE", GetParam()}, {"GPULAZY_SERVER", "unix:" + server_socket()}});
  StopServer(*server);
  EXPECT_EQ(out.exit_code, 0) << out.output;
  EXPECT_NE(out.output.find("sim: ok"), std::string::npos) << out.output;
}

INSTANTIATE_TEST_SUITE_P(Modes, RealServerTest, ::testing::Values("eager", "parallel", "lazy"));

// A process with thousands of BOs, as real ROCm processes have: more than a protocol version 1
// OpenImageReply could list, so this restore needs version 2's image table.
TEST_F(PluginHostTest, ThousandsOfBosRestoreLazilyFromARealServer) {
  // The fake KFD's dmabufs and the host engine's memfds: a descriptor or two per BO.
  Result<uint64_t> fds = RaiseOpenFileLimit();
  ASSERT_TRUE(fds.ok()) << fds.status().ToString();
  ASSERT_GT(*fds, 8000u) << "RLIMIT_NOFILE's hard limit is too low for this test";
  ASSERT_NO_FATAL_FAILURE(Make(1, 24u << 20, {}, 3000));
  auto cp = image::CriuCheckpoint::Open(images_);
  ASSERT_TRUE(cp.ok());
  ASSERT_GT(cp->content_bos().size(), 2000u);
  auto server = StartServer();
  ASSERT_TRUE(server);
  Outcome out =
      Sim({"1"}, {{"GPULAZY_MODE", "lazy"}, {"GPULAZY_SERVER", "unix:" + server_socket()}});
  StopServer(*server);
  EXPECT_EQ(out.exit_code, 0) << out.output.substr(0, 20000);
  EXPECT_NE(out.output.find("sim: ok"), std::string::npos) << out.output.substr(0, 20000);
}

// ---- a task dying mid-restore ----
//
// The server is stopped right after POST_FORKING, so with a 2 MiB credit window at most a few
// MiB of the 32 MiB image have arrived when the second task is SIGKILLed (after it handed its
// BOs over). It passes no image files: a client holding them reads every chunk itself, without
// the server, and on a fast host had the whole image before the stop (1 run in 384 on 16 cores).
// Upstream CRIU fails the whole restore on such a death (its SIGCHLD handler aborts, then
// exit(RESTORE, -1)); the plugin must then return from exit at once. Should the host go on
// regardless, RESUME_DEVICES_LATE of the dead task fails naming it, and the other task still
// resumes with byte-exact contents: the dead task's BOs leave the stream.

class TaskDeathTest : public PluginHostTest, public ::testing::WithParamInterface<const char*> {
 protected:
  Outcome KillSecondTask(const std::string& on_death) {
    Make(2, 16u << 20);
    auto server = StartServerOn("unix:" + server_socket(), {"--no-pass-files"});
    if (!server) return {};
    Outcome out =
        Sim({"1", "2"},
            {{"GPULAZY_MODE", GetParam()},
             {"GPULAZY_SERVER", "unix:" + server_socket()},
             {"GPULAZY_WINDOW", std::to_string(2u << 20)}},
            "criu",
            {"--stop-pid", std::to_string(server->pid()), "--kill", "1", "--on-death", on_death});
    StopServer(*server);
    return out;
  }
};

TEST_P(TaskDeathTest, OtherTaskFinishesByteExactAndTheDeadOneFailsItsResume) {
  Outcome out = KillSecondTask("continue");
  EXPECT_EQ(out.exit_code, 0) << out.output;
  EXPECT_NE(out.output.find("sim: ok"), std::string::npos) << out.output;
  // The master noticed by itself (pidfd) and named the task; its resume fails with -ECANCELED.
  EXPECT_NE(out.output.find("(amdgpu-kfd-2.img) died during restore"), std::string::npos)
      << out.output;
  EXPECT_NE(out.output.find(" = " + std::to_string(-ECANCELED) + " (killed task)"),
            std::string::npos)
      << out.output;
  // What had not arrived of the dead task's BOs was never fetched (the server was stopped
  // before a few MiB of the image had come): the restore ends with less of the image received
  // than the whole. Copies of one chunk count once: a chunk the stream sent while the resuming
  // task's demand for it was on its way arrives twice (received_bytes counts both).
  std::smatch done;
  const std::regex summary(
      R"(restore of \S+ done: (\d+) of (\d+) bytes resident, (\d+) received \((\d+) of them )"
      R"(duplicates\), (\d+) of exited)");
  ASSERT_TRUE(std::regex_search(out.output, done, summary)) << out.output;
  const uint64_t resident = std::stoull(done[1]), total = std::stoull(done[2]);
  const uint64_t received = std::stoull(done[3]), duplicate = std::stoull(done[4]);
  const uint64_t abandoned = std::stoull(done[5]);
  EXPECT_GT(abandoned, 0u) << out.output;
  EXPECT_EQ(resident + abandoned, total) << out.output;
  ASSERT_LE(duplicate, received) << out.output;
  EXPECT_LT(received - duplicate, total) << out.output;
}

TEST_P(TaskDeathTest, CriuAbortsAndExitReturnsPromptly) {
  Outcome out = KillSecondTask("abort");
  EXPECT_EQ(out.exit_code, 0) << out.output;
  EXPECT_NE(out.output.find("sim: ok"), std::string::npos) << out.output;
  const size_t at = out.output.find("exit(RESTORE, -1) returned after ");
  ASSERT_NE(at, std::string::npos) << out.output;
  // Generous for a loaded machine; a hang would be the resume timeout (60 s) or the alarm.
  EXPECT_LT(std::stoll(out.output.substr(at + 33)), 20'000) << out.output;
}

INSTANTIATE_TEST_SUITE_P(Modes, TaskDeathTest, ::testing::Values("parallel", "lazy"));

// Lazy: a program that exits after its resume, while its BOs still stream, is no failure; its
// remaining BOs leave the stream and exit(RESTORE, 0) completes with the other task byte-exact.
TEST_F(PluginHostTest, LazyTaskExitingAfterResumeStopsItsStreamOnly) {
  ASSERT_NO_FATAL_FAILURE(Make(2, 16u << 20));
  auto server = StartServer();
  ASSERT_TRUE(server);
  Outcome out = Sim(
      {"1", "2"},
      {{"GPULAZY_MODE", "lazy"},
       {"GPULAZY_SERVER", "unix:" + server_socket()},
       {"GPULAZY_WINDOW", std::to_string(2u << 20)}},
      "criu",
      {"--stop-pid", std::to_string(server->pid()), "--kill", "1", "--on-death", "after-resume"});
  StopServer(*server);
  EXPECT_EQ(out.exit_code, 0) << out.output;
  EXPECT_NE(out.output.find("sim: ok"), std::string::npos) << out.output;
  EXPECT_NE(out.output.find("(amdgpu-kfd-2.img) exited;"), std::string::npos) << out.output;
  EXPECT_EQ(out.output.find("died during restore"), std::string::npos) << out.output;
}

// ---- the fault channel, end to end ----

// Lazy mode, server stopped: the tasks resume without their contents, then each asks the fault
// channel (the C library) for the last page of its last BO. While the server is stopped the
// first task's ensure times out (resume timeout 1.5 s) instead of answering; once the server
// goes on, ensure returns only when those bytes are in the BO (checked at once). Errors come
// back as -errno, and after exit the channel is closed.
// The server passes no image files: a client holding them reads a page it waits for from the
// files itself, without the server, so whether the page could arrive while the server was
// stopped would depend on whether the files had been passed before the stop (a TSan run
// caught the ensure answering early that way).
TEST_F(PluginHostTest, FaultChannelAnswersOnceResident) {
  ASSERT_NO_FATAL_FAILURE(Make(2, 16u << 20));
  auto server = StartServerOn("unix:" + server_socket(), {"--no-pass-files"});
  ASSERT_TRUE(server);
  Outcome out = Sim({"1", "2"},
                    {{"GPULAZY_MODE", "lazy"},
                     {"GPULAZY_SERVER", "unix:" + server_socket()},
                     {"GPULAZY_WINDOW", std::to_string(2u << 20)},
                     {"GPULAZY_RESUME_TIMEOUT_MS", "1500"}},
                    "criu", {"--stop-pid", std::to_string(server->pid()), "--fault-check", "1"});
  StopServer(*server);
  EXPECT_EQ(out.exit_code, 0) << out.output;
  EXPECT_NE(out.output.find("sim: ok"), std::string::npos) << out.output;
  size_t checked = 0;
  for (size_t at = 0; (at = out.output.find("byte-exact after ensure", at)) != std::string::npos;
       ++at)
    ++checked;
  EXPECT_EQ(checked, 2u) << out.output;
  // The first ensure found its range missing (the server was stopped until then).
  EXPECT_NE(out.output.find("fault channel: pid"), std::string::npos) << out.output;
  EXPECT_NE(out.output.find("waits for"), std::string::npos) << out.output;
  EXPECT_NE(out.output.find("timed out"), std::string::npos) << out.output;
}

// ---- dump, then restore what was dumped ----

// DUMP_EXT_FILE against the fake KFD, whose "live" process state is a known checkpoint: the
// driver sees PROCESS_INFO -> CHECKPOINT -> UNPAUSE, the images carry the same BO table and
// driver blob, the device entries describe the (fake) sysfs topology, a lazy image is written
// at exit, and restoring the dumped images gives the live contents back byte for byte.
// Dump reads BO contents back through the GPU's engine (an SDMA copy on hardware, where a
// dmabuf cannot be pread): asked for SDMA on the fake KFD, it fails in libdrm and says so,
// and the queues are still unpaused.
TEST_F(PluginHostTest, DumpReadsBackThroughTheConfiguredEngine) {
  const fs::path live = dir_ / "kfd" / "live";
  ASSERT_NO_FATAL_FAILURE(Make(1, 1u << 20, live));
  fs::create_directories(images_);
  Outcome dump = Sim({}, {{"GPULAZY_ENGINE", "sdma"}}, "criu", {"--dump", "5"});
  EXPECT_NE(dump.exit_code, 0) << dump.output;
  EXPECT_NE(dump.output.find("amdgpu_device_initialize"), std::string::npos) << dump.output;
  std::vector<std::string> op_logs;
  for (const fs::directory_entry& e : fs::directory_iterator(dir_ / "kfd"))
    if (e.path().filename().string().starts_with("ops-")) op_logs.push_back(Slurp(e.path()));
  ASSERT_EQ(op_logs.size(), 1u);
  EXPECT_EQ(op_logs[0], "PROCESS_INFO\nCHECKPOINT\nUNPAUSE\n");
}

TEST_F(PluginHostTest, DumpThenRestoreIsByteExact) {
  const fs::path live = dir_ / "kfd" / "live";
  ASSERT_NO_FATAL_FAILURE(Make(1, 4u << 20, live));
  fs::create_directories(images_);
  Outcome dump = Sim({}, {{"GPULAZY_LAZY_IMAGE", "1"}}, "criu", {"--dump", "5"});
  ASSERT_EQ(dump.exit_code, 0) << dump.output;
  EXPECT_NE(dump.output.find("DUMP_EXT_FILE(/dev/null) = " + std::to_string(-ENOTSUP)),
            std::string::npos)
      << dump.output;

  std::vector<std::string> op_logs;
  for (const fs::directory_entry& e : fs::directory_iterator(dir_ / "kfd"))
    if (e.path().filename().string().starts_with("ops-")) op_logs.push_back(Slurp(e.path()));
  ASSERT_EQ(op_logs.size(), 1u);
  EXPECT_EQ(op_logs[0], "PROCESS_INFO\nCHECKPOINT\nUNPAUSE\n");

  auto original = image::CriuCheckpoint::Open(live);
  auto dumped = image::CriuCheckpoint::Open(images_);
  ASSERT_TRUE(original.ok() && dumped.ok()) << dumped.status().ToString();
  ASSERT_EQ(dumped->processes().size(), 1u);
  EXPECT_EQ(dumped->processes()[0].file_id, 5u);
  const criu::KfdProcess& was = original->processes()[0].message;
  const criu::KfdProcess& now = dumped->processes()[0].message;
  EXPECT_EQ(now.driver_private(), was.driver_private());
  EXPECT_EQ(now.object_count(), was.object_count());
  ASSERT_EQ(now.bos_size(), was.bos_size());
  for (int i = 0; i < now.bos_size(); ++i) {
    EXPECT_EQ(now.bos(i).gpu_va(), was.bos(i).gpu_va()) << i;
    EXPECT_EQ(now.bos(i).size(), was.bos(i).size()) << i;
    EXPECT_EQ(now.bos(i).mmap_offset(), was.bos(i).mmap_offset()) << i;
    EXPECT_EQ(now.bos(i).alloc_flags(), was.bos(i).alloc_flags()) << i;
    EXPECT_EQ(now.bos(i).gpu_id(), was.bos(i).gpu_id()) << i;
  }
  ASSERT_EQ(now.devices_size(), was.devices_size());
  for (int i = 0; i < now.devices_size(); ++i) {
    // Every field as sysfs describes the GPU; node numbering and io links are the host's.
    criu::KfdDevice device = now.devices(i);
    device.set_node_id(was.devices(i).node_id());
    device.set_vram_public(was.devices(i).vram_public());
    *device.mutable_links() = was.devices(i).links();
    EXPECT_EQ(device.SerializeAsString(), was.devices(i).SerializeAsString())
        << device.ShortDebugString() << "\nvs\n"
        << was.devices(i).ShortDebugString();
  }
  EXPECT_TRUE(image::LazyImage::Exists(images_)) << dump.output;

  // The restored tasks compare with the live contents (the expect file points there), as file 5.
  std::ifstream in(dir_ / "expect");
  std::string line, rewritten;
  while (std::getline(in, line))
    rewritten += "5" + line.substr(line.find(' ')) + "\n";
  in.close();
  std::ofstream(dir_ / "expect") << rewritten;
  for (const char* mode : {"eager", "parallel", "lazy"}) {
    Outcome out = Sim({"5"}, {{"GPULAZY_MODE", mode}});
    EXPECT_EQ(out.exit_code, 0) << mode << "\n" << out.output;
    EXPECT_NE(out.output.find("sim: ok"), std::string::npos) << mode << "\n" << out.output;
  }
}

// ---- failures name their reason ----

// Past "is this ours?", a missing piece is a failure, not -ENOTSUP (which would send CRIU to
// the next plugin and hide the reason).
TEST_F(PluginHostTest, MissingTopologyFailsRestoreExtFileWithEio) {
  ASSERT_NO_FATAL_FAILURE(Make(1));
  Outcome out = Sim({"1"}, {{"GPULAZY_MODE", "parallel"},
                            {"GPULAZY_TOPOLOGY", (dir_ / "no-such-topology").string()}});
  EXPECT_NE(out.exit_code, 0) << out.output;
  EXPECT_NE(out.output.find("RESTORE_EXT_FILE(1) = " + std::to_string(-EIO)), std::string::npos)
      << out.output;
  EXPECT_NE(out.output.find("no KFD topology at"), std::string::npos) << out.output;
}

// Eager copies go through the engine the plugin makes for the GPU, not a plain write into the
// dmabuf (which real VRAM dmabufs refuse): asked for SDMA on the fake KFD, whose render node is
// a memfd, the task's copy must fail in libdrm, naming it -- with the default engine it passes.
TEST_F(PluginHostTest, EagerCopiesThroughTheConfiguredEngine) {
  ASSERT_NO_FATAL_FAILURE(Make(1));
  Outcome host = Sim({"1"}, {{"GPULAZY_MODE", "eager"}, {"GPULAZY_ENGINE", "host"}});
  EXPECT_EQ(host.exit_code, 0) << host.output;
  Outcome sdma = Sim({"1"}, {{"GPULAZY_MODE", "eager"}, {"GPULAZY_ENGINE", "sdma"}});
  EXPECT_NE(sdma.exit_code, 0) << sdma.output;
  EXPECT_NE(sdma.output.find("sim: FAIL task"), std::string::npos) << sdma.output;
  EXPECT_NE(sdma.output.find("amdgpu_device_initialize"), std::string::npos) << sdma.output;
}

TEST_F(PluginHostTest, ServerDownFailsEagerInTheTask) {
  ASSERT_NO_FATAL_FAILURE(Make(1));
  const std::string nowhere = "unix:" + (dir_ / "nobody.sock").string();
  Outcome out = Sim({"1"}, {{"GPULAZY_MODE", "eager"}, {"GPULAZY_SERVER", nowhere}});
  EXPECT_NE(out.exit_code, 0) << out.output;
  EXPECT_NE(out.output.find("sim: FAIL task"), std::string::npos) << out.output;
  EXPECT_NE(out.output.find("eager restore: page server " + nowhere), std::string::npos)
      << out.output;
}

TEST_F(PluginHostTest, ServerDownFailsParallelAtPostForking) {
  ASSERT_NO_FATAL_FAILURE(Make(1));
  const std::string nowhere = "unix:" + (dir_ / "nobody.sock").string();
  Outcome out = Sim({"1"}, {{"GPULAZY_MODE", "parallel"}, {"GPULAZY_SERVER", nowhere}});
  EXPECT_NE(out.exit_code, 0) << out.output;
  EXPECT_NE(out.output.find("sim: FAIL POST_FORKING"), std::string::npos) << out.output;
  EXPECT_NE(out.output.find("parallel restore: page server " + nowhere), std::string::npos)
      << out.output;
}

// The server answers, but does not have the image (or will not show it to this token): its
// ERROR_NOT_FOUND must fail POST_FORKING, not read as "nothing of ours to do", after which CRIU
// would resume the tasks with empty BOs.
TEST_F(PluginHostTest, ImageMissingOnTheServerFailsPostForking) {
  ASSERT_NO_FATAL_FAILURE(Make(1));
  auto server = StartServer();
  ASSERT_TRUE(server);
  for (const char* mode : {"parallel", "lazy"}) {
    SCOPED_TRACE(mode);
    Outcome out = Sim({"1"}, {{"GPULAZY_MODE", mode},
                              {"GPULAZY_SERVER", "unix:" + server_socket()},
                              {"GPULAZY_IMAGE", "no-such-image"}});
    EXPECT_NE(out.exit_code, 0) << out.output;
    EXPECT_NE(out.output.find("sim: FAIL POST_FORKING"), std::string::npos) << out.output;
    EXPECT_NE(out.output.find("image no-such-image"), std::string::npos) << out.output;
  }
  StopServer(*server);
}

TEST_F(PluginHostTest, WrongTopologyFailsRestoreExtFileNamingDeviceId) {
  ASSERT_NO_FATAL_FAILURE(Make(1));
  std::vector<criu::KfdDevice> other = devices_;
  for (criu::KfdDevice& d : other)
    d.set_device_id(d.device_id() ^ 0x1);
  ASSERT_TRUE(WriteFakeTopology(dir_ / "other-topology", other).ok());
  Outcome out = Sim({"1"}, {{"GPULAZY_MODE", "parallel"},
                            {"GPULAZY_TOPOLOGY", (dir_ / "other-topology").string()}});
  EXPECT_NE(out.exit_code, 0) << out.output;
  EXPECT_NE(out.output.find("sim: FAIL task"), std::string::npos) << out.output;
  EXPECT_NE(out.output.find("RESTORE_EXT_FILE"), std::string::npos) << out.output;
  EXPECT_NE(out.output.find("device_id"), std::string::npos) << out.output;
}

// ---- over TCP with TLS, against a real gpulazy-server ----
//
// The plugin's transport settings (server = tcp:..., tls_ca, tls_cert, tls_key, token_file,
// insecure_tcp) end to end: certificates made with the openssl CLI, a server with
// --tls-cert/--tls-key/--tls-client-ca and --token-file on tcp:127.0.0.1 (a port it picks), a
// lazy restore of a two-process tree byte-exact; then each thing that must stop it does, and
// says why.

class PluginTlsTest : public PluginHostTest {
 protected:
  void SetUp() override {
    ASSERT_TRUE(pki_.ok()) << pki_.log();
    ASSERT_NO_FATAL_FAILURE(Make(2));
    std::ofstream(token_) << "plugin-s3cret\n";
    fs::permissions(token_, fs::perms::owner_read | fs::perms::owner_write);
  }
  // A server speaking mutual TLS and requiring the token on tcp:127.0.0.1; *endpoint gets its
  // address.
  std::optional<server::ServerChild> StartTlsServer(std::string* endpoint) {
    return StartServerOn("tcp:127.0.0.1:0",
                         {"--tls-cert", pki_.pem("server"), "--tls-key", pki_.key("server"),
                          "--tls-client-ca", pki_.pem("ca"), "--token-file", token_.string()},
                         endpoint, "debug");
  }
  // Environment for a lazy restore from `endpoint` with the client certificate, CA `ca`.
  std::map<std::string, std::string> TlsEnv(const std::string& endpoint, const std::string& ca) {
    return {{"GPULAZY_MODE", "lazy"},
            {"GPULAZY_SERVER", endpoint},
            {"GPULAZY_TLS_CA", pki_.pem(ca)},
            {"GPULAZY_TLS_CERT", pki_.pem("node7")},
            {"GPULAZY_TLS_KEY", pki_.key("node7")},
            {"GPULAZY_TOKEN_FILE", token_.string()}};
  }

  gpulazy::testing::TempDir pki_dir_;
  gpulazy::testing::TestPki pki_{pki_dir_.path()};
  fs::path token_ = dir_ / "token";
};

// Every transport setting from the plugin's config file (the keys docs/criu.md lists); the mode
// is in the environment as well, where the simulator reads it.
TEST_F(PluginTlsTest, LazyRestoreOverMutualTlsWithTokenIsByteExact) {
  std::string endpoint;
  auto server = StartTlsServer(&endpoint);
  ASSERT_TRUE(server);
  ASSERT_TRUE(endpoint.starts_with("tcp:127.0.0.1:")) << endpoint;
  const fs::path conf = dir_ / "tls.conf";
  std::ofstream(conf) << "mode = lazy\nserver = " << endpoint << "\ntls_ca = " << pki_.pem("ca")
                      << "\ntls_cert = " << pki_.pem("node7") << "\ntls_key = " << pki_.key("node7")
                      << "\ntls_server_name = localhost\ntoken_file = " << token_.string() << "\n";
  Outcome out = Sim({"1", "2"}, {{"GPULAZY_CONFIG", conf.string()}, {"GPULAZY_MODE", "lazy"}});
  StopServer(*server);
  const std::string log = Slurp(dir_ / "server.log");
  EXPECT_EQ(out.exit_code, 0) << out.output << log;
  EXPECT_NE(out.output.find("sim: ok"), std::string::npos) << out.output;
  // The server saw TLS sessions from the client certificate's CN, past the token check.
  EXPECT_NE(log.find("(TLS, client certificates required)"), std::string::npos) << log;
  EXPECT_NE(log.find("cn 'node7'"), std::string::npos) << log;
  EXPECT_NE(log.find("stream done"), std::string::npos) << log;
}

TEST_F(PluginTlsTest, ServerCertificateFromAnotherCaFailsNamingTheVerification) {
  std::string endpoint;
  auto server = StartTlsServer(&endpoint);
  ASSERT_TRUE(server);
  Outcome out = Sim({"1", "2"}, TlsEnv(endpoint, "other-ca"));
  StopServer(*server);
  EXPECT_NE(out.exit_code, 0) << out.output;
  EXPECT_EQ(out.output.find("sim: ok"), std::string::npos) << out.output;
  // OpenSSL's verdict, after what failed: "TLS handshake: server certificate refused: self-signed
  // certificate in certificate chain".
  EXPECT_NE(out.output.find("TLS handshake: server certificate refused: "), std::string::npos)
      << out.output;
  EXPECT_EQ(Slurp(dir_ / "server.log").find("opened image"), std::string::npos);
}

TEST_F(PluginTlsTest, MissingTokenFailsWithAnAuthenticationError) {
  std::string endpoint;
  auto server = StartTlsServer(&endpoint);
  ASSERT_TRUE(server);
  std::map<std::string, std::string> env = TlsEnv(endpoint, "ca");
  env.erase("GPULAZY_TOKEN_FILE");
  Outcome out = Sim({"1", "2"}, env);
  StopServer(*server);
  EXPECT_NE(out.exit_code, 0) << out.output;
  EXPECT_EQ(out.output.find("sim: ok"), std::string::npos) << out.output;
  EXPECT_NE(out.output.find("ERROR_UNAUTHENTICATED"), std::string::npos) << out.output;
  EXPECT_EQ(Slurp(dir_ / "server.log").find("opened image"), std::string::npos);
}

TEST_F(PluginTlsTest, PlainTcpWithoutInsecureTcpIsRefusedSayingHowToAllowIt) {
  std::string endpoint;
  auto server = StartServerOn("tcp:127.0.0.1:0", {"--insecure-tcp"}, &endpoint, "debug");
  ASSERT_TRUE(server);
  Outcome refused = Sim({"1", "2"}, {{"GPULAZY_MODE", "lazy"}, {"GPULAZY_SERVER", endpoint}});
  EXPECT_NE(refused.exit_code, 0) << refused.output;
  EXPECT_EQ(refused.output.find("sim: ok"), std::string::npos) << refused.output;
  EXPECT_NE(refused.output.find("plain TCP would carry GPU memory"), std::string::npos)
      << refused.output;
  EXPECT_NE(refused.output.find("insecure_tcp = 1 (GPULAZY_INSECURE_TCP)"), std::string::npos)
      << refused.output;
  // Eager mode connects from each task (task_restore.cc), and is refused the same way.
  Outcome eager = Sim({"1"}, {{"GPULAZY_MODE", "eager"}, {"GPULAZY_SERVER", endpoint}});
  EXPECT_NE(eager.exit_code, 0) << eager.output;
  EXPECT_NE(eager.output.find("eager restore: server " + endpoint + ": plain TCP"),
            std::string::npos)
      << eager.output;
  EXPECT_EQ(Slurp(dir_ / "server.log").find("hello from"), std::string::npos)
      << "the plugin connected anyway";
  // Allowed explicitly, the same restore goes through, with the bulk connections asked for.
  Outcome allowed = Sim({"1", "2"}, {{"GPULAZY_MODE", "lazy"},
                                     {"GPULAZY_SERVER", endpoint},
                                     {"GPULAZY_INSECURE_TCP", "1"},
                                     {"GPULAZY_LANES", "3"}});
  StopServer(*server);
  EXPECT_EQ(allowed.exit_code, 0) << allowed.output;
  EXPECT_NE(allowed.output.find("sim: ok"), std::string::npos) << allowed.output;
  EXPECT_NE(allowed.output.find("asks for 3 bulk connections"), std::string::npos)
      << allowed.output;
}

// ---- processes without GPU state: every hook passes ----

TEST_F(PluginHostTest, RestoreWithoutGpuStateStaysOutOfTheWay) {
  fs::create_directories(images_);
  std::ofstream(images_ / "inventory.img") << "not ours";
  Outcome out = Sim({"none", "none"}, {{"GPULAZY_MODE", "parallel"}});
  EXPECT_EQ(out.exit_code, 0) << out.output;
  EXPECT_NE(out.output.find("POST_FORKING = 0"), std::string::npos) << out.output;
  EXPECT_NE(out.output.find("sim: ok"), std::string::npos) << out.output;
}

TEST_F(PluginHostTest, TaskWithoutGpuStateInAGpuRestorePasses) {
  ASSERT_NO_FATAL_FAILURE(Make(1));
  Outcome out = Sim({"1", "none"}, {{"GPULAZY_MODE", "parallel"}});
  EXPECT_EQ(out.exit_code, 0) << out.output;
  EXPECT_NE(out.output.find("sim: ok"), std::string::npos) << out.output;
}

}  // namespace
}  // namespace gpulazy::plugin
