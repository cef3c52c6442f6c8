// Endpoint parsing, frames sent from files, payload wake-ups, the host copy engine, residency
// tracking and chunk decoding.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <lz4.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>

#include "lazy-server/image/io.h"
#include "page-client/chunk_codec.h"
#include "page-client/engine_gate.h"
#include "page-client/file_chunks.h"
#include "page-client/host_engine.h"
#include "page-client/net/endpoint.h"
#include "page-client/net/frame_stream.h"
#include "page-client/net/threads.h"
#include "page-client/populate_ahead.h"
#include "page-client/residency.h"
#include "proto/checksum.h"
#include "tests/client/forwarding_engine.h"
#include "tests/support/temp_dir.h"
#include "tests/support/threads.h"

namespace gpulazy::client {
namespace {

TEST(Endpoint, ParsesUnixAndTcp) {
  Result<net::Endpoint> unix_ep = net::Endpoint::Parse("unix:/run/x.sock");
  ASSERT_TRUE(unix_ep.ok());
  EXPECT_EQ(unix_ep->kind, net::Endpoint::Kind::kUnix);
  EXPECT_EQ(unix_ep->path, "/run/x.sock");
  Result<net::Endpoint> tcp = net::Endpoint::Parse("tcp:127.0.0.1:7070");
  ASSERT_TRUE(tcp.ok());
  EXPECT_EQ(tcp->host, "127.0.0.1");
  EXPECT_EQ(tcp->port, 7070);
  Result<net::Endpoint> v6 = net::Endpoint::Parse("tcp:[::1]:80");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->host, "::1");
  EXPECT_EQ(v6->ToString(), "tcp:[::1]:80");
}

TEST(Endpoint, RejectsMalformed) {
  for (const char* bad :
       {"", "unix:", "tcp:host", "tcp::80", "tcp:h:99999", "tcp:h:8x", "udp:h:1", "tcp:[::1]80"})
    EXPECT_FALSE(net::Endpoint::Parse(bad).ok()) << bad;
  EXPECT_FALSE(net::Endpoint::Parse("unix:/" + std::string(200, 'a')).ok());
}

// A frame sent from a file (sendfile) against one read back by the ordinary frame reader, over
// a Unix socket pair: `payload_at`/`payload_length` name the file range sent.
struct FromFileRun {
  Status written;
  Result<wire::Header> read = Internal("not read");
  std::vector<uint8_t> payload;
};
FromFileRun SendFromFile(int file_fd, uint64_t payload_at, uint32_t payload_length, bool tls,
                         bool reader_gone = false) {
  namespace asio = boost::asio;
  int fds[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  asio::io_context io;
  const asio::generic::stream_protocol unix_stream(AF_UNIX, SOCK_STREAM);
  net::Socket writer_socket(io, unix_stream, fds[0]);
  net::Socket reader_socket(io, unix_stream, fds[1]);
  auto tls_context = std::make_shared<net::TlsContext>(net::TlsContext::tls_server);
  net::Stream writer =
      tls ? net::Stream(std::move(writer_socket), tls_context, net::Stream::Side::kServer)
          : net::Stream(std::move(writer_socket));
  net::Stream reader(std::move(reader_socket));
  FromFileRun run;
  FrameLimits limits;
  wire::Header header;
  header.set_request_id(77);
  header.mutable_chunk()->set_bo(3);
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        run.written = co_await net::WriteFrameFromFile(writer, header, file_fd, payload_at,
                                                       payload_length, limits);
        boost::system::error_code ignored;
        writer.close(ignored);  // what the server does after a failed write
      },
      asio::detached);
  if (reader_gone) {
    boost::system::error_code ignored;
    reader.close(ignored);
  } else {
    asio::co_spawn(
        io,
        [&]() -> asio::awaitable<void> {
          run.read = co_await net::ReadFrame(reader, limits, &run.payload);
        },
        asio::detached);
  }
  io.run();
  return run;
}

// Socket buffers under net.core.[rw]mem_max, which many hosts keep at 208 KiB (a 2 MiB chunk
// would cross in ten pieces; TCP ran 30-50 % slower here, see docs/benchmarks.md): TuneSocket
// stays under the caps (the administrator's bound, kept for peers not yet let in), and
// ForceSocketBuffers passes them as root. The caps are lowered for the moment of the calls.
TEST(TuneSocket, OnlyForcedBuffersPassTheSysctlCaps) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root (SO_SNDBUFFORCE)";
  const std::array<const char*, 2> caps = {"/proc/sys/net/core/wmem_max",
                                           "/proc/sys/net/core/rmem_max"};
  // Two runs at once (the sanitizer builds' suites) must not save each other's lowered caps.
  UniqueFd lock(
      ::open("/tmp/gpulazy-test-sysctl.lock", O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
  ASSERT_TRUE(lock.valid());
  ASSERT_EQ(::flock(lock.get(), LOCK_EX), 0);
  std::array<std::string, 2> saved;
  for (size_t i = 0; i < caps.size(); ++i) {
    std::ifstream cap(caps[i]);  // procfs files have no size: read, do not stat
    if (!std::getline(cap, saved[i]) || saved[i].empty()) GTEST_SKIP() << "cannot read " << caps[i];
    saved[i] += '\n';
  }
  auto write_caps = [&](const std::array<std::string, 2>& values) {
    bool all = true;  // every file is tried, whatever failed before
    for (size_t i = 0; i < caps.size(); ++i) {
      UniqueFd fd(::open(caps[i], O_WRONLY | O_CLOEXEC));
      all = fd.valid() && ::write(fd.get(), values[i].data(), values[i].size()) > 0 && all;
    }
    return all;
  };
  boost::asio::io_context io;
  const boost::asio::generic::stream_protocol unix_stream(AF_UNIX, SOCK_STREAM);
  int plain_fds[2];
  int forced_fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, plain_fds), 0);
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, forced_fds), 0);
  net::Socket plain(io, unix_stream, plain_fds[0]);
  net::Socket forced(io, unix_stream, forced_fds[0]);
  UniqueFd plain_peer(plain_fds[1]);
  UniqueFd forced_peer(forced_fds[1]);
  constexpr int kCap = 212992;
  if (!write_caps({"212992\n", "212992\n"})) {
    write_caps(saved);
    GTEST_SKIP() << "cannot write net.core.[rw]mem_max here";
  }
  net::TuneSocket(plain);
  net::TuneSocket(forced);
  net::ForceSocketBuffers(forced);
  ASSERT_TRUE(write_caps(saved)) << "could not restore net.core.[rw]mem_max to " << saved[0];
  auto buffers = [](int fd) {
    std::array<int, 2> sizes{};
    socklen_t length = sizeof(int);
    EXPECT_EQ(::getsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sizes[0], &length), 0);
    length = sizeof(int);
    EXPECT_EQ(::getsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sizes[1], &length), 0);
    return sizes;
  };
  // The kernel reports twice what was set.
  for (int size : buffers(plain_fds[0]))
    EXPECT_LE(size, 2 * kCap);
  for (int size : buffers(forced_fds[0]))
    EXPECT_GE(size, net::kSocketBufferBytes);
}

class FrameFromFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Larger than a socket pair's buffer: the writer must wait for room, more than once.
    bytes_.resize(3u << 20);
    for (size_t i = 0; i < bytes_.size(); ++i)
      bytes_[i] = static_cast<uint8_t>(i * 131 + (i >> 12));
    fd_.reset(::open((dir_.path() / "pages").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600));
    ASSERT_TRUE(fd_.valid());
    ASSERT_EQ(::pwrite(fd_.get(), bytes_.data(), bytes_.size(), 0),
              static_cast<ssize_t>(bytes_.size()));
  }
  testing::TempDir dir_;
  UniqueFd fd_;
  std::vector<uint8_t> bytes_;
};

TEST_F(FrameFromFileTest, PayloadArrivesAsTheFileRange) {
  const uint64_t at = 4096 + 17;  // not page aligned
  const uint32_t length = static_cast<uint32_t>(bytes_.size() - at - 5);
  FromFileRun run = SendFromFile(fd_.get(), at, length, /*tls=*/false);
  ASSERT_TRUE(run.written.ok()) << run.written.ToString();
  ASSERT_TRUE(run.read.ok()) << run.read.status().ToString();
  EXPECT_EQ(run.read->request_id(), 77u);
  EXPECT_EQ(run.read->chunk().bo(), 3u);
  ASSERT_EQ(run.payload.size(), length);
  EXPECT_TRUE(std::equal(run.payload.begin(), run.payload.end(), bytes_.begin() + at));
}

// The file is shorter than the frame promised (it shrank after the server sized the chunk): the
// writer says so, and the reader sees a truncated frame, never a short or padded payload.
TEST_F(FrameFromFileTest, AFileThatEndsEarlyCutsTheFrameAndSaysWhy) {
  const uint32_t length = 1u << 20;
  FromFileRun run = SendFromFile(fd_.get(), bytes_.size() - 1000, length, /*tls=*/false);
  EXPECT_EQ(run.written.code(), Code::kCorrupt) << run.written.ToString();
  // 1000 bytes were there to send: the rest is missing.
  EXPECT_NE(run.written.message().find(std::to_string(length - 1000) + " bytes short"),
            std::string::npos)
      << run.written.ToString();
  EXPECT_EQ(run.read.status().code(), Code::kCorrupt) << run.read.status().ToString();
}

// sendfile has no MSG_NOSIGNAL: a reader that is gone must give an error, not a SIGPIPE (which
// gtest does not ignore: this process would die).
TEST_F(FrameFromFileTest, AReaderGoneIsAnErrorNotASignal) {
  FromFileRun run = SendFromFile(fd_.get(), 0, 2u << 20, /*tls=*/false, /*reader_gone=*/true);
  EXPECT_EQ(run.written.code(), Code::kUnavailable) << run.written.ToString();
  sigset_t pending;
  sigpending(&pending);
  EXPECT_EQ(sigismember(&pending, SIGPIPE), 0) << "a SIGPIPE was left pending";
}

TEST_F(FrameFromFileTest, TlsStreamsAndOversizedPayloadsAreRefused) {
  FromFileRun tls = SendFromFile(fd_.get(), 0, 4096, /*tls=*/true);
  EXPECT_EQ(tls.written.code(), Code::kUnsupported) << tls.written.ToString();
  EXPECT_FALSE(tls.read.ok()) << "nothing may have been written on the TLS stream";
  FromFileRun huge = SendFromFile(fd_.get(), 0, FrameLimits{}.max_payload + 1, /*tls=*/false);
  EXPECT_EQ(huge.written.code(), Code::kResourceExhausted) << huge.written.ToString();
}

// A connected loopback TCP pair, as plain fds (the reader's end wrapped by the caller).
struct TcpPair {
  UniqueFd reader, writer;
};
TcpPair ConnectedTcpPair() {
  TcpPair pair;
  UniqueFd listener(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  EXPECT_EQ(::bind(listener.get(), reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  EXPECT_EQ(::listen(listener.get(), 1), 0);
  EXPECT_EQ(::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&address), &length), 0);
  pair.writer.reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  EXPECT_EQ(::connect(pair.writer.get(), reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  pair.reader.reset(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
  EXPECT_TRUE(pair.reader.valid());
  int one = 1;
  ::setsockopt(pair.writer.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return pair;
}

int ReceiveLowWatermark(int fd) {
  int mark = -1;
  socklen_t length = sizeof mark;
  EXPECT_EQ(::getsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &mark, &length), 0);
  return mark;
}

// The mark follows the read on plain TCP, capped, and is 1 again once the payload is read, so
// the next frame head (a few bytes) wakes the reader; Unix sockets and TLS never get one.
TEST(PayloadWatermark, SetOnPlainTcpOnlyAndLoweredAfterwards) {
  namespace asio = boost::asio;
  asio::io_context io;
  TcpPair tcp = ConnectedTcpPair();
  const int tcp_fd = tcp.reader.get();
  net::Stream tcp_stream(
      net::Socket(io, asio::generic::stream_protocol(AF_INET, SOCK_STREAM), tcp.reader.release()));
  {
    net::PayloadWatermark mark(tcp_stream);
    EXPECT_TRUE(mark.active());
    mark.Expect(100000);
    EXPECT_EQ(ReceiveLowWatermark(tcp_fd), 100000);
    mark.Expect(64u << 20);
    EXPECT_EQ(ReceiveLowWatermark(tcp_fd), static_cast<int>(net::PayloadWatermark::kMaxBytes));
    mark.Expect(0);
    EXPECT_EQ(ReceiveLowWatermark(tcp_fd), 1);
    mark.Expect(4096);
  }
  EXPECT_EQ(ReceiveLowWatermark(tcp_fd), 1);
  {
    net::PayloadWatermark off(tcp_stream, /*enabled=*/false);
    EXPECT_FALSE(off.active());
    off.Expect(4096);
    EXPECT_EQ(ReceiveLowWatermark(tcp_fd), 1);
  }

  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds), 0);
  UniqueFd unix_peer(fds[1]);
  net::Stream unix_stream(
      net::Socket(io, asio::generic::stream_protocol(AF_UNIX, SOCK_STREAM), fds[0]));
  net::PayloadWatermark unix_mark(unix_stream);
  EXPECT_FALSE(unix_mark.active());
  unix_mark.Expect(4096);
  EXPECT_EQ(ReceiveLowWatermark(fds[0]), 1);

  TcpPair tls = ConnectedTcpPair();
  const int tls_fd = tls.reader.get();
  net::Stream tls_stream(
      net::Socket(io, asio::generic::stream_protocol(AF_INET, SOCK_STREAM), tls.reader.release()),
      std::make_shared<net::TlsContext>(net::TlsContext::tls_client), net::Stream::Side::kClient);
  net::PayloadWatermark tls_mark(tls_stream);
  EXPECT_FALSE(tls_mark.active());
  tls_mark.Expect(4096);
  EXPECT_EQ(ReceiveLowWatermark(tls_fd), 1);
}

// A payload trickling in (16 pieces, 3 ms apart) is read whole with the reader asleep once or
// twice rather than once per piece; its last bytes, after which nothing more comes, still wake
// it (a mark above what the read still needs would leave them stranded); and a frame after it
// is read as usual.
TEST(PayloadWatermark, ReadsATricklingPayloadWithFewWakeupsAndEveryByte) {
  namespace asio = boost::asio;
  asio::io_context io;
  TcpPair tcp = ConnectedTcpPair();
  net::Stream reader(
      net::Socket(io, asio::generic::stream_protocol(AF_INET, SOCK_STREAM), tcp.reader.release()));
  constexpr size_t kPiece = 16000;  // not a divisor of the mark's cap: the last read is short
  constexpr int kPieces = 16;
  std::vector<uint8_t> sent(kPiece * kPieces);
  for (size_t i = 0; i < sent.size(); ++i)
    sent[i] = static_cast<uint8_t>(i * 7 + 3);
  wire::Header after;
  after.set_request_id(5);
  after.mutable_stream_done()->set_chunks(1);
  Result<std::string> after_bytes = EncodeFrameHead(after, 0, FrameLimits{});
  ASSERT_TRUE(after_bytes.ok());
  std::thread writer([&] {
    for (int i = 0; i < kPieces; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(3));
      ASSERT_EQ(::send(tcp.writer.get(), sent.data() + i * kPiece, kPiece, MSG_NOSIGNAL),
                static_cast<ssize_t>(kPiece));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_EQ(::send(tcp.writer.get(), after_bytes->data(), after_bytes->size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(after_bytes->size()));
  });
  std::vector<uint8_t> received(sent.size());
  Status read = Internal("not run");
  Result<wire::Header> next = Internal("not run");
  long sleeps = -1;
  asio::co_spawn(
      io,
      [&]() -> asio::awaitable<void> {
        rusage before{}, after_read{};
        ::getrusage(RUSAGE_THREAD, &before);
        {
          net::PayloadWatermark mark(reader);
          read = co_await net::ReadPayload(reader, std::span(received), mark);
        }
        ::getrusage(RUSAGE_THREAD, &after_read);
        sleeps = after_read.ru_nvcsw - before.ru_nvcsw;
        std::vector<uint8_t> payload;
        next = co_await net::ReadFrame(reader, FrameLimits{}, &payload);
      },
      asio::detached);
  io.run_for(std::chrono::seconds(30));
  writer.join();
  ASSERT_TRUE(read.ok()) << read.ToString();
  EXPECT_EQ(received, sent);
  // Without the mark the reader sleeps between the pieces: about 16 times.
  EXPECT_LE(sleeps, 3) << "the reader was woken per segment";
  ASSERT_TRUE(next.ok()) << next.status().ToString();
  EXPECT_TRUE(next->has_stream_done());
}

TEST(Threads, EachPoolThreadIsNamedAndLoweredOnce) {
  const int base = testing::ListThreads().at(static_cast<pid_t>(::gettid())).nice;
  ASSERT_LE(base, 19 - 4) << "the test needs room to lower a priority";
  boost::asio::thread_pool pool(3);
  std::mutex mu;
  std::set<std::thread::id> ran_on;
  int calls = 0;
  net::RunOnEachPoolThread(pool, 3, [&] {
    net::NameThisThread("gl-test-pool-thread-long-name");  // kept: its first 15 characters
    EXPECT_TRUE(net::LowerThisThreadPriority(4).ok());
    std::lock_guard lock(mu);
    ran_on.insert(std::this_thread::get_id());
    ++calls;
  });
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(ran_on.size(), 3u) << "a pool thread ran it twice";
  EXPECT_FALSE(ran_on.contains(std::this_thread::get_id()));
  EXPECT_EQ(testing::NiceOfThreadsNamed("gl-test-pool-th"),
            (std::vector<int>{base + 4, base + 4, base + 4}));
  EXPECT_EQ(testing::ListThreads().at(static_cast<pid_t>(::gettid())).nice, base);
  pool.join();
}

TEST(Threads, PriorityIsOnlyLoweredAndCappedAt19) {
  std::thread([] {
    const pid_t tid = static_cast<pid_t>(::gettid());
    const int base = testing::ListThreads().at(tid).nice;
    EXPECT_EQ(net::LowerThisThreadPriority(-1).code(), Code::kInvalidArgument);
    EXPECT_TRUE(net::LowerThisThreadPriority(0).ok());
    EXPECT_EQ(testing::ListThreads().at(tid).nice, base);
    EXPECT_TRUE(net::LowerThisThreadPriority(100).ok());
    EXPECT_EQ(testing::ListThreads().at(tid).nice, 19);
  }).join();
}

TEST(HostCopyEngine, WritesLandInTheMemfd) {
  HostCopyEngine engine;
  ASSERT_TRUE(engine.AddDestination(3, 8192).ok());
  std::vector<uint8_t> bytes(100, 0xab);
  int done_calls = 0;
  ASSERT_TRUE(engine
                  .Write(3, 4000, bytes,
                         [&](Status s) {
                           EXPECT_TRUE(s.ok());
                           ++done_calls;
                         })
                  .ok());
  EXPECT_EQ(done_calls, 1);
  Result<std::span<uint8_t>> mapping = engine.Mapping(3);
  ASSERT_TRUE(mapping.ok());
  EXPECT_EQ(mapping->size(), 8192u);
  EXPECT_EQ((*mapping)[4000], 0xab);
  EXPECT_EQ((*mapping)[4099], 0xab);
  EXPECT_EQ((*mapping)[4100], 0);
  // The fd names the same memory.
  Result<int> fd = engine.Fd(3);
  ASSERT_TRUE(fd.ok());
  uint8_t b = 0;
  ASSERT_EQ(::pread(*fd, &b, 1, 4050), 1);
  EXPECT_EQ(b, 0xab);
  EXPECT_EQ(engine.bytes_written(), 100u);
}

// Bytes of [from, to) of a shared mapping whose pages exist (mincore), in whole pages.
uint64_t ResidentBytes(std::span<uint8_t> memory, uint64_t from, uint64_t to) {
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> pages((to - from) / page);
  EXPECT_EQ(::mincore(memory.data() + from, to - from, pages.data()), 0) << std::strerror(errno);
  return page * static_cast<uint64_t>(std::count_if(pages.begin(), pages.end(),
                                                    [](unsigned char p) { return p & 1; }));
}

// Polls until the thread has populated at least `bytes` (it works asynchronously).
bool PopulatedAtLeast(const std::function<uint64_t()>& populated, uint64_t bytes) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (populated() < bytes) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

TEST(PopulateAhead, FaultsInPagesAheadOfTheWriterAndNoFurther) {
  constexpr uint64_t kMiB = 1u << 20;
  Result<MemfdRegion> region = MemfdRegion::Create("populate-test", 64 * kMiB);
  ASSERT_TRUE(region.ok()) << region.status().message();
  const std::span<uint8_t> memory = region->bytes();
  PopulateAhead populate(8 * kMiB);
  populate.AddRegion(5, memory);
  populate.WritingAt(5, 0, 2 * kMiB);
  ASSERT_TRUE(PopulatedAtLeast([&] { return populate.populated_bytes(); }, 8 * kMiB));
  EXPECT_EQ(ResidentBytes(memory, 2 * kMiB, 10 * kMiB), 8 * kMiB);  // ahead of the write
  EXPECT_EQ(ResidentBytes(memory, 0, 2 * kMiB), 0u);                // the writer's own range
  EXPECT_EQ(ResidentBytes(memory, 10 * kMiB, 64 * kMiB), 0u);       // bounded by `ahead`
  // The writer jumps (another run of chunks): the thread follows it there.
  populate.WritingAt(5, 40 * kMiB, 2 * kMiB);
  ASSERT_TRUE(PopulatedAtLeast([&] { return populate.populated_bytes(); }, 16 * kMiB));
  EXPECT_EQ(ResidentBytes(memory, 42 * kMiB, 50 * kMiB), 8 * kMiB);
  EXPECT_EQ(ResidentBytes(memory, 10 * kMiB, 42 * kMiB), 0u);
  EXPECT_EQ(ResidentBytes(memory, 50 * kMiB, 64 * kMiB), 0u);
  // Near the end it stops at the region's end; unknown regions and bad ranges are ignored.
  populate.WritingAt(5, 60 * kMiB, 2 * kMiB);
  populate.WritingAt(6, 0, 2 * kMiB);
  populate.WritingAt(5, 63 * kMiB, 2 * kMiB);
  ASSERT_TRUE(PopulatedAtLeast([&] { return populate.populated_bytes(); }, 18 * kMiB));
  EXPECT_EQ(ResidentBytes(memory, 62 * kMiB, 64 * kMiB), 2 * kMiB);
  EXPECT_EQ(populate.populated_bytes(), 18 * kMiB);
}

TEST(PopulateAhead, OffMeansNoThreadAndNothingPopulated) {
  Result<MemfdRegion> region = MemfdRegion::Create("populate-off", 8u << 20);
  ASSERT_TRUE(region.ok()) << region.status().message();
  PopulateAhead populate(0);
  EXPECT_FALSE(populate.enabled());
  populate.AddRegion(0, region->bytes());
  populate.WritingAt(0, 0, 4096);
  EXPECT_EQ(populate.populated_bytes(), 0u);
  EXPECT_EQ(ResidentBytes(region->bytes(), 0, 8u << 20), 0u);
}

TEST(PopulateAhead, StopsPromptlyWhenDestroyedMidRegion) {
  Result<MemfdRegion> region = MemfdRegion::Create("populate-stop", 256u << 20);
  ASSERT_TRUE(region.ok()) << region.status().message();
  uint64_t populated = 0;
  {
    PopulateAhead populate(256u << 20);
    populate.AddRegion(0, region->bytes());
    populate.WritingAt(0, 0, 0);
    ASSERT_TRUE(PopulatedAtLeast([&] { return populate.populated_bytes(); }, 2u << 20));
    populated = populate.populated_bytes();
  }  // joins: a thread that ignored the stop would populate all 256 MiB first
  EXPECT_LT(ResidentBytes(region->bytes(), 0, 256u << 20), 256u << 20);
  EXPECT_GE(ResidentBytes(region->bytes(), 0, 256u << 20), populated);
}

TEST(HostCopyEngine, PopulatesTheDestinationAheadOfReceives) {
  HostCopyEngine engine;  // default options: on, 32 MiB ahead
  ASSERT_TRUE(engine.AddDestination(1, 16u << 20).ok());
  // The first chunk finds fresh pages and is written through the file; what follows it is
  // populated, so the next chunk is received in place.
  const std::vector<uint8_t> first(2u << 20, 0x5a);
  ASSERT_TRUE(engine.Write(1, 0, first, nullptr).ok());
  ASSERT_TRUE(PopulatedAtLeast([&] { return engine.populated_bytes(); }, 14u << 20));
  Result<std::span<uint8_t>> mapping = engine.Mapping(1);
  ASSERT_TRUE(mapping.ok());
  EXPECT_EQ(ResidentBytes(*mapping, 2u << 20, 16u << 20), 14u << 20);
  EXPECT_TRUE(engine.ReceiveTarget(1, 2u << 20, 2u << 20).has_value());
  // The option turns it off.
  HostCopyEngine quiet(HostEngineOptions{.populate_ahead_bytes = 0});
  ASSERT_TRUE(quiet.AddDestination(1, 16u << 20).ok());
  ASSERT_TRUE(quiet.Write(1, 0, first, nullptr).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(quiet.populated_bytes(), 0u);
  EXPECT_EQ(ResidentBytes(*quiet.Mapping(1), 2u << 20, 16u << 20), 0u);
}

// A running helper fills megabytes within milliseconds (the tests above); a stopped one, given
// far longer, must fill nothing.
TEST(PopulateAhead, StopEndsTheHelperForGood) {
  Result<MemfdRegion> region = MemfdRegion::Create("populate-stopped", 16u << 20);
  ASSERT_TRUE(region.ok()) << region.status().message();
  PopulateAhead populate(8u << 20);
  populate.AddRegion(0, region->bytes());
  populate.Stop();
  populate.Stop();  // idempotent, and the destructor after it too
  populate.WritingAt(0, 0, 2u << 20);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(populate.populated_bytes(), 0u);
  EXPECT_EQ(ResidentBytes(region->bytes(), 0, 16u << 20), 0u);
}

// Several writers (file readers, local readers) fault their own pages in parallel: the engine
// drops its helper when told to expect them, and keeps it for one.
TEST(HostCopyEngine, SeveralWritersStopThePopulateHelper) {
  HostCopyEngine one;
  one.ExpectWriters(1);
  ASSERT_TRUE(one.AddDestination(1, 16u << 20).ok());
  ASSERT_TRUE(one.Write(1, 0, std::vector<uint8_t>(2u << 20, 1), nullptr).ok());
  ASSERT_TRUE(PopulatedAtLeast([&] { return one.populated_bytes(); }, 14u << 20));

  HostCopyEngine many;
  many.ExpectWriters(4);
  ASSERT_TRUE(many.AddDestination(1, 16u << 20).ok());
  ASSERT_TRUE(many.ReceiveTarget(1, 0, 2u << 20).has_value());
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(many.populated_bytes(), 0u);
  Result<std::span<uint8_t>> mapping = many.Mapping(1);
  ASSERT_TRUE(mapping.ok());
  EXPECT_EQ(ResidentBytes(*mapping, 2u << 20, 16u << 20), 0u);

  // One writer again (a server refused the files those writers would read): the helper follows
  // the writes again, and fresh pages go through the file again.
  many.ExpectWriters(1);
  EXPECT_FALSE(many.ReceiveTarget(1, 8u << 20, 2u << 20).has_value());
  ASSERT_TRUE(many.Write(1, 8u << 20, std::vector<uint8_t>(2u << 20, 2), nullptr).ok());
  ASSERT_TRUE(PopulatedAtLeast([&] { return many.populated_bytes(); }, 6u << 20));
  EXPECT_EQ(ResidentBytes(*mapping, 10u << 20, 16u << 20), 6u << 20);
}

// Paused, the helper thread is gone and nothing is populated; unpaused, a new one works again.
TEST(PopulateAhead, PausedDoesNothingUntilResumed) {
  Result<MemfdRegion> region = MemfdRegion::Create("populate-paused", 16u << 20);
  ASSERT_TRUE(region.ok()) << region.status().message();
  PopulateAhead populate(8u << 20);
  populate.AddRegion(0, region->bytes());
  populate.SetPaused(true);
  EXPECT_TRUE(testing::NiceOfThreadsNamed("gl-populate").empty());  // no idle thread kept
  populate.WritingAt(0, 0, 2u << 20);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  EXPECT_EQ(populate.populated_bytes(), 0u);
  EXPECT_EQ(ResidentBytes(region->bytes(), 0, 16u << 20), 0u);
  populate.SetPaused(false);
  EXPECT_EQ(testing::NiceOfThreadsNamedAwaiting("gl-populate", 1).size(), 1u);
  populate.WritingAt(0, 0, 2u << 20);
  ASSERT_TRUE(PopulatedAtLeast([&] { return populate.populated_bytes(); }, 8u << 20));
  EXPECT_EQ(ResidentBytes(region->bytes(), 2u << 20, 10u << 20), 8u << 20);
}

// Fresh pages (none allocated yet) are written through the memfd, and ReceiveTarget declines
// them so that the session hands those chunks to Write; pages that exist take chunks in place.
// The bytes land the same either way.
TEST(HostCopyEngine, WritesFreshPagesThroughTheFile) {
  constexpr uint64_t kMiB = 1u << 20;
  HostCopyEngine engine(HostEngineOptions{.populate_ahead_bytes = 0});
  ASSERT_TRUE(engine.AddDestination(1, 16 * kMiB).ok());
  Result<std::span<uint8_t>> mapping = engine.Mapping(1);
  ASSERT_TRUE(mapping.ok());
  EXPECT_FALSE(engine.ReceiveTarget(1, 4 * kMiB, 2 * kMiB).has_value());  // fresh: declined

  std::vector<uint8_t> bytes(2 * kMiB + 100);
  for (size_t i = 0; i < bytes.size(); ++i)
    bytes[i] = static_cast<uint8_t>(i * 7 + 1);
  int done_calls = 0;
  ASSERT_TRUE(engine
                  .Write(1, 3 * kMiB - 50, bytes,
                         [&](Status s) {
                           EXPECT_TRUE(s.ok());
                           ++done_calls;
                         })
                  .ok());
  EXPECT_EQ(done_calls, 1);
  EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), mapping->begin() + 3 * kMiB - 50));
  EXPECT_EQ((*mapping)[3 * kMiB - 51], 0);  // nothing around the write
  EXPECT_EQ((*mapping)[5 * kMiB + 50], 0);
  EXPECT_EQ(ResidentBytes(*mapping, 3 * kMiB - 4096, 5 * kMiB + 4096), 2 * kMiB + 8192);
  EXPECT_EQ(engine.bytes_written(), bytes.size());

  // Pages that exist (touched here, as populating ahead would) are lent for a receive.
  for (uint64_t at = 8 * kMiB; at < 10 * kMiB; at += 4096)
    (*mapping)[at] = 0;
  std::optional<std::span<uint8_t>> target = engine.ReceiveTarget(1, 8 * kMiB, 2 * kMiB);
  ASSERT_TRUE(target.has_value());
  EXPECT_EQ(target->data(), mapping->data() + 8 * kMiB);
  EXPECT_TRUE(engine.CommitReceived(1, 8 * kMiB, 2 * kMiB, nullptr).ok());

  // Off, fresh pages are lent as before; several writers turn it off too.
  HostCopyEngine mapped(HostEngineOptions{.populate_ahead_bytes = 0, .write_fresh_pages = false});
  ASSERT_TRUE(mapped.AddDestination(1, 16 * kMiB).ok());
  EXPECT_TRUE(mapped.ReceiveTarget(1, 4 * kMiB, 2 * kMiB).has_value());
  HostCopyEngine readers(HostEngineOptions{.populate_ahead_bytes = 0});
  readers.ExpectWriters(4);
  ASSERT_TRUE(readers.AddDestination(1, 16 * kMiB).ok());
  EXPECT_TRUE(readers.ReceiveTarget(1, 4 * kMiB, 2 * kMiB).has_value());
}

// PrepareDestination faults in the missing pages of a waited range, never changes a byte that
// is there, stops where the writer has already been, and ignores what is out of bounds or off.
TEST(HostCopyEngine, PrepareDestinationFaultsInMissingPagesAndKeepsBytes) {
  constexpr uint64_t kMiB = 1u << 20;
  HostCopyEngine engine(HostEngineOptions{.populate_ahead_bytes = 0});
  ASSERT_TRUE(engine.AddDestination(1, 16 * kMiB).ok());
  Result<std::span<uint8_t>> mapping = engine.Mapping(1);
  ASSERT_TRUE(mapping.ok());

  engine.PrepareDestination(1, 2 * kMiB + 100, 2 * kMiB);
  EXPECT_EQ(ResidentBytes(*mapping, 2 * kMiB, 4 * kMiB + 4096), 2 * kMiB + 4096);
  EXPECT_EQ(ResidentBytes(*mapping, 0, 2 * kMiB), 0u);  // nothing outside the range
  EXPECT_EQ(ResidentBytes(*mapping, 4 * kMiB + 4096, 16 * kMiB), 0u);
  EXPECT_EQ(engine.prepared_bytes(), 2 * kMiB + 4096);
  // (Reading a shared mapping allocates its pages too: only the prepared range is read.)
  EXPECT_TRUE(std::all_of(mapping->begin() + 2 * kMiB, mapping->begin() + 4 * kMiB + 4096,
                          [](uint8_t b) { return b == 0; }));

  // Bytes a writer has put there stay, and a range whose front the writer has reached is left
  // to it: only the pieces behind that are still missing get faulted in.
  std::vector<uint8_t> front(300 * 1024, 0x5a);
  std::copy(front.begin(), front.end(), mapping->begin() + 8 * kMiB);
  const uint64_t before = engine.prepared_bytes();
  engine.PrepareDestination(1, 8 * kMiB, 2 * kMiB);
  EXPECT_TRUE(std::all_of(mapping->begin() + 8 * kMiB, mapping->begin() + 8 * kMiB + front.size(),
                          [](uint8_t b) { return b == 0x5a; }));
  // Pieces of 256 KiB from the back: the one at 8 MiB + 256 KiB starts in the written bytes.
  EXPECT_EQ(engine.prepared_bytes() - before, 2 * kMiB - 512 * 1024);
  EXPECT_EQ(ResidentBytes(*mapping, 8 * kMiB + 512 * 1024, 10 * kMiB), 2 * kMiB - 512 * 1024);

  // A fresh range then takes its chunk in place: the pages exist.
  EXPECT_TRUE(engine.ReceiveTarget(1, 2 * kMiB, 2 * kMiB).has_value());
  engine.ReleaseReceived(1, 2 * kMiB, 2 * kMiB);

  // Out of bounds, unknown BOs, empty ranges: nothing happens.
  const uint64_t settled = engine.prepared_bytes();
  engine.PrepareDestination(1, 16 * kMiB, 4096);
  engine.PrepareDestination(1, 15 * kMiB, 2 * kMiB);
  engine.PrepareDestination(2, 0, 4096);
  engine.PrepareDestination(1, 12 * kMiB, 0);
  EXPECT_EQ(engine.prepared_bytes(), settled);
  EXPECT_EQ(ResidentBytes(*mapping, 12 * kMiB, 16 * kMiB), 0u);

  HostCopyEngine off(HostEngineOptions{.populate_ahead_bytes = 0, .prepare_waited_ranges = false});
  ASSERT_TRUE(off.AddDestination(1, 4 * kMiB).ok());
  off.PrepareDestination(1, 0, 2 * kMiB);
  Result<std::span<uint8_t>> off_mapping = off.Mapping(1);
  ASSERT_TRUE(off_mapping.ok());
  EXPECT_EQ(ResidentBytes(*off_mapping, 0, 4 * kMiB), 0u);
  EXPECT_EQ(off.prepared_bytes(), 0u);
}

// With several writers, fresh chunks go through the mapping by default, through the file with
// kWrite, and with kOnePerBo through the file for one chunk of a BO at a time (a second pwrite
// into its memfd would wait on the inode lock): from ReceiveTarget's decline to its Write, or
// until the claim lapses.
TEST(HostCopyEngine, SeveralWritersWriteFreshPagesAsConfigured) {
  constexpr uint64_t kMiB = 1u << 20;
  using FreshPages = HostEngineOptions::FreshPages;
  HostCopyEngine always(HostEngineOptions{.populate_ahead_bytes = 0,
                                          .fresh_pages_with_several_writers = FreshPages::kWrite});
  always.ExpectWriters(8);
  ASSERT_TRUE(always.AddDestination(1, 16 * kMiB).ok());
  EXPECT_FALSE(always.ReceiveTarget(1, 4 * kMiB, 2 * kMiB).has_value());
  EXPECT_FALSE(always.ReceiveTarget(1, 6 * kMiB, 2 * kMiB).has_value());

  HostCopyEngine one(HostEngineOptions{.populate_ahead_bytes = 0,
                                       .fresh_pages_with_several_writers = FreshPages::kOnePerBo});
  one.ExpectWriters(8);
  ASSERT_TRUE(one.AddDestination(1, 16 * kMiB).ok());
  ASSERT_TRUE(one.AddDestination(2, 4 * kMiB).ok());
  EXPECT_FALSE(one.ReceiveTarget(1, 0, 2 * kMiB).has_value());  // claims BO 1's file
  std::optional<std::span<uint8_t>> lent = one.ReceiveTarget(1, 2 * kMiB, 2 * kMiB);
  EXPECT_TRUE(lent.has_value());                                // the mapping, meanwhile
  EXPECT_FALSE(one.ReceiveTarget(2, 0, 2 * kMiB).has_value());  // another BO, another file
  if (lent) one.ReleaseReceived(1, 2 * kMiB, 2 * kMiB);

  std::vector<uint8_t> bytes(2 * kMiB, 0x3c);
  ASSERT_TRUE(one.Write(1, 0, bytes, nullptr).ok());  // the claimed chunk, by pwrite
  Result<std::span<uint8_t>> mapping = one.Mapping(1);
  ASSERT_TRUE(mapping.ok());
  EXPECT_TRUE(std::all_of(mapping->begin(), mapping->begin() + 2 * kMiB,
                          [](uint8_t b) { return b == 0x3c; }));
  EXPECT_FALSE(one.ReceiveTarget(1, 4 * kMiB, 2 * kMiB).has_value());  // released: claimed again
  EXPECT_TRUE(one.ReceiveTarget(1, 6 * kMiB, 2 * kMiB).has_value());
  one.ReleaseReceived(1, 6 * kMiB, 2 * kMiB);
  // A claim whose chunk never reaches Write (its receive failed) lapses.
  std::this_thread::sleep_for(HostCopyEngine::kFileWriteClaim * 3);
  EXPECT_FALSE(one.ReceiveTarget(1, 8 * kMiB, 2 * kMiB).has_value());
  // One writer again: every fresh chunk goes through the file.
  one.ExpectWriters(1);
  EXPECT_FALSE(one.ReceiveTarget(1, 10 * kMiB, 2 * kMiB).has_value());
}

// The host engine takes calls from several threads at once (CopyEngine::ConcurrentCalls):
// writes of disjoint ranges, fresh and populated pages mixed, all land.
TEST(HostCopyEngine, TakesConcurrentWritesOfDisjointRanges) {
  constexpr uint64_t kChunk = 64 * 1024;
  constexpr uint32_t kThreads = 8;
  constexpr uint32_t kChunksEach = 32;
  HostCopyEngine engine;
  EXPECT_TRUE(engine.ConcurrentCalls());
  ASSERT_TRUE(engine.AddDestination(0, kChunk * kThreads * kChunksEach).ok());
  Result<std::span<uint8_t>> mapping = engine.Mapping(0);
  ASSERT_TRUE(mapping.ok());
  for (uint64_t at = 0; at < mapping->size(); at += 3 * kChunk)  // every third chunk exists
    (*mapping)[at + kChunk - 1] = 0;
  std::atomic<uint32_t> completed{0};
  auto done = [&](Status s) {
    EXPECT_TRUE(s.ok());
    ++completed;
  };
  std::vector<std::thread> threads;
  for (uint32_t t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      std::vector<uint8_t> bytes(kChunk);
      for (uint32_t i = 0; i < kChunksEach; ++i) {
        const uint64_t chunk = uint64_t{i} * kThreads + t;
        std::fill(bytes.begin(), bytes.end(), static_cast<uint8_t>(chunk + 1));
        if (auto target = engine.ReceiveTarget(0, chunk * kChunk, kChunk)) {
          std::memcpy(target->data(), bytes.data(), kChunk);
          EXPECT_TRUE(engine.CommitReceived(0, chunk * kChunk, kChunk, done).ok());
        } else {
          EXPECT_TRUE(engine.Write(0, chunk * kChunk, bytes, done).ok());
        }
      }
    });
  for (std::thread& thread : threads)
    thread.join();
  EXPECT_EQ(completed.load(), kThreads * kChunksEach);
  for (uint64_t chunk = 0; chunk < kThreads * kChunksEach; ++chunk)
    for (uint64_t at : {uint64_t{0}, kChunk - 1})
      ASSERT_EQ((*mapping)[chunk * kChunk + at], static_cast<uint8_t>(chunk + 1))
          << "chunk " << chunk;
}

// Zero writes: whole pages punched out of the memfd (no memory held; they read as zeros), the
// parts of pages at either end zeroed in place, the bytes around kept; bounds as for Write.
TEST(HostCopyEngine, ZeroWritesFreeWholePagesAndZeroTheRest) {
  const auto page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  HostCopyEngine engine(HostEngineOptions{.populate_ahead_bytes = 0});
  const uint64_t size = 16 * page + 100;  // a BO that is not whole pages
  ASSERT_TRUE(engine.AddDestination(0, size).ok());
  std::vector<uint8_t> bytes(size);
  for (size_t i = 0; i < bytes.size(); ++i)
    bytes[i] = static_cast<uint8_t>(i % 251 + 1);
  ASSERT_TRUE(engine.Write(0, 0, bytes, nullptr).ok());
  Result<std::span<uint8_t>> mapping = engine.Mapping(0);
  ASSERT_TRUE(mapping.ok());
  ASSERT_EQ(ResidentBytes(*mapping, 0, 16 * page), 16 * page);
  int done_calls = 0;
  auto count = [&](Status s) {
    EXPECT_TRUE(s.ok()) << s.ToString();
    ++done_calls;
  };
  // Pages 2-5 whole, half of page 8 to a quarter into page 11, and the BO's short last page.
  const std::vector<std::pair<uint64_t, uint64_t>> ranges = {
      {2 * page, 4 * page}, {8 * page + page / 2, 2 * page + page / 4}, {16 * page, 100}};
  for (const auto& [offset, length] : ranges) {
    ASSERT_TRUE(engine.WriteZeros(0, offset, length, count).ok());
    std::fill_n(bytes.begin() + static_cast<std::ptrdiff_t>(offset), length, 0);
  }
  EXPECT_EQ(done_calls, 3);
  EXPECT_EQ(ResidentBytes(*mapping, 2 * page, 6 * page), 0u);    // punched out
  EXPECT_EQ(ResidentBytes(*mapping, 9 * page, 10 * page), 0u);   // the whole page of the second
  EXPECT_EQ(ResidentBytes(*mapping, 8 * page, 9 * page), page);  // zeroed in place
  EXPECT_TRUE(std::equal(bytes.begin(), bytes.end(), mapping->begin()));
  EXPECT_EQ(engine.bytes_zeroed(), 4 * page + 2 * page + page / 4 + 100);
  bool called = false;
  auto mark = [&](Status) { called = true; };
  EXPECT_EQ(engine.WriteZeros(0, size - 10, 11, mark).code(), Code::kOutOfRange);
  EXPECT_EQ(engine.WriteZeros(0, UINT64_MAX - 4, 8, mark).code(), Code::kOutOfRange);
  EXPECT_EQ(engine.WriteZeros(1, 0, 8, mark).code(), Code::kNotFound);
  EXPECT_FALSE(called);
  EXPECT_TRUE(engine.AddDestination(9, 0).ok());
  EXPECT_TRUE(engine.WriteZeros(9, 0, 0, nullptr).ok());  // an empty BO, an empty range
}

TEST(HostCopyEngine, RejectsOutOfBoundsAndUnknownBos) {
  HostCopyEngine engine;
  ASSERT_TRUE(engine.AddDestination(0, 4096).ok());
  EXPECT_EQ(engine.AddDestination(0, 4096).code(), Code::kInvalidArgument);
  std::vector<uint8_t> bytes(16);
  bool called = false;
  auto done = [&](Status) { called = true; };
  EXPECT_EQ(engine.Write(0, 4090, bytes, done).code(), Code::kOutOfRange);
  EXPECT_EQ(engine.Write(0, 5000, bytes, done).code(), Code::kOutOfRange);
  EXPECT_EQ(engine.Write(0, UINT64_MAX - 4, bytes, done).code(), Code::kOutOfRange);
  EXPECT_EQ(engine.Write(1, 0, bytes, done).code(), Code::kNotFound);
  EXPECT_FALSE(called);
  EXPECT_TRUE(engine.Write(0, 4080, bytes, done).ok());  // exactly to the end
  EXPECT_TRUE(called);
  EXPECT_FALSE(engine.Mapping(7).ok());
  EXPECT_TRUE(engine.AddDestination(9, 0).ok());  // an empty BO has no mapping but is valid
  EXPECT_TRUE(engine.Write(9, 0, {}, nullptr).ok());
}

// InstallFileChunk over a file whose bytes we control: a chunk of 1 MiB + 4 KiB (several read
// slices, the last one short) at an odd offset, received in place into the host engine.
class InstallFileChunkTest : public ::testing::Test {
 protected:
  static constexpr uint32_t kLength = (1u << 20) + 4096;
  static constexpr uint64_t kFileOffset = 12345;

  void SetUp() override {
    fd_ = ::memfd_create("install-file-chunk-test", MFD_CLOEXEC);
    ASSERT_GE(fd_, 0);
    bytes_.resize(kLength);
    for (size_t i = 0; i < bytes_.size(); ++i)
      bytes_[i] = static_cast<uint8_t>(i * 7 + i / 4096);
    WriteFile();
    ASSERT_TRUE(engine_.AddDestination(0, 4u << 20).ok());
  }
  void TearDown() override { ::close(fd_); }

  void WriteFile() {
    ASSERT_EQ(::pwrite(fd_, bytes_.data(), bytes_.size(), kFileOffset),
              static_cast<ssize_t>(bytes_.size()));
  }

  FileChunk Chunk(std::optional<uint64_t> checksum) const {
    return FileChunk{.bo = 0,
                     .chunk = 1,
                     .dest_offset = 1u << 20,
                     .raw_length = kLength,
                     .checksum = checksum,
                     .fd = fd_,
                     .file_offset = kFileOffset,
                     .stored_length = kLength};
  }

  Status Install(const FileChunk& c, int* done_calls) {
    return InstallFileChunk(
        engine_, engine_gate_, Urgency::kBackground, c, buffers_, scratch_, "BO 0 chunk 1",
        [=](Status s) {
          EXPECT_TRUE(s.ok());
          ++*done_calls;
        },
        &bytes_read_);
  }

  std::span<uint8_t> Destination() { return engine_.Mapping(0)->subspan(1u << 20, kLength); }

  int fd_ = -1;
  std::vector<uint8_t> bytes_;
  HostCopyEngine engine_;
  EngineGate engine_gate_;
  ChunkBufferPool buffers_{2};
  std::vector<uint8_t> scratch_;
  uint64_t bytes_read_ = 0;
};

TEST_F(InstallFileChunkTest, VerifiedChunkLandsByteExact) {
  int done_calls = 0;
  ASSERT_TRUE(Install(Chunk(Checksum64(bytes_)), &done_calls).ok());
  EXPECT_EQ(done_calls, 1);
  EXPECT_TRUE(std::ranges::equal(Destination(), bytes_));
  EXPECT_EQ(bytes_read_, kLength);
}

TEST_F(InstallFileChunkTest, BadBytesAreRefusedAndNothingUnverifiedStays) {
  const uint64_t checksum = Checksum64(bytes_);
  // One flipped byte in the last (short) slice: only a hash over every slice catches it.
  bytes_[kLength - 10] ^= 0x40;
  WriteFile();
  int done_calls = 0;
  Status status = Install(Chunk(checksum), &done_calls);
  EXPECT_EQ(status.code(), Code::kCorrupt) << status.ToString();
  EXPECT_NE(status.message().find("BO 0 chunk 1: checksum mismatch"), std::string::npos)
      << status.message();
  EXPECT_EQ(done_calls, 0);
  EXPECT_TRUE(std::ranges::all_of(Destination(), [](uint8_t b) { return b == 0; }));
}

TEST_F(InstallFileChunkTest, ChunkWithoutChecksumIsInstalledAsRead) {
  int done_calls = 0;
  ASSERT_TRUE(Install(Chunk(std::nullopt), &done_calls).ok());
  EXPECT_EQ(done_calls, 1);
  EXPECT_TRUE(std::ranges::equal(Destination(), bytes_));
}

TEST_F(InstallFileChunkTest, ShortFileIsAnErrorAndInstallsNothing) {
  ASSERT_EQ(::ftruncate(fd_, kFileOffset + kLength / 2), 0);
  int done_calls = 0;
  Status status = Install(Chunk(Checksum64(bytes_)), &done_calls);
  EXPECT_FALSE(status.ok());
  EXPECT_EQ(done_calls, 0);
  EXPECT_TRUE(std::ranges::all_of(Destination(), [](uint8_t b) { return b == 0; }));
}

// BO 0's first chunk: the whole of `fd`'s `length` bytes, raw and without a checksum.
FileChunk WholeFileChunk(int fd, uint32_t length) {
  return FileChunk{.bo = 0,
                   .chunk = 0,
                   .dest_offset = 0,
                   .raw_length = length,
                   .checksum = std::nullopt,
                   .fd = fd,
                   .file_offset = 0,
                   .stored_length = length};
}

// The wait to enter the engine gate is counted apart (FileReadTimes::gate_wait_ns) and inside
// the engine time: a chunk installed while another thread holds the gate for 30 ms after it
// began to wait waits that long, and an install with the gate free waits for nothing of the
// kind. (The install is urgent so that the holder sees it waiting: counting 30 ms from the
// holder's entry failed once under load, the installer having reached the gate 5 ms late.)
TEST(InstallFileChunkTimes, WaitAtTheGateIsCountedWithinEngineTime) {
  const int fd = ::memfd_create("gate-wait", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  constexpr uint32_t kLength = 64 << 10;
  ASSERT_EQ(::ftruncate(fd, kLength), 0);
  HostCopyEngine engine;
  ASSERT_TRUE(engine.AddDestination(0, kLength).ok());
  EngineGate gate;
  ChunkBufferPool buffers{1};
  std::vector<uint8_t> scratch;
  const FileChunk chunk = WholeFileChunk(fd, kLength);
  FileReadTimes free_gate;
  ASSERT_TRUE(InstallFileChunk(
                  engine, gate, Urgency::kBackground, chunk, buffers, scratch, "BO 0 chunk 0",
                  [](const Status&) {}, nullptr, &free_gate)
                  .ok());
  EXPECT_LT(free_gate.gate_wait_s(), 0.010) << "waited at a gate no one held";

  FileReadTimes held_gate;
  std::promise<void> holding;
  std::thread holder([&] {
    std::lock_guard hold(gate);
    holding.set_value();
    for (int i = 0; i < 10000 && gate.urgent_waiting() == 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
  });
  holding.get_future().wait();
  Status installed = InstallFileChunk(
      engine, gate, Urgency::kUrgent, chunk, buffers, scratch, "BO 0 chunk 0", [](const Status&) {},
      nullptr, &held_gate);
  holder.join();
  ::close(fd);
  ASSERT_TRUE(installed.ok()) << installed.message();
  EXPECT_GE(held_gate.gate_wait_s(), 0.025) << "the 30 ms behind the holder are not counted";
  EXPECT_LE(held_gate.gate_wait_s(), held_gate.engine_s()) << "the wait is outside engine time";
}

// An engine that takes concurrent commits (CopyEngine::ConcurrentCommits) is lent its buffer
// under the gate and committed outside it; any other is committed under the gate. The engine
// below starts a thread in ReceiveTarget that takes the gate as soon as the lend leaves it and
// holds it until the commit or for `hold`; the commit waits up to `patience` for that thread to
// be holding the gate. It can be only while the commit is outside the gate.
class GateProbeEngine : public ForwardingHostEngine {
 public:
  GateProbeEngine(EngineGate& gate, bool concurrent_commits, std::chrono::milliseconds hold,
                  std::chrono::milliseconds patience)
      : gate_(gate), concurrent_commits_(concurrent_commits), hold_(hold), patience_(patience) {}
  ~GateProbeEngine() override {
    release_.store(true);
    if (holder_.joinable()) holder_.join();
  }
  std::string_view name() const override { return "gate-probe"; }
  bool ConcurrentCommits() const override { return concurrent_commits_; }
  std::optional<std::span<uint8_t>> ReceiveTarget(uint32_t bo, uint64_t offset,
                                                  uint64_t length) override {
    holder_ = std::thread([this] {
      std::lock_guard hold(gate_);
      holding_.store(true);
      const auto until = std::chrono::steady_clock::now() + hold_;
      while (!release_.load() && std::chrono::steady_clock::now() < until)
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      holding_.store(false);
    });
    (void)bo, (void)offset;
    lent_.assign(length, 0);
    return std::span<uint8_t>(lent_);
  }
  Status CommitReceived(uint32_t bo, uint64_t offset, uint64_t length, CopyDone done) override {
    const auto give_up = std::chrono::steady_clock::now() + patience_;
    while (!holding_.load() && std::chrono::steady_clock::now() < give_up)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    committed_beside_holder_ = holding_.load();
    release_.store(true);
    if (length != lent_.size())
      return InvalidArgument("commit of {} bytes, {} lent", length, lent_.size());
    return host_.Write(bo, offset, lent_, std::move(done));
  }
  bool committed_beside_holder() const { return committed_beside_holder_; }

 private:
  EngineGate& gate_;
  const bool concurrent_commits_;
  const std::chrono::milliseconds hold_;
  const std::chrono::milliseconds patience_;
  std::vector<uint8_t> lent_;
  std::thread holder_;
  std::atomic<bool> holding_{false};
  std::atomic<bool> release_{false};
  bool committed_beside_holder_ = false;
};

bool CommittedBesideAGateHolder(bool concurrent_commits, std::chrono::milliseconds hold,
                                std::chrono::milliseconds patience) {
  const int fd = ::memfd_create("gate-probe", MFD_CLOEXEC);
  EXPECT_GE(fd, 0);
  constexpr uint32_t kLength = 64 << 10;
  EXPECT_EQ(::ftruncate(fd, kLength), 0);
  EngineGate gate;
  GateProbeEngine engine(gate, concurrent_commits, hold, patience);
  EXPECT_TRUE(engine.AddDestination(0, kLength).ok());
  ChunkBufferPool buffers{1};
  std::vector<uint8_t> scratch;
  const FileChunk chunk = WholeFileChunk(fd, kLength);
  bool written = false;
  Status status = InstallFileChunk(
      engine, gate, Urgency::kBackground, chunk, buffers, scratch, "BO 0 chunk 0",
      [&](const Status& s) { written = s.ok(); }, nullptr);
  ::close(fd);
  EXPECT_TRUE(status.ok()) << status.message();
  EXPECT_TRUE(engine.Flush().ok());
  EXPECT_TRUE(written);
  return engine.committed_beside_holder();
}

TEST(InstallFileChunkGate, ConcurrentCommitsLeaveTheGateToOthers) {
  EXPECT_TRUE(CommittedBesideAGateHolder(true, std::chrono::seconds(10), std::chrono::seconds(10)))
      << "the commit held the gate although the engine takes concurrent commits";
}

// The holder gives the gate up after 100 ms (the commit waits for it); the commit, under the gate,
// never sees it holding.
TEST(InstallFileChunkGate, SerialEnginesCommitUnderTheGate) {
  EXPECT_FALSE(CommittedBesideAGateHolder(false, std::chrono::milliseconds(100),
                                          std::chrono::milliseconds(300)))
      << "another thread held the gate during the commit of a one-caller-at-a-time engine";
}

// A chunk whose read fails hands its lent destination back: that engine call, and its wait at
// the gate, are engine time like any other (Progress::file_engine_s), not time between chunks.
TEST(InstallFileChunkTimes, ReleaseAfterAFailedReadCountsAsEngineTime) {
  class SlowReleaseEngine : public ForwardingHostEngine {
   public:
    std::optional<std::span<uint8_t>> ReceiveTarget(uint32_t, uint64_t, uint64_t length) override {
      lent_.assign(length, 0xAA);
      return std::span<uint8_t>(lent_);
    }
    void ReleaseReceived(uint32_t, uint64_t, uint64_t) override {
      std::this_thread::sleep_for(std::chrono::milliseconds(30));
      released_ = true;
    }
    std::string_view name() const override { return "slow-release"; }
    std::vector<uint8_t> lent_;
    bool released_ = false;
  };
  const int fd = ::memfd_create("short-file", MFD_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 4096), 0);  // the chunk below wants 64 KiB: the read comes up short
  SlowReleaseEngine engine;
  EngineGate gate;
  ChunkBufferPool buffers{1};
  std::vector<uint8_t> scratch;
  FileReadTimes times;
  const FileChunk chunk{.bo = 0,
                        .chunk = 0,
                        .dest_offset = 0,
                        .raw_length = 64 << 10,
                        .checksum = std::nullopt,
                        .fd = fd,
                        .file_offset = 0,
                        .stored_length = 64 << 10};
  Status status = InstallFileChunk(engine, gate, Urgency::kBackground, chunk, buffers, scratch,
                                   "BO 0 chunk 0", nullptr, nullptr, &times);
  ::close(fd);
  EXPECT_FALSE(status.ok());
  EXPECT_TRUE(engine.released_);
  EXPECT_TRUE(std::ranges::all_of(engine.lent_, [](uint8_t b) { return b == 0; }))
      << "bytes read before the failure were left in the lent destination";
  EXPECT_GE(times.engine_s(), 0.030) << "the release's 30 ms are not in the engine time";
}

TEST(Residency, GeometryAndStates) {
  std::vector<uint64_t> sizes{10000, 4096, 0};
  Result<ResidencyMap> created = ResidencyMap::Create(4096, sizes);
  ASSERT_TRUE(created.ok());
  ResidencyMap& map = *created;
  EXPECT_EQ(map.total_chunks(), 4u);  // 3 + 1 + 0
  EXPECT_EQ(map.chunk_count(0), 3u);
  EXPECT_EQ(map.ChunkLength(0, 2), 10000u - 8192u);
  EXPECT_TRUE(map.CheckChunk(0, 2).ok());
  EXPECT_EQ(map.CheckChunk(0, 3).code(), Code::kOutOfRange);
  EXPECT_EQ(map.CheckChunk(3, 0).code(), Code::kOutOfRange);
  EXPECT_EQ(map.CheckChunk(2, 0).code(), Code::kOutOfRange);

  Result<ChunkRun> run = map.Covering(0, 4095, 2);
  ASSERT_TRUE(run.ok());
  EXPECT_EQ(*run, (ChunkRun{0, 0, 2}));
  EXPECT_EQ(map.Covering(0, 9999, 2).status().code(), Code::kOutOfRange);
  EXPECT_EQ(map.Covering(0, UINT64_MAX, 2).status().code(), Code::kOutOfRange);

  EXPECT_TRUE(map.MarkLanding(0, 1));
  EXPECT_FALSE(map.MarkLanding(0, 1));  // never applied twice
  EXPECT_TRUE(map.held(0, 1));
  EXPECT_FALSE(map.resident(0, 1));
  EXPECT_TRUE(map.MarkResident(0, 1));
  EXPECT_FALSE(map.MarkResident(0, 1));
  EXPECT_EQ(map.resident_chunks(), 1u);
  EXPECT_EQ(map.resident_bytes(), 4096u);
  ASSERT_TRUE(map.MarkLanding(0, 2));
  ASSERT_TRUE(map.MarkResident(0, 2));
  ASSERT_TRUE(map.MarkLanding(1, 0));
  EXPECT_EQ(map.HeldRuns(), (std::vector<ChunkRun>{{0, 1, 2}, {1, 0, 1}}));
  map.set_demanded(0, 0);
  EXPECT_EQ(map.PendingDemandRuns(), (std::vector<ChunkRun>{{0, 0, 1}}));
  EXPECT_TRUE(map.UnrequestedRuns().empty());
  EXPECT_FALSE(map.complete());
  ASSERT_TRUE(map.MarkResident(1, 0));
  ASSERT_TRUE(map.MarkLanding(0, 0));
  ASSERT_TRUE(map.MarkResident(0, 0));
  EXPECT_TRUE(map.complete());
  EXPECT_EQ(map.resident_bytes(), 10000u + 4096u);
}

// An abandoned BO: its missing chunks become abandoned (held: never claimed, listed in the Have),
// a landing one still lands, and the map completes without the abandoned ones.
TEST(Residency, AbandonedChunksAreSettledButNeverResident) {
  std::vector<uint64_t> sizes{4 * 4096, 10000};
  Result<ResidencyMap> created = ResidencyMap::Create(4096, sizes);
  ASSERT_TRUE(created.ok());
  ResidencyMap& map = *created;
  ASSERT_TRUE(map.MarkLanding(1, 0));
  ASSERT_TRUE(map.MarkResident(1, 0));
  ASSERT_TRUE(map.MarkLanding(1, 2));  // on its way when the BO is abandoned
  map.set_demanded(1, 1);
  std::vector<ChunkRun> runs;
  map.Abandon(1, &runs);
  EXPECT_EQ(runs, (std::vector<ChunkRun>{{1, 1, 1}}));
  EXPECT_TRUE(map.abandoned(1, 1));
  EXPECT_FALSE(map.abandoned(1, 0));
  EXPECT_FALSE(map.abandoned(1, 2));
  EXPECT_TRUE(map.held(1, 1));
  EXPECT_TRUE(map.settled(1, 1));
  EXPECT_FALSE(map.resident(1, 1));
  EXPECT_FALSE(map.MarkLanding(1, 1));  // a copy arriving now is dropped
  EXPECT_EQ(map.abandoned_chunks(), 1u);
  EXPECT_EQ(map.abandoned_bytes(), 4096u);
  EXPECT_TRUE(map.PendingDemandRuns().empty());  // demanded, but no longer wanted
  EXPECT_EQ(map.UnrequestedRuns(), (std::vector<ChunkRun>{{0, 0, 4}}));
  EXPECT_EQ(map.HeldRuns(), (std::vector<ChunkRun>{{1, 0, 3}}));
  runs.clear();
  map.Abandon(1, &runs);  // idempotent
  EXPECT_TRUE(runs.empty());
  EXPECT_EQ(map.abandoned_chunks(), 1u);
  EXPECT_FALSE(map.complete());
  ASSERT_TRUE(map.MarkResident(1, 2));
  for (uint32_t chunk = 0; chunk < 4; ++chunk) {
    ASSERT_TRUE(map.MarkLanding(0, chunk));
    ASSERT_TRUE(map.MarkResident(0, chunk));
  }
  EXPECT_TRUE(map.complete());
  EXPECT_EQ(map.resident_chunks(), 6u);
  EXPECT_EQ(map.resident_bytes(), 4u * 4096 + 4096 + (10000 - 8192));
}

// Only chunks someone waits for wake waiters when they land (and the last one, which ends
// WaitComplete); the flags survive the landing -> resident transition.
TEST(Residency, OnlyWaitedHotOrLastLandingsWake) {
  std::vector<uint64_t> sizes{4 * 4096};
  Result<ResidencyMap> created = ResidencyMap::Create(4096, sizes);
  ASSERT_TRUE(created.ok());
  ResidencyMap& map = *created;
  map.set_waited(0, 1);
  map.set_hot(0, 2);
  EXPECT_TRUE(map.waited(0, 1));
  EXPECT_FALSE(map.waited(0, 2));  // hot is not waited: it is not installed ahead of others
  for (uint32_t chunk = 0; chunk < 3; ++chunk) {
    ASSERT_TRUE(map.MarkLanding(0, chunk));
    ASSERT_TRUE(map.MarkResident(0, chunk));
  }
  EXPECT_FALSE(map.LandingWakes(0, 0));
  EXPECT_TRUE(map.LandingWakes(0, 1));
  EXPECT_TRUE(map.LandingWakes(0, 2));
  EXPECT_TRUE(map.waited(0, 1));
  ASSERT_TRUE(map.MarkLanding(0, 3));
  ASSERT_TRUE(map.MarkResident(0, 3));
  EXPECT_TRUE(map.LandingWakes(0, 3));  // the last one: complete
}

// An urgent caller gets the gate ahead of a background caller that was waiting longer: the
// background one is queued on the gate before the urgent one arrives, and still goes second.
TEST(EngineGate, UrgentCallerGoesBeforeEarlierBackgroundCaller) {
  EngineGate gate;
  std::mutex order_mu;
  std::string order;
  auto note = [&](char who) {
    std::lock_guard lock(order_mu);
    order += who;
  };
  gate.lock();  // a background install in progress
  std::thread background([&] {
    std::lock_guard hold(gate);
    note('B');
  });
  // Let it queue on the gate first (with a plain mutex it would then be served first).
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::thread urgent([&] {
    EngineHold hold(gate, Urgency::kUrgent);
    note('U');
  });
  while (gate.urgent_waiting() == 0)
    std::this_thread::yield();
  gate.unlock();
  urgent.join();
  background.join();
  EXPECT_EQ(order, "UB");
  EXPECT_EQ(gate.urgent_waiting(), 0u);
}

// Mutual exclusion holds across both entries (a plain counter, incremented under the gate by
// background and urgent callers at once, loses no increment).
TEST(EngineGate, ExcludesAcrossBothEntries) {
  EngineGate gate;
  uint64_t counter = 0;
  constexpr int kThreads = 6;
  constexpr int kRounds = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      const Urgency urgency = t % 3 == 0 ? Urgency::kUrgent : Urgency::kBackground;
      for (int i = 0; i < kRounds; ++i) {
        EngineHold hold(gate, urgency);
        uint64_t seen = counter;
        if (i % 64 == 0) std::this_thread::yield();  // widen the window a lost update needs
        counter = seen + 1;
      }
    });
  for (std::thread& thread : threads)
    thread.join();
  EXPECT_EQ(counter, uint64_t{kThreads} * kRounds);
  EXPECT_EQ(gate.urgent_waiting(), 0u);
}

// An open gate (for an engine that takes concurrent calls) lets every caller in at once.
TEST(EngineGate, OpenGateLetsEveryCallerIn) {
  EngineGate gate(/*serialize=*/false);
  gate.lock();
  std::thread([&] {
    EngineHold urgent(gate, Urgency::kUrgent);
    std::lock_guard background(gate);
  }).join();  // would hang on a closed gate
  gate.unlock();
  EXPECT_EQ(gate.urgent_waiting(), 0u);
}

// EngineHold with `waited` adds the time spent waiting to enter.
TEST(EngineGate, HoldReportsTheWait) {
  EngineGate gate;
  gate.lock();
  std::chrono::nanoseconds waited{0};
  std::thread urgent([&] { EngineHold hold(gate, Urgency::kUrgent, &waited); });
  while (gate.urgent_waiting() == 0)
    std::this_thread::yield();
  std::this_thread::sleep_for(std::chrono::milliseconds(30));
  gate.unlock();
  urgent.join();
  EXPECT_GE(waited, std::chrono::milliseconds(30));
}

TEST(Residency, RefusesHugeTables) {
  std::vector<uint64_t> sizes{uint64_t{1} << 62};
  EXPECT_EQ(ResidencyMap::Create(4096, sizes).status().code(), Code::kResourceExhausted);
  EXPECT_FALSE(ResidencyMap::Create(0, sizes).ok());
}

TEST(ChunkCodec, DecodesAndVerifiesEveryCodec) {
  std::vector<uint8_t> raw(5000);
  for (size_t i = 0; i < raw.size(); ++i)
    raw[i] = static_cast<uint8_t>(i % 13);
  wire::ChunkData data;
  data.set_raw_length(5000);
  data.set_checksum(Checksum64(raw));
  std::vector<uint8_t> out;

  data.set_codec(manifest::CODEC_RAW);
  ASSERT_TRUE(DecodeChunkPayload(data, raw, &out, "c").ok());
  EXPECT_EQ(out, raw);

  std::vector<uint8_t> lz4(LZ4_compressBound(5000));
  lz4.resize(LZ4_compress_default(reinterpret_cast<const char*>(raw.data()),
                                  reinterpret_cast<char*>(lz4.data()), 5000, int(lz4.size())));
  data.set_codec(manifest::CODEC_LZ4);
  out.clear();
  ASSERT_TRUE(DecodeChunkPayload(data, lz4, &out, "c").ok());
  EXPECT_EQ(out, raw);
  std::vector<uint8_t> truncated(lz4.begin(), lz4.end() - 3);
  EXPECT_EQ(DecodeChunkPayload(data, truncated, &out, "c").code(), Code::kCorrupt);

  std::vector<uint8_t> zeros(5000, 0);
  data.set_codec(manifest::CODEC_ZERO);
  data.set_checksum(Checksum64(zeros));
  ASSERT_TRUE(DecodeChunkPayload(data, {}, &out, "c").ok());
  EXPECT_EQ(out, zeros);
  EXPECT_EQ(DecodeChunkPayload(data, raw, &out, "c").code(), Code::kCorrupt);

  data.set_codec(manifest::CODEC_RAW);
  data.set_checksum(Checksum64(raw) ^ 1);
  Status bad = DecodeChunkPayload(data, raw, &out, "image x, BO 1, chunk 2");
  EXPECT_EQ(bad.code(), Code::kCorrupt);
  EXPECT_NE(bad.message().find("BO 1, chunk 2"), std::string::npos);
  data.set_checksum(Checksum64(raw));
  std::vector<uint8_t> short_raw(raw.begin(), raw.end() - 1);
  EXPECT_EQ(DecodeChunkPayload(data, short_raw, &out, "c").code(), Code::kCorrupt);
  data.set_codec(static_cast<manifest::Codec>(9));
  EXPECT_EQ(DecodeChunkPayload(data, raw, &out, "c").code(), Code::kCorrupt);
}

}  // namespace
}  // namespace gpulazy::client
