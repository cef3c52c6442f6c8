// gpulazy-server: serves CRIU amdgpu checkpoints and gpulazy lazy images to page clients.
// See docs/server.md.
#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <csignal>

#include "lazy-server/server/config.h"
#include "lazy-server/server/server.h"

int main(int argc, char** argv) {
  gpulazy::server::ParsedCommandLine parsed = gpulazy::server::ParseCommandLine(argc, argv);
  if (!parsed.config) return parsed.exit_code;
  const gpulazy::server::ServerConfig& config = *parsed.config;

  auto logger = spdlog::stderr_color_mt("gpulazy-server");
  logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e %^%l%$ [%t] %v");
  logger->set_level(spdlog::level::from_str(config.log_level));
  logger->flush_on(spdlog::level::info);  // tests and supervisors read the log as it happens
  spdlog::set_default_logger(logger);

  // Sockets are written with MSG_NOSIGNAL, but a stray SIGPIPE must never kill the server.
  std::signal(SIGPIPE, SIG_IGN);

  gpulazy::server::Server server(config);
  gpulazy::Status listening = server.Listen();
  if (!listening.ok()) {
    spdlog::critical("cannot listen: {}", listening.ToString());
    return 1;
  }
  return server.Run();
}
