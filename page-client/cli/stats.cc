// `gpulazy-client stats`: Hello, StatsRequest, print StatsReply.json.
#include <fmt/format.h>

#include "page-client/cli/commands.h"
#include "page-client/net/endpoint.h"
#include "page-client/net/stream.h"
#include "page-client/server_connection.h"

namespace gpulazy::client::cli {
namespace {

Result<std::string> FetchStats(const StatsOptions& options) {
  GPULAZY_ASSIGN_OR_RETURN(net::Endpoint endpoint, net::Endpoint::Parse(options.server));
  std::string token;
  if (!options.token_file.empty()) {
    GPULAZY_ASSIGN_OR_RETURN(token, net::ReadTokenFile(options.token_file));
  }
  GPULAZY_ASSIGN_OR_RETURN(net::ClientTransport transport,
                           net::ClientTransport::Make(options.tls, options.insecure));
  return FetchServerStats(endpoint, transport, token, "gpulazy-client stats");
}

}  // namespace

int RunStats(const StatsOptions& options) {
  Result<std::string> json = FetchStats(options);
  if (!json.ok()) {
    fmt::print(stderr, "gpulazy-client stats: {}\n", json.status().ToString());
    return 1;
  }
  fmt::print("{}\n", *json);
  return 0;
}

}  // namespace gpulazy::client::cli
