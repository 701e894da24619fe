// One CudaPseudoOutputs run — on a GPU, or emulated on the CPU (CudaOptions::emulate) — against
// the float64 reference (iha_core.h PseudoOutputs + autograd) on the same inputs rounded to the
// kernel's dtype: the output and the gradients of q, k, v and the three alpha tensors, each as
// max |got - ref| / max(1, max |ref|). Shared by iha_cuda_emulation_test and iha_cuda_test.
#ifndef LOOM_PLUGINS_ATTENTION_IHA_CUDA_IHA_CUDA_TEST_UTIL_H_
#define LOOM_PLUGINS_ATTENTION_IHA_CUDA_IHA_CUDA_TEST_UTIL_H_

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "plugins/attention/iha/cuda/iha_cuda.h"
#include "plugins/attention/iha/iha_core.h"

namespace loom::attention::iha {

inline double RelativeError(const torch::Tensor& got, const torch::Tensor& ref) {
  const double scale = std::max(1.0, ref.abs().max().item<double>());
  return (got.cpu().to(torch::kFloat64) - ref).abs().max().item<double>() / scale;
}

struct CudaKernelCheck {
  Options options;  // segments (if any) on the CPU
  int64_t b = 2, n = 1, h = 1, dk = 1, dv = 1;
  double alpha_scale = 1.0;                   // alphas ~ N(0, alpha_scale²), q/k/v ~ N(0, 1)
  int64_t position_offset = 0;                // row 1's token positions start here (row 0's at 0)
  torch::ScalarType dtype = torch::kFloat32;  // q, k, v; the alphas are float32
  torch::Device device = torch::kCPU;         // kCUDA, or kCPU with cuda.emulate
  CudaOptions cuda;
};

// Seeds nothing (callers do). Returns the worst relative error over the output and the six
// gradients; each above `tol`, a non-finite output or gradient, or a wrong dtype fails the test
// with `name`.
inline double ExpectCudaKernelMatchesReference(const CudaKernelCheck& c, double tol,
                                               const std::string& name) {
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  // Kernel inputs on the device, the reference on the same rounded values in float64.
  auto make = [&](std::vector<int64_t> shape, torch::ScalarType t, double scale) {
    torch::Tensor base = (torch::randn(shape, f64) * scale).to(t);
    return std::pair{base.to(c.device).requires_grad_(), base.to(torch::kFloat64).requires_grad_()};
  };
  auto [q, q_ref] = make({c.b, c.n, c.h, c.dk}, c.dtype, 1.0);
  auto [k, k_ref] = make({c.b, c.n, c.h, c.dk}, c.dtype, 1.0);
  auto [v, v_ref] = make({c.b, c.n, c.h, c.dv}, c.dtype, 1.0);
  auto [aq, aq_ref] = make({c.h, c.h, c.options.p}, torch::kFloat32, c.alpha_scale);
  auto [ak, ak_ref] = make({c.h, c.h, c.options.p}, torch::kFloat32, c.alpha_scale);
  auto [av, av_ref] = make({c.h, c.h, c.options.p}, torch::kFloat32, c.alpha_scale);
  torch::Tensor positions = torch::arange(c.n, torch::kInt64).unsqueeze(0).repeat({c.b, 1});
  if (c.b > 1) positions[1] += c.position_offset;
  torch::Tensor upstream = torch::randn({c.b, c.n, c.h, c.options.p, c.dv}, f64);

  torch::Tensor ref =
      PseudoOutputs(q_ref, k_ref, v_ref, aq_ref, ak_ref, av_ref, positions, c.options);
  auto ref_grads = torch::autograd::grad({(ref * upstream).sum()},
                                         {q_ref, k_ref, v_ref, aq_ref, ak_ref, av_ref});
  Options on_device = c.options;
  if (on_device.segments.defined()) on_device.segments = on_device.segments.to(c.device);
  torch::Tensor got =
      CudaPseudoOutputs(q, k, v, aq, ak, av, positions.to(c.device), on_device, c.cuda);
  EXPECT_EQ(got.scalar_type(), c.dtype) << name;
  EXPECT_EQ(got.sizes(), ref.sizes()) << name;
  EXPECT_TRUE(torch::isfinite(got).all().item<bool>()) << "unwritten output elements: " << name;
  double worst = RelativeError(got, ref);
  EXPECT_LE(worst, tol) << "output: " << name;
  auto got_grads = torch::autograd::grad({(got.to(torch::kFloat64) * upstream.to(c.device)).sum()},
                                         {q, k, v, aq, ak, av});
  const char* names[] = {"q", "k", "v", "alpha_q", "alpha_k", "alpha_v"};
  const torch::Tensor* inputs[] = {&q, &k, &v, &aq, &ak, &av};
  for (int i = 0; i < 6; ++i) {
    EXPECT_TRUE(got_grads[i].defined()) << names[i];
    if (!got_grads[i].defined()) continue;
    EXPECT_EQ(got_grads[i].scalar_type(), inputs[i]->scalar_type()) << names[i];
    EXPECT_TRUE(torch::isfinite(got_grads[i]).all().item<bool>())
        << "non-finite gradient of " << names[i] << ": " << name;
    const double err = RelativeError(got_grads[i], ref_grads[i]);
    EXPECT_LE(err, tol) << "gradient of " << names[i] << ": " << name;
    worst = std::max(worst, err);
  }
  return worst;
}

}  // namespace loom::attention::iha

#endif  // LOOM_PLUGINS_ATTENTION_IHA_CUDA_IHA_CUDA_TEST_UTIL_H_
