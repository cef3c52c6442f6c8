// Unit tests of the plugin's pieces: SDMA packets, topology mapping, config, the fake KFD's
// contract, the SDMA engine's pipelining (fake libdrm device), the BO handoff.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "lazy-server/image/synth.h"
#include "plugin/config.h"
#include "plugin/coordinator.h"
#include "plugin/criu_host.h"
#include "plugin/device_engine.h"
#include "plugin/dump.h"
#include "plugin/fault/gpulazy_fault.h"
#include "plugin/fault_channel.h"
#include "plugin/handoff.h"
#include "plugin/kfd.h"
#include "plugin/router.h"
#include "plugin/sdma_engine.h"
#include "plugin/sdma_packets.h"
#include "plugin/task_restore.h"
#include "plugin/topology.h"
#include "proto/criu_file.h"
#include "tests/plugin/fake_amdgpu.h"
#include "tests/support/fake_drm_log.h"
#include "tests/support/render_node_images.h"

namespace gpulazy::plugin {
namespace {
namespace fs = std::filesystem;

struct TempDir {
  TempDir() {
    char t[] = "/tmp/gpulazy-plugin-test-XXXXXX";
    path = ::mkdtemp(t);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path path;
};

// ---- SDMA packets ----

TEST(SdmaPackets, OnePacketLayoutV4) {
  auto ib =
      BuildCopyIb(SdmaGeneration::kV4Plus, 0x1122334455667788ull, 0x99aabbccddeeff00ull, 4096);
  ASSERT_TRUE(ib.ok());
  ASSERT_EQ(ib->size(), 8u);
  EXPECT_EQ((*ib)[0], 0x00000001u);  // op COPY=1, sub-op LINEAR=0
  EXPECT_EQ((*ib)[1], 4095u);        // count - 1 on v4+
  EXPECT_EQ((*ib)[2], 0u);
  EXPECT_EQ((*ib)[3], 0x55667788u);
  EXPECT_EQ((*ib)[4], 0x11223344u);
  EXPECT_EQ((*ib)[5], 0xddeeff00u);
  EXPECT_EQ((*ib)[6], 0x99aabbccu);
  EXPECT_EQ((*ib)[7], 0u);  // one NOP pads 7 to 8
}

TEST(SdmaPackets, CountEncodingPerGeneration) {
  auto cik = BuildCopyIb(SdmaGeneration::kCikVi, 0, 0x1000, 4096);
  ASSERT_TRUE(cik.ok());
  EXPECT_EQ((*cik)[1], 4096u);
  EXPECT_EQ(SdmaGenerationForFamily(141), SdmaGeneration::kV4Plus);  // AI (Vega)
  EXPECT_EQ(SdmaGenerationForFamily(143), SdmaGeneration::kV4Plus);  // NV
  EXPECT_EQ(SdmaGenerationForFamily(130), SdmaGeneration::kCikVi);   // VI
}

TEST(SdmaPackets, AroundTheTwoMiBLimit) {
  const uint64_t max = kSdmaMaxPacketBytes;
  for (uint64_t bytes :
       std::initializer_list<uint64_t>{max - 1, max, max + 1, 2 * max, 2 * max + 4096, 1}) {
    auto ib = BuildCopyIb(SdmaGeneration::kV4Plus, 0x10000, 0x800000000ull, bytes);
    ASSERT_TRUE(ib.ok()) << bytes;
    EXPECT_EQ(ib->size() % 8, 0u);
    auto copies = DecodeCopyIb(SdmaGeneration::kV4Plus, *ib);
    ASSERT_TRUE(copies.ok()) << copies.status().ToString();
    EXPECT_EQ(copies->size(), (bytes + max - 1) / max) << bytes;
    uint64_t total = 0;
    for (const auto& c : *copies) {
      EXPECT_LE(c.bytes, max);
      EXPECT_EQ(c.src, 0x10000 + total);
      EXPECT_EQ(c.dst, 0x800000000ull + total);
      total += c.bytes;
    }
    EXPECT_EQ(total, bytes);
  }
  std::vector<uint32_t> ib;
  EXPECT_FALSE(AppendLinearCopy(ib, SdmaGeneration::kV4Plus, 0, 0, max + 1).ok());
  EXPECT_FALSE(AppendLinearCopy(ib, SdmaGeneration::kV4Plus, 0, 0, 0).ok());
  EXPECT_TRUE(AppendLinearCopy(ib, SdmaGeneration::kV4Plus, 0, 0, max).ok());
  EXPECT_EQ(ib[1], max - 1);
}

TEST(SdmaPackets, NopPadding) {
  std::vector<uint32_t> ib;
  for (int packets = 1; packets <= 9; ++packets) {
    ib.clear();
    for (int i = 0; i < packets; ++i)
      ASSERT_TRUE(AppendLinearCopy(ib, SdmaGeneration::kV4Plus, 0, 0, 64).ok());
    PadWithNops(ib);
    EXPECT_EQ(ib.size(), (packets * 7 + 7) / 8 * 8u);
    for (size_t i = packets * 7; i < ib.size(); ++i)
      EXPECT_EQ(ib[i], 0u);
  }
  EXPECT_FALSE(DecodeCopyIb(SdmaGeneration::kV4Plus, {1, 0, 0, 0, 0, 0, 0}).ok());  // not padded
}

// ---- topology ----

criu::KfdDevice Device(uint32_t gpu_id, uint32_t device_id, uint64_t vram) {
  criu::KfdDevice d;
  const auto* r = d.GetReflection();
  for (int f = 0; f < d.GetDescriptor()->field_count(); ++f) {
    const auto* field = d.GetDescriptor()->field(f);
    if (field->is_repeated()) continue;
    if (field->cpp_type() == google::protobuf::FieldDescriptor::CPPTYPE_UINT32)
      r->SetUInt32(&d, field, 1);
    else
      r->SetUInt64(&d, field, 1);
  }
  d.set_gpu_id(gpu_id);
  d.set_device_id(device_id);
  d.set_vram_size(vram);
  d.set_drm_render_minor(128);
  return d;
}

TEST(Topology, ReadsFakeTreeAndMaps) {
  TempDir dir;
  std::vector<criu::KfdDevice> local = {Device(0x1111, 0x740f, 64ull << 30),
                                        Device(0x2222, 0x740f, 64ull << 30)};
  ASSERT_TRUE(WriteFakeTopology(dir.path, local).ok());
  auto gpus = ReadTopology(dir.path);
  ASSERT_TRUE(gpus.ok()) << gpus.status().ToString();
  ASSERT_EQ(gpus->size(), 2u);  // the CPU node is skipped
  std::vector<criu::KfdDevice> cp = {Device(0xaaaa, 0x740f, 32ull << 30),
                                     Device(0xbbbb, 0x740f, 64ull << 30)};
  auto m = MapGpus(cp, *gpus, {});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->checkpoint_to_local.at(0xaaaa), 0x1111u);
  EXPECT_EQ(m->checkpoint_to_local.at(0xbbbb), 0x2222u);
}

TEST(Topology, WrongDeviceIdIsAClearErrorUnlessCheckOff) {
  TempDir dir;
  ASSERT_TRUE(WriteFakeTopology(dir.path, {Device(0x1111, 0x7408, 64ull << 30)}).ok());
  auto gpus = ReadTopology(dir.path);
  ASSERT_TRUE(gpus.ok());
  auto m = MapGpus({Device(0xaaaa, 0x740f, 1)}, *gpus, {});
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("wrong topology"), std::string::npos);
  EXPECT_NE(m.status().message().find("device_id 0x7408 != 0x740f"), std::string::npos)
      << m.status().message();
  TopologyChecks lax;
  lax.device_id = false;
  EXPECT_TRUE(MapGpus({Device(0xaaaa, 0x740f, 1)}, *gpus, lax).ok());
}

TEST(Topology, VramTooSmallAndTooFewGpus) {
  TempDir dir;
  ASSERT_TRUE(WriteFakeTopology(dir.path, {Device(0x1111, 0x740f, 16ull << 30)}).ok());
  auto gpus = ReadTopology(dir.path);
  ASSERT_TRUE(gpus.ok());
  auto m = MapGpus({Device(0xaaaa, 0x740f, 32ull << 30)}, *gpus, {});
  ASSERT_FALSE(m.ok());
  EXPECT_NE(m.status().message().find("vram_size"), std::string::npos);
  EXPECT_FALSE(MapGpus({Device(1, 0x740f, 1), Device(2, 0x740f, 1)}, *gpus, {}).ok());
  EXPECT_EQ(ReadTopology(dir.path / "missing").status().code(), Code::kNotFound);
}

// VRAM as real sysfs keeps it: not a node property but the frame-buffer heaps among
// nodes/N/mem_banks/*/properties (heap_type 1 public, 2 private; others are not VRAM).
TEST(Topology, VramComesFromTheFrameBufferMemBanks) {
  TempDir dir;
  ASSERT_TRUE(WriteFakeTopology(dir.path, {Device(0x1111, 0x740f, 1)}).ok());
  const fs::path banks = dir.path / "nodes" / "1" / "mem_banks";
  fs::remove_all(banks);
  auto bank = [&](int n, uint64_t heap, uint64_t bytes) {
    fs::create_directories(banks / std::to_string(n));
    std::ofstream(banks / std::to_string(n) / "properties")
        << "heap_type " << heap << "\nsize_in_bytes " << bytes << "\nflags 0\nwidth 4096\n";
  };
  bank(0, 2, 16ull << 30);   // private frame buffer
  bank(1, 1, 256ull << 20);  // public frame buffer (the BAR)
  bank(2, 0, 512ull << 30);  // system memory: not VRAM
  bank(3, 4, 64ull << 10);   // LDS: not VRAM
  auto gpus = ReadTopology(dir.path);
  ASSERT_TRUE(gpus.ok()) << gpus.status().ToString();
  ASSERT_EQ(gpus->size(), 1u);
  const uint64_t vram = (16ull << 30) + (256ull << 20);
  EXPECT_EQ(gpus->front().vram_size, vram);
  EXPECT_TRUE(gpus->front().vram_public);

  EXPECT_TRUE(MapGpus({Device(0xaaaa, 0x740f, vram)}, *gpus, {}).ok());
  auto too_big = MapGpus({Device(0xaaaa, 0x740f, vram + 4096)}, *gpus, {});
  ASSERT_FALSE(too_big.ok());
  EXPECT_NE(too_big.status().message().find(fmt::format("vram_size {} < {}", vram, vram + 4096)),
            std::string::npos)
      << too_big.status().message();
  TopologyChecks lax;
  lax.vram = false;
  EXPECT_TRUE(MapGpus({Device(0xaaaa, 0x740f, vram + 4096)}, *gpus, lax).ok());

  // No banks at all (an odd tree): no VRAM, which the check reports instead of guessing.
  fs::remove_all(banks);
  gpus = ReadTopology(dir.path);
  ASSERT_TRUE(gpus.ok());
  EXPECT_EQ(gpus->front().vram_size, 0u);
  EXPECT_FALSE(MapGpus({Device(0xaaaa, 0x740f, 4096)}, *gpus, {}).ok());
  // A bank without a readable properties file is a broken tree, said so.
  fs::create_directories(banks / "0");
  EXPECT_EQ(ReadTopology(dir.path).status().code(), Code::kCorrupt);
}

TEST(Topology, BacktracksPastAGreedyChoice) {
  TempDir dir;
  // Local 1 fits both checkpointed GPUs, local 2 only the first: greedy would fail.
  ASSERT_TRUE(
      WriteFakeTopology(dir.path, {Device(1, 0x740f, 64ull << 30), Device(2, 0x740f, 16ull << 30)})
          .ok());
  auto gpus = ReadTopology(dir.path);
  auto m = MapGpus({Device(0xa, 0x740f, 8ull << 30), Device(0xb, 0x740f, 32ull << 30)}, *gpus, {});
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->checkpoint_to_local.at(0xa), 2u);
  EXPECT_EQ(m->checkpoint_to_local.at(0xb), 1u);
}

// ---- config ----

// io links: read from sysfs by link number; the dump keeps those to other GPUs (upstream's
// topology_to_devinfo), not those to CPU nodes or to nodes that are not there.
TEST(Topology, IoLinksAreReadAndDumpedToOtherGpus) {
  TempDir dir;
  const fs::path nodes = dir.path / "nodes";
  auto node = [&](int n, uint32_t gpu_id, std::vector<std::pair<int, int>> links) {
    fs::create_directories(nodes / std::to_string(n));
    std::ofstream(nodes / std::to_string(n) / "gpu_id") << gpu_id << "\n";
    std::ofstream(nodes / std::to_string(n) / "properties")
        << "device_id 29772\nio_links_count " << links.size() << "\n";
    for (size_t l = 0; l < links.size(); ++l) {
      const fs::path link = nodes / std::to_string(n) / "io_links" / std::to_string(l);
      fs::create_directories(link);
      std::ofstream(link / "properties") << "type " << links[l].first << "\nnode_from " << n
                                         << "\nnode_to " << links[l].second << "\nweight 15\n";
    }
  };
  node(0, 0, {{2, 1}, {2, 2}});                 // the CPU
  node(1, 0x1111, {{2, 0}, {11, 2}, {11, 7}});  // PCIe to the CPU, XGMI to 2, to a gone 7
  node(2, 0x2222, {{2, 0}, {11, 1}});
  // Link directories are numbered; 10 sorts after 9 numerically, not as text.
  for (int l = 3; l <= 10; ++l) {
    const fs::path link = nodes / "2" / "io_links" / std::to_string(l);
    fs::create_directories(link);
    std::ofstream(link / "properties")
        << "type " << (l == 10 ? 11 : 2) << "\nnode_to " << (l == 10 ? 1 : 0) << "\n";
  }
  auto topology = ReadTopology(dir.path);
  ASSERT_TRUE(topology.ok()) << topology.status().ToString();
  ASSERT_EQ(topology->size(), 2u);
  ASSERT_EQ((*topology)[0].io_links.size(), 3u);
  EXPECT_EQ((*topology)[0].io_links[1].type, 11u);
  EXPECT_EQ((*topology)[0].io_links[1].node_to, 2u);
  ASSERT_EQ((*topology)[1].io_links.size(), 10u);
  EXPECT_EQ((*topology)[1].io_links[9].type, 11u);  // link 10, last
  criu::KfdDevice first;
  DescribeDevice((*topology)[0], *topology, &first);
  ASSERT_EQ(first.links_size(), 1);
  EXPECT_EQ(first.links(0).link_type(), 11u);
  EXPECT_EQ(first.links(0).peer_node_id(), 2u);
  EXPECT_EQ(first.io_links_count(), 3u);  // sysfs's count, as upstream keeps it
  EXPECT_TRUE(first.IsInitialized()) << first.InitializationErrorString();
  criu::KfdDevice second;
  DescribeDevice((*topology)[1], *topology, &second);
  EXPECT_EQ(second.links_size(), 2);  // links 1 and 10 lead to node 1
  // A link without node_to is a corrupt tree, named.
  std::ofstream(nodes / "2" / "io_links" / "3" / "properties") << "type 2\n";
  auto bad = ReadTopology(dir.path);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("io_links/3"), std::string::npos)
      << bad.status().ToString();
}

TEST(Config, EnvironmentAndFile) {
  TempDir dir;
  std::ofstream(dir.path / "p.conf")
      << "# comment\nmode = lazy\nserver = unix:/x\ncheck_vram = 0\n";
  std::map<std::string, std::string> env = {{"GPULAZY_CONFIG", (dir.path / "p.conf").string()},
                                            {"GPULAZY_SERVER", "tcp:h:1"}};
  auto lookup = [&](const std::string& k) -> std::optional<std::string> {
    auto it = env.find(k);
    return it == env.end() ? std::nullopt : std::optional(it->second);
  };
  auto c = LoadConfig(lookup);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->mode, Mode::kLazy);
  EXPECT_EQ(c->server, "tcp:h:1");  // the environment wins
  EXPECT_FALSE(c->checks.vram);
  env["GPULAZY_MODE"] = "fast";
  EXPECT_FALSE(LoadConfig(lookup).ok());
}

// tcp: servers need TLS settings or an explicit insecure_tcp; a token file is read at load
// time and refused when others may read it.
TEST(Config, TlsTokenFileAndInsecureTcp) {
  TempDir dir;
  const std::filesystem::path token = dir.path / "token";
  std::ofstream(token) << "s3cret\n";
  std::filesystem::permissions(
      token, std::filesystem::perms::owner_read | std::filesystem::perms::owner_write);
  std::map<std::string, std::string> env = {{"GPULAZY_TLS_CA", "/etc/ca.pem"},
                                            {"GPULAZY_TLS_SERVER_NAME", "pages.example"},
                                            {"GPULAZY_TOKEN_FILE", token.string()},
                                            {"GPULAZY_INSECURE_TCP", "1"}};
  auto lookup = [&](const std::string& k) -> std::optional<std::string> {
    auto it = env.find(k);
    return it == env.end() ? std::nullopt : std::optional(it->second);
  };
  auto c = LoadConfig(lookup);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->tls.ca_file, "/etc/ca.pem");
  EXPECT_EQ(c->tls.server_name, "pages.example");
  EXPECT_TRUE(c->tls.enabled());
  EXPECT_EQ(c->token, "s3cret");
  EXPECT_TRUE(c->insecure_tcp);
  std::filesystem::permissions(token, std::filesystem::perms::others_read,
                               std::filesystem::perm_options::add);
  auto refused = LoadConfig(lookup);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("GPULAZY_TOKEN_FILE"), std::string::npos)
      << refused.status().message();
}

// A tcp: server without tls_ca or insecure_tcp is refused in the plugin's own terms; Unix
// sockets and the in-process server need neither.
TEST(Config, PlainTcpNeedsTlsOrInsecureTcp) {
  PluginConfig c;
  EXPECT_TRUE(CheckServerTransport(c).ok());
  c.server = "unix:/run/gpulazy.sock";
  EXPECT_TRUE(CheckServerTransport(c).ok());
  c.server = "tcp:pages.example:7740";
  Status refused = CheckServerTransport(c);
  EXPECT_EQ(refused.code(), Code::kPermissionDenied);
  EXPECT_NE(refused.message().find("tls_ca"), std::string::npos) << refused.message();
  EXPECT_NE(refused.message().find("insecure_tcp"), std::string::npos) << refused.message();
  c.insecure_tcp = true;
  EXPECT_TRUE(CheckServerTransport(c).ok());
  c.insecure_tcp = false;
  c.tls.ca_file = "/etc/gpulazy/ca.pem";
  EXPECT_TRUE(CheckServerTransport(c).ok());
}

// ---- fake KFD contract ----

class FakeKfdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    image::SynthOptions o;
    o.out = state.path / "live";
    o.gpus = 2;
    o.bos = 8;
    o.total_bytes = 4 << 20;
    auto r = image::SynthesizeCheckpoint(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    auto bytes = ReadWholeFile(o.out / criu_format::KfdImageName(1), 1 << 30);
    ASSERT_TRUE(bytes.ok());
    auto m = criu_format::ParseKfdProcess(std::span(*bytes).subspan(8), "kfd");
    ASSERT_TRUE(m.ok());
    process = *m;
    ASSERT_TRUE(WriteFakeTopology(state.path / "topology",
                                  {process.devices().begin(), process.devices().end()})
                    .ok());
    provider = MakeFakeKfdProvider(state.path.string());
  }
  TempDir state;
  criu::KfdProcess process;
  std::unique_ptr<KfdProvider> provider;
};

TEST_F(FakeKfdTest, DumpOrderIsEnforced) {
  auto kfd = provider->Open();
  ASSERT_TRUE(kfd.ok());
  kfd_ioctl_criu_args a{};
  a.op = KFD_CRIU_OP_CHECKPOINT;
  EXPECT_EQ((*kfd)->CriuOp(a), -EINVAL);  // before PROCESS_INFO
  a.op = KFD_CRIU_OP_UNPAUSE;
  EXPECT_EQ((*kfd)->CriuOp(a), -EINVAL);
  a.op = KFD_CRIU_OP_PROCESS_INFO;
  ASSERT_EQ((*kfd)->CriuOp(a), 0);
  EXPECT_EQ(a.num_bos, static_cast<uint32_t>(process.bos_size()));
  EXPECT_EQ(a.priv_data_size, process.driver_private().size());
  std::vector<kfd_criu_device_bucket> d(a.num_devices);
  std::vector<kfd_criu_bo_bucket> b(a.num_bos);
  std::string priv(a.priv_data_size, '\0');
  kfd_ioctl_criu_args c = a;
  c.op = KFD_CRIU_OP_CHECKPOINT;
  c.devices = reinterpret_cast<uint64_t>(d.data());
  c.bos = reinterpret_cast<uint64_t>(b.data());
  c.priv_data = reinterpret_cast<uint64_t>(priv.data());
  c.num_bos = a.num_bos - 1;
  EXPECT_EQ((*kfd)->CriuOp(c), -EINVAL);  // bucket count must match PROCESS_INFO
  c.num_bos = a.num_bos;
  ASSERT_EQ((*kfd)->CriuOp(c), 0);
  EXPECT_EQ(priv, process.driver_private());
  for (const auto& bucket : b)
    if (bucket.dmabuf_fd != kKfdInvalidFd) ::close(static_cast<int>(bucket.dmabuf_fd));
  a.op = KFD_CRIU_OP_UNPAUSE;
  EXPECT_EQ((*kfd)->CriuOp(a), 0);
}

TEST_F(FakeKfdTest, RestoreChecksBucketsAndResumeNeedsRestore) {
  auto kfd = provider->Open();
  ASSERT_TRUE(kfd.ok());
  std::vector<kfd_criu_device_bucket> d;
  std::vector<UniqueFd> drm;
  for (const auto& dev : process.devices()) {
    drm.push_back(provider->OpenRenderNode(128).value());
    d.push_back({dev.gpu_id(), dev.gpu_id(), static_cast<uint32_t>(drm.back().get()), 0});
  }
  std::vector<kfd_criu_bo_bucket> b;
  for (const auto& bo : process.bos()) {
    kfd_criu_bo_bucket x{};
    x.addr = bo.gpu_va();
    x.size = bo.size();
    x.offset = bo.mmap_offset();
    x.gpu_id = bo.gpu_id();
    x.alloc_flags = bo.alloc_flags();
    b.push_back(x);
  }
  kfd_ioctl_criu_args resume{};
  resume.op = KFD_CRIU_OP_RESUME;
  resume.pid = static_cast<uint32_t>(::getpid());
  EXPECT_EQ((*kfd)->CriuOp(resume), -ESRCH);  // nothing restored yet

  kfd_ioctl_criu_args a{};
  a.op = KFD_CRIU_OP_RESTORE;
  a.devices = reinterpret_cast<uint64_t>(d.data());
  a.num_devices = static_cast<uint32_t>(d.size());
  a.bos = reinterpret_cast<uint64_t>(b.data());
  a.num_bos = static_cast<uint32_t>(b.size());
  d[0].actual_gpu_id = 0xdead;
  EXPECT_EQ((*kfd)->CriuOp(a), -EINVAL);  // no such local GPU
  d[0].actual_gpu_id = d[0].user_gpu_id;
  ASSERT_EQ((*kfd)->CriuOp(a), 0);
  EXPECT_EQ((*kfd)->CriuOp(a), -EINVAL);  // once per file
  for (size_t i = 0; i < b.size(); ++i) {
    EXPECT_NE(b[i].restored_offset, b[i].offset);
    if (criu_format::HasContents(b[i].alloc_flags)) {
      ASSERT_NE(b[i].dmabuf_fd, kKfdInvalidFd);
      // Bytes written through the dmabuf are visible: it is a memfd.
      uint32_t v = 0xabcd1234;
      ASSERT_EQ(::pwrite(static_cast<int>(b[i].dmabuf_fd), &v, 4, 0), 4);
      ::close(static_cast<int>(b[i].dmabuf_fd));
    } else {
      EXPECT_EQ(b[i].dmabuf_fd, kKfdInvalidFd);
    }
  }
  EXPECT_EQ((*kfd)->CriuOp(resume), 0);
  EXPECT_EQ((*kfd)->CriuOp(resume), -EINVAL);  // twice
  kfd_ioctl_criu_args bad{};
  bad.op = 99;
  EXPECT_EQ((*kfd)->CriuOp(bad), -EINVAL);
}

// ---- render-node files (RESTORE_EXT_FILE of amdgpu-renderD-<id>.img) ----

// A one-process checkpoint, a fake KFD whose topology matches it, a directory standing for
// /dev/dri with a plain file per render node, and a TaskRestorer as a restored task runs it.
class RenderNodeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    image::SynthOptions o;
    o.out = images;
    o.gpus = 2;
    o.bos = 8;
    o.total_bytes = 1 << 20;
    ASSERT_TRUE(fs::create_directories(images));
    auto r = image::SynthesizeCheckpoint(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    auto bytes = ReadWholeFile(images / criu_format::KfdImageName(1), 1 << 30);
    ASSERT_TRUE(bytes.ok());
    auto m = criu_format::ParseKfdProcess(std::span(*bytes).subspan(8), "kfd");
    ASSERT_TRUE(m.ok());
    process = *m;
    devices.assign(process.devices().begin(), process.devices().end());
    ASSERT_TRUE(WriteFakeTopology(kfd_state / "topology", devices).ok());
    ASSERT_TRUE(fs::create_directories(dri));
    for (const auto& d : devices)
      std::ofstream(dri / ("renderD" + std::to_string(d.drm_render_minor()))) << "node\n";
    config.mode = Mode::kEager;
    config.topology_root = kfd_state / "topology";
    config.fake_kfd = kfd_state;
    config.dri_root = dri;
    provider = MakeFakeKfdProvider(kfd_state.string(), dri.string());
    restorer = std::make_unique<TaskRestorer>(config, *provider, [](uint32_t) {
      return Result<std::unique_ptr<DeviceEngine>>(std::make_unique<HostDmabufEngine>());
    });
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
    handoff_task.reset(sv[0]);
    handoff_master.reset(sv[1]);
  }

  // Two VRAM BOs and a GTT one mapped into the GPU's VA space, a CPU-domain BO without
  // contents, as file `id` on checkpointed GPU `gpu`.
  criu::RenderNode RenderNode(uint32_t id, uint32_t gpu) {
    using gpulazy::testing::RenderBoSpec;
    return gpulazy::testing::MakeRenderNode(
        id, gpu, 200,
        {RenderBoSpec{64 << 10, criu_format::kGemDomainVram, 5, 0x7f0000000000ull},
         RenderBoSpec{8 << 10, 0x1 /* CPU */, 9, 0},
         RenderBoSpec{12 << 10, criu_format::kGemDomainGtt, 3, 0x7f0000100000ull},
         RenderBoSpec{4 << 10, criu_format::kGemDomainVram, 2, 0x7f0000200000ull}});
  }

  Result<int> Restore(int id) { return restorer->RestoreFile(images, id, handoff_task.get()); }

  // The fake DRM's log of this process (kfd.h): the live BOs, handle -> memfd.
  std::map<uint32_t, int> DrmBos() {
    return gpulazy::testing::FakeDrmBos(kfd_state / ("drm-" + std::to_string(::getpid())));
  }

  static int OrMinus(const Result<int>& r) { return r.ok() ? *r : -1; }

  static std::string Target(int fd) {
    char buf[512] = {};
    ssize_t n = ::readlink(("/proc/self/fd/" + std::to_string(fd)).c_str(), buf, sizeof(buf) - 1);
    return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
  }

  // Two fds share one open file description exactly when a seek on one moves the other.
  static bool SameOpenFile(int a, int b) {
    const off_t mark = 4321;
    if (::lseek(a, mark, SEEK_SET) != mark) return false;
    bool same = ::lseek(b, 0, SEEK_CUR) == mark;
    (void)::lseek(a, 0, SEEK_SET);
    return same;
  }

  TempDir dir;
  fs::path images = dir.path / "ckpt";
  fs::path kfd_state = dir.path / "kfd";
  fs::path dri = dir.path / "dri";
  criu::KfdProcess process;
  std::vector<criu::KfdDevice> devices;
  PluginConfig config;
  std::unique_ptr<KfdProvider> provider;
  std::unique_ptr<TaskRestorer> restorer;
  UniqueFd handoff_task, handoff_master;
};

TEST_F(RenderNodeTest, RenderBeforeKfdSharesTheRenderNodeFileAndRestoresBos) {
  const uint32_t gpu = devices[1].gpu_id();
  const criu::RenderNode node = RenderNode(11, gpu);
  const auto contents = gpulazy::testing::WriteRenderNodeImages(images, node, 3);
  Result<int> render = Restore(11);
  ASSERT_TRUE(render.ok()) << render.status().ToString();
  UniqueFd render_fd(*render);
  EXPECT_EQ(Target(render_fd.get()),
            (dri / ("renderD" + std::to_string(devices[1].drm_render_minor()))).string());

  // Every mapped VRAM/GTT BO under its old handle with its bytes; the CPU BO has no contents.
  std::map<uint32_t, int> bos = DrmBos();
  ASSERT_EQ(bos.size(), 4u);
  for (int i = 0; i < node.bos_size(); ++i) {
    const criu::RenderBo& bo = node.bos(i);
    ASSERT_TRUE(bos.count(bo.handle())) << "handle " << bo.handle();
    std::vector<uint8_t> got(bo.size());
    ASSERT_EQ(::pread(bos[bo.handle()], got.data(), got.size(), 0),
              static_cast<ssize_t>(got.size()));
    if (bo.preferred_domains() == 0x1)
      EXPECT_EQ(got, std::vector<uint8_t>(bo.size(), 0)) << "CPU BO " << i;
    else
      EXPECT_EQ(got, contents[static_cast<size_t>(i)]) << "BO " << i;
  }
  // The task's KFD file after its render node: the driver gets the same render-node file, and
  // a KFD BO on that GPU mmaps through it too.
  Result<int> kfd = Restore(1);
  ASSERT_TRUE(kfd.ok()) << kfd.status().ToString();
  const criu::KfdBo* on_gpu = nullptr;
  for (const auto& bo : process.bos())
    if (bo.gpu_id() == gpu && criu_format::HasContents(bo.alloc_flags())) on_gpu = &bo;
  ASSERT_NE(on_gpu, nullptr);
  uint64_t pgoff = 0;
  int vma_fd = -1;
  ASSERT_EQ(OrMinus(restorer->UpdateVmaMap("/dev/dri/renderD128", on_gpu->gpu_va(),
                                           on_gpu->mmap_offset(), &pgoff, &vma_fd)),
            1);
  UniqueFd kfd_bo_fd(vma_fd);
  EXPECT_TRUE(SameOpenFile(render_fd.get(), kfd_bo_fd.get()));
  // A render BO mmaps at the driver's new offset through that same file.
  const criu::RenderBo& first = node.bos(0);
  ASSERT_EQ(OrMinus(restorer->UpdateVmaMap("/dev/dri/renderD200", first.gpu_va(),
                                           first.mmap_offset(), &pgoff, &vma_fd)),
            1);
  UniqueFd render_bo_fd(vma_fd);
  EXPECT_EQ(pgoff, (1ull << 40) + (uint64_t{first.handle()} << 32));
  EXPECT_TRUE(SameOpenFile(render_fd.get(), render_bo_fd.get()));
}

TEST_F(RenderNodeTest, KfdBeforeRenderSharesTheRenderNodeFile) {
  Result<int> kfd = Restore(1);
  ASSERT_TRUE(kfd.ok()) << kfd.status().ToString();
  const uint32_t gpu = devices[0].gpu_id();
  gpulazy::testing::WriteRenderNodeImages(images, RenderNode(12, gpu), 4);
  Result<int> render = Restore(12);
  ASSERT_TRUE(render.ok()) << render.status().ToString();
  UniqueFd render_fd(*render);
  const criu::KfdBo* on_gpu = nullptr;
  for (const auto& bo : process.bos())
    if (bo.gpu_id() == gpu && criu_format::HasContents(bo.alloc_flags())) on_gpu = &bo;
  ASSERT_NE(on_gpu, nullptr);
  uint64_t pgoff = 0;
  int vma_fd = -1;
  ASSERT_EQ(OrMinus(restorer->UpdateVmaMap("/dev/dri/renderD128", on_gpu->gpu_va(),
                                           on_gpu->mmap_offset(), &pgoff, &vma_fd)),
            1);
  UniqueFd kfd_bo_fd(vma_fd);
  EXPECT_TRUE(SameOpenFile(render_fd.get(), kfd_bo_fd.get()));
  EXPECT_EQ(DrmBos().size(), 4u);
}

TEST_F(RenderNodeTest, ReleaseFormatHoldsOnlyTheGpu) {
  // CRIU 4.x: criu_render_node { gpu_id } and nothing else.
  criu::RenderNode node;
  node.set_gpu_id(devices[0].gpu_id());
  gpulazy::testing::WriteCriuFile(images / criu_format::RenderNodeImageName(13),
                                  node.SerializePartialAsString());
  Result<int> render = Restore(13);
  ASSERT_TRUE(render.ok()) << render.status().ToString();
  UniqueFd fd(*render);
  EXPECT_EQ(Target(fd.get()),
            (dri / ("renderD" + std::to_string(devices[0].drm_render_minor()))).string());
  EXPECT_TRUE(DrmBos().empty());
}

TEST_F(RenderNodeTest, MissingImageIsNotOurs) {
  Result<int> r = Restore(77);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kNotFound);  // -ENOTSUP: the next plugin's
}

TEST_F(RenderNodeTest, UnknownGpuIsAnErrorNamingFileAndGpu) {
  gpulazy::testing::WriteRenderNodeImages(images, RenderNode(14, 0xdead), 1);
  Result<int> r = Restore(14);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kIoError);  // ours, failed: not -ENOTSUP
  EXPECT_NE(r.status().message().find("amdgpu-renderD-14.img"), std::string::npos)
      << r.status().ToString();
  EXPECT_NE(r.status().message().find("0xdead"), std::string::npos) << r.status().ToString();
  EXPECT_TRUE(DrmBos().empty());
}

TEST_F(RenderNodeTest, TruncatedOrCorruptImagesAreErrorsNamingTheFile) {
  const std::string good = RenderNode(15, devices[0].gpu_id()).SerializeAsString();
  const fs::path path = images / criu_format::RenderNodeImageName(15);
  auto expect_error = [&](const std::string& what) {
    Result<int> r = Restore(15);
    ASSERT_FALSE(r.ok()) << what;
    EXPECT_NE(r.status().message().find("amdgpu-renderD-15.img"), std::string::npos)
        << what << ": " << r.status().ToString();
  };
  std::ofstream(path, std::ios::binary) << "abc";  // shorter than the header
  expect_error("short header");
  gpulazy::testing::WriteCriuFile(path, good);
  fs::resize_file(path, fs::file_size(path) - 10);  // header says more than follows
  expect_error("truncated payload");
  gpulazy::testing::WriteCriuFile(
      path, good.substr(0, good.size() / 2));  // consistent header, cut message
  expect_error("cut message");
  criu::RenderNode lying = RenderNode(15, devices[0].gpu_id());
  lying.set_bo_count(99);
  gpulazy::testing::WriteCriuFile(path, lying.SerializeAsString());
  expect_error("wrong BO count");
  criu::RenderNode outside = RenderNode(15, devices[0].gpu_id());
  outside.mutable_bos(0)->mutable_mappings(0)->set_size(1ull << 40);
  gpulazy::testing::WriteCriuFile(path, outside.SerializeAsString());
  expect_error("VA mapping past the BO");
  EXPECT_TRUE(DrmBos().empty());
}

TEST_F(RenderNodeTest, BadPagesFilesInstallNothing) {
  const criu::RenderNode node = RenderNode(16, devices[0].gpu_id());
  gpulazy::testing::WriteRenderNodeImages(images, node, 5);
  const fs::path pages = images / criu_format::DrmPagesImageName(16, 200, 2);
  fs::resize_file(pages, fs::file_size(pages) - 4096);
  Result<int> r = Restore(16);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("amdgpu-drm-pages-16-200-0002.img"), std::string::npos)
      << r.status().ToString();
  fs::remove(pages);
  r = Restore(16);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("amdgpu-drm-pages-16-200-0002.img"), std::string::npos)
      << r.status().ToString();
  EXPECT_TRUE(DrmBos().empty());
  uint64_t pgoff = 0;
  int fd = -1;
  EXPECT_EQ(OrMinus(restorer->UpdateVmaMap("/dev/dri/renderD200", node.bos(0).gpu_va(),
                                           node.bos(0).mmap_offset(), &pgoff, &fd)),
            0);
}

TEST_F(RenderNodeTest, ImportedBoIsUnsupportedAndInstallsNothing) {
  criu::RenderNode node = RenderNode(17, devices[0].gpu_id());
  node.mutable_bos(3)->set_is_import(1);
  gpulazy::testing::WriteRenderNodeImages(images, node, 6);
  Result<int> r = Restore(17);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("imported"), std::string::npos) << r.status().ToString();
  EXPECT_TRUE(DrmBos().empty());
}

TEST_F(RenderNodeTest, DriverRefusalUndoesTheFile) {
  // Two BOs mapped at overlapping VAs: the driver refuses the second mapping.
  criu::RenderNode node = RenderNode(18, devices[0].gpu_id());
  node.mutable_bos(2)->mutable_mappings(0)->set_gpu_va(node.bos(0).gpu_va() + 4096);
  gpulazy::testing::WriteRenderNodeImages(images, node, 7);
  Result<int> r = Restore(18);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("overlaps"), std::string::npos) << r.status().ToString();
  EXPECT_TRUE(DrmBos().empty());  // the BOs made before the refusal are closed again
  uint64_t pgoff = 0;
  int fd = -1;
  EXPECT_EQ(OrMinus(restorer->UpdateVmaMap("/dev/dri/renderD200", node.bos(0).gpu_va(),
                                           node.bos(0).mmap_offset(), &pgoff, &fd)),
            0);
}

TEST_F(RenderNodeTest, WrongTopologyFailsTheRenderNodeRestore) {
  fs::remove_all(kfd_state / "topology");
  std::vector<criu::KfdDevice> other = devices;
  for (auto& d : other)
    d.set_device_id(0x1234);
  ASSERT_TRUE(WriteFakeTopology(kfd_state / "topology", other).ok());
  gpulazy::testing::WriteRenderNodeImages(images, RenderNode(19, devices[0].gpu_id()), 8);
  Result<int> r = Restore(19);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("device_id"), std::string::npos) << r.status().ToString();
  EXPECT_TRUE(DrmBos().empty());
}

TEST_F(RenderNodeTest, NoKfdImageToMapWith) {
  fs::remove(images / criu_format::KfdImageName(1));
  gpulazy::testing::WriteRenderNodeImages(images, RenderNode(20, devices[0].gpu_id()), 9);
  Result<int> r = Restore(20);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("no amdgpu-kfd-<id>.img"), std::string::npos)
      << r.status().ToString();
}

// The task's KFD image lists the GPUs in another order than the image the render node was
// mapped with: MapGpus would pick differently among equal GPUs, but the task keeps one mapping.
class RenderNodeTwoImagesTest : public RenderNodeTest {
 protected:
  void SetUp() override {
    RenderNodeTest::SetUp();
    fs::remove_all(images);
    image::SynthOptions o;
    o.out = images;
    o.gpus = 2;
    o.bos = 8;
    o.total_bytes = 2 << 20;
    o.processes = 2;
    auto r = image::SynthesizeCheckpoint(o);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    auto bytes = ReadWholeFile(images / criu_format::KfdImageName(2), 1 << 30);
    ASSERT_TRUE(bytes.ok());
    auto m = criu_format::ParseKfdProcess(std::span(*bytes).subspan(8), "kfd");
    ASSERT_TRUE(m.ok());
    second = *m;
    std::reverse(second.mutable_devices()->begin(), second.mutable_devices()->end());
  }
  void WriteSecond() {
    gpulazy::testing::WriteCriuFile(images / criu_format::KfdImageName(2),
                                    second.SerializeAsString());
  }
  criu::KfdProcess second;
};

TEST_F(RenderNodeTwoImagesTest, ReorderedDevicesKeepTheMapping) {
  WriteSecond();
  const uint32_t gpu = devices[0].gpu_id();
  gpulazy::testing::WriteRenderNodeImages(images, RenderNode(21, gpu), 10);
  Result<int> render = Restore(21);  // maps with amdgpu-kfd-1.img's order
  ASSERT_TRUE(render.ok()) << render.status().ToString();
  UniqueFd render_fd(*render);
  Result<int> kfd = Restore(2);
  ASSERT_TRUE(kfd.ok()) << kfd.status().ToString();
  const criu::KfdBo* on_gpu = nullptr;
  for (const auto& bo : second.bos())
    if (bo.gpu_id() == gpu && criu_format::HasContents(bo.alloc_flags())) on_gpu = &bo;
  ASSERT_NE(on_gpu, nullptr);
  uint64_t pgoff = 0;
  int vma_fd = -1;
  ASSERT_EQ(OrMinus(restorer->UpdateVmaMap("/dev/dri/renderD128", on_gpu->gpu_va(),
                                           on_gpu->mmap_offset(), &pgoff, &vma_fd)),
            1);
  UniqueFd kfd_bo_fd(vma_fd);
  EXPECT_TRUE(SameOpenFile(render_fd.get(), kfd_bo_fd.get()));
}

TEST_F(RenderNodeTwoImagesTest, AFileMappingAGpuElsewhereIsAnError) {
  // Different entries (an unchecked field changed) are mapped afresh, in the reversed order.
  for (auto& d : *second.mutable_devices())
    d.set_capability(d.capability() ^ 1);
  WriteSecond();
  gpulazy::testing::WriteRenderNodeImages(images, RenderNode(22, devices[0].gpu_id()), 11);
  Result<int> render = Restore(22);
  ASSERT_TRUE(render.ok()) << render.status().ToString();
  UniqueFd render_fd(*render);
  Result<int> kfd = Restore(2);
  ASSERT_FALSE(kfd.ok());
  EXPECT_NE(kfd.status().message().find("an earlier file of this task mapped it"),
            std::string::npos)
      << kfd.status().ToString();
  EXPECT_NE(kfd.status().message().find("amdgpu-kfd-2.img"), std::string::npos)
      << kfd.status().ToString();
}

TEST(RealKfdProvider, OpensRenderNodesUnderTheConfiguredRoot) {
  TempDir dir;
  std::ofstream(dir.path / "renderD130") << "x";
  auto provider = MakeRealKfdProvider(dir.path.string());
  Result<UniqueFd> fd = provider->OpenRenderNode(130);
  ASSERT_TRUE(fd.ok()) << fd.status().ToString();
  char buf[256] = {};
  ASSERT_GT(::readlink(("/proc/self/fd/" + std::to_string(fd->get())).c_str(), buf, 255), 0);
  EXPECT_EQ(std::string(buf), (dir.path / "renderD130").string());
  Result<UniqueFd> missing = provider->OpenRenderNode(131);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find((dir.path / "renderD131").string()), std::string::npos);
}

TEST(Config, DriRoot) {
  auto c = LoadConfig([](const std::string& k) -> std::optional<std::string> {
    if (k == "GPULAZY_CONFIG") return "/dev/null";
    if (k == "GPULAZY_DRI_ROOT") return "/tmp/dri";
    return std::nullopt;
  });
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->dri_root, "/tmp/dri");
  auto d = LoadConfig([](const std::string& k) -> std::optional<std::string> {
    if (k == "GPULAZY_CONFIG") return "/dev/null";
    return std::nullopt;
  });
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->dri_root, "/dev/dri");
}

// The config with no file and one environment variable, `name`, set to `value` (or unset).
Result<PluginConfig> ConfigWithOnly(const std::string& name, std::optional<std::string> value) {
  return LoadConfig([&](const std::string& k) -> std::optional<std::string> {
    if (k == "GPULAZY_CONFIG") return "/dev/null";
    if (k == name) return value;
    return std::nullopt;
  });
}

TEST(Config, BackgroundNice) {
  auto with = [](std::optional<std::string> value) {
    return ConfigWithOnly("GPULAZY_BACKGROUND_NICE", std::move(value));
  };
  auto unset = with(std::nullopt);
  ASSERT_TRUE(unset.ok());
  EXPECT_EQ(unset->background_nice, 10);
  auto off = with("0");
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(off->background_nice, 0);
  auto bad = with("20");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("background_nice"), std::string::npos)
      << bad.status().ToString();
}

// lanes reaches the session (coordinator and eager tasks); bounded like gpulazy-client's --lanes.
TEST(Config, Lanes) {
  auto with = [](std::optional<std::string> value) {
    return ConfigWithOnly("GPULAZY_LANES", std::move(value));
  };
  auto unset = with(std::nullopt);
  ASSERT_TRUE(unset.ok());
  EXPECT_EQ(unset->lanes, 0u);  // the client's default for this host
  auto one = with("1");
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->lanes, 1u);
  auto most = with("16");
  ASSERT_TRUE(most.ok());
  EXPECT_EQ(most->lanes, 16u);
  for (const char* bad : {"17", "-1", "four"}) {
    auto refused = with(bad);
    ASSERT_FALSE(refused.ok()) << bad;
    EXPECT_NE(refused.status().message().find("GPULAZY_LANES"), std::string::npos)
        << refused.status().ToString();
  }
}

// ---- SDMA engine pipelining ----

// An SDMA engine over a fake device whose copies take `latency`; *fake (when given) is the device.
Result<std::unique_ptr<SdmaCopyEngine>> MakeSdmaEngine(
    uint32_t slots, uint64_t slot_bytes, std::chrono::microseconds latency,
    testing::FakeAmdgpuDevice** fake = nullptr,
    std::chrono::milliseconds fence_timeout = SdmaOptions{}.fence_timeout) {
  auto device = std::make_unique<testing::FakeAmdgpuDevice>(SdmaGeneration::kV4Plus, latency);
  if (fake != nullptr) *fake = device.get();
  SdmaOptions options;
  options.staging_slots = slots;
  options.slot_bytes = slot_bytes;
  options.fence_timeout = fence_timeout;
  return SdmaCopyEngine::Create(std::move(device), options);
}

TEST(SdmaEngine, PipelinesAndReapsAsynchronously) {
  testing::FakeAmdgpuDevice* fake = nullptr;
  auto engine = MakeSdmaEngine(3, 2u << 20, std::chrono::microseconds(20000), &fake);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const uint64_t bo_size = 16u << 20;
  int memfd = ::memfd_create("dst", MFD_CLOEXEC);
  ASSERT_EQ(::ftruncate(memfd, bo_size), 0);
  int keep = ::dup(memfd);
  ASSERT_TRUE((*engine)->Bind(7, UniqueFd(memfd), bo_size).ok());

  std::vector<std::vector<uint8_t>> chunks(8);
  std::atomic<int> done{0};
  std::atomic<int> on_writer_thread{0};
  const auto writer = std::this_thread::get_id();
  // The device completes nothing until released: what the engine keeps in flight, and that
  // Write returns before its copy is done, do not depend on how fast this thread runs.
  fake->HoldCompletions(true);
  for (size_t i = 0; i < chunks.size(); ++i) {
    chunks[i].assign(2u << 20, static_cast<uint8_t>(i + 1));
    Status s = (*engine)->Write(7, i * (2u << 20), chunks[i], [&](Status st) {
      EXPECT_TRUE(st.ok()) << st.ToString();
      if (std::this_thread::get_id() == writer) ++on_writer_thread;
      ++done;
    });
    ASSERT_TRUE(s.ok()) << s.ToString();
  }
  EXPECT_EQ(done.load(), 0);               // every Write returned before its copy finished
  EXPECT_EQ(fake->max_outstanding(), 3u);  // one copy per staging slot in flight at once
  fake->HoldCompletions(false);
  ASSERT_TRUE((*engine)->Flush().ok());
  EXPECT_EQ(done.load(), 8);
  EXPECT_EQ(on_writer_thread.load(), 0);  // fences reaped off the writer's thread
  SdmaStats st = (*engine)->stats();
  EXPECT_EQ(st.submits, 8u);
  EXPECT_GT(st.queued_writes, 0u);         // more writes than staging slots
  EXPECT_EQ(fake->max_outstanding(), 3u);  // never more than the slots
  void* p = ::mmap(nullptr, bo_size, PROT_READ, MAP_SHARED, keep, 0);
  ASSERT_NE(p, MAP_FAILED);
  for (size_t i = 0; i < 8; ++i)
    EXPECT_EQ(static_cast<uint8_t*>(p)[i * (2u << 20) + 123], i + 1);
  ::munmap(p, bo_size);
  ::close(keep);
  // Bounds and unknown BOs fail the Write without calling `done`.
  EXPECT_FALSE((*engine)->Write(7, bo_size - 1, chunks[0], [](Status) { FAIL(); }).ok());
  EXPECT_FALSE((*engine)->Write(8, 0, chunks[0], [](Status) { FAIL(); }).ok());
  auto live_at_exit = fake->live_bos_at_destruction();
  engine->reset();                      // destroys the fake device too
  EXPECT_EQ(live_at_exit->load(), 0u);  // staging and imported BOs released before the device
}

// A dead task's BO (Release): writes already accepted still land, the BO's handle and mapping
// go once the last of them has completed (never while a copy still targets it), its dmabuf is
// closed, and later writes are refused. The other BO is untouched.
TEST(SdmaEngine, ReleasesABoOnceItsAcceptedWritesHaveCompleted) {
  testing::FakeAmdgpuDevice* fake = nullptr;
  auto engine = MakeSdmaEngine(2, 1u << 20, std::chrono::microseconds(2000), &fake);
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const uint64_t bo_size = 4u << 20;
  int dead = ::memfd_create("dead", MFD_CLOEXEC);
  int alive = ::memfd_create("alive", MFD_CLOEXEC);
  ASSERT_EQ(::ftruncate(dead, bo_size), 0);
  ASSERT_EQ(::ftruncate(alive, bo_size), 0);
  int dead_view = ::dup(dead);
  ASSERT_TRUE((*engine)->Bind(1, UniqueFd(dead), bo_size).ok());
  ASSERT_TRUE((*engine)->Bind(2, UniqueFd(alive), bo_size).ok());
  const size_t bound = fake->live_bos();  // two staging slots and the two BOs

  std::vector<uint8_t> chunk(1u << 20, 0x5C);
  std::atomic<int> done{0};
  fake->HoldCompletions(true);
  for (uint64_t i = 0; i < 4; ++i)  // two in flight, two queued for a slot
    ASSERT_TRUE((*engine)
                    ->Write(1, i << 20, chunk,
                            [&](Status st) {
                              EXPECT_TRUE(st.ok()) << st.ToString();
                              ++done;
                            })
                    .ok());
  (*engine)->Release(1);
  EXPECT_EQ((*engine)->Write(1, 0, chunk, [](Status) { FAIL(); }).code(), Code::kNotFound);
  EXPECT_EQ(fake->live_bos(), bound);  // copies still target it
  fake->HoldCompletions(false);
  ASSERT_TRUE((*engine)->Flush().ok());
  EXPECT_EQ(done.load(), 4);
  std::vector<uint8_t> back(16);
  EXPECT_EQ((*engine)->ReadBack(1, 0, back).code(), Code::kNotFound);
  EXPECT_EQ(fake->live_bos(), bound - 1);
  EXPECT_EQ(fake->busy_releases(), 0u);
  // Every accepted write landed before the BO went.
  std::vector<uint8_t> contents(bo_size);
  ASSERT_EQ(::pread(dead_view, contents.data(), contents.size(), 0),
            static_cast<ssize_t>(contents.size()));
  EXPECT_TRUE(std::all_of(contents.begin(), contents.end(), [](uint8_t b) { return b == 0x5C; }));
  ::close(dead_view);
  // Releasing again, or a BO never bound, changes nothing; the other BO still takes writes.
  (*engine)->Release(1);
  (*engine)->Release(9);
  ASSERT_TRUE((*engine)->Write(2, 0, chunk, [](Status st) { EXPECT_TRUE(st.ok()); }).ok());
  ASSERT_TRUE((*engine)->Flush().ok());
  // A BO with nothing in flight goes at once.
  (*engine)->Release(2);
  EXPECT_EQ(fake->live_bos(), bound - 2);
  EXPECT_EQ(fake->busy_releases(), 0u);
}

// A fence that does not signal in time leaves its copy possibly still running, reading its
// staging slot. Reusing that slot for the next chunk would let the stale copy put the next
// chunk's bytes into the first BO. The slot is quarantined and the engine takes no more work:
// writes still queued fail, new ones are refused, nothing lands where it does not belong.
TEST(SdmaEngine, AFenceThatTimesOutNeverLetsItsSlotBeReused) {
  testing::FakeAmdgpuDevice* fake = nullptr;
  auto engine = MakeSdmaEngine(1, 1u << 20, std::chrono::microseconds(100), &fake,
                               std::chrono::milliseconds(50));
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const uint64_t bo_size = 1u << 20;
  int first = ::memfd_create("first", MFD_CLOEXEC);
  int second = ::memfd_create("second", MFD_CLOEXEC);
  ASSERT_EQ(::ftruncate(first, bo_size), 0);
  ASSERT_EQ(::ftruncate(second, bo_size), 0);
  int first_view = ::dup(first);
  ASSERT_TRUE((*engine)->Bind(1, UniqueFd(first), bo_size).ok());
  ASSERT_TRUE((*engine)->Bind(2, UniqueFd(second), bo_size).ok());

  fake->HoldCompletions(true);  // the ring stalls: the first copy's fence will not signal
  std::vector<uint8_t> a(4096, 0xAA), b(4096, 0xBB);
  std::atomic<int> timed_out{0}, queued_failed{0};
  ASSERT_TRUE((*engine)
                  ->Write(1, 0, a,
                          [&](Status st) {
                            if (st.code() == Code::kTimeout) ++timed_out;
                          })
                  .ok());
  // Queued behind it for the one slot.
  ASSERT_TRUE((*engine)
                  ->Write(2, 0, b,
                          [&](Status st) {
                            if (!st.ok()) ++queued_failed;
                          })
                  .ok());
  EXPECT_EQ((*engine)->Flush().code(), Code::kTimeout);
  EXPECT_EQ(timed_out.load(), 1);
  EXPECT_EQ(queued_failed.load(), 1);
  EXPECT_EQ((*engine)->stats().quarantined_slots, 1u);
  // No more work: a write is refused at once, saying why.
  EXPECT_EQ((*engine)->Write(2, 4096, b, [](Status) { FAIL() << "accepted"; }).code(),
            Code::kTimeout);
  std::vector<uint8_t> back(16);
  EXPECT_EQ((*engine)->ReadBack(2, 0, back).code(), Code::kTimeout);
  // The ring moves again and the stale copy runs: it can only carry A's bytes.
  fake->HoldCompletions(false);
  std::vector<uint8_t> contents(4096);
  for (int i = 0; i < 200; ++i) {  // until the stale copy has run (or 2 s)
    ASSERT_EQ(::pread(first_view, contents.data(), contents.size(), 0), 4096);
    if (contents[0] != 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(std::none_of(contents.begin(), contents.end(), [](uint8_t v) { return v == 0xBB; }))
      << "the next chunk's bytes reached the first BO through the reused slot";
  ::close(first_view);
}

// Read-back runs the copy the other way (BO -> staging slot -> host), slot by slot: what dump
// and the render-node check need on hardware, where a dmabuf cannot be pread.
TEST(SdmaEngine, ReadsBackThroughStagingSlots) {
  auto engine = MakeSdmaEngine(2, 1u << 20, std::chrono::microseconds(500));
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  const uint64_t bo_size = 5u << 20;
  int memfd = ::memfd_create("bo", MFD_CLOEXEC);
  ASSERT_EQ(::ftruncate(memfd, bo_size), 0);
  // Contents the engine did not write itself (a dumped BO): put them in behind its back.
  std::vector<uint8_t> contents(bo_size);
  for (size_t i = 0; i < contents.size(); ++i)
    contents[i] = static_cast<uint8_t>((i * 2654435761u) >> 13);
  ASSERT_EQ(::pwrite(memfd, contents.data(), contents.size(), 0),
            static_cast<ssize_t>(contents.size()));
  ASSERT_TRUE((*engine)->Bind(3, UniqueFd(memfd), bo_size).ok());
  // And one written through the engine just before, which read-back must see (it flushes).
  std::vector<uint8_t> patch(300000, 0xA5);
  ASSERT_TRUE((*engine)->Write(3, 4u << 20, patch, [](Status st) { EXPECT_TRUE(st.ok()); }).ok());
  std::copy(patch.begin(), patch.end(), contents.begin() + (4u << 20));

  // 2.5 slots' worth at an odd offset: three copies, the last one short.
  const uint64_t offset = 12345;
  std::vector<uint8_t> out((5u << 19) + 77);
  ASSERT_TRUE((*engine)->ReadBack(3, offset, out).ok());
  EXPECT_TRUE(std::equal(out.begin(), out.end(), contents.begin() + offset));
  std::vector<uint8_t> tail(1u << 20);
  ASSERT_TRUE((*engine)->ReadBack(3, 4u << 20, tail).ok());
  EXPECT_TRUE(std::equal(tail.begin(), tail.end(), contents.begin() + (4u << 20)));
  EXPECT_EQ((*engine)->ReadBack(3, bo_size - 10, tail).code(), Code::kOutOfRange);
  EXPECT_EQ((*engine)->ReadBack(9, 0, tail).code(), Code::kNotFound);
  // The slots all came back: writes still go through afterwards.
  ASSERT_TRUE((*engine)->Write(3, 0, patch, [](Status st) { EXPECT_TRUE(st.ok()); }).ok());
  ASSERT_TRUE((*engine)->Write(3, 1u << 20, patch, [](Status st) { EXPECT_TRUE(st.ok()); }).ok());
  EXPECT_TRUE((*engine)->Flush().ok());
}

// Its slots are fixed at Create: an image whose chunks are larger is refused when the restore
// opens it (ExpectChunkBytes), not at its first write.
TEST(SdmaEngine, RefusesChunksLargerThanItsSlotsUpFront) {
  auto engine = MakeSdmaEngine(2, 1u << 20, std::chrono::microseconds(100));
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  EXPECT_TRUE((*engine)->ExpectChunkBytes(4096).ok());
  EXPECT_TRUE((*engine)->ExpectChunkBytes(1u << 20).ok());
  Status refused = (*engine)->ExpectChunkBytes((1u << 20) + 4096);
  EXPECT_EQ(refused.code(), Code::kInvalidArgument) << refused.ToString();
  EXPECT_NE(refused.message().find("1052672"), std::string::npos) << refused.ToString();
  EXPECT_NE(refused.message().find("1048576"), std::string::npos) << refused.ToString();
}

// ---- handoff ----

TEST(Handoff, RecordsCarryFdsInBatches) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv), 0);
  UniqueFd a(sv[0]), b(sv[1]);
  int sndbuf = 4 << 20;
  ::setsockopt(a.get(), SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
  ASSERT_TRUE(EnableSenderCredentials(b.get()).ok());
  UniqueFd self(static_cast<int>(::syscall(SYS_pidfd_open, ::getpid(), 0)));
  ASSERT_TRUE(self.valid());
  std::vector<HandedBo> bos;
  for (uint32_t i = 0; i < 150; ++i) {
    int fd = ::memfd_create("bo", MFD_CLOEXEC);
    ASSERT_EQ(::ftruncate(fd, 4096 * (i + 1)), 0);
    bos.push_back(HandedBo{i * 2, 0x1234, 4096ull * (i + 1), UniqueFd(fd)});
  }
  ASSERT_TRUE(SendHandoff(a.get(), 42, 3, bos, self.get()).ok());
  uint32_t seen = 0;
  bool last = false;
  while (!last) {
    auto r = ReceiveHandoff(b.get(), true);
    ASSERT_TRUE(r.ok()) << r.status().ToString();
    EXPECT_EQ(r->pid, 42u);
    EXPECT_EQ(r->sender_pid, static_cast<uint32_t>(::getpid()));  // the kernel's word
    EXPECT_EQ(r->pidfd.valid(), seen == 0);                       // with the first record only
    if (r->pidfd.valid()) {
      pollfd alive{r->pidfd.get(), POLLIN, 0};
      EXPECT_EQ(::poll(&alive, 1, 0), 0);  // this process is alive
    }
    EXPECT_EQ(r->file_id, 3u);
    for (auto& bo : r->bos) {
      EXPECT_EQ(bo.bo_index, seen * 2);
      off_t size = ::lseek(bo.dmabuf.get(), 0, SEEK_END);
      EXPECT_EQ(static_cast<uint64_t>(size), bo.size);
      ++seen;
    }
    last = r->last;
  }
  EXPECT_EQ(seen, 150u);
  EXPECT_EQ(ReceiveHandoff(b.get(), true).status().code(), Code::kTimeout);
  ASSERT_TRUE(SendHandoff(a.get(), 43, 4, {}).ok());  // a task without content BOs
  auto r = ReceiveHandoff(b.get(), true);
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->last);
  EXPECT_TRUE(r->bos.empty());
}

// ---- router: a dead task's BOs leave the stream ----

// Records every write it receives.
class RecordingEngine : public DeviceEngine {
 public:
  std::string_view name() const override { return "recording"; }
  Status Bind(uint32_t bo, UniqueFd, uint64_t) override {
    bound.insert(bo);
    return Status::Ok();
  }
  void Release(uint32_t bo) override { released.insert(bo); }
  Status Write(uint32_t bo, uint64_t, std::span<const uint8_t>, client::CopyDone done) override {
    ++writes[bo];
    done(Status::Ok());
    return Status::Ok();
  }
  Status Flush() override { return Status::Ok(); }
  Status ExpectChunkBytes(uint32_t max_bytes) override {
    told.push_back(max_bytes);
    if (max_bytes > max_chunk)
      return InvalidArgument("chunks of {} bytes exceed {}", max_bytes, max_chunk);
    return Status::Ok();
  }
  std::set<uint32_t> bound, released;
  std::map<uint32_t, int> writes;
  std::vector<uint32_t> told;  // every ExpectChunkBytes
  uint32_t max_chunk = 64u << 20;
};

// The session tells the router its image's chunk size at open, before any device engine exists
// (they come one per GPU with the first handed-over BO): each engine hears it at its first Bind,
// once, and one that cannot stage such chunks fails that Bind and takes nothing.
TEST(Router, NewEnginesHearTheChunkSizeAtTheirFirstBind) {
  Router router(/*discard_unbound=*/false);
  for (uint32_t bo : {0u, 1u, 2u, 3u})
    ASSERT_TRUE(router.AddDestination(bo, 1 << 20).ok());
  ASSERT_TRUE(router.ExpectChunkBytes(16u << 20).ok());
  RecordingEngine roomy;
  RecordingEngine small;
  small.max_chunk = 8u << 20;
  ASSERT_TRUE(router.Bind(0, &roomy, UniqueFd(), 1 << 20).ok());
  ASSERT_TRUE(router.Bind(1, &roomy, UniqueFd(), 1 << 20).ok());
  EXPECT_EQ(roomy.told, std::vector<uint32_t>{16u << 20});  // once, at its first Bind
  Status refused = router.Bind(2, &small, UniqueFd(), 1 << 20);
  EXPECT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("recording engine"), std::string::npos) << refused.ToString();
  EXPECT_EQ(small.bound.count(2), 0u);  // not bound: nothing reaches it
  std::vector<uint8_t> bytes(4096, 7);
  int done = 0;
  ASSERT_TRUE(router.Write(2, 0, bytes, [&](Status) { ++done; }).ok());
  EXPECT_EQ(done, 0);  // parked, not written to the engine that refused
  EXPECT_TRUE(small.writes.empty());
  // An engine already bound when the size arrives is asked at once.
  Router later(/*discard_unbound=*/false);
  ASSERT_TRUE(later.AddDestination(0, 1 << 20).ok());
  RecordingEngine bound_first;
  bound_first.max_chunk = 8u << 20;
  ASSERT_TRUE(later.Bind(0, &bound_first, UniqueFd(), 1 << 20).ok());
  EXPECT_TRUE(bound_first.told.empty());
  EXPECT_FALSE(later.ExpectChunkBytes(16u << 20).ok());
  router.FailParked(Aborted("test over"));
  EXPECT_EQ(done, 1);
}

TEST(Router, DropCompletesParkedAndLaterWritesAndReleasesTheBo) {
  Router router(/*discard_unbound=*/false);
  RecordingEngine engine;
  std::vector<uint8_t> bytes(4096, 7);
  for (uint32_t bo : {0u, 1u, 2u})
    ASSERT_TRUE(router.AddDestination(bo, 1 << 20).ok());
  std::vector<Status> done;
  auto record = [&](Status s) { done.push_back(std::move(s)); };
  ASSERT_TRUE(router.Write(1, 0, bytes, record).ok());  // parked: BO 1 not bound yet
  ASSERT_TRUE(router.Bind(0, &engine, UniqueFd(), 1 << 20).ok());
  EXPECT_EQ(router.parked(), 1u);
  EXPECT_TRUE(done.empty());

  EXPECT_EQ(router.Drop({0, 1}), 1u);  // BO 0 bound, BO 1 parked: both belong to a dead task
  ASSERT_EQ(done.size(), 1u);
  EXPECT_TRUE(done[0].ok());  // resident as far as the session cares: never fetched again
  EXPECT_EQ(router.parked(), 0u);
  EXPECT_EQ(engine.released, std::set<uint32_t>{0});

  ASSERT_TRUE(router.Write(0, 4096, bytes, record).ok());
  ASSERT_TRUE(router.Write(1, 4096, bytes, record).ok());
  EXPECT_EQ(done.size(), 3u);
  EXPECT_TRUE(engine.writes.empty());  // nothing reached the engine

  // A handoff that arrives after the death binds nothing.
  int fd = ::memfd_create("late-bo", MFD_CLOEXEC);
  ASSERT_TRUE(router.Bind(1, &engine, UniqueFd(fd), 1 << 20).ok());
  EXPECT_EQ(engine.bound.count(1), 0u);

  // Other BOs are untouched.
  ASSERT_TRUE(router.Bind(2, &engine, UniqueFd(), 1 << 20).ok());
  ASSERT_TRUE(router.Write(2, 0, bytes, record).ok());
  EXPECT_EQ(engine.writes[2], 1);
}

// ---- the fault channel: what restored programs can do to CRIU's master ----

// Tries `attempt` every 10 ms for up to 5 s, until it succeeds (each call may act).
template <typename Attempt>
bool Eventually(Attempt attempt) {
  for (int i = 0; i < 500; ++i) {
    if (attempt()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

// Ended connections do not leave threads behind until Stop: a program connecting once per
// fault for hours would otherwise pile up threads in CRIU's master until it could make none.
TEST(FaultChannel, ThreadsOfEndedConnectionsAreJoined) {
  TempDir dir;
  std::atomic<int> calls{0};
  FaultChannel channel(dir.path / "fault.sock", [&](uint32_t, uint64_t, uint64_t) {
    ++calls;
    return Status::Ok();
  });
  ASSERT_TRUE(channel.Start().ok());
  for (int i = 0; i < 64; ++i) {
    const int fd = gpulazy_fault_connect(channel.path().c_str());
    ASSERT_GE(fd, 0);
    ASSERT_EQ(gpulazy_ensure(fd, 0x1000, 4096), 0);
    gpulazy_fault_close(fd);
  }
  EXPECT_EQ(calls.load(), 64);
  // Each accept joins the threads that ended before it: only the last few can be left (one or
  // two here; a loaded machine may not have run a few threads to their end yet). 64 without.
  EXPECT_LE(channel.threads(), 16u);
  channel.Stop();
  EXPECT_EQ(channel.threads(), 0u);
}

// Past the limit a new connection is closed at once (its ensure fails, it never waits), those
// already open are still answered, and once one ends there is room again.
TEST(FaultChannel, ConnectionsPastTheLimitAreRefusedAndTheOthersServed) {
  TempDir dir;
  FaultChannel channel(
      dir.path / "fault.sock", [](uint32_t, uint64_t, uint64_t) { return Status::Ok(); },
      /*max_connections=*/4);
  ASSERT_TRUE(channel.Start().ok());
  std::vector<int> open;
  for (int i = 0; i < 4; ++i) {
    open.push_back(gpulazy_fault_connect(channel.path().c_str()));
    ASSERT_GE(open.back(), 0);
    ASSERT_EQ(gpulazy_ensure(open.back(), 0x1000, 4096), 0);
  }
  const int extra = gpulazy_fault_connect(channel.path().c_str());
  ASSERT_GE(extra, 0);  // the kernel accepted it into the backlog; the channel closes it
  EXPECT_NE(gpulazy_ensure(extra, 0x1000, 4096), 0);
  gpulazy_fault_close(extra);
  EXPECT_EQ(channel.refused(), 1u);
  for (int fd : open)
    EXPECT_EQ(gpulazy_ensure(fd, 0x2000, 4096), 0);
  gpulazy_fault_close(open.back());
  open.pop_back();
  // Its thread ends after it sees the close; the next accept then has room.
  int again = -1;
  ASSERT_TRUE(Eventually([&] {
    if (again >= 0) gpulazy_fault_close(again);
    again = gpulazy_fault_connect(channel.path().c_str());
    return again >= 0 && gpulazy_ensure(again, 0x3000, 4096) == 0;
  }));
  gpulazy_fault_close(again);
  for (int fd : open)
    gpulazy_fault_close(fd);
  channel.Stop();
}

// An exception from the resolver (out of memory, say) ends that connection only: before, it
// escaped the thread and std::terminate took CRIU's master down with every task's restore.
TEST(FaultChannel, AnExceptionInTheResolverEndsOnlyItsConnection) {
  TempDir dir;
  FaultChannel channel(dir.path / "fault.sock", [](uint32_t, uint64_t va, uint64_t) {
    if (va == 0xdead000) throw std::bad_alloc();
    return Status::Ok();
  });
  ASSERT_TRUE(channel.Start().ok());
  const int keeps = gpulazy_fault_connect(channel.path().c_str());
  const int throws = gpulazy_fault_connect(channel.path().c_str());
  ASSERT_GE(keeps, 0);
  ASSERT_GE(throws, 0);
  EXPECT_NE(gpulazy_ensure(throws, 0xdead000, 4096), 0);  // closed: the reply never comes
  gpulazy_fault_close(throws);
  EXPECT_EQ(gpulazy_ensure(keeps, 0x1000, 4096), 0);
  const int later = gpulazy_fault_connect(channel.path().c_str());
  ASSERT_GE(later, 0);
  EXPECT_EQ(gpulazy_ensure(later, 0x2000, 4096), 0);
  gpulazy_fault_close(later);
  gpulazy_fault_close(keeps);
  channel.Stop();
}

// ---- the image directory as a restored task sees it ----

int g_image_dir_fd = -1;  // what the fake criu_get_image_dir returns

// In a restored container's mount namespace the path the master resolved may name another
// directory (or none). A child process stands in for such a task: its own mount namespace
// mounts an empty directory over the image directory's path. ImageDir must still lead to the
// images, through the fd.
TEST(CriuHost, ImageDirLeadsToTheImagesWhereTheirPathNamesAnotherDirectory) {
  TempDir dir;
  const fs::path images = dir.path / "ckpt";
  const fs::path other = dir.path / "other";
  fs::create_directories(images);
  fs::create_directories(other);
  std::ofstream(images / "amdgpu-kfd-1.img") << "x";
  UniqueFd image_fd(::open(images.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  ASSERT_TRUE(image_fd.valid());
  g_image_dir_fd = image_fd.get();
  CriuHost host;
  host.criu_get_image_dir = [] { return g_image_dir_fd; };
  Result<fs::path> here = host.ImageDir();
  ASSERT_TRUE(here.ok()) << here.status().ToString();
  EXPECT_EQ(*here, fs::canonical(images));  // the master: the plain path

  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (::unshare(CLONE_NEWNS) != 0) ::_exit(77);
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) ::_exit(77);
    if (::mount(other.c_str(), images.c_str(), nullptr, MS_BIND, nullptr) != 0) ::_exit(77);
    if (fs::exists(images / "amdgpu-kfd-1.img")) ::_exit(3);  // the mount did not hide them
    Result<fs::path> there = host.ImageDir();
    if (!there.ok()) ::_exit(4);
    ::_exit(fs::exists(*there / "amdgpu-kfd-1.img") ? 0 : 5);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "no mount namespace here (needs root)";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "5: ImageDir named the directory mounted over the images";
}

// ---- Router::Bind's replay racing a Drop (session 61, found by review) ----

// Write blocks on its first call until `go`; a released BO refuses writes (as HostDmabufEngine
// and SdmaCopyEngine do).
class GatedEngine : public DeviceEngine {
 public:
  std::string_view name() const override { return "gated"; }
  Status Bind(uint32_t bo, UniqueFd, uint64_t) override {
    std::lock_guard l(m);
    bound.insert(bo);
    return Status::Ok();
  }
  void Release(uint32_t bo) override {
    std::lock_guard l(m);
    bound.erase(bo);
  }
  Status Write(uint32_t bo, uint64_t, std::span<const uint8_t>, client::CopyDone done) override {
    if (calls.fetch_add(1) == 0) {
      entered = true;
      while (!go)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    {
      std::lock_guard l(m);
      if (!bound.count(bo)) return NotFound("BO {} was released", bo);
    }
    done(Status::Ok());
    return Status::Ok();
  }
  Status Flush() override { return Status::Ok(); }
  std::mutex m;
  std::set<uint32_t> bound;
  std::atomic<int> calls{0};
  std::atomic<bool> entered{false}, go{false};
};

// A task dies (Drop) while the receiver's Bind replays the BO's parked writes: the writes still
// to replay go to an engine that has released the BO. As in Router::Write, that is not an error
// (until session 61 the replay handed the session a failed copy, failing every task's restore).
TEST(Router, ADropDuringABindsReplayIsNotAnError) {
  Router router(/*discard_unbound=*/false);
  ASSERT_TRUE(router.AddDestination(0, 1 << 20).ok());
  std::vector<uint8_t> bytes(4096, 7);
  std::mutex dm;
  std::vector<Status> done;
  auto record = [&](Status s) {
    std::lock_guard l(dm);
    done.push_back(std::move(s));
  };
  ASSERT_TRUE(router.Write(0, 0, bytes, record).ok());     // parked
  ASSERT_TRUE(router.Write(0, 4096, bytes, record).ok());  // parked
  GatedEngine engine;
  std::thread binder([&] { EXPECT_TRUE(router.Bind(0, &engine, UniqueFd(), 1 << 20).ok()); });
  while (!engine.entered)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  router.Drop({0});  // the task died: OnTaskDied on another thread
  engine.go = true;
  binder.join();
  ASSERT_EQ(done.size(), 2u);
  for (const Status& s : done)
    EXPECT_TRUE(s.ok()) << s.ToString();
}

// ---- a hand-over that failed, then exit(RESTORE, 0) (session 61, found by review) ----

class StubKfd : public Kfd {
 public:
  int fd() const override { return -1; }
  int CriuOp(kfd_ioctl_criu_args&) override { return 0; }
};
class StubKfdProvider : public KfdProvider {
 public:
  std::string_view name() const override { return "stub"; }
  Result<std::unique_ptr<Kfd>> Open() override {
    return std::unique_ptr<Kfd>(std::make_unique<StubKfd>());
  }
  Result<std::unique_ptr<Kfd>> Attach(int) override { return Unsupported("stub"); }
  bool IsKfd(int) const override { return false; }
  bool IsKfdPath(const std::string&) const override { return false; }
  Result<UniqueFd> OpenRenderNode(uint32_t) override { return Unsupported("stub"); }
  std::unique_ptr<DrmFile> AttachDrm(int) override { return nullptr; }
  bool real() const override { return false; }
};

// Runs in a child (it may hang): 0 = Finish returned, 2 = setup failed; SIGALRM = hung.
int FinishAfterAFailedHandOver(const fs::path& root) {
  image::SynthOptions o;
  o.out = root / "ckpt";
  o.gpus = 2;
  o.bos = 8;
  o.total_bytes = 4 << 20;
  if (!image::SynthesizeCheckpoint(o).ok()) return 2;
  auto bytes = ReadWholeFile(o.out / criu_format::KfdImageName(1), 1 << 30);
  if (!bytes.ok()) return 2;
  auto process = criu_format::ParseKfdProcess(std::span(*bytes).subspan(8), "kfd");
  if (!process.ok()) return 2;
  const uint32_t failing_gpu = process->devices(1).gpu_id();
  PluginConfig config;
  config.mode = Mode::kParallel;
  config.resume_timeout = std::chrono::milliseconds(2000);
  config.background_nice = 0;
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0) return 2;
  UniqueFd task_end(sv[1]);
  if (!EnableSenderCredentials(sv[0]).ok()) return 2;
  StubKfdProvider kfd;
  // The engine of the second GPU cannot be made (SDMA: no device, no pinned staging...).
  EngineFactory engines = [&](uint32_t gpu) -> Result<std::unique_ptr<DeviceEngine>> {
    if (gpu == failing_gpu) return Internal("no engine for gpu {:#x}", gpu);
    return std::unique_ptr<DeviceEngine>(std::make_unique<HostDmabufEngine>());
  };
  RestoreCoordinator coordinator(config, o.out, UniqueFd(sv[0]), kfd, engines);
  Status started = coordinator.Start();
  if (!started.ok()) {
    std::fprintf(stderr, "start: %s\n", started.ToString().c_str());
    return 2;
  }
  std::vector<HandedBo> handed;
  for (int i = 0; i < process->bos_size(); ++i) {
    const auto& bo = process->bos(i);
    if (!criu_format::HasContents(bo.alloc_flags())) continue;
    int fd = ::memfd_create("bo", MFD_CLOEXEC);
    if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(bo.size())) != 0) return 2;
    handed.push_back(HandedBo{static_cast<uint32_t>(i), bo.gpu_id(), bo.size(), UniqueFd(fd)});
  }
  if (!SendHandoff(task_end.get(), ::getpid(), 1, handed, -1).ok()) return 2;
  Status resumed = coordinator.ResumeTask(::getpid());
  std::fprintf(stderr, "RESUME_DEVICES_LATE: %s (CRIU only logs this)\n",
               resumed.ToString().c_str());
  // criu restore -d: exit(RESTORE, 0) right after the resume, the task still alive.
  Status finished = coordinator.Finish(true);
  std::fprintf(stderr, "Finish(true): %s\n", finished.ToString().c_str());
  if (finished.ok()) return 3;  // the hand-over's error must be what it returns
  return 0;
}

// A BO whose hand-over failed (its GPU's engine could not be made) is never bound: its chunks
// stay parked. Until session 61 exit(RESTORE, 0) then waited for the restore to complete, for
// ever; now it returns the hand-over's error.
TEST(Coordinator, ExitAfterAFailedHandOverReturnsItsError) {
  TempDir dir;
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::alarm(20);
    ::_exit(FinishAfterAFailedHandOver(dir.path));
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << "setup failed";
  ASSERT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 3) << "Finish said the restore is ok";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "Finish(true) did not return within 20 s (signal "
      << (WIFSIGNALED(status) ? WTERMSIG(status) : 0) << ")";
}

}  // namespace
}  // namespace gpulazy::plugin
