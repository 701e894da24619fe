// collapse_cpu.h: the row kernel against the einsum it replaces (float64 to 1e-12, float32 to
// 1e-5 relative), forward and both gradients, for contiguous and permuted pseudo outputs and row
// counts that are not a multiple of the kernel's chunk; the gradient of R bitwise the same at one
// and two threads; and Collapse() taking it exactly for CPU float32/float64.
#include "plugins/attention/iha/collapse_cpu.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <vector>

#include "cpu_kernels/thread_count_for_test.h"
#include "plugins/attention/iha/iha_core.h"

namespace loom::attention::iha {
namespace {

struct Result {
  torch::Tensor out, dpseudo, dcollapse;
};

// pseudo [B, N, H, P, dv]; permuted: built as [B, H, N, P, dv] and viewed, as the reference path
// passes it.
Result RunCollapse(bool fast, torch::ScalarType type, int64_t b, int64_t n, int64_t h, int64_t p,
                   int64_t d, bool permuted, uint64_t seed) {
  torch::manual_seed(seed);
  auto opts = torch::TensorOptions().dtype(type);
  torch::Tensor pseudo = permuted ? torch::randn({b, h, n, p, d}, opts).permute({0, 2, 1, 3, 4})
                                  : torch::randn({b, n, h, p, d}, opts);
  pseudo.requires_grad_();
  torch::Tensor collapse = torch::randn({h, h * p}, opts).requires_grad_();
  torch::Tensor upstream = torch::randn({b, n, h, d}, opts);
  torch::Tensor out = fast ? CpuCollapse(pseudo, collapse) : EinsumCollapse(pseudo, collapse);
  auto grads = torch::autograd::grad({(out * upstream).sum()}, {pseudo, collapse});
  return {out.detach(), grads[0], grads[1]};
}

double RelErr(const torch::Tensor& got, const torch::Tensor& want) {
  return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item<double>();
}

TEST(CpuCollapse, MatchesTheEinsumForwardAndGradients) {
  struct Shape {
    int64_t b, n, h, p, d;
  };
  uint64_t seed = 1;
  for (Shape s : {Shape{2, 5, 3, 2, 4}, Shape{3, 71, 4, 2, 32}, Shape{1, 9, 2, 4, 6}}) {
    for (bool permuted : {false, true}) {
      for (auto [type, tol] :
           {std::pair{torch::kFloat64, 1e-12}, std::pair{torch::kFloat32, 1e-5}}) {
        const Result got = RunCollapse(true, type, s.b, s.n, s.h, s.p, s.d, permuted, seed);
        const Result want = RunCollapse(false, type, s.b, s.n, s.h, s.p, s.d, permuted, seed);
        ++seed;
        SCOPED_TRACE(testing::Message() << "n=" << s.n << " h=" << s.h << " p=" << s.p
                                        << " permuted=" << permuted << " type=" << type);
        EXPECT_EQ(got.out.sizes(), want.out.sizes());
        EXPECT_LT(RelErr(got.out, want.out), tol);
        EXPECT_LT(RelErr(got.dpseudo, want.dpseudo), tol);
        EXPECT_LT(RelErr(got.dcollapse, want.dcollapse), tol);
      }
    }
  }
}

TEST(CpuCollapse, GradientOfRDoesNotDependOnTheThreadCount) {
  auto run = [](int threads) {
    cpu_kernels::ThreadCount scope(threads);
    return RunCollapse(true, torch::kFloat32, 4, 300, 4, 2, 32, false, 7);
  };
  const Result one = run(1), two = run(2);
  EXPECT_TRUE(torch::equal(one.dcollapse, two.dcollapse));
  EXPECT_TRUE(torch::equal(one.out, two.out));
}

TEST(CpuCollapse, CollapseTakesItForCpuFloatsOnly) {
  torch::Tensor f32 = torch::randn({1, 2, 2, 2, 3}), r = torch::randn({2, 4});
  EXPECT_TRUE(CpuCollapseApplies(f32, r));
  EXPECT_TRUE(CpuCollapseApplies(f32.to(torch::kFloat64), r.to(torch::kFloat64)));
  EXPECT_FALSE(CpuCollapseApplies(f32.to(torch::kBFloat16), r.to(torch::kBFloat16)));
  EXPECT_FALSE(CpuCollapseApplies(f32, r.to(torch::kFloat64)));
  // Collapse converts R to the pseudo outputs' type first, as the einsum did.
  EXPECT_TRUE(torch::allclose(Collapse(f32, r.to(torch::kFloat64)), EinsumCollapse(f32, r)));
  EXPECT_TRUE(torch::allclose(Collapse(f32.to(torch::kBFloat16), r).to(torch::kFloat32),
                              EinsumCollapse(f32.to(torch::kBFloat16), r).to(torch::kFloat32)));
}

}  // namespace
}  // namespace loom::attention::iha
