// The "inference" side of the CUDA restore demo (issue 6): a layer kernel that consumes a
// layer's weights in device memory. It sums the layer as 64-bit words (wrapping), so its result
// can be checked against the same sum over the checkpoint's bytes: a layer that ran on wrong or
// missing bytes gives a wrong result.
#pragma once

#include <cstdint>
#include <span>

#include "proto/status.h"

namespace gpulazy::bench {

class LayerKernel {
 public:
  static Result<LayerKernel> Create();
  LayerKernel(LayerKernel&& other) noexcept;
  LayerKernel& operator=(LayerKernel&&) = delete;
  LayerKernel(const LayerKernel&) = delete;
  ~LayerKernel();

  // Runs the kernel over `bytes` bytes (a multiple of 8) at `device` and waits for its result.
  Result<uint64_t> Run(const void* device, uint64_t bytes);

 private:
  LayerKernel() = default;
  unsigned long long* result_ = nullptr;  // one device word
};

// The same sum on the host, for the expected value.
uint64_t HostLayerSum(std::span<const uint8_t> bytes);

}  // namespace gpulazy::bench
