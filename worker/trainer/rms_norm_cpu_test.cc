// rms_norm_cpu.h: the row kernel against the composite RMSNorm computed in float64 (float64 to
// 1e-12, float32 to 1e-5 relative), forward and both gradients, for contiguous and transposed
// inputs and row counts that are not a multiple of the kernel's chunk; the gradient of the weight
// bitwise the same at one and two threads; the model's RMSNorm taking it exactly for CPU floats;
// and a clear error for mismatched shapes.
#include "worker/trainer/rms_norm_cpu.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "cpu_kernels/thread_count_for_test.h"
#include "worker/trainer/model.h"

namespace loom::trainer {
namespace {

struct Result {
  torch::Tensor y, dx, dw;
};

// x [..., D]; `transposed`: built with its last two dimensions swapped and viewed back, so that
// the kernel reads a non-contiguous input.
Result RunNorm(bool kernel, torch::ScalarType type, std::vector<int64_t> shape, bool transposed,
               uint64_t seed) {
  torch::manual_seed(seed);
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  const int64_t dim = shape.back();
  torch::Tensor x64;
  if (transposed) {
    std::vector<int64_t> swapped = shape;
    std::swap(swapped[swapped.size() - 1], swapped[swapped.size() - 2]);
    x64 = torch::randn(swapped, f64).transpose(-1, -2);
  } else {
    x64 = torch::randn(shape, f64);
  }
  torch::Tensor w64 = 1 + 0.5 * torch::randn({dim}, f64);
  torch::Tensor upstream = torch::randn(shape, f64).to(type);
  torch::Tensor x = x64.to(type).requires_grad_(), w = w64.to(type).requires_grad_();
  if (transposed && shape[shape.size() - 2] > 1) {
    EXPECT_FALSE(x.is_contiguous());
  }
  torch::Tensor y = kernel ? CpuRmsNorm(x, w, 1e-5) : CompositeRmsNorm(x, w, 1e-5);
  auto grads = torch::autograd::grad({(y * upstream).sum()}, {x, w});
  return {y.detach(), grads[0], grads[1]};
}

double RelErr(const torch::Tensor& got, const torch::Tensor& want) {
  torch::Tensor w = want.to(torch::kFloat64);
  return ((got.to(torch::kFloat64) - w).abs().max() / w.abs().max().clamp_min(1e-30))
      .item<double>();
}

TEST(CpuRmsNorm, MatchesTheFloat64CompositeForwardAndGradients) {
  uint64_t seed = 1;
  for (std::vector<int64_t> shape : std::vector<std::vector<int64_t>>{
           {2, 5, 8}, {3, 71, 128}, {1, 1, 3}, {130, 64}, {4, 33, 256}}) {
    for (bool transposed : {false, true}) {
      const Result want = RunNorm(false, torch::kFloat64, shape, transposed, seed);
      for (auto [type, tol] :
           {std::pair{torch::kFloat64, 1e-12}, std::pair{torch::kFloat32, 1e-5}}) {
        SCOPED_TRACE(testing::Message() << "shape " << torch::IntArrayRef(shape)
                                        << " transposed=" << transposed << " type=" << type);
        const Result got = RunNorm(true, type, shape, transposed, seed);
        EXPECT_EQ(got.y.sizes(), want.y.sizes());
        EXPECT_EQ(got.y.scalar_type(), type);
        EXPECT_LT(RelErr(got.y, want.y), tol);
        EXPECT_LT(RelErr(got.dx, want.dx), tol);
        EXPECT_LT(RelErr(got.dw, want.dw), tol);
      }
      ++seed;
    }
  }
}

TEST(CpuRmsNorm, GradientOfTheWeightDoesNotDependOnTheThreadCount) {
  auto run = [](int threads) {
    cpu_kernels::ThreadCount scope(threads);
    return RunNorm(true, torch::kFloat32, {8, 300, 128}, false, 7);
  };
  const Result one = run(1), two = run(2);
  EXPECT_TRUE(torch::equal(one.dw, two.dw));
  EXPECT_TRUE(torch::equal(one.dx, two.dx));
  EXPECT_TRUE(torch::equal(one.y, two.y));
}

TEST(CpuRmsNorm, TheModelsNormTakesItForCpuFloatsOnly) {
  RMSNorm norm(16, 1e-6);
  torch::Tensor x = torch::randn({2, 3, 16}, torch::requires_grad());
  const std::string fused = norm->forward(x).grad_fn()->name();
  EXPECT_NE(fused.find("RmsNormFunction"), std::string::npos) << fused;
  EXPECT_TRUE(CpuRmsNormApplies(x, torch::ones({16}, torch::kFloat64).to(torch::kFloat32)));
  EXPECT_FALSE(CpuRmsNormApplies(x.to(torch::kBFloat16), torch::ones({16}, torch::kBFloat16)));
  EXPECT_FALSE(CpuRmsNormApplies(x, torch::ones({16}, torch::kFloat64)));
  // A bfloat16 input (CPU autocast) takes the composite form, in a wider result type as before.
  torch::Tensor bf = x.detach().to(torch::kBFloat16);
  EXPECT_TRUE(torch::allclose(norm->forward(bf).to(torch::kFloat32),
                              CompositeRmsNorm(bf, torch::ones({16}), 1e-6).to(torch::kFloat32)));
}

TEST(CpuRmsNorm, MismatchedShapesAreAClearError) {
  try {
    CpuRmsNorm(torch::randn({2, 8}), torch::ones({7}), 1e-5);
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("weight [7]"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace loom::trainer
