// The tests' temporary directory: fresh, short-named under /tmp (Unix socket paths inside it
// are limited to 107 bytes), removed with everything in it when the object dies.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

namespace gpulazy::testing {

class TempDir {
 public:
  TempDir() {
    char pattern[] = "/tmp/gl-XXXXXX";
    if (::mkdtemp(pattern) == nullptr) std::abort();  // nothing a test could do without it
    path_ = pattern;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

}  // namespace gpulazy::testing
