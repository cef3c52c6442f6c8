// Dispatcher: turns the Scheduler's picks into disk reads on thread pools, so a slow disk never
// blocks the network event loop, and hands each chunk read to its session's sink.
//
// Two lanes. Demand items are read in a lane of their own (`demand_threads` threads, one read
// in flight per thread, filled first), so a demand read starts as soon as it is scheduled and
// never queues behind background reads. Everything else goes to the bulk lane (`disk_threads`
// threads, two reads in flight per thread server-wide). Each finished read pumps the next
// picks, so the disk stays busy while sessions have work and credit. Before a bulk read it
// hints the kernel (posix_fadvise WILLNEED) about the next few chunks that session will read.
// A placed chunk goes to the session's placement on a disk thread, and its slot is free as soon
// as it is queued there (the placement delivers it when done).
// A chunk sent by reference (the client reads it from the files it holds) needs no read: it is
// located and handed to its sink on the thread that picked it, with no hints. So is a demand
// chunk the connection sends from the page cache (cached bytes, known checksum: sendfile).
//
// Chunks are read into buffers of a bounded ChunkBufferPool (buffer_pool.h); a LoadedChunk
// holds its buffer until the chunk is written or dropped.
//
// Thread-safety: every method may be called from any thread; one mutex guards the Scheduler.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>

#include "lazy-server/image/image_source.h"
#include "lazy-server/server/buffer_pool.h"
#include "lazy-server/server/scheduler.h"
#include "page-client/net/asio.h"

namespace gpulazy::server {

// One chunk read for a session: what the image says about it and its stored bytes, in a buffer
// from the pool (returned when this is destroyed).
// A chunk sent by reference has no buffer (info.stored_length 0): in_file says where the
// client reads its stored bytes, and has_checksum whether the checksum is known yet.
// A chunk sent from the page cache has no buffer either: its info.stored_length bytes travel
// on the wire, but the kernel takes them from from_file (sendfile), never read by us.
// A placed chunk has neither: the server wrote its raw bytes into the client's destination.
struct LoadedChunk {
  image::ChunkInfo info;
  ChunkBuffer buffer;
  std::optional<image::DiskRange> in_file;
  std::optional<image::DiskRange> from_file;
  bool has_checksum = true;
  bool placed = false;
  std::span<const uint8_t> bytes() const {
    return from_file ? std::span<const uint8_t>() : buffer.span().first(info.stored_length);
  }
};

// Receives chunks read for a session (Session implements it). Called on a disk thread, or for
// a by-reference chunk on whichever thread pumped (never with a Dispatcher lock held).
class ChunkSink {
 public:
  virtual ~ChunkSink() = default;
  virtual const image::ImageSource& source() const = 0;
  virtual void OnChunkRead(const WorkItem& item, Result<LoadedChunk> chunk) = 0;
  // The connection `item` goes out on may send its bytes straight from the image file
  // (LoadedChunk::from_file): a plain (not TLS) socket, and the server allows it.
  virtual bool SendsFromFiles(const WorkItem& item) const = 0;
  // A placed item (WorkItem::placed): writes the RAW chunk stored at `from` into the session's
  // destination, checked against `checksum` when there is one, and calls `done` once it is
  // there (Ok) or will not be (an error: the chunk then goes as bytes). An error return: nothing
  // was queued, `done` never runs, and the chunk goes as bytes.
  virtual Status PlaceChunk(const WorkItem& item, const image::DiskRange& from,
                            std::optional<uint64_t> checksum,
                            std::function<void(Status)> done) {  // NOLINT(performance-*)
    (void)item, (void)from, (void)checksum, (void)done;
    return Unsupported("this session places nothing");
  }
};

struct DispatcherOptions {
  SchedulerLimits limits;
  uint32_t disk_threads = 4;       // bulk lane (prefetch, background; also opening images)
  uint32_t demand_threads = 2;     // demand lane
  uint32_t read_ahead = 4;         // chunks hinted ahead of each bulk read
  int background_nice = 0;         // added to the bulk lane threads' nice value
  size_t buffer_bytes = 4u << 20;  // capacity of a pooled chunk buffer
  size_t pooled_buffers = 32;      // idle chunk buffers kept for reuse
};

class Dispatcher {
 public:
  explicit Dispatcher(const DispatcherOptions& options);
  ~Dispatcher();  // stops and joins the disk threads

  void AddSession(SessionId id, std::shared_ptr<const ImageLayout> layout,
                  std::weak_ptr<ChunkSink> sink);
  void RemoveSession(SessionId id);

  // Runs f(scheduler) under the lock, then pumps reads. Returns f's result.
  template <typename F>
  auto Update(F&& f) {
    struct PumpAfter {
      Dispatcher* d;
      ~PumpAfter() { d->Pump(); }
    } pump{this};
    std::lock_guard lock(mu_);
    return f(scheduler_);
  }
  // A picked chunk is finished (written: sent_payload set; dropped: nullopt). Returns the
  // session's StreamDone totals when this completed its stream_all.
  std::optional<StreamDoneInfo> Done(const WorkItem& item, std::optional<uint32_t> sent_payload);
  bool TakeCredit(SessionId id, uint64_t bytes);
  std::optional<Scheduler::SessionCounters> Counters(SessionId id) const;

  // The bulk lane's disk threads, also used for other slow work (opening images).
  boost::asio::thread_pool& pool() { return pool_; }
  const ChunkBufferPool& buffers() const { return buffers_; }
  struct LaneCounters {
    uint64_t demand_reads = 0;  // reads done in the demand lane
    uint64_t bulk_reads = 0;    // reads done in the bulk lane
    uint32_t demand_in_flight = 0;
    uint32_t bulk_in_flight = 0;
    uint64_t read_ahead_hints = 0;  // POSIX_FADV_WILLNEED calls made
  };
  LaneCounters lanes() const;
  // A placed chunk is copied from memory the placement backend keeps resident (the cuda
  // backend's registered page cache): no read-ahead hint serves it or the placed chunks after
  // it. Set before serving.
  void SetPlacedSourcesResident(bool resident);
  // Starts reads while slots and eligible work remain.
  void Pump();
  // No new reads; waits for the disk threads.
  void Stop();

 private:
  enum class Lane : uint8_t { kDemand, kBulk };
  struct Job {
    WorkItem item;
    Lane lane = Lane::kBulk;
    std::weak_ptr<ChunkSink> sink;
    std::vector<manifest::ChunkRef> upcoming;
    // The page cache was asked already, on the thread that picked it (ServeFromCacheHere): the
    // chunk is to be read, not asked about again.
    bool cache_probed = false;
  };
  Job MakeJob(const WorkItem& item, Lane lane);  // mu_ held
  void Read(const Job& job);
  // The chunk's stored bytes in a pooled buffer.
  Result<LoadedChunk> ReadInto(const image::ImageSource& source, const WorkItem& item,
                               bool from_file_allowed);
  Result<LoadedChunk> Locate(const image::ImageSource& source, const WorkItem& item);
  // The chunk as sent from the page cache (from_file), if its bytes are cached and its checksum
  // known; nullopt when it must be read.
  std::optional<LoadedChunk> FromCache(const image::ImageSource& source, const WorkItem& item,
                                       uint32_t length);
  // A demand job whose chunk goes out from the page cache: served on this thread (true).
  // Otherwise the job is marked cache_probed and goes to a disk thread.
  bool ServeFromCacheHere(Job& job);
  // A placed job: hands the chunk to the sink for placement and frees the job's slot at once
  // (the placement's completion delivers it). False: it cannot be placed (stored compressed or
  // empty, no destination, the device refused), so it is to be read and sent as bytes.
  bool TryPlace(const Job& job, const std::shared_ptr<ChunkSink>& sink);
  // Counts the read and hands the chunk to its sink; then the job's slot is free.
  void Deliver(const Job& job, ChunkSink& sink, Result<LoadedChunk> chunk);
  // A read of `lane` finished (or was skipped): frees its slot and pumps.
  void Finished(Lane lane);

  const uint32_t max_reads_;         // bulk lane
  const uint32_t max_demand_reads_;  // demand lane
  const uint32_t read_ahead_;
  ChunkBufferPool buffers_;
  mutable std::mutex mu_;
  Scheduler scheduler_;
  std::map<SessionId, std::weak_ptr<ChunkSink>> sinks_;
  // Per session, the chunks hinted last (oldest first, at most kHintMemory of them): each read
  // hints the next read_ahead chunks, so without it every chunk would be hinted read_ahead
  // times, each a walk over its pages in the page cache.
  std::map<SessionId, std::deque<uint64_t>> hinted_;
  // Chunks a hint is remembered for, in multiples of read_ahead: a demand read or a requeue can
  // reorder the plan a little without a chunk's hint being repeated.
  static constexpr uint32_t kHintMemory = 4;
  uint32_t reads_in_flight_ = 0;
  uint32_t demand_reads_in_flight_ = 0;
  uint64_t bulk_reads_ = 0;
  uint64_t demand_reads_ = 0;
  std::atomic<uint64_t> read_ahead_hints_{0};
  bool placed_sources_resident_ = false;
  bool stopped_ = false;
  boost::asio::thread_pool pool_;
  boost::asio::thread_pool demand_pool_;
};

}  // namespace gpulazy::server
