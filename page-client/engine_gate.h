// EngineGate: serializes the calls into one CopyEngine (its one-caller-at-a-time contract) and
// lets a caller that someone is blocked on go first.
//
// Background installs (file readers, the stream thread) enter with lock() and may hammer the
// gate back to back: with 4 KiB chunks four readers keep a plain mutex held nearly all the time,
// and a plain mutex gives a newly arriving locker no precedence, so a fault's chunk could wait
// behind any number of background installs (docs/benchmarks.md, issue 4). An urgent caller
// (the demand thread installing a chunk a fault or Ensure waits for) announces itself first;
// background lockers do not take the gate while one is announced, and one that took it in the
// meantime steps back. An urgent caller therefore waits for at most the install in progress.
// Urgent callers among themselves are served as by a plain mutex.
//
// Thread-safety: all members may be called from any thread. BasicLockable (lock/unlock) is the
// background entry, so std::lock_guard<EngineGate> works for it.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>

namespace gpulazy::client {

enum class Urgency : uint8_t { kBackground, kUrgent };

class EngineGate {
 public:
  // `serialize` false: an open gate, whose entries return at once (for an engine that takes
  // concurrent calls, CopyEngine::ConcurrentCalls).
  explicit EngineGate(bool serialize = true) : serialize_(serialize) {}
  void lock();  // background entry
  void unlock();
  void lock_urgent();
  // Enters as `urgency` says; leave with unlock().
  void lock(Urgency urgency) {
    if (urgency == Urgency::kUrgent)
      lock_urgent();
    else
      lock();
  }
  // Urgent callers announced and not yet inside (tests, diagnostics).
  uint32_t urgent_waiting() const { return urgent_waiting_.load(std::memory_order_acquire); }

 private:
  const bool serialize_;
  std::mutex mu_;
  std::atomic<uint32_t> urgent_waiting_{0};
};

// RAII entry at a given urgency. With `waited`, the time spent waiting to enter is added to it.
// A null gate is entered by no one: for calls the engine takes from several threads at once.
class EngineHold {
 public:
  EngineHold(EngineGate& gate, Urgency urgency, std::chrono::nanoseconds* waited = nullptr)
      : EngineHold(&gate, urgency, waited) {}
  EngineHold(EngineGate* gate, Urgency urgency, std::chrono::nanoseconds* waited = nullptr)
      : gate_(gate) {
    if (gate_ == nullptr) return;
    if (waited == nullptr) {
      gate_->lock(urgency);
      return;
    }
    const auto asked = std::chrono::steady_clock::now();
    gate_->lock(urgency);
    *waited += std::chrono::steady_clock::now() - asked;
  }
  ~EngineHold() {
    if (gate_ != nullptr) gate_->unlock();
  }
  EngineHold(const EngineHold&) = delete;
  EngineHold& operator=(const EngineHold&) = delete;

 private:
  EngineGate* gate_;
};

}  // namespace gpulazy::client
