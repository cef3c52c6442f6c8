#include "page-client/local_restore.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>

#include "lazy-server/image/image_source.h"
#include "lazy-server/image/io.h"
#include "page-client/file_chunks.h"
#include "page-client/net/threads.h"
#include "page-client/residency.h"

namespace gpulazy::client {

namespace {

struct ChunkId {
  uint32_t bo = 0;
  uint32_t chunk = 0;
};

// A chunk whose bytes failed verification (a reader's check or the engine's) is read again this
// many times before the restore fails.
constexpr uint32_t kMaxRereads = 1;
// Buffers of ours kept for reuse (chunks the engine lends no memory for).
constexpr size_t kMaxSpareBuffers = 32;

}  // namespace

class LocalRestore::Impl {
 public:
  Impl(LocalRestoreOptions options, CopyEngine& engine)
      : options_(std::move(options)), engine_(engine), engine_gate_(!engine.ConcurrentCalls()) {}

  ~Impl() {
    Cancel();
    for (std::thread& reader : readers_)
      if (reader.joinable()) reader.join();
    // Writes the engine still holds own callbacks into this object: let them finish first.
    std::lock_guard engine_lock(engine_gate_);
    (void)engine_.Flush();
  }

  Status Start() {
    reader_count_ = WritersFor(options_.readers, engine_);
    GPULAZY_ASSIGN_OR_RETURN(image_,
                             image::ImageSource::Open(options_.image_dir, options_.raw_chunk_size));
    const manifest::Manifest& m = image_->manifest();
    std::vector<uint64_t> sizes;
    for (const manifest::Bo& bo : m.bos()) {
      BoEntry entry;
      entry.process_id = bo.process_id();
      entry.bo_index = bo.bo_index();
      entry.gpu_id = bo.gpu_id();
      entry.gpu_va = bo.gpu_va();
      entry.size = bo.size();
      entry.alloc_flags = bo.alloc_flags();
      entry.chunk_count = static_cast<uint32_t>(bo.chunks_size());
      bos_.push_back(entry);
      sizes.push_back(bo.size());
    }
    GPULAZY_ASSIGN_OR_RETURN(residency_, ResidencyMap::Create(m.chunk_size(), sizes));
    uint64_t total = 0;
    for (uint32_t bo = 0; bo < bos_.size(); ++bo) {
      // ImageSource validated the table; a mismatch here would be our own bug.
      if (residency_.chunk_count(bo) != bos_[bo].chunk_count)
        return Corrupt("{}: BO {} has {} chunks, its size needs {}", Name(), bo,
                       bos_[bo].chunk_count, residency_.chunk_count(bo));
      first_chunk_.push_back(total);
      total += bos_[bo].chunk_count;
    }
    // Writers first: an engine sizes its staging to them when it hears the chunk size.
    engine_.ExpectWriters(reader_count_);
    GPULAZY_RETURN_IF_ERROR(engine_.ExpectChunkBytes(m.chunk_size()));
    for (uint32_t bo = 0; bo < bos_.size(); ++bo)
      GPULAZY_RETURN_IF_ERROR(engine_.AddDestination(bo, bos_[bo].size));
    BuildOrder(m);
    readers_.reserve(reader_count_);
    for (uint32_t i = 0; i < reader_count_; ++i)
      readers_.emplace_back([this] {
        net::NameThisThread("gl-local-reader");  // for top -H and profiles
        ReadLoop();
      });
    return Status::Ok();
  }

  const std::vector<BoEntry>& bos() const { return bos_; }
  uint32_t chunk_size() const { return residency_.chunk_size(); }
  uint32_t readers() const { return reader_count_; }

  Status Ensure(uint32_t bo, uint64_t offset, uint64_t length,
                std::optional<std::chrono::milliseconds> timeout) {
    std::unique_lock lock(mu_);
    if (bo >= bos_.size()) return OutOfRange("{}: BO {} does not exist", Name(), bo);
    if (length == 0) return Status::Ok();
    GPULAZY_ASSIGN_OR_RETURN(ChunkRun run, residency_.Covering(bo, offset, length));
    bool queued = false;
    // In reverse, so the run's first chunk ends up first in the queue.
    for (uint32_t i = run.count; i-- > 0;) {
      const uint32_t chunk = run.first + i;
      if (residency_.held(bo, chunk) || residency_.demanded(bo, chunk)) continue;
      residency_.set_demanded(bo, chunk);
      demand_.push_front({bo, chunk});
      ++demand_chunks_;
      queued = true;
    }
    if (queued) work_.notify_all();
    return WaitFor(
        lock, [&] { return residency_.AllResident(run); }, timeout);
  }

  Status WaitHotSet(std::optional<std::chrono::milliseconds> timeout) {
    std::unique_lock lock(mu_);
    return WaitFor(
        lock, [&] { return hot_resident_ == hot_count_; }, timeout);
  }

  Status WaitComplete(std::optional<std::chrono::milliseconds> timeout) {
    std::unique_lock lock(mu_);
    return WaitFor(
        lock, [&] { return residency_.complete(); }, timeout);
  }

  bool IsResident(uint32_t bo, uint64_t offset, uint64_t length) const {
    std::lock_guard lock(mu_);
    if (bo >= bos_.size()) return false;
    if (length == 0) return true;
    Result<ChunkRun> run = residency_.Covering(bo, offset, length);
    return run.ok() && residency_.AllResident(*run);
  }

  Progress progress() const {
    std::lock_guard lock(mu_);
    Progress p;
    p.total_bytes = residency_.total_bytes();
    p.total_chunks = residency_.total_chunks();
    p.resident_bytes = residency_.resident_bytes();
    p.resident_chunks = residency_.resident_chunks();
    p.hot_chunks = hot_count_;
    p.hot_resident_chunks = hot_resident_;
    p.received_bytes = read_bytes_;
    p.demand_chunks = demand_chunks_;
    p.zero_filled_chunks = zero_filled_chunks_;
    p.zero_filled_bytes = zero_filled_bytes_;
    p.refetches = rereads_;
    p.file_read_s = file_times_.read_s();
    p.file_engine_s = file_times_.engine_s();
    p.file_gate_wait_s = file_times_.gate_wait_s();
    p.complete = residency_.complete();
    return p;
  }

  Status status() const {
    std::lock_guard lock(mu_);
    return status_;
  }

  void Cancel() {
    std::lock_guard lock(mu_);
    if (status_.ok() && !residency_.complete()) status_ = Aborted("{}: restore cancelled", Name());
    stopping_ = true;
    work_.notify_all();
    changed_.notify_all();
  }

 private:
  std::string Name() const { return options_.image_dir.string(); }

  template <typename Done>
  Status WaitFor(std::unique_lock<std::mutex>& lock, Done done,
                 std::optional<std::chrono::milliseconds> timeout) {
    auto finished = [&] { return done() || !status_.ok(); };
    if (timeout) {
      if (!changed_.wait_for(lock, *timeout, finished))
        return TimedOut("{}: not resident after {} ms", Name(), timeout->count());
    } else {
      changed_.wait(lock, finished);
    }
    return done() ? Status::Ok() : status_;
  }

  // The profile's order first (its first hot_count entries are the hot set), then every other
  // chunk in table order. Profile entries are untrusted: out-of-range or repeated ones are
  // skipped.
  void BuildOrder(const manifest::Manifest& m) {
    std::vector<uint8_t> listed(residency_.total_chunks(), 0);
    hot_.assign(residency_.total_chunks(), 0);
    const manifest::AccessProfile& profile = m.profile();
    for (int i = 0; i < profile.order_size(); ++i) {
      const manifest::ChunkRef& ref = profile.order(i);
      if (!residency_.CheckChunk(ref.bo(), ref.chunk()).ok()) continue;
      const uint64_t global = first_chunk_[ref.bo()] + ref.chunk();
      if (listed[global]) continue;
      listed[global] = 1;
      order_.push_back({ref.bo(), ref.chunk()});
      if (static_cast<uint32_t>(i) < profile.hot_count()) {
        hot_[global] = 1;
        ++hot_count_;
      }
    }
    for (uint32_t bo = 0; bo < bos_.size(); ++bo)
      for (uint32_t chunk = 0; chunk < bos_[bo].chunk_count; ++chunk)
        if (!listed[first_chunk_[bo] + chunk]) order_.push_back({bo, chunk});
  }

  struct Pick {
    ChunkId id;
    Urgency urgency;  // urgent: Ensure waits for it (its engine calls go first)
  };
  // Under mu_: the next chunk to read, marked landing; nullopt when there is nothing left.
  std::optional<Pick> NextChunk() {
    while (!demand_.empty()) {
      ChunkId id = demand_.front();
      demand_.pop_front();
      if (residency_.MarkLanding(id.bo, id.chunk)) return Pick{id, Urgency::kUrgent};
    }
    while (next_ < order_.size()) {
      ChunkId id = order_[next_++];
      if (residency_.MarkLanding(id.bo, id.chunk)) return Pick{id, Urgency::kBackground};
    }
    return std::nullopt;
  }

  void ReadLoop() {
    std::vector<uint8_t> scratch;
    while (true) {
      Pick pick;
      {
        std::unique_lock lock(mu_);
        std::optional<Pick> next;
        work_.wait(lock, [&] {
          if (stopping_ || !status_.ok()) return true;
          next = NextChunk();
          return next.has_value();
        });
        if (!next) return;
        pick = *next;
      }
      if (Status s = Restore(pick.id, pick.urgency, scratch); !s.ok()) {
        Fail(s);
        return;
      }
    }
  }

  // Reads one chunk into the engine's buffer (or a buffer of ours), verifies it and hands it
  // to the engine. Bytes that fail verification, here or in the engine, send the chunk back to
  // the queue (ReadAgainOrFail); any other failure leaves it missing and fails the restore.
  Status Restore(ChunkId id, Urgency urgency, std::vector<uint8_t>& scratch) {
    const manifest::Chunk& stored =
        image_->manifest().bos(static_cast<int>(id.bo)).chunks(static_cast<int>(id.chunk));
    GPULAZY_ASSIGN_OR_RETURN(image::DiskRange range, image_->LocateChunk(id.bo, id.chunk));
    FileChunk c;
    c.bo = id.bo;
    c.chunk = id.chunk;
    c.dest_offset = residency_.ChunkOffset(id.chunk);
    c.raw_length = residency_.ChunkLength(id.bo, id.chunk);
    c.codec = stored.codec();
    // A CRIU checkpoint records no checksums.
    if (image_->is_lazy()) c.checksum = stored.checksum();
    c.fd = range.fd;
    c.file_offset = range.offset;
    c.stored_length = static_cast<uint32_t>(range.length);
    const std::string what = fmt::format("{}: BO {} chunk {}", Name(), id.bo, id.chunk);
    if (stored.raw_length() != c.raw_length) {
      std::lock_guard lock(mu_);
      residency_.ClearLanding(id.bo, id.chunk);
      return Corrupt("{}: raw length {} but the BO needs {}", what, stored.raw_length(),
                     c.raw_length);
    }
    uint64_t read = 0;
    Status s = InstallFileChunk(
        engine_, engine_gate_, urgency, c, buffers_, scratch, what,
        [this, id, length = c.raw_length, zeroed = EngineZeroesChunk(engine_, c)](
            const Status& status) { OnWritten(id, length, zeroed, status); },
        &read, &file_times_);
    Count(read);
    if (s.ok()) return s;
    std::lock_guard lock(mu_);
    if (s.code() == Code::kCorrupt) {
      ReadAgainOrFail(id, s.message());
      return Status::Ok();  // queued again, or status_ says why not
    }
    residency_.ClearLanding(id.bo, id.chunk);
    return s;
  }

  // Under mu_: chunk `id` (landing) failed verification, found by a reader (`why` names the
  // chunk) or by the engine. One mechanism for both, so a chunk is read at most kMaxRereads
  // times more however its copies went bad: it goes back to the front of the queue, or, past
  // that, the restore fails naming it. Either way it stays missing.
  void ReadAgainOrFail(ChunkId id, std::string_view why) {
    if (!residency_.ClearLanding(id.bo, id.chunk)) return;  // not ours to read again
    if (stopping_ || !status_.ok()) return;
    if (residency_.CountBadCopy(id.bo, id.chunk) <= kMaxRereads) {
      spdlog::warn("{}; reading it again", why);
      ++rereads_;
      demand_.push_front(id);
      work_.notify_one();
      return;
    }
    status_ = Corrupt("{} (read {} times)", why, kMaxRereads + 1);
    spdlog::error("local restore failed: {}", status_.message());
    work_.notify_all();
    changed_.notify_all();
  }

  void Count(uint64_t bytes) {
    std::lock_guard lock(mu_);
    read_bytes_ += bytes;
  }

  // `zeroed`: the engine zeroed the chunk itself (EngineZeroesChunk), no bytes read for it.
  void OnWritten(ChunkId id, uint32_t length, bool zeroed, const Status& status) {
    std::lock_guard lock(mu_);
    if (status.code() == Code::kCorrupt) {
      // The engine verified the bytes itself (CopyEngine::VerifiesChunks) and they did not match.
      ReadAgainOrFail(
          id, fmt::format("{}: BO {} chunk {}: {}", Name(), id.bo, id.chunk, status.message()));
    } else if (!status.ok()) {
      residency_.ClearLanding(id.bo, id.chunk);
      if (status_.ok())
        status_ = Status(status.code(), fmt::format("{}: BO {} chunk {} ({} bytes): {}", Name(),
                                                    id.bo, id.chunk, length, status.message()));
      work_.notify_all();
    } else if (residency_.MarkResident(id.bo, id.chunk)) {
      if (hot_[first_chunk_[id.bo] + id.chunk]) ++hot_resident_;
      if (zeroed) {
        ++zero_filled_chunks_;
        zero_filled_bytes_ += length;
      }
    }
    changed_.notify_all();
  }

  void Fail(const Status& status) {
    std::lock_guard lock(mu_);
    if (status_.ok()) status_ = status;
    spdlog::error("local restore failed: {}", status.message());
    work_.notify_all();
    changed_.notify_all();
  }

  const LocalRestoreOptions options_;
  CopyEngine& engine_;
  uint32_t reader_count_ = 0;  // set by Start: options_.readers, or the engine's preference
  std::shared_ptr<const image::ImageSource> image_;
  std::vector<BoEntry> bos_;
  std::vector<uint64_t> first_chunk_;  // global index of each BO's chunk 0
  std::vector<ChunkId> order_;         // immutable after Start
  std::vector<uint8_t> hot_;           // by global chunk index; immutable after Start
  uint64_t hot_count_ = 0;

  // Engine calls are serialized (InstallFileChunk says why ReceiveTarget is too), unless the
  // engine takes concurrent calls (CopyEngine::ConcurrentCalls), as in RestoreSession; reads are
  // never serialized.
  EngineGate engine_gate_;
  ChunkBufferPool buffers_{kMaxSpareBuffers};

  mutable std::mutex mu_;
  std::condition_variable work_;     // readers: demand queued, stopping, failed
  std::condition_variable changed_;  // waiters: residency or status changed
  ResidencyMap residency_;
  std::deque<ChunkId> demand_;
  size_t next_ = 0;  // next entry of order_
  uint64_t hot_resident_ = 0;
  uint64_t read_bytes_ = 0;
  FileReadTimes file_times_;  // the readers' (Progress::file_read_s); Ensure only queues
  uint64_t demand_chunks_ = 0;
  uint64_t zero_filled_chunks_ = 0;  // installed by the engine zeroing them (none read)
  uint64_t zero_filled_bytes_ = 0;
  uint64_t rereads_ = 0;
  bool stopping_ = false;
  Status status_;
  std::vector<std::thread> readers_;
};

LocalRestore::LocalRestore(LocalRestoreOptions options, CopyEngine& engine)
    : impl_(std::make_unique<Impl>(std::move(options), engine)) {}
LocalRestore::~LocalRestore() = default;
Status LocalRestore::Start() {
  return impl_->Start();
}
const std::vector<BoEntry>& LocalRestore::bos() const {
  return impl_->bos();
}
uint32_t LocalRestore::chunk_size() const {
  return impl_->chunk_size();
}
uint32_t LocalRestore::readers() const {
  return impl_->readers();
}
Status LocalRestore::Ensure(uint32_t bo, uint64_t offset, uint64_t length,
                            std::optional<std::chrono::milliseconds> timeout) {
  return impl_->Ensure(bo, offset, length, timeout);
}
Status LocalRestore::WaitHotSet(std::optional<std::chrono::milliseconds> timeout) {
  return impl_->WaitHotSet(timeout);
}
Status LocalRestore::WaitComplete(std::optional<std::chrono::milliseconds> timeout) {
  return impl_->WaitComplete(timeout);
}
bool LocalRestore::IsResident(uint32_t bo, uint64_t offset, uint64_t length) const {
  return impl_->IsResident(bo, offset, length);
}
Progress LocalRestore::progress() const {
  return impl_->progress();
}
Status LocalRestore::status() const {
  return impl_->status();
}
void LocalRestore::Cancel() {
  impl_->Cancel();
}

}  // namespace gpulazy::client
