// Running the project's executables (and shell commands) from tests: output captured, exit
// status decoded, and always under `timeout`, so a hung child fails its test instead of hanging
// the suite.
#pragma once

#include <stdio.h>
#include <sys/wait.h>

#include <string>

namespace gpulazy::testing {

struct CommandRun {
  int exit_code = -1;  // -1: could not start, or did not exit normally (killed by a signal)
  std::string out;     // standard output, and standard error unless kept apart
};

enum class Stderr { kCaptured, kToTestLog };

// Runs `command` through the shell, killed after `timeout_s` seconds (exit code 124).
inline CommandRun RunCommand(const std::string& command, int timeout_s = 60,
                             Stderr stderr_to = Stderr::kCaptured) {
  const std::string line = "timeout " + std::to_string(timeout_s) + " " + command +
                           (stderr_to == Stderr::kCaptured ? " 2>&1" : "");
  CommandRun run;
  FILE* pipe = ::popen(line.c_str(), "r");
  if (pipe == nullptr) return run;
  char buffer[4096];
  size_t n;
  while ((n = ::fread(buffer, 1, sizeof buffer, pipe)) > 0)
    run.out.append(buffer, n);
  const int status = ::pclose(pipe);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

}  // namespace gpulazy::testing
