// Multi-head attention (Vaswani et al. 2017) with optional sliding window: the `mha` (global)
// and `local` plugins, and the baseline every other attention plugin is measured against.
//
// Option kernel (parity with iha): auto | reference | fused | stock. fused = the shared flash
// kernel the IHA plugin uses, at P = 1 without mixing (kernels/fused_attention.h:
// FusedHeadAttention; CPU only);
// reference = the materialising softmax(q kᵀ) v (ReferenceAttention), what fused is tested
// against; stock = at::scaled_dot_product_attention (LibTorch 2.x only); auto = fused for CPU
// tensors, stock for others where LibTorch has it, else reference.
#ifndef LOOM_PLUGINS_ATTENTION_MHA_MHA_ATTENTION_H_
#define LOOM_PLUGINS_ATTENTION_MHA_MHA_ATTENTION_H_

#include <torch/torch.h>

#include "loom/attention_plugin.h"
#include "plugins/attention/common/attention_common.h"

namespace loom::attention {

class MultiHeadAttention : public ProjectedAttention {
 public:
  // Validates `spec` (throws InvalidAttentionSpec naming the field). `plugin` names the plugin
  // in errors; `local` requires window > 0, global requires window == 0.
  MultiHeadAttention(const LoomAttentionSpecV1& spec, const std::string& plugin, bool local);

  torch::Tensor forward(const torch::Tensor& x, const AttentionInputs& inputs) override;
  double ForwardFlopsPerToken(int64_t context) const override;
  // The kernel forward() takes for tensors on `device`: "fused", "reference" or "stock".
  std::string KernelFor(const torch::Device& device) const;
  torch::Tensor Attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& allowed) override;

 private:
  torch::Tensor Stock(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                      const AttentionInputs& inputs);
  torch::Tensor Reference(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const AttentionInputs& inputs);

  std::string kernel_ = "auto";
};

}  // namespace loom::attention

#endif  // LOOM_PLUGINS_ATTENTION_MHA_MHA_ATTENTION_H_
