#include "iha_attention.h"

#include "attention_common.h"
#include "iha_fused.h"

namespace loom::attention::iha {

IhaAttention::IhaAttention(const LoomAttentionSpecV1& spec) : ProjectedAttention(spec, "iha") {
  PluginOptions opts(spec, plugin_);
  options_.p = opts.GetInt("p", spec.n_heads, 1, 256);
  const bool causal = spec.causal != 0;
  const std::string mask =
      opts.GetChoice("mask", causal ? "interleaved" : "none", {"interleaved", "block", "none"});
  if (causal && mask == "none") {
    throw InvalidAttentionSpec("iha: options.mask: 'none' lets decoder tokens see the future");
  }
  if (!causal && mask != "none") {
    throw InvalidAttentionSpec("iha: options.mask: '" + mask +
                               "' is causal; encoders (causal = 0) take 'none'");
  }
  options_.mask = ParseMask(mask);
  options_.window = spec.window;
  options_.rope_theta = spec.rope_theta;
  options_.rope_phase =
      ParseRopePhase(opts.GetChoice("rope_phase", "interleaved", {"interleaved", "token"}));
  options_.score = ParseScore(opts.GetChoice("score", "softmax", {"softmax", "linear"}));
  options_.scale = opts.GetDouble("scale", 0.0, 0.0, 1e6);
  kernel_ = opts.GetChoice("kernel", "auto", {"auto", "reference", "fused"});
  const std::string init = opts.GetChoice("init", "near_mha", {"near_mha", "identity", "random"});
  const double noise = opts.GetDouble("init_noise", 0.02, 0.0, 10.0);
  opts.Finish();

  const int64_t h = n_heads_, p = options_.p;

  // Initialisation (docs/iha.md):
  //   identity: alpha[m, h, j] = 1(m = h); R[h, h'·P + j] = 1(h' = h, j = 0).
  //   near_mha: identity + N(0, init_noise²) on every entry of alpha and R.
  //   random:   alpha ~ N(0, 1/H), R ~ N(0, 1/(H·P)).
  torch::NoGradGuard no_grad;
  torch::Tensor eye_alpha = torch::eye(h).unsqueeze(-1).repeat({1, 1, p});  // [H, H, P]
  torch::Tensor eye_r = torch::zeros({h, h, p});
  eye_r.select(2, 0).copy_(torch::eye(h));
  eye_r = eye_r.reshape({h, h * p});
  auto make_alpha = [&]() -> torch::Tensor {
    if (init == "random") return torch::randn({h, h, p}) / std::sqrt(static_cast<double>(h));
    if (init == "identity") return eye_alpha.clone();
    return eye_alpha + noise * torch::randn({h, h, p});
  };
  alpha_q = register_parameter("alpha_q", make_alpha());
  alpha_k = register_parameter("alpha_k", make_alpha());
  alpha_v = register_parameter("alpha_v", make_alpha());
  torch::Tensor r;
  if (init == "random") {
    r = torch::randn({h, h * p}) / std::sqrt(static_cast<double>(h * p));
  } else if (init == "identity") {
    r = eye_r.clone();
  } else {
    r = eye_r + noise * torch::randn({h, h * p});
  }
  collapse = register_parameter("collapse", r);
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> IhaAttention::Project(
    const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == d_model_, "iha: x must be [B, N, ", d_model_, "], got ",
              x.sizes());
  const int64_t b = x.size(0), n = x.size(1);
  auto heads = [&](const torch::Tensor& t) { return t.view({b, n, n_heads_, head_dim_}); };
  return {heads(proj_.q->forward(x)), heads(proj_.k->forward(x)), heads(proj_.v->forward(x))};
}

torch::Tensor IhaAttention::forward(const torch::Tensor& x, const AttentionInputs& inputs) {
  auto [q, k, v] = Project(x);
  torch::Tensor positions = inputs.positions;
  if (!positions.defined() && options_.rope_theta > 0) {
    TORCH_CHECK(false, "iha: positions are required when RoPE is on");
  }
  Options call = options_;
  call.segments = inputs.segments;
  torch::Tensor heads =
      UsesFusedKernel(x.size(1), x.device())
          ? FusedForward(q, k, v, alpha_q, alpha_k, alpha_v, collapse, positions, call)
          : Forward(q, k, v, alpha_q, alpha_k, alpha_v, collapse, positions, call);
  return proj_.o->forward(heads.reshape({x.size(0), x.size(1), n_heads_ * head_dim_}));
}

bool IhaAttention::UsesFusedKernel(int64_t n, const torch::Device& device) const {
  if (kernel_ != "auto") return kernel_ == "fused";
  // Below ~512 expanded positions the (N·P)² scores are small and one big GEMM wins (measured
  // in docs/benchmarks.md); CUDA tensors keep the reference path until the CUDA kernels land.
  return device.is_cpu() && n * options_.p >= 512;
}

double IhaAttention::ForwardFlopsPerToken(int64_t context) const {
  const double h = static_cast<double>(n_heads_), d = static_cast<double>(head_dim_),
               p = static_cast<double>(options_.p);
  const double projections = ProjectionFlopsPerToken();
  const double mixing = 3.0 * 2.0 * h * h * p * d;  // each pseudo q/k/v mixes H heads
  const double collapse_flops = 2.0 * h * h * p * d;
  const double keys = AverageAttendedKeys(context, options_.p, options_.mask, options_.window);
  return projections + mixing + collapse_flops + h * p * 4.0 * d * keys;
}

}  // namespace loom::attention::iha
