# LibTorch: Debian's libtorch-dev (1.13, CPU) by default; a LibTorch 2.x distribution (for
# example PyTorch's: -DCMAKE_PREFIX_PATH=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)'))
# on GPU machines. Version differences are handled in api/loom/torch_compat.h only.
# A CUDA LibTorch's config compiles for the GPUs of TORCH_CUDA_ARCH_LIST (a dozen by default)
# and sets CMAKE_CUDA_ARCHITECTURES to OFF: give it Loom's (80;90 -> 8.0;9.0), and keep Loom's
# for Loom's own kernels.
set(_loom_cuda_architectures "${CMAKE_CUDA_ARCHITECTURES}")
if(LOOM_HAVE_CUDA AND NOT DEFINED TORCH_CUDA_ARCH_LIST AND NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(TORCH_CUDA_ARCH_LIST "")
  foreach(_arch ${CMAKE_CUDA_ARCHITECTURES})
    string(REGEX REPLACE "^([0-9]+)([0-9])$" "\\1.\\2" _arch "${_arch}")
    list(APPEND TORCH_CUDA_ARCH_LIST "${_arch}")
  endforeach()
endif()
find_package(Torch REQUIRED)
if(LOOM_HAVE_CUDA)
  set(CMAKE_CUDA_ARCHITECTURES "${_loom_cuda_architectures}")
endif()
message(STATUS "Loom: LibTorch ${Torch_VERSION} (${TORCH_LIBRARIES})")

# One precompiled <torch/torch.h> shared by every LibTorch target (loom_use_torch), so each
# translation unit does not re-parse ~200k lines of headers.
add_library(loom_torch_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/torch_pch.cc)
target_link_libraries(loom_torch_pch PUBLIC torch)
target_compile_options(loom_torch_pch PUBLIC ${TORCH_CXX_FLAGS})
target_precompile_headers(loom_torch_pch PRIVATE <torch/torch.h>)

function(loom_use_torch target)
  target_link_libraries(${target} PUBLIC torch loom_blas_flavour)
  target_precompile_headers(${target} REUSE_FROM loom_torch_pch)
endfunction()

# OpenBLAS's threading flavour. Debian's LibTorch runs its element-wise ops on an OpenMP pool
# (libgomp) and its GEMMs in whichever OpenBLAS the libblas.so.3 alternative names: by default
# the pthreads build, whose own pool of N threads spins after every GEMM while LibTorch's N
# OpenMP threads want the same N cores (measured in docs/benchmarks.md: two threads 3.7x slower
# than one). The OpenMP build shares LibTorch's pool and follows torch::set_num_threads, so
# Loom's programs load it when it is installed (scripts/install-deps installs
# libopenblas0-openmp): linked directly, found through the RUNPATH, so its libraries are loaded
# before LibTorch asks for libblas.so.3 by name; the system's alternative is left alone.
# Other LibTorch builds (PyTorch's, with MKL) are not touched.
set(LOOM_OPENBLAS_OPENMP_DIR "/usr/lib/${CMAKE_LIBRARY_ARCHITECTURE}/openblas-openmp"
    CACHE PATH "Where Debian's OpenMP build of OpenBLAS lives")
option(LOOM_OPENBLAS_OPENMP "Load the OpenMP build of OpenBLAS with Debian's LibTorch" ON)
add_library(loom_blas_flavour INTERFACE)
if(LOOM_OPENBLAS_OPENMP AND TORCH_INSTALL_PREFIX STREQUAL "/usr"
   AND EXISTS "${LOOM_OPENBLAS_OPENMP_DIR}/libopenblas.so.0")
  message(STATUS "Loom: OpenBLAS OpenMP build from ${LOOM_OPENBLAS_OPENMP_DIR}")
  # LibTorch's own link items end in --as-needed, which would drop these (nothing calls them
  # directly), so each carries its own --no-as-needed, as LibTorch's torch_cpu does.
  foreach(_lib libopenblas.so.0 libblas.so.3 liblapack.so.3)
    target_link_libraries(loom_blas_flavour INTERFACE
      "-Wl,--no-as-needed,${LOOM_OPENBLAS_OPENMP_DIR}/${_lib}")
  endforeach()
  target_link_options(loom_blas_flavour INTERFACE "LINKER:-rpath,${LOOM_OPENBLAS_OPENMP_DIR}")
  set(CMAKE_INSTALL_RPATH "${CMAKE_INSTALL_RPATH};${LOOM_OPENBLAS_OPENMP_DIR}")
  set(LOOM_OPENBLAS_OPENMP_LOADED ON)
elseif(TORCH_INSTALL_PREFIX STREQUAL "/usr")
  message(STATUS "Loom: no OpenMP build of OpenBLAS (libopenblas0-openmp); multi-threaded "
                 "training will be slow (docs/building.md)")
endif()

# OpenMP for CPU kernels that run on LibTorch's own thread pool
# (plugins/attention/kernels/fused_attention.cc): loom_openmp_sources(FILES...) compiles them
# with OpenMP (without the shared precompiled header, which is built without it) and loom_openmp
# links the OpenMP runtime LibTorch uses, so a process has one pool: Debian's LibTorch uses the
# system libgomp; PyTorch's wheels bundle a renamed copy in torch.libs/, which is linked instead
# when present.
find_package(OpenMP REQUIRED COMPONENTS CXX)
add_library(loom_openmp INTERFACE)
file(GLOB _loom_bundled_gomp "${TORCH_INSTALL_PREFIX}/../torch.libs/libgomp*.so*"
     "${TORCH_INSTALL_PREFIX}/lib/libgomp*.so*")  # torch.libs/ until 2.x, lib/ in 2.15
if(_loom_bundled_gomp)
  list(GET _loom_bundled_gomp 0 _loom_gomp)
  message(STATUS "Loom: OpenMP runtime of the LibTorch distribution: ${_loom_gomp}")
  target_link_libraries(loom_openmp INTERFACE "${_loom_gomp}")
else()
  target_link_libraries(loom_openmp INTERFACE ${OpenMP_CXX_LIBRARIES})
endif()

function(loom_openmp_sources)
  separate_arguments(_flags UNIX_COMMAND "${OpenMP_CXX_FLAGS}")
  set_source_files_properties(${ARGN} PROPERTIES COMPILE_OPTIONS "${_flags}"
                              SKIP_PRECOMPILE_HEADERS ON)
endfunction()
