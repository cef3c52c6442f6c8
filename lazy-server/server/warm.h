// --warm: images made ready before any client asks for them, for a page server that starts
// with the host and serves a known set of images (inference containers' cold start): each
// file's bytes read into the page cache, and with placement each file prepared by the backend
// (cuda: registered for DMA, which a first restore would otherwise wait for: on an H200 a cold
// server's first (eager) placed restore of a 3.1 GB model took 0.23-0.28 s and of 16 GiB
// 1.0-1.4 s, where a registered image is resident in 0.09 s and 0.37 s; docs/benchmarks.md,
// "Session 42"). A failure is
// logged and counted, and that image's restores simply start cold.
#pragma once

#include <cstdint>
#include <functional>

#include "lazy-server/server/context.h"
#include "proto/status.h"

namespace gpulazy::server {

// Reads [0, size) of `fd` into the page cache without copying it anywhere
// (MADV_POPULATE_READ over a mapping, a window at a time; pread into a scratch buffer where the
// kernel has no MADV_POPULATE_READ). Stops early with kAborted once `keep_going` says no.
Status ReadIntoPageCache(int fd, uint64_t size, const std::function<bool()>& keep_going);

// Warms config.warm's images one after another, in the order given, on the calling thread (a
// bulk disk thread), stopping when the server shuts down. Counts in ctx.totals.warm_*.
void WarmImages(ServerContext& ctx);

}  // namespace gpulazy::server
