#include "plugins/attention/iha/iha_core.h"

#include <cmath>
#include <tuple>

#include "plugins/attention/common/attention_common.h"
#include "plugins/attention/iha/collapse_cpu.h"
#include "plugins/attention/kernels/rope.h"

namespace loom::attention::iha {
namespace {

void CheckShapes(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& alpha_q,
                 const torch::Tensor& alpha_k, const Options& o) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4, "iha: q and k must be [B, N, H, d]");
  TORCH_CHECK(q.sizes() == k.sizes(), "iha: q ", q.sizes(), " and k ", k.sizes(), " differ");
  const int64_t h = q.size(2);
  for (const torch::Tensor* a : {&alpha_q, &alpha_k}) {
    TORCH_CHECK(a->dim() == 3 && a->size(0) == h && a->size(1) == h && a->size(2) == o.p,
                "iha: alpha must be [H, H, P] = [", h, ", ", h, ", ", o.p, "], got ", a->sizes());
  }
  TORCH_CHECK(o.p >= 1, "iha: p must be >= 1");
  TORCH_CHECK(o.window >= 0, "iha: window must be >= 0");
}

torch::Tensor Scores(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& alpha_q,
                     const torch::Tensor& alpha_k, const torch::Tensor& positions,
                     const Options& o) {
  CheckShapes(q, k, alpha_q, alpha_k, o);
  torch::Tensor qi = MixAndInterleave(q, alpha_q);  // [B, H, NP, dk]
  torch::Tensor ki = MixAndInterleave(k, alpha_k);
  std::tie(qi, ki) = kernels::RotatePseudoQueriesKeys(qi, ki, positions, o);
  const double scale = o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  return torch::matmul(qi, ki.transpose(-2, -1)) * scale;  // [B, H, NP, NP]
}

}  // namespace

torch::Tensor MixAndInterleave(const torch::Tensor& x, const torch::Tensor& alpha) {
  const int64_t b = x.size(0), n = x.size(1), h = x.size(2), d = x.size(3), p = alpha.size(2);
  // [B, N, H(m), d] x [H(m), H(h), P] -> [B, H(h), N, P, d] -> [B, H, N·P, d] (token-major).
  torch::Tensor mixed = torch::einsum("bnmd,mhj->bhnjd", {x, alpha.to(x.dtype())});
  return mixed.reshape({b, h, n * p, d});
}

torch::Tensor AllowedMask(int64_t n, int64_t p, Mask mask, int64_t window,
                          const torch::Device& device) {
  auto idx = torch::arange(n * p, torch::TensorOptions().dtype(torch::kInt64).device(device));
  return AllowedBetween(idx, idx, p, mask, window);
}

torch::Tensor AllowedBetween(const torch::Tensor& queries, const torch::Tensor& keys, int64_t p,
                             Mask mask, int64_t window) {
  torch::Tensor s = queries.unsqueeze(1), t = keys.unsqueeze(0);
  torch::Tensor allowed =
      torch::ones({queries.size(0), keys.size(0)},
                  torch::TensorOptions().dtype(torch::kBool).device(s.device()));
  if (mask == Mask::kInterleaved) allowed = allowed & (t <= s);
  if (mask == Mask::kBlock)
    allowed = allowed & (torch::div(t, p, "floor") <= torch::div(s, p, "floor"));
  if (window > 0) allowed = allowed & ((s - t).abs() < window * p);
  return allowed;
}

double AverageAttendedKeys(int64_t n, int64_t p, Mask mask, int64_t window) {
  const int64_t len = n * p;
  if (len <= 0) return 0;
  const int64_t reach = window > 0 ? window * p - 1 : len;  // max |s - s'|
  double total = 0;
  for (int64_t s = 0; s < len; ++s) {
    const int64_t lo = std::max<int64_t>(0, s - reach);
    int64_t hi = std::min<int64_t>(len - 1, s + reach);
    if (mask == Mask::kInterleaved) hi = std::min(hi, s);
    if (mask == Mask::kBlock) hi = std::min(hi, (s / p + 1) * p - 1);
    total += static_cast<double>(hi - lo + 1);
  }
  return total / static_cast<double>(len);
}

torch::Tensor AttentionWeights(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& alpha_q, const torch::Tensor& alpha_k,
                               const torch::Tensor& positions, const Options& o) {
  torch::Tensor scores = Scores(q, k, alpha_q, alpha_k, positions, o);
  torch::Tensor allowed = AllowedMask(q.size(1), o.p, o.mask, o.window, q.device());
  allowed = WithSegments(allowed, o.segments, q.size(0), q.size(1), o.p, q.device());
  if (o.score == Score::kLinear) return scores * allowed.to(scores.dtype());
  return torch::softmax(
      scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity()), -1);
}

torch::Tensor PseudoOutputs(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& alpha_q, const torch::Tensor& alpha_k,
                            const torch::Tensor& alpha_v, const torch::Tensor& positions,
                            const Options& o) {
  TORCH_CHECK(
      v.dim() == 4 && v.size(0) == q.size(0) && v.size(1) == q.size(1) && v.size(2) == q.size(2),
      "iha: v must be [B, N, H, dv] matching q's B, N, H; got ", v.sizes());
  TORCH_CHECK(alpha_v.sizes() == alpha_q.sizes(), "iha: alpha_v must be [H, H, P], got ",
              alpha_v.sizes());
  const int64_t b = q.size(0), n = q.size(1), h = q.size(2), dv = v.size(3);
  torch::Tensor weights = AttentionWeights(q, k, alpha_q, alpha_k, positions, o);
  torch::Tensor vi = MixAndInterleave(v, alpha_v);               // [B, H, NP, dv]
  torch::Tensor out = torch::matmul(weights, vi);                // [B, H, NP, dv]
  return out.view({b, h, n, o.p, dv}).permute({0, 2, 1, 3, 4});  // [B, N, H, P, dv]
}

torch::Tensor Collapse(const torch::Tensor& pseudo, const torch::Tensor& collapse) {
  const int64_t h = pseudo.size(2), p = pseudo.size(3);
  TORCH_CHECK(collapse.dim() == 2 && collapse.size(0) == h && collapse.size(1) == h * p,
              "iha: collapse must be [H, H·P] = [", h, ", ", h * p, "], got ", collapse.sizes());
  torch::Tensor r = collapse.to(pseudo.dtype());
  if (CpuCollapseApplies(pseudo, r)) return CpuCollapse(pseudo, r);
  return EinsumCollapse(pseudo, r);
}

torch::Tensor EinsumCollapse(const torch::Tensor& pseudo, const torch::Tensor& collapse) {
  const int64_t h = pseudo.size(2), p = pseudo.size(3);
  // R[h, h'·P + j] viewed as [h, h', j].
  return torch::einsum("bngjd,hgj->bnhd", {pseudo, collapse.view({h, h, p}).to(pseudo.dtype())});
}

torch::Tensor Forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                      const torch::Tensor& alpha_q, const torch::Tensor& alpha_k,
                      const torch::Tensor& alpha_v, const torch::Tensor& collapse,
                      const torch::Tensor& positions, const Options& o) {
  return Collapse(PseudoOutputs(q, k, v, alpha_q, alpha_k, alpha_v, positions, o), collapse);
}

torch::Tensor FusedForward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& alpha_q, const torch::Tensor& alpha_k,
                           const torch::Tensor& alpha_v, const torch::Tensor& collapse,
                           const torch::Tensor& positions, const Options& options,
                           const FusedOptions& fused) {
  return Collapse(FusedPseudoOutputs(q, k, v, alpha_q, alpha_k, alpha_v, positions, options, fused),
                  collapse);
}

}  // namespace loom::attention::iha
