#include "page-client/engine_gate.h"

namespace gpulazy::client {

void EngineGate::lock() {
  if (!serialize_) return;
  for (;;) {
    // Sleep (futex) while urgent callers are announced, rather than queue on mu_ beside them.
    for (uint32_t waiting = urgent_waiting_.load(std::memory_order_acquire); waiting != 0;
         waiting = urgent_waiting_.load(std::memory_order_acquire))
      urgent_waiting_.wait(waiting, std::memory_order_acquire);
    mu_.lock();
    // One may have announced itself while we queued for mu_: let it in first.
    if (urgent_waiting_.load(std::memory_order_acquire) == 0) return;
    mu_.unlock();
  }
}

void EngineGate::unlock() {
  if (serialize_) mu_.unlock();
}

void EngineGate::lock_urgent() {
  if (!serialize_) return;
  urgent_waiting_.fetch_add(1, std::memory_order_acq_rel);
  mu_.lock();
  if (urgent_waiting_.fetch_sub(1, std::memory_order_acq_rel) == 1) urgent_waiting_.notify_all();
}

}  // namespace gpulazy::client
