// The Theorem 3 experiment's model (filter_layer.h) is the plugin's layer, can represent the
// theorem's exact solution, and respects the Eckart–Young floor; its plan file parses.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>

#include "experiments/polyfilter/filter_layer.h"
#include "experiments/polyfilter/filter_plan.h"
#include "experiments/polyfilter/filter_task.h"

namespace loom::polyfilter {
namespace {

constexpr auto f64 = torch::kFloat64;

at::Generator Gen(uint64_t seed) { return at::detail::createCPUGenerator(seed); }

LayerShape Shape(int64_t n, int64_t k, int64_t heads, int64_t pseudo, bool mixing) {
  LayerShape s;
  s.nodes = n;
  s.features = 2;
  s.powers = k;
  s.heads = heads;
  s.pseudo = pseudo;
  s.mixing = mixing;
  s.key_width = n;
  s.value_width = k * 2;
  s.scale = 1.0 / std::sqrt(static_cast<double>(n));
  return s;
}

double MaxDiff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

// (a) The training layer (positions-only scores folded into one linear map) computes what the
// plugin's IHA core computes on X̂ = [X, I] with linear scores and no mask, reference and fused.
TEST(PolyfilterLayer, EqualsPluginCoreWithLinearScores) {
  struct Case {
    int64_t heads, pseudo;
    bool mixing;
  };
  for (Case c : {Case{1, 1, false}, Case{3, 1, false}, Case{1, 1, true}, Case{2, 2, true},
                 Case{3, 3, true}, Case{2, 3, true}}) {
    LayerShape s = Shape(6, 4, c.heads, c.pseudo, c.mixing);
    s.key_width = 5;  // dk != N and dv != k·dx: no accidental transposes
    s.value_width = 3;
    FilterLayer layer(s, Init::kRandom, 0.0, Gen(7 + c.heads * 10 + c.pseudo));
    torch::Tensor x = torch::randn({3, 6, 2}, Gen(1), f64);
    torch::NoGradGuard no_grad;
    torch::Tensor mine = layer.forward(x);
    EXPECT_GT(mine.abs().max().item<double>(), 0.1);
    EXPECT_LT(MaxDiff(mine, layer.PluginForward(x, false)), 1e-10) << c.heads << " " << c.pseudo;
    EXPECT_LT(MaxDiff(mine, layer.PluginForward(x, true)), 1e-10) << c.heads << " " << c.pseudo;
  }
}

// (b) Theorem 3's weights loaded into the experiment's IHA layer (H = P = ⌈√k⌉, the widths the
// plan uses) fit the filter bank exactly, on both graph families.
TEST(PolyfilterTheorem3, ExperimentLayerRepresentsTheExactSolution) {
  for (GraphKind kind : {GraphKind::kOrthogonal, GraphKind::kErdosRenyi}) {
    torch::Tensor a = GraphMatrix(kind, 16, 0.3, Gen(3), f64);
    for (int64_t k : {4, 9, 16}) {
      const int64_t h = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(k))));
      FilterLayer layer(Shape(16, k, h, h, true), Init::kNearMha, 0.02, Gen(5));
      LoadTheorem3(layer, a);
      torch::Tensor x = torch::randn({64, 16, 2}, Gen(9), f64);
      EXPECT_LT(PopulationResidual(layer, a), 1e-10) << "k " << k;
      EXPECT_LT(HeldOutResidual(layer, a, x), 1e-10) << "k " << k;
      torch::NoGradGuard no_grad;
      EXPECT_LT(
          MaxDiff(layer.forward(x.narrow(0, 0, 4)), layer.PluginForward(x.narrow(0, 0, 4), false)),
          1e-9)
          << "k " << k;
      // One head fewer per side leaves H² − 2H + 1 < k operators: the floor is positive.
      EXPECT_GT(EckartYoungResidual(a, k, (h - 1) * (h - 1)), 0.0) << "k " << k;
    }
  }
}

// The target map and the targets agree, and the floor runs from 1 (rank 0) to 0 (rank k).
TEST(PolyfilterTask, TargetMapAndFloor) {
  torch::Tensor a = GraphMatrix(GraphKind::kOrthogonal, 8, 0, Gen(2), f64);
  EXPECT_LT(MaxDiff(torch::matmul(a, a.t()), torch::eye(8, f64)), 1e-12);
  torch::Tensor x = torch::randn({5, 8, 2}, Gen(4), f64);
  torch::Tensor f = TargetMap(a, 4, 2).reshape({8 * 8, 8 * 2});
  torch::Tensor via_map = torch::matmul(x.reshape({5, 16}), f.t()).view({5, 8, 8});
  EXPECT_LT(MaxDiff(via_map, FilterTargets(a, x, 4)), 1e-12);
  EXPECT_NEAR(EckartYoungResidual(a, 4, 0), 1.0, 1e-12);
  EXPECT_EQ(EckartYoungResidual(a, 4, 4), 0.0);
  torch::Tensor g = GraphMatrix(GraphKind::kErdosRenyi, 8, 0.4, Gen(2), f64);
  EXPECT_LT(MaxDiff(g, g.t()), 1e-15);
  EXPECT_LE(torch::linalg_eigvalsh(g).abs().max().item<double>(), 1.0 + 1e-12);
}

// (c) Trained MHA with h < k heads cannot beat the Eckart–Young floor, and training does reach
// near it (a short run).
TEST(PolyfilterTraining, MhaStopsAtTheEckartYoungFloor) {
  torch::Tensor a = GraphMatrix(GraphKind::kOrthogonal, 8, 0, Gen(11), f64);
  FilterLayer layer(Shape(8, 4, 2, 1, false), Init::kNearMha, 0.02, Gen(12));
  const double before = PopulationResidual(layer, a);
  TrainConfig c;
  c.steps = 600;
  c.batch = 32;
  c.lr = 2e-2;
  TrainResult r = Train(layer, a, c, Gen(13));
  const double floor = EckartYoungResidual(a, 4, 2), after = PopulationResidual(layer, a);
  EXPECT_EQ(r.steps, 600);
  EXPECT_GT(floor, 0.3);
  EXPECT_GE(after, floor * (1 - 1e-9));
  EXPECT_LT(after, std::min(before, 1.2 * floor)) << "before " << before << " floor " << floor;
}

constexpr char kPlan[] = R"(
nodes: 8
features: 2
families:
  - {name: er, kind: erdos_renyi, edge_prob: 0.3}
  - {name: orth, kind: orthogonal}
grid:
  - {k: 4, mha: [1, 2], iha: [1, 2]}
seeds: [1, 2]
restarts: 2
train: {steps: 10, batch: 4, lr: 0.01, min_lr_ratio: 0.1, window: 5, stop_residual: 1.0e-6}
eval: {samples: 8}
)";

absl::Status ParseEdited(const std::string& from, const std::string& to) {
  std::string text = kPlan;
  text.replace(text.find(from), from.size(), to);
  return ParsePlan(text).status();
}

TEST(PolyfilterPlan, ErrorsNameTheField) {
  absl::StatusOr<Plan> plan = ParsePlan(kPlan);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->families[0].edge_prob, 0.3);
  EXPECT_EQ(CellShape(*plan, 4, true, 2).pseudo, 2);
  EXPECT_EQ(CellShape(*plan, 4, false, 2).value_width, 8);
  struct Bad {
    const char *from, *to, *field;
  };
  for (Bad b :
       {Bad{"steps: 10", "steps: -1", "train.steps"}, Bad{"steps: 10", "stepz: 10", "train.stepz"},
        Bad{"k: 4", "k: 9", "grid[0].k"}, Bad{"mha: [1, 2]", "mha: [1, x]", "grid[0].mha[1]"},
        Bad{"kind: orthogonal", "kind: ring", "families[1].kind"},
        Bad{"seeds: [1, 2]", "seeds: []", "seeds"}, Bad{"eval: {samples: 8}", "", "eval"}}) {
    absl::Status s = ParseEdited(b.from, b.to);
    EXPECT_FALSE(s.ok()) << b.to;
    EXPECT_NE(std::string(s.message()).find(std::string("plan: ") + b.field), std::string::npos)
        << s.message();
  }
}

TEST(PolyfilterPlan, CommittedPlanParses) {
  const char* src = std::getenv("LOOM_SOURCE_DIR");
  ASSERT_NE(src, nullptr);
  absl::StatusOr<Plan> plan = LoadPlan(std::string(src) + "/experiments/polyfilter/theorem3.yaml");
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_GE(plan->seeds.size(), 5u);
}

}  // namespace
}  // namespace loom::polyfilter
