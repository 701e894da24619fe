# Tests: GoogleTest from Debian (libgtest-dev), or sources given by LOOM_GTEST_SOURCE_DIR on
# machines without it. loom_test(NAME SOURCES ... LIBS ... LABELS ...) adds one ctest entry
# with the given labels (unit | integration | slow).
enable_testing()
find_package(GTest QUIET)
if(NOT GTest_FOUND)
  if(LOOM_GTEST_SOURCE_DIR)
    add_subdirectory(${LOOM_GTEST_SOURCE_DIR} ${PROJECT_BINARY_DIR}/_gtest EXCLUDE_FROM_ALL)
    add_library(GTest::gtest ALIAS gtest)
    add_library(GTest::gtest_main ALIAS gtest_main)
  else()
    message(FATAL_ERROR "GoogleTest not found: install libgtest-dev or set LOOM_GTEST_SOURCE_DIR")
  endif()
endif()
include(GoogleTest)

# CPU shares for ctest's scheduler. `make test` runs ctest with two `cpu` slots per core
# (build/ctest-resources.json, written here) and -j of twice the cores: a test takes 2 slots, a
# core, unless it was measured to keep less than half a core busy over its run (its faults hold
# it waiting on leases, timeouts and restarts); such a suite is `light` and takes 1, so two of
# them share a core instead of leaving half of one idle. Every test must say which
# (ctest_resources_test checks the registered list).
cmake_host_system_information(RESULT LOOM_CORES QUERY NUMBER_OF_LOGICAL_CORES)
math(EXPR _loom_cpu_slots "2 * ${LOOM_CORES}")
file(WRITE ${PROJECT_BINARY_DIR}/ctest-resources.json
     "{\"version\": {\"major\": 1, \"minor\": 0}, \"local\": [{\"cpu\": [{\"id\": \"0\", \"slots\": ${_loom_cpu_slots}}]}]}\n")
function(loom_test_cpu name weight)
  if(weight STREQUAL "light")
    set_tests_properties(${name} PROPERTIES RESOURCE_GROUPS "cpu:1")
  elseif(weight STREQUAL "core")
    set_tests_properties(${name} PROPERTIES RESOURCE_GROUPS "cpu:2")
  else()
    message(FATAL_ERROR "loom_test_cpu(${name} ${weight}): core | light")
  endif()
endfunction()

# Test code is compiled -O1 in optimised builds. What a test exercises runs in the libraries at
# the build's -O3; the test's own code (fixtures, float64 reference loops) then costs a third to
# a half less to compile (coordinator_tests' batch: 44 -> 24 s of CPU, trainer_tests' 31 -> 24),
# and -O1 keeps using the -O3 LibTorch PCH (both define __OPTIMIZE__).
function(loom_test_compile_options target)
  target_compile_options(${target} PRIVATE $<$<CONFIG:Release,RelWithDebInfo,MinSizeRel>:-O1>)
endfunction()

# loom_test_binary(NAME [TORCH] [LIBS ...]): one test executable shared by the loom_test(...
# BINARY NAME) entries of a folder. Each LibTorch test file costs ~11 s to compile, mostly the
# LibTorch templates and inline functions it instantiates; compiled together (a unity build) ten
# of them cost about what three did alone. Every entry keeps its own ctest name, labels,
# timeout, environment and process: it runs the binary with a filter on its own suites.
function(loom_test_binary name)
  cmake_parse_arguments(B "TORCH" "" "LIBS" ${ARGN})
  add_executable(${name})
  target_link_libraries(${name} PRIVATE ${B_LIBS} GTest::gtest GTest::gtest_main)
  loom_test_compile_options(${name})
  if(B_TORCH)
    loom_use_torch(${name})
    set_target_properties(${name} PROPERTIES LOOM_TORCH ON)  # its entries get the label torch
  endif()
  set_target_properties(${name} PROPERTIES UNITY_BUILD ${LOOM_UNITY_BUILD} UNITY_BUILD_BATCH_SIZE 0)
  # Once the folder has added its entries: a test of the binary that no entry's filter selects
  # (a suite the filter's parse missed) fails this check instead of never running.
  # (EVAL: a deferred call's arguments are expanded when it runs, where ${name} is not set.)
  cmake_language(EVAL CODE "cmake_language(DEFER CALL loom_test_binary_coverage [[${name}]])")
endfunction()

function(loom_test_binary_coverage binary)
  get_property(_all GLOBAL PROPERTY LOOM_TEST_FILTERS_${binary})
  add_test(NAME ${binary}_runs_every_test COMMAND sh -c
           "! \"$0\" --gtest_list_tests --gtest_filter=\"-$1\" | grep '^  '"
           $<TARGET_FILE:${binary}> "${_all}")
  set_tests_properties(${binary}_runs_every_test PROPERTIES LABELS unit TIMEOUT 60)
  loom_test_cpu(${binary}_runs_every_test core)
endfunction()

# The --gtest_filter selecting the suites SOURCES define (TEST, TEST_F, TEST_P; a suite's
# parameterised instances are Prefix/Suite). Two entries of one binary may not share a suite.
function(loom_test_filter out binary entry)
  set(_patterns)
  foreach(_src ${ARGN})
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_src})  # new suites
    file(STRINGS ${CMAKE_CURRENT_SOURCE_DIR}/${_src} _lines REGEX "^TEST(_F|_P)?\\(")
    foreach(_line ${_lines})
      string(REGEX REPLACE "^TEST(_F|_P)?\\( *([A-Za-z0-9_]+).*" "\\2" _suite "${_line}")
      get_property(_owner GLOBAL PROPERTY LOOM_TEST_SUITE_${binary}_${_suite})
      if(_owner AND NOT _owner STREQUAL entry)
        message(FATAL_ERROR "${binary}: suite ${_suite} in both ${_owner} and ${entry}")
      endif()
      set_property(GLOBAL PROPERTY LOOM_TEST_SUITE_${binary}_${_suite} ${entry})
      list(APPEND _patterns "${_suite}.*" "*/${_suite}.*")
    endforeach()
  endforeach()
  list(REMOVE_DUPLICATES _patterns)
  if(NOT _patterns)
    message(FATAL_ERROR "${binary}: no TEST in ${ARGN}")
  endif()
  list(JOIN _patterns ":" _filter)
  set_property(GLOBAL APPEND_STRING PROPERTY LOOM_TEST_FILTERS_${binary} "${_filter}:")
  set(${out} ${_filter} PARENT_SCOPE)
endfunction()

# loom_test(NAME [TORCH] [BINARY B] SOURCES ... LIBS ... LABELS ... TIMEOUT s COST s ENV ...):
# one ctest entry; its own executable NAME, or a filter on the shared binary B.
function(loom_test name)
  cmake_parse_arguments(T "TORCH" "TIMEOUT;COST;BINARY" "SOURCES;LIBS;LABELS;ENV" ${ARGN})
  if(T_BINARY)
    target_sources(${T_BINARY} PRIVATE ${T_SOURCES})
    target_link_libraries(${T_BINARY} PRIVATE ${T_LIBS})
    loom_test_filter(_filter ${T_BINARY} ${name} ${T_SOURCES})
    add_test(NAME ${name} COMMAND ${T_BINARY} --gtest_filter=${_filter})
  else()
    add_executable(${name} ${T_SOURCES})
    target_link_libraries(${name} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main)
    loom_test_compile_options(${name})
    if(T_TORCH)
      loom_use_torch(${name})
    endif()
    add_test(NAME ${name} COMMAND ${name})
  endif()
  if(NOT T_LABELS)
    set(T_LABELS unit)
  endif()
  # `torch`: the entries that run LibTorch code, which the second build (LOOM_TORCH=pypi) runs.
  set(_torch ${T_TORCH})
  if(T_BINARY)
    get_target_property(_torch ${T_BINARY} LOOM_TORCH)
  endif()
  if(_torch)
    list(APPEND T_LABELS torch)
  endif()
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  set_tests_properties(${name} PROPERTIES LABELS "${T_LABELS}" TIMEOUT ${T_TIMEOUT}
                       ENVIRONMENT "OMP_NUM_THREADS=1;LOOM_PLUGIN_PATH=${LOOM_PLUGIN_OUTPUT_DIR};LOOM_SOURCE_DIR=${PROJECT_SOURCE_DIR};${T_ENV}")
  loom_test_cpu(${name} core)
  # COST (seconds, measured): a fresh clone has no timings, and ctest -j starts costly tests first.
  if(T_COST)
    set_tests_properties(${name} PROPERTIES COST ${T_COST})
  endif()
endfunction()
