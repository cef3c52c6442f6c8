# gpulazy-bench maps: the uffd pager's one-address lookup in a program's maps, two ways.
target_sources(gpulazy-bench PRIVATE ${CMAKE_CURRENT_LIST_DIR}/maps_bench.cc)
target_link_libraries(gpulazy-bench PRIVATE gpulazy_uffd)
