// The userfaultfd pager end to end: a real gpulazy-server, a RestoreSession, a UffdCopyEngine
// and real userfaultfd faults. Every wait is bounded.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>

#include "lazy-server/image/criu_checkpoint.h"
#include "lazy-server/image/image_source.h"
#include "lazy-server/image/io.h"
#include "lazy-server/image/lazy_image.h"
#include "lazy-server/image/synth.h"
#include "page-client/restore_session.h"
#include "page-client/uffd/handover.h"
#include "page-client/uffd/mappings.h"
#include "page-client/uffd/memory.h"
#include "page-client/uffd/pager.h"
#include "page-client/uffd/uffd_engine.h"
#include "page-client/uffd/userfaultfd.h"
#include "tests/server/test_support.h"
#include "tests/support/sanitizers.h"

namespace gpulazy::uffd {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using server::testing::ServerProcess;
using server::testing::TempDir;

// A small synthetic checkpoint converted to a lazy image with 64 KiB chunks (many chunks, so
// faults and the background stream overlap).
fs::path MakeImage(const fs::path& root, uint64_t bytes) {
  image::SynthOptions synth;
  synth.out = root / "ckpt";
  synth.gpus = 1;
  synth.bos = 6;
  synth.total_bytes = bytes;
  EXPECT_TRUE(image::SynthesizeCheckpoint(synth).ok());
  auto checkpoint = image::CriuCheckpoint::Open(synth.out);
  EXPECT_TRUE(checkpoint.ok());
  image::ConvertOptions convert;
  convert.chunk_size = 64 << 10;
  EXPECT_TRUE(image::ConvertToLazyImage(*checkpoint, convert).ok());
  return synth.out;
}

// The source bytes of every BO, in session order, straight from the CRIU pages files.
std::vector<std::vector<uint8_t>> SourceBytes(const fs::path& dir,
                                              const std::vector<client::BoEntry>& bos) {
  auto source = image::ImageSource::Open(dir);
  EXPECT_TRUE(source.ok());
  std::vector<std::vector<uint8_t>> out;
  for (const client::BoEntry& entry : bos) {
    for (const manifest::Bo& bo : (*source)->manifest().bos()) {
      if (bo.process_id() != entry.process_id || bo.bo_index() != entry.bo_index) continue;
      auto fd = OpenForRead(dir / bo.source_file());
      EXPECT_TRUE(fd.ok());
      std::vector<uint8_t> bytes(bo.size());
      EXPECT_TRUE(ReadExactAt(fd->get(), 8 + bo.source_offset(), bytes, bo.source_file()).ok());
      out.push_back(std::move(bytes));
    }
  }
  EXPECT_EQ(out.size(), bos.size());
  return out;
}

std::vector<uint64_t> Sizes(const std::vector<client::BoEntry>& bos) {
  std::vector<uint64_t> sizes;
  for (const client::BoEntry& bo : bos)
    sizes.push_back(bo.size);
  return sizes;
}

// The restored process's memory for every BO of the session (memfd-backed, registered), each
// region bound to the engine.
Result<RestoredMemory> BoundMemory(const Userfaultfd& uffd, UffdCopyEngine& engine,
                                   const client::RestoreSession& session) {
  GPULAZY_ASSIGN_OR_RETURN(RestoredMemory memory,
                           RestoredMemory::Create(uffd, Sizes(session.bos())));
  for (const Region& region : memory.regions())
    GPULAZY_RETURN_IF_ERROR(engine.Bind(region, memory.memfd(region.bo)));
  return memory;
}

// The BO with the most nonzero bytes, `besides` left out: a test that interferes with a BO picks
// this one so its installs carry data, not only zeros.
uint32_t MostDataBo(const std::vector<std::vector<uint8_t>>& source,
                    std::optional<uint32_t> besides = std::nullopt) {
  auto data_bytes = [&](uint32_t bo) {
    return std::count_if(source[bo].begin(), source[bo].end(), [](uint8_t b) { return b != 0; });
  };
  std::optional<uint32_t> most;
  for (uint32_t bo = 0; bo < source.size(); ++bo)
    if (bo != besides && (!most || data_bytes(bo) > data_bytes(*most))) most = bo;
  EXPECT_TRUE(most.has_value() && data_bytes(*most) > 0) << "the image has no BO with data";
  return most.value_or(0);
}

client::SessionOptions Options(const ServerProcess& server) {
  client::SessionOptions options;
  options.endpoint = "unix:" + server.socket_path().string();
  options.image = "ckpt";
  options.window_bytes = 1 << 20;
  options.reconnect.initial_backoff = 20ms;
  options.reconnect.deadline = 20000ms;
  return options;
}

// Several threads read random pages (with random lengths) while the background stream runs;
// every byte must match the source.
void ReadRandomly(const RestoredMemory& memory, const std::vector<std::vector<uint8_t>>& source,
                  int threads, int reads, std::atomic<int>* mismatches) {
  std::vector<std::thread> readers;
  for (int t = 0; t < threads; ++t) {
    readers.emplace_back([&, t] {
      std::mt19937_64 random(t + 7);
      for (int i = 0; i < reads; ++i) {
        const auto bo = static_cast<uint32_t>(random() % source.size());
        if (source[bo].empty()) continue;
        const uint64_t offset = random() % source[bo].size();
        const uint64_t length =
            std::min<uint64_t>(1 + random() % 20000, source[bo].size() - offset);
        if (std::memcmp(memory.bytes(bo).data() + offset, source[bo].data() + offset, length) != 0)
          ++*mismatches;
      }
    });
  }
  for (std::thread& reader : readers)
    reader.join();
}

// Bytes a memfd holds (allocated pages, whatever is mapped).
uint64_t AllocatedBytes(int fd) {
  struct stat st {};
  return fstat(fd, &st) == 0 ? static_cast<uint64_t>(st.st_blocks) * 512 : ~uint64_t{0};
}

// (fill mode, chunks read from the image files by reference). Reading the files is fast enough
// that the whole fill can land before the readers touch a page, so only the socket data plane
// is held to "some reads faulted", and only in an unsanitized build.
class UffdRestore : public ::testing::TestWithParam<std::tuple<FillMode, bool>> {};

TEST_P(UffdRestore, ByteExactWithRandomFaultsRacingTheFill) {
  const auto [fill_mode, read_files] = GetParam();
  TempDir dir;
  const fs::path image_dir = MakeImage(dir.path() / "images", 24 << 20);
  ServerProcess server(dir.path(), dir.path() / "images");
  ASSERT_TRUE(server.ready()) << server.Log();

  auto uffd = Userfaultfd::Create(fill_mode);
  ASSERT_TRUE(uffd.ok()) << uffd.status().ToString();
  UffdCopyEngine engine(*uffd);
  client::SessionOptions options = Options(server);
  options.read_files = read_files;
  // One receiving thread: with lanes the socket plane's fill, too, can land before the readers
  // touch a page.
  options.lanes = 1;
  client::RestoreSession session(options, engine);
  ASSERT_TRUE(session.Start().ok());
  auto source = SourceBytes(image_dir, session.bos());
  auto memory = BoundMemory(*uffd, engine, session);
  ASSERT_TRUE(memory.ok()) << memory.status().ToString();
  AccessRecorder recorder;
  recorder.Reset(session.bos());
  PagerOptions pager_options;
  pager_options.recorder = &recorder;
  Pager pager(*uffd, session, engine, memory->regions(), pager_options);

  // The readers start before the pager, as a restored process resumes before its memory is
  // back: their first touches wait on faults, however fast the fill (on a quick machine the
  // fill had landed before readers started after the pager, and none faulted).
  std::atomic<int> mismatches{0};
  const auto reading = std::chrono::steady_clock::now();
  double read_for_s = 0;
  std::thread readers([&] {
    ReadRandomly(*memory, source, 4, 300, &mismatches);
    read_for_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - reading).count();
  });
  if (Status started = pager.Start(); !started.ok()) {
    // Nobody will serve the readers' faults: end loudly rather than hang.
    std::fprintf(stderr, "pager did not start: %s\n", started.ToString().c_str());
    std::abort();
  }
  readers.join();
  EXPECT_EQ(mismatches.load(), 0);
  // Every woken fault has its latency and when it was read, within the time the readers ran.
  {
    const PagerStats stats = pager.stats();
    ASSERT_EQ(stats.fault_at_s.size(), stats.latencies_s.size());
    for (size_t i = 0; i < stats.fault_at_s.size(); ++i) {
      EXPECT_GE(stats.fault_at_s[i], 0.0);
      EXPECT_LE(stats.fault_at_s[i] + stats.latencies_s[i], read_for_s + 1.0) << "fault " << i;
    }
  }
  ASSERT_TRUE(session.WaitComplete(20s).ok());
  ASSERT_TRUE(pager.UnregisterAll().ok());
  pager.Stop();
  EXPECT_TRUE(pager.status().ok()) << pager.status().ToString();
  uint64_t allocated = 0, total = 0;
  for (uint32_t bo = 0; bo < source.size(); ++bo) {
    allocated += AllocatedBytes(memory->memfd(bo));
    total += source[bo].size();
  }
  for (uint32_t bo = 0; bo < source.size(); ++bo)
    EXPECT_EQ(std::memcmp(memory->bytes(bo).data(), source[bo].data(), source[bo].size()), 0)
        << "BO " << bo;
  EXPECT_EQ(session.progress().reading_files, read_files);
  // The synthetic job's zero BOs came as zero chunks, installed without bytes (WriteZeros). In
  // MISSING mode they were deferred: the readers' faults installed the chunks they touched (the
  // job has a zero BO, and 1200 random reads over 6 BOs touch it), and only those were
  // allocated, measured before the whole-memory check above read the rest as holes. (Whether
  // some zero chunk stayed untouched is up to the random reads: the deterministic checks of
  // that are UffdZeros.MissingModeDefersZeroChunksToTheirFirstTouch and the hot-zeros test.)
  EXPECT_GT(engine.bytes_zeroed(), 0u);
  if (fill_mode == FillMode::kMissingCopy) {
    EXPECT_GT(engine.bytes_zero_deferred(), 0u);
    EXPECT_LE(engine.bytes_zeroed(), engine.bytes_zero_deferred());
    EXPECT_LE(allocated, total - engine.bytes_zero_deferred() + engine.bytes_zeroed() +
                             source.size() * PageSize());
  } else {
    EXPECT_EQ(engine.bytes_zero_deferred(), 0u);
  }
  // Under a sanitizer the readers slow down far more than the kernel's fill, so the socket
  // plane's fill too can land before they touch a page (seen once in CI's TSan stage).
  if (!read_files && !::gpulazy::testing::kSanitized) {
    EXPECT_GT(pager.stats().faults, 0u);
    EXPECT_GT(recorder.size(), 0u);
  }
}

// Resident bytes of the mapping that holds `addr` (its "Rss:" in /proc/self/smaps): that
// mapping's own pages, not a sanitizer's shadow of them. ~0 when it cannot be read.
uint64_t MappingResidentBytes(const void* addr) {
  std::FILE* smaps = std::fopen("/proc/self/smaps", "r");
  if (smaps == nullptr) return ~uint64_t{0};
  const auto at = reinterpret_cast<uintptr_t>(addr);
  char line[512];
  bool inside = false;
  uint64_t rss = ~uint64_t{0};
  while (std::fgets(line, sizeof line, smaps) != nullptr) {
    unsigned long long from = 0, to = 0;
    if (std::sscanf(line, "%llx-%llx ", &from, &to) == 2 && std::strchr(line, '-') != nullptr &&
        std::strstr(line, "kB") == nullptr) {
      inside = from <= at && at < to;
      continue;
    }
    unsigned long long kib = 0;
    if (inside && std::sscanf(line, "Rss: %llu kB", &kib) == 1) {
      rss = kib * 1024;
      break;
    }
  }
  std::fclose(smaps);
  return rss;
}

// AddressMap alone: where BO offsets live after the program moved some of them.
TEST(AddressMap, AMoveOfPartOfABoSplitsItAndResolvesEachOffsetWhereItIs) {
  const uint64_t page = PageSize();
  AddressMap map;
  map.Add({/*bo=*/0, /*addr=*/100 * page, /*size=*/10 * page});
  map.Add({/*bo=*/1, /*addr=*/200 * page, /*size=*/4 * page - 1});
  EXPECT_EQ(map.generation(), 0u);
  {
    AddressMap::EventHold hold = map.hold_for_events();
    AddressMap::MoveHold installs = map.hold_installs_for_moves();
    // Pages 3..6 of BO 0 to 500: the BO now lives in three ranges.
    EXPECT_EQ(map.Move(103 * page, 500 * page, 4 * page, hold, installs), 4 * page);
    // Nothing of ours there: no change.
    EXPECT_EQ(map.Move(900 * page, 950 * page, page, hold, installs), 0u);
  }
  EXPECT_EQ(map.generation(), 1u);
  const std::vector<AddressMap::Piece> pieces = map.Resolve(0, 2 * page, 6 * page);
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[0].addr, 102 * page);
  EXPECT_EQ(pieces[0].offset, 2 * page);
  EXPECT_EQ(pieces[0].length, page);
  EXPECT_EQ(pieces[1].addr, 500 * page);
  EXPECT_EQ(pieces[1].offset, 3 * page);
  EXPECT_EQ(pieces[1].length, 4 * page);
  EXPECT_EQ(pieces[2].addr, 107 * page);
  EXPECT_EQ(pieces[2].offset, 7 * page);
  EXPECT_EQ(pieces[2].length, page);
  ASSERT_TRUE(map.Find(501 * page + 5).has_value());
  EXPECT_EQ(map.Find(501 * page + 5)->bo, 0u);
  EXPECT_EQ(map.Find(501 * page + 5)->offset, 4 * page + 5);
  EXPECT_FALSE(map.Find(104 * page).has_value()) << "the range it left is not BO memory";
  // BO 1's page-rounded tail past its size is no BO byte.
  EXPECT_TRUE(map.Find(200 * page + 4 * page - 2).has_value());
  EXPECT_FALSE(map.Find(200 * page + 4 * page - 1).has_value());
  EXPECT_EQ(map.Ranges().size(), 4u);
}

// MREMAP_FIXED onto BO memory unmaps what was there: those offsets are nowhere afterwards, and
// a BO added again keeps where it is.
// A move leaves a record of the BO bytes that were in the range it took them from (a move with
// MREMAP_DONTUNMAP leaves that range mapped); the record goes where the range goes, and lapses
// where BO memory comes back.
TEST(AddressMap, ARangeAMoveLeftNamesWhatWasThereUntilBoMemoryReturns) {
  const uint64_t page = PageSize();
  AddressMap map;
  map.Add({0, 100 * page, 4 * page});
  auto move = [&](uint64_t from, uint64_t to, uint64_t length) {
    AddressMap::EventHold hold = map.hold_for_events();
    AddressMap::MoveHold installs = map.hold_installs_for_moves();
    return map.Move(from, to, length, hold, installs);
  };
  EXPECT_EQ(move(101 * page, 300 * page, 2 * page), 2 * page);
  const auto left = map.FindLeftBehind(102 * page + 5);
  ASSERT_TRUE(left.has_value());
  EXPECT_EQ(left->bo, 0u);
  EXPECT_EQ(left->offset, 2 * page + 5);
  EXPECT_FALSE(map.FindLeftBehind(100 * page).has_value()) << "BO memory stayed there";
  EXPECT_FALSE(map.FindLeftBehind(103 * page).has_value());
  EXPECT_FALSE(map.FindLeftBehind(300 * page).has_value()) << "where it went";
  using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;
  EXPECT_EQ(map.LeftBehindRanges(), (Ranges{{101 * page, 2 * page}}));
  // The range left behind moves on (it was kept mapped): no BO memory moves, the record goes
  // with it, and the generation changes (UnregisterAll walks again).
  const uint64_t generation = map.generation();
  EXPECT_EQ(move(102 * page, 400 * page, page), 0u);
  EXPECT_GT(map.generation(), generation);
  ASSERT_TRUE(map.FindLeftBehind(400 * page).has_value());
  EXPECT_EQ(map.FindLeftBehind(400 * page)->offset, 2 * page);
  // BO memory moved back onto the range it left: found as BO memory there, and the range the
  // move back left is recorded instead.
  EXPECT_EQ(move(300 * page, 101 * page, 2 * page), 2 * page);
  EXPECT_FALSE(map.FindLeftBehind(101 * page).has_value());
  ASSERT_TRUE(map.Find(101 * page).has_value());
  ASSERT_TRUE(map.FindLeftBehind(301 * page).has_value());
  EXPECT_EQ(map.FindLeftBehind(301 * page)->offset, 2 * page);
  EXPECT_EQ(map.LeftBehindRanges(), (Ranges{{300 * page, 2 * page}, {400 * page, page}}));
}

TEST(AddressMap, AMoveOntoAnotherBoReplacesIt) {
  const uint64_t page = PageSize();
  AddressMap map;
  map.Add({0, 100 * page, 4 * page});
  map.Add({1, 200 * page, 4 * page});
  {
    AddressMap::EventHold hold = map.hold_for_events();
    AddressMap::MoveHold installs = map.hold_installs_for_moves();
    EXPECT_EQ(map.Move(100 * page, 201 * page, 2 * page, hold, installs), 2 * page);
  }
  map.Add(
      {0, 100 * page, 4 * page});  // a second Add (the engine's Bind after the pager's) is ignored
  const std::vector<AddressMap::Piece> one = map.Resolve(1, 0, 4 * page);
  ASSERT_EQ(one.size(), 2u) << "pages 1 and 2 of BO 1 were replaced";
  EXPECT_EQ(one[0].addr, 200 * page);
  EXPECT_EQ(one[0].length, page);
  EXPECT_EQ(one[1].addr, 203 * page);
  EXPECT_EQ(one[1].offset, 3 * page);
  ASSERT_TRUE(map.Find(202 * page).has_value());
  EXPECT_EQ(map.Find(202 * page)->bo, 0u);
  EXPECT_EQ(map.Find(202 * page)->offset, page);
  EXPECT_EQ(map.Resolve(0, 0, 4 * page).front().addr, 201 * page);
  EXPECT_TRUE(map.Resolve(7, 0, page).empty()) << "an unknown BO";
}

// Zero writes installed at once, in either mode: held until the BO is bound, within the BO only,
// and in MISSING mode never over a page that is there (a chunk installed earlier keeps its
// bytes); in private anonymous memory MISSING mode maps the zero page and allocates nothing.
// Threads fault on registered pages nobody fills while the range is unregistered: each must
// come back (reading zeros) however its fault lines up with the unregistration. The kernel's own
// wake at UFFDIO_UNREGISTER misses a fault that queues itself just after it; before Unregister
// woke the range itself, a thread stayed asleep for good within the first 15 rounds of every run
// on the 6.18 development VM (none in 80,000 rounds with the wake). A race, so many rounds.
// /proc/PID/maps as the pager reads it: ranges clipped to the one asked about, in order; a text
// that is not a maps file is refused rather than read as "nothing mapped".
TEST(ProcessMappings, ParsedClippedToTheRangeAskedAbout) {
  const std::string maps =
      "1000-3000 rw-p 00000000 00:00 0\n"
      "5000-6000 r--p 00000000 08:01 1234                       /usr/bin/x\n"
      "6000-9000 rw-s 00000000 00:01 77                         /memfd:bo (deleted)\n"
      "7fff0000-7fff1000 rw-p 00000000 00:00 0                  [stack]\n";
  auto found = ParseMappingsIn(maps, 0x2000, 0x8000);
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  ASSERT_EQ(found->size(), 3u);
  EXPECT_EQ((*found)[0].start, 0x2000u);
  EXPECT_EQ((*found)[0].end, 0x3000u);
  EXPECT_EQ((*found)[1].start, 0x5000u);
  EXPECT_EQ((*found)[1].end, 0x6000u);
  EXPECT_EQ((*found)[2].start, 0x6000u);
  EXPECT_EQ((*found)[2].end, 0x8000u);
  auto none = ParseMappingsIn(maps, 0x3000, 0x5000);
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty()) << "a hole between two mappings";

  for (const char* bad : {"zz-3000 rw-p 0 00:00 0\n", "3000-1000 rw-p 0 00:00 0\n",
                          "1000 rw-p 0 00:00 0\n", "1000-2000 rw-p\n0800-0900 rw-p\n"}) {
    auto refused = ParseMappingsIn(bad, 0, ~uint64_t{0});
    EXPECT_EQ(refused.status().code(), Code::kCorrupt) << bad;
  }
}

// A walk of UnregisterAll reads the whole map once and clips it per refused range.
TEST(ProcessMappings, ClippedFromAWholeReading) {
  const std::vector<MappedRange> all = {{0x1000, 0x3000}, {0x5000, 0x6000}, {0x6000, 0x9000}};
  const std::vector<MappedRange> found = ClipMappings(all, 0x2000, 0x8000);
  ASSERT_EQ(found.size(), 3u);
  EXPECT_EQ(found[0].start, 0x2000u);
  EXPECT_EQ(found[0].end, 0x3000u);
  EXPECT_EQ(found[1].start, 0x5000u);
  EXPECT_EQ(found[2].end, 0x8000u);
  EXPECT_TRUE(ClipMappings(all, 0x3000, 0x5000).empty()) << "a hole between two mappings";
  EXPECT_TRUE(ClipMappings(all, 0x9000, 0xa000).empty()) << "past the last mapping";
  const std::vector<MappedRange> inside = ClipMappings(all, 0x6800, 0x7000);
  ASSERT_EQ(inside.size(), 1u);
  EXPECT_EQ(inside[0].start, 0x6800u);
  EXPECT_EQ(inside[0].end, 0x7000u);
}

// The live process: a mapping with a hole punched in its middle reads as two.
TEST(ProcessMappings, ALiveProcessListsItsMappings) {
  const uint64_t page = PageSize();
  void* at = ::mmap(nullptr, 3 * page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(at, MAP_FAILED) << std::strerror(errno);
  const auto start = reinterpret_cast<uint64_t>(at);
  ASSERT_EQ(::munmap(reinterpret_cast<void*>(start + page), page), 0);
  auto found = MappingsIn(::getpid(), start, start + 3 * page);
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  ASSERT_EQ(found->size(), 2u);
  EXPECT_EQ((*found)[0].start, start);
  EXPECT_EQ((*found)[0].end, start + page);
  EXPECT_EQ((*found)[1].start, start + 2 * page);
  EXPECT_EQ((*found)[1].end, start + 3 * page);
  ::munmap(at, page);
  ::munmap(reinterpret_cast<void*>(start + 2 * page), page);
}

// Whether [addr, addr + length) is mapped all through (mincore fails with ENOMEM on a hole).
bool Mapped(uint64_t addr, uint64_t length) {
  std::vector<unsigned char> residency(length / PageSize());
  return ::mincore(reinterpret_cast<void*>(addr), length, residency.data()) == 0;
}

// The program unmapped parts of a BO and other mappings took their addresses: destroying the
// Mapping unmaps only the rest, not those.
TEST(Mapping, DestructionLeavesTheRangesItForgotAlone) {
  const uint64_t page = PageSize();
  const std::vector<std::pair<uint64_t, uint64_t>> forgotten = {{1, 4}, {5, 6}, {7, 8}};  // pages
  uint64_t start = 0;
  {
    auto mapping = Mapping::Map(-1, 8 * page);
    ASSERT_TRUE(mapping.ok()) << mapping.status().ToString();
    start = reinterpret_cast<uint64_t>(mapping->data());
    // Page 1, pages 2-3 (touching it), part of pages 1-2 (within): one range, pages 1-3.
    mapping->Forget(start + page, page);
    mapping->Forget(start + 2 * page, 2 * page);
    mapping->Forget(start + page + 7, page);
    mapping->Forget(start + 5 * page + 100, 1);     // a byte of page 5: the whole page
    mapping->Forget(start + 7 * page, UINT64_MAX);  // to the end, not past it
    mapping->Forget(start - page, page);            // ends where the mapping starts: nothing
    for (const auto& [from, to] : forgotten) {
      void* other = ::mmap(reinterpret_cast<void*>(start + from * page), (to - from) * page,
                           PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
      ASSERT_EQ(other, reinterpret_cast<void*>(start + from * page)) << std::strerror(errno);
      std::memset(other, 0x7e, (to - from) * page);
    }
  }
  for (const auto& [from, to] : forgotten) {
    ASSERT_TRUE(Mapped(start + from * page, (to - from) * page)) << "pages " << from << "-" << to;
    EXPECT_EQ(*reinterpret_cast<const uint8_t*>(start + (to - 1) * page), 0x7e);
    ::munmap(reinterpret_cast<void*>(start + from * page), (to - from) * page);
  }
  for (uint64_t unmapped : {0, 4, 6})
    EXPECT_FALSE(Mapped(start + unmapped * page, page)) << "page " << unmapped;
}

// An install over a range with a page already in it stops at that page with EAGAIN and a count
// of what it did: partial progress, which the install goes on from. Only EAGAIN with nothing done
// means the program is moving memory (an unread event) and the rest is left `interrupted`.
TEST(UffdRegistration, AnInstallStoppedByAPageAlreadyThereGoesOn) {
  const uint64_t page = PageSize();
  auto uffd = Userfaultfd::Create(FillMode::kMissingCopy);
  ASSERT_TRUE(uffd.ok()) << uffd.status().ToString();
  void* memory =
      ::mmap(nullptr, 6 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(memory, MAP_FAILED) << std::strerror(errno);
  const auto base = reinterpret_cast<uint64_t>(memory);
  ASSERT_TRUE(uffd->Register(base, 6 * page).ok());
  const std::vector<uint8_t> ones(page, 1);
  ASSERT_EQ(uffd->Copy(base + 2 * page, ones)->installed, page);
  auto zeroed = uffd->ZeroPage(base, 6 * page);
  ASSERT_TRUE(zeroed.ok()) << zeroed.status().ToString();
  EXPECT_EQ(zeroed->installed, 5 * page);
  EXPECT_EQ(zeroed->already_present, page);
  EXPECT_EQ(zeroed->interrupted, 0u);
  const std::vector<uint8_t> twos(3 * page, 2);
  auto copied = uffd->Copy(base, twos);  // every page there already
  ASSERT_TRUE(copied.ok()) << copied.status().ToString();
  EXPECT_EQ(copied->already_present, 3 * page);
  EXPECT_EQ(copied->interrupted, 0u);
  EXPECT_EQ(static_cast<const uint8_t*>(memory)[2 * page], 1);
  EXPECT_EQ(static_cast<const uint8_t*>(memory)[0], 0);
  ASSERT_TRUE(uffd->Unregister(base, 6 * page).ok());
  ::munmap(memory, 6 * page);
}

TEST(UffdRegistration, UnregisterLeavesNoFaultAsleep) {
  constexpr int kThreads = 4;
  constexpr int kPagesEach = 16;
  // Fewer under a sanitizer, whose 5-20 times slower faults leave the race to the optimized build.
  constexpr auto kRounds = static_cast<int>(gpulazy::testing::SanitizerScaled(1000, 250));
  const uint64_t page = PageSize();
  const uint64_t length = uint64_t{kThreads} * kPagesEach * page;
  auto uffd = Userfaultfd::Create(FillMode::kMissingCopy);
  ASSERT_TRUE(uffd.ok()) << uffd.status().ToString();

  std::atomic<int> round{0};     // the round the touchers may start
  std::atomic<int> finished{0};  // touchers through this round's pages
  std::atomic<uint8_t*> memory{nullptr};
  std::vector<std::jthread> touchers;  // stopped and joined on every way out
  for (int t = 0; t < kThreads; ++t)
    touchers.emplace_back([&, t](std::stop_token stop) {
      for (int seen = 0; !stop.stop_requested();) {
        if (round.load() == seen) {
          std::this_thread::yield();
          continue;
        }
        seen = round.load();
        const uint8_t* base = memory.load();
        for (uint64_t p = 0; p < kPagesEach; ++p) {
          volatile uint8_t byte = base[(static_cast<uint64_t>(t) * kPagesEach + p) * page];
          (void)byte;
        }
        finished.fetch_add(1);
      }
    });

  for (int r = 1; r <= kRounds && !HasFailure(); ++r) {
    auto mapping = Mapping::Map(-1, length);
    ASSERT_TRUE(mapping.ok()) << mapping.status().ToString();
    const auto addr = reinterpret_cast<uint64_t>(mapping->data());
    ASSERT_TRUE(uffd->Register(addr, length).ok());
    finished.store(0);
    memory.store(mapping->data());
    round.store(r);
    // Unregister at a different moment of the touchers' faults each round.
    std::atomic<int> spin{0};
    while (spin.fetch_add(1, std::memory_order_relaxed) < (r % 64) * 64) {
    }
    if (Status unregistered = uffd->Unregister(addr, length); !unregistered.ok()) {
      ADD_FAILURE() << unregistered.ToString();
      ASSERT_TRUE(uffd->ZeroPage(addr, length).ok());  // fill the pages, so the touchers end
    }
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (finished.load() < kThreads && std::chrono::steady_clock::now() < deadline)
      std::this_thread::yield();
    if (finished.load() < kThreads) {
      ADD_FAILURE() << kThreads - finished.load() << " thread(s) still asleep in round " << r;
      ASSERT_TRUE(uffd->Wake(addr, length).ok());  // let them go, so they can be joined
    }
    while (finished.load() < kThreads)
      std::this_thread::yield();
  }
}

class UffdZeros : public ::testing::TestWithParam<FillMode> {};

TEST_P(UffdZeros, ZeroWritesInstallZerosAndNeverOverwriteAPresentPage) {
  const FillMode mode = GetParam();
  auto uffd = Userfaultfd::Create(mode);
  ASSERT_TRUE(uffd.ok()) << uffd.status().ToString();
  constexpr uint64_t kChunk = 64 << 10;
  UffdCopyEngine engine(*uffd, {.defer_zeros = false});
  EXPECT_FALSE(engine.defers_zeros());
  ASSERT_TRUE(engine.AddDestination(0, 4 * kChunk).ok());
  auto memory = RestoredMemory::Create(*uffd, {4 * kChunk});
  ASSERT_TRUE(memory.ok()) << memory.status().ToString();
  int completed = 0;
  auto count = [&](const Status& s) {
    EXPECT_TRUE(s.ok()) << s.ToString();
    ++completed;
  };
  ASSERT_TRUE(engine.WriteZeros(0, 2 * kChunk, kChunk, count).ok());  // held: not bound yet
  EXPECT_EQ(completed, 0);
  ASSERT_TRUE(engine.Bind(memory->regions()[0], memory->memfd(0)).ok());
  EXPECT_EQ(completed, 1);
  const std::vector<uint8_t> data(kChunk, 0xab);
  ASSERT_TRUE(engine.Write(0, 0, data, count).ok());
  // MISSING mode: over chunk 0 (present: skipped) and chunk 1 (missing: zeroed). MINOR mode
  // writes through the memfd before it maps, as its Write does: a chunk is only ever written
  // with its own bytes (the session claims it first), so there only chunk 1.
  const bool missing = mode == FillMode::kMissingCopy;
  ASSERT_TRUE(
      engine.WriteZeros(0, missing ? 0 : kChunk, missing ? 2 * kChunk : kChunk, count).ok());
  ASSERT_TRUE(engine.WriteZeros(0, 3 * kChunk, kChunk, count).ok());
  bool called = false;
  auto mark = [&](Status) { called = true; };
  EXPECT_EQ(engine.WriteZeros(0, 4 * kChunk - 4096, 8192, mark).code(), Code::kOutOfRange);
  EXPECT_EQ(engine.WriteZeros(1, 0, 4096, mark).code(), Code::kNotFound);
  EXPECT_FALSE(called);
  EXPECT_EQ(completed, 4);
  EXPECT_EQ(engine.bytes_zeroed(), 3 * kChunk);
  EXPECT_EQ(engine.bytes_already_present(), missing ? kChunk : 0);
  // Every page is there now: reading faults on none.
  std::span<const uint8_t> bytes = memory->bytes(0);
  EXPECT_TRUE(std::equal(data.begin(), data.end(), bytes.begin()));
  EXPECT_TRUE(std::all_of(bytes.begin() + kChunk, bytes.end(), [](uint8_t b) { return b == 0; }));
}

TEST(UffdZeros, MissingModeZeroesAnonymousMemoryWithoutAllocatingIt) {
  auto uffd = Userfaultfd::Create(FillMode::kMissingCopy);
  ASSERT_TRUE(uffd.ok()) << uffd.status().ToString();
  constexpr uint64_t kSize = 64ull << 20;
  UffdCopyEngine engine(*uffd, {.defer_zeros = false});
  ASSERT_TRUE(engine.AddDestination(0, kSize).ok());
  auto memory = RestoredMemory::Create(*uffd, {kSize}, /*anonymous=*/true);
  ASSERT_TRUE(memory.ok()) << memory.status().ToString();
  ASSERT_TRUE(engine.Bind(memory->regions()[0]).ok());
  for (uint64_t offset = 0; offset < kSize; offset += 2 << 20)
    ASSERT_TRUE(engine
                    .WriteZeros(0, offset, 2 << 20,
                                [](const Status& s) { EXPECT_TRUE(s.ok()) << s.ToString(); })
                    .ok());
  std::span<const uint8_t> bytes = memory->bytes(0);
  EXPECT_TRUE(std::all_of(bytes.begin(), bytes.end(), [](uint8_t b) { return b == 0; }));
  EXPECT_EQ(engine.bytes_zeroed(), kSize);
  // The shared zero page, mapped 16 384 times, counts nothing; 64 MiB of copied zeros would.
  EXPECT_LT(MappingResidentBytes(bytes.data()), 8ull << 20);
  // And the measure sees pages when there are some: writing 16 MiB allocates them.
  for (uint64_t offset = 0; offset < (16ull << 20); offset += PageSize())
    memory->bytes(0)[offset] = 1;
  EXPECT_GE(MappingResidentBytes(bytes.data()), 16ull << 20);
}

// MISSING mode's default: zero chunks recorded and completed at once, allocating nothing; a
// fault's page installed from the record (and only where the record says zeros: a page of a
// data chunk is the data's); after unregistration the rest reads as the holes they are.
TEST(UffdZeros, MissingModeDefersZeroChunksToTheirFirstTouch) {
  auto uffd = Userfaultfd::Create(FillMode::kMissingCopy);
  ASSERT_TRUE(uffd.ok()) << uffd.status().ToString();
  constexpr uint64_t kChunk = 2 << 20;
  constexpr uint64_t kSize = 8 * kChunk + 12345;  // a short last chunk, inside a page
  UffdCopyEngine engine(*uffd);
  EXPECT_TRUE(engine.defers_zeros());
  ASSERT_TRUE(engine.AddDestination(0, kSize).ok());
  auto memory = RestoredMemory::Create(*uffd, {kSize});
  ASSERT_TRUE(memory.ok()) << memory.status().ToString();
  int completed = 0;
  auto count = [&](const Status& s) {
    EXPECT_TRUE(s.ok()) << s.ToString();
    ++completed;
  };
  ASSERT_TRUE(engine.WriteZeros(0, 8 * kChunk, 12345, count).ok());  // held until Bind
  ASSERT_TRUE(engine.Bind(memory->regions()[0], memory->memfd(0)).ok());
  const std::vector<uint8_t> data(kChunk, 0x5c);
  ASSERT_TRUE(engine.Write(0, 3 * kChunk, data, count).ok());
  for (uint64_t chunk : {0, 1, 2, 4, 6, 5})  // out of order: the record merges them
    ASSERT_TRUE(engine.WriteZeros(0, chunk * kChunk, kChunk, count).ok());
  EXPECT_EQ(completed, 8);
  EXPECT_EQ(engine.bytes_zero_deferred(), 6 * kChunk + 12345);
  EXPECT_EQ(engine.bytes_zeroed(), 0u);
  EXPECT_EQ(AllocatedBytes(memory->memfd(0)), kChunk);  // the data chunk only

  const uint64_t page = PageSize();
  // A fault in zero chunk 5: its one page, installed (which also wakes its threads).
  auto installed = engine.InstallDeferredZeros(0, 5 * kChunk + 7 * page, page);
  ASSERT_TRUE(installed.ok()) << installed.status().ToString();
  ASSERT_TRUE(installed->has_value());
  EXPECT_EQ((*installed)->installed, page);
  EXPECT_EQ(AllocatedBytes(memory->memfd(0)), kChunk + page);
  // The same page again (two threads faulted on it): out of the record, so a wake's business.
  installed = engine.InstallDeferredZeros(0, 5 * kChunk + 7 * page, page);
  ASSERT_TRUE(installed.ok());
  EXPECT_FALSE(installed->has_value());
  // The rest of chunk 5, whole: the pages around the one installed.
  installed = engine.InstallDeferredZeros(0, 5 * kChunk, kChunk);
  ASSERT_TRUE(installed.ok() && installed->has_value());
  EXPECT_EQ((*installed)->installed, kChunk - page);
  EXPECT_EQ((*installed)->already_present, 0u);
  // The last page, part zero chunk: installed whole.
  installed = engine.InstallDeferredZeros(0, PageAlignDown(kSize - 1), page);
  ASSERT_TRUE(installed.ok() && installed->has_value());
  EXPECT_EQ((*installed)->installed, page);
  // Pages that are not deferred zeros: the data chunk, chunk 7 (nothing came), an unknown BO.
  for (auto [bo, offset] :
       {std::pair<uint32_t, uint64_t>{0, 3 * kChunk + page}, {0, 7 * kChunk}, {1, 0}}) {
    installed = engine.InstallDeferredZeros(bo, offset, page);
    ASSERT_TRUE(installed.ok()) << installed.status().ToString();
    EXPECT_FALSE(installed->has_value()) << "BO " << bo << " offset " << offset;
  }
  EXPECT_EQ(engine.bytes_zeroed(), kChunk + page);
  EXPECT_EQ(AllocatedBytes(memory->memfd(0)), 2 * kChunk + page);

  // Chunk 7 as data, then unregistered: every byte reads right, nothing waits.
  ASSERT_TRUE(engine.Write(0, 7 * kChunk, data, count).ok());
  const Region& region = memory->regions()[0];
  ASSERT_TRUE(uffd->Unregister(region.addr, PageAlignUp(region.size)).ok());
  std::span<const uint8_t> bytes = memory->bytes(0);
  for (uint64_t chunk = 0; chunk < 9; ++chunk) {
    const uint64_t length = std::min(kChunk, kSize - chunk * kChunk);
    const bool is_data = chunk == 3 || chunk == 7;
    EXPECT_TRUE(std::all_of(bytes.begin() + chunk * kChunk, bytes.begin() + chunk * kChunk + length,
                            [&](uint8_t b) { return b == (is_data ? 0x5c : 0); }))
        << "chunk " << chunk;
  }
}

// A profile's hot zero chunks, with deferred zeros: installed by the pager once the hot set is
// resident, before the program touches them (no fault), and only those: the other zero chunks
// stay deferred until a touch.
TEST(UffdPager, HotZeroChunksAreInstalledBeforeTheProgramTouchesThem) {
  TempDir dir;
  const fs::path image_dir = MakeImage(dir.path() / "images", 8 << 20);
  std::vector<std::pair<uint32_t, uint32_t>> hot_zeros, cold_zeros;
  uint64_t hot_zero_bytes = 0, zero_bytes = 0;
  {
    auto lazy = image::LazyImage::Open(image_dir);
    ASSERT_TRUE(lazy.ok()) << lazy.status().ToString();
    manifest::Manifest manifest = lazy->manifest();
    manifest::AccessProfile* profile = manifest.mutable_profile();
    profile->Clear();
    for (int bo = 0; bo < manifest.bos_size(); ++bo) {
      for (int c = 0; c < manifest.bos(bo).chunks_size(); ++c) {
        const manifest::Chunk& chunk = manifest.bos(bo).chunks(c);
        if (chunk.codec() != manifest::CODEC_ZERO) continue;
        zero_bytes += chunk.raw_length();
        if (c % 2 != 0) {  // every other zero chunk is hot
          cold_zeros.emplace_back(bo, c);
          continue;
        }
        hot_zeros.emplace_back(bo, c);
        hot_zero_bytes += chunk.raw_length();
        manifest::ChunkRef* ref = profile->add_order();
        ref->set_bo(static_cast<uint32_t>(bo));
        ref->set_chunk(static_cast<uint32_t>(c));
      }
    }
    ASSERT_FALSE(hot_zeros.empty() || cold_zeros.empty()) << "too few zero chunks";
    profile->set_hot_count(static_cast<uint32_t>(profile->order_size()));
    profile->set_source("test");
    ASSERT_TRUE(image::WriteManifest(image_dir, manifest).ok());
  }
  ServerProcess server(dir.path(), dir.path() / "images");
  ASSERT_TRUE(server.ready()) << server.Log();
  auto uffd = Userfaultfd::Create(FillMode::kMissingCopy);
  ASSERT_TRUE(uffd.ok()) << uffd.status().ToString();
  UffdCopyEngine engine(*uffd);
  client::RestoreSession session(Options(server), engine);
  ASSERT_TRUE(session.Start().ok());
  ASSERT_EQ(session.profile().hot_count(), hot_zeros.size());
  auto memory = BoundMemory(*uffd, engine, session);
  ASSERT_TRUE(memory.ok()) << memory.status().ToString();
  Pager pager(*uffd, session, engine, memory->regions());
  ASSERT_TRUE(pager.Start().ok());
  ASSERT_TRUE(session.WaitComplete(20s).ok());
  // The pager's thread installs after the hot set is resident; give it a bounded while.
  for (int i = 0; i < 1000 && engine.bytes_zeroed() < hot_zero_bytes; ++i)
    std::this_thread::sleep_for(10ms);
  EXPECT_EQ(engine.bytes_zero_deferred(), zero_bytes);
  EXPECT_EQ(engine.bytes_zeroed(), hot_zero_bytes);  // the hot ones, none else
  const uint32_t chunk_size = session.chunk_size();
  for (const auto& [bo, chunk] : hot_zeros) {
    std::span<const uint8_t> bytes = memory->bytes(bo).subspan(
        uint64_t{chunk} * chunk_size,
        std::min<uint64_t>(chunk_size, memory->bytes(bo).size() - uint64_t{chunk} * chunk_size));
    EXPECT_TRUE(std::all_of(bytes.begin(), bytes.end(), [](uint8_t b) { return b == 0; }));
  }
  EXPECT_EQ(pager.stats().faults, 0u);  // they were there when read
  // A cold zero chunk: its first touch faults, and the pager installs it.
  const auto [cold_bo, cold_chunk] = cold_zeros.front();
  EXPECT_EQ(memory->bytes(cold_bo)[uint64_t{cold_chunk} * chunk_size], 0);
  EXPECT_EQ(pager.stats().faults, 1u);
  // The install's own wake resumed us, maybe before the pager counted it.
  for (int i = 0; i < 1000 && engine.bytes_zeroed() == hot_zero_bytes; ++i)
    std::this_thread::sleep_for(1ms);
  EXPECT_GT(engine.bytes_zeroed(), hot_zero_bytes);
  ASSERT_TRUE(pager.UnregisterAll().ok());
  pager.Stop();
  EXPECT_TRUE(pager.status().ok()) << pager.status().ToString();
}

// The race a clean-clone CI run once lost, made certain: the pager reads a fault on a deferred
// zero chunk, the owner unregisters every region before the pager handles it, and the pager's
// install then finds its range unregistered (UFFDIO_ZEROPAGE: ENOENT). Unregistering woke the
// faulting thread, which reads the zeros as plain memory; the pager must not count that install
// as its failure.
TEST(UffdPager, AZeroInstallAfterUnregisterAllIsNoFailure) {
  TempDir dir;
  const fs::path image_dir = MakeImage(dir.path() / "images", 8 << 20);
  ServerProcess server(dir.path(), dir.path() / "images");
  ASSERT_TRUE(server.ready()) << server.Log();
  auto uffd = Userfaultfd::Create(FillMode::kMissingCopy);
  ASSERT_TRUE(uffd.ok()) << uffd.status().ToString();
  UffdCopyEngine engine(*uffd);
  ASSERT_TRUE(engine.defers_zeros());
  client::RestoreSession session(Options(server), engine);
  ASSERT_TRUE(session.Start().ok());
  auto memory = BoundMemory(*uffd, engine, session);
  ASSERT_TRUE(memory.ok()) << memory.status().ToString();
  ASSERT_TRUE(session.WaitComplete(20s).ok());
  ASSERT_GT(engine.bytes_zero_deferred(), 0u) << "the image has no zero chunk";
  // A zero chunk nobody installed: the first chunk of the manifest stored as zeros.
  std::optional<std::pair<uint32_t, uint32_t>> zero_chunk;
  {
    auto lazy = image::LazyImage::Open(image_dir);
    ASSERT_TRUE(lazy.ok()) << lazy.status().ToString();
    const manifest::Manifest& manifest = lazy->manifest();
    for (int bo = 0; bo < manifest.bos_size() && !zero_chunk; ++bo)
      for (int c = 0; c < manifest.bos(bo).chunks_size() && !zero_chunk; ++c)
        if (manifest.bos(bo).chunks(c).codec() == manifest::CODEC_ZERO) zero_chunk.emplace(bo, c);
  }
  ASSERT_TRUE(zero_chunk.has_value());
  const auto [zero_bo, chunk] = *zero_chunk;

  // Between the pager's read of the fault and its handling, the owner unregisters everything.
  std::mutex mutex;
  std::condition_variable changed;
  bool fault_read = false, unregistered = false;
  PagerOptions pager_options;
  pager_options.install_hot_zeros = false;
  pager_options.after_events_read = [&] {
    std::unique_lock lock(mutex);
    fault_read = true;
    changed.notify_all();
    changed.wait_for(lock, 20s, [&] { return unregistered; });
  };
  Pager pager(*uffd, session, engine, memory->regions(), pager_options);
  ASSERT_TRUE(pager.Start().ok());
  std::atomic<int> read_byte{-1};
  std::thread toucher(
      [&] { read_byte.store(memory->bytes(zero_bo)[uint64_t{chunk} * session.chunk_size()]); });
  {
    std::unique_lock lock(mutex);
    EXPECT_TRUE(changed.wait_for(lock, 20s, [&] { return fault_read; })) << "no fault was read";
  }
  const Status unregister = pager.UnregisterAll();
  {
    std::lock_guard lock(mutex);
    unregistered = true;
    changed.notify_all();
  }
  for (int i = 0; i < 2000 && read_byte.load() < 0; ++i)
    std::this_thread::sleep_for(10ms);
  const int byte = read_byte.load();
  if (byte < 0) {
    std::fprintf(stderr, "the touching thread is still blocked after 20 s\n");
    std::abort();  // joining it would hang the test binary
  }
  toucher.join();
  EXPECT_TRUE(unregister.ok()) << unregister.ToString();
  EXPECT_EQ(byte, 0);
  // Stop lets the loop finish handling that fault, after the unregistration: its install found
  // nothing to fill.
  pager.Stop();
  EXPECT_EQ(pager.stats().faults, 1u);
  EXPECT_EQ(engine.bytes_zeroed(), 0u);
  EXPECT_TRUE(pager.status().ok()) << pager.status().ToString();
}

INSTANTIATE_TEST_SUITE_P(Modes, UffdZeros,
                         ::testing::Values(FillMode::kMissingCopy, FillMode::kMinorContinue),
                         [](const ::testing::TestParamInfo<FillMode>& info) {
                           std::string name = FillModeName(info.param);
                           std::ranges::replace(name, '-', '_');
                           return name;
                         });

// Test names that say what runs: Modes/UffdRestore.<test>/missing_copy_ReadFiles, and so on
// (the pager's own mode names; gtest allows no '-').
std::string ModeName(FillMode mode) {
  std::string name = FillModeName(mode);
  std::ranges::replace(name, '-', '_');
  return name;
}

INSTANTIATE_TEST_SUITE_P(Modes, UffdRestore,
                         ::testing::Combine(::testing::Values(FillMode::kMissingCopy,
                                                              FillMode::kMinorContinue),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<UffdRestore::ParamType>& info) {
                           return ModeName(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_ReadFiles" : "_Socket");
                         });

// Runs `call` (a system call on registered memory) on a thread of its own and returns its
// result, or aborts the test binary loudly when it has not returned within 20 s (a kernel-mode
// fault nobody serves would block it for good).
ssize_t BoundedCall(const std::function<ssize_t()>& call, const char* what) {
  std::atomic<bool> done{false};
  ssize_t result = -1;
  int error = 0;
  std::thread caller([&] {
    result = call();
    error = errno;
    done.store(true);
  });
  for (int i = 0; i < 2000 && !done.load(); ++i)
    std::this_thread::sleep_for(10ms);
  if (!done.load()) {
    std::fprintf(stderr, "%s: still blocked after 20 s\n", what);
    std::abort();
  }
  caller.join();
  errno = error;
  return result;
}

// The pager's userfaultfd catches the kernel's faults too where this process may (root, as a
// CRIU restore): a system call handed restored memory that has not arrived waits for its chunk
// like the program's own access, instead of failing with EFAULT.
bool CatchesKernelFaults(const Userfaultfd& uffd) {
  return uffd.scope() == FaultScope::kUserAndKernel;
}

UniqueFd CreateFile(const fs::path& path) {
  return UniqueFd(::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600));
}

TEST(UffdKernelFaults, ASystemCallOnMemoryNotYetRestoredWaitsForItsChunks) {
  TempDir dir;
  const fs::path image_dir = MakeImage(dir.path() / "images", 8 << 20);
  ServerProcess server(dir.path(), dir.path() / "images");
  ASSERT_TRUE(server.ready()) << server.Log();
  auto uffd = Userfaultfd::Create(FillMode::kMissingCopy);
  ASSERT_TRUE(uffd.ok()) << uffd.status().ToString();
  if (!CatchesKernelFaults(*uffd)) GTEST_SKIP() << "not allowed to catch kernel-mode faults";
  UffdCopyEngine engine(*uffd);
  client::SessionOptions options = Options(server);
  options.stream_all = false;  // only what a fault asks for arrives
  client::RestoreSession session(options, engine);
  ASSERT_TRUE(session.Start().ok());
  const auto source = SourceBytes(image_dir, session.bos());
  auto memory = BoundMemory(*uffd, engine, session);
  ASSERT_TRUE(memory.ok()) << memory.status().ToString();
  Pager pager(*uffd, session, engine, memory->regions());
  ASSERT_TRUE(pager.Start().ok());

  // write(2) reads the BO's memory in the kernel: three chunks, none of them there yet.
  const uint32_t bo = 0;
  ASSERT_GT(source[bo].size(), 300'000u);
  const uint64_t offset = 70'000;
  const size_t length = 150'000;
  ASSERT_FALSE(session.IsResident(bo, offset, length));
  const UniqueFd out = CreateFile(dir.path() / "written");
  ASSERT_TRUE(out.valid()) << std::strerror(errno);
  const ssize_t written = BoundedCall(
      [&] { return ::write(out.get(), memory->bytes(bo).data() + offset, length); }, "write(2)");
  ASSERT_EQ(written, static_cast<ssize_t>(length)) << std::strerror(errno);
  std::vector<uint8_t> file(length);
  ASSERT_TRUE(ReadExactAt(out.get(), 0, file, "written").ok());
  EXPECT_EQ(std::memcmp(file.data(), source[bo].data() + offset, length), 0);
  EXPECT_TRUE(session.IsResident(bo, offset, length));
  EXPECT_GE(pager.stats().faults, 1u);

  // read(2) writes into it in the kernel: the chunk comes first, then the file's bytes on top.
  const uint32_t other = 1;
  ASSERT_GT(source[other].size(), 4096u);
  std::vector<uint8_t> pattern(4096);
  for (size_t i = 0; i < pattern.size(); ++i)
    pattern[i] = static_cast<uint8_t>(i * 7 + 1);
  ASSERT_EQ(::pwrite(out.get(), pattern.data(), pattern.size(), 0),
            static_cast<ssize_t>(pattern.size()));
  auto* into = const_cast<uint8_t*>(memory->bytes(other).data()) + 1000;  // the program's memory
  const ssize_t read =
      BoundedCall([&] { return ::pread(out.get(), into, pattern.size(), 0); }, "pread(2)");
  ASSERT_EQ(read, static_cast<ssize_t>(pattern.size())) << std::strerror(errno);
  EXPECT_EQ(std::memcmp(into, pattern.data(), pattern.size()), 0);
  EXPECT_EQ(std::memcmp(memory->bytes(other).data(), source[other].data(), 1000), 0);

  session.Cancel();
  pager.Stop();
}

// The fallback for a process that may not catch the kernel's faults, and what the registration
// was before: the same system call fails at once.
TEST(UffdKernelFaults, UserModeOnlyMakesASystemCallOnUnfilledMemoryFail) {
  auto uffd = Userfaultfd::Create(FillMode::kMissingCopy, FaultScope::kUserOnly);
  ASSERT_TRUE(uffd.ok()) << uffd.status().ToString();
  EXPECT_EQ(uffd->scope(), FaultScope::kUserOnly);
  auto memory = RestoredMemory::Create(*uffd, {1 << 20});
  ASSERT_TRUE(memory.ok()) << memory.status().ToString();
  TempDir dir;
  const UniqueFd out = CreateFile(dir.path() / "written");
  ASSERT_TRUE(out.valid()) << std::strerror(errno);
  errno = 0;
  EXPECT_EQ(::write(out.get(), memory->bytes(0).data(), 4096), -1);
  EXPECT_EQ(errno, EFAULT);
}

// A deferred zero chunk (resident for the session, its pages holes until touched) handed to a
// system call: the kernel's fault reaches the pager, which installs the zeros.
TEST(UffdKernelFaults, ASystemCallOnADeferredZeroChunkGetsItsZeros) {
  TempDir dir;
  const fs::path image_dir = MakeImage(dir.path() / "images", 8 << 20);
  std::pair<uint32_t, uint32_t> zero{~0u, ~0u};
  {
    auto lazy = image::LazyImage::Open(image_dir);
    ASSERT_TRUE(lazy.ok()) << lazy.status().ToString();
    const manifest::Manifest& manifest = lazy->manifest();
    for (int bo = 0; bo < manifest.bos_size() && zero.first == ~0u; ++bo)
      for (int c = 0; c < manifest.bos(bo).chunks_size(); ++c)
        if (manifest.bos(bo).chunks(c).codec() == manifest::CODEC_ZERO &&
            manifest.bos(bo).chunks(c).raw_length() == 64u << 10) {
          zero = {static_cast<uint32_t>(bo), static_cast<uint32_t>(c)};
          break;
        }
    ASSERT_NE(zero.first, ~0u) << "no whole zero chunk in the image";
  }
  ServerProcess server(dir.path(), dir.path() / "images");
  ASSERT_TRUE(server.ready()) << server.Log();
  auto uffd = Userfaultfd::Create(FillMode::kMissingCopy);
  ASSERT_TRUE(uffd.ok()) << uffd.status().ToString();
  if (!CatchesKernelFaults(*uffd)) GTEST_SKIP() << "not allowed to catch kernel-mode faults";
  UffdCopyEngine engine(*uffd);
  ASSERT_TRUE(engine.defers_zeros());
  client::RestoreSession session(Options(server), engine);
  ASSERT_TRUE(session.Start().ok());
  ASSERT_EQ(session.chunk_size(), 64u << 10);
  auto memory = BoundMemory(*uffd, engine, session);
  ASSERT_TRUE(memory.ok()) << memory.status().ToString();
  Pager pager(*uffd, session, engine, memory->regions());
  ASSERT_TRUE(pager.Start().ok());
  ASSERT_TRUE(session.WaitComplete(20s).ok()) << session.status().ToString();
  const uint64_t zeroed = engine.bytes_zeroed();

  const std::span<const uint8_t> chunk =
      memory->bytes(zero.first).subspan(uint64_t{zero.second} * (64u << 10), 64u << 10);
  const UniqueFd out = CreateFile(dir.path() / "zeros");
  ASSERT_TRUE(out.valid()) << std::strerror(errno);
  const ssize_t written =
      BoundedCall([&] { return ::write(out.get(), chunk.data(), chunk.size()); }, "write(2)");
  ASSERT_EQ(written, static_cast<ssize_t>(chunk.size())) << std::strerror(errno);
  std::vector<uint8_t> file(chunk.size(), 0xff);
  ASSERT_TRUE(ReadExactAt(out.get(), 0, file, "zeros").ok());
  EXPECT_TRUE(std::all_of(file.begin(), file.end(), [](uint8_t b) { return b == 0; }));
  EXPECT_GT(engine.bytes_zeroed(), zeroed);  // installed for the system call, not before
  ASSERT_TRUE(pager.UnregisterAll().ok());
  pager.Stop();
  EXPECT_TRUE(pager.status().ok()) << pager.status().ToString();
}

// Whether any page of [addr, addr + length) lies in a mapping userfaultfd tracks: its VmFlags
// in /proc/self/smaps carry "um" (missing faults) or "ui" (minor faults).
bool TrackedByUserfaultfd(uint64_t addr, uint64_t length) {
  std::ifstream smaps("/proc/self/smaps");
  std::string line;
  bool overlapping = false;
  while (std::getline(smaps, line)) {
    unsigned long start = 0, end = 0;  // NOLINT(google-runtime-int): sscanf's %lx
    if (std::sscanf(line.c_str(), "%lx-%lx ", &start, &end) == 2) {
      overlapping = start < addr + length && addr < end;
      continue;
    }
    if (!overlapping || line.rfind("VmFlags:", 0) != 0) continue;
    std::istringstream flags(line.substr(8));
    for (std::string flag; flags >> flag;)
      if (flag == "um" || flag == "ui") return true;
  }
  return false;
}

// The restored program runs while its BOs stream in, and may change their memory before or
// after the bytes arrive. Set up as far as the session; a test then makes the program's memory
// (CreateMemory), changes it, and restores. `target_` is the BO with the most data, so the
// installs a test interferes with carry data, not only zeros.
class UffdProgramChangesItsMemory : public ::testing::Test {
 protected:
  void SetUp() override {
    image_dir_ = MakeImage(dir_.path() / "images", 8 << 20);
    server_.emplace(dir_.path(), dir_.path() / "images");
    ASSERT_TRUE(server_->ready()) << server_->Log();
    auto uffd = Userfaultfd::Create(Mode());
    ASSERT_TRUE(uffd.ok()) << uffd.status().ToString();
    uffd_.emplace(std::move(*uffd));
    engine_.emplace(*uffd_);
    session_.emplace(Options(*server_), *engine_);
    ASSERT_TRUE(session_->Start().ok());
    source_ = SourceBytes(image_dir_, session_->bos());
    target_ = MostDataBo(source_);
  }

  ~UffdProgramChangesItsMemory() override {
    for (const auto& [at, length] : holds_)
      ::munmap(reinterpret_cast<void*>(at), length);
  }

  // Waits up to 10 s for the pager's stat `field` to reach `at_least` (what a thread of the
  // test set off is counted by, once the pager has seen it).
  void AwaitStat(uint64_t PagerStats::*field, uint64_t at_least = 1) {
    for (int i = 0; i < 10000 && pager_->stats().*field < at_least; ++i)
      std::this_thread::sleep_for(1ms);
  }

  void TearDown() override {
    if (!pager_) return;
    if (!unregistered_) {
      EXPECT_TRUE(pager_->UnregisterAll().ok());
    }
    pager_->Stop();
    EXPECT_TRUE(pager_->status().ok()) << pager_->status().ToString();
  }

  virtual FillMode Mode() const { return FillMode::kMissingCopy; }

  // Memfds shared, as the host engine maps BOs, or private anonymous memory.
  void CreateMemory(bool anonymous = false) {
    auto memory = RestoredMemory::Create(*uffd_, Sizes(session_->bos()), anonymous);
    ASSERT_TRUE(memory.ok()) << memory.status().ToString();
    memory_.emplace(std::move(*memory));
  }

  // Binds every BO, pages until the session completes, and compares every BO but `skip` with
  // its source. The pager runs on until TearDown (or Unregister).
  void RestoreAndCompare(std::optional<uint32_t> skip) {
    ASSERT_NO_FATAL_FAILURE(Bind());
    ASSERT_NO_FATAL_FAILURE(StartPager());
    ASSERT_TRUE(session_->WaitComplete(20s).ok()) << session_->status().ToString();
    for (uint32_t bo = 0; bo < source_.size(); ++bo) {
      if (bo == skip) continue;
      EXPECT_EQ(std::memcmp(memory_->bytes(bo).data(), source_[bo].data(), source_[bo].size()), 0)
          << "BO " << bo;
    }
  }

  // A page dropped after its chunk landed faults again while the region is registered. It must
  // read zeros, as with no pager: the chunk is resident, so a pager that only woke the page would
  // refault it for good. `drop` drops the page of target_ at `offset` (page aligned).
  void ExpectADroppedPageReadsZeros(const std::function<void(uint64_t offset)>& drop) {
    const std::vector<uint8_t>& bytes = source_[target_];
    const auto data = std::find_if(bytes.begin(), bytes.end(), [](uint8_t b) { return b != 0; });
    const auto offset = static_cast<uint64_t>(data - bytes.begin());
    ASSERT_NO_FATAL_FAILURE(drop(PageAlignDown(offset)));
    const PagerStats before = pager_->stats();

    std::promise<uint8_t> read;
    std::future<uint8_t> value = read.get_future();
    std::thread reader([&] {
      const volatile uint8_t* at = memory_->bytes(target_).data() + offset;
      read.set_value(uint8_t{*at});
    });
    const bool in_time = value.wait_for(10s) == std::future_status::ready;
    Unregister();  // wakes the reader if it is stuck, so it can be joined
    reader.join();
    ASSERT_TRUE(in_time) << "a read of the dropped page did not return within 10 s";
    EXPECT_EQ(value.get(), 0);
    // UFFDIO_ZEROPAGE wakes the reader before the pager, back from it, counts the page (seen
    // once under TSan on the 2-core VM): wait for the count.
    for (int i = 0; i < 500 && pager_->stats().dropped_pages_zeroed == before.dropped_pages_zeroed;
         ++i)
      std::this_thread::sleep_for(10ms);
    EXPECT_EQ(pager_->stats().dropped_pages_zeroed, before.dropped_pages_zeroed + 1);
  }

  void Unregister() {
    unregistered_ = true;
    ASSERT_TRUE(pager_->UnregisterAll().ok());
  }

  // Before Bind(), nothing lands: the engine holds every write until its BO is bound.
  void StartPager(PagerOptions options = {}) {
    pager_.emplace(pager_uffd_ ? *pager_uffd_ : *uffd_, *session_, *engine_, memory_->regions(),
                   std::move(options));
    ASSERT_TRUE(pager_->Start().ok());
  }
  void Bind() {
    for (const Region& r : memory_->regions())
      ASSERT_TRUE(engine_->Bind(r, memory_->memfd(r.bo)).ok());
  }

  // Address space nobody else takes: a PROT_NONE placeholder that a move may land on.
  static uint64_t Reserve(uint64_t length) {
    void* at = ::mmap(nullptr, length, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    EXPECT_NE(at, MAP_FAILED) << std::strerror(errno);
    return reinterpret_cast<uint64_t>(at);
  }
  // The program moves [from, +length) onto a reservation at `to`. The pager must be running:
  // the move waits for it to read the event.
  static void Move(uint64_t from, uint64_t to, uint64_t length) {
    void* moved = ::mremap(reinterpret_cast<void*>(from), length, length,
                           MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(to));
    ASSERT_EQ(moved, reinterpret_cast<void*>(to)) << std::strerror(errno);
  }
  // The program moves [from, +length) to fresh address space with MREMAP_DONTUNMAP, which
  // leaves the old range mapped (and registered); returns where it went. The pager must run.
  static uint64_t MoveLeavingItMapped(uint64_t from, uint64_t length) {
    const uint64_t to = Reserve(length);
    void* moved =
        ::mremap(reinterpret_cast<void*>(from), length, length,
                 MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, reinterpret_cast<void*>(to));
    EXPECT_EQ(moved, reinterpret_cast<void*>(to)) << std::strerror(errno);
    return to;
  }
  // On the pager's loop thread (a test's after_events_read): starts the program's move of all of
  // `bo`'s memory to `to` on a thread of its own, and returns once the move is under way, its
  // event waiting for this thread to read it. `moved` turns true when the move has returned.
  std::thread MoveWhileThePagerWaits(const Region& bo, uint64_t to, std::atomic<bool>& moved) {
    std::thread mover([&moved, from = bo.addr, to, length = PageAlignUp(bo.size)] {
      Move(from, to, length);
      moved.store(true);
    });
    for (int i = 0; i < 2000 && !uffd_->MappingsChanging(); ++i)
      std::this_thread::sleep_for(1ms);
    return mover;
  }
  // The install of a BO's chunk 0 held between its address lookup and its ioctls (the engine's
  // after-resolve hook) while the program changes its memory. Armed before the pager starts (the
  // hook is not synchronized); the hook's state is shared with the engine, which keeps the hook.
  class HeldInstall {
   public:
    HeldInstall(UffdCopyEngine& engine, uint32_t bo) : engine_(engine) {
      engine.set_after_resolve_for_testing(
          [state = state_, bo](uint32_t installing, uint64_t offset) {
            if (installing != bo || offset != 0) return;
            std::unique_lock lock(state->mutex);
            if (state->entered) return;
            state->entered = true;
            state->changed.notify_all();
            // Until the program's change is done, or 1 s: an install that holds the change up (it
            // must not be applied under an install that looked its address up before it) goes
            // on after that.
            state->changed.wait_for(lock, 1s, [&] { return state->released; });
          });
    }
    // Binds `region` (the held BO's) on a thread of its own: Bind installs the writes held so far
    // on the calling thread, and the test's thread makes the change.
    void Bind(const Region& region, int memfd) {
      binder_ = std::thread([this, region, memfd] { bound_ = engine_.Bind(region, memfd); });
    }
    ~HeldInstall() {
      Release();
      if (binder_.joinable()) binder_.join();
    }
    HeldInstall(const HeldInstall&) = delete;
    HeldInstall& operator=(const HeldInstall&) = delete;

    // Whether the install is held, waiting up to 10 s for it.
    bool Held() {
      std::unique_lock lock(state_->mutex);
      return state_->changed.wait_for(lock, 10s, [&] { return state_->entered; });
    }
    void Release() {
      std::lock_guard lock(state_->mutex);
      state_->released = true;
      state_->changed.notify_all();
    }
    // Releases the install and returns what binding the region came to.
    Status Finish() {
      Release();
      if (binder_.joinable()) binder_.join();
      return bound_;
    }

   private:
    struct State {
      std::mutex mutex;
      std::condition_variable changed;
      bool entered = false;
      bool released = false;
    };
    UffdCopyEngine& engine_;
    std::shared_ptr<State> state_ = std::make_shared<State>();
    Status bound_;
    std::thread binder_;
  };
  // Binds every BO but `bound` (already bound by the test).
  void BindTheRest(uint32_t bound) {
    for (const Region& r : memory_->regions()) {
      if (r.bo == bound) continue;
      ASSERT_TRUE(engine_->Bind(r, memory_->memfd(r.bo)).ok()) << "BO " << r.bo;
    }
  }
  // The program unmapped one BO and mapped a file of its own over a page of another (the pager
  // is not told: it asks for no unmap events). UFFDIO_UNREGISTER refuses a range with no mapping
  // at all, or with a mapping userfaultfd cannot track, and then unregisters none of it.
  // Unregistering at the end must still leave no BO memory registered: memory left so would make
  // the program's later first touch there wait for a pager that has stopped. Returns the
  // unregister calls the pager made, and the pages of the BO unmapped.
  std::pair<uint64_t, uint64_t> UnregisterAfterAnUnmapAndAFileMap() {
    RestoredMemory& memory = *memory_;
    Pager& pager = *pager_;
    unregistered_ = true;
    // The largest BO goes (probing where it was page by page would take the most calls); the
    // next largest gets a page of this test binary's file (a private file mapping: not shmem, not
    // anonymous) in its middle.
    std::vector<Region> by_size = memory.regions();
    std::sort(by_size.begin(), by_size.end(),
              [](const Region& a, const Region& b) { return a.size > b.size; });
    EXPECT_GE(by_size.size(), 2u);
    if (by_size.size() < 2) return {};
    const Region gone = by_size[0];
    const Region filed = by_size[1];
    EXPECT_GE(PageAlignUp(filed.size), 3 * PageSize());
    const uint64_t file_page = filed.addr + PageAlignDown(PageAlignUp(filed.size) / 2);
    UniqueFd exe(::open("/proc/self/exe", O_RDONLY | O_CLOEXEC));
    EXPECT_TRUE(exe.valid()) << std::strerror(errno);
    EXPECT_EQ(::mmap(reinterpret_cast<void*>(file_page), PageSize(), PROT_READ,
                     MAP_PRIVATE | MAP_FIXED, exe.get(), 0),
              reinterpret_cast<void*>(file_page))
        << std::strerror(errno);
    EXPECT_EQ(::munmap(reinterpret_cast<void*>(gone.addr), PageAlignUp(gone.size)), 0)
        << std::strerror(errno);
    const uint64_t calls_before = pager.stats().unregister_calls;
    const Status unregistered = pager.UnregisterAll();
    Hold(gone.addr, PageAlignUp(gone.size));
    EXPECT_TRUE(unregistered.ok()) << unregistered.ToString();
    for (const Region& region : memory.regions())
      EXPECT_FALSE(TrackedByUserfaultfd(region.addr, PageAlignUp(region.size)))
          << "BO " << region.bo;
    return {pager.stats().unregister_calls - calls_before, PageAlignUp(gone.size) / PageSize()};
  }
  void ExpectARangeLeftByADontUnmapMoveReads(bool expect_alias);
  // BO `bo`'s bytes as its memfd holds them (holes read zeros), whatever the program maps.
  std::vector<uint8_t> MemfdBytes(uint32_t bo) const {
    std::vector<uint8_t> bytes(source_[bo].size());
    const ssize_t n = ::pread(memory_->memfd(bo), bytes.data(), bytes.size(), 0);
    EXPECT_EQ(n, static_cast<ssize_t>(bytes.size())) << std::strerror(errno);
    return bytes;
  }
  // The program unmapped or moved the BO memory at [at, at + length). RestoredMemory's unmapping
  // at the end must leave the range alone: another thread's mapping (the pager's, or the
  // sanitizer allocator's) may have taken the address since. A placeholder, where the range is
  // still free, keeps the test's own later mappings from landing where the pager's records of
  // the old range would muddle them.
  void Hold(uint64_t at, uint64_t length) {
    memory_->Forget(at, length);
    void* hold = ::mmap(reinterpret_cast<void*>(at), length, PROT_NONE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
    if (hold == reinterpret_cast<void*>(at))
      holds_.emplace_back(at, length);
    else if (hold != MAP_FAILED)  // a kernel before 4.17 took the address as a hint
      ::munmap(hold, length);
  }
  // Unregisters what the map says is BO memory now, then unmaps moved memory at `at`.
  void UnregisterAndUnmap(uint64_t at, uint64_t length) {
    ASSERT_NO_FATAL_FAILURE(Unregister());
    ASSERT_EQ(::munmap(reinterpret_cast<void*>(at), length), 0) << std::strerror(errno);
  }

  // A second mapping of the whole target BO, made as `mremap(old, 0, ...)` makes one.
  void* SecondMappingOfTheTarget() {
    const Region& region = memory_->regions()[target_];
    void* second =
        ::mremap(reinterpret_cast<void*>(region.addr), 0, PageAlignUp(region.size), MREMAP_MAYMOVE);
    EXPECT_NE(second, MAP_FAILED) << std::strerror(errno);
    return second;
  }
  // `second`, a second mapping of the target BO (mremap with length 0) that the kernel
  // registered: UnregisterAll leaves it unregistered and showing the BO; then it is unmapped.
  void ExpectUnregisteredShowingTheBo(void* second, uint64_t length) {
    const auto at = reinterpret_cast<uint64_t>(second);
    ASSERT_TRUE(TrackedByUserfaultfd(at, length)) << "the kernel did not register it";
    ASSERT_NO_FATAL_FAILURE(Unregister());
    EXPECT_FALSE(TrackedByUserfaultfd(at, length)) << "the second mapping";
    EXPECT_EQ(std::memcmp(second, source_[target_].data(), source_[target_].size()), 0);
    ASSERT_EQ(::munmap(second, length), 0) << std::strerror(errno);
  }

  TempDir dir_;
  fs::path image_dir_;
  std::optional<ServerProcess> server_;
  std::optional<Userfaultfd> uffd_;
  // The pager's own object for the same userfaultfd, when a test wants it to know less (a
  // descriptor handed over without the sender's pid).
  std::optional<Userfaultfd> pager_uffd_;
  std::optional<UffdCopyEngine> engine_;
  std::optional<client::RestoreSession> session_;
  std::vector<std::vector<uint8_t>> source_;
  std::optional<RestoredMemory> memory_;
  std::optional<Pager> pager_;
  bool unregistered_ = false;
  uint32_t target_ = 0;
  std::vector<std::pair<uint64_t, uint64_t>> holds_;  // placeholders Hold made: [at, +length)
};

// The changes to a mapping, in both fill modes: UFFDIO_CONTINUE refuses a range across VMAs or
// outside any registered one as UFFDIO_COPY does.
class UffdProgramChangesItsMapping : public UffdProgramChangesItsMemory,
                                     public ::testing::WithParamInterface<FillMode> {
 public:
  FillMode Mode() const override { return GetParam(); }
};

INSTANTIATE_TEST_SUITE_P(Modes, UffdProgramChangesItsMapping,
                         ::testing::Values(FillMode::kMissingCopy, FillMode::kMinorContinue),
                         [](const ::testing::TestParamInfo<FillMode>& info) {
                           return ModeName(info.param);
                         });

// A mapping of the program's own where a BO was (munmap + mmap, as an allocator may). The new
// memory is not registered: installs there find no registered range (ENOENT) and must neither
// touch it nor fail the restore; every other BO comes back byte-exact. The BO itself (its memfd,
// which another mapping may show) still gets its bytes.
TEST_P(UffdProgramChangesItsMapping, AReplacedMappingIsLeftAloneAndTheBoKeepsItsBytes) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  const Region& region = memory_->regions()[target_];
  const uint64_t length = PageAlignUp(region.size);
  void* fresh = ::mmap(reinterpret_cast<void*>(region.addr), length, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  ASSERT_EQ(fresh, reinterpret_cast<void*>(region.addr)) << std::strerror(errno);
  std::memset(fresh, 0x77, length);
  RestoreAndCompare(target_);
  const std::span<const uint8_t> kept = memory_->bytes(target_);
  EXPECT_TRUE(std::all_of(kept.begin(), kept.end(), [](uint8_t b) { return b == 0x77; }))
      << "the program's own memory was written";
  EXPECT_GT(engine_->bytes_unregistered(), 0u) << "no install was counted as skipped";
  EXPECT_EQ(MemfdBytes(target_), source_[target_]) << "the BO's memfd";
  EXPECT_GT(engine_->bytes_kept_in_memfd(), 0u);
}

// A BO's mapping split (madvise or mprotect on part of it): a chunk then spans two VMAs, which
// one UFFDIO_COPY or ZEROPAGE refuses with ENOENT. Installs go on page by page and every byte
// lands; nothing counts as skipped.
TEST_P(UffdProgramChangesItsMapping, ASplitMappingStillRestoresWhole) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  // One page in the middle of every chunk gets its own VMA (a flag the other pages lack).
  const Region& region = memory_->regions()[target_];
  const uint64_t chunk = 64 << 10;  // MakeImage's chunk size
  int splits = 0;
  for (uint64_t at = chunk / 2; at + PageSize() <= PageAlignDown(region.size); at += chunk) {
    ASSERT_EQ(::madvise(reinterpret_cast<void*>(region.addr + at), PageSize(), MADV_NOHUGEPAGE), 0)
        << std::strerror(errno);
    ++splits;
  }
  ASSERT_GT(splits, 0) << "the BO is smaller than half a chunk";
  RestoreAndCompare(std::nullopt);
  EXPECT_EQ(engine_->bytes_unregistered(), 0u);
}

// MADV_DONTNEED on a BO's shared memfd mapping before any of it has landed. On shared memory
// the call only drops page-table entries and the page cache keeps the bytes, so with no pager
// the memory would still hold the checkpoint's contents: they must all arrive. (This is why the
// pager does not act on UFFD_EVENT_REMOVE, which this call and MADV_REMOVE send alike;
// docs/uffd.md, "Limits".)
TEST_P(UffdProgramChangesItsMapping, DontneedBeforeTheChunksLandKeepsTheCheckpointBytes) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  const Region& region = memory_->regions()[target_];
  ASSERT_EQ(
      ::madvise(reinterpret_cast<void*>(region.addr), PageAlignUp(region.size), MADV_DONTNEED), 0)
      << std::strerror(errno);
  RestoreAndCompare(std::nullopt);
  EXPECT_EQ(engine_->bytes_unregistered(), 0u);
}

// The restored program forks before its BOs have landed, and the child touches BO memory. A
// child's copy of a registered mapping is not registered with our userfaultfd (we do not ask
// for fork events), so a shared memfd page it touched would be allocated as zeros in the BO's
// page cache for parent and child alike, and the install that comes later would find the page
// there and skip it: the parent would read zeros for good. BO memory is not inherited
// (MADV_DONTFORK, as memory a device reads commonly is): the child's touch faults, and the
// parent's BOs come back byte-exact.
TEST_P(UffdProgramChangesItsMapping, AForkedChildCannotTouchBoMemoryBeforeItLands) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  const std::vector<uint8_t>& bytes = source_[target_];
  const auto data = std::find_if(bytes.begin(), bytes.end(), [](uint8_t b) { return b != 0; });
  ASSERT_NE(data, bytes.end()) << "the target BO holds no data";
  const volatile uint8_t* at = memory_->bytes(target_).data() + (data - bytes.begin());
  // Nothing has landed yet: the engine holds every write until the BO is bound.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) {
    // Async-signal-safe only: the parent has threads. The kernel's SIGSEGV, not a sanitizer's
    // report and exit.
    struct sigaction default_action {};
    default_action.sa_handler = SIG_DFL;
    sigaction(SIGSEGV, &default_action, nullptr);
    const uint8_t value = *at;
    _exit(value == 0 ? 10 : 11);  // reached only if the mapping was inherited
  }
  int wait_status = 0;
  ASSERT_EQ(::waitpid(child, &wait_status, 0), child) << std::strerror(errno);
  EXPECT_TRUE(WIFSIGNALED(wait_status) && WTERMSIG(wait_status) == SIGSEGV)
      << "the child read BO memory (exit status "
      << (WIFEXITED(wait_status) ? WEXITSTATUS(wait_status) : -1) << ")";
  RestoreAndCompare(std::nullopt);
}

// The program moves a whole BO (mremap) before any of it has landed. The registration moves
// with it (remap events), the pager follows the move, and every byte lands at the new address.
TEST_P(UffdProgramChangesItsMapping, AMovedBoGetsItsBytesAtItsNewAddress) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  ASSERT_NO_FATAL_FAILURE(StartPager());
  const Region& region = memory_->regions()[target_];
  const uint64_t length = PageAlignUp(region.size);
  const uint64_t elsewhere = Reserve(length);
  ASSERT_NO_FATAL_FAILURE(Move(region.addr, elsewhere, length));
  ASSERT_NO_FATAL_FAILURE(Hold(region.addr, length));
  ASSERT_NO_FATAL_FAILURE(Bind());
  ASSERT_TRUE(session_->WaitComplete(20s).ok()) << session_->status().ToString();
  EXPECT_EQ(std::memcmp(reinterpret_cast<const void*>(elsewhere), source_[target_].data(),
                        source_[target_].size()),
            0);
  for (uint32_t bo = 0; bo < source_.size(); ++bo) {
    if (bo == target_) continue;
    EXPECT_EQ(std::memcmp(memory_->bytes(bo).data(), source_[bo].data(), source_[bo].size()), 0)
        << "BO " << bo;
  }
  EXPECT_EQ(engine_->bytes_unregistered(), 0u);
  EXPECT_EQ(pager_->stats().bytes_moved, length);
  UnregisterAndUnmap(elsewhere, length);
}

// Part of a BO moved (its middle chunks): the BO's offsets now live in three ranges, and each
// byte lands in the one that holds it.
TEST_P(UffdProgramChangesItsMapping, APartlyMovedBoRestoresWhole) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  ASSERT_NO_FATAL_FAILURE(StartPager());
  const Region& region = memory_->regions()[target_];
  const uint64_t chunk = 64 << 10;  // MakeImage's chunk size
  ASSERT_GE(region.size, 4 * chunk) << "the BO is too small to move its middle";
  // From the middle of chunk 1 to the middle of chunk 3: chunks cut in two by the move.
  const uint64_t from = chunk + chunk / 2;
  const uint64_t length = 2 * chunk;
  const uint64_t elsewhere = Reserve(length);
  ASSERT_NO_FATAL_FAILURE(Move(region.addr + from, elsewhere, length));
  ASSERT_NO_FATAL_FAILURE(Hold(region.addr + from, length));
  ASSERT_NO_FATAL_FAILURE(Bind());
  ASSERT_TRUE(session_->WaitComplete(20s).ok()) << session_->status().ToString();
  const std::vector<uint8_t>& source = source_[target_];
  const uint8_t* stayed = memory_->bytes(target_).data();
  EXPECT_EQ(std::memcmp(stayed, source.data(), from), 0) << "before the moved range";
  EXPECT_EQ(std::memcmp(reinterpret_cast<const void*>(elsewhere), source.data() + from, length), 0)
      << "the moved range";
  EXPECT_EQ(std::memcmp(stayed + from + length, source.data() + from + length,
                        source.size() - from - length),
            0)
      << "after the moved range";
  EXPECT_EQ(engine_->bytes_unregistered(), 0u);
  UnregisterAndUnmap(elsewhere, length);
}

// A BO moved again and again while its chunks stream in: installs that
// race a move are made again where the bytes went, and nothing is skipped.
TEST_P(UffdProgramChangesItsMapping, ABoMovedAgainAndAgainWhileItStreamsRestoresWhole) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  ASSERT_NO_FATAL_FAILURE(StartPager());
  const Region& region = memory_->regions()[target_];
  const uint64_t length = PageAlignUp(region.size);
  uint64_t now = Reserve(length);
  ASSERT_NO_FATAL_FAILURE(Move(region.addr, now, length));
  ASSERT_NO_FATAL_FAILURE(Hold(region.addr, length));
  std::atomic<bool> done{false};
  int moves = 1;
  std::thread mover([&] {
    // Each move to a fresh reservation: the range it leaves is not ours to reuse.
    while (!done.load() && moves < 1000) {
      const uint64_t next = Reserve(length);
      Move(now, next, length);
      now = next;
      ++moves;
    }
  });
  ASSERT_NO_FATAL_FAILURE(Bind());
  const bool complete = session_->WaitComplete(20s).ok();
  done.store(true);
  mover.join();
  ASSERT_TRUE(complete) << session_->status().ToString();
  EXPECT_EQ(std::memcmp(reinterpret_cast<const void*>(now), source_[target_].data(),
                        source_[target_].size()),
            0)
      << "after " << moves << " moves";
  EXPECT_EQ(engine_->bytes_unregistered(), 0u) << "after " << moves << " moves";
  UnregisterAndUnmap(now, length);
}

// The first page of a BO's bytes holding data (not zero), and the offset of a data byte in it.
std::pair<uint64_t, uint64_t> DataPage(const std::vector<uint8_t>& bytes) {
  const auto data = std::find_if(bytes.begin(), bytes.end(), [](uint8_t b) { return b != 0; });
  const auto offset = static_cast<uint64_t>(data - bytes.begin());
  return {PageAlignDown(offset), offset};
}

// The bytes of BO memory a reader thread read at `at`, or abort() after 10 s: a read stuck on
// a fault the pager will never serve cannot be joined, and a hung test binary says less.
// A read of BO memory on a thread of its own, waited for later: its fault may wait for a chunk
// that lands only after the test has done more.
class BackgroundRead {
 public:
  explicit BackgroundRead(uint64_t at)
      : reader_([this, at] {
          read_.set_value(uint8_t{*reinterpret_cast<const volatile uint8_t*>(at)});
        }) {}
  ~BackgroundRead() {
    if (reader_.joinable()) Get("a read the test did not wait for");
  }
  BackgroundRead(const BackgroundRead&) = delete;
  BackgroundRead& operator=(const BackgroundRead&) = delete;
  uint8_t Get(const char* what) {
    if (!got_) {
      if (value_.wait_for(10s) != std::future_status::ready) {
        std::fprintf(stderr, "%s: the read did not return within 10 s\n", what);
        std::abort();
      }
      reader_.join();
      got_ = value_.get();
    }
    return *got_;
  }

 private:
  std::promise<uint8_t> read_;
  std::future<uint8_t> value_ = read_.get_future();
  std::thread reader_;
  std::optional<uint8_t> got_;
};

uint8_t ReadOrAbort(const volatile uint8_t* at, const char* what) {
  return BackgroundRead(reinterpret_cast<uint64_t>(at)).Get(what);
}

// The pager serves a fault on a chunk that has landed (a page the program dropped) while another
// thread of the program is moving a different BO. Until the pager reads that move's event every
// install on the userfaultfd fails with EAGAIN, and the move waits for the read: the pager's own
// thread, the reader, must not wait for the install. It reads the event, then serves the fault.
TEST_P(UffdProgramChangesItsMapping, AFaultServedWhileAnotherBoMovesDoesNotStallThePager) {
  const bool missing = GetParam() == FillMode::kMissingCopy;
  // A dropped page faults again: private anonymous memory in MISSING mode (it then reads zeros),
  // the memfd in MINOR mode (whose page cache keeps the bytes).
  ASSERT_NO_FATAL_FAILURE(CreateMemory(/*anonymous=*/missing));
  ASSERT_GE(memory_->regions().size(), 2u);
  const Region moving = memory_->regions()[target_ == 0 ? 1 : 0];
  const uint64_t moving_length = PageAlignUp(moving.size);
  const uint64_t elsewhere = Reserve(moving_length);
  std::atomic<bool> armed{false}, moved{false};
  std::thread mover;
  PagerOptions options;
  options.after_events_read = [&] {
    if (armed.exchange(false)) mover = MoveWhileThePagerWaits(moving, elsewhere, moved);
  };
  ASSERT_NO_FATAL_FAILURE(Bind());
  ASSERT_NO_FATAL_FAILURE(StartPager(std::move(options)));
  ASSERT_TRUE(session_->WaitComplete(20s).ok()) << session_->status().ToString();
  const Region& region = memory_->regions()[target_];
  const auto [page, offset] = DataPage(source_[target_]);
  ASSERT_EQ(::madvise(reinterpret_cast<void*>(region.addr + page), PageSize(), MADV_DONTNEED), 0)
      << std::strerror(errno);
  armed.store(true);
  const uint8_t value =
      ReadOrAbort(memory_->bytes(target_).data() + offset, "a dropped page during a move");
  for (int i = 0; i < 1000 && !moved.load(); ++i)
    std::this_thread::sleep_for(10ms);
  if (!moved.load()) {
    std::fprintf(stderr, "the program's move did not return within 10 s\n");
    std::abort();
  }
  mover.join();
  ASSERT_NO_FATAL_FAILURE(Hold(moving.addr, moving_length));
  EXPECT_EQ(value, missing ? 0 : source_[target_][offset]);
  EXPECT_EQ(std::memcmp(reinterpret_cast<const void*>(elsewhere), source_[moving.bo].data(),
                        source_[moving.bo].size()),
            0)
      << "the moved BO";
  EXPECT_EQ(pager_->stats().bytes_moved, moving_length);
  UnregisterAndUnmap(elsewhere, moving_length);
}

// Another thread touches a BO at its new address while the move's event is still unread: the
// kernel hands the pager that fault before the move, in one read. The fault is the moved BO's
// and is served there; taken for an address outside every BO it would stop the pager.
TEST_P(UffdProgramChangesItsMapping, AFaultWhereABoHasJustMovedIsServedThere) {
  const bool missing = GetParam() == FillMode::kMissingCopy;
  ASSERT_NO_FATAL_FAILURE(CreateMemory(/*anonymous=*/missing));
  ASSERT_GE(memory_->regions().size(), 2u);
  const Region moving = memory_->regions()[target_];
  const uint64_t moving_length = PageAlignUp(moving.size);
  const uint64_t elsewhere = Reserve(moving_length);
  const auto [page, offset] = DataPage(source_[target_]);
  const uint32_t other = target_ == 0 ? 1 : 0;
  std::atomic<bool> armed{false}, moved{false};
  std::atomic<int> moved_byte{-1};
  std::thread mover, toucher;
  PagerOptions options;
  options.after_events_read = [&] {
    if (!armed.exchange(false)) return;
    mover = MoveWhileThePagerWaits(moving, elsewhere, moved);
    // The page tables have moved by now; the toucher's fault queues behind the unread event.
    std::this_thread::sleep_for(50ms);
    toucher = std::thread(
        [&] { moved_byte.store(*reinterpret_cast<const volatile uint8_t*>(elsewhere + offset)); });
    std::this_thread::sleep_for(50ms);
  };
  ASSERT_NO_FATAL_FAILURE(Bind());
  ASSERT_NO_FATAL_FAILURE(StartPager(std::move(options)));
  ASSERT_TRUE(session_->WaitComplete(20s).ok()) << session_->status().ToString();
  // Dropped pages fault again: the moved BO's where the toucher reads, and the other BO's, whose
  // fault sets the scene.
  ASSERT_EQ(::madvise(reinterpret_cast<void*>(moving.addr + page), PageSize(), MADV_DONTNEED), 0)
      << std::strerror(errno);
  const auto [other_page, other_offset] = DataPage(source_[other]);
  ASSERT_EQ(::madvise(reinterpret_cast<void*>(memory_->regions()[other].addr + other_page),
                      PageSize(), MADV_DONTNEED),
            0)
      << std::strerror(errno);
  armed.store(true);
  ReadOrAbort(memory_->bytes(other).data() + other_offset, "the other BO's dropped page");
  for (int i = 0; i < 1000 && (!moved.load() || moved_byte.load() < 0); ++i)
    std::this_thread::sleep_for(10ms);
  if (!moved.load() || moved_byte.load() < 0) {
    std::fprintf(stderr, "the move or the read at its destination did not return within 10 s\n");
    std::abort();
  }
  mover.join();
  toucher.join();
  ASSERT_NO_FATAL_FAILURE(Hold(moving.addr, moving_length));
  EXPECT_EQ(moved_byte.load(), missing ? 0 : source_[target_][offset]);
  EXPECT_TRUE(pager_->status().ok()) << pager_->status().ToString();
  UnregisterAndUnmap(elsewhere, moving_length);
}

// An install looks up where its bytes go, then installs them there. If in between the program
// swaps two BOs through a third range (the first BO moved away, the second moved onto the
// first's old address) and the pager has read both moves, the install must not land in the
// second BO: it would fill the second BO's missing pages with the first's bytes, and the second
// BO's own bytes would then find those pages taken and be skipped.
TEST_P(UffdProgramChangesItsMapping, AnInstallRacingASwapOfTwoBosLandsInItsOwnBo) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  const Region first = memory_->regions()[target_];
  const Region second = memory_->regions()[MostDataBo(source_, first.bo)];
  const uint64_t first_length = PageAlignUp(first.size);
  const uint64_t swapped = std::min(first_length, PageAlignUp(second.size));
  const uint64_t parking = Reserve(first_length);
  HeldInstall install(*engine_, first.bo);
  ASSERT_NO_FATAL_FAILURE(StartPager());
  // Only the first BO for now: the second's writes are held until it is bound, so its pages are
  // missing when the swap puts them where the first BO was.
  install.Bind(first, memory_->memfd(first.bo));
  ASSERT_TRUE(install.Held()) << "no install of the first BO's chunk 0";
  ASSERT_NO_FATAL_FAILURE(Move(first.addr, parking, first_length));
  ASSERT_NO_FATAL_FAILURE(Move(second.addr, first.addr, swapped));
  const Status bound = install.Finish();
  ASSERT_TRUE(bound.ok()) << bound.ToString();
  ASSERT_NO_FATAL_FAILURE(Hold(second.addr, swapped));
  // Where the first BO was past what came back onto it (a smaller second BO): a hole.
  if (swapped < first_length) {
    ASSERT_NO_FATAL_FAILURE(Hold(first.addr + swapped, first_length - swapped));
  }
  ASSERT_NO_FATAL_FAILURE(BindTheRest(first.bo));
  ASSERT_TRUE(session_->WaitComplete(20s).ok()) << session_->status().ToString();
  EXPECT_EQ(std::memcmp(reinterpret_cast<const void*>(parking), source_[first.bo].data(),
                        source_[first.bo].size()),
            0)
      << "the first BO, moved away";
  const std::vector<uint8_t>& second_bytes = source_[second.bo];
  const uint64_t at_first = std::min<uint64_t>(swapped, second_bytes.size());
  EXPECT_EQ(std::memcmp(reinterpret_cast<const void*>(first.addr), second_bytes.data(), at_first),
            0)
      << "the second BO's part moved onto the first's old address";
  EXPECT_EQ(std::memcmp(reinterpret_cast<const void*>(second.addr + at_first),
                        second_bytes.data() + at_first, second_bytes.size() - at_first),
            0)
      << "the rest of the second BO";
  EXPECT_EQ(engine_->bytes_unregistered(), 0u);
  UnregisterAndUnmap(parking, first_length);
}

// The same race with one move: the program moves one BO onto another's live range (`MREMAP_FIXED`)
// while an install for that other BO, looked up before the move, is under way. Once the move's
// event is read the kernel accepts installs at the new layout again, so the pager must not read
// it while that install is in flight: it would fill the moved BO's missing pages with the other
// BO's bytes.
TEST_P(UffdProgramChangesItsMapping, AnInstallRacingAMoveOntoItsBoLandsNowhereElse) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  const Region installing = memory_->regions()[target_];
  const Region moving = memory_->regions()[MostDataBo(source_, installing.bo)];
  const uint64_t moved = std::min(PageAlignUp(installing.size), PageAlignUp(moving.size));
  HeldInstall install(*engine_, installing.bo);
  ASSERT_NO_FATAL_FAILURE(StartPager());
  install.Bind(installing, memory_->memfd(installing.bo));
  ASSERT_TRUE(install.Held()) << "no install of the installing BO's chunk 0";
  ASSERT_NO_FATAL_FAILURE(Move(moving.addr, installing.addr, moved));
  const Status bound = install.Finish();
  ASSERT_TRUE(bound.ok()) << bound.ToString();
  ASSERT_NO_FATAL_FAILURE(Hold(moving.addr, moved));
  ASSERT_NO_FATAL_FAILURE(BindTheRest(installing.bo));
  ASSERT_TRUE(session_->WaitComplete(20s).ok()) << session_->status().ToString();
  const std::vector<uint8_t>& bytes = source_[moving.bo];
  const uint64_t at_new = std::min<uint64_t>(moved, bytes.size());
  EXPECT_EQ(std::memcmp(reinterpret_cast<const void*>(installing.addr), bytes.data(), at_new), 0)
      << "the moved BO at its new address";
  EXPECT_EQ(std::memcmp(reinterpret_cast<const void*>(moving.addr + at_new), bytes.data() + at_new,
                        bytes.size() - at_new),
            0)
      << "the rest of the moved BO";
}

// The program moves a whole BO with MREMAP_DONTUNMAP before any of it has landed, and reads at
// the old address from another thread while the chunk is still to come. The old range stays
// mapped and registered (seen on 6.18): in a shared mapping of the BO's memfd it shows the BO's
// pages, in private memory it holds zeros, as it would with no pager. `expect_alias`: whether
// the old range must read the BO's bytes (else zeros). The pager failed on such a fault
// ("outside every registered BO") before it kept the ranges moves left.
void UffdProgramChangesItsMemory::ExpectARangeLeftByADontUnmapMoveReads(bool expect_alias) {
  ASSERT_NO_FATAL_FAILURE(StartPager());
  const Region region = memory_->regions()[target_];
  const uint64_t length = PageAlignUp(region.size);
  const std::vector<uint8_t>& bytes = source_[target_];
  const auto [page, offset] = DataPage(bytes);
  const uint64_t elsewhere = MoveLeavingItMapped(region.addr, length);
  ASSERT_FALSE(HasFailure());
  // Nothing lands before Bind: in a shared mapping the reader's fault waits for the chunk.
  BackgroundRead reader(region.addr + offset);
  // Its fault read before Bind (in a shared mapping a read after the chunk landed would find
  // the page in the page cache and not fault at all).
  AwaitStat(&PagerStats::left_behind_faults);
  if (pager_->stats().left_behind_faults != 1) {
    // The reader cannot be joined while its fault waits: say why, and stop here.
    std::fprintf(stderr, "%lu faults where the BO was, not one, within 10 s: %s\n",
                 static_cast<unsigned long>(pager_->stats().left_behind_faults),  // NOLINT
                 pager_->status().ToString().c_str());
    std::abort();
  }
  if (!expect_alias) {
    // Private memory reads zeros whatever the BO holds: served at once, not after a chunk that
    // memory never shows.
    EXPECT_EQ(reader.Get("a read where the BO was, before any chunk landed"), 0);
    // Counted once the zero page woke the reader.
    AwaitStat(&PagerStats::private_left_behind_zeroed);
    EXPECT_EQ(pager_->stats().private_left_behind_zeroed, 1u);
    EXPECT_EQ(pager_->stats().demand_chunks, 0u) << "a chunk asked for a page that reads zeros";
  }
  ASSERT_NO_FATAL_FAILURE(Bind());
  const uint8_t value = reader.Get("a read where the BO was");
  EXPECT_EQ(value, expect_alias ? bytes[offset] : 0);
  ASSERT_TRUE(session_->WaitComplete(20s).ok()) << session_->status().ToString();
  EXPECT_EQ(std::memcmp(reinterpret_cast<const void*>(elsewhere), bytes.data(), bytes.size()), 0)
      << "the BO where it went";
  // Every page of the old range now, the chunks resident: the zero chunks' pages, deferred or
  // not, and the data pages.
  const auto* old_range = reinterpret_cast<const uint8_t*>(region.addr);
  if (expect_alias) {
    EXPECT_EQ(std::memcmp(old_range, bytes.data(), bytes.size()), 0) << "the range it left";
  } else {
    EXPECT_TRUE(std::all_of(old_range, old_range + bytes.size(), [](uint8_t b) { return b == 0; }))
        << "the range it left";
  }
  EXPECT_GE(pager_->stats().left_behind_faults, 1u);
  // Asked only while a chunk was still to come (the first read, in private memory).
  EXPECT_EQ(pager_->stats().private_left_behind_zeroed, expect_alias ? 0u : 1u);
  EXPECT_TRUE(pager_->status().ok()) << pager_->status().ToString();
  ASSERT_NO_FATAL_FAILURE(Unregister());
  EXPECT_FALSE(TrackedByUserfaultfd(region.addr, length)) << "the range the move left";
  EXPECT_FALSE(TrackedByUserfaultfd(elsewhere, length)) << "the BO where it went";
  ASSERT_EQ(::munmap(reinterpret_cast<void*>(elsewhere), length), 0) << std::strerror(errno);
}

TEST_P(UffdProgramChangesItsMapping, ARangeLeftByADontUnmapMoveShowsTheBoInASharedMapping) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  ExpectARangeLeftByADontUnmapMoveReads(/*expect_alias=*/true);
}

// `mremap(old, 0, new_length, MREMAP_MAYMOVE)` of a shared BO mapping makes a second mapping of
// the same memfd pages, registered as the first is; its event has length 0, so the map never
// learns where it is or how long. A read there before the chunk lands must wait for it and show
// the BO's bytes (before the pager looked such a fault up in the program's maps, it stopped:
// "outside every registered BO", and the read hung).
TEST_P(UffdProgramChangesItsMapping, ASecondMappingMadeByALengthZeroMremapShowsTheBo) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  const Region region = memory_->regions()[target_];
  const uint64_t length = PageAlignUp(region.size);
  const std::vector<uint8_t>& bytes = source_[target_];
  // A byte of chunk 0 that is not zero, read where its install is held.
  const uint64_t chunk = 64 << 10;  // MakeImage's chunk size
  const auto data = std::find_if(
      bytes.begin(), bytes.begin() + static_cast<std::ptrdiff_t>(std::min(chunk, bytes.size())),
      [](uint8_t b) { return b != 0; });
  ASSERT_NE(data, bytes.begin() + static_cast<std::ptrdiff_t>(std::min(chunk, bytes.size())));
  const auto offset = static_cast<uint64_t>(data - bytes.begin());
  HeldInstall held(*engine_, target_);
  ASSERT_NO_FATAL_FAILURE(StartPager());
  void* second = ::mremap(reinterpret_cast<void*>(region.addr), 0, length, MREMAP_MAYMOVE);
  ASSERT_NE(second, MAP_FAILED) << std::strerror(errno);
  const auto at = reinterpret_cast<uint64_t>(second);
  held.Bind(region, memory_->memfd(target_));
  ASSERT_NO_FATAL_FAILURE(BindTheRest(target_));
  ASSERT_TRUE(held.Held());
  // Chunk 0 is not in the memfd yet: the read faults. The pager reads the fault once the held
  // install goes on (after 1 s: an install looking its addresses up holds event reads off).
  BackgroundRead reader(at + offset);
  for (int i = 0; i < 500 && pager_->stats().aliases_found == 0 && pager_->status().ok(); ++i)
    std::this_thread::sleep_for(10ms);
  if (pager_->stats().aliases_found != 1) {
    // The reader cannot be joined while its fault waits: say why, and stop here.
    std::fprintf(stderr, "the second mapping was not found within 5 s: %s\n",
                 pager_->status().ToString().c_str());
    std::abort();
  }
  ASSERT_TRUE(held.Finish().ok());
  EXPECT_EQ(reader.Get("a read in the second mapping"), bytes[offset]);
  ASSERT_TRUE(session_->WaitComplete(20s).ok()) << session_->status().ToString();
  EXPECT_EQ(std::memcmp(second, bytes.data(), bytes.size()), 0) << "the second mapping";
  EXPECT_EQ(std::memcmp(reinterpret_cast<const void*>(region.addr), bytes.data(), bytes.size()), 0)
      << "the BO's own mapping";
  EXPECT_TRUE(pager_->status().ok()) << pager_->status().ToString();
  ASSERT_NO_FATAL_FAILURE(Unregister());
  EXPECT_FALSE(TrackedByUserfaultfd(at, length)) << "the second mapping";
  EXPECT_FALSE(TrackedByUserfaultfd(region.addr, length)) << "the BO's own mapping";
  ASSERT_EQ(::munmap(second, length), 0) << std::strerror(errno);
}

// A second mapping made after the restore completed, never touched: the pager learns of it
// from the move's event (and the maps), so UnregisterAll leaves it unregistered too. (In MINOR
// mode a page of it left registered would fault after the pager stopped, and wait for good.)
TEST_P(UffdProgramChangesItsMapping, AnUntouchedSecondMappingIsUnregisteredToo) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  RestoreAndCompare(std::nullopt);
  const uint64_t length = PageAlignUp(memory_->regions()[target_].size);
  void* second = SecondMappingOfTheTarget();
  ASSERT_FALSE(HasFailure());
  // The mremap returns once its event is read; the pager reads the maps after that.
  AwaitStat(&PagerStats::aliases_found);
  EXPECT_EQ(pager_->stats().aliases_found, 1u);
  ExpectUnregisteredShowingTheBo(second, length);
}

// A second mapping of one BO unmapped (no event says so), then one of another BO made over where
// it was, starting a page before it: the map must name the second BO there, not what the first
// record said (a fault served as the wrong BO could put a zero page into the other BO's memfd
// before its bytes land).
TEST_P(UffdProgramChangesItsMapping, ASecondMappingAtAnAddressAnotherOneLeftShowsItsOwnBo) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  RestoreAndCompare(std::nullopt);
  ASSERT_GE(memory_->regions().size(), 2u);
  const Region first = memory_->regions()[target_];
  const Region other = memory_->regions()[(target_ + 1) % memory_->regions().size()];
  const uint64_t page = PageSize();
  ASSERT_GE(first.size, 2 * page);
  ASSERT_GE(other.size, 4 * page);
  const uint64_t at = Reserve(4 * page);
  void* second = ::mremap(reinterpret_cast<void*>(first.addr), 0, 2 * page,
                          MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(at + page));
  ASSERT_EQ(second, reinterpret_cast<void*>(at + page)) << std::strerror(errno);
  AwaitStat(&PagerStats::aliases_found);
  EXPECT_EQ(pager_->stats().aliases_found, 1u);
  EXPECT_EQ(*reinterpret_cast<const volatile uint8_t*>(at + page), source_[target_][0]);
  ASSERT_EQ(::munmap(second, 2 * page), 0) << std::strerror(errno);
  void* third = ::mremap(reinterpret_cast<void*>(other.addr), 0, 4 * page,
                         MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(at));
  ASSERT_EQ(third, reinterpret_cast<void*>(at)) << std::strerror(errno);
  AwaitStat(&PagerStats::aliases_found, 2);
  EXPECT_EQ(pager_->stats().aliases_found, 2u);
  for (const uint64_t offset : {uint64_t{0}, page, 2 * page, 3 * page}) {
    const std::optional<AddressMap::Location> there =
        engine_->addresses().FindLeftBehind(at + offset);
    ASSERT_TRUE(there.has_value()) << offset;
    EXPECT_EQ(there->bo, other.bo) << "at +" << offset << ": the BO the unmapped mapping showed";
    EXPECT_EQ(there->offset, offset);
  }
  EXPECT_EQ(std::memcmp(third, source_[other.bo].data(), 4 * page), 0);
  EXPECT_TRUE(pager_->status().ok()) << pager_->status().ToString();
  ASSERT_NO_FATAL_FAILURE(Unregister());
  EXPECT_FALSE(TrackedByUserfaultfd(at, 4 * page));
  ASSERT_EQ(::munmap(third, 4 * page), 0) << std::strerror(errno);
}

// A BO the program unmapped (no event says so), then a second mapping of another BO made where
// it was: the map must stop placing the unmapped BO there (its installs would write its bytes
// into the other BO's memfd), and name the other BO.
TEST_P(UffdProgramChangesItsMapping, ASecondMappingWhereAnUnmappedBoWasReplacesItInTheMap) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  RestoreAndCompare(std::nullopt);
  ASSERT_GE(memory_->regions().size(), 2u);
  const Region gone = memory_->regions()[target_];
  const Region other = memory_->regions()[(target_ + 1) % memory_->regions().size()];
  const uint64_t length = PageSize();
  ASSERT_TRUE(engine_->addresses().Find(gone.addr).has_value());
  ASSERT_EQ(::munmap(reinterpret_cast<void*>(gone.addr), length), 0) << std::strerror(errno);
  void* second = ::mremap(reinterpret_cast<void*>(other.addr), 0, length,
                          MREMAP_MAYMOVE | MREMAP_FIXED, reinterpret_cast<void*>(gone.addr));
  ASSERT_EQ(second, reinterpret_cast<void*>(gone.addr)) << std::strerror(errno);
  AwaitStat(&PagerStats::aliases_found);
  EXPECT_EQ(pager_->stats().aliases_found, 1u);
  EXPECT_FALSE(engine_->addresses().Find(gone.addr).has_value())
      << "the unmapped BO is still there";
  const std::optional<AddressMap::Location> there = engine_->addresses().FindLeftBehind(gone.addr);
  ASSERT_TRUE(there.has_value());
  EXPECT_EQ(there->bo, other.bo);
  EXPECT_TRUE(engine_->addresses().Find(gone.addr + length).has_value()) << "the rest of it";
  EXPECT_EQ(std::memcmp(second, source_[other.bo].data(), length), 0);
  ASSERT_NO_FATAL_FAILURE(Unregister());
  EXPECT_FALSE(TrackedByUserfaultfd(gone.addr, length));
}

// A second mapping made before its BO was bound, never touched: the lookup at its event found
// no BO, so the map never recorded it; UnregisterAll finds it in the maps all the same.
TEST_P(UffdProgramChangesItsMapping, AnUnrecordedSecondMappingIsUnregisteredToo) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  ASSERT_NO_FATAL_FAILURE(StartPager());
  const uint64_t length = PageAlignUp(memory_->regions()[target_].size);
  void* second = SecondMappingOfTheTarget();
  ASSERT_FALSE(HasFailure());
  // The pager's lookup at the event, done before the BO is bound.
  AwaitStat(&PagerStats::maps_reads);
  ASSERT_EQ(pager_->stats().maps_reads, 1u);
  ASSERT_NO_FATAL_FAILURE(Bind());
  ASSERT_TRUE(session_->WaitComplete(20s).ok()) << session_->status().ToString();
  EXPECT_EQ(pager_->stats().aliases_found, 0u);
  ExpectUnregisteredShowingTheBo(second, length);
}

// What the pager reads at a fault it finds in no BO: the mapping holding the address, and the
// file it maps.
TEST(ProcessMappings, TheMappingAtAnAddressWithItsFile) {
  const std::string maps =
      "1000-3000 r-xp 00000000 fd:01 1234 /usr/bin/x\n"
      "5000-9000 rw-s 00002000 00:01 987654 /memfd:bo (deleted)\n"
      "9000-a000 rw-p 00000000 00:00 0 \n";
  auto found = ParseMappingAt(maps, 0x6abc);
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->range.start, 0x5000u);
  EXPECT_EQ((*found)->range.end, 0x9000u);
  EXPECT_TRUE((*found)->shared);
  EXPECT_EQ((*found)->file_offset, 0x2000u);
  EXPECT_EQ((*found)->device, makedev(0, 1));
  EXPECT_EQ((*found)->inode, 987654u);
  auto first = ParseMappingAt(maps, 0x1000);
  ASSERT_TRUE(first.ok() && first->has_value());
  EXPECT_FALSE((*first)->shared);
  EXPECT_EQ((*first)->device, makedev(0xfd, 1));
  auto anonymous = ParseMappingAt(maps, 0x9fff);
  ASSERT_TRUE(anonymous.ok() && anonymous->has_value());
  EXPECT_EQ((*anonymous)->inode, 0u);
  for (const uint64_t hole : {uint64_t{0}, uint64_t{0x3000}, uint64_t{0x4fff}, uint64_t{0xa000}}) {
    auto none = ParseMappingAt(maps, hole);
    ASSERT_TRUE(none.ok()) << none.status().ToString();
    EXPECT_FALSE(none->has_value()) << std::hex << hole;
  }
  for (const char* bad :
       {"5000-9000 rw-s\n", "5000-9000 rw-s 2000 00:01\n", "5000-9000 rw-s 2000 0001 5\n",
        "5000-9000 rw 2000 00:01 5\n", "5000-9000 rw-s 2000 00:01 x5\n"}) {
    EXPECT_EQ(ParseMappingAt(bad, 0x6000).status().code(), Code::kCorrupt) << bad;
  }
}

// This process's own maps: a memfd mapped shared is found with the file fstat names.
TEST(ProcessMappings, AMemfdMappingIsFoundAsTheFileItMaps) {
  UniqueFd memfd(::memfd_create("mappings-test", MFD_CLOEXEC));
  ASSERT_TRUE(memfd.valid()) << std::strerror(errno);
  ASSERT_EQ(::ftruncate(memfd.get(), 4 * PageSize()), 0) << std::strerror(errno);
  void* at = ::mmap(nullptr, 2 * PageSize(), PROT_READ, MAP_SHARED, memfd.get(), PageSize());
  ASSERT_NE(at, MAP_FAILED) << std::strerror(errno);
  struct stat st {};
  ASSERT_EQ(::fstat(memfd.get(), &st), 0);
  auto found = MappingAt(::getpid(), reinterpret_cast<uint64_t>(at) + PageSize() + 5);
  ASSERT_TRUE(found.ok()) << found.status().ToString();
  ASSERT_TRUE(found->has_value());
  EXPECT_EQ((*found)->range.start, reinterpret_cast<uint64_t>(at));
  EXPECT_TRUE((*found)->shared);
  EXPECT_EQ((*found)->file_offset, PageSize());
  EXPECT_EQ((*found)->device, st.st_dev);
  EXPECT_EQ((*found)->inode, static_cast<uint64_t>(st.st_ino));
  ASSERT_EQ(::munmap(at, 2 * PageSize()), 0);
}

// The kernel's PROCMAP_QUERY (Linux 6.11+) and the maps text describe this process's mappings
// alike: a memfd mapped shared from an offset, a hole, private anonymous memory, a private file
// mapping, an inaccessible reservation.
TEST(ProcessMappings, TheKernelsQueryAnswersAsTheText) {
  const uint64_t page = PageSize();
  void* reserved = ::mmap(nullptr, 6 * page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(reserved, MAP_FAILED) << std::strerror(errno);
  const auto at = reinterpret_cast<uint64_t>(reserved);
  UniqueFd memfd(::memfd_create("query-test", MFD_CLOEXEC));
  UniqueFd exe(::open("/proc/self/exe", O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(memfd.valid() && exe.valid()) << std::strerror(errno);
  ASSERT_EQ(::ftruncate(memfd.get(), 4 * page), 0) << std::strerror(errno);
  auto place = [&](uint64_t index, uint64_t pages, int prot, int flags, int fd, off_t offset) {
    return ::mmap(reinterpret_cast<void*>(at + index * page), pages * page, prot, flags | MAP_FIXED,
                  fd, offset) == reinterpret_cast<void*>(at + index * page);
  };
  ASSERT_TRUE(place(0, 2, PROT_READ | PROT_WRITE, MAP_SHARED, memfd.get(), page));
  ASSERT_EQ(::munmap(reinterpret_cast<void*>(at + 2 * page), page), 0);
  ASSERT_TRUE(place(3, 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_TRUE(place(4, 1, PROT_READ, MAP_PRIVATE, exe.get(), 0));
  struct stat memfd_stat {};
  ASSERT_EQ(::fstat(memfd.get(), &memfd_stat), 0);
  for (const uint64_t offset : {uint64_t{5}, page, 2 * page, 3 * page + 17, 4 * page, 5 * page}) {
    auto text = MappingAt(::getpid(), at + offset, MapsLookup::kText);
    ASSERT_TRUE(text.ok()) << text.status().ToString();
    auto queried = MappingAt(::getpid(), at + offset, MapsLookup::kQuery);
    if (queried.status().code() == Code::kUnsupported) {
      ::munmap(reserved, 6 * page);
      GTEST_SKIP() << queried.status().ToString();
    }
    ASSERT_TRUE(queried.ok()) << queried.status().ToString();
    ASSERT_EQ(queried->has_value(), text->has_value()) << "at page offset " << offset;
    EXPECT_EQ(text->has_value(), offset / page != 2) << "only page 2 is a hole";
    if (!text->has_value()) continue;
    const MappingDetails& a = **queried;
    const MappingDetails& b = **text;
    EXPECT_EQ(a.range.start, b.range.start) << offset;
    EXPECT_EQ(a.range.end, b.range.end) << offset;
    EXPECT_EQ(a.shared, b.shared) << offset;
    EXPECT_EQ(a.file_offset, b.file_offset) << offset;
    EXPECT_EQ(a.device, b.device) << offset;
    EXPECT_EQ(a.inode, b.inode) << offset;
    switch (offset / page) {
      case 0:
      case 1:
        EXPECT_EQ(a.range.start, at);
        EXPECT_EQ(a.range.end, at + 2 * page);
        EXPECT_TRUE(a.shared);
        EXPECT_EQ(a.file_offset, page);
        EXPECT_EQ(a.device, memfd_stat.st_dev);
        EXPECT_EQ(a.inode, static_cast<uint64_t>(memfd_stat.st_ino));
        break;
      case 3:
      case 5:
        EXPECT_FALSE(a.shared) << offset;
        EXPECT_EQ(a.inode, 0u) << offset;
        // The reservation's top page may merge with like memory mapped above it.
        EXPECT_EQ(a.range.start, at + offset / page * page) << offset;
        if (offset / page == 3) {
          EXPECT_EQ(a.range.end, at + 4 * page);
        }
        break;
      case 4:
        // The file's device is not compared with stat's: on btrfs subvolumes or overlayfs
        // stat names another device than the superblock's, which the maps show.
        EXPECT_FALSE(a.shared);
        EXPECT_EQ(a.file_offset, 0u);
        EXPECT_NE(a.inode, 0u);
        break;
    }
  }
  ::munmap(reserved, 6 * page);
}

// Makes every ioctl of this process fail with EPERM, as a seccomp policy filtering ioctls does.
// False where it could not (or this architecture is not one the filter knows).
bool RefuseEveryIoctl() {
#if defined(__x86_64__)
  constexpr uint32_t kArch = AUDIT_ARCH_X86_64;
#elif defined(__aarch64__)
  constexpr uint32_t kArch = AUDIT_ARCH_AARCH64;
#else
  return false;
#endif
  sock_filter program[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, arch)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, kArch, 1, 0),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_ioctl, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog filter{static_cast<unsigned short>(std::size(program)), program};
  return ::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0 &&
         ::syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &filter) == 0;
}

// Under a policy that refuses the ioctl, the lookup reads the text instead (kQuery says why).
TEST(ProcessMappings, ALookupTheKernelRefusesReadsTheText) {
#if !defined(__x86_64__) && !defined(__aarch64__)
  GTEST_SKIP() << "no seccomp filter for this architecture here";
#endif
  void* at = ::mmap(nullptr, PageSize(), PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(at, MAP_FAILED) << std::strerror(errno);
  const auto address = reinterpret_cast<uint64_t>(at);
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        if (!RefuseEveryIoctl()) std::_Exit(2);
        auto queried = MappingAt(::getpid(), address, MapsLookup::kQuery);
        if (queried.ok() ||
            queried.status().message().find("Operation not permitted") == std::string::npos)
          std::_Exit(3);
        auto found = MappingAt(::getpid(), address + 5);
        if (!found.ok() || !found->has_value() || (*found)->range.start != address) std::_Exit(4);
        std::_Exit(0);
      },
      ::testing::ExitedWithCode(0), "");
  ::munmap(at, PageSize());
}

TEST(ShmemLargeFolios, OnlySettingsThatHugeAWriteCount) {
  const std::string never = "always within_size advise [never] deny force";
  EXPECT_FALSE(ShmemWritesMayAllocateLargeFolios(never, {}));
  EXPECT_FALSE(ShmemWritesMayAllocateLargeFolios("", {}));  // no transparent huge pages at all
  EXPECT_FALSE(ShmemWritesMayAllocateLargeFolios("always within_size [advise] never deny force",
                                                 {"always [inherit] within_size advise never"}));
  EXPECT_TRUE(
      ShmemWritesMayAllocateLargeFolios("[always] within_size advise never deny force", {}));
  EXPECT_TRUE(
      ShmemWritesMayAllocateLargeFolios("always [within_size] advise never deny force", {}));
  EXPECT_TRUE(
      ShmemWritesMayAllocateLargeFolios("always within_size advise never deny [force]", {}));
  EXPECT_FALSE(ShmemWritesMayAllocateLargeFolios(
      never,
      {"always [inherit] within_size advise never", "always inherit within_size [advise] never"}));
  EXPECT_TRUE(ShmemWritesMayAllocateLargeFolios(
      never,
      {"always [inherit] within_size advise never", "[always] inherit within_size advise never"}));
  EXPECT_TRUE(
      ShmemWritesMayAllocateLargeFolios(never, {"always inherit [within_size] advise never"}));
}

// The memfd given at Bind may come from the restored process (a handover): one it may only read
// is not written through (the engine would reopen it by path with its own rights).
TEST_F(UffdProgramChangesItsMemory, AMemfdGivenReadOnlyIsNotWrittenThrough) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  const Region& region = memory_->regions()[target_];
  void* fresh = ::mmap(reinterpret_cast<void*>(region.addr), PageAlignUp(region.size),
                       PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
  ASSERT_EQ(fresh, reinterpret_cast<void*>(region.addr)) << std::strerror(errno);
  const std::string path = "/proc/self/fd/" + std::to_string(memory_->memfd(target_));
  UniqueFd read_only(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(read_only.valid()) << std::strerror(errno);
  ASSERT_TRUE(engine_->Bind(region, read_only.get()).ok());
  ASSERT_NO_FATAL_FAILURE(BindTheRest(target_));
  ASSERT_NO_FATAL_FAILURE(StartPager());
  ASSERT_TRUE(session_->WaitComplete(20s).ok()) << session_->status().ToString();
  EXPECT_GT(engine_->bytes_unregistered(), 0u);
  EXPECT_EQ(engine_->bytes_kept_in_memfd(), 0u);
  const std::vector<uint8_t> kept = MemfdBytes(target_);
  EXPECT_TRUE(std::all_of(kept.begin(), kept.end(), [](uint8_t b) { return b == 0; }));
}

// A shared BO moved with MREMAP_DONTUNMAP, then unmapped where it went, before its bytes came:
// the range the move left still maps the BO's memfd, and must show the BO's bytes there, not
// zeros (in MISSING mode the installs find no registered range of the BO and, before the engine
// kept such bytes in the memfd, were skipped; the pager then served the range's faults with
// zero pages).
TEST_P(UffdProgramChangesItsMapping, ABoUnmappedAfterADontUnmapMoveShowsItsBytesWhereItWas) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  ASSERT_NO_FATAL_FAILURE(StartPager());
  const Region region = memory_->regions()[target_];
  const uint64_t length = PageAlignUp(region.size);
  const std::vector<uint8_t>& bytes = source_[target_];
  const uint64_t elsewhere = MoveLeavingItMapped(region.addr, length);
  ASSERT_FALSE(HasFailure());
  ASSERT_EQ(::munmap(reinterpret_cast<void*>(elsewhere), length), 0) << std::strerror(errno);
  ASSERT_NO_FATAL_FAILURE(Bind());
  ASSERT_TRUE(session_->WaitComplete(20s).ok()) << session_->status().ToString();
  EXPECT_GT(engine_->bytes_unregistered(), 0u) << "the BO's installs found it mapped";
  EXPECT_EQ(MemfdBytes(target_), bytes) << "the BO's memfd";
  // Every page of the range the move left, each read faulting (or finding the page cache's).
  const auto* old_range = reinterpret_cast<const uint8_t*>(region.addr);
  EXPECT_EQ(std::memcmp(old_range, bytes.data(), bytes.size()), 0) << "the range the move left";
  EXPECT_TRUE(pager_->status().ok()) << pager_->status().ToString();
}

// The program wrote a page of a BO through a mapping of the BO's memfd that is not registered
// (it mapped the memfd afresh) before that page's chunk came: the chunk's other pages go into
// the memfd, that page keeps what the program wrote. MISSING mode (the engine's own
// userfaultfd installs only where no page is); MINOR mode writes a chunk whole through its own
// mapping before mapping it, as docs/uffd.md says.
TEST_F(UffdProgramChangesItsMemory, ABoPageTheProgramWroteThroughAnotherMappingKeepsItsBytes) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  ASSERT_NO_FATAL_FAILURE(StartPager());
  const Region region = memory_->regions()[target_];
  const uint64_t length = PageAlignUp(region.size);
  const std::vector<uint8_t>& bytes = source_[target_];
  const auto [page, offset] = DataPage(bytes);
  // The BO's registered range gone, the memfd mapped again where nothing is registered.
  ASSERT_EQ(::munmap(reinterpret_cast<void*>(region.addr), length), 0) << std::strerror(errno);
  ASSERT_NO_FATAL_FAILURE(Hold(region.addr, length));
  auto* again = static_cast<uint8_t*>(
      ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, memory_->memfd(target_), 0));
  ASSERT_NE(again, MAP_FAILED) << std::strerror(errno);
  std::memset(again + page, 0x5a, PageSize());
  ASSERT_NO_FATAL_FAILURE(Bind());
  ASSERT_TRUE(session_->WaitComplete(20s).ok()) << session_->status().ToString();
  std::vector<uint8_t> expected = bytes;
  std::fill_n(expected.begin() + static_cast<std::ptrdiff_t>(page),
              std::min<uint64_t>(PageSize(), bytes.size() - page), uint8_t{0x5a});
  EXPECT_EQ(std::vector<uint8_t>(again, again + bytes.size()), expected);
  EXPECT_GT(engine_->bytes_kept_in_memfd(), 0u);
  ASSERT_EQ(::munmap(again, length), 0) << std::strerror(errno);
  EXPECT_TRUE(pager_->status().ok()) << pager_->status().ToString();
}

TEST_F(UffdProgramChangesItsMemory, ARangeLeftByADontUnmapMoveReadsZerosInPrivateMemory) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory(/*anonymous=*/true));
  ExpectARangeLeftByADontUnmapMoveReads(/*expect_alias=*/false);
}

// A range a DONTUNMAP move left moves on, onto a page of another BO that a thread waits on:
// the move carries no BO bytes, yet the waiting thread must be woken (it faults again there and
// reads what the range shows, the first BO's page), not left asleep on the page that went.
TEST_P(UffdProgramChangesItsMapping, ALeftRangeMovedOntoAWaitedPageWakesTheWaiter) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  ASSERT_NO_FATAL_FAILURE(StartPager());
  const Region first = memory_->regions()[target_];
  const Region second = memory_->regions()[MostDataBo(source_, first.bo)];
  const uint64_t first_length = PageAlignUp(first.size);
  const auto [first_page, first_offset] = DataPage(source_[first.bo]);
  const auto [second_page, second_offset] = DataPage(source_[second.bo]);
  const uint64_t elsewhere = MoveLeavingItMapped(first.addr, first_length);
  ASSERT_FALSE(HasFailure());
  BackgroundRead reader(second.addr + second_offset);
  AwaitStat(&PagerStats::demand_chunks);
  ASSERT_GE(pager_->stats().demand_chunks, 1u) << "the reader's fault was not read";
  // The page of the first BO's old range onto the page the reader waits on.
  ASSERT_NO_FATAL_FAILURE(Move(first.addr + first_page, second.addr + second_page, PageSize()));
  ASSERT_NO_FATAL_FAILURE(Hold(first.addr + first_page, PageSize()));
  ASSERT_NO_FATAL_FAILURE(Bind());
  const uint8_t value = reader.Get("the reader of the page the range moved onto");
  EXPECT_EQ(value, source_[first.bo][first_page + (second_offset - second_page)]);
  ASSERT_TRUE(session_->WaitComplete(20s).ok()) << session_->status().ToString();
  EXPECT_TRUE(pager_->status().ok()) << pager_->status().ToString();
  UnregisterAndUnmap(elsewhere, first_length);
}

// The pager knows the program (here, itself): where the kernel refuses a range it unregisters
// what the program's maps show there, a few calls per range instead of two per page.
TEST_P(UffdProgramChangesItsMapping, UnregisterAllLeavesNothingRegisteredAfterUnmapsAndFileMaps) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  RestoreAndCompare(std::nullopt);
  ASSERT_EQ(uffd_->owner(), ::getpid());
  const auto [calls, gone_pages] = UnregisterAfterAnUnmapAndAFileMap();
  ASSERT_GE(gone_pages, 64u) << "the image's largest BO is too small to tell the ways apart";
  // One call per range and per mapping in the refused ones (three: the BO split by the file
  // page), a few more if the program's threads map something meanwhile; halving takes about two
  // per page of the BO unmapped.
  EXPECT_LT(calls, gone_pages / 2) << "calls for " << gone_pages << " pages gone";
}

// Without the program's pid (a handover from a sender that sent no credentials) the pager
// probes a refused range by halves: slower, and still nothing is left registered.
TEST_P(UffdProgramChangesItsMapping, UnregisterAllWithoutTheProgramsMapsStillLeavesNothing) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  UniqueFd copy(::fcntl(uffd_->fd(), F_DUPFD_CLOEXEC, 0));
  ASSERT_TRUE(copy.valid()) << std::strerror(errno);
  pager_uffd_.emplace(Userfaultfd::Adopt(std::move(copy), uffd_->mode(), uffd_->scope()));
  ASSERT_FALSE(pager_uffd_->owner().has_value());
  RestoreAndCompare(std::nullopt);
  const auto [calls, gone_pages] = UnregisterAfterAnUnmapAndAFileMap();
  EXPECT_GE(calls, gone_pages) << "the refused range probed by halves, down to its pages";
}

// The program unmapped every BO: each range is refused, and one reading of its maps says for all
// of them that nothing is mapped there.
TEST_P(UffdProgramChangesItsMapping, UnregisterAllReadsTheProgramsMapsOncePerWalk) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  RestoreAndCompare(std::nullopt);
  ASSERT_GE(memory_->regions().size(), 2u) << "one range tells nothing about a reading kept";
  unregistered_ = true;
  for (const Region& region : memory_->regions())
    ASSERT_EQ(::munmap(reinterpret_cast<void*>(region.addr), PageAlignUp(region.size)), 0)
        << std::strerror(errno);
  const Status unregistered = pager_->UnregisterAll();
  for (const Region& region : memory_->regions())
    ASSERT_NO_FATAL_FAILURE(Hold(region.addr, PageAlignUp(region.size)));
  EXPECT_TRUE(unregistered.ok()) << unregistered.ToString();
  // One by the walk, one at the end for mappings of the memfds the map never recorded.
  EXPECT_EQ(pager_->stats().maps_reads, 2u);
  EXPECT_LE(pager_->stats().unregister_calls, memory_->regions().size()) << "one per range";
}

// The program splits a registered mapping after the pager has read its maps (a file mapped over
// part of it, as the first was): the kernel refuses the whole mapping the reading named, and the
// reading, taken before, still shows it whole. Taking that as "a mapping the kernel cannot track"
// would leave the rest of it registered; a second reading shows the split.
TEST_P(UffdProgramChangesItsMapping, AMappingSplitAfterTheMapsWereReadEndsUnregistered) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  std::vector<Region> by_size = memory_->regions();
  std::sort(by_size.begin(), by_size.end(),
            [](const Region& a, const Region& b) { return a.size > b.size; });
  const Region split = by_size[0];
  const uint64_t length = PageAlignUp(split.size);
  ASSERT_GE(length, 8 * PageSize());
  UniqueFd exe(::open("/proc/self/exe", O_RDONLY | O_CLOEXEC));
  ASSERT_TRUE(exe.valid()) << std::strerror(errno);
  auto map_file_page = [&](uint64_t at) {
    return ::mmap(reinterpret_cast<void*>(at), PageSize(), PROT_READ, MAP_PRIVATE | MAP_FIXED,
                  exe.get(), 0) == reinterpret_cast<void*>(at);
  };
  // The first file page splits the BO in two at its middle; the second, mapped once the pager
  // has read the maps, splits the first half again.
  const uint64_t middle = split.addr + PageAlignDown(length / 2);
  const uint64_t quarter = split.addr + PageAlignDown(length / 4);
  int reads = 0;
  bool second_mapped = false;
  PagerOptions options;
  options.after_maps_read = [&] {
    if (++reads == 1) second_mapped = map_file_page(quarter);
  };
  ASSERT_NO_FATAL_FAILURE(Bind());
  ASSERT_NO_FATAL_FAILURE(StartPager(std::move(options)));
  ASSERT_TRUE(session_->WaitComplete(20s).ok()) << session_->status().ToString();
  ASSERT_TRUE(map_file_page(middle)) << std::strerror(errno);
  unregistered_ = true;
  const Status unregistered = pager_->UnregisterAll();
  ASSERT_TRUE(second_mapped) << std::strerror(errno);
  EXPECT_TRUE(unregistered.ok()) << unregistered.ToString();
  for (const Region& region : memory_->regions())
    EXPECT_FALSE(TrackedByUserfaultfd(region.addr, PageAlignUp(region.size))) << "BO " << region.bo;
  EXPECT_GE(pager_->stats().maps_reads, 2u);
  EXPECT_LT(pager_->stats().unregister_calls, length / PageSize() / 2)
      << "split pieces found in the maps, not by halving";
}

// The program moves a BO while the pager unregisters, after the walk has taken the map's
// ranges: the BO must not stay registered at its new address, where a later first touch would
// wait for a pager that has stopped.
TEST_P(UffdProgramChangesItsMapping, ABoMovedWhileUnregisteringEndsUnregisteredWhereItIs) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  const Region moving = memory_->regions()[target_];
  const uint64_t length = PageAlignUp(moving.size);
  const uint64_t elsewhere = Reserve(length);
  bool moved = false;
  PagerOptions options;
  options.after_unregister_snapshot = [&] {
    if (moved) return;
    moved = true;
    Move(moving.addr, elsewhere, length);  // the pager's loop reads the event meanwhile
  };
  ASSERT_NO_FATAL_FAILURE(Bind());
  ASSERT_NO_FATAL_FAILURE(StartPager(std::move(options)));
  ASSERT_TRUE(session_->WaitComplete(20s).ok()) << session_->status().ToString();
  unregistered_ = true;
  const Status unregistered = pager_->UnregisterAll();
  ASSERT_TRUE(moved);
  ASSERT_NO_FATAL_FAILURE(Hold(moving.addr, length));
  EXPECT_TRUE(unregistered.ok()) << unregistered.ToString();
  EXPECT_FALSE(TrackedByUserfaultfd(elsewhere, length)) << "the BO moved while unregistering";
  for (const Region& region : memory_->regions()) {
    if (region.bo == moving.bo) continue;
    EXPECT_FALSE(TrackedByUserfaultfd(region.addr, PageAlignUp(region.size))) << "BO " << region.bo;
  }
  EXPECT_EQ(std::memcmp(reinterpret_cast<const void*>(elsewhere), source_[moving.bo].data(),
                        source_[moving.bo].size()),
            0);
  ASSERT_EQ(::munmap(reinterpret_cast<void*>(elsewhere), length), 0) << std::strerror(errno);
}

// MADV_DONTNEED on private anonymous memory, as an allocator returning memory does.
TEST_F(UffdProgramChangesItsMemory, APageDroppedAfterItLandedReadsZeros) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory(/*anonymous=*/true));
  ASSERT_NO_FATAL_FAILURE(RestoreAndCompare(std::nullopt));
  ExpectADroppedPageReadsZeros([&](uint64_t offset) {
    ASSERT_EQ(::madvise(memory_->bytes(target_).data() + offset, PageSize(), MADV_DONTNEED), 0)
        << std::strerror(errno);
  });
}

// A hole punched in a BO's memfd: the page leaves the page cache, and its next touch is a
// MISSING fault again.
TEST_F(UffdProgramChangesItsMemory, AHolePunchedAfterItLandedReadsZeros) {
  ASSERT_NO_FATAL_FAILURE(CreateMemory());
  ASSERT_NO_FATAL_FAILURE(RestoreAndCompare(std::nullopt));
  ExpectADroppedPageReadsZeros([&](uint64_t offset) {
    ASSERT_EQ(::fallocate(memory_->memfd(target_), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                          static_cast<off_t>(offset), static_cast<off_t>(PageSize())),
              0)
        << std::strerror(errno);
  });
}

TEST(UffdPager, ServerKilledWhileFaultsPendingThenRestarted) {
  TempDir dir;
  const fs::path image_dir = MakeImage(dir.path() / "images", 24 << 20);
  auto server = std::make_unique<ServerProcess>(dir.path(), dir.path() / "images");
  ASSERT_TRUE(server->ready()) << server->Log();
  client::SessionOptions options = Options(*server);
  // Every byte through the server: with the image files passed, the client could finish from
  // them alone (a loaded machine let the whole stream's references arrive before the kill) and
  // never need the restarted server.
  options.read_files = false;

  auto uffd = Userfaultfd::Create(FillMode::kMissingCopy);
  ASSERT_TRUE(uffd.ok());
  UffdCopyEngine engine(*uffd);
  client::RestoreSession session(options, engine);
  ASSERT_TRUE(session.Start().ok());
  // The server dies before the memory is even bound: every read below faults on a dead server.
  kill(server->pid(), SIGKILL);
  auto source = SourceBytes(image_dir, session.bos());
  auto memory = RestoredMemory::Create(*uffd, Sizes(session.bos()));
  ASSERT_TRUE(memory.ok());
  for (const Region& region : memory->regions())
    ASSERT_TRUE(engine.Bind(region, -1).ok());
  Pager pager(*uffd, session, engine, memory->regions());
  ASSERT_TRUE(pager.Start().ok());

  std::atomic<int> mismatches{0};
  std::thread readers([&] { ReadRandomly(*memory, source, 3, 100, &mismatches); });
  std::this_thread::sleep_for(300ms);  // faults pile up against the dead server
  server.reset();                      // reaps the killed process
  fs::remove(dir.path() / "ready");
  server = std::make_unique<ServerProcess>(dir.path(), dir.path() / "images");
  ASSERT_TRUE(server->ready()) << server->Log();
  readers.join();
  EXPECT_EQ(mismatches.load(), 0);
  ASSERT_TRUE(session.WaitComplete(20s).ok()) << session.status().ToString();
  EXPECT_GE(session.progress().reconnects, 1u);
  ASSERT_TRUE(pager.UnregisterAll().ok());
  pager.Stop();
  for (uint32_t bo = 0; bo < source.size(); ++bo)
    EXPECT_EQ(std::memcmp(memory->bytes(bo).data(), source[bo].data(), source[bo].size()), 0);
}

// What the restored child does once it has handed its memory over.
enum class ChildDoes {
  kReadsAll,    // reads every BO, checks their hash, waits for Complete
  kExitsEarly,  // touches BO 0's first byte and exits
  // unmaps BO 0 at once, reads the others, and after Complete hashes BO 0 from its memfd
  kUnmapsBoZero,
};

// The restored process in a forked child hands its userfaultfd (and memfds) to the pager in
// this process over SCM_RIGHTS, then does `does`.
void RunChild(int socket, ChildDoes does, FillMode mode, uint64_t expected_hash) {
  const bool exit_early = does == ChildDoes::kExitsEarly;
  // A child blocked on a fault nobody serves would outlive its test and hold the test's output
  // open until ctest's timeout: it dies with this process, or after a minute whatever happens.
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  ::alarm(60);
  auto layout = ReceiveLayout(socket, 10s);
  if (!layout.ok()) _exit(10);
  auto uffd = Userfaultfd::Create(mode);
  if (!uffd.ok()) _exit(11);
  auto memory = RestoredMemory::Create(*uffd, *layout);
  if (!memory.ok()) _exit(12);
  const Region zero = memory->regions()[0];
  // Before the handover: no chunk of BO 0 can have landed in its mapping.
  if (does == ChildDoes::kUnmapsBoZero &&
      ::munmap(reinterpret_cast<void*>(zero.addr), PageAlignUp(zero.size)) != 0)
    _exit(16);
  if (!SendHandover(socket, *uffd, memory->regions(), memory->memfds()).ok()) _exit(13);
  if (does == ChildDoes::kUnmapsBoZero) {
    if (!WaitComplete(socket, 20s).ok()) _exit(15);
    std::vector<uint8_t> kept(zero.size);
    if (::pread(memory->memfd(0), kept.data(), kept.size(), 0) != static_cast<ssize_t>(kept.size()))
      _exit(17);
    uint64_t hash = XXH3_64bits_withSeed(kept.data(), kept.size(), 0);
    for (uint32_t bo = 1; bo < layout->size(); ++bo)
      hash = XXH3_64bits_withSeed(memory->bytes(bo).data(), memory->bytes(bo).size(), hash);
    _exit(hash == expected_hash ? 0 : 14);
  }
  uint64_t hash = 0;
  for (uint32_t bo = 0; bo < layout->size(); ++bo) {
    std::span<uint8_t> bytes = memory->bytes(bo);
    if (exit_early) {
      volatile uint8_t first = bytes.empty() ? 0 : bytes[0];
      (void)first;
      _exit(0);
    }
    hash = XXH3_64bits_withSeed(bytes.data(), bytes.size(), hash);
  }
  if (hash != expected_hash) _exit(14);
  if (!WaitComplete(socket, 20s).ok()) _exit(15);
  _exit(0);
}

// A restored process forked to run RunChild, and this process's end of its handover socket.
// Fork before this process has threads (a probe's are joined when it returns). A test that ends
// (or fails) with the child still running kills and reaps it.
class RestoredChild {
 public:
  RestoredChild() = default;
  RestoredChild(pid_t pid, UniqueFd socket) : pid_(pid), socket_(std::move(socket)) {}
  RestoredChild(const RestoredChild&) = delete;
  RestoredChild& operator=(const RestoredChild&) = delete;
  ~RestoredChild() {
    if (pid_ <= 0 || exit_status_.has_value()) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }

  pid_t pid() const { return pid_; }
  int socket() const { return socket_.get(); }

  // The child's wait status once it has exited, waiting at most `timeout`; nullopt while it runs.
  std::optional<int> WaitExit(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (!exit_status_.has_value()) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        exit_status_ = status;
        break;
      }
      if (std::chrono::steady_clock::now() >= deadline) break;
      std::this_thread::sleep_for(10ms);
    }
    return exit_status_;
  }

 private:
  pid_t pid_ = -1;
  UniqueFd socket_;
  std::optional<int> exit_status_;
};

RestoredChild ForkRestoredChild(ChildDoes does, FillMode mode, uint64_t expected_hash) {
  auto pair = HandoverSocketPair();
  EXPECT_TRUE(pair.ok()) << pair.status().ToString();
  if (!pair.ok()) return {};
  const pid_t pid = fork();
  if (pid == 0) {
    pair->first.reset();
    RunChild(pair->second.get(), does, mode, expected_hash);
  }
  pair->second.reset();
  return RestoredChild(pid, std::move(pair->first));
}

class UffdHandover : public ::testing::TestWithParam<std::tuple<FillMode, bool>> {};

// The BO sizes in the order the server lists them, and the hash of their bytes in that order,
// from a first session (its threads are joined on return, so the caller may fork after it).
struct ImageLayout {
  std::vector<uint64_t> sizes;
  uint64_t hash = 0;
};

ImageLayout ProbeLayout(const TempDir& dir, const fs::path& image_dir, FillMode mode) {
  ImageLayout layout;
  ServerProcess probe_server(dir.path(), dir.path() / "images");
  EXPECT_TRUE(probe_server.ready()) << probe_server.Log();
  auto uffd = Userfaultfd::Create(mode);
  EXPECT_TRUE(uffd.ok());
  if (!uffd.ok()) return layout;
  UffdCopyEngine engine(*uffd);
  client::RestoreSession probe(Options(probe_server), engine);
  EXPECT_TRUE(probe.Start().ok());
  for (const auto& bytes : SourceBytes(image_dir, probe.bos()))
    layout.hash = XXH3_64bits_withSeed(bytes.data(), bytes.size(), layout.hash);
  layout.sizes = Sizes(probe.bos());
  probe.Cancel();
  engine.Abandon();
  fs::remove(dir.path() / "ready");
  return layout;
}

// The pager in this process serves a restored child that does `does` (not kExitsEarly: see
// PagerInAnotherProcess).
void PageAChild(FillMode mode, ChildDoes does) {
  const bool exit_early = does == ChildDoes::kExitsEarly;
  TempDir dir;
  const fs::path image_dir = MakeImage(dir.path() / "images", 24 << 20);
  const auto [sizes, expected] = ProbeLayout(dir, image_dir, mode);
  ASSERT_FALSE(sizes.empty());
  RestoredChild restored = ForkRestoredChild(does, mode, expected);
  ASSERT_GT(restored.pid(), 0);
  const int socket = restored.socket();
  ASSERT_GE(socket, 0);
  ServerProcess server(dir.path(), dir.path() / "images");
  ASSERT_TRUE(server.ready()) << server.Log();

  ASSERT_TRUE(SendLayout(socket, sizes).ok());
  auto handover = ReceiveHandover(socket, 10s);
  ASSERT_TRUE(handover.ok()) << handover.status().ToString();
  EXPECT_EQ(handover->uffd.mode(), mode);
  // The sender as the kernel names it: the child, not the parent that made the socket pair
  // (which is whom SO_PEERCRED would name).
  EXPECT_EQ(handover->uffd.owner(), restored.pid());
  UffdCopyEngine engine(handover->uffd);
  client::RestoreSession session(Options(server), engine);
  ASSERT_TRUE(session.Start().ok());
  for (size_t i = 0; i < handover->regions.size(); ++i)
    ASSERT_TRUE(engine.Bind(handover->regions[i], handover->memfds[i].get()).ok());
  PagerOptions pager_options;
  pager_options.peer_fd = socket;
  Pager pager(handover->uffd, session, engine, handover->regions, pager_options);
  ASSERT_TRUE(pager.Start().ok());

  Status complete = session.WaitComplete(20s);
  if (exit_early) {
    // The child is gone: the pager notices (hang-up or ESRCH) and ends the session quietly.
    for (int i = 0; i < 200 && !pager.peer_gone(); ++i)
      std::this_thread::sleep_for(10ms);
    EXPECT_TRUE(pager.peer_gone());
    EXPECT_TRUE(complete.ok() || complete.code() == Code::kAborted) << complete.ToString();
    pager.Stop();
    EXPECT_TRUE(pager.status().ok()) << pager.status().ToString();
  } else {
    ASSERT_TRUE(complete.ok()) << complete.ToString();
    EXPECT_FALSE(handover->uffd.OwnerExited()) << "the child waits for Complete";
    ASSERT_TRUE(pager.UnregisterAll().ok());
    ASSERT_TRUE(SendComplete(socket).ok());
    pager.Stop();
    EXPECT_TRUE(pager.status().ok()) << pager.status().ToString();
  }
  const std::optional<int> status = restored.WaitExit(10s);
  ASSERT_TRUE(status.has_value()) << "the restored child is still running";
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << "wait status " << *status;
  if (exit_early) {
    // The kernel answers ENOMEM for a process that has exited (its pidfd, opened at the
    // handover, says so): nothing is left to unregister.
    const Status unregistered = pager.UnregisterAll();
    EXPECT_TRUE(unregistered.ok()) << unregistered.ToString();
  }
}

TEST_P(UffdHandover, PagerInAnotherProcess) {
  const auto [mode, exit_early] = GetParam();
  PageAChild(mode, exit_early ? ChildDoes::kExitsEarly : ChildDoes::kReadsAll);
}

// A BO the restored child unmaps before any of its chunks came keeps its bytes in its memfd,
// which the child reads after the restore: the handover passes the memfds in MISSING mode too
// (before session 58 it passed none there, and the pager skipped the BO's bytes).
class UffdHandoverModes : public ::testing::TestWithParam<FillMode> {};

TEST_P(UffdHandoverModes, ABoTheProgramUnmappedKeepsItsBytesInItsMemfd) {
  PageAChild(GetParam(), ChildDoes::kUnmapsBoZero);
}

INSTANTIATE_TEST_SUITE_P(Modes, UffdHandoverModes,
                         ::testing::Values(FillMode::kMissingCopy, FillMode::kMinorContinue),
                         [](const ::testing::TestParamInfo<FillMode>& info) {
                           return ModeName(info.param);
                         });

INSTANTIATE_TEST_SUITE_P(Modes, UffdHandover,
                         ::testing::Combine(::testing::Values(FillMode::kMissingCopy,
                                                              FillMode::kMinorContinue),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<UffdHandover::ParamType>& info) {
                           return ModeName(std::get<0>(info.param)) +
                                  (std::get<1>(info.param) ? "_ExitsEarly" : "_RunsToEnd");
                         });

// A fault the pager read while its process was still there, on a chunk that lands before the
// pager handles it; the process then exits. Waking that fault (UFFDIO_CONTINUE in MINOR mode)
// finds the process gone: the pager must end quietly, as on a hang-up, not report an error.
TEST(UffdPager, FaultReadBeforeItsProcessExitedEndsQuietly) {
  const FillMode mode = FillMode::kMinorContinue;
  TempDir dir;
  const fs::path image_dir = MakeImage(dir.path() / "images", 4 << 20);
  const std::vector<uint64_t> sizes = ProbeLayout(dir, image_dir, mode).sizes;
  ASSERT_FALSE(sizes.empty());
  // The child touches BO 0's first byte and exits.
  RestoredChild restored = ForkRestoredChild(ChildDoes::kExitsEarly, mode, 0);
  ASSERT_GT(restored.pid(), 0);
  const int socket = restored.socket();
  ASSERT_GE(socket, 0);
  ServerProcess server(dir.path(), dir.path() / "images");
  ASSERT_TRUE(server.ready()) << server.Log();
  ASSERT_TRUE(SendLayout(socket, sizes).ok());
  auto handover = ReceiveHandover(socket, 10s);
  ASSERT_TRUE(handover.ok()) << handover.status().ToString();
  pollfd fault{handover->uffd.fd(), POLLIN, 0};
  ASSERT_EQ(poll(&fault, 1, 10000), 1) << "the child never faulted";

  UffdCopyEngine engine(handover->uffd);
  client::SessionOptions options = Options(server);
  options.stream_all = false;  // nothing lands unless asked for
  client::RestoreSession session(options, engine);
  ASSERT_TRUE(session.Start().ok());
  for (size_t i = 0; i < handover->regions.size(); ++i)
    ASSERT_TRUE(engine.Bind(handover->regions[i], handover->memfds[i].get()).ok());
  std::optional<int> child_status;
  PagerOptions pager_options;
  pager_options.peer_fd = socket;
  pager_options.after_events_read = [&] {
    if (child_status.has_value()) return;
    // Between the read and the handling: the faulting chunk lands (which wakes the child) and
    // the child exits.
    const uint64_t length = std::min<uint64_t>(sizes[0], session.chunk_size());
    EXPECT_TRUE(session.Ensure(0, 0, length, 10s).ok());
    child_status = restored.WaitExit(10s);
  };
  Pager pager(handover->uffd, session, engine, handover->regions, pager_options);
  ASSERT_TRUE(pager.Start().ok());
  for (int i = 0; i < 1000 && !pager.peer_gone(); ++i)
    std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(pager.peer_gone());
  pager.Stop();
  EXPECT_TRUE(pager.status().ok()) << pager.status().ToString();
  ASSERT_TRUE(child_status.has_value()) << "the restored child is still running";
  EXPECT_TRUE(WIFEXITED(*child_status) && WEXITSTATUS(*child_status) == 0) << *child_status;
}

// The pager learns the userfaultfd's fault scope: where faults are user-mode only, a system call
// on a deferred zero page would fail with EFAULT, so that pager's engine installs zeros at once.
TEST(Handover, CarriesTheFaultScope) {
  for (const FaultScope scope : {FaultScope::kUserOnly, FaultScope::kUserAndKernel}) {
    SCOPED_TRACE(FaultScopeName(scope));
    auto uffd = Userfaultfd::Create(FillMode::kMissingCopy, scope);
    if (!uffd.ok()) {
      ASSERT_EQ(scope, FaultScope::kUserAndKernel) << uffd.status().ToString();
      continue;  // not allowed to catch kernel-mode faults here
    }
    auto pair = HandoverSocketPair();
    ASSERT_TRUE(pair.ok());
    ASSERT_TRUE(SendHandover(pair->first.get(), *uffd, {}, {}).ok());
    auto handover = ReceiveHandover(pair->second.get(), 1s);
    ASSERT_TRUE(handover.ok()) << handover.status().ToString();
    EXPECT_EQ(handover->uffd.scope(), scope);
    UffdCopyEngine engine(handover->uffd);
    EXPECT_EQ(engine.defers_zeros(), scope == FaultScope::kUserAndKernel);
  }
}

// The pager learns whose memory a handed-over userfaultfd covers only from a sender that made
// it: a sender forwarding one it adopted names no owner (its own maps would be the wrong ones).
TEST(Handover, NamesTheOwnerOnlyWhenTheSenderMadeTheUserfaultfd) {
  auto uffd = Userfaultfd::Create(FillMode::kMissingCopy, FaultScope::kUserOnly);
  ASSERT_TRUE(uffd.ok()) << uffd.status().ToString();
  UniqueFd copy(::fcntl(uffd->fd(), F_DUPFD_CLOEXEC, 0));
  ASSERT_TRUE(copy.valid()) << std::strerror(errno);
  const Userfaultfd forwarded = Userfaultfd::Adopt(std::move(copy), uffd->mode(), uffd->scope());
  auto pair = HandoverSocketPair();
  ASSERT_TRUE(pair.ok());
  ASSERT_TRUE(SendHandover(pair->first.get(), *uffd, {}, {}).ok());
  auto made = ReceiveHandover(pair->second.get(), 1s);
  ASSERT_TRUE(made.ok()) << made.status().ToString();
  EXPECT_EQ(made->uffd.owner(), ::getpid());
  EXPECT_FALSE(made->uffd.OwnerExited());
  ASSERT_TRUE(SendHandover(pair->first.get(), forwarded, {}, {}).ok());
  auto passed_on = ReceiveHandover(pair->second.get(), 1s);
  ASSERT_TRUE(passed_on.ok()) << passed_on.status().ToString();
  EXPECT_FALSE(passed_on->uffd.owner().has_value());
}

// A sender in a user namespace of its own with no uid or gid mapped (as in some containers):
// explicit SCM_CREDENTIALS would make its sendmsg fail (EINVAL); the pid the kernel stamps still
// arrives, and the pidfd opened at the handover tells when that process has exited.
TEST(Handover, NamesASenderWithNothingMappedInItsUserNamespace) {
  auto pair = HandoverSocketPair();
  ASSERT_TRUE(pair.ok());
  const pid_t child = fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) {
    pair->second.reset();
    if (::unshare(CLONE_NEWUSER) != 0) _exit(2);
    auto uffd = Userfaultfd::Create(FillMode::kMissingCopy, FaultScope::kUserOnly);
    if (!uffd.ok()) _exit(3);
    _exit(SendHandover(pair->first.get(), *uffd, {}, {}).ok() ? 0 : 4);
  }
  pair->first.reset();
  auto handover = ReceiveHandover(pair->second.get(), 10s);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  if (WEXITSTATUS(status) == 2 || WEXITSTATUS(status) == 3)
    GTEST_SKIP() << "no user namespace or no userfaultfd in one here (" << WEXITSTATUS(status)
                 << ")";
  ASSERT_EQ(WEXITSTATUS(status), 0) << "the sender's handover failed";
  ASSERT_TRUE(handover.ok()) << handover.status().ToString();
  EXPECT_EQ(handover->uffd.owner(), child);
  EXPECT_TRUE(handover->uffd.OwnerExited()) << "reaped";
}

TEST(Handover, RejectsGarbage) {
  auto pair = HandoverSocketPair();
  ASSERT_TRUE(pair.ok());
  const char junk[5] = "junk";
  ASSERT_EQ(write(pair->first.get(), junk, sizeof junk), 5);
  EXPECT_EQ(ReceiveHandover(pair->second.get(), 1s).status().code(), Code::kCorrupt);
  EXPECT_EQ(ReceiveLayout(pair->second.get(), 50ms).status().code(), Code::kTimeout);
}

}  // namespace
}  // namespace gpulazy::uffd
