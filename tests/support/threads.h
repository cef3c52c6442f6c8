// The threads of a process as /proc shows them: name and nice value, for tests that check which
// threads run at a lower priority.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace gpulazy::testing {

struct ThreadInfo {
  std::string name;
  int nice = 0;
};

// Every thread of `pid` (0: this process), by thread id.
inline std::map<pid_t, ThreadInfo> ListThreads(pid_t pid = 0) {
  const std::filesystem::path tasks = std::filesystem::path("/proc") /
                                      (pid == 0 ? std::string("self") : std::to_string(pid)) /
                                      "task";
  std::map<pid_t, ThreadInfo> out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(tasks, ec)) {
    ThreadInfo info;
    std::ifstream(entry.path() / "comm") >> info.name;
    std::ifstream stat_file(entry.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(stat_file)), {});
    // Fields after the parenthesised name: state is field 3, nice field 19.
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream fields(stat.substr(close + 2));
    std::vector<std::string> rest;
    for (std::string field; fields >> field;)
      rest.push_back(field);
    if (rest.size() < 17) continue;
    info.nice = std::stoi(rest[16]);
    out[static_cast<pid_t>(std::stoi(entry.path().filename().string()))] = info;
  }
  return out;
}

// The nice values of the threads named `name`.
inline std::vector<int> NiceOfThreadsNamed(const std::string& name, pid_t pid = 0) {
  std::vector<int> out;
  for (const auto& [tid, info] : ListThreads(pid))
    if (info.name == name) out.push_back(info.nice);
  return out;
}

// NiceOfThreadsNamed once `count` threads carry the name, or after `patience` whatever is
// there: a thread names itself when it starts, which may be after its creator returned.
inline std::vector<int> NiceOfThreadsNamedAwaiting(
    const std::string& name, size_t count, pid_t pid = 0,
    std::chrono::milliseconds patience = std::chrono::milliseconds(2000)) {
  const auto deadline = std::chrono::steady_clock::now() + patience;
  std::vector<int> nice = NiceOfThreadsNamed(name, pid);
  while (nice.size() != count && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    nice = NiceOfThreadsNamed(name, pid);
  }
  return nice;
}

}  // namespace gpulazy::testing
