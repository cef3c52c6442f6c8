#include "lazy-server/image/synth.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <span>
#include <system_error>

#include "lazy-server/image/criu_checkpoint.h"
#include "proto/criu_amdgpu.pb.h"
#include "proto/criu_file.h"
#include "proto/size.h"

namespace gpulazy::image {
namespace {

namespace cf = criu_format;

// KFD alloc flags beyond those criu_file.h names (linux/kfd_ioctl.h), used only to make the
// synthetic BO tables look like what ROCr allocates.
constexpr uint32_t kAllocUncached = 1u << 25;
constexpr uint32_t kAllocCoherent = 1u << 26;
constexpr uint32_t kAllocNoSubstitute = 1u << 28;

// KFD mmap offsets of doorbell BOs encode the type and the GPU (kfd_priv.h).
constexpr uint64_t kMmapTypeDoorbell = 3ull << 62;
constexpr int kMmapGpuIdShift = 46;
// DRM hands out mmap offsets of GEM objects above 4 GiB (DRM_FILE_PAGE_OFFSET_START).
constexpr uint64_t kDrmMmapBase = 1ull << 32;

// KFD topology io-link types (CRAT).
constexpr uint32_t kLinkPcie = 2;
constexpr uint32_t kLinkXgmi = 11;

constexpr uint64_t kTwoMiB = 2ull << 20;
constexpr size_t kWriteBuffer = 4u << 20;  // contents go to disk in 4 MiB writes

// ---- Randomness. splitmix64 derives seeds; xoshiro256** makes the bytes (about 1 ns per 8
// bytes, so GiBs of "weights" cost seconds, not minutes).

uint64_t SplitMix(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A seed for one purpose, derived from the user's seed and a few tags.
uint64_t Derive(uint64_t seed, uint64_t a, uint64_t b = 0, uint64_t c = 0) {
  uint64_t state = seed;
  uint64_t h = SplitMix(state);
  for (uint64_t tag : {a, b, c}) {
    state ^= h + tag * 0xd1342543de82ef95ull;
    h = SplitMix(state);
  }
  return h;
}

class Rng {
 public:
  explicit Rng(uint64_t seed) {
    for (auto& word : s_)
      word = SplitMix(seed);
  }
  uint64_t Next() {
    const uint64_t result = std::rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = std::rotl(s_[3], 45);
    return result;
  }
  // Uniform in [lo, hi] (hi - lo small compared with 2^64; the bias does not matter here).
  uint64_t Between(uint64_t lo, uint64_t hi) { return lo + Next() % (hi - lo + 1); }
  double Unit() { return static_cast<double>(Next() >> 11) * 0x1.0p-53; }
  template <typename T>
  void Shuffle(std::vector<T>& items) {
    for (size_t i = items.size(); i > 1; --i)
      std::swap(items[i - 1], items[Next() % i]);
  }

 private:
  uint64_t s_[4];
};

// ---- Content generators. Each is a pure function of its seed and the bytes produced so far,
// so a duplicate BO only has to reuse its source's seed. Buffers are whole pages.

// Incompressible bytes, like trained weights.
class WeightsStream {
 public:
  explicit WeightsStream(uint64_t seed) : rng_(seed) {}
  void Fill(std::span<uint8_t> out) {
    size_t i = 0;
    for (; i + 8 <= out.size(); i += 8) {
      uint64_t word = rng_.Next();
      std::memcpy(out.data() + i, &word, 8);
    }
    if (i < out.size()) {
      uint64_t word = rng_.Next();
      std::memcpy(out.data() + i, &word, out.size() - i);
    }
  }

 private:
  Rng rng_;
};

// Low-entropy data that LZ4 compresses: fp16 activations that hold a value for a run of
// elements (quantized, ReLU-like zeros), alternating per 64 KiB with ring-buffer records of
// mostly constant fields.
class CompressibleStream {
 public:
  explicit CompressibleStream(uint64_t seed) : rng_(seed) {}
  // `out` is whole pages, so segments, records and fp16 values never straddle two calls.
  void Fill(std::span<uint8_t> out) {
    size_t i = 0;
    while (i < out.size()) {
      if (produced_ % kSegment == 0) ring_mode_ = rng_.Next() % 4 == 0;
      size_t n = std::min<uint64_t>(out.size() - i, kSegment - produced_ % kSegment);
      if (ring_mode_)
        FillRing(out.subspan(i, n));
      else
        FillActivations(out.subspan(i, n));
      i += n;
      produced_ += n;
    }
  }

 private:
  static constexpr uint64_t kSegment = 64 << 10;
  static constexpr size_t kRecord = 64;

  void FillActivations(std::span<uint8_t> out) {
    for (size_t i = 0; i + 2 <= out.size();) {
      if (run_left_ == 0) {
        run_left_ = static_cast<uint32_t>(rng_.Between(4, 64));
        uint64_t r = rng_.Next();
        if (r % 3 == 0) {
          value_ = 0;  // ReLU zeros
        } else {
          uint16_t sign = static_cast<uint16_t>((r >> 8) & 1) << 15;
          uint16_t exponent = static_cast<uint16_t>(10 + (r >> 9) % 5) << 10;
          uint16_t mantissa = static_cast<uint16_t>((r >> 12) & 0xf) << 6;
          value_ = sign | exponent | mantissa;
        }
      }
      size_t count = std::min<size_t>(run_left_, (out.size() - i) / 2);
      const uint8_t lo = static_cast<uint8_t>(value_), hi = static_cast<uint8_t>(value_ >> 8);
      for (size_t k = 0; k < count; ++k, i += 2) {
        out[i] = lo;
        out[i + 1] = hi;
      }
      run_left_ -= static_cast<uint32_t>(count);
    }
  }

  // 64-byte records: opcode, sequence number, a small payload, zero padding.
  void FillRing(std::span<uint8_t> out) {
    for (size_t i = 0; i + kRecord <= out.size(); i += kRecord) {
      ++sequence_;
      uint8_t* record = out.data() + i;
      std::memset(record, 0, kRecord);
      uint32_t header = 0x1000u | static_cast<uint32_t>(sequence_ % 7);
      uint32_t sequence = static_cast<uint32_t>(sequence_);
      uint32_t payload = static_cast<uint32_t>(rng_.Next() % 16);
      std::memcpy(record, &header, 4);
      std::memcpy(record + 4, &sequence, 4);
      std::memcpy(record + 8, &payload, 4);
    }
  }

  Rng rng_;
  uint64_t produced_ = 0;
  bool ring_mode_ = false;
  uint32_t run_left_ = 0;
  uint16_t value_ = 0;
  uint64_t sequence_ = 0;
};

// ---- The plan. Every process of a job runs the same program, so all processes share one BO
// template (kinds, GPUs, roles, relative sizes); each process then gets its own sizes, VAs,
// streams and pid.

enum class BoKind { kVram, kGtt, kUserptr, kDoorbell };

struct BoSlot {
  BoKind kind = BoKind::kVram;
  uint32_t gpu_index = 0;
  SynthContent content = SynthContent::kWeights;
  bool small = false;          // a queue/EOP/ctx-save style BO with a fixed target size
  uint64_t target_pages = 0;   // small BOs, USERPTR and DOORBELL: the size they ask for
  double weight = 0;           // large BOs: share of the process's remaining pages
  uint32_t weights_index = 0;  // kWeights/kDuplicate: index among the template's weight BOs
};

struct BoMix {
  uint32_t vram = 0, gtt = 0, userptr = 0, doorbell = 0;
  uint32_t content() const { return vram + gtt; }
};

// How a process's `bos` split into kinds: about a fifth without contents (one DOORBELL per
// GPU as far as they go, at least one USERPTR), about a fifth of the rest GTT. Tiny tables
// (fewer than 3 BOs) hold content BOs only.
BoMix MixFor(uint32_t bos, uint32_t gpus) {
  BoMix mix;
  uint32_t without = bos >= 3 ? std::max(2u, bos / 5) : 0;
  without = std::min(without, bos - 1);
  if (without > 0) {
    mix.doorbell = std::min(gpus, without - std::max(1u, without / 3));
    mix.userptr = without - mix.doorbell;
  }
  uint32_t content = bos - without;
  mix.gtt = content >= 2 ? std::max(1u, content / 5) : 0;
  mix.vram = content - mix.gtt;
  return mix;
}

std::vector<BoSlot> MakeTemplate(const SynthOptions& options) {
  Rng rng(Derive(options.seed, 0x7e3a));
  BoMix mix = MixFor(options.bos, options.gpus);

  // Roles of VRAM BOs: one of each content kind first (so every kind shows up), a replicated
  // tensor when there is room, a quarter small, the rest drawn.
  std::vector<BoSlot> vram;
  const SynthContent forced[] = {SynthContent::kWeights, SynthContent::kZero,
                                 SynthContent::kCompressible, SynthContent::kPartialZero};
  for (uint32_t i = 0; i < mix.vram; ++i) {
    BoSlot slot;
    slot.kind = BoKind::kVram;
    if (i < std::size(forced)) {
      slot.content = forced[i];
    } else if (i == std::size(forced) && mix.vram >= 6) {
      slot.content = SynthContent::kDuplicate;
    } else if (i < std::size(forced) + 1 + mix.vram / 4) {
      slot.small = true;
      slot.content = rng.Next() % 2 ? SynthContent::kCompressible : SynthContent::kZero;
    } else {
      double r = rng.Unit();
      slot.content = r < 0.55   ? SynthContent::kWeights
                     : r < 0.75 ? SynthContent::kZero
                     : r < 0.90 ? SynthContent::kCompressible
                                : SynthContent::kPartialZero;
    }
    vram.push_back(slot);
  }
  std::vector<BoSlot> gtt(mix.gtt);
  for (uint32_t i = 0; i < mix.gtt; ++i) {
    gtt[i].kind = BoKind::kGtt;
    gtt[i].small = true;
    gtt[i].content = i == 0 || rng.Next() % 3 ? SynthContent::kCompressible : SynthContent::kZero;
  }

  std::vector<BoSlot> content = std::move(vram);
  content.insert(content.end(), gtt.begin(), gtt.end());
  for (auto& slot : content) {
    if (slot.small) {
      // Sizes ROCr asks for: EOP buffers, signal pools, ring buffers, ctx-save areas.
      static constexpr uint64_t kSmallPages[] = {1, 1, 2, 3, 4, 16, 64, 257, 600};
      slot.target_pages = kSmallPages[rng.Next() % std::size(kSmallPages)];
    } else {
      slot.weight = std::exp(rng.Unit() * std::log(64.0));  // log-uniform: a few dominate
    }
  }

  // Scale the weights so each kind of large BO takes a steady share of the bytes, whatever the
  // draw: KV-cache pools are the biggest allocations of an inference job, then the weights.
  static constexpr double kShare[] = {0.30, 0.35, 0.12, 0.10, 0.13};  // by SynthContent
  std::map<SynthContent, double> kind_weight;
  for (const auto& slot : content)
    if (!slot.small) kind_weight[slot.content] += slot.weight;
  for (auto& slot : content)
    if (!slot.small)
      slot.weight =
          slot.weight / kind_weight[slot.content] * kShare[static_cast<int>(slot.content)];

  // GPUs: every GPU gets a content BO while there are enough, the rest land at random.
  std::vector<uint32_t> gpu_of(content.size());
  for (size_t i = 0; i < content.size(); ++i)
    gpu_of[i] = i < options.gpus ? static_cast<uint32_t>(i) : rng.Next() % options.gpus;
  rng.Shuffle(gpu_of);
  for (size_t i = 0; i < content.size(); ++i)
    content[i].gpu_index = gpu_of[i];

  std::vector<BoSlot> all = std::move(content);
  for (uint32_t i = 0; i < mix.doorbell; ++i) {
    BoSlot slot;
    slot.kind = BoKind::kDoorbell;
    slot.gpu_index = i;
    slot.target_pages = 2;  // one 8 KiB doorbell slice per process and GPU
    all.push_back(slot);
  }
  for (uint32_t i = 0; i < mix.userptr; ++i) {
    BoSlot slot;
    slot.kind = BoKind::kUserptr;
    slot.gpu_index = rng.Next() % options.gpus;
    slot.target_pages = rng.Between(1, 8192);  // pinned host buffers, up to 32 MiB
    all.push_back(slot);
  }

  // CRIU lists BOs per GPU (KFD walks each device's handle table); within a GPU the
  // allocation order is the program's, here shuffled.
  rng.Shuffle(all);
  std::stable_sort(all.begin(), all.end(),
                   [](const BoSlot& a, const BoSlot& b) { return a.gpu_index < b.gpu_index; });
  uint32_t weights_index = 0;
  for (auto& slot : all)
    if ((slot.kind == BoKind::kVram || slot.kind == BoKind::kGtt) &&
        (slot.content == SynthContent::kWeights || slot.content == SynthContent::kDuplicate))
      slot.weights_index = weights_index++;
  return all;
}

bool HasContent(const BoSlot& slot) {
  return slot.kind == BoKind::kVram || slot.kind == BoKind::kGtt;
}

// Page counts of one process's content BOs (in template order, 0 for BOs without contents)
// summing to exactly `pages`. Every content BO gets a page; small BOs get their target as far
// as a fair cap allows; large BOs share the rest by weight; the rounding remainder goes to the
// largest one.
std::vector<uint64_t> SplitPages(const std::vector<BoSlot>& slots, uint64_t pages) {
  std::vector<uint64_t> sizes(slots.size(), 0);
  uint64_t content = 0;
  double total_weight = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (!HasContent(slots[i])) continue;
    sizes[i] = 1;
    ++content;
    if (!slots[i].small) total_weight += slots[i].weight;
  }
  uint64_t extra = pages - content;
  const uint64_t small_cap = extra / (4 * content);
  for (size_t i = 0; i < slots.size(); ++i) {
    if (!HasContent(slots[i]) || !slots[i].small) continue;
    uint64_t add = std::min(slots[i].target_pages - 1, small_cap);
    sizes[i] += add;
    extra -= add;
  }
  size_t largest = slots.size();
  uint64_t given = 0;
  for (size_t i = 0; i < slots.size(); ++i) {
    if (!HasContent(slots[i]) || slots[i].small) continue;
    uint64_t add =
        static_cast<uint64_t>(static_cast<double>(extra) * slots[i].weight / total_weight);
    add = std::min(add, extra - given);
    sizes[i] += add;
    given += add;
    if (largest == slots.size() || slots[i].weight > slots[largest].weight) largest = i;
  }
  if (largest == slots.size()) {  // only small BOs: the last content BO takes the rest
    for (size_t i = slots.size(); i-- > 0;)
      if (HasContent(slots[i])) {
        largest = i;
        break;
      }
  }
  sizes[largest] += extra - given;
  return sizes;
}

// ---- Topology: an MI210 or MI300X node with two CPU sockets (KFD nodes 0 and 1) and the
// GPUs after them, linked by PCIe to a socket and by XGMI to each other.

struct GpuModel {
  uint32_t device_id, compute_units, array_count, cu_per_simd_array, sdma_xgmi, fw_version,
      sdma_fw_version, caches;
  uint64_t vram_bytes;
};
constexpr GpuModel kMi210 = {0x740f, 104, 8, 13, 3, 79, 9, 221, 64ull << 30};
constexpr GpuModel kMi300x = {0x74a1, 304, 32, 10, 14, 150, 19, 640, 192ull << 30};

uint32_t GpuIdFor(uint32_t index) {
  // KFD derives gpu_id from a hash of the device; what matters is that they are distinct,
  // non-zero and fit the 4 hex digits of the pages file name.
  return 0x1000 + (0xc0de - 0x1000 + index * 0x1f3) % 0xf000;
}

std::vector<criu::KfdDevice> MakeDevices(const SynthOptions& options, uint64_t max_gpu_bytes) {
  const GpuModel& model =
      max_gpu_bytes > kMi210.vram_bytes || Derive(options.seed, 0xde71ce) % 2 ? kMi300x : kMi210;
  const uint64_t hive_id = options.gpus > 1 ? Derive(options.seed, 0x41fe) | 1 : 0;
  std::vector<criu::KfdDevice> devices;
  for (uint32_t i = 0; i < options.gpus; ++i) {
    criu::KfdDevice d;
    d.set_node_id(2 + i);
    d.set_gpu_id(GpuIdFor(i));
    d.set_cpu_cores_count(0);
    d.set_simd_count(model.compute_units * 4);
    d.set_mem_banks_count(1);
    d.set_caches_count(model.caches);
    d.set_max_waves_per_simd(8);
    d.set_lds_size_in_kb(64);
    d.set_gds_size_in_kb(0);
    d.set_num_gws(64);
    d.set_wave_front_size(64);
    d.set_array_count(model.array_count);
    d.set_simd_arrays_per_engine(1);
    d.set_cu_per_simd_array(model.cu_per_simd_array);
    d.set_simd_per_cu(4);
    d.set_max_slots_scratch_cu(32);
    d.set_vendor_id(0x1002);
    d.set_device_id(model.device_id);
    d.set_domain(0);
    d.set_drm_render_minor(128 + i);
    d.set_hive_id(hive_id);
    d.set_num_sdma_engines(2);
    d.set_num_sdma_xgmi_engines(model.sdma_xgmi);
    d.set_num_sdma_queues_per_engine(8);
    d.set_num_cp_queues(24);
    d.set_fw_version(model.fw_version);
    d.set_capability(0x2b2a2880);
    d.set_sdma_fw_version(model.sdma_fw_version);
    d.set_vram_public(1);
    d.set_vram_size(model.vram_bytes);
    auto* pcie = d.add_links();
    pcie->set_link_type(kLinkPcie);
    pcie->set_peer_node_id(i % 2);
    for (uint32_t j = 0; j < options.gpus; ++j) {
      if (j == i) continue;
      auto* xgmi = d.add_links();
      xgmi->set_link_type(kLinkXgmi);
      xgmi->set_peer_node_id(2 + j);
    }
    d.set_io_links_count(static_cast<uint32_t>(d.links_size()));
    devices.push_back(std::move(d));
  }
  return devices;
}

// Opaque driver state: a small header, then per-queue and per-event records of noise.
std::string MakeDriverPrivate(uint64_t seed, uint32_t queues, uint32_t events) {
  std::string blob = "KFDP";
  blob.resize(16, '\0');
  blob[4] = 1;  // version
  blob[8] = static_cast<char>(queues);
  blob[12] = static_cast<char>(events);
  WeightsStream noise(seed);
  std::vector<uint8_t> record(size_t{queues} * 640 + size_t{events} * 32);
  noise.Fill(record);
  blob.append(record.begin(), record.end());
  return blob;
}

SynthContent ReportedContent(const BoSlot& slot, uint32_t file_id) {
  // Even-numbered weights of later processes are the same tensors as process 1's (replicas).
  if (slot.content == SynthContent::kWeights && file_id > 1 && slot.weights_index % 2 == 0)
    return SynthContent::kDuplicate;
  return slot.content;
}

// The seed of a BO's content stream.
uint64_t StreamSeed(const SynthOptions& options, const std::vector<BoSlot>& slots, size_t index,
                    uint32_t file_id) {
  const BoSlot& slot = slots[index];
  switch (ReportedContent(slot, file_id)) {
    case SynthContent::kDuplicate:
      if (slot.content == SynthContent::kDuplicate) {
        // Replicates this process's first weight BO (e.g. an embedding on a second GPU).
        for (size_t i = 0; i < slots.size(); ++i)
          if (slots[i].content == SynthContent::kWeights)
            return StreamSeed(options, slots, i, file_id);
        return Derive(options.seed, 0x3e1, file_id, index);
      }
      return Derive(options.seed, 0x3e1, 1, index);  // process 1's tensor in this slot
    case SynthContent::kWeights:
      return Derive(options.seed, 0x3e1, file_id, index);
    default:
      return Derive(options.seed, 0xc0b, file_id, index);
  }
}

Status CheckOutputDirectory(const std::filesystem::path& out) {
  std::error_code ec;
  std::filesystem::create_directories(out, ec);
  if (ec) return IoError("{}: cannot create the directory: {}", out.string(), ec.message());
  for (const auto& entry : std::filesystem::directory_iterator(out, ec)) {
    std::string name = entry.path().filename().string();
    if (name.starts_with("amdgpu-") || name.starts_with("gpulazy-"))
      return InvalidArgument("{}: already holds a checkpoint ({}); choose an empty directory",
                             out.string(), name);
  }
  if (ec) return IoError("{}: cannot list the directory: {}", out.string(), ec.message());
  return Status::Ok();
}

class ContentWriter {
 public:
  ContentWriter() : buffer_(kWriteBuffer) {}

  // Appends one BO's contents to `pages`.
  Status Write(PagesFileWriter& pages, SynthContent content, uint64_t seed, uint64_t size) {
    switch (content) {
      case SynthContent::kZero:
        return pages.AppendZeros(size);
      case SynthContent::kPartialZero: {
        // A KV cache 20-70% filled: the head holds data, the tail was never written.
        const uint64_t whole_pages = size / kSynthPageSize;
        const double filled = 0.2 + 0.5 * static_cast<double>(seed % 1000) / 1000.0;
        uint64_t head_pages = static_cast<uint64_t>(static_cast<double>(whole_pages) * filled);
        uint64_t head = head_pages * kSynthPageSize;
        CompressibleStream stream(seed);
        GPULAZY_RETURN_IF_ERROR(Stream(pages, stream, head));
        return pages.AppendZeros(size - head);
      }
      case SynthContent::kCompressible: {
        CompressibleStream stream(seed);
        return Stream(pages, stream, size);
      }
      case SynthContent::kWeights:
      case SynthContent::kDuplicate: {
        WeightsStream stream(seed);
        return Stream(pages, stream, size);
      }
    }
    return Internal("unknown synthetic content kind");
  }

 private:
  template <typename Generator>
  Status Stream(PagesFileWriter& pages, Generator& generator, uint64_t size) {
    while (size > 0) {
      size_t n = static_cast<size_t>(std::min<uint64_t>(size, buffer_.size()));
      std::span<uint8_t> piece(buffer_.data(), n);
      generator.Fill(piece);
      GPULAZY_RETURN_IF_ERROR(pages.Append(piece));
      size -= n;
    }
    return Status::Ok();
  }

  std::vector<uint8_t> buffer_;
};

uint64_t AlignUp(uint64_t value, uint64_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

}  // namespace

std::string_view SynthContentName(SynthContent content) {
  switch (content) {
    case SynthContent::kWeights:
      return "weights";
    case SynthContent::kZero:
      return "zero";
    case SynthContent::kCompressible:
      return "compressible";
    case SynthContent::kDuplicate:
      return "duplicate";
    case SynthContent::kPartialZero:
      return "partial-zero";
  }
  return "unknown";
}

Status ValidateSynthOptions(const SynthOptions& options) {
  if (options.out.empty()) return InvalidArgument("--out is required");
  if (options.gpus < 1 || options.gpus > kSynthMaxGpus)
    return InvalidArgument("--gpus {} is outside 1..{}", options.gpus, kSynthMaxGpus);
  if (options.bos < 1 || options.bos > kSynthMaxBos)
    return InvalidArgument("--bos {} is outside 1..{}", options.bos, kSynthMaxBos);
  if (options.processes < 1 || options.processes > kSynthMaxProcesses)
    return InvalidArgument("--processes {} is outside 1..{}", options.processes,
                           kSynthMaxProcesses);
  if (options.total_bytes % kSynthPageSize != 0)
    return InvalidArgument("--size {} is not a multiple of 4 KiB (BOs are whole pages)",
                           options.total_bytes);
  const uint64_t content_bos = MixFor(options.bos, options.gpus).content();
  const uint64_t minimum = content_bos * options.processes * kSynthPageSize;
  if (options.total_bytes < minimum)
    return InvalidArgument(
        "--size {} is too small: {} process(es) x {} BOs with contents need at least {} ({} "
        "bytes)",
        options.total_bytes, options.processes, content_bos, FormatSize(minimum), minimum);
  // A GPU's share must fit the largest device we pretend to be (and the VA window below).
  if (options.total_bytes / options.processes > kMi300x.vram_bytes * options.gpus)
    return InvalidArgument("--size {} does not fit {} GPU(s) of {} each",
                           FormatSize(options.total_bytes), options.gpus,
                           FormatSize(kMi300x.vram_bytes));
  return Status::Ok();
}

namespace {

// Writes the checkpoint, recording each finished file in report->files.
Status Synthesize(const SynthOptions& options, SynthReport* out_report) {
  SynthReport& report = *out_report;
  const std::vector<BoSlot> slots = MakeTemplate(options);
  // Processes are replicas: equal page budgets, process 1 takes the rounding remainder.
  const uint64_t total_pages = options.total_bytes / kSynthPageSize;
  std::vector<std::vector<uint64_t>> pages_of(options.processes);
  for (uint32_t p = 0; p < options.processes; ++p) {
    uint64_t budget = total_pages / options.processes;
    if (p == 0) budget += total_pages % options.processes;
    pages_of[p] = SplitPages(slots, budget);
  }
  std::vector<uint64_t> gpu_bytes(options.gpus, 0);
  for (uint32_t p = 0; p < options.processes; ++p)
    for (size_t i = 0; i < slots.size(); ++i)
      gpu_bytes[slots[i].gpu_index] += pages_of[p][i] * kSynthPageSize;
  const std::vector<criu::KfdDevice> devices =
      MakeDevices(options, *std::max_element(gpu_bytes.begin(), gpu_bytes.end()));

  for (const auto& device : devices)
    report.gpu_ids.push_back(device.gpu_id());
  ContentWriter writer;

  for (uint32_t p = 0; p < options.processes; ++p) {
    const uint32_t file_id = p + 1;
    Rng rng(Derive(options.seed, 0x9a1a, file_id));
    criu::KfdProcess process;
    process.set_pid(static_cast<uint32_t>(2000 + Derive(options.seed, 0x919) % 60000 + 17 * p));
    process.set_gpu_count(options.gpus);
    process.set_cpu_count(2);
    for (const auto& device : devices)
      *process.add_devices() = device;

    // VAs: ROCr reserves one big window in the process's address space and places BOs in it,
    // 2 MiB aligned when they are that large, with occasional holes of freed allocations.
    uint64_t va = 0x7f0000000000ull - (uint64_t{64} << 40) + (rng.Between(0, 255) << 30);
    uint64_t userptr_va = 0x55d000000000ull + (rng.Between(0, 4095) << 20);
    uint64_t mmap_offset = kDrmMmapBase;
    std::vector<uint32_t> next_handle(options.gpus, 0);
    std::vector<uint64_t> expected(options.gpus, 0);

    for (size_t i = 0; i < slots.size(); ++i) {
      const BoSlot& slot = slots[i];
      const uint32_t gpu_id = devices[slot.gpu_index].gpu_id();
      const uint64_t size =
          HasContent(slot) ? pages_of[p][i] * kSynthPageSize : slot.target_pages * kSynthPageSize;
      criu::KfdBo* bo = process.add_bos();
      bo->set_size(size);
      bo->set_gpu_id(gpu_id);
      bo->set_handle(next_handle[slot.gpu_index]++);
      switch (slot.kind) {
        case BoKind::kVram:
          bo->set_alloc_flags(cf::kAllocVram | cf::kAllocWritable | cf::kAllocExecutable |
                              kAllocNoSubstitute | (slot.small ? cf::kAllocPublic : 0));
          ++report.vram_bos;
          break;
        case BoKind::kGtt:
          bo->set_alloc_flags(cf::kAllocGtt | cf::kAllocWritable | cf::kAllocExecutable |
                              kAllocNoSubstitute | (rng.Next() % 2 ? kAllocCoherent : 0));
          ++report.gtt_bos;
          break;
        case BoKind::kUserptr:
          bo->set_alloc_flags(cf::kAllocUserptr | cf::kAllocWritable | cf::kAllocExecutable |
                              kAllocNoSubstitute);
          ++report.userptr_bos;
          break;
        case BoKind::kDoorbell:
          bo->set_alloc_flags(cf::kAllocDoorbell | cf::kAllocWritable | kAllocNoSubstitute |
                              kAllocUncached);
          ++report.doorbell_bos;
          break;
      }
      if (slot.kind == BoKind::kUserptr) {
        // A user pointer BO maps host memory the application allocated; KFD keeps its address.
        bo->set_gpu_va(userptr_va);
        bo->set_mmap_offset(userptr_va);
        userptr_va += size + rng.Between(0, 64) * kSynthPageSize;
      } else {
        va = AlignUp(va, size >= kTwoMiB ? kTwoMiB : kSynthPageSize);
        bo->set_gpu_va(va);
        va += size;
        if (rng.Next() % 4 == 0) va += rng.Between(1, 512) * kSynthPageSize;
        if (slot.kind == BoKind::kDoorbell) {
          bo->set_mmap_offset(kMmapTypeDoorbell | (uint64_t{gpu_id} << kMmapGpuIdShift));
        } else {
          bo->set_mmap_offset(mmap_offset);
          mmap_offset += size;
        }
      }
      if (HasContent(slot)) {
        expected[slot.gpu_index] += size;
        SynthContent content = ReportedContent(slot, file_id);
        ++report.bos_by_content[content];
        report.bytes_by_content[content] += size;
        report.bytes_by_gpu[gpu_id] += size;
        report.content_bytes += size;
      }
    }
    process.set_bo_count(static_cast<uint64_t>(process.bos_size()));
    const uint32_t queues = options.gpus * 2;
    const uint32_t events = 8 + static_cast<uint32_t>(rng.Between(0, 8));
    process.set_object_count(queues + events);
    process.set_shared_mem_size(AlignUp(uint64_t{options.bos} * 64, kSynthPageSize));
    process.set_shared_mem_magic(0x6b66644d);
    process.set_driver_private(
        MakeDriverPrivate(Derive(options.seed, 0xd41, file_id), queues, events));

    // Pages files, one per GPU with contents, BOs in table order.
    for (uint32_t g = 0; g < options.gpus; ++g) {
      if (expected[g] == 0) continue;
      const uint32_t gpu_id = devices[g].gpu_id();
      GPULAZY_ASSIGN_OR_RETURN(PagesFileWriter pages,
                               PagesFileWriter::Create(options.out, file_id, gpu_id, expected[g]));
      for (size_t i = 0; i < slots.size(); ++i) {
        if (slots[i].gpu_index != g || !HasContent(slots[i])) continue;
        GPULAZY_RETURN_IF_ERROR(writer
                                    .Write(pages, ReportedContent(slots[i], file_id),
                                           StreamSeed(options, slots, i, file_id),
                                           pages_of[p][i] * kSynthPageSize)
                                    .Context(fmt::format("writing BO {} of {}", i,
                                                         cf::PagesImageName(file_id, gpu_id))));
      }
      GPULAZY_RETURN_IF_ERROR(pages.Finish());
      report.files.push_back(cf::PagesImageName(file_id, gpu_id));
    }
    GPULAZY_RETURN_IF_ERROR(WriteKfdImage(options.out, file_id, process));
    report.files.push_back(cf::KfdImageName(file_id));
  }
  return Status::Ok();
}

}  // namespace

Result<SynthReport> SynthesizeCheckpoint(const SynthOptions& options) {
  GPULAZY_RETURN_IF_ERROR(ValidateSynthOptions(options));
  GPULAZY_RETURN_IF_ERROR(CheckOutputDirectory(options.out));
  SynthReport report;
  if (Status status = Synthesize(options, &report); !status.ok()) {
    // A checkpoint missing some of its files would only fail later and less clearly.
    for (const auto& name : report.files) {
      std::error_code ec;
      std::filesystem::remove(options.out / name, ec);
    }
    return status.Context(fmt::format("synthesizing {}", options.out.string()));
  }
  return report;
}

}  // namespace gpulazy::image
