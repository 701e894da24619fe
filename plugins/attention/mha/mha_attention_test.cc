// mha and local against a float64 reference written here with plain loops, plus the causality,
// window, RoPE and encoder properties, on both CPU kernels (fused, the default, and reference),
// and the two kernels against each other at sizes that span several tiles. Tolerance: 1e-10
// absolute in float64.
#include "plugins/attention/mha/mha_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "plugins/attention/common/attention_common.h"
#include "plugins/attention/common/attention_test_util.h"

namespace loom::attention {
namespace {

constexpr double kTol = 1e-10;

std::shared_ptr<MultiHeadAttention> Make(LoomAttentionSpecV1 spec,
                                         const std::string& kernel = "auto") {
  if (kernel != "auto") {
    auto* options = KeptOptions({{"kernel", kernel}});
    spec.options = options->data();
    spec.num_options = options->size();
  }
  torch::manual_seed(11);
  auto m = std::make_shared<MultiHeadAttention>(spec, spec.window > 0 ? "local" : "mha",
                                                spec.window > 0);
  m->to(torch::kFloat64);
  return m;
}

// RoPE on one vector at position p, rotate-half pairing, written independently of ApplyRope.
std::vector<double> RopeVec(const std::vector<double>& x, double p, double theta) {
  const size_t d = x.size(), half = d / 2;
  std::vector<double> out(d);
  for (size_t i = 0; i < half; ++i) {
    const double f = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(d));
    const double c = std::cos(p * f), s = std::sin(p * f);
    out[i] = x[i] * c - x[i + half] * s;
    out[i + half] = x[i + half] * c + x[i] * s;
  }
  return out;
}

// y = o_proj(concat_h softmax_j(q_i·k_j/√d over allowed j) v_j), all in nested loops.
torch::Tensor LoopReference(MultiHeadAttention& m, const torch::Tensor& x,
                            const LoomAttentionSpecV1& s) {
  const int64_t B = x.size(0), N = x.size(1), H = s.n_heads, d = s.head_dim;
  auto params = m.named_parameters();
  auto wq = params["q_proj.weight"], wk = params["k_proj.weight"], wv = params["v_proj.weight"],
       wo = params["o_proj.weight"];
  auto xa = x.accessor<double, 3>();
  auto project = [&](const torch::Tensor& w, int64_t b, int64_t n, int64_t h) {
    auto wa = w.accessor<double, 2>();
    std::vector<double> out(d, 0.0);
    for (int64_t e = 0; e < d; ++e) {
      for (int64_t c = 0; c < s.d_model; ++c) out[e] += wa[h * d + e][c] * xa[b][n][c];
    }
    return out;
  };
  torch::Tensor y = torch::zeros({B, N, s.d_model}, torch::kFloat64);
  auto ya = y.accessor<double, 3>();
  auto woa = wo.accessor<double, 2>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < N; ++i) {
      std::vector<double> concat(H * d, 0.0);
      for (int64_t h = 0; h < H; ++h) {
        auto q = project(wq, b, i, h);
        if (s.rope_theta > 0) q = RopeVec(q, static_cast<double>(i), s.rope_theta);
        std::vector<double> scores;
        std::vector<int64_t> keys;
        for (int64_t j = 0; j < N; ++j) {
          if (s.causal && j > i) continue;
          if (s.window > 0 && std::abs(i - j) >= s.window) continue;
          auto k = project(wk, b, j, h);
          if (s.rope_theta > 0) k = RopeVec(k, static_cast<double>(j), s.rope_theta);
          double dot = 0;
          for (int64_t e = 0; e < d; ++e) dot += q[e] * k[e];
          scores.push_back(dot / std::sqrt(static_cast<double>(d)));
          keys.push_back(j);
        }
        double mx = -1e300, z = 0;
        for (double v : scores) mx = std::max(mx, v);
        for (double& v : scores) z += (v = std::exp(v - mx));
        for (size_t t = 0; t < keys.size(); ++t) {
          auto v = project(wv, b, keys[t], h);
          for (int64_t e = 0; e < d; ++e) concat[h * d + e] += scores[t] / z * v[e];
        }
      }
      for (int64_t c = 0; c < s.d_model; ++c) {
        for (int64_t e = 0; e < H * d; ++e) ya[b][i][c] += woa[c][e] * concat[e];
      }
    }
  }
  return y;
}

struct MhaCase {
  int64_t d_model, heads, head_dim;
  bool causal;
  int64_t window;
  double theta;
};

TEST(MultiHeadAttention, MatchesLoopReference) {
  const MhaCase cases[] = {
      {16, 4, 4, true, 0, 0},      {16, 4, 4, true, 0, 10000}, {16, 2, 6, true, 3, 500000},
      {12, 3, 4, false, 0, 10000}, {12, 3, 4, false, 2, 100},  {8, 1, 8, true, 1, 10000},
      {8, 2, 4, true, 64, 10000},
  };
  for (const std::string kernel : {"fused", "reference"}) {
    for (const MhaCase& c : cases) {
      auto spec = TestSpec(c.d_model, c.heads, c.head_dim, c.causal, c.window, c.theta);
      auto m = Make(spec, kernel);
      torch::manual_seed(3);
      torch::Tensor x = torch::randn({2, 9, c.d_model}, torch::kFloat64);
      AttentionInputs in{torch::arange(9), {}};
      torch::Tensor y = m->forward(x, in);
      torch::Tensor ref = LoopReference(*m, x, spec);
      EXPECT_LT((y - ref).abs().max().item<double>(), kTol)
          << kernel << ": d_model " << c.d_model << " H " << c.heads << " d " << c.head_dim
          << " causal " << c.causal << " window " << c.window << " theta " << c.theta;
    }
  }
}

// The fused kernel against the reference kernel with the same weights: outputs and the
// gradients of the input and every parameter, with sequences longer than one tile (256 tokens;
// windows tile by W/4), packed segments and RoPE. float64 to 1e-10; float32 to 2e-5 relative
// to the largest value plus 1e-6 (the two sum in different orders; a one-token sequence has
// exactly zero q and k gradients in the reference and rounding-sized ones in the kernel).
TEST(MultiHeadAttention, FusedKernelMatchesReferenceKernel) {
  struct Shape {
    bool causal;
    int64_t window, n;
    bool segments;
  };
  const Shape shapes[] = {{true, 0, 300, false},
                          {false, 0, 270, true},
                          {true, 37, 100, true},
                          {false, 5, 64, false},
                          {true, 0, 1, false}};
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    for (const Shape& sh : shapes) {
      auto spec = TestSpec(16, 2, 8, sh.causal, sh.window, 10000);
      auto fused = Make(spec, "fused"), reference = Make(spec, "reference");
      fused->to(dtype);
      reference->to(dtype);
      torch::manual_seed(5);
      torch::Tensor x = torch::randn({2, sh.n, 16}, dtype);
      AttentionInputs in{torch::arange(sh.n), {}};
      if (sh.segments) {  // packed documents: positions restart per row ([B, N] tables)
        in.segments = (torch::arange(sh.n) / 23).repeat({2, 1});
        in.positions = torch::stack({torch::arange(sh.n) % 23, torch::arange(sh.n) + 40});
      }
      auto run = [&](MultiHeadAttention& m) {
        torch::Tensor xi = x.clone().requires_grad_(true);
        m.zero_grad();
        torch::Tensor y = m.forward(xi, in);
        (y * torch::linspace(-1, 1, y.numel(), dtype).view(y.sizes())).sum().backward();
        std::vector<torch::Tensor> out = {y.detach(), xi.grad()};
        for (auto& p : m.parameters()) out.push_back(p.grad());
        return out;
      };
      auto a = run(*fused), b = run(*reference);
      for (size_t i = 0; i < a.size(); ++i) {
        const double scale = dtype == torch::kFloat64 ? 1.0 : b[i].abs().max().item<double>();
        const double tol = dtype == torch::kFloat64 ? kTol : 2e-5 * scale + 1e-6;
        EXPECT_LT((a[i] - b[i]).abs().max().item<double>(), tol)
            << "tensor " << i << " (0 output, 1 dx, then parameters) dtype " << dtype << " causal "
            << sh.causal << " window " << sh.window << " n " << sh.n << " segments " << sh.segments;
      }
    }
  }
}

TEST(MultiHeadAttention, CausalityChangingTokenTNeverChangesEarlierOutputs) {
  for (int64_t window : {0, 3}) {
    auto spec = TestSpec(16, 4, 4, true, window, 10000);
    auto m = Make(spec);
    torch::Tensor x = torch::randn({1, 12, 16}, torch::kFloat64);
    AttentionInputs in{torch::arange(12), {}};
    torch::Tensor y = m->forward(x, in);
    for (int64_t t = 0; t < 12; ++t) {
      torch::Tensor x2 = x.clone();
      x2.index_put_({0, t}, torch::randn({16}, torch::kFloat64) * 5);
      torch::Tensor y2 = m->forward(x2, in);
      torch::Tensor diff = (y2 - y).abs().amax({0, 2});  // per position
      for (int64_t i = 0; i < t; ++i)
        EXPECT_EQ(diff[i].item<double>(), 0.0) << "t=" << t << " i=" << i;
      EXPECT_GT(diff[t].item<double>(), 1e-6) << "token t must affect its own output";
    }
  }
}

TEST(MultiHeadAttention, WindowTokensOutsideHaveNoEffect) {
  for (bool causal : {true, false}) {
    const int64_t W = 3, N = 12;
    auto spec = TestSpec(16, 4, 4, causal, W, 10000);
    auto m = Make(spec);
    torch::Tensor x = torch::randn({1, N, 16}, torch::kFloat64);
    AttentionInputs in{torch::arange(N), {}};
    torch::Tensor y = m->forward(x, in);
    for (int64_t t = 0; t < N; ++t) {
      torch::Tensor x2 = x.clone();
      x2.index_put_({0, t}, torch::randn({16}, torch::kFloat64) * 5);
      torch::Tensor diff = (m->forward(x2, in) - y).abs().amax({0, 2});
      for (int64_t i = 0; i < N; ++i) {
        const bool inside = std::abs(i - t) < W && (!causal || t <= i);
        if (inside) {
          EXPECT_GT(diff[i].item<double>(), 1e-9)
              << "causal " << causal << " t " << t << " i " << i;
        } else {
          EXPECT_EQ(diff[i].item<double>(), 0.0) << "causal " << causal << " t " << t << " i " << i;
        }
      }
    }
  }
}

TEST(Rope, DotProductDependsOnlyOnRelativePosition) {
  torch::manual_seed(5);
  torch::Tensor q = torch::randn({1, 1, 1, 8}, torch::kFloat64);
  torch::Tensor k = torch::randn({1, 1, 1, 8}, torch::kFloat64);
  auto dot = [&](double m, double n) {
    auto rq = ApplyRope(q, torch::tensor({m}, torch::kFloat64), 10000);
    auto rk = ApplyRope(k, torch::tensor({n}, torch::kFloat64), 10000);
    return (rq * rk).sum().item<double>();
  };
  for (double offset : {1.0, 7.0, 123.0, 4096.0}) {
    EXPECT_NEAR(dot(5, 2), dot(5 + offset, 2 + offset), 1e-9) << offset;
    EXPECT_NEAR(dot(0, 9), dot(offset, 9 + offset), 1e-9) << offset;
  }
  EXPECT_GT(std::abs(dot(5, 2) - dot(5, 3)), 1e-6);  // and it does depend on the distance
  // Rotation preserves norms.
  auto rq = ApplyRope(q, torch::tensor({17.0}, torch::kFloat64), 10000);
  EXPECT_NEAR(rq.norm().item<double>(), q.norm().item<double>(), 1e-12);
}

TEST(MultiHeadAttention, ShiftingAllPositionsLeavesOutputUnchanged) {
  for (bool causal : {true, false}) {
    auto spec = TestSpec(16, 4, 4, causal, 0, 10000);
    auto m = Make(spec);
    torch::Tensor x = torch::randn({2, 10, 16}, torch::kFloat64);
    torch::Tensor y0 = m->forward(x, {torch::arange(10), {}});
    torch::Tensor y1 = m->forward(x, {torch::arange(10) + 1000, {}});
    EXPECT_LT((y0 - y1).abs().max().item<double>(), 1e-9);
    // Per-batch positions [B, N] are accepted and give the same answer.
    torch::Tensor y2 = m->forward(x, {torch::arange(10).unsqueeze(0).repeat({2, 1}) + 37, {}});
    EXPECT_LT((y0 - y2).abs().max().item<double>(), 1e-9);
  }
}

TEST(MultiHeadAttention, EncoderModeSeesTheFuture) {
  auto spec = TestSpec(16, 4, 4, false, 0, 10000);
  auto m = Make(spec);
  torch::Tensor x = torch::randn({1, 8, 16}, torch::kFloat64);
  AttentionInputs in{torch::arange(8), {}};
  torch::Tensor y = m->forward(x, in);
  torch::Tensor x2 = x.clone();
  x2.index_put_({0, 7}, torch::randn({16}, torch::kFloat64));
  torch::Tensor diff = (m->forward(x2, in) - y).abs().amax({0, 2});
  for (int64_t i = 0; i < 8; ++i) EXPECT_GT(diff[i].item<double>(), 1e-9) << i;
}

TEST(MultiHeadAttention, GradientsMatchFiniteDifferences) {
  auto spec = TestSpec(8, 2, 4, true, 3, 10000);
  auto m = Make(spec);
  torch::Tensor x = torch::randn({1, 5, 8}, torch::kFloat64);
  AttentionInputs in{torch::arange(5), {}};
  torch::Tensor w = torch::randn({1, 5, 8}, torch::kFloat64);
  ExpectGradientsMatchFiniteDifferences(
      *m, [&] { return (m->forward(x, in) * w).sum(); }, [](const std::string&) { return 7; },
      1e-6);
}

TEST(MultiHeadAttention, ReportsParametersAndFlops) {
  auto m = Make(TestSpec(16, 4, 4, true, 0, 0));
  EXPECT_EQ(m->NumParameters(), 4 * 16 * 16);
  // Causal, N = 8: mean attended keys (1+...+8)/8 = 4.5.
  EXPECT_DOUBLE_EQ(m->ForwardFlopsPerToken(8), 2.0 * 4 * 16 * 16 + 4.0 * 16 * 4.5);
  auto local = Make(TestSpec(16, 4, 4, true, 2, 0));
  // Window 2: keys per query 1,2,2,2 -> 7/4.
  EXPECT_DOUBLE_EQ(local->ForwardFlopsPerToken(4), 2.0 * 4 * 16 * 16 + 4.0 * 16 * 1.75);
  EXPECT_DOUBLE_EQ(AverageAttendedKeys(5, false, 2), (2 + 3 + 3 + 3 + 2) / 5.0);
}

TEST(MultiHeadAttention, RejectsBadSpecsNamingTheField) {
  auto expect_error = [](LoomAttentionSpecV1 s, bool local, const std::string& field) {
    try {
      MultiHeadAttention m(s, local ? "local" : "mha", local);
      ADD_FAILURE() << "accepted a bad spec (" << field << ")";
    } catch (const InvalidAttentionSpec& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  expect_error(TestSpec(0, 4, 4, true, 0, 0), false, "d_model");
  expect_error(TestSpec(16, 0, 4, true, 0, 0), false, "n_heads");
  expect_error(TestSpec(16, 4, 3, true, 0, 10000), false, "head_dim");
  expect_error(TestSpec(16, 4, 4, true, 0, -1), false, "rope_theta");
  expect_error(TestSpec(16, 4, 4, true, 0, 0), true, "window");
  expect_error(TestSpec(16, 4, 4, true, 8, 0), false, "window");
  LoomOption opt{"p", "2"};
  auto s = TestSpec(16, 4, 4, true, 0, 0);
  s.options = &opt;
  s.num_options = 1;
  expect_error(s, false, "options.p");
  LoomOption bad_kernel{"kernel", "flash"};
  s.options = &bad_kernel;
  expect_error(s, false, "options.kernel");
#if !LOOM_TORCH_HAS_SDPA
  LoomOption stock{"kernel", "stock"};
  s.options = &stock;
  expect_error(s, false, "options.kernel");
#endif
}

}  // namespace
}  // namespace loom::attention
