# LibTorch: Debian's libtorch-dev (1.13, CPU) by default; a LibTorch 2.x distribution (for
# example PyTorch's: -DCMAKE_PREFIX_PATH=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)'))
# on GPU machines. Version differences are handled in api/loom/torch_compat.h only.
find_package(Torch REQUIRED)
message(STATUS "Loom: LibTorch ${Torch_VERSION} (${TORCH_LIBRARIES})")

# One precompiled <torch/torch.h> shared by every LibTorch target (loom_use_torch), so each
# translation unit does not re-parse ~200k lines of headers.
add_library(loom_torch_pch OBJECT ${PROJECT_SOURCE_DIR}/cmake/torch_pch.cc)
target_link_libraries(loom_torch_pch PUBLIC torch)
target_compile_options(loom_torch_pch PUBLIC ${TORCH_CXX_FLAGS})
target_precompile_headers(loom_torch_pch PRIVATE <torch/torch.h>)

function(loom_use_torch target)
  target_link_libraries(${target} PUBLIC torch)
  target_precompile_headers(${target} REUSE_FROM loom_torch_pch)
endfunction()
