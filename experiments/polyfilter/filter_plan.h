// The plan file of loom-exp-polyfilter (experiments/polyfilter/theorem3.yaml): graph families,
// the (k, heads) grid per model, seeds, restarts, model widths, training and evaluation. Every
// field is required except `report` (read by report_polyfilter.py) and the model fields with
// defaults; unknown fields are errors, so a typo cannot silently fall back to a default.
#ifndef LOOM_EXPERIMENTS_POLYFILTER_FILTER_PLAN_H_
#define LOOM_EXPERIMENTS_POLYFILTER_FILTER_PLAN_H_

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "experiments/polyfilter/filter_layer.h"
#include "experiments/polyfilter/filter_task.h"

namespace loom::polyfilter {

struct Family {
  std::string name;
  GraphKind kind = GraphKind::kOrthogonal;
  double edge_prob = 0;  // erdos_renyi only
};

struct GridRow {
  int64_t k = 0;
  std::vector<int64_t> mha, iha;  // head counts; IHA runs with P = H
};

struct ModelConfig {
  int64_t key_width = 0;    // 0: N
  int64_t value_width = 0;  // 0: k·dx
  double scale = 0;         // 0: 1/√dk
  Init iha_init = Init::kNearMha;
  double init_noise = 0.02;
};

struct Plan {
  int64_t nodes = 0, features = 0;
  torch::ScalarType dtype = torch::kFloat64;
  std::vector<Family> families;
  std::vector<GridRow> grid;
  std::vector<int64_t> seeds;
  int64_t restarts = 0;
  ModelConfig model;
  TrainConfig train;
  int64_t eval_samples = 0;
};

// Parses the YAML text; an error names the field ("plan: train.steps: ...").
absl::StatusOr<Plan> ParsePlan(const std::string& yaml);
absl::StatusOr<Plan> LoadPlan(const std::string& path);

// The layer shape of one cell: MHA (P = 1, no mixing) or IHA (P = H, mixing).
LayerShape CellShape(const Plan& plan, int64_t k, bool iha, int64_t heads);

}  // namespace loom::polyfilter

#endif  // LOOM_EXPERIMENTS_POLYFILTER_FILTER_PLAN_H_
