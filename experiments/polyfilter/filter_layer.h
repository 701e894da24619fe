// Theorem 3 of the IHA paper trained directly (spec/iha.md, "Thm 3 (polynomial filter)"): one
// linear-attention layer (no softmax, no mask, no RoPE) over the tokens X̂ = [X, I_N] of a graph's
// N nodes, fitted to the polynomial filter bank [X, AX, …, A^{k−1}X].
//
// FilterLayer is the model the experiment trains, MHA (P = 1, fixed identity mixing and collapse)
// or IHA (P pseudo-heads, learned alpha and R), written from plain differentiable LibTorch ops.
// Queries and keys read the position block of X̂ and values its feature block — the block
// structure of the paper's construction (plugins/attention/iha/iha_theorems_test.cc). The scores
// then do not depend on X, so the layer is one linear map F of the node features, built once per
// step and applied to the batch; PluginForward computes the same layer through the plugin's IHA
// core (iha::Forward / FusedForward, Score::kLinear, Mask::kNone) on X̂ itself, and the tests hold
// the two equal in float64.
#ifndef LOOM_EXPERIMENTS_POLYFILTER_FILTER_LAYER_H_
#define LOOM_EXPERIMENTS_POLYFILTER_FILTER_LAYER_H_

#include <torch/torch.h>

#include <cstdint>

namespace loom::polyfilter {

struct LayerShape {
  int64_t nodes = 16;       // N: one token per node
  int64_t features = 2;     // dx
  int64_t powers = 4;       // k: output blocks X, AX, …, A^{k−1}X
  int64_t heads = 1;        // H
  int64_t pseudo = 1;       // P; 1 with mixing off is MHA
  bool mixing = false;      // learned alpha and R (IHA); off: identity, not trained (MHA)
  int64_t key_width = 16;   // dk of queries and keys
  int64_t value_width = 8;  // dv per head
  double scale = 0.25;      // score scale (linear scores: q·k · scale)
  torch::ScalarType dtype = torch::kFloat64;
};

enum class Init {
  kNearMha,  // the plugin's default: alpha, R = identity + N(0, noise²) (iha_attention.cc)
  kRandom,   // the plugin's "random": alpha ~ N(0, 1/H), R ~ N(0, 1/(H·P))
};

class FilterLayer : public torch::nn::Module {
 public:
  FilterLayer(const LayerShape& shape, Init init, double noise, at::Generator gen);

  // The layer as one linear map of the node features: F [N, k·dx, N, dx], output
  // Ŷ[n, c] = Σ_{n', a} F[n, c, n', a] · X[n', a].
  torch::Tensor LinearMap() const;
  // X [B, N, dx] -> Ŷ [B, N, k·dx].
  torch::Tensor forward(const torch::Tensor& x) const;
  // The same layer through the plugin's IHA core on X̂ = [X, I] with the full projection
  // matrices (their zero blocks explicit): `fused` picks FusedForward over the reference Forward.
  torch::Tensor PluginForward(const torch::Tensor& x, bool fused) const;

  // Trained parameters (MHA: wq, wk, wv, wo).
  int64_t ParameterCount() const;
  const LayerShape& shape() const { return shape_; }

  torch::Tensor wq, wk;                     // [H, N, dk]: position block of W_Q, W_K per head
  torch::Tensor wv;                         // [H, dx, dv]: feature block of W_V per head
  torch::Tensor alpha_q, alpha_k, alpha_v;  // [H, H, P]
  torch::Tensor collapse;                   // R [H, H·P]
  torch::Tensor wo;                         // [H·dv, k·dx]

 private:
  torch::Tensor Scores() const;  // [H, N·P, N·P], interleaved token-major (s = n·P + j)
  LayerShape shape_;
};

// Theorem 3's construction for graph matrix A [N, N] (the weights of FilterBankLayer in
// iha_theorems_test.cc, with W_O routing head g's value block j to output block g·P + j). Needs
// mixing, heads = pseudo = H with H² >= k, key_width = N and value_width >= P·dx.
void LoadTheorem3(FilterLayer& layer, const torch::Tensor& a);

}  // namespace loom::polyfilter

#endif  // LOOM_EXPERIMENTS_POLYFILTER_FILTER_LAYER_H_
