// The polynomial-filter task of the Theorem 3 experiment: graph matrices, targets, the
// Eckart–Young floor on what a rank-limited layer can reach, and training with Adam on fresh
// Gaussian node features every step.
#ifndef LOOM_EXPERIMENTS_POLYFILTER_FILTER_TASK_H_
#define LOOM_EXPERIMENTS_POLYFILTER_FILTER_TASK_H_

#include <torch/torch.h>

#include <cstdint>

#include "experiments/polyfilter/filter_layer.h"

namespace loom::polyfilter {

enum class GraphKind {
  // Erdős–Rényi G(N, p) with self-loops, symmetrically normalised D^{-1/2}(A + I)D^{-1/2} (the
  // GCN / SGC propagation matrix): spectrum in (−1, 1], so powers stay bounded.
  kErdosRenyi,
  // A Haar-random orthogonal matrix: eigenvalues spread on the unit circle, so the powers stay
  // far from linearly dependent (the control where MHA provably needs k heads).
  kOrthogonal,
};

torch::Tensor GraphMatrix(GraphKind kind, int64_t nodes, double edge_prob, at::Generator gen,
                          torch::ScalarType dtype);

// [B, N, dx] -> [B, N, k·dx]: blocks X, AX, …, A^{k−1}X.
torch::Tensor FilterTargets(const torch::Tensor& a, const torch::Tensor& x, int64_t k);

// The target as a linear map of X, laid out as FilterLayer::LinearMap: [N, k·dx, N, dx].
torch::Tensor TargetMap(const torch::Tensor& a, int64_t k, int64_t features);

// min over rank-r maps of ‖F − F*‖_F / ‖F*‖_F: σ_{r+1..k} of M = [vec I, vec A, …, vec A^{k−1}]
// over ‖M‖_F (0 when r >= k). A layer whose map has rank <= r (MHA with r heads; IHA with H
// heads has rank <= H²) cannot have a population relative residual below it.
double EckartYoungResidual(const torch::Tensor& a, int64_t k, int64_t rank);

// ‖F − F*‖_F / ‖F*‖_F: the relative residual in expectation over X ~ N(0, I), exactly.
double PopulationResidual(const FilterLayer& layer, const torch::Tensor& a);

// sqrt(Σ‖Ŷ − Y‖² / Σ‖Y‖²) over the node-feature sets x [S, N, dx].
double HeldOutResidual(const FilterLayer& layer, const torch::Tensor& a, const torch::Tensor& x);

struct TrainConfig {
  int64_t steps = 3000;  // at most
  int64_t batch = 64;    // fresh X per step
  double lr = 1e-2;      // Adam, cosine from lr to lr·min_lr_ratio over `steps`
  double min_lr_ratio = 1e-2;
  int64_t window = 100;         // steps per train-loss window
  double stop_residual = 1e-6;  // stop after a window whose train residual is below this
};

struct TrainResult {
  int64_t steps = 0;
  double train_loss = 0;      // mean MSE over the last window
  double train_residual = 0;  // sqrt(Σ‖Ŷ − Y‖² / Σ‖Y‖²) over the last window's batches
};

TrainResult Train(FilterLayer& layer, const torch::Tensor& a, const TrainConfig& config,
                  at::Generator data);

}  // namespace loom::polyfilter

#endif  // LOOM_EXPERIMENTS_POLYFILTER_FILTER_TASK_H_
