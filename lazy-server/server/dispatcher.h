// Dispatcher: turns the Scheduler's picks into disk reads on a small thread pool, so a slow
// disk never blocks the network event loop, and hands each chunk read to its session's sink.
// It bounds the reads in flight server-wide; each finished read pumps the next pick, so the
// disk stays busy while sessions have work and credit. Before a read it hints the kernel
// (posix_fadvise WILLNEED) about the next few chunks that session will read.
//
// Thread-safety: every method may be called from any thread; one mutex guards the Scheduler.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include "lazy-server/image/image_source.h"
#include "lazy-server/server/scheduler.h"
#include "page-client/net/asio.h"

namespace gpulazy::server {

// Receives chunks read for a session (Session implements it). Called on a disk thread.
class ChunkSink {
 public:
  virtual ~ChunkSink() = default;
  virtual const image::ImageSource& source() const = 0;
  virtual void OnChunkRead(const WorkItem& item, Result<image::StoredChunk> chunk) = 0;
};

class Dispatcher {
 public:
  Dispatcher(SchedulerLimits limits, uint32_t disk_threads, uint32_t read_ahead);
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

  // The disk threads, also used for other slow work (opening images).
  boost::asio::thread_pool& pool() { return pool_; }
  // Starts reads while slots and eligible work remain.
  void Pump();
  // No new reads; waits for the disk threads.
  void Stop();

 private:
  struct Job {
    WorkItem item;
    std::weak_ptr<ChunkSink> sink;
    std::vector<manifest::ChunkRef> upcoming;
  };
  void Read(const Job& job);

  const uint32_t max_reads_;
  const uint32_t read_ahead_;
  mutable std::mutex mu_;
  Scheduler scheduler_;
  std::map<SessionId, std::weak_ptr<ChunkSink>> sinks_;
  uint32_t reads_in_flight_ = 0;
  bool stopped_ = false;
  boost::asio::thread_pool pool_;
};

}  // namespace gpulazy::server
