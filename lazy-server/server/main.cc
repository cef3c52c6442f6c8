// gpulazy-server: serves CRIU amdgpu checkpoints and gpulazy lazy images to page clients.
// See docs/server.md.
#include <google/protobuf/stubs/logging.h>
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <csignal>
#include <iostream>

#include "lazy-server/server/config.h"
#include "lazy-server/server/server.h"

namespace {

// Protobuf writes its own lines to stderr, for instance one per frame a client sends with a string
// that is not UTF-8. The server reports every frame it cannot parse itself, with the connection
// (debug, then an error to the client), so protobuf's lines go to the server's log at debug,
// in its format and under its level, where a hostile client cannot fill stderr with them.
void ProtobufToLog(google::protobuf::LogLevel level, const char* file, int line,
                   const std::string& message) {
  if (level == google::protobuf::LOGLEVEL_FATAL) {
    spdlog::critical("protobuf ({}:{}): {}", file, line, message);
  } else {
    spdlog::debug("protobuf ({}:{}): {}", file, line, message);
  }
}

}  // namespace

int main(int argc, char** argv) {
  gpulazy::server::ParsedCommandLine parsed = gpulazy::server::ParseCommandLine(argc, argv);
  if (!parsed.config) return parsed.exit_code;
  const gpulazy::server::ServerConfig& config = *parsed.config;
  if (parsed.check_only) return gpulazy::server::CheckConfiguration(config, std::cout, std::cerr);

  auto logger = spdlog::stderr_color_mt("gpulazy-server");
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ [%t] %v");
  logger->set_level(spdlog::level::from_str(config.log_level));
  logger->flush_on(spdlog::level::info);  // tests and supervisors read the log as it happens
  spdlog::set_default_logger(logger);
  google::protobuf::SetLogHandler(&ProtobufToLog);

  // Sockets are written with MSG_NOSIGNAL, but a stray SIGPIPE must never kill the server.
  std::signal(SIGPIPE, SIG_IGN);

  gpulazy::server::Server server(config);
  gpulazy::Status listening = server.Listen();
  if (!listening.ok()) {
    spdlog::critical("cannot start: {}", listening.ToString());
    return 1;
  }
  return server.Run();
}
