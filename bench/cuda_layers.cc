#include "bench/cuda_layers.h"

#include <cuda_runtime.h>

#include <cstring>
#include <utility>

cudaError_t GpulazySumWords(const void* words, unsigned long long count,
                            unsigned long long* scratch, unsigned long long* host_sum);

namespace gpulazy::bench {

Result<LayerKernel> LayerKernel::Create() {
  LayerKernel kernel;
  if (cudaError_t e = cudaMalloc(&kernel.result_, sizeof(unsigned long long)); e != cudaSuccess)
    return Unavailable("allocating the layer result: {}", cudaGetErrorString(e));
  return kernel;
}

LayerKernel::LayerKernel(LayerKernel&& other) noexcept
    : result_(std::exchange(other.result_, nullptr)) {}

LayerKernel::~LayerKernel() {
  if (result_ != nullptr) cudaFree(result_);
}

Result<uint64_t> LayerKernel::Run(const void* device, uint64_t bytes) {
  if (bytes % 8 != 0) return InvalidArgument("layer of {} bytes is not whole 64-bit words", bytes);
  unsigned long long sum = 0;
  if (cudaError_t e = GpulazySumWords(device, bytes / 8, result_, &sum); e != cudaSuccess)
    return Unavailable("running the layer kernel: {}", cudaGetErrorString(e));
  return static_cast<uint64_t>(sum);
}

uint64_t HostLayerSum(std::span<const uint8_t> bytes) {
  uint64_t sum = 0;
  for (size_t i = 0; i + 8 <= bytes.size(); i += 8) {
    uint64_t word;
    std::memcpy(&word, bytes.data() + i, 8);
    sum += word;
  }
  return sum;
}

}  // namespace gpulazy::bench
