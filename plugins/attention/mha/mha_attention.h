// Multi-head attention (Vaswani et al. 2017) with optional sliding window: the `mha` (global)
// and `local` plugins, and the baseline every other attention plugin is measured against.
#ifndef LOOM_PLUGINS_ATTENTION_MHA_MHA_ATTENTION_H_
#define LOOM_PLUGINS_ATTENTION_MHA_MHA_ATTENTION_H_

#include <torch/torch.h>

#include "attention_common.h"
#include "loom/attention_plugin.h"

namespace loom::attention {

class MultiHeadAttention : public ProjectedAttention {
 public:
  // Validates `spec` (throws InvalidAttentionSpec naming the field). `plugin` names the plugin
  // in errors; `local` requires window > 0, global requires window == 0.
  MultiHeadAttention(const LoomAttentionSpecV1& spec, const std::string& plugin, bool local);

  torch::Tensor forward(const torch::Tensor& x, const AttentionInputs& inputs) override;
  double ForwardFlopsPerToken(int64_t context) const override;
  torch::Tensor Attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& allowed) override;
};

}  // namespace loom::attention

#endif  // LOOM_PLUGINS_ATTENTION_MHA_MHA_ATTENTION_H_
