// The AdamW update of many parameters in one element-wise pass, split across LibTorch's threads.
// Written as tensor ops (the reference path) an update is nine passes over memory per
// parameter, each its own parallel region — and below ATen's grain size (32 768 elements: every
// 128×128 projection of the tiny-cpu model) single-threaded. Here every element of every
// parameter is read and written once, and the elements of all parameters are divided among the
// threads as one range. The arithmetic is torch.optim.AdamW's (worker/trainer/adamw.h), in the
// parameters' dtype, so float64 results equal the reference path's to rounding.
#ifndef LOOM_CPU_KERNELS_ADAMW_CPU_H_
#define LOOM_CPU_KERNELS_ADAMW_CPU_H_

#include <torch/torch.h>

#include <vector>

namespace loom::cpu_kernels {

struct AdamWStepCoefficients {
  double lr, beta1, beta2, eps, weight_decay;
  int64_t step;  // 1 for the first update (bias corrections 1 − β^step)
};

// One parameter's update: its tensor, gradient and two moments (updated in place); decay says
// whether weight decay applies to it.
struct AdamWTensors {
  torch::Tensor param, grad, exp_avg, exp_avg_sq;
  bool decay;
};

// Whether FusedAdamWStep takes this parameter: four contiguous CPU tensors of one float32 or
// float64 dtype and one size. LOOM_CPU_ADAMW=torch (read at each call) says no everywhere.
bool FusedAdamWApplies(const AdamWTensors& t);

// Updates every parameter of `params` (each must satisfy FusedAdamWApplies) in place.
void FusedAdamWStep(const std::vector<AdamWTensors>& params, const AdamWStepCoefficients& c);

}  // namespace loom::cpu_kernels

#endif  // LOOM_CPU_KERNELS_ADAMW_CPU_H_
