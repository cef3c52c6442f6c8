# The CUDA copy engine, only with -DGPULAZY_WITH_CUDA=ON. Its host code uses the CUDA runtime API
# alone; the kernel that verifies chunks on the GPU (verify_kernel.cu) needs nvcc.
find_package(CUDAToolkit REQUIRED)
include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  message(FATAL_ERROR "GPULAZY_WITH_CUDA=ON needs nvcc (the engine verifies chunks on the GPU)")
endif()
enable_language(CUDA)
# The kernel alone, without gpulazy's C++20 targets: this CMake knows no CUDA20 dialect.
add_library(gpulazy_cuda_verify STATIC ${CMAKE_CURRENT_LIST_DIR}/verify_kernel.cu)
# Hopper (H100/H200, where it has run) and Ampere; PTX for later GPUs.
set_target_properties(gpulazy_cuda_verify PROPERTIES CUDA_ARCHITECTURES "80-real;90"
                      CUDA_STANDARD 17 CUDA_RUNTIME_LIBRARY Static)
target_link_libraries(gpulazy_cuda_verify PUBLIC CUDA::cudart_static)
add_library(gpulazy_cuda_engine STATIC ${CMAKE_CURRENT_LIST_DIR}/cuda_engine.cc)
target_link_libraries(gpulazy_cuda_engine PUBLIC gpulazy_client CUDA::cudart_static
                      PRIVATE gpulazy_cuda_verify)
