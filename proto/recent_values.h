// The latest N values of a stream of them, for diagnostics that must stay bounded however long
// a restore runs: the server's per-session demand latencies, the client's demand timings.
// Not thread-safe: the owner's lock guards it.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

namespace gpulazy {

template <typename T>
class RecentValues {
 public:
  // capacity > 0: how many of the latest values are kept.
  explicit RecentValues(size_t capacity) : capacity_(capacity) {}

  // Keeps `value`, dropping the oldest kept one once `capacity` are kept.
  void Add(T value) {
    if (values_.size() < capacity_) {
      values_.push_back(std::move(value));
      return;
    }
    values_[oldest_] = std::move(value);
    oldest_ = (oldest_ + 1) % capacity_;
  }

  // The kept values, oldest first.
  std::vector<T> OldestFirst() const {
    std::vector<T> ordered(values_.begin() + static_cast<std::ptrdiff_t>(oldest_), values_.end());
    ordered.insert(ordered.end(), values_.begin(),
                   values_.begin() + static_cast<std::ptrdiff_t>(oldest_));
    return ordered;
  }

  // The kept values in no particular order (for statistics that do not care).
  const std::vector<T>& Unordered() const { return values_; }

  size_t size() const { return values_.size(); }
  size_t capacity() const { return capacity_; }

 private:
  size_t capacity_;
  std::vector<T> values_;
  size_t oldest_ = 0;  // index of the oldest kept value once the ring is full
};

}  // namespace gpulazy
