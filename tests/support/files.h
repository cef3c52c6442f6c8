// Whole files as bytes, for tests that compare what a tool wrote with what it should have.
// One bulk read: reading through stream iterators goes byte by byte, which the -O0 sanitizer
// build CI runs turns into seconds per megabyte (it was most of the end-to-end suite's time).
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace gpulazy::testing {

// The file's bytes; empty when it cannot be opened (a missing log, say: callers that need the
// file check its size or contents, which then fail with the path in their message). Reads in
// blocks until the end, so files that report no size (/proc) come back whole too.
template <typename Bytes = std::string>
Bytes ReadWholeFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  Bytes bytes;
  char block[1 << 16];
  while (in) {
    in.read(block, sizeof block);
    bytes.insert(bytes.end(), block, block + in.gcount());
  }
  return bytes;
}

inline std::vector<uint8_t> ReadFileBytes(const std::filesystem::path& path) {
  return ReadWholeFile<std::vector<uint8_t>>(path);
}

// A checkpoint directory's CRIU amdgpu pages files (amdgpu-pages-*.img), by name; empty when
// the directory does not exist.
inline std::map<std::string, std::vector<uint8_t>> PagesFiles(const std::filesystem::path& dir) {
  std::map<std::string, std::vector<uint8_t>> files;
  std::error_code error;
  for (const std::filesystem::directory_entry& entry :
       std::filesystem::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("amdgpu-pages-") && name.ends_with(".img"))
      files[name] = ReadFileBytes(entry.path());
  }
  return files;
}

}  // namespace gpulazy::testing
