// The paper's theorems, reproduced numerically in float64 with hand-built weights
// (spec/iha.md, "Theorems the code must reproduce numerically").
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "plugins/attention/common/attention_test_util.h"
#include "plugins/attention/iha/iha_attention.h"
#include "plugins/attention/iha/iha_core.h"
#include "plugins/attention/mha/mha_attention.h"

namespace loom::attention::iha {
namespace {

constexpr auto f64 = torch::kFloat64;

// Copies the shared projections (q/k/v/o) of `from` into `to`.
void CopyProjections(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto src = from.named_parameters();
  for (auto& p : to.named_parameters()) p.value().copy_(src[p.key()]);
}

// Theorem 2(a): identity mixing with R selecting pseudo 0 reproduces MHA exactly — where every
// copy of a key is visible to a query (mask none or block) and RoPE uses token positions.
TEST(IhaTheorem2, IdentityMixingReproducesMhaExactly) {
  struct Setting {
    bool causal;
    const char* mask;
  };
  for (Setting st : {Setting{false, "none"}, Setting{true, "block"}}) {
    for (const char* p : {"1", "2", "3"}) {
      std::vector<LoomOption> opts = {
          {"p", p}, {"mask", st.mask}, {"rope_phase", "token"}, {"init", "identity"}};
      torch::manual_seed(1);
      IhaAttention iha(TestSpec(12, 3, 4, st.causal, 0, 10000, &opts));
      MultiHeadAttention mha(TestSpec(12, 3, 4, st.causal, 0, 10000, nullptr), "mha", false);
      iha.to(f64);
      mha.to(f64);
      CopyProjections(iha, mha);
      torch::Tensor x = torch::randn({2, 7, 12}, f64);
      AttentionInputs in{torch::arange(7), {}};
      EXPECT_LT((iha.forward(x, in) - mha.forward(x, in)).abs().max().item<double>(), 1e-12)
          << st.mask << " P " << p;
    }
  }
  // The inclusion is not exact under the interleaved mask: query (n, j) sees only j + 1 copies
  // of its own token's key (spec/iha.md, Initialisation).
  std::vector<LoomOption> opts = {
      {"p", "2"}, {"mask", "interleaved"}, {"rope_phase", "token"}, {"init", "identity"}};
  IhaAttention iha(TestSpec(12, 3, 4, true, 0, 10000, &opts));
  MultiHeadAttention mha(TestSpec(12, 3, 4, true, 0, 10000, nullptr), "mha", false);
  iha.to(f64);
  mha.to(f64);
  CopyProjections(iha, mha);
  torch::Tensor x = torch::randn({1, 7, 12}, f64);
  AttentionInputs in{torch::arange(7), {}};
  EXPECT_GT((iha.forward(x, in) - mha.forward(x, in)).abs().max().item<double>(), 1e-6);
}

// Theorem 2(b) (paper, App. B.1). On the repeated-token subspace S = {X = 1·xᵀ} every MHA head
// sees one query, one key and one value at every position, so its output 1·(W_V x)ᵀ is linear
// in x. The paper's IHA construction, P = 2, no RoPE: α^Q = α^K = identity on pseudo 0 and
// α(·,·,1) = −α(·,·,0), R keeping pseudo 0 of each head.
//
// What happens to V: the paper displays V̄ = [V; V] (α^V identity on both pseudo-heads). Then
// every pseudo-value of head h equals v_h, and a softmax row, summing to 1, returns v_h whatever
// the opposite-sign scores: the layer is still linear on S. The "tanh-like" nonlinearity the
// proof sketch names needs α^V(·,·,1) = −α^V(·,·,0) as well. Then query (n, 0) of head h sees
// `a` pseudo-0 keys (score c_h = q_h·k_h/√d, value v_h) and `b` pseudo-1 keys (score −c_h,
// value −v_h), so
//   O_h = v_h · (a·e^{c_h} − b·e^{−c_h}) / (a·e^{c_h} + b·e^{−c_h}),
// with a = b (mask none: N; block: n + 1), i.e. tanh(c_h)·v_h, and a = n + 1, b = n under the
// interleaved mask. c_h is quadratic in x and v_h linear, so f(2x) ≠ 2·f(x) unless every
// c_h = 0.
enum class PseudoSigns { kEqual, kOppositeQK, kOppositeQKV };

// alpha[m, h, 0] = 1(m = h) for Q, K and V; alpha[m, h, 1] = ±1(m = h): − for Q and K unless
// kEqual, − for V only with kOppositeQKV. R[h, h'·2 + j] = 1(h' = h, j = 0).
void SetTheorem2bMixing(IhaAttention& iha, PseudoSigns signs) {
  torch::NoGradGuard no_grad;
  const int64_t h = iha.alpha_q.size(0);
  torch::Tensor eye = torch::eye(h, f64);
  const double qk = signs == PseudoSigns::kEqual ? 1.0 : -1.0;
  const double v = signs == PseudoSigns::kOppositeQKV ? -1.0 : 1.0;
  for (auto [alpha, sign] : {std::pair<torch::Tensor*, double>{&iha.alpha_q, qk},
                             {&iha.alpha_k, qk},
                             {&iha.alpha_v, v}}) {
    alpha->select(2, 0).copy_(eye);
    alpha->select(2, 1).copy_(sign * eye);
  }
  iha.collapse.zero_();
  for (int64_t i = 0; i < h; ++i) iha.collapse.index_put_({i, i * 2}, 1.0);
}

// The closed form above, from the layer's own projections only (no mixing, interleaving,
// attention or collapse code): x [1, N, D] with every token equal.
torch::Tensor Theorem2bReference(IhaAttention& iha, const torch::Tensor& x,
                                 const std::string& mask) {
  torch::NoGradGuard no_grad;
  auto [q, k, v] = iha.Project(x);  // [1, N, H, d]
  const int64_t n_tokens = x.size(1), h = q.size(2), d = q.size(3);
  torch::Tensor c = (q[0][0] * k[0][0]).sum(-1) / std::sqrt(static_cast<double>(d));  // [H]
  std::vector<torch::Tensor> rows;
  for (int64_t n = 0; n < n_tokens; ++n) {
    double a = static_cast<double>(n_tokens), b = a;  // mask none
    if (mask == "block") a = b = static_cast<double>(n + 1);
    if (mask == "interleaved") a = static_cast<double>(n + 1), b = static_cast<double>(n);
    torch::Tensor g = (a * c.exp() - b * (-c).exp()) / (a * c.exp() + b * (-c).exp());
    rows.push_back((g.unsqueeze(1) * v[0][n]).reshape({h * d}));
  }
  torch::Tensor heads = torch::stack(rows).unsqueeze(0);  // [1, N, H·d]
  return torch::matmul(heads, iha.named_parameters()["o_proj.weight"].t());
}

TEST(IhaTheorem2, OppositePseudoHeadsAreNonlinearOnRepeatedTokens) {
  const int64_t D = 12, H = 3, d = 4, N = 6;
  for (auto [causal, mask] :
       {std::pair<bool, std::string>{false, "none"}, {true, "block"}, {true, "interleaved"}}) {
    std::vector<LoomOption> opts = {{"p", "2"}, {"mask", mask.c_str()}, {"init", "identity"}};
    torch::manual_seed(4);
    IhaAttention iha(TestSpec(D, H, d, causal, 0, 0, &opts));
    MultiHeadAttention mha(TestSpec(D, H, d, causal, 0, 0, nullptr), "mha", false);
    iha.to(f64);
    mha.to(f64);
    CopyProjections(iha, mha);
    AttentionInputs in{torch::arange(N), {}};
    auto repeated = [&](const torch::Tensor& v) { return v.expand({1, N, D}).contiguous(); };
    // max |f(2x) − 2·f(x)| / max |2·f(x)|: 0 for a layer linear on S.
    auto nonlinearity = [&](AttentionLayer& layer, const torch::Tensor& xv) {
      torch::Tensor f1 = layer.forward(repeated(xv), in), f2 = layer.forward(repeated(2 * xv), in);
      return ((f2 - 2 * f1).abs().max() / (2 * f1).abs().max()).item<double>();
    };
    for (int draw = 0; draw < 3; ++draw) {
      // Scaled so that max_h |c_h| = 1: a random x can give c_h ≈ 0 in every head (seen: 0.02),
      // where tanh is nearly linear and the margin would be luck.
      torch::Tensor xv = torch::randn({D}, f64);
      {
        auto [q, k, v] = iha.Project(repeated(xv));
        const double c_max = ((q[0][0] * k[0][0]).sum(-1) / std::sqrt(static_cast<double>(d)))
                                 .abs()
                                 .max()
                                 .item<double>();
        xv = xv / std::sqrt(c_max);
      }
      // Every MHA layer is linear on S (float64 rounding only).
      EXPECT_LT(nonlinearity(mha, xv), 1e-12) << mask;
      // Control: equal alpha for the two pseudo-heads makes every pseudo-key of a head equal,
      // uniform attention, linear — fails if the test were blind to the construction.
      SetTheorem2bMixing(iha, PseudoSigns::kEqual);
      EXPECT_LT(nonlinearity(iha, xv), 1e-12) << mask;
      // The paper's displayed V̄ = [V; V]: opposite Q/K alone stay linear (see above).
      SetTheorem2bMixing(iha, PseudoSigns::kOppositeQK);
      EXPECT_LT(nonlinearity(iha, xv), 1e-12) << mask;
      // The construction: the layer is the closed form (1e-12, float64) and clearly nonlinear.
      SetTheorem2bMixing(iha, PseudoSigns::kOppositeQKV);
      for (double scale : {1.0, 2.0}) {
        torch::Tensor x = repeated(scale * xv);
        EXPECT_LT(
            (iha.forward(x, in) - Theorem2bReference(iha, x, mask)).abs().max().item<double>(),
            1e-12)
            << mask << " scale " << scale;
      }
      EXPECT_GT(nonlinearity(iha, xv), 0.1) << mask;
    }
  }
}

// Builds the Theorem 3/4 layer for graph matrix A [N, N] and node features X [N, dx] with
// H = P heads and linear scores, from the input X̂ = [X, I] through per-head projections:
//   head m query   = X̂ → row n of A^{m·H}        (W_q[m] = [0; A^{mH}])
//   head m key     = X̂ → column n of A^m          (W_k[m] = [0; (A^m)ᵀ])
//   head m value   = X̂ → X_n in value block m     (W_v[m] = [E_m; 0])
// alpha^Q routes head h into pseudo 0 of head h; alpha^K and alpha^V route head j into pseudo j
// of every head; R keeps pseudo 0 of each head. Returns the concatenated heads [N, H·H·dx].
torch::Tensor FilterBankLayer(const torch::Tensor& A, const torch::Tensor& X, int64_t H) {
  const int64_t N = A.size(0), dx = X.size(1), P = H;
  torch::Tensor xhat = torch::cat({X, torch::eye(N, f64)}, 1);  // [N, dx + N]
  std::vector<torch::Tensor> wq, wk, wv;
  for (int64_t m = 0; m < H; ++m) {
    torch::Tensor zeros_x = torch::zeros({dx, N}, f64);
    wq.push_back(torch::cat({zeros_x, torch::matrix_power(A, m * H)}, 0));
    wk.push_back(torch::cat({zeros_x, torch::matrix_power(A, m).t()}, 0));
    torch::Tensor route = torch::zeros({dx + N, P * dx}, f64);
    route.index_put_({torch::indexing::Slice(0, dx), torch::indexing::Slice(m * dx, (m + 1) * dx)},
                     torch::eye(dx, f64));
    wv.push_back(route);
  }
  auto project = [&](const std::vector<torch::Tensor>& w) {
    std::vector<torch::Tensor> heads;
    for (const auto& wm : w) heads.push_back(torch::matmul(xhat, wm));
    return torch::stack(heads, 1).unsqueeze(0);  // [1, N, H, width]
  };
  torch::Tensor aq = torch::zeros({H, H, P}, f64), ak = torch::zeros({H, H, P}, f64),
                av = torch::zeros({H, H, P}, f64), r = torch::zeros({H, H * P}, f64);
  for (int64_t h = 0; h < H; ++h) {
    aq.index_put_({h, h, 0}, 1.0);
    r.index_put_({h, h * P + 0}, 1.0);
    for (int64_t j = 0; j < P; ++j) {
      ak.index_put_({j, h, j}, 1.0);
      av.index_put_({j, h, j}, 1.0);
    }
  }
  Options o;
  o.p = P;
  o.mask = Mask::kNone;
  o.score = Score::kLinear;
  o.scale = 1.0;
  torch::Tensor out = Forward(project(wq), project(wk), project(wv), aq, ak, av, r, {}, o);
  return out.reshape({N, H * P * dx});
}

// Theorem 3: linear-score IHA with ⌈√k⌉ heads outputs [X, AX, ..., A^{k-1}X] exactly; for
// non-square k (5, 10) the layer computes ⌈√k⌉² > k powers and the first k are checked.
TEST(IhaTheorem3, PolynomialFilterBank) {
  for (int64_t k : {4, 5, 9, 10, 16}) {
    const int64_t H = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(k))));
    torch::manual_seed(k);
    const int64_t N = 7, dx = 2;
    // A random graph: Bernoulli(0.4) adjacency, row-normalised so powers stay bounded.
    torch::Tensor adj = (torch::rand({N, N}, f64) < 0.4).to(f64) + torch::eye(N, f64);
    torch::Tensor A = adj / adj.sum(1, true);
    torch::Tensor X = torch::randn({N, dx}, f64);
    torch::Tensor out = FilterBankLayer(A, X, H);
    for (int64_t power = 0; power < k; ++power) {
      torch::Tensor want = torch::matmul(torch::matrix_power(A, power), X);
      torch::Tensor got = out.narrow(1, power * dx, dx);
      EXPECT_LT((got - want).abs().max().item<double>(), 1e-12) << "k " << k << " power " << power;
    }
  }
}

// Theorem 4 (CPM-3): ⌈√N⌉ heads put every cyclic shift of the sequence at every position
// (non-square N: the first N of the ⌈√N⌉² shifts).
TEST(IhaTheorem4, AllCyclicShiftsAtEveryPosition) {
  for (int64_t N : {4, 5, 9, 10, 16}) {
    const int64_t H = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(N))));
    torch::Tensor shift = torch::zeros({N, N}, f64);
    for (int64_t n = 0; n < N; ++n) shift.index_put_({n, (n + 1) % N}, 1.0);
    torch::Tensor X = torch::arange(1, N + 1, f64).unsqueeze(1);       // tokens 1..N
    torch::Tensor out = FilterBankLayer(shift, X, H).narrow(1, 0, N);  // first N shifts
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t s = 0; s < N; ++s) {
        EXPECT_NEAR(out[n][s].item<double>(), static_cast<double>((n + s) % N + 1), 1e-12);
      }
    }
    if (N == 4) {
      const double rows[4][4] = {{1, 2, 3, 4}, {2, 3, 4, 1}, {3, 4, 1, 2}, {4, 1, 2, 3}};
      for (int n = 0; n < 4; ++n) {
        for (int s = 0; s < 4; ++s) EXPECT_EQ(out[n][s].item<double>(), rows[n][s]);
      }
    }
  }
}

// The other half of Theorems 3/4 (Theorem 1): MHA needs k heads. A linear MHA head applies one
// attention operator S_m [N, N] to the features, so with h heads feature block i of the output
// is Σ_m w_m[i]·S_m·X. For one fixed X a head whose values read the identity part of X̂ can emit
// any matrix, so "the same outputs" means for every X: the same operators, A^i ∈ span{S_m}.
// The best any h heads can do (Eckart–Young, over all S_m and w) leaves the singular values
// σ_{h+1}, … of M = [vec op_0, …, vec op_{k−1}]; this returns that residual over ‖M‖_F. It is
// non-increasing in h, so a bound at h = k − 1 holds for every h < k, ⌈√k⌉ included.
double MhaResidual(const std::vector<torch::Tensor>& ops, int64_t heads) {
  std::vector<torch::Tensor> columns;
  for (const auto& op : ops) columns.push_back(op.reshape({-1}));
  torch::Tensor m = torch::stack(columns, 1);
  torch::Tensor s = torch::linalg_svdvals(m);  // descending
  if (heads >= s.size(0)) return 0.0;
  return (s.narrow(0, heads, s.size(0) - heads).square().sum().sqrt() / m.norm()).item<double>();
}

// The k operators the IHA layer applies, read off its outputs: with X = I_N (dx = N) feature
// block i of the output is op_i itself.
std::vector<torch::Tensor> LayerOperators(const torch::Tensor& A, int64_t H, int64_t k) {
  const int64_t N = A.size(0);
  torch::Tensor out = FilterBankLayer(A, torch::eye(N, f64), H);
  std::vector<torch::Tensor> ops;
  for (int64_t i = 0; i < k; ++i) ops.push_back(out.narrow(1, i * N, N));
  return ops;
}

// Theorem 3 vs Theorem 1. The powers must be linearly independent for MHA to need k heads, so
// N >= k (Cayley–Hamilton), and A's spectrum must not make them nearly dependent: for
// row-normalised random graphs like those above (N = 12) the powers converge to 1·πᵀ and the
// k − 1 head residual is only ~2e-6 at k = 10 (measured). A random orthogonal A (any real A is
// allowed; its eigenvalues lie on the unit circle) keeps the powers apart.
TEST(IhaTheorem3, MhaWithFewerThanKHeadsCannotMatch) {
  const int64_t N = 16;
  for (int64_t k : {4, 5, 9, 10}) {
    const int64_t H = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(k))));
    torch::manual_seed(k);
    torch::Tensor A = std::get<0>(torch::linalg_qr(torch::randn({N, N}, f64)));
    std::vector<torch::Tensor> ops = LayerOperators(A, H, k);
    for (int64_t i = 0; i < k; ++i) {
      EXPECT_LT((ops[i] - torch::matrix_power(A, i)).abs().max().item<double>(), 1e-12)
          << "k " << k << " power " << i;
    }
    // IHA with H heads is exact (above, 1e-12); MHA with k − 1 heads misses by > 10% of ‖M‖_F.
    EXPECT_GT(MhaResidual(ops, k - 1), 0.1) << "k " << k;
  }
}

// Theorem 4 vs MHA: the N cyclic shifts are permutation matrices with disjoint supports, each of
// Frobenius norm √N, so every singular value of M is √N and h heads leave exactly
// √((N − h)/N) — 1/√N for h = N − 1 (float64, 1e-12).
TEST(IhaTheorem4, MhaWithFewerThanNHeadsCannotMatch) {
  for (int64_t N : {4, 5, 9, 10, 16}) {
    const int64_t H = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(N))));
    torch::Tensor shift = torch::zeros({N, N}, f64);
    for (int64_t n = 0; n < N; ++n) shift.index_put_({n, (n + 1) % N}, 1.0);
    std::vector<torch::Tensor> ops = LayerOperators(shift, H, N);
    const int64_t fewer = N - 1;
    const double residual = MhaResidual(ops, fewer);
    EXPECT_GT(residual, 0.2) << "N " << N;
    EXPECT_NEAR(residual, 1.0 / std::sqrt(static_cast<double>(N)), 1e-12) << "N " << N;
    // MHA with as many heads as IHA uses misses far more.
    EXPECT_NEAR(MhaResidual(ops, H), std::sqrt(static_cast<double>(N - H) / N), 1e-12) << "N " << N;
  }
}

}  // namespace
}  // namespace loom::attention::iha
