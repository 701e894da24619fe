#include "experiments/polyfilter/filter_task.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace loom::polyfilter {

torch::Tensor GraphMatrix(GraphKind kind, int64_t nodes, double edge_prob, at::Generator gen,
                          torch::ScalarType dtype) {
  auto opts = torch::TensorOptions().dtype(dtype);
  if (kind == GraphKind::kOrthogonal) {
    auto [q, r] = torch::linalg_qr(torch::randn({nodes, nodes}, gen, opts));
    return q * torch::sign(torch::diagonal(r)).unsqueeze(0);  // signs fixed: Haar measure
  }
  torch::Tensor upper = (torch::rand({nodes, nodes}, gen, opts) < edge_prob).to(dtype).triu(1);
  torch::Tensor adj = upper + upper.t() + torch::eye(nodes, opts);
  torch::Tensor d = adj.sum(1).rsqrt();
  return d.unsqueeze(1) * adj * d.unsqueeze(0);
}

torch::Tensor FilterTargets(const torch::Tensor& a, const torch::Tensor& x, int64_t k) {
  std::vector<torch::Tensor> blocks = {x};
  for (int64_t i = 1; i < k; ++i) blocks.push_back(torch::matmul(a, blocks.back()));
  return torch::cat(blocks, 2);
}

namespace {

torch::Tensor Powers(const torch::Tensor& a, int64_t k) {  // [k, N, N]
  std::vector<torch::Tensor> powers = {torch::eye(a.size(0), a.options())};
  for (int64_t i = 1; i < k; ++i) powers.push_back(torch::matmul(a, powers.back()));
  return torch::stack(powers);
}

}  // namespace

torch::Tensor TargetMap(const torch::Tensor& a, int64_t k, int64_t features) {
  const int64_t n = a.size(0);
  torch::Tensor eye = torch::eye(features, a.options());
  // F*[n, i·dx + c, n', a] = A^i[n, n'] · 1(c = a).
  return torch::einsum("imp,ca->micpa", {Powers(a, k), eye})
      .reshape({n, k * features, n, features});
}

double EckartYoungResidual(const torch::Tensor& a, int64_t k, int64_t rank) {
  torch::Tensor m = Powers(a, k).reshape({k, -1}).t();  // [N², k]
  torch::Tensor s = torch::linalg_svdvals(m);           // descending
  if (rank >= s.size(0)) return 0.0;
  return (s.narrow(0, rank, s.size(0) - rank).square().sum().sqrt() / m.norm()).item<double>();
}

double PopulationResidual(const FilterLayer& layer, const torch::Tensor& a) {
  torch::NoGradGuard no_grad;
  const LayerShape& s = layer.shape();
  torch::Tensor want = TargetMap(a, s.powers, s.features);
  return ((layer.LinearMap() - want).norm() / want.norm()).item<double>();
}

double HeldOutResidual(const FilterLayer& layer, const torch::Tensor& a, const torch::Tensor& x) {
  torch::NoGradGuard no_grad;
  torch::Tensor want = FilterTargets(a, x, layer.shape().powers);
  return ((layer.forward(x) - want).norm() / want.norm()).item<double>();
}

namespace {

// One step's summed squared error and target norm: on a fresh batch of X ~ N(0, I), or (batch 0)
// their expectations over X, ‖F − F*‖² and ‖F*‖² (the layer is linear in X).
std::pair<torch::Tensor, double> StepError(const FilterLayer& layer, const torch::Tensor& a,
                                           const torch::Tensor& target_map, double map_norm,
                                           int64_t batch, at::Generator& data) {
  const LayerShape& s = layer.shape();
  if (batch == 0) return {(layer.LinearMap() - target_map).square().sum(), map_norm};
  torch::Tensor x =
      torch::randn({batch, s.nodes, s.features}, data, torch::TensorOptions().dtype(s.dtype));
  torch::Tensor y = FilterTargets(a, x, s.powers);
  return {(layer.forward(x) - y).square().sum(), y.square().sum().item<double>()};
}

}  // namespace

TrainResult Train(FilterLayer& layer, const torch::Tensor& a, const TrainConfig& c,
                  at::Generator data) {
  const LayerShape& s = layer.shape();
  const torch::Tensor target_map = TargetMap(a, s.powers, s.features);
  const double map_norm = target_map.square().sum().item<double>();
  // Loss = MSE per output element (in expectation over X for batch 0).
  const double elements =
      static_cast<double>(std::max<int64_t>(c.batch, 1) * s.nodes * s.powers * s.features);
  torch::optim::Adam adam(layer.parameters(), torch::optim::AdamOptions(c.lr));
  TrainResult result;
  double window_loss = 0, window_err = 0, window_norm = 0;
  for (int64_t step = 0; step < c.steps; ++step) {
    const double progress = static_cast<double>(step) / static_cast<double>(c.steps);
    const double lr =
        c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + std::cos(M_PI * progress)));
    for (auto& group : adam.param_groups()) {
      static_cast<torch::optim::AdamOptions&>(group.options()).lr(lr);
    }
    auto [err, norm] = StepError(layer, a, target_map, map_norm, c.batch, data);
    torch::Tensor loss = err / elements;
    adam.zero_grad();
    loss.backward();
    adam.step();
    window_loss += loss.item<double>();
    window_err += err.item<double>();
    window_norm += norm;
    result.steps = step + 1;
    if (result.steps % c.window != 0 && result.steps != c.steps) continue;
    const int64_t in_window = (result.steps - 1) % c.window + 1;
    result.train_loss = window_loss / static_cast<double>(in_window);
    result.train_residual = std::sqrt(window_err / window_norm);
    window_loss = window_err = window_norm = 0;
    if (result.train_residual < c.stop_residual) break;
  }
  return result;
}

}  // namespace loom::polyfilter
