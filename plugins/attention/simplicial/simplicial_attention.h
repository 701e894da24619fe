// 2-simplicial (trilinear) attention: Clift, Doryn, Murfet, Wallbridge 2019, "Logic and the
// 2-Simplicial Transformer" (arXiv:1909.00668), in the trilinear form and with the sliding
// windows of Roy, Chou, Duvvuri et al. 2025, "Fast and Simplex: 2-Simplicial Attention in
// Triton" (arXiv:2507.02754). Per head (width d), for query token i:
//   q_i, k_j, k'_l, v_j, v'_l  five separate projections of x (q_proj, k_proj, k2_proj, v_proj,
//                              v2_proj, each [H·d, D]);
//   a_ijl = scale · sum_t q_it k_jt k'_lt            (scale = 1/sqrt(d) by default);
//   P_ijl = softmax of a_ij· over all allowed pairs (j, l) jointly;
//   o_i   = sum_jl P_ijl (v_j ⊙ v'_l);   y = concat_h o · W_Oᵀ (o_proj).
// Allowed: j and l each pass the causal mask (j, l <= i) and the packed segment of i, and
// i - j < w1, i - l < w2 (encoders: |i - j| < w1, |i - l| < w2). w1 = options.window1, w2 =
// options.window2, each also bounded by the layer's spec window (0 = unbounded).
//
// Two implementations (options.kernel). The fused CPU kernel (simplicial_cpu.h: per (row,
// head) tiles in cache, the backward by recomputation, O(N) memory saved per head) is the
// default on CPU float32/float64. The reference path is plain LibTorch ops, for other devices
// and dtypes and for cached decoding: queries in chunks, each over the band of keys its window
// can reach, so no-grad peak memory is O(chunk · w1 · w2) per head and the work O(N · w1 · w2 ·
// d) (O(N³ · d) unwindowed); under autograd the saved probabilities of every chunk stay alive,
// O(N · w1 · w2) per head. A float64 loop reference decides the correctness of both
// (simplicial_attention_test).
//
// RoPE: the trilinear form is not invariant under a common rotation of q, k, k', so rotary
// phases give no relative position. Option rope = none (default: the layer ignores positions) |
// rotate (apply the spec's RoPE to q, k and k' anyway). The 2025 paper's determinant form is
// not implemented.
#ifndef LOOM_PLUGINS_ATTENTION_SIMPLICIAL_SIMPLICIAL_ATTENTION_H_
#define LOOM_PLUGINS_ATTENTION_SIMPLICIAL_SIMPLICIAL_ATTENTION_H_

#include <torch/torch.h>

#include <memory>
#include <string>

#include "loom/attention_plugin.h"
#include "plugins/attention/common/attention_common.h"

namespace loom::attention {

// The decoding cache: k|k' and v|v' concatenated on the feature axis ([B, H, L, 2d] each) in a
// KeyValueCache bounded by max(w1, w2) when both windows are set. Its own type so that another
// layer's cache is refused.
class SimplicialCache : public KeyValueCache {
 public:
  using KeyValueCache::KeyValueCache;
  void AppendRows(const AttentionCache& other) override;
};

class SimplicialAttention : public ProjectedAttention {
 public:
  // Throws InvalidAttentionSpec naming the field or option.
  explicit SimplicialAttention(const LoomAttentionSpecV1& spec);

  torch::Tensor forward(const torch::Tensor& x, const AttentionInputs& inputs) override;
  std::unique_ptr<AttentionCache> NewCache() const override;
  torch::Tensor ForwardCached(const torch::Tensor& x, const AttentionInputs& inputs,
                              AttentionCache& cache) override;
  double ForwardFlopsPerToken(int64_t context) const override;

  // The effective windows (0 = unbounded), the logit scale and the query chunk (0 = auto).
  int64_t window1() const { return window1_; }
  int64_t window2() const { return window2_; }
  double scale() const { return scale_; }
  int64_t query_chunk() const { return query_chunk_; }
  // options.kernel: "auto" (the fused CPU kernel where it applies, else the reference path),
  // "fused" (an error elsewhere) or "reference" (LibTorch ops, chunked over queries).
  const std::string& kernel() const { return kernel_; }

  torch::nn::Linear k2{nullptr}, v2{nullptr};  // k2_proj, v2_proj: [H·d, D]

 protected:
  // Unused: the layer has two key and two value sets (see Simplicial()).
  torch::Tensor Attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& allowed) override;

 private:
  // The attention itself. q [B, H, T, d] at sequence indices q0 .. q0 + T - 1; k, v: the two
  // sets concatenated, [B, H, L, 2d] at k0 .. k0 + L - 1; base: bool [B|1, 1, T, L] pairs allowed
  // by segments (undefined: all). Returns heads [B, H, T, d].
  torch::Tensor Simplicial(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& base, int64_t q0, int64_t k0) const;
  // One query chunk [from, from + count) of Simplicial().
  torch::Tensor Chunk(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                      const torch::Tensor& base, int64_t q0, int64_t k0, int64_t from,
                      int64_t count) const;
  // x -> q [B, H, N, d] and the concatenated k, v [B, H, N, 2d].
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> Project(const torch::Tensor& x,
                                                                  const AttentionInputs& inputs);

  // Whether forward() takes the fused CPU kernel (simplicial_cpu.h) for these queries.
  bool UsesFusedKernel(const torch::Tensor& q) const;

  int64_t window1_ = 0, window2_ = 0, query_chunk_ = 0;
  std::string kernel_ = "auto";
  double scale_ = 1.0;
  bool rope_ = false;
};

}  // namespace loom::attention

#endif  // LOOM_PLUGINS_ATTENTION_SIMPLICIAL_SIMPLICIAL_ATTENTION_H_
