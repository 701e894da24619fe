// IHA's collapse (pseudo outputs [B, N, H, P, dv] × R [H, H·P] → [B, N, H, dv]) on CPU float32 and
// float64 tensors as a row kernel on LibTorch's thread pool, differentiable in both inputs.
// LibTorch's einsum runs it as one skinny GEMM (K = H·P, N = H: 65536×8×4 at the tiny-cpu width)
// that OpenBLAS makes 2–3 × slower with two threads than with one (docs/benchmarks.md); here each
// thread takes whole rows. The gradient of R sums fixed chunks of rows in order, so it does not
// depend on the thread count.
#ifndef LOOM_PLUGINS_ATTENTION_IHA_COLLAPSE_CPU_H_
#define LOOM_PLUGINS_ATTENTION_IHA_COLLAPSE_CPU_H_

#include <torch/torch.h>

namespace loom::attention::iha {

// Whether CpuCollapse takes these tensors (CPU, both float32 or both float64).
bool CpuCollapseApplies(const torch::Tensor& pseudo, const torch::Tensor& collapse);

// pseudo [B, N, H, P, dv] (any strides), collapse [H, H·P] of pseudo's dtype.
torch::Tensor CpuCollapse(const torch::Tensor& pseudo, const torch::Tensor& collapse);

}  // namespace loom::attention::iha

#endif  // LOOM_PLUGINS_ATTENTION_IHA_COLLAPSE_CPU_H_
