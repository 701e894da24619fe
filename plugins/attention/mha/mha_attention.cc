#include "plugins/attention/mha/mha_attention.h"

#include <cmath>

#include "plugins/attention/common/attention_common.h"
#include "plugins/attention/kernels/fused_attention.h"

namespace loom::attention {

MultiHeadAttention::MultiHeadAttention(const LoomAttentionSpecV1& spec, const std::string& plugin,
                                       bool local)
    : ProjectedAttention(spec, plugin) {
  if (local && spec.window <= 0) throw InvalidAttentionSpec(plugin + ": window: must be > 0");
  if (!local && spec.window != 0) {
    throw InvalidAttentionSpec(plugin + ": window: global attention takes no window (use 'local')");
  }
  PluginOptions options(spec, plugin);
  kernel_ = options.GetChoice("kernel", "auto", {"auto", "reference", "fused", "stock"});
  options.Finish();
#if !LOOM_TORCH_HAS_SDPA
  if (kernel_ == "stock") {
    throw InvalidAttentionSpec(plugin +
                               ": options.kernel: 'stock' needs LibTorch 2.x "
                               "(scaled_dot_product_attention); this build has " +
                               std::string(TORCH_VERSION));
  }
#endif
}

std::string MultiHeadAttention::KernelFor(const torch::Device& device) const {
  if (kernel_ != "auto") return kernel_;
  if (device.is_cpu()) return "fused";
  return LOOM_TORCH_HAS_SDPA ? "stock" : "reference";
}

torch::Tensor MultiHeadAttention::forward(const torch::Tensor& x, const AttentionInputs& inputs) {
  const std::string kernel = KernelFor(x.device());
  // The fused kernel rotates q and k itself, tile by tile as it loads them.
  auto [q, k, v] = QueriesKeysValues(x, inputs, n_heads_, /*rotate=*/kernel != "fused");
  if (kernel == "stock") return Output(Stock(q, k, v, inputs));
  if (kernel == "reference") return Output(Reference(q, k, v, inputs));
  TORCH_CHECK(x.is_cpu(), plugin_, ": options.kernel: 'fused' runs on CPU tensors only");
  kernels::Options o;  // P = 1 and no mixing: the flash kernel as multi-head attention
  o.mask = causal_ ? kernels::Mask::kInterleaved : kernels::Mask::kNone;
  o.window = window_;
  o.segments = inputs.segments;
  o.rope_theta = rope_theta_;
  // [B, H, N, d] -> [B, N, H, d] views; the kernel reads them in place.
  torch::Tensor heads = kernels::FusedHeadAttention(q.transpose(1, 2), k.transpose(1, 2),
                                                    v.transpose(1, 2), inputs.positions, o);
  return Output(heads.transpose(1, 2));
}

torch::Tensor MultiHeadAttention::Reference(const torch::Tensor& q, const torch::Tensor& k,
                                            const torch::Tensor& v, const AttentionInputs& inputs) {
  const int64_t length = q.size(2);
  torch::Tensor allowed;
  if (causal_ || window_ > 0) allowed = AllowedMask(length, causal_, window_, q.device());
  allowed = WithSegments(allowed, inputs.segments, q.size(0), length, 1, q.device());
  return ReferenceAttention(q, k, v, allowed, 1.0 / std::sqrt(static_cast<double>(head_dim_)));
}

torch::Tensor MultiHeadAttention::Stock(const torch::Tensor& q, const torch::Tensor& k,
                                        const torch::Tensor& v, const AttentionInputs& inputs) {
#if LOOM_TORCH_HAS_SDPA
  // LibTorch 2.x: fused kernels (Flash / memory-efficient) where the backend has them.
  const int64_t length = q.size(2);
  if (inputs.segments.defined()) {
    torch::Tensor allowed = (causal_ || window_ > 0)
                                ? AllowedMask(length, causal_, window_, q.device())
                                : torch::Tensor();
    return at::scaled_dot_product_attention(
        q, k, v, WithSegments(allowed, inputs.segments, q.size(0), length, 1, q.device()), 0.0,
        false);
  }
  if (window_ == 0) return at::scaled_dot_product_attention(q, k, v, {}, 0.0, causal_);
  return at::scaled_dot_product_attention(
      q, k, v, AllowedMask(length, causal_, window_, q.device()), 0.0, false);
#else
  return Reference(q, k, v, inputs);  // unreachable: the constructor rejects 'stock' here
#endif
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
