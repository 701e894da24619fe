#include "plugins/attention/kernels/kernel_autograd.h"

namespace loom::attention::kernels {

void CheckKernelInputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& alpha_q, const torch::Tensor& alpha_k,
                       const torch::Tensor& alpha_v, const Options& o) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes(), "iha: q and k must be [B, N, H, d] alike");
  TORCH_CHECK(
      v.dim() == 4 && v.size(0) == q.size(0) && v.size(1) == q.size(1) && v.size(2) == q.size(2),
      "iha: v must be [B, N, H, dv] matching q");
  const int64_t h = q.size(2);
  for (const torch::Tensor* a : {&alpha_q, &alpha_k, &alpha_v}) {
    TORCH_CHECK(a->dim() == 3 && a->size(0) == h && a->size(1) == h && a->size(2) == o.p,
                "iha: alpha must be [H, H, P] = [", h, ", ", h, ", ", o.p, "], got ", a->sizes());
  }
  TORCH_CHECK(o.p >= 1 && o.window >= 0, "iha: bad p or window");
}

torch::Tensor KernelSegments(const Options& o, int64_t batch, int64_t length,
                             const torch::Device& device) {
  auto i64 = torch::TensorOptions().dtype(torch::kInt64).device(device);
  if (!o.segments.defined()) return torch::empty({0}, i64);
  torch::Tensor segments = o.segments.to(device, torch::kInt64);
  if (segments.dim() == 1) segments = segments.unsqueeze(0);
  TORCH_CHECK(segments.dim() == 2 && (segments.size(0) == 1 || segments.size(0) == batch) &&
                  segments.size(1) == length,
              "iha: segments must be [B, N] = [", batch, ", ", length, "], got ",
              o.segments.sizes());
  return segments.contiguous();
}

Options KernelOptions(int64_t p, int64_t mask, int64_t window, int64_t score, double scale) {
  Options o;
  o.p = p;
  o.mask = static_cast<Mask>(mask);
  o.window = window;
  o.score = static_cast<Score>(score);
  o.scale = scale;
  return o;
}

void SaveKernelOptions(torch::autograd::AutogradContext* ctx, const Options& o) {
  ctx->saved_data["p"] = o.p;
  ctx->saved_data["mask"] = static_cast<int64_t>(o.mask);
  ctx->saved_data["window"] = o.window;
  ctx->saved_data["score"] = static_cast<int64_t>(o.score);
  ctx->saved_data["scale"] = o.scale;
}

Options SavedKernelOptions(torch::autograd::AutogradContext* ctx) {
  return KernelOptions(ctx->saved_data["p"].toInt(), ctx->saved_data["mask"].toInt(),
                       ctx->saved_data["window"].toInt(), ctx->saved_data["score"].toInt(),
                       ctx->saved_data["scale"].toDouble());
}

torch::autograd::variable_list LeadingGrads(torch::autograd::variable_list grads, size_t inputs) {
  grads.resize(inputs);  // undefined tensors: no gradient for the rest
  return grads;
}

torch::Tensor PseudoRowDelta(const torch::Tensor& grad_out, const torch::Tensor& out,
                             torch::ScalarType type) {
  const int64_t b = out.size(0), n = out.size(1), h = out.size(2), p = out.size(3);
  return (grad_out.to(type) * out.to(type))
      .sum(-1)                // [B, N, H, P]
      .permute({0, 2, 1, 3})  // [B, H, N, P]
      .reshape({b, h, n * p})
      .contiguous();
}

}  // namespace loom::attention::kernels
