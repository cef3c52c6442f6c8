// UserspaceWire: a point-to-point IP link between two network namespaces, made of one TUN device
// in each and a relay thread that forwards the IP packets between them with a one-way delay,
// jitter, random loss and a cut switch. It is the link impairment of the two-host test where
// the kernel has no sch_netem (this VM's and CI's kernels do not), so delay and loss run
// everywhere /dev/net/tun can be opened.
//
// Each TUN device is created inside its namespace (a short-lived thread setns()es into it, so
// the caller's threads never change namespace), gets `local` and `peer` addresses and comes up;
// it disappears when the wire is destroyed (the fds are the only references).
//
// Thread-safety: Cut() and stats() may be called from any thread while the relay runs.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "lazy-server/image/io.h"
#include "proto/status.h"

namespace gpulazy::testing {

struct WireImpairment {
  std::chrono::microseconds delay{0};   // one way, added in each direction
  std::chrono::microseconds jitter{0};  // uniform in [-jitter, +jitter]; packet order is kept
  double loss = 0.0;                    // probability each packet is dropped, each direction
  uint32_t seed = 1;                    // the loss and jitter draws are reproducible
  size_t queue_limit = 10'000;          // packets held per direction (netem's default is 1000)
};

struct WireEnd {
  std::string netns;  // name under /var/run/netns (ip netns add NAME)
  std::string ifname;
  std::string local;  // IPv4 address of this end
};

// Per direction: [0] = first end to second, [1] = second to first.
struct WireStats {
  std::array<uint64_t, 2> forwarded_packets{};
  std::array<uint64_t, 2> forwarded_bytes{};
  std::array<uint64_t, 2> lost{};      // dropped by the random loss
  std::array<uint64_t, 2> cut{};       // dropped while the wire was cut
  std::array<uint64_t, 2> overflow{};  // dropped because the delay queue was full
  // The first packet delivered after the last cut ended, per direction (nullopt: none yet).
  std::array<std::optional<std::chrono::steady_clock::time_point>, 2> first_after_cut;
};

class UserspaceWire {
 public:
  using Clock = std::chrono::steady_clock;

  // Opens /dev/net/tun in each namespace, configures both ends (point-to-point, `mtu`, up) and
  // starts relaying. Fails naming the step and namespace when it cannot.
  static Result<std::unique_ptr<UserspaceWire>> Create(const WireEnd& first, const WireEnd& second,
                                                       const WireImpairment& impairment,
                                                       int mtu = 1500);
  ~UserspaceWire();
  UserspaceWire(const UserspaceWire&) = delete;
  UserspaceWire& operator=(const UserspaceWire&) = delete;

  struct Key {  // only Create() makes wires
    explicit Key() = default;
  };
  UserspaceWire(Key, UniqueFd first, UniqueFd second, UniqueFd wake,
                const WireImpairment& impairment);

  // Drops every packet, in both directions and already in flight, from now for `length`.
  void Cut(std::chrono::milliseconds length);
  WireStats stats() const;

 private:
  void Relay();
  bool CutNow(Clock::time_point now) const;

  std::array<UniqueFd, 2> tun_;
  UniqueFd wake_;  // eventfd: tells the relay to stop
  const WireImpairment impairment_;
  std::atomic<int64_t> cut_until_ns_{0};  // steady_clock nanoseconds; 0: never cut
  mutable std::mutex mu_;
  WireStats stats_;  // guarded by mu_
  std::thread relay_;
};

}  // namespace gpulazy::testing
