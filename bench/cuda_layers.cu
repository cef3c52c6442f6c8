// The layer kernel, compiled by nvcc. Kept free of gpulazy's headers (fmt and protobuf are not
// for nvcc); cuda_layers.cc wraps it.
#include <cuda_runtime.h>

namespace {

__global__ void SumWords(const unsigned long long* words, unsigned long long count,
                         unsigned long long* out) {
  unsigned long long sum = 0;
  const unsigned long long stride = static_cast<unsigned long long>(gridDim.x) * blockDim.x;
  for (unsigned long long i =
           static_cast<unsigned long long>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < count; i += stride)
    sum += words[i];
  for (int offset = 16; offset > 0; offset >>= 1)
    sum += __shfl_down_sync(0xffffffffu, sum, offset);
  if ((threadIdx.x & 31) == 0) atomicAdd(out, sum);
}

}  // namespace

// Sums `count` 64-bit words at `words` (device memory) into *host_sum, using `scratch` (one
// device word). Synchronous.
cudaError_t GpulazySumWords(const void* words, unsigned long long count,
                            unsigned long long* scratch, unsigned long long* host_sum) {
  cudaError_t e = cudaMemset(scratch, 0, sizeof(unsigned long long));
  if (e != cudaSuccess) return e;
  SumWords<<<1024, 256>>>(static_cast<const unsigned long long*>(words), count, scratch);
  e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  return cudaMemcpy(host_sum, scratch, sizeof(unsigned long long), cudaMemcpyDeviceToHost);
}
