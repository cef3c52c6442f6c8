#include "page-client/file_chunks.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <utility>

#include "lazy-server/image/io.h"
#include "proto/checksum.h"
#include "proto/chunk_codec.h"

namespace gpulazy::client {

std::shared_ptr<std::vector<uint8_t>> ChunkBufferPool::Take(size_t length) {
  std::shared_ptr<std::vector<uint8_t>> buffer;
  {
    std::lock_guard lock(mu_);
    if (!spare_.empty()) {
      buffer = std::move(spare_.back());
      spare_.pop_back();
    }
  }
  if (!buffer) buffer = std::make_shared<std::vector<uint8_t>>();
  buffer->resize(length);
  return buffer;
}

void ChunkBufferPool::Return(std::shared_ptr<std::vector<uint8_t>> buffer) {
  std::lock_guard lock(mu_);
  if (spare_.size() < max_spare_) spare_.push_back(std::move(buffer));
}

namespace {

// Reads the chunk's stored bytes and leaves its verified raw bytes in `into`.
// engine_verifies: the engine checks the raw bytes itself (CopyEngine::VerifiesChunks), so
// they are read without hashing.
Status ReadInto(const FileChunk& c, std::span<uint8_t> into, bool engine_verifies,
                std::vector<uint8_t>& scratch, const std::string& what, uint64_t* bytes_read) {
  if (c.codec == manifest::CODEC_RAW) {
    if (c.stored_length != into.size())
      return Corrupt("{}: stored length {} but raw length {}", what, c.stored_length, into.size());
    // Straight from the page cache into the destination: no copy of ours in between.
    if (!c.checksum || engine_verifies) {
      GPULAZY_RETURN_IF_ERROR(ReadExactAt(c.fd, c.file_offset, into, what));
      if (bytes_read != nullptr) *bytes_read += into.size();
      return Status::Ok();
    }
    // Slice by slice, each hashed while the read has just left it in the cache: one pass over
    // the destination instead of two (the second would compete with the DMA for memory).
    Checksum64Stream hash;
    for (size_t done = 0; done < into.size();) {
      const std::span<uint8_t> slice =
          into.subspan(done, std::min(kChecksumSliceBytes, into.size() - done));
      GPULAZY_RETURN_IF_ERROR(ReadExactAt(c.fd, c.file_offset + done, slice, what));
      hash.Update(slice);
      done += slice.size();
    }
    if (bytes_read != nullptr) *bytes_read += into.size();
    if (hash.Digest() != *c.checksum) return Corrupt("{}: checksum mismatch", what);
    return Status::Ok();
  }
  if (!c.checksum) return Corrupt("{}: an encoded chunk without a checksum", what);
  scratch.resize(c.stored_length);
  if (!scratch.empty()) GPULAZY_RETURN_IF_ERROR(ReadExactAt(c.fd, c.file_offset, scratch, what));
  if (bytes_read != nullptr) *bytes_read += scratch.size();
  return DecodeChunkBytes(c.codec, *c.checksum, scratch, into, what);
}

// Adds the time since it was made, or since the last Lap, to one of FileReadTimes' counters.
class Stopwatch {
 public:
  explicit Stopwatch(FileReadTimes* times) : times_(times) {
    if (times_ != nullptr) last_ = std::chrono::steady_clock::now();
  }
  // Where an EngineHold adds its wait at the gate: nullptr without times, so no clock is read.
  std::chrono::nanoseconds* gate_wait() { return times_ != nullptr ? &gate_wait_ : nullptr; }
  ~Stopwatch() {
    if (times_ != nullptr && gate_wait_.count() > 0)
      times_->gate_wait_ns.fetch_add(static_cast<uint64_t>(gate_wait_.count()),
                                     std::memory_order_relaxed);
  }
  Stopwatch(const Stopwatch&) = delete;
  Stopwatch& operator=(const Stopwatch&) = delete;

  void Lap(std::atomic<uint64_t> FileReadTimes::*counter) {
    if (times_ == nullptr) return;
    const auto now = std::chrono::steady_clock::now();
    (times_->*counter)
        .fetch_add(static_cast<uint64_t>(
                       std::chrono::duration_cast<std::chrono::nanoseconds>(now - last_).count()),
                   std::memory_order_relaxed);
    last_ = now;
  }

 private:
  FileReadTimes* times_;
  std::chrono::steady_clock::time_point last_;
  std::chrono::nanoseconds gate_wait_{0};
};

}  // namespace

bool EngineZeroesChunk(const CopyEngine& engine, const FileChunk& c) {
  return c.codec == manifest::CODEC_ZERO && c.stored_length == 0 && engine.WritesZeros();
}

Status InstallFileChunk(CopyEngine& engine, EngineGate& gate, Urgency urgency, const FileChunk& c,
                        ChunkBufferPool& buffers, std::vector<uint8_t>& scratch,
                        const std::string& what, CopyDone done, uint64_t* bytes_read,
                        FileReadTimes* times) {
  Stopwatch stopwatch(times);
  EngineGate* const commit_gate = engine.ConcurrentCommits() ? nullptr : &gate;
  if (EngineZeroesChunk(engine, c)) {
    // Nothing to read: the checksum must be that of the zeros, and the engine zeroes the range.
    if (!c.checksum) return Corrupt("{}: an encoded chunk without a checksum", what);
    GPULAZY_RETURN_IF_ERROR(CheckZeroChunk(*c.checksum, c.raw_length, what));
    Status queued;
    {
      EngineHold engine_hold(commit_gate, urgency, stopwatch.gate_wait());
      queued = engine.WriteZeros(c.bo, c.dest_offset, c.raw_length, std::move(done));
    }
    stopwatch.Lap(&FileReadTimes::engine_ns);
    if (!queued.ok())
      return Internal("{}: the {} engine refused to zero it: {}", what, engine.name(),
                      queued.message());
    return Status::Ok();
  }
  // ReceiveTarget under the gate although the contract would allow concurrent calls: readers
  // then take slots one at a time, in order. Measured (docs/benchmarks.md): 0.74-0.78 of the
  // pinned rate this way against 0.58-0.63 with every reader grabbing slots at once.
  // The calls after it enter the gate only for an engine that needs them serialized.
  std::optional<std::span<uint8_t>> target;
  {
    EngineHold engine_hold(gate, urgency, stopwatch.gate_wait());
    target = engine.ReceiveTarget(c.bo, c.dest_offset, c.raw_length);
  }
  if (target && target->size() != c.raw_length) {
    EngineHold engine_hold(commit_gate, urgency, stopwatch.gate_wait());
    engine.ReleaseReceived(c.bo, c.dest_offset, c.raw_length);
    target.reset();
  }
  // Taking (and zero-filling) a buffer of ours counts as reading: the engine lent nothing.
  stopwatch.Lap(&FileReadTimes::engine_ns);
  std::shared_ptr<std::vector<uint8_t>> own;
  std::span<uint8_t> into;
  if (target) {
    into = *target;
  } else {
    own = buffers.Take(c.raw_length);
    into = *own;
  }
  // Only a lent buffer: the engine verifies what it lent, not a Write's bytes.
  const bool engine_verifies =
      target && c.codec == manifest::CODEC_RAW && c.checksum && engine.VerifiesChunks(c.raw_length);
  Status read = ReadInto(c, into, engine_verifies, scratch, what, bytes_read);
  stopwatch.Lap(&FileReadTimes::read_ns);
  if (!read.ok()) {
    if (target) {
      // Nothing unverified may linger in a destination the engine lent us.
      std::memset(into.data(), 0, into.size());
      {
        EngineHold engine_hold(commit_gate, urgency, stopwatch.gate_wait());
        engine.ReleaseReceived(c.bo, c.dest_offset, c.raw_length);
      }
      stopwatch.Lap(&FileReadTimes::engine_ns);
    } else {
      buffers.Return(std::move(own));
    }
    return read;
  }
  CopyDone finish = [&buffers, own, done = std::move(done)](const Status& status) {
    if (own) buffers.Return(own);
    done(status);
  };
  Status queued;
  {
    EngineHold engine_hold(commit_gate, urgency, stopwatch.gate_wait());
    queued = engine_verifies ? engine.CommitUnverified(c.bo, c.dest_offset, c.raw_length,
                                                       *c.checksum, std::move(finish))
             : target ? engine.CommitReceived(c.bo, c.dest_offset, c.raw_length, std::move(finish))
                      : engine.Write(c.bo, c.dest_offset, into, std::move(finish));
  }
  stopwatch.Lap(&FileReadTimes::engine_ns);
  if (!queued.ok())
    return Internal("{}: the {} engine refused the copy: {}", what, engine.name(),
                    queued.message());
  return Status::Ok();
}

}  // namespace gpulazy::client
