# gpulazy-bench restore (issue 4): restore modes side by side on the userfaultfd pager.
target_sources(gpulazy-bench PRIVATE ${CMAKE_CURRENT_LIST_DIR}/restore_bench.cc)
target_link_libraries(gpulazy-bench PRIVATE gpulazy_uffd)
