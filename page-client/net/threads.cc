#include "page-client/net/threads.h"

#include <pthread.h>
#include <sched.h>
#include <spdlog/spdlog.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <latch>
#include <string>
#include <thread>

namespace gpulazy::net {

namespace {

// spdlog builds its registry (and default logger) on first use, inside libspdlog. That is
// thread-safe, but the library is not built with ThreadSanitizer, so TSan cannot see the
// static-init guard when two of our threads log for the first time at once, and reports a race
// on the logger's level (seen: 64 restore sessions starting together, CI). Building it here,
// during static initialization and so before any of our threads exists, removes that window
// for every program that starts threads through this file.
[[maybe_unused]] const spdlog::logger* const kLoggerBuiltBeforeAnyThread =
    spdlog::default_logger_raw();

}  // namespace

void NameThisThread(std::string_view name) {
  const std::string truncated(name.substr(0, 15));
  (void)::pthread_setname_np(::pthread_self(), truncated.c_str());
}

Status LowerThisThreadPriority(int increment) {
  if (increment < 0) return InvalidArgument("a nice increment must be >= 0, not {}", increment);
  if (increment == 0) return Status::Ok();
  // On Linux the nice value is per thread: PRIO_PROCESS with a thread id names that thread.
  const auto tid = static_cast<id_t>(::syscall(SYS_gettid));
  errno = 0;
  const int current = ::getpriority(PRIO_PROCESS, tid);
  if (current == -1 && errno != 0) return ErrnoError(errno, "getpriority of thread {}", tid);
  const int wanted = std::min(19, current + increment);
  if (::setpriority(PRIO_PROCESS, tid, wanted) != 0)
    return ErrnoError(errno, "setpriority of thread {} to nice {}", tid, wanted);
  return Status::Ok();
}

void RunOnEachPoolThread(boost::asio::thread_pool& pool, uint32_t threads,
                         const std::function<void()>& fn) {
  if (threads == 0) return;
  // Every task waits until all have started, so no thread can take two of them; the caller
  // waits until all are done, so `fn` and the latches outlive them.
  std::latch started(threads);
  std::latch finished(threads);
  for (uint32_t i = 0; i < threads; ++i) {
    boost::asio::post(pool, [&] {
      fn();
      started.arrive_and_wait();
      finished.count_down();
    });
  }
  finished.wait();
}

uint32_t UsableCpus() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  uint32_t cpus = 0;
  if (sched_getaffinity(0, sizeof(allowed), &allowed) == 0)
    cpus = static_cast<uint32_t>(CPU_COUNT(&allowed));
  if (cpus == 0) cpus = std::thread::hardware_concurrency();
  return std::max(cpus, 1u);
}

}  // namespace gpulazy::net
