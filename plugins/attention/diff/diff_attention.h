// Differential attention (Ye, Dong, Xia, Sun, Zhu, Huang, Wei 2024, "Differential Transformer",
// arXiv:2410.05258), following the paper and its reference code (microsoft/unilm, Diff-
// Transformer, multihead_diffattn.py):
//   * H/2 differential heads for a baseline of H heads of width d, so parameters match MHA:
//     q_proj, k_proj: [H·d, D] viewed as 2·(H/2) heads of width d, consecutive pairs (2i, 2i+1)
//     giving (Q1, Q2) and (K1, K2) of differential head i; v_proj: [H·d, D] viewed as H/2 heads
//     of width 2d;
//   * A_i = softmax(Q1 K1ᵀ / sqrt(d)) - λ · softmax(Q2 K2ᵀ / sqrt(d)),  head_i = A_i V_i;
//   * λ = exp(λ_q1 · λ_k1) - exp(λ_q2 · λ_k2) + λ_init, vectors λ_* of width d shared by the
//     layer's heads, initialised N(0, 0.1²);
//   * λ_init = 0.8 - 0.6 · exp(-0.3 · (l - 1)) for 1-based layer l (= layer_index + 1);
//   * head_i ← (1 - λ_init) · RMSNorm(head_i) (per head over 2d, ε = 1e-5, learned weight
//     `subln.weight` of width 2d shared by heads); concat; o_proj.
// Options: lambda_init (overrides the depth schedule), lambda_std (default 0.1).
#ifndef LOOM_PLUGINS_ATTENTION_DIFF_DIFF_ATTENTION_H_
#define LOOM_PLUGINS_ATTENTION_DIFF_DIFF_ATTENTION_H_

#include <torch/torch.h>

#include "loom/attention_plugin.h"
#include "plugins/attention/common/attention_common.h"

namespace loom::attention {

// λ_init for a 0-based layer index.
double DiffLambdaInit(int64_t layer_index);

class DiffAttention : public ProjectedAttention {
 public:
  explicit DiffAttention(const LoomAttentionSpecV1& spec);
  torch::Tensor forward(const torch::Tensor& x, const AttentionInputs& inputs) override;
  double ForwardFlopsPerToken(int64_t context) const override;
  torch::Tensor Attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& allowed) override;
  int64_t ValueHeads() const override { return n_heads_ / 2; }

  double lambda_init() const { return lambda_init_; }
  torch::Tensor Lambda() const;  // the scalar λ (0-dim tensor, differentiable)

  torch::Tensor lambda_q1, lambda_k1, lambda_q2, lambda_k2, subln_weight;

 private:
  double lambda_init_;
};

}  // namespace loom::attention

#endif  // LOOM_PLUGINS_ATTENTION_DIFF_DIFF_ATTENTION_H_
