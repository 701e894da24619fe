#include "mha_attention.h"

#include <cmath>

#include "attention_common.h"

namespace loom::attention {

MultiHeadAttention::MultiHeadAttention(const LoomAttentionSpecV1& spec, const std::string& plugin,
                                       bool local)
    : ProjectedAttention(spec, plugin) {
  if (local && spec.window <= 0) throw InvalidAttentionSpec(plugin + ": window: must be > 0");
  if (!local && spec.window != 0) {
    throw InvalidAttentionSpec(plugin + ": window: global attention takes no window (use 'local')");
  }
  PluginOptions options(spec, plugin);  // mha and local take no plugin options
  options.Finish();
}

torch::Tensor MultiHeadAttention::forward(const torch::Tensor& x, const AttentionInputs& inputs) {
  auto [q, k, v] = QueriesKeysValues(x, inputs, n_heads_);
  const int64_t length = x.size(1);
  torch::Tensor out;
#if LOOM_TORCH_HAS_SDPA
  // LibTorch 2.x: fused kernels (Flash / memory-efficient) where the backend has them.
  if (inputs.segments.defined()) {
    torch::Tensor allowed = (causal_ || window_ > 0)
                                ? AllowedMask(length, causal_, window_, x.device())
                                : torch::Tensor();
    out = at::scaled_dot_product_attention(
        q, k, v, WithSegments(allowed, inputs.segments, x.size(0), length, 1, x.device()), 0.0,
        false);
  } else if (window_ == 0) {
    out = at::scaled_dot_product_attention(q, k, v, {}, 0.0, causal_);
  } else {
    out = at::scaled_dot_product_attention(
        q, k, v, AllowedMask(length, causal_, window_, x.device()), 0.0, false);
  }
#else
  torch::Tensor allowed;
  if (causal_ || window_ > 0) allowed = AllowedMask(length, causal_, window_, x.device());
  allowed = WithSegments(allowed, inputs.segments, x.size(0), length, 1, x.device());
  out = ReferenceAttention(q, k, v, allowed, 1.0 / std::sqrt(static_cast<double>(head_dim_)));
#endif
  return Output(out);
}

torch::Tensor MultiHeadAttention::Attend(const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, const torch::Tensor& allowed) {
#if LOOM_TORCH_HAS_SDPA
  return at::scaled_dot_product_attention(q, k, v, allowed, 0.0, false);
#else
  return ReferenceAttention(q, k, v, allowed, 1.0 / std::sqrt(static_cast<double>(head_dim_)));
#endif
}

double MultiHeadAttention::ForwardFlopsPerToken(int64_t context) const {
  const double keys = AverageAttendedKeys(context, causal_, window_);
  return ProjectionFlopsPerToken() +
         4.0 * static_cast<double>(n_heads_ * head_dim_) * keys;  // q·k, p·v
}

}  // namespace loom::attention
