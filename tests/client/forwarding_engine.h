// A CopyEngine that hands every call to a HostCopyEngine: test engines derive from it and
// override only the calls they change (holding readers, verifying chunks, ...).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>

#include "page-client/host_engine.h"

namespace gpulazy::client {

class ForwardingHostEngine : public CopyEngine {
 public:
  explicit ForwardingHostEngine(HostEngineOptions options = {}) : host_(options) {}

  Status AddDestination(uint32_t bo, uint64_t size) override {
    return host_.AddDestination(bo, size);
  }
  Status Write(uint32_t bo, uint64_t offset, std::span<const uint8_t> raw, CopyDone done) override {
    return host_.Write(bo, offset, raw, std::move(done));
  }
  std::optional<std::span<uint8_t>> ReceiveTarget(uint32_t bo, uint64_t offset,
                                                  uint64_t length) override {
    return host_.ReceiveTarget(bo, offset, length);
  }
  Status CommitReceived(uint32_t bo, uint64_t offset, uint64_t length, CopyDone done) override {
    return host_.CommitReceived(bo, offset, length, std::move(done));
  }
  void ReleaseReceived(uint32_t bo, uint64_t offset, uint64_t length) override {
    host_.ReleaseReceived(bo, offset, length);
  }
  Status ExpectChunkBytes(uint32_t max_bytes) override { return host_.ExpectChunkBytes(max_bytes); }
  void ExpectWriters(uint32_t writers) override { host_.ExpectWriters(writers); }
  void PrepareDestination(uint32_t bo, uint64_t offset, uint64_t length) override {
    host_.PrepareDestination(bo, offset, length);
  }
  Status Flush() override { return host_.Flush(); }

  const HostCopyEngine& host() const { return host_; }

 protected:
  HostCopyEngine host_;
};

// Takes `delay` in every ReceiveTarget, whoever calls it: a stand-in for an engine call that
// costs time (tests of where a restore's readers spend theirs).
class SlowReceiveEngine : public ForwardingHostEngine {
 public:
  explicit SlowReceiveEngine(std::chrono::milliseconds delay) : delay_(delay) {}
  std::string_view name() const override { return "slow-receive"; }
  std::optional<std::span<uint8_t>> ReceiveTarget(uint32_t bo, uint64_t offset,
                                                  uint64_t length) override {
    std::this_thread::sleep_for(delay_);
    return host_.ReceiveTarget(bo, offset, length);
  }

 private:
  const std::chrono::milliseconds delay_;
};

// Remembers how many writers the restore had announced when it said its chunk size: an engine
// that stages writes sizes its buffers then (the CUDA engine: four slots a writer). Prefers
// `preferred_writers` writers (0: no preference) where the restore leaves the count to it.
class WritersAtChunkSizeEngine : public ForwardingHostEngine {
 public:
  explicit WritersAtChunkSizeEngine(uint32_t preferred_writers = 0)
      : preferred_writers_(preferred_writers) {}
  std::string_view name() const override { return "writers-at-chunk-size"; }
  uint32_t PreferredWriters() const override { return preferred_writers_; }
  void ExpectWriters(uint32_t writers) override {
    writers_ = writers;
    ForwardingHostEngine::ExpectWriters(writers);
  }
  Status ExpectChunkBytes(uint32_t max_bytes) override {
    int64_t unset = kUnset;
    writers_at_chunk_size_.compare_exchange_strong(unset, writers_.load());
    return ForwardingHostEngine::ExpectChunkBytes(max_bytes);
  }
  // nullopt: the chunk size was never said; 0: no writers were announced before it.
  std::optional<uint32_t> writers_at_chunk_size() const {
    const int64_t writers = writers_at_chunk_size_.load();
    if (writers == kUnset) return std::nullopt;
    return static_cast<uint32_t>(writers);
  }

 private:
  static constexpr int64_t kUnset = -1;
  const uint32_t preferred_writers_;
  std::atomic<uint32_t> writers_{0};
  // Read by the test thread while the restore's threads may still call in.
  std::atomic<int64_t> writers_at_chunk_size_{kUnset};
};

}  // namespace gpulazy::client
