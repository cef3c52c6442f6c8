// Reading and writing CRIU amdgpu checkpoint directories, exactly as CRIU's amdgpu plugin lays
// them out (design.md 4.1): amdgpu-kfd-<id>.img per process and amdgpu-pages-<id>-<gpu>.img per
// GPU holding the VRAM/GTT BOs' bytes in BO-table order. Offsets are 64-bit throughout.
// Thread-safety: a CriuCheckpoint is immutable after Open and safe to share.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "lazy-server/image/io.h"
#include "proto/criu_amdgpu.pb.h"
#include "proto/status.h"

namespace gpulazy::image {

// A BO whose contents CRIU stored, located in its pages file.
struct ContentBo {
  uint32_t process_id = 0;  // CRIU file id (the <id> of amdgpu-kfd-<id>.img)
  uint32_t bo_index = 0;    // index in that image's BO table
  uint32_t gpu_id = 0;
  uint64_t gpu_va = 0;
  uint64_t size = 0;
  uint32_t alloc_flags = 0;
  std::string pages_file;     // file name inside the checkpoint directory
  uint64_t pages_offset = 0;  // offset of the BO's first byte, counted after the 8-byte header
};

struct PagesFile {
  std::string name;
  uint32_t gpu_id = 0;
  uint64_t payload_length = 0;  // the header's value, equal to the sum of the GPU's BO sizes
};

struct KfdProcessImage {
  uint32_t file_id = 0;
  std::string file_name;
  criu::KfdProcess message;
  std::map<uint32_t, PagesFile> pages_by_gpu;  // only GPUs that have content BOs
};

class CriuCheckpoint {
 public:
  // Reads every amdgpu-kfd-<id>.img in dir (ascending id), derives BO locations and checks each
  // pages file: present, header equal to the sum of its BO sizes, real size equal to 8 + header.
  // Errors name the file and the mismatch. A directory without KFD images is kNotFound.
  static Result<CriuCheckpoint> Open(const std::filesystem::path& dir);

  const std::filesystem::path& dir() const { return dir_; }
  const std::vector<KfdProcessImage>& processes() const { return processes_; }
  // All content BOs, by process (ascending file id) then BO-table order.
  const std::vector<ContentBo>& content_bos() const { return content_bos_; }
  uint64_t content_bytes() const { return content_bytes_; }

 private:
  std::filesystem::path dir_;
  std::vector<KfdProcessImage> processes_;
  std::vector<ContentBo> content_bos_;
  uint64_t content_bytes_ = 0;
};

// Writes amdgpu-kfd-<file_id>.img (8-byte header + message), atomically.
Status WriteKfdImage(const std::filesystem::path& dir, uint32_t file_id,
                     const criu::KfdProcess& process);

// Streams one amdgpu-pages-<id>-<gpu>.img: Append the BOs' bytes in table order, then Finish,
// which writes the header and checks the total against `expected_length`.
class PagesFileWriter {
 public:
  // The file is written under a temporary name and renamed by Finish; a writer destroyed before
  // Finish removes its temporary, so no half-written pages file ever carries the real name.
  PagesFileWriter() = default;  // an empty writer; every call on it fails
  PagesFileWriter(PagesFileWriter&& other) noexcept;
  PagesFileWriter& operator=(PagesFileWriter&& other) noexcept;
  ~PagesFileWriter();

  static Result<PagesFileWriter> Create(const std::filesystem::path& dir, uint32_t file_id,
                                        uint32_t gpu_id, uint64_t expected_length);
  Status Append(std::span<const uint8_t> bytes);
  // Extends the file by `length` zero bytes without writing them (a sparse hole).
  Status AppendZeros(uint64_t length);
  Status Finish();
  uint64_t written() const { return written_; }

 private:
  Status CheckRoom(uint64_t length) const;
  void Abandon();

  std::filesystem::path path_;
  std::filesystem::path tmp_path_;  // empty once renamed (or never created)
  UniqueFd fd_;
  uint64_t expected_length_ = 0;
  uint64_t written_ = 0;
};

}  // namespace gpulazy::image
