# gpulazy-cuda-bench: GPU-side measurements (issue 6); only with -DGPULAZY_WITH_CUDA=ON.
if(GPULAZY_WITH_CUDA)
  add_executable(gpulazy-cuda-bench ${CMAKE_CURRENT_LIST_DIR}/cuda_bench.cc
                 ${CMAKE_CURRENT_LIST_DIR}/harness.cc)
  target_link_libraries(gpulazy-cuda-bench PRIVATE gpulazy_cuda_engine gpulazy_client gpulazy_image
                        gpulazy_net spdlog::spdlog)
  target_compile_definitions(gpulazy-cuda-bench
                             PRIVATE GPULAZY_DEFAULT_BIN_DIR="${CMAKE_BINARY_DIR}/bin")
endif()
