// The plumbing the fast attention kernels share between LibTorch and their tile code: input
// checks and segment ids in the kernels' layout (their RoPE tables: rope.h), and what their
// autograd functions keep for the backward pass. Used by the fused CPU kernel
// (fused_attention.cc) and the IHA CUDA glue (iha/cuda/iha_cuda_glue.cc); the reference path
// (iha/iha_core.h) needs none of it.
#ifndef LOOM_PLUGINS_ATTENTION_KERNELS_KERNEL_AUTOGRAD_H_
#define LOOM_PLUGINS_ATTENTION_KERNELS_KERNEL_AUTOGRAD_H_

#include <torch/torch.h>

#include <cstdint>

#include "plugins/attention/kernels/attention_options.h"

namespace loom::attention::kernels {

// What the fused kernels (CPU, fused_attention.h; CUDA, iha/cuda/iha_cuda.h) take besides q,
// k, v and the RoPE tables (rope.h: ExpandedRopeTables): CheckKernelInputs validates the shapes
// (TORCH_CHECK); KernelSegments gives options.segments as contiguous int64 [B|1, N] on `device`
// (empty [0] without).
void CheckKernelInputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& alpha_q, const torch::Tensor& alpha_k,
                       const torch::Tensor& alpha_v, const Options& options);
torch::Tensor KernelSegments(const Options& options, int64_t batch, int64_t length,
                             const torch::Device& device);

// The fused kernels' autograd functions pass Options through apply() as scalars (segments and
// RoPE travel as tensors) and keep them for the backward pass: KernelOptions rebuilds them,
// SaveKernelOptions / SavedKernelOptions keep them in the context, LeadingGrads pads the
// backward's gradients of the leading inputs with undefined ones for the rest of apply()'s
// `inputs` arguments, and PseudoRowDelta is the softmax backward's per-row term rowsum(dO ∘ O)
// of pseudo outputs [B, N, H, P, dv], as `type`, heads-major [B, H, N·P].
Options KernelOptions(int64_t p, int64_t mask, int64_t window, int64_t score, double scale);
void SaveKernelOptions(torch::autograd::AutogradContext* ctx, const Options& options);
Options SavedKernelOptions(torch::autograd::AutogradContext* ctx);
torch::autograd::variable_list LeadingGrads(torch::autograd::variable_list grads, size_t inputs);
torch::Tensor PseudoRowDelta(const torch::Tensor& grad_out, const torch::Tensor& out,
                             torch::ScalarType type);

}  // namespace loom::attention::kernels

#endif  // LOOM_PLUGINS_ATTENTION_KERNELS_KERNEL_AUTOGRAD_H_
