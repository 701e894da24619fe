#include "mha_attention.h"

#include <cmath>

#include "attention_common.h"

namespace loom::attention {

MultiHeadAttention::MultiHeadAttention(const LoomAttentionSpecV1& spec, const std::string& plugin,
                                       bool local) {
  ValidateSpec(spec, plugin);
  if (local && spec.window <= 0) throw InvalidAttentionSpec(plugin + ": window: must be > 0");
  if (!local && spec.window != 0) {
    throw InvalidAttentionSpec(plugin + ": window: global attention takes no window (use 'local')");
  }
  PluginOptions options(spec, plugin);  // mha and local take no plugin options
  options.Finish();

  d_model_ = spec.d_model;
  n_heads_ = spec.n_heads;
  head_dim_ = spec.head_dim;
  window_ = spec.window;
  causal_ = spec.causal != 0;
  rope_theta_ = spec.rope_theta;
  proj_ = RegisterProjections(*this, spec);
}

torch::Tensor MultiHeadAttention::forward(const torch::Tensor& x, const AttentionInputs& inputs) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == d_model_, "mha: x must be [B, N, ", d_model_, "], got ",
              x.sizes());
  const int64_t batch = x.size(0), length = x.size(1);
  auto heads = [&](const torch::Tensor& t) {
    return t.view({batch, length, n_heads_, head_dim_}).transpose(1, 2);  // [B, H, N, d]
  };
  torch::Tensor q = heads(proj_.q->forward(x));
  torch::Tensor k = heads(proj_.k->forward(x));
  torch::Tensor v = heads(proj_.v->forward(x));
  if (rope_theta_ > 0) {
    torch::Tensor pos = CheckedPositions(inputs.positions, batch, length, x.device());
    q = ApplyRope(q, pos, rope_theta_);
    k = ApplyRope(k, pos, rope_theta_);
  }
  torch::Tensor out;
#if LOOM_TORCH_HAS_SDPA
  // LibTorch 2.x: fused kernels (Flash / memory-efficient) where the backend has them.
  if (window_ == 0) {
    out = at::scaled_dot_product_attention(q, k, v, {}, 0.0, causal_);
  } else {
    out = at::scaled_dot_product_attention(
        q, k, v, AllowedMask(length, causal_, window_, x.device()), 0.0, false);
  }
#else
  torch::Tensor allowed;
  if (causal_ || window_ > 0) allowed = AllowedMask(length, causal_, window_, x.device());
  out = ReferenceAttention(q, k, v, allowed, 1.0 / std::sqrt(static_cast<double>(head_dim_)));
#endif
  out = out.transpose(1, 2).reshape({batch, length, n_heads_ * head_dim_});
  return proj_.o->forward(out);
}

double MultiHeadAttention::ForwardFlopsPerToken(int64_t context) const {
  const double inner = static_cast<double>(n_heads_ * head_dim_);
  const double projections = 2.0 * 4.0 * static_cast<double>(d_model_) * inner;
  const double keys = AverageAttendedKeys(context, causal_, window_);
  return projections + 4.0 * inner * keys;  // q·k and p·v per attended key
}

}  // namespace loom::attention
