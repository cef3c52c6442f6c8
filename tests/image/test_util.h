// Helpers shared by the image library tests: a self-removing temporary directory, a tiny
// protobuf wire encoder (to build CRIU images byte by byte, independent of our generated
// classes), and a builder that writes a whole CRIU checkpoint.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "lazy-server/image/criu_checkpoint.h"
#include "proto/criu_file.h"
#include "proto/endian.h"
#include "tests/support/files.h"
#include "tests/support/temp_dir.h"

namespace gpulazy::testing {

// Protobuf wire format, by hand: tags are (field << 3) | wire type.
class PbWriter {
 public:
  PbWriter& Varint(uint32_t field, uint64_t value) {
    PutVarint((uint64_t{field} << 3) | 0);
    PutVarint(value);
    return *this;
  }
  PbWriter& Bytes(uint32_t field, const std::string& value) {
    PutVarint((uint64_t{field} << 3) | 2);
    PutVarint(value.size());
    bytes_ += value;
    return *this;
  }
  PbWriter& Message(uint32_t field, const PbWriter& message) { return Bytes(field, message.str()); }
  const std::string& str() const { return bytes_; }

 private:
  void PutVarint(uint64_t v) {
    while (v >= 0x80) {
      bytes_ += static_cast<char>((v & 0x7f) | 0x80);
      v >>= 7;
    }
    bytes_ += static_cast<char>(v);
  }
  std::string bytes_;
};

// CRIU's kfd_device_entry: fields 1..31 scalars (22 and 31 are u64), 32 repeated iolinks.
// Field n holds base + n unless skip == n, so tests can tell every field apart.
inline PbWriter HandDevice(uint32_t gpu_id, uint32_t base = 100, uint32_t skip = 0) {
  PbWriter w;
  for (uint32_t field = 1; field <= 31; ++field) {
    if (field == skip) continue;
    uint64_t value = base + field;
    if (field == 2) value = gpu_id;
    if (field == 22) value = 0x1234'5678'9abc'def0ull;  // hive_id, u64
    if (field == 31) value = 17ull << 30;               // vram_size, u64: 17 GiB
    w.Varint(field, value);
  }
  w.Message(32, PbWriter().Varint(1, 2).Varint(2, 7));  // iolinks {type, node_to_id}
  return w;
}

// CRIU's kfd_bo_entry: addr=1 size=2 offset=3 alloc_flags=4 gpu_id=5 handle=6.
inline PbWriter HandBo(uint64_t addr, uint64_t size, uint32_t flags, uint32_t gpu_id,
                       uint32_t handle) {
  return PbWriter()
      .Varint(1, addr)
      .Varint(2, size)
      .Varint(3, addr ^ 0xffff)
      .Varint(4, flags)
      .Varint(5, gpu_id)
      .Varint(6, handle);
}

// CRIU's criu_kfd. num_of_bos defaults to bos.size().
inline PbWriter HandProcess(const std::vector<PbWriter>& devices, const std::vector<PbWriter>& bos,
                            int64_t num_of_bos = -1, bool with_magic = true) {
  PbWriter w;
  w.Varint(1, 4242).Varint(2, devices.size()).Varint(3, 16);
  for (const PbWriter& d : devices)
    w.Message(4, d);
  w.Varint(5, num_of_bos < 0 ? bos.size() : static_cast<uint64_t>(num_of_bos));
  for (const PbWriter& b : bos)
    w.Message(6, b);
  w.Varint(7, 3).Varint(8, 1ull << 33);
  if (with_magic) w.Varint(9, 0x43524955);
  w.Bytes(10, std::string("driver-private\0blob", 19));
  return w;
}

// 8-byte little-endian length + payload, as CRIU writes image files.
inline std::string WithCriuHeader(const std::string& payload, uint64_t header_value) {
  std::string out(8, '\0');
  StoreLe64(reinterpret_cast<uint8_t*>(out.data()), header_value);
  return out + payload;
}
inline std::string WithCriuHeader(const std::string& payload) {
  return WithCriuHeader(payload, payload.size());
}

inline void WriteFile(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

inline std::string ReadFile(const std::filesystem::path& path) {
  return ReadWholeFile(path);
}

// Flips one byte of a file in place.
inline void FlipByte(const std::filesystem::path& path, uint64_t offset) {
  std::fstream f(path, std::ios::binary | std::ios::in | std::ios::out);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.get(c);
  f.seekp(static_cast<std::streamoff>(offset));
  f.put(static_cast<char>(c ^ 0x5a));
  ASSERT_TRUE(f.good()) << path << " @" << offset;
}

inline criu::KfdDevice MakeDevice(uint32_t gpu_id) {
  criu::KfdDevice device;
  EXPECT_TRUE(device.ParseFromString(HandDevice(gpu_id).str()));
  return device;
}

inline std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> out(n);
  for (auto& b : out)
    b = static_cast<uint8_t>(rng());
  return out;
}

// Text-like bytes that LZ4 shrinks well but that are not all zero.
inline std::vector<uint8_t> CompressibleBytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> out(n);
  for (size_t i = 0; i < n; ++i)
    out[i] = static_cast<uint8_t>("gpulazy!"[(i + seed) % 8] + (i / 4096) % 3);
  return out;
}

// One BO of a synthetic checkpoint. Empty `data` with a non-zero size writes a sparse hole.
struct BoSpec {
  uint32_t gpu_id = 0;
  uint64_t size = 0;
  uint32_t flags = criu_format::kAllocVram;
  std::vector<uint8_t> data;
};

// Writes amdgpu-kfd-<file_id>.img and one pages file per GPU with content BOs.
inline criu::KfdProcess MakeProcess(const std::vector<uint32_t>& gpus,
                                    const std::vector<BoSpec>& bos) {
  criu::KfdProcess process;
  process.set_pid(1000);
  process.set_gpu_count(static_cast<uint32_t>(gpus.size()));
  process.set_cpu_count(1);
  for (uint32_t gpu : gpus)
    *process.add_devices() = MakeDevice(gpu);
  process.set_bo_count(bos.size());
  uint64_t va = 0x7f00'0000'0000ull;
  for (size_t i = 0; i < bos.size(); ++i) {
    criu::KfdBo* bo = process.add_bos();
    bo->set_gpu_va(va);
    va += (bos[i].size + 0xfffff) & ~0xfffffull;
    va += 1 << 20;
    bo->set_size(bos[i].size);
    bo->set_mmap_offset(i << 12);
    bo->set_alloc_flags(bos[i].flags);
    bo->set_gpu_id(bos[i].gpu_id);
    bo->set_handle(static_cast<uint32_t>(i + 1));
  }
  process.set_object_count(0);
  process.set_shared_mem_size(0);
  process.set_shared_mem_magic(0);
  process.set_driver_private("");
  return process;
}

inline void WriteCheckpoint(const std::filesystem::path& dir, uint32_t file_id,
                            const std::vector<uint32_t>& gpus, const std::vector<BoSpec>& bos) {
  ASSERT_TRUE(image::WriteKfdImage(dir, file_id, MakeProcess(gpus, bos)).ok());
  for (uint32_t gpu : gpus) {
    uint64_t total = 0;
    bool any = false;
    for (const BoSpec& bo : bos)
      if (bo.gpu_id == gpu && criu_format::HasContents(bo.flags)) total += bo.size, any = true;
    if (!any) continue;
    auto writer = image::PagesFileWriter::Create(dir, file_id, gpu, total);
    ASSERT_TRUE(writer.ok()) << writer.status().ToString();
    for (const BoSpec& bo : bos) {
      if (bo.gpu_id != gpu || !criu_format::HasContents(bo.flags)) continue;
      if (bo.data.empty()) {
        ASSERT_TRUE(writer->AppendZeros(bo.size).ok());
      } else {
        ASSERT_EQ(bo.data.size(), bo.size);
        ASSERT_TRUE(writer->Append(bo.data).ok());
      }
    }
    Status finished = writer->Finish();
    ASSERT_TRUE(finished.ok()) << finished.ToString();
  }
}

inline std::vector<uint8_t> ReadRange(const std::filesystem::path& path, uint64_t offset,
                                      size_t length) {
  std::ifstream in(path, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(offset));
  std::vector<uint8_t> out(length);
  in.read(reinterpret_cast<char*>(out.data()), static_cast<std::streamsize>(length));
  EXPECT_EQ(static_cast<size_t>(in.gcount()), length);
  return out;
}

}  // namespace gpulazy::testing
