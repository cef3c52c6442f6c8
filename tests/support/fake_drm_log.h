// Reading the fake DRM's per-process log (plugin/kfd_fake.cc) from tests and the simulated
// CRIU host.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

namespace gpulazy::testing {

// The fake DRM's live BOs, handle -> memfd, from its per-process log (`drm-<pid>` in the fake
// KFD's state directory, kfd.h): "bo H FD" creates, "mv OLD NEW" changes a handle, "close H".
inline std::map<uint32_t, int> FakeDrmBos(const std::filesystem::path& log_path) {
  std::map<uint32_t, int> out;
  std::ifstream log(log_path);
  std::string line;
  while (std::getline(log, line)) {
    std::istringstream in(line);
    std::string kind;
    uint64_t a = 0, b = 0;
    in >> kind >> std::hex >> a >> b;
    if (kind == "bo") out[static_cast<uint32_t>(a)] = static_cast<int>(b);
    if (kind == "mv") {
      out[static_cast<uint32_t>(b)] = out[static_cast<uint32_t>(a)];
      out.erase(static_cast<uint32_t>(a));
    }
    if (kind == "close") out.erase(static_cast<uint32_t>(a));
  }
  return out;
}

}  // namespace gpulazy::testing
