// Naming threads and running background work at a lower CPU priority.
//
// Restore work that can wait (the background stream, its readers, the server's bulk disk reads)
// runs "nicer" than the work someone is waiting for (a fault, a demand request, the resumed
// program itself): on a machine with few cores the scheduler then gives a waking demand thread
// the CPU ahead of them (docs/benchmarks.md, the 4 KiB fault on 2 cores). Only ever lowered:
// raising a thread's priority back needs CAP_SYS_NICE, so a thread lowers its own priority
// and the caller's threads are never touched.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>

#include "page-client/net/asio.h"
#include "proto/status.h"

namespace gpulazy::net {

// Names the calling thread (shown by top -H, /proc/PID/task/TID/comm); at most 15 characters
// are kept.
void NameThisThread(std::string_view name);

// Adds `increment` (>= 0) to the calling thread's nice value, capped at 19. 0 does nothing.
Status LowerThisThreadPriority(int increment);

// The CPUs this process may run on (a container's or taskset's share, not the machine's); at
// least 1.
uint32_t UsableCpus();

// Runs `fn` once on each of the pool's `threads` threads, before any other work posted after
// this call: each thread takes one task and holds it until all have taken theirs. The pool
// must have exactly `threads` threads, all idle.
void RunOnEachPoolThread(boost::asio::thread_pool& pool, uint32_t threads,
                         const std::function<void()>& fn);

}  // namespace gpulazy::net
