// Where the command-line tools log: spdlog's default logger to stderr, so that what they print
// on stdout (--json results) stays machine-readable.
#pragma once

#include <spdlog/spdlog.h>

namespace gpulazy::net {

// Replaces the default logger's sinks with one colour sink on stderr and sets its level.
void LogToStderr(spdlog::level::level_enum level);

}  // namespace gpulazy::net
