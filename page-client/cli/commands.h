// gpulazy-client's subcommands. Each returns the process exit status and prints its own errors.
#pragma once

#include <cstdint>
#include <string>

#include "page-client/net/stream.h"
#include "page-client/restore_session.h"

namespace gpulazy::client::cli {

struct FetchOptions {
  std::string server;
  std::string image;
  std::string out_dir;
  uint64_t window_bytes = 16u << 20;
  // A fetch only streams (nothing waits on a demand chunk): several chunks in flight per lane.
  uint64_t window_per_connection_bytes = client::kBulkWindowPerConnection;
  uint64_t file_window_bytes = 256u << 20;  // while reading passed image files
  bool demand_connection = true;
  bool read_files = true;     // Unix servers: read chunks from the passed image files
  uint32_t file_readers = 0;  // threads reading them; 0: the engine's choice (WritersFor)
  uint32_t lanes = 0;         // bulk connections when bytes use the socket; 0: LanesFor
  bool json = false;
  std::string token_file;
  net::TlsClientOptions tls;
  bool insecure = false;  // plain tcp: allowed
};
// Restores the image's BO contents with the host engine and writes them as CRIU pages files.
int RunFetch(const FetchOptions& options);

struct StatsOptions {
  std::string server;
  std::string token_file;
  net::TlsClientOptions tls;
  bool insecure = false;
};
// Prints the server's stats JSON.
int RunStats(const StatsOptions& options);

}  // namespace gpulazy::client::cli
