#include "plugins/attention/kernels/rope.h"

namespace loom::attention::kernels {

torch::Tensor CheckedPositions(const torch::Tensor& positions, int64_t batch, int64_t length,
                               const torch::Device& device) {
  TORCH_CHECK(positions.defined(), "attention: positions are required when RoPE is on");
  torch::Tensor p = positions.to(device, torch::kInt64);
  if (p.dim() == 1) p = p.unsqueeze(0);
  TORCH_CHECK(p.dim() == 2 && (p.size(0) == 1 || p.size(0) == batch) && p.size(1) == length,
              "attention: positions must be [N] or [B, N] with B = ", batch, ", N = ", length,
              ", got ", positions.sizes());
  return p;
}

torch::Tensor RopeAngles(const torch::Tensor& positions, int64_t d, double theta,
                         const torch::Device& device) {
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64).device(device);
  torch::Tensor inv_freq =
      torch::pow(theta, -torch::arange(0, d / 2, f64) * 2.0 / static_cast<double>(d));
  return positions.to(device, torch::kFloat64).unsqueeze(-1) * inv_freq;
}

torch::Tensor ApplyRope(const torch::Tensor& x, const torch::Tensor& positions, double theta) {
  TORCH_CHECK(x.dim() == 4, "ApplyRope: x must be [B, H, L, d], got ", x.sizes());
  const int64_t d = x.size(3);
  TORCH_CHECK(d % 2 == 0, "ApplyRope: head width must be even, got ", d);
  const int64_t half = d / 2;
  torch::Tensor pos = positions.dim() == 1 ? positions.unsqueeze(0) : positions;  // [B|1, L]
  TORCH_CHECK(pos.dim() == 2 && pos.size(1) == x.size(2),
              "ApplyRope: positions must be [L] or [B, L] with L = ", x.size(2), ", got ",
              positions.sizes());
  torch::Tensor angles = RopeAngles(pos, d, theta, x.device());       // [B|1, L, half]
  torch::Tensor cos = angles.cos().unsqueeze(1).to(x.scalar_type());  // [B|1, 1, L, half]
  torch::Tensor sin = angles.sin().unsqueeze(1).to(x.scalar_type());
  torch::Tensor x1 = x.narrow(3, 0, half);
  torch::Tensor x2 = x.narrow(3, half, half);
  return torch::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, 3);
}

torch::Tensor ExpandedPositions(const torch::Tensor& positions, int64_t p, RopePhase phase) {
  torch::Tensor pos = positions.dim() == 1 ? positions.unsqueeze(0) : positions;  // [B|1, N]
  const int64_t rows = pos.size(0), n = pos.size(1);
  auto opts = torch::TensorOptions().dtype(torch::kInt64).device(pos.device());
  torch::Tensor j = torch::arange(p, opts);
  torch::Tensor base = pos.to(torch::kInt64).unsqueeze(-1);  // [B|1, N, 1]
  torch::Tensor expanded =
      phase == RopePhase::kInterleaved ? base * p + j : base.expand({rows, n, p});
  return expanded.reshape({rows, n * p});
}

torch::Tensor RotatePseudoTokens(const torch::Tensor& x, const torch::Tensor& positions,
                                 const Options& o) {
  if (o.rope_theta <= 0) return x;
  return ApplyRope(x, ExpandedPositions(positions, o.p, o.rope_phase), o.rope_theta);
}

std::pair<torch::Tensor, torch::Tensor> RotatePseudoQueriesKeys(const torch::Tensor& qi,
                                                                const torch::Tensor& ki,
                                                                const torch::Tensor& positions,
                                                                const Options& o) {
  if (o.rope_theta <= 0) return {qi, ki};
  torch::Tensor pos = CheckedPositions(positions, qi.size(0), qi.size(2) / o.p, qi.device());
  return {RotatePseudoTokens(qi, pos, o), RotatePseudoTokens(ki, pos, o)};
}

std::pair<torch::Tensor, torch::Tensor> ExpandedRopeTables(const torch::Tensor& q,
                                                           const torch::Tensor& positions,
                                                           const Options& o,
                                                           torch::ScalarType type) {
  auto opts = torch::TensorOptions().dtype(type).device(q.device());
  if (o.rope_theta <= 0) return {torch::empty({0}, opts), torch::empty({0}, opts)};
  torch::NoGradGuard no_grad;
  const int64_t d = q.size(3);
  TORCH_CHECK(d % 2 == 0, "iha: RoPE needs an even head width, got ", d);
  torch::Tensor pos = CheckedPositions(positions, q.size(0), q.size(1), q.device());
  // Angles in float64 whatever the table type: positions up to N·P lose no phase.
  torch::Tensor angles = RopeAngles(ExpandedPositions(pos, o.p, o.rope_phase), d, o.rope_theta,
                                    q.device());  // [B|1, N·P, d/2]
  return {angles.cos().to(type).contiguous(), angles.sin().to(type).contiguous()};
}

}  // namespace loom::attention::kernels
