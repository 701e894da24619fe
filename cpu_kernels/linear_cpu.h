// y = x·Wᵀ (+ b) on CPU float32/float64 tensors with its rows split across LibTorch's threads:
// each thread runs a single-threaded GEMM on its own block of rows (forward and the input's
// gradient) or of output features (the weight's gradient). The trainer's GEMMs are skinny
// (thousands of rows × 128–1024): OpenBLAS threading each one made the trainer's aten::mm
// 1.45× faster on two cores, the split rows 1.95× (docs/benchmarks.md). torch::linear stays the
// reference it is tested against and the path for other dtypes, devices and small inputs;
// LOOM_CPU_LINEAR=torch (read at each call) keeps it everywhere.
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
