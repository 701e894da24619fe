// The paper's theorems, reproduced numerically in float64 with hand-built weights
// (spec/iha.md, "Theorems the code must reproduce numerically").
#include <gtest/gtest.h>

#include <cmath>

#include "attention_test_util.h"
#include "iha_attention.h"
#include "iha_core.h"
#include "mha_attention.h"

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
      AttentionInputs in{torch::arange(7)};
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
  AttentionInputs in{torch::arange(7)};
  EXPECT_GT((iha.forward(x, in) - mha.forward(x, in)).abs().max().item<double>(), 1e-6);
}

// Theorem 2(b): with P = 2 and alpha(·,·,1) = -alpha(·,·,0) for Q and K, a layer fed a
// repeated-token input X = 1·xᵀ is not linear in x, while MHA is linear there.
TEST(IhaTheorem2, OppositePseudoHeadsAreNonlinearOnRepeatedTokens) {
  for (auto [causal, mask] :
       {std::pair<bool, const char*>{false, "none"}, {true, "block"}, {true, "interleaved"}}) {
    std::vector<LoomOption> opts = {{"p", "2"}, {"mask", mask}, {"init", "random"}};
    torch::manual_seed(4);
    IhaAttention iha(TestSpec(12, 3, 4, causal, 0, 0, &opts));
    MultiHeadAttention mha(TestSpec(12, 3, 4, causal, 0, 0, nullptr), "mha", false);
    iha.to(f64);
    mha.to(f64);
    {
      torch::NoGradGuard no_grad;
      iha.alpha_q.select(2, 1).copy_(-iha.alpha_q.select(2, 0));
      iha.alpha_k.select(2, 1).copy_(-iha.alpha_k.select(2, 0));
    }
    torch::Tensor xv = torch::randn({12}, f64);
    auto repeated = [&](const torch::Tensor& v) { return v.expand({1, 6, 12}).contiguous(); };
    AttentionInputs in{torch::arange(6)};
    auto nonlinearity = [&](AttentionLayer& layer) {
      torch::Tensor f1 = layer.forward(repeated(xv), in), f2 = layer.forward(repeated(2 * xv), in);
      return ((f2 - 2 * f1).abs().max() / f1.abs().max()).item<double>();
    };
    EXPECT_LT(nonlinearity(mha), 1e-12) << mask;
    EXPECT_GT(nonlinearity(iha), 1e-3) << mask;
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

// Theorem 3: linear-score IHA with ⌈√k⌉ heads outputs [X, AX, ..., A^{k-1}X] exactly.
TEST(IhaTheorem3, PolynomialFilterBank) {
  for (int64_t k : {4, 9, 16}) {
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

// Theorem 4 (CPM-3): ⌈√N⌉ heads put every cyclic shift of the sequence at every position.
TEST(IhaTheorem4, AllCyclicShiftsAtEveryPosition) {
  for (int64_t N : {4, 9, 16}) {
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

}  // namespace
}  // namespace loom::attention::iha
