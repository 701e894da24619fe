// linear_cpu.h: the row-split linear against torch::linear computed in float64 (float64 to
// 1e-12, float32 to 1e-5 relative), forward and the gradients of x, W and b, at two and three
// threads, for 2-D and 3-D inputs, non-contiguous inputs, row counts that do not divide evenly,
// with and without a bias; only the gradients asked for are computed; where it applies and where
// torch::linear is kept (CPU autocast included, which must stay bf16); and a clear error for
// mismatched shapes.
#include "cpu_kernels/linear_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/autocast_mode.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <string>
#include <vector>

#include "cpu_kernels/thread_count_for_test.h"
#include "loom/torch_compat.h"

namespace loom::cpu_kernels {
namespace {

// bf16 autocast on the CPU (LibTorch 2.4 replaced the per-device setters).
void SetCpuAutocast(bool on) {
#if LOOM_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  at::autocast::set_autocast_enabled(at::kCPU, on);
#else
  at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
  at::autocast::set_cpu_enabled(on);
#endif
  if (!on) at::autocast::clear_cache();
}

struct Result {
  torch::Tensor y, dx, dw, db;
};

struct Case {
  std::vector<int64_t> x_shape;
  int64_t out = 0;
  bool bias = false, transposed = false;
};

Result RunLinear(bool row_split, torch::ScalarType type, const Case& c, uint64_t seed) {
  torch::manual_seed(seed);
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  const int64_t in = c.x_shape.back();
  torch::Tensor x64 =
      c.transposed ? torch::randn({in, c.x_shape[0]}, f64).t() : torch::randn(c.x_shape, f64);
  torch::Tensor w64 = torch::randn({c.out, in}, f64) / std::sqrt(static_cast<double>(in));
  torch::Tensor b64 = torch::randn({c.out}, f64);
  std::vector<int64_t> y_shape = c.x_shape;
  y_shape.back() = c.out;
  torch::Tensor upstream = torch::randn(y_shape, f64).to(type);
  torch::Tensor x = x64.to(type).requires_grad_(), w = w64.to(type).requires_grad_();
  torch::Tensor b = c.bias ? b64.to(type).requires_grad_() : torch::Tensor();
  if (c.transposed) {
    EXPECT_FALSE(x.is_contiguous());
  }
  torch::Tensor y = row_split ? RowSplitLinear(x, w, b) : torch::linear(x, w, b);
  std::vector<torch::Tensor> wrt{x, w};
  if (c.bias) wrt.push_back(b);
  auto grads = torch::autograd::grad({(y * upstream).sum()}, wrt);
  return {y.detach(), grads[0], grads[1], c.bias ? grads[2] : torch::Tensor()};
}

// The autograd node that made y, looking through the reshape back to [..., out].
std::string Node(const torch::Tensor& y) {
  auto node = y.grad_fn();
  if (node->name().find("View") != std::string::npos) node = node->next_edges()[0].function;
  return node->name();
}

double RelErr(const torch::Tensor& got, const torch::Tensor& want) {
  torch::Tensor w = want.to(torch::kFloat64);
  return ((got.to(torch::kFloat64) - w).abs().max() / w.abs().max().clamp_min(1e-30))
      .item<double>();
}

TEST(RowSplitLinear, MatchesTheFloat64ReferenceForwardAndGradients) {
  const std::vector<Case> cases = {
      {{2048, 128}, 512, false, false}, {{8, 256, 128}, 384, true, false},
      {{333, 64}, 100, true, false},    {{250, 96}, 40, false, true},
      {{3, 41, 16}, 7, true, false},    {{1, 5}, 3, false, false}};
  uint64_t seed = 1;
  for (int threads : {2, 3}) {
    ThreadCount scope(threads);
    for (const Case& c : cases) {
      const Result want = RunLinear(false, torch::kFloat64, c, seed);
      for (auto [type, tol] :
           {std::pair{torch::kFloat64, 1e-12}, std::pair{torch::kFloat32, 1e-5}}) {
        SCOPED_TRACE(testing::Message() << "x " << torch::IntArrayRef(c.x_shape) << " out " << c.out
                                        << " bias=" << c.bias << " transposed=" << c.transposed
                                        << " threads=" << threads << " " << type);
        const Result got = RunLinear(true, type, c, seed);
        EXPECT_EQ(got.y.sizes(), want.y.sizes());
        EXPECT_EQ(got.y.scalar_type(), type);
        EXPECT_LT(RelErr(got.y, want.y), tol);
        EXPECT_LT(RelErr(got.dx, want.dx), tol);
        EXPECT_LT(RelErr(got.dw, want.dw), tol);
        if (c.bias) {
          EXPECT_LT(RelErr(got.db, want.db), tol);
        }
      }
      ++seed;
    }
  }
}

TEST(RowSplitLinear, ComputesOnlyTheGradientsAskedFor) {
  ThreadCount scope(2);
  torch::Tensor x = torch::randn({512, 64}), w = torch::randn({64, 64}, torch::requires_grad());
  torch::Tensor y = RowSplitLinear(x, w, {});
  auto dw = torch::autograd::grad({y.sum()}, {w});
  EXPECT_TRUE(torch::allclose(dw[0], torch::ones({512, 64}).t().mm(x), 1e-5, 1e-4));
  // A frozen weight: only x's gradient.
  torch::Tensor x2 = torch::randn({512, 64}, torch::requires_grad());
  auto dx = torch::autograd::grad({RowSplitLinear(x2, w.detach(), {}).sum()}, {x2});
  EXPECT_TRUE(torch::allclose(dx[0], torch::ones({512, 64}).mm(w.detach()), 1e-5, 1e-4));
}

TEST(RowSplitLinear, AppliesToLargeCpuFloatsOnMoreThanOneThread) {
  torch::Tensor x = torch::randn({8, 256, 128}), w = torch::randn({512, 128});
  {
    ThreadCount scope(1);
    EXPECT_FALSE(RowSplitLinearApplies(x, w, {}));  // nothing to split over
    EXPECT_EQ(Node(Linear(x.requires_grad_(), w)).find("RowSplit"), std::string::npos);
  }
  ThreadCount scope(2);
  EXPECT_TRUE(RowSplitLinearApplies(x, w, {}));
  EXPECT_TRUE(RowSplitLinearApplies(x.to(torch::kFloat64), w.to(torch::kFloat64), {}));
  const std::string node = Node(Linear(x, w));
  EXPECT_NE(node.find("RowSplitLinearFunction"), std::string::npos) << node;
  const std::string affine = Node(Linear(x, w, torch::zeros({512})));
  EXPECT_NE(affine.find("RowSplitAffineFunction"), std::string::npos) << affine;
  EXPECT_FALSE(RowSplitLinearApplies(x.to(torch::kBFloat16), w.to(torch::kBFloat16), {}));
  EXPECT_FALSE(RowSplitLinearApplies(x, w.to(torch::kFloat64), {}));
  EXPECT_FALSE(RowSplitLinearApplies(x, w, torch::zeros({512}, torch::kFloat64)));
  EXPECT_FALSE(RowSplitLinearApplies(torch::randn({1, 128}), w, {}));  // one decode row
  EXPECT_FALSE(RowSplitLinearApplies(torch::randn({64, 8}), torch::randn({8, 8}), {}));  // tiny
  // Inside a parallel region (a caller's own parallel_for) the split would run serially anyway.
  std::atomic<int> applied{0};
  at::parallel_for(0, 2, 1, [&](int64_t, int64_t) {
    if (RowSplitLinearApplies(x, w, {})) ++applied;
  });
  EXPECT_EQ(applied.load(), 0);
}

TEST(RowSplitLinear, CpuAutocastKeepsTorchLinearAndItsBf16) {
  ThreadCount scope(2);
  torch::Tensor x = torch::randn({8, 256, 128}), w = torch::randn({512, 128});
  ASSERT_TRUE(RowSplitLinearApplies(x, w, {}));
  SetCpuAutocast(true);
  const bool applies = RowSplitLinearApplies(x, w, {});
  const torch::ScalarType type = Linear(x, w).scalar_type();
  SetCpuAutocast(false);
  EXPECT_FALSE(applies);
  EXPECT_EQ(type, torch::kBFloat16);
}

TEST(RowSplitLinear, MismatchedShapesAreAClearError) {
  try {
    RowSplitLinear(torch::randn({64, 8}), torch::randn({16, 7}), {});
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("weight [16, 7]"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace loom::cpu_kernels
