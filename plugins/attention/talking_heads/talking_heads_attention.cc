#include "talking_heads_attention.h"

#include <cmath>
#include <limits>

#include "attention_common.h"

namespace loom::attention {

TalkingHeadsAttention::TalkingHeadsAttention(const LoomAttentionSpecV1& spec) {
  const std::string plugin = "talking_heads";
  ValidateSpec(spec, plugin);
  PluginOptions opts(spec, plugin);
  const std::string init = opts.GetChoice("init", "identity", {"identity", "random"});
  opts.Finish();
  d_model_ = spec.d_model;
  n_heads_ = spec.n_heads;
  head_dim_ = spec.head_dim;
  window_ = spec.window;
  causal_ = spec.causal != 0;
  rope_theta_ = spec.rope_theta;
  proj_ = RegisterProjections(*this, spec);
  auto make = [&]() -> torch::Tensor {
    if (init == "random")
      return torch::randn({n_heads_, n_heads_}) / std::sqrt(static_cast<double>(n_heads_));
    return torch::eye(n_heads_);
  };
  logit_mix = register_parameter("logit_mix", make());
  weight_mix = register_parameter("weight_mix", make());
}

torch::Tensor TalkingHeadsAttention::forward(const torch::Tensor& x,
                                             const AttentionInputs& inputs) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == d_model_, "talking_heads: x must be [B, N, ", d_model_,
              "], got ", x.sizes());
  const int64_t b = x.size(0), n = x.size(1);
  auto heads = [&](const torch::Tensor& t) {
    return t.view({b, n, n_heads_, head_dim_}).transpose(1, 2);  // [B, H, N, d]
  };
  torch::Tensor q = heads(proj_.q->forward(x)), k = heads(proj_.k->forward(x)),
                v = heads(proj_.v->forward(x));
  if (rope_theta_ > 0) {
    torch::Tensor pos = CheckedPositions(inputs.positions, b, n, x.device());
    q = ApplyRope(q, pos, rope_theta_);
    k = ApplyRope(k, pos, rope_theta_);
  }
  torch::Tensor logits =
      torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim_));
  logits = torch::einsum("bmqk,mh->bhqk", {logits, logit_mix.to(logits.dtype())});
  if (causal_ || window_ > 0) {
    // Masked after mixing: mixing -inf logits would produce NaN.
    torch::Tensor allowed = AllowedMask(n, causal_, window_, x.device());
    logits = logits.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  }
  torch::Tensor weights =
      torch::einsum("bmqk,mh->bhqk", {torch::softmax(logits, -1), weight_mix.to(logits.dtype())});
  torch::Tensor out =
      torch::matmul(weights, v).transpose(1, 2).reshape({b, n, n_heads_ * head_dim_});
  return proj_.o->forward(out);
}

double TalkingHeadsAttention::ForwardFlopsPerToken(int64_t context) const {
  const double h = static_cast<double>(n_heads_), d = static_cast<double>(head_dim_);
  const double keys = AverageAttendedKeys(context, causal_, window_);
  return 2.0 * 4.0 * static_cast<double>(d_model_) * h * d + 4.0 * h * d * keys +
         2.0 * 2.0 * h * h * keys;  // two H×H mixes per (query, key) pair
}

}  // namespace loom::attention
