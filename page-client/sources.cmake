# net/: Asio transports and frame I/O, shared with the page server.
add_library(gpulazy_net STATIC
  ${CMAKE_CURRENT_LIST_DIR}/net/endpoint.cc
  ${CMAKE_CURRENT_LIST_DIR}/net/fd_passing.cc
  ${CMAKE_CURRENT_LIST_DIR}/net/frame_stream.cc
  ${CMAKE_CURRENT_LIST_DIR}/net/stderr_log.cc
  ${CMAKE_CURRENT_LIST_DIR}/net/stream.cc
  ${CMAKE_CURRENT_LIST_DIR}/net/threads.cc)
target_link_libraries(gpulazy_net PUBLIC gpulazy_proto gpulazy_image Boost::system OpenSSL::SSL OpenSSL::Crypto spdlog::spdlog
                      Threads::Threads)

if(EXISTS ${CMAKE_CURRENT_LIST_DIR}/client.cmake)
  include(${CMAKE_CURRENT_LIST_DIR}/client.cmake)
endif()

if(EXISTS ${CMAKE_CURRENT_LIST_DIR}/uffd/uffd.cmake)
  include(${CMAKE_CURRENT_LIST_DIR}/uffd/uffd.cmake)
endif()

if(GPULAZY_WITH_CUDA)
  include(${CMAKE_CURRENT_LIST_DIR}/cuda/cuda.cmake)
endif()
