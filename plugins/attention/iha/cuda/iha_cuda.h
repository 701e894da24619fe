// CUDA kernels for Interleaved Head Attention (FlashAttention-style; iha_cuda_tiles.h holds the
// block programs, iha_cuda_kernels.cu the kernels) behind the same contract as
// FusedPseudoOutputs (kernels/fused_attention.h), plus a "stock" baseline on
// at::scaled_dot_product_attention. This header and iha_cuda_glue.cc are the only parts that know
// LibTorch; they compile whether or not LibTorch has CUDA and whether or not the .cu was built
// (then the kernels report why they cannot run, and callers take the reference path).
#ifndef LOOM_PLUGINS_ATTENTION_IHA_CUDA_IHA_CUDA_H_
#define LOOM_PLUGINS_ATTENTION_IHA_CUDA_IHA_CUDA_H_

#include <torch/torch.h>

#include <string>
#include <utility>

#include "plugins/attention/iha/iha_core.h"

namespace loom::attention::iha {

struct CudaOptions {
  int64_t tile = 0;            // pseudo rows per block (16, 32 or 64); 0 = largest that fits
  bool poison_output = false;  // tests: fill outputs and pseudo gradients with NaN first
  // Tests: run the kernels' block programs on the CPU, one thread at a time with emulated
  // shared memory (CPU tensors; no GPU needed). Slow.
  bool emulate = false;
};

// Empty when CudaPseudoOutputs can run these inputs on the GPU, else why not (for example
// "LibTorch built without CUDA", "built without CUDA kernels", "not a CUDA tensor",
// "score=linear", "head dim 160 > 128", "dtype Double").
std::string CudaKernelUnsupportedReason(const torch::Tensor& q, const torch::Tensor& k,
                                        const torch::Tensor& v, const Options& options);

// Same contract as PseudoOutputs / FusedPseudoOutputs: [B, N, H, P, dv] in q's dtype,
// differentiable with respect to q, k, v and the three alpha tensors. q, k, v: float32, bf16 or
// fp16 (compute in float32). Throws with the reason when unsupported.
torch::Tensor CudaPseudoOutputs(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const torch::Tensor& alpha_q,
                                const torch::Tensor& alpha_k, const torch::Tensor& alpha_v,
                                const torch::Tensor& positions, const Options& options,
                                const CudaOptions& cuda = {});

// The un-mixing of a pseudo-row gradient g [B, H, N·P, d] of x [B, N, H, d] mixed by alpha
// [H, H, P]: dx[b, n, m, :] = sum_{h, j} alpha[m, h, j] · g[b, h, n·P + j, :] and
// dalpha[m, h, j] = sum_{b, n, c} x[b, n, m, c] · g[b, h, n·P + j, c]. Float32 results.
std::pair<torch::Tensor, torch::Tensor> UnmixPseudoGradient(const torch::Tensor& x,
                                                            const torch::Tensor& alpha,
                                                            const torch::Tensor& g);

// The stock baseline: MixAndInterleave, RoPE, then at::scaled_dot_product_attention on the N·P
// sequence (interleaved mask = is_causal). Needs LibTorch >= 2.0; no window, no segments, no
// linear score. Empty reason = supported.
std::string StockSdpaUnsupportedReason(const torch::Tensor& q, const Options& options);
torch::Tensor StockSdpaPseudoOutputs(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const torch::Tensor& alpha_q,
                                     const torch::Tensor& alpha_k, const torch::Tensor& alpha_v,
                                     const torch::Tensor& positions, const Options& options);

}  // namespace loom::attention::iha

#endif  // LOOM_PLUGINS_ATTENTION_IHA_CUDA_IHA_CUDA_H_
