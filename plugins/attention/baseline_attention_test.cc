// talking_heads and diff against float64 references written here with plain loops, and the
// defining equations of their papers. Tolerance: 1e-10 absolute.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "plugins/attention/common/attention_common.h"
#include "plugins/attention/common/attention_test_util.h"
#include "plugins/attention/diff/diff_attention.h"
#include "plugins/attention/mha/mha_attention.h"
#include "plugins/attention/talking_heads/talking_heads_attention.h"

namespace loom::attention {
namespace {

constexpr auto f64 = torch::kFloat64;

// Per-head q or k for token n of batch b after RoPE at position n: loops over the weights.
std::vector<double> Head(const torch::Tensor& w, const torch::Tensor& x, int64_t b, int64_t n,
                         int64_t head, int64_t width, double theta) {
  auto W = w.accessor<double, 2>();
  auto X = x.accessor<double, 3>();
  std::vector<double> out(width, 0.0);
  for (int64_t e = 0; e < width; ++e) {
    for (int64_t c = 0; c < x.size(2); ++c) out[e] += W[head * width + e][c] * X[b][n][c];
  }
  if (theta > 0) {
    const int64_t half = width / 2;
    std::vector<double> r(width);
    for (int64_t i = 0; i < half; ++i) {
      const double f = std::pow(theta, -2.0 * i / static_cast<double>(width)), a = n * f;
      r[i] = out[i] * std::cos(a) - out[i + half] * std::sin(a);
      r[i + half] = out[i + half] * std::cos(a) + out[i] * std::sin(a);
    }
    out = r;
  }
  return out;
}

double Dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

bool Allowed(int64_t i, int64_t j, bool causal, int64_t window) {
  return (!causal || j <= i) && (window == 0 || std::abs(i - j) < window);
}

// Softmax over the allowed keys of a row of logits (others 0).
std::vector<double> Softmax(const std::vector<double>& logits, const std::vector<bool>& allowed) {
  double mx = -1e300, z = 0;
  for (size_t j = 0; j < logits.size(); ++j) {
    if (allowed[j]) mx = std::max(mx, logits[j]);
  }
  std::vector<double> p(logits.size(), 0.0);
  for (size_t j = 0; j < logits.size(); ++j) {
    if (allowed[j]) z += (p[j] = std::exp(logits[j] - mx));
  }
  for (double& v : p) v /= z;
  return p;
}

torch::Tensor OutProj(const torch::Tensor& concat, const torch::Tensor& wo) {
  return torch::matmul(concat, wo.t());
}

TEST(TalkingHeads, MatchesLoopReference) {
  for (auto [causal, window] :
       {std::pair<bool, int64_t>{true, 0}, {true, 3}, {false, 0}, {false, 2}}) {
    std::vector<LoomOption> opts = {{"init", "random"}};
    torch::manual_seed(2);
    TalkingHeadsAttention m(TestSpec(12, 3, 4, causal, window, 10000, &opts));
    m.to(f64);
    const int64_t B = 2, N = 6, H = 3, d = 4;
    torch::Tensor x = torch::randn({B, N, 12}, f64);
    torch::Tensor y = m.forward(x, {torch::arange(N), {}});
    auto p = m.named_parameters();
    auto PL = m.logit_mix.accessor<double, 2>(), PW = m.weight_mix.accessor<double, 2>();
    torch::Tensor concat = torch::zeros({B, N, H * d}, f64);
    auto C = concat.accessor<double, 3>();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < N; ++i) {
        // J[m][j] raw logits, then J'[h][j] = sum_m PL[m][h] J[m][j], W = softmax, W' mixed.
        std::vector<std::vector<double>> J(H, std::vector<double>(N)), W(H);
        for (int64_t mh = 0; mh < H; ++mh) {
          auto q = Head(p["q_proj.weight"], x, b, i, mh, d, 10000);
          for (int64_t j = 0; j < N; ++j)
            J[mh][j] = Dot(q, Head(p["k_proj.weight"], x, b, j, mh, d, 10000)) / 2.0;
        }
        std::vector<bool> allowed(N);
        for (int64_t j = 0; j < N; ++j) allowed[j] = Allowed(i, j, causal, window);
        for (int64_t h = 0; h < H; ++h) {
          std::vector<double> mixed(N, 0.0);
          for (int64_t mh = 0; mh < H; ++mh) {
            for (int64_t j = 0; j < N; ++j) mixed[j] += PL[mh][h] * J[mh][j];
          }
          W[h] = Softmax(mixed, allowed);
        }
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t j = 0; j < N; ++j) {
            double wmix = 0;
            for (int64_t mh = 0; mh < H; ++mh) wmix += PW[mh][h] * W[mh][j];
            auto v = Head(p["v_proj.weight"], x, b, j, h, d, 0);
            for (int64_t e = 0; e < d; ++e) C[b][i][h * d + e] += wmix * v[e];
          }
        }
      }
    }
    EXPECT_LT((y - OutProj(concat, p["o_proj.weight"])).abs().max().item<double>(), 1e-10)
        << causal << " " << window;
  }
}

// With identity mixing matrices talking-heads attention is exactly MHA (the paper's starting
// point); with mixing, head h's output depends on other heads' logits.
TEST(TalkingHeads, IdentityMixingIsMhaAndMixingCouplesHeads) {
  torch::manual_seed(3);
  TalkingHeadsAttention th(TestSpec(12, 3, 4, true, 0, 10000));
  MultiHeadAttention mha(TestSpec(12, 3, 4, true, 0, 10000), "mha", false);
  th.to(f64);
  mha.to(f64);
  {
    torch::NoGradGuard g;
    auto src = th.named_parameters();
    for (auto& p : mha.named_parameters()) p.value().copy_(src[p.key()]);
  }
  torch::Tensor x = torch::randn({1, 5, 12}, f64);
  AttentionInputs in{torch::arange(5), {}};
  EXPECT_LT((th.forward(x, in) - mha.forward(x, in)).abs().max().item<double>(), 1e-12);
  EXPECT_EQ(th.NumParameters() - mha.NumParameters(), 2 * 3 * 3);
  {
    torch::NoGradGuard g;
    th.logit_mix.index_put_({0, 1}, 0.7);  // head 1 now sees head 0's logits
  }
  EXPECT_GT((th.forward(x, in) - mha.forward(x, in)).abs().max().item<double>(), 1e-6);
}

TEST(Diff, LambdaInitScheduleFollowsThePaper) {
  // λ_init = 0.8 - 0.6 exp(-0.3 (l - 1)), l = 1..L.
  for (int64_t l = 1; l <= 26; ++l) {
    EXPECT_DOUBLE_EQ(DiffLambdaInit(l - 1), 0.8 - 0.6 * std::exp(-0.3 * (l - 1)));
  }
  EXPECT_DOUBLE_EQ(DiffLambdaInit(0), 0.2);
  DiffAttention layer(TestSpec(16, 4, 4, true, 0, 0, nullptr, 5));
  EXPECT_DOUBLE_EQ(layer.lambda_init(), 0.8 - 0.6 * std::exp(-1.5));
}

TEST(Diff, MatchesLoopReference) {
  for (auto [causal, window] : {std::pair<bool, int64_t>{true, 0}, {true, 2}, {false, 0}}) {
    torch::manual_seed(6);
    DiffAttention m(TestSpec(16, 4, 4, causal, window, 10000, nullptr, 2));
    m.to(f64);
    const int64_t B = 2, N = 5, H = 4, d = 4, pairs = 2;
    torch::Tensor x = torch::randn({B, N, 16}, f64);
    torch::Tensor y = m.forward(x, {torch::arange(N), {}});
    auto p = m.named_parameters();
    const double lq1k1 = (m.lambda_q1 * m.lambda_k1).sum().item<double>();
    const double lq2k2 = (m.lambda_q2 * m.lambda_k2).sum().item<double>();
    const double linit = 0.8 - 0.6 * std::exp(-0.3 * 2);
    const double lambda = std::exp(lq1k1) - std::exp(lq2k2) + linit;
    auto G = m.subln_weight.accessor<double, 1>();
    torch::Tensor concat = torch::zeros({B, N, H * d}, f64);
    auto C = concat.accessor<double, 3>();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < N; ++i) {
        std::vector<bool> allowed(N);
        for (int64_t j = 0; j < N; ++j) allowed[j] = Allowed(i, j, causal, window);
        for (int64_t a = 0; a < pairs; ++a) {
          std::vector<double> maps[2];
          for (int t = 0; t < 2; ++t) {
            auto q = Head(p["q_proj.weight"], x, b, i, 2 * a + t, d, 10000);
            std::vector<double> logits(N);
            for (int64_t j = 0; j < N; ++j)
              logits[j] = Dot(q, Head(p["k_proj.weight"], x, b, j, 2 * a + t, d, 10000)) / 2.0;
            maps[t] = Softmax(logits, allowed);
          }
          std::vector<double> head(2 * d, 0.0);
          for (int64_t j = 0; j < N; ++j) {
            auto v = Head(p["v_proj.weight"], x, b, j, a, 2 * d, 0);
            for (int64_t e = 0; e < 2 * d; ++e)
              head[e] += (maps[0][j] - lambda * maps[1][j]) * v[e];
          }
          double ms = 0;
          for (double v : head) ms += v * v / (2 * d);
          for (int64_t e = 0; e < 2 * d; ++e) {
            C[b][i][a * 2 * d + e] = head[e] / std::sqrt(ms + 1e-5) * G[e] * (1 - linit);
          }
        }
      }
    }
    EXPECT_LT((y - OutProj(concat, p["o_proj.weight"])).abs().max().item<double>(), 1e-10)
        << causal << " " << window;
  }
}

// The paper's equations: λ = exp(λq1·λk1) - exp(λq2·λk2) + λ_init; with equal maps
// (Q1 = Q2, K1 = K2) the difference is (1 - λ)·A, and the per-head RMSNorm removes the
// (1 - λ) factor whenever 1 - λ > 0 — the output no longer depends on λ (up to the norm's
// ε = 1e-5, negligible next to the mean square of these inputs: relative tolerance 1e-6).
TEST(Diff, DefiningEquations) {
  torch::manual_seed(8);
  DiffAttention m(TestSpec(16, 4, 4, true, 0, 0));
  m.to(f64);
  {
    torch::NoGradGuard g;
    m.lambda_q1.zero_();
    m.lambda_q2.zero_();
  }
  EXPECT_NEAR(m.Lambda().item<double>(), m.lambda_init(), 1e-15);  // exp(0) - exp(0) + λ_init
  {
    torch::NoGradGuard g;
    auto p = m.named_parameters();
    for (const char* name : {"q_proj.weight", "k_proj.weight"}) {
      torch::Tensor w = p[name].view({2, 2, 4, 16});  // [pair, map, d, D]
      w.select(1, 1).copy_(w.select(1, 0));
    }
  }
  torch::Tensor x = torch::randn({1, 6, 16}, f64) * 100;
  AttentionInputs in{torch::arange(6), {}};
  torch::Tensor y0 = m.forward(x, in);
  {
    torch::NoGradGuard g;
    m.lambda_q1.fill_(0.3);
    m.lambda_k1.fill_(-0.2);  // λ changes but stays < 1
  }
  EXPECT_LT(m.Lambda().item<double>(), 1.0);
  EXPECT_NE(m.Lambda().item<double>(), m.lambda_init());
  EXPECT_LT(((m.forward(x, in) - y0).abs().max() / y0.abs().max()).item<double>(), 1e-6);
  // Parameters: MHA's plus four λ vectors of width d and the 2d RMSNorm gain.
  MultiHeadAttention mha(TestSpec(16, 4, 4, true, 0, 0), "mha", false);
  EXPECT_EQ(m.NumParameters() - mha.NumParameters(), 4 * 4 + 2 * 4);
}

TEST(Diff, RejectsOddHeadCounts) {
  try {
    DiffAttention m(TestSpec(12, 3, 4, true, 0, 0));
    ADD_FAILURE() << "accepted 3 heads";
  } catch (const InvalidAttentionSpec& e) {
    EXPECT_NE(std::string(e.what()).find("n_heads"), std::string::npos);
  }
}

TEST(Baselines, GradientsMatchFiniteDifferences) {
  std::vector<LoomOption> opts = {{"init", "random"}};
  torch::manual_seed(10);
  std::vector<std::shared_ptr<AttentionLayer>> layers = {
      std::make_shared<TalkingHeadsAttention>(TestSpec(8, 2, 4, true, 0, 10000, &opts)),
      std::make_shared<DiffAttention>(TestSpec(8, 2, 4, true, 0, 10000))};
  for (auto& m : layers) {
    m->to(f64);
    torch::Tensor x = torch::randn({1, 4, 8}, f64), w = torch::randn({1, 4, 8}, f64);
    AttentionInputs in{torch::arange(4), {}};
    ExpectGradientsMatchFiniteDifferences(
        *m, [&] { return (m->forward(x, in) * w).sum(); }, [](const std::string&) { return 3; },
        1e-6);
  }
}

}  // namespace
}  // namespace loom::attention
