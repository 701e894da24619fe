# The fuzz harnesses in the ordinary build's tests: a second build of the same sources with clang,
# libFuzzer, ASan and UBSan (LOOM_FUZZ=ON) in <build>/fuzz, made as part of this build, and one
# ctest entry per harness (label `fuzz`) that runs its committed corpus through it once.
# Without clang and its libFuzzer runtime (Debian: clang, libclang-rt-14-dev) the entries are
# left out with a warning.
find_program(LOOM_CLANGXX NAMES clang++ clang++-14)
find_program(LOOM_CLANG NAMES clang clang-14)
set(_fuzz_probe ${PROJECT_BINARY_DIR}/CMakeFiles/loom_fuzz_probe.cc)
file(WRITE ${_fuzz_probe} "#include <cstdint>\n#include <cstddef>\nextern \"C\" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n")
set(LOOM_HAVE_FUZZ OFF)
if(LOOM_CLANGXX AND LOOM_CLANG)
  execute_process(COMMAND ${LOOM_CLANGXX} -fsanitize=fuzzer,address,undefined ${_fuzz_probe}
                          -o ${PROJECT_BINARY_DIR}/CMakeFiles/loom_fuzz_probe
                  RESULT_VARIABLE _fuzz_rc OUTPUT_QUIET ERROR_QUIET)
  if(_fuzz_rc EQUAL 0)
    set(LOOM_HAVE_FUZZ ON)
  endif()
endif()
if(NOT LOOM_HAVE_FUZZ)
  message(WARNING "Loom: no clang with libFuzzer + ASan/UBSan (install clang libclang-rt-14-dev):"
                  " the fuzz corpus replays are left out of the tests")
  return()
endif()

include(ExternalProject)
set(LOOM_FUZZ_DIR ${PROJECT_BINARY_DIR}/fuzz)
set(_launcher)
if(CMAKE_CXX_COMPILER_LAUNCHER)
  set(_launcher -DCMAKE_C_COMPILER_LAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER}
                -DCMAKE_CXX_COMPILER_LAUNCHER=${CMAKE_CXX_COMPILER_LAUNCHER})
endif()
ExternalProject_Add(loom_fuzz_build
  SOURCE_DIR ${PROJECT_SOURCE_DIR}
  BINARY_DIR ${LOOM_FUZZ_DIR}
  CMAKE_GENERATOR ${CMAKE_GENERATOR}
  # -O0 and no coverage feedback: it only replays the corpus once (CMakeLists.txt, LOOM_FUZZ_OPT
  # and LOOM_FUZZ_COVERAGE); ASan and UBSan check every input as in a fuzzing run.
  CMAKE_ARGS -DLOOM_FUZZ=ON -DLOOM_FUZZ_OPT=-O0 -DLOOM_FUZZ_COVERAGE=OFF -DCMAKE_C_COMPILER=${LOOM_CLANG}
             -DCMAKE_CXX_COMPILER=${LOOM_CLANGXX} ${_launcher}
  BUILD_COMMAND ${CMAKE_COMMAND} --build ${LOOM_FUZZ_DIR} --target loom_fuzzers
  INSTALL_COMMAND ""
  BUILD_ALWAYS ON)  # its own build tool decides what is stale

include(${PROJECT_SOURCE_DIR}/fuzz/harnesses.cmake)
foreach(entry ${LOOM_FUZZERS})
  string(REGEX REPLACE ":.*" "" name ${entry})
  add_test(NAME fuzz_${name}
           COMMAND ${LOOM_FUZZ_DIR}/bin/loom-fuzz-${name} -runs=0
                   ${PROJECT_SOURCE_DIR}/fuzz/corpus/${name})
  set_tests_properties(fuzz_${name} PROPERTIES LABELS fuzz TIMEOUT 300
                       ENVIRONMENT "UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1")
  loom_test_cpu(fuzz_${name} core)
endforeach()
