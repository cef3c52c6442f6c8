# The harness (server processes, synthesis, JSON, CPU meters), compiled once for both benches.
add_library(gpulazy_bench_harness STATIC ${CMAKE_CURRENT_LIST_DIR}/harness.cc)
target_link_libraries(gpulazy_bench_harness PUBLIC gpulazy_image gpulazy_net gpulazy_server_child)
add_executable(gpulazy-bench
  ${CMAKE_CURRENT_LIST_DIR}/main.cc
  ${CMAKE_CURRENT_LIST_DIR}/stream_bench.cc
  ${CMAKE_CURRENT_LIST_DIR}/demand_bench.cc
  ${CMAKE_CURRENT_LIST_DIR}/checksum_bench.cc
  ${CMAKE_CURRENT_LIST_DIR}/maps_bench.cc)
target_link_libraries(gpulazy-bench PRIVATE gpulazy_bench_harness gpulazy_client gpulazy_image gpulazy_net gpulazy_uffd spdlog::spdlog)
# The bench starts the real server binary; build it alongside.
if(TARGET gpulazy-server)
  add_dependencies(gpulazy-bench gpulazy-server)
endif()
target_compile_definitions(gpulazy-bench PRIVATE GPULAZY_DEFAULT_BIN_DIR="${CMAKE_BINARY_DIR}/bin")

# Further benchmark parts (restore demo) add themselves here.
file(GLOB GPULAZY_BENCH_PARTS ${CMAKE_CURRENT_LIST_DIR}/*.part.cmake)
foreach(part ${GPULAZY_BENCH_PARTS})
  include(${part})
endforeach()
