#include "lazy-server/server/dispatcher.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>

#include <vector>

namespace gpulazy::server {

Dispatcher::Dispatcher(SchedulerLimits limits, uint32_t disk_threads, uint32_t read_ahead)
    // Two reads per disk thread keep each thread busy while its last result is handed over.
    : max_reads_(disk_threads * 2),
      read_ahead_(read_ahead),
      scheduler_(limits),
      pool_(disk_threads) {}

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

void Dispatcher::Pump() {
  std::vector<Job> jobs;
  {
    std::lock_guard lock(mu_);
    while (!stopped_ && reads_in_flight_ < max_reads_) {
      std::optional<WorkItem> item = scheduler_.Next();
      if (!item) break;
      ++reads_in_flight_;
      Job job;
      job.item = *item;
      auto sink = sinks_.find(item->session);
      if (sink != sinks_.end()) job.sink = sink->second;
      if (read_ahead_ > 0) job.upcoming = scheduler_.Upcoming(item->session, read_ahead_);
      jobs.push_back(std::move(job));
    }
  }
  for (Job& job : jobs)
    boost::asio::post(pool_, [this, job = std::move(job)] { Read(job); });
}

void Dispatcher::Read(const Job& job) {
  std::shared_ptr<ChunkSink> sink = job.sink.lock();
  if (!sink) {
    {
      std::lock_guard lock(mu_);
      scheduler_.Done(job.item, std::nullopt);
      --reads_in_flight_;
    }
    Pump();
    return;
  }
  const image::ImageSource& source = sink->source();
  // Hints are best effort: a failed fadvise costs nothing but the read-ahead. (They help a
  // client reading by reference too: the page cache is shared.)
  for (const manifest::ChunkRef& ref : job.upcoming) {
    Result<image::ImageSource::DiskRange> range = source.LocateChunk(ref.bo(), ref.chunk());
    if (range.ok() && range->fd >= 0 && range->length > 0)
      ::posix_fadvise(range->fd, static_cast<off_t>(range->offset),
                      static_cast<off_t>(range->length), POSIX_FADV_WILLNEED);
  }
  // By reference the client reads the bytes itself: only say where they are.
  Result<image::StoredChunk> chunk = job.item.by_reference
                                         ? source.LocateStoredChunk(job.item.bo, job.item.chunk)
                                         : source.ReadChunk(job.item.bo, job.item.chunk);
  sink->OnChunkRead(job.item, std::move(chunk));
  {
    std::lock_guard lock(mu_);
    --reads_in_flight_;
  }
  Pump();
}

void Dispatcher::Stop() {
  {
    std::lock_guard lock(mu_);
    if (stopped_) return;
    stopped_ = true;
  }
  pool_.join();
}

}  // namespace gpulazy::server
