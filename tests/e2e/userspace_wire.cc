#include "tests/e2e/userspace_wire.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <random>
#include <vector>

namespace gpulazy::testing {
namespace {

using Clock = std::chrono::steady_clock;

Status SetAddress(int sock, const std::string& ifname, unsigned long request,
                  const std::string& address, const char* what) {
  ifreq ifr{};
  std::strncpy(ifr.ifr_name, ifname.c_str(), IFNAMSIZ - 1);
  sockaddr_in sin{};
  sin.sin_family = AF_INET;
  if (::inet_pton(AF_INET, address.c_str(), &sin.sin_addr) != 1)
    return InvalidArgument("{}: '{}' is not an IPv4 address", ifname, address);
  std::memcpy(&ifr.ifr_addr, &sin, sizeof(sin));
  if (::ioctl(sock, request, &ifr) != 0)
    return ErrnoError(errno, "{}: setting the {} address {}", ifname, what, address);
  return Status::Ok();
}

// Runs on a thread of its own that has entered `end`'s namespace: TUN devices and the ioctls
// that configure them act on the calling thread's network namespace.
Result<UniqueFd> OpenTunHere(const WireEnd& end, const std::string& peer, int mtu) {
  const std::string ns_path = "/var/run/netns/" + end.netns;
  UniqueFd ns(::open(ns_path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!ns.valid()) return ErrnoError(errno, "opening network namespace {}", ns_path);
  if (::setns(ns.get(), CLONE_NEWNET) != 0)
    return ErrnoError(errno, "entering network namespace {}", end.netns);
  UniqueFd tun(::open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC));
  if (!tun.valid()) return ErrnoError(errno, "opening /dev/net/tun in {}", end.netns);
  ifreq ifr{};
  ifr.ifr_flags = IFF_TUN | IFF_NO_PI;
  std::strncpy(ifr.ifr_name, end.ifname.c_str(), IFNAMSIZ - 1);
  if (::ioctl(tun.get(), TUNSETIFF, &ifr) != 0)
    return ErrnoError(errno, "TUNSETIFF {} in {}", end.ifname, end.netns);

  UniqueFd sock(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0));
  if (!sock.valid()) return ErrnoError(errno, "socket in {}", end.netns);
  // A TUN device is point-to-point: the local address gets a /32 and the peer a host route.
  GPULAZY_RETURN_IF_ERROR(SetAddress(sock.get(), end.ifname, SIOCSIFADDR, end.local, "local"));
  GPULAZY_RETURN_IF_ERROR(SetAddress(sock.get(), end.ifname, SIOCSIFDSTADDR, peer, "peer"));
  ifreq req{};
  std::strncpy(req.ifr_name, end.ifname.c_str(), IFNAMSIZ - 1);
  req.ifr_mtu = mtu;
  if (::ioctl(sock.get(), SIOCSIFMTU, &req) != 0)
    return ErrnoError(errno, "{}: setting MTU {}", end.ifname, mtu);
  if (::ioctl(sock.get(), SIOCGIFFLAGS, &req) != 0)
    return ErrnoError(errno, "{}: reading flags", end.ifname);
  req.ifr_flags = static_cast<short>(req.ifr_flags | IFF_UP | IFF_RUNNING);
  if (::ioctl(sock.get(), SIOCSIFFLAGS, &req) != 0)
    return ErrnoError(errno, "{}: bringing it up", end.ifname);
  return tun;
}

Result<UniqueFd> OpenTunIn(const WireEnd& end, const std::string& peer, int mtu) {
  Result<UniqueFd> result = Internal("{}: the setup thread did not run", end.ifname);
  std::thread([&] { result = OpenTunHere(end, peer, mtu); }).join();
  return result;
}

int64_t Nanos(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

}  // namespace

Result<std::unique_ptr<UserspaceWire>> UserspaceWire::Create(const WireEnd& first,
                                                             const WireEnd& second,
                                                             const WireImpairment& impairment,
                                                             int mtu) {
  GPULAZY_ASSIGN_OR_RETURN(UniqueFd a, OpenTunIn(first, second.local, mtu));
  GPULAZY_ASSIGN_OR_RETURN(UniqueFd b, OpenTunIn(second, first.local, mtu));
  UniqueFd wake(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!wake.valid()) return ErrnoError(errno, "eventfd for the wire relay");
  auto wire = std::make_unique<UserspaceWire>(Key(), std::move(a), std::move(b), std::move(wake),
                                              impairment);
  wire->relay_ = std::thread([raw = wire.get()] { raw->Relay(); });
  return wire;
}

UserspaceWire::UserspaceWire(Key /*unused*/, UniqueFd first, UniqueFd second, UniqueFd wake,
                             const WireImpairment& impairment)
    : tun_{std::move(first), std::move(second)}, wake_(std::move(wake)), impairment_(impairment) {}

UserspaceWire::~UserspaceWire() {
  const uint64_t one = 1;
  if (::write(wake_.get(), &one, sizeof(one)) != sizeof(one)) std::abort();  // relay never ends
  relay_.join();
}

void UserspaceWire::Cut(std::chrono::milliseconds length) {
  std::lock_guard lock(mu_);
  stats_.first_after_cut = {};
  cut_until_ns_.store(Nanos(Clock::now() + length));
}

WireStats UserspaceWire::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

bool UserspaceWire::CutNow(Clock::time_point now) const {
  return Nanos(now) < cut_until_ns_.load();
}

void UserspaceWire::Relay() {
  struct Packet {
    Clock::time_point due;
    std::vector<uint8_t> bytes;
  };
  std::array<std::deque<Packet>, 2> queues;
  std::array<Clock::time_point, 2> last_due{};
  std::mt19937_64 rng(impairment_.seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  const int64_t jitter_us = impairment_.jitter.count();
  std::uniform_int_distribution<int64_t> jitter(-jitter_us, jitter_us);
  std::vector<uint8_t> buffer(65536);

  for (;;) {
    Clock::time_point now = Clock::now();
    for (size_t d = 0; d < 2; ++d) {
      while (!queues[d].empty() && queues[d].front().due <= now) {
        Packet packet = std::move(queues[d].front());
        queues[d].pop_front();
        std::lock_guard lock(mu_);
        if (CutNow(now)) {
          ++stats_.cut[d];  // in flight when the cut came
          continue;
        }
        // A TUN write hands the packet to the peer namespace's stack; if its backlog is full
        // the packet is lost, as on a real link.
        if (::write(tun_[1 - d].get(), packet.bytes.data(), packet.bytes.size()) < 0) {
          ++stats_.overflow[d];
          continue;
        }
        ++stats_.forwarded_packets[d];
        stats_.forwarded_bytes[d] += packet.bytes.size();
        const int64_t cut_until = cut_until_ns_.load();
        if (cut_until != 0 && !stats_.first_after_cut[d]) stats_.first_after_cut[d] = now;
      }
    }

    timespec timeout{};
    timespec* timeout_ptr = nullptr;
    std::optional<Clock::time_point> next;
    for (const auto& queue : queues)
      if (!queue.empty()) next = next ? std::min(*next, queue.front().due) : queue.front().due;
    if (next) {
      const auto wait = std::max<Clock::duration>(*next - now, Clock::duration::zero());
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(wait).count();
      timeout.tv_sec = ns / 1'000'000'000;
      timeout.tv_nsec = ns % 1'000'000'000;
      timeout_ptr = &timeout;
    }
    pollfd fds[3] = {
        {tun_[0].get(), POLLIN, 0}, {tun_[1].get(), POLLIN, 0}, {wake_.get(), POLLIN, 0}};
    if (::ppoll(fds, 3, timeout_ptr, nullptr) < 0 && errno != EINTR) std::abort();
    if (fds[2].revents != 0) return;

    for (size_t d = 0; d < 2; ++d) {
      if ((fds[d].revents & POLLIN) == 0) continue;
      for (int budget = 0; budget < 256; ++budget) {
        const ssize_t n = ::read(tun_[d].get(), buffer.data(), buffer.size());
        if (n <= 0) break;  // EAGAIN: drained
        now = Clock::now();
        std::lock_guard lock(mu_);
        if (CutNow(now)) {
          ++stats_.cut[d];
          continue;
        }
        if (impairment_.loss > 0 && unit(rng) < impairment_.loss) {
          ++stats_.lost[d];
          continue;
        }
        if (queues[d].size() >= impairment_.queue_limit) {
          ++stats_.overflow[d];
          continue;
        }
        // Jitter never reorders: a packet is not due before the one queued ahead of it, so TCP
        // sees delay variation, not a storm of duplicate ACKs (netem reorders; real paths
        // rarely do).
        const Clock::time_point due =
            std::max(now + impairment_.delay + std::chrono::microseconds(jitter(rng)), last_due[d]);
        last_due[d] = due;
        queues[d].push_back(Packet{due, std::vector<uint8_t>(buffer.begin(), buffer.begin() + n)});
      }
    }
  }
}

}  // namespace gpulazy::testing
