// The `iha` attention plugin's module: MHA projections around the IHA core (iha_core.h), with
// the mixing tensors alpha_q, alpha_k, alpha_v [H, H, P] and the collapse R [H, H·P] as
// parameters. Global IHA has window 0; local IHA is the same plugin with window > 0.
//
// Options (docs/iha.md): p (default H), mask (interleaved | block for decoders, default
// interleaved; none for encoders), rope_phase (interleaved | token), init (near_mha | identity |
// random), init_noise (default 0.02), score (softmax | linear), scale (default 1/sqrt(d)),
// kernel (auto | reference | fused; auto = the fused kernel, iha_fused.h, for CPU tensors when
// the expanded sequence N·P reaches 512, where it is faster, and the reference path otherwise).
#ifndef LOOM_PLUGINS_ATTENTION_IHA_IHA_ATTENTION_H_
#define LOOM_PLUGINS_ATTENTION_IHA_IHA_ATTENTION_H_

#include <torch/torch.h>

#include "attention_common.h"
#include "iha_core.h"
#include "loom/attention_plugin.h"

namespace loom::attention::iha {

class IhaAttention : public ProjectedAttention {
 public:
  explicit IhaAttention(const LoomAttentionSpecV1& spec);

  torch::Tensor forward(const torch::Tensor& x, const AttentionInputs& inputs) override;
  double ForwardFlopsPerToken(int64_t context) const override;

  const Options& options() const { return options_; }
  // Which path forward() takes for a sequence of n tokens on `device`.
  bool UsesFusedKernel(int64_t n, const torch::Device& device) const;
  // Per-head q, k, v [B, N, H, d] for x (what the core receives).
  std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> Project(const torch::Tensor& x);

  torch::Tensor alpha_q, alpha_k, alpha_v, collapse;

 private:
  Options options_;
  std::string kernel_ = "auto";
};

}  // namespace loom::attention::iha

#endif  // LOOM_PLUGINS_ATTENTION_IHA_IHA_ATTENTION_H_
