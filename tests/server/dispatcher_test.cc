// Unit tests of the Dispatcher's disk lanes and of the chunk buffer pool, in process: a real
// (tiny) CRIU checkpoint, a fake ChunkSink that can hold background reads on their disk thread.
#include "lazy-server/server/dispatcher.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <linux/magic.h>
#include <sys/vfs.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "lazy-server/server/context.h"
#include "proto/criu_file.h"
#include "tests/image/test_util.h"

namespace gpulazy::server {
namespace {

using namespace std::chrono_literals;

constexpr uint32_t kGpu = 0xc0de;
constexpr uint32_t kChunk = 4096;
constexpr uint32_t kChunks = 16;

// ---------------------------------------------------------------------------------------------
// ChunkBufferPool

TEST(ChunkBufferPoolTest, KeepsAtMostMaxFreeIdleBuffersAndReusesThem) {
  ChunkBufferPool pool(1024, 2);
  std::set<const uint8_t*> addresses;
  {
    std::vector<ChunkBuffer> out;
    for (int i = 0; i < 3; ++i) {
      out.push_back(pool.Acquire(1000));
      EXPECT_EQ(out.back().capacity(), 1024u);
      addresses.insert(out.back().data());
    }
    EXPECT_EQ(pool.counters().allocated, 3u);
    EXPECT_EQ(pool.counters().out, 3u);
    EXPECT_EQ(pool.counters().idle, 0u);
  }
  // Three came back; two are kept, one is freed.
  ChunkBufferPool::Counters c = pool.counters();
  EXPECT_EQ(c.idle, 2u);
  EXPECT_EQ(c.freed, 1u);
  EXPECT_EQ(c.out, 0u);

  ChunkBuffer a = pool.Acquire(1024);
  ChunkBuffer b = pool.Acquire(10);
  EXPECT_TRUE(addresses.contains(a.data()));
  EXPECT_TRUE(addresses.contains(b.data()));
  EXPECT_EQ(pool.counters().reused, 2u);
  EXPECT_EQ(pool.counters().allocated, 3u);
  ChunkBuffer fresh = pool.Acquire(1);  // none idle: a new one, not a wait
  EXPECT_EQ(pool.counters().allocated, 4u);

  // Larger than the pool's buffers: a one-off of its own size, never pooled.
  {
    ChunkBuffer big = pool.Acquire(4096);
    EXPECT_EQ(big.capacity(), 4096u);
  }
  EXPECT_EQ(pool.counters().idle, 0u);

  // Moving hands the buffer over; only the last owner returns it.
  ChunkBuffer moved = std::move(a);
  EXPECT_EQ(a.capacity(), 0u);  // NOLINT(bugprone-use-after-move): moved-from is empty
  EXPECT_EQ(pool.counters().out, 3u);
}

TEST(ChunkBufferPoolTest, BufferMayOutliveItsPool) {
  ChunkBuffer survivor;
  {
    ChunkBufferPool pool(64, 4);
    survivor = pool.Acquire(64);
    survivor.span()[63] = 7;
  }
  EXPECT_EQ(survivor.span()[63], 7);  // still valid; freed with the handle (ASan checks)
}

// ---------------------------------------------------------------------------------------------
// Dispatcher

class DispatcherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::WriteCheckpoint(dir_.path(), 1, {kGpu},
                             {{kGpu, kChunks * kChunk, criu_format::kAllocVram,
                               testing::RandomBytes(kChunks * kChunk, 5)}});
    auto source = image::ImageSource::Open(dir_.path(), kChunk);
    ASSERT_TRUE(source.ok()) << source.status().ToString();
    source_ = *source;
    layout_ =
        std::make_shared<const ImageLayout>(ImageLayout::FromManifest(source_->manifest(), false));
  }

  // One thread in each lane and buffers of one chunk: reads happen where a test can see them.
  static DispatcherOptions OneThreadALane(uint32_t read_ahead) {
    DispatcherOptions options;
    options.disk_threads = 1;  // bulk lane: 1 thread, 2 reads in flight
    options.demand_threads = 1;
    options.read_ahead = read_ahead;
    options.buffer_bytes = kChunk;
    return options;
  }

  // What the tests' sinks share: the image their chunks come from, the dispatcher they finish
  // chunks on.
  class SinkBase : public ChunkSink {
   public:
    SinkBase(const image::ImageSource& source, Dispatcher* dispatcher)
        : source_(source), dispatcher_(dispatcher) {}
    const image::ImageSource& source() const override { return source_; }
    bool SendsFromFiles(const WorkItem&) const override { return sends_from_files_; }
    bool sends_from_files_ = false;

   protected:
    const image::ImageSource& source_;
    Dispatcher* dispatcher_;
  };

  // Receives chunks on the disk threads. While `hold_background` is set, a background read
  // stays in OnChunkRead (its disk thread busy) until released.
  class Sink : public SinkBase {
   public:
    using SinkBase::SinkBase;
    void OnChunkRead(const WorkItem& item, Result<LoadedChunk> chunk) override {
      std::unique_lock lock(mu_);
      if (item.priority == wire::PRIORITY_DEMAND) {
        demand_ok_ = chunk.ok();
        if (chunk.ok()) demand_bytes_.assign(chunk->bytes().begin(), chunk->bytes().end());
        demand_done_ = true;
        cv_.notify_all();
      } else {
        ++background_reads_;
        ++background_holding_;
        cv_.notify_all();
        cv_.wait(lock, [&] { return !hold_background_; });
        --background_holding_;
      }
      lock.unlock();
      const uint32_t sent = chunk.ok() ? chunk->info.stored_length : 0;
      chunk = Result<LoadedChunk>(Internal("dropped"));  // the buffer goes back first
      dispatcher_->Done(item, sent);
    }

    std::mutex mu_;
    std::condition_variable cv_;
    bool hold_background_ = false;
    int background_holding_ = 0;
    int background_reads_ = 0;
    bool demand_done_ = false;
    bool demand_ok_ = false;
    std::vector<uint8_t> demand_bytes_;
  };

  testing::TempDir dir_;
  std::shared_ptr<const image::ImageSource> source_;
  std::shared_ptr<const ImageLayout> layout_;
};

// The bulk lane's only thread is stuck in a background read and its other slot is queued
// behind it: a demand read is still answered, by the demand lane, without waiting for them.
TEST_F(DispatcherTest, DemandIsReadWhileBackgroundReadsHoldEveryBulkSlot) {
  Dispatcher dispatcher(OneThreadALane(/*read_ahead=*/0));
  auto sink = std::make_shared<Sink>(*source_, &dispatcher);
  sink->hold_background_ = true;
  dispatcher.AddSession(1, layout_, sink);
  dispatcher.Update([&](Scheduler& s) {
    ASSERT_TRUE(s.StreamAll(1).ok());
    s.AddCredit(1, 1 << 30);
  });
  {
    std::unique_lock lock(sink->mu_);
    ASSERT_TRUE(sink->cv_.wait_for(lock, 10s, [&] { return sink->background_holding_ == 1; }));
  }
  Dispatcher::LaneCounters lanes = dispatcher.lanes();
  EXPECT_EQ(lanes.bulk_in_flight, 2u) << "the bulk lane should be full";

  google::protobuf::RepeatedPtrField<wire::ChunkRange> ranges;
  wire::ChunkRange* range = ranges.Add();
  range->set_bo(0);
  range->set_first_chunk(kChunks - 1);
  range->set_chunk_count(1);
  Status enqueued = dispatcher.Update([&](Scheduler& s) {
    return s.Enqueue(1, wire::PRIORITY_DEMAND, Output::kDemand, 5, ranges, Clock::now());
  });
  ASSERT_TRUE(enqueued.ok()) << enqueued.ToString();
  {
    std::unique_lock lock(sink->mu_);
    EXPECT_TRUE(sink->cv_.wait_for(lock, 10s, [&] { return sink->demand_done_; }))
        << "the demand chunk waited behind the held background reads";
    EXPECT_TRUE(sink->demand_ok_);
    EXPECT_EQ(sink->background_holding_, 1);  // still held: the demand did not wait for it
    EXPECT_EQ(sink->background_reads_, 1);
    auto expected = source_->ReadChunk(0, kChunks - 1);
    ASSERT_TRUE(expected.ok());
    EXPECT_EQ(sink->demand_bytes_, expected->bytes);
    sink->hold_background_ = false;
    sink->cv_.notify_all();
  }
  // The lane counts a read once the sink has returned from it: after Stop, every count is in.
  dispatcher.Stop();
  EXPECT_EQ(dispatcher.lanes().demand_reads, 1u);
}

// A whole stream reads through a handful of pooled buffers: bounded by the reads in flight,
// reused for the rest.
TEST_F(DispatcherTest, StreamReusesPooledBuffers) {
  DispatcherOptions options = OneThreadALane(/*read_ahead=*/2);
  options.pooled_buffers = 4;
  Dispatcher dispatcher(options);
  auto sink = std::make_shared<Sink>(*source_, &dispatcher);
  dispatcher.AddSession(1, layout_, sink);
  dispatcher.Update([&](Scheduler& s) {
    ASSERT_TRUE(s.StreamAll(1).ok());
    s.AddCredit(1, 1 << 30);
  });
  {
    std::unique_lock lock(sink->mu_);
    ASSERT_TRUE(
        sink->cv_.wait_for(lock, 10s, [&] { return sink->background_reads_ == int{kChunks}; }));
  }
  dispatcher.Stop();
  const ChunkBufferPool::Counters c = dispatcher.buffers().counters();
  EXPECT_LE(c.allocated, 2u) << "more buffers than reads in flight (1 thread x 2)";
  EXPECT_GE(c.reused, kChunks - 2);
  EXPECT_EQ(c.out, 0u);
  EXPECT_EQ(dispatcher.lanes().bulk_reads, kChunks);
}

// A connection that can send from files gets, for a chunk whose bytes are cached and whose
// checksum is known, only where the bytes are: no buffer, no read. A plain checkpoint's chunk is
// read (and hashed) the first time; bytes not in the page cache are read on the disk thread, so
// a network thread never waits for the disk.
TEST_F(DispatcherTest, CachedChunksWithKnownChecksumsAreSentFromTheFile) {
  class RecordingSink : public SinkBase {
   public:
    using SinkBase::SinkBase;
    void OnChunkRead(const WorkItem& item, Result<LoadedChunk> chunk) override {
      std::lock_guard lock(mu_);
      EXPECT_TRUE(chunk.ok()) << chunk.status().ToString();
      uint32_t sent = 0;
      if (chunk.ok()) {
        sent = chunk->info.stored_length;
        auto raw = source_.ReadChunk(item.bo, item.chunk);
        EXPECT_TRUE(raw.ok());
        std::vector<uint8_t> bytes;
        if (chunk->from_file) {
          ++from_file_;
          EXPECT_EQ(chunk->buffer.span().size(), 0u) << "sent from the file, yet a buffer";
          EXPECT_EQ(chunk->from_file->length, chunk->info.stored_length);
          bytes.resize(chunk->from_file->length);
          EXPECT_TRUE(ReadExactAt(chunk->from_file->fd, chunk->from_file->offset, bytes, "f").ok());
        } else {
          ++buffered_;
          bytes.assign(chunk->bytes().begin(), chunk->bytes().end());
        }
        EXPECT_EQ(bytes, raw->bytes) << "BO " << item.bo << " chunk " << item.chunk;
        EXPECT_EQ(chunk->info.checksum, raw->checksum);
      }
      ++done_;
      chunk = Result<LoadedChunk>(Internal("dropped"));
      dispatcher_->Done(item, sent);
    }
    std::mutex mu_;
    uint32_t done_ = 0;
    uint32_t from_file_ = 0;
    uint32_t buffered_ = 0;
  };
  // No hints: what is cached is what the test made cached.
  Dispatcher dispatcher(OneThreadALane(/*read_ahead=*/0));
  auto stream_all = [&](SessionId id, bool sends_from_files) {
    auto sink = std::make_shared<RecordingSink>(*source_, &dispatcher);
    sink->sends_from_files_ = sends_from_files;
    dispatcher.AddSession(id, layout_, sink);
    dispatcher.Update([&](Scheduler& s) {
      ASSERT_TRUE(s.StreamAll(id).ok());
      s.AddCredit(id, 1 << 30);
    });
    const auto deadline = Clock::now() + 10s;
    for (;;) {
      {
        std::lock_guard lock(sink->mu_);
        if (sink->done_ == kChunks || Clock::now() > deadline) break;
      }
      std::this_thread::sleep_for(1ms);
    }
    dispatcher.RemoveSession(id);
    std::lock_guard lock(sink->mu_);
    EXPECT_EQ(sink->done_, kChunks);
    return std::pair{sink->from_file_, sink->buffered_};
  };
  // First: nothing hashed yet, every chunk is read. Then every chunk is cached and hashed.
  EXPECT_EQ(stream_all(1, true), std::pair(0u, kChunks));
  EXPECT_EQ(stream_all(2, true), std::pair(kChunks, 0u));
  // A TLS connection (or --no-sendfile) reads every chunk, cached or not.
  EXPECT_EQ(stream_all(3, false), std::pair(0u, kChunks));
  // Dropped from the page cache (where the file system lets us): read again, not sent blind.
  const int fd = source_->files().at(0).fd.get();
  struct statfs fs {};
  ASSERT_EQ(::fstatfs(fd, &fs), 0);
  if (fs.f_type != TMPFS_MAGIC) {
    // RANDOM: no kernel read-ahead either, so reading one chunk does not cache the next.
    ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM), 0);
    // Dirty pages are not dropped: written back first, or on a busy machine some stay cached.
    ASSERT_EQ(::fdatasync(fd), 0);
    ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
    // Nearly all are read. Not always every one: on a loaded machine a page now and then stays
    // cached through DONTNEED (seen 3 times in 200 runs beside busy loops), and a chunk whose
    // bytes are all cached is rightly sent from the file. One sent blind would make it most.
    const auto [from_file, buffered] = stream_all(4, true);
    EXPECT_EQ(from_file + buffered, kChunks);
    EXPECT_LE(from_file, 2u) << "chunks dropped from the page cache were sent from the file";
  }
  dispatcher.Stop();
}

// By reference there is nothing to read: each chunk is located on the thread that pumps (here
// the test's own, inside Update) with no disk thread and no buffer. A sink that finishes every
// chunk inside OnChunkRead pumps again from there; that must loop, not recurse once per chunk.
TEST_F(DispatcherTest, ByReferenceChunksAreLocatedWhereTheyArePickedWithoutRecursion) {
  class RecordingSink : public SinkBase {
   public:
    using SinkBase::SinkBase;
    void OnChunkRead(const WorkItem& item, Result<LoadedChunk> chunk) override {
      ++depth_;
      max_depth_ = std::max(max_depth_, depth_);
      threads_.insert(std::this_thread::get_id());
      EXPECT_TRUE(chunk.ok()) << chunk.status().ToString();
      if (chunk.ok()) {
        EXPECT_TRUE(item.by_reference);
        EXPECT_EQ(chunk->info.stored_length, 0u) << "a by-reference chunk carries no bytes";
        ASSERT_TRUE(chunk->in_file.has_value());
        auto where = source_.LocateChunk(item.bo, item.chunk);
        ASSERT_TRUE(where.ok());
        EXPECT_EQ(chunk->in_file->offset, where->offset);
        EXPECT_EQ(chunk->in_file->length, where->length);
        chunks_.push_back(item.chunk);
      }
      dispatcher_->Done(item, chunk.ok() ? chunk->in_file->length : 0);
      --depth_;
    }
    int depth_ = 0;
    int max_depth_ = 0;
    std::set<std::thread::id> threads_;
    std::vector<uint32_t> chunks_;
  };
  Dispatcher dispatcher(OneThreadALane(/*read_ahead=*/4));
  auto sink = std::make_shared<RecordingSink>(*source_, &dispatcher);
  dispatcher.AddSession(1, layout_, sink);
  dispatcher.Update([&](Scheduler& s) {
    ASSERT_TRUE(s.StreamAll(1, Delivery::kByReference).ok());
    s.AddCredit(1, 1 << 30);
  });
  // Update returned after its pump: every chunk was served inside it, on this thread.
  std::vector<uint32_t> expected(kChunks);
  for (uint32_t i = 0; i < kChunks; ++i)
    expected[i] = i;
  EXPECT_EQ(sink->chunks_, expected);
  EXPECT_EQ(sink->threads_, std::set<std::thread::id>{std::this_thread::get_id()});
  EXPECT_EQ(sink->max_depth_, 1) << "serving a chunk recursed into serving the next";
  dispatcher.Stop();
  EXPECT_EQ(dispatcher.lanes().bulk_reads, kChunks);
  EXPECT_EQ(dispatcher.buffers().counters().allocated, 0u);
}

// Bulk reads hint the chunks after them to the kernel, each chunk once (each read looks four
// ahead); a session placed from memory the backend keeps resident (SetPlacedSourcesResident: the
// cuda backend's registered page cache) reads nothing, and its placed chunks get no hints.
// Without that promise they still do.
TEST_F(DispatcherTest, ChunksAreHintedOnceAndNotAtAllWhenPlacedFromResidentSources) {
  class PlacingSink : public SinkBase {
   public:
    using SinkBase::SinkBase;
    Status PlaceChunk(const WorkItem&, const image::DiskRange& from, std::optional<uint64_t>,
                      std::function<void(Status)> done) override {
      EXPECT_EQ(from.length, kChunk);
      done(Status::Ok());
      return Status::Ok();
    }
    void OnChunkRead(const WorkItem& item, Result<LoadedChunk> chunk) override {
      EXPECT_TRUE(chunk.ok() && chunk->placed) << "a chunk went as bytes";
      std::lock_guard lock(mu_);
      ++placed_;
      cv_.notify_all();
      dispatcher_->Done(item, 0);
    }
    bool AllPlaced() {
      std::unique_lock lock(mu_);
      return cv_.wait_for(lock, 10s, [&] { return placed_ == kChunks; });
    }
    std::mutex mu_;
    std::condition_variable cv_;
    uint32_t placed_ = 0;
  };
  for (const bool resident : {true, false}) {
    SCOPED_TRACE(resident ? "resident" : "read from the file");
    Dispatcher dispatcher(OneThreadALane(/*read_ahead=*/4));
    dispatcher.SetPlacedSourcesResident(resident);
    auto sink = std::make_shared<PlacingSink>(*source_, &dispatcher);
    dispatcher.AddSession(1, layout_, sink);
    dispatcher.Update([&](Scheduler& s) {
      ASSERT_TRUE(s.StreamAll(1, Delivery::kPlaced).ok());
      s.AddCredit(1, 1 << 30);
    });
    ASSERT_TRUE(sink->AllPlaced());
    dispatcher.Stop();
    if (resident) {
      EXPECT_EQ(dispatcher.lanes().read_ahead_hints, 0u);
    } else {
      // Every chunk but the first (read before any hint), once.
      EXPECT_EQ(dispatcher.lanes().read_ahead_hints, kChunks - 1);
    }
  }
}

// A demand chunk that goes out from the page cache (cached, checksum known, a connection that
// may sendfile) is served on the thread that picks it, not after a hop to the demand lane's
// disk thread and back: a fault waits for no other thread. One that must be read still goes
// to the disk thread.
TEST_F(DispatcherTest, CachedDemandChunksAreServedWhereTheyArePicked) {
  class RecordingSink : public SinkBase {
   public:
    using SinkBase::SinkBase;
    void OnChunkRead(const WorkItem& item, Result<LoadedChunk> chunk) override {
      {
        std::lock_guard lock(mu_);
        EXPECT_TRUE(chunk.ok()) << chunk.status().ToString();
        served_.push_back({std::this_thread::get_id(), chunk.ok() && chunk->from_file});
        cv_.notify_all();
      }
      const uint32_t sent = chunk.ok() ? chunk->info.stored_length : 0;
      chunk = Result<LoadedChunk>(Internal("dropped"));
      dispatcher_->Done(item, sent);
    }
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<std::pair<std::thread::id, bool>> served_;  // thread, from the file
  };
  Dispatcher dispatcher(OneThreadALane(/*read_ahead=*/0));
  auto sink = std::make_shared<RecordingSink>(*source_, &dispatcher);
  dispatcher.AddSession(1, layout_, sink);
  auto demand = [&](uint32_t chunk, bool sends_from_files) {
    sink->sends_from_files_ = sends_from_files;
    google::protobuf::RepeatedPtrField<wire::ChunkRange> ranges;
    wire::ChunkRange* range = ranges.Add();
    range->set_bo(0);
    range->set_first_chunk(chunk);
    range->set_chunk_count(1);
    Status enqueued = dispatcher.Update([&](Scheduler& s) {
      return s.Enqueue(1, wire::PRIORITY_DEMAND, Output::kDemand, chunk + 1, ranges, Clock::now());
    });
    EXPECT_TRUE(enqueued.ok()) << enqueued.ToString();
    std::unique_lock lock(sink->mu_);
    EXPECT_TRUE(sink->cv_.wait_for(lock, 10s, [&] { return !sink->served_.empty(); }));
    auto served = sink->served_.empty() ? std::pair<std::thread::id, bool>{} : sink->served_.back();
    sink->served_.clear();
    lock.unlock();
    // The sink hears of the chunk before the disk thread gives its demand slot back; a demand
    // made in between would wait for that slot and be served by the disk thread's own pump.
    const auto deadline = Clock::now() + 10s;
    while (dispatcher.lanes().demand_in_flight != 0 && Clock::now() < deadline)
      std::this_thread::sleep_for(1ms);
    EXPECT_EQ(dispatcher.lanes().demand_in_flight, 0u);
    return served;
  };
  const std::thread::id here = std::this_thread::get_id();
  // Not hashed yet: read (and hashed) on the demand lane's thread.
  auto first = demand(1, true);
  EXPECT_NE(first.first, here);
  EXPECT_FALSE(first.second);
  // Now cached with a known checksum: served inside Update, on this thread, from the file.
  // Finished frees the demand slot before its own Pump, so that pump (on the disk thread) can
  // still pick a demand made right after the slot came back and serve it there, also from the
  // file. Hence a few tries: one must be served here, and every one from the file. Were cached
  // demand chunks posted to the disk thread, none would be served here.
  uint64_t demands = 1;
  int served_here = 0;
  for (int attempt = 0; attempt < 20 && served_here == 0; ++attempt) {
    auto second = demand(1, true);
    ++demands;
    EXPECT_TRUE(second.second) << "attempt " << attempt;
    if (second.first == here) ++served_here;
  }
  EXPECT_EQ(served_here, 1) << "a cached demand chunk went to a disk thread and back";
  // A connection that may not sendfile (TLS) has it read, on the disk thread.
  auto third = demand(1, false);
  ++demands;
  EXPECT_NE(third.first, here);
  EXPECT_FALSE(third.second);
  dispatcher.Stop();
  EXPECT_EQ(dispatcher.lanes().demand_reads, demands);
}

// Demand connections moving at the same instant spread over the demand loops: picking the least
// busy loop and counting the connection on it are one step. Each round, as many threads as
// loops claim one at once (released together); every round must put one on each loop (two
// picks that both saw a loop empty would stack there).
TEST(DemandLoopsTest, SimultaneousClaimsTakeOneLoopEach) {
  ServerContext ctx(ServerConfig{});
  constexpr int kLoops = 4;
  for (int i = 0; i < kLoops; ++i)
    ctx.demand_loops.emplace_back();
  std::atomic<int> round{0};
  std::atomic<int> arrived{0};
  std::vector<std::thread> threads;
  constexpr int kRounds = 2000;
  int stacked = 0;
  for (int t = 0; t < kLoops; ++t)
    threads.emplace_back([&] {
      for (int r = 1; r <= kRounds; ++r) {
        while (round.load() < r)  // released together
          std::this_thread::yield();
        EXPECT_NE(ctx.ClaimLeastBusyDemandLoop(), nullptr);
        arrived.fetch_add(1);
      }
    });
  for (int r = 1; r <= kRounds; ++r) {
    for (ServerContext::DemandLoop& loop : ctx.demand_loops)
      loop.connections.store(0);
    arrived.store(0);
    round.store(r);
    while (arrived.load() < kLoops)
      std::this_thread::yield();
    for (const ServerContext::DemandLoop& loop : ctx.demand_loops)
      if (loop.connections.load() != 1) {
        ++stacked;
        break;
      }
  }
  for (std::thread& thread : threads)
    thread.join();
  EXPECT_EQ(stacked, 0) << "rounds in which two claims landed on one loop";
  ServerContext none(ServerConfig{});
  EXPECT_EQ(none.ClaimLeastBusyDemandLoop(), nullptr);
}

}  // namespace
}  // namespace gpulazy::server
