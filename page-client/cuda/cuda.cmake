# The CUDA copy engine, only with -DGPULAZY_WITH_CUDA=ON. It uses the CUDA runtime API alone (no
# kernels), so the host compiler builds it; nvcc is not needed.
find_package(CUDAToolkit REQUIRED)
add_library(gpulazy_cuda_engine STATIC ${CMAKE_CURRENT_LIST_DIR}/cuda_engine.cc)
target_link_libraries(gpulazy_cuda_engine PUBLIC gpulazy_client CUDA::cudart_static)
