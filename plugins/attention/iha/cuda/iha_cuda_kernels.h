// Launchers of the CUDA IHA kernels (iha_cuda_kernels.cu), over raw device pointers. No LibTorch
// and no CUDA headers: the stream is a cudaStream_t passed as void*. Each returns an empty string
// on success, else what failed. Only the glue (iha_cuda_glue.cc) calls them, and only when built
// with the kernels (LOOM_IHA_HAVE_CUDA_KERNELS) against a LibTorch with CUDA.
#ifndef LOOM_PLUGINS_ATTENTION_IHA_CUDA_IHA_CUDA_KERNELS_H_
#define LOOM_PLUGINS_ATTENTION_IHA_CUDA_IHA_CUDA_KERNELS_H_

#include <string>

#include "plugins/attention/iha/cuda/iha_cuda_tiles.h"

namespace loom::attention::iha::cuda {

enum class IhaDType { kFloat32, kBFloat16, kFloat16 };

// Writes params.out and params.lse. tile: pseudo rows per block (0 = the largest of 64, 32, 16
// whose shared memory fits the device).
std::string LaunchIhaForward(const IhaCudaParams& params, IhaDType dtype, int tile, void* stream);

// Writes params.dq_pseudo, dk_pseudo and dv_pseudo (the dK/dV kernel, then the dQ kernel).
std::string LaunchIhaBackward(const IhaCudaParams& params, IhaDType dtype, int tile, void* stream);

}  // namespace loom::attention::iha::cuda

#endif  // LOOM_PLUGINS_ATTENTION_IHA_CUDA_IHA_CUDA_KERNELS_H_
