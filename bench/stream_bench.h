// `gpulazy-bench stream`: end-to-end streaming throughput (server -> client -> engine) of one or
// more concurrent sessions from the page cache, against a ceiling measured in the same run: the
// same bytes read straight from the page cache into memory, one thread per session for the
// socket transports and `file_readers` per session by reference (the client's own readers).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/harness.h"
#include "page-client/host_engine.h"
#include "page-client/restore_session.h"

namespace gpulazy::bench {

struct StreamOptions {
  uint64_t size = 1ull << 30;
  std::vector<uint32_t> sessions = {1};
  std::vector<std::string> transports = {"unix"};
  std::string engine = "host";  // host (memcpy into memfds) or discard
  uint64_t window = 16u << 20;
  // The stream alone is measured, nobody waits on a chunk: a bulk client's window, as a fetch's.
  uint64_t window_per_connection = client::kBulkWindowPerConnection;
  uint32_t file_readers = 4;  // unix-files: the client's reader threads per session
  // unix, tcp: bulk connections per session (SessionOptions::lanes, 0: client::LanesFor), each
  // received by a thread of its own; the ceiling reads with as many threads.
  uint32_t lanes = client::SessionOptions{}.lanes;
  // The host engine's populate-ahead distance (HostEngineOptions); the memfd ceiling gets the
  // same helper. 0: neither populates ahead.
  uint64_t populate_ahead = client::HostEngineOptions{}.populate_ahead_bytes;
  int populate_nice = client::HostEngineOptions{}.populate_nice;
  // HostEngineOptions::write_fresh_pages: fresh destination pages written through the memfd's
  // file (true) or through the mapping (false, as before session 20).
  bool write_fresh_pages = client::HostEngineOptions{}.write_fresh_pages;
  client::HostEngineOptions::FreshPages fresh_pages_with_several_writers =
      client::HostEngineOptions{}.fresh_pages_with_several_writers;
  bool batch_tcp_wakeups = client::SessionOptions{}.batch_tcp_wakeups;
};

Status RunStreamBench(const CommonOptions& common, const StreamOptions& options);

}  // namespace gpulazy::bench
