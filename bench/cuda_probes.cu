// gpulazy-cuda-probes: two host-side limits of streaming a page-cached file into NVIDIA device
// memory, measured beside the pinned cudaMemcpy ceiling in the same run (docs/benchmarks.md,
// "Where the last 10-15 % goes"). Not part of the pipeline: each probe answers one question.
//
//   pin-page-cache FILE   Can the DMA engine read the page cache directly? mmap the file and
//                         cudaHostRegister it read-only (whole, then in pipelined windows),
//                         so no CPU copy remains; reports registration cost and throughput.
//   read-dma FILE         What do T threads reach when each fills 2 MiB chunks into its own
//                         pinned slots, (a) without DMA, (b) with DMA on its own stream? The
//                         best CPU-copy design this host allows, without gpulazy's machinery.
//                         Four fills: pread; pread + XXH3 per slice (what verification adds;
//                         once per XXH3 entry point, proto/checksum_variants.h);
//                         from an mmap of the file, XXH3 per slice then a streaming-store copy,
//                         and that copy alone (one read of the page cache, no read-for-
//                         ownership of the slot).
//   hash-slices FILE      Where does verification's cost in read-dma come from? The same
//                         readers (16 threads, 4 pinned slots each, DMA on their own
//                         streams), each chunk hashed in slices of 16 KiB to 2 MiB right after
//                         each slice is read, or read into a small bounce buffer, hashed there
//                         and copied to the slot with streaming stores; rounds in rotating order.
//   pin-overlap FILE      Does registering page-cache windows (cudaHostRegister) run beside
//                         DMA, or stall it? Pinned copies alone, register/unregister alone,
//                         both at once, and both with the registered windows copied too (a
//                         hybrid: part zero-copy, part from pinned memory).
//   ipc-dma FILE          Can a page server on the same host DMA from its page cache, kept
//                         registered across restores, into memory the restoring process
//                         exported, with every chunk verified on the GPU before it is
//                         installed? (ipc::IpcDma below.)
//   pinned-cache FILE     The same question the other way round: the server holds the image in
//                         pinned host memory it shares by descriptor, and the restoring process
//                         maps it and DMAs from it itself (pinned_cache::PinnedCache below).
//   ipc-open-overlap TOTAL_MIB [BUFFERS=8 COPY_MIB=16384]
//                         Does opening CUDA IPC handles (TOTAL_MIB in BUFFERS allocations of
//                         another process) stall DMA running meanwhile, in this process or from
//                         another one? (open_overlap::Run below.)
//   pin-cost TOTAL_MIB    What does a staging ring of TOTAL_MIB cost to make before a restore
//                         may resume? Per-slot cudaMallocHost (2 and 4 MiB), one allocation,
//                         and cudaHostRegister of memory we fault in ourselves (4 KiB pages or
//                         transparent huge pages); also the device allocations of a 36-BO model.
//
// Output: one JSON object per line. The file should be in the page cache (each probe reads it
// once first). Written for measurement, so errors abort with a message.
#include <cuda.h>
#include <cuda_runtime.h>
#include <emmintrin.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t by value
#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "page-client/cuda/verify_kernel.h"
#include "proto/checksum_variants.h"
#include "proto/xxh3_blocks.h"

namespace {

void Check(cudaError_t error, const char* what) {
  if (error == cudaSuccess) return;
  std::fprintf(stderr, "gpulazy-cuda-probes: %s: %s\n", what, cudaGetErrorString(error));
  std::exit(1);
}

using Clock = std::chrono::steady_clock;
double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kCeilingCopy = 64 * kMiB;

struct File {
  int fd = -1;
  size_t size = 0;
  explicit File(const char* path) : fd(::open(path, O_RDONLY | O_CLOEXEC)) {
    if (fd < 0) {
      std::perror(path);
      std::exit(1);
    }
    size = static_cast<size_t>(::lseek(fd, 0, SEEK_END));
  }
  ~File() { ::close(fd); }
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  void ReadFully(char* into, size_t length, size_t offset) const {
    size_t got = 0;
    while (got < length) {
      ssize_t n = ::pread(fd, into + got, length - got, static_cast<off_t>(offset + got));
      if (n <= 0) {
        std::perror("pread");
        std::exit(1);
      }
      got += static_cast<size_t>(n);
    }
  }
  void WarmPageCache() const {
    std::vector<char> buffer(kCeilingCopy);
    for (size_t offset = 0; offset < size; offset += buffer.size())
      ReadFully(buffer.data(), std::min(buffer.size(), size - offset), offset);
  }
};

// The pinned-buffer host-to-device rate: one 64 MiB pinned buffer copied over `size` bytes.
double CeilingBps(void* device, size_t size) {
  void* pinned = nullptr;
  Check(cudaMallocHost(&pinned, kCeilingCopy), "pinning the ceiling buffer");
  std::memset(pinned, 1, kCeilingCopy);
  cudaStream_t stream = nullptr;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "creating a stream");
  Check(cudaMemcpy(device, pinned, kCeilingCopy, cudaMemcpyHostToDevice), "warm-up copy");
  const auto start = Clock::now();
  for (size_t offset = 0; offset + kCeilingCopy <= size; offset += kCeilingCopy)
    Check(cudaMemcpyAsync(static_cast<char*>(device) + offset, pinned, kCeilingCopy,
                          cudaMemcpyHostToDevice, stream),
          "ceiling copy");
  Check(cudaStreamSynchronize(stream), "ceiling copy");
  const double bps = static_cast<double>(size / kCeilingCopy * kCeilingCopy) / SecondsSince(start);
  cudaStreamDestroy(stream);
  cudaFreeHost(pinned);
  std::printf("{\"probe\":\"ceiling\",\"pinned_cudaMemcpy_GBps\":%.2f}\n", bps / 1e9);
  return bps;
}

bool SampleMatches(const File& file, const void* device, size_t offset) {
  std::vector<char> got(kMiB);
  std::vector<char> want(kMiB);
  Check(cudaMemcpy(got.data(), static_cast<const char*>(device) + offset, kMiB,
                   cudaMemcpyDeviceToHost),
        "reading a sample back");
  file.ReadFully(want.data(), kMiB, offset);
  return got == want;
}

void PinPageCache(const File& file, size_t window, int in_flight) {
  const size_t size = file.size / window * window;
  void* device = nullptr;
  Check(cudaMalloc(&device, size), "allocating device memory");
  const double ceiling = CeilingBps(device, size);
  void* mapped = ::mmap(nullptr, size, PROT_READ, MAP_SHARED | MAP_POPULATE, file.fd, 0);
  if (mapped == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  char* const base = static_cast<char*>(mapped);
  std::vector<cudaStream_t> streams(4);
  for (cudaStream_t& s : streams)
    Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "creating a stream");

  // Whole file: register, copy, unregister.
  for (int round = 0; round < 2; ++round) {
    const auto start = Clock::now();
    Check(cudaHostRegister(base, size, cudaHostRegisterReadOnly), "registering the mapping");
    const double registered = SecondsSince(start);
    const auto copy_start = Clock::now();
    for (size_t offset = 0; offset < size; offset += kCeilingCopy)
      Check(cudaMemcpyAsync(static_cast<char*>(device) + offset, base + offset,
                            std::min(kCeilingCopy, size - offset), cudaMemcpyHostToDevice,
                            streams[(offset / kCeilingCopy) % streams.size()]),
            "copying from the registered mapping");
    Check(cudaDeviceSynchronize(), "copying from the registered mapping");
    const double copied = SecondsSince(copy_start);
    Check(cudaHostUnregister(base), "unregistering the mapping");
    const double total = SecondsSince(start);
    std::printf(
        "{\"probe\":\"pin-page-cache\",\"mode\":\"whole\",\"register_s\":%.3f,\"copy_GBps\":%.2f,"
        "\"end_to_end_GBps\":%.2f,\"ratio\":%.3f,\"sample_ok\":%s}\n",
        registered, static_cast<double>(size) / copied / 1e9,
        static_cast<double>(size) / total / 1e9, static_cast<double>(size) / total / ceiling,
        SampleMatches(file, device, size / 2) ? "true" : "false");
  }

  // Windows: a thread registers window i+k while window i is copied; unregister after its event.
  for (int round = 0; round < 2; ++round) {
    const size_t windows = size / window;
    std::mutex mu;
    std::condition_variable changed;
    size_t registered = 0;  // windows [0, registered) are registered
    size_t released = 0;    // windows [0, released) are copied and unregistered
    const auto start = Clock::now();
    std::thread registrar([&] {
      for (size_t i = 0; i < windows; ++i) {
        {
          std::unique_lock lock(mu);
          changed.wait(lock, [&] { return i < released + static_cast<size_t>(in_flight); });
        }
        Check(cudaHostRegister(base + i * window, window, cudaHostRegisterReadOnly),
              "registering a window");
        {
          std::lock_guard lock(mu);
          registered = i + 1;
        }
        changed.notify_all();
      }
    });
    std::deque<std::pair<size_t, cudaEvent_t>> pending;
    auto release_front = [&] {
      Check(cudaEventSynchronize(pending.front().second), "waiting for a window's copy");
      Check(cudaHostUnregister(base + pending.front().first * window), "unregistering a window");
      cudaEventDestroy(pending.front().second);
      pending.pop_front();
      {
        std::lock_guard lock(mu);
        ++released;
      }
      changed.notify_all();
    };
    for (size_t i = 0; i < windows; ++i) {
      {
        std::unique_lock lock(mu);
        changed.wait(lock, [&] { return i < registered; });
      }
      cudaEvent_t done = nullptr;
      Check(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), "creating an event");
      Check(cudaMemcpyAsync(static_cast<char*>(device) + i * window, base + i * window, window,
                            cudaMemcpyHostToDevice, streams[i % streams.size()]),
            "copying a window");
      Check(cudaEventRecord(done, streams[i % streams.size()]), "recording an event");
      pending.emplace_back(i, done);
      while (pending.size() >= static_cast<size_t>(in_flight))
        release_front();
    }
    while (!pending.empty())
      release_front();
    registrar.join();
    const double seconds = SecondsSince(start);
    std::printf(
        "{\"probe\":\"pin-page-cache\",\"mode\":\"windows\",\"window_MiB\":%zu,\"in_flight\":%d,"
        "\"end_to_end_GBps\":%.2f,\"ratio\":%.3f,\"sample_ok\":%s}\n",
        window / kMiB, in_flight, static_cast<double>(size) / seconds / 1e9,
        static_cast<double>(size) / seconds / ceiling,
        SampleMatches(file, device, size / 3 / kMiB * kMiB) ? "true" : "false");
  }
  for (cudaStream_t s : streams)
    cudaStreamDestroy(s);
  ::munmap(mapped, size);
  cudaFree(device);
}

// pin-overlap: a thread copies from a pinned buffer for `seconds` while another registers and
// unregisters `window`-sized pieces of the file's mapping (and, with `copy_windows`, copies each
// registered piece to the device before unregistering it).
struct OverlapRates {
  double pinned_GBps = 0;
  double windows_GBps = 0;  // windows registered (and copied, if asked) per second, as bytes
  double register_ms = 0;   // mean per window
  double unregister_ms = 0;
};

OverlapRates Overlap(const File& file, char* base, void* device, size_t window, bool copy_pinned,
                     bool cycle_windows, bool copy_windows, double seconds) {
  OverlapRates rates;
  std::atomic<bool> stop{false};
  std::thread pinned_copier;
  std::atomic<size_t> pinned_bytes{0};
  double pinned_seconds = 0;
  if (copy_pinned) {
    pinned_copier = std::thread([&] {
      void* pinned = nullptr;
      Check(cudaMallocHost(&pinned, kCeilingCopy), "pinning a copy buffer");
      std::memset(pinned, 1, kCeilingCopy);
      cudaStream_t stream = nullptr;
      Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "creating a stream");
      const auto start = Clock::now();
      // Two copies in flight at a time: the stream never drains between them.
      while (!stop.load(std::memory_order_relaxed)) {
        for (int i = 0; i < 4; ++i)
          Check(cudaMemcpyAsync(static_cast<char*>(device) + (i % 2) * kCeilingCopy, pinned,
                                kCeilingCopy, cudaMemcpyHostToDevice, stream),
                "pinned copy");
        Check(cudaStreamSynchronize(stream), "pinned copy");
        pinned_bytes += 4 * kCeilingCopy;
      }
      pinned_seconds = SecondsSince(start);
      cudaStreamDestroy(stream);
      cudaFreeHost(pinned);
    });
  }
  size_t windows_done = 0;
  double register_s = 0, unregister_s = 0;
  const auto start = Clock::now();
  if (cycle_windows) {
    cudaStream_t stream = nullptr;
    Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "creating a stream");
    const size_t windows = file.size / window;
    // The device side of the copied windows: past the pinned copier's two buffers.
    char* const target = static_cast<char*>(device) + 2 * kCeilingCopy;
    while (SecondsSince(start) < seconds) {
      char* const piece = base + (windows_done % windows) * window;
      auto t0 = Clock::now();
      Check(cudaHostRegister(piece, window, cudaHostRegisterReadOnly), "registering a window");
      register_s += SecondsSince(t0);
      if (copy_windows) {
        Check(cudaMemcpyAsync(target, piece, window, cudaMemcpyHostToDevice, stream),
              "copying a registered window");
        Check(cudaStreamSynchronize(stream), "copying a registered window");
      }
      t0 = Clock::now();
      Check(cudaHostUnregister(piece), "unregistering a window");
      unregister_s += SecondsSince(t0);
      ++windows_done;
    }
    cudaStreamDestroy(stream);
  } else {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  }
  const double elapsed = SecondsSince(start);
  stop = true;
  if (pinned_copier.joinable()) pinned_copier.join();
  if (copy_pinned) rates.pinned_GBps = static_cast<double>(pinned_bytes) / pinned_seconds / 1e9;
  if (windows_done > 0) {
    rates.windows_GBps = static_cast<double>(windows_done * window) / elapsed / 1e9;
    rates.register_ms = register_s / static_cast<double>(windows_done) * 1e3;
    rates.unregister_ms = unregister_s / static_cast<double>(windows_done) * 1e3;
  }
  return rates;
}

void PinOverlap(const File& file, size_t window) {
  const size_t size = file.size / window * window;
  void* device = nullptr;
  Check(cudaMalloc(&device, 2 * kCeilingCopy + window), "allocating device memory");
  void* mapped = ::mmap(nullptr, size, PROT_READ, MAP_SHARED | MAP_POPULATE, file.fd, 0);
  if (mapped == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  struct Case {
    const char* name;
    bool copy_pinned, cycle_windows, copy_windows;
  };
  const Case cases[] = {{"pinned_alone", true, false, false},
                        {"register_alone", false, true, false},
                        {"pinned_while_registering", true, true, false},
                        {"zero_copy_alone", false, true, true},
                        {"pinned_and_zero_copy", true, true, true}};
  for (int round = 0; round < 2; ++round) {
    for (const Case& c : cases) {
      const OverlapRates r = Overlap(file, static_cast<char*>(mapped), device, window,
                                     c.copy_pinned, c.cycle_windows, c.copy_windows, 1.0);
      std::printf(
          "{\"probe\":\"pin-overlap\",\"case\":\"%s\",\"window_MiB\":%zu,\"pinned_GBps\":%.2f,"
          "\"windows_GBps\":%.2f,\"total_GBps\":%.2f,\"register_ms\":%.3f,\"unregister_ms\":%.3f}"
          "\n",
          c.name, window / kMiB, r.pinned_GBps, r.windows_GBps,
          r.pinned_GBps + (c.copy_windows ? r.windows_GBps : 0), r.register_ms, r.unregister_ms);
    }
  }
  ::munmap(mapped, size);
  cudaFree(device);
}

// How a reader fills its pinned slot with one chunk.
enum class Fill {
  kPread,       // pread into the slot (LocalRestore on a checkpoint without checksums)
  kPreadHash,   // pread slice by slice, each slice hashed after it lands (by reference)
  kMappedHash,  // from a mapping of the file: hash a slice, then copy it with streaming stores
  kMapped,      // from a mapping of the file: copy with streaming stores, no hash
  kBounceHash,  // pread a slice into a small buffer, hash it there, stream it into the slot
};
const char* FillName(Fill fill) {
  switch (fill) {
    case Fill::kPread:
      return "pread";
    case Fill::kPreadHash:
      return "pread+xxh3";
    case Fill::kMappedHash:
      return "mmap+xxh3+nt";
    case Fill::kMapped:
      return "mmap+nt";
    case Fill::kBounceHash:
      return "pread-bounce+xxh3+nt";
  }
  return "?";
}

constexpr size_t kSliceBytes = 256 * 1024;

// The XXH3 entry points (proto/checksum_variants.h): the plain library and its CPU dispatch.
using Hasher = gpulazy::checksum_internal::Xxh3Variant;

bool Hashes(Fill fill) {
  return fill == Fill::kPreadHash || fill == Fill::kMappedHash || fill == Fill::kBounceHash;
}

// Streaming (non-temporal) stores: the slot's lines go to memory without being read first (no
// read-for-ownership) and without evicting the cache, which is where the DMA engine reads them.
void CopyStreaming(char* to, const char* from, size_t length) {
  size_t i = 0;
  for (; i + 64 <= length; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(to + i + 48), d);
  }
  std::memcpy(to + i, from + i, length - i);
}

// How one case fills its slots.
struct FillPlan {
  Fill fill = Fill::kPread;
  const Hasher* hasher = nullptr;
  size_t slice = kSliceBytes;  // the hashing fills' unit: read (or copy), then hash
};

// One chunk into `slot`; returns its XXH3 (0 when the fill does not hash). `bounce` holds at
// least plan.slice bytes (kBounceHash only).
uint64_t FillSlot(const FillPlan& plan, const File& file, const char* mapped, char* slot,
                  size_t length, size_t offset, XXH3_state_t* state, char* bounce) {
  const size_t slice = plan.slice;
  switch (plan.fill) {
    case Fill::kPread:
      file.ReadFully(slot, length, offset);
      return 0;
    case Fill::kPreadHash:
      XXH3_64bits_reset(state);
      for (size_t done = 0; done < length; done += slice) {
        const size_t n = std::min(slice, length - done);
        file.ReadFully(slot + done, n, offset + done);
        plan.hasher->update(state, slot + done, n);
      }
      return XXH3_64bits_digest(state);
    case Fill::kBounceHash:
      XXH3_64bits_reset(state);
      for (size_t done = 0; done < length; done += slice) {
        const size_t n = std::min(slice, length - done);
        file.ReadFully(bounce, n, offset + done);
        plan.hasher->update(state, bounce, n);
        CopyStreaming(slot + done, bounce, n);
      }
      _mm_sfence();
      return XXH3_64bits_digest(state);
    case Fill::kMappedHash:
    case Fill::kMapped: {
      const char* from = mapped + offset;
      // One call maps the chunk's cached pages instead of a fault per 16 of them.
      if (::madvise(const_cast<char*>(from), length, MADV_POPULATE_READ) != 0) {
        std::perror("madvise(MADV_POPULATE_READ)");
        std::exit(1);
      }
      if (plan.fill == Fill::kMappedHash) XXH3_64bits_reset(state);
      for (size_t done = 0; done < length; done += slice) {
        const size_t n = std::min(slice, length - done);
        if (plan.fill == Fill::kMappedHash) plan.hasher->update(state, from + done, n);
        CopyStreaming(slot + done, from + done, n);
      }
      _mm_sfence();  // the streaming stores are visible before the DMA is queued
      return plan.fill == Fill::kMappedHash ? XXH3_64bits_digest(state) : 0;
    }
  }
  return 0;
}

// The XXH3 of every chunk of the file, once, to check each hashing fill against.
std::vector<uint64_t> ChunkHashes(const File& file, size_t chunk_bytes, size_t chunks) {
  std::vector<uint64_t> want(chunks);
  std::vector<char> buffer(chunk_bytes);
  for (size_t chunk = 0; chunk < chunks; ++chunk) {
    file.ReadFully(buffer.data(), chunk_bytes, chunk * chunk_bytes);
    want[chunk] = XXH3_64bits(buffer.data(), chunk_bytes);
  }
  return want;
}

// One case of T readers filling their own pinned slots (0 slots a thread: read only, no DMA),
// the whole file once; prints one JSON line. `device` holds the file's size.
void RunReadCase(const File& file, void* device, size_t chunk_bytes, double ceiling,
                 const std::vector<uint64_t>& want, const FillPlan& plan, int threads,
                 int slots_per_thread, const char* probe_name) {
  const size_t chunks = want.size();
  const size_t size = chunks * chunk_bytes;
  const Fill fill = plan.fill;
  const bool dma = slots_per_thread > 0;
  const int slots = dma ? slots_per_thread : 1;
  std::vector<void*> pinned(static_cast<size_t>(threads * slots));
  for (void*& p : pinned)
    Check(cudaMallocHost(&p, chunk_bytes), "pinning a slot");
  std::vector<cudaStream_t> streams(static_cast<size_t>(threads));
  for (cudaStream_t& s : streams)
    Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "creating a stream");
  std::vector<cudaEvent_t> events(pinned.size());
  for (cudaEvent_t& ev : events)
    Check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "creating an event");
  std::atomic<size_t> next{0};
  std::atomic<size_t> mismatches{0};
  const bool maps = fill == Fill::kMappedHash || fill == Fill::kMapped;
  const auto start = Clock::now();
  // Mapped and unmapped inside the timed part: a restore would pay for both.
  char* mapped = nullptr;
  if (maps) {
    void* m = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, file.fd, 0);
    if (m == MAP_FAILED) {
      std::perror("mmap");
      std::exit(1);
    }
    mapped = static_cast<char*>(m);
  }
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&, t] {
      auto state_storage = std::make_unique<XXH3_state_t>();
      XXH3_state_t* state = state_storage.get();
      std::vector<char> bounce(fill == Fill::kBounceHash ? plan.slice : 0);
      std::vector<bool> used(static_cast<size_t>(slots), false);
      for (size_t turn = 0;; ++turn) {
        const size_t chunk = next.fetch_add(1);
        if (chunk >= chunks) break;
        const size_t j = turn % static_cast<size_t>(slots);
        const size_t slot = static_cast<size_t>(t * slots) + j;
        if (used[j]) Check(cudaEventSynchronize(events[slot]), "waiting for a slot's copy");
        const uint64_t hash = FillSlot(plan, file, mapped, static_cast<char*>(pinned[slot]),
                                       chunk_bytes, chunk * chunk_bytes, state, bounce.data());
        if (Hashes(fill) && hash != want[chunk]) mismatches.fetch_add(1);
        if (!dma) continue;
        Check(cudaMemcpyAsync(static_cast<char*>(device) + chunk * chunk_bytes, pinned[slot],
                              chunk_bytes, cudaMemcpyHostToDevice, streams[static_cast<size_t>(t)]),
              "copying a chunk");
        Check(cudaEventRecord(events[slot], streams[static_cast<size_t>(t)]), "recording an event");
        used[j] = true;
      }
      Check(cudaStreamSynchronize(streams[static_cast<size_t>(t)]), "draining a stream");
    });
  }
  for (std::thread& w : workers)
    w.join();
  if (maps) ::munmap(mapped, size);
  const double bps = static_cast<double>(size) / SecondsSince(start);
  std::printf(
      "{\"probe\":\"%s\",\"fill\":\"%s\",\"xxh3\":\"%s\",\"mode\":\"%s\","
      "\"chunk_KiB\":%zu,\"slice_KiB\":%zu,"
      "\"threads\":%d,\"slots_per_thread\":%d,\"GBps\":%.2f,\"ratio\":%.3f,"
      "\"hash_mismatches\":%zu,\"sample_ok\":%s}\n",
      probe_name, FillName(fill), Hashes(fill) ? std::string(plan.hasher->name).c_str() : "none",
      dma ? "read+dma" : "read-only", chunk_bytes >> 10, Hashes(fill) ? plan.slice >> 10 : 0,
      threads, slots_per_thread, bps / 1e9, bps / ceiling, mismatches.load(),
      !dma || SampleMatches(file, device, size / 3 / chunk_bytes * chunk_bytes) ? "true" : "false");
  std::fflush(stdout);
  Check(cudaMemset(device, 0, size), "clearing device memory between cases");
  // The next case's streams do not wait for the legacy stream's memset.
  Check(cudaDeviceSynchronize(), "clearing device memory between cases");
  for (cudaEvent_t ev : events)
    cudaEventDestroy(ev);
  for (cudaStream_t s : streams)
    cudaStreamDestroy(s);
  for (void* p : pinned)
    cudaFreeHost(p);
}

void ReadDma(const File& file, size_t chunk_bytes) {
  const size_t chunks = file.size / chunk_bytes;
  void* device = nullptr;
  Check(cudaMalloc(&device, chunks * chunk_bytes), "allocating device memory");
  const double ceiling = CeilingBps(device, chunks * chunk_bytes);
  const std::vector<uint64_t> want = ChunkHashes(file, chunk_bytes, chunks);
  // Each fill once, the hashing pread with every XXH3 entry point available.
  const Hasher& selected = gpulazy::checksum_internal::SelectedXxh3();
  std::vector<FillPlan> plans = {{Fill::kPread, &selected}};
  for (const Hasher* hasher : gpulazy::checksum_internal::AvailableXxh3Variants())
    plans.push_back({Fill::kPreadHash, hasher});
  plans.push_back({Fill::kMappedHash, &selected});
  plans.push_back({Fill::kMapped, &selected});
  for (const FillPlan& plan : plans) {
    for (int threads : {16, 24}) {
      // 0: read only, no DMA (the pread fill only)
      for (int slots_per_thread : {0, 2, 4}) {
        if (slots_per_thread == 0 && plan.fill != Fill::kPread) continue;
        RunReadCase(file, device, chunk_bytes, ceiling, want, plan, threads, slots_per_thread,
                    "read-dma");
      }
    }
  }
  cudaFree(device);
}

// Verification's cost by where the hash reads its bytes: slices small enough to stay in L1 or
// L2 after their read, or a bounce buffer the slot is then streamed from. Each round runs every
// case once, rotated so no case always runs first; the ceiling is measured once per round.
void HashSlices(const File& file, size_t chunk_bytes, int rounds) {
  const size_t chunks = file.size / chunk_bytes;
  void* device = nullptr;
  Check(cudaMalloc(&device, chunks * chunk_bytes), "allocating device memory");
  const std::vector<uint64_t> want = ChunkHashes(file, chunk_bytes, chunks);
  const Hasher& selected = gpulazy::checksum_internal::SelectedXxh3();
  std::vector<FillPlan> plans = {{Fill::kPread, &selected}};
  for (size_t kib : {16, 64, 256, 2048})
    if (kib * 1024 <= chunk_bytes) plans.push_back({Fill::kPreadHash, &selected, kib * 1024});
  for (size_t kib : {64, 256})
    if (kib * 1024 <= chunk_bytes) plans.push_back({Fill::kBounceHash, &selected, kib * 1024});
  for (int round = 0; round < rounds; ++round) {
    const double ceiling = CeilingBps(device, chunks * chunk_bytes);
    for (size_t i = 0; i < plans.size(); ++i) {
      const FillPlan& plan = plans[(i + static_cast<size_t>(round)) % plans.size()];
      RunReadCase(file, device, chunk_bytes, ceiling, want, plan, 16, 4, "hash-slices");
    }
  }
  cudaFree(device);
}

// Each way of making `total` bytes of pinned staging memory, timed (3 rounds, the median
// printed): what the CUDA engine's resume pays before a lazy restore lets the program run.
void PinCost(size_t total) {
  const auto init_start = Clock::now();
  Check(cudaFree(nullptr), "creating the CUDA context");
  std::printf("{\"probe\":\"pin-cost\",\"case\":\"context\",\"ms\":%.2f}\n",
              SecondsSince(init_start) * 1e3);
  auto report = [&](const char* what, std::vector<double> ms) {
    std::sort(ms.begin(), ms.end());
    std::printf(
        "{\"probe\":\"pin-cost\",\"case\":\"%s\",\"total_mib\":%zu,\"ms\":[%.2f,%.2f,%.2f],"
        "\"median_ms\":%.2f}\n",
        what, total / kMiB, ms[0], ms[1], ms[2], ms[1]);
    std::fflush(stdout);
  };
  for (size_t slot : {2 * kMiB, 4 * kMiB}) {
    std::vector<double> ms;
    for (int round = 0; round < 3; ++round) {
      std::vector<void*> slots(total / slot);
      const auto start = Clock::now();
      for (void*& p : slots)
        Check(cudaMallocHost(&p, slot), "pinning a slot");
      ms.push_back(SecondsSince(start) * 1e3);
      for (void* p : slots)
        cudaFreeHost(p);
    }
    report(slot == 2 * kMiB ? "cudaMallocHost_per_2MiB_slot" : "cudaMallocHost_per_4MiB_slot", ms);
  }
  {
    std::vector<double> ms;
    for (int round = 0; round < 3; ++round) {
      void* p = nullptr;
      const auto start = Clock::now();
      Check(cudaMallocHost(&p, total), "pinning the ring at once");
      ms.push_back(SecondsSince(start) * 1e3);
      cudaFreeHost(p);
    }
    report("cudaMallocHost_one", ms);
  }
  for (bool huge : {false, true}) {
    std::vector<double> touch_ms;
    std::vector<double> register_ms;
    for (int round = 0; round < 3; ++round) {
      const auto start = Clock::now();
      void* p = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) {
        std::perror("mmap");
        std::exit(1);
      }
      ::madvise(p, total, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
      std::memset(p, 0, total);
      touch_ms.push_back(SecondsSince(start) * 1e3);
      const auto registered = Clock::now();
      Check(cudaHostRegister(p, total, cudaHostRegisterDefault), "registering");
      register_ms.push_back(SecondsSince(registered) * 1e3);
      cudaHostUnregister(p);
      ::munmap(p, total);
    }
    report(huge ? "thp_touch" : "4k_touch", touch_ms);
    report(huge ? "thp_cudaHostRegister" : "4k_cudaHostRegister", register_ms);
  }
  {
    // A 3.1 GB model as 36 BOs (the layers bench's shape, roughly): its device allocations.
    std::vector<double> ms;
    for (int round = 0; round < 3; ++round) {
      std::vector<void*> bos(36);
      const auto start = Clock::now();
      for (void*& p : bos)
        Check(cudaMalloc(&p, 86 * kMiB), "allocating a BO");
      ms.push_back(SecondsSince(start) * 1e3);
      for (void* p : bos)
        cudaFree(p);
    }
    report("cudaMalloc_36_BOs_of_86MiB", ms);
  }
}

// ipc-dma: a page server on the restoring process's host that keeps its image's page cache
// registered for DMA (cudaHostRegister once, as a long-lived server could) and copies chunks
// straight from it into device memory the restoring process exported (cudaIpcGetMemHandle).
// The "client" is a second process, forked before either touches CUDA: it owns the device
// memory, a staging ring of SLOTS chunks and one interprocess event per slot. For each
// chunk the server queues the DMA into a free slot, records the slot's event and names chunk and
// slot in a message; the client makes its verify stream wait for that event, runs the verify
// kernel (XXH3 of the staged bytes against the chunk's expected hash, installed into the
// destination only if it matches) and hands the slot back once the verdict is in. So no CPU copy
// and no host round trip per chunk stands between the page cache and the check.
// "server-verified" runs the same kernel in the server's own context instead (the server supplies
// the expected hashes in any case), so no work of two contexts interleaves per chunk. "direct"
// copies into the destination with no check, the upper bound of the route. The first verified round
// is a control: one chunk's expected hash is wrong, and exactly one mismatch must be counted.
namespace ipc {

constexpr uint32_t kMaxIpcSlots = 256;

struct Shape {
  uint32_t slots = 32;     // staging slots of one chunk each
  int verify_streams = 4;  // the client's; slot s verifies on stream s % verify_streams
  int copy_streams = 4;    // the server's (the CUDA engine's default is 4)
};

enum Kind : uint32_t { kStart = 1, kPlace, kFree, kRoundDone, kQuit };
enum Mode : uint32_t { kVerified = 1, kDirect, kServerVerified };

struct Message {
  uint32_t kind = 0;
  uint32_t slot = 0;   // kPlace, kFree; kStart: the mode
  uint64_t chunk = 0;  // kPlace; kRoundDone: mismatches (verified) or samples wrong (direct)
};

struct Handles {
  cudaIpcMemHandle_t staging;
  cudaIpcMemHandle_t destination;
  cudaIpcEventHandle_t events[kMaxIpcSlots];
};

void SendAll(int fd, const void* data, size_t length) {
  if (::send(fd, data, length, MSG_NOSIGNAL) != static_cast<ssize_t>(length)) {
    std::perror("ipc-dma: send");
    std::exit(1);
  }
}
void RecvAll(int fd, void* data, size_t length) {
  if (::recv(fd, data, length, MSG_WAITALL) != static_cast<ssize_t>(length)) {
    std::fprintf(stderr, "ipc-dma: the other process closed the socket\n");
    std::exit(1);
  }
}
void Send(int fd, Message m) {
  SendAll(fd, &m, sizeof m);
}
Message Recv(int fd) {
  Message m;
  RecvAll(fd, &m, sizeof m);
  return m;
}

// The verify kernel's memory for a ring of `slots` chunks, in the calling process's context.
struct VerifyRing {
  uint8_t* secret = nullptr;
  uint8_t* sums = nullptr;
  size_t sums_stride = 0;
  uint32_t* arrivals = nullptr;
  uint32_t* verdicts = nullptr;  // pinned, mapped for the device
  uint32_t* mapped_verdicts = nullptr;

  VerifyRing(uint32_t slots, size_t chunk_bytes) {
    uint8_t secret_bytes[gpulazy::xxh3::kSecretBytes];
    XXH3_generateSecret_fromSeed(secret_bytes, 0);
    Check(cudaMalloc(&secret, sizeof secret_bytes), "allocating the secret");
    Check(cudaMemcpy(secret, secret_bytes, sizeof secret_bytes, cudaMemcpyHostToDevice),
          "copying the secret");
    sums_stride = (gpulazy::client::cuda::BlockSumBytes(chunk_bytes) + 255) / 256 * 256;
    Check(cudaMalloc(&sums, sums_stride * slots), "allocating block sums");
    Check(cudaMalloc(&arrivals, sizeof(uint32_t) * slots), "allocating counters");
    Check(cudaMemset(arrivals, 0, sizeof(uint32_t) * slots), "clearing counters");
    Check(cudaHostAlloc(reinterpret_cast<void**>(&verdicts), sizeof(uint32_t) * slots,
                        cudaHostAllocMapped),
          "allocating verdicts");
    Check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&mapped_verdicts), verdicts, 0),
          "mapping verdicts");
  }
  // Queues slot `s`'s check of `staged` against `expected`, installing into `destination`.
  void Launch(uint32_t s, const uint8_t* staged, uint8_t* destination, size_t length,
              uint64_t expected, cudaStream_t stream) {
    verdicts[s] = gpulazy::client::cuda::kVerdictPending;
    gpulazy::client::cuda::VerifyJob job;
    job.staged = staged;
    job.destination = destination;
    job.length = length;
    job.expected = expected;
    job.secret = secret;
    job.block_sums = reinterpret_cast<uint64_t*>(sums + sums_stride * s);
    job.arrivals = arrivals + s;
    job.verdict = mapped_verdicts + s;
    Check(gpulazy::client::cuda::LaunchVerifyAndInstall(job, stream), "verifying a chunk");
  }
  bool Matched(uint32_t s) const {
    return static_cast<volatile uint32_t*>(verdicts)[s] == gpulazy::client::cuda::kVerdictMatches;
  }
};

// The restoring process: device memory, staging ring, verification.
int Client(const File& file, size_t chunk_bytes, size_t chunks, Shape shape, int fd) {
  const uint32_t slots = shape.slots;
  const size_t size = chunks * chunk_bytes;
  const std::vector<uint64_t> want = ChunkHashes(file, chunk_bytes, chunks);
  Check(cudaSetDevice(0), "client: selecting the device");
  uint8_t* destination = nullptr;
  uint8_t* staging = nullptr;
  Check(cudaMalloc(&destination, size), "client: allocating the destination");
  Check(cudaMalloc(&staging, chunk_bytes * slots), "client: allocating the staging ring");
  VerifyRing ring(slots, chunk_bytes);
  Handles handles{};
  Check(cudaIpcGetMemHandle(&handles.staging, staging), "client: exporting the staging ring");
  Check(cudaIpcGetMemHandle(&handles.destination, destination),
        "client: exporting the destination");
  std::vector<cudaEvent_t> placed(slots);
  std::vector<cudaEvent_t> verified(slots);
  for (uint32_t s = 0; s < slots; ++s) {
    Check(cudaEventCreateWithFlags(&placed[s], cudaEventDisableTiming | cudaEventInterprocess),
          "client: creating an interprocess event");
    Check(cudaIpcGetEventHandle(&handles.events[s], placed[s]), "client: exporting an event");
    Check(cudaEventCreateWithFlags(&verified[s], cudaEventDisableTiming),
          "client: creating an event");
  }
  std::vector<cudaStream_t> streams(static_cast<size_t>(shape.verify_streams));
  for (cudaStream_t& s : streams)
    Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "client: creating a stream");
  SendAll(fd, &handles, sizeof handles);

  bool control_done = false;
  for (;;) {
    const Message start = Recv(fd);
    if (start.kind == kQuit) break;
    if (start.slot != kVerified) {
      (void)Recv(fd);  // the server's kRoundDone: its copies (and checks) have completed
      uint64_t wrong = 0;
      for (size_t offset : {size_t{0}, size / 3 / chunk_bytes * chunk_bytes, size - chunk_bytes})
        wrong += SampleMatches(file, destination, offset) ? 0 : 1;
      // Cleared before the reply: the server's next round writes here as soon as it has it.
      Check(cudaMemset(destination, 0, size), "client: clearing the destination");
      Check(cudaDeviceSynchronize(), "client: clearing the destination");
      Send(fd, {kRoundDone, 0, wrong});
      continue;
    }
    // The control round: one wrong expected hash.
    const size_t wrong_chunk = control_done ? chunks : 7;
    std::mutex mu;
    std::condition_variable queued;
    std::deque<std::pair<uint32_t, uint64_t>> in_flight;  // slot, chunk
    uint64_t mismatches = 0;
    std::thread reaper([&] {
      for (size_t done = 0; done < chunks; ++done) {
        std::pair<uint32_t, uint64_t> next;
        {
          std::unique_lock lock(mu);
          queued.wait(lock, [&] { return !in_flight.empty(); });
          next = in_flight.front();
          in_flight.pop_front();
        }
        Check(cudaEventSynchronize(verified[next.first]), "client: waiting for a verdict");
        if (!ring.Matched(next.first)) ++mismatches;
        Send(fd, {kFree, next.first, 0});
      }
    });
    for (size_t received = 0; received < chunks; ++received) {
      const Message place = Recv(fd);
      const uint32_t s = place.slot;
      cudaStream_t stream = streams[s % streams.size()];
      Check(cudaStreamWaitEvent(stream, placed[s], 0), "client: waiting for a placement");
      ring.Launch(s, staging + chunk_bytes * s, destination + chunk_bytes * place.chunk,
                  chunk_bytes, want[place.chunk] ^ (place.chunk == wrong_chunk ? 1u : 0u), stream);
      Check(cudaEventRecord(verified[s], stream), "client: recording a verdict");
      {
        std::lock_guard lock(mu);
        in_flight.emplace_back(s, place.chunk);
      }
      queued.notify_one();
    }
    reaper.join();
    // Installed bytes, sampled: only a matching chunk may have reached the destination.
    uint64_t wrong_samples = 0;
    for (size_t offset : {size_t{0}, size / 3 / chunk_bytes * chunk_bytes, size - chunk_bytes})
      wrong_samples += SampleMatches(file, destination, offset) ? 0 : 1;
    control_done = true;
    Check(cudaMemset(destination, 0, size), "client: clearing the destination");
    Check(cudaDeviceSynchronize(), "client: clearing the destination");
    Send(fd, {kRoundDone, static_cast<uint32_t>(wrong_samples), mismatches});
  }
  return 0;
}

// The page server: the file's page cache registered once, DMA into the client's memory.
void Server(const File& file, size_t chunk_bytes, size_t chunks, int rounds, Shape shape, int fd) {
  const uint32_t slots = shape.slots;
  const size_t size = chunks * chunk_bytes;
  Check(cudaSetDevice(0), "server: selecting the device");
  void* own = nullptr;
  Check(cudaMalloc(&own, size), "server: allocating the ceiling's device memory");
  void* mapped = ::mmap(nullptr, size, PROT_READ, MAP_SHARED | MAP_POPULATE, file.fd, 0);
  if (mapped == MAP_FAILED) {
    std::perror("mmap");
    std::exit(1);
  }
  char* const base = static_cast<char*>(mapped);
  auto start = Clock::now();
  Check(cudaHostRegister(base, size, cudaHostRegisterReadOnly), "server: registering the file");
  const double register_s = SecondsSince(start);
  Handles handles{};
  RecvAll(fd, &handles, sizeof handles);
  start = Clock::now();
  void* staging = nullptr;
  void* destination = nullptr;
  Check(cudaIpcOpenMemHandle(&staging, handles.staging, cudaIpcMemLazyEnablePeerAccess),
        "server: opening the staging ring");
  Check(cudaIpcOpenMemHandle(&destination, handles.destination, cudaIpcMemLazyEnablePeerAccess),
        "server: opening the destination");
  std::vector<cudaEvent_t> placed(slots);
  for (uint32_t s = 0; s < slots; ++s)
    Check(cudaIpcOpenEventHandle(&placed[s], handles.events[s]), "server: opening an event");
  const double open_s = SecondsSince(start);
  std::vector<cudaStream_t> streams(static_cast<size_t>(shape.copy_streams));
  for (cudaStream_t& s : streams)
    Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "server: creating a stream");
  // kServerVerified: the server checks what it placed, in its own context (the bytes and the
  // expected hashes both come from the server in any case).
  VerifyRing ring(slots, chunk_bytes);
  std::vector<cudaEvent_t> checked(slots);
  for (cudaEvent_t& e : checked)
    Check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "server: creating an event");
  const std::vector<uint64_t> want = ChunkHashes(file, chunk_bytes, chunks);
  std::printf(
      "{\"probe\":\"ipc-dma\",\"register_s\":%.3f,\"register_GBps\":%.2f,\"open_s\":%.4f,"
      "\"chunk_MiB\":%zu,\"slots\":%u,\"verify_streams\":%d,\"copy_streams\":%d}\n",
      register_s, static_cast<double>(size) / register_s / 1e9, open_s, chunk_bytes / kMiB, slots,
      shape.verify_streams, shape.copy_streams);
  for (int round = 0; round < rounds; ++round) {
    const double ceiling = CeilingBps(own, size);
    for (Mode mode : {kVerified, kServerVerified, kDirect}) {
      Send(fd, {kStart, mode, 0});
      start = Clock::now();
      Message done{};
      if (mode == kServerVerified) {
        size_t mismatches = 0;
        for (size_t c = 0; c < chunks + slots; ++c) {
          const uint32_t s = static_cast<uint32_t>(c % slots);
          if (c >= slots) {  // the slot's previous chunk: its verdict
            Check(cudaEventSynchronize(checked[s]), "server: waiting for a verdict");
            if (!ring.Matched(s)) ++mismatches;
          }
          if (c >= chunks) continue;
          cudaStream_t stream = streams[s % streams.size()];
          uint8_t* slot = static_cast<uint8_t*>(staging) + s * chunk_bytes;
          Check(cudaMemcpyAsync(slot, base + c * chunk_bytes, chunk_bytes, cudaMemcpyHostToDevice,
                                stream),
                "server: placing a chunk");
          ring.Launch(s, slot, static_cast<uint8_t*>(destination) + c * chunk_bytes, chunk_bytes,
                      want[c], stream);
          Check(cudaEventRecord(checked[s], stream), "server: recording a verdict");
        }
        const double seconds = SecondsSince(start);
        Send(fd, {kRoundDone, 0, 0});
        done = Recv(fd);
        std::printf(
            "{\"probe\":\"ipc-dma\",\"mode\":\"server-verified\",\"round\":%d,\"GBps\":%.2f,"
            "\"ratio\":%.3f,\"mismatches\":%zu,\"wrong_samples\":%llu,\"slots\":%u}\n",
            round, static_cast<double>(size) / seconds / 1e9,
            static_cast<double>(size) / seconds / ceiling, mismatches,
            static_cast<unsigned long long>(done.chunk), slots);
      } else if (mode == kDirect) {
        for (size_t c = 0; c < chunks; ++c)
          Check(cudaMemcpyAsync(static_cast<char*>(destination) + c * chunk_bytes,
                                base + c * chunk_bytes, chunk_bytes, cudaMemcpyHostToDevice,
                                streams[c % streams.size()]),
                "server: copying a chunk");
        for (cudaStream_t s : streams)
          Check(cudaStreamSynchronize(s), "server: draining a stream");
        const double seconds = SecondsSince(start);
        Send(fd, {kRoundDone, 0, 0});
        done = Recv(fd);
        std::printf(
            "{\"probe\":\"ipc-dma\",\"mode\":\"direct\",\"round\":%d,\"GBps\":%.2f,"
            "\"ratio\":%.3f,\"wrong_samples\":%llu}\n",
            round, static_cast<double>(size) / seconds / 1e9,
            static_cast<double>(size) / seconds / ceiling,
            static_cast<unsigned long long>(done.chunk));
      } else {
        std::vector<uint32_t> free_slots;
        for (uint32_t s = 0; s < slots; ++s)
          free_slots.push_back(s);
        size_t frees = 0;
        for (size_t c = 0; c < chunks; ++c) {
          while (free_slots.empty()) {
            const Message m = Recv(fd);
            free_slots.push_back(m.slot);
            ++frees;
          }
          const uint32_t s = free_slots.back();
          free_slots.pop_back();
          cudaStream_t stream = streams[s % streams.size()];
          Check(
              cudaMemcpyAsync(static_cast<char*>(staging) + s * chunk_bytes, base + c * chunk_bytes,
                              chunk_bytes, cudaMemcpyHostToDevice, stream),
              "server: placing a chunk");
          Check(cudaEventRecord(placed[s], stream), "server: recording a placement");
          Send(fd, {kPlace, s, c});
        }
        for (;;) {
          done = Recv(fd);
          if (done.kind == kRoundDone) break;
          ++frees;
        }
        const double seconds = SecondsSince(start);
        std::printf(
            "{\"probe\":\"ipc-dma\",\"mode\":\"verified\",\"round\":%d,\"GBps\":%.2f,"
            "\"ratio\":%.3f,\"control\":%s,\"mismatches\":%llu,\"wrong_samples\":%u,"
            "\"slots_returned\":%zu,\"slots\":%u,\"verify_streams\":%d}\n",
            round, static_cast<double>(size) / seconds / 1e9,
            static_cast<double>(size) / seconds / ceiling, round == 0 ? "true" : "false",
            static_cast<unsigned long long>(done.chunk), done.slot, frees, slots,
            shape.verify_streams);
      }
      std::fflush(stdout);
    }
  }
  Send(fd, {kQuit, 0, 0});
  cudaIpcCloseMemHandle(staging);
  cudaIpcCloseMemHandle(destination);
  cudaHostUnregister(base);
  ::munmap(mapped, size);
  cudaFree(own);
}

void IpcDma(const File& file, size_t chunk_bytes, int rounds, Shape shape) {
  const size_t chunks = file.size / chunk_bytes;
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, fds) != 0) {
    std::perror("socketpair");
    std::exit(1);
  }
  // Forked before either process makes a CUDA call: CUDA does not survive fork.
  const pid_t child = ::fork();
  if (child < 0) {
    std::perror("fork");
    std::exit(1);
  }
  if (child == 0) {
    ::close(fds[0]);
    std::fflush(stdout);
    ::_exit(Client(file, chunk_bytes, chunks, shape, fds[1]));
  }
  ::close(fds[1]);
  Server(file, chunk_bytes, chunks, rounds, shape, fds[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "ipc-dma: the client process failed (status %d)\n", status);
    std::exit(1);
  }
}

}  // namespace ipc

// pinned-cache: the other way round from ipc-dma. The page server keeps the image in pinned host
// memory it can share (cuMemCreate on the host, exported as a file descriptor), filled once; the
// restoring process imports that memory, maps it, and copies each chunk from it into its device
// staging itself, the verify kernel installing it, so the per-chunk work and the check stay in
// the restoring process and the server does nothing per chunk. Costs once per restore: import and
// map; once per server: the fill.
namespace pinned_cache {

void Cu(CUresult result, const char* what) {
  if (result == CUDA_SUCCESS) return;
  const char* name = nullptr;
  cuGetErrorName(result, &name);
  std::fprintf(stderr, "gpulazy-cuda-probes: %s: %s\n", what, name != nullptr ? name : "?");
  std::exit(1);
}

struct Shared {
  size_t size = 0;   // the file's bytes at the start
  size_t alloc = 0;  // the allocation's, rounded to its granularity
  double fill_s = 0;
};

void SendFd(int socket, int fd, const Shared& shared) {
  char control[CMSG_SPACE(sizeof(int))] = {};
  iovec io{const_cast<Shared*>(&shared), sizeof shared};
  msghdr msg{};
  msg.msg_iov = &io;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  c->cmsg_level = SOL_SOCKET;
  c->cmsg_type = SCM_RIGHTS;
  c->cmsg_len = CMSG_LEN(sizeof(int));
  std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
  if (::sendmsg(socket, &msg, 0) != static_cast<ssize_t>(sizeof shared)) {
    std::perror("pinned-cache: sendmsg");
    std::exit(1);
  }
}

int RecvFd(int socket, Shared& shared) {
  char control[CMSG_SPACE(sizeof(int))] = {};
  iovec io{&shared, sizeof shared};
  msghdr msg{};
  msg.msg_iov = &io;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  if (::recvmsg(socket, &msg, 0) != static_cast<ssize_t>(sizeof shared)) {
    std::fprintf(stderr, "pinned-cache: no descriptor from the server\n");
    std::exit(1);
  }
  cmsghdr* c = CMSG_FIRSTHDR(&msg);
  if (c == nullptr || c->cmsg_type != SCM_RIGHTS) {
    std::fprintf(stderr, "pinned-cache: no descriptor from the server\n");
    std::exit(1);
  }
  int fd = -1;
  std::memcpy(&fd, CMSG_DATA(c), sizeof fd);
  return fd;
}

CUmemAllocationProp SharedHostMemory() {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  // HOST allocations cannot be shared; a NUMA node's can (node 0: also where there is no NUMA).
  prop.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  prop.location.id = 0;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

// The server: allocate, fill from the file (16 threads), export, then wait for the client.
void Server(const File& file, size_t size, int socket) {
  Cu(cuInit(0), "server: cuInit");
  CUdevice device = 0;
  Cu(cuDeviceGet(&device, 0), "server: cuDeviceGet");
  CUcontext context = nullptr;
  Cu(cuDevicePrimaryCtxRetain(&context, device), "server: retaining the context");
  Cu(cuCtxSetCurrent(context), "server: cuCtxSetCurrent");
  const CUmemAllocationProp prop = SharedHostMemory();
  size_t granularity = 0;
  Cu(cuMemGetAllocationGranularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
     "server: granularity");
  Shared shared;
  shared.size = size;
  shared.alloc = (size + granularity - 1) / granularity * granularity;
  CUmemGenericAllocationHandle handle = 0;
  Cu(cuMemCreate(&handle, shared.alloc, &prop, 0), "server: cuMemCreate on the host");
  CUdeviceptr va = 0;
  Cu(cuMemAddressReserve(&va, shared.alloc, 0, 0, 0), "server: reserving addresses");
  Cu(cuMemMap(va, shared.alloc, 0, handle, 0), "server: mapping");
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  access.location.id = 0;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  Cu(cuMemSetAccess(va, shared.alloc, &access, 1), "server: host access");
  char* const cache = reinterpret_cast<char*>(va);
  const auto start = Clock::now();
  std::vector<std::thread> fillers;
  const size_t part = (size / 16 + kMiB - 1) / kMiB * kMiB;
  for (size_t offset = 0; offset < size; offset += part)
    fillers.emplace_back(
        [&, offset] { file.ReadFully(cache + offset, std::min(part, size - offset), offset); });
  for (std::thread& t : fillers)
    t.join();
  shared.fill_s = SecondsSince(start);
  int fd = -1;
  Cu(cuMemExportToShareableHandle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0),
     "server: exporting");
  SendFd(socket, fd, shared);
  ::close(fd);
  char done = 0;
  (void)::recv(socket, &done, 1, MSG_WAITALL);  // the client has finished
  cuMemUnmap(va, shared.alloc);
  cuMemAddressFree(va, shared.alloc);
  cuMemRelease(handle);
}

int Client(const File& file, size_t chunk_bytes, size_t chunks, int rounds, int copy_streams,
           int socket) {
  const size_t size = chunks * chunk_bytes;
  const std::vector<uint64_t> want = ChunkHashes(file, chunk_bytes, chunks);
  Shared shared;
  const int fd = RecvFd(socket, shared);
  Check(cudaSetDevice(0), "client: selecting the device");
  Check(cudaFree(nullptr), "client: making the context");
  auto start = Clock::now();
  CUmemGenericAllocationHandle handle = 0;
  Cu(cuMemImportFromShareableHandle(&handle, reinterpret_cast<void*>(static_cast<uintptr_t>(fd)),
                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
     "client: importing the cache");
  CUdeviceptr va = 0;
  Cu(cuMemAddressReserve(&va, shared.alloc, 0, 0, 0), "client: reserving addresses");
  Cu(cuMemMap(va, shared.alloc, 0, handle, 0), "client: mapping the cache");
  CUmemAccessDesc access[2] = {};
  access[0].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access[0].location.id = 0;
  access[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
  access[1].location.type = CU_MEM_LOCATION_TYPE_HOST_NUMA;
  access[1].location.id = 0;
  access[1].flags = CU_MEM_ACCESS_FLAGS_PROT_READ;
  Cu(cuMemSetAccess(va, shared.alloc, access, 2), "client: access");
  const double import_s = SecondsSince(start);
  ::close(fd);
  const char* const cache = reinterpret_cast<const char*>(va);

  uint8_t* destination = nullptr;
  Check(cudaMalloc(&destination, size), "client: allocating the destination");
  const uint32_t slots = 64;
  uint8_t* staging = nullptr;
  Check(cudaMalloc(&staging, chunk_bytes * slots), "client: allocating the staging ring");
  ipc::VerifyRing ring(slots, chunk_bytes);
  std::vector<cudaEvent_t> checked(slots);
  for (cudaEvent_t& e : checked)
    Check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "client: creating an event");
  std::vector<cudaStream_t> streams(static_cast<size_t>(copy_streams));
  for (cudaStream_t& s : streams)
    Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "client: creating a stream");
  std::printf(
      "{\"probe\":\"pinned-cache\",\"fill_s\":%.3f,\"fill_GBps\":%.2f,\"import_map_s\":%.4f,"
      "\"chunk_MiB\":%zu,\"streams\":%d,\"sample_ok\":%s}\n",
      shared.fill_s, static_cast<double>(shared.size) / shared.fill_s / 1e9, import_s,
      chunk_bytes / kMiB, copy_streams,
      SampleMatches(file, cache, size / 2 / kMiB * kMiB) ? "true" : "false");
  for (int round = 0; round < rounds; ++round) {
    const double ceiling = CeilingBps(destination, size);
    for (bool verify : {true, false}) {
      start = Clock::now();
      size_t mismatches = 0;
      for (size_t c = 0; c < chunks + slots; ++c) {
        const uint32_t s = static_cast<uint32_t>(c % slots);
        if (verify && c >= slots) {
          Check(cudaEventSynchronize(checked[s]), "client: waiting for a verdict");
          if (!ring.Matched(s)) ++mismatches;
        }
        if (c >= chunks) continue;
        cudaStream_t stream = streams[s % streams.size()];
        if (!verify) {
          Check(cudaMemcpyAsync(destination + c * chunk_bytes, cache + c * chunk_bytes, chunk_bytes,
                                cudaMemcpyDefault, stream),
                "client: copying a chunk");
          continue;
        }
        uint8_t* slot = staging + s * chunk_bytes;
        Check(
            cudaMemcpyAsync(slot, cache + c * chunk_bytes, chunk_bytes, cudaMemcpyDefault, stream),
            "client: staging a chunk");
        // Round 0 is the control: chunk 7's expected hash is wrong.
        ring.Launch(s, slot, destination + c * chunk_bytes, chunk_bytes,
                    want[c] ^ (round == 0 && c == 7 ? 1u : 0u), stream);
        Check(cudaEventRecord(checked[s], stream), "client: recording a verdict");
      }
      Check(cudaDeviceSynchronize(), "client: draining");
      const double seconds = SecondsSince(start);
      uint64_t wrong = 0;
      for (size_t offset : {size_t{0}, size / 3 / chunk_bytes * chunk_bytes, size - chunk_bytes})
        wrong += SampleMatches(file, destination, offset) ? 0 : 1;
      std::printf(
          "{\"probe\":\"pinned-cache\",\"mode\":\"%s\",\"round\":%d,\"GBps\":%.2f,"
          "\"ratio\":%.3f,\"control\":%s,\"mismatches\":%zu,\"wrong_samples\":%llu}\n",
          verify ? "verified" : "direct", round, static_cast<double>(size) / seconds / 1e9,
          static_cast<double>(size) / seconds / ceiling, verify && round == 0 ? "true" : "false",
          mismatches, static_cast<unsigned long long>(wrong));
      std::fflush(stdout);
      Check(cudaMemset(destination, 0, size), "client: clearing the destination");
      Check(cudaDeviceSynchronize(), "client: clearing the destination");
    }
  }
  const char done = 1;
  (void)::send(socket, &done, 1, MSG_NOSIGNAL);
  return 0;
}

void PinnedCache(const File& file, size_t chunk_bytes, int rounds, int copy_streams) {
  const size_t chunks = file.size / chunk_bytes;
  int fds[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    std::perror("socketpair");
    std::exit(1);
  }
  const pid_t child = ::fork();  // before either process makes a CUDA call
  if (child < 0) {
    std::perror("fork");
    std::exit(1);
  }
  if (child == 0) {
    ::close(fds[0]);
    std::fflush(stdout);
    ::_exit(Client(file, chunk_bytes, chunks, rounds, copy_streams, fds[1]));
  }
  ::close(fds[1]);
  Server(file, chunks * chunk_bytes, fds[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "pinned-cache: the client process failed (status %d)\n", status);
    std::exit(1);
  }
}

}  // namespace pinned_cache

}  // namespace

// ipc-open-overlap: does opening a CUDA IPC handle (what a page server does for each destination
// a restoring process hands over) stall DMA that runs meanwhile, and does it matter which process
// opens? An exporter process allocates BUFFERS device buffers of TOTAL_MIB in all and exports
// them. This process copies COPY_MIB from pinned memory into its own device buffer (2 MiB chunks
// on 16 streams, as the placer does): alone; beside a thread of its own that opens and closes
// every exported buffer; and beside a second process that does the same. Each opening is timed
// too. Processes are forked before any CUDA call (a forked CUDA context is unusable).
namespace open_overlap {

void ExporterProcess(int to_copier, int to_opener, size_t total, int buffers) {
  Check(cudaSetDevice(0), "exporter: selecting GPU 0");
  std::vector<void*> allocations;
  for (int i = 0; i < buffers; ++i) {
    void* allocation = nullptr;
    Check(cudaMalloc(&allocation, total / static_cast<size_t>(buffers)), "exporter: cudaMalloc");
    cudaIpcMemHandle_t handle;
    Check(cudaIpcGetMemHandle(&handle, allocation), "exporter: cudaIpcGetMemHandle");
    ipc::SendAll(to_copier, &handle, sizeof handle);
    ipc::SendAll(to_opener, &handle, sizeof handle);
    allocations.push_back(allocation);
  }
  char quit = 0;
  ipc::RecvAll(to_copier, &quit, 1);
  for (void* allocation : allocations)
    cudaFree(allocation);
}

std::vector<cudaIpcMemHandle_t> ReceiveHandles(int from_exporter, int buffers) {
  std::vector<cudaIpcMemHandle_t> handles(static_cast<size_t>(buffers));
  for (cudaIpcMemHandle_t& handle : handles)
    ipc::RecvAll(from_exporter, &handle, sizeof handle);
  return handles;
}

// Opens and closes each handle; the seconds the openings took, summed.
double OpenAll(const std::vector<cudaIpcMemHandle_t>& handles) {
  Check(cudaSetDevice(0), "opener: selecting GPU 0");
  double opening = 0;
  for (const cudaIpcMemHandle_t& handle : handles) {
    void* mapped = nullptr;
    const auto start = Clock::now();
    Check(cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess),
          "cudaIpcOpenMemHandle");
    opening += SecondsSince(start);
    Check(cudaIpcCloseMemHandle(mapped), "cudaIpcCloseMemHandle");
  }
  return opening;
}

void OpenerProcess(int from_exporter, int to_copier, int buffers) {
  const std::vector<cudaIpcMemHandle_t> handles = ReceiveHandles(from_exporter, buffers);
  Check(cudaSetDevice(0), "opener: selecting GPU 0");
  Check(cudaFree(nullptr), "opener: making its context");
  char go = 0;
  ipc::SendAll(to_copier, &go, 1);  // ready
  ipc::RecvAll(to_copier, &go, 1);
  const double opening = OpenAll(handles);
  ipc::SendAll(to_copier, &opening, sizeof opening);
}

struct Copier {
  static constexpr size_t kChunk = 2 * kMiB;
  static constexpr size_t kRing = 256 * kMiB;
  static constexpr int kStreams = 16;
  uint8_t* host = nullptr;
  uint8_t* device = nullptr;
  std::vector<cudaStream_t> streams;
  Copier() {
    Check(cudaMallocHost(&host, kRing), "pinned ring");
    std::memset(host, 0x5a, kRing);
    Check(cudaMalloc(&device, kRing), "device ring");
    streams.resize(kStreams);
    for (cudaStream_t& stream : streams)
      Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  }
  double Copy(size_t bytes) {
    const auto start = Clock::now();
    for (size_t done = 0, i = 0; done < bytes; done += kChunk, ++i) {
      const size_t at = done % kRing;
      Check(cudaMemcpyAsync(device + at, host + at, kChunk, cudaMemcpyHostToDevice,
                            streams[i % streams.size()]),
            "cudaMemcpyAsync");
    }
    Check(cudaDeviceSynchronize(), "copies");
    return SecondsSince(start);
  }
};

void Run(size_t total, int buffers, size_t copy_bytes) {
  int to_exporter[2], to_opener[2], exporter_to_opener[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM, 0, to_exporter) != 0 ||
      ::socketpair(AF_UNIX, SOCK_STREAM, 0, to_opener) != 0 ||
      ::socketpair(AF_UNIX, SOCK_STREAM, 0, exporter_to_opener) != 0) {
    std::perror("ipc-open-overlap: socketpair");
    std::exit(1);
  }
  const pid_t exporter = ::fork();
  if (exporter == 0) {
    ExporterProcess(to_exporter[1], exporter_to_opener[0], total, buffers);
    std::_Exit(0);
  }
  const pid_t opener = ::fork();
  if (opener == 0) {
    OpenerProcess(exporter_to_opener[1], to_opener[1], buffers);
    std::_Exit(0);
  }
  const std::vector<cudaIpcMemHandle_t> handles = ReceiveHandles(to_exporter[0], buffers);
  Check(cudaSetDevice(0), "selecting GPU 0");
  Copier copier;
  copier.Copy(copy_bytes);  // warm-up
  const double copy_alone = copier.Copy(copy_bytes);
  const double open_alone = OpenAll(handles);
  double open_beside = 0;
  std::thread opening([&] { open_beside = OpenAll(handles); });
  const double copy_beside_own_open = copier.Copy(copy_bytes);
  opening.join();
  char go = 0;
  ipc::RecvAll(to_opener[0], &go, 1);  // the opener's context is made
  ipc::SendAll(to_opener[0], &go, 1);
  const double copy_beside_other_open = copier.Copy(copy_bytes);
  double open_other = 0;
  ipc::RecvAll(to_opener[0], &open_other, sizeof open_other);
  ipc::SendAll(to_exporter[0], &go, 1);
  ::waitpid(opener, nullptr, 0);
  ::waitpid(exporter, nullptr, 0);
  const double gb = static_cast<double>(copy_bytes) / 1e9;
  std::printf(
      "{\"probe\": \"ipc-open-overlap\", \"open_bytes\": %zu, \"buffers\": %d, \"copy_bytes\": "
      "%zu, \"copy_alone_s\": %.4f, \"copy_alone_GBps\": %.2f, \"open_alone_s\": %.4f, "
      "\"copy_beside_own_open_s\": %.4f, \"open_beside_own_copy_s\": %.4f, "
      "\"copy_beside_other_process_open_s\": %.4f, \"open_in_other_process_s\": %.4f}\n",
      total, buffers, copy_bytes, copy_alone, gb / copy_alone, open_alone, copy_beside_own_open,
      open_beside, copy_beside_other_open, open_other);
}

}  // namespace open_overlap

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "pin-cost") {
    const size_t total = std::strtoull(argv[2], nullptr, 10) * kMiB;
    if (total < 4 * kMiB) return 2;
    PinCost(total);
    return 0;
  }
  if (argc >= 3 && std::string(argv[1]) == "ipc-open-overlap") {
    const size_t total = std::strtoull(argv[2], nullptr, 10) * kMiB;
    const int buffers = argc > 3 ? std::atoi(argv[3]) : 8;
    const size_t copy = (argc > 4 ? std::strtoull(argv[4], nullptr, 10) : 16384) * kMiB;
    if (total < kMiB || buffers < 1 || buffers > 1024 || copy < 256 * kMiB) return 2;
    open_overlap::Run(total, buffers, copy);
    return 0;
  }
  if (argc < 3) {
    std::fprintf(stderr,
                 "usage: %s pin-page-cache FILE [WINDOW_MIB=256 IN_FLIGHT=4] | read-dma FILE "
                 "[CHUNK_KIB=2048] | hash-slices FILE [CHUNK_KIB=2048 ROUNDS=3] | pin-overlap FILE "
                 "[WINDOW_MIB=64] | pin-cost TOTAL_MIB | ipc-dma FILE [ROUNDS=3 SLOTS=32 "
                 "VERIFY_STREAMS=4 COPY_STREAMS=4 CHUNK_MIB=2] | pinned-cache FILE [ROUNDS=3 "
                 "CHUNK_MIB=2 STREAMS=16]\n",
                 argv[0]);
    return 2;
  }
  const std::string probe = argv[1];
  File file(argv[2]);
  if (file.size < 256 * kMiB) {
    std::fprintf(stderr, "gpulazy-cuda-probes: %s is smaller than 256 MiB\n", argv[2]);
    return 2;
  }
  file.WarmPageCache();
  if (probe == "pin-page-cache") {
    const size_t window = (argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 256) * kMiB;
    const int in_flight = argc > 4 ? std::atoi(argv[4]) : 4;
    if (window == 0 || in_flight < 1) return 2;
    PinPageCache(file, window, in_flight);
  } else if (probe == "pin-overlap") {
    const size_t window = (argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 64) * kMiB;
    if (window == 0 || window > file.size) return 2;
    PinOverlap(file, window);
  } else if (probe == "hash-slices") {
    const size_t chunk = (argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 2048) * 1024;
    const int rounds = argc > 4 ? std::atoi(argv[4]) : 3;
    if (chunk == 0 || chunk > 64 * kMiB || chunk % 4096 != 0 || rounds < 1) return 2;
    HashSlices(file, chunk, rounds);
  } else if (probe == "ipc-dma") {
    const int rounds = argc > 3 ? std::atoi(argv[3]) : 3;
    ipc::Shape shape;
    if (argc > 4) shape.slots = static_cast<uint32_t>(std::strtoul(argv[4], nullptr, 10));
    if (argc > 5) shape.verify_streams = std::atoi(argv[5]);
    if (argc > 6) shape.copy_streams = std::atoi(argv[6]);
    const size_t chunk = (argc > 7 ? std::strtoull(argv[7], nullptr, 10) : 2) * kMiB;
    if (rounds < 1 || shape.slots < 1 || shape.slots > ipc::kMaxIpcSlots ||
        shape.verify_streams < 1 || shape.copy_streams < 1 || chunk == 0 || chunk > 64 * kMiB)
      return 2;
    ipc::IpcDma(file, chunk, rounds, shape);
  } else if (probe == "pinned-cache") {
    const int rounds = argc > 3 ? std::atoi(argv[3]) : 3;
    const size_t chunk = (argc > 4 ? std::strtoull(argv[4], nullptr, 10) : 2) * kMiB;
    const int streams = argc > 5 ? std::atoi(argv[5]) : 16;
    if (rounds < 1 || chunk == 0 || chunk > 64 * kMiB || streams < 1) return 2;
    pinned_cache::PinnedCache(file, chunk, rounds, streams);
  } else if (probe == "read-dma") {
    const size_t chunk = (argc > 3 ? std::strtoull(argv[3], nullptr, 10) : 2048) * 1024;
    // Whole pages: the mapped fills populate each chunk's pages (MADV_POPULATE_READ).
    if (chunk == 0 || chunk > 64 * kMiB || chunk % 4096 != 0) return 2;
    ReadDma(file, chunk);
  } else {
    std::fprintf(stderr, "gpulazy-cuda-probes: unknown probe %s\n", probe.c_str());
    return 2;
  }
  return 0;
}
