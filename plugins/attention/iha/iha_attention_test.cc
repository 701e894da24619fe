// IHA against an independent reference written here with plain loops over tokens n, pseudo
// indices j and heads h, in float64, across mask × window × RoPE phase × P × (H, d). Tolerances:
// 1e-10 absolute for forward values; 1e-6 absolute between autograd and central finite
// differences (step 1e-6).
#include "plugins/attention/iha/iha_attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "plugins/attention/common/attention_common.h"
#include "plugins/attention/common/attention_test_util.h"
#include "plugins/attention/iha/iha_core.h"
#include "plugins/attention/mha/mha_attention.h"

namespace loom::attention::iha {
namespace {

using Vec = std::vector<double>;

Vec Rope(const Vec& x, double p, double theta) {
  const size_t d = x.size(), half = d / 2;
  Vec out(d);
  for (size_t i = 0; i < half; ++i) {
    const double f = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(d));
    out[i] = x[i] * std::cos(p * f) - x[i + half] * std::sin(p * f);
    out[i + half] = x[i + half] * std::cos(p * f) + x[i] * std::sin(p * f);
  }
  return out;
}

// The paper's Algorithm 1 with loops: returns [B, N, H, dv].
torch::Tensor LoopIha(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                      const torch::Tensor& aq, const torch::Tensor& ak, const torch::Tensor& av,
                      const torch::Tensor& r, const Options& o) {
  const int64_t B = q.size(0), N = q.size(1), H = q.size(2), dk = q.size(3), dv = v.size(3),
                P = o.p;
  auto Q = q.accessor<double, 4>(), K = k.accessor<double, 4>(), V = v.accessor<double, 4>();
  auto AQ = aq.accessor<double, 3>(), AK = ak.accessor<double, 3>(), AV = av.accessor<double, 3>();
  auto R = r.accessor<double, 2>();
  const double scale = o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(dk));
  torch::Tensor out = torch::zeros({B, N, H, dv}, torch::kFloat64);
  auto O = out.accessor<double, 4>();
  for (int64_t b = 0; b < B; ++b) {
    // pseudo[h][n][j] for q, k, v of every head.
    std::vector<std::vector<std::vector<Vec>>> pq(H), pk(H), pv(H), po(H);
    for (int64_t h = 0; h < H; ++h) {
      pq[h].assign(N, std::vector<Vec>(P, Vec(dk, 0)));
      pk[h].assign(N, std::vector<Vec>(P, Vec(dk, 0)));
      pv[h].assign(N, std::vector<Vec>(P, Vec(dv, 0)));
      po[h].assign(N, std::vector<Vec>(P, Vec(dv, 0)));
      for (int64_t n = 0; n < N; ++n) {
        for (int64_t j = 0; j < P; ++j) {
          for (int64_t m = 0; m < H; ++m) {
            for (int64_t e = 0; e < dk; ++e) {
              pq[h][n][j][e] += AQ[m][h][j] * Q[b][n][m][e];
              pk[h][n][j][e] += AK[m][h][j] * K[b][n][m][e];
            }
            for (int64_t e = 0; e < dv; ++e) pv[h][n][j][e] += AV[m][h][j] * V[b][n][m][e];
          }
          if (o.rope_theta > 0) {
            const double phase = o.rope_phase == RopePhase::kInterleaved
                                     ? static_cast<double>(n * P + j)
                                     : static_cast<double>(n);
            pq[h][n][j] = Rope(pq[h][n][j], phase, o.rope_theta);
            pk[h][n][j] = Rope(pk[h][n][j], phase, o.rope_theta);
          }
        }
      }
      for (int64_t n = 0; n < N; ++n) {
        for (int64_t j = 0; j < P; ++j) {
          const int64_t s = n * P + j;
          std::vector<double> w;
          std::vector<std::pair<int64_t, int64_t>> keys;
          for (int64_t n2 = 0; n2 < N; ++n2) {
            for (int64_t j2 = 0; j2 < P; ++j2) {
              const int64_t s2 = n2 * P + j2;
              if (o.mask == Mask::kInterleaved && s2 > s) continue;
              if (o.mask == Mask::kBlock && n2 > n) continue;
              if (o.window > 0 && std::abs(s - s2) >= o.window * P) continue;
              double dot = 0;
              for (int64_t e = 0; e < dk; ++e) dot += pq[h][n][j][e] * pk[h][n2][j2][e];
              w.push_back(dot * scale);
              keys.emplace_back(n2, j2);
            }
          }
          if (o.score == Score::kSoftmax) {
            double mx = -1e300, z = 0;
            for (double x : w) mx = std::max(mx, x);
            for (double& x : w) z += (x = std::exp(x - mx));
            for (double& x : w) x /= z;
          }
          for (size_t t = 0; t < keys.size(); ++t) {
            for (int64_t e = 0; e < dv; ++e)
              po[h][n][j][e] += w[t] * pv[h][keys[t].first][keys[t].second][e];
          }
        }
      }
    }
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t h2 = 0; h2 < H; ++h2) {
          for (int64_t j = 0; j < P; ++j) {
            for (int64_t e = 0; e < dv; ++e) O[b][n][h][e] += R[h][h2 * P + j] * po[h2][n][j][e];
          }
        }
      }
    }
  }
  return out;
}

TEST(IhaCore, MatchesLoopReferenceAcrossOptions) {
  struct Shape {
    int64_t h, dk, dv;
  };
  const Shape shapes[] = {{2, 4, 4}, {4, 2, 2}, {3, 6, 4}};
  int checked = 0;
  for (const Shape& sh : shapes) {
    for (int64_t p : {int64_t{1}, int64_t{2}, int64_t{3}, sh.h}) {
      for (Mask mask : {Mask::kInterleaved, Mask::kBlock, Mask::kNone}) {
        for (int64_t window : {0, 2}) {
          for (int rope = 0; rope < 3; ++rope) {
            for (Score score : {Score::kSoftmax, Score::kLinear}) {
              Options o;
              o.p = p;
              o.mask = mask;
              o.window = window;
              o.rope_theta = rope == 0 ? 0.0 : 10000.0;
              o.rope_phase = rope == 2 ? RopePhase::kToken : RopePhase::kInterleaved;
              o.score = score;
              torch::manual_seed(100 + checked);
              const int64_t B = 2, N = 5;
              auto f64 = torch::kFloat64;
              torch::Tensor q = torch::randn({B, N, sh.h, sh.dk}, f64),
                            k = torch::randn({B, N, sh.h, sh.dk}, f64),
                            v = torch::randn({B, N, sh.h, sh.dv}, f64);
              torch::Tensor aq = torch::randn({sh.h, sh.h, p}, f64),
                            ak = torch::randn({sh.h, sh.h, p}, f64),
                            av = torch::randn({sh.h, sh.h, p}, f64),
                            r = torch::randn({sh.h, sh.h * p}, f64);
              torch::Tensor got = Forward(q, k, v, aq, ak, av, r, torch::arange(N), o);
              torch::Tensor want = LoopIha(q, k, v, aq, ak, av, r, o);
              ASSERT_LT((got - want).abs().max().item<double>(), 1e-10)
                  << "H " << sh.h << " dk " << sh.dk << " dv " << sh.dv << " P " << p << " mask "
                  << static_cast<int>(mask) << " window " << window << " rope " << rope << " score "
                  << static_cast<int>(score);
              ++checked;
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 3 * 4 * 3 * 2 * 3 * 2);
}

std::shared_ptr<IhaAttention> MakeIha(int64_t d_model, int64_t h, int64_t d, bool causal,
                                      int64_t window, double theta,
                                      std::vector<LoomOption> options) {
  torch::manual_seed(21);
  auto m = std::make_shared<IhaAttention>(TestSpec(d_model, h, d, causal, window, theta, &options));
  m->to(torch::kFloat64);
  return m;
}

TEST(IhaAttention, ModuleIsProjectionsAroundTheCore) {
  for (const char* kernel : {"reference", "fused"}) {
    for (const char* mask : {"interleaved", "block"}) {
      auto m = MakeIha(12, 3, 4, true, 0, 10000,
                       {{"p", "2"}, {"mask", mask}, {"init", "random"}, {"kernel", kernel}});
      torch::Tensor x = torch::randn({2, 6, 12}, torch::kFloat64);
      torch::Tensor y = m->forward(x, {torch::arange(6), {}});
      auto [q, k, v] = m->Project(x);
      torch::Tensor heads =
          LoopIha(q, k, v, m->alpha_q, m->alpha_k, m->alpha_v, m->collapse, m->options());
      auto params = m->named_parameters();
      torch::Tensor want = torch::matmul(heads.reshape({2, 6, 12}), params["o_proj.weight"].t());
      EXPECT_LT((y - want).abs().max().item<double>(), 1e-10) << mask << " " << kernel;
    }
  }
}

TEST(IhaAttention, KernelSelection) {
  auto automatic = MakeIha(12, 3, 4, true, 0, 0, {{"p", "4"}});
  EXPECT_TRUE(automatic->UsesFusedKernel(torch::kCPU));
  EXPECT_FALSE(automatic->UsesFusedKernel(torch::Device(torch::kCUDA, 0)));
  EXPECT_TRUE(MakeIha(12, 3, 4, true, 0, 0, {{"kernel", "fused"}})->UsesFusedKernel(torch::kCPU));
  EXPECT_FALSE(
      MakeIha(12, 3, 4, true, 0, 0, {{"kernel", "reference"}})->UsesFusedKernel(torch::kCPU));
}

TEST(IhaAttention, GradientsOfEveryParameterMatchFiniteDifferences) {
  for (const char* kernel : {"reference", "fused"}) {
    auto m = MakeIha(8, 2, 4, true, 2, 10000, {{"p", "2"}, {"init", "random"}, {"kernel", kernel}});
    torch::Tensor x = torch::randn({1, 4, 8}, torch::kFloat64);
    torch::Tensor w = torch::randn({1, 4, 8}, torch::kFloat64);
    AttentionInputs in{torch::arange(4), {}};
    // Every alpha and R entry; every fifth projection weight.
    const int64_t checked = ExpectGradientsMatchFiniteDifferences(
        *m, [&] { return (m->forward(x, in) * w).sum(); },
        [](const std::string& name) { return name.find("proj") == std::string::npos ? 1 : 5; },
        1e-6);
    EXPECT_GT(checked,
              3 * 2 * 2 * 2 + 2 * 4);  // all 3·H²·P alpha entries and H·H·P collapse entries
  }
}

TEST(IhaAttention, ParameterOverheadIsFourHSquaredP) {
  for (int64_t p : {1, 2, 3, 4}) {
    for (int64_t h : {1, 2, 4}) {
      auto iha = MakeIha(16, h, 4, true, 0, 0, {{"p", std::to_string(p).c_str()}});
      LoomAttentionSpecV1 s = TestSpec(16, h, 4, true, 0, 0, nullptr);
      MultiHeadAttention mha(s, "mha", false);
      EXPECT_EQ(iha->NumParameters() - mha.NumParameters(), 4 * h * h * p)
          << "H " << h << " P " << p;
    }
  }
  // Default P = H.
  EXPECT_EQ(MakeIha(16, 4, 4, true, 0, 0, {})->options().p, 4);
}

// Changing token t must never change outputs before t, for both causal masks, with and without
// a window; with window W (tokens), outputs at i depend only on tokens i - W .. i (the boundary
// token i - W is seen only by pseudo-queries j < j', as the window counts W·P expanded positions).
TEST(IhaAttention, CausalityAndWindowForBothMasks) {
  const int64_t N = 9;
  for (const char* mask : {"interleaved", "block"}) {
    for (int64_t window : {0, 2}) {
      for (int64_t p : {1, 3}) {
        for (const char* kernel : {"reference", "fused"}) {
          auto m = MakeIha(12, 3, 4, true, window, 10000,
                           {{"p", std::to_string(p).c_str()},
                            {"mask", mask},
                            {"init", "random"},
                            {"kernel", kernel}});
          torch::Tensor x = torch::randn({1, N, 12}, torch::kFloat64);
          AttentionInputs in{torch::arange(N), {}};
          torch::Tensor y = m->forward(x, in);
          for (int64_t t = 0; t < N; ++t) {
            torch::Tensor x2 = x.clone();
            x2.index_put_({0, t}, torch::randn({12}, torch::kFloat64) * 3);
            torch::Tensor diff = (m->forward(x2, in) - y).abs().amax({0, 2});
            for (int64_t i = 0; i < N; ++i) {
              const int64_t reach = p == 1 ? window - 1 : window;  // tokens back that are visible
              const bool visible = t <= i && (window == 0 || i - t <= reach);
              if (visible) {
                EXPECT_GT(diff[i].item<double>(), 1e-12)
                    << mask << " W " << window << " P " << p << " t " << t << " i " << i;
              } else {
                EXPECT_EQ(diff[i].item<double>(), 0.0)
                    << mask << " W " << window << " P " << p << " t " << t << " i " << i << kernel;
              }
            }
          }
        }
      }
    }
  }
}

// The defining property seed 004 lacks: pseudo-query j attends to pseudo-keys of other indices
// j' != j. Changing only pseudo-value j' (through alpha_v[:, :, j']) changes pseudo output j.
TEST(IhaCore, PseudoQueriesAttendAcrossPseudoIndices) {
  torch::manual_seed(9);
  const int64_t B = 1, N = 4, H = 2, d = 3, P = 3;
  auto f64 = torch::kFloat64;
  torch::Tensor q = torch::randn({B, N, H, d}, f64), k = torch::randn({B, N, H, d}, f64),
                v = torch::randn({B, N, H, d}, f64);
  torch::Tensor aq = torch::randn({H, H, P}, f64), ak = torch::randn({H, H, P}, f64),
                av = torch::randn({H, H, P}, f64);
  for (Mask mask : {Mask::kInterleaved, Mask::kBlock, Mask::kNone}) {
    Options o;
    o.p = P;
    o.mask = mask;
    torch::Tensor base = PseudoOutputs(q, k, v, aq, ak, av, {}, o);  // [B, N, H, P, d]
    for (int64_t jv = 0; jv < P; ++jv) {
      torch::Tensor av2 = av.clone();
      av2.select(2, jv).add_(1.0);
      torch::Tensor changed = PseudoOutputs(q, k, v, aq, ak, av2, {}, o);
      for (int64_t j = 0; j < P; ++j) {
        if (j == jv) continue;
        // Last token: every mask lets it see all pseudo-keys of earlier tokens.
        const double delta =
            (changed - base).select(3, j).select(1, N - 1).abs().max().item<double>();
        EXPECT_GT(delta, 1e-6) << "mask " << static_cast<int>(mask) << ": pseudo-query " << j
                               << " ignores pseudo-values " << jv;
      }
    }
    // And the weights really spread over other pseudo indices: for every pseudo-query of the last
    // token, the mass on keys of other indices is substantial.
    torch::Tensor w = AttentionWeights(q, k, aq, ak, {}, o);  // [B, H, NP, NP]
    for (int64_t j = 0; j < P; ++j) {
      torch::Tensor row = w.index({0, 0, (N - 1) * P + j});
      double other = 0;
      for (int64_t s = 0; s < N * P; ++s) {
        if (s % P != j) other += row[s].item<double>();
      }
      EXPECT_GT(other, 0.05) << "pseudo-query " << j;
    }
  }
  // A "per-pseudo" peer (each pseudo-head attends only to its own index, then averages) is a
  // different function: IHA must not reduce to it.
  Options o;
  o.p = P;
  o.mask = Mask::kNone;
  torch::Tensor qi = MixAndInterleave(q, aq).view({B, H, N, P, d}),
                ki = MixAndInterleave(k, ak).view({B, H, N, P, d}),
                vi = MixAndInterleave(v, av).view({B, H, N, P, d});
  torch::Tensor scores = torch::einsum("bhnjd,bhmjd->bhjnm", {qi, ki}) / std::sqrt(3.0);
  torch::Tensor naive = torch::einsum("bhjnm,bhmjd->bnhjd", {torch::softmax(scores, -1), vi});
  torch::Tensor iha = PseudoOutputs(q, k, v, aq, ak, av, {}, o);
  EXPECT_GT((iha - naive).abs().max().item<double>(), 1e-3);
}

TEST(IhaCore, AttendedKeysAndFlops) {
  // Interleaved, N = 2, P = 2: queries s = 0..3 see 1, 2, 3, 4 keys.
  EXPECT_DOUBLE_EQ(AverageAttendedKeys(2, 2, Mask::kInterleaved, 0), 2.5);
  // Block: both pseudo of token 0 see 2 keys, of token 1 see 4.
  EXPECT_DOUBLE_EQ(AverageAttendedKeys(2, 2, Mask::kBlock, 0), 3.0);
  EXPECT_DOUBLE_EQ(AverageAttendedKeys(2, 2, Mask::kNone, 0), 4.0);
  // The count agrees with the mask it describes.
  for (Mask mask : {Mask::kInterleaved, Mask::kBlock, Mask::kNone}) {
    for (int64_t w : {0, 1, 3}) {
      torch::Tensor allowed = AllowedMask(7, 3, mask, w, torch::kCPU);
      EXPECT_DOUBLE_EQ(AverageAttendedKeys(7, 3, mask, w), allowed.sum().item<double>() / 21.0)
          << static_cast<int>(mask) << " " << w;
    }
  }
  auto m = MakeIha(16, 4, 4, true, 0, 0, {{"p", "2"}});
  const double h = 4, d = 4, p = 2;
  EXPECT_DOUBLE_EQ(m->ForwardFlopsPerToken(2),
                   8 * 16 * 16 + 8 * h * h * p * d + h * p * 4 * d * 2.5);
}

TEST(IhaAttention, RejectsBadOptionsNamingTheField) {
  auto expect_error = [](bool causal, std::vector<LoomOption> options, const std::string& field) {
    try {
      IhaAttention m(TestSpec(16, 4, 4, causal, 0, 0, &options));
      ADD_FAILURE() << "accepted " << field;
    } catch (const InvalidAttentionSpec& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  expect_error(true, {{"p", "0"}}, "options.p");
  expect_error(true, {{"p", "two"}}, "options.p");
  expect_error(true, {{"mask", "none"}}, "options.mask");
  expect_error(false, {{"mask", "block"}}, "options.mask");
  expect_error(true, {{"mask", "diagonal"}}, "options.mask");
  expect_error(true, {{"rope_phase", "sideways"}}, "options.rope_phase");
  expect_error(true, {{"init", "zeros"}}, "options.init");
  expect_error(true, {{"score", "relu"}}, "options.score");
  expect_error(true, {{"init_noise", "-1"}}, "options.init_noise");
  expect_error(true, {{"pseudo_heads", "2"}}, "options.pseudo_heads");
  expect_error(true, {{"kernel", "triton"}}, "options.kernel");
}

TEST(IhaAttention, NearMhaInitialisationIsDocumented) {
  auto identity = MakeIha(16, 4, 4, true, 0, 0, {{"p", "3"}, {"init", "identity"}});
  torch::Tensor eye = torch::eye(4, torch::kFloat64);
  for (int64_t j = 0; j < 3; ++j) EXPECT_TRUE(torch::equal(identity->alpha_q.select(2, j), eye));
  torch::Tensor r = identity->collapse.view({4, 4, 3});
  EXPECT_TRUE(torch::equal(r.select(2, 0), eye));
  EXPECT_EQ(r.select(2, 1).abs().sum().item<double>(), 0.0);
  auto near = MakeIha(16, 4, 4, true, 0, 0, {{"p", "3"}});
  torch::Tensor noise = near->alpha_k - identity->alpha_k;
  EXPECT_GT(noise.abs().max().item<double>(), 0.0);
  EXPECT_NEAR(noise.std().item<double>(), 0.02, 0.01);
}

}  // namespace
}  // namespace loom::attention::iha
