#include "lazy-server/server/dispatcher.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "page-client/net/threads.h"

namespace gpulazy::server {

Dispatcher::Dispatcher(const DispatcherOptions& options)
    // Two reads per bulk thread keep each thread busy while its last result is handed over.
    : max_reads_(options.disk_threads * 2),
      // One per demand thread: a demand read never waits in a pool's queue.
      max_demand_reads_(options.demand_threads),
      read_ahead_(options.read_ahead),
      buffers_(options.buffer_bytes, options.pooled_buffers),
      scheduler_(options.limits),
      pool_(options.disk_threads),
      demand_pool_(options.demand_threads) {
  // Named for top -H and the tests; the bulk lane made nicer (best effort: it reads anyway).
  net::RunOnEachPoolThread(pool_, options.disk_threads, [&options] {
    net::NameThisThread("gl-disk");
    Status lowered = net::LowerThisThreadPriority(options.background_nice);
    if (!lowered.ok()) spdlog::warn("a disk thread keeps its priority: {}", lowered.message());
  });
  net::RunOnEachPoolThread(demand_pool_, options.demand_threads,
                           [] { net::NameThisThread("gl-demand-disk"); });
}

Dispatcher::~Dispatcher() {
  Stop();
}

void Dispatcher::AddSession(SessionId id, std::shared_ptr<const ImageLayout> layout,
                            std::weak_ptr<ChunkSink> sink) {
  std::lock_guard lock(mu_);
  scheduler_.AddSession(id, std::move(layout));
  sinks_[id] = std::move(sink);
}

void Dispatcher::RemoveSession(SessionId id) {
  std::lock_guard lock(mu_);
  scheduler_.RemoveSession(id);
  sinks_.erase(id);
  hinted_.erase(id);
}

std::optional<StreamDoneInfo> Dispatcher::Done(const WorkItem& item,
                                               std::optional<uint32_t> sent_payload) {
  std::optional<StreamDoneInfo> done;
  {
    std::lock_guard lock(mu_);
    scheduler_.Done(item, sent_payload);
    if (item.from_stream_all) done = scheduler_.TakeStreamDone(item.session);
  }
  Pump();  // a slot or credit came back
  return done;
}

bool Dispatcher::TakeCredit(SessionId id, uint64_t bytes) {
  std::lock_guard lock(mu_);
  return scheduler_.TakeCredit(id, bytes);
}

std::optional<Scheduler::SessionCounters> Dispatcher::Counters(SessionId id) const {
  std::lock_guard lock(mu_);
  return scheduler_.Counters(id);
}

Dispatcher::LaneCounters Dispatcher::lanes() const {
  std::lock_guard lock(mu_);
  return LaneCounters{demand_reads_, bulk_reads_, demand_reads_in_flight_, reads_in_flight_,
                      read_ahead_hints_.load(std::memory_order_relaxed)};
}

void Dispatcher::SetPlacedSourcesResident(bool resident) {
  std::lock_guard lock(mu_);
  placed_sources_resident_ = resident;
}

Dispatcher::Job Dispatcher::MakeJob(const WorkItem& item, Lane lane) {
  Job job;
  job.item = item;
  job.lane = lane;
  auto sink = sinks_.find(item.session);
  if (sink != sinks_.end()) job.sink = sink->second;
  // Hints only ahead of bulk reads of ours: a demand read should start at once, and the chunks
  // the session reads next are bulk ones anyway. A client reading by reference does its own
  // reads (and the kernel its read-ahead for them). A session placed from resident memory reads
  // nothing: there a hint is a walk over cached pages for nothing, which took the cuda
  // placement's disk threads from 0.026 to 0.15-0.16 CPU-s a 4 GiB stream (docs/benchmarks.md,
  // "Session 45").
  const bool reads_nothing = item.placed && placed_sources_resident_;
  if (lane == Lane::kBulk && read_ahead_ > 0 && !item.by_reference && !reads_nothing) {
    std::deque<uint64_t>& hinted = hinted_[item.session];
    for (manifest::ChunkRef& ref : scheduler_.Upcoming(item.session, read_ahead_)) {
      const uint64_t key = (uint64_t{ref.bo()} << 32) | ref.chunk();
      if (std::find(hinted.begin(), hinted.end(), key) != hinted.end()) continue;
      hinted.push_back(key);
      if (hinted.size() > size_t{kHintMemory} * read_ahead_) hinted.pop_front();
      job.upcoming.push_back(std::move(ref));
    }
  }
  return job;
}

void Dispatcher::Pump() {
  // A by-reference item is served right here (finding where its bytes lie is a table lookup),
  // and serving one frees its slot, which may pump again from inside: this thread's outer call
  // then loops instead of recursing.
  thread_local const Dispatcher* pumping = nullptr;
  thread_local bool again = false;
  if (pumping == this) {
    again = true;
    return;
  }
  // Another dispatcher's pump may be under way further up this thread: its state comes back
  // however this one ends.
  struct Restore {
    const Dispatcher* outer_pumping;
    bool outer_again;
    ~Restore() {
      pumping = outer_pumping;
      again = outer_again;
    }
  } restore{std::exchange(pumping, this), std::exchange(again, false)};
  do {
    again = false;
    std::vector<Job> jobs;
    {
      std::lock_guard lock(mu_);
      // Demand first, in its own lane: free demand slots never wait for bulk ones.
      while (!stopped_ && demand_reads_in_flight_ < max_demand_reads_) {
        std::optional<WorkItem> item = scheduler_.Next(Scheduler::Pick::kDemandOnly);
        if (!item) break;
        ++demand_reads_in_flight_;
        jobs.push_back(MakeJob(*item, Lane::kDemand));
      }
      while (!stopped_ && reads_in_flight_ < max_reads_) {
        std::optional<WorkItem> item = scheduler_.Next(Scheduler::Pick::kNoDemand);
        if (!item) break;
        ++reads_in_flight_;
        jobs.push_back(MakeJob(*item, Lane::kBulk));
      }
    }
    for (Job& job : jobs) {
      if (job.item.by_reference) {
        // Two thread hops (to a disk thread and back to the network) per chunk were what a
        // by-reference stream paid for nothing: measured in docs/benchmarks.md.
        Read(job);
        continue;
      }
      // A demand chunk that goes out from the page cache (sendfile) has nothing to read either:
      // a fault then waits for no disk thread (docs/benchmarks.md, session 9). Not a placed one:
      // it goes through TryPlace, which places it, or makes it wait for its placement in
      // flight. Sent as bytes from here it could reach the client, and be changed there, before
      // that placement lands on top of it (docs/protocol.md, "Placement").
      if (job.lane == Lane::kDemand && !job.item.placed && ServeFromCacheHere(job)) continue;
      boost::asio::thread_pool& lane = job.lane == Lane::kDemand ? demand_pool_ : pool_;
      boost::asio::post(lane, [this, job = std::move(job)] { Read(job); });
    }
  } while (again);
}

void Dispatcher::Finished(Lane lane) {
  {
    std::lock_guard lock(mu_);
    if (lane == Lane::kDemand)
      --demand_reads_in_flight_;
    else
      --reads_in_flight_;
  }
  Pump();
}

void Dispatcher::Read(const Job& job) {
  std::shared_ptr<ChunkSink> sink = job.sink.lock();
  if (!sink) {
    {
      std::lock_guard lock(mu_);
      scheduler_.Done(job.item, std::nullopt);
    }
    Finished(job.lane);
    return;
  }
  const image::ImageSource& source = sink->source();
  // Hints are best effort: a failed fadvise costs nothing but the read-ahead.
  for (const manifest::ChunkRef& ref : job.upcoming) {
    Result<image::ImageSource::DiskRange> range = source.LocateChunk(ref.bo(), ref.chunk());
    if (range.ok() && range->fd >= 0 && range->length > 0) {
      ::posix_fadvise(range->fd, static_cast<off_t>(range->offset),
                      static_cast<off_t>(range->length), POSIX_FADV_WILLNEED);
      read_ahead_hints_.fetch_add(1, std::memory_order_relaxed);
    }
  }
  if (job.item.placed && TryPlace(job, sink)) return;
  Result<LoadedChunk> chunk =
      job.item.by_reference
          ? Locate(source, job.item)
          : ReadInto(source, job.item, sink->SendsFromFiles(job.item) && !job.cache_probed);
  Deliver(job, *sink, std::move(chunk));
}

bool Dispatcher::TryPlace(const Job& job, const std::shared_ptr<ChunkSink>& sink) {
  const image::ImageSource& source = sink->source();
  Result<LoadedChunk> located = Locate(source, job.item);
  // Only RAW chunks: the bytes placed are the bytes stored (no device decompresses them).
  if (!located.ok() || !located->in_file || located->info.codec != manifest::CODEC_RAW ||
      located->in_file->length == 0 || located->in_file->length != located->info.raw_length)
    return false;
  const image::DiskRange from = *located->in_file;
  std::optional<uint64_t> checksum;
  if (located->has_checksum) checksum = located->info.checksum;
  const WorkItem item = job.item;
  Status queued = sink->PlaceChunk(
      item, from, checksum,
      [this, item, sink, info = located->info,
       has_checksum = located->has_checksum](const Status& status) {
        if (status.ok()) {
          LoadedChunk placed;
          placed.info = info;
          placed.has_checksum = has_checksum;
          placed.placed = true;
          sink->OnChunkRead(item, std::move(placed));
          return;
        }
        // Not placed, and nothing written (a mismatch), or a device that failed: the chunk goes
        // as bytes, which the client checks itself and asks for again if they are bad.
        // (Aborted: the client let its destinations go, ending the session: no news.)
        spdlog::log(status.code() == Code::kAborted ? spdlog::level::debug : spdlog::level::warn,
                    "BO {} chunk {} of session {} not placed ({}); sending its bytes", item.bo,
                    item.chunk, item.session, status.ToString());
        sink->OnChunkRead(item, ReadInto(sink->source(), item, /*from_file_allowed=*/false));
      });
  if (!queued.ok()) {
    spdlog::debug("BO {} chunk {} of session {} goes as bytes: {}", item.bo, item.chunk,
                  item.session, queued.ToString());
    return false;
  }
  {
    std::lock_guard lock(mu_);
    ++(job.lane == Lane::kDemand ? demand_reads_ : bulk_reads_);
  }
  Finished(job.lane);
  return true;
}

void Dispatcher::Deliver(const Job& job, ChunkSink& sink, Result<LoadedChunk> chunk) {
  // Counted before the sink sees it: once a chunk can have been sent, its read is in lanes().
  {
    std::lock_guard lock(mu_);
    ++(job.lane == Lane::kDemand ? demand_reads_ : bulk_reads_);
  }
  sink.OnChunkRead(job.item, std::move(chunk));
  Finished(job.lane);
}

bool Dispatcher::ServeFromCacheHere(Job& job) {
  std::shared_ptr<ChunkSink> sink = job.sink.lock();
  if (!sink || !sink->SendsFromFiles(job.item)) return false;
  Result<uint32_t> length = sink->source().StoredLength(job.item.bo, job.item.chunk);
  if (!length.ok()) return false;  // the disk thread reports it
  std::optional<LoadedChunk> cached = FromCache(sink->source(), job.item, *length);
  job.cache_probed = true;
  if (!cached) return false;
  Deliver(job, *sink, std::move(*cached));
  return true;
}

std::optional<LoadedChunk> Dispatcher::FromCache(const image::ImageSource& source,
                                                 const WorkItem& item, uint32_t length) {
  // Cached bytes whose checksum is known need not pass through us: the connection sends them
  // from the file (sendfile), which spares the copy into a buffer and the copy out of it. A
  // plain checkpoint's chunk is read once anyway, to hash it; bytes not in the page cache are
  // read on a disk thread, since a network thread must never wait for the disk.
  if (length == 0) return std::nullopt;
  Result<LoadedChunk> located = Locate(source, item);
  if (!located.ok() || !located->has_checksum || !located->in_file ||
      located->in_file->length != length || !source.InPageCache(*located->in_file))
    return std::nullopt;
  located->info.stored_length = length;
  located->from_file = std::exchange(located->in_file, std::nullopt);
  return std::move(located).value();
}

Result<LoadedChunk> Dispatcher::ReadInto(const image::ImageSource& source, const WorkItem& item,
                                         bool from_file_allowed) {
  GPULAZY_ASSIGN_OR_RETURN(uint32_t length, source.StoredLength(item.bo, item.chunk));
  if (from_file_allowed) {
    if (std::optional<LoadedChunk> cached = FromCache(source, item, length))
      return *std::move(cached);
  }
  LoadedChunk chunk;
  chunk.buffer = buffers_.Acquire(length);
  GPULAZY_ASSIGN_OR_RETURN(chunk.info,
                           source.ReadChunkInto(item.bo, item.chunk, chunk.buffer.span()));
  return chunk;
}

Result<LoadedChunk> Dispatcher::Locate(const image::ImageSource& source, const WorkItem& item) {
  // By reference the client reads the bytes itself: only say where they are (no buffer).
  GPULAZY_ASSIGN_OR_RETURN(image::StoredChunk located,
                           source.LocateStoredChunk(item.bo, item.chunk));
  LoadedChunk chunk;
  chunk.info.codec = located.codec;
  chunk.info.raw_length = located.raw_length;
  chunk.info.checksum = located.checksum;
  chunk.has_checksum = located.has_checksum;
  chunk.in_file = located.in_file;
  return chunk;
}

void Dispatcher::Stop() {
  {
    std::lock_guard lock(mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  demand_pool_.join();
  pool_.join();
}

}  // namespace gpulazy::server
