#include "page-client/net/stderr_log.h"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <memory>

namespace gpulazy::net {

void LogToStderr(spdlog::level::level_enum level) {
  spdlog::set_level(level);
  spdlog::default_logger()->sinks().clear();
  spdlog::default_logger()->sinks().push_back(
      std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
}

}  // namespace gpulazy::net
