// RMSNorm (y = x · rsqrt(mean(x²) + eps) · w over the last dimension) on CPU float32 and float64
// tensors as one row kernel on LibTorch's thread pool, differentiable in x and w. The composite
// form is six element-wise ops forward and about twice that backward, each a pass over the
// activations with its own dispatch; at the tiny-cpu width those passes were a tenth of the step
// and scaled worst with threads (docs/benchmarks.md). The gradient of w sums fixed chunks of rows
// in order, so it does not depend on the thread count.
#ifndef LOOM_WORKER_TRAINER_RMS_NORM_CPU_H_
#define LOOM_WORKER_TRAINER_RMS_NORM_CPU_H_

#include <torch/torch.h>

namespace loom::trainer {

// Whether CpuRmsNorm takes these tensors (CPU, both float32 or both float64).
bool CpuRmsNormApplies(const torch::Tensor& x, const torch::Tensor& weight);

// x [..., D] (any strides), weight [D] of x's dtype.
torch::Tensor CpuRmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

// The composite form: the reference the kernel is tested against, and the path for other dtypes
// and devices.
torch::Tensor CompositeRmsNorm(const torch::Tensor& x, const torch::Tensor& weight, double eps);

}  // namespace loom::trainer

#endif  // LOOM_WORKER_TRAINER_RMS_NORM_CPU_H_
