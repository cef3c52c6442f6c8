# page-client/: the restore client library (RestoreSession, CopyEngine, HostCopyEngine) and the
# gpulazy-client CLI. Included from sources.cmake.
add_library(gpulazy_client STATIC
  ${CMAKE_CURRENT_LIST_DIR}/chunk_codec.cc
  ${CMAKE_CURRENT_LIST_DIR}/engine_gate.cc
  ${CMAKE_CURRENT_LIST_DIR}/file_chunks.cc
  ${CMAKE_CURRENT_LIST_DIR}/host_engine.cc
  ${CMAKE_CURRENT_LIST_DIR}/populate_ahead.cc
  ${CMAKE_CURRENT_LIST_DIR}/residency.cc
  ${CMAKE_CURRENT_LIST_DIR}/restore_session.cc
  ${CMAKE_CURRENT_LIST_DIR}/server_connection.cc)
target_link_libraries(gpulazy_client PUBLIC gpulazy_net gpulazy_image gpulazy_proto spdlog::spdlog
                      PkgConfig::LZ4 Threads::Threads)

# Restoring from an image directory on this host, with no server (LocalRestore).
add_library(gpulazy_local_restore STATIC ${CMAKE_CURRENT_LIST_DIR}/local_restore.cc)
target_link_libraries(gpulazy_local_restore PUBLIC gpulazy_client gpulazy_image)

add_executable(gpulazy-client
  ${CMAKE_CURRENT_LIST_DIR}/cli/main.cc
  ${CMAKE_CURRENT_LIST_DIR}/cli/fetch.cc
  ${CMAKE_CURRENT_LIST_DIR}/cli/stats.cc)
# The image library only for its CRIU pages-file writer (fetch's output).
target_link_libraries(gpulazy-client PRIVATE gpulazy_client gpulazy_image)
