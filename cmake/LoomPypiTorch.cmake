# LOOM_TORCH=pypi: LibTorch 2.x from PyPI's torch wheel, in the virtual environment
# scripts/install-deps makes from scripts/pins/torch.txt (.tools/torch), found through the
# wheel's own CMake config. The wheel is built with CUDA, so its config needs a CUDA toolkit:
# the pinned nvidia-* wheels hold its pieces (nvcc, headers, runtime) under nvidia/cu13 in a
# layout of their own, which this file presents as a toolkit (a folder of links in the build
# tree) to nvcc, FindCUDA and FindCUDAToolkit. Included before cmake/LoomCuda.cmake.
# LOOM_TORCH_SITE: the site-packages folder holding torch (scripts/gpu-check passes the GPU
# machine's own); by default the one of .tools/torch.
file(GLOB _loom_site "${PROJECT_SOURCE_DIR}/.tools/torch/lib/python3*/site-packages")
set(LOOM_TORCH_SITE "${_loom_site}" CACHE PATH "site-packages with PyPI's torch (LOOM_TORCH=pypi)")
set(_loom_site "${LOOM_TORCH_SITE}")
if(NOT EXISTS "${_loom_site}/torch/share/cmake/Torch/TorchConfig.cmake")
  message(FATAL_ERROR "LOOM_TORCH=pypi: no torch in '${_loom_site}' "
                      "(scripts/install-deps installs it into .tools/torch)")
endif()
list(PREPEND CMAKE_PREFIX_PATH "${_loom_site}/torch/share/cmake")
# Its libraries before the system's: the config searches its own lib/ only after the system
# folders, where Debian's libtorch.so may be. (Not torch/ as a prefix: its bin/ has a protoc of
# its own, without the well-known .proto files.)
list(PREPEND CMAKE_LIBRARY_PATH "${_loom_site}/torch/lib")

# Where the wheels hold no nvcc (a GPU machine's torch alone), cmake/LoomCuda.cmake looks for
# the machine's own toolkit as usual.
file(GLOB _loom_cu "${_loom_site}/nvidia/cu[0-9]*/bin/nvcc")
if(_loom_cu AND NOT LOOM_CUDA STREQUAL "OFF")
  list(GET _loom_cu 0 _loom_cu)
  get_filename_component(_loom_cu "${_loom_cu}" DIRECTORY)
  get_filename_component(_loom_cu "${_loom_cu}" DIRECTORY)
  set(_loom_root "${PROJECT_BINARY_DIR}/cuda-toolkit")
  file(MAKE_DIRECTORY "${_loom_root}/lib64")
  # nvcc finds its front end and headers relative to the folder it is called from (nvcc.profile:
  # TOP = $(_HERE_)/..), so bin, include and nvvm are linked as folders.
  foreach(_dir bin include nvvm)
    file(CREATE_LINK "${_loom_cu}/${_dir}" "${_loom_root}/${_dir}" SYMBOLIC)
  endforeach()
  # The wheels ship only versioned sonames (libcudart.so.13): the unversioned names the find
  # modules look for are added beside them.
  file(GLOB _loom_libs "${_loom_cu}/lib/lib*.so.*" "${_loom_cu}/lib/lib*.a")
  foreach(_lib ${_loom_libs})
    get_filename_component(_name "${_lib}" NAME)
    file(CREATE_LINK "${_lib}" "${_loom_root}/lib64/${_name}" SYMBOLIC)
    string(REGEX REPLACE "\\.so\\..*$" ".so" _plain "${_name}")
    file(CREATE_LINK "${_lib}" "${_loom_root}/lib64/${_plain}" SYMBOLIC)
  endforeach()
  file(CREATE_LINK "${_loom_root}/lib64" "${_loom_root}/lib" SYMBOLIC)
  set(CUDAToolkit_ROOT "${_loom_root}")
  set(CUDA_TOOLKIT_ROOT_DIR "${_loom_root}" CACHE PATH "CUDA toolkit (the PyPI wheels, linked)")
  set(CMAKE_CUDA_COMPILER "${_loom_root}/bin/nvcc" CACHE FILEPATH "nvcc")
  set(LOOM_NCCL_HINT "${_loom_site}/nvidia/nccl")
  message(STATUS "Loom: CUDA toolkit from PyPI wheels (${_loom_cu}), linked in ${_loom_root}")
endif()
