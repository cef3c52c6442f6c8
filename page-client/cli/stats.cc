// `gpulazy-client stats`: Hello, StatsRequest, print StatsReply.json.
#include <fmt/format.h>

#include "page-client/cli/commands.h"
#include "page-client/net/endpoint.h"
#include "page-client/net/frame_stream.h"
#include "page-client/net/stream.h"

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
  boost::asio::io_context io;
  GPULAZY_ASSIGN_OR_RETURN(net::Stream socket, net::ConnectBlocking(io, endpoint, transport));
  FrameLimits limits;
  std::vector<uint8_t> payload;
  wire::Header hello;
  hello.mutable_hello()->set_min_version(kMinProtocolVersion);
  hello.mutable_hello()->set_max_version(kProtocolVersion);
  hello.mutable_hello()->set_client_name("gpulazy-client stats");
  hello.mutable_hello()->set_token(token);
  GPULAZY_RETURN_IF_ERROR(net::WriteFrameBlocking(socket, hello, {}, limits));
  GPULAZY_ASSIGN_OR_RETURN(wire::Header reply, net::ReadFrameBlocking(socket, limits, &payload));
  if (reply.has_error())
    return Unavailable("Hello refused: {} ({})", reply.error().message(),
                       wire::ErrorCode_Name(reply.error().code()));
  if (!reply.has_hello_reply()) return Corrupt("expected HelloReply from {}", endpoint.ToString());
  wire::Header request;
  request.set_request_id(1);
  request.mutable_stats_request();
  GPULAZY_RETURN_IF_ERROR(net::WriteFrameBlocking(socket, request, {}, limits));
  GPULAZY_ASSIGN_OR_RETURN(reply, net::ReadFrameBlocking(socket, limits, &payload));
  if (reply.has_error())
    return Unavailable("stats refused: {} ({})", reply.error().message(),
                       wire::ErrorCode_Name(reply.error().code()));
  if (!reply.has_stats_reply()) return Corrupt("expected StatsReply from {}", endpoint.ToString());
  return reply.stats_reply().json();
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
