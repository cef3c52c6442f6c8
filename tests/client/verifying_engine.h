// The host engine, claiming to verify chunks itself the way the CUDA engine does on the GPU
// (CopyEngine::VerifiesChunks / CommitUnverified), so the client's side of that contract runs
// in every build: it checks the lent bytes against the checksum at commit, and can spoil the
// first chunk committed that way to make the client handle a kCorrupt completion.
#pragma once

#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <utility>

#include "proto/checksum.h"
#include "proto/xxh3_blocks.h"
#include "tests/client/forwarding_engine.h"

namespace gpulazy::client {

class VerifyingHostEngine : public ForwardingHostEngine {
 public:
  // The first chunk committed unverified is spoiled (a byte flipped before the check) on its
  // first `spoil_times` commits.
  explicit VerifyingHostEngine(int spoil_times = 0, HostEngineOptions options = {})
      : ForwardingHostEngine(options), spoil_times_(spoil_times) {}

  // Called on the committing thread right after a kCorrupt completion has returned: a test
  // looks there at what the client has done about the bad copy before any other thread could
  // have run on its behalf.
  void set_after_mismatch(std::function<void()> hook) { after_mismatch_ = std::move(hook); }

  std::string_view name() const override { return "verifying-host"; }
  bool VerifiesChunks(uint64_t length) const override { return length > xxh3::kMidsizeMax; }
  Status CommitUnverified(uint32_t bo, uint64_t offset, uint64_t length, uint64_t checksum,
                          CopyDone done) override {
    Result<std::span<uint8_t>> mapping = host_.Mapping(bo);
    if (!mapping.ok()) return mapping.status();
    if (offset > mapping->size() || length > mapping->size() - offset)
      return OutOfRange("commit past the end of BO {}", bo);
    const std::span<uint8_t> bytes = mapping->subspan(offset, length);
    {
      std::lock_guard lock(mu_);
      ++unverified_commits_;
      if (!victim_) victim_ = {bo, offset};
      if (*victim_ == std::pair{bo, offset}) {
        ++victim_commits_;
        if (spoiled_ < spoil_times_) {
          ++spoiled_;
          bytes[length / 2] ^= 0x5a;
        }
      }
    }
    if (Checksum64(bytes) != checksum) {
      // As the CUDA engine leaves its destination: nothing of the bad copy.
      std::memset(bytes.data(), 0, bytes.size());
      host_.ReleaseReceived(bo, offset, length);
      {
        std::lock_guard lock(mu_);
        ++mismatches_;
      }
      done(Corrupt("BO {} bytes [{}, {}): checksum mismatch in the engine", bo, offset,
                   offset + length));
      if (after_mismatch_) after_mismatch_();
      return Status::Ok();
    }
    return host_.CommitReceived(bo, offset, length, std::move(done));
  }

  uint64_t unverified_commits() const {
    std::lock_guard lock(mu_);
    return unverified_commits_;
  }
  uint64_t mismatches() const {
    std::lock_guard lock(mu_);
    return mismatches_;
  }
  // Commits of the spoiled chunk, good and bad.
  uint64_t victim_commits() const {
    std::lock_guard lock(mu_);
    return victim_commits_;
  }
  // The spoiled chunk's BO and offset, once there is one.
  std::optional<std::pair<uint32_t, uint64_t>> victim() const {
    std::lock_guard lock(mu_);
    return victim_;
  }

 private:
  const int spoil_times_;
  mutable std::mutex mu_;
  std::optional<std::pair<uint32_t, uint64_t>> victim_;
  std::function<void()> after_mismatch_;
  int spoiled_ = 0;
  uint64_t victim_commits_ = 0;
  uint64_t unverified_commits_ = 0;
  uint64_t mismatches_ = 0;
};

}  // namespace gpulazy::client
