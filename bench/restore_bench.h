// bench/restore_bench: `gpulazy-bench restore` (issue 4). Restores one image into a small
// "inference" workload in several modes side by side, same image, same server:
//   eager          copy everything, then resume and run
//   parallel       resume at once; the program's start-up runs while everything is copied;
//                  the first token waits for completion
//   lazy           resume at once; the BO memory is registered with userfaultfd, faults fetch
//                  chunks on demand, the rest streams in the background
//   lazy-profiled  lazy, streaming in the order a previous lazy run recorded (access profile)
// The workload reads per layer (BO) one contiguous "expert" slice of 1/8 of it per token and
// hashes what it read; the result must equal the same hash over the source checkpoint files.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "bench/harness.h"

namespace CLI {
class App;
}

namespace gpulazy::bench {

struct RestoreOptions {
  uint64_t size = 512ull << 20;
  std::vector<std::string> modes = {"eager", "parallel", "lazy", "lazy-profiled"};
  uint32_t chunk_size = 0;    // lazy image chunk size; 0 = 2 MiB (and raw serving if possible)
  uint32_t startup_ms = 100;  // the program's own start-up work before its first token
  uint32_t tokens = 2;        // tokens the workload computes (the first is "first result")
  std::string fill_mode = "missing";  // missing (UFFDIO_COPY) or minor (UFFDIO_CONTINUE)
  bool defer_zeros = true;            // MISSING mode: zero chunks installed on their first fault
  std::string svg;                    // write a timeline plot here
  bool mechanisms = false;            // instead: compare MISSING+COPY and MINOR+CONTINUE, no server
  bool read_files = true;  // by reference from the passed image files, else through the socket
  // By reference: read a faulting chunk from the files via the chunk table, not via the server.
  bool local_demand = true;
  bool demand_on_caller = true;  // SessionOptions::demand_on_caller
  // Added to the nice value of the restore's background threads, client and server (the
  // plugin's default in parallel and lazy modes); 0 = everything at one priority.
  int background_nice = 10;
  std::optional<uint64_t> file_window;  // by reference; unset: the client library's default
  bool cold = false;  // drop the image's files from the page cache before each mode
  uint64_t seed = 1;
};

Status RunRestoreBench(const CommonOptions& common, const RestoreOptions& options);

// Registers the `restore` subcommand on `app`; returns it, with its options bound to `options`
// and the size text bound to `size_text`.
CLI::App* AddRestoreCommand(CLI::App& app, RestoreOptions& options, std::string& size_text,
                            std::string& chunk_text);

}  // namespace gpulazy::bench
