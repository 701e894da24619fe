#include "plugins/attention/talking_heads/talking_heads_attention.h"

#include <cmath>
#include <limits>

#include "plugins/attention/common/attention_common.h"

namespace loom::attention {

TalkingHeadsAttention::TalkingHeadsAttention(const LoomAttentionSpecV1& spec)
    : ProjectedAttention(spec, "talking_heads") {
  PluginOptions opts(spec, plugin_);
  const std::string init = opts.GetChoice("init", "identity", {"identity", "random"});
  opts.Finish();
  auto make = [&]() -> torch::Tensor {
    if (init == "random") {
      return torch::randn({n_heads_, n_heads_}) / std::sqrt(static_cast<double>(n_heads_));
    }
    return torch::eye(n_heads_);
  };
  logit_mix = register_parameter("logit_mix", make());
  weight_mix = register_parameter("weight_mix", make());
}

torch::Tensor TalkingHeadsAttention::forward(const torch::Tensor& x,
                                             const AttentionInputs& inputs) {
  auto [q, k, v] = QueriesKeysValues(x, inputs, n_heads_);
  torch::Tensor allowed;
  if (causal_ || window_ > 0) allowed = AllowedMask(x.size(1), causal_, window_, x.device());
  allowed = WithSegments(allowed, inputs.segments, x.size(0), x.size(1), 1, x.device());
  return Output(Attend(q, k, v, allowed));
}

torch::Tensor TalkingHeadsAttention::Attend(const torch::Tensor& q, const torch::Tensor& k,
                                            const torch::Tensor& v, const torch::Tensor& allowed) {
  torch::Tensor logits =
      torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim_));
  logits = torch::einsum("bmqk,mh->bhqk", {logits, logit_mix.to(logits.dtype())});
  if (allowed.defined()) {
    // Masked after mixing: mixing -inf logits would produce NaN.
    logits = logits.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  }
  torch::Tensor weights =
      torch::einsum("bmqk,mh->bhqk", {torch::softmax(logits, -1), weight_mix.to(logits.dtype())});
  return torch::matmul(weights, v);
}

double TalkingHeadsAttention::ForwardFlopsPerToken(int64_t context) const {
  const double h = static_cast<double>(n_heads_), d = static_cast<double>(head_dim_);
  const double keys = AverageAttendedKeys(context, causal_, window_);
  return ProjectionFlopsPerToken() + 4.0 * h * d * keys +
         2.0 * 2.0 * h * h * keys;  // two H×H mixes per (query, key) pair
}

}  // namespace loom::attention
