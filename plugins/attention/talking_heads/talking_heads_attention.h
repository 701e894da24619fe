// Talking-Heads Attention (Shazeer, Lan, Cheng, Ding, Hou 2020, arXiv:2003.02436): multi-head
// attention whose H per-head logit maps are mixed across heads by a learned [H, H] matrix
// before the softmax, and whose H probability maps are mixed again by a second [H, H] matrix
// after it:
//   J[h]  = q_h k_hᵀ / sqrt(d)                       (logits, per head)
//   J'[h] = sum_m logit_mix[m, h] · J[m]              (before softmax)
//   W[h]  = softmax(J'[h] over allowed keys)
//   W'[h] = sum_m weight_mix[m, h] · W[m]             (after softmax)
//   O[h]  = W'[h] v_h,   y = concat_h O[h] · W_Oᵀ
// The paper allows different head counts for keys, logits and values; Loom keeps all H.
// Options: init = identity (default: starts as MHA) | random (N(0, 1/H) per entry).
#ifndef LOOM_PLUGINS_ATTENTION_TALKING_HEADS_TALKING_HEADS_ATTENTION_H_
#define LOOM_PLUGINS_ATTENTION_TALKING_HEADS_TALKING_HEADS_ATTENTION_H_

#include <torch/torch.h>

#include "loom/attention_plugin.h"
#include "plugins/attention/common/attention_common.h"

namespace loom::attention {

class TalkingHeadsAttention : public ProjectedAttention {
 public:
  explicit TalkingHeadsAttention(const LoomAttentionSpecV1& spec);
  torch::Tensor forward(const torch::Tensor& x, const AttentionInputs& inputs) override;
  double ForwardFlopsPerToken(int64_t context) const override;
  torch::Tensor Attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& allowed) override;

  torch::Tensor logit_mix, weight_mix;  // [H, H], indexed [source head m, target head h]
};

}  // namespace loom::attention

#endif  // LOOM_PLUGINS_ATTENTION_TALKING_HEADS_TALKING_HEADS_ATTENTION_H_
