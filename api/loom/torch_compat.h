// The one place that knows LibTorch version differences. Loom builds against Debian's LibTorch
// 1.13 (CPU, CI) and LibTorch 2.x with CUDA (GPU machines); code elsewhere tests the LOOM_TORCH_*
// macros below instead of TORCH_VERSION_* directly.
#ifndef LOOM_API_TORCH_COMPAT_H_
#define LOOM_API_TORCH_COMPAT_H_

#include <torch/version.h>

#include "loom/plugin_abi.h"

#define LOOM_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||       \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// The build stamp compares LibTorch major.minor: patch releases keep the C++ ABI.
#undef LOOM_TORCH_VERSION_STRING
#define LOOM_TORCH_VERSION_STRING \
  LOOM_STAMP_STR(TORCH_VERSION_MAJOR) "." LOOM_STAMP_STR(TORCH_VERSION_MINOR)

// at::scaled_dot_product_attention (fused SDPA / FlashAttention dispatch) appeared in 2.0.
#define LOOM_TORCH_HAS_SDPA LOOM_TORCH_AT_LEAST(2, 0)

// c10::Allocator in 2.3: allocate() is no longer const, and copy_data() is pure virtual. A
// custom allocator declares `c10::DataPtr allocate(size_t n) LOOM_TORCH_ALLOCATE_CONST override`
// and defines copy_data where LOOM_TORCH_ALLOCATOR_HAS_COPY_DATA.
#if LOOM_TORCH_AT_LEAST(2, 3)
#define LOOM_TORCH_ALLOCATE_CONST
#define LOOM_TORCH_ALLOCATOR_HAS_COPY_DATA 1
#else
#define LOOM_TORCH_ALLOCATE_CONST const
#define LOOM_TORCH_ALLOCATOR_HAS_COPY_DATA 0
#endif

#endif  // LOOM_API_TORCH_COMPAT_H_
