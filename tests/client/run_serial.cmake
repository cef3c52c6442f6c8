# Included by ctest after the discovered tests of this directory (TEST_INCLUDE_FILES): tests
# that must not run beside others under ctest -j.
#
# TuneSocket.OnlyForcedBuffersPassTheSysctlCaps lowers net.core.[rw]mem_max for a moment, which
# caps the socket buffers of every other test that opens a socket meanwhile.
list(FIND client_basics_test_TESTS "TuneSocket.OnlyForcedBuffersPassTheSysctlCaps" found)
if(NOT found EQUAL -1)
  set_tests_properties("TuneSocket.OnlyForcedBuffersPassTheSysctlCaps" PROPERTIES RUN_SERIAL TRUE)
endif()
