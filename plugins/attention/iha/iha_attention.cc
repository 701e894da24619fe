#include "plugins/attention/iha/iha_attention.h"

#include <atomic>
#include <iostream>
#include <limits>

#include "cpu_kernels/linear_cpu.h"
#include "plugins/attention/common/attention_common.h"
#include "plugins/attention/iha/cuda/iha_cuda.h"
#include "plugins/attention/kernels/rope.h"

namespace loom::attention::iha {

using cpu_kernels::Linear;

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
  kernel_ = opts.GetChoice("kernel", "auto", {"auto", "reference", "fused", "cuda", "stock"});
  cache_heads_ = opts.GetChoice("kv_cache", "pseudo", {"pseudo", "heads"}) == "heads";
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
  return {heads(Linear(proj_.q, x)), heads(Linear(proj_.k, x)), heads(Linear(proj_.v, x))};
}

torch::Tensor IhaAttention::forward(const torch::Tensor& x, const AttentionInputs& inputs) {
  auto [q, k, v] = Project(x);
  torch::Tensor positions = inputs.positions;
  if (!positions.defined() && options_.rope_theta > 0) {
    TORCH_CHECK(false, "iha: positions are required when RoPE is on");
  }
  Options call = options_;
  call.segments = inputs.segments;
  const std::string accelerated = AcceleratedKernel(q, k, v, call);
  torch::Tensor heads;
  if (accelerated == "cuda") {
    heads =
        Collapse(CudaPseudoOutputs(q, k, v, alpha_q, alpha_k, alpha_v, positions, call), collapse);
  } else if (accelerated == "stock") {
    heads = Collapse(StockSdpaPseudoOutputs(q, k, v, alpha_q, alpha_k, alpha_v, positions, call),
                     collapse);
  } else if (UsesFusedKernel(x.device())) {
    heads = FusedForward(q, k, v, alpha_q, alpha_k, alpha_v, collapse, positions, call);
  } else {
    heads = Forward(q, k, v, alpha_q, alpha_k, alpha_v, collapse, positions, call);
  }
  return Linear(proj_.o, heads.reshape({x.size(0), x.size(1), n_heads_ * head_dim_}));
}

int64_t IhaCache::bytes() const { return DefinedBytes({&keys, &values, &positions, &segments}); }

void IhaCache::KeepRows(const torch::Tensor& rows) {
  if (rows.numel() == 0) {
    *this = IhaCache();
    return;
  }
  KeepCacheRows({&keys, &values, &positions, &segments}, rows);
  const int64_t drop = LeadingPadTokens(segments);
  if (drop == 0) return;
  const int64_t kept = segments.size(1) - drop, per_token = heads_layout ? 1 : p;
  keys = keys.narrow(heads_layout ? 1 : 2, drop * per_token, kept * per_token);
  values = values.narrow(heads_layout ? 1 : 2, drop * per_token, kept * per_token);
  if (positions.defined()) positions = positions.narrow(1, drop, kept);
  segments = segments.narrow(1, drop, kept);
  tokens_ -= drop;
}

void IhaCache::AppendRows(const AttentionCache& base) {
  const auto* other = dynamic_cast<const IhaCache*>(&base);
  TORCH_CHECK(other != nullptr, "iha cache: AppendRows needs a cache made by an IHA layer");
  if (other->tokens_ == 0) return;
  if (tokens_ == 0) {
    *this = *other;
    return;
  }
  TORCH_CHECK(other->heads_layout == heads_layout && other->p == p,
              "iha cache: AppendRows needs a cache made by the same layer");
  // pseudo: [B, H, L·P, d]; heads: [B, L, H, d] and positions [B, L].
  const int64_t dim = heads_layout ? 1 : 2, per_token = heads_layout ? 1 : p;
  AppendCacheRows({{&keys, other->keys, dim, per_token},
                   {&values, other->values, dim, per_token},
                   {&positions, other->positions, 1, 1}},
                  segments, other->segments, keys.size(dim) / per_token,
                  other->keys.size(dim) / per_token);
  tokens_ = std::max(tokens_, other->tokens_);
}

std::unique_ptr<AttentionCache> IhaAttention::NewCache() const {
  return std::make_unique<IhaCache>();
}

torch::Tensor IhaAttention::ForwardCached(const torch::Tensor& x, const AttentionInputs& inputs,
                                          AttentionCache& base) {
  TORCH_CHECK(causal_, "iha: incremental decoding needs a causal (decoder) layer");
  auto* cache = dynamic_cast<IhaCache*>(&base);
  TORCH_CHECK(cache != nullptr, "iha: the cache was not made by this layer's NewCache()");
  auto [q, k, v] = Project(x);  // [B, T, H, d]
  const int64_t b = x.size(0), t = x.size(1), p = options_.p, start = cache->tokens_;
  const bool rope = options_.rope_theta > 0;
  torch::Tensor pos;
  if (rope) pos = CheckedPositions(inputs.positions, b, t, x.device()).expand({b, t});
  torch::Tensor seg = CheckedSegments(inputs.segments, b, t, x.device());
  if (start > 0) {
    CheckCacheContinues("iha cache", cache->keys.size(0), cache->segments.defined(), b,
                        seg.defined());
  }
  auto cat = [&](const torch::Tensor& old, const torch::Tensor& now, int64_t dim) {
    return start > 0 && old.defined() ? torch::cat({old, now}, dim) : now;
  };
  torch::Tensor qi =
      kernels::RotatePseudoTokens(MixAndInterleave(q, alpha_q), pos, options_);  // [B, H, T·P, d]
  torch::Tensor keys, values, all_pos;  // as stored after this call
  torch::Tensor ki, vi;                 // pseudo keys / values attended
  if (cache_heads_) {
    keys = cat(cache->keys, k, 1);
    values = cat(cache->values, v, 1);
    if (rope) all_pos = cat(cache->positions, pos, 1);
    ki = kernels::RotatePseudoTokens(MixAndInterleave(keys, alpha_k), all_pos, options_);
    vi = MixAndInterleave(values, alpha_v);
  } else {
    keys = ki = cat(cache->keys,
                    kernels::RotatePseudoTokens(MixAndInterleave(k, alpha_k), pos, options_), 2);
    values = vi = cat(cache->values, MixAndInterleave(v, alpha_v), 2);
  }
  torch::Tensor all_seg = seg.defined() ? cat(cache->segments, seg, 1) : seg;
  const int64_t length = ki.size(2) / p, first = start + t - length;  // tokens attended
  auto i64 = torch::TensorOptions().dtype(torch::kInt64).device(x.device());
  torch::Tensor allowed = AllowedBetween(torch::arange(start * p, (start + t) * p, i64),
                                         torch::arange(first * p, (first + length) * p, i64), p,
                                         options_.mask, options_.window)
                              .view({1, 1, t * p, length * p});
  if (seg.defined()) {
    allowed = allowed & SameSegment(seg.repeat_interleave(p, 1), all_seg.repeat_interleave(p, 1));
  }
  const double scale =
      options_.scale > 0 ? options_.scale : 1.0 / std::sqrt(static_cast<double>(head_dim_));
  torch::Tensor scores = torch::matmul(qi, ki.transpose(-2, -1)) * scale;
  torch::Tensor weights =
      options_.score == Score::kLinear
          ? scores * allowed.to(scores.dtype())
          : torch::softmax(
                scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity()),
                -1);
  torch::Tensor pseudo = torch::matmul(weights, vi)
                             .view({b, n_heads_, t, p, head_dim_})
                             .permute({0, 2, 1, 3, 4});  // [B, T, H, P, d]
  torch::Tensor heads = Collapse(pseudo, collapse);
  // Keep what later queries can still see: all tokens, or the last `window` of them.
  const int64_t keep = options_.window > 0 ? std::min(length, options_.window) : length;
  auto tail = [&](const torch::Tensor& tensor, int64_t dim, int64_t per_token) {
    if (!tensor.defined() || keep == length) return tensor;
    return tensor.narrow(dim, (length - keep) * per_token, keep * per_token).clone();
  };
  const int64_t token_dim = cache_heads_ ? 1 : 2, per_token = cache_heads_ ? 1 : p;
  cache->keys = tail(keys, token_dim, per_token);
  cache->values = tail(values, token_dim, per_token);
  cache->positions = tail(all_pos, 1, 1);
  cache->segments = tail(all_seg, 1, 1);
  cache->tokens_ += t;
  cache->heads_layout = cache_heads_;
  cache->p = p;
  return Linear(proj_.o, heads.reshape({b, t, n_heads_ * head_dim_}));
}

bool IhaAttention::UsesFusedKernel(const torch::Device& device) const {
  if (kernel_ != "auto") return kernel_ == "fused";
  // On the CPU the fused kernel wins at every measured N·P, from 32 to 16384, encoders with
  // d = 8 included (docs/benchmarks.md). CUDA tensors take the CUDA kernels (AcceleratedKernel)
  // or, where those cannot run, the reference path.
  return device.is_cpu();
}

std::string IhaAttention::AcceleratedKernel(const torch::Tensor& q, const torch::Tensor& k,
                                            const torch::Tensor& v, const Options& call) const {
  if (kernel_ == "cuda" || kernel_ == "stock") {
    const std::string reason = kernel_ == "cuda" ? CudaKernelUnsupportedReason(q, k, v, call)
                                                 : StockSdpaUnsupportedReason(q, call);
    if (!reason.empty()) {
      throw InvalidAttentionSpec("iha: options.kernel: '" + kernel_ + "' cannot run: " + reason);
    }
    return kernel_;
  }
  if (kernel_ != "auto" || !q.is_cuda()) return {};
  // Until a lent GPU has validated Loom's own CUDA kernels (scripts/gpu-check), auto takes the
  // paper's route on CUDA: PyTorch's SDPA on the expanded sequence; kernel: cuda asks for ours.
  const std::string reason = StockSdpaUnsupportedReason(q, call);
  static std::atomic<bool> logged{false};
  if (!logged.exchange(true)) {
    std::cerr << "iha: kernel auto on CUDA: "
              << (reason.empty() ? "SDPA on the expanded sequence (stock)"
                                 : "the reference path (stock SDPA cannot run: " + reason + ")")
              << "\n";
  }
  return reason.empty() ? "stock" : "";
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
