// `gpulazy-bench demand`: how long a demand request waits while a background stream saturates
// the session, against the time to fetch one chunk alone on an idle server (same run, same
// image). p50/p99 come from RestoreSession::Ensure on chunks that are not yet resident; the lone
// chunk is the same Ensure on a session that streams nothing (lone_chunk_s), and, for comparison
// with runs before that baseline, a bare frame-level request (lone_chunk_frame_s).
#pragma once

#include <cstdint>
#include <string>

#include "bench/harness.h"
#include "page-client/host_engine.h"
#include "page-client/restore_session.h"

namespace gpulazy::bench {

struct DemandOptions {
  uint64_t size = 2ull << 30;
  uint32_t requests = 200;  // per session
  // Sessions measured at once, each on an image of its own (`size` each) with its own stream
  // and demand connection: how the server's demand path holds up with several restores asking
  // at the same time (its demand network threads serve all of them). p50/p99 pool the samples.
  uint32_t sessions = 1;
  std::string transport = "unix";
  uint64_t window = 16u << 20;
  uint64_t window_per_connection = client::SessionOptions{}.window_per_connection_bytes;
  uint64_t seed = 42;
  uint32_t lanes = client::SessionOptions{}.lanes;  // bulk connections (SessionOptions::lanes)
  // Added to the nice value of the background threads, client and server: the plugin's default
  // (as for `gpulazy-bench restore`), so the tail measured is the one a restore sees.
  int background_nice = 10;
  // HostEngineOptions::write_fresh_pages for every session the benchmark opens.
  bool write_fresh_pages = client::HostEngineOptions{}.write_fresh_pages;
  client::HostEngineOptions::FreshPages fresh_pages_with_several_writers =
      client::HostEngineOptions{}.fresh_pages_with_several_writers;
  // HostEngineOptions::prepare_waited_ranges: the Ensure caller faults in its chunks' pages.
  bool prepare_waited_ranges = client::HostEngineOptions{}.prepare_waited_ranges;
  bool batch_tcp_wakeups = client::SessionOptions{}.batch_tcp_wakeups;
};

Status RunDemandBench(const CommonOptions& common, const DemandOptions& options);

}  // namespace gpulazy::bench
