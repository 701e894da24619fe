// The `iha` attention plugin's module: MHA projections around the IHA core (iha_core.h), with
// the mixing tensors alpha_q, alpha_k, alpha_v [H, H, P] and the collapse R [H, H·P] as
// parameters. Global IHA has window 0; local IHA is the same plugin with window > 0.
//
// Options (docs/iha.md): p (default H), mask (interleaved | block for decoders, default
// interleaved; none for encoders), rope_phase (interleaved | token), init (near_mha | identity |
// random), init_noise (default 0.02), score (softmax | linear), scale (default 1/sqrt(d)),
// kernel (auto | reference | fused | cuda | stock; auto = the CUDA kernels, cuda/iha_cuda.h,
// for CUDA tensors they support, the fused kernel, kernels/fused_attention.h, for CPU tensors
// (faster at every measured N·P), and the reference path otherwise; stock =
// at::scaled_dot_product_attention on the expanded sequence, a baseline), kv_cache (pseudo | heads:
// what incremental decoding caches, see IhaCache).
#ifndef LOOM_PLUGINS_ATTENTION_IHA_IHA_ATTENTION_H_
#define LOOM_PLUGINS_ATTENTION_IHA_IHA_ATTENTION_H_

#include <torch/torch.h>

#include "loom/attention_plugin.h"
#include "plugins/attention/common/attention_common.h"
#include "plugins/attention/iha/iha_core.h"

namespace loom::attention::iha {

// The KV cache of incremental decoding, in one of two layouts (option kv_cache):
//   pseudo (default): the mixed, rotated pseudo-keys and mixed pseudo-values, [B, H, L·P, d]
//     each: P times an MHA cache; a step mixes only its new tokens.
//   heads: the H heads' keys and values as projected, [B, L, H, d] each (an MHA cache) plus
//     their positions; every step re-mixes and re-rotates all L cached tokens (about H/P times
//     the step's attention FLOPs more work). docs/benchmarks.md measures both.
// Sliding-window layers keep only the last `window` tokens.
class IhaCache : public AttentionCache {
 public:
  int64_t tokens() const override { return tokens_; }
  int64_t bytes() const override;
  void KeepRows(const torch::Tensor& rows) override;
  void AppendRows(const AttentionCache& other) override;

 private:
  friend class IhaAttention;
  bool heads_layout = false;  // set by the layer on its first ForwardCached call
  int64_t p = 1;
  int64_t tokens_ = 0;
  torch::Tensor keys, values;  // pseudo: [B, H, L·P, d]; heads: [B, L, H, d]
  torch::Tensor positions;     // heads: int64 [B, L]
  torch::Tensor segments;      // int64 [B, L] or undefined
};

class IhaAttention : public ProjectedAttention {
 public:
  explicit IhaAttention(const LoomAttentionSpecV1& spec);

  torch::Tensor forward(const torch::Tensor& x, const AttentionInputs& inputs) override;
  std::unique_ptr<AttentionCache> NewCache() const override;
  torch::Tensor ForwardCached(const torch::Tensor& x, const AttentionInputs& inputs,
                              AttentionCache& cache) override;
  double ForwardFlopsPerToken(int64_t context) const override;

  const Options& options() const { return options_; }
  // Not used: IHA overrides ForwardCached (its attention runs on pseudo-tokens).
  torch::Tensor Attend(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&,
                       const torch::Tensor&) override {
    TORCH_CHECK(false, "iha: Attend is not used");
  }
  // Whether forward() takes the fused CPU kernel for tensors on `device`.
  bool UsesFusedKernel(const torch::Device& device) const;
  // "cuda" or "stock" when forward() takes that kernel for these inputs, else empty (then
  // UsesFusedKernel decides). A forced kernel that cannot run throws InvalidAttentionSpec with
  // the reason; auto on CUDA tensors the kernels cannot take logs the reason once.
  std::string AcceleratedKernel(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const Options& call) const;
  // Per-head q, k, v [B, N, H, d] for x (what the core receives).
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> Project(const torch::Tensor& x);

  torch::Tensor alpha_q, alpha_k, alpha_v, collapse;

 private:
  Options options_;
  std::string kernel_ = "auto";
  bool cache_heads_ = false;  // kv_cache: heads
};

}  // namespace loom::attention::iha

#endif  // LOOM_PLUGINS_ATTENTION_IHA_IHA_ATTENTION_H_
