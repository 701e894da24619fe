#include "cpu_kernels/adamw_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

namespace loom::cpu_kernels {
namespace {

// Elements per thread below which a range stays on one thread: the update is a few ns per
// element, a fork/join some µs.
constexpr int64_t kGrainElements = 16384;

bool FusedAllowed() {
  const char* mode = std::getenv("LOOM_CPU_ADAMW");
  return mode == nullptr || std::strcmp(mode, "torch") != 0;
}

// The per-step scalars in the parameters' dtype, rounded as ATen rounds a Scalar argument.
template <typename T>
struct Coefficients {
  T decay_factor, beta1, one_minus_beta1, beta2, one_minus_beta2, sqrt_bc2, eps, step_size;
  explicit Coefficients(const AdamWStepCoefficients& c)
      : decay_factor(static_cast<T>(1.0 - c.lr * c.weight_decay)),
        beta1(static_cast<T>(c.beta1)),
        one_minus_beta1(static_cast<T>(1.0 - c.beta1)),
        beta2(static_cast<T>(c.beta2)),
        one_minus_beta2(static_cast<T>(1.0 - c.beta2)),
        sqrt_bc2(static_cast<T>(std::sqrt(1.0 - std::pow(c.beta2, static_cast<double>(c.step))))),
        eps(static_cast<T>(c.eps)),
        step_size(static_cast<T>(-c.lr / (1.0 - std::pow(c.beta1, static_cast<double>(c.step))))) {}
};

// x86-64: an AVX2 copy of the update beside the baseline one, picked at load time (the update is
// bound by sqrt and division, which AVX2 does eight floats at a time; the build's baseline is
// SSE2). Vectorising needs -fno-math-errno (CMakeLists.txt); -ffp-contract=off there keeps
// both copies and the scalar tail rounding alike, so results do not depend on the split.
#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define LOOM_AVX2_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef LOOM_AVX2_CLONES
#define LOOM_AVX2_CLONES
#endif

// Elements [lo, hi) of one parameter, in the reference path's order of operations:
// mul_, mul_ + add_(alpha), mul_ + addcmul_, sqrt / + eps, addcdiv_.
template <typename T>
inline __attribute__((always_inline)) void UpdateRange(const AdamWTensors& t, int64_t lo,
                                                       int64_t hi, const Coefficients<T>& k) {
  T* __restrict p = t.param.data_ptr<T>();
  const T* __restrict g = t.grad.data_ptr<T>();
  T* __restrict m = t.exp_avg.data_ptr<T>();
  T* __restrict v = t.exp_avg_sq.data_ptr<T>();
  const T decay = t.decay ? k.decay_factor : T(1);
  for (int64_t i = lo; i < hi; ++i) {
    const T gi = g[i];
    const T mi = m[i] * k.beta1 + k.one_minus_beta1 * gi;
    const T vi = v[i] * k.beta2 + k.one_minus_beta2 * gi * gi;
    const T denom = std::sqrt(vi) / k.sqrt_bc2 + k.eps;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay + k.step_size * (mi / denom);
  }
}

LOOM_AVX2_CLONES void UpdateRange(const AdamWTensors& t, int64_t lo, int64_t hi,
                                  const Coefficients<float>& k) {
  UpdateRange<float>(t, lo, hi, k);
}

LOOM_AVX2_CLONES void UpdateRange(const AdamWTensors& t, int64_t lo, int64_t hi,
                                  const Coefficients<double>& k) {
  UpdateRange<double>(t, lo, hi, k);
}

template <typename T>
void Step(const std::vector<AdamWTensors>& params, const AdamWStepCoefficients& c) {
  const Coefficients<T> k(c);
  // Element offsets of the parameters in one virtual flat range, which the threads divide.
  std::vector<int64_t> start(params.size() + 1, 0);
  for (size_t i = 0; i < params.size(); ++i) start[i + 1] = start[i] + params[i].param.numel();
  at::parallel_for(0, start.back(), kGrainElements, [&](int64_t begin, int64_t end) {
    size_t i = std::upper_bound(start.begin(), start.end(), begin) - start.begin() - 1;
    for (; i < params.size() && start[i] < end; ++i) {
      const int64_t lo = std::max(begin, start[i]) - start[i];
      const int64_t hi = std::min(end, start[i + 1]) - start[i];
      if (lo < hi) UpdateRange(params[i], lo, hi, k);
    }
  });
}

}  // namespace

bool FusedAdamWApplies(const AdamWTensors& t) {
  const torch::Tensor* all[] = {&t.param, &t.grad, &t.exp_avg, &t.exp_avg_sq};
  const auto type = t.param.defined() ? t.param.scalar_type() : torch::kFloat32;
  if (type != torch::kFloat32 && type != torch::kFloat64) return false;
  for (const torch::Tensor* x : all) {
    if (!x->defined() || !x->is_cpu() || x->scalar_type() != type || !x->is_contiguous() ||
        x->numel() != t.param.numel()) {
      return false;
    }
  }
  return FusedAllowed();
}

void FusedAdamWStep(const std::vector<AdamWTensors>& params, const AdamWStepCoefficients& c) {
  RECORD_USER_SCOPE("loom::fused_adamw");  // a row of loom-bench-train's op profile
  std::vector<AdamWTensors> f32, f64;
  for (const AdamWTensors& t : params) {
    TORCH_CHECK(FusedAdamWApplies(t), "fused AdamW: parameter of shape ", t.param.sizes(),
                " is not four contiguous CPU float32/float64 tensors of one size");
    (t.param.scalar_type() == torch::kFloat64 ? f64 : f32).push_back(t);
  }
  if (!f32.empty()) Step<float>(f32, c);
  if (!f64.empty()) Step<double>(f64, c);
  // In-place writes through data pointers: tell autograd the parameters changed, as mul_ would.
  for (const AdamWTensors& t : params) torch::autograd::impl::bump_version(t.param);
}

}  // namespace loom::cpu_kernels
