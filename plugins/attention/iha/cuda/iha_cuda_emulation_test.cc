// The CUDA IHA kernels' block programs (iha_cuda_tiles.h), run on the CPU by the emulator behind
// CudaOptions::emulate: every block of the forward, backward dK/dV and backward dQ kernels, phase
// by phase, thread by thread (in reverse thread order), with shared memory poisoned with NaN at
// each block start and every output (out, lse, the pseudo gradients) poisoned with NaN before
// the run. The glue around them is the production one (RoPE tables, autograd function, delta,
// un-mixing), so this checks everything of CudaPseudoOutputs but the launch itself.
//
// Compared with the float64 reference (iha_core.h PseudoOutputs + autograd) on the same
// (rounded) inputs: the output and the gradients of q, k, v and the three alpha tensors, across
// mask (interleaved, block, none) × window (0, 3, 9) × RoPE (off, theta 10000 with both phases) ×
// P (1, 2, 3) × N (1, 7, 33, 70: partial tiles) × tile (16, 32, 64) × segments (none, two per
// row, different per row).
//
// Tolerances, as max |got - ref| / max(1, max |ref|) per tensor:
//   float32 inputs: 1e-4 (float32 accumulation over at most a few hundred terms);
//   bfloat16 inputs: 5e-2 (the reference uses the same bf16-rounded inputs, but the output is
//     stored in bf16, 2^-8 relative, and the backward pass, like FlashAttention's, takes
//     delta = rowsum(dO · O) from that rounded output, which the alpha gradients sum over;
//     observed up to ~2e-2);
//   float16 inputs: 1e-2 (the same with fp16 rounding, 2^-11; observed up to ~4e-3).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "plugins/attention/iha/cuda/iha_cuda.h"
#include "plugins/attention/iha/cuda/iha_cuda_test_util.h"
#include "plugins/attention/iha/cuda/iha_cuda_tiles.h"
#include "plugins/attention/iha/iha_core.h"

namespace loom::attention::iha {
namespace {

struct EmulationCase {
  Mask mask;
  int64_t window;
  double rope;
  RopePhase phase;
  int64_t p;
  int64_t n;
  int64_t tile;
  bool segments;
};

std::string Name(const EmulationCase& c, torch::ScalarType t) {
  return std::string(c10::toString(t)) + " mask=" + std::to_string(static_cast<int>(c.mask)) +
         " window=" + std::to_string(c.window) + " rope=" + std::to_string(c.rope) +
         " phase=" + std::to_string(static_cast<int>(c.phase)) + " p=" + std::to_string(c.p) +
         " n=" + std::to_string(c.n) + " tile=" + std::to_string(c.tile) +
         " segments=" + std::to_string(c.segments);
}

// Returns the worst relative error over the output and the six gradients (and fails the test
// above `tol`).
double ExpectMatchesReference(const EmulationCase& c, torch::ScalarType dtype, uint64_t seed,
                              double tol) {
  torch::manual_seed(seed);
  CudaKernelCheck check;
  check.n = c.n;
  check.h = 3;
  check.dk = 6;
  check.dv = 5;
  check.position_offset = 5;
  check.dtype = dtype;
  check.options.p = c.p;
  check.options.mask = c.mask;
  check.options.window = c.window;
  check.options.rope_theta = c.rope;
  check.options.rope_phase = c.phase;
  if (c.segments) {
    // Two segments per row, split at different tokens; row 1 uses other ids.
    torch::Tensor seg = torch::zeros({check.b, c.n}, torch::kInt64);
    seg[0].narrow(0, c.n / 3, c.n - c.n / 3).fill_(1);
    seg[1].fill_(4);
    seg[1].narrow(0, (2 * c.n) / 3, c.n - (2 * c.n) / 3).fill_(9);
    check.options.segments = seg;
  }
  check.cuda.emulate = true;
  check.cuda.poison_output = true;
  check.cuda.tile = c.tile;
  return ExpectCudaKernelMatchesReference(check, tol, Name(c, dtype));
}

TEST(IhaCudaEmulationTest, Float32MatchesTheReferenceEverywhere) {
  uint64_t seed = 1;
  int cases = 0;
  double worst = 0;
  for (Mask mask : {Mask::kInterleaved, Mask::kBlock, Mask::kNone}) {
    for (int64_t window : {0, 3, 9}) {  // 9 with P = 2: the window edge on a 16-row tile edge
      for (auto [rope, phase] :
           {std::pair{0.0, RopePhase::kInterleaved}, std::pair{10000.0, RopePhase::kInterleaved},
            std::pair{10000.0, RopePhase::kToken}}) {
        for (int64_t p : {1, 2, 3}) {
          for (auto [n, tile] :
               {std::pair<int64_t, int64_t>{1, 16}, std::pair<int64_t, int64_t>{7, 16},
                std::pair<int64_t, int64_t>{33, 32}, std::pair<int64_t, int64_t>{70, 16},
                std::pair<int64_t, int64_t>{70, 64}}) {
            for (bool segments : {false, true}) {
              worst = std::max(
                  worst, ExpectMatchesReference({mask, window, rope, phase, p, n, tile, segments},
                                                torch::kFloat32, seed++, 1e-4));
              ++cases;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(cases, 3 * 3 * 3 * 3 * 5 * 2);
  std::cout << "float32: " << cases << " cases, worst relative error " << worst << "\n";
}

TEST(IhaCudaEmulationTest, BFloat16AndFloat16Inputs) {
  uint64_t seed = 1000;
  double worst_bf16 = 0, worst_f16 = 0;
  for (Mask mask : {Mask::kInterleaved, Mask::kBlock, Mask::kNone}) {
    for (int64_t window : {0, 3}) {
      for (double rope : {0.0, 10000.0}) {
        for (bool segments : {false, true}) {
          const EmulationCase c{mask, window, rope, RopePhase::kInterleaved, 2, 33, 16, segments};
          worst_bf16 =
              std::max(worst_bf16, ExpectMatchesReference(c, torch::kBFloat16, seed++, 5e-2));
          worst_f16 = std::max(worst_f16, ExpectMatchesReference(c, torch::kFloat16, seed++, 1e-2));
        }
      }
    }
  }
  std::cout << "worst relative error: bf16 " << worst_bf16 << ", fp16 " << worst_f16 << "\n";
}

// Head widths at the kernels' limit (128) and the default tile: the shared-memory layout with
// large rows, and the scale option.
TEST(IhaCudaEmulationTest, WideHeadsAndCustomScale) {
  torch::manual_seed(77);
  const int64_t b = 1, n = 40, h = 2, p = 2, d = cuda::kMaxHeadDim;
  torch::Tensor q = torch::randn({b, n, h, d}).requires_grad_();
  torch::Tensor k = torch::randn({b, n, h, d}).requires_grad_();
  torch::Tensor v = torch::randn({b, n, h, d}).requires_grad_();
  torch::Tensor a = (torch::randn({h, h, p}) / 2).requires_grad_();
  Options o;
  o.p = p;
  o.rope_theta = 10000;
  o.scale = 0.05;
  o.window = 9;
  torch::Tensor positions = torch::arange(n);
  CudaOptions emu;
  emu.emulate = true;
  emu.poison_output = true;
  torch::Tensor got = CudaPseudoOutputs(q, k, v, a, a, a, positions, o, emu);
  auto f64 = [](const torch::Tensor& t) { return t.detach().to(torch::kFloat64).requires_grad_(); };
  torch::Tensor qr = f64(q), kr = f64(k), vr = f64(v), ar = f64(a);
  torch::Tensor ref = PseudoOutputs(qr, kr, vr, ar, ar, ar, positions, o);
  EXPECT_LE(RelativeError(got, ref), 1e-4);
  torch::Tensor up = torch::randn_like(ref);
  auto g = torch::autograd::grad({(got.to(torch::kFloat64) * up).sum()}, {q, k, v, a});
  auto r = torch::autograd::grad({(ref * up).sum()}, {qr, kr, vr, ar});
  for (int i = 0; i < 4; ++i) EXPECT_LE(RelativeError(g[i], r[i]), 1e-4) << i;
}

// Every allowed (query, key) pair lies inside the tile ranges the kernels walk, so skipping
// the tiles outside them never drops a key (the end-to-end tests above would also catch it;
// this pins it down exhaustively on small shapes).
TEST(IhaCudaEmulationTest, TileRangesCoverEveryAllowedPair) {
  for (int mask : {0, 1, 2}) {
    for (int64_t window : {0, 1, 2, 5}) {
      for (int64_t p : {1, 2, 3, 4}) {
        for (int64_t n : {1, 5, 13}) {
          for (int tile : {1, 2, 4, 16}) {
            cuda::IhaCudaParams pr;
            pr.n = n;
            pr.p = p;
            pr.h = 1;
            pr.mask = mask;
            pr.window = window;
            const int64_t len = n * p;
            for (int64_t s = 0; s < len; ++s) {
              for (int64_t t = 0; t < len; ++t) {
                if (!cuda::IhaAllowed(pr, 0, s, t)) continue;
                const int64_t s0 = s / tile * tile, s1 = std::min(s0 + tile, len) - 1;
                const int64_t t0 = t / tile * tile, t1 = std::min(t0 + tile, len) - 1;
                int64_t lo, hi;
                cuda::IhaKeyRange(pr, s0, s1, &lo, &hi);
                EXPECT_TRUE(lo <= t && t <= hi)
                    << mask << " " << window << " " << p << " " << s << " " << t << " " << tile;
                cuda::IhaQueryRange(pr, t0, t1, &lo, &hi);
                EXPECT_TRUE(lo <= s && s <= hi)
                    << mask << " " << window << " " << p << " " << s << " " << t << " " << tile;
              }
            }
          }
        }
      }
    }
  }
}

// The bf16 / fp16 converters the kernels use agree bit for bit with c10's.
TEST(IhaCudaEmulationTest, ElementConvertersMatchC10) {
  for (uint32_t bits = 0; bits < 0x10000u; ++bits) {
    c10::Half h;
    h.x = static_cast<uint16_t>(bits);
    const float want = static_cast<float>(h), got = cuda::IhaToFloat(cuda::IhaHalf{h.x});
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << bits;
    } else {
      EXPECT_EQ(want, got) << bits;
    }
    c10::BFloat16 bf;
    bf.x = static_cast<uint16_t>(bits);
    const float want_bf = static_cast<float>(bf), got_bf = cuda::IhaToFloat(cuda::IhaBf16{bf.x});
    if (std::isnan(want_bf)) {
      EXPECT_TRUE(std::isnan(got_bf)) << bits;
    } else {
      EXPECT_EQ(want_bf, got_bf) << bits;
    }
  }
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> any_bits;
  std::vector<float> values = {0.f,     -0.f,  1.f,      65504.f,  65519.f,
                               65520.f, 1e-8f, 5.96e-8f, 2.98e-8f, 6.1e-5f,
                               3e-5f,   1e30f, -1e-30f,  INFINITY, -INFINITY};
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = any_bits(rng);
    if (i % 2) u = (u & 0x807fffffu) | ((100u + u % 45u) << 23);  // around the fp16 range
    float f;
    std::memcpy(&f, &u, sizeof f);
    values.push_back(f);
  }
  for (float f : values) {
    if (std::isnan(f)) continue;
    EXPECT_EQ(cuda::IhaFromFloat<cuda::IhaHalf>(f).bits, c10::Half(f).x) << f;
    EXPECT_EQ(cuda::IhaFromFloat<cuda::IhaBf16>(f).bits, c10::BFloat16(f).x) << f;
  }
}

TEST(IhaCudaEmulationTest, UnsupportedInputsSayWhy) {
  torch::Tensor q = torch::randn({1, 4, 2, 4}, torch::kFloat64);
  torch::Tensor a = torch::randn({2, 2, 1});
  Options o;
  EXPECT_FALSE(CudaKernelUnsupportedReason(q, q, q, o).empty());  // CPU tensors
  CudaOptions emu;
  emu.emulate = true;
  try {
    CudaPseudoOutputs(q, q, q, a, a, a, torch::arange(4), o, emu);
    ADD_FAILURE() << "float64 accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("dtype Double"), std::string::npos) << e.what();
  }
  o.score = Score::kLinear;
  torch::Tensor f = q.to(torch::kFloat32);
  try {
    CudaPseudoOutputs(f, f, f, a, a, a, torch::arange(4), o, emu);
    ADD_FAILURE() << "linear score accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("score=linear"), std::string::npos) << e.what();
  }
  o.score = Score::kSoftmax;
  torch::Tensor wide = torch::randn({1, 4, 2, 160});
  try {
    CudaPseudoOutputs(wide, wide, wide, a, a, a, torch::arange(4), o, emu);
    ADD_FAILURE() << "head dim 160 accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("head dim 160 > 128"), std::string::npos) << e.what();
  }
}

// Shared memory the kernels ask for (the launcher picks the largest tile that fits the device:
// A100 opt-in 163 KiB, H100 227 KiB).
TEST(IhaCudaEmulationTest, SharedMemoryBudget) {
  EXPECT_LE(cuda::IhaSmemBytes(0, 128, 128, 64), 163 * 1024);
  EXPECT_LE(cuda::IhaSmemBytes(1, 128, 128, 32), 163 * 1024);
  EXPECT_LE(cuda::IhaSmemBytes(2, 128, 128, 64), 227 * 1024);
  EXPECT_LE(cuda::IhaSmemBytes(1, 64, 64, 64), 163 * 1024);
}

}  // namespace
}  // namespace loom::attention::iha
