# gpulazy-cuda-bench: GPU-side measurements (issue 6); only with -DGPULAZY_WITH_CUDA=ON and nvcc
# (the layer workload has a kernel; the copy engine itself needs no nvcc).
if(GPULAZY_WITH_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
    # The kernel alone, without gpulazy's C++20 targets: this CMake knows no CUDA20 dialect.
    add_library(gpulazy_cuda_kernels STATIC ${CMAKE_CURRENT_LIST_DIR}/cuda_layers.cu)
    # Hopper (H100/H200, where it has run) and Ampere; PTX for later GPUs.
    set_target_properties(gpulazy_cuda_kernels PROPERTIES CUDA_ARCHITECTURES "80-real;90"
                          CUDA_STANDARD 17 CUDA_RUNTIME_LIBRARY Static)
    add_executable(gpulazy-cuda-bench ${CMAKE_CURRENT_LIST_DIR}/cuda_bench.cc
                   ${CMAKE_CURRENT_LIST_DIR}/cuda_layers.cc)
    # The engine brings the static CUDA runtime the kernel's launch stubs need.
    target_link_libraries(gpulazy-cuda-bench PRIVATE gpulazy_bench_harness gpulazy_cuda_kernels
                          gpulazy_cuda_engine gpulazy_server gpulazy_server_gpu gpulazy_local_restore
                          gpulazy_client gpulazy_image gpulazy_net spdlog::spdlog)
    target_compile_definitions(gpulazy-cuda-bench
                               PRIVATE GPULAZY_DEFAULT_BIN_DIR="${CMAKE_BINARY_DIR}/bin")
    # Standalone probes of the host's limits (docs/benchmarks.md): the CUDA runtime, and the
    # driver API for shareable host memory (pinned-cache).
    find_package(CUDAToolkit REQUIRED)
    add_executable(gpulazy-cuda-probes ${CMAKE_CURRENT_LIST_DIR}/cuda_probes.cu)
    set_target_properties(gpulazy-cuda-probes PROPERTIES CUDA_ARCHITECTURES "80-real;90"
                          CUDA_STANDARD 17 CUDA_RUNTIME_LIBRARY Static)
    target_link_libraries(gpulazy-cuda-probes PRIVATE Threads::Threads gpulazy_proto
                          gpulazy_cuda_verify CUDA::cuda_driver)
  else()
    message(STATUS "gpulazy-cuda-bench: no CUDA compiler (nvcc) found, not built")
  endif()
endif()
