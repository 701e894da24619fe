// The fused kernel (kernels/fused_attention.h) at IHA shapes against the float64 reference path
// (iha_core.h, itself checked against the paper's loops and finite differences in
// iha_attention_test): forward and the gradients of q, k, v and the three alpha tensors, across
// mask × window × RoPE phase × P × odd N × tile size × score. The output is poisoned with NaN
// before each run, so an element the kernel forgets to write fails the comparison. Tolerance: 1e-10
// absolute (float64).
#include <gtest/gtest.h>

#include "cpu_kernels/thread_count_for_test.h"
#include "plugins/attention/iha/iha_core.h"
#include "plugins/attention/kernels/fused_attention.h"

namespace loom::attention::iha {
namespace {

struct FusedCase {
  Mask mask;
  int64_t window;
  double rope;
  RopePhase phase;
  int64_t p;
  int64_t n;
  int64_t tile;
  Score score;
  int64_t block = 0;  // FusedOptions::block_tokens (0: the default)
};

std::string Name(const FusedCase& c) {
  return "mask=" + std::to_string(static_cast<int>(c.mask)) +
         " window=" + std::to_string(c.window) + " rope=" + std::to_string(c.rope) +
         " phase=" + std::to_string(static_cast<int>(c.phase)) + " p=" + std::to_string(c.p) +
         " n=" + std::to_string(c.n) + " tile=" + std::to_string(c.tile) +
         " score=" + std::to_string(static_cast<int>(c.score)) +
         " block=" + std::to_string(c.block);
}

void ExpectMatchesReference(const FusedCase& c, uint64_t seed) {
  torch::manual_seed(seed);
  const int64_t b = 2, h = 3, dk = 4, dv = 6;
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  auto leaf = [&](std::vector<int64_t> shape) { return torch::randn(shape, f64).requires_grad_(); };
  torch::Tensor q = leaf({b, c.n, h, dk}), k = leaf({b, c.n, h, dk}), v = leaf({b, c.n, h, dv});
  torch::Tensor aq = leaf({h, h, c.p}), ak = leaf({h, h, c.p}), av = leaf({h, h, c.p});
  // Per-row positions with an offset (a resumed or packed sequence), as the module passes them.
  torch::Tensor positions = torch::arange(c.n, torch::kInt64).unsqueeze(0).repeat({b, 1});
  positions[1] += 5;
  Options o;
  o.p = c.p;
  o.mask = c.mask;
  o.window = c.window;
  o.rope_theta = c.rope;
  o.rope_phase = c.phase;
  o.score = c.score;
  torch::Tensor upstream = torch::randn({b, c.n, h, c.p, dv}, f64);

  torch::Tensor ref = PseudoOutputs(q, k, v, aq, ak, av, positions, o);
  auto ref_grads = torch::autograd::grad({(ref * upstream).sum()}, {q, k, v, aq, ak, av});
  FusedOptions fused;
  fused.tile_tokens = c.tile;
  fused.block_tokens = c.block;
  fused.poison_output = true;
  torch::Tensor got = FusedPseudoOutputs(q, k, v, aq, ak, av, positions, o, fused);
  ASSERT_EQ(got.sizes(), ref.sizes()) << Name(c);
  ASSERT_TRUE(torch::isfinite(got).all().item<bool>()) << "unwritten output elements: " << Name(c);
  EXPECT_LT((got - ref).abs().max().item<double>(), 1e-10) << Name(c);
  auto got_grads = torch::autograd::grad({(got * upstream).sum()}, {q, k, v, aq, ak, av});
  const char* names[] = {"q", "k", "v", "alpha_q", "alpha_k", "alpha_v"};
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(got_grads[i].defined()) << names[i];
    EXPECT_LT((got_grads[i] - ref_grads[i]).abs().max().item<double>(), 1e-10)
        << "gradient of " << names[i] << ": " << Name(c);
  }
}

TEST(IhaFusedTest, MatchesTheReferenceAcrossMasksWindowsRopeAndTiles) {
  uint64_t seed = 1;
  int cases = 0;
  for (Mask mask : {Mask::kInterleaved, Mask::kBlock, Mask::kNone}) {
    for (int64_t window : {0, 3}) {
      for (auto [rope, phase] :
           {std::pair{0.0, RopePhase::kInterleaved}, std::pair{100.0, RopePhase::kInterleaved},
            std::pair{100.0, RopePhase::kToken}}) {
        for (int64_t p : {1, 2, 3}) {
          for (auto [n, tile] :
               {std::pair<int64_t, int64_t>{13, 4}, std::pair<int64_t, int64_t>{7, 0}}) {
            ExpectMatchesReference({mask, window, rope, phase, p, n, tile, Score::kSoftmax},
                                   seed++);
            ++cases;
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 108);
}

// Sliding windows take consecutive tiles as one block: blocks shorter than the window's span
// (several blocks per query tile, and per key tile in the backward pass, so the online softmax
// runs across blocks), one tile per block, and the default (one block per span).
TEST(IhaFusedTest, SlidingWindowBlocksOfTilesMatchTheReference) {
  uint64_t seed = 100;
  for (Mask mask : {Mask::kInterleaved, Mask::kBlock, Mask::kNone}) {
    for (int64_t p : {1, 2, 3}) {
      for (int64_t block : {4, 2, 0}) {
        ExpectMatchesReference(
            {mask, 5, 100, RopePhase::kInterleaved, p, 29, 2, Score::kSoftmax, block}, seed++);
      }
      ExpectMatchesReference({mask, 9, 0, RopePhase::kToken, p, 31, 3, Score::kLinear, 7}, seed++);
    }
  }
}

TEST(IhaFusedTest, LinearScoresAndLongerSequences) {
  ExpectMatchesReference(
      {Mask::kInterleaved, 0, 0, RopePhase::kInterleaved, 2, 21, 5, Score::kLinear}, 7);
  ExpectMatchesReference({Mask::kBlock, 4, 100, RopePhase::kToken, 3, 17, 3, Score::kLinear}, 8);
  ExpectMatchesReference({Mask::kNone, 0, 0, RopePhase::kInterleaved, 4, 9, 2, Score::kLinear}, 9);
  // N = 61 with 1-token tiles: every tile boundary case of the window and the causal diagonal.
  ExpectMatchesReference(
      {Mask::kInterleaved, 5, 50, RopePhase::kInterleaved, 4, 61, 1, Score::kSoftmax}, 10);
  ExpectMatchesReference({Mask::kBlock, 0, 0, RopePhase::kInterleaved, 4, 64, 16, Score::kSoftmax},
                         11);
}

// Random float64 inputs for one head layout, shared alpha, windowed RoPE IHA.
struct RandomInputs {
  torch::Tensor q, k, v, a, positions;
  Options o;
};
RandomInputs MakeInputs(uint64_t seed, int64_t n, int64_t p, int64_t window) {
  torch::manual_seed(seed);
  const int64_t b = 2, h = 4, d = 8;
  RandomInputs in;
  in.q = torch::randn({b, n, h, d}, torch::kFloat64);
  in.k = torch::randn_like(in.q);
  in.v = torch::randn_like(in.q);
  in.a = torch::randn({h, h, p}, torch::kFloat64) / 2;
  in.positions = torch::arange(n, torch::kInt64);
  in.o.p = p;
  in.o.window = window;
  in.o.rope_theta = 10000;
  return in;
}

// Low precision against float64: float32 computes in float32 (vectorised exp, BLAS GEMMs);
// bfloat16 inputs are mixed into float32 tiles, so only the input and output rounding
// (8 significant bits, relative 2^-8 ≈ 0.4%) is lost. Tolerances: float32 1e-4 absolute on
// O(1) values; bfloat16 3e-2 absolute on outputs and gradients (a few bf16 ulps of values up to
// about 4), both measured well inside the bound.
void ExpectLowPrecisionAgrees(torch::ScalarType type, double tolerance) {
  RandomInputs in = MakeInputs(3, 40, 2, 6);
  auto leaf = [&](const torch::Tensor& t) { return t.to(type).requires_grad_(); };
  torch::Tensor q = leaf(in.q), k = leaf(in.k), v = leaf(in.v), aq = leaf(in.a),
                ak = leaf(in.a * 0.9), av = leaf(in.a * 1.1);
  // The reference sees exactly the rounded inputs.
  auto f64 = [](const torch::Tensor& t) { return t.detach().to(torch::kFloat64).requires_grad_(); };
  torch::Tensor rq = f64(q), rk = f64(k), rv = f64(v), raq = f64(aq), rak = f64(ak), rav = f64(av);
  torch::Tensor ref = PseudoOutputs(rq, rk, rv, raq, rak, rav, in.positions, in.o);
  torch::Tensor upstream = torch::randn(ref.sizes(), torch::kFloat64);
  auto ref_grads = torch::autograd::grad({(ref * upstream).sum()}, {rq, rk, rv, raq, rak, rav});
  FusedOptions f;
  f.tile_tokens = 7;  // partial last tile
  f.poison_output = true;
  torch::Tensor got = FusedPseudoOutputs(q, k, v, aq, ak, av, in.positions, in.o, f);
  EXPECT_EQ(got.scalar_type(), type);
  EXPECT_LT((got.to(torch::kFloat64) - ref).abs().max().item<double>(), tolerance);
  auto got_grads =
      torch::autograd::grad({(got.to(torch::kFloat64) * upstream).sum()}, {q, k, v, aq, ak, av});
  const char* names[] = {"q", "k", "v", "alpha_q", "alpha_k", "alpha_v"};
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(got_grads[i].scalar_type(), type) << names[i];
    // Alpha gradients sum over B·N·d terms: compare relative to their size.
    const double norm = i < 3 ? 1.0 : std::max(1.0, ref_grads[i].abs().max().item<double>());
    EXPECT_LT((got_grads[i].to(torch::kFloat64) - ref_grads[i]).abs().max().item<double>() / norm,
              tolerance)
        << "gradient of " << names[i];
  }
}

TEST(IhaFusedTest, Float32AgreesWithFloat64) { ExpectLowPrecisionAgrees(torch::kFloat32, 1e-4); }

TEST(IhaFusedTest, Bfloat16InputsAccumulateInFloat32) {
  ExpectLowPrecisionAgrees(torch::kBFloat16, 3e-2);
}

// Packed sequences: segment ids per row; a pseudo-token attends only inside its token's
// segment, including segments that start inside a tile and tiles that no query can use.
TEST(IhaFusedTest, SegmentsMatchTheReference) {
  for (Mask mask : {Mask::kInterleaved, Mask::kBlock, Mask::kNone}) {
    for (int64_t window : {0, 4}) {
      torch::manual_seed(21);
      const int64_t b = 2, n = 23, h = 2, d = 4, p = 3;
      auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
      auto leaf = [&](std::vector<int64_t> s) { return torch::randn(s, f64).requires_grad_(); };
      torch::Tensor q = leaf({b, n, h, d}), k = leaf({b, n, h, d}), v = leaf({b, n, h, d});
      torch::Tensor a = leaf({h, h, p});
      torch::Tensor segments = torch::zeros({b, n}, torch::kInt64);
      segments[0].narrow(0, 5, 11).fill_(1);
      segments[0].narrow(0, 16, 7).fill_(2);
      segments[1].narrow(0, 12, 11).fill_(1);
      Options o;
      o.p = p;
      o.mask = mask;
      o.window = window;
      o.rope_theta = 100;
      o.segments = segments;
      torch::Tensor positions = torch::arange(n, torch::kInt64);
      torch::Tensor ref = PseudoOutputs(q, k, v, a, a, a, positions, o);
      torch::Tensor up = torch::randn(ref.sizes(), f64);
      auto rg = torch::autograd::grad({(ref * up).sum()}, {q, k, v, a});
      FusedOptions f;
      f.tile_tokens = 4;
      f.poison_output = true;
      torch::Tensor got = FusedPseudoOutputs(q, k, v, a, a, a, positions, o, f);
      EXPECT_LT((got - ref).abs().max().item<double>(), 1e-10) << "mask " << int(mask);
      auto gg = torch::autograd::grad({(got * up).sum()}, {q, k, v, a});
      for (int i = 0; i < 4; ++i) {
        EXPECT_LT((gg[i] - rg[i]).abs().max().item<double>(), 1e-10)
            << "gradient " << i << " mask " << int(mask) << " window " << window;
      }
    }
  }
}

// The outputs and gradients of one fused call (poisoned output, so a task that never ran shows).
std::vector<torch::Tensor> FusedResults(const RandomInputs& in, const torch::Tensor& upstream,
                                        int64_t tile) {
  auto leaf = [](const torch::Tensor& t) { return t.detach().clone().requires_grad_(); };
  torch::Tensor q = leaf(in.q), k = leaf(in.k), v = leaf(in.v), aq = leaf(in.a),
                ak = leaf(in.a * 0.9), av = leaf(in.a * 1.1);
  FusedOptions f;
  f.tile_tokens = tile;
  f.poison_output = true;
  torch::Tensor out = FusedPseudoOutputs(q, k, v, aq, ak, av, in.positions, in.o, f);
  auto grads = torch::autograd::grad({(out * upstream).sum()}, {q, k, v, aq, ak, av});
  grads.insert(grads.begin(), out.detach());
  return grads;
}

// Tasks are dealt out per thread and stolen at the end: at 2, 3 and 5 threads, with more and
// with fewer tasks than threads, every output and gradient has the bits of the one-thread run
// (each task owns what it writes, so a task run twice or never changes a value or leaves NaN).
TEST(IhaFusedTest, EveryThreadCountComputesTheSameBits) {
  for (auto [window, tile, rows] :
       {std::tuple<int64_t, int64_t, int64_t>{0, 3, 2}, {6, 2, 2}, {0, 64, 1}}) {
    RandomInputs in = MakeInputs(31, 37, 2, window);
    in.q = in.q.narrow(0, 0, rows);
    in.k = in.k.narrow(0, 0, rows);
    in.v = in.v.narrow(0, 0, rows);
    const torch::Tensor upstream = torch::randn({rows, 37, 4, 2, 8}, torch::kFloat64);
    std::vector<torch::Tensor> one;
    {
      cpu_kernels::ThreadCount threads(1);
      one = FusedResults(in, upstream, tile);
    }
    ASSERT_TRUE(torch::isfinite(one[0]).all().item<bool>());
    for (int n : {2, 3, 5}) {
      cpu_kernels::ThreadCount threads(n);
      const std::vector<torch::Tensor> got = FusedResults(in, upstream, tile);
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_TRUE(torch::equal(got[i], one[i]))
            << "result " << i << " at " << n << " threads, window " << window << ", tile " << tile;
      }
    }
  }
}

TEST(IhaFusedTest, RefusesCudaTensorsWithAReason) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  RandomInputs in = MakeInputs(5, 9, 2, 0);
  torch::Tensor q = in.q.to(torch::kCUDA);
  EXPECT_THROW(FusedPseudoOutputs(q, q, q, in.a, in.a, in.a, in.positions, in.o), c10::Error);
}

}  // namespace
}  // namespace loom::attention::iha
