#include "plugins/attention/diff/diff_attention.h"

#include <cmath>

#include "plugins/attention/common/attention_common.h"

namespace loom::attention {

double DiffLambdaInit(int64_t layer_index) {
  return 0.8 - 0.6 * std::exp(-0.3 * static_cast<double>(layer_index));
}

DiffAttention::DiffAttention(const LoomAttentionSpecV1& spec) : ProjectedAttention(spec, "diff") {
  if (spec.n_heads % 2 != 0) {
    throw InvalidAttentionSpec(
        "diff: n_heads: must be even (H/2 differential heads of 2 maps each)");
  }
  PluginOptions opts(spec, plugin_);
  lambda_init_ = opts.GetDouble("lambda_init", DiffLambdaInit(spec.layer_index), -10.0, 10.0);
  const double lambda_std = opts.GetDouble("lambda_std", 0.1, 0.0, 10.0);
  opts.Finish();
  lambda_q1 = register_parameter("lambda_q1", torch::randn({head_dim_}) * lambda_std);
  lambda_k1 = register_parameter("lambda_k1", torch::randn({head_dim_}) * lambda_std);
  lambda_q2 = register_parameter("lambda_q2", torch::randn({head_dim_}) * lambda_std);
  lambda_k2 = register_parameter("lambda_k2", torch::randn({head_dim_}) * lambda_std);
  // A child module so the weight is named `subln.weight`, as in the reference code.
  auto subln = register_module("subln", std::make_shared<torch::nn::Module>());
  subln_weight = subln->register_parameter("weight", torch::ones({2 * head_dim_}));
}

torch::Tensor DiffAttention::Lambda() const {
  return torch::exp((lambda_q1 * lambda_k1).sum()) - torch::exp((lambda_q2 * lambda_k2).sum()) +
         lambda_init_;
}

torch::Tensor DiffAttention::forward(const torch::Tensor& x, const AttentionInputs& inputs) {
  const int64_t b = x.size(0), n = x.size(1), pairs = n_heads_ / 2;
  // q, k: [B, H, N, d] with heads (2i, 2i+1) the two maps of differential head i; v: H/2 heads of
  // width 2d.
  auto [q, k, v] = QueriesKeysValues(x, inputs, pairs);
  torch::Tensor allowed;
  if (causal_ || window_ > 0) allowed = AllowedMask(n, causal_, window_, x.device());
  allowed = WithSegments(allowed, inputs.segments, b, n, 1, x.device());
  return Output(Attend(q, k, v, allowed));
}

torch::Tensor DiffAttention::Attend(const torch::Tensor& q, const torch::Tensor& k,
                                    const torch::Tensor& v, const torch::Tensor& allowed) {
  const int64_t b = q.size(0), t = q.size(2), l = k.size(2), pairs = n_heads_ / 2;
  torch::Tensor scores =
      torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(head_dim_));
  if (allowed.defined()) {
    scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  }
  torch::Tensor maps = torch::softmax(scores, -1).view({b, pairs, 2, t, l});
  torch::Tensor attn = maps.select(2, 0) - Lambda().to(maps.dtype()) * maps.select(2, 1);
  torch::Tensor heads = torch::matmul(attn, v);  // [B, H/2, N, 2d]
  heads = heads * torch::rsqrt(heads.pow(2).mean(-1, true) + 1e-5) * subln_weight.to(heads.dtype());
  return heads * (1.0 - lambda_init_);
}

double DiffAttention::ForwardFlopsPerToken(int64_t context) const {
  const double h = static_cast<double>(n_heads_), d = static_cast<double>(head_dim_);
  const double keys = AverageAttendedKeys(context, causal_, window_);
  // H score maps of width d, H/2 value products of width 2d, and the map difference.
  return ProjectionFlopsPerToken() + 2.0 * h * d * keys + 2.0 * (h / 2) * 2 * d * keys +
         2.0 * (h / 2) * keys;
}

}  // namespace loom::attention
