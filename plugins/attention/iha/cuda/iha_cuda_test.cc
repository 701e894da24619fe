// The CUDA IHA kernels on a real GPU (iha_cuda.h) against the float64 reference computed on the
// CPU (iha_core.h): output and the gradients of q, k, v and the three alpha tensors, float32
// and bf16 inputs, with several tiles per sequence, RoPE, windows, block masks and segments.
// Skips, with the reason, where the kernels cannot run (no CUDA in LibTorch, no GPU, built
// without the kernels). The module's kernel choice and the stock SDPA baseline are checked too.
//
// Tolerances, as max |got - ref| / max(1, max |ref|) per tensor: float32 inputs 2e-4 (float32
// accumulation over up to ~1000 keys); bf16 inputs 5e-2 (outputs and gradients rounded to bf16,
// 2^-8 relative, and delta = rowsum(dO · O) taken from the rounded output; the reference uses
// the same bf16-rounded inputs).
#include "plugins/attention/iha/cuda/iha_cuda.h"

#include <gtest/gtest.h>

#include "plugins/attention/common/attention_test_util.h"
#include "plugins/attention/iha/cuda/iha_cuda_test_util.h"
#include "plugins/attention/iha/iha_attention.h"
#include "plugins/attention/iha/iha_core.h"

namespace loom::attention::iha {
namespace {

struct GpuCase {
  Mask mask;
  int64_t window;
  double rope;
  int64_t p, n, h, d;
  bool segments;
};

std::string SkipReason() {
  if (!torch::cuda::is_available()) return "no CUDA device visible to LibTorch";
  torch::Tensor probe = torch::zeros({1, 1, 1, 8}, torch::TensorOptions().device(torch::kCUDA));
  return CudaKernelUnsupportedReason(probe, probe, probe, Options{});
}

void ExpectGpuMatchesReference(const GpuCase& c, torch::ScalarType dtype, double tol) {
  torch::manual_seed(c.n * 7 + c.p);
  CudaKernelCheck check;
  check.n = c.n;
  check.h = c.h;
  check.dk = check.dv = c.d;
  check.alpha_scale = 0.5;
  check.position_offset = 3;
  check.dtype = dtype;
  check.device = torch::kCUDA;
  check.options.p = c.p;
  check.options.mask = c.mask;
  check.options.window = c.window;
  check.options.rope_theta = c.rope;
  if (c.segments) {
    torch::Tensor seg = torch::zeros({check.b, c.n}, torch::kInt64);
    seg[0].narrow(0, c.n / 2, c.n - c.n / 2).fill_(1);
    seg[1].narrow(0, c.n / 5, c.n - c.n / 5).fill_(2);
    check.options.segments = seg;
  }
  check.cuda.poison_output = true;
  ExpectCudaKernelMatchesReference(check, tol, c10::toString(dtype));
}

TEST(IhaCudaTest, GpuMatchesTheFloat64Reference) {
  const std::string reason = SkipReason();
  if (!reason.empty()) GTEST_SKIP() << reason;
  const GpuCase cases[] = {
      {Mask::kInterleaved, 0, 10000, 2, 150, 4, 64, false},  // 300 pseudo rows: several tiles
      {Mask::kInterleaved, 7, 10000, 3, 77, 3, 32, true},
      {Mask::kBlock, 0, 0, 4, 33, 2, 128, false},
      {Mask::kNone, 5, 10000, 1, 129, 2, 16, true},
  };
  for (const GpuCase& c : cases) {
    SCOPED_TRACE("mask " + std::to_string(static_cast<int>(c.mask)) + " window " +
                 std::to_string(c.window) + " p " + std::to_string(c.p) + " n " +
                 std::to_string(c.n) + " d " + std::to_string(c.d));
    ExpectGpuMatchesReference(c, torch::kFloat32, 2e-4);
    ExpectGpuMatchesReference(c, torch::kBFloat16, 5e-2);
  }
}

TEST(IhaCudaTest, CpuTensorsAreNotSupported) {
  torch::Tensor q = torch::randn({1, 3, 2, 4});
  EXPECT_FALSE(CudaKernelUnsupportedReason(q, q, q, Options{}).empty());
}

// kernel: cuda forced where the kernels cannot run fails at forward time with the reason;
// kernel: auto keeps working (reference path).
TEST(IhaCudaTest, ModuleKernelChoice) {
  std::vector<LoomOption> forced = {{"p", "2"}, {"kernel", "cuda"}};
  IhaAttention m(TestSpec(8, 2, 4, true, 0, 0, &forced));
  torch::Tensor x = torch::randn({1, 5, 8});
  if (!CudaKernelUnsupportedReason(x.view({1, 5, 2, 4}), x.view({1, 5, 2, 4}), x.view({1, 5, 2, 4}),
                                   m.options())
           .empty()) {
    try {
      m.forward(x, {torch::arange(5), {}});
      ADD_FAILURE() << "kernel: cuda ran on CPU tensors";
    } catch (const InvalidAttentionSpec& e) {
      EXPECT_NE(std::string(e.what()).find("options.kernel"), std::string::npos) << e.what();
    }
  }
  std::vector<LoomOption> automatic = {{"p", "2"}};
  IhaAttention a(TestSpec(8, 2, 4, true, 0, 0, &automatic));
  EXPECT_EQ(a.forward(x, {torch::arange(5), {}}).sizes(), x.sizes());
  EXPECT_EQ(a.AcceleratedKernel(x.view({1, 5, 2, 4}), x.view({1, 5, 2, 4}), x.view({1, 5, 2, 4}),
                                a.options()),
            "");
}

// The stock baseline (LibTorch >= 2.0): same function as the reference where it applies.
TEST(IhaCudaTest, StockSdpaMatchesTheReference) {
  Options o;
  o.p = 2;
  o.rope_theta = 10000;
  torch::Tensor q = torch::randn({2, 9, 3, 8});
  const std::string reason = StockSdpaUnsupportedReason(q, o);
  if (!reason.empty()) GTEST_SKIP() << reason;
  torch::Tensor k = torch::randn_like(q), v = torch::randn_like(q), a = torch::randn({3, 3, 2});
  torch::Tensor pos = torch::arange(9);
  for (Mask mask : {Mask::kInterleaved, Mask::kBlock, Mask::kNone}) {
    o.mask = mask;
    torch::Tensor ref = PseudoOutputs(q, k, v, a, a, a, pos, o);
    torch::Tensor got = StockSdpaPseudoOutputs(q, k, v, a, a, a, pos, o);
    EXPECT_LT((got - ref).abs().max().item<double>(), 1e-4) << static_cast<int>(mask);
  }
  o.window = 2;
  EXPECT_EQ(StockSdpaUnsupportedReason(q, o), "window > 0");
}

}  // namespace
}  // namespace loom::attention::iha
