// adamw_cpu.h: the fused AdamW pass against torch.optim.AdamW's formula written as float64
// tensor ops (float64 to 1e-12, float32 to 2e-6 relative to the largest entry), over several
// steps, for parameters whose sizes put the threads' range boundaries inside parameters; the
// same bits at one, two and three threads (the update is element-wise, so the split must not
// change a single result); weight decay only where asked; where it applies; and the version
// counter that autograd checks.
#include "cpu_kernels/adamw_cpu.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <vector>

#include "cpu_kernels/thread_count_for_test.h"

namespace loom::cpu_kernels {
namespace {

constexpr double kLr = 3e-3, kBeta1 = 0.9, kBeta2 = 0.95, kEps = 1e-8, kDecay = 0.1;

// Sizes around the grain (16 384) and odd ones, so that a thread's range starts and ends
// inside parameters, and a parameter smaller than a grain sits between large ones.
const std::vector<int64_t> kSizes = {7, 40000, 130, 16385, 1, 33000};

struct Params {
  std::vector<AdamWTensors> t;
};

Params MakeParams(torch::ScalarType type, uint64_t seed) {
  torch::manual_seed(seed);
  Params p;
  for (size_t i = 0; i < kSizes.size(); ++i) {
    p.t.push_back({torch::randn({kSizes[i]}, torch::kFloat64).to(type), torch::Tensor(),
                   torch::zeros({kSizes[i]}, type), torch::zeros({kSizes[i]}, type),
                   /*decay=*/i % 2 == 1});
  }
  return p;
}

Params Clone(const Params& p, torch::ScalarType type) {
  Params out;
  for (const AdamWTensors& t : p.t) {
    out.t.push_back({t.param.to(type).clone(), t.grad.defined() ? t.grad.to(type).clone() : t.grad,
                     t.exp_avg.to(type).clone(), t.exp_avg_sq.to(type).clone(), t.decay});
  }
  return out;
}

void SetGrads(Params& p, int step) {
  torch::manual_seed(1000 + step);
  for (AdamWTensors& t : p.t) {
    t.grad = torch::randn(t.param.sizes(), torch::kFloat64)
                 .mul_(0.01 * (step + 1))
                 .to(t.param.scalar_type());
  }
}

// torch.optim.AdamW's update as float64 tensor ops (the formula of worker/trainer/adamw.h).
void ReferenceStep(Params& p, int64_t step) {
  const double bc1 = 1 - std::pow(kBeta1, step), bc2 = 1 - std::pow(kBeta2, step);
  for (AdamWTensors& t : p.t) {
    if (t.decay) t.param.mul_(1 - kLr * kDecay);
    t.exp_avg.mul_(kBeta1).add_(t.grad, 1 - kBeta1);
    t.exp_avg_sq.mul_(kBeta2).addcmul_(t.grad, t.grad, 1 - kBeta2);
    t.param.addcdiv_(t.exp_avg, (t.exp_avg_sq.sqrt() / std::sqrt(bc2)).add_(kEps), -kLr / bc1);
  }
}

// Runs `steps` fused updates on a copy of `start` in `type` at `threads`, the reference beside
// it in float64, and returns the largest error of parameters and moments relative to the
// largest reference entry.
double FusedError(const Params& start, torch::ScalarType type, int threads, int steps,
                  Params* fused_out = nullptr) {
  ThreadCount scope(threads);
  Params ref = Clone(start, torch::kFloat64), fused = Clone(start, type);
  double worst = 0;
  for (int s = 1; s <= steps; ++s) {
    SetGrads(ref, s);
    for (size_t i = 0; i < ref.t.size(); ++i) fused.t[i].grad = ref.t[i].grad.to(type);
    ReferenceStep(ref, s);
    FusedAdamWStep(fused.t, {kLr, kBeta1, kBeta2, kEps, kDecay, s});
    for (size_t i = 0; i < ref.t.size(); ++i) {
      for (auto [a, b] : {std::pair{fused.t[i].param, ref.t[i].param},
                          {fused.t[i].exp_avg, ref.t[i].exp_avg},
                          {fused.t[i].exp_avg_sq, ref.t[i].exp_avg_sq}}) {
        const double scale = std::max(1e-30, b.abs().max().item<double>());
        worst = std::max(worst, (a.to(torch::kFloat64) - b).abs().max().item<double>() / scale);
      }
    }
  }
  if (fused_out != nullptr) *fused_out = fused;
  return worst;
}

TEST(FusedAdamW, MatchesTheReferenceInFloat64AndFloat32) {
  const Params start = MakeParams(torch::kFloat64, 1);
  for (int threads : {1, 2, 3}) {
    EXPECT_LT(FusedError(start, torch::kFloat64, threads, 6), 1e-12) << threads << " threads";
    EXPECT_LT(FusedError(start, torch::kFloat32, threads, 6), 2e-6) << threads << " threads";
  }
}

TEST(FusedAdamW, SameBitsOnAnyThreadCount) {
  const Params start = MakeParams(torch::kFloat32, 2);
  Params one, two, three;
  FusedError(start, torch::kFloat32, 1, 3, &one);
  FusedError(start, torch::kFloat32, 2, 3, &two);
  FusedError(start, torch::kFloat32, 3, 3, &three);
  for (size_t i = 0; i < one.t.size(); ++i) {
    EXPECT_TRUE(torch::equal(one.t[i].param, two.t[i].param)) << "parameter " << i;
    EXPECT_TRUE(torch::equal(one.t[i].param, three.t[i].param)) << "parameter " << i;
    EXPECT_TRUE(torch::equal(one.t[i].exp_avg_sq, three.t[i].exp_avg_sq)) << "parameter " << i;
  }
}

TEST(FusedAdamW, DecaysOnlyWhereAsked) {
  // A zero gradient leaves the moments at zero and the Adam step at 0/(0 + eps) = 0, so the
  // parameter changes by weight decay alone.
  torch::Tensor w = torch::ones({50000}), b = torch::ones({3});
  std::vector<AdamWTensors> p = {
      {w, torch::zeros_like(w), torch::zeros_like(w), torch::zeros_like(w), true},
      {b, torch::zeros_like(b), torch::zeros_like(b), torch::zeros_like(b), false}};
  ThreadCount scope(2);
  FusedAdamWStep(p, {0.5, kBeta1, kBeta2, kEps, 0.2, 1});
  EXPECT_TRUE(torch::allclose(w, torch::full({50000}, 0.9f)));
  EXPECT_TRUE(torch::equal(b, torch::ones({3})));
}

TEST(FusedAdamW, AppliesToContiguousCpuFloatTensorsOfOneSize) {
  auto make = [](torch::Tensor p) {
    return AdamWTensors{p, torch::ones_like(p), torch::zeros_like(p), torch::zeros_like(p), true};
  };
  EXPECT_TRUE(FusedAdamWApplies(make(torch::ones({4, 3}))));
  EXPECT_TRUE(FusedAdamWApplies(make(torch::ones({4, 3}, torch::kFloat64))));
  EXPECT_FALSE(FusedAdamWApplies(make(torch::ones({4, 3}, torch::kBFloat16))));
  AdamWTensors strided = make(torch::ones({4, 3}));
  strided.grad = torch::ones({3, 4}).t();  // a transposed gradient: not contiguous
  EXPECT_FALSE(FusedAdamWApplies(strided));
  AdamWTensors mixed = make(torch::ones({4, 3}));
  mixed.grad = mixed.grad.to(torch::kFloat64);
  EXPECT_FALSE(FusedAdamWApplies(mixed));
  AdamWTensors no_grad = make(torch::ones({4, 3}));
  no_grad.grad = torch::Tensor();
  EXPECT_FALSE(FusedAdamWApplies(no_grad));
  setenv("LOOM_CPU_ADAMW", "torch", 1);
  EXPECT_FALSE(FusedAdamWApplies(make(torch::ones({4, 3}))));
  unsetenv("LOOM_CPU_ADAMW");
  EXPECT_THROW(FusedAdamWStep({strided}, {kLr, kBeta1, kBeta2, kEps, kDecay, 1}), c10::Error);
}

TEST(FusedAdamW, BumpsTheParametersVersion) {
  // Autograd compares saved tensors' versions: an update must count as an in-place write.
  torch::Tensor w = torch::ones({8}).requires_grad_();
  const auto before = w._version();
  std::vector<AdamWTensors> p = {
      {w, torch::ones({8}), torch::zeros({8}), torch::zeros({8}), false}};
  {
    torch::NoGradGuard no_grad;
    FusedAdamWStep(p, {kLr, kBeta1, kBeta2, kEps, kDecay, 1});
  }
  EXPECT_GT(w._version(), before);
  EXPECT_LT(w.max().item<float>(), 1.0f);
}

}  // namespace
}  // namespace loom::cpu_kernels
