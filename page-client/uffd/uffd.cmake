# page-client/uffd/: the userfaultfd pager (docs/uffd.md). Included from ../sources.cmake.
add_library(gpulazy_uffd STATIC
  ${CMAKE_CURRENT_LIST_DIR}/userfaultfd.cc
  ${CMAKE_CURRENT_LIST_DIR}/memory.cc
  ${CMAKE_CURRENT_LIST_DIR}/uffd_engine.cc
  ${CMAKE_CURRENT_LIST_DIR}/pager.cc
  ${CMAKE_CURRENT_LIST_DIR}/handover.cc
  ${CMAKE_CURRENT_LIST_DIR}/mappings.cc)
target_link_libraries(gpulazy_uffd PUBLIC gpulazy_client gpulazy_proto spdlog::spdlog
                      Threads::Threads)
