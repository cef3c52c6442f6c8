// gpulazy-ipc-exporter SIZE: a stand-in for a restoring process, for device_placer_test and
// gpulazy-cuda-bench's placement case (IpcExporterProcess, ipc_exporter.h). Allocates SIZE bytes
// of device memory, zeroes them, prints their CUDA IPC handle as hex on one line and keeps the
// allocation until its standard input closes. A process of its own because an IPC handle cannot
// be opened by the process that exported it.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: gpulazy-ipc-exporter SIZE\n");
    return 2;
  }
  const size_t size = std::strtoull(argv[1], nullptr, 10);
  void* device = nullptr;
  cudaIpcMemHandle_t handle{};
  cudaError_t e = cudaMalloc(&device, size);
  if (e == cudaSuccess) e = cudaMemset(device, 0, size);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e == cudaSuccess) e = cudaIpcGetMemHandle(&handle, device);
  if (e != cudaSuccess) {
    std::fprintf(stderr, "gpulazy-ipc-exporter: %s\n", cudaGetErrorString(e));
    return 1;
  }
  const auto* bytes = reinterpret_cast<const unsigned char*>(&handle);
  for (size_t i = 0; i < sizeof handle; ++i)
    std::printf("%02x", bytes[i]);
  std::printf("\n");
  std::fflush(stdout);
  while (std::getchar() != EOF) {
  }
  cudaFree(device);
  return 0;
}
