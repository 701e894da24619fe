// y = x·Wᵀ (+ b) on CPU float32/float64 tensors with its rows split across LibTorch's threads:
// each thread runs a single-threaded GEMM on its own block of rows (forward and the input's
// gradient) or of output features (the weight's gradient). The trainer's GEMMs are skinny
// (thousands of rows × 128–1024), and OpenBLAS threading one such GEMM reached 1.44–1.80× on two
// cores where splitting the rows reached 1.91–2.13× (docs/benchmarks.md). torch::linear stays the
// reference it is tested against and the path for other dtypes, devices and tiny inputs.
#ifndef LOOM_CPU_KERNELS_LINEAR_CPU_H_
#define LOOM_CPU_KERNELS_LINEAR_CPU_H_

#include <torch/torch.h>

namespace loom::cpu_kernels {

// Whether RowSplitLinear takes these tensors: CPU, one float32/float64 dtype, more than one
// thread to split over, enough rows for the split to pay, and CPU autocast off (under it
// torch::linear runs in bf16).
bool RowSplitLinearApplies(const torch::Tensor& x, const torch::Tensor& weight,
                           const torch::Tensor& bias);

// x [..., in] (any strides), weight [out, in], bias [out] or undefined; differentiable in all
// three. Throws c10::Error naming the shapes when they do not fit.
torch::Tensor RowSplitLinear(const torch::Tensor& x, const torch::Tensor& weight,
                             const torch::Tensor& bias);

// RowSplitLinear where it applies, torch::linear otherwise: what the model's layers call.
torch::Tensor Linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const torch::Tensor& bias = {});

// The same for a torch::nn::Linear module, so its parameters keep their checkpoint names.
torch::Tensor Linear(const torch::nn::Linear& module, const torch::Tensor& x);

}  // namespace loom::cpu_kernels

#endif  // LOOM_CPU_KERNELS_LINEAR_CPU_H_
